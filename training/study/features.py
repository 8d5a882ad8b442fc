"""What a row's head reads: raw pixels, or an encoder's features in one mode."""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from vip_hub.loading import Encoder

from ..data.labelled import LabelledArrays

__all__ = ["CHUNK", "embed", "pixels"]

CHUNK = 1000
"""Records embedded at once (memory only)."""


def pixels(data: LabelledArrays) -> torch.Tensor:
    """``data``'s grey pixels flattened and scaled to [-1, 1] (a public per-record rule): the
    raw-pixel row's features."""
    return torch.from_numpy(data.images.reshape(len(data), -1).astype(np.float32) / 127.5 - 1.0)


def embed(encoder: Encoder, data: LabelledArrays, mode: str, desc: str = "embed") -> torch.Tensor:
    """``encoder``'s ``mode`` features of every record of ``data`` (N, D), on the CPU."""
    parts = []
    for start in tqdm(range(0, len(data), CHUNK), desc=desc, unit="chunk", leave=False):
        images = [data.pil(i) for i in range(start, min(start + CHUNK, len(data)))]
        parts.append(encoder.embed(images, mode).cpu())
    return torch.cat(parts)
