"""Import of checkpoints in the layout of the reference code of each family into the repo format.

- ViP (facebookresearch/ViP-MAE): ``{"model": state_dict, ...}`` where the state dict is either a
  whole MAE (encoder keys plus ``decoder_*`` and ``mask_token``) or an encoder-only ViT. Encoder
  keys already follow timm's layout, except that the final ``norm`` becomes ``fc_norm`` (ViP
  repos pool like MAE's global pool). The ``decoder_*`` tensors must be an MAE decoder of the width
  and depth they show (``vip_hub.models.encoders.mae_decoder_shapes``, the rule
  ``training.recipes.mae.load_mae`` holds a repo's decoder to).
- DP-Cap (facebookresearch/dpcap, ``MaskedAutoencoderViT_autoregressive``): ``{"model":
  state_dict, "args": Namespace, ...}``. Encoder keys follow timm's layout (the final ``norm``
  stays per token); the frozen ``encoder_image_type_embedding`` is folded into ``pos_embed``;
  the text decoder's keys are renamed to ``vip_hub.models.text_decoder.TextDecoder``'s
  (``DPCAP_DECODER_KEYS``).

Weights holding NaN or an infinity are refused, naming the tensors (``artifacts.nonfinite_count``,
the rule ``verify`` applies to a repo's weights files).

This is the only place that unpickles, with ``torch.load(weights_only=True)`` and only
``argparse.Namespace`` allowed: anything but plain tensors and containers is refused.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch

from ..errors import CheckpointError, ConfigError, MissingInputError
from ..models.encoders import (
    DEFAULT_IMG_SIZE,
    EncoderSpec,
    create_encoder,
    mae_decoder_problems,
    mae_decoder_size,
)
from ..models.text_decoder import TextDecoder, TextDecoderConfig
from ..models.tokenizer import CaptionTokenizer
from ..privacy.accounting import CURAND_FLOAT32_SUPPORT, paper_delta
from ..privacy.ledger import NOT_RELEASED, Dataset, DPStage, NonPrivateStage, noised_key
from ..privacy.sensitivity import DP_ADAMW
from .artifacts import nonfinite_problem
from .card import DEFAULT_LICENSE
from .files import Release, export_encoder

__all__ = [
    "PRESETS",
    "REFERENCE_NOISED_TENSORS",
    "REFERENCE_NOISE_SUPPORT",
    "CheckpointError",
    "DPCAP_DECODER_KEYS",
    "ImportPreset",
    "dpcap_reference_key",
    "import_dpcap_checkpoint",
    "import_mae_checkpoint",
    "load_reference_checkpoint",
    "split_dpcap_state_dict",
    "split_mae_state_dict",
]

DPCAP_LICENSE = "cc-by-nc-4.0"
"""The licence of the DP-Cap authors' released weights (CC BY-NC 4.0)."""

_DECODER = re.compile(r"^(decoder_|mask_token$)")
_IGNORED = re.compile(r"^head\.")  # a fine-tuned classifier: not part of a released encoder


REFERENCE_NOISE_SUPPORT = CURAND_FLOAT32_SUPPORT
REFERENCE_NOISED_TENSORS = {noised_key(NOT_RELEASED, "the reference model (at most)"): 10**9}
"""The noise sampler an imported DP stage is recorded with: the reference code drew its noise with
torch on CUDA in float32 (curand's Box-Muller on 32-bit uniforms, |z| <= sqrt(66 ln 2) = 6.76:
unverified for each release), on at most 10^9 trained coordinates, declared rather than named
(the reference code's tensors are not all released); its stage's delta counts that
truncation."""


@dataclass(frozen=True)
class ImportPreset:
    """Architecture and ledger stages of a published checkpoint."""

    arch: str
    model_name: str
    summary: str
    stages: tuple[NonPrivateStage | DPStage, ...]
    license: str = DEFAULT_LICENSE


def _shaders21k() -> NonPrivateStage:
    return NonPrivateStage(
        name="synthetic-pretraining",
        dataset=Dataset(
            name="Shaders21k",
            size=1_300_000,
            description=(
                "images rendered from 21k procedural OpenGL shader programs (Baradad et al., 2022)"
            ),
        ),
        private_data=False,
        description=(
            "MAE pretraining (AdamW, 1,000 epochs, mask ratio 0.75) on synthetic images only."
        ),
    )


def _vip_syn_base() -> ImportPreset:
    return ImportPreset(
        "vip-base",
        "vip-syn-base",
        "(Syn)-ViP-Base from the ViP paper: MAE on synthetic images only.",
        (_shaders21k(),),
    )


def _vip_base() -> ImportPreset:
    n, batch = 233_000_000, 81_920
    laion = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(
            name="LAION-233M",
            size=n,
            description="the ~233M images of LAION-400M still reachable when ViP was trained",
        ),
        sample_rate=batch / n,
        noise_multiplier=0.5,
        steps=10_000,
        clipping_norm=0.1,
        noise_support=REFERENCE_NOISE_SUPPORT,
        noised_tensors=REFERENCE_NOISED_TENSORS,
        delta=paper_delta(n),
        mechanism=DP_ADAMW,
        description=(
            "MAE with DP-AdamW from the (Syn)-ViP initialisation (ViP paper, Sec. 4.1 and "
            "App. A.2). The paper states epsilon = 8 as its target; the parameters give the "
            "epsilon below."
        ),
        hyperparameters={
            "lr": 3.84e-4,
            "warmup_steps": 1000,
            "weight_decay": 0.005,
            "betas": [0.9, 0.95],
            "adam_eps": 1e-8,
            "lr_schedule": "cosine",
            "mask_ratio": 0.75,
            "batch_size": batch,
        },
    )
    return ImportPreset(
        "vip-base",
        "vip-base",
        "ViP-Base from the ViP paper: (Syn)-ViP then DP-AdamW on LAION-233M.",
        (_shaders21k(), laion),
    )


DPCAP_N = 2_000_000_000
"""MetaCLIP as the DP-Cap release's README counts it ("2 billion samples"); no exact count is
published."""
DPCAP_BATCH = 1_310_720
"""The ``--batch_size`` of the reference's training command, which the paper and README call
1.3M."""


def _dpcap_base_eps7() -> ImportPreset:
    metaclip = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(
            name="MetaCLIP",
            size=DPCAP_N,
            description=(
                "image-text pairs curated as for Meta-CLIP; the release's README gives 2 billion "
                "samples (not the paper's LAION-233M); n = 2e9 is that figure, the exact count is "
                "unpublished"
            ),
        ),
        sample_rate=DPCAP_BATCH / DPCAP_N,
        noise_multiplier=0.527,
        steps=5_000,
        clipping_norm=1.0,
        noise_support=REFERENCE_NOISE_SUPPORT,
        noised_tensors=REFERENCE_NOISED_TENSORS,
        mechanism=DP_ADAMW,
        sampling="shuffle",
        delta=1.0 / DPCAP_N,
        description=(
            "Image captioning with DP-AdamW (per-example clipping of the whole captioner, C = 1) "
            "from a synthetic-image MAE initialisation (DP-Cap paper and release README: 5,000 "
            "steps, sigma 0.527, batch 1.3M, 2 billion MetaCLIP pairs; the README calls it the eps "
            "= 7 model). delta = 1/n as the authors account it (their patched private-transformers "
            "sets target_delta = sample_size ** -1). The reference code does not Poisson-sample "
            "(it prints 'Training WITHOUT poisson sampling'): it reads shuffled fixed-size "
            "batches, while the accountants assume Poisson sampling."
        ),
        hyperparameters={
            "batch_size": DPCAP_BATCH,
            "betas": [0.9, 0.95],
            "text_max_length": 40,
            "tokenizer": "bert-base-uncased WordPiece",
        },
    )
    synthetic = NonPrivateStage(
        name="synthetic-pretraining",
        dataset=_shaders21k().dataset,
        private_data=False,
        description=(
            "MAE pretraining on synthetic images only (the DP-Cap initialisation, as for "
            "(Syn)-ViP)."
        ),
    )
    return ImportPreset(
        "dpcap-base",
        "dpcap-base-eps7",
        "DP-Cap-Base released by the DP-Cap authors: an image captioner trained with DP-AdamW on 2 "
        "billion MetaCLIP image-text pairs (eps about 7).",
        (synthetic, metaclip),
        license=DPCAP_LICENSE,
    )


PRESETS: dict[str, Callable[[], ImportPreset]] = {
    "vip-syn-base": _vip_syn_base,
    "vip-base": _vip_base,
    "dpcap-base-eps7": _dpcap_base_eps7,
}
"""The published checkpoints, by name (built on demand: their epsilon needs the accountant)."""


def _shapes_of(build: Callable[[Any], torch.nn.Module], arg: Any) -> dict[str, torch.Tensor]:
    """The state dict of ``build(arg)`` on the meta device: names and shapes, no initialisation."""
    with torch.device("meta"):
        return build(arg).state_dict()


def _loaded(
    build: Callable[[Any], torch.nn.Module], arg: Any, state: dict[str, torch.Tensor]
) -> Any:
    """``build(arg)`` holding ``state`` (every key, checked shapes), without initialising it
    first."""
    with torch.device("meta"):
        module = build(arg)
    module.load_state_dict(state, strict=True, assign=True)
    return module


def _compressed_member(path: str | os.PathLike[str]) -> str | None:
    """A compressed member of a zip checkpoint (torch.save stores every record as is, and a
    deflated one makes a small file claim up to a thousand times its size in memory)."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as z:
            return next(
                (i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED), None
            )
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({e})") from None


def _state_problem(state: dict[Any, Any]) -> str | None:
    """Why ``state`` is not a state dict the importer can write (None: it is): string keys, dense
    floating-point tensors on the CPU, each with its own stored data holding all its elements."""
    owners: dict[int, str] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            return f"the key {key!r} is not a string"
        if not isinstance(value, torch.Tensor):
            return f"{key} is a {type(value).__name__}, not a tensor"
        if value.device.type != "cpu":
            return f"{key} holds no data (a tensor on {value.device})"
        if value.layout != torch.strided or not value.is_floating_point():
            return f"{key} is {value.dtype} {value.layout}, not a dense floating-point tensor"
        stored = value.untyped_storage().nbytes() // value.element_size()
        if value.numel() > stored:
            return f"{key} has {value.numel()} elements but {stored} stored"
        if (
            value.numel()
            and (other := owners.setdefault(value.untyped_storage().data_ptr(), key)) != key
        ):
            return f"{' and '.join(sorted((key, other)))} share their stored data"
    return None


def load_reference_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict inside a reference checkpoint, loaded without executing pickled code."""
    if (member := _compressed_member(path)) is not None:
        raise CheckpointError(f"{path}: refused, its record {member} is compressed")
    try:
        # The reference saves its argparse.Namespace of hyper-parameters next to the weights:
        # a plain attribute bag, allow-listed; everything else stays refused.
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        globals_ = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        if not globals_:
            raise CheckpointError(
                f"{path}: not a readable PyTorch checkpoint (corrupt pickle)"
            ) from None
        raise CheckpointError(
            f"{path}: refused, the file holds objects other than tensors and plain containers "
            f"(loaded with weights_only=True): {globals_[0]}"
        ) from None
    except Exception as e:
        # weights_only runs no pickled code, so what fails is the file: a corrupt old-style
        # pickle raises KeyError, IndexError, UnicodeDecodeError, AssertionError and others
        raise CheckpointError(
            f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})"
        ) from None
    state = obj.get("model", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path}: expected a state dict or a dict with a 'model' state dict of tensors"
        )
    if (problem := _state_problem(state)) is not None:
        raise CheckpointError(f"{path}: refused, {problem}")
    return state


def _refuse_nonfinite(
    checkpoint: str | os.PathLike[str], state: dict[str, torch.Tensor], dropped: re.Pattern[str]
) -> None:
    """Refuse a checkpoint whose released tensors (all but those ``dropped`` matches) hold NaN or
    an infinity, naming them."""
    released = {k: v for k, v in state.items() if not dropped.match(k)}
    if (problem := nonfinite_problem(released)) is not None:
        raise CheckpointError(f"{checkpoint}: refused, {problem}")


def _check_out(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Refuse an output folder that is, or holds, the checkpoint (writing it would delete it)."""
    source, out = Path(checkpoint).resolve(), Path(out_dir).resolve()
    if source == out or out in source.parents:
        raise ConfigError(
            f"{out_dir}: writing the repo there would replace the checkpoint {checkpoint}"
        )


def split_mae_state_dict(
    state: dict[str, torch.Tensor], spec: EncoderSpec
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split into (encoder state dict in timm layout, decoder state dict); check every key/shape."""
    expected = {k: v.shape for k, v in _shapes_of(create_encoder, spec).items()}
    encoder: dict[str, torch.Tensor] = {}
    decoder: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    sources: dict[str, str] = {}  # encoder key: the checkpoint key it came from
    twice: list[str] = []
    for key, value in state.items():
        if _DECODER.match(key):
            decoder[key] = value
        elif _IGNORED.match(key):
            continue
        else:
            name = "fc_norm." + key.removeprefix("norm.") if key.startswith("norm.") else key
            if name not in expected:
                unexpected.append(key)
            elif name in sources:
                twice.append(f"{' and '.join(sorted((sources[name], key)))} (both {name})")
            else:
                encoder[name], sources[name] = value, key
    missing = sorted(k for k in expected if k not in encoder)
    wrong = sorted(
        f"{k} {tuple(encoder[k].shape)} (expected {tuple(expected[k])})"
        for k in encoder
        if encoder[k].shape != expected[k]
    )
    problems = []
    if twice:
        problems.append(f"keys naming one encoder tensor twice: {', '.join(sorted(twice))}")
    if missing:
        problems.append(f"missing encoder keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(sorted(unexpected))}")
    if wrong:
        problems.append(
            f"shape mismatches for {spec.arch} at {spec.img_size}px: {', '.join(wrong)}"
        )
    if problems:
        raise CheckpointError("; ".join(problems))
    return encoder, decoder


def import_mae_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    arch: str,
    img_size: int = DEFAULT_IMG_SIZE,
    **release: Unpack[Release],
) -> Path:
    """Convert a ViP-MAE reference checkpoint to a released-encoder repo folder (``release``:
    its ledger stages, name and card fields, as ``export_encoder`` takes them)."""
    spec = EncoderSpec(arch, img_size=img_size)
    if spec.family.name != "vip":
        raise ConfigError(
            f"{arch} is not a ViP architecture (vip-*); DP-Cap checkpoints use "
            "import_dpcap_checkpoint"
        )
    _check_out(checkpoint, out_dir)
    state = load_reference_checkpoint(checkpoint)
    encoder_sd, decoder_sd = split_mae_state_dict(state, spec)
    decoder_config = None
    if decoder_sd:
        width, depth = mae_decoder_size(decoder_sd, spec)
        if problems := mae_decoder_problems(decoder_sd, spec, width, depth):
            raise CheckpointError(
                f"{checkpoint}: refused, its decoder_* tensors are not an MAE decoder {width} wide "
                f"and {depth} blocks deep for {spec.arch} at {spec.img_size}px: "
                + "; ".join(problems)
            )
        # training.recipes.mae.DecoderConfig's fields, as load_mae reads them
        decoder_config = {
            "dim": width,
            "depth": depth,
            "num_heads": spec.architecture.decoder_num_heads,
        }
    _refuse_nonfinite(checkpoint, state, _IGNORED)
    model = _loaded(create_encoder, spec, encoder_sd)
    return export_encoder(
        out_dir, model, spec, decoder=decoder_sd or None, decoder_config=decoder_config, **release
    )


# ------------------------------------------------------------------------------- DP-Cap
DPCAP_DECODER_KEYS: dict[str, str] = {
    "memory.embed.weight": "decoder_embed.weight",
    "memory.embed.bias": "decoder_embed.bias",
    "memory.pos_embed": "decoder_pos_embed",
    "memory.type_embed": "decoder_image_type_embedding",
    "token_embed.weight": "text_embedding_layer_SimVLM.weight",
    "text_pos_embed": "text_decoder_pos_embed",
    "text_type_embed": "decoder_text_type_embedding",
    "head_norm.weight": "decoder_pred_text.0.weight",
    "head_norm.bias": "decoder_pred_text.0.bias",
    "head.weight": "decoder_pred_text.1.weight",
    "head.bias": "decoder_pred_text.1.bias",
    **{
        f"blocks.{{i}}.{ours}": f"decoder.layers.{{i}}.{ref}"
        for ours, ref in (
            ("self_attn.qkv.weight", "self_attn.c_attn.weight"),
            ("self_attn.proj.weight", "self_attn.c_proj.weight"),
            ("cross_attn.q.weight", "multihead_attn.q_proj.weight"),
            ("cross_attn.kv.weight", "multihead_attn.kv_proj.weight"),
            ("cross_attn.proj.weight", "multihead_attn.c_proj.weight"),
            ("mlp.fc1.weight", "linear1.weight"),
            ("mlp.fc2.weight", "linear2.weight"),
            *((f"norm{n}.{p}", f"norm{n}.{p}") for n in (1, 2, 3) for p in ("weight", "bias")),
        )
    },
}
"""``TextDecoder`` key -> the reference's key (``MaskedAutoencoderViT_autoregressive``); ``{i}`` is
a block."""
_DPCAP_UNUSED = re.compile(
    r"^(mask_token|mask_token_text|text_pos_embed|encoder_text_type_embedding"
    r"|decoder\.layers\.\d+\.self_attn\.bias)$"
    # masking tokens, the unused text-encoder inputs, and the causal-mask buffer: not part of the
    # forward pass
)
_TYPE = "encoder_image_type_embedding"
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_REF_BLOCK = re.compile(r"^decoder\.layers\.(\d+)\.")


def dpcap_reference_key(key: str) -> str:
    """The reference's name of one of ``TextDecoder``'s keys."""
    m = _BLOCK.match(key)
    return (
        DPCAP_DECODER_KEYS[f"blocks.{{i}}.{m[2]}"].format(i=m[1]) if m else DPCAP_DECODER_KEYS[key]
    )


def split_dpcap_state_dict(
    state: dict[str, torch.Tensor], spec: EncoderSpec, decoder_heads: int | None = None
) -> tuple[dict[str, torch.Tensor], TextDecoderConfig, dict[str, torch.Tensor]]:
    """Split a DP-Cap reference state dict into (encoder state dict in timm layout with the image
    type embedding folded into ``pos_embed``, the text decoder's config, its state dict);
    every key and shape is checked and every problem named in the reference's key names."""
    try:
        config = _dpcap_decoder_config(state, spec, decoder_heads)
    except KeyError as e:
        raise CheckpointError(
            f"not a DP-Cap checkpoint: no text decoder key {e} (missing keys)"
        ) from None
    expected_enc = {k: v.shape for k, v in _shapes_of(create_encoder, spec).items()}
    expected_dec = {
        dpcap_reference_key(k): (k, v.shape) for k, v in _shapes_of(TextDecoder, config).items()
    }
    encoder, decoder, unexpected, wrong = {}, {}, [], []
    for key, value in state.items():
        if _DPCAP_UNUSED.match(key) or key == _TYPE:
            continue
        if key in expected_dec:
            ours, shape = expected_dec[key]
            decoder[ours] = value
        elif key in expected_enc:
            encoder[key], shape = value, expected_enc[key]
        else:
            unexpected.append(key)
            continue
        if value.shape != shape:
            wrong.append(f"{key} {tuple(value.shape)} (expected {tuple(shape)})")
    missing = [k for k in [*expected_enc, *expected_dec, _TYPE] if k not in state]
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(sorted(missing))}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(sorted(unexpected))}")
    if _TYPE in state and state[_TYPE].shape != (1, 1, spec.architecture.embed_dim):
        wrong.append(
            f"{_TYPE} {tuple(state[_TYPE].shape)} (expected (1, 1, {spec.architecture.embed_dim}))"
        )
    if wrong:
        problems.append(
            f"shape mismatches for {spec.arch} at {spec.img_size}px: {', '.join(sorted(wrong))}"
        )
    if problems:
        raise CheckpointError("; ".join(problems))
    encoder["pos_embed"] = encoder["pos_embed"] + state[_TYPE]
    return encoder, config, decoder


_SIZED_BY = {
    "decoder_embed.weight": 2,
    "decoder.layers.0.linear1.weight": 2,
    "text_embedding_layer_SimVLM.weight": 2,
    "text_decoder_pos_embed": 3,
}
"""The reference tensors the text decoder's sizes are read from, and their dimensions."""


def _dpcap_decoder_config(
    state: dict[str, torch.Tensor], spec: EncoderSpec, heads: int | None
) -> TextDecoderConfig:
    """The text decoder's sizes as the reference tensors show them (heads cannot be seen in
    shapes: ``heads``, else the family's default for the size)."""
    for key, ndim in _SIZED_BY.items():
        shape = tuple(state[key].shape) if key in state else None
        if shape is not None and (len(shape) != ndim or 0 in shape):
            raise CheckpointError(f"{key} has shape {list(shape)}, not {ndim} non-empty sizes")
    width = int(state["decoder_embed.weight"].shape[0])
    depth = len({m[1] for k in state if (m := _REF_BLOCK.match(k))})
    hidden = int(state["decoder.layers.0.linear1.weight"].shape[0]) if depth else 4 * width
    ratio = hidden / width
    if int(width * ratio) != hidden:  # the decoder is built int(width * mlp_ratio) wide
        ratio = math.nextafter(ratio, math.inf)
    return TextDecoderConfig.for_encoder(
        spec,
        width=width,
        depth=depth,
        num_heads=heads or spec.architecture.decoder_num_heads,
        vocab_size=int(state["text_embedding_layer_SimVLM.weight"].shape[0]),
        max_length=int(state["text_decoder_pos_embed"].shape[1]),
        mlp_ratio=ratio,
    )


def import_dpcap_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    arch: str,
    img_size: int = DEFAULT_IMG_SIZE,
    vocab: str | os.PathLike[str] | None = None,
    decoder_heads: int | None = None,
    **release: Unpack[Release],
) -> Path:
    """Convert a DP-Cap reference checkpoint (encoder and text decoder) to a repo folder; with
    ``vocab`` (the tokenizer's vocabulary file, e.g. bert-base-uncased's) the repo can caption
    (``release``: as for ``import_mae_checkpoint``; licence by default the DP-Cap authors')."""
    spec = EncoderSpec(arch, img_size=img_size)
    if spec.family.name != "dpcap":
        raise ConfigError(f"{arch} is not a DP-Cap architecture (dpcap-*)")
    _check_out(checkpoint, out_dir)
    try:  # before the checkpoint, which takes a while to load
        vocab_bytes = None if vocab is None else Path(vocab).read_bytes()
    except FileNotFoundError:
        raise MissingInputError(f"{vocab}: no such vocabulary file") from None
    except OSError as e:  # a folder, an unreadable file
        raise ConfigError(f"{vocab}: cannot read the vocabulary file ({e.strerror})") from None
    state = load_reference_checkpoint(checkpoint)
    encoder_sd, config, decoder_sd = split_dpcap_state_dict(state, spec, decoder_heads)
    _refuse_nonfinite(checkpoint, state, _DPCAP_UNUSED)
    if vocab_bytes is not None:
        tok = CaptionTokenizer(vocab_bytes, max_length=config.max_length)
        config = TextDecoderConfig.from_dict(
            {**config.to_dict(), "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}
        )
    model = _loaded(create_encoder, spec, encoder_sd)
    decoder = _loaded(TextDecoder, config, decoder_sd)
    release.setdefault("license", DPCAP_LICENSE)
    return export_encoder(out_dir, model, spec, text_decoder=decoder, vocab=vocab_bytes, **release)
