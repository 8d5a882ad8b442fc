"""A model held in memory for inference: the verified encoder, its probe heads, its text
decoder (DP-Cap repos that caption), and the batcher that runs its forward passes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vip_hub import load_encoder
from vip_hub.loading import CaptioningModel
from vip_hub.models.features import Pooling
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.repo.heads import HeadInfo, LinearProbe, list_heads, load_head

from ..metrics import Metrics, ModelSeries
from ..settings import InferenceSettings
from .batcher import Batcher, WorkItem

__all__ = ["LoadedModel", "Task"]


@dataclass(frozen=True)
class Task:
    """What to compute for a work item: feature modes, a head's class probabilities, captions
    of at most ``caption_tokens`` tokens, or the caption loss of each of ``texts`` (zero-shot)."""

    poolings: tuple[Pooling, ...] = ()
    head: str | None = None
    caption_tokens: int | None = None
    texts: torch.Tensor | None = None  # (labels, T) token ids

    @property
    def decodes(self) -> bool:
        """Whether the text decoder runs (captions or zero-shot) rather than the features."""
        return self.caption_tokens is not None or self.texts is not None

    @property
    def passes_per_image(self) -> int:
        """What one image costs in its batcher's queue: one pass, or for zero-shot one
        text-decoder pass per label (``text_losses`` scores every label for every image)."""
        return 1 if self.texts is None else int(self.texts.shape[0])


@dataclass
class LoadedModel:
    """An encoder (eval mode, verified) with its heads and batcher."""

    repo_id: str
    commit: str
    encoder: Any  # vip_hub.Encoder
    heads: dict[str, tuple[LinearProbe, HeadInfo]]
    series: ModelSeries | None = None
    device: torch.device = torch.device("cpu")
    captions: CaptioningModel | None = None
    batcher: Batcher | None = None
    private: bool = False

    @property
    def ledger(self) -> PrivacyLedger:
        return self.encoder.ledger

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:10]}"

    @property
    def metrics_label(self) -> str:
        """The model in metrics' labels, which anyone may read: a private repo's name is left
        out."""
        return f"private@{self.commit[:10]}" if self.private else self.label

    def feature_dims(self) -> dict[str, int]:
        return {p: self.encoder.feature_dim(p) for p in self.encoder.poolings}

    @classmethod
    def load(
        cls,
        repo_id: str,
        commit: str,
        folder: Path,
        settings: InferenceSettings,
        metrics: Metrics,
        device: torch.device,
        private: bool = False,
    ) -> LoadedModel:
        """Load onto ``device`` (verifying the ledger), warm up, and start the batcher. Runs in a
        worker thread."""
        encoder = load_encoder(folder, verify=True, device=device)
        heads = {}
        for name in list_heads(folder):
            head, info = load_head(folder, name, encoder.ledger)  # the verified heads
            heads[name] = (head.to(device), info)
        captions = CaptioningModel.from_encoder(encoder) if encoder.can_caption else None
        model = cls(repo_id, commit, encoder, heads, None, device, captions, private=private)
        model.warm_up()
        model.series = series = ModelSeries(metrics, model.metrics_label)
        model.batcher = Batcher(
            model.metrics_label,
            model.run_batch,
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_wait_ms / 1000,
            max_queue_images=settings.max_queue_images,
            on_depth=series.queue_depth,
            on_reject=series.rejected,
        )
        return model

    def close(self) -> None:
        """Finish the queued work and stop the batcher thread."""
        if self.batcher is not None:
            self.batcher.close()

    def warm_up(self) -> None:
        """One forward pass per head and mode (and one decoding step) on a blank batch, so first
        requests run warm."""
        size = self.encoder.spec.img_size
        with torch.inference_mode():
            x = torch.zeros(2, 3, size, size, device=self.device)
            feats = self.encoder.features(x, self.encoder.poolings)
            for head, info in self.heads.values():
                head(feats[info.pooling])
            if self.captions is not None:
                self.captions.captioner.generate(x, 1)

    @torch.inference_mode()
    def run_batch(self, items: list[WorkItem]) -> None:
        """Forward the items' images as one batch; set each item's result:
        ``(output, enqueued, started, forward seconds)``."""
        start = time.perf_counter()
        x = torch.cat([i.images for i in items]) if len(items) > 1 else items[0].images
        x = x.to(self.device, non_blocking=True)
        rows, offset = [], 0
        for item in items:
            rows.append(slice(offset, offset + item.size))
            offset += item.size
        results: list[Any] = [None] * len(items)
        encode = [k for k, item in enumerate(items) if not item.task.decodes]
        if encode:
            self._run_features(
                [items[k] for k in encode], torch.cat([x[rows[k]] for k in encode]), encode, results
            )
        captions = [k for k, item in enumerate(items) if item.task.caption_tokens is not None]
        if captions:
            self._run_captions(
                [items[k] for k in captions],
                torch.cat([x[rows[k]] for k in captions]),
                captions,
                results,
            )
        for k, item in enumerate(items):
            if item.task.texts is not None:
                assert self.captions is not None
                results[k] = self.captions.captioner.text_losses(
                    x[rows[k]], item.task.texts.to(self.device)
                ).cpu()
        forward_s = (
            time.perf_counter() - start
        )  # after the copies back: a CUDA forward is asynchronous
        if self.series is not None:  # before the results: the event loop wakes on those
            self.series.batch(x.shape[0], forward_s, [i.started - i.enqueued for i in items])
        for item, result in zip(items, results, strict=True):
            item.future.set_result((result, item.enqueued, item.started, forward_s))

    def _run_features(
        self, items: list[WorkItem], x: torch.Tensor, slots: list[int], results: list[Any]
    ) -> None:
        """Feature modes and head probabilities of ``items`` (images ``x``), into
        ``results[slots]``."""
        modes: set[Pooling] = set()
        for item in items:
            modes.update(item.task.poolings)
            if item.task.head is not None:
                modes.add(self.heads[item.task.head][1].pooling)
        feats = self.encoder.features(x, tuple(sorted(modes)))
        offset = 0
        for slot, item in zip(slots, items, strict=True):
            rows = slice(offset, offset + item.size)
            offset += item.size
            if item.task.head is not None:
                head, info = self.heads[item.task.head]
                results[slot] = torch.softmax(head(feats[info.pooling][rows]).float(), dim=-1).cpu()
            else:
                results[slot] = {m: feats[m][rows].float().cpu() for m in item.task.poolings}

    def _run_captions(
        self, items: list[WorkItem], x: torch.Tensor, slots: list[int], results: list[Any]
    ) -> None:
        """Greedy captions of ``items`` in one decoding loop: each caption is the prefix of the
        longest budget's, so it is cut at its own item's ``caption_tokens``."""
        assert self.captions is not None
        ids = self.captions.captioner.generate(x, max(item.task.caption_tokens for item in items))
        offset = 0
        for slot, item in zip(slots, items, strict=True):
            rows = ids[offset : offset + item.size]
            offset += item.size
            results[slot] = [
                self.captions.tokenizer.decode(r[: item.task.caption_tokens]) for r in rows
            ]
