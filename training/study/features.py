"""What a row's head reads: raw pixels, or an encoder's features in one mode, optionally on the
top principal components of the public centring records' features."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from vip_hub.loading import Encoder

from ..data.labelled import LabelledArrays

__all__ = ["CHUNK", "embed", "pixels", "public_components"]

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


def public_components(centre: torch.Tensor, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map of features onto the top ``k`` principal directions of ``centre``, features of
    PUBLIC records (centred on their mean, scaled so that their mean norm is kept): fixed by public
    data, so a DP head may read it in place of the features, with fewer coordinates for its noise,
    at no privacy cost."""
    if not 0 < k <= min(centre.shape):
        raise ValueError(f"{k} components of {tuple(centre.shape)} public features")
    mean = centre.double().mean(0, keepdim=True)
    centred = centre.double() - mean
    directions = torch.linalg.svd(centred, full_matrices=False)[2][:k].T
    p = directions * centred.norm(dim=1).mean() / (centred @ directions).norm(dim=1).mean()

    def project(x: torch.Tensor) -> torch.Tensor:
        return ((x.double() - mean) @ p).to(x.dtype)

    return project
