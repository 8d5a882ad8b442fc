"""Logit-DP training: (Syn) vip-nano -> train-logit-dp (per-pair clipping) and its Naive-DP
baseline -> verified repos whose ledgers name the mechanism, loss, tau, clip and Delta; only the
top blocks change; two views per example from the example's own stream; bad settings named;
resume after SIGKILL; 2-process torchrun gives the same ledger stage as one process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from support.audit_breaks import BROKEN, SETTINGS, assert_refused, break_engine
from support.clipping import empty_step_update
from support.helpers import TINY, kill_mid_run, run_stages, tiny_encoder, tiny_syn

import training.recipes.logit_dp
from training.data.images import Augmented, ImageFolder, mae_transform
from training.dp.pair_clipping import BatchClipper, PairClipper
from training.recipes.logit_dp import (
    ContrastiveMechanism,
    LogitDPConfig,
    contrastive_model,
    skip_cap,
    train_logit_dp,
)
from vip_hub import verify_repo
from vip_hub.errors import ConfigError
from vip_hub.privacy.accounting import epsilon
from vip_hub.privacy.audit import DEFAULT_CANARIES
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.privacy.sensitivity import (
    CONTRASTIVE_LOSS,
    FP64_CAPPED,
    ROUNDING_SUM,
    ROUNDING_TERMS,
    logit_dp_sensitivity,
    rounding_allowance,
)
from vip_hub.repo_format import CARD_FILE, CURVES_FILE, LEDGER_FILE, WEIGHTS_FILE

BIN = Path(sys.executable).parent
DP_ARGS = dict(
    steps=6,
    batch_size=6,
    sigma=1.0,
    seed=5,
    workers=0,
    device="cpu",
    checkpoint_every=2,
    eval_every=3,
    dataset_name="test/images",
    trainable_blocks=2,
    projection_dim=8,
)


def cli_args(settings: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def syn_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_syn(tmp_path_factory.mktemp("syn") / "vip-nano-syn", img_size=16)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 small grey images in class subfolders (labels are ignored by the recipe)."""
    root = tmp_path_factory.mktemp("data") / "digits"
    rng = np.random.default_rng(0)
    for label in range(3):
        (root / str(label)).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8), mode="L").save(
                root / str(label) / f"{i}.png"
            )
    return root


@pytest.fixture(scope="module")
def trained(syn_repo: Path, images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp") / "vip-nano-logit-dp"
    return train_logit_dp(
        LogitDPConfig(init=str(syn_repo), data=str(images), out=str(out), **DP_ARGS)
    )


# ---------------------------------------------------------------- end to end
def test_train_logit_dp_exports_a_verified_repo_that_names_its_sensitivity(
    trained: Path, syn_repo: Path, images: Path
) -> None:
    report = verify_repo(trained)
    assert report.ok, report.to_dict()
    syn, dp = PrivacyLedger.read(trained).stages
    assert syn == PrivacyLedger.read(syn_repo).stages[0]
    assert (dp.type, dp.name, dp.mechanism, dp.sampling, dp.steps) == (
        "dp",
        "dp-contrastive",
        "Logit-DP",
        "poisson",
        6,
    )
    terms = dp.mechanism_params.pop(ROUNDING_TERMS)
    assert dp.mechanism_params == {
        "loss": CONTRASTIVE_LOSS,
        "temperature": 1.0,
        ROUNDING_SUM: FP64_CAPPED,
    }  # no cap: it would not lower Delta
    assert dp.clipping_norm == 1e-3
    assert dp.sensitivity == pytest.approx(
        2e-3 * (1 + math.exp(2)) * rounding_allowance(terms, FP64_CAPPED)
    )  # with the 1/tau factor (tau = 1 here)
    assert dp.noise_std == pytest.approx(dp.noise_multiplier * dp.sensitivity)
    assert (
        dp.audit is not None
        and dp.audit.canaries == DEFAULT_CANARIES
        and dp.audit.epsilon_lower_bound < dp.epsilon
    )
    assert dp.dataset.size == 24 and dp.hyperparameters["trainable_blocks"] == 2

    before, after = (
        load_file(syn_repo / WEIGHTS_FILE),
        load_file(trained / WEIGHTS_FILE),
    )
    assert set(before) == set(after)  # the projection head is not released
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("blocks.10.", "blocks.11.", "fc_norm.")) for k in changed)
    assert any(k.startswith("blocks.10.") for k in changed) and any(
        k.startswith("blocks.11.") for k in changed
    )

    card = (trained / CARD_FILE).read_text()
    assert "Logit-DP" in card and f"]({CURVES_FILE})" in card
    log = [
        json.loads(line)
        for line in (trained.parent / f"{trained.name}.run" / "log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in log if "public_loss" in r] == [0, 3, 6]
    assert all(
        np.isfinite(r["public_loss"]) and r["epsilon"] <= 8 for r in log if "public_loss" in r
    )


def test_naive_dp_has_the_sensitivity_2c_at_the_same_budget(
    trained: Path, syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    out = train_logit_dp(
        LogitDPConfig(
            init=str(syn_repo),
            data=str(images),
            out=str(tmp_path / "naive"),
            mechanism=ContrastiveMechanism.NAIVE,
            max_grad_norm=0.05,
            **DP_ARGS,
        )
    )
    assert verify_repo(out).ok
    naive, logit = PrivacyLedger.read(out).stages[1], PrivacyLedger.read(trained).stages[1]
    assert (naive.mechanism, naive.clipping_norm) == ("Naive-DP", 0.05)
    terms = naive.mechanism_params[ROUNDING_TERMS]
    assert naive.sensitivity == 0.1 * rounding_allowance(terms, FP64_CAPPED)
    assert naive.noise_std == pytest.approx(naive.noise_multiplier * naive.sensitivity)
    assert (
        naive.epsilon == logit.epsilon
    )  # equal epsilon: same q, sigma, steps; only what is clipped differs


def test_the_skip_cap_is_used_where_it_lowers_delta_and_recorded() -> None:
    assert skip_cap(1e-3, 1.0, 64, None) is None  # at tau 1 the uncapped 16.8 B is smaller
    cap = skip_cap(1e-3, 0.1, 64, None)  # at tau 0.1, e^20: the cap B + 6 sqrt(B)
    assert cap == 112 and logit_dp_sensitivity(1e-3, 0.1, cap) < logit_dp_sensitivity(1e-3, 0.1)
    assert (
        skip_cap(1e-3, 0.001, 64, None) == 112
    )  # e^2000 overflows: the cap is the only finite Delta
    assert skip_cap(1e-3, 0.1, 64, 0) is None and skip_cap(1e-3, 0.1, 64, 80) == 80
    with pytest.raises(ConfigError, match="below the expected batch 64"):
        skip_cap(1e-3, 0.1, 64, 50)


def test_a_capped_run_records_the_cap_and_verify_recomputes_delta(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    settings = {**DP_ARGS, "steps": 2, "audit_canaries": 0}
    out = train_logit_dp(
        LogitDPConfig(
            init=str(syn_repo),
            data=str(images),
            out=str(tmp_path / "capped"),
            temperature=0.1,
            max_batch=12,
            **settings,
        )
    )
    dp = PrivacyLedger.read(out).stages[1]
    terms = dp.mechanism_params.pop(ROUNDING_TERMS)
    assert dp.mechanism_params == {
        "loss": CONTRASTIVE_LOSS,
        "temperature": 0.1,
        "max_batch": 12,
        ROUNDING_SUM: FP64_CAPPED,
    }
    assert dp.sensitivity == pytest.approx(
        logit_dp_sensitivity(1e-3, 0.1, 12) * rounding_allowance(terms, FP64_CAPPED)
    )
    assert dp.audit is None
    assert verify_repo(out).ok
    ledger = json.loads((out / LEDGER_FILE).read_text())
    ledger["stages"][1]["mechanism_params"]["max_batch"] = (
        6  # a smaller cap than the run used: Delta too low
    )
    (out / LEDGER_FILE).write_text(json.dumps(ledger))
    assert not verify_repo(out).ok


def test_bad_settings_are_named(syn_repo: Path, images: Path, tmp_path: Path) -> None:
    common = dict(
        init=str(syn_repo), data=str(images), out=str(tmp_path / "o"), dataset_name="test/images"
    )
    with pytest.raises(ValueError, match="whole Poisson sample"):
        LogitDPConfig(micro_batch_size=4, **common)
    with pytest.raises(ConfigError, match="--max-batch is Logit-DP's"):
        train_logit_dp(LogitDPConfig(mechanism="naive", max_batch=40, **common))
    with pytest.raises(
        ConfigError, match="--trainable-blocks 13: the vip-nano encoder has 12 blocks"
    ):
        train_logit_dp(LogitDPConfig(**{**DP_ARGS, **common, "trainable_blocks": 13}))


def test_two_views_come_from_the_example_own_stream(images: Path) -> None:
    folder = ImageFolder(images)
    grey = torch.nn.Identity()  # an encoder's normalisation, as timm's pretrained_cfg holds it
    grey.pretrained_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
    augmented = Augmented(folder, mae_transform(grey, 16), seed=3)
    first, second = augmented.views(4, 7, 2)
    assert torch.equal(
        first, augmented[4, 7]
    )  # the first view is the one-view recipes' augmentation
    assert not torch.equal(first, second)
    again = augmented.views(4, 7, 2)
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    assert not torch.equal(augmented.views(4, 8, 2)[1], second)


# ---------------------------------------------------------------- the engine with these clippers
@pytest.mark.parametrize("mechanism", list(ContrastiveMechanism))
def test_the_update_noise_is_sigma_delta_over_b_even_for_an_empty_sample(
    mechanism: ContrastiveMechanism,
) -> None:
    model = contrastive_model(tiny_encoder(), TINY, trainable_blocks=12, dim=8)
    clip, tau, sigma, batch = 1e-3, 0.5, 1.3, 32
    if mechanism is ContrastiveMechanism.LOGIT_DP:
        clipper, delta = PairClipper(model, clip, tau), logit_dp_sensitivity(clip, tau)
    else:
        clipper, delta = BatchClipper(model, clip, tau), 2 * clip
    engine, update = empty_step_update(
        clipper,
        clip=clip,
        sensitivity=delta,
        sigma=sigma,
        batch=batch,
        micro_batch_size=None,
        audit_canaries=0,
    )
    assert update.numel() > 100_000
    assert update.std().item() == pytest.approx(sigma * delta / batch, rel=0.01)
    assert engine.history == [(sigma, batch / 1000, 1)]


def test_the_budget_stops_a_run_before_it_exceeds_epsilon(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    settings = {
        **DP_ARGS,
        "steps": 6,
        "audit_canaries": 0,
        "epsilon": 1.0,
        "delta": 1 / 48,
    }  # delta 1/(2n), explicit
    out = train_logit_dp(
        LogitDPConfig(
            init=str(syn_repo), data=str(images), out=str(tmp_path / "stopped"), **settings
        )
    )
    dp = PrivacyLedger.read(out).stages[1]
    assert dp.steps < 6 and dp.epsilon <= 1.0
    assert (
        epsilon(1.0, 6 / 24, dp.steps + 1, dp.delta, "rdp") > 1.0
    )  # one more step would have exceeded it


# ---------------------------------------------------------------- processes
def dp_command(syn_repo: Path, images: Path, out: Path) -> list[str]:
    return ["--init", str(syn_repo), "--data", str(images), "--out", str(out), *cli_args(DP_ARGS)]


def test_resume_after_sigkill_ends_with_the_same_ledger_and_weights(
    syn_repo: Path, images: Path, trained: Path, tmp_path: Path
) -> None:
    out = tmp_path / "vip-nano-logit-dp"
    log = kill_mid_run(
        [str(BIN / "vip-hub"), "train-logit-dp", *dp_command(syn_repo, images, out)], out, step=3
    )
    train_logit_dp(LogitDPConfig(init=str(syn_repo), data=str(images), out=str(out), **DP_ARGS))
    assert run_stages(PrivacyLedger.read(out)) == run_stages(PrivacyLedger.read(trained))
    a, b = load_file(out / WEIGHTS_FILE), load_file(trained / WEIGHTS_FILE)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(7))


@pytest.mark.slow
def test_two_processes_give_the_same_ledger_stage(
    syn_repo: Path, images: Path, trained: Path, tmp_path: Path
) -> None:
    """Each rank contrasts its own Poisson sample, so the weights differ from one process's; what
    the ledger records (budget, Delta, audit: the canaries read only the noise) must not."""
    out = tmp_path / "vip-nano-logit-dp"
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "training.recipes.logit_dp",
        *dp_command(syn_repo, images, out),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert verify_repo(out).ok
    assert run_stages(PrivacyLedger.read(out)) == run_stages(PrivacyLedger.read(trained))


@pytest.mark.parametrize("broken", BROKEN)
@pytest.mark.parametrize("mechanism", list(ContrastiveMechanism))
def test_the_audit_catches_a_broken_engine(
    mechanism: ContrastiveMechanism,
    broken: str,
    syn_repo: Path,
    images: Path,
    hub,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clipper = "PairClipper" if mechanism is ContrastiveMechanism.LOGIT_DP else "BatchClipper"
    staged = break_engine(monkeypatch, broken, training.recipes.logit_dp, clipper)
    settings = {
        **DP_ARGS,
        **SETTINGS,
        "batch_size": 12,
        "mechanism": mechanism.value,
    }  # q = 1/2 of 24 images
    out = train_logit_dp(
        LogitDPConfig(
            init=str(syn_repo), data=str(images), out=str(tmp_path / "broken"), **settings
        )
    )
    dp = assert_refused(out, hub, f"{mechanism.value}-{broken.replace(' ', '-')}", staged)
    assert dp.mechanism == mechanism.ledger_name
