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

from vip_hub.ledger import Dataset
from vip_hub.repo import export_encoder
from vip_hub.repo_format import CURVES_FILE, ENCODER
from vip_hub.sensitivity import sensitivity

from .clipping import PerExampleClipper
from .data import Augmented, mae_transform, open_images
from .distributed import Dist
from .dp_engine import Budget, DPEngine
from .mae import eval_loss, load_mae, public_eval_batch
from .optim import make_adamw, warmup_cosine
from .recipe import DPRunConfig, Recipe, recipe_main
from .run import Run
from .runlog import plot_curves
from .sampling import MASKING, torch_generator

__all__ = ["RECIPE", "VipConfig", "train_vip"]

MECHANISM = "DP-AdamW"


class VipConfig(DPRunConfig):
    """A ViP run: DP-AdamW on the MAE loss. Defaults follow the ViP paper, App. A.2."""

    init: str = Field(description="(Syn)-ViP repo folder or hub id to start from (with mae_decoder.safetensors)")
    data: str = Field(description="image folder (class subfolders allowed) or directory of webdataset tar shards")
    lr: float = Field(3.84e-4, gt=0, description="peak learning rate")
    warmup_steps: int | None = Field(None, ge=0, description="warm-up steps (default: min(1000, steps // 10))")
    weight_decay: float = Field(0.005, ge=0, description="AdamW weight decay (touches no data: no privacy cost)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")


def train_vip(cfg: VipConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP-AdamW training of an MAE and export the released repo; returns its path."""
    dist = dist or Dist.from_env(cfg.device)
    images = open_images(cfg.data)
    n = len(images)
    budget = Budget.for_config(cfg, n)
    run = Run(cfg, dist)
    mae, spec, init_ledger = load_mae(cfg.init)
    mae.to(dist.device)
    optimizer = make_adamw(mae, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(1000, cfg.steps // 10))
    scheduler = warmup_cosine(optimizer, warmup, cfg.steps)
    engine = DPEngine.for_run(PerExampleClipper(mae, cfg.max_grad_norm), optimizer, scheduler, budget, run, cfg,
                              sensitivity=sensitivity(MECHANISM, cfg.max_grad_norm), clipping_norm=cfg.max_grad_norm)
    mean, std = mae.encoder.pretrained_cfg["mean"], mae.encoder.pretrained_cfg["std"]
    augmented = Augmented(images, mae_transform(spec.img_size, tuple(mean), tuple(std)), run.seed)

    def load(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(mae.num_patches, generator=torch_generator(run.seed, MASKING, step, index))
        return augmented[index, step], noise

    public = public_eval_batch(spec, mae.num_patches)
    records = engine.train(run, mae, load, desc="train-vip",
                           evaluate=lambda: {"public_loss": eval_loss(mae, public, dist.device)})

    def export() -> None:
        name = cfg.dataset_name
        stage = engine.stage(
            audit_delta=cfg.audit_delta, name="dp-pretrain", mechanism=MECHANISM,
            dataset=Dataset(name=name, size=n, description=f"{n} images; MAE pretraining with DP-AdamW"),
            description=("ViP step 2: masked-autoencoder training with DP-AdamW (per-example clipping, "
                         "Gaussian noise once per logical step, Poisson sampling)"),
            hyperparameters={
                "lr": cfg.lr, "warmup_steps": warmup, "schedule": "cosine", "weight_decay": cfg.weight_decay,
                "betas": [cfg.beta1, cfg.beta2], "mask_ratio": mae.config.mask_ratio, "img_size": spec.img_size,
                "augmentation": "random resized crop (0.2-1), flip",
            },
        )
        prior = [s for s in init_ledger.stages if s.component == ENCODER]
        png = plot_curves(records, "public_loss", "MAE loss on public procedural images", f"DP-AdamW on {name}")
        export_encoder(
            cfg.out, mae.encoder, spec, [*prior, stage], model_name=cfg.model_name or Path(cfg.out).name,
            repo_id=cfg.repo_id,
            summary=(f"A {spec.arch} encoder trained with the ViP recipe: MAE pretraining on procedural images, "
                     f"then DP-AdamW on {name} ({n} images). The loss curve is measured on public procedural "
                     "images, so publishing it costs no privacy."),
            decoder=mae.decoder_state_dict(), decoder_config=mae.config.to_dict(),
            extra_files={CURVES_FILE: png}, overwrite=True,
        )

    return run.export(export)


RECIPE = Recipe("vip", "ViP: DP-AdamW MAE training on private images", VipConfig, train_vip)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-vip"))
