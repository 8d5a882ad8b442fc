"""A model held in memory for inference: the verified encoder, its probe heads, its privacy
summaries, and the batcher that runs its forward passes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vip_hub import load_encoder
from vip_hub.device import pick_device
from vip_hub.features import POOLINGS, Pooling, extract_features
from vip_hub.heads import HeadInfo, LinearProbe, list_heads, load_head
from vip_hub.ledger import PrivacyLedger

from ..metrics import Metrics
from ..settings import InferenceSettings
from .batcher import Batcher, WorkItem

__all__ = ["LoadedModel", "Task"]


@dataclass(frozen=True)
class Task:
    """What to compute for a work item: feature modes, or a head's class probabilities."""

    poolings: tuple[Pooling, ...] = ()
    head: str | None = None


@dataclass
class LoadedModel:
    """An encoder (eval mode, verified) with its heads and batcher."""

    repo_id: str
    commit: str
    encoder: Any  # vip_hub.Encoder
    heads: dict[str, tuple[LinearProbe, HeadInfo]]
    metrics: Metrics | None = None
    device: torch.device = torch.device("cpu")
    batcher: Batcher | None = None
    last_used: float = field(default_factory=time.monotonic)

    @property
    def ledger(self) -> PrivacyLedger:
        return self.encoder.ledger

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:10]}"

    def feature_dims(self) -> dict[str, int]:
        return {p: self.encoder.feature_dim(p) for p in POOLINGS}

    @classmethod
    def load(cls, repo_id: str, commit: str, folder: Path, settings: InferenceSettings,
             metrics: Metrics) -> "LoadedModel":
        """Load (verifying the ledger), warm up, and start the batcher. Runs in a worker thread."""
        device = pick_device(settings.device)
        encoder = load_encoder(folder, verify=True, device=device)
        heads = {}
        for name in list_heads(folder):
            head, info = load_head(folder, name)
            heads[name] = (head.to(device), info)
        model = cls(repo_id, commit, encoder, heads, metrics, device)
        model.warm_up()
        label = model.label
        model.batcher = Batcher(
            label, model.run_batch, max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_wait_ms / 1000, max_queue_images=settings.max_queue_images,
            on_depth=metrics.queue_depth.labels(label).set,
        )
        return model

    def close(self) -> None:
        """Finish the queued work and stop the batcher thread."""
        if self.batcher is not None:
            self.batcher.close()

    def warm_up(self) -> None:
        """One forward pass per head and mode on a blank batch, so first requests run warm."""
        size = self.encoder.spec.img_size
        with torch.inference_mode():
            feats = extract_features(self.encoder.model, torch.zeros(2, 3, size, size, device=self.device), POOLINGS)
            for head, info in self.heads.values():
                head(feats[info.pooling])

    @torch.inference_mode()
    def run_batch(self, items: list[WorkItem]) -> None:
        """Forward the items' images as one batch; set each item's result:
        ``(output, enqueued, started, forward seconds)``."""
        start = time.perf_counter()
        modes: set[Pooling] = set()
        for item in items:
            task: Task = item.task
            modes.update(task.poolings)
            if task.head is not None:
                modes.add(self.heads[task.head][1].pooling)
        x = torch.cat([i.images for i in items]) if len(items) > 1 else items[0].images
        x = x.to(self.device, non_blocking=True)
        feats = extract_features(self.encoder.model, x, tuple(sorted(modes)))
        results: list[Any] = []
        offset = 0
        for item in items:
            rows = slice(offset, offset + item.size)
            offset += item.size
            if item.task.head is not None:
                head, info = self.heads[item.task.head]
                results.append(torch.softmax(head(feats[info.pooling][rows]).float(), dim=-1).cpu())
            else:
                results.append({m: feats[m][rows].float().cpu() for m in item.task.poolings})
        forward_s = time.perf_counter() - start  # after the copies back: a CUDA forward is asynchronous
        if self.metrics is not None:  # before the results: the event loop wakes on those
            self.metrics.batch_size.labels(self.label).observe(x.shape[0])
            self.metrics.forward_seconds.labels(self.label).observe(forward_s)
            for item in items:
                self.metrics.queue_seconds.labels(self.label).observe(item.started - item.enqueued)
        for item, result in zip(items, results):
            item.future.set_result((result, item.enqueued, item.started, forward_s))
