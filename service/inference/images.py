"""Untrusted images in, RGB PIL images out, with limits enforced before the pixels are decoded.

Accepted: JPEG, PNG, WebP, GIF (first frame), BMP, TIFF. The byte size is checked before
base64 decoding, the pixel count and the aspect ratio from the header before ``load()``
(decompression bombs never allocate), and every failure names the input's index and the reason.
An image much larger than the model's input is decoded at a reduced scale (``load_rgb``); one
whose resize to the model's input would be large is centre-cropped along its long side first
(``crop_for_resize``), so a thin image is never resized to hundreds of megapixels.

Modes become RGB by ``vip_hub.images.to_rgb``, as in training and in the Python API: as timm's
loader does (``convert("RGB")``: L, LA, P, RGBA, CMYK; alpha dropped), but upright by the EXIF
orientation, and 16-bit and float greyscale (I;16, I, F) scaled to 8 bits instead of clipped.
"""

from __future__ import annotations

import binascii
import io
import math
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pybase64
from PIL import Image, UnidentifiedImageError

from vip_hub.images import to_rgb

from ..errors import BadRequest, PayloadTooLarge

__all__ = [
    "FORMATS",
    "ImageLimits",
    "crop_for_resize",
    "image_bytes_from_text",
    "load_rgb",
    "open_image",
]

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_DATA_URI = re.compile(  # a URI's scheme and RFC 2397's ";base64" are case-insensitive
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[\w-]+=[\w.-]+)*;base64,", re.ASCII | re.IGNORECASE
)


@dataclass(frozen=True)
class ImageLimits:
    """Per-image limits (``inference.max_image_bytes``, ``max_image_pixels``,
    ``max_aspect_ratio``)."""

    max_bytes: int
    max_pixels: int
    max_aspect_ratio: float


def image_bytes_from_text(text: str, index: int, limits: ImageLimits) -> bytes:
    """Bytes of a base64 string or ``data:`` URI; URLs are refused (no server-side fetching)."""
    scheme = text[:8].lower()
    if scheme.startswith(("http://", "https://", "ftp://", "file:")):
        raise BadRequest(
            f"input[{index}]: URLs are not fetched; send the image bytes as base64 or a data: URI"
        )
    payload = text
    if scheme.startswith("data:"):
        match = _DATA_URI.match(text)
        if match is None:
            raise BadRequest(
                f"input[{index}]: a data: URI must be base64-encoded (data:image/png;base64,...)"
            )
        payload = text[match.end() :]
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise PayloadTooLarge(f"input[{index}]: image larger than {limits.max_bytes} bytes")
    try:
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"input[{index}]: not valid base64") from None
    return data


def open_image(data: bytes, index: int, limits: ImageLimits) -> Image.Image:
    """The image's header, checked (size in bytes, format, pixel count) before any pixel is
    decoded; a 4xx naming ``index`` and what was wrong otherwise."""
    if not data:
        raise BadRequest(f"input[{index}]: empty image")
    if len(data) > limits.max_bytes:
        raise PayloadTooLarge(f"input[{index}]: image larger than {limits.max_bytes} bytes")
    _check_structure(data, index, limits)
    with _decoding(index):
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = img.size
        if width * height > limits.max_pixels:
            raise PayloadTooLarge(
                f"input[{index}]: {width}x{height} pixels exceeds the limit of {limits.max_pixels} "
                "(decompression bombs are refused from the header)"
            )
        if width == 0 or height == 0:
            raise BadRequest(f"input[{index}]: image has no pixels")
        long, short = max(width, height), min(width, height)
        if long > limits.max_aspect_ratio * short:
            raise BadRequest(
                f"input[{index}]: {width}x{height} pixels has an aspect ratio of "
                f"{long / short:.6g}:1, over the limit of {limits.max_aspect_ratio:g}:1 "
                "(inference.max_aspect_ratio); crop or pad it first"
            )
    return img


MAX_HEADER_STEPS = 1024
"""Most steps (JPEG marker segments, fill and junk bytes before the first scan; GIF blocks and
sub-blocks before the first frame) an image may take to reach its pixels: Pillow walks them in
Python, so megabytes of empty ones held a preprocessing thread for seconds."""
MAX_PNG_CHUNKS = 16_384
"""Most chunks of a PNG (a 10 MiB one written in libpng's 8 KiB IDAT chunks has 1,280): Pillow
reads each in Python, the IDAT chunks as it decodes."""
MAX_JPEG_SCANS = 100
"""Most scans of a JPEG: each costs a pass over every pixel, so one
10 MiB image of repeated empty progressive scans decoded for minutes (libjpeg-turbo's
``-maxscan`` guidance; a progressive encoder writes about 10)."""
MAX_TIFF_BLOCKS = 65_536
"""Most strips or tiles of a TIFF (a 4096x4096 one of a row per strip in four planes has 65,536):
Pillow reads an uncompressed one's blocks one at a time in Python, so a 64x64 TIFF listing 1.25M
strips held a preprocessing thread for 8.6 s."""


def _check_structure(data: bytes, index: int, limits: ImageLimits) -> None:
    """BadRequest naming ``index`` for an image whose structure would cost its decoder more than
    its bytes and pixels say (``MAX_HEADER_STEPS``, ``MAX_PNG_CHUNKS``, ``MAX_JPEG_SCANS``, a
    TIFF's blocks); checked on the raw bytes before Pillow parses anything."""
    scans = 0
    if data.startswith(b"\xff\xd8"):
        steps, first_scan = _jpeg_header_steps(data)
        what = "marker segments or fill bytes before its scan"
        # in coded data a 0xff byte is followed by 0 or RSTn: each 0xff 0xda is a scan
        scans = data.count(b"\xff\xda", first_scan)
    elif data.startswith(b"GIF8"):
        steps, what = _gif_header_steps(data), "blocks before its first frame"
    elif data.startswith(b"\x89PNG\r\n\x1a\n") and _png_chunks(data) > MAX_PNG_CHUNKS:
        raise BadRequest(f"input[{index}]: a PNG of more than {MAX_PNG_CHUNKS} chunks")
    elif data[:4] in _TIFF_MAGIC and (problem := _tiff_problem(data, limits.max_pixels)):
        raise BadRequest(f"input[{index}]: {problem}")
    else:
        steps, what = 0, ""
    if steps > MAX_HEADER_STEPS:
        raise BadRequest(f"input[{index}]: more than {MAX_HEADER_STEPS} {what}")
    if scans > MAX_JPEG_SCANS:
        raise BadRequest(
            f"input[{index}]: a JPEG of {scans} scans, over the limit of {MAX_JPEG_SCANS} (each "
            "is a pass over every pixel)"
        )


_TIFF_MAGIC = (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")  # classic and BigTIFF, each byte order
_TIFF_OFFSETS = {273: "strips", 324: "tiles"}  # StripOffsets, TileOffsets: their counts matter
# ImageWidth, ImageLength, SamplesPerPixel, RowsPerStrip, PlanarConfiguration, TileWidth, -Length
_TIFF_SIZES = {
    256: "width",
    257: "height",
    277: "samples",
    278: "rows",
    284: "planar",
    322: "tile_width",
    323: "tile_length",
}
_TIFF_INTEGERS = {3: "H", 4: "I", 16: "Q"}  # SHORT, LONG, LONG8: the types a size may have


def _tiff_problem(data: bytes, max_pixels: int) -> str | None:
    """What makes a TIFF's first directory cost more than its pixels: more than
    ``MAX_HEADER_STEPS`` entries, more than ``MAX_TIFF_BLOCKS`` strips or tiles or more than its
    size divides into, or a tile of more than ``max_pixels`` (decoded whole); else None."""
    try:
        entries, fields = _tiff_directory(data)
    except struct.error:
        return None  # truncated: Pillow names it
    if entries > MAX_HEADER_STEPS:
        return f"a TIFF directory of {entries} entries, over the limit of {MAX_HEADER_STEPS}"
    kind = "tiles" if "tiles" in fields else "strips"
    if (blocks := fields.get(kind)) is None:
        return None
    if blocks > MAX_TIFF_BLOCKS:
        return f"a TIFF of {blocks} {kind}, over the limit of {MAX_TIFF_BLOCKS}"
    width, height = fields.get("width", 0), fields.get("height", 0)
    planes = fields.get("samples", 1) if fields.get("planar") == 2 else 1
    if kind == "tiles":
        across, down = fields.get("tile_width", 0), fields.get("tile_length", 0)
        if across * down > max_pixels:
            return (
                f"a TIFF tile of {across}x{down} pixels, over the limit of {max_pixels} "
                "(inference.max_image_pixels: a tile is decoded whole)"
            )
        grid = f"{width}x{height} pixels in {across}x{down} tiles"
    else:
        across, down = width, min(fields.get("rows", height) or height, height)
        grid = f"{height} rows in strips of {down}"
    if not (width and height and across and down):
        return None  # no pixels or no block size: Pillow names it
    expected = -(-width // across) * -(-height // down) * planes
    if blocks > expected:
        return f"a TIFF listing {blocks} {kind} where its {grid} make {expected}"
    return None


def _tiff_directory(data: bytes) -> tuple[int, dict[str, int]]:
    """The entry count of a TIFF's first directory, and the sizes in ``_TIFF_SIZES`` and block
    counts in ``_TIFF_OFFSETS`` among its first ``MAX_HEADER_STEPS`` entries."""
    order = "<" if data[:2] == b"II" else ">"
    big = data[2:4] in (b"+\0", b"\0+")  # BigTIFF: 8-byte counts and offsets
    count, entry, offset = ("Q", 20, 8) if big else ("H", 12, 4)
    (directory,) = struct.unpack_from(order + ("Q" if big else "I"), data, offset)
    (entries,) = struct.unpack_from(order + count, data, directory)
    fields: dict[str, int] = {}
    start = directory + struct.calcsize(count)
    for pos in range(start, start + entry * min(entries, MAX_HEADER_STEPS), entry):
        tag, kind, values = struct.unpack_from(order + ("HHQ" if big else "HHI"), data, pos)
        if tag in _TIFF_OFFSETS:
            fields[_TIFF_OFFSETS[tag]] = values
        elif tag in _TIFF_SIZES and kind in _TIFF_INTEGERS and values == 1 and (big or kind != 16):
            value_at = pos + (12 if big else 8)
            (fields[_TIFF_SIZES[tag]],) = struct.unpack_from(
                order + _TIFF_INTEGERS[kind], data, value_at
            )
    return entries, fields


def _jpeg_header_steps(data: bytes) -> tuple[int, int]:
    """The steps Pillow's JPEG parser takes from the start of ``data`` to its first scan (or the
    end), each a segment, a fill byte or a junk byte, counted to ``MAX_HEADER_STEPS + 1`` at
    most; and where they stopped."""
    pos, steps = 2, 0
    while pos + 1 < len(data) and steps <= MAX_HEADER_STEPS:
        steps += 1
        marker = data[pos + 1]
        if data[pos] != 0xFF or marker in (0x00, 0xFF):  # junk or fill: one byte at a time
            pos += 1
        elif marker == 0xDA:  # the first scan: the pixels
            break
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return steps, pos


def _gif_header_steps(data: bytes) -> int:
    """The blocks and sub-blocks before a GIF's first frame; counted to ``MAX_HEADER_STEPS + 1``
    at most."""
    pos = 13 + (3 << ((data[10] & 7) + 1) if len(data) > 10 and data[10] & 0x80 else 0)
    steps = 0
    while pos < len(data) and data[pos : pos + 1] == b"!" and steps <= MAX_HEADER_STEPS:
        pos += 2  # the extension's introducer and label, then its sub-blocks
        while pos < len(data) and data[pos] and steps <= MAX_HEADER_STEPS:
            steps += 1
            pos += 1 + data[pos]
        pos += 1
        steps += 1
    return steps


def _png_chunks(data: bytes) -> int:
    """A PNG's chunks up to its IEND (or the end of ``data``); counted to ``MAX_PNG_CHUNKS + 1``
    at most."""
    pos, chunks = 8, 0
    while pos + 8 <= len(data) and chunks <= MAX_PNG_CHUNKS:
        chunks += 1
        if data[pos + 4 : pos + 8] == b"IEND":
            break
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")
    return chunks


def crop_for_resize(img: Image.Image, min_side: int, max_pixels: int) -> Image.Image:
    """``img`` centre-cropped along its long side so that resizing its shorter side to
    ``min_side`` makes at most ``max_pixels`` pixels (never below a square: what is cut lies
    outside the centre crop that follows the resize)."""
    short, long = min(img.size), max(img.size)
    keep = max(short, math.floor(max_pixels * short / max(min_side, 1) ** 2))
    if min_side <= 0 or long <= keep:
        return img
    start = (long - keep) // 2
    if img.width > img.height:
        return img.crop((start, 0, start + keep, img.height))
    return img.crop((0, start, img.width, start + keep))


def load_rgb(img: Image.Image, index: int, min_side: int = 0) -> Image.Image:
    """Decode an opened image's first frame to RGB (``to_rgb``), reduced by a power of two (at
    most 8) while its shorter side stays at least twice ``min_side`` (the model's resize target):
    JPEG decodes at that scale directly, other formats are reduced once in RGB."""
    factor = 1
    while factor < 8 and min(img.size) // (2 * factor) >= 2 * min_side > 0:
        factor *= 2
    with _decoding(index):
        img.seek(0)  # first frame of an animation
        if factor > 1 and img.format == "JPEG":
            img.draft("RGB", (img.width // factor, img.height // factor))
            factor = 1
        rgb = to_rgb(img)
    return rgb.reduce(factor) if factor > 1 else rgb


@contextmanager
def _decoding(index: int) -> Iterator[None]:
    """PIL's failures as 4xx errors naming input ``index``. The warning filters are left alone
    (they are the process's, and images decode in several threads at once): ``open_image``
    refuses what is over ``max_pixels`` from the header, and PIL raises its
    ``DecompressionBombError`` over twice its ``MAX_IMAGE_PIXELS``."""
    try:
        yield
    except UnidentifiedImageError:
        raise BadRequest(
            f"input[{index}]: not an image in a supported format ({', '.join(FORMATS)})"
        ) from None
    # the warning as well where the interpreter makes warnings errors (python -W error)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise PayloadTooLarge(
            f"input[{index}]: decompression bomb refused from the header ({e})"
        ) from None
    except (
        OSError,
        SyntaxError,
        ValueError,
        EOFError,
        # a malformed header's field of the wrong type (a TIFF's StripOffsets as a fraction),
        # index or key: Pillow's plugins raise these as they parse
        TypeError,
        IndexError,
        KeyError,
        struct.error,
        ZeroDivisionError,
    ) as e:
        raise BadRequest(f"input[{index}]: truncated or corrupt image data ({e})") from None
