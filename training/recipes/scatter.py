"""The (Syn) stage's distillation objective (``train-syn --objective scatter``): an encoder's patch
tokens learn to predict a ScatterNet's coefficients of procedural images.

The teacher is Tramer & Boneh's handcrafted ScatterNet (ICLR 2021): kymatio's ``Scattering2D``
(``SCATTER_J`` scales, ``SCATTER_ANGLES`` angles: 81 coefficient maps at 1 / 2^J of the image's
side) on the greyscale image in [0, 1], then a GroupNorm over ``SCATTER_GROUPS`` groups of maps
per example, the features whose DP linear probe reaches 89.7 % on Fashion-MNIST at (3, 1e-5).
The student is the encoder (a shallow one, ``train-syn --depth``): its last block's patch
tokens, through a linear map that is not released, regress the teacher's maps average-pooled to
the patch grid (a mean squared error per example). The teacher has no parameters and sees only
procedural images, so the stage uses no private data; a linear probe on the last block's spatial
map can then read what the teacher computes, and the encoder stays a plain timm ViT that DP
training can start from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

__all__ = [
    "SCATTER_ANGLES",
    "SCATTER_GROUPS",
    "SCATTER_J",
    "ScatterDistiller",
    "Scattering",
    "scattering_channels",
]

SCATTER_J, SCATTER_ANGLES, SCATTER_GROUPS = 2, 8, 27
"""Tramer & Boneh's ScatterNet on 28 x 28 images: 2 scales, 8 angles, GroupNorm over 27 groups
(their published choice, tuned by them on Fashion-MNIST's training split: external, disclosed)."""


def scattering_channels(j: int = SCATTER_J, angles: int = SCATTER_ANGLES) -> int:
    """Coefficient maps of a second-order scattering of one channel: 1 + J L + L^2 J (J - 1) / 2."""
    return 1 + j * angles + angles**2 * j * (j - 1) // 2


class Scattering(nn.Module):
    """``forward(grey)``: the GroupNorm-ed scattering (B, 81, side / 2^J, side / 2^J) of greyscale
    images (B, side, side) in [0, 1], per example (no statistics across examples)."""

    def __init__(self, side: int):
        super().__init__()
        # the torch frontend alone: kymatio.torch imports its 3-D module, which fails on SciPy
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

        self.scattering = ScatteringTorch2D(J=SCATTER_J, shape=(side, side), L=SCATTER_ANGLES)

    def forward(self, grey: torch.Tensor) -> torch.Tensor:
        return F.group_norm(self.scattering(grey), SCATTER_GROUPS, eps=1e-5)


class ScatterDistiller(nn.Module):
    """An encoder and a linear map from each of its last block's patch tokens to the teacher's
    coefficients at that patch: ``forward(grey)`` returns each example's mean squared error."""

    mean: torch.Tensor  # buffers (register_buffer)
    std: torch.Tensor

    def __init__(self, encoder: VisionTransformer, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.encoder = encoder
        self.teacher = Scattering(encoder.patch_embed.img_size[0])
        self.head = nn.Linear(encoder.embed_dim, scattering_channels())
        self.register_buffer("mean", mean.view(1, -1, 1, 1))
        self.register_buffer("std", std.view(1, -1, 1, 1))

    def tokens(self, grey: torch.Tensor) -> torch.Tensor:
        """The last block's patch tokens (B, N, C), before the final norm, for greyscale images in
        [0, 1]."""
        e = self.encoder
        x = (grey.unsqueeze(1).expand(-1, 3, -1, -1) - self.mean) / self.std
        return e.blocks(e.norm_pre(e._pos_embed(e.patch_embed(x))))[:, e.num_prefix_tokens :]

    def forward(self, grey: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = F.adaptive_avg_pool2d(
                self.teacher(grey.float()), self.encoder.patch_embed.grid_size
            )
        prediction = self.head(self.tokens(grey))  # (B, N, 81)
        return (prediction - target.flatten(2).transpose(1, 2)).pow(2).mean(dim=(1, 2))
