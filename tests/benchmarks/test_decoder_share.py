"""benchmarks/decoder_share.py: the encoder's share of the per-example squared gradient norm."""

from __future__ import annotations

import pytest
import torch
from support.helpers import load_benchmark

from training.recipes.mae import MAE, DecoderConfig
from vip_hub.models.encoders import EncoderSpec, create_encoder

decoder_share = load_benchmark("decoder_share")


def test_the_share_is_the_encoders_part_of_each_examples_squared_norm() -> None:
    torch.manual_seed(0)
    mae = MAE(
        create_encoder(EncoderSpec("vip-nano", img_size=32, patch_size=8), mae_init=True),
        DecoderConfig(dim=32, depth=1, num_heads=4),
    )
    images, noise = torch.randn(3, 3, 32, 32), torch.rand(3, mae.num_patches)
    share = decoder_share.encoder_share(mae, images, noise)
    assert 0 < share < 1
    encoder = {id(p) for p in mae.encoder.parameters()}
    for p in mae.parameters():  # the decoder frozen: the encoder's is the whole norm
        p.requires_grad_(id(p) in encoder)
    assert decoder_share.encoder_share(mae, images, noise) == pytest.approx(1.0)
    for p in mae.parameters():  # and the encoder frozen: none of it
        p.requires_grad_(id(p) not in encoder)
    assert decoder_share.encoder_share(mae, images, noise) == 0.0


def test_the_tool_measures_both_priors_with_a_fresh_and_a_warmed_decoder() -> None:
    out = decoder_share.main(["--warmup", "2", "--images", "2"])
    assert out["prior"] == "vip-nano-scatter" and out["warmup_steps"] == 2
    assert 0 < out["fresh"] < 1 and 0 < out["warmed"] < 1
    out = decoder_share.main(["--family", "dpcap", "--warmup", "2", "--images", "2"])
    assert out["prior"] == "dpcap-nano-scatter" and out["warmup_steps"] == 2
    assert 0 < out["fresh"] < 1 and 0 < out["warmed"] < 1
    with pytest.raises(SystemExit):
        decoder_share.main(["--warmup", "0"])
