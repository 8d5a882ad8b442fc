"""Shared fixtures. Tests make their own small data; nothing is downloaded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Keep every hub client's cache and token away from the user's home, before any import.
_HOME = Path(tempfile.mkdtemp(prefix="vip-hub-tests-"))
os.environ.setdefault("HF_HOME", str(_HOME / "hf"))
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from vip_hub import Dataset, DPStage, EncoderSpec, NonPrivateStage, create_encoder, export_encoder  # noqa: E402

TINY = EncoderSpec("vip-nano", img_size=32)


def synthetic_stage() -> NonPrivateStage:
    return NonPrivateStage(
        name="synthetic-pretraining",
        dataset=Dataset(name="procedural-images", description="generated in the test"),
        private_data=False,
    )


def dp_stage(n: int = 1000, batch: int = 50, sigma: float = 1.0, steps: int = 100) -> DPStage:
    return DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="test-images", size=n),
        sample_rate=batch / n,
        noise_multiplier=sigma,
        steps=steps,
        clipping_norm=0.1,
    )


def tiny_encoder(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_encoder(TINY, mae_init=True).eval()


@pytest.fixture(scope="session")
def dp_stage_session() -> DPStage:
    return dp_stage()


@pytest.fixture
def tiny_repo(tmp_path: Path, dp_stage_session: DPStage) -> Path:
    """A freshly exported random vip-nano (32 px) repo with a synthetic and a DP stage."""
    decoder = {"mask_token": torch.zeros(1, 1, 512), "decoder_embed.weight": torch.randn(512, 192)}
    return export_encoder(
        tmp_path / "repo",
        tiny_encoder(),
        TINY,
        [synthetic_stage(), dp_stage_session],
        model_name="vip-nano-test",
        summary="A randomly initialised test encoder.",
        decoder=decoder,
        decoder_config={"embed_dim": 512, "depth": 0},
    )
