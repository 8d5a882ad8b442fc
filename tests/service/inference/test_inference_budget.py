"""Large images cannot tie inference up (issue 24, Medium 9): a per-request pixel budget and a
per-image cap checked from the headers before any pixel is decoded, and images much larger than
the model's input decoded at a reduced scale."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image
from support.helpers import decode_image

from service.inference.images import ImageLimits
from service.settings import InferenceSettings

MODEL = "vip/vip-nano-test"


def _png(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_defaults_cap_an_image_at_16_megapixels_and_a_request_at_64():
    settings = InferenceSettings()
    assert (
        settings.max_image_pixels == 4096 * 4096 and settings.max_request_pixels == 64 * 1024 * 1024
    )


def _headers_only(url: str) -> str:
    """The PNG of ``url`` cut inside its pixel data: its header still says its size, but
    decoding it fails."""
    data = base64.b64decode(url.split(",", 1)[1])
    return "data:image/png;base64," + base64.b64encode(data[:200]).decode()


def test_a_request_over_its_pixel_budget_is_refused_before_decoding(hub, published):
    big = _png(4096, 4096)  # at the per-image cap; five of them are over the request's budget
    cut = _headers_only(big)  # decoding it would answer 400 (corrupt), not 413
    r = httpx.post(
        f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [cut] * 5}, timeout=60
    )
    assert r.status_code == 413, r.text
    assert "per-request budget of 67108864" in r.json()["error"]
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [cut]}, timeout=60)
    assert r.status_code == 400, r.text  # within the budget, it is decoded, and found cut
    over = _png(4097, 4096)
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [over]}, timeout=60)
    assert r.status_code == 413 and "exceeds the limit of 16777216" in r.json()["error"]
    r = httpx.post(
        f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [big] * 2}, timeout=60
    )
    assert r.status_code == 200 and len(r.json()["data"]) == 2


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_large_image_is_decoded_at_a_reduced_scale(fmt):
    buf = io.BytesIO()
    Image.new("RGB", (2000, 1500), (10, 120, 240)).save(buf, fmt)
    limits = ImageLimits(10 * 1024 * 1024, 4096 * 4096, 16)
    img = decode_image(buf.getvalue(), 0, limits, min_side=36)
    assert img.mode == "RGB" and min(img.size) >= 72 and img.size[0] <= 2000 // 8 + 8
    assert img.getpixel((10, 10))[2] > 200
    assert decode_image(buf.getvalue(), 0, limits).size == (2000, 1500)  # no target: full size
    assert decode_image(buf.getvalue(), 0, limits, min_side=600).size == (
        2000,
        1500,
    )  # needed as is


def _encoded(img: Image.Image, fmt: str) -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return base64.b64encode(buf.getvalue()).decode()


def test_large_images_of_every_mode_are_decoded_at_a_reduced_scale(hub, published):
    """Palette (every GIF), 1-bit and 16-bit images large enough to be reduced are embedded,
    not refused as corrupt (``Image.reduce`` takes none of those modes)."""
    rgb = Image.new("RGB", (1200, 900), (10, 120, 240))
    wide = Image.new("I;16", (1200, 900), 40000)
    inputs = [
        _encoded(rgb, "GIF"),
        _encoded(rgb.convert("P"), "PNG"),
        _encoded(rgb.convert("1"), "PNG"),
        _encoded(wide, "PNG"),
    ]
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": inputs}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == len(inputs)


def test_preprocessing_serves_requests_in_turn_not_first_come_first_served():
    """A one-image request queued behind a many-image request is preprocessed after one of the
    large request's images, not after all of them (a FIFO pool finished the large one first)."""
    import threading

    from service.inference.fair_pool import FairPool

    order: list[str] = []
    small_queued = threading.Event()

    def request(name: str, images: int):
        for i in range(images):
            if name == "large" and i == 0:
                small_queued.wait(
                    10
                )  # hold the only worker on the large request until the small one is queued
            order.append(name)
            yield

    pool = FairPool(1)
    try:
        pool.submit(request("large", 8))
        pool.submit(request("small", 1))
        small_queued.set()
    finally:
        pool.shutdown()
    assert order.index("small") <= 2 and len(order) == 9, (
        order
    )  # after at most one more large image
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(request("late", 1))


def test_concurrent_requests_of_different_sizes_all_complete(hub, published):
    import concurrent.futures

    big, small = _png(1024, 1024), _png(32, 32)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        calls = [
            ex.submit(
                httpx.post,
                f"{hub.url}/v1/embeddings",
                json={"model": MODEL, "input": images},
                timeout=120,
            )
            for images in ([big] * 12, [small], [small] * 3, [big])
        ]
        answers = [c.result() for c in calls]
    assert [r.status_code for r in answers] == [200] * 4
    assert [len(r.json()["data"]) for r in answers] == [12, 1, 3, 1]
