"""The encoder families (ViP, DP-Cap): plain timm VisionTransformers named by an architecture
plus model_args, in one registry.

Both families share the sizes of the ViP paper (Table 5): patch 16, MLP ratio 4, LayerNorm eps
1e-6, widths 192/384/576/768/1024 and 12 blocks (24 for large). They differ in what the
reference code fixes beside the shapes, all of which a ``Family`` records:

- ViP (facebookresearch/ViP-MAE ``models_mae.py``): qkv bias, 12 heads down to the nano size,
  an MAE decoder of 4 blocks x 512 with 16 heads, and the final norm after pooling (MAE's
  global pool, timm's ``fc_norm``). Feature modes ``vip``, ``avg``, ``cls``.
- DP-Cap (facebookresearch/dpcap ``models_mae.py``, the ``*_autoregressive_nobias`` models): no
  qkv bias, heads nano 6 / tiny 6 / small 12 / base 12 / large 16, the final norm on every
  token (timm's ``norm``), a frozen random class token and image type embedding (folded into
  ``pos_embed``), and a text decoder (``vip_hub.models.text_decoder``). Feature modes ``dpcap``,
  ``avg``, ``cls``.

Head count does not change weight shapes but does change outputs, so it must match. A repo's
timm configuration names the architecture and its family in its ``CONFIG_BLOCK`` block, so it
loads with ``timm.create_model`` alone and its default forward returns the ``avg`` embedding.

Importing this module imports neither torch nor timm (the hub's processes read specs and render
cards without them); the functions that build tensors or models import them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..errors import ConfigError, RepoFormatError
from ..repo_format import CONFIG_BLOCK, CONFIG_FILE
from .names import SIZES, arch_name

if TYPE_CHECKING:
    import torch
    from timm.models.vision_transformer import VisionTransformer

__all__ = [
    "ARCHS",
    "DEFAULT_IMG_SIZE",
    "DEFAULT_PATCH_SIZE",
    "FAMILIES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MIN_CROP_PCT",
    "TRANSFORM_KEYS",
    "Arch",
    "EncoderSpec",
    "Family",
    "count_parameters",
    "create_encoder",
    "get_arch",
    "mae_decoder_problems",
    "mae_init_",
    "encoder_shapes",
    "mae_decoder_shapes",
    "mae_decoder_size",
    "sincos_pos_embed_1d",
    "sincos_pos_embed_2d",
]

DEFAULT_IMG_SIZE = 224
"""Input resolution in pixels of an encoder that names none (the released checkpoints')."""
DEFAULT_PATCH_SIZE = 16
DEFAULT_INTERPOLATION = "bicubic"
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
"""The resize modes timm's transforms know by name."""
_WIDTH = {"nano": 192, "tiny": 384, "small": 576, "base": 768, "large": 1024}
_DEPTH = {"nano": 12, "tiny": 12, "small": 12, "base": 12, "large": 24}
_TIMM_ARCH = {
    "nano": "vit_tiny_patch16_224",
    "tiny": "vit_small_patch16_224",
    "small": "vit_base_patch16_224",
    "base": "vit_base_patch16_224",
    "large": "vit_large_patch16_224",
}


MAX_IMG_SIZE = 4096
"""The widest input an encoder may take: a 4096-pixel side at patch 16 is 65,536 tokens (a
wider one's position embedding and attention are built before anything could refuse them)."""


@dataclass(frozen=True)
class Family:
    """What a family's reference code fixes beyond the sizes (see the module docstring)."""

    name: str  # prefix of its architecture names, and its repos' configured vip_hub.family
    title: str
    heads: dict[str, int]  # attention heads per size
    decoder: dict[
        str, tuple[int, int, int]
    ]  # per size: the training decoder's (width, depth, heads)
    qkv_bias: bool
    pooled_norm: (
        bool  # final LayerNorm after pooling (timm fc_norm) rather than on every token (timm norm)
    )
    frozen_tokens: bool  # class token and image type embedding are frozen random constants
    poolings: tuple[str, ...]  # feature modes, the family's linear-probe mode first
    captions: bool  # a repo can carry a text decoder (captions, zero-shot)
    unit: str  # one training example of its recipe, as the card names the unit of privacy
    crop_pct: float
    crop_mode: str

    def offered_poolings(self, text_decoder: bool) -> tuple[str, ...]:
        """The feature modes a repo of this family offers: ``dpcap`` needs its text decoder's
        weights."""
        return tuple(m for m in self.poolings if m != "dpcap" or text_decoder)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="vip",
            title="ViP",
            heads={s: (16 if s == "large" else 12) for s in SIZES},
            decoder={s: (512, 4, 16) for s in SIZES},
            qkv_bias=True,
            pooled_norm=True,
            frozen_tokens=False,
            poolings=("vip", "avg", "cls"),
            captions=False,
            unit="image",
            crop_pct=0.875,
            crop_mode="center",
        ),
        Family(
            name="dpcap",
            title="DP-Cap",
            heads={"nano": 6, "tiny": 6, "small": 12, "base": 12, "large": 16},
            decoder={
                "nano": (192, 6, 6),
                "tiny": (384, 6, 6),
                "small": (576, 6, 12),
                "base": (768, 6, 12),
                "large": (768, 6, 12),
            },
            qkv_bias=False,
            pooled_norm=False,
            frozen_tokens=True,
            poolings=("dpcap", "avg", "cls"),
            captions=True,
            unit="image-caption pair",
            crop_pct=1.0,
            crop_mode="squash",
        ),
    )
}


@dataclass(frozen=True)
class Arch:
    """One size of one family: encoder width/depth/heads and the decoder it trains with."""

    name: str
    family: Family
    size: str
    embed_dim: int
    depth: int
    num_heads: int
    timm_architecture: str
    decoder_embed_dim: int
    decoder_depth: int
    decoder_num_heads: int


def _arch(family: Family, size: str) -> Arch:
    width, depth, heads = family.decoder[size]
    return Arch(
        arch_name(family.name, size),
        family,
        size,
        _WIDTH[size],
        _DEPTH[size],
        family.heads[size],
        _TIMM_ARCH[size],
        width,
        depth,
        heads,
    )


ARCHS: dict[str, Arch] = {
    a.name: a for f in FAMILIES.values() for a in (_arch(f, s) for s in SIZES)
}


def get_arch(name: str) -> Arch:
    """Return the architecture called ``name``; the error lists the known ones."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ConfigError(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}") from None


MIN_CROP_PCT = 0.5
"""The smallest centre crop a spec takes: its image is first resized to img_size / crop_pct."""

TRANSFORM_KEYS = (
    "input_size",
    "fixed_input_size",
    "interpolation",
    "crop_pct",
    "crop_mode",
    "mean",
    "std",
)
"""The ``pretrained_cfg`` entries from which timm's ``resolve_data_config`` builds the
transform a repo's images go through (one left out takes timm's default, not the spec's)."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""timm's ``IMAGENET_DEFAULT_MEAN`` and ``_STD``, every encoder's normalisation, here so that
verifying a config imports no timm (a test holds them equal)."""


@dataclass(frozen=True)
class EncoderSpec:
    """Everything that fixes an encoder's shapes and its preprocessing. ``crop_pct`` defaults
    to the family's (ViP 0.875 centre crop; DP-Cap 1.0, a plain resize as its README does)."""

    arch: str
    img_size: int = DEFAULT_IMG_SIZE
    patch_size: int = DEFAULT_PATCH_SIZE
    crop_pct: float | None = None
    interpolation: str = DEFAULT_INTERPOLATION
    depth: int | None = None
    """Blocks (default: the architecture's); fewer is a shallower stack of the same blocks."""

    def __post_init__(self) -> None:
        arch = get_arch(self.arch)
        if self.crop_pct is None:
            object.__setattr__(self, "crop_pct", arch.family.crop_pct)
        if self.depth is None:
            object.__setattr__(self, "depth", arch.depth)
        assert self.depth is not None and self.crop_pct is not None  # both set just above
        if not 1 <= self.depth <= arch.depth:
            raise ConfigError(f"depth {self.depth}: a {self.arch} has 1 to {arch.depth} blocks")
        if not (0 < self.patch_size <= self.img_size <= MAX_IMG_SIZE):
            raise ConfigError(
                f"img_size {self.img_size} and patch_size {self.patch_size}: both positive, the "
                f"patch no larger than the image, the image at most {MAX_IMG_SIZE} pixels wide"
            )
        if self.img_size % self.patch_size:
            raise ConfigError(
                f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}"
            )
        if not MIN_CROP_PCT <= self.crop_pct <= 1.0:
            raise ConfigError(
                f"crop_pct must be in [{MIN_CROP_PCT}, 1], got {self.crop_pct}: a smaller crop "
                "resizes every image to many times the encoder's size first"
            )
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(
                f"interpolation {self.interpolation!r} is not one of {', '.join(INTERPOLATIONS)}"
            )

    @property
    def architecture(self) -> Arch:
        return ARCHS[self.arch]

    @property
    def family(self) -> Family:
        return ARCHS[self.arch].family

    @property
    def grid_size(self) -> int:
        return self.img_size // self.patch_size

    def model_args(self) -> dict[str, Any]:
        """Constructor kwargs for timm's VisionTransformer (stored in the timm configuration)."""
        a = self.architecture
        return {
            "img_size": self.img_size,
            "patch_size": self.patch_size,
            "embed_dim": a.embed_dim,
            "depth": self.depth,
            "num_heads": a.num_heads,
            "mlp_ratio": 4.0,
            "qkv_bias": a.family.qkv_bias,
            "class_token": True,
            "global_pool": "avg",
            "fc_norm": a.family.pooled_norm,
        }

    def pretrained_cfg(self) -> dict[str, Any]:
        """timm's pretrained_cfg: input size and preprocessing for this encoder (no timm import:
        a hub verifies configs without it)."""
        return {
            "input_size": [3, self.img_size, self.img_size],
            "fixed_input_size": True,
            "interpolation": self.interpolation,
            "crop_pct": self.crop_pct,
            "crop_mode": self.family.crop_mode,
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "num_classes": 0,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderSpec:
        """Rebuild the spec from an exported timm configuration. A value of the wrong type, or a
        model timm would build otherwise than the spec (``architecture``, ``num_classes``,
        ``model_args``), is a RepoFormatError naming it."""
        if not isinstance(config, dict):
            raise RepoFormatError(f"{CONFIG_FILE} is not a JSON object")
        meta, args, cfg = (
            _section(config, k) for k in (CONFIG_BLOCK, "model_args", "pretrained_cfg")
        )
        if "arch" not in meta:
            raise RepoFormatError(
                f"{CONFIG_FILE} has no {CONFIG_BLOCK}.arch entry: not a vip-hub export"
            )
        crop_pct = _typed(cfg, "pretrained_cfg.crop_pct", (int, float), None)
        spec = cls(
            arch=_typed(meta, f"{CONFIG_BLOCK}.arch", str, None),
            img_size=_typed(args, "model_args.img_size", int, DEFAULT_IMG_SIZE),
            patch_size=_typed(args, "model_args.patch_size", int, DEFAULT_PATCH_SIZE),
            crop_pct=None if crop_pct is None else float(crop_pct),
            interpolation=_typed(cfg, "pretrained_cfg.interpolation", str, DEFAULT_INTERPOLATION),
            depth=_typed(args, "model_args.depth", int, None),
        )
        if meta.get("family", spec.family.name) != spec.family.name:
            raise RepoFormatError(
                f"{CONFIG_FILE}: vip_hub.family {meta['family']!r} disagrees with arch "
                f"{spec.arch!r}"
            )
        built = {
            "architecture": config.get("architecture"),
            # timm's order: the top level's, else pretrained_cfg's, else the model's 1000
            "num_classes": config.get("num_classes", cfg.get("num_classes", 1000)),
            **{f"model_args.{k}": args.get(k) for k in args},
        }
        want = {
            "architecture": spec.architecture.timm_architecture,
            "num_classes": 0,
            **{f"model_args.{k}": v for k, v in spec.model_args().items()},
        }
        wrong = [k for k in dict.fromkeys([*want, *built]) if built.get(k) != want.get(k)]
        if wrong:
            raise RepoFormatError(
                f"{CONFIG_FILE}: timm would build another model than a {spec.arch}: "
                + ", ".join(f"{k} is {built.get(k)!r}, not {want.get(k)!r}" for k in wrong)
            )
        reads = spec.pretrained_cfg()  # an image of any size: its transform's output, bounded
        wrong = [k for k in TRANSFORM_KEYS if cfg.get(k) != reads[k]]
        if wrong:
            raise RepoFormatError(
                f"{CONFIG_FILE}: timm would transform images otherwise than a {spec.arch} of "
                f"img_size {spec.img_size} reads them: "
                + ", ".join(
                    f"pretrained_cfg.{k} is {cfg.get(k)!r}, not {reads[k]!r}" for k in wrong
                )
            )
        return spec


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise RepoFormatError(f"{CONFIG_FILE}: {key} is not an object")
    return value


def _typed(section: dict[str, Any], where: str, kind: Any, default: Any) -> Any:
    """``section``'s value at the last key of ``where``, or ``default``; RepoFormatError unless
    it is of type ``kind`` (a bool is not a number)."""
    key = where.rsplit(".", 1)[-1]
    if key not in section:
        return default
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RepoFormatError(f"{CONFIG_FILE}: {where} is {value!r}, of the wrong type")
    return value


def sincos_pos_embed_1d(dim: int, positions: torch.Tensor | int) -> torch.Tensor:
    """Fixed 1-D sine-cosine embeddings (MAE), shape (len(positions), dim): sines then cosines."""
    import torch

    if dim % 2:
        raise ConfigError(f"embedding dim {dim} must be even")
    pos = (
        torch.arange(positions, dtype=torch.float64)
        if isinstance(positions, int)
        else positions.double()
    )
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = pos.reshape(-1, 1) * omega.reshape(1, -1)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def sincos_pos_embed_2d(dim: int, grid_size: int, cls_token: bool = True) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings (MAE), shape (grid**2 [+1], dim).

    Half the channels encode the row, half the column; the class token gets zeros.
    """
    import torch

    if dim % 4:
        raise ConfigError(f"embedding dim {dim} must be divisible by 4")
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    # MAE's convention: the first half of the channels encodes the column (w), then the row (h).
    emb = torch.cat(
        [sincos_pos_embed_1d(dim // 2, cols), sincos_pos_embed_1d(dim // 2, rows)], dim=1
    )
    if cls_token:
        emb = torch.cat([torch.zeros(1, dim), emb], dim=0)
    return emb


def create_encoder(spec: EncoderSpec, *, mae_init: bool = False) -> VisionTransformer:
    """Build the timm VisionTransformer for ``spec`` (randomly initialised, no head).

    With ``mae_init`` the weights follow the MAE recipe: fixed sin-cos position embeddings
    (frozen), xavier-uniform linears and patch projection, normal(0.02) class token. In a family
    with ``frozen_tokens`` (DP-Cap) a normal(0.02) image type embedding is added to every row of
    ``pos_embed`` and the class token is frozen, as in the reference.
    """
    import timm

    # every architecture's timm name is a VisionTransformer (timm types the result as a Module)
    model = cast(
        "VisionTransformer",
        timm.create_model(
            spec.architecture.timm_architecture,
            pretrained=False,
            num_classes=0,
            pretrained_cfg_overlay=spec.pretrained_cfg(),
            **spec.model_args(),
        ),
    )
    if mae_init:
        _init_mae(model, spec)
    return model


def _init_mae(model: VisionTransformer, spec: EncoderSpec) -> None:
    import torch

    # optional in timm (a ViT may have neither); every family here has both
    assert model.pos_embed is not None and model.cls_token is not None
    with torch.no_grad():
        model.pos_embed.copy_(sincos_pos_embed_2d(model.embed_dim, spec.grid_size)[None])
        model.pos_embed.requires_grad_(False)
        w = model.patch_embed.proj.weight
        torch.nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        torch.nn.init.normal_(model.cls_token, std=0.02)
        if spec.family.frozen_tokens:
            model.pos_embed.add_(torch.randn(1, 1, model.embed_dim) * 0.02)
            model.cls_token.requires_grad_(False)
        mae_init_(model.modules())


def mae_init_(modules: Iterable[torch.nn.Module]) -> None:
    """The MAE reference's initialisation of ``modules``, in their order: each Linear's weight
    Xavier-uniform and its bias 0, each LayerNorm's weight 1 and bias 0."""
    import torch

    for m in modules:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
        elif isinstance(m, torch.nn.LayerNorm):
            torch.nn.init.ones_(m.weight)
            torch.nn.init.zeros_(m.bias)


_DECODER_EMBED = "decoder_embed.weight"
_DECODER_BLOCKS = "decoder_blocks."


def _block_shapes(d: int, hidden: int, qkv_bias: bool = True) -> dict[str, tuple[int, ...]]:
    """The tensors of one transformer block ``d`` wide with an MLP ``hidden`` wide, by name
    within the block (timm's ``Block``, and the reference MAE decoder's)."""
    return {
        "norm1.weight": (d,),
        "norm1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        **({"attn.qkv.bias": (3 * d,)} if qkv_bias else {}),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "norm2.weight": (d,),
        "norm2.bias": (d,),
        "mlp.fc1.weight": (hidden, d),
        "mlp.fc1.bias": (hidden,),
        "mlp.fc2.weight": (d, hidden),
        "mlp.fc2.bias": (d,),
    }


def encoder_shapes(spec: EncoderSpec) -> dict[str, tuple[int, ...]]:
    """The tensors of ``spec``'s encoder by name, as timm's VisionTransformer builds them from
    ``spec.model_args()`` (``create_encoder``: a test holds the two together), without timm."""
    args = spec.model_args()
    d, p = args["embed_dim"], args["patch_size"]
    block = _block_shapes(d, int(d * args["mlp_ratio"]), args["qkv_bias"])
    norm = "fc_norm" if args["fc_norm"] else "norm"
    return {
        "cls_token": (1, 1, d),
        "pos_embed": (1, spec.grid_size**2 + 1, d),
        "patch_embed.proj.weight": (d, 3, p, p),
        "patch_embed.proj.bias": (d,),
        **{f"blocks.{i}.{k}": shape for i in range(args["depth"]) for k, shape in block.items()},
        f"{norm}.weight": (d,),
        f"{norm}.bias": (d,),
    }


def mae_decoder_shapes(spec: EncoderSpec, dim: int, depth: int) -> dict[str, tuple[int, ...]]:
    """The tensors of an MAE decoder ``dim`` wide and ``depth`` blocks deep behind ``spec``'s
    encoder, by name: the reference ``models_mae.py``'s layout, which ``training.recipes.mae.MAE``
    builds (its tests hold the two together)."""
    d, pixels = dim, 3 * spec.patch_size**2
    block = _block_shapes(d, 4 * d)
    return {
        _DECODER_EMBED: (d, spec.architecture.embed_dim),
        "decoder_embed.bias": (d,),
        "mask_token": (1, 1, d),
        "decoder_pos_embed": (1, spec.grid_size**2 + 1, d),
        **{f"{_DECODER_BLOCKS}{i}.{k}": shape for i in range(depth) for k, shape in block.items()},
        "decoder_norm.weight": (d,),
        "decoder_norm.bias": (d,),
        "decoder_pred.weight": (pixels, d),
        "decoder_pred.bias": (pixels,),
    }


def mae_decoder_size(state: Mapping[str, torch.Tensor], spec: EncoderSpec) -> tuple[int, int]:
    """The width and depth an MAE decoder's tensors show (the width ``spec``'s default when its
    input projection is missing or malformed, which ``mae_decoder_problems`` names)."""
    depth = len({k.split(".")[1] for k in state if k.startswith(_DECODER_BLOCKS)})
    embed = state.get(_DECODER_EMBED)
    width = int(embed.shape[0]) if embed is not None and embed.ndim == 2 else 0
    return width or spec.architecture.decoder_embed_dim, depth


def mae_decoder_problems(
    state: Mapping[str, torch.Tensor], spec: EncoderSpec, dim: int, depth: int
) -> list[str]:
    """How ``state`` differs from ``mae_decoder_shapes(spec, dim, depth)`` (empty: it does not):
    the rule the importer and the training load (``load_mae``) hold an MAE decoder to."""
    expected = mae_decoder_shapes(spec, dim, depth)
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    wrong = sorted(
        f"{k} {tuple(v.shape)} (expected {expected[k]})"
        for k, v in state.items()
        if k in expected and tuple(v.shape) != expected[k]
    )
    return [
        f"{what}: {', '.join(keys)}"
        for what, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", wrong),
        )
        if keys
    ]


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())
