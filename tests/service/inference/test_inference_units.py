"""Image decoding, the batcher and the engine's wait for results, on their own."""

import asyncio
import base64
import errno
import io
import struct
import threading
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from support.helpers import WIDE_GREY, decode_image, turned_jpeg, wide_grey

from service.errors import (
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    PayloadTooLarge,
    QueueFull,
    ServiceError,
    ShuttingDown,
    error_response,
)
from service.inference.batcher import Batcher, WorkItem
from service.inference.engine import _wait_or_disconnect
from service.inference.images import ImageLimits, image_bytes_from_text
from service.store import errors as store_errors
from vip_hub.repo_format import head_component

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=4096 * 4096, max_aspect_ratio=16)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


RGB = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 32, 3), dtype=np.uint8))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_formats(fmt):
    img = decode_image(encode(RGB, fmt), 0, LIMITS)
    assert img.mode == "RGB" and img.size == (32, 24)


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "CMYK", "I;16"])
def test_modes_become_rgb(mode):
    src = (
        RGB.convert(mode)
        if mode != "I;16"
        else Image.fromarray((np.arange(24 * 32).reshape(24, 32) * 80).astype(np.uint16))
    )
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    img = decode_image(encode(src, fmt), 0, LIMITS)
    assert img.mode == "RGB"
    if mode == "I;16":  # rescaled, not clipped at 255: the gradient survives
        row = np.asarray(img)[:, :, 0].ravel()
        assert row.min() == 0 and 200 < row.max() <= 255 and len(np.unique(row)) > 50


@pytest.mark.parametrize("min_side", [0, 3])  # 3: decoded at a quarter of the size
@pytest.mark.parametrize("mode", WIDE_GREY)
def test_wide_greyscale_decodes_as_its_8_bit_version(mode, min_side):
    """16-bit and float greyscale are scaled to 8 bits (a 16-bit value >> 8), not clipped at 255."""
    data, narrow = wide_grey(mode)
    assert Image.open(io.BytesIO(data)).mode == mode
    expected = narrow.reduce(4) if min_side else narrow
    assert np.array_equal(np.asarray(decode_image(data, 0, LIMITS, min_side)), np.asarray(expected))


@pytest.mark.parametrize("corrupt", [False, True])
def test_exif_orientation_is_applied(corrupt):
    """A JPEG comes upright as a viewer shows it, decoded at full or at a reduced scale, its EXIF
    well-formed or not."""
    data, upright = turned_jpeg(corrupt=corrupt)
    assert np.array_equal(np.asarray(decode_image(data, 0, LIMITS)), np.asarray(upright))
    assert decode_image(data, 0, LIMITS, min_side=3).size == (6, 10)


def test_animated_gif_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(data, 0, LIMITS).getpixel((0, 0))[0] > 200


def _rational_strip_tiff() -> bytes:
    """A 2 x 2 grey TIFF whose StripOffsets is a RATIONAL (a fraction), not an integer: Pillow's
    decoder raises TypeError on it (a fuzzer's find)."""
    entries = [(256, 3, 2), (257, 3, 2), (258, 3, 8), (259, 3, 1), (262, 3, 1), (278, 3, 2)]
    ifd = 8
    rational = ifd + 2 + 12 * (len(entries) + 2) + 4
    pixels = rational + 8
    out = b"II*\0" + struct.pack("<IH", ifd, len(entries) + 2)
    out += b"".join(struct.pack("<HHIHH", tag, kind, 1, value, 0) for tag, kind, value in entries)
    out += struct.pack("<HHII", 273, 5, 1, rational) + struct.pack("<HHII", 279, 4, 1, 4)
    return out + struct.pack("<III", 0, 2 * pixels + 1, 2) + bytes([0, 64, 128, 255])


def test_bad_inputs_name_the_index():
    with pytest.raises(BadRequest, match=r"input\[5\]: truncated or corrupt"):  # was a 500
        decode_image(_rational_strip_tiff(), 5, LIMITS)
    with pytest.raises(BadRequest, match=r"input\[3\]: empty image"):
        decode_image(b"", 3, LIMITS)
    with pytest.raises(BadRequest, match=r"input\[1\]: not an image"):
        decode_image(b"hello world", 1, LIMITS)
    with pytest.raises(BadRequest, match=r"input\[2\]: truncated or corrupt"):
        decode_image(encode(RGB, "PNG")[:200], 2, LIMITS)
    with pytest.raises(PayloadTooLarge, match=r"input\[0\]: image larger than"):
        decode_image(b"x" * (LIMITS.max_bytes + 1), 0, LIMITS)
    with pytest.raises(BadRequest, match=r"input\[4\]: not an image"):
        decode_image(b"%PDF-1.4 ...", 4, LIMITS)


def test_decompression_bomb_refused_from_header():
    bomb = encode(Image.new("L", (5000, 5000)), "PNG")  # a small file, 25M pixels
    assert len(bomb) < 1 << 20
    with pytest.raises(PayloadTooLarge, match=r"input\[0\]: 5000x5000 pixels exceeds"):
        decode_image(bomb, 0, LIMITS)
    huge = encode(Image.new("1", (20000, 20000)), "PNG")  # PIL itself refuses this one in open()
    with pytest.raises(
        PayloadTooLarge, match=r"input\[1\]: decompression bomb refused from the header"
    ):
        decode_image(huge, 1, LIMITS)


def test_decoding_threads_leave_the_warning_filters_alone():
    """Images decode in several preprocessing threads at once: none may touch the process's
    warning filters (saved and restored per call, one thread's exit dropped the filter another
    was decoding under and left its own behind), and every bomb is still refused."""
    rng = np.random.default_rng(1)
    photo = encode(Image.fromarray(rng.integers(0, 255, (900, 900, 3), dtype=np.uint8)), "PNG")
    bombs = [
        encode(Image.new("L", (5000, 5000)), "PNG"),
        encode(Image.new("1", (20000,) * 2), "PNG"),
    ]
    limits = ImageLimits(max_bytes=len(photo), max_pixels=4096 * 4096, max_aspect_ratio=16)
    before = list(warnings.filters)
    refused: list[int] = []
    errors: list[BaseException] = []

    def decode(k: int) -> None:
        try:
            for i in range(6):
                data = bombs[(k + i) % 2] if (k + i) % 3 == 0 else photo
                try:
                    assert decode_image(data, i, limits).size == (900, 900)
                except PayloadTooLarge:
                    refused.append(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=decode, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(refused) == 8  # the bombs and only they
    assert warnings.filters == before


def test_text_inputs():
    data = encode(RGB, "PNG")
    b64 = base64.b64encode(data).decode()
    assert image_bytes_from_text(b64, 0, LIMITS) == data
    assert image_bytes_from_text("data:image/png;base64," + b64, 0, LIMITS) == data
    assert image_bytes_from_text("DATA:image/PNG;BASE64," + b64, 0, LIMITS) == data  # RFC 2397
    for url in (
        "http://169.254.169.254/latest",
        "HTTPS://example.com/cat.jpg",
        "ftp://example.com/cat.jpg",
        "file:///etc/passwd",
        "FILE:cat.png",
    ):
        with pytest.raises(BadRequest, match="URLs are not fetched"):
            image_bytes_from_text(url, 0, LIMITS)
    with pytest.raises(BadRequest, match=r"input\[5\]: not valid base64"):
        image_bytes_from_text("***", 5, LIMITS)
    with pytest.raises(BadRequest, match="data: URI must be base64"):
        image_bytes_from_text("data:image/png,rawbytes", 0, LIMITS)
    with pytest.raises(PayloadTooLarge):
        image_bytes_from_text("A" * (2 * LIMITS.max_bytes), 0, LIMITS)


class Clock:
    """The batcher's clock, moved by the test: no test depends on how fast the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _item(n: int, deadline: float = 60.0) -> WorkItem:
    return WorkItem(torch.zeros(n, 1), task=None, deadline=1000.0 + deadline)


def _recording_batcher(**kw):
    """A batcher on a test clock whose batches block on ``gate``; ``running`` is set as each
    batch starts."""
    sizes: list[int] = []
    gate, running = threading.Event(), threading.Event()
    clock = Clock()

    def run(items):
        running.set()
        gate.wait(5)
        sizes.append(sum(i.size for i in items))
        for i in items:
            i.future.set_result(i.size)

    options = dict(max_batch_size=8, max_wait_s=0.2, max_queue_images=20, clock=clock) | kw
    return Batcher("test", run, **options), sizes, gate, running, clock


def test_batches_fill_up_to_the_limit_and_keep_order():
    batcher, sizes, gate, _, _ = _recording_batcher()
    items = [_item(3) for _ in range(4)]
    for item in items:
        batcher.submit([item])
    gate.set()
    assert [i.future.result(5) for i in items] == [3, 3, 3, 3]
    assert sizes[0] <= 8 and sum(sizes) == 12 and max(sizes) == 6
    batcher.close()


def test_a_batch_fills_exactly_to_its_limit():
    batcher, sizes, gate, running, _ = _recording_batcher(max_wait_s=0.0)
    blocker = _item(1)
    batcher.submit([blocker])
    assert running.wait(5)  # the worker holds the blocker: the rest queue behind it
    items = [_item(4) for _ in range(4)]
    for item in items:
        batcher.submit([item])
    gate.set()
    assert [i.future.result(5) for i in items] == [4, 4, 4, 4]
    assert sizes == [1, 8, 8]
    batcher.close()


def test_max_wait_bounds_the_wait_for_a_lone_request():
    batcher, sizes, gate, running, clock = _recording_batcher(max_wait_s=0.05)
    gate.set()
    batcher.expect(1)  # an image on its way: the lone item waits for it...
    item = _item(1)
    batcher.submit([item])
    assert not running.wait(0.1)  # (the clock stands still: it waits)
    clock.now += 0.06  # ...but not past max_wait
    assert item.future.result(5) == 1 and sizes == [1]
    batcher.withdraw(1)  # (close waits for announced images: the one never came)
    batcher.close()


def test_announced_images_join_the_forming_batch_and_withdrawing_releases_it():
    batcher, sizes, gate, running, clock = _recording_batcher(max_wait_s=2.0)
    gate.set()
    batcher.expect(2)  # another request's two images are being decoded
    first, second = _item(1), _item(2)
    batcher.submit([first])
    assert not running.wait(0.05)  # the clock stands still: the first waits for the announced ones
    batcher.submit([second], announced=2)
    assert first.future.result(5) == 1 and second.future.result(5) == 2
    assert sizes == [3]  # one batch: the first item waited for the announced ones
    running.clear()
    batcher.expect(3)
    lone = _item(1)
    batcher.submit([lone])
    assert not running.wait(0.05)
    batcher.withdraw(3)  # their request failed while decoding: no need to wait for max_wait
    assert lone.future.result(5) == 1 and sizes == [3, 1]
    batcher.close()


def test_queue_full_cancelled_expired_and_drain():
    rejected: list[str] = []  # vip_hub_rejected_total's reasons: it was never counted
    batcher, sizes, gate, running, clock = _recording_batcher(
        max_queue_images=10, max_wait_s=0.0, on_reject=rejected.append
    )
    first = _item(8)
    batcher.submit([first])
    assert running.wait(5)  # taken by the worker, which blocks on the gate
    queued = [_item(4), _item(4)]
    batcher.submit(queued)
    with pytest.raises(QueueFull) as err:
        batcher.submit([_item(4)])
    assert error_response(err.value).headers["Retry-After"] == "1"
    queued[0].future.cancel()  # the client went away
    expired = _item(2, deadline=5)
    batcher.submit([expired])  # 8 + 2: the queue exactly full is not over its limit
    clock.now += 10  # its deadline passes while it waits
    gate.set()
    assert first.future.result(5) == 8 and queued[1].future.result(5) == 4
    assert queued[0].future.cancelled()
    with pytest.raises(Exception, match="deadline"):
        expired.future.result(5)
    assert sizes == [8, 4]  # the cancelled and the expired images were never computed
    assert rejected == ["queue_full", "deadline"]
    batcher.close()
    with pytest.raises(ShuttingDown):
        batcher.submit([_item(1)])


def test_a_batch_gives_the_queue_back_each_items_passes():
    """A zero-shot item holds images x labels of the queue, and gives all of them back when its
    batch starts: the depth returns to zero and a second such item fits."""
    depths: list[int] = []
    batcher, sizes, gate, _, _ = _recording_batcher(
        max_queue_images=8, max_wait_s=0.0, on_depth=depths.append
    )
    gate.set()
    for _ in range(2):
        item = _item(2)
        item.passes_per_image = 4  # two images x four labels: the whole queue
        batcher.submit([item])
        assert item.future.result(5) == 2
    assert batcher.depth == 0 and depths == [8, 0, 8, 0] and sizes == [2, 2]
    batcher.close()


def test_close_drains_queued_work():
    batcher, sizes, gate, _, _ = _recording_batcher(max_wait_s=0.0)
    items = [_item(2) for _ in range(3)]
    batcher.submit(items)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert all(i.future.result(0) == 2 for i in items)


def test_close_waits_for_announced_images_and_runs_them():
    """A model evicted while a request's images are decoded still runs them: ``close`` refuses
    new work but accepts and finishes what was announced before it."""
    batcher, sizes, gate, _, _ = _recording_batcher(max_wait_s=0.0)
    gate.set()
    batcher.expect(2)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the announced images
    with pytest.raises(ShuttingDown):
        batcher.submit([_item(1)])  # not announced: refused
    item = _item(2)
    batcher.submit([item], announced=2)
    closer.join(10)
    assert not closer.is_alive() and item.future.result(0) == 2 and sizes == [2]


def test_waiting_ends_with_the_results_the_client_leaving_or_the_timeout():
    async def scenario(finish: bool, leave: bool, timeout: float) -> tuple[str, bool]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future(), loop.create_future()]
        left = asyncio.Event()
        if finish:
            loop.call_later(0.01, lambda: [f.set_result(i) for i, f in enumerate(futures)])
        if leave:
            loop.call_later(0.01, left.set)
        try:
            await _wait_or_disconnect(futures, left.wait, timeout)
            outcome = "done"
        except (ClientGone, DeadlineExceeded) as e:
            outcome = type(e).__name__
        return outcome, all(f.cancelled() for f in futures)

    assert asyncio.run(scenario(finish=True, leave=False, timeout=5)) == ("done", False)
    assert asyncio.run(scenario(finish=False, leave=True, timeout=5)) == ("ClientGone", True)
    assert asyncio.run(scenario(finish=False, leave=False, timeout=0.05)) == (
        "DeadlineExceeded",
        True,
    )


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_a_models_series_go_with_the_last_copy_recording_under_its_label():
    """An evicted copy's series stayed when a load of the same commit was under way as its
    batcher stopped, and that load then failed: nothing removed them. The label's series go
    when its last copy retires, whichever retires first."""
    from prometheus_client import generate_latest

    from service.metrics import Metrics, ModelSeries

    metrics, label = Metrics(), "o/a@aaaaaaaaaa"
    shown = lambda: f'model="{label}"' in generate_latest(metrics.registry).decode()  # noqa: E731
    evicted = ModelSeries(metrics, label)
    evicted.queue_depth(3)
    again = ModelSeries(metrics, label)  # loaded again while the first drained
    evicted.retire()
    again.queue_depth(1)
    assert shown()  # the new copy's
    again.retire()
    again.retire()  # a second retire releases nothing more
    assert not shown()
    failed_reload = ModelSeries(metrics, label)
    failed_reload.batch(2, 0.1, [0.01, 0.02])
    failed_reload.retire()  # no copy loaded since: its series go
    assert not shown()
    failed_reload.queue_depth(5)  # a late recording brings nothing back
    assert not shown()


def test_a_models_queue_gauge_sums_its_live_copies_queues():
    """An evicted copy draining its queue set the label's gauge over the reloaded copy's (the
    last writer won); the gauge now shows both copies' queues, and a retired copy's go."""
    from service.metrics import Metrics, ModelSeries

    metrics, label = Metrics(), "o/a@aaaaaaaaaa"
    gauge = lambda: metrics.registry.get_sample_value(  # noqa: E731
        "vip_hub_queue_images", {"model": label}
    )
    evicted = ModelSeries(metrics, label)
    evicted.queue_depth(3)
    again = ModelSeries(metrics, label)
    again.queue_depth(5)
    evicted.queue_depth(2)  # the evicted copy drains one
    assert gauge() == 7
    evicted.retire()  # its 2 leave the sum
    assert gauge() == 5
    again.queue_depth(4)
    assert gauge() == 4
    again.retire()
    assert gauge() is None


def test_http_statuses_live_in_service_errors_and_each_error_name_is_one_class():
    http = _subclasses(
        ServiceError
    )  # batcher and engine are imported: their errors would show here
    assert {c.__module__ for c in http} == {"service.errors"}
    store = [store_errors.StoreError, *_subclasses(store_errors.StoreError)]
    assert not {c.__name__ for c in http} & {c.__name__ for c in store}
    inference = (QueueFull, ClientGone, ShuttingDown, DeadlineExceeded)
    assert [error_response(e("x")).status_code for e in inference] == [429, 499, 503, 503]


def test_store_errors_answer_with_their_status_and_hub_code():
    answers = {
        cls.__name__: (r.status_code, r.headers.get("x-error-code"))
        for cls in (store_errors.StoreError, *_subclasses(store_errors.StoreError))
        for r in [error_response(cls("x"))]
    }
    assert answers == {
        "StoreError": (400, None),
        "InvalidRequest": (400, None),
        "PublishRefused": (400, None),
        "SignatureRefused": (403, None),
        "UploadMissing": (400, None),
        "NoSuchRepo": (404, "RepoNotFound"),
        "NoSuchRevision": (404, "RevisionNotFound"),
        "NoSuchEntry": (404, "EntryNotFound"),
        "Conflict": (409, None),
        "TooLarge": (413, None),
        "TooMuchStaged": (429, None),
        "TooMuchUncommitted": (429, None),
        "StoreUnavailable": (503, None),
        "CorruptObject": (500, None),
        "UploadMismatch": (400, None),
    }


def test_a_preload_turned_away_by_the_load_bound_waits_and_loads(tmp_path, monkeypatch):
    """A preload that met as many loads under way as may run at once (429) was recorded as an
    error and never tried again: ``/readyz`` said 503 until a restart. It waits, then loads."""
    from service.inference import engine as engine_module
    from service.metrics import Metrics
    from service.settings import InferenceSettings
    from service.store import HubStore

    store = HubStore(tmp_path / "store")
    store.create_repo("vip/pre")
    monkeypatch.setattr(store, "resolve", lambda repo_id, revision: "c" * 40)
    monkeypatch.setattr(engine_module, "PRELOAD_POLL_S", 0.01)
    engine = engine_module.InferenceEngine(
        InferenceSettings(preload=["vip/pre"], device="cpu"), Metrics()
    )
    asked: list[str] = []

    async def model(repo_id: str, commit: str):
        asked.append(repo_id)
        if len(asked) == 1:
            raise QueueFull("1 models are loading, the most at once")
        return object()

    monkeypatch.setattr(engine, "model", model)

    async def preload() -> dict:
        engine.store = store
        await engine._preload_all()
        return engine.readiness(lambda repo_id: True)

    state = asyncio.run(preload())
    assert asked == ["vip/pre", "vip/pre"] and state["status"] == "ready", state


@pytest.mark.parametrize("raised", ["ConfigError", "ValueError"])
def test_a_failed_load_is_kept_without_what_the_load_held(monkeypatch, raised):
    """The failure of a commit's load is answered again for ``FAILED_LOAD_S`` from a copy: the
    exception itself kept the load's frames through its traceback, and with them whatever it
    held when it failed (an encoder already on its device, say). A failure no library error
    names (timm's ValueError, say) was not kept: each request loaded and verified it again."""
    import gc
    import weakref
    from types import SimpleNamespace

    from service.errors import ModelLoadFailed
    from service.inference import engine as engine_module
    from service.metrics import Metrics
    from service.settings import InferenceSettings
    from vip_hub.errors import ConfigError

    error, answered = {
        "ConfigError": (ConfigError, f"o/n@{'a' * 12}/{head_component('x')}: malformed"),
        "ValueError": (ModelLoadFailed, f"o/n@{'a' * 12} failed to load (ValueError); the s"),
    }[raised]

    class Weights:
        pass

    held = []

    def load(repo_id, commit, folder, *args):
        weights = Weights()
        held.append(weakref.ref(weights))
        if raised == "ValueError":
            raise ValueError("mean must have 3 values")
        raise ConfigError(f"{folder}/{head_component('x')}: malformed")

    monkeypatch.setattr(engine_module.LoadedModel, "load", staticmethod(load))
    engine = engine_module.InferenceEngine(InferenceSettings(device="cpu"), Metrics())
    engine.store = SimpleNamespace(
        snapshot_dir=lambda repo_id, commit: "/snapshot",
        get_repo=lambda repo_id: SimpleNamespace(private=False),
    )

    async def failure() -> str:
        with pytest.raises(error) as caught:
            await engine.model("o/n", "a" * 40)
        return str(caught.value)

    first = asyncio.run(failure())
    gc.collect()
    assert held[0]() is None  # once the request has its answer
    assert asyncio.run(failure()) == first and first.startswith(answered), first
    assert len(held) == 1  # answered from the kept failure


@pytest.mark.parametrize(
    "shortage",
    [MemoryError(), OSError(errno.ENOSPC, "No space left on device"), "cuda-out-of-memory"],
    ids=["MemoryError", "ENOSPC", "torch.OutOfMemoryError"],
)
def test_a_load_short_of_memory_or_disk_is_not_kept(monkeypatch, shortage):
    """A load that runs out of the machine's memory or disk failed for the machine's state, not
    the commit's: it is answered as 503 with Retry-After and not kept, so the next request loads
    the commit again (once the memory is freed it serves) instead of an error for a minute."""
    from types import SimpleNamespace

    from service.errors import ModelLoadShortOf
    from service.inference import engine as engine_module
    from service.metrics import Metrics
    from service.settings import InferenceSettings

    if shortage == "cuda-out-of-memory":
        shortage = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    loads = []

    def load(repo_id, commit, folder, *args):
        loads.append(commit)
        if len(loads) == 1:
            raise shortage
        return SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(engine_module.LoadedModel, "load", staticmethod(load))
    engine = engine_module.InferenceEngine(InferenceSettings(device="cpu"), Metrics())
    engine.store = SimpleNamespace(
        snapshot_dir=lambda repo_id, commit: "/snapshot",
        get_repo=lambda repo_id: SimpleNamespace(private=False),
    )

    async def twice():
        with pytest.raises(ModelLoadShortOf) as caught:
            await engine.model("o/n", "a" * 40)
        return caught.value, await engine.model("o/n", "a" * 40)

    error, model = asyncio.run(twice())
    assert error.status == 503 and error.retry_after_s > 0
    assert str(error).startswith(f"o/n@{'a' * 12} could not load now ({type(shortage).__name__}")
    assert len(loads) == 2 and model is not None  # loaded again, not answered from a kept failure


def _saved(img: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    import zlib

    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_an_image_whose_structure_costs_more_than_its_bytes_is_refused_before_pillow_reads_it():
    """Pillow walks JPEG segments, PNG chunks and GIF blocks in Python, and libjpeg passes over
    every pixel once per scan: 10 MB of empty segments held a preprocessing thread for seconds,
    and a 600 KB progressive JPEG of repeated scans for 19 s (every request waits behind it).
    Each is refused from its bytes; ordinary images of each kind still open."""
    from service.inference.images import MAX_HEADER_STEPS, MAX_PNG_CHUNKS, load_rgb, open_image

    limits = ImageLimits(10 << 20, 4096 * 4096, 16.0)
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 96, 3), np.uint8))
    jpeg, exif = _saved(rgb, "JPEG", progressive=True), Image.Exif()
    exif[0x010E] = "a photo"  # an APP1 segment before the scans
    photo = _saved(rgb, "JPEG", progressive=True, optimize=True, exif=exif.tobytes())
    png = _saved(rgb, "PNG")
    idat_at = png.index(b"IDAT") - 4
    length = struct.unpack(">I", png[idat_at : idat_at + 4])[0]
    stream = png[idat_at + 8 : idat_at + 8 + length]
    split = b"".join(_png_chunk(b"IDAT", stream[i : i + 8]) for i in range(0, len(stream), 8))
    many_idat = png[:idat_at] + split + png[idat_at + 12 + length :]  # thousands of chunks
    gif = _saved(rgb.convert("P"), "GIF", comment=b"made here")
    for ok in (jpeg, photo, png, many_idat, gif):
        assert load_rgb(open_image(ok, 0, limits), 0).size == (96, 96)
    assert 1_000 < many_idat.count(b"IDAT") < MAX_PNG_CHUNKS

    last_scan = jpeg.rindex(b"\xff\xda")
    scans = jpeg[:last_scan] + jpeg[last_scan:-2] * 150 + b"\xff\xd9"
    header_end = 13 + 3 * 256  # a GIF's header and its global colour table
    floods = {
        "a JPEG of 159 scans, over the limit of 100": scans,
        f"more than {MAX_HEADER_STEPS} marker segments": jpeg[:2]
        + b"\xff\xe5\x00\x02" * (MAX_HEADER_STEPS + 1)
        + jpeg[2:],
        f"more than {MAX_HEADER_STEPS} marker segments or fill bytes": jpeg[:2]
        + b"\xff" * (MAX_HEADER_STEPS + 2)
        + jpeg[2:],
        f"a PNG of more than {MAX_PNG_CHUNKS} chunks": png[:33]
        + _png_chunk(b"prVt", b"") * MAX_PNG_CHUNKS
        + png[33:],
        f"more than {MAX_HEADER_STEPS} blocks before its first frame": gif[:header_end]
        + b"!\xfe"
        + b"\x01x" * (MAX_HEADER_STEPS + 1)
        + b"\x00"
        + gif[header_end:],
    }
    for why, data in floods.items():
        with pytest.raises(BadRequest, match=rf"input\[3\]: {why}"):
            open_image(data, 3, limits)


def _tiff(fields: dict[int, list[int]], pixels: bytes, big: bool = False) -> bytes:
    """A little-endian TIFF (BigTIFF if ``big``) of ``pixels`` at its start, then one directory
    of ``fields`` (tag: LONG values; the offsets in them are into the file)."""
    head, entry, slot = (16, 20, 8) if big else (8, 12, 4)
    directory = head + len(pixels)
    beyond = directory + (8 if big else 2) + entry * len(fields) + slot
    entries, extra = b"", b""
    for tag, values in sorted(fields.items()):
        raw = struct.pack(f"<{len(values)}I", *values)
        if len(raw) > slot:  # out of line
            raw, extra = struct.pack("<Q" if big else "<I", beyond + len(extra)), extra + raw
        entries += struct.pack("<HHQ" if big else "<HHI", tag, 4, len(values)) + raw.ljust(slot)
    start = (
        b"II+\0" + struct.pack("<HHQ", 8, 0, directory)
        if big
        else b"II*\0" + struct.pack("<I", directory)
    )
    count = struct.pack("<Q" if big else "<H", len(fields))
    return start + pixels + count + entries + bytes(slot) + extra


@pytest.mark.parametrize("big", [False, True], ids=["tiff", "bigtiff"])
def test_a_tiff_whose_blocks_cost_more_than_its_pixels_is_refused_before_pillow_reads_it(big):
    """A TIFF's strips and tiles were never checked: a 16x16 one declaring a 45000x45000 deflate
    tile answered after 9.6 s and 2 GB, and a 64x64 one listing 1.25M strips after 8.6 s (every
    request waits behind either). Each is refused from its bytes; striped and tiled ones open."""
    from service.inference.images import MAX_HEADER_STEPS, MAX_TIFF_BLOCKS, load_rgb, open_image

    limits, head = ImageLimits(10 << 20, 4096 * 4096, 16.0), 16 if big else 8
    pixels = np.random.default_rng(0).integers(0, 256, (48, 48, 3), np.uint8)
    rgb = {256: [40], 257: [40], 258: [8, 8, 8], 259: [1], 262: [2], 277: [3]}
    rows = {**rgb, 278: [1], 273: [head + 120 * i for i in range(40)], 279: [120] * 40}
    tiles = [pixels[y : y + 16, x : x + 16].tobytes() for y in (0, 16, 32) for x in (0, 16, 32)]
    tiled = {**rgb, 322: [16], 323: [16], 324: [head + 768 * i for i in range(9)], 325: [768] * 9}
    striped = _tiff(rows, pixels[:40, :40].tobytes(), big)
    assert np.array_equal(np.asarray(load_rgb(open_image(striped, 0, limits), 0)), pixels[:40, :40])
    assert load_rgb(open_image(_tiff(tiled, b"".join(tiles), big), 0, limits), 0).size == (40, 40)

    many = MAX_TIFF_BLOCKS + 1
    floods = {
        f"a TIFF of {many} strips, over the limit of {MAX_TIFF_BLOCKS}": (
            {**rows, 273: [head] * many, 279: [120] * many}
        ),
        "a TIFF listing 41 strips where its 40 rows in strips of 1 make 40": (
            {**rows, 273: [head] * 41, 279: [120] * 41}
        ),
        "a TIFF listing 10 tiles where its 40x40 pixels in 16x16 tiles make 9": (
            {**tiled, 324: [head] * 10, 325: [768] * 10}
        ),
        "a TIFF tile of 45008x45008 pixels, over the limit of 16777216": (
            {**tiled, 259: [8], 322: [45008], 323: [45008], 324: [head], 325: [768]}
        ),
        f"a TIFF directory of {MAX_HEADER_STEPS + 1} entries, over the limit": (
            {**rows, **{40_000 + i: [0] for i in range(MAX_HEADER_STEPS + 1 - len(rows))}}
        ),
    }
    for why, fields in floods.items():
        with pytest.raises(BadRequest, match=rf"input\[3\]: {why}"):
            open_image(_tiff(fields, b"".join(tiles), big), 3, limits)
