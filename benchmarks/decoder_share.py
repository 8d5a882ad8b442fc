"""The encoder's share of a ViP stage's per-example gradient (issue 56): how much of the
clipping norm reaches the encoder when its MAE decoder is fresh, and after ``warm_decoder``'s
public warm-up. Public data only: the committed prior and the public procedural images the MAE
curves use (``public_eval_batch``).

    python benchmarks/decoder_share.py [--prior vip-nano-scatter] [--warmup 150] [--images 32]

For each image alone, the squared gradient norm of the encoder's trainable tensors over that of
all trainable tensors (what per-example clipping scales together); the mean over the images.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, cast

import torch

from training.data.images import mae_transform
from training.priors import prior_path
from training.recipes.mae import MAE, load_mae, public_eval_batch, warm_decoder
from training.study.config import JOB

SEED = 0
"""Seeds the fresh decoder (public: nothing here is private)."""


def encoder_share(mae: MAE, images: torch.Tensor, noise: torch.Tensor) -> float:
    """Mean over ``images`` (one at a time, masks ``noise``) of the encoder's share of the
    per-example squared gradient norm of ``mae``'s trainable tensors."""
    encoder = {id(p) for p in mae.encoder.parameters()}
    shares = []
    for i in range(len(images)):
        mae.zero_grad(set_to_none=True)
        mae(images[i : i + 1], noise[i : i + 1]).sum().backward()
        sq = {True: 0.0, False: 0.0}
        for p in mae.parameters():
            if p.grad is not None:
                sq[id(p) in encoder] += float(p.grad.square().sum())
        shares.append(sq[True] / (sq[True] + sq[False]))
    mae.zero_grad(set_to_none=True)
    return sum(shares) / len(shares)


def measure(prior: str, warmup: int, count: int) -> dict[str, Any]:
    """The share with the study's fresh ViP decoder on ``prior``, then after ``warmup`` public
    warm-up steps; the warm-up's first and last loss."""
    torch.manual_seed(SEED)
    shape = {"dim": JOB.decoder_dim, "depth": JOB.decoder_depth, "num_heads": JOB.decoder_heads}
    mae, enc = load_mae(prior_path(prior), shape)
    images, noise = (t[:count] for t in public_eval_batch(enc.spec, mae.num_patches))
    fresh = encoder_share(mae, images, noise)
    cfg = cast(dict[str, Any], mae.encoder.pretrained_cfg)
    transform = mae_transform(enc.spec.img_size, tuple(cfg["mean"]), tuple(cfg["std"]))
    losses = warm_decoder(mae, transform, warmup)
    return {
        "prior": prior,
        "images": len(images),
        "fresh": fresh,
        "warmup_steps": warmup,
        "warmed": encoder_share(mae, images, noise),
        "warmup_loss": [losses[0], losses[-1]],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print the measurement as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prior", default=JOB.syn_prior)
    p.add_argument("--warmup", type=int, default=150, help="public warm-up steps of the decoder")
    p.add_argument("--images", type=int, default=32, help="public images averaged over")
    a = p.parse_args(argv)
    if a.warmup < 1 or a.images < 1:
        p.error("--warmup and --images are at least 1")
    out = measure(a.prior, a.warmup, a.images)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
