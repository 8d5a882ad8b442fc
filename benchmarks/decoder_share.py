"""The encoder's share of a DP encoder stage's per-example gradient (issue 56): how much of the
clipping norm reaches the encoder when the stage starts a fresh decoder (ViP's MAE decoder, or
DP-Cap's text decoder with ``--family dpcap``), fresh and after ``warm_decoder``'s public warm-up.
Public data only: the committed prior, the public procedural images the curves use and, for
DP-Cap, the public captions over Fashion-MNIST's class names.

    python benchmarks/decoder_share.py [--family vip|dpcap] [--warmup 150] [--images 32]

For each image alone, the squared gradient norm of the encoder's trainable tensors over that of
all trainable tensors (what per-example clipping scales together); the mean over the images.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from training.data.images import mae_transform
from training.data.labelled import FASHION_MNIST_CLASSES, class_public_captions, class_vocabulary
from training.priors import prior_path
from training.recipes.dpcap import DPCapConfig, public_caption_loss
from training.recipes.mae import (
    freeze_fixed_tokens,
    load_mae,
    masked_loss,
    public_eval_batch,
    public_images,
    warm_decoder,
)
from training.study.config import JOB
from vip_hub.loading import load_encoder
from vip_hub.models.text_decoder import Captioner, TextDecoder, TextDecoderConfig
from vip_hub.models.tokenizer import CaptionTokenizer

SEED = 0
"""Seeds the fresh decoder (public: nothing here is private)."""


def encoder_share(model: nn.Module, *inputs: torch.Tensor) -> float:
    """Mean over the examples of ``inputs`` (one at a time) of the share of ``model.encoder``'s
    trainable tensors in the squared gradient norm of all of ``model``'s, for a ``model`` that
    returns per-example losses (an MAE, a captioner)."""
    encoder = {id(p) for p in cast(nn.Module, model.encoder).parameters()}
    shares = []
    for i in range(len(inputs[0])):
        model.zero_grad(set_to_none=True)
        model(*(x[i : i + 1] for x in inputs)).sum().backward()
        sq = {True: 0.0, False: 0.0}
        for p in model.parameters():
            if p.grad is not None:
                sq[id(p) in encoder] += float(p.grad.square().sum())
        shares.append(sq[True] / (sq[True] + sq[False]))
    model.zero_grad(set_to_none=True)
    return sum(shares) / len(shares)


def vip_shares(warmup: int, count: int) -> dict[str, Any]:
    """The share with the study's fresh ViP decoder on its prior, then after ``warmup`` public
    warm-up steps; the warm-up's first and last loss."""
    torch.manual_seed(SEED)
    shape = {"dim": JOB.decoder_dim, "depth": JOB.decoder_depth, "num_heads": JOB.decoder_heads}
    mae, enc = load_mae(prior_path(JOB.syn_prior), shape)
    images, noise = (t[:count] for t in public_eval_batch(enc.spec, mae.num_patches))
    fresh = encoder_share(mae, images, noise)
    transform = mae_transform(mae.encoder, enc.spec.img_size)
    losses = warm_decoder(mae, mae.encoder, transform, masked_loss(mae), warmup)
    return {
        "fresh": fresh,
        "warmup_steps": warmup,
        "warmed": encoder_share(mae, images, noise),
        "warmup_loss": [losses[0], losses[-1]],
    }


def dpcap_shares(warmup: int, count: int) -> dict[str, Any]:
    """The share with DP-Cap's fresh text decoder (the recipe's default shape) on its prior,
    captioning the public images with the public captions over the class names, then after
    ``warmup`` public warm-up steps (the recipe's ``decoder_warmup``); the warm-up's first and
    last loss."""
    torch.manual_seed(SEED)
    tokenizer = CaptionTokenizer(class_vocabulary(FASHION_MNIST_CLASSES))
    init = load_encoder(prior_path(JOB.dpcap_prior))
    shape = {k: DPCapConfig.model_fields[f"decoder_{k}"].default for k in ("width", "depth")}
    heads = DPCapConfig.model_fields["decoder_heads"].default
    decoder = TextDecoder(
        TextDecoderConfig.for_encoder(init.spec, tokenizer, **shape, num_heads=heads)
    )
    model = Captioner(freeze_fixed_tokens(init.model.train(), init.spec), decoder)
    images = public_images(init.spec)[:count]
    captions = class_public_captions(FASHION_MNIST_CLASSES)
    texts = tokenizer.encode([captions[i % len(captions)] for i in range(len(images))])
    fresh = encoder_share(model, images, texts)
    transform = mae_transform(init.model, init.spec.img_size)
    loss = public_caption_loss(model, tokenizer, captions)
    losses = warm_decoder(model, model.encoder, transform, loss, warmup)
    return {
        "fresh": fresh,
        "warmup_steps": warmup,
        "warmed": encoder_share(model, images, texts),
        "warmup_loss": [losses[0], losses[-1]],
    }


def measure(family: str, warmup: int, count: int) -> dict[str, Any]:
    """``family``'s shares on ``count`` public images, fresh and after a ``warmup``."""
    shares = (vip_shares if family == "vip" else dpcap_shares)(warmup, count)
    return {"family": family, "prior": JOB.prior(family), "images": count, **shares}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print the measurement as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("vip", "dpcap"), default="vip")
    p.add_argument("--warmup", type=int, default=150, help="public warm-up steps of the decoder")
    p.add_argument("--images", type=int, default=32, help="public images averaged over")
    a = p.parse_args(argv)
    if a.warmup < 1 or a.images < 1:
        p.error("--warmup and --images are at least 1")
    out = measure(a.family, a.warmup, a.images)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
