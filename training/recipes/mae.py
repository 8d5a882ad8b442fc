"""Masked autoencoder around a vip-* or dpcap-* timm encoder (He et al. 2022; the ViP recipe, and
the synthetic-image step DP-Cap starts from).

The encoder is the exported timm ``VisionTransformer`` itself, so trained weights export
without key surgery; the decoder's parameter names follow the reference ``models_mae.py``
(``decoder_embed``, ``mask_token``, ``decoder_pos_embed``, ``decoder_blocks.N``,
``decoder_norm``, ``decoder_pred``). The loss is returned per example and each example's
loss depends on that example only (no batch statistics), so per-example gradients are
well defined. Masking noise is an input, so the caller owns its randomness. Both families'
layouts work: the final norm is whichever the encoder has (ViP's ``fc_norm``, DP-Cap's per-token
``norm``), ``pos_embed`` is fixed (DP-Cap's image type embedding is folded into it) and DP-Cap's
random class token stays frozen (``freeze_fixed_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import load_file
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from vip_hub.errors import ConfigError, RepoFormatError
from vip_hub.loading import Encoder, load_encoder
from vip_hub.models.encoders import (
    EncoderSpec,
    create_encoder,
    mae_decoder_problems,
    mae_init_,
    sincos_pos_embed_2d,
)
from vip_hub.models.features import final_norm
from vip_hub.repo.verify import check_loaded_decoder_config, check_loaded_tensors
from vip_hub.repo_format import MAE_DECODER_FILE, META_DECODER

from ..data.procedural import ProceduralPictures, SyntheticImages
from ..dp.clipping import BroadcastHook, broadcast
from ..dp.run import DPRun
from ..dp.sampling import MASKING, torch_generator

__all__ = [
    "DecoderConfig",
    "MAE",
    "eval_loss",
    "freeze_fixed_tokens",
    "load_mae",
    "new_mae",
    "patchify",
    "public_eval_batch",
    "public_images",
    "decoder_warmup_field",
    "masked_loss",
    "warm_decoder",
    "warm_fresh_decoder",
]

EVAL_SEED = 2**31 - 7  # the public evaluation images: a stream training never draws from
EVAL_IMAGES = 64
WARMUP_SEED = 2**31 - 11  # a fresh decoder's public warm-up images: a stream no other step draws


@dataclass(frozen=True)
class DecoderConfig:
    """The MAE decoder and loss settings (stored with the decoder weights)."""

    dim: int = 512
    depth: int = 4
    num_heads: int = 16
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, 3, H, W) -> (B, L, patch*patch*3), MAE's (row, col, channel) order within a patch."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(
        b, (h // patch) * (w // patch), patch * patch * c
    )


class MAE(nn.Module):
    """Encoder + lightweight decoder; ``forward(images, noise)`` returns per-example losses."""

    decoder_pos_embed: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, encoder: VisionTransformer, config: DecoderConfig = DecoderConfig()):
        super().__init__()
        if not 0.0 <= config.mask_ratio < 1.0:
            raise ConfigError(f"mask_ratio must be in [0, 1), got {config.mask_ratio}")
        self.encoder = encoder
        self.config = config
        # optional in timm (a ViT may have neither); every family here has both
        assert encoder.pos_embed is not None and encoder.cls_token is not None
        encoder.pos_embed.requires_grad_(False)  # fixed sin-cos, as in the reference
        grid = encoder.patch_embed.grid_size[0]
        self.patch = encoder.patch_embed.patch_size[0]
        self.num_patches = encoder.patch_embed.num_patches
        dim = config.dim
        self.decoder_embed = nn.Linear(encoder.embed_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("decoder_pos_embed", sincos_pos_embed_2d(dim, grid)[None])
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.decoder_blocks = nn.ModuleList(
            Block(
                dim,
                config.num_heads,
                mlp_ratio=4.0,
                qkv_bias=True,
                # timm annotates norm_layer as a class; it only calls it, as it does a partial
                norm_layer=cast(type[nn.Module], norm),
            )
            for _ in range(config.depth)
        )
        self.decoder_norm = norm(dim)
        self.decoder_pred = nn.Linear(dim, self.patch**2 * 3)
        # Called with (parameter, broadcast tensor) wherever a parameter held directly by a
        # module is broadcast over the batch, so per-example gradients can be read off it.
        self.broadcast_hooks: list[BroadcastHook] = []
        self._init_decoder()

    def _init_decoder(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)
        mae_init_([self.decoder_embed, self.decoder_pred, *self.decoder_blocks.modules()])

    def num_masked(self) -> int:
        return int(self.num_patches * self.config.mask_ratio)

    def decoder_state_dict(self) -> dict[str, torch.Tensor]:
        """The decoder's tensors, reference-named (what the repo's MAE decoder file holds)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("encoder.")}

    def broadcast_parameters(self) -> list[nn.Parameter]:
        """Parameters this module broadcasts over the batch itself (see ``broadcast_hooks``)."""
        assert self.encoder.cls_token is not None  # see __init__
        return [p for p in (self.encoder.cls_token, self.mask_token) if p.requires_grad]

    def forward(self, images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Per-example reconstruction loss (B,). ``noise`` (B, L) in [0, 1) picks the mask:
        the patches with the smallest noise are kept."""
        enc = self.encoder
        assert enc.pos_embed is not None and enc.cls_token is not None  # see __init__
        b = images.shape[0]
        x = enc.patch_embed(images) + enc.pos_embed[:, 1:]
        keep = self.num_patches - self.num_masked()
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :keep]
        x = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, x.shape[-1]))
        cls = broadcast(enc.cls_token, (b, 1, -1), self.broadcast_hooks) + enc.pos_embed[:, :1]
        x = enc.blocks(enc.norm_pre(torch.cat([cls, x], dim=1)))
        x = final_norm(enc)(x)

        x = self.decoder_embed(x)
        masked = broadcast(self.mask_token, (b, self.num_patches - keep, -1), self.broadcast_hooks)
        patches = torch.cat([x[:, 1:], masked], dim=1)
        patches = torch.gather(patches, 1, ids_restore[..., None].expand(-1, -1, x.shape[-1]))
        x = torch.cat([x[:, :1], patches], dim=1) + self.decoder_pos_embed
        for block in self.decoder_blocks:
            x = block(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]

        dtype = torch.promote_types(pred.dtype, torch.float32)  # the loss in fp32 under autocast
        target = patchify(images, self.patch).to(dtype)
        if self.config.norm_pix_loss:
            mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1e-6) ** 0.5
        mask = torch.ones(b, self.num_patches, device=images.device, dtype=dtype)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        per_patch = (pred.to(dtype) - target).square().mean(-1)
        return (per_patch * mask).sum(1) / mask.sum(1).clamp(min=1)


def freeze_fixed_tokens(encoder: VisionTransformer, spec: EncoderSpec) -> VisionTransformer:
    """Freeze what the family's reference never trains, as ``create_encoder(mae_init=True)`` does:
    ``pos_embed`` (sin-cos, plus DP-Cap's type embedding) and, in DP-Cap, the random class token.
    A loaded encoder needs it: loading makes every tensor trainable."""
    assert encoder.pos_embed is not None and encoder.cls_token is not None  # as in MAE
    encoder.pos_embed.requires_grad_(False)
    if spec.family.frozen_tokens:
        encoder.cls_token.requires_grad_(False)
    return encoder


def new_mae(spec: EncoderSpec, decoder: DecoderConfig) -> MAE:
    """A freshly initialised MAE (MAE recipe initialisation)."""
    return MAE(create_encoder(spec, mae_init=True), decoder)


def load_mae(repo: str | Path, fresh: Mapping[str, Any] | None = None) -> tuple[MAE, Encoder]:
    """The MAE of an exported repo (its verified encoder and its MAE decoder), and the loaded
    repo (its spec, ledger and config). A repo without a decoder (a contrastive or distilled
    (Syn) prior) gets a freshly initialised one of its family's shape for its size, ``fresh``'s
    ``DecoderConfig`` fields overriding it (seed torch first for a reproducible one)."""
    enc = load_encoder(repo)
    path = Path(enc.path) / MAE_DECODER_FILE
    if not path.is_file():
        a = enc.spec.architecture
        shape = DecoderConfig(a.decoder_embed_dim, a.decoder_depth, a.decoder_num_heads)
        decoder = replace(shape, **(fresh or {}))
        return MAE(freeze_fixed_tokens(enc.model.train(), enc.spec), decoder), enc
    with safe_open(path, "pt") as f:
        cfg = json.loads((f.metadata() or {}).get(META_DECODER) or "{}")
    check_loaded_decoder_config(enc.config, MAE_DECODER_FILE, cfg)  # the one verified
    try:
        config = DecoderConfig(**cfg)
    except TypeError as e:
        raise RepoFormatError(
            f"{path}: no MAE decoder configuration in its metadata ({e})"
        ) from None
    tensors = load_file(path)
    check_loaded_tensors(enc.ledger, MAE_DECODER_FILE, path, tensors)  # the one verified
    if problems := mae_decoder_problems(tensors, enc.spec, config.dim, config.depth):
        raise RepoFormatError(f"{path} does not match the decoder: {'; '.join(problems)}")
    mae = MAE(freeze_fixed_tokens(enc.model.train(), enc.spec), config)
    mae.load_state_dict(
        {f"encoder.{k}": v for k, v in enc.model.state_dict().items()} | tensors, strict=True
    )
    return mae, enc


def public_images(spec: EncoderSpec) -> torch.Tensor:
    """The fixed procedural images public loss curves are measured on (normalised, (64, 3, H,
    W))."""
    data = SyntheticImages(spec.img_size, seed=EVAL_SEED)
    return torch.stack([data[i] for i in range(EVAL_IMAGES)])


def public_eval_batch(spec: EncoderSpec, num_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed procedural images and masks: a loss curve on them reveals nothing private."""
    noise = torch.rand(EVAL_IMAGES, num_patches, generator=torch_generator(EVAL_SEED, MASKING, 0))
    return public_images(spec), noise


@torch.no_grad()
def eval_loss(model: nn.Module, batch: Sequence[torch.Tensor], device: torch.device) -> float:
    """Mean of ``model(*batch)``'s per-example losses on a fixed batch (eval mode, no gradient):
    the MAE's, the (Syn) distiller's and the captioner's public curves."""
    was = model.training
    model.eval()
    loss = model(*(t.to(device) for t in batch)).mean().item()
    model.train(was)
    return loss


def warm_decoder(
    model: nn.Module,
    encoder: VisionTransformer,
    transform: Callable[[Any], torch.Tensor],
    loss: Callable[[torch.Tensor, int], torch.Tensor],
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
) -> list[float]:
    """Train ``model``'s fresh decoder (every trainable parameter outside ``encoder``, which stays
    frozen) for ``steps`` AdamW steps of ``loss(images, first)`` on public greyscale procedural
    images through ``transform`` (``first``: the batch's first image index), seeded by
    ``WARMUP_SEED``: no private data. A fresh decoder's gradients otherwise take a DP stage's
    clipping norm and steps for what public data teaches (the benchmarks' README, "The MAE decoder's
    public warm-up", "DP-Cap's text decoder's public warm-up"). Returns the losses."""
    trainable = {p: p.requires_grad for p in model.parameters()}
    for p in encoder.parameters():
        p.requires_grad_(False)
    decoder = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(decoder, lr=lr, weight_decay=0.0)
    source = ProceduralPictures(encoder.patch_embed.img_size[0], seed=WARMUP_SEED)
    device = decoder[0].device
    losses = []
    was = model.training
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WARMUP_SEED)
        for step in range(steps):
            first = step * batch_size
            images = torch.stack(
                [
                    transform(source.load(first + i).convert("L").convert("RGB"))
                    for i in range(batch_size)
                ]
            )
            value = loss(images.to(device), first)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()
            losses.append(value.item())
    for p, flag in trainable.items():
        p.requires_grad_(flag)
        p.grad = None
    model.train(was)
    return losses


def warm_fresh_decoder(
    run: DPRun,
    model: nn.Module,
    encoder: VisionTransformer,
    transform: Callable[[Any], torch.Tensor],
    loss: Callable[[torch.Tensor, int], torch.Tensor],
    steps: int,
    name: str,
) -> None:
    """``warm_decoder`` for ``steps`` before a DP ``run``'s first step, unless it resumes (its
    checkpoint holds the warmed decoder), printing the loss of the fresh ``name``."""
    if steps and not run.checkpoint_path.exists():
        losses = warm_decoder(model, encoder, transform, loss, steps)
        print(f"{name} warm-up on public images: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def decoder_warmup_field(decoder: str) -> Any:
    """The ``decoder_warmup`` config field of a recipe whose DP stage starts ``decoder`` fresh."""
    return Field(
        0,
        ge=0,
        description=f"steps (batch 32, AdamW at 1e-3) of the fresh {decoder}'s training on public "
        "greyscale procedural images, the encoder frozen, before the DP stage (no private data: "
        "the DP stage's clipping norm and steps then go to what the private data adds); 0: none",
    )


def masked_loss(mae: MAE) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``warm_decoder``'s loss for ``mae``: its mean loss under fresh random masks."""
    return lambda images, first: mae(
        images, torch.rand(len(images), mae.num_patches).to(images.device)
    ).mean()
