"""A row's DP linear head: the same protocol on every row, of one of two kinds (``HeadKind``).
The DP-SGD head is the paper's (expected batch n / ``head_batches``, clipping ``head_clip``, SGD
at ``head_lr`` with momentum 0.9, warm-up and cosine) over the preset's ``probe_epochs``, on the
top ``head_components`` principal components of the row's features of the centring records; the
class-means head (``training/recipes/class_means.py``) releases the class means once and reads
``class_means_components`` of them. Either has its BatchNorm fixed to statistics of the centring
records (the DP-SGD head: their mean with variance 1; the class-means head: their mean and
variance, their covariance its LDA's), its epsilon what the split rule leaves after the encoder's
DP stages, and its ledger stage; the head released reads the features themselves
(``unproject``). A row's head is drawn ``head_draws`` times (``dp_head_draws``), the draws
sharing that epsilon, each a ledger stage: the head released is their mean (``mean_head``), and
every draw's top-1 can be reported."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from vip_hub.errors import ConfigError
from vip_hub.privacy.ledger import NOT_RELEASED, Dataset, DPStage, noised_key
from vip_hub.repo.heads import LinearProbe

from ..recipes.class_means import fit_class_means
from ..recipes.probe import (
    ProbeConfig,
    centred_statistics,
    component_count,
    dp_head_sampling,
    dp_head_schedule,
    fit_probe,
    probe_stage,
    public_components,
    unproject,
)
from .budget import head_epsilon
from .config import StudyConfig

__all__ = [
    "DPHead",
    "DrawnHead",
    "HeadKind",
    "dp_head",
    "dp_head_draws",
    "head_config",
    "head_kind",
    "head_sampling",
    "mean_head",
    "released_epsilon",
    "released_sampling",
    "unreleased_draw",
]


@dataclass(frozen=True)
class DPHead:
    """A fitted DP head, its settings and its ledger stage."""

    head: LinearProbe
    config: ProbeConfig
    stage: DPStage


def head_config(
    cfg: StudyConfig,
    n: int,
    epsilon: float | None,
    *,
    dataset: str,
    name: str = "probe",
    pooling: str = "vip",
    lr: float | None = None,
) -> ProbeConfig:
    """The study's head on ``n`` records of ``dataset`` at ``epsilon`` (``lr`` replaces
    ``cfg.head_lr``; ``public_data`` names the centring records, for its stage's description);
    with ``epsilon`` None the same schedule without DP at SGD 0.1, a non-private reference that
    research scripts print and nothing releases."""
    dp = epsilon is not None
    return ProbeConfig(
        encoder="",
        data="",
        public_data=f"the first {cfg.centre_size} public selection records" if dp else None,
        dataset_name=dataset,
        head=name,
        pooling=pooling,
        epsilon=epsilon,
        delta=cfg.delta if dp else None,
        **dp_head_schedule(n, cfg.probe_epochs, cfg.head_batches),
        lr=(lr or cfg.head_lr) if dp else 0.1,
        max_grad_norm=cfg.head_clip,
        seed=0,
    )


def head_sampling(cfg: StudyConfig, n: int, dataset: str) -> tuple[float, int]:
    """A study head's sample rate and steps on ``n`` records of ``dataset``, known before
    training (so the split rule can calibrate it)."""
    return dp_head_sampling(n, head_config(cfg, n, None, dataset=dataset))


HeadKind = Literal["sgd", "class-means"]
"""A released head: the study's DP-SGD head, or the class-means head."""


def released_sampling(kind: HeadKind, cfg: StudyConfig, n: int, dataset: str) -> tuple[float, int]:
    """A released head's sample rate and steps on ``n`` records: the DP-SGD head's
    (``head_sampling``), or one step on every record for a class-means head."""
    return (1.0, 1) if kind == "class-means" else head_sampling(cfg, n, dataset)


def released_epsilon(
    cfg: StudyConfig, kind: HeadKind, n: int, dataset: str, prior: Sequence[DPStage]
) -> float:
    """A ``kind`` head's own epsilon on ``n`` records of ``dataset`` after the DP stages
    ``prior``: what the split rule leaves at its sampling (``released_sampling``)."""
    return head_epsilon(cfg, prior, *released_sampling(kind, cfg, n, dataset))


def head_kind(cfg: StudyConfig, kind: HeadKind | None) -> HeadKind:
    """The head a row releases: ``kind`` (a public choice's), else the study's fixed one."""
    chosen = kind or cfg.head_kind
    if chosen == "chosen":
        raise ConfigError("the study chooses its head on public records: pass the choice's kind")
    return chosen


def dp_head(
    cfg: StudyConfig,
    x: torch.Tensor,
    y: torch.Tensor,
    centre_x: torch.Tensor,
    data: Dataset,
    classes: int,
    prior: Sequence[DPStage] = (),
    *,
    name: str = "probe",
    pooling: str = "vip",
    lr: float | None = None,
    kind: HeadKind | None = None,
) -> DPHead:
    """A DP head of ``kind`` (default: the study's; ``head_kind``) on the private features ``x``
    (labels ``y``, ``classes`` of them) of ``data``, centred on the centring records' features
    ``centre_x``, at the epsilon the split rule leaves after the encoder's DP stages ``prior``
    (``pooling`` names the features in its stage)."""
    kind = head_kind(cfg, kind)
    eps = released_epsilon(cfg, kind, len(y), data.name, prior)
    config = head_config(cfg, len(y), eps, dataset=data.name, name=name, pooling=pooling, lr=lr)
    means = kind == "class-means"
    k = component_count(centre_x, cfg.class_means_components if means else cfg.head_components)
    components = public_components(centre_x, k) if k else None
    px, pc = (components(x), components(centre_x)) if components else (x, centre_x)
    if means:
        fit, dp = fit_class_means(px, y, classes, config, pc)
    else:
        fit, dp = fit_probe(px, y, classes, config, centred_statistics(pc), f"head {name}")
    head = unproject(fit, components, centred_statistics(centre_x)) if components else fit
    if components:
        # the noise went to the k-coordinate head, which no file holds; the released one is its map
        on = f"on {k} public principal components"
        unreleased = f"{NOT_RELEASED}:"
        dp["noised"] = {
            noised_key(NOT_RELEASED, f"{key.removeprefix(unreleased)} {on}"): n
            for key, n in dp["noised"].items()
        }
    stage = probe_stage(config, data, dp)
    assert isinstance(stage, DPStage)  # the head ran with DP: its config has an epsilon
    if means:
        stage = stage.model_copy(
            update={
                "name": f"class-means-dp:{name}",
                "description": f"class-means head ({pooling} features): each class's sum of "
                "per-example clipped [standardised features, a constant] released once by the "
                "Gaussian mechanism (one DP-SGD step on every record, q = 1, its sum formed in "
                "fp64 and rounded once); the head is LDA on those noised means with the "
                f"Ledoit-Wolf covariance of {config.public_data}'s features (public), "
                "post-processing; normalisation fixed to the same public features",
                "hyperparameters": {"pooling": pooling, "rule": "lda-ledoit-wolf"},
            }
        )
    if k:
        stage = stage.model_copy(
            update={
                "description": f"{stage.description}; it read the top {k} principal components "
                f"of its features of {config.public_data} (public), and the head released is "
                "its map back to the features (post-processing)",
                "hyperparameters": {**stage.hyperparameters, "components": k},
            }
        )
    return DPHead(head, config, stage)


def unreleased_draw(stage: DPStage, draw: int, draws: int) -> DPStage:
    """Head draw ``draw`` of ``draws``'s ledger stage, ``stage`` as ``dp_head`` made it, for a
    draw after the first: its own name, and its noised tensors named unreleased (the released
    head is the draws' mean, post-processing)."""
    assert stage.noised_tensors is not None  # dp_head names them
    label = f"draw {draw} of {draws}"
    return stage.model_copy(
        update={
            "name": f"{stage.name}:draw-{draw}",
            "noised_tensors": {
                noised_key(NOT_RELEASED, f"{key.partition(':')[2]} ({label})"): n
                for key, n in stage.noised_tensors.items()
            },
            "description": f"{stage.description}; {label} of this head",
        }
    )


def mean_head(heads: Sequence[LinearProbe]) -> LinearProbe:
    """The head whose logits are the mean of ``heads``' (one BatchNorm, the mean of their linear
    layers); heads normalised differently are an error."""
    first = heads[0]
    norm = first.norm.state_dict()
    for h in heads[1:]:
        other = h.norm.state_dict()
        if not all(torch.equal(norm[k], other[k]) for k in ("running_mean", "running_var")):
            raise ConfigError("the heads to average are normalised differently")
    mean = LinearProbe(first.linear.in_features, first.linear.out_features)
    mean.load_state_dict(first.state_dict())
    with torch.no_grad():
        mean.linear.weight.copy_(torch.stack([h.linear.weight for h in heads]).mean(0))
        mean.linear.bias.copy_(torch.stack([h.linear.bias for h in heads]).mean(0))
    return mean.eval()


@dataclass(frozen=True)
class DrawnHead:
    """A row's head drawn several times: the head released, the mean of the draws' heads
    (``mean_head``), and each draw with its ledger stage (the first's named as ``dp_head``
    names it, the others' by ``unreleased_draw``)."""

    head: LinearProbe
    draws: list[DPHead]

    @property
    def stages(self) -> list[DPStage]:
        """Every draw's stage: all of them are what the released head rests on."""
        return [d.stage for d in self.draws]


def dp_head_draws(draw: Callable[[], DPHead], k: int) -> DrawnHead:
    """``k`` DP heads, each ``draw()`` (``dp_head``: a fresh secret each, at the epsilon the
    split rule shares among ``cfg.head_draws`` of them), and the mean of their heads to release
    (as good as one head at their whole budget on the public stand-in, where each draw is a
    point worse: the benchmarks' README, 'Head draws')."""
    fits = [draw() for _ in range(k)]
    mean = f"; the head released is the mean of the {k} draws' heads (post-processing)"
    note = mean if k > 1 else ""
    draws: list[DPHead] = []
    for i, f in enumerate(fits, 1):
        stage = f.stage.model_copy(update={"description": f.stage.description + note})
        draws.append(replace(f, stage=stage if i == 1 else unreleased_draw(stage, i, k)))
    return DrawnHead(mean_head([f.head for f in fits]), draws)
