"""The Logit-DP recipe: a contrastive encoder trained under DP with per-pair clipping (Kong et
al., *DP-SGD for non-decomposable objective functions*), and its Naive-DP baseline.

The recipe is a model (``ContrastiveEmbedder``: a vip-* or dpcap-* encoder from a repo, its top
K blocks trainable, and a projection head), a loss (symmetric InfoNCE at temperature tau over
the cosine similarities of two augmented views per image) and a clipper: ``PairClipper``
(``--mechanism logit-dp``: every pair's similarity gradient clipped to B, sensitivity from
``vip_hub.privacy.sensitivity``) or ``BatchClipper`` (``--mechanism naive``: the whole-batch
gradient clipped to C, sensitivity 2C). Everything private about a step is the DP engine's
(``training/dp/engine.py``); the derivation and the conditions this recipe keeps are in
``docs/logit_dp_sensitivity.md``: the whole Poisson sample of a rank is one clipper call
(micro-batching would change the mechanism), each rank contrasts its own sample, and an example's
two views are drawn from its own (seed, step, index) stream.

Run it with ``vip-hub train-logit-dp ...`` or ``torchrun --nproc_per_node N -m
training.recipes.logit_dp ...``.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import cast

import torch
from pydantic import Field, field_validator
from timm.models.vision_transformer import VisionTransformer

from vip_hub.errors import ConfigError
from vip_hub.loading import load_encoder
from vip_hub.models.encoders import EncoderSpec
from vip_hub.models.features import final_norm
from vip_hub.privacy.ledger import NOT_RELEASED
from vip_hub.privacy.sensitivity import (
    CONTRASTIVE_LOSS,
    LOGIT_DP,
    MIN_CLIP,
    NAIVE_DP,
    logit_dp_sensitivity,
)
from vip_hub.repo_format import WEIGHTS_FILE

from ..data.images import MAE_AUGMENTATION, Augmented, mae_transform, open_images
from ..dp.pair_clipping import (
    BatchClipper,
    ContrastiveEmbedder,
    PairClipper,
)
from ..dp.run import DPRun
from ..dp.sampling import init_seed
from ..skeleton.config import DPRunConfig, Recipe, recipe_main, tenth_of_steps, with_adamw
from ..skeleton.distributed import Dist
from .mae import freeze_fixed_tokens
from .syn import public_loss, public_views

__all__ = [
    "RECIPE",
    "ContrastiveMechanism",
    "LogitDPConfig",
    "contrastive_model",
    "skip_cap",
    "train_logit_dp",
]


class ContrastiveMechanism(enum.StrEnum):
    """How the batch gradient is clipped: per pair (Logit-DP) or as a whole (Naive-DP)."""

    LOGIT_DP = "logit-dp"
    NAIVE = "naive"

    @property
    def ledger_name(self) -> str:
        """The mechanism's name in the ledger (the rule ``vip_hub.privacy.sensitivity`` applies)."""
        return LOGIT_DP if self is ContrastiveMechanism.LOGIT_DP else NAIVE_DP


DEFAULT_CLIP = {ContrastiveMechanism.LOGIT_DP: 1e-3, ContrastiveMechanism.NAIVE: 1e-2}
"""Default B (per pair) and C (whole batch): below the norms met at the start of training, so
every pair (every batch) is clipped and AdamW sees normalised directions
(docs/guides/train-logit-dp.md)."""


class LogitDPConfig(
    # a base made at run time (with_adamw's AdamW fields), which mypy takes as Any
    with_adamw(DPRunConfig, lr=1e-3, warmup=tenth_of_steps, weight_decay=0.05),  # type: ignore[misc]
):
    """A Logit-DP (or Naive-DP) run: symmetric InfoNCE on two views per image, DP-AdamW."""

    init: str = Field(
        description="(Syn)-ViP, ViP or DP-Cap repo folder or hub id whose encoder starts the run"
    )
    data: str = Field(
        description="image folder (class subfolders allowed, labels ignored) or directory of "
        "webdataset tar shards"
    )
    mechanism: ContrastiveMechanism = Field(
        ContrastiveMechanism.LOGIT_DP,
        description="logit-dp (per-pair clipping to B) or naive "
        "(the whole-batch gradient clipped to C)",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="InfoNCE temperature tau (Logit-DP's Delta grows like "
        "e^(2/tau)/tau: 16.8 B at 1, 222 B at 0.5)",
    )
    max_grad_norm: float | None = Field(
        None,
        ge=MIN_CLIP,
        description="pair clip B (logit-dp) or batch clip C (naive) (default: 1e-3 and 1e-2)",
    )
    max_batch: int | None = Field(
        None,
        ge=0,
        description="Logit-DP skip cap m: a rank's sample of more than m "
        "examples adds only noise (default: B + 6 sqrt(B) where "
        "that lowers Delta; 0: no cap)",
    )
    trainable_blocks: int = Field(
        2,
        ge=0,
        description="top encoder blocks trained (with the final norm and the "
        "projection head); the rest stays the init repo's",
    )
    projection_dim: int = Field(
        16, gt=0, description="projection head output d (Logit-DP's memory and time grow with d)"
    )
    projection_hidden: int | None = Field(
        None, gt=0, description="projection head hidden width (default: the encoder's width)"
    )
    micro_batch_size: int | None = Field(
        None,
        description="not used: a contrastive clipped sum is not additive "
        "over micro-batches, each rank's sample is one call",
    )

    @field_validator("micro_batch_size")
    @classmethod
    def _whole_sample(cls, value: int | None) -> None:
        if value is not None:
            raise ValueError(
                "the contrastive clipped sum is not a sum over micro-batches: the whole Poisson "
                "sample of a rank is one call (spread a large batch over ranks with torchrun)"
            )
        return None


def skip_cap(clip: float, temperature: float, batch_size: int, max_batch: int | None) -> int | None:
    """The Logit-DP cap m to run with: ``max_batch`` if given (0: none), else B + 6 sqrt(B) for
    the expected batch B when its sensitivity is below the uncapped one (or that overflows)."""
    if max_batch == 0:
        return None
    if max_batch is not None:
        if max_batch < max(2, batch_size):
            raise ConfigError(
                f"--max-batch {max_batch} is below the expected batch {batch_size}: most steps "
                "would add only noise"
            )
        return max_batch
    cap = math.ceil(batch_size + 6 * math.sqrt(batch_size))
    if 2.0 / temperature > 700.0:
        return cap
    return (
        cap
        if logit_dp_sensitivity(clip, temperature, cap) < logit_dp_sensitivity(clip, temperature)
        else None
    )


def contrastive_model(
    encoder: VisionTransformer,
    spec: EncoderSpec,
    trainable_blocks: int,
    dim: int,
    hidden: int | None = None,
) -> ContrastiveEmbedder:
    """The encoder with only its top ``trainable_blocks`` blocks and final norm trainable (all of
    it but the fixed tokens when that is every block), plus a fresh projection head."""
    depth = len(encoder.blocks)
    if trainable_blocks > depth:
        raise ConfigError(
            f"--trainable-blocks {trainable_blocks}: the {spec.arch} encoder has {depth} blocks"
        )
    encoder.requires_grad_(trainable_blocks == depth)
    freeze_fixed_tokens(encoder, spec)
    for module in [*encoder.blocks[depth - trainable_blocks :], final_norm(encoder)]:
        module.requires_grad_(True)
    return ContrastiveEmbedder(encoder, dim, hidden)


def train_logit_dp(cfg: LogitDPConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) Logit-DP or Naive-DP training and export the released encoder; returns its
    path."""
    dist = dist or Dist.from_env(cfg.device)
    mechanism = ContrastiveMechanism(cfg.mechanism)
    clip = cfg.max_grad_norm or DEFAULT_CLIP[mechanism]
    if mechanism is ContrastiveMechanism.NAIVE and cfg.max_batch:
        raise ConfigError(
            "--max-batch is Logit-DP's: Naive-DP's sensitivity 2C holds for every batch size"
        )
    images = open_images(cfg.data)
    n = len(images)
    params: dict[str, object] = {"loss": CONTRASTIVE_LOSS, "temperature": cfg.temperature}
    if mechanism is ContrastiveMechanism.LOGIT_DP:
        cap = skip_cap(clip, cfg.temperature, cfg.batch_size, cfg.max_batch)
        if cap is not None:
            params["max_batch"] = cap
    run = DPRun(cfg, dist, n, mechanism.ledger_name, params, clip)
    init = load_encoder(cfg.init)
    run.from_init(init)
    spec = init.spec
    torch.manual_seed(init_seed(run.seed))  # the fresh projection head, the same on every rank
    model = contrastive_model(
        init.model.train(), spec, cfg.trainable_blocks, cfg.projection_dim, cfg.projection_hidden
    ).to(dist.device)
    clipper = (
        # params holds skip_cap's int under max_batch, when it caps the batch
        PairClipper(model, clip, cfg.temperature, cast("int | None", params.get("max_batch")))
        if mechanism is ContrastiveMechanism.LOGIT_DP
        else BatchClipper(model, clip, cfg.temperature)
    )
    # micro_batch_size is None: each rank's whole Poisson sample is one clipper call
    engine = run.engine(model, clipper)

    transform = mae_transform(init.model, spec.img_size)
    augmented = Augmented(images, transform, run.seed)

    def load(index: int, step: int) -> tuple[torch.Tensor, ...]:
        return tuple(augmented.views(index, step, 2))

    public = public_views(spec, transform)
    records = engine.train(
        run,
        model,
        load,
        desc=f"train-logit-dp ({mechanism.ledger_name})",
        evaluate=lambda: {"public_loss": public_loss(model, public, cfg.temperature, dist.device)},
    )

    encoder = cast(VisionTransformer, model.encoder)  # contrastive_model's: init's ViT
    name, depth, k = mechanism.ledger_name, len(encoder.blocks), cfg.trainable_blocks
    trained = sum(p.numel() for p in clipper.params)
    frozen = (
        "nothing (the fixed position embedding aside)"
        if k == depth
        else f"the patch embedding, blocks 0-{depth - k - 1} and the class and position tokens"
    )
    clipping = (
        f"each pair's similarity gradient clipped to B = {clip:g}, the clipped sum "
        f"weighted by dL/dZ (Algorithm 1)"
        if mechanism is ContrastiveMechanism.LOGIT_DP
        else f"the whole-batch gradient clipped to C = {clip:g}"
    )
    hidden = cfg.projection_hidden or encoder.num_features
    return run.export_dp(
        encoder,
        spec,
        init,
        released={WEIGHTS_FILE: encoder, NOT_RELEASED: model},  # the projection head's
        records=records,
        curve_label="contrastive loss on public procedural images",
        dataset_description=f"{n} images; contrastive training with {name}",
        summary=(
            f"A {spec.arch} encoder trained contrastively with {name} on {cfg.dataset_name} "
            f"({n} images), starting from {cfg.init}: symmetric InfoNCE (temperature "
            f"{cfg.temperature:g}) on the top {k} of {depth} blocks and a projection head, "
            "which is not released (the encoder's features are the ones to probe). The loss "
            "curve is measured on public procedural images, so publishing it costs no "
            "privacy."
        ),
        name="dp-contrastive",
        description=(
            f"{name}: symmetric InfoNCE at temperature {cfg.temperature:g} over two "
            "augmented views per image, negatives from the same rank's Poisson sample; "
            f"{clipping}; Gaussian noise sigma x sensitivity once per logical step. "
            f"Trained: the top {k} of {depth} blocks, the final norm and a projection "
            f"head ({trained:,} parameters); {frozen} are the init repo's, unchanged: "
            "they never see this data and cost no privacy"
        ),
        hyperparameters={
            **cfg.adamw_hyperparameters(),
            "img_size": spec.img_size,
            "trainable_blocks": k,
            "trainable_parameters": trained,
            "frozen": frozen,
            "projection_head": {"dim": cfg.projection_dim, "hidden": hidden, "released": False},
            "augmentation": f"two views per image: {MAE_AUGMENTATION}",
        },
    )


RECIPE = Recipe(LogitDPConfig, train_logit_dp)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-logit-dp"))
