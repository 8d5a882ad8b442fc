"""Step 2 of the ViP recipe: DP-AdamW on private images, from a (Syn)-ViP MAE.

Each logical step, exactly as DESIGN.md ("DP-AdamW, exactly") says: every rank
Poisson-samples its shard of the dataset at rate q = B/n; the sample is cut into physical
micro-batches; per-example gradients are clipped to C (``PerExampleClipper``, no
per-example gradient is materialised) and summed; one all-reduce sums the ranks; Gaussian
noise N(0, sigma^2 C^2) is added once (by rank 0, before the all-reduce); the sum is
divided by the expected batch size B; AdamW steps; the accountant advances by one step.
Training stops before the target epsilon would be exceeded.

Run it with ``vip-hub train-dp ...`` or, on several processes or GPUs,
``torchrun --nproc_per_node N -m training.dp ...`` (same arguments).
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vip_hub.accounting import (
    Accountant,
    AccountingError,
    calibrate,
    composed_epsilon,
    default_delta,
    epsilon,
)
from opacus.accountants import RDPAccountant
from vip_hub.ledger import ENCODER, Dataset, DPStage
from vip_hub.repo import export_encoder

from .clipping import PerExampleClipper
from .data import Augmented, mae_transform, open_images
from .distributed import Dist
from .loop import Run, eval_loss, load_mae, open_run_dir, public_eval_batch, run_settings
from .optim import make_adamw, warmup_cosine
from .runlog import plot_curves
from .sampling import MASKING, NOISE, micro_batches, poisson_sample, rank_shard, torch_generator

__all__ = ["DPConfig", "max_steps_within", "noisy_mean_gradient", "train_dp"]

CURVES_FILE = "training_curves.png"


@dataclass
class DPConfig:
    """A DP-AdamW run. Defaults follow the ViP paper, App. A.2."""

    init: str  # a (Syn)-ViP repo folder (with mae_decoder.safetensors)
    data: str  # an image folder or a directory of tar shards
    out: str  # where the released repo is written
    epsilon: float | None = 8.0  # target; None: spend whatever sigma and steps give
    sigma: float | None = None  # noise multiplier; calibrated from epsilon when None
    delta: float | None = None  # default 1/(2n)
    batch_size: int = 256  # expected logical batch B (q = B/n)
    steps: int = 100
    dataset_size: int | None = None  # checked against the count when given
    dataset_name: str | None = None  # the ledger's name for the data (default: folder name)
    micro_batch_size: int = 32  # physical batch; does not change the result
    lr: float = 3.84e-4
    warmup_steps: int | None = None  # default min(1000, steps // 10)
    weight_decay: float = 0.005
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 0.1
    accountant: str = "rdp"
    seed: int | None = None  # None: a secret random seed (kept in the run folder only)
    device: str = "auto"
    workers: int = 1
    checkpoint_every: int = 50
    eval_every: int | None = None
    model_name: str | None = None
    repo_id: str | None = None
    restart: bool = False


def max_steps_within(target: float, sigma: float, sample_rate: float, delta: float,
                     steps: int, accountant: Accountant) -> int:
    """The most steps (<= ``steps``) whose epsilon stays within ``target``."""
    if epsilon(sigma, sample_rate, steps, delta, accountant) <= target:
        return steps
    lo, hi = 0, steps  # epsilon(lo) <= target < epsilon(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon(sigma, sample_rate, mid, delta, accountant) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def noisy_mean_gradient(params: list[nn.Parameter], sigma: float, max_norm: float,
                        expected_batch_size: float, generator: torch.Generator, dist: Dist,
                        extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Replace each ``p.grad`` (this rank's clipped sum) by the noisy mean over all ranks:
    (sum over ranks + N(0, sigma^2 C^2), drawn once) / B. One all-reduce; ``extra`` (e.g.
    counts for the log) rides along noise-free and comes back summed."""
    device = params[0].device
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    size = flat.numel()
    if dist.main:
        flat += sigma * max_norm * torch.randn(size, generator=generator, device=device)
    if extra is not None:
        flat = torch.cat([flat, extra.to(device=device, dtype=flat.dtype)])
    dist.all_reduce_sum(flat)
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / expected_batch_size).view_as(p).to(p.dtype)
        offset += p.numel()
    return flat[size:] if extra is not None else None


class _Collate:
    """Stack a micro-batch; an empty one is an empty tensor of the right shape."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, items: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(items) if items else torch.empty(0, 3, self.size, self.size)


def _resolve_seed(seed: int | None, run_dir: Path, dist: Dist) -> int:
    """The given seed, else the one kept in the run folder, else a new secret one; rank 0
    decides and every rank gets the same."""
    if seed is not None:
        return seed
    chosen = torch.zeros(1, dtype=torch.int64, device=dist.device)
    if dist.main:
        saved = run_dir / "seed"
        if not saved.exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            saved.write_text(str(secrets.randbits(62)))
        chosen[0] = int(saved.read_text())
    dist.broadcast_([chosen])
    return int(chosen.item())


def train_dp(cfg: DPConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP-AdamW training and export the released repo; returns its path."""
    dist = dist or Dist.from_env(cfg.device)
    images = open_images(cfg.data)
    n = len(images)
    if cfg.dataset_size is not None and cfg.dataset_size != n:
        raise ValueError(f"--dataset-size {cfg.dataset_size} but {cfg.data} holds {n} images")
    if not 0 < cfg.batch_size <= n:
        raise ValueError(f"--batch-size must be in [1, n={n}], got {cfg.batch_size}")
    q = cfg.batch_size / n
    delta = cfg.delta if cfg.delta is not None else default_delta(n)
    kind = Accountant(cfg.accountant)
    if cfg.sigma is None and cfg.epsilon is None:
        raise ValueError("give --epsilon (sigma is calibrated) or --sigma")
    sigma = cfg.sigma if cfg.sigma is not None else calibrate(cfg.epsilon, delta, q, cfg.steps, kind)
    steps = cfg.steps if cfg.epsilon is None else max_steps_within(cfg.epsilon, sigma, q, delta, cfg.steps, kind)
    if steps == 0:
        raise AccountingError(
            f"a single step at sigma {sigma:g}, q {q:.4g} already exceeds epsilon {cfg.epsilon}"
        )
    out = Path(cfg.out)
    run_dir = open_run_dir(out, cfg.restart, dist)
    seed = _resolve_seed(cfg.seed, run_dir, dist)
    run = Run(run_dir, {**run_settings(cfg), "seed": seed}, dist)
    if dist.main and steps < cfg.steps:
        print(f"budget: stopping after step {steps} of {cfg.steps}; step {steps + 1} would exceed "
              f"epsilon {cfg.epsilon} ({kind.value}, delta {delta:.3g})", file=sys.stderr)

    mae, spec, init_ledger = load_mae(cfg.init)
    mae.to(dist.device)
    clipper = PerExampleClipper(mae, cfg.max_grad_norm)
    optimizer = make_adamw(mae, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(1000, cfg.steps // 10))
    scheduler = warmup_cosine(optimizer, warmup, cfg.steps)
    accountant = RDPAccountant()  # history only
    start = 0
    if (state := run.resume_state()) is not None:
        mae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        accountant.load_state_dict(state["accountant"])
        start = int(state["step"])
        if accountant.history and accountant.history != [(sigma, q, start)]:
            raise ValueError(f"checkpoint accountant history {accountant.history} does not match "
                             f"{start} steps at sigma {sigma}, q {q}")

    shard = rank_shard(n, dist.rank, dist.world)

    def plan(step: int) -> tuple[np.ndarray, list[np.ndarray]]:
        local = shard[poisson_sample(len(shard), q, seed, step, dist.rank)]
        return local, micro_batches(np.arange(len(local)), cfg.micro_batch_size)

    def batches() -> Any:
        for step in range(start, steps):
            local, parts = plan(step)
            for part in parts:
                yield [(int(i), step) for i in local[part]]

    transform = mae_transform(spec.img_size, *_mean_std(mae))
    loader = torch.utils.data.DataLoader(
        Augmented(images, transform, seed), batch_sampler=batches(), num_workers=cfg.workers,
        collate_fn=_Collate(spec.img_size), pin_memory=dist.device.type == "cuda",
        persistent_workers=False,
    )
    public = public_eval_batch(spec, mae.num_patches)
    eval_every = cfg.eval_every or max(1, steps // 20)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.type == "cuda"
           else contextlib.nullcontext())
    run.open(start, steps, "train-dp")
    if start == 0 and dist.main:
        run.log.write({"step": 0, "epsilon": 0.0, "public_loss": eval_loss(mae, public, dist.device)})
    it = iter(loader)
    try:
        for step in range(start, steps):
            local, parts = plan(step)
            masks = torch.rand(len(local), mae.num_patches,
                               generator=torch_generator(seed, MASKING, step, dist.rank))
            loss_sum = torch.zeros((), dtype=torch.float64)
            for part in parts:
                imgs = next(it)
                if len(part) == 0:
                    continue
                with amp:
                    r = clipper.accumulate(imgs.to(dist.device, non_blocking=True), masks[part].to(dist.device))
                loss_sum += r.losses.double().sum().cpu()
            noise = torch_generator(seed, NOISE, step, 0, device=dist.device)
            counts = noisy_mean_gradient(
                clipper.params, sigma, cfg.max_grad_norm, cfg.batch_size, noise, dist,
                extra=torch.stack([torch.tensor(float(len(local)), dtype=torch.float64), loss_sum]),
            )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            accountant.step(noise_multiplier=sigma, sample_rate=q)
            eps = composed_epsilon(accountant.history, delta, kind)
            sampled = int(counts[0].item())
            record = {"step": step + 1, "epsilon": eps, "sampled": sampled,
                      "train_loss": counts[1].item() / max(sampled, 1), "lr": scheduler.get_last_lr()[0]}
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                record["public_loss"] = eval_loss(mae, public, dist.device)
            run.step_done(record, sampled, {"loss": f"{record['train_loss']:.4f}", "eps": f"{eps:.3f}"})
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
                run.save({"step": step + 1, "model": mae.state_dict(), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict(), "accountant": accountant.state_dict()})
    finally:
        run.close()
    if accountant.history != [(sigma, q, steps)]:
        raise RuntimeError(f"accountant history {accountant.history} != {steps} steps at ({sigma}, {q})")
    if dist.main:
        _export(cfg, mae, spec, init_ledger, images, sigma=sigma, q=q, steps=steps, delta=delta,
                kind=kind, warmup=warmup, curves=run.records())
    dist.barrier()
    return out


def _mean_std(mae: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    cfg = mae.encoder.pretrained_cfg
    return tuple(cfg["mean"]), tuple(cfg["std"])


def _export(cfg: DPConfig, mae: Any, spec: Any, init_ledger: Any, images: Any, *, sigma: float,
            q: float, steps: int, delta: float, kind: Accountant, warmup: int,
            curves: list[dict[str, Any]]) -> None:
    n = len(images)
    name = cfg.dataset_name or images.name
    stage = DPStage.from_parameters(
        name="dp-pretrain",
        dataset=Dataset(name=name, size=n, fingerprint=images.fingerprint(),
                        description=f"{n} images; MAE pretraining with DP-AdamW"),
        sample_rate=q, noise_multiplier=sigma, steps=steps, clipping_norm=cfg.max_grad_norm,
        mechanism="DP-AdamW", delta=delta, accountant=kind,
        description="ViP step 2: masked-autoencoder training with DP-AdamW (per-example "
                    "clipping, Gaussian noise once per logical step, Poisson sampling)",
        hyperparameters={
            "lr": cfg.lr, "warmup_steps": warmup, "schedule": "cosine", "weight_decay": cfg.weight_decay,
            "betas": [cfg.beta1, cfg.beta2], "mask_ratio": mae.config.mask_ratio,
            "img_size": spec.img_size, "augmentation": "random resized crop (0.2-1), flip",
        },
    )
    prior = [s for s in init_ledger.stages if s.component == ENCODER]
    png = plot_curves(curves, "public_loss", "MAE loss on public procedural images",
                      f"DP-AdamW on {name}")
    model_name = cfg.model_name or Path(cfg.out).name
    export_encoder(
        cfg.out, mae.encoder, spec, [*prior, stage], model_name=model_name, repo_id=cfg.repo_id,
        summary=(f"A {spec.arch} encoder trained with the ViP recipe: MAE pretraining on procedural "
                 f"images, then DP-AdamW on {name} ({n} images). The loss curve is measured on "
                 "public procedural images, so publishing it costs no privacy."),
        decoder=mae.decoder_state_dict(), decoder_config=mae.config.to_dict(),
        extra_files={CURVES_FILE: png}, overwrite=True,
    )


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m training.dp`` entry point: the arguments of ``vip-hub train-dp``."""
    from vip_hub.cli import main as cli_main

    return cli_main(["train-dp", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
