"""The vip-* encoder family: plain timm VisionTransformers named by an architecture plus model_args.

Sizes follow the ViP paper (Table 5) and the reference code (facebookresearch/ViP-MAE,
``models_mae.py``): patch 16, MLP ratio 4, LayerNorm eps 1e-6, qkv bias, 12 heads down to
the nano size, and an MAE decoder of 4 blocks x 512 with 16 heads.

The exported layout pools like MAE's global pool: the mean of the patch tokens, then the
final LayerNorm (timm's ``global_pool="avg", fc_norm=True``), so the encoder's final norm
lives under the timm key ``fc_norm``. A repo therefore loads with ``timm.create_model`` alone
and its default forward returns the ``avg`` embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import timm
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import VisionTransformer

from .errors import ConfigError, RepoFormatError
from .repo_format import CONFIG_BLOCK

__all__ = [
    "ARCHS",
    "EncoderSpec",
    "VipArch",
    "count_parameters",
    "create_encoder",
    "get_arch",
    "sincos_pos_embed_2d",
]


@dataclass(frozen=True)
class VipArch:
    """One size of the family: encoder width/depth/heads and its MAE decoder."""

    name: str
    embed_dim: int
    depth: int
    num_heads: int
    timm_architecture: str
    decoder_embed_dim: int = 512
    decoder_depth: int = 4
    decoder_num_heads: int = 16


ARCHS: dict[str, VipArch] = {
    a.name: a
    for a in (
        VipArch("vip-nano", 192, 12, 12, "vit_tiny_patch16_224"),
        VipArch("vip-tiny", 384, 12, 12, "vit_small_patch16_224"),
        VipArch("vip-small", 576, 12, 12, "vit_base_patch16_224"),
        VipArch("vip-base", 768, 12, 12, "vit_base_patch16_224"),
        VipArch("vip-large", 1024, 24, 16, "vit_large_patch16_224"),
    )
}


def get_arch(name: str) -> VipArch:
    """Return the architecture called ``name``; the error lists the known ones."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ConfigError(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}") from None


@dataclass(frozen=True)
class EncoderSpec:
    """Everything that fixes an encoder's shapes and its preprocessing."""

    arch: str
    img_size: int = 224
    patch_size: int = 16
    crop_pct: float = 0.875
    interpolation: str = "bicubic"

    def __post_init__(self) -> None:
        get_arch(self.arch)
        if self.patch_size <= 0 or self.img_size <= 0:
            raise ConfigError("img_size and patch_size must be positive")
        if self.img_size % self.patch_size:
            raise ConfigError(
                f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}"
            )
        if not 0.0 < self.crop_pct <= 1.0:
            raise ConfigError(f"crop_pct must be in (0, 1], got {self.crop_pct}")

    @property
    def family(self) -> VipArch:
        return ARCHS[self.arch]

    @property
    def grid_size(self) -> int:
        return self.img_size // self.patch_size

    def model_args(self) -> dict[str, Any]:
        """Constructor kwargs for timm's VisionTransformer (stored in config.json)."""
        a = self.family
        return {
            "img_size": self.img_size,
            "patch_size": self.patch_size,
            "embed_dim": a.embed_dim,
            "depth": a.depth,
            "num_heads": a.num_heads,
            "mlp_ratio": 4.0,
            "qkv_bias": True,
            "class_token": True,
            "global_pool": "avg",
            "fc_norm": True,
        }

    def pretrained_cfg(self) -> dict[str, Any]:
        """timm's pretrained_cfg: input size and preprocessing for this encoder."""
        return {
            "input_size": [3, self.img_size, self.img_size],
            "fixed_input_size": True,
            "interpolation": self.interpolation,
            "crop_pct": self.crop_pct,
            "crop_mode": "center",
            "mean": list(IMAGENET_DEFAULT_MEAN),
            "std": list(IMAGENET_DEFAULT_STD),
            "num_classes": 0,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EncoderSpec":
        """Rebuild the spec from an exported config.json."""
        meta = config.get(CONFIG_BLOCK) or {}
        args = config.get("model_args") or {}
        cfg = config.get("pretrained_cfg") or {}
        if "arch" not in meta:
            raise RepoFormatError("config.json has no vip_hub.arch entry: not a vip-hub export")
        return cls(
            arch=meta["arch"],
            img_size=int(args.get("img_size", 224)),
            patch_size=int(args.get("patch_size", 16)),
            crop_pct=float(cfg.get("crop_pct", 0.875)),
            interpolation=str(cfg.get("interpolation", "bicubic")),
        )


def sincos_pos_embed_2d(dim: int, grid_size: int, cls_token: bool = True) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings (MAE), shape (grid**2 [+1], dim).

    Half the channels encode the row, half the column; the class token gets zeros.
    """
    if dim % 4:
        raise ConfigError(f"embedding dim {dim} must be divisible by 4")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    # MAE's convention: the first half of the channels encodes the column (w), then the row (h).
    emb = torch.cat([encode(cols), encode(rows)], dim=1)
    if cls_token:
        emb = torch.cat([torch.zeros(1, dim, dtype=torch.float64), emb], dim=0)
    return emb.float()


def create_encoder(spec: EncoderSpec, *, mae_init: bool = False) -> VisionTransformer:
    """Build the timm VisionTransformer for ``spec`` (randomly initialised, no head).

    With ``mae_init`` the weights follow the MAE recipe: fixed sin-cos position embeddings
    (frozen), xavier-uniform linears and patch projection, normal(0.02) class token.
    """
    model = timm.create_model(
        spec.family.timm_architecture,
        pretrained=False,
        num_classes=0,
        pretrained_cfg_overlay=spec.pretrained_cfg(),
        **spec.model_args(),
    )
    if mae_init:
        _init_mae(model, spec)
    return model


def _init_mae(model: VisionTransformer, spec: EncoderSpec) -> None:
    with torch.no_grad():
        model.pos_embed.copy_(sincos_pos_embed_2d(model.embed_dim, spec.grid_size)[None])
        model.pos_embed.requires_grad_(False)
        w = model.patch_embed.proj.weight
        torch.nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        torch.nn.init.normal_(model.cls_token, std=0.02)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
            elif isinstance(m, torch.nn.LayerNorm):
                torch.nn.init.ones_(m.weight)
                torch.nn.init.zeros_(m.bias)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())

