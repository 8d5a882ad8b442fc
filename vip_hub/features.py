"""Feature modes of a vip-* encoder, computed with timm's own ``forward_intermediates``.

- ``cls``: the class token after the final norm.
- ``avg``: the mean of the patch tokens, then the final norm (MAE's global pool; what the
  exported timm model's default forward returns).
- ``vip``: the ViP paper's linear-probe features: the mean of the patch tokens at the output
  of each of the last 6 blocks, before the final norm, concatenated, then a LayerNorm
  without learned parameters.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from .errors import ConfigError

Pooling = Literal["cls", "avg", "vip"]
POOLINGS: tuple[Pooling, ...] = get_args(Pooling)
VIP_LAYERS = 6
LN_EPS = 1e-6

__all__ = ["POOLINGS", "Pooling", "check_pooling", "extract_features", "feature_dim", "final_norm", "vip_layers"]


def final_norm(model: VisionTransformer) -> torch.nn.Module:
    """The encoder's final LayerNorm, wherever the timm layout keeps it."""
    return model.fc_norm if not isinstance(model.fc_norm, torch.nn.Identity) else model.norm


def vip_layers(model: VisionTransformer) -> int:
    """Blocks concatenated by the ``vip`` mode: the last 6, or all of a shallower model."""
    return min(VIP_LAYERS, len(model.blocks))


def feature_dim(model: VisionTransformer, pooling: Pooling) -> int:
    """Width of the embedding that ``pooling`` produces."""
    check_pooling(pooling)
    return model.embed_dim * (vip_layers(model) if pooling == "vip" else 1)


def extract_features(
    model: VisionTransformer, images: torch.Tensor, pooling: Pooling | tuple[Pooling, ...]
) -> torch.Tensor | dict[Pooling, torch.Tensor]:
    """Embed a batch of preprocessed images, shape (B, 3, H, W).

    A single mode returns a (B, dim) tensor; a tuple of modes returns a dict of them,
    computed from one forward pass.
    """
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    for mode in modes:
        check_pooling(mode)
    depth = vip_layers(model) if "vip" in modes else 1
    outputs = model.forward_intermediates(
        images,
        indices=depth,
        norm=False,
        output_fmt="NLC",
        return_prefix_tokens=True,
        intermediates_only=True,
    )
    patches = [spatial for spatial, _ in outputs]
    norm = final_norm(model)
    result: dict[Pooling, torch.Tensor] = {}
    for mode in modes:
        if mode == "cls":
            result[mode] = norm(outputs[-1][1][:, 0])
        elif mode == "avg":
            result[mode] = norm(patches[-1].mean(dim=1))
        else:
            stacked = torch.cat([p.mean(dim=1) for p in patches], dim=1)
            result[mode] = F.layer_norm(stacked, stacked.shape[-1:], eps=LN_EPS)
    return result[modes[0]] if isinstance(pooling, str) else result


def check_pooling(pooling: str) -> None:
    """Raise ConfigError unless ``pooling`` is a known feature mode."""
    if pooling not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
