"""Linear-probe heads stored with a released encoder, under ``heads/<name>/``.

A head is the MAE / ViP linear probe: BatchNorm1d without affine parameters (eps 1e-6),
then a Linear layer, on top of one of the encoder's feature modes. Its folder holds::

    heads/<name>/head.safetensors   weights; metadata: pooling, feature dim, labels
    heads/<name>/labels.json        class names, index order
    heads/<name>/metrics.json       evaluation of the head (e.g. top-1 on a held-out split)

Its training is a ledger stage with ``component = "heads/<name>"`` (DP or not), added to the
repo's ledger when the head is saved.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import EvalResult
from safetensors.torch import load_file, save_file

from .artifacts import read_safetensors_header
from .features import POOLINGS, Pooling
from .ledger import DPStage, NonPrivateStage, PrivacyLedger

__all__ = ["HEADS_DIR", "HeadInfo", "LinearProbe", "head_component", "list_heads", "load_head", "save_head"]

HEADS_DIR = "heads"
HEAD_FILE = "head.safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class LinearProbe(torch.nn.Module):
    """BatchNorm1d (no affine, eps 1e-6) then Linear, as in MAE's and ViP's linear probing."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(in_features, affine=False, eps=1e-6)
        self.linear = torch.nn.Linear(in_features, num_classes)
        torch.nn.init.trunc_normal_(self.linear.weight, std=0.01)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(features))


@dataclass
class HeadInfo:
    """What a head needs besides its weights."""

    name: str
    pooling: Pooling
    labels: list[str]
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def component(self) -> str:
        return head_component(self.name)


def head_component(name: str) -> str:
    """The ledger component of head ``name``."""
    if not _NAME.match(name):
        raise ValueError(f"head name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return f"{HEADS_DIR}/{name}"


def save_head(
    repo_dir: str | os.PathLike[str],
    head: LinearProbe,
    info: HeadInfo,
    stage: NonPrivateStage | DPStage,
    eval_result: EvalResult | None = None,
) -> PrivacyLedger:
    """Add (or replace) head ``info.name`` in a repo, with its ledger stage; returns the ledger."""
    from .repo import update_repo

    component = head_component(info.name)
    if stage.component != component:
        raise ValueError(f"the head's ledger stage must have component {component!r}")
    if info.pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {info.pooling!r}")
    if len(info.labels) != head.linear.out_features:
        raise ValueError(f"{len(info.labels)} labels for {head.linear.out_features} outputs")
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    meta = {
        "format": "pt",
        "vip_hub.pooling": info.pooling,
        "vip_hub.in_features": str(head.linear.in_features),
        "vip_hub.labels": json.dumps(info.labels),
    }
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / HEAD_FILE
        save_file(tensors, weights, metadata=meta)
        return update_repo(
            repo_dir,
            add_stages=[stage],
            add_files={
                f"{component}/{HEAD_FILE}": weights,
                f"{component}/labels.json": (json.dumps(info.labels, indent=1) + "\n").encode(),
                f"{component}/metrics.json": (json.dumps(info.metrics, indent=1) + "\n").encode(),
            },
            add_eval_results=[eval_result] if eval_result else [],
            replace_component=component,
        )


def list_heads(repo_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the heads stored in a repo folder."""
    root = Path(repo_dir) / HEADS_DIR
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / HEAD_FILE).is_file())


def load_head(repo_dir: str | os.PathLike[str], name: str) -> tuple[LinearProbe, HeadInfo]:
    """Load head ``name`` (eval mode) and its info from a repo folder."""
    folder = Path(repo_dir) / head_component(name)
    path = folder / HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no head {name!r} in {repo_dir}")
    meta = read_safetensors_header(path)[0].get("__metadata__") or {}
    labels = json.loads(meta["vip_hub.labels"])
    state = load_file(path)
    head = LinearProbe(int(meta["vip_hub.in_features"]), len(labels))
    head.load_state_dict(state)
    metrics_file = folder / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    return head.eval(), HeadInfo(name, meta["vip_hub.pooling"], labels, metrics)  # type: ignore[arg-type]
