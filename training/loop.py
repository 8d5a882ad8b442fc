"""What every training run shares: its run folder (checkpoint, JSONL log), resume, the
progress bar, building the MAE, and the public evaluation loss."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from vip_hub.loading import load_encoder
from vip_hub.models import EncoderSpec, create_encoder
from vip_hub.repo_format import MAE_DECODER_FILE as DECODER_FILE, META_DECODER

from .checkpoint import load_checkpoint, save_checkpoint
from .distributed import Dist
from .mae import MAE, DecoderConfig
from .runlog import RunLog
from .sampling import MASKING, torch_generator
from .synthetic import SyntheticImages

__all__ = ["Run", "load_mae", "new_mae", "open_run_dir", "public_eval_batch", "run_settings"]

EVAL_SEED = 2**31 - 7  # the public evaluation images: a stream training never draws from
EVAL_IMAGES = 64
# Recipe fields that name outputs or resources, not the run: they may change across a resume.
NOT_RUN_SETTINGS = ("out", "device", "workers", "checkpoint_every", "restart", "model_name", "repo_id")


def run_settings(cfg: Any) -> dict[str, Any]:
    """A recipe dataclass's fields that must match for a checkpoint to be resumed."""
    return {k: v for k, v in asdict(cfg).items() if k not in NOT_RUN_SETTINGS}


def open_run_dir(out: str | Path, restart: bool, dist: Dist) -> Path:
    """The run folder ``<out>.run/`` of an output; ``restart`` empties it first (rank 0)."""
    run_dir = Path(out).with_name(Path(out).name + ".run")
    if restart and dist.main and run_dir.exists():
        shutil.rmtree(run_dir)
    dist.barrier()
    return run_dir


def new_mae(spec: EncoderSpec, decoder: DecoderConfig) -> MAE:
    """A freshly initialised MAE (MAE recipe initialisation)."""
    return MAE(create_encoder(spec, mae_init=True), decoder)


def load_mae(repo: str | Path) -> tuple[MAE, EncoderSpec, Any]:
    """The MAE of an exported repo (encoder and ``mae_decoder.safetensors``), and its ledger."""
    enc = load_encoder(repo)
    path = Path(enc.path) / DECODER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{repo} has no {DECODER_FILE}: DP training starts from an MAE (train one with "
            "`vip-hub train-syn`)"
        )
    with safe_open(path, "pt") as f:
        cfg = json.loads((f.metadata() or {}).get(META_DECODER) or "{}")
    mae = MAE(enc.model.train(), DecoderConfig(**cfg))
    missing, unexpected = mae.load_state_dict(
        {f"encoder.{k}": v for k, v in enc.model.state_dict().items()} | load_file(path), strict=False
    )
    if missing or unexpected:
        raise ValueError(f"{path} does not match the decoder: missing {missing}, unexpected {unexpected}")
    return mae, enc.spec, enc.ledger


def public_eval_batch(spec: EncoderSpec, num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed procedural images and masks: a loss curve on them reveals nothing private."""
    data = SyntheticImages(spec.img_size, seed=EVAL_SEED)
    images = torch.stack([data[i] for i in range(EVAL_IMAGES)])
    noise = torch.rand(EVAL_IMAGES, num_patches, generator=torch_generator(EVAL_SEED, MASKING, 0))
    return images, noise


@torch.no_grad()
def eval_loss(mae: MAE, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> float:
    """Mean MAE loss on a fixed batch (eval mode, no gradient)."""
    was = mae.training
    mae.eval()
    loss = mae(batch[0].to(device), batch[1].to(device)).mean().item()
    mae.train(was)
    return loss


class Run:
    """The run folder ``<out>.run/``: checkpoint, log, settings; plus the progress bar."""

    def __init__(self, run_dir: Path, config: dict[str, Any], dist: Dist):
        self.dir = run_dir
        self.config = config
        self.dist = dist
        self.checkpoint_path = self.dir / "checkpoint.pt"
        self.log: RunLog | None = None
        self.bar: tqdm | None = None
        self._t0 = time.perf_counter()
        self._images = 0

    def resume_state(self) -> dict[str, Any] | None:
        """The checkpoint to resume from (checked against this run's settings), if any."""
        return load_checkpoint(self.checkpoint_path, self.config) if self.checkpoint_path.exists() else None

    def open(self, start: int, total: int, desc: str) -> None:
        """Start logging and the progress bar at step ``start`` of ``total``."""
        if self.dist.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "settings.json").write_text(json.dumps(self.config, indent=2) + "\n")
            self.log = RunLog(self.dir / "log.jsonl", start)
            self.bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True)

    def step_done(self, record: dict[str, Any], images: int, postfix: dict[str, str]) -> None:
        """Log one step (rank 0) and advance the bar with images/s."""
        self._images += images
        if not self.dist.main:
            return
        rate = self._images / max(time.perf_counter() - self._t0, 1e-9)
        self.log.write({**record, "images_per_s": round(rate, 2)})
        self.bar.set_postfix({**postfix, "img/s": f"{rate:.1f}"}, refresh=False)
        self.bar.update(1)

    def save(self, state: dict[str, Any]) -> None:
        if self.dist.main:
            save_checkpoint(self.checkpoint_path, {"config": self.config, **state})
        self.dist.barrier()

    def records(self) -> list[dict[str, Any]]:
        return self.log.records() if self.log else []

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.log:
            self.log.close()
