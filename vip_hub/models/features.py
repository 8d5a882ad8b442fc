"""Feature modes of an encoder, computed with timm's own ``forward_intermediates``.

- ``cls``: the class token after the final norm.
- ``avg``: the mean of the patch tokens with the final norm: what the exported timm model's
  default forward returns (ViP: the norm after the mean, MAE's global pool; DP-Cap: the mean
  of the normed tokens).
- ``vip``: the ViP paper's linear-probe features: the mean of the patch tokens at the output
  of each of the last 6 blocks, before the final norm, concatenated, then a LayerNorm
  without learned parameters.
- ``dpcap``: the DP-Cap reference's linear-probe features (``linear_prob_forward(x).mean(1)``):
  the mean over all tokens, class token included, of the text decoder's image memory
  ``decoder_embed(norm(h)) + decoder_pos_embed + decoder_image_type_embedding``. It needs that
  memory's weights (``vip_hub.models.text_decoder.ImageMemory``, stored in the repo's text decoder
  file).

Which modes a repo offers is its family's business (``vip_hub.models.encoders.Family.poolings``);
this module computes any mode it is given the weights for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from ..errors import ConfigError

if TYPE_CHECKING:  # captioning imports nothing from here, but keep the import light
    from .text_decoder import ImageMemory

Pooling = Literal["cls", "avg", "vip", "dpcap"]
POOLINGS: tuple[Pooling, ...] = get_args(Pooling)
VIP_LAYERS = 6
LN_EPS = 1e-6

MODE_DESCRIPTIONS: dict[str, str] = {
    "cls": "the class token after the final norm",
    "avg": "the mean of the patch tokens with the final norm (timm's default forward)",
    "vip": "the ViP paper's linear-probe features: mean patch token of each of the last 6 blocks, "
    "concatenated, then a LayerNorm without parameters",
    "dpcap": (
        "the DP-Cap paper's linear-probe features: mean over all tokens of the text decoder's "
        "image memory (decoder_embed of the normed tokens plus its position and type embeddings)"
    ),
}
"""Each mode in one line, for cards and help texts."""

__all__ = [
    "MODE_DESCRIPTIONS",
    "POOLINGS",
    "Pooling",
    "check_pooling",
    "extract_features",
    "feature_dim",
    "final_norm",
    "pool_features",
    "vip_layers",
]


def final_norm(model: VisionTransformer) -> torch.nn.Module:
    """The encoder's final LayerNorm, wherever the timm layout keeps it."""
    return model.fc_norm if not isinstance(model.fc_norm, torch.nn.Identity) else model.norm


def vip_layers(model: VisionTransformer) -> int:
    """Blocks concatenated by the ``vip`` mode: the last 6, or all of a shallower model."""
    return min(VIP_LAYERS, len(model.blocks))


def feature_dim(
    model: VisionTransformer, pooling: Pooling, memory: ImageMemory | None = None
) -> int:
    """Width of the embedding that ``pooling`` produces."""
    check_pooling(pooling)
    if pooling == "dpcap":
        return _need_memory(model, memory).width
    return model.embed_dim * (vip_layers(model) if pooling == "vip" else 1)


def extract_features(
    model: VisionTransformer,
    images: torch.Tensor,
    pooling: Pooling | tuple[Pooling, ...],
    memory: ImageMemory | None = None,
) -> torch.Tensor | dict[Pooling, torch.Tensor]:
    """Embed a batch of preprocessed images, shape (B, 3, H, W).

    A single mode returns a (B, dim) tensor; a tuple of modes returns a dict of them,
    computed from one forward pass. ``dpcap`` needs the image ``memory`` weights.
    """
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    for mode in modes:
        check_pooling(mode)
    if "dpcap" in modes:
        _need_memory(model, memory)
    depth = vip_layers(model) if "vip" in modes else 1
    outputs = model.forward_intermediates(
        images,
        indices=depth,
        norm=False,
        output_fmt="NLC",
        return_prefix_tokens=True,
        intermediates_only=True,
    )
    result = pool_features(model, outputs, modes, memory)
    return result[modes[0]] if isinstance(pooling, str) else result


def pool_features(
    model: VisionTransformer,
    outputs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    modes: tuple[Pooling, ...],
    memory: ImageMemory | None = None,
) -> dict[Pooling, torch.Tensor]:
    """The feature modes from the blocks' outputs as (patch tokens, prefix tokens) pairs, the last
    block's last (``vip`` reads the patch-token mean of the last ``vip_layers`` pairs; the others
    the last pair only): what ``extract_features`` computes after the blocks."""
    spatial, prefix = outputs[-1]
    # The per-token final norm (timm's ``norm``: Identity in the ViP layout), then the pooled
    # one (``fc_norm``: Identity in the DP-Cap layout), exactly as timm's forward applies them.
    tokens = model.norm(torch.cat([prefix, spatial], dim=1))
    p = prefix.shape[1]
    result: dict[Pooling, torch.Tensor] = {}
    for mode in modes:
        if mode == "cls":
            result[mode] = model.fc_norm(tokens[:, 0])
        elif mode == "avg":
            result[mode] = model.fc_norm(tokens[:, p:].mean(dim=1))
        elif mode == "dpcap":
            result[mode] = memory.pooled(tokens)  # type: ignore[union-attr]
        else:
            stacked = torch.cat([s.mean(dim=1) for s, _ in outputs[-vip_layers(model) :]], dim=1)
            result[mode] = F.layer_norm(stacked, stacked.shape[-1:], eps=LN_EPS)
    return result


def check_pooling(pooling: str) -> None:
    """Raise ConfigError unless ``pooling`` is a known feature mode."""
    if pooling not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")


def _need_memory(model: VisionTransformer, memory: ImageMemory | None) -> ImageMemory:
    if memory is None:
        raise ConfigError(
            "the dpcap feature mode needs the text decoder's image-memory weights "
            "(a DP-Cap repo's text_decoder.safetensors)"
        )
    if not isinstance(model.fc_norm, torch.nn.Identity):
        raise ConfigError(
            "the dpcap feature mode needs an encoder with the final norm on every token "
            "(a dpcap-* architecture)"
        )
    return memory
