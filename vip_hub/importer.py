"""Import of checkpoints in the layout of the ViP-MAE reference code into the repo format.

The reference saves ``{"model": state_dict, ...}`` where the state dict is either a whole
MAE (encoder keys plus ``decoder_*`` and ``mask_token``) or an encoder-only ViT. Encoder keys
already follow timm's layout, except that the final ``norm`` becomes ``fc_norm`` (our
exported models pool like MAE's global pool). This is the only place that unpickles, with
``torch.load(weights_only=True)``: anything but plain tensors and containers is refused.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from .errors import CheckpointError
from .ledger import Dataset, DPStage, NonPrivateStage
from .models import EncoderSpec, create_encoder
from .repo import export_encoder

__all__ = [
    "PRESETS",
    "CheckpointError",
    "ImportPreset",
    "import_mae_checkpoint",
    "load_reference_checkpoint",
    "split_mae_state_dict",
]

_DECODER = re.compile(r"^(decoder_|mask_token$)")
_IGNORED = re.compile(r"^head\.")  # a fine-tuned classifier: not part of a released encoder


@dataclass(frozen=True)
class ImportPreset:
    """Architecture and ledger stages of a published checkpoint."""

    arch: str
    model_name: str
    summary: str
    stages: tuple[NonPrivateStage | DPStage, ...]


def _shaders21k() -> NonPrivateStage:
    return NonPrivateStage(
        name="synthetic-pretraining",
        dataset=Dataset(
            name="Shaders21k",
            size=1_300_000,
            description="images rendered from 21k procedural OpenGL shader programs (Baradad et al., 2022)",
        ),
        private_data=False,
        description="MAE pretraining (AdamW, 1,000 epochs, mask ratio 0.75) on synthetic images only.",
    )


def _vip_syn_base() -> ImportPreset:
    return ImportPreset(
        "vip-base", "vip-syn-base", "(Syn)-ViP-Base from the ViP paper: MAE on synthetic images only.",
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
        mechanism="DP-AdamW",
        description=(
            "MAE with DP-AdamW from the (Syn)-ViP initialisation (ViP paper, Sec. 4.1 and "
            "App. A.2). The paper states epsilon = 8 as its target; the parameters give the "
            "epsilon below."
        ),
        hyperparameters={
            "lr": 3.84e-4, "warmup_steps": 1000, "weight_decay": 0.005, "betas": [0.9, 0.95],
            "adam_eps": 1e-8, "lr_schedule": "cosine", "mask_ratio": 0.75, "batch_size": batch,
        },
    )
    return ImportPreset(
        "vip-base", "vip-base", "ViP-Base from the ViP paper: (Syn)-ViP then DP-AdamW on LAION-233M.",
        (_shaders21k(), laion),
    )


PRESETS: dict[str, Callable[[], ImportPreset]] = {"vip-syn-base": _vip_syn_base, "vip-base": _vip_base}
"""The two published checkpoints, by name (built on demand: their epsilon needs the accountant)."""


def load_reference_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict inside a reference checkpoint, loaded without executing pickled code."""
    try:
        # The reference saves its argparse.Namespace of hyper-parameters next to the weights:
        # a plain attribute bag, allow-listed; everything else stays refused.
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        globals_ = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        if not globals_:
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (corrupt pickle)") from None
        raise CheckpointError(
            f"{path}: refused, the file holds objects other than tensors and plain containers "
            f"(loaded with weights_only=True): {globals_[0]}"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({e})") from None
    state = obj.get("model", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{path}: expected a state dict or a dict with a 'model' state dict of tensors"
        )
    return state


def split_mae_state_dict(
    state: dict[str, torch.Tensor], spec: EncoderSpec
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split into (encoder state dict in timm layout, decoder state dict); check every key/shape."""
    expected = {k: v.shape for k, v in create_encoder(spec).state_dict().items()}
    encoder, decoder, unexpected = {}, {}, []
    for key, value in state.items():
        if _DECODER.match(key):
            decoder[key] = value
        elif _IGNORED.match(key):
            continue
        else:
            name = "fc_norm." + key.removeprefix("norm.") if key.startswith("norm.") else key
            (encoder.__setitem__(name, value) if name in expected else unexpected.append(key))
    missing = sorted(k for k in expected if k not in encoder)
    wrong = sorted(
        f"{k} {tuple(encoder[k].shape)} (expected {tuple(expected[k])})"
        for k in encoder
        if encoder[k].shape != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing encoder keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(sorted(unexpected))}")
    if wrong:
        problems.append(f"shape mismatches for {spec.arch} at {spec.img_size}px: {', '.join(wrong)}")
    if problems:
        raise CheckpointError("; ".join(problems))
    return encoder, decoder


def import_mae_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    arch: str,
    stages: tuple[NonPrivateStage | DPStage, ...] | list[NonPrivateStage | DPStage],
    model_name: str,
    summary: str = "",
    img_size: int = 224,
    repo_id: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a reference checkpoint to a released-encoder repo folder."""
    spec = EncoderSpec(arch, img_size=img_size)
    encoder_sd, decoder_sd = split_mae_state_dict(load_reference_checkpoint(checkpoint), spec)
    model = create_encoder(spec)
    model.load_state_dict(encoder_sd, strict=True)
    decoder_config = None
    if decoder_sd:
        family = spec.family
        depth = len({k.split(".")[1] for k in decoder_sd if k.startswith("decoder_blocks.")})
        width = decoder_sd["decoder_embed.weight"].shape[0] if "decoder_embed.weight" in decoder_sd else family.decoder_embed_dim
        decoder_config = {
            "embed_dim": int(width),
            "depth": depth,
            "num_heads": family.decoder_num_heads,
            "patch_size": spec.patch_size,
            "in_chans": 3,
        }
    return export_encoder(
        out_dir,
        model,
        spec,
        stages,
        model_name=model_name,
        repo_id=repo_id,
        summary=summary,
        decoder=decoder_sd or None,
        decoder_config=decoder_config,
        overwrite=overwrite,
    )
