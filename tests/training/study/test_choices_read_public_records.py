"""Audit (the selection rule): every run-time choice of the study reads public records only, and
the public parts of a released DP head do not move when one private record changes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from support.helpers import dp_stage

from training.recipes import class_means, probe
from training.study import heads as study_heads
from training.study import selection
from training.study.config import JOB
from training.study.heads import dp_head, released_epsilon
from training.study.selection import choose_features, sgd_scores
from vip_hub.privacy.ledger import Dataset

DATA = "audit/private"


class Guarded:
    """Private records as the choices may see them: n, classes, declared name; any read of an
    image, a label or a PIL record fails the test."""

    def __init__(self, n: int, classes: tuple[str, ...]):
        self._n, self.classes = n, classes
        self.dataset = Dataset(name=DATA, size=n)

    def __len__(self) -> int:
        return self._n

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a choice read private records: .{name}")


class Public:
    def __init__(self, labels: np.ndarray):
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)


def _features(n: int, d: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = 3.0 * torch.randn(3, d, generator=g)[y] + torch.randn(n, d, generator=g)
    return x, y


STUDY = JOB.updated(
    {"centre_size": 40, "probe_epochs": 2, "head_batches": 2, "head_components": 4,
     "class_means_components": 4, "head_kind": "chosen"}
)  # fmt: skip


def test_the_feature_mode_head_kind_and_lr_choices_read_no_private_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The choices read of the private records their n, classes and name alone; the mode with
    the highest score is chosen, each scored at the noise of the head on the private records
    after the encoder's stage."""
    x, y = _features(200)
    feats = {"a": x, "b": torch.randn(200, 6, generator=torch.Generator().manual_seed(5))}
    private = Guarded(5_000, ("a", "b", "c"))
    choice = choose_features(STUDY, feats, Public(y.numpy()), private)  # type: ignore[arg-type]
    assert choice.mode == "a" and choice.scores["a"] > choice.scores["b"] + 20
    assert choice.head in ("sgd", "class-means")
    targets: list[float | None] = []
    scores = selection.selection_scores
    monkeypatch.setattr(
        selection,
        "selection_scores",
        lambda feats, labels, classes, cfg, *rest: (
            targets.append(cfg.epsilon) or scores(feats, labels, classes, cfg, *rest)
        ),
    )
    stage = dp_stage(5_000, batch=128, sigma=1.3, steps=70)
    for lr in (4.0, 16.0):
        sgd_scores(STUDY, feats, Public(y.numpy()), private, [stage], lr)  # type: ignore[arg-type]
    after = released_epsilon(STUDY, "sgd", 5_000, DATA, [stage])
    assert targets == [after, after] and after < released_epsilon(STUDY, "sgd", 5_000, DATA, [])


def _public_inputs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Record what a DP head reads as public: the statistics its BatchNorms are fixed to, the
    features its principal components come from, the class-means head's constant ``a`` and its
    covariance's features."""
    seen: list[tuple[str, Any]] = []

    def spy(module: Any, name: str, pick: Any) -> None:
        real = getattr(module, name)

        def wrapped(*args: Any) -> Any:
            seen.append((name, pick(*args)))
            return real(*args)

        monkeypatch.setattr(module, name, wrapped)

    spy(probe, "fix_normalisation", lambda head, public_x: public_x.clone())
    spy(class_means, "fix_normalisation", lambda head, public_x: public_x.clone())
    spy(study_heads, "public_components", lambda public_x, k: public_x.clone())
    spy(class_means, "lda_rule", lambda sums, counts, public_z: public_z.clone())
    spy(class_means, "ClassSumLoss", lambda linear, a: a)
    return seen


@pytest.mark.parametrize("kind", ["sgd", "class-means"])
def test_a_released_heads_public_parts_do_not_move_with_one_private_record(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The released head's BatchNorm is the same when one private record changes: the centring
    records' mean with variance 1; and everything a DP head takes as public (its BatchNorms'
    statistics, its principal components' records, the class-means head's constant and
    covariance) is the same when every private record changes."""
    monkeypatch.setattr("training.recipes.probe.new_secret", lambda: 12345)
    x, y = _features(300, seed=1)
    centre, _ = _features(40, seed=2)
    data = Dataset(name=DATA, size=300)
    seen = _public_inputs(monkeypatch)
    a = dp_head(STUDY, x, y, centre, data, 3, kind=kind)  # type: ignore[arg-type]
    first = list(seen)
    seen.clear()
    x2 = x.clone()
    x2[0] = 100.0  # one private record replaced
    b = dp_head(STUDY, x2, y, centre, data, 3, kind=kind)  # type: ignore[arg-type]
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(a.head.norm, name), getattr(b.head.norm, name))
    seen.clear()  # and every private record replaced (a median need not move with one)
    dp_head(STUDY, _features(300, seed=3)[0], y, centre, data, 3, kind=kind)  # type: ignore[arg-type]
    assert [n for n, _ in first] == [n for n, _ in seen] and len(first) >= 3
    for (name, one), (_, two) in zip(first, seen, strict=True):
        same = torch.equal(one, two) if isinstance(one, torch.Tensor) else one == two
        assert same, name
    assert torch.allclose(a.head.norm.running_mean, centre.mean(0))
    assert torch.allclose(a.head.norm.running_var, torch.ones(x.shape[1]))
    assert study_heads.component_count(centre, 4) == 4


def test_a_head_reads_no_more_components_than_its_public_records_span() -> None:
    """Three centring records span two principal directions: a head asked for four reads two,
    however many private records there are."""
    x, y = _features(300, seed=1)
    fit = dp_head(STUDY, x, y, _features(3, seed=2)[0], Dataset(name=DATA, size=300), 3, kind="sgd")
    assert fit.stage.hyperparameters["components"] == 2
