"""Training runs end to end: (Syn)-ViP -> DP-AdamW -> export -> verify; budget stop;
resume after SIGKILL; a 2-process torchrun; tar shards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file
from support.audit_breaks import BROKEN, SETTINGS, assert_refused, break_engine
from support.helpers import (
    ROOT,
    TINY_SYN,
    assert_biases_only_trained,
    kill_mid_run,
    published_hashes_of,
    run_stages,
    tiny_syn,
)
from support.ports import free_port

import training.dp.engine
import training.dp.run
from training.data.images import TarShards, open_images
from training.dp.run import retrained_if_flagged
from training.recipes.syn import SynConfig, train_syn
from training.recipes.vip import VipConfig, train_vip
from training.skeleton.checkpoint import save_checkpoint
from training.skeleton.config import run_folder
from training.skeleton.run import LOCK_FILE
from vip_hub.cli.main import main
from vip_hub.errors import (
    AccountingError,
    AuditError,
    CheckpointError,
    ConfigError,
    DataError,
    MissingInputError,
    StepFailed,
    UnsupportedLayerError,
    VipHubError,
)
from vip_hub.privacy.accounting import NOISE_SAMPLER, Accountant, max_steps_within
from vip_hub.privacy.audit import DEFAULT_CANARIES
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.privacy.sensitivity import (
    FP64_CAPPED,
    ROUNDING_SUM,
    ROUNDING_TERMS,
    rounding_allowance,
    sample_bound,
)
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import (
    CARD_FILE,
    CONFIG_FILE,
    CURVES_FILE,
    MAE_DECODER_FILE,
    WEIGHTS_FILE,
)

BIN = Path(sys.executable).parent


def make_images(root: Path, per_class: int = 20, classes: int = 2, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            size = int(rng.integers(24, 64))
            Image.fromarray(rng.integers(0, 255, (size, size + 3, 3), dtype=np.uint8)).save(
                root / f"class{c}" / f"{i:03d}.png"
            )
    return root


@pytest.fixture(scope="module")
def syn_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_syn(tmp_path_factory.mktemp("syn") / "vip-nano-syn", steps=4)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "private-images")


def vip_config(syn_repo: Path, images: Path, out: Path, **settings: Any) -> VipConfig:
    """A DP-AdamW run from the module's (Syn) repo on its private images into ``out`` (no
    data-loading processes, the images declared as ``test/images``); ``settings`` are the run's
    own."""
    return VipConfig(
        init=str(syn_repo),
        data=str(images),
        out=str(out),
        workers=0,
        dataset_name="test/images",
        **settings,
    )


def make_repo_without_decoder(tmp_path: Path) -> Path:
    from support.helpers import TINY, synthetic_stage, tiny_encoder

    from vip_hub import export_encoder

    return export_encoder(
        tmp_path / "no-decoder", tiny_encoder(), TINY, [synthetic_stage()], model_name="x"
    )


def test_syn_export_says_no_private_data(syn_repo: Path) -> None:
    report = verify_repo(syn_repo)
    assert report.ok, report.problems
    ledger = PrivacyLedger.read(syn_repo)
    assert [s.type for s in ledger.stages] == ["non-private"]
    assert ledger.stages[0].private_data is False and ledger.guarantees == []
    assert (syn_repo / MAE_DECODER_FILE).is_file()
    assert CURVES_FILE in ledger.artifacts
    log = [
        json.loads(line) for line in (syn_repo.with_name("vip-nano-syn.run") / "log.jsonl").open()
    ]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]  # step 0: the public loss before training


def test_contrastive_syn_exports_a_verified_repo_without_private_data(tmp_path: Path) -> None:
    """The (Syn) contrastive objective: its own ledger stage saying no private data, no MAE
    decoder (ViP would start a fresh one), plain timm loads it, and a rerun of the same
    settings reproduces its loss curve (its views come from their own streams)."""
    cfg = dict(TINY_SYN, img_size=16, patch_size=4, crop_pct=1.0, objective="contrastive", steps=3)
    cfg["families"] = "dead_leaves,cellular"
    out = train_syn(SynConfig(out=str(tmp_path / "con"), **cfg))
    report = verify_repo(out)
    assert report.ok, report.problems
    (stage,) = PrivacyLedger.read(out).stages
    assert stage.type == "non-private" and stage.name == "syn-contrastive"
    assert stage.private_data is False and "no private data" in stage.description
    assert "dead_leaves, cellular" in stage.dataset.description
    assert not (out / MAE_DECODER_FILE).exists()
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert model.patch_embed.grid_size == (4, 4)
    assert model.pretrained_cfg["crop_pct"] == 1.0
    again = train_syn(SynConfig(out=str(tmp_path / "again"), **cfg))

    def curve(repo: Path) -> list[float]:
        log = (repo.with_name(repo.name + ".run") / "log.jsonl").open()
        return [r["train_loss"] for r in map(json.loads, log) if "train_loss" in r]

    assert len(curve(out)) == 3 and curve(out) == pytest.approx(curve(again), rel=1e-5)
    with pytest.raises(ValueError, match="unknown procedural families"):
        SynConfig(out=str(tmp_path / "x"), families="dead_leaves,stripes")


def test_scatter_syn_distils_the_scatternet_into_a_shallow_encoder(tmp_path: Path) -> None:
    """The (Syn) ScatterNet distillation: the teacher is kymatio's scattering with the per-example
    GroupNorm (pooled to the patch grid when coarser), the tokens predict it far better as they
    train (on the fixed public images), the encoder has ``--depth`` blocks and declares its last
    block's spatial modes, the ledger says no private data, and plain timm loads it with no
    vip-hub code."""
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    from training.recipes.scatter import ScatterDistiller, Scattering, scattering_channels
    from vip_hub.models.encoders import EncoderSpec, create_encoder

    grey = torch.rand(3, 16, 16)
    direct = ScatteringTorch2D(J=2, shape=(16, 16), L=8)(grey)  # (3, 81, 4, 4)
    assert direct.shape[1] == scattering_channels() == 81
    groups = direct.reshape(3, 27, -1)
    centred = groups - groups.mean(-1, keepdim=True)
    expected = centred / (groups.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(Scattering(16)(grey), expected.reshape(direct.shape))
    coarse = ScatterDistiller(  # 32 px at patch 16: the 8 x 8 maps pooled to 2 x 2
        create_encoder(EncoderSpec("vip-nano", 32, 16, depth=1), mae_init=True),
        torch.zeros(3),
        torch.ones(3),
    )
    with torch.no_grad():
        assert coarse(torch.rand(2, 32, 32)).shape == (2,)

    cfg = dict(TINY_SYN, img_size=16, patch_size=4, crop_pct=1.0, objective="scatter", lr=1e-3)
    cfg.update(steps=40, batch_size=16, depth=2, seed=3)
    out = train_syn(SynConfig(out=str(tmp_path / "scatter"), **cfg))
    report = verify_repo(out)
    assert report.ok, report.problems
    (stage,) = PrivacyLedger.read(out).stages
    assert stage.name == "syn-scatter" and stage.private_data is False
    assert "last of 2 blocks" in stage.description
    assert not (out / MAE_DECODER_FILE).exists()
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["model_args"]["depth"] == 2
    dims = config["vip_hub"]["feature_dims"]
    assert dims["spatial-b2-g4"] == 192 * 16 and dims["vip"] == 2 * 192
    log = (out.with_name(out.name + ".run") / "log.jsonl").open()
    public = [r["public_loss"] for r in map(json.loads, log) if "public_loss" in r]
    assert public[-1] < 0.6 * public[0]  # the tokens learn the teacher on held-out public images
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert len(model.blocks) == 2 and model.patch_embed.grid_size == (4, 4)
    with pytest.raises(ConfigError, match="depth 13: a vip-nano has 1 to 12 blocks"):
        train_syn(SynConfig(out=str(tmp_path / "x"), **dict(cfg, depth=13)))


def test_dp_end_to_end_exports_a_verified_repo_that_timm_loads(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    out = train_vip(
        vip_config(
            syn_repo,
            images,
            tmp_path / "vip-nano-dp",
            epsilon=8.0,
            batch_size=8,
            steps=3,
            micro_batch_size=3,
            seed=0,
        )
    )
    report = verify_repo(out)
    assert report.ok, report.problems
    ledger = PrivacyLedger.read(out)
    syn, dp = ledger.stages
    assert syn.name == "syn-pretrain" and syn.private_data is False
    assert dp.type == "dp" and dp.mechanism == "DP-AdamW" and dp.steps == 3
    assert dp.dataset.size == 40 and dp.sample_rate == pytest.approx(8 / 40)
    assert dp.delta == pytest.approx(1e-5) and dp.clipping_norm == 0.1
    assert dp.epsilon <= 8.0 and set(dp.reference_epsilon) == {Accountant.PRV, Accountant.PLD}
    terms = sample_bound(40, 8 / 40)
    assert dp.mechanism_params == {ROUNDING_TERMS: terms, ROUNDING_SUM: FP64_CAPPED}
    assert dp.sensitivity == 0.1 * rounding_allowance(terms, FP64_CAPPED)
    assert dp.noise_std == pytest.approx(dp.noise_multiplier * dp.sensitivity)
    audit = dp.audit  # on by default: 1000 canaries, bound below the accounted epsilon at its delta
    assert audit is not None and audit.canaries == DEFAULT_CANARIES and audit.delta == 1e-5
    assert 0 <= audit.epsilon_lower_bound <= min(audit.accountant_epsilon.values())
    assert "Empirical audit of `dp-pretrain`" in (out / CARD_FILE).read_text()
    assert dp.dataset.name == "test/images" and not published_hashes_of(images, out)
    assert ledger.guarantees[0].epsilon == pytest.approx(dp.epsilon)
    assert CURVES_FILE in (out / CARD_FILE).read_text()
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 192)
    decoder = load_file(out / MAE_DECODER_FILE)
    assert "mask_token" in decoder and "decoder_pred.weight" in decoder


def test_a_dp_run_folder_is_private_from_its_creation(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    """Under umask 022 (the usual one; under 077 anything passes), a DP run with a secret seed
    leaves no file or folder under OUT.run/ with a group or other bit (the seed, the settings,
    the run id, every checkpoint, the log), the seed only in its own file (and the owner-only
    checkpoint), and its random run id in the released stage."""
    old = os.umask(0o022)
    try:
        out = train_vip(
            vip_config(
                syn_repo,
                images,
                tmp_path / "vip-nano-dp",
                epsilon=8.0,
                batch_size=8,
                steps=2,
                checkpoint_every=1,
                audit_canaries=100,
            )
        )
    finally:
        os.umask(old)
    run = tmp_path / "vip-nano-dp.run"
    made = [run, *run.rglob("*")]
    assert {p.name for p in made} == {
        run.name,
        "seed",
        "run_id",
        "settings.json",
        "checkpoint.pt",
        "log.jsonl",
        LOCK_FILE,
    }
    assert [f"{p} {p.stat().st_mode & 0o777:o}" for p in made if p.stat().st_mode & 0o077] == []
    seed = (run / "seed").read_text()
    assert seed not in (run / "settings.json").read_text()
    assert "seed" not in json.loads((run / "settings.json").read_text())
    assert PrivacyLedger.read(out).stages[-1].run_id == (run / "run_id").read_text()


def test_training_stops_before_the_budget_is_exceeded(
    syn_repo: Path, images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sigma, q = 0.6, 8 / 40
    expected = max_steps_within(
        3.0, sigma, q, 1 / 80, 50, Accountant.RDP
    )  # delta 1/(2n), given explicitly
    assert 0 < expected < 50
    out = train_vip(
        vip_config(
            syn_repo,
            images,
            tmp_path / "dp",
            epsilon=3.0,
            sigma=sigma,
            batch_size=8,
            steps=50,
            seed=0,
            eval_every=100,
            delta=1 / 80,
        )
    )
    assert f"stopping after step {expected} of 50" in capsys.readouterr().err
    dp = PrivacyLedger.read(out).stages[-1]
    assert dp.steps == expected and dp.epsilon <= 3.0


def test_a_biases_only_stage_trains_the_encoders_vectors_and_the_whole_decoder(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    """``encoder_parameters="biases"`` (DP-BiTFiT): the encoder's matrices are released as the
    init's, its biases and norm scales move, and the stage says so."""
    out = train_vip(
        vip_config(
            syn_repo,
            images,
            tmp_path / "biases",
            seed=0,
            batch_size=8,
            steps=2,
            eval_every=100,
            delta=1 / 80,
            encoder_parameters="biases",
        )
    )
    assert_biases_only_trained(syn_repo, out, "dp-pretrain", MAE_DECODER_FILE)
    assert verify_repo(out).ok


def test_a_trial_keeps_the_weights_the_run_would_release_and_writes_nothing(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    """``trial_weights``: the same seeded run, once exported and once inside the block, which
    holds the released weights (the iterates' average) and leaves no repo behind."""
    settings = {"seed": 3, "batch_size": 8, "steps": 2, "eval_every": 100, "ema_decay": 0.5}
    out = train_vip(vip_config(syn_repo, images, tmp_path / "a", **settings))
    released = load_file(out / WEIGHTS_FILE)
    with training.dp.run.trial_weights() as kept:
        train_vip(vip_config(syn_repo, images, tmp_path / "b", **settings))
    assert not (tmp_path / "b").exists()
    assert kept.keys() == released.keys()
    assert all(torch.equal(kept[k], released[k]) for k in kept)
    prior = load_file(syn_repo / WEIGHTS_FILE)
    assert any(not torch.equal(kept[k], prior[k]) for k in kept)  # trained
    with training.dp.run.trial_weights() as outside:
        pass
    train_vip(vip_config(syn_repo, images, tmp_path / "c", **settings))
    assert not outside and (tmp_path / "c" / WEIGHTS_FILE).is_file()  # the block ended


def test_bad_inputs_name_what_is_wrong(
    syn_repo: Path, images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x"
    with pytest.raises(DataError, match="dataset-size 41"):
        train_vip(vip_config(syn_repo, images, out, seed=0, dataset_size=41))
    with pytest.raises(ConfigError, match="batch-size"):
        train_vip(vip_config(syn_repo, images, out, seed=0, batch_size=100))
    with pytest.raises(MissingInputError, match="not a directory"):
        train_vip(vip_config(syn_repo, tmp_path / "missing", out, seed=0))
    # a (Syn) prior without an MAE decoder (contrastive, distilled) starts a fresh one, warmed
    # up on public images first when asked (the stage says so); a repo's own decoder is never
    # replaced by a warm-up
    no_decoder = make_repo_without_decoder(tmp_path)
    fresh, warmed = (
        train_vip(
            vip_config(
                no_decoder,
                images,
                tmp_path / f"fresh{warmup}",
                seed=0,
                batch_size=8,
                steps=2,
                eval_every=100,
                delta=1 / 80,
                decoder_warmup=warmup,
            )
        )
        for warmup in (0, 2)
    )
    assert (fresh / MAE_DECODER_FILE).is_file()
    stage = PrivacyLedger.read(warmed).stage("dp-pretrain")
    assert stage.hyperparameters["decoder_warmup"] == 2
    assert "first trained 2 steps on public procedural images" in stage.description
    assert PrivacyLedger.read(fresh).stage("dp-pretrain").hyperparameters["decoder_warmup"] == 0
    with pytest.raises(ConfigError, match=f"trains a fresh decoder.*{MAE_DECODER_FILE}"):
        train_vip(
            vip_config(
                syn_repo,
                images,
                tmp_path / "z",
                seed=0,
                batch_size=8,
                delta=1 / 80,
                decoder_warmup=2,
            )
        )
    for bad, message in (
        (["--batch-size", "0"], "--batch-size: Input should be greater than 0"),
        (["--dataset-name", "images"], "--dataset-name: String should match pattern"),  # org/name
    ):
        capsys.readouterr()
        assert main([*dp_command(syn_repo, images, tmp_path / "y")[1:], *bad]) == 1  # the last wins
        err = capsys.readouterr().err  # one line naming the setting, as `vip-hub train-vip` prints
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(DataError, match="no images"):
        (tmp_path / "empty").mkdir()
        train_vip(vip_config(syn_repo, tmp_path / "empty", out, seed=0))


def test_resume_with_other_settings_is_one_line_naming_restart(
    syn_repo: Path, tmp_path: Path
) -> None:
    run_dir = syn_repo.with_name(syn_repo.name + ".run")
    shutil.copytree(run_dir, tmp_path / run_dir.name)  # its checkpoint, written with --steps 4
    args = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY_SYN, "steps": 5}.items()]
    r = subprocess.run(
        [str(BIN / "vip-hub"), "train-syn", "--out", str(tmp_path / syn_repo.name), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "other settings (steps)" in r.stderr and "pass --restart" in r.stderr


def test_a_run_resumed_from_another_init_is_refused(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    """A re-run resumes from the run folder's checkpoint; with ``--init`` now holding another
    repo its export stated that repo's stages for weights grown from the first (a Logit-DP
    init replaced by its (Syn) prior dropped a DP stage from the guarantee). The init's ledger
    is a setting of the run: refused by name."""
    init, out = tmp_path / "init", tmp_path / "dp"
    shutil.copytree(syn_repo, init)
    first = train_vip(vip_config(init, images, out, batch_size=8, steps=2, seed=0))
    shutil.rmtree(init)
    shutil.copytree(first, init)  # the init folder now holds another repo (a DP-trained one)
    shutil.rmtree(out)
    with pytest.raises(
        CheckpointError, match=rf"other settings \({training.dp.run.INIT_LEDGER}\).*--restart"
    ):
        train_vip(vip_config(init, images, out, batch_size=8, steps=2, seed=0))


def test_a_recipe_that_did_not_record_its_init_exports_nothing(
    syn_repo: Path, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal above rests on every recipe recording its ``--init`` (``DPRun.from_init``):
    one that skips it would resume from another init unnoticed, so its export is refused."""
    monkeypatch.setattr(training.dp.run.DPRun, "from_init", lambda self, init: None)
    out = tmp_path / "dp"
    with pytest.raises(RuntimeError, match="an init it did not record"):
        train_vip(vip_config(syn_repo, images, out, batch_size=8, steps=2, seed=0))
    assert not (out / WEIGHTS_FILE).exists()


@pytest.mark.parametrize(
    ("budget", "refusal"),
    [
        (dict(sigma=0.01, epsilon=None), "beyond what the PRV accountant can compute"),
        (dict(epsilon=1e300), "beyond what the PRV accountant can compute"),
        (dict(audit_delta=1e-30), "delta 1e-30 is too small for the PRV accountant"),
    ],
    ids=["sigma", "epsilon", "audit delta"],
)
def test_a_budget_whose_ledger_cannot_be_computed_is_refused_before_training(
    syn_repo: Path, images: Path, tmp_path: Path, budget: dict[str, Any], refusal: str
) -> None:
    """``--sigma 0.01`` (or ``--epsilon 1e300``, calibrated to the smallest sigma) spends an
    epsilon beyond what the ledger's PRV reference can compute, and the audit states every
    accountant's epsilon at ``--audit-delta``, which PRV cannot resolve at 1e-30: the run
    trained every step, checkpointed, then failed at its export. It is refused before the run
    folder is made."""
    out = tmp_path / "dp"
    with pytest.raises(AccountingError, match=refusal):
        train_vip(vip_config(syn_repo, images, out, batch_size=8, steps=2, seed=0, **budget))
    assert not out.with_name("dp.run").exists()


def test_a_run_checkpointed_by_the_ziggurat_sampler_is_refused_then_restarts(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    """Issue 52: a DP run whose checkpoint was written before the noise moved to Philox on the
    device (its engine state names no sampler) is refused with a message naming --restart,
    before any step; with --restart it trains afresh and exports a repo that verifies."""
    settings = dict(epsilon=8.0, batch_size=8, steps=2, checkpoint_every=1, seed=0)
    out = train_vip(vip_config(syn_repo, images, tmp_path / "dp", **settings))
    path = tmp_path / "dp.run" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    del state["engine"]["noise_sampler"]  # as the ziggurat's checkpoints were written
    save_checkpoint(path, {k: v for k, v in state.items() if k != "format"})
    with pytest.raises(CheckpointError, match="numpy float64 ziggurat.*pass --restart"):
        train_vip(vip_config(syn_repo, images, tmp_path / "dp", **settings))
    out = train_vip(vip_config(syn_repo, images, tmp_path / "dp", restart=True, **settings))
    assert verify_repo(out).ok
    assert torch.load(path, weights_only=True)["engine"]["noise_sampler"] == NOISE_SAMPLER


def test_training_errors_join_the_library_tree() -> None:
    """The CLI prints a VipHubError as one line: a model the clipper cannot train, a failed main-job
    step."""
    assert issubclass(UnsupportedLayerError, ConfigError) and issubclass(StepFailed, VipHubError)


def test_tar_shards_read_like_an_image_folder(images: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    files = sorted(images.rglob("*.png"))
    for s in range(2):
        with tarfile.open(shards / f"{s:05d}.tar", "w") as tar:
            for i, f in enumerate(files[s::2]):
                tar.add(f, arcname=f"{s:05d}{i:04d}.png")
                caption = tmp_path / "caption.txt"
                caption.write_text("a caption, ignored")
                tar.add(caption, arcname=f"{s:05d}{i:04d}.txt")
    data = open_images(shards)
    assert isinstance(data, TarShards) and len(data) == len(files)
    assert data.load(0).size == Image.open(files[0]).size
    (shards / "bad").mkdir()
    with tarfile.open(shards / "00009.tar", "w") as tar:
        bad = tmp_path / "bad.jpg"
        bad.write_bytes(b"not an image")
        tar.add(bad, arcname="bad.jpg")
    with pytest.raises(ValueError, match="cannot decode image 00009.tar"):
        open_images(shards).load(len(files))


# ---------------------------------------------------------------- processes
DP_ARGS = [
    "--device",
    "cpu",
    "--epsilon",
    "8",
    "--batch-size",
    "8",
    "--steps",
    "10",
    "--micro-batch-size",
    "4",
    "--seed",
    "7",
    "--workers",
    "0",
    "--checkpoint-every",
    "2",
    "--eval-every",
    "5",
    "--dataset-name",
    "test/images",
    "--ema-decay",
    "0.8",  # the resumed, the two-process and the reference runs release the iterates' average
]


def dp_command(syn_repo: Path, images: Path, out: Path) -> list[str]:
    return [
        str(BIN / "vip-hub"),
        "train-vip",
        "--init",
        str(syn_repo),
        "--data",
        str(images),
        "--out",
        str(out),
        *DP_ARGS,
    ]


@pytest.fixture(scope="module")
def reference_run(syn_repo: Path, images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "vip-nano-dp"
    subprocess.run(dp_command(syn_repo, images, out), check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.slow
def test_resume_after_sigkill_ends_with_the_same_ledger_and_weights(
    syn_repo: Path, images: Path, reference_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "vip-nano-dp"
    log = kill_mid_run(dp_command(syn_repo, images, out), out, step=5)
    resumed = subprocess.run(
        dp_command(syn_repo, images, out), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert run_stages(PrivacyLedger.read(out)) == run_stages(PrivacyLedger.read(reference_run))
    assert (
        PrivacyLedger.read(out).stages[-1].run_id
        != PrivacyLedger.read(reference_run).stages[-1].run_id
    )
    a, b = load_file(out / WEIGHTS_FILE), load_file(reference_run / WEIGHTS_FILE)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(11))  # the log was cut back to the checkpoint, then continued


@pytest.mark.slow
def test_an_averaging_run_releases_the_average_and_records_its_decay(reference_run: Path) -> None:
    """``--ema-decay``: the exported encoder is the average the last checkpoint holds, not the
    last iterate; the stage records the decay, the log the average's public loss."""
    state = torch.load(
        reference_run.with_name(reference_run.name + ".run") / "checkpoint.pt", weights_only=True
    )
    average, iterate = state["engine"]["average"], state["model"]
    released = load_file(reference_run / WEIGHTS_FILE)
    moved = [k for k in released if not torch.equal(released[k], iterate[f"encoder.{k}"])]
    assert moved  # the released tensors that are not the last iterate are the average's
    assert all(any(torch.equal(released[k], a) for a in average) for k in moved)
    assert PrivacyLedger.read(reference_run).stages[-1].hyperparameters["ema_decay"] == 0.8
    log = reference_run.with_name(reference_run.name + ".run") / "log.jsonl"
    assert "public_loss_average" in json.loads(log.read_text().splitlines()[-1])


LAYOUTS = ["one node", "two nodes"]


def torchrun(args: list[str], layout: str) -> tuple[int, str]:
    """Run ``torchrun ... args`` as two processes on one node, or as two nodes of one process
    each that meet through c10d's rendezvous on 127.0.0.1 (as two machines would, with
    ``--local-addr`` for what each node tells the other); the exit status and the stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if layout == "one node":
        launches = [["--standalone", "--nproc_per_node", "2"]]
    else:
        rendezvous = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id={os.getpid()}-{time.monotonic_ns()}",
            "--local-addr=127.0.0.1",
        ]
        launches = [rendezvous, rendezvous]
    procs = [
        subprocess.Popen(
            [str(BIN / "torchrun"), *launch, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for launch in launches
    ]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return max(p.returncode for p in procs), "\n".join(e[-3000:] for e in errors)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_give_the_same_ledger_noise_and_weights(
    syn_repo: Path, images: Path, reference_run: Path, tmp_path: Path, layout: str
) -> None:
    out = tmp_path / "vip-nano-dp"
    args = ["-m", "training.recipes.vip", "--init", str(syn_repo), "--data", str(images)]
    code, stderr = torchrun([*args, "--out", str(out), *DP_ARGS], layout)
    assert code == 0, stderr
    assert verify_repo(out).ok
    assert run_stages(PrivacyLedger.read(out)) == run_stages(PrivacyLedger.read(reference_run))
    assert PrivacyLedger.read(out).guarantees == PrivacyLedger.read(reference_run).guarantees
    a, b = load_file(out / WEIGHTS_FILE), load_file(reference_run / WEIGHTS_FILE)
    for k in a:  # the same samples and noise; only the all-reduce's order of sums differs
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_two_ranks_add_the_noise_once_and_agree_on_the_sample_and_the_audit(
    tmp_path: Path,
) -> None:
    """One DP-engine step (``dist_noise_probe.py``) in one process and on two nodes of one rank
    each (the layout with a rendezvous; the engine's code is the same in both): the update's
    noise is sigma C / B once, not once per rank, and the ranks agree with the single process."""
    probe = ROOT / "tests" / "support" / "dist_noise_probe.py"
    single = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "one.json")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert single.returncode == 0, single.stderr
    code, stderr = torchrun([str(probe), str(tmp_path / "two.json")], "two nodes")
    assert code == 0, stderr
    one, both = (
        json.loads((tmp_path / "one.json").read_text()),
        json.loads((tmp_path / "two.json").read_text()),
    )
    assert both["world"] == 2 and one["world"] == 1
    expected = one["sigma"] * one["clip"] / one["batch"]
    assert one["std"] == pytest.approx(expected, rel=0.01)
    assert both["std"] == pytest.approx(one["std"], rel=1e-6)  # once, not once per rank
    assert both["ranks_agree"] and both["mean_signal"] == pytest.approx(
        one["mean_signal"], rel=1e-6
    )
    assert both["sampled"] == one["sampled"] == 40
    assert both["canary_scores"] == one["canary_scores"]  # the audit does not depend on the ranks


@pytest.mark.parametrize("broken", BROKEN)
def test_the_audit_catches_a_broken_engine(
    broken: str,
    syn_repo: Path,
    images: Path,
    hub,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staged = break_engine(monkeypatch, broken, training.dp.run, "PerExampleClipper")
    out = train_vip(
        vip_config(
            syn_repo,
            images,
            tmp_path / "vip-broken",
            batch_size=20,
            micro_batch_size=10,
            seed=0,
            **SETTINGS,
        )
    )
    assert_refused(out, hub, "vip-" + broken.replace(" ", "-"), staged)


def _flagged_first(
    monkeypatch: pytest.MonkeyPatch, flagged: int, seeds: list[str]
) -> Callable[..., Path]:
    """``train_vip`` with the engine's noise zeroed on its first ``flagged`` calls (the audit
    flags such a run at ``SETTINGS``' claim); each call's seed (its run folder's secret, or the
    one given) is appended to ``seeds``."""
    real = training.dp.engine.add_gaussian_noise

    def train(cfg: VipConfig, *dist: Any) -> Path:
        leaky = len(seeds) < flagged
        monkeypatch.setattr(
            training.dp.engine,
            "add_gaussian_noise",
            (lambda flat, std, seed, step: None) if leaky else real,
        )
        try:
            return train_vip(cfg, *dist)
        finally:
            secret = run_folder(Path(cfg.out)) / "seed"
            seeds.append(secret.read_text() if secret.exists() else str(cfg.seed))

    return train


@pytest.mark.parametrize("via", ["retrained_if_flagged", "vip-hub train-vip"])
def test_a_flagged_run_is_trained_again_from_a_fresh_secret(
    via: str,
    syn_repo: Path,
    images: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run its audit flags is trained again from a fresh secret (a new seed and run id, the
    flagged run's folder gone), and that run's release verifies: through
    ``retrained_if_flagged``, and through ``vip-hub train-vip`` in one process (exit 0)."""
    from training.recipes import vip
    from training.skeleton.config import Recipe
    from vip_hub.cli.main import main

    seeds: list[str] = []
    train = _flagged_first(monkeypatch, 1, seeds)
    settings = {**SETTINGS, "batch_size": 20, "micro_batch_size": 10}
    out = tmp_path / "vip-dp"
    if via == "retrained_if_flagged":
        out = retrained_if_flagged(train, vip_config(syn_repo, images, out, **settings))
    else:
        monkeypatch.setattr(vip, "RECIPE", Recipe(VipConfig, train))
        args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if v is not None]
        paths = [f"--init={syn_repo}", f"--data={images}", f"--out={out}"]
        assert main(["train-vip", *paths, "--dataset-name=test/images", "--workers=0", *args]) == 0
    assert len(seeds) == 2 and seeds[0] != seeds[1]
    assert "flagged the run" in capsys.readouterr().err
    assert verify_repo(out).ok
    run = run_folder(out)
    assert (run / "seed").read_text() == seeds[1]
    assert PrivacyLedger.read(out).dp_stages()[-1].run_id == (run / "run_id").read_text()


@pytest.mark.parametrize("seed", [None, 0])
def test_a_second_flag_or_a_fixed_seeds_flag_is_raised(
    seed: int | None,
    syn_repo: Path,
    images: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run flagged again from a fresh secret is refused, naming a broken engine; a run whose
    seed is fixed would repeat, so its first flag is refused. Nothing is released either way."""
    seeds: list[str] = []
    cfg = vip_config(
        syn_repo,
        images,
        tmp_path / "vip-dp",
        batch_size=20,
        micro_batch_size=10,
        seed=seed,
        **SETTINGS,
    )
    with pytest.raises(AuditError, match="exceeds the accounted epsilon") as e:
        retrained_if_flagged(_flagged_first(monkeypatch, 2, seeds), cfg)
    assert ("the DP engine is broken" in str(e.value)) is (seed is None)
    assert seeds == [str(seed)] if seed is not None else len(set(seeds)) == 2
    assert not (tmp_path / "vip-dp").exists()


def test_a_checkpoint_from_before_a_setting_existed_resumes_at_its_default(
    tmp_path: Path,
) -> None:
    """A checkpoint written before a run setting was added (here ``ema_decay`` and
    ``decoder_warmup``) resumes when the run keeps that setting's default, what runs did then,
    and is refused, naming it, when the run sets another value."""
    from training.skeleton.checkpoint import load_checkpoint, save_checkpoint

    cfg = VipConfig(init="x", data="y", out=str(tmp_path / "repo"), dataset_name="test/images")
    now = cfg.run_settings()
    before = {k: v for k, v in now.items() if k not in ("ema_decay", "decoder_warmup")}
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"config": before, "step": 7})
    defaults = VipConfig.run_defaults()
    assert defaults["ema_decay"] == 0 and defaults["decoder_warmup"] == 0
    assert load_checkpoint(path, now, defaults)["step"] == 7
    with pytest.raises(CheckpointError, match=r"other settings \(ema_decay\)"):
        load_checkpoint(path, {**now, "ema_decay": 0.9}, defaults)
    with pytest.raises(CheckpointError, match=r"other settings \(decoder_warmup, ema_decay\)"):
        load_checkpoint(path, now)  # without the defaults, as before
    # a setting the checkpoint holds is never defaulted over
    save_checkpoint(path, {"config": {**now, "ema_decay": 0.5}, "step": 7})
    with pytest.raises(CheckpointError, match=r"other settings \(ema_decay\)"):
        load_checkpoint(path, now, defaults)


def test_a_checkpoint_that_is_not_one_is_refused_naming_the_file_and_what_is_missing(
    tmp_path: Path,
) -> None:
    """A file holding a list or a bare tensor, a checkpoint of another format, or one without an
    entry the run loads (a model, the step), is a CheckpointError naming the file, not an
    AttributeError or KeyError."""
    from training.skeleton.checkpoint import load_checkpoint
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    path = tmp_path / "checkpoint.pt"
    for content in ([1, 2], torch.zeros(2)):
        torch.save(content, path)
        with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoint.pt holds a"):
            load_checkpoint(path, {})
    for format_ in (None, 0, 2):  # a checkpoint of another (or no) format, its entries the same
        torch.save({"format": format_, "config": {}, "step": 4}, path)
        with pytest.raises(CheckpointError, match=f"has format {format_!r}, expected 1"):
            load_checkpoint(path, {})
    run = Run(RunConfig(out=str(tmp_path / "repo"), seed=3), Dist())
    model = torch.nn.Linear(2, 2)
    save_checkpoint(run.checkpoint_path, {"config": run.settings})
    with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoint.pt has no model, step"):
        run.resume({"model": model})
    save_checkpoint(run.checkpoint_path, {"config": run.settings, "model": model.state_dict()})
    with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoint.pt has no step"):
        run.resume({"model": model})
    save_checkpoint(
        run.checkpoint_path, {"config": run.settings, "model": model.state_dict(), "step": 4}
    )
    assert run.resume({"model": model}) == 4


def test_a_run_folder_another_process_runs_is_refused(tmp_path: Path) -> None:
    """Two processes on one run folder would interleave their checkpoints, and one started with
    --restart would replace the seed and the run id under the other (two runs' releases then
    share a run id, so compose as one): while a process runs the folder, another is refused,
    --restart deleting nothing; once it ends, the folder is free again."""
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    out = tmp_path / "repo"
    hold = (
        "import sys; from training.skeleton.config import RunConfig; "
        "from training.skeleton.distributed import Dist; from training.skeleton.run import Run; "
        "run = Run(RunConfig(out=sys.argv[1], seed=None), Dist()); print('ready', flush=True); "
        "sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        seed = (tmp_path / "repo.run" / "seed").read_text()
        for restart in (False, True):
            with pytest.raises(ConfigError, match="another process is running the run folder"):
                Run(RunConfig(out=str(out), seed=None, restart=restart), Dist())
        assert (tmp_path / "repo.run" / "seed").read_text() == seed
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    # no checkpoint to resume: a start from step 0, under a new secret
    assert Run(RunConfig(out=str(out), seed=None), Dist()).seed != int(seed, 16)


def test_a_run_folder_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    """OUT.run/ a symbolic link: the secret seed and the checkpoints would be written wherever it
    points (another run's folder, whose seed the run would then share, or a folder others may
    read), and --restart would fail on it. Refused, naming it; nothing is written there."""
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "repo.run").symlink_to(elsewhere)
    for restart in (False, True):
        with pytest.raises(ConfigError, match=r"repo\.run is a symbolic link"):
            Run(RunConfig(out=str(tmp_path / "repo"), seed=None, restart=restart), Dist())
    assert list(elsewhere.iterdir()) == []


class _Killed(BaseException):
    """A kill (SIGKILL, Ctrl-C) at a chosen point of a run."""


def test_a_restart_killed_while_it_deletes_the_run_folder_leaves_no_secret_for_other_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--restart`` deletes the run folder; killed part way (its settings and checkpoint gone,
    in the order the folder lists them, its secret seed not yet), a run with other settings
    started from step 0 there would key its noise and sampling by the secret the first run drew
    for its own (whose export may be out): two releases sharing their noise, which no ledger
    describes. Such a run draws a new secret."""
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import SETTINGS_FILE, Run

    out = tmp_path / "repo"
    first = Run(RunConfig(out=str(out), seed=None, steps=4), Dist())
    first.loop(0, 0, iter(()), desc="first", objects={})  # writes the settings
    save_checkpoint(first.checkpoint_path, {"config": first.settings, "step": 4})

    def killed_part_way(path: Path, *args: Any, **kwargs: Any) -> None:
        for name in (SETTINGS_FILE, "checkpoint.pt"):
            (Path(path) / name).unlink()
        raise _Killed

    monkeypatch.setattr(shutil, "rmtree", killed_part_way)
    with pytest.raises(_Killed):
        Run(RunConfig(out=str(out), seed=None, steps=4, restart=True), Dist())
    monkeypatch.undo()
    second = Run(RunConfig(out=str(out), seed=None, steps=8), Dist())
    assert second.resume({}) == 0
    assert second.seed != first.seed


def test_a_checkpoint_write_killed_part_way_leaves_no_copy_once_the_run_resumes(
    tmp_path: Path,
) -> None:
    """A checkpoint write killed part way (no ``except`` runs on SIGKILL) leaves its owner-only
    temporary, as large as a checkpoint, beside the last whole one; the next run of the folder,
    which holds its lock, removes it and resumes from the whole checkpoint."""
    from training.skeleton.config import RunConfig
    from training.skeleton.distributed import Dist
    from training.skeleton.run import Run

    out = tmp_path / "repo"
    first = Run(RunConfig(out=str(out), seed=3, steps=4), Dist())
    first.loop(0, 0, iter(()), desc="first", objects={})
    save_checkpoint(first.checkpoint_path, {"config": first.settings, "step": 2})

    killed = subprocess.run(  # a write's bytes on disk, then SIGKILL before its rename
        [
            sys.executable,
            "-c",
            "import os, signal, sys; from pathlib import Path; "
            "from vip_hub.paths import private_writer\n"
            "with private_writer(Path(sys.argv[1])) as f:\n"
            "    f.write(b'x' * 4096); f.flush(); os.kill(os.getpid(), signal.SIGKILL)",
            str(first.checkpoint_path),
        ],
        check=False,
    )
    assert killed.returncode == -9
    assert [p.name for p in first.dir.iterdir() if p.name.startswith(".checkpoint.pt.tmp-")]
    second = Run(RunConfig(out=str(out), seed=3, steps=4), Dist())
    assert not [p.name for p in second.dir.iterdir() if ".tmp-" in p.name]
    assert second.resume({}) == 2


def test_a_fresh_start_in_a_run_folder_that_exported_neither_reuses_its_secret_nor_its_run_id(
    syn_repo: Path, images: Path, tmp_path: Path
) -> None:
    """A run folder whose checkpoint is gone (deleted after the export, unreadable) starts over
    from step 0: with another learning rate (no part of the stage's identity) the second release
    reused the first one's noise and sampling, and its run id, so ``compose_releases`` counted
    the two releases once; with the same settings (the data not among them) it reused the
    secret under a new run id, so two releases with one noise (on data that may have changed)
    composed as independent. Now every fresh start draws a new secret and a new run id; other
    settings are refused as a checkpoint's are."""
    from vip_hub.privacy.ledger import compose_releases

    out, run = tmp_path / "dp", tmp_path / "dp.run"
    settings: dict[str, Any] = dict(batch_size=8, steps=2, eval_every=100, delta=1 / 80)
    first = PrivacyLedger.read(train_vip(vip_config(syn_repo, images, out, **settings)))
    secret = (run / "seed").read_text()
    (run / "checkpoint.pt").unlink()
    with pytest.raises(CheckpointError, match=r"other settings \(lr\).*--restart"):
        train_vip(vip_config(syn_repo, images, out, lr=2e-3, **settings))
    again = PrivacyLedger.read(train_vip(vip_config(syn_repo, images, out, **settings)))
    assert (run / "seed").read_text() != secret
    assert again.stages[-1].run_id != first.stages[-1].run_id
    (run / "checkpoint.pt").unlink()
    settings["seed"] = 1  # its own seed: the folder's secret unused, the settings alike
    train_vip(vip_config(syn_repo, images, out, restart=True, **settings))
    (run / "checkpoint.pt").unlink()
    ours = PrivacyLedger.read(out).stages[-1]
    second = PrivacyLedger.read(
        train_vip(vip_config(syn_repo, images, out, **{**settings, "seed": 2}))
    )
    assert second.stages[-1].run_id != ours.run_id
    one = compose_releases([first.stages[-1]], 1 / 80)
    assert compose_releases([ours, second.stages[-1]], 1 / 80) != one
