"""What a row's head reads: raw pixels, or an encoder's features in one mode."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from vip_hub.loading import Encoder

from ..data.labelled import LabelledArrays

__all__ = ["CHUNK", "Inputs", "embed", "pixels"]

CHUNK = 1000
"""Records embedded at once (memory only)."""


def pixels(data: LabelledArrays) -> torch.Tensor:
    """``data``'s grey pixels flattened and scaled to [-1, 1] (a public per-record rule): the
    raw-pixel row's features."""
    return torch.from_numpy(data.images.reshape(len(data), -1).astype(np.float32) / 127.5 - 1.0)


class Inputs:
    """Each dataset's records preprocessed once per data configuration: the encoders of one run
    whose transforms share theirs (``Encoder.data_config``) read the same tensors, which equal
    what ``Encoder.preprocess`` makes of the records' images."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, int], tuple[LabelledArrays, torch.Tensor]] = {}

    def __call__(self, encoder: Encoder, data: LabelledArrays) -> torch.Tensor:
        """``data``'s records as ``encoder`` preprocesses them, (N, 3, H, W) on the CPU."""
        key = (json.dumps(encoder.data_config, sort_keys=True), id(data))
        if key not in self._done:  # the dataset is kept with its tensors, so its id stays its own
            chunks = tqdm(range(0, len(data), CHUNK), desc="preprocess", unit="chunk", leave=False)
            images = [encoder.preprocess(_images(data, s)) for s in chunks]
            self._done[key] = (data, torch.cat(images))
        return self._done[key][1]


def _images(data: LabelledArrays, start: int) -> list[Image.Image]:
    """The chunk of ``data`` from record ``start`` as PIL images."""
    return [data.pil(i) for i in range(start, min(start + CHUNK, len(data)))]


def embed(
    encoder: Encoder,
    data: LabelledArrays,
    mode: str,
    desc: str = "embed",
    inputs: Inputs | None = None,
) -> torch.Tensor:
    """``encoder``'s ``mode`` features of every record of ``data`` (N, D), on the CPU; with
    ``inputs``, from its preprocessed records (the same features, computed in the same batches)."""
    ready = inputs(encoder, data) if inputs is not None else None
    parts = []
    for start in tqdm(range(0, len(data), CHUNK), desc=desc, unit="chunk", leave=False):
        batch = _images(data, start) if ready is None else ready[start : start + CHUNK]
        parts.append(encoder.embed(batch, mode).cpu())
    return torch.cat(parts)
