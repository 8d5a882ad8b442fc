"""The inference engine: which models are in memory (LRU, lazy or preloaded), decoding and
preprocessing in a thread pool, and requests split into work items for each model's batcher.

The event loop never runs torch or PIL: decoding/preprocessing run in ``preprocess_pool``
(overlapping the forward passes, which run in each model's batcher thread), one image per step
and round-robin across requests (``FairPool``), loading in a worker thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vip_hub.device import pick_device
from vip_hub.errors import VipHubError
from vip_hub.repo_format import DEFAULT_BRANCH

from ..errors import (
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    ModelLoadFailed,
    ModelLoadShortOf,
    PayloadTooLarge,
    QueueFull,
    ServiceError,
    ShuttingDown,
)
from ..metrics import Metrics
from ..settings import InferenceSettings
from ..store import HubStore
from ..store.errors import NoSuchRepo, NoSuchRevision, StoreError
from .batcher import WorkItem
from .fair_pool import FairPool
from .images import ImageLimits, crop_for_resize, load_rgb, open_image
from .models import LoadedModel, Task

__all__ = ["InferenceEngine", "Result", "parse_model_ref"]

PRELOAD_POLL_S = 1.0
FAILED_LOAD_S = 60.0
"""How long a commit whose load failed (it does not verify, a file it needs is malformed) is
answered with that failure without loading it again: a commit does not change, and each load
verifies the whole repo, so a request naming a broken commit cost a full verification."""
FAILED_LOADS_KEPT = 256
"""The most such failures remembered (the oldest forgotten first)."""
SHORT_OF = frozenset({errno.ENOMEM, errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE})
"""The OSErrors of a machine short of memory, disk or file handles: a load failing with one
(or with MemoryError, or a device out of memory) is not kept, since it may load once they are
freed."""


log = logging.getLogger(__name__)


def _short_of(e: BaseException) -> bool:
    """Whether ``e`` is the machine's shortage (memory, disk, file handles), not the commit's."""
    if isinstance(e, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(e, OSError) and e.errno in SHORT_OF


def _fresh(e: Exception) -> Exception:
    """``e`` again, as it was made: its type, arguments and attributes, without the traceback,
    cause or context it gathered (what a cached failure must not hold)."""
    clone = type(e).__new__(type(e))
    clone.args = e.args
    clone.__dict__.update(e.__dict__)
    return clone


def parse_model_ref(ref: str) -> tuple[str, str]:
    """``org/name[@revision]`` -> (repo id, revision)."""
    repo_id, _, revision = ref.partition("@")
    if repo_id.count("/") != 1:
        raise BadRequest(f"model must be 'org/name' or 'org/name@revision', not {ref!r}")
    return repo_id, revision or DEFAULT_BRANCH


@dataclass
class Result:
    """Outputs of one request and where its time went (seconds)."""

    outputs: list[Any]
    queue_s: float
    preprocess_s: float
    forward_s: float


class InferenceEngine:
    """Owns the loaded models and their batchers."""

    def __init__(self, settings: InferenceSettings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.device = pick_device(settings.device)  # a GPU that is not there fails at start-up
        self.limits = ImageLimits(
            settings.max_image_bytes, settings.max_image_pixels, settings.max_aspect_ratio
        )
        # No torch.set_num_threads in these threads: it also sets MKL's process-wide thread count,
        # which would slow the forward pass down.
        self.preprocess_pool = FairPool(settings.preprocess_threads)
        self.store: HubStore | None = None
        self._models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()
        self._loading: dict[tuple[str, str], asyncio.Task[LoadedModel]] = {}
        self._draining: set[asyncio.Task[None]] = set()  # evicted models finishing their work
        self._failed: OrderedDict[tuple[str, str], tuple[float, Exception]] = OrderedDict()
        self._preload: dict[str, str] = {ref: "pending" for ref in settings.preload}
        self._preload_task: asyncio.Task[None] | None = None
        self._closing = False
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)

    # ---------------------------------------------------------------- lifecycle
    async def start(self, store: HubStore) -> None:
        """Begin serving; preloading runs in the background (``/readyz`` reports it)."""
        self.store = store
        self._preload_task = asyncio.create_task(self._preload_all()) if self._preload else None

    async def stop(self) -> None:
        """Refuse new work, end the preloading, wait for the loads under way (each closes what it
        loaded) and drain every batcher (in-flight batches finish, evicted models' included):
        nothing reads the store after it returns."""
        self._closing = True
        if self._preload_task is not None:
            self._preload_task.cancel()  # a load it awaits is shielded, and waited for below
        await asyncio.gather(
            *(t for t in (self._preload_task, *self._loading.values()) if t is not None),
            *self._draining,
            return_exceptions=True,
        )
        await asyncio.gather(*(asyncio.to_thread(m.close) for m in self._models.values()))
        self.preprocess_pool.shutdown()

    def readiness(self, visible: Callable[[str], bool]) -> dict[str, Any]:
        """``ready`` once every preloaded model is loaded and warm; models whose repo id is not
        ``visible`` to the caller are counted in the status but not named."""
        states = self._preload
        if self._closing:
            status = "stopping"
        elif any(s.startswith("error") for s in states.values()):
            status = "error"
        elif all(s == "ready" for s in states.values()):
            status = "ready"
        else:
            status = "loading"
        return {
            "status": status,
            "models": {
                ref: state for ref, state in states.items() if visible(ref.partition("@")[0])
            },
            "loaded": [m.label for m in self._models.values() if visible(m.repo_id)],
        }

    async def _preload_all(self) -> None:
        """Load each configured model; one not published yet, or turned away while requests
        load as many models as may load at once, is waited for (checked every
        ``PRELOAD_POLL_S``), any other failure is reported by ``/readyz``."""
        for ref in self._preload:
            while not self._closing:
                try:
                    repo_id, revision = parse_model_ref(ref)
                    commit = self._store().resolve(repo_id, revision)
                except (NoSuchRepo, NoSuchRevision):
                    self._preload[ref] = "waiting: not published yet"
                    await asyncio.sleep(PRELOAD_POLL_S)
                    continue
                except (ServiceError, StoreError) as e:  # a malformed reference
                    self._preload[ref] = f"error: {e}"
                    break
                self._preload[ref] = "loading"
                try:
                    await self.model(repo_id, commit)
                    self._preload[ref] = "ready"
                except QueueFull:
                    self._preload[ref] = "waiting: as many models are loading as may at once"
                    await asyncio.sleep(PRELOAD_POLL_S)
                    continue
                except Exception as e:  # the process stays up; /readyz says why
                    self._preload[ref] = f"error: {e}"
                break

    # ------------------------------------------------------------------ models
    def _store(self) -> HubStore:
        if self.store is None:
            raise ShuttingDown("the inference engine is not started")
        return self.store

    def loaded(self) -> list[LoadedModel]:
        return list(self._models.values())

    async def model(self, repo_id: str, commit: str) -> LoadedModel:
        """The model at ``commit``, loaded once on first use (concurrent first requests share the
        load); least recently used ones are evicted and their batchers closed."""
        key = (repo_id, commit)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < FAILED_LOAD_S:
            raise _fresh(failed[1])  # a new one each time: a raise adds its frames to it
        self._failed.pop(key, None)
        task = self._loading.get(key)
        busy = len(self._loading) + len(self._draining)
        if task is None and busy >= self.settings.max_loaded_models:
            raise QueueFull(  # loads of any commit anyone names (and evicted models still
                # finishing their work): their memory is bounded too
                f"{len(self._loading)} models are loading and {len(self._draining)} evicted "
                "ones finishing their work, the most at once (inference.max_loaded_models): "
                "retry shortly"
            )
        if task is None:  # registered before any await: a second request finds it
            task = asyncio.create_task(self._load(key))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(
            task
        )  # a waiter that goes away does not cancel the others' load

    async def _load(self, key: tuple[str, str]) -> LoadedModel:
        repo_id, commit = key
        folder = await asyncio.to_thread(self._store().snapshot_dir, repo_id, commit)
        private = (await asyncio.to_thread(self._store().get_repo, repo_id)).private
        try:
            model = await asyncio.to_thread(
                LoadedModel.load,
                repo_id,
                commit,
                folder,
                self.settings,
                self.metrics,
                self.device,
                private,
            )
        except VipHubError as e:  # its message names the repo, not the server's folders
            e.args = (str(e).replace(str(folder), f"{repo_id}@{commit[:12]}"),)
            # a copy, without the traceback that holds the failed load's frames (its tensors)
            self._remember_failure(key, _fresh(e))
            raise
        except Exception as e:  # no library error names it: its traceback logged as text
            if _short_of(e):
                log.warning("loading %s@%s ran short: %r", repo_id, commit, e)
                raise ModelLoadShortOf(
                    f"{repo_id}@{commit[:12]} could not load now ({type(e).__name__}: the "
                    "server is short of memory, disk or file handles); retry later"
                ) from None
            trace = "".join(traceback.format_exception(e))  # (a record would hold its frames)
            log.error("loading %s@%s failed:\n%s", repo_id, commit, trace)
            failed = ModelLoadFailed(
                f"{repo_id}@{commit[:12]} failed to load ({type(e).__name__}); "
                "the server's log has the rest"
            )
            self._remember_failure(key, _fresh(failed))
            raise failed from None
        if self._closing:  # stop() has drained the others already
            await self._retire(model)
            raise ShuttingDown()
        self._failed.pop(key, None)
        self._models[key] = model
        self._evict()
        return model

    def _remember_failure(self, key: tuple[str, str], failure: Exception) -> None:
        """Answer ``key``'s loads with ``failure`` for ``FAILED_LOAD_S`` (the most recent
        ``FAILED_LOADS_KEPT`` failures kept)."""
        self._failed[key] = (time.monotonic(), failure)
        self._failed.move_to_end(key)
        while len(self._failed) > FAILED_LOADS_KEPT:
            self._failed.popitem(last=False)

    def _evict(self) -> None:
        """Drop the least recently used models past ``max_loaded_models``; each finishes its
        queued work in the background (``stop`` waits for it), not in the request that loaded
        the model taking its place."""
        while len(self._models) > self.settings.max_loaded_models:
            _, old = self._models.popitem(last=False)
            task = asyncio.create_task(self._retire(old))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        self.metrics.loaded_models.set(len(self._models))

    @staticmethod
    async def _retire(model: LoadedModel) -> None:
        """Finish ``model``'s queued work, stop its batcher and retire its series (whatever the
        closing raised: it is logged, as nobody awaits an eviction)."""
        try:
            await asyncio.to_thread(model.close)
        except Exception:
            log.exception("closing the evicted model %s failed", model.label)
        finally:
            if model.series is not None:
                model.series.retire()

    # ------------------------------------------------------------------ running
    async def run(
        self,
        model: LoadedModel,
        images: Sequence[bytes],
        task: Task,
        disconnected: Callable[[], Awaitable[None]],
    ) -> Result:
        """Decode, preprocess and batch ``images`` for ``task``; results in input order.
        ``disconnected()`` returns when the client goes away (its images are then dropped).

        The event loop hands the request to the preprocessing threads (one image per turn, in
        turn with other requests), which hand its work items to the batcher; the loop wakes
        once, when the batcher has set their futures (or when preprocessing has failed them)."""
        key = (model.repo_id, model.commit)
        if not self._closing and self._models.get(key) is not model:
            # evicted since the route got it: loaded again, once (a load returns the model it
            # has just made the most recently used, with no wait between: it is current)
            model = await self.model(*key)
        if self._closing:
            raise ShuttingDown()
        batcher = model.batcher
        assert batcher is not None
        start = time.perf_counter()
        futures: list[Future] = [
            Future() for _ in range(0, len(images), self.settings.max_batch_size)
        ]
        batcher.expect(len(images))  # a forming batch waits for these
        try:
            self.preprocess_pool.submit(self._prepare(model, images, task, futures, start))
        except BaseException:
            batcher.withdraw(len(images))
            raise
        try:
            await _wait_or_disconnect(
                [asyncio.wrap_future(f) for f in futures],
                disconnected,
                self.settings.request_timeout_s + 5,
            )
        except BaseException:
            for f in futures:
                f.cancel()  # images not yet computed are dropped, before or after preprocessing
            raise
        outputs, preprocess_s, queue_s, forward_s = [], 0.0, 0.0, 0.0
        for f in futures:
            output, enqueued, started, fwd = f.result()
            outputs.append(output)
            preprocess_s = max(preprocess_s, enqueued - start)
            queue_s, forward_s = max(queue_s, started - enqueued), forward_s + fwd
        return Result(outputs, queue_s, preprocess_s, forward_s)

    def _prepare(
        self,
        model: LoadedModel,
        images: Sequence[bytes],
        task: Task,
        futures: list[Future],
        start: float,
    ) -> Generator[None, None, None]:
        """In the preprocessing threads, one image per step: read each header (its own step),
        check them against the budget, then decode and preprocess each (its own step), letting
        go of its full-size pixels once transformed; then hand the work items (one per future)
        straight to the batcher. A failure, or a client gone away, goes to the futures instead."""
        batcher = model.batcher
        assert batcher is not None
        try:
            opened: list[Image.Image | None] = []
            for i, data in enumerate(images):
                if i:
                    yield  # each header is read in its turn too
                opened.append(open_image(data, i, self.limits))  # the header only
            pixels = sum(img.width * img.height for img in opened if img is not None)
            if pixels > self.settings.max_request_pixels:
                raise PayloadTooLarge(
                    f"{len(images)} images of {pixels} pixels in all exceed the per-request "
                    f"budget of {self.settings.max_request_pixels}; send fewer or smaller images"
                )
            spec = model.encoder.spec
            min_side = math.floor(spec.img_size / spec.crop_pct)  # the transform's resize target
            # a squash resizes the whole image to a square (bounded): no part of it is dropped
            squash = spec.family.crop_mode == "squash"
            transform = model.encoder.transform
            tensors = []
            for i in range(len(opened)):
                yield  # the next image waits its turn behind the other requests' next images
                if all(f.cancelled() for f in futures):  # the client went away
                    break
                img, opened[i] = opened[i], None  # decoded, it is held by this step alone
                assert img is not None
                try:
                    rgb = load_rgb(img, i, min_side)
                    if not squash:
                        rgb = crop_for_resize(rgb, min_side, self.settings.max_resized_pixels)
                    tensors.append(transform(rgb))
                    del rgb
                finally:
                    img.close()  # its decoded pixels too
            else:
                batch = torch.stack(tensors)
                if model.series is not None:
                    model.series.preprocessed(time.perf_counter() - start)
                deadline = start + self.settings.request_timeout_s
                size = self.settings.max_batch_size
                items = [
                    WorkItem(
                        batch[k * size : (k + 1) * size],
                        task,
                        deadline,
                        f,
                        passes_per_image=task.passes_per_image,
                    )
                    for k, f in enumerate(futures)
                ]
                batcher.submit(
                    items, announced=len(images)
                )  # accepted: the announcement is settled
                return
        except BaseException as e:
            for f in futures:
                if f.set_running_or_notify_cancel():
                    f.set_exception(e)
        batcher.withdraw(len(images))


async def _wait_or_disconnect(
    futures: list[asyncio.Future[Any]], disconnected: Callable[[], Awaitable[None]], timeout: float
) -> None:
    """Wait for every future; stop early (cancelling them) if the client disconnects first."""
    pending = asyncio.gather(*futures)
    gone = asyncio.ensure_future(disconnected())
    try:
        waited: set[asyncio.Future[Any]] = {pending, gone}
        await asyncio.wait(waited, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if pending.done():
        pending.result()
        return
    pending.cancel()
    if gone.done() and not gone.cancelled():
        raise ClientGone("client disconnected")
    raise DeadlineExceeded("timed out waiting for the model")
