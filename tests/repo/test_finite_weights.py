"""Non-finite weights: ``vip-hub verify`` names each weights file's tensors that hold NaN or an
infinity, by the rule the importer refuses them by (``nonfinite_count``)."""

import pytest
import torch
from support.helpers import TINY, staged_reports, synthetic_stage, tiny_encoder

from vip_hub import export_encoder, verify_repo
from vip_hub.cli.main import main
from vip_hub.repo.artifacts import nonfinite_count
from vip_hub.repo_format import MAE_DECODER_FILE, WEIGHTS_FILE

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@pytest.mark.parametrize("name", DTYPES)
def test_the_rule_counts_what_torch_finds_non_finite(name):
    """On random bit patterns of each floating safetensors dtype (many of them NaN or infinite)
    the count is torch's; integer dtypes hold no non-finite value."""
    bits = torch.randint(0, 256, (4096 * 8,), dtype=torch.uint8, generator=torch.Generator())
    values = bits.view(DTYPES[name])
    expected = int((~torch.isfinite(values.double())).sum())
    assert expected > 0
    assert nonfinite_count(bits.numpy().tobytes(), name) == expected
    assert nonfinite_count(bits.numpy().tobytes(), "I32") == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_names_the_tensors_holding_nan_or_infinity(tmp_path, dtype, monkeypatch):
    """A repo exported with a NaN in an encoder weight and an infinity in its MAE decoder (its
    digests what the ledger records) fails verify, naming each file and tensor."""
    # the export itself refuses such a repo: let it write one, for verify to find
    staged_reports(monkeypatch)
    model = tiny_encoder()
    with torch.no_grad():
        model.blocks[2].mlp.fc1.weight[0, 7] = float("nan")
    decoder = {"mask_token": torch.zeros(1, 1, 512), "decoder_embed.weight": torch.randn(512, 192)}
    decoder["decoder_embed.weight"][1, 1] = float("inf")
    repo = export_encoder(
        tmp_path / "repo",
        model,
        TINY,
        [synthetic_stage()],
        model_name="nan",
        decoder=decoder,
        weights_dtype=dtype,
    )
    report = verify_repo(repo)
    assert sorted(map(str, report.problems)) == [
        f"{MAE_DECODER_FILE}: NaN or infinite values in decoder_embed.weight: it would serve "
        "non-finite outputs",
        f"{WEIGHTS_FILE}: NaN or infinite values in blocks.2.mlp.fc1.weight: it would serve "
        "non-finite outputs",
    ]
    assert "weights finite" in report.checks
    assert main(["verify", str(repo)]) == 1
    with torch.no_grad():
        model.blocks[2].mlp.fc1.weight[0, 7] = 0.0
    decoder["decoder_embed.weight"][1, 1] = 0.0
    fine = export_encoder(
        tmp_path / "fine", model, TINY, [synthetic_stage()], model_name="ok", decoder=decoder
    )
    assert verify_repo(fine).ok
