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
            chunks = range(0, len(data), CHUNK)
            images = (
                encoder.preprocess([data.pil(i) for i in range(s, min(s + CHUNK, len(data)))])
                for s in tqdm(chunks, desc="preprocess", unit="chunk", leave=False)
            )
            self._done[key] = (data, torch.cat(list(images)))
        return self._done[key][1]


def embed(
    encoder: Encoder,
    data: LabelledArrays,
    mode: str,
    desc: str = "embed",
    inputs: Inputs | None = None,
) -> torch.Tensor:
    """``encoder``'s ``mode`` features of every record of ``data`` (N, D), on the CPU; with
    ``inputs``, from its preprocessed records (the same features, computed in the same batches)."""
    parts = []
    for start in tqdm(range(0, len(data), CHUNK), desc=desc, unit="chunk", leave=False):
        stop = min(start + CHUNK, len(data))
        if inputs is None:
            batch: list[Image.Image] | torch.Tensor = [data.pil(i) for i in range(start, stop)]
        else:
            batch = inputs(encoder, data)[start:stop]
        parts.append(encoder.embed(batch, mode).cpu())
    return torch.cat(parts)
