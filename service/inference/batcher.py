"""Dynamic batching for one model: a bounded queue and a worker thread that forms batches of
up to ``max_batch_size`` images, waiting at most ``max_wait`` after the oldest arrival (and
only while more images are being preprocessed), and runs them with ``run_batch`` off the
event loop. The queue's bound, ``max_queue_images``, counts image passes: an image once, a
zero-shot image once per label (each is a text-decoder pass), so a request's share of the queue
is the work it holds the worker for.

Work items carry a ``concurrent.futures.Future``: the asyncio side awaits it (wrapped), a
client that goes away cancels it, and the worker skips cancelled or expired items before
computing anything.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DeadlineExceeded, QueueFull, ShuttingDown

CLOSE_WAIT_S = 30.0
"""How long ``Batcher.close`` waits for the work it finishes (a forward past it runs on, its
batcher's thread with it, and records no metrics: ``ModelSeries.retire``)."""

__all__ = ["Batcher", "WorkItem"]


@dataclass
class WorkItem:
    """Preprocessed images of one request (or one slice of it) and what to compute."""

    images: torch.Tensor
    task: Any
    deadline: float
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    passes_per_image: int = 1  # the task's (Task.passes_per_image): labels for zero-shot

    @property
    def size(self) -> int:
        return int(self.images.shape[0])

    @property
    def cost(self) -> int:
        """Its share of the queue's ``max_queue_images``: image passes (images x passes each)."""
        return self.size * self.passes_per_image


class Batcher:
    """One worker thread per model; ``run_batch(items)`` sets each item's future result."""

    def __init__(
        self,
        name: str,
        run_batch: Callable[[list[WorkItem]], None],
        *,
        max_batch_size: int,
        max_wait_s: float,
        max_queue_images: int,
        on_depth: Callable[[int], None] = lambda depth: None,
        on_reject: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.name = name
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue_images = max_queue_images
        self._on_depth = on_depth
        self._on_reject = on_reject  # a refused request's reason: queue_full, deadline
        self._clock = (
            clock  # the time of enqueue stamps, the fill wait and deadlines (tests inject theirs)
        )
        self._incoming = 0  # images announced by expect() and not yet submitted or withdrawn
        self._items: deque[WorkItem] = deque()
        self._queued = 0
        self._closing = False
        self._stopped = False  # the worker has returned: nothing queued from now on would run
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"batcher:{name}", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Image passes waiting (not yet in a running batch): an image counts once, a zero-shot
        image once per label."""
        return self._queued

    def expect(self, n: int) -> None:
        """Announce ``n`` images on their way (being decoded): a forming batch waits for them,
        up to ``max_wait``, until they are submitted or withdrawn."""
        with self._cond:
            self._incoming += n

    def withdraw(self, n: int) -> None:
        """``n`` announced images will not come (their request failed before submitting)."""
        with self._cond:
            self._incoming -= n
            self._cond.notify()

    def submit(self, items: list[WorkItem], announced: int = 0) -> None:
        """Queue a request's items, all or none; 429 when the queue is full, 503 when closing
        (except images announced before: a model evicted while they were decoded still runs
        them). Accepted, they settle ``announced`` images of ``expect``; refused, the caller
        withdraws them."""
        cost = sum(i.cost for i in items)
        with self._cond:
            if self._stopped or (self._closing and not announced):
                raise ShuttingDown()
            if self._queued + cost > self.max_queue_images:
                self._on_reject("queue_full")
                raise QueueFull(
                    f"{self.name}: queue full ({self._queued} image passes waiting, {cost} more "
                    f"asked for, limit {self.max_queue_images}: inference.max_queue_images)"
                )
            now = self._clock()
            for item in items:
                item.enqueued = now
            self._items.extend(items)
            self._incoming -= announced
            self._queued += cost
            self._on_depth(self._queued)
            self._cond.notify()

    def close(self) -> None:
        """Stop accepting work, finish what is queued, running or announced (being decoded),
        then stop the thread; waits ``CLOSE_WAIT_S`` at most."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(CLOSE_WAIT_S)

    def _next_batch(self) -> list[WorkItem] | None:
        with self._cond:
            while not self._items:
                if self._closing and self._incoming <= 0:
                    self._stopped = True
                    return None
                self._cond.wait()
            # Wait for more work only while some is known to be on its way (being decoded and
            # preprocessed), and never past max_wait after the oldest arrival: a lone request
            # runs at once.
            fill_by = self._items[0].enqueued + self.max_wait_s
            while (
                sum(i.size for i in self._items) < self.max_batch_size
                and not self._closing
                and self._incoming > 0
                and (remaining := fill_by - self._clock()) > 0
            ):
                self._cond.wait(min(remaining, 0.001))
            batch, size = [], 0
            while self._items and size + self._items[0].size <= self.max_batch_size:
                item = self._items.popleft()
                size += item.size
                batch.append(item)
            if not batch:  # a single item larger than a batch runs alone
                batch.append(self._items.popleft())
            self._queued -= sum(i.cost for i in batch)
            self._on_depth(self._queued)
            return batch

    def _loop(self) -> None:
        try:
            self._serve()
        finally:  # the model holds this batcher: without the cycle, its last reference frees it
            self._run_batch = _stopped

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            now = self._clock()
            live = []
            for item in batch:
                if now > item.deadline:
                    if item.future.set_running_or_notify_cancel():
                        self._on_reject("deadline")
                        item.future.set_exception(
                            DeadlineExceeded(f"{self.name}: waited past the request deadline")
                        )
                elif item.future.set_running_or_notify_cancel():  # False: the client went away
                    item.started = now
                    live.append(item)
            if not live:
                continue
            try:
                self._run_batch(live)
            except BaseException as e:  # never let one bad batch kill the worker
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(e)


def _stopped(items: list[WorkItem]) -> None:
    """A stopped batcher's forward pass: none runs."""
    raise ShuttingDown()
