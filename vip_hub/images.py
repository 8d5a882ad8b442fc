"""The one rule that turns a decoded PIL image into the RGB image a model sees, shared by serving,
training and the Python API (``to_rgb``).

As timm's loader (``convert("RGB")``), with two differences: the EXIF orientation is applied (as
``PIL.ImageOps.exif_transpose`` does), so a phone photo comes upright as a viewer shows it; 16-bit
and float greyscale (I;16, I;16B, I, F) are scaled to 8 bits (a 16-bit value >> 8, a float in
[0, 1] times 255) instead of being clipped at 255. Alpha is dropped, not composited: a transparent
pixel keeps the colour stored under it.
"""

from __future__ import annotations

import numpy as np
from PIL import ExifTags, Image

__all__ = ["to_rgb"]

_WIDE_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_UPRIGHT = {  # EXIF orientation -> what shows the image as a viewer does (as exif_transpose)
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def to_rgb(img: Image.Image) -> Image.Image:
    """``img``'s pixels as RGB, upright (EXIF orientation) and wide greyscale scaled to 8 bits;
    ``img`` itself when it already is both, a new image otherwise (``img`` is not changed)."""
    img.load()  # a PNG may carry its EXIF after the pixels
    turn = _UPRIGHT.get(img.getexif().get(ExifTags.Base.Orientation, 1))
    if turn is not None:  # not exif_transpose: it rewrites the EXIF, and fails on a corrupt one
        img = img.transpose(turn)
        img.info = {}  # the metadata that said to turn it: a second to_rgb leaves it alone
    if img.mode in _WIDE_GREY:
        pixels = np.asarray(img)
        if img.mode == "F":
            grey = np.rint(np.clip(np.nan_to_num(pixels), 0.0, 1.0) * 255.0)
        else:
            grey = np.clip(pixels, 0, 65535) >> 8
        img = Image.fromarray(grey.astype(np.uint8))
    return img if img.mode == "RGB" else img.convert("RGB")
