"""The DP class-means head (``training/recipes/class_means.py``): its one release is the class
sums of clipped ``[features, a]`` with noise sigma * C, every record sampled, from a fresh
secret; the head is LDA's rule on those means; the study's stage says q = 1, T = 1."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal
from sklearn.covariance import LedoitWolf
from support.helpers import dp_stage
from torch import nn

from training.dp.clipping import PerExampleClipper
from training.recipes.class_means import ClassSumLoss, fit_class_means, lda_rule
from training.recipes.probe import head_engine
from training.study.config import JOB, StudyConfig
from training.study.heads import dp_head, head_config
from vip_hub.errors import ConfigError
from vip_hub.privacy.accounting import calibrate, composed_epsilon
from vip_hub.privacy.ledger import NOT_RELEASED, Dataset

DATA = "test/class-means"
C = 0.1


def _features(n: int = 600, d: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three Gaussian classes in ``d`` dimensions, a few points far out (clipped harder)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    centres = 3.0 * torch.randn(3, d, generator=g)
    x = centres[y] + torch.randn(n, d, generator=g)
    x[:5] *= 40.0
    return x, y


def _clipped_sums(z: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    """Each class's sum of ``[z, a]`` clipped to C, computed directly (K, D + 1)."""
    v = torch.cat([z, torch.full((len(z), 1), a)], 1).double()
    v = v * (C / v.norm(dim=1, keepdim=True)).clamp(max=1.0)
    return torch.stack([v[y == k].sum(0) for k in range(3)])


def _engine_sums(z: torch.Tensor, y: torch.Tensor, a: float, epsilon: float) -> torch.Tensor:
    """The mechanism's release as the head sees it: n times the weights after one step."""
    sums = nn.Linear(z.shape[1] + 1, 3, bias=False)
    nn.init.zeros_(sums.weight)
    cfg = head_config(JOB, len(z), epsilon, dataset=DATA)
    engine, dp = head_engine(
        ClassSumLoss(sums, a), torch.optim.SGD(sums.parameters(), lr=1.0), len(z), 1.0, 1, cfg
    )
    batch = torch.as_tensor(engine.plan(0))
    assert len(batch) == len(z)  # q = 1: every record is in the one sample
    engine.step(0, [(z[batch], y[batch])])
    assert dp["sample_rate"] == 1.0 and dp["steps"] == 1
    return sums.weight.detach().double() * len(z)


def test_a_records_gradient_is_minus_its_vector_in_its_class_row() -> None:
    """``ClassSumLoss``: a record's gradient is ``-[z, a]`` in its class's row of ``W`` and zero
    elsewhere, whatever ``W`` is, so a step from zero at learning rate 1 adds each (clipped)
    record's ``[z, a]`` to its class's sum."""
    linear = nn.Linear(4, 3, bias=False)
    nn.init.normal_(linear.weight)
    ClassSumLoss(linear, 0.25)(torch.tensor([[0.5, -2.0, 1.0]]), torch.tensor([2])).sum().backward()
    expected = torch.zeros(3, 4)
    expected[2] = -torch.tensor([0.5, -2.0, 1.0, 0.25])
    assert linear.weight.grad is not None and torch.equal(linear.weight.grad, expected)


def test_the_noise_on_the_class_sums_is_sigma_times_the_clip() -> None:
    """The release minus the exact clipped sums is Gaussian with std sigma * C on every
    coordinate (3 x 2,001 draws: the std within 4 %), and two runs draw different noise."""
    z, y = torch.randn(600, 2000), torch.arange(600) % 3
    a = 30.0
    epsilon = 2.0
    sigma = calibrate(epsilon, JOB.delta, 1.0, 1)
    first = _engine_sums(z, y, a, epsilon) - _clipped_sums(z, y, a)
    second = _engine_sums(z, y, a, epsilon) - _clipped_sums(z, y, a)
    for noise in (first, second):
        assert noise.std().item() == pytest.approx(sigma * C, rel=0.04)
        assert abs(noise.mean().item()) < 4 * sigma * C / math.sqrt(noise.numel())
    assert not torch.allclose(first, second)  # a fresh secret each run


def test_one_record_moves_the_clipped_sums_by_at_most_the_clip() -> None:
    """The sensitivity C the stage claims: the clipper's sum over a set and over the set less one
    record (the farthest one, clipped) differ by at most C; the sum is every record's clipped
    ``[z, a]`` in its class's row (the clipped gradient is minus it)."""
    z, y = _features()
    a = 5.0

    def clipped_sum(rows: slice) -> torch.Tensor:
        sums = nn.Linear(z.shape[1] + 1, 3, bias=False)
        nn.init.zeros_(sums.weight)
        clipper = PerExampleClipper(ClassSumLoss(sums, a), C)
        clipper.accumulate(z[rows], y[rows])
        return -clipper.take_sum().view(3, -1)  # the loss is minus the score: its gradient too

    whole, less = clipped_sum(slice(0, None)), clipped_sum(slice(1, None))
    assert torch.allclose(whole, _clipped_sums(z, y, a), rtol=1e-5, atol=1e-7)
    moved = (whole - less).norm().item()
    assert C * (1 - 1e-5) < moved <= C  # clipped to C (the clipper's factor errs below it)
    # record 0 is class 0: one row moves; the others by no more than a rounding (the sum's
    # chunks of whole examples are grouped otherwise without it: 8.9e-16 was seen)
    assert (whole - less)[1:].abs().max().item() <= 1e-12 * C


def test_the_head_is_lda_on_the_released_means() -> None:
    """With noise negligible (epsilon 1e4) the head is LDA's rule on the clip-weighted class
    means and the public covariance, applied to the features as they come; it separates the
    classes."""
    x, y = _features()
    public = x[100:400]  # not the five far points: they would swell the public covariance
    cfg = head_config(JOB, len(x), 1e4, dataset=DATA)
    head, dp = fit_class_means(x, y, 3, cfg, public)
    z, pz = head.norm(x), head.norm(public)
    a = float(pz.norm(dim=1).median())
    exact = _clipped_sums(z, y, a)
    weights, bias = lda_rule(exact[:, :-1] * a, exact[:, -1], pz)
    assert torch.allclose(head.linear.weight.double(), weights, rtol=1e-2, atol=1e-2)
    assert torch.allclose(head.linear.bias.double(), bias, rtol=1e-2, atol=1e-2)
    assert (head(x).argmax(1) == y).float().mean() > 0.95
    # LDA's definition, computed apart: the class of highest prior times Gaussian likelihood,
    # every class with the public covariance
    covariance = LedoitWolf(assume_centered=True).fit(pz.double().numpy()).covariance_
    means, prior = exact[:, :-1] * a / exact[:, -1:], exact[:, -1] / exact[:, -1].sum()
    likelihood = np.stack(
        [
            multivariate_normal(means[k].numpy(), covariance).logpdf(z.double().numpy())
            + math.log(prior[k])
            for k in range(3)
        ],
        1,
    )
    agree = (head(x).argmax(1).numpy() == likelihood.argmax(1)).mean()
    assert agree > 0.99, agree
    assert list(dp["noised"].values()) == [3 * (x.shape[1] + 1)]


def test_the_study_releases_it_as_one_gaussian_step_within_the_split() -> None:
    """``dp_head`` of kind class-means: a stage named for it at q = 1, T = 1 whose composition
    with the encoder's stage, one per head draw, is the study's epsilon, on
    ``class_means_components`` components; under ``chosen`` the caller must say which kind was
    chosen."""
    study = StudyConfig(**{**JOB.model_dump(), "class_means_components": 4})
    x, y = _features()
    prior = dp_stage(len(x), batch=15, sigma=1.3, steps=70)
    encoder = [prior.mechanism_tuple]
    data = Dataset(name=DATA, size=len(x))
    with pytest.raises(ConfigError, match="chooses its head on public records"):
        dp_head(study, x, y, x[100:400], data, 3, [prior], name="h")
    fit = dp_head(study, x, y, x[100:400], data, 3, [prior], name="h", kind="class-means")
    s = fit.stage
    assert s.name == "class-means-dp:h" and (s.sample_rate, s.steps) == (1.0, 1)
    assert "LDA" in s.description and s.hyperparameters["rule"] == "lda-ledoit-wolf"
    assert "top 4 principal components" in s.description
    (noised,) = s.noised_tensors or {}  # one unreleased tensor, named once as such
    assert noised.startswith(f"{NOT_RELEASED}:class sums") and noised.count(NOT_RELEASED) == 1
    draws = [(s.noise_multiplier, 1.0, 1)] * study.head_draws
    both = composed_epsilon([*encoder, *draws], study.delta)
    assert study.epsilon - 0.01 < both <= study.epsilon


@pytest.mark.parametrize("spent", [False, True])
def test_the_choice_scores_class_means_heads_at_the_real_noise_on_public_records(
    spent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``choose_head`` under ``chosen``: two class-means heads, each fit on one half of the
    records after the centring ones and scored on the other, their covariance and principal
    components from the centring records, the noise on each class mean the real head's (sigma,
    after the encoder's stage when there is one, times half / n); the kind with the higher score
    is taken; a fixed kind is returned unscored."""
    from training.study import selection
    from training.study.budget import head_epsilon

    x, y = _features(n=135)
    x, y = x[5:], y[5:]  # not the far points: the centring records' covariance is the head's
    study = StudyConfig(**{**JOB.model_dump(), "centre_size": 30, "class_means_components": 4})
    private = fashion_like(1_000)
    prior = [dp_stage(1_000, batch=25, sigma=1.3, steps=70)] if spent else []
    fits: list[tuple[int, int, float]] = []
    bases: list[tuple[int, int]] = []
    fit, components = selection.fit_class_means, selection.public_components

    def spy(z: torch.Tensor, labels: torch.Tensor, classes: int, cfg: Any, public: Any) -> Any:
        fits.append((len(z), len(public), calibrate(cfg.epsilon, cfg.delta, 1.0, 1)))
        return fit(z, labels, classes, cfg, public)

    def basis(public_x: torch.Tensor, k: int) -> Any:
        bases.append((len(public_x), k))
        return components(public_x, k)

    monkeypatch.setattr(selection, "fit_class_means", spy)
    monkeypatch.setattr(selection, "public_components", basis)
    kind, scores = selection.choose_head(study, x, y.numpy(), private, prior, sgd_score=0.0)
    real = calibrate(head_epsilon(study, prior, 1.0, 1), study.delta, 1.0, 1)
    assert [f[:2] for f in fits] == [(50, 30), (50, 30)] and bases == [(30, 4)]
    assert fits[0][2] == pytest.approx(real * 50 / 1_000, rel=1e-4)
    assert kind == "class-means" and scores["class-means"] > 90 and scores["sgd"] == 0.0
    assert selection.choose_head(study, x, y.numpy(), private, [], sgd_score=100.0)[0] == "sgd"
    fixed = study.model_copy(update={"head_kind": "sgd"})
    assert selection.choose_head(fixed, x, y.numpy(), private, [], 0.0) == ("sgd", {})
    few = study.model_copy(update={"centre_size": 3})  # three records span two directions
    bases.clear()
    selection.choose_head(few, x, y.numpy(), private, prior, sgd_score=0.0)
    assert bases == [(3, 2)]


def fashion_like(n: int) -> Any:
    """Private records as the choice sees them: their number, classes and declared name."""
    from types import SimpleNamespace

    class Records(SimpleNamespace):
        def __len__(self) -> int:
            return n

    return Records(classes=("a", "b", "c"), dataset=Dataset(name=DATA, size=n))
