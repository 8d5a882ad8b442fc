"""Thin images cannot blow the server up (issue 35, point 4): the aspect ratio is capped from the
header (400 naming the limit), and an image whose resize to the model's input would be large is
centre-cropped along its long side first. The extreme shapes are sent to a real server process
whose address space is capped (``RLIMIT_AS``) a little above what it holds once warm; the PNGs
are written row by row through zlib, never held decoded."""

from __future__ import annotations

import base64
import io
import resource
import struct
import zlib

import httpx
import pytest
from PIL import Image
from support.helpers import tiny_repo_with_head
from support.live import WRITE_TOKEN, ProcessServer

from service.errors import BadRequest
from service.inference.images import ImageLimits, open_image
from service.settings import InferenceSettings
from vip_hub.repo.push import push_repo

HEADROOM = 768 * 1024**2  # what the capped server may still map once warm
MAX_ASPECT = 1_000_000  # 2,097,152 x 8 (262,144:1) is within, 16,777,216 x 1 is not


def _png(width: int, height: int) -> bytes:
    """A black greyscale PNG, its rows compressed in batches of at most 16 MiB."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    row = b"\0" + bytes(width)  # filter 0, then the pixels
    batch = max(1, (16 << 20) // len(row))
    z, idat, left = zlib.compressobj(9), [], height
    while left:
        n = min(batch, left)
        idat.append(z.compress(row * n))
        left -= n
    idat.append(z.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", b"".join(idat))
        + chunk(b"IEND", b"")
    )


def _uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_the_default_aspect_ratio_limit_is_16_to_1():
    settings = InferenceSettings()
    limits = ImageLimits(
        settings.max_image_bytes, settings.max_image_pixels, settings.max_aspect_ratio
    )
    for size in ((160, 10), (10, 160)):
        buf = io.BytesIO()
        Image.new("RGB", size).save(buf, "PNG")
        assert open_image(buf.getvalue(), 0, limits).size == size
    buf = io.BytesIO()
    Image.new("RGB", (10, 161)).save(buf, "PNG")
    with pytest.raises(BadRequest, match=r"input\[0\]: 10x161 .* over the limit of 16:1"):
        open_image(buf.getvalue(), 0, limits)


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """A server process with inference, a tiny model loaded and warm, then its address space
    capped at what it maps plus ``HEADROOM``."""
    base = tmp_path_factory.mktemp("thin")
    server = ProcessServer(
        base / "store",
        extra_env={
            "VIP_HUB_INFERENCE__MAX_ASPECT_RATIO": str(MAX_ASPECT),
            "VIP_HUB_INFERENCE__MAX_RESIZED_PIXELS": str(256 * 1024),
            "VIP_HUB_INFERENCE__TORCH_THREADS": "1",
            "MALLOC_ARENA_MAX": "2",
        },
        inference=True,
    ).start()
    try:
        push_repo(
            tiny_repo_with_head(base / "thin"), "vip/thin", endpoint=server.url, token=WRITE_TOKEN
        )
        small = _uri(_png(40, 30))
        for _ in range(3):
            r = httpx.post(
                f"{server.url}/v1/embeddings",
                json={"model": "vip/thin", "input": [small]},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        assert server.proc is not None
        pid = server.proc.pid
        with open(f"/proc/{pid}/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
        resource.prlimit(pid, resource.RLIMIT_AS, (mapped + HEADROOM, hard))
        yield server
    finally:
        server.stop()


@pytest.mark.slow  # a server process of its own (its address space capped)
@pytest.mark.parametrize("size", [(2_097_152, 8), (8, 2_097_152)])
def test_a_thin_image_within_the_ratio_is_cropped_before_resizing(capped, size):
    png = _png(*size)
    assert len(png) < 100_000
    r = httpx.post(
        f"{capped.url}/v1/embeddings", json={"model": "vip/thin", "input": [_uri(png)]}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) > 0
    assert httpx.get(f"{capped.url}/healthz").status_code == 200


@pytest.mark.slow
def test_an_image_over_the_ratio_is_refused_naming_the_limit(capped):
    r = httpx.post(
        f"{capped.url}/v1/embeddings",
        json={"model": "vip/thin", "input": [_uri(_png(16_777_216, 1))]},
        timeout=120,
    )
    assert r.status_code == 400
    assert (
        f"16777216x1 pixels has an aspect ratio of 1.67772e+07:1, over the limit of "
        f"{MAX_ASPECT:g}:1" in r.json()["error"]
    )
    ok = httpx.post(
        f"{capped.url}/v1/embeddings",
        json={"model": "vip/thin", "input": [_uri(_png(40, 30))]},
        timeout=120,
    )
    assert ok.status_code == 200
