"""Step 1 of the ViP recipe: (Syn)-ViP, MAE pretraining on procedural images only.

AdamW (betas 0.9/0.95), warm-up + cosine schedule, bf16 autocast on GPU, checkpoints and
resume. Batch ``step`` holds images ``step*B .. step*B+B-1`` of the procedural stream and
its masks come from the (seed, step) stream, so a resumed run sees exactly what an
uninterrupted one would. The export carries the encoder, the decoder and a ledger saying
that no private data was used.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from vip_hub.ledger import Dataset, NonPrivateStage
from vip_hub.models import EncoderSpec
from vip_hub.repo import export_encoder

from .distributed import Dist
from .loop import Run, eval_loss, new_mae, open_run_dir, public_eval_batch, run_settings
from .mae import DecoderConfig
from .optim import make_adamw, warmup_cosine
from .runlog import plot_curves
from .sampling import MASKING, torch_generator
from .synthetic import FAMILIES, SyntheticImages

__all__ = ["SynConfig", "SYNTHETIC_DATASET", "train_syn"]

SYNTHETIC_DATASET = "vip-hub-procedural-v1"
CURVES_FILE = "training_curves.png"


@dataclass
class SynConfig:
    """A (Syn)-ViP run. Defaults follow the MAE/ViP recipe, scaled for small experiments."""

    out: str
    arch: str = "vip-nano"
    img_size: int = 224
    patch_size: int = 16
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1.5e-4 * 64 / 256  # MAE's base lr 1.5e-4 per 256 images
    warmup_steps: int | None = None  # default steps // 10
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.95
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False
    decoder_dim: int = 512
    decoder_depth: int = 4
    decoder_heads: int = 16
    seed: int = 0
    device: str = "auto"
    workers: int = 1
    checkpoint_every: int = 100
    eval_every: int | None = None
    model_name: str | None = None
    repo_id: str | None = None
    restart: bool = False


def train_syn(cfg: SynConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) MAE pretraining on procedural images and export the repo."""
    dist = dist or Dist.from_env(cfg.device)
    if dist.world > 1:
        raise ValueError("train-syn runs on one process (use train-dp with torchrun for DP training)")
    spec = EncoderSpec(cfg.arch, img_size=cfg.img_size, patch_size=cfg.patch_size)
    decoder = DecoderConfig(cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads,
                            cfg.mask_ratio, cfg.norm_pix_loss)
    torch.manual_seed(cfg.seed)  # initialisation only; batches and masks use their own streams
    mae = new_mae(spec, decoder).to(dist.device)
    optimizer = make_adamw(mae, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 10)
    scheduler = warmup_cosine(optimizer, warmup, cfg.steps)
    run = Run(open_run_dir(cfg.out, cfg.restart, dist), run_settings(cfg), dist)
    start = 0
    if (state := run.resume_state()) is not None:
        mae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = int(state["step"])

    data = SyntheticImages(cfg.img_size, seed=cfg.seed)
    sampler = (range(s * cfg.batch_size, (s + 1) * cfg.batch_size) for s in range(start, cfg.steps))
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=cfg.workers,
                                         pin_memory=dist.device.type == "cuda")
    public = public_eval_batch(spec, mae.num_patches)
    eval_every = cfg.eval_every or max(1, cfg.steps // 20)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.type == "cuda"
           else contextlib.nullcontext())
    run.open(start, cfg.steps, "train-syn")
    try:
        for step, images in enumerate(loader, start):
            noise = torch.rand(len(images), mae.num_patches, generator=torch_generator(cfg.seed, MASKING, step))
            with amp:
                loss = mae(images.to(dist.device, non_blocking=True), noise.to(dist.device)).mean()
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            record = {"step": step + 1, "train_loss": loss.item(), "lr": scheduler.get_last_lr()[0]}
            if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
                record["public_loss"] = eval_loss(mae, public, dist.device)
            run.step_done(record, len(images), {"loss": f"{record['train_loss']:.4f}"})
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                run.save({"step": step + 1, "model": mae.state_dict(), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict()})
    finally:
        run.close()
    stage = NonPrivateStage(
        name="syn-pretrain",
        dataset=Dataset(
            name=SYNTHETIC_DATASET,
            description=("procedural images generated on the fly (" + ", ".join(FAMILIES)
                         + f"), stream seed {cfg.seed}; no real images"),
        ),
        private_data=False,
        description=(f"(Syn)-ViP: MAE pretraining, {cfg.steps} steps x {cfg.batch_size} images at "
                     f"{cfg.img_size} px, mask ratio {cfg.mask_ratio}"),
    )
    png = plot_curves(run.records(), "train_loss", "MAE training loss (procedural images)",
                      "(Syn)-ViP pretraining")
    export_encoder(
        cfg.out, mae.encoder, spec, [stage], model_name=cfg.model_name or Path(cfg.out).name,
        repo_id=cfg.repo_id,
        summary=(f"A {spec.arch} encoder pretrained as a masked autoencoder on procedural images "
                 "only (Syn-ViP): it has seen no real images, so it carries no privacy cost."),
        decoder=mae.decoder_state_dict(), decoder_config=decoder.to_dict(),
        extra_files={CURVES_FILE: png}, overwrite=True,
    )
    return Path(cfg.out)
