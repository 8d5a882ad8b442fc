"""Step 2 of the ViP recipe: the MAE of a (Syn)-ViP repo trained with DP-AdamW on private images.

The recipe is a model (the MAE), a per-example loss (its masked reconstruction error) and a
clipper (``PerExampleClipper``); everything private about a step is the DP engine's
(``training/dp_engine.py``). Masks and augmentations are drawn per example from the
(seed, step, index) streams, so nothing depends on the micro-batch split or the number of ranks.

Run it with ``vip-hub train-vip ...`` or, on several processes or GPUs,
``torchrun --nproc_per_node N -m training.vip ...`` (same arguments).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field

from vip_hub.privacy.sensitivity import sensitivity

from .clipping import PerExampleClipper
from .data import Augmented, mae_transform, open_images
from .distributed import Dist
from .dp_engine import Budget, DPEngine
from .mae import eval_loss, load_mae, public_eval_batch
from .optim import make_adamw, warmup_cosine
from .recipe import (
    DPRunConfig,
    Recipe,
    beta_field,
    lr_field,
    recipe_main,
    tenth_of_steps_to_1000,
    warmup_field,
    weight_decay_field,
)
from .runner import Run
from .sampling import MASKING, torch_generator

__all__ = ["RECIPE", "VipConfig", "train_vip"]

MECHANISM = "DP-AdamW"


class VipConfig(DPRunConfig):
    """A ViP run: DP-AdamW on the MAE loss. Defaults follow the ViP paper, App. A.2."""

    init: str = Field(
        description="(Syn)-ViP repo folder or hub id to start from (with mae_decoder.safetensors)"
    )
    data: str = Field(
        description="image folder (class subfolders allowed) or directory of webdataset tar shards"
    )
    lr: float = lr_field(3.84e-4)
    warmup_steps: int | None = warmup_field(tenth_of_steps_to_1000)
    weight_decay: float = weight_decay_field(0.005)
    beta1: float = beta_field(1)
    beta2: float = beta_field(2)


def train_vip(cfg: VipConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP-AdamW training of an MAE and export the released repo; returns its
    path."""
    dist = dist or Dist.from_env(cfg.device)
    images = open_images(cfg.data)
    n = len(images)
    budget = Budget.for_config(cfg, n)
    run = Run(cfg, dist)
    mae, spec, init_ledger = load_mae(cfg.init)
    mae.to(dist.device)
    optimizer = make_adamw(mae, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else tenth_of_steps_to_1000(cfg.steps)
    scheduler = warmup_cosine(optimizer, warmup, cfg.steps)
    engine = DPEngine.for_run(
        PerExampleClipper(mae, cfg.max_grad_norm),
        optimizer,
        scheduler,
        budget,
        run,
        cfg,
        sensitivity=sensitivity(MECHANISM, cfg.max_grad_norm),
        clipping_norm=cfg.max_grad_norm,
    )
    mean, std = mae.encoder.pretrained_cfg["mean"], mae.encoder.pretrained_cfg["std"]
    augmented = Augmented(images, mae_transform(spec.img_size, tuple(mean), tuple(std)), run.seed)

    def load(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(
            mae.num_patches, generator=torch_generator(run.seed, MASKING, step, index)
        )
        return augmented[index, step], noise

    public = public_eval_batch(spec, mae.num_patches)
    records = engine.train(
        run,
        mae,
        load,
        desc="train-vip",
        evaluate=lambda: {"public_loss": eval_loss(mae, public, dist.device)},
    )

    return engine.export(
        run,
        cfg,
        mae.encoder,
        spec,
        init_ledger,
        records=records,
        mechanism=MECHANISM,
        curve_label="MAE loss on public procedural images",
        dataset_description=f"{n} images; MAE pretraining with DP-AdamW",
        summary=(
            f"A {spec.arch} encoder trained with the ViP recipe: MAE pretraining on "
            f"procedural images, then DP-AdamW on {cfg.dataset_name} ({n} images). The "
            "loss curve is measured on public procedural images, so publishing it costs no "
            "privacy."
        ),
        files={"decoder": mae.decoder_state_dict(), "decoder_config": mae.config.to_dict()},
        name="dp-pretrain",
        description=(
            "ViP step 2: masked-autoencoder training with DP-AdamW (per-example clipping, "
            "Gaussian noise once per logical step, Poisson sampling)"
        ),
        hyperparameters={
            "lr": cfg.lr,
            "warmup_steps": warmup,
            "schedule": "cosine",
            "weight_decay": cfg.weight_decay,
            "betas": [cfg.beta1, cfg.beta2],
            "mask_ratio": mae.config.mask_ratio,
            "img_size": spec.img_size,
            "augmentation": "random resized crop (0.2-1), flip",
        },
    )


RECIPE = Recipe("vip", "ViP: DP-AdamW MAE training on private images", VipConfig, train_vip)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-vip"))
