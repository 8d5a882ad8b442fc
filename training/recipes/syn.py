"""Step 1 of the ViP and DP-Cap recipes: (Syn)-ViP, pretraining on procedural images only
(``--arch vip-*`` for ViP, ``--arch dpcap-*`` for the encoder DP-Cap training starts from), by
MAE (the default), contrastive learning or ScatterNet distillation (``--objective``).

AdamW (betas 0.9/0.95), warm-up + cosine schedule, bf16 autocast on GPU, checkpoints and
resume (the run skeleton, ``training/skeleton/run.py``). Batch ``step`` holds images
``step*B .. step*B+B-1`` of the procedural stream and its masks come from the (seed, step)
stream, so a resumed run sees exactly what an uninterrupted one would. The export carries the
encoder, the MAE decoder (MAE only) and a ledger saying that no private data was used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, cast

import torch
from pydantic import Field, field_validator
from timm.models.vision_transformer import VisionTransformer

from vip_hub.errors import ConfigError
from vip_hub.models.encoders import (
    ARCHS,
    DEFAULT_IMG_SIZE,
    DEFAULT_PATCH_SIZE,
    IMAGENET_MEAN,
    IMAGENET_STD,
    MIN_CROP_PCT,
    EncoderSpec,
    create_encoder,
)
from vip_hub.models.features import SpatialMode
from vip_hub.privacy.ledger import Dataset, NonPrivateStage

from ..data.images import Augmented, contrastive_transform, greyscale_transform
from ..data.procedural import FAMILIES, ProceduralPictures, SyntheticImages, check_families
from ..dp.pair_clipping import ContrastiveEmbedder, embed, symmetric_infonce
from ..dp.sampling import MASKING, init_seed, torch_generator
from ..skeleton.config import Recipe, RunConfig, recipe_main, tenth_of_steps, with_adamw
from ..skeleton.distributed import Dist
from ..skeleton.run import Run, Stateful
from .mae import (
    EVAL_IMAGES,
    EVAL_SEED,
    MAE,
    DecoderConfig,
    eval_loss,
    freeze_fixed_tokens,
    new_mae,
    public_eval_batch,
)
from .scatter import ScatterDistiller

__all__ = ["RECIPE", "SYNTHETIC_DATASET", "SynConfig", "public_loss", "public_views", "train_syn"]

SYNTHETIC_DATASET = "vip-hub-procedural-v1"


class SynConfig(
    # a base made at run time (with_adamw's AdamW fields), which mypy takes as Any
    with_adamw(  # type: ignore[misc]
        RunConfig,
        lr=1.5e-4 * 64 / 256,
        lr_note="MAE's 1.5e-4 per 256 images",
        warmup=tenth_of_steps,
        weight_decay=0.05,
    )
):
    """A (Syn)-ViP run. Defaults follow the MAE/ViP recipe, scaled for small experiments."""

    arch: str = Field(
        "vip-nano",
        description=f"encoder architecture: {', '.join(ARCHS)} (dpcap-*: to start DP-Cap "
        "training from)",
    )
    img_size: int = Field(DEFAULT_IMG_SIZE, gt=0, description="input resolution in pixels")
    patch_size: int = Field(DEFAULT_PATCH_SIZE, gt=0, description="patch size in pixels")
    crop_pct: float | None = Field(
        None,
        ge=MIN_CROP_PCT,
        le=1,
        description="the released transform's centre crop (default: the family's; 1: a plain "
        "resize, none at all when images already have --img-size pixels)",
    )
    families: str = Field(
        ",".join(FAMILIES),
        min_length=1,
        description=f"procedural families the images are drawn from, comma-separated (of "
        f"{', '.join(FAMILIES)})",
    )
    batch_size: int = Field(64, gt=0, description="images per step")
    mask_ratio: float = Field(
        DecoderConfig.mask_ratio, ge=0, lt=1, description="fraction of patches masked"
    )
    norm_pix_loss: bool = Field(
        DecoderConfig.norm_pix_loss, description="normalise each target patch (MAE's option)"
    )
    decoder_dim: int = Field(DecoderConfig.dim, gt=0, description="MAE decoder width")
    decoder_depth: int = Field(DecoderConfig.depth, gt=0, description="MAE decoder blocks")
    decoder_heads: int = Field(
        DecoderConfig.num_heads, gt=0, description="MAE decoder attention heads"
    )
    objective: Literal["mae", "contrastive", "scatter"] = Field(
        "mae",
        description="mae (masked autoencoder, the ViP recipe's), contrastive (InfoNCE between "
        "SimCLR-augmented views, as Baradad et al. 2021 and DP-RandP) or scatter (the last "
        "block's patch tokens regress a ScatterNet's coefficients of greyscale images, "
        "training/recipes/scatter.py); the last two export no MAE decoder (ViP then starts one "
        "fresh)",
    )
    depth: int | None = Field(
        None,
        gt=0,
        description="encoder blocks (default: the architecture's; fewer: a shallower stack of "
        "the same blocks)",
    )
    weights_dtype: Literal["float32", "float16"] = Field(
        "float32",
        description="dtype of the exported encoder weights (float16: half the size, for a prior "
        "committed to a project)",
    )
    temperature: float = Field(0.2, gt=0, description="InfoNCE temperature (contrastive)")
    projection_dim: int = Field(128, gt=0, description="projection head width (contrastive)")

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: str) -> str:
        check_families(value.split(","))
        return value

    @property
    def family_names(self) -> tuple[str, ...]:
        """``families`` as a tuple of names."""
        return tuple(self.families.split(","))


def public_views(
    spec: EncoderSpec, transform: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fixed augmented views of the public procedural images the MAE curves use."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(EVAL_SEED)
        source = ProceduralPictures(spec.img_size, seed=EVAL_SEED)
        pictures = [source.load(i) for i in range(EVAL_IMAGES)]
        first = torch.stack([transform(p) for p in pictures])
        second = torch.stack([transform(p) for p in pictures])
    return first, second


@torch.no_grad()
def public_loss(
    model: ContrastiveEmbedder,
    views: tuple[torch.Tensor, torch.Tensor],
    temperature: float,
    device: torch.device,
) -> float:
    """Mean symmetric InfoNCE on the fixed public views (eval mode, no gradient)."""
    was = model.training
    model.eval()
    e = embed(model, views[0].to(device), views[1].to(device))
    k = views[0].shape[0]
    loss = symmetric_infonce(e[:k] @ e[k:].T, temperature).mean().item()
    model.train(was)
    return loss


class _Views(torch.utils.data.Dataset):
    """Item ``index``: ``count`` augmented views (count, C, H, W) of procedural image ``index``,
    drawn from that image's own (seed, step, index) stream (``Augmented``)."""

    def __init__(self, augmented: Augmented, batch_size: int, count: int):
        self.augmented, self.batch_size, self.count = augmented, batch_size, count

    def __len__(self) -> int:
        return len(self.augmented)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.stack(self.augmented.views(index, index // self.batch_size, self.count))


def public_greys(size: int) -> torch.Tensor:
    """The fixed public procedural images the curves use, greyscale in [0, 1] (EVAL_IMAGES, 1, H, W)
    through ``greyscale_transform`` under ``EVAL_SEED``."""
    transform = greyscale_transform()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(EVAL_SEED)
        source = ProceduralPictures(size, seed=EVAL_SEED)
        return torch.stack([transform(source.load(i)) for i in range(EVAL_IMAGES)])


def train_syn(cfg: SynConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) (Syn) pretraining on procedural images (``cfg.objective``: MAE,
    contrastive or ScatterNet distillation) and export the repo."""
    dist = dist or Dist.from_env(cfg.device)
    if dist.world > 1:
        raise ConfigError(
            "train-syn runs on one process (use a DP recipe with torchrun for several)"
        )
    spec = EncoderSpec(
        cfg.arch,
        img_size=cfg.img_size,
        patch_size=cfg.patch_size,
        crop_pct=cfg.crop_pct,
        depth=cfg.depth,
    )
    decoder = DecoderConfig(
        cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads, cfg.mask_ratio, cfg.norm_pix_loss
    )
    run = Run(cfg, dist)
    torch.manual_seed(
        init_seed(run.seed)
    )  # initialisation only; batches, masks and views use their own streams
    pictures = ProceduralPictures(cfg.img_size, seed=run.seed, families=cfg.family_names)
    if cfg.objective == "contrastive":
        embedder = ContrastiveEmbedder(
            freeze_fixed_tokens(create_encoder(spec, mae_init=True), spec), cfg.projection_dim
        )
        model: torch.nn.Module = embedder
        transform = contrastive_transform(cfg.img_size, IMAGENET_MEAN, IMAGENET_STD)
        data: torch.utils.data.Dataset = _Views(
            Augmented(pictures, transform, run.seed), cfg.batch_size, 2
        )
        views = public_views(spec, transform)
        evaluate = lambda: {  # noqa: E731
            "public_loss": public_loss(embedder, views, cfg.temperature, dist.device)
        }
    elif cfg.objective == "scatter":
        encoder = create_encoder(spec, mae_init=True)
        # set by timm's create_model (a Module's unknown attribute types as Tensor | Module)
        pretrained_cfg = cast(dict[str, Any], encoder.pretrained_cfg)
        cfg_mean, cfg_std = pretrained_cfg["mean"], pretrained_cfg["std"]
        model = ScatterDistiller(encoder, torch.tensor(cfg_mean), torch.tensor(cfg_std))
        data = _Views(Augmented(pictures, greyscale_transform(), run.seed), cfg.batch_size, 1)
        greys = public_greys(cfg.img_size)
        evaluate = lambda: {"public_loss": eval_loss(model, (greys[:, 0],), dist.device)}  # noqa: E731
    else:
        model = new_mae(spec, decoder)
        data = SyntheticImages(cfg.img_size, seed=run.seed, families=cfg.family_names)
        public = public_eval_batch(spec, model.num_patches)
        evaluate = lambda: {"public_loss": eval_loss(model, public, dist.device)}  # noqa: E731
    model.to(dist.device)
    optimizer, scheduler = run.adamw(model)
    objects: dict[str, Stateful] = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    start = run.resume(objects)

    batches = (range(s * cfg.batch_size, (s + 1) * cfg.batch_size) for s in range(start, cfg.steps))
    loader = torch.utils.data.DataLoader(
        data,
        # typed as lists of indices; any sequence of them works (each indexes the dataset)
        batch_sampler=batches,  # type: ignore[arg-type]
        num_workers=cfg.workers,
        pin_memory=dist.device.type == "cuda",
    )

    def loss_of(step: int, images: torch.Tensor) -> torch.Tensor:
        images = images.to(dist.device, non_blocking=True)
        if cfg.objective == "contrastive":  # (B, 2, 3, H, W): InfoNCE across the two views
            e = embed(model, images[:, 0], images[:, 1])
            b = images.shape[0]
            return symmetric_infonce(e[:b] @ e[b:].T, cfg.temperature)
        if cfg.objective == "scatter":  # (B, 1, 1, H, W): one greyscale view each
            return model(images[:, 0, 0])
        noise = torch.rand(
            len(images),
            cast(MAE, model).num_patches,  # the MAE objective's model
            generator=torch_generator(run.seed, MASKING, step),
        )
        return model(images, noise.to(dist.device))

    def steps() -> Iterator[tuple[int, Callable[[], tuple[dict[str, Any], int]]]]:
        for step, images in enumerate(loader, start):

            def do(step: int = step, images: torch.Tensor = images) -> tuple[dict, int]:
                with run.autocast():
                    loss = loss_of(step, images).mean()
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                return {"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, len(images)

            yield step, do

    records = run.loop(
        start, cfg.steps, steps(), desc="train-syn", objects=objects, evaluate=evaluate
    )
    title = f"(Syn)-{spec.family.title}"
    files: dict = {}
    if cfg.objective == "contrastive":
        what = (
            f"contrastive pretraining (symmetric InfoNCE at temperature {cfg.temperature:g} "
            "between two SimCLR-augmented views of each image, a projection head that is not "
            "released)"
        )
        curve = "contrastive loss (procedural images)"
    elif cfg.objective == "scatter":
        what = (
            f"ScatterNet distillation (the patch tokens of the last of {spec.depth} blocks "
            "regress, through a linear map that is not released, the GroupNorm-ed coefficients "
            "of kymatio's Scattering2D(J=2, L=8) of greyscale images, half of them inverted)"
        )
        curve = "distillation loss (procedural images)"
        side = min(encoder.patch_embed.grid_size)  # the distiller's encoder
        assert spec.depth is not None  # EncoderSpec fills it in
        files = {
            "spatial": tuple(
                dict.fromkeys(SpatialMode((spec.depth,), g).name for g in (side, min(4, side)))
            )
        }
    else:
        what = f"MAE pretraining, mask ratio {cfg.mask_ratio}"
        curve = "MAE training loss (procedural images)"
        mae = cast(MAE, model)  # the MAE objective's model
        files = {"decoder": mae.decoder_state_dict(), "decoder_config": decoder.to_dict()}
    stage = NonPrivateStage(
        name={"mae": "syn-pretrain"}.get(cfg.objective, f"syn-{cfg.objective}"),
        dataset=Dataset(
            name=SYNTHETIC_DATASET,
            description=(
                "procedural images generated on the fly ("
                + ", ".join(cfg.family_names)
                + f"), stream seed {run.seed}; no real images"
            ),
        ),
        private_data=False,
        description=(
            f"{title}: {what}, {cfg.steps} steps x {cfg.batch_size} images at {cfg.img_size} px"
            "; no private data"
        ),
    )
    # the encoder create_encoder built, whichever objective's model holds it
    encoder = cast(VisionTransformer, model.encoder)
    return run.export_encoder(
        encoder,
        spec,
        lambda: [stage],
        records=records,
        curve=("train_loss", curve, f"{title} pretraining"),
        summary=(
            f"A {spec.arch} encoder pretrained by {cfg.objective} learning on procedural images "
            f"only ({title}): it has seen no real images, so it carries no privacy cost."
        ),
        weights_dtype=getattr(torch, cfg.weights_dtype),
        **files,
    )


RECIPE = Recipe(SynConfig, train_syn)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-syn"))
