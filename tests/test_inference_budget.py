"""Large images cannot tie inference up (issue 24, Medium 9): a per-request pixel budget and a
per-image cap checked from the headers before any pixel is decoded, and images much larger than
the model's input decoded at a reduced scale."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest
from PIL import Image

from service.inference.images import ImageLimits, decode_image
from service.settings import InferenceSettings

MODEL = "vip/vip-nano-test"


def _png(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_defaults_cap_an_image_at_16_megapixels_and_a_request_at_64():
    settings = InferenceSettings()
    assert settings.max_image_pixels == 4096 * 4096 and settings.max_request_pixels == 64 * 1024 * 1024


def test_a_request_over_its_pixel_budget_is_refused_before_decoding(hub, published):
    big = _png(4096, 4096)  # at the per-image cap; five of them are over the request's budget
    start = time.monotonic()
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [big] * 5}, timeout=60)
    assert r.status_code == 413, r.text
    assert "per-request budget of 67108864" in r.json()["error"]
    assert time.monotonic() - start < 5
    over = _png(4097, 4096)
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [over]}, timeout=60)
    assert r.status_code == 413 and "exceeds the limit of 16777216" in r.json()["error"]
    r = httpx.post(f"{hub.url}/v1/embeddings", json={"model": MODEL, "input": [big] * 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 2


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_large_image_is_decoded_at_a_reduced_scale(fmt):
    buf = io.BytesIO()
    Image.new("RGB", (2000, 1500), (10, 120, 240)).save(buf, fmt)
    limits = ImageLimits(10 * 1024 * 1024, 4096 * 4096)
    img = decode_image(buf.getvalue(), 0, limits, min_side=36)
    assert img.mode == "RGB" and min(img.size) >= 72 and img.size[0] <= 2000 // 8 + 8
    assert img.getpixel((10, 10))[2] > 200
    assert decode_image(buf.getvalue(), 0, limits).size == (2000, 1500)  # no target: full size
    assert decode_image(buf.getvalue(), 0, limits, min_side=600).size == (2000, 1500)  # needed as is
