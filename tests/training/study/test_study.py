"""The Fashion-MNIST study as one package (``training/study``): the job's and the benchmark's
settings differ only where their presets say, the splits follow their public rules, and
zero-shot is shown only above chance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.helpers import write_idx

from training.data.labelled import fashion_mnist
from training.main_job import MainJobConfig
from training.recipes.probe import (
    centred_statistics,
    fit_probe,
    fix_normalisation,
    public_components,
    unproject,
)
from training.study.budget import composed
from training.study.config import BENCHMARK, JOB, StudyConfig
from training.study.heads import head_config
from training.study.splits import study_splits
from training.study.table import chance_test, paired
from vip_hub.errors import DataError
from vip_hub.privacy.accounting import Accountant
from vip_hub.privacy.ledger import Dataset, DPStage, compose_releases


def test_the_job_and_the_benchmark_differ_only_in_their_sizes_and_heads() -> None:
    differ = {k for k in StudyConfig.model_fields if getattr(JOB, k) != getattr(BENCHMARK, k)}
    # the heads' epochs, batch and components: each preset's on the public stand-in at its noise
    # and the head draws: the job's share its budget, the benchmark's are each at the budget
    heads = {"probe_epochs", "head_batches", "head_components", "head_draws"}
    assert differ == {"train_size", "select_size", "test_size", *heads}
    assert MainJobConfig().study() == JOB  # `vip-hub run` runs the job's preset
    with pytest.raises(ValueError, match="leaves nothing of epsilon 3"):
        StudyConfig(encoder_epsilon=3.0)


def _stage(name: str, sigma: float, q: float, steps: int, data: str = "fashion") -> DPStage:
    return DPStage.from_parameters(
        name=name,
        dataset=Dataset(name=data, size=60_000),
        sample_rate=q,
        noise_multiplier=sigma,
        steps=steps,
        clipping_norm=1.0,
        noised_tensors={"unreleased:test": 10},
    )


def test_a_classifier_composing_past_the_budget_or_on_other_data_is_refused() -> None:
    """``composed`` is the study's last check that a released classifier keeps its (3, 1e-5):
    within it the composition is returned, past it (or on another dataset) an error."""
    encoder = _stage("encoder", 2.0, 256 / 60_000, 70)
    fair, greedy = _stage("head", 1.81, 0.1, 100), _stage("head", 1.79, 0.1, 100)
    within = composed(JOB, [encoder, fair], "fashion")[Accountant.RDP]
    assert JOB.epsilon - 0.05 < within <= JOB.epsilon  # 2.97
    past = compose_releases([encoder, greedy], JOB.delta)[Accountant.RDP]
    assert JOB.epsilon < past < JOB.epsilon + 0.05  # 3.02
    with pytest.raises(RuntimeError, match="> the budget"):
        composed(JOB, [encoder, greedy], "fashion")
    with pytest.raises(RuntimeError, match="expected only fashion"):
        composed(JOB, [encoder, _stage("head", 2.0, 0.01, 10, "digits")], "fashion")


def test_the_splits_follow_their_public_rules(tmp_path: Path) -> None:
    write_idx(tmp_path, "train", 30, seed=0)
    write_idx(tmp_path, "t10k", 20, seed=1)
    cfg = StudyConfig(train_size=25, select_size=8, test_size=10, centre_size=3)
    s = study_splits(cfg, tmp_path)
    train, test = fashion_mnist("train", tmp_path), fashion_mnist("test", tmp_path)
    assert (s.private.images == train.images[:25]).all() and s.private.dataset.size == 25
    assert (s.selection.images == test.images[:8]).all()
    assert (s.centre.images == test.images[:3]).all()
    assert (s.test.images == test.images[8:18]).all()
    with pytest.raises(DataError, match="select_size 8 \\+ test_size 13 > the 20 test records"):
        study_splits(cfg.model_copy(update={"test_size": 13}), tmp_path)


def test_zero_shot_is_above_chance_only_when_its_whole_interval_is() -> None:
    labels = np.arange(2000) % 10  # balanced: chance is 0.1
    predicted = np.where(np.arange(2000) < 217, labels, (labels + 1) % 10)  # 217 right: 0.1085
    near = chance_test(predicted, labels)
    assert near.top1 == 0.1085 and near.chance == 0.1 and near.low < 0.1 < near.high
    assert not near.above_chance and near.describe().endswith(": not above chance")
    better = chance_test(np.where(np.arange(2000) < 300, labels, (labels + 1) % 10), labels)
    assert better.above_chance and better.low > 0.1
    # chance is the best a classifier blind to the images scores: the largest class's share
    skewed = np.array([0] * 400 + [1] * 1600)
    blind = chance_test(np.ones(2000, dtype=int), skewed)
    assert blind.top1 == 0.8 and blind.chance == 0.8 and not blind.above_chance


def test_the_paired_comparison_adds_the_records_and_the_draws_terms() -> None:
    a = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=bool)  # two draws: 2 and 1 of 4 right
    b = np.array([[1, 0, 0, 0]], dtype=bool)  # one draw
    p = paired(a, b)
    # per record A's share less B's: (0, 0.5, 0, 0); the draws: A's top-1 0.5 and 0.25
    assert p.difference == pytest.approx(0.125)
    assert p.se_records == pytest.approx(0.25 / 2)  # their sample SD 0.25 over sqrt(4)
    assert p.se_draws == pytest.approx(np.sqrt(0.03125 / 2))  # variance 0.03125 over 2 draws
    assert p.z == pytest.approx(0.125 / np.hypot(0.125, np.sqrt(0.015625)))
    assert "+12.50 points" in p.describe()
    with pytest.raises(ValueError, match="same records"):
        paired(a, b[:, :3])


def test_the_paired_comparison_is_calibrated_under_the_null() -> None:
    """Two rows of one accuracy (each record's chance of a right answer shared, each draw its
    own): z spreads like N(0, 1), neither narrower (overclaiming) nor much wider."""
    rng = np.random.default_rng(0)
    zs = []
    for _ in range(400):
        easy = rng.random(500)  # each record's chance of being answered right
        draw_skill = rng.normal(0, 0.03, (2, 3))  # each head draw's own luck, per row
        right = rng.random((2, 3, 500)) < np.clip(easy + draw_skill[..., None], 0, 1)
        zs.append(paired(right[0], right[1]).z)
    assert 0.8 < np.std(zs) < 1.25 and abs(np.mean(zs)) < 0.2


def test_public_components_keep_the_public_records_top_directions_and_their_mean_norm():
    # public features with variance along e0 (largest), e1, e2 only, around an offset
    g = torch.Generator().manual_seed(0)
    offset = torch.arange(10.0)
    spread = torch.randn(500, 3, generator=g) * torch.tensor([5.0, 2.0, 1.0])
    centre = offset + spread @ torch.eye(10)[:3]
    project = public_components(centre, 2)
    z = project(centre)
    assert z.shape == (500, 2)
    assert z.mean(0).abs().max() < 1e-4  # centred on the public records' mean
    torch.testing.assert_close(
        z.norm(dim=1).mean(), (centre - offset).norm(dim=1).mean(), rtol=0.05, atol=0
    )
    e = torch.eye(10)
    at = {i: project(centre.mean(0) + e[i]).norm().item() for i in range(10)}
    assert at[0] > 0.9 * at[1] > 0  # the two directions of most variance, scaled alike
    assert at[2] < 0.1 * at[0]  # the third: left out (up to the sample's correlations)
    assert max(at[i] for i in range(3, 10)) < 1e-4 * at[0]  # no public variance there: gone
    with pytest.raises(DataError, match="11 principal components"):
        public_components(centre, 11)
    with pytest.raises(DataError, match="do not vary"):
        public_components(torch.ones(5, 10), 2)


@pytest.mark.parametrize("records", [30, 200])  # fewer and more records than coordinates
def test_public_components_are_the_svds_directions_and_unspanned_ones_read_nothing(records):
    g = torch.Generator().manual_seed(2)
    centre = torch.randn(records, 3, generator=g) @ torch.randn(3, 50, generator=g) + 7  # rank 3
    project = public_components(centre, 5)
    top = torch.linalg.svd((centre - centre.mean(0)).double(), full_matrices=False)[2][:3]
    unit = project.directions / project.directions.norm(dim=0).clamp(min=1e-300)
    torch.testing.assert_close((top @ unit[:, :3]).abs(), torch.eye(3, dtype=torch.float64))
    assert project.directions[:, 3:].abs().max() == 0  # no public variance there: read as 0
    assert (unit.gather(0, unit.abs().argmax(0, keepdim=True))[:, :3] > 0).all()  # one sign
    assert project(torch.randn(4, 50, generator=g))[:, 3:].abs().max() == 0


def test_a_head_on_public_components_is_released_as_the_same_head_on_the_features():
    g = torch.Generator().manual_seed(1)
    x, centre = torch.randn(300, 20, generator=g) + 3, torch.randn(40, 20, generator=g) + 3
    y = torch.randint(0, 4, (300,), generator=g)
    components = public_components(centre, 5)
    cfg = head_config(JOB.model_copy(update={"probe_epochs": 3}), 300, 2.0, dataset="org/data")
    head, _ = fit_probe(components(x), y, 4, cfg, centred_statistics(components(centre)))
    # any statistics either BatchNorm is fixed to: means and variances of their own
    fix_normalisation(head, torch.randn(7, 5, generator=g) * 3 + 1)
    full = unproject(head, components, torch.randn(9, 20, generator=g) * 2 - 4)
    assert full.linear.weight.shape == (4, 20)
    with torch.no_grad():
        torch.testing.assert_close(full(x), head(components(x)), rtol=1e-4, atol=1e-4)
        assert full(x).std() > 0.01  # a head that answers something


def test_the_mean_head_averages_the_draws_logits_and_refuses_other_normalisations() -> None:
    """``mean_head``: one BatchNorm, the mean of the linear layers, so its logits are the
    mean of the draws' logits; draws normalised on other statistics cannot be averaged."""
    from training.study.heads import mean_head
    from vip_hub.errors import ConfigError
    from vip_hub.repo.heads import LinearProbe

    torch.manual_seed(0)
    heads = [LinearProbe(8, 3).eval() for _ in range(3)]
    for h in heads:
        h.norm.running_mean.fill_(0.5)
        torch.nn.init.normal_(h.linear.weight)
        torch.nn.init.normal_(h.linear.bias)
    x = torch.randn(20, 8)
    mean = mean_head(heads)
    assert torch.allclose(mean(x), torch.stack([h(x) for h in heads]).mean(0), atol=1e-5)
    assert all(not torch.allclose(mean(x), h(x)) for h in heads)
    heads[1].norm.running_mean.fill_(0.25)
    with pytest.raises(ConfigError, match="normalised differently"):
        mean_head(heads)


def test_inputs_preprocess_each_split_once_per_data_configuration(monkeypatch) -> None:
    """``Inputs``: encoders sharing a data configuration read one preprocessing of a split, and
    their features (in every chunk, across chunk edges) are bit for bit those of the images."""
    from dataclasses import replace

    from timm.data import create_transform

    from training.data.labelled import LabelledArrays
    from training.priors import prior_path
    from training.study import features
    from vip_hub.loading import Encoder, load_encoder

    monkeypatch.setattr(features, "CHUNK", 50)  # three chunks, the last one short
    rng = np.random.default_rng(0)
    data = LabelledArrays(
        rng.integers(0, 256, (120, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 120),
        tuple("abcdefghij"),
        Dataset(name="test/grey", size=120),
    )
    vip = load_encoder(prior_path("vip-nano-scatter"))
    twin = load_encoder(prior_path("vip-nano-scatter"))
    grey = {**vip.data_config, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    other = replace(vip, data_config=grey, transform=create_transform(**grey))
    made = []
    real = Encoder.preprocess
    monkeypatch.setattr(Encoder, "preprocess", lambda e, im: made.append(e) or real(e, im))
    inputs = features.Inputs()
    for encoder in (vip, twin, other):
        for mode in ("avg", "pixels"):
            plain = features.embed(encoder, data, mode)
            assert torch.equal(features.embed(encoder, data, mode, inputs=inputs), plain)
    # the plain reads (3 encoders, 2 modes, 3 chunks), then vip's configuration's and grey's
    assert len(made) == 3 * 2 * 3 + 3 + 3
    assert torch.equal(inputs(twin, data), inputs(vip, data))
    assert not torch.equal(inputs(other, data), inputs(vip, data))
