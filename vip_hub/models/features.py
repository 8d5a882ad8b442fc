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
- ``spatial-b<blocks>-g<grid>`` (e.g. ``spatial-b4-g4``, ``spatial-b4.8-g2``): the patch tokens
  at the output of the given blocks (1-based, before the final norm) kept on their image grid,
  average-pooled to ``grid`` x ``grid`` cells, each block's map normalised per example
  (:data:`SPATIAL_NORM`, no statistics across examples, no parameters), concatenated block by
  block: ``len(blocks) * width * grid**2`` values. For small images and classes that live in
  the layout (a 28-pixel garment's shape), where the means over tokens throw the layout away.
  A repo declares which spatial modes it offers (its configuration's ``feature_dims``).
- ``pixels``: the preprocessed image itself (the encoder's resize, crop and normalisation), its
  channels averaged, flattened: ``H * W`` values that read no weight. Every repo offers it (its
  width is its input size's, so no configuration declares it): a head on it is the raw-pixel
  baseline, served and verified as any other head, whose guarantee is its own stage alone.

Which modes a repo offers is its family's business (``vip_hub.models.encoders.Family.poolings``);
this module computes any mode it is given the weights for. Importing it does not import torch
(the hub's processes name and describe modes without it); the functions that compute do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast, get_args, overload

from ..errors import ConfigError
from ..repo_format import TEXT_DECODER_FILE

if TYPE_CHECKING:
    import torch
    from timm.models.vision_transformer import VisionTransformer

    from .text_decoder import ImageMemory

FixedPooling = Literal["cls", "avg", "vip", "dpcap", "pixels"]
POOLINGS: tuple[FixedPooling, ...] = get_args(FixedPooling)
"""The fixed feature modes; spatial modes (:class:`SpatialMode`) are named by their settings."""
Pooling = str
"""A feature mode's name: one of :data:`POOLINGS` or a :class:`SpatialMode` name."""
PIXELS: FixedPooling = "pixels"
"""The mode that reads the input alone (the module docstring), offered by every repo."""
VIP_LAYERS = 6
LN_EPS = 1e-6
SPATIAL_PATTERN = re.compile(r"spatial-b([1-9][0-9]*(?:\.[1-9][0-9]*)*)-g([1-9][0-9]*)")
SPATIAL_SYNTAX = "spatial-b<block>[.<block>...]-g<grid>"

MODE_DESCRIPTIONS: dict[str, str] = {
    "cls": "the class token after the final norm",
    "avg": "the mean of the patch tokens with the final norm (timm's default forward)",
    "vip": "the ViP paper's linear-probe features: mean patch token of each of the last 6 blocks, "
    "concatenated, then a LayerNorm without parameters",
    "dpcap": (
        "the DP-Cap paper's linear-probe features: mean over all tokens of the text decoder's "
        "image memory (decoder_embed of the normed tokens plus its position and type embeddings)"
    ),
    PIXELS: "the preprocessed image's pixels, its channels averaged, flattened (reads no weights: "
    "the raw-pixel baseline)",
}
"""Each fixed mode in one line, for cards and help texts (:func:`describe` covers every mode)."""

__all__ = [
    "MODE_DESCRIPTIONS",
    "PIXELS",
    "POOLINGS",
    "SPATIAL_PATTERN",
    "SPATIAL_SYNTAX",
    "FixedPooling",
    "Pooling",
    "SpatialMode",
    "check_pooling",
    "default_spatial_modes",
    "describe",
    "extract_features",
    "feature_dim",
    "final_norm",
    "pixel_width",
    "pool_features",
    "vip_layers",
]


@dataclass(frozen=True)
class SpatialMode:
    """A spatial feature mode: the patch tokens of ``blocks`` (1-based) pooled to a ``grid`` x
    ``grid`` map, each block's map normalised per example (the module docstring)."""

    blocks: tuple[int, ...]
    grid: int

    @property
    def name(self) -> str:
        return f"spatial-b{'.'.join(map(str, self.blocks))}-g{self.grid}"

    @classmethod
    def parse(cls, name: str) -> SpatialMode | None:
        """The spatial mode called ``name``, or None if ``name`` is not one (fixed modes)."""
        m = SPATIAL_PATTERN.fullmatch(name)
        if m is None:
            return None
        blocks = tuple(int(b) for b in m[1].split("."))
        if list(blocks) != sorted(set(blocks)):
            raise ConfigError(f"{name}: list the blocks in increasing order, each once")
        return cls(blocks, int(m[2]))

    def check(self, model: VisionTransformer) -> None:
        """Raise ConfigError unless ``model`` has these blocks and a patch grid this fine."""
        depth, side = len(model.blocks), min(model.patch_embed.grid_size)
        if self.blocks[-1] > depth:
            raise ConfigError(f"{self.name}: block {self.blocks[-1]} of a {depth}-block encoder")
        if self.grid > side:
            raise ConfigError(f"{self.name}: a {self.grid}-cell grid from {side} x {side} patches")

    def dim(self, width: int) -> int:
        """Width of the embedding for tokens ``width`` wide."""
        return len(self.blocks) * width * self.grid**2

    def pool(self, tokens: Sequence[torch.Tensor], grid_size: tuple[int, int]) -> torch.Tensor:
        """The embedding from each block's patch tokens (B, N, C), ``grid_size`` the patch grid."""
        import torch
        import torch.nn.functional as F

        maps = []
        for t in tokens:
            x = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], *grid_size)
            x = F.adaptive_avg_pool2d(x, self.grid).flatten(1)
            maps.append(F.layer_norm(x, x.shape[-1:], eps=LN_EPS))
        return torch.cat(maps, dim=1)


SPATIAL_NORM = "a LayerNorm without parameters over each block's pooled map"
"""How :class:`SpatialMode` normalises each example (for cards and help texts)."""


def default_spatial_modes(model: VisionTransformer) -> tuple[str, ...]:
    """The spatial modes a repo declares unless told otherwise: the blocks at a third and two
    thirds of the depth (the last block's layout is the MAE's reconstruction target, weaker for a
    probe), each on a 4 x 4 and a 2 x 2 grid (at most the patch grid)."""
    depth, side = len(model.blocks), min(model.patch_embed.grid_size)
    blocks = sorted({max(1, depth // 3), max(1, 2 * depth // 3)})
    grids = sorted({min(4, side), min(2, side)}, reverse=True)
    return tuple(SpatialMode((b,), g).name for g in grids for b in blocks)


def describe(pooling: Pooling) -> str:
    """One line saying what feature mode ``pooling`` computes."""
    spatial = SpatialMode.parse(pooling)
    if spatial is None:
        return MODE_DESCRIPTIONS[pooling]
    blocks = ", ".join(map(str, spatial.blocks))
    return (
        f"patch tokens of block{'s' if len(spatial.blocks) > 1 else ''} {blocks} average-pooled "
        f"to a {spatial.grid} x {spatial.grid} grid, {SPATIAL_NORM}, concatenated: for small "
        "images and layout-bound classes"
    )


def final_norm(model: VisionTransformer) -> torch.nn.Module:
    """The encoder's final LayerNorm, wherever the timm layout keeps it."""
    import torch

    return model.fc_norm if not isinstance(model.fc_norm, torch.nn.Identity) else model.norm


def vip_layers(model: VisionTransformer) -> int:
    """Blocks concatenated by the ``vip`` mode: the last 6, or all of a shallower model."""
    return min(VIP_LAYERS, len(model.blocks))


def pixel_width(input_size: Sequence[int]) -> int:
    """Width of the ``pixels`` mode for inputs of ``input_size`` ((H, W), or timm's (C, H, W))."""
    height, width = input_size[-2:]
    return int(height) * int(width)


def feature_dim(
    model: VisionTransformer, pooling: Pooling, memory: ImageMemory | None = None
) -> int:
    """Width of the embedding that ``pooling`` produces."""
    spatial = check_pooling(pooling, model)
    if spatial is not None:
        return spatial.dim(model.embed_dim)
    if pooling == PIXELS:
        return pixel_width(model.patch_embed.img_size)
    if pooling == "dpcap":
        return _need_memory(model, memory).width
    return model.embed_dim * (vip_layers(model) if pooling == "vip" else 1)


@overload
def extract_features(
    model: VisionTransformer,
    images: torch.Tensor,
    pooling: Pooling,
    memory: ImageMemory | None = None,
) -> torch.Tensor: ...


@overload
def extract_features(
    model: VisionTransformer,
    images: torch.Tensor,
    pooling: tuple[Pooling, ...],
    memory: ImageMemory | None = None,
) -> dict[Pooling, torch.Tensor]: ...


def extract_features(
    model: VisionTransformer,
    images: torch.Tensor,
    pooling: Pooling | tuple[Pooling, ...],
    memory: ImageMemory | None = None,
) -> torch.Tensor | dict[Pooling, torch.Tensor]:
    """Embed a batch of preprocessed images, shape (B, 3, H, W).

    A single mode returns a (B, dim) tensor; a tuple of modes returns a dict of them,
    computed from one forward pass (up to the deepest block they read; none for ``pixels``
    alone). ``dpcap`` needs the image ``memory`` weights.
    """
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    spatial = [s for s in (check_pooling(m, model) for m in modes) if s is not None]
    if "dpcap" in modes:
        _need_memory(model, memory)
    result: dict[Pooling, torch.Tensor] = {}
    if PIXELS in modes:
        result[PIXELS] = images.mean(dim=1).flatten(1)
    read = tuple(m for m in modes if m != PIXELS)  # the modes that read the blocks
    if read:
        result.update(_from_blocks(model, images, read, spatial, memory))
    return result[modes[0]] if isinstance(pooling, str) else {m: result[m] for m in modes}


def _from_blocks(
    model: VisionTransformer,
    images: torch.Tensor,
    modes: tuple[Pooling, ...],
    spatial: Sequence[SpatialMode],
    memory: ImageMemory | None,
) -> dict[Pooling, torch.Tensor]:
    """``modes`` (none of them ``pixels``) from one forward pass up to the deepest block read."""
    depth = len(model.blocks)
    blocks = {b - 1 for s in spatial for b in s.blocks}
    if any(m in POOLINGS for m in modes):
        blocks.add(depth - 1)
    if "vip" in modes:
        blocks.update(range(depth - vip_layers(model), depth))
    indices = sorted(blocks)
    # intermediates_only with return_prefix_tokens: a list of (patch tokens, prefix tokens)
    outputs = model.forward_intermediates(
        images,
        indices=indices,
        norm=False,
        output_fmt="NLC",
        return_prefix_tokens=True,
        intermediates_only=True,
        stop_early=True,
    )
    pairs = cast("list[tuple[torch.Tensor, torch.Tensor]]", outputs)
    return pool_features(model, pairs, modes, memory, blocks=indices)


def pool_features(
    model: VisionTransformer,
    outputs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    modes: tuple[Pooling, ...],
    memory: ImageMemory | None = None,
    blocks: Sequence[int] | None = None,
) -> dict[Pooling, torch.Tensor]:
    """The feature modes from blocks' outputs as (patch tokens, prefix tokens) pairs, the last
    block's last (``vip`` reads the patch-token mean of the last ``vip_layers`` pairs; the other
    fixed modes the last pair only): what ``extract_features`` computes after the blocks.
    Spatial modes need ``blocks``, each output's block index (0-based)."""
    import torch
    import torch.nn.functional as F

    result: dict[Pooling, torch.Tensor] = {}
    for mode in modes:
        spatial = SpatialMode.parse(mode)
        if spatial is None:
            continue
        if blocks is None:
            raise ConfigError(f"{mode}: pool_features needs each output's block index")
        by_block = dict(zip(blocks, outputs, strict=True))
        tokens = [by_block[b - 1][0] for b in spatial.blocks]
        result[mode] = spatial.pool(tokens, model.patch_embed.grid_size)
    if all(mode in result for mode in modes):
        return {mode: result[mode] for mode in modes}
    spatial_tokens, prefix = outputs[-1]
    # The per-token final norm (timm's ``norm``: Identity in the ViP layout), then the pooled
    # one (``fc_norm``: Identity in the DP-Cap layout), exactly as timm's forward applies them.
    tokens = model.norm(torch.cat([prefix, spatial_tokens], dim=1))
    p = prefix.shape[1]
    for mode in modes:
        if mode == "cls":
            result[mode] = model.fc_norm(tokens[:, 0])
        elif mode == "avg":
            result[mode] = model.fc_norm(tokens[:, p:].mean(dim=1))
        elif mode == "dpcap":
            assert memory is not None  # extract_features checked it; fine-tuning refuses dpcap
            result[mode] = memory.pooled(tokens)
        elif mode == "vip":
            stacked = torch.cat([s.mean(dim=1) for s, _ in outputs[-vip_layers(model) :]], dim=1)
            result[mode] = F.layer_norm(stacked, stacked.shape[-1:], eps=LN_EPS)
    return {mode: result[mode] for mode in modes}


def check_pooling(pooling: str, model: VisionTransformer | None = None) -> SpatialMode | None:
    """Raise ConfigError unless ``pooling`` is a known feature mode (and, given ``model``, one it
    can compute); returns the spatial mode it names, if it names one."""
    spatial = SpatialMode.parse(pooling)
    if spatial is None and pooling not in POOLINGS:
        raise ConfigError(
            f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)} or {SPATIAL_SYNTAX}"
        )
    if spatial is not None and model is not None:
        spatial.check(model)
    return spatial


def _need_memory(model: VisionTransformer, memory: ImageMemory | None) -> ImageMemory:
    import torch

    if memory is None:
        raise ConfigError(
            "the dpcap feature mode needs the text decoder's image-memory weights "
            f"(a DP-Cap repo's {TEXT_DECODER_FILE})"
        )
    if not isinstance(model.fc_norm, torch.nn.Identity):
        raise ConfigError(
            "the dpcap feature mode needs an encoder with the final norm on every token "
            "(a dpcap-* architecture)"
        )
    return memory
