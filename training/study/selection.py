"""Each (Syn) encoder's feature mode and head kind, chosen once on the public selection records
and read by the heads of every encoder trained from it (a short DP run keeps its prior's
geometry, and one choice per prior costs a fraction of one per encoder). ``selection_scores``
scores every mode the (Syn) repo offers, spatial modes included, by two DP-SGD heads fit on each
half of the records and scored on the other, their noise on the averaged gradient that of the
noisiest private head reading the choice; under ``head_kind`` ``chosen``, ``choose_head`` then
scores two class-means heads on the chosen mode at the same head's noise, and the higher kind is
released. No private record takes part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from vip_hub.loading import load_encoder
from vip_hub.privacy.accounting import calibrate, epsilon
from vip_hub.privacy.ledger import DPStage

from ..data.labelled import LabelledArrays
from ..recipes.class_means import fit_class_means
from ..recipes.probe import accuracy, component_count, public_components, selection_scores
from .budget import head_epsilon
from .config import StudyConfig
from .features import Inputs
from .heads import HeadKind, head_config, released_epsilon, released_sampling

__all__ = ["Choice", "choose_features", "choose_head", "choose_modes", "sgd_scores"]


@dataclass(frozen=True)
class Choice:
    """A (Syn) encoder's chosen feature mode, every mode's selection score (top-1 %), the (Syn)
    encoder's name and how many selection records chose; the head kind its rows release and,
    when the study chose it, each kind's score."""

    mode: str
    scores: dict[str, float]
    prior: str
    records: int
    head: HeadKind = "sgd"
    head_scores: dict[str, float] = field(default_factory=dict)

    def shown(self) -> str:
        """Every mode's and head's score and the choices, as the job prints them."""
        by_score = sorted(self.scores.items(), key=lambda kv: -kv[1])
        heads = ", ".join(f"{k} {v:.1f}" for k, v in self.head_scores.items())
        return (
            "modes on public records: "
            + ", ".join(f"{m} {v:.1f}" for m, v in by_score)
            + f"; chosen {self.mode}"
            + (f"; heads: {heads}; chosen {self.head}" if heads else "")
        )

    def head_note(self) -> str:
        """The head kind and each kind's score, when the study compared them ('' otherwise)."""
        if len(self.head_scores) < 2:
            return ""
        scores = ", ".join(f"{k} {v:.1f} %" for k, v in self.head_scores.items())
        return f"a {self.head} head ({scores} on the selection records)"

    def describe(self) -> str:
        """The mode and how it was chosen, as the comparison shows it."""
        note = self.head_note()
        head = f"; {note}" if note else ""
        return (
            f"{self.mode} features (the best of {len(self.scores)} modes on public test records "
            f"0-{self.records - 1}, scored on {self.prior}{head})"
        )


def choose_head(
    cfg: StudyConfig,
    x: torch.Tensor,
    labels: np.ndarray,
    private: LabelledArrays,
    prior: Sequence[DPStage],
    sgd_score: float,
) -> tuple[HeadKind, dict[str, float]]:
    """The head kind a row on ``private`` after the DP stages ``prior`` releases: the study's
    fixed kind, or under ``chosen`` the one that scores higher on the PUBLIC selection features
    ``x`` (labels ``labels``): the DP-SGD head's ``sgd_score`` (``selection_scores``) against the
    mean top-1 (%) of two class-means heads, each fit on one half of the records after the first
    ``centre_size`` and scored on the other, their covariance from those first records (the
    centring records the released head's comes from), the noise on each class mean the real
    head's (its sigma scaled by the records' ratio, at least the accountant's least sigma: where
    that binds, the choice's class-means heads are the noisier); with fewer than 4 records past
    the centring ones, the DP-SGD head. Each kind's score is returned beside it."""
    if cfg.head_kind != "chosen":
        return cfg.head_kind, {}
    centre = min(cfg.centre_size, len(labels))
    half = (len(labels) - centre) // 2
    if half < 2:
        print(
            f"    too few public records past the {centre} centring ones ({len(labels)}) to "
            "score a class-means head: the DP-SGD head is kept",
            flush=True,
        )
        return "sgd", {"sgd": sgd_score}
    q, steps = released_sampling("class-means", cfg, len(private), private.dataset.name)
    sigma = calibrate(head_epsilon(cfg, prior, q, steps), cfg.delta, q, steps)
    matched = epsilon(sigma * half / len(private), q, steps, cfg.delta)
    config = head_config(cfg, half, matched, dataset=private.dataset.name)
    k = component_count(x[:centre], cfg.class_means_components)
    project = public_components(x[:centre], k) if k else (lambda features: features)
    z, y = project(x), torch.as_tensor(labels)
    folds = (slice(centre, centre + half), slice(centre + half, centre + 2 * half))
    classes = len(private.classes)
    top1 = [
        accuracy(fit_class_means(z[a], y[a], classes, config, z[:centre])[0], z[b], y[b])
        for a, b in (folds, folds[::-1])
    ]
    scores = {"sgd": sgd_score, "class-means": 100 * sum(top1) / len(top1)}
    return ("class-means" if scores["class-means"] > scores["sgd"] else "sgd"), scores


def sgd_scores(
    cfg: StudyConfig,
    feats: Mapping[str, torch.Tensor],
    selection: LabelledArrays,
    private: LabelledArrays,
    prior: Sequence[DPStage] = (),
    lr: float | None = None,
) -> dict[str, float]:
    """Each mode of the PUBLIC ``selection`` records' features ``feats`` scored by
    ``selection_scores`` with the noise of the DP-SGD head at ``lr`` (default the study's) on
    ``private`` after the DP stages ``prior``; of ``private`` only its n and classes are read."""
    n, dataset = len(private), private.dataset.name
    eps = released_epsilon(cfg, "sgd", n, dataset, prior)
    head = head_config(cfg, n, eps, dataset=dataset, lr=lr)
    return selection_scores(
        feats, selection.labels, len(private.classes), head, n, cfg.head_components,
        cfg.centre_size,
    )  # fmt: skip


def choose_features(
    cfg: StudyConfig,
    feats: Mapping[str, torch.Tensor],
    selection: LabelledArrays,
    private: LabelledArrays,
    prior: Sequence[DPStage] = (),
) -> Choice:
    """Of the PUBLIC ``selection`` records' features in each mode of ``feats``, the mode and the
    head kind (``choose_head``) for a head on ``private`` after the DP stages ``prior``, the
    mode by ``sgd_scores``; ``prior`` names the choice."""
    scores = sgd_scores(cfg, feats, selection, private, prior)
    mode = max(scores, key=lambda m: scores[m])
    kind, kinds = choose_head(cfg, feats[mode], selection.labels, private, prior, scores[mode])
    return Choice(mode, scores, "", len(selection), kind, kinds)


def choose_modes(
    cfg: StudyConfig,
    readers: Mapping[Path, Sequence[Sequence[DPStage]]],
    selection: LabelledArrays,
    private: LabelledArrays,
    device: str = "cpu",
    inputs: Inputs | None = None,
) -> dict[Path, Choice]:
    """Each (Syn) encoder repo of ``readers`` (mapped to the DP stages on ``private`` of every
    encoder whose heads read its choice: none for the (Syn) encoder itself) with its mode and
    head kind (``choose_features``), chosen on the ``selection`` records for a head on
    ``private`` after the most spent of those stages; ``inputs`` keeps the records preprocessed
    for a run's later reads."""
    n, dataset = len(private), private.dataset.name
    inputs = inputs or Inputs()
    out = {}
    for prior, stages in readers.items():
        spent = min(stages, key=lambda s: released_epsilon(cfg, "sgd", n, dataset, s))
        encoder = load_encoder(prior, device=device)
        feats = encoder.embed(inputs(encoder, selection), encoder.encoder_poolings)
        choice = choose_features(cfg, feats, selection, private, spent)
        out[prior] = choice = replace(choice, prior=prior.name)
        print(f"    {prior.name}: {choice.shown()}", flush=True)
    return out
