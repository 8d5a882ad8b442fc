"""Step 1 of the ViP and DP-Cap recipes: (Syn)-ViP, MAE pretraining on procedural images only
(``--arch vip-*`` for ViP, ``--arch dpcap-*`` for the encoder DP-Cap training starts from).

AdamW (betas 0.9/0.95), warm-up + cosine schedule, bf16 autocast on GPU, checkpoints and
resume (the run skeleton, ``training/skeleton/run.py``). Batch ``step`` holds images
``step*B .. step*B+B-1`` of the procedural stream and its masks come from the (seed, step)
stream, so a resumed run sees exactly what an uninterrupted one would. The export carries the
encoder, the decoder and a ledger saying that no private data was used.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field

from vip_hub.errors import ConfigError
from vip_hub.models.encoders import ARCHS, DEFAULT_IMG_SIZE, DEFAULT_PATCH_SIZE, EncoderSpec
from vip_hub.privacy.ledger import Dataset, NonPrivateStage

from ..data.procedural import FAMILIES, SyntheticImages
from ..dp.sampling import MASKING, init_seed, torch_generator
from ..skeleton.config import Recipe, RunConfig, recipe_main, tenth_of_steps, with_adamw
from ..skeleton.distributed import Dist
from ..skeleton.run import Run
from .mae import DecoderConfig, eval_loss, new_mae, public_eval_batch

__all__ = ["RECIPE", "SYNTHETIC_DATASET", "SynConfig", "train_syn"]

SYNTHETIC_DATASET = "vip-hub-procedural-v1"


class SynConfig(
    with_adamw(
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
    batch_size: int = Field(64, gt=0, description="images per step")
    mask_ratio: float = Field(0.75, ge=0, lt=1, description="fraction of patches masked")
    norm_pix_loss: bool = Field(False, description="normalise each target patch (MAE's option)")
    decoder_dim: int = Field(512, gt=0, description="MAE decoder width")
    decoder_depth: int = Field(4, gt=0, description="MAE decoder blocks")
    decoder_heads: int = Field(16, gt=0, description="MAE decoder attention heads")


def train_syn(cfg: SynConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) MAE pretraining on procedural images and export the repo."""
    dist = dist or Dist.from_env(cfg.device)
    if dist.world > 1:
        raise ConfigError(
            "train-syn runs on one process (use a DP recipe with torchrun for several)"
        )
    spec = EncoderSpec(cfg.arch, img_size=cfg.img_size, patch_size=cfg.patch_size)
    decoder = DecoderConfig(
        cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads, cfg.mask_ratio, cfg.norm_pix_loss
    )
    run = Run(cfg, dist)
    torch.manual_seed(
        init_seed(run.seed)
    )  # initialisation only; batches and masks use their own streams
    mae = new_mae(spec, decoder).to(dist.device)
    optimizer, scheduler = run.adamw(mae)
    objects = {"model": mae, "optimizer": optimizer, "scheduler": scheduler}
    start = run.resume(objects)

    data = SyntheticImages(cfg.img_size, seed=run.seed)
    batches = (range(s * cfg.batch_size, (s + 1) * cfg.batch_size) for s in range(start, cfg.steps))
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=batches, num_workers=cfg.workers, pin_memory=dist.device.type == "cuda"
    )
    public = public_eval_batch(spec, mae.num_patches)

    def steps():  # type: ignore[no-untyped-def]
        for step, images in enumerate(loader, start):

            def do(step: int = step, images: torch.Tensor = images) -> tuple[dict, int]:
                noise = torch.rand(
                    len(images), mae.num_patches, generator=torch_generator(run.seed, MASKING, step)
                )
                with run.autocast():
                    loss = mae(
                        images.to(dist.device, non_blocking=True), noise.to(dist.device)
                    ).mean()
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                return {"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, len(images)

            yield step, do

    records = run.loop(
        start,
        cfg.steps,
        steps(),
        desc="train-syn",
        objects=objects,
        evaluate=lambda: {"public_loss": eval_loss(mae, public, dist.device)},
    )
    stage = NonPrivateStage(
        name="syn-pretrain",
        dataset=Dataset(
            name=SYNTHETIC_DATASET,
            description=(
                "procedural images generated on the fly ("
                + ", ".join(FAMILIES)
                + f"), stream seed {run.seed}; no real images"
            ),
        ),
        private_data=False,
        description=(
            f"(Syn)-{spec.family.title}: MAE pretraining, {cfg.steps} steps x {cfg.batch_size} "
            f"images at {cfg.img_size} px, mask ratio {cfg.mask_ratio}"
        ),
    )
    return run.export_encoder(
        mae.encoder,
        spec,
        lambda: [stage],
        records=records,
        curve=(
            "train_loss",
            "MAE training loss (procedural images)",
            f"(Syn)-{spec.family.title} pretraining",
        ),
        summary=(
            f"A {spec.arch} encoder pretrained as a masked autoencoder on procedural images only "
            f"((Syn)-{spec.family.title}): it has seen no real images, so it carries no privacy "
            "cost."
        ),
        decoder=mae.decoder_state_dict(),
        decoder_config=decoder.to_dict(),
    )


RECIPE = Recipe("syn", "(Syn)-ViP: MAE pretraining on procedural images", SynConfig, train_syn)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-syn"))
