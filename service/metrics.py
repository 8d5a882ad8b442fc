"""Prometheus metrics of one app (its own registry, so several apps can live in a process)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics", "ModelSeries"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Request, queue, batch and stage-timing metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vip_hub_requests_total", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "vip_hub_request_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            buckets=_LATENCY,
            registry=r,
        )
        self.in_flight = Gauge(
            "vip_hub_requests_in_flight",
            "HTTP requests received and not yet answered (what a drain on SIGTERM waits for)",
            registry=r,
        )
        self.queue_depth = Gauge(
            "vip_hub_queue_images",
            "Image passes waiting per model (a zero-shot image counts once per label)",
            ["model"],
            registry=r,
        )
        self.batch_size = Histogram(
            "vip_hub_batch_images",
            "Images per forward batch",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.queue_seconds = Histogram(
            "vip_hub_queue_seconds",
            "Time an image waited in the queue",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.preprocess_seconds = Histogram(
            "vip_hub_preprocess_seconds",
            "Decoding and preprocessing per request",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "vip_hub_forward_seconds",
            "Forward pass per batch",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.page_renders = Counter(
            "vip_hub_page_renders_total",
            "Model pages rendered from a commit's files (once per commit while cached)",
            registry=r,
        )
        self.loaded_models = Gauge("vip_hub_loaded_models", "Models held in memory", registry=r)
        self._copies: dict[str, int] = {}  # a model label: its live ModelSeries
        self._queued: dict[str, int] = {}  # a model label: its live copies' queues, summed
        self._copies_lock = threading.Lock()
        self.compositions = Counter(
            "vip_hub_compositions_total",
            "Dataset-page compositions computed (each kept until the dataset's releases change)",
            registry=r,
        )
        self.rejected = Counter(
            "vip_hub_rejected_total",
            "Requests refused by the batcher",
            ["model", "reason"],
            registry=r,
        )

    def _hold(self, label: str) -> None:
        """One more loaded copy records under ``label`` (``ModelSeries``)."""
        with self._copies_lock:
            self._copies[label] = self._copies.get(label, 0) + 1

    def _queue_changed(self, label: str, change: int) -> None:
        """A live copy's queue under ``label`` grew by ``change`` (negative: shrank); the gauge
        shows every live copy's queue (an evicted one draining, one loaded again) summed."""
        with self._copies_lock:
            queued = self._queued[label] = self._queued.get(label, 0) + change
            self.queue_depth.labels(label).set(queued)

    def _release(self, label: str, queued: int) -> None:
        """A copy recording under ``label``, ``queued`` images still in its queue, retired: the
        label's series go with the last one."""
        with self._copies_lock:
            self._copies[label] -= 1
            if self._copies[label]:
                self._queued[label] -= queued
                self.queue_depth.labels(label).set(self._queued[label])
                return
            del self._copies[label]
            self._queued.pop(label, None)
            self.forget_model(label)

    def forget_model(self, label: str) -> None:
        """Remove the series of the model ``label`` (``repo@commit``): a model's labels come
        from the commits requests name, so an evicted model's must go with it."""
        for metric in (
            self.queue_depth,
            self.batch_size,
            self.queue_seconds,
            self.preprocess_seconds,
            self.forward_seconds,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(label)
        reasons = {
            sample.labels["reason"]
            for family in self.rejected.collect()
            for sample in family.samples
            if sample.labels.get("model") == label
        }
        for reason in reasons:
            with contextlib.suppress(KeyError):
                self.rejected.remove(label, reason)


class ModelSeries:
    """One loaded copy of a model's series (labelled ``label``), recorded until ``retire``: a
    batch still running when its model was evicted, or a request it still answers, records
    nothing after its series went."""

    def __init__(self, metrics: Metrics, label: str) -> None:
        self.metrics, self.label = metrics, label
        self._lock = threading.Lock()
        self._retired = False
        self._queued = 0
        metrics._hold(label)

    def queue_depth(self, depth: int) -> None:
        """The image passes now waiting in this copy's queue."""
        with self._lock:
            if not self._retired:
                self.metrics._queue_changed(self.label, depth - self._queued)
                self._queued = depth

    def rejected(self, reason: str) -> None:
        """A request the model's batcher refused (``queue_full``, ``deadline``)."""
        with self._lock:
            if not self._retired:
                self.metrics.rejected.labels(self.label, reason).inc()

    def preprocessed(self, seconds: float) -> None:
        """A request's images decoded and transformed in ``seconds``."""
        with self._lock:
            if not self._retired:
                self.metrics.preprocess_seconds.labels(self.label).observe(seconds)

    def batch(self, size: int, forward_s: float, waits: Sequence[float]) -> None:
        """A forward pass over ``size`` images, and each item's wait in the queue."""
        with self._lock:
            if self._retired:
                return
            self.metrics.batch_size.labels(self.label).observe(size)
            self.metrics.forward_seconds.labels(self.label).observe(forward_s)
            for wait in waits:
                self.metrics.queue_seconds.labels(self.label).observe(wait)

    def retire(self) -> None:
        """Record nothing more; the label's series go when no other copy of the model (loaded
        again since) records under it."""
        with self._lock:
            if not self._retired:
                self._retired = True
                self.metrics._release(self.label, self._queued)
