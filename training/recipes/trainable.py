"""What of an encoder a DP stage trains (``encoder_parameters``): all of it, or its biases and
normalisation scales alone (after Bu et al. 2022's DP-BiTFiT); the recipes' config field, the
freezing and what the stage's description says."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from torch import nn

from ..skeleton.config import EncoderParameters

__all__ = [
    "EncoderParameters",
    "encoder_parameters_field",
    "encoder_parameters_note",
    "restrict_encoder",
]


def encoder_parameters_field(other: str = "the decoder") -> Any:
    """The ``encoder_parameters`` config field of a recipe whose DP stage trains an encoder and
    ``other`` (a decoder, a head), which trains whole."""
    return Field(
        "all",
        description="what of the encoder the DP stage trains: all, or biases (its biases and "
        "normalisation scales only, after Bu et al. 2022's DP-BiTFiT: of the encoder, the "
        f"stage's noise falls on those alone, under 1 % of its coordinates); {other} trains whole",
    )


def restrict_encoder(encoder: nn.Module, parameters: EncoderParameters) -> int:
    """Freeze ``encoder``'s parameters of two or more dimensions when ``parameters`` is
    ``biases``; returns the number of its coordinates left trainable."""
    if parameters == "biases":
        for p in encoder.parameters():
            if p.ndim > 1:
                p.requires_grad_(False)
    return sum(p.numel() for p in encoder.parameters() if p.requires_grad)


def encoder_parameters_note(parameters: EncoderParameters) -> str:
    """What a DP stage's description adds for ``parameters`` (nothing for ``all``)."""
    if parameters == "biases":
        return "; of the encoder, its biases and normalisation scales only"
    return ""
