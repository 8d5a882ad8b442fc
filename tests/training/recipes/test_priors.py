"""The (Syn) priors committed to the project (``training.priors``): each is a verified repo of at
most 5 MB that says it used no private data, plain timm loads it, and its documented command
reproduces its committed loss curve (checked on the first steps of a real run of that command)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
from safetensors import safe_open
from support.helpers import ROOT, kill_mid_run

from training.priors import PRIORS, losses_path, prior_command, prior_path, read_losses
from vip_hub.errors import MissingInputError
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import CONFIG_BLOCK, CONFIG_FILE, WEIGHTS_FILE

BIN = ROOT / ".venv" / "bin"
MAX_BYTES = 5 * 1024 * 1024
CHECKED_STEPS = 5


@pytest.mark.parametrize("name", sorted(PRIORS))
def test_a_committed_prior_is_a_small_verified_repo_without_private_data(name: str) -> None:
    repo = prior_path(name)
    report = verify_repo(repo)
    assert report.ok, report.problems
    (stage,) = PrivacyLedger.read(repo).stages
    assert stage.name == "syn-scatter" and stage.private_data is False
    weights = repo / WEIGHTS_FILE
    total = sum(f.stat().st_size for f in repo.iterdir())
    assert total <= MAX_BYTES, f"{name}: {total} bytes"
    with safe_open(weights, "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} <= {"F16"}
    config = json.loads((repo / CONFIG_FILE).read_text())
    settings = PRIORS[name]
    assert config["model_args"]["depth"] == settings["depth"]
    assert config[CONFIG_BLOCK]["arch"] == settings["arch"]
    assert f"spatial-b{settings['depth']}-g7" in config[CONFIG_BLOCK]["feature_dims"]
    model = timm.create_model(f"local-dir:{repo}", pretrained=True)
    assert len(model.blocks) == settings["depth"] and model.patch_embed.grid_size == (7, 7)
    assert len(read_losses(name)) == settings["steps"]


@pytest.mark.parametrize("name", sorted(PRIORS))
def test_the_documented_command_reproduces_the_committed_loss_curve(
    name: str, tmp_path: Path
) -> None:
    """The first steps of ``prior_command`` (the real CLI, the prior's settings, its full step
    count, stopped once its log has them) give the committed losses: the prior is that command's."""
    out = tmp_path / name
    command = prior_command(name, str(out))
    log = kill_mid_run([str(BIN / command[0]), *command[1:]], out, step=CHECKED_STEPS)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]
    losses = [r["train_loss"] for r in records if "train_loss" in r][:CHECKED_STEPS]
    assert len(losses) == CHECKED_STEPS
    assert losses == pytest.approx(read_losses(name)[:CHECKED_STEPS], rel=1e-3)


def test_an_unknown_prior_is_named() -> None:
    with pytest.raises(MissingInputError, match="no committed prior 'vip-nano-mae'; known: vip"):
        prior_path("vip-nano-mae")
    assert losses_path("vip-nano-scatter").name == "vip-nano-scatter.losses.json"
