"""Linear-probe heads stored with a released encoder, each in its own folder under ``HEADS_DIR``.

A head is the MAE / ViP linear probe: BatchNorm1d without affine parameters (eps 1e-6),
then a Linear layer, on top of one of the encoder's feature modes. Its folder (layout in
``vip_hub.repo_format``) holds the weights (metadata: pooling, feature dim, labels), the
class names in index order, and its evaluation metrics with its feature mode
(``METRICS_POOLING``, the binding of the metadata's, which the tensors digest leaves out).

Its training is a ledger stage whose ``component`` is the head's folder (DP or not), added to the
repo's ledger when the head is saved, or a stage already in the ledger that trained it jointly
with the encoder (one mechanism, its ``also_trains`` naming the head: end-to-end fine-tuning).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import EvalResult
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, MissingInputError, TamperedFileError
from ..models.features import Pooling, check_pooling
from ..privacy.ledger import DPStage, NonPrivateStage, PrivacyLedger
from ..repo_format import (
    HEAD_LABELS,
    HEAD_METRICS,
    HEAD_WEIGHTS,
    HEAD_WEIGHTS_GLOB,
    META_IN_FEATURES,
    META_LABELS,
    META_POOLING,
    METRICS_POOLING,
    head_component,
    head_file,
    heads_in,
)
from .artifacts import read_safetensors_metadata
from .verify import Problem, check_loaded_tensors, verified_bytes

__all__ = ["HeadInfo", "LinearProbe", "head_pooling", "list_heads", "load_head", "save_head"]


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


def save_head(
    repo_dir: str | os.PathLike[str],
    head: LinearProbe,
    info: HeadInfo,
    stage: NonPrivateStage | DPStage | None,
    eval_result: EvalResult | None = None,
    signing_key: str | os.PathLike[str] | None = None,
    draws: Sequence[DPStage] = (),
) -> PrivacyLedger:
    """Add (or replace) head ``info.name`` in a repo, with its ledger stage (None: a stage of the
    repo's ledger trained it jointly, its ``also_trains`` names the head), the stages of its
    unreleased ``draws`` (other DP draws of the head whose results the repo reports) and its card
    result (bound to the head by ``metric_config``, so a replaced head's goes with it), signed
    with ``signing_key`` if given (``update_repo``); returns the ledger."""
    from .files import update_repo

    component = head_component(info.name)
    if stage is None:
        ledger = PrivacyLedger.read(repo_dir)
        if not any(component in s.also_trains for s in ledger.stages):
            raise ConfigError(
                f"no stage of {repo_dir}'s ledger trained {component} jointly: give its own stage"
            )
    if any(s.component != component for s in [*([stage] if stage else []), *draws]):
        raise ConfigError(f"the head's ledger stages must have component {component!r}")
    if draws and not isinstance(stage, DPStage):
        raise ConfigError("only a head with its own DP stage has other draws")
    check_pooling(info.pooling)
    if len(info.labels) != head.linear.out_features:
        raise ConfigError(f"{len(info.labels)} labels for {head.linear.out_features} outputs")
    if info.metrics.get(METRICS_POOLING, info.pooling) != info.pooling:
        raise ConfigError(f"the head's metrics name another feature mode than {info.pooling!r}")
    metrics = {**info.metrics, METRICS_POOLING: info.pooling}  # binds the metadata's mode
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    meta = {
        "format": "pt",
        META_POOLING: info.pooling,
        META_IN_FEATURES: str(head.linear.in_features),
        META_LABELS: json.dumps(info.labels),
    }
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / HEAD_WEIGHTS
        save_file(tensors, weights, metadata=meta)
        return update_repo(
            repo_dir,
            add_stages=[stage, *draws] if stage is not None else [],
            add_files={
                head_file(info.name, HEAD_WEIGHTS): weights,
                head_file(info.name, HEAD_LABELS): (
                    json.dumps(info.labels, indent=1) + "\n"
                ).encode(),
                head_file(info.name, HEAD_METRICS): (json.dumps(metrics, indent=1) + "\n").encode(),
            },
            add_eval_results=[replace(eval_result, metric_config=component)] if eval_result else [],
            signing_key=signing_key,
            replace_component=component,
        )


def list_heads(repo_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the heads stored in a repo folder."""
    root = Path(repo_dir)
    return heads_in(p.relative_to(root).as_posix() for p in root.glob(HEAD_WEIGHTS_GLOB))


def head_pooling(weights: str | os.PathLike[str]) -> Pooling:
    """The feature mode a head's weights file says it reads (from its metadata only)."""
    return read_safetensors_metadata(weights).get(META_POOLING, "vip")


def load_head(
    repo_dir: str | os.PathLike[str], name: str, ledger: PrivacyLedger | None = None
) -> tuple[LinearProbe, HeadInfo]:
    """Load head ``name`` (eval mode) and its info from a repo folder; given the repo's verified
    ``ledger``, its tensors and labels must be the ones that ledger binds (else a
    TamperedFileError)."""
    rel = head_file(name, HEAD_WEIGHTS)
    path = Path(repo_dir) / rel
    if not path.is_file():
        raise MissingInputError(f"no head {name!r} in {repo_dir}")
    meta = read_safetensors_metadata(path)
    labels = json.loads(meta[META_LABELS])
    head = LinearProbe(int(meta[META_IN_FEATURES]), len(labels))
    tensors = load_file(path)
    if ledger is not None:
        check_loaded_tensors(ledger, rel, path, tensors)
        listed = head_file(name, HEAD_LABELS)  # the digest leaves the metadata's labels out
        if json.loads(verified_bytes(ledger, listed, Path(repo_dir) / listed)) != labels:
            raise TamperedFileError(
                [
                    Problem(
                        rel,
                        f"changed after verification: its labels are not {listed}'s",
                        TamperedFileError,
                    )
                ]
            )
    head.load_state_dict(tensors)
    rel_metrics = head_file(name, HEAD_METRICS)
    metrics_file = Path(repo_dir) / rel_metrics
    if ledger is not None:  # the metrics bind the feature mode the digest leaves out
        metrics = json.loads(verified_bytes(ledger, rel_metrics, metrics_file))
        if metrics.get(METRICS_POOLING) != meta[META_POOLING]:
            raise TamperedFileError(
                [
                    Problem(
                        rel,
                        f"changed after verification: its feature mode is not {rel_metrics}'s",
                        TamperedFileError,
                    )
                ]
            )
    else:
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    return head.eval(), HeadInfo(name, meta[META_POOLING], labels, metrics)
