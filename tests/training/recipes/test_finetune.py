"""DP fine-tuning (train-finetune): the clipped sum over the fine-tuned parameters is each example's
own clipped gradient summed (with augmentation multiplicity: the mean over the example's views,
clipped once, never per view), the update's noise is sigma C / B on exactly those parameters, the
frozen blocks never change, the noise and sampling come from a secret drawn per run, and the
exported repo (encoder + head, one DP stage covering both, after a DP probe whose stage composes
with it within the total epsilon) verifies, composes and classifies through the hub; small runs
through the CLI on a generated subsample."""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.clipping import empty_step_update
from support.helpers import assert_biases_only_trained, tiny_syn
from support.live import WRITE_TOKEN

from training.data.labelled import LabelledArrays, write_image_folder
from training.dp.clipping import PerExampleClipper, clip_factors
from training.dp.run import INIT_LEDGER
from training.recipes.finetune import (
    EncoderClassifier,
    FinetuneConfig,
    augment_views,
    classifier,
    train_finetune,
)
from vip_hub.cli.main import main
from vip_hub.errors import CheckpointError, ConfigError, DataError
from vip_hub.loading import load_encoder
from vip_hub.models.features import extract_features
from vip_hub.privacy.accounting import composed_epsilon, epsilon
from vip_hub.privacy.ledger import (
    NOISED_CANARIES,
    Dataset,
    DPStage,
    NonPrivateStage,
    PrivacyLedger,
)
from vip_hub.privacy.sensitivity import (
    FP64_CAPPED,
    ROUNDING_SUM,
    ROUNDING_TERMS,
    rounding_allowance,
)
from vip_hub.repo.heads import HeadInfo, LinearProbe, load_head, save_head
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import CARD_FILE, ENCODER, WEIGHTS_FILE, head_component, head_file

BIN = Path(sys.executable).parent
CLASSES = ("circle", "square", "stripe")
RUN_ARGS = dict(
    steps=3,
    batch_size=8,
    sigma=1.0,
    workers=0,
    device="cpu",
    audit_canaries=64,
    dataset_name="test/shapes",
    head="clf",
    trainable_blocks=2,
)
DEPTH, TRAINED = 12, 2  # vip-nano's blocks, and the top ones fine-tuned
SPATIAL = "spatial-b4-g2"  # a mode the (Syn) repo declares: block 4 on a 2 x 2 grid
WHOLE_ARGS = dict(
    trainable_blocks="all",
    pooling=SPATIAL,
    augmult=2,
    epsilon=3.0,
    sigma=None,
    probe_epsilon=1.0,
    probe_epochs=2,
)
"""The whole encoder after a DP probe: (3, 1e-5) in all, the probe's epsilon 1 alone."""
READ = ("patch_embed.", "cls_token", *(f"blocks.{i}." for i in range(4)))
"""What of the encoder SPATIAL reads: the patch embedding, the class token, blocks 1-4."""


@pytest.fixture(scope="module")
def syn_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_syn(tmp_path_factory.mktemp("syn") / "vip-nano-syn")


def shapes(n: int, seed: int) -> LabelledArrays:
    """n generated 28 x 28 grey images whose class sets their mean brightness, in 3 classes."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(CLASSES)
    images = rng.integers(0, 80, (n, 28, 28)) + 80 * labels[:, None, None]
    return LabelledArrays(
        images.astype(np.uint8), labels, CLASSES, Dataset(name="test/shapes", size=n)
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A private train folder (the first 24 of 60 generated records) and a public test folder."""
    root = tmp_path_factory.mktemp("shapes")
    train = write_image_folder(shapes(60, 0).first(24), root / "train", CLASSES)
    return train, write_image_folder(shapes(12, 1), root / "test", CLASSES)


def finetune(syn_repo: Path, data: tuple[Path, Path], out: Path, **settings: object) -> Path:
    cfg = FinetuneConfig(
        init=str(syn_repo),
        data=str(data[0]),
        test_data=str(data[1]),
        out=str(out),
        **{**RUN_ARGS, **settings},
    )
    return train_finetune(cfg)


@pytest.fixture(scope="module")
def finetuned(
    syn_repo: Path, data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """Two runs with the same settings and no --seed (each draws its secret)."""
    base = tmp_path_factory.mktemp("finetuned")
    return tuple(finetune(syn_repo, data, base / f"run{i}") for i in range(2))  # type: ignore[return-value]


# ---------------------------------------------------------------- the mechanism on this model
@pytest.mark.parametrize("pooling", ["avg", "vip"])
def test_the_clipped_sum_is_each_examples_own_clipped_gradient_over_the_fine_tuned_parameters(
    syn_repo: Path, pooling: str
) -> None:
    torch.manual_seed(0)
    model = classifier(load_encoder(syn_repo), len(CLASSES), pooling, TRAINED).double()  # type: ignore[arg-type]
    enc = model.encoder
    trained = [*enc.blocks[DEPTH - TRAINED :], model.head.linear]
    trained += [enc.fc_norm] if pooling == "avg" else []  # vip features skip the final norm
    params = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in params} == {id(p) for m in trained for p in m.parameters()}

    images = torch.randn(
        6, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    x = (*model.frozen(images), torch.tensor([0, 1, 2, 0, 1, 2]))
    own = [
        torch.cat([g.flatten() for g in torch.autograd.grad(model(*_one(x, i)).sum(), params)])
        for i in range(6)
    ]
    norms = torch.stack([g.norm() for g in own])
    clip = float(norms.median())  # some examples clipped, some not
    expected = sum(g * c for g, c in zip(own, clip_factors(norms, clip), strict=True))

    clipper = PerExampleClipper(model, clip)
    result = clipper.accumulate(*x)
    got = clipper.take_sum()
    torch.testing.assert_close(result.norms.double(), norms, rtol=1e-6, atol=0)
    # the factors carry the proof's margin 2^-30 (9.3e-10 relative)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected.double(), rtol=1e-6, atol=1e-8 * scale)

    # every example clipped: removing any one moves the sum by at most C, and by almost C
    tiny = float(norms.min()) / 10
    full = _clipped(model, tiny, x)
    moved = max(
        float((full - _clipped(model, tiny, tuple(t[keep] for t in x))).norm())
        for keep in ([j for j in range(6) if j != i] for i in range(6))
    )
    assert 0.99 * tiny < moved <= tiny


@pytest.mark.parametrize("pooling", [SPATIAL])
def test_augmentation_multiplicity_clips_each_examples_mean_over_its_views_once(
    syn_repo: Path, pooling: str
) -> None:
    """K views per example: the clipped sum is that of each example's one gradient, the mean over
    its views (what the loss averages), clipped once; clipping each view would give another sum,
    and removing an example still moves the sum by at most C."""
    torch.manual_seed(0)
    model = classifier(load_encoder(syn_repo), len(CLASSES), pooling, "all").double()
    enc = model.encoder
    assert isinstance(model, EncoderClassifier)
    read = 4 if pooling == SPATIAL else DEPTH
    trained = [enc.patch_embed, *enc.blocks[:read], model.head.linear]
    trained += [enc.fc_norm] if pooling == "avg" else []
    params = [p for p in model.parameters() if p.requires_grad]
    expected_params = {id(enc.cls_token)} | {id(p) for m in trained for p in m.parameters()}
    assert {id(p) for p in params} == expected_params

    g = torch.Generator().manual_seed(1)
    views = torch.randn(6, 3, 3, 32, 32, dtype=torch.float64, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    x = (views, labels)
    own = [
        torch.cat([g.flatten() for g in torch.autograd.grad(model(*_one(x, i)).sum(), params)])
        for i in range(6)
    ]
    norms = torch.stack([g.norm() for g in own])
    clip = float(norms.median())
    expected = sum(g * c for g, c in zip(own, clip_factors(norms, clip), strict=True))
    got = _clipped(model, clip, x)  # (the factors' margin 2^-30: 9.3e-10 relative)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8 * float(expected.abs().max()))

    # per view: each view's share of the loss (1/K of its cross-entropy) clipped on its own
    per_view = []
    for i in range(6):
        for k in range(3):
            one = (views[i : i + 1, k : k + 1], labels[i : i + 1])
            grads = torch.autograd.grad(model(*one).sum() / 3, params)
            per_view.append(torch.cat([g.flatten() for g in grads]))
    view_norms = torch.stack([g.norm() for g in per_view])
    wrong = sum(g * c for g, c in zip(per_view, clip_factors(view_norms, clip), strict=True))
    assert float((wrong - expected).norm()) > 0.05 * clip

    tiny = float(norms.min()) / 10
    full = _clipped(model, tiny, x)
    moved = max(
        float((full - _clipped(model, tiny, tuple(t[keep] for t in x))).norm())
        for keep in ([j for j in range(6) if j != i] for i in range(6))
    )
    assert 0.99 * tiny < moved <= tiny


def test_views_are_shifted_and_flipped_copies_drawn_from_the_stream() -> None:
    image = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0))
    views = augment_views(image, 8, torch.Generator().manual_seed(5))
    assert views.shape == (8, 3, 32, 32)
    again = augment_views(image, 8, torch.Generator().manual_seed(5))
    assert torch.equal(views, again)
    assert not all(torch.equal(views[0], v) for v in views[1:])
    inner = image[:, 4:28, 4:28]  # every view holds the image's centre, shifted by <= 4 pixels
    for v in views:
        found = any(
            torch.equal(w[:, 4 + dy : 28 + dy, 4 + dx : 28 + dx], inner)
            for w in (v, v.flip(-1))
            for dy in range(-4, 5)
            for dx in range(-4, 5)
        )
        assert found
    assert torch.equal(augment_views(image, 0, torch.Generator()), image[None])


def _one(x: tuple[torch.Tensor, ...], i: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[i : i + 1] for t in x)


def _clipped(model: torch.nn.Module, clip: float, x: tuple[torch.Tensor, ...]) -> torch.Tensor:
    clipper = PerExampleClipper(model, clip)
    clipper.accumulate(*x)
    return clipper.take_sum()


@pytest.mark.parametrize(("pooling", "trained"), [("avg", 1), ("cls", 2), ("vip", 2), ("vip", 7)])
def test_training_on_the_frozen_blocks_outputs_computes_what_the_service_does(
    syn_repo: Path, pooling: str, trained: int
) -> None:
    """The top blocks run on the frozen blocks' outputs, computed once, give the scores of the
    whole encoder's feature mode and the head: what /v1/classify computes."""
    model = classifier(load_encoder(syn_repo), len(CLASSES), pooling, trained).eval()  # type: ignore[arg-type]
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        served = model.head(extract_features(model.encoder, images, pooling))  # type: ignore[arg-type]
        torch.testing.assert_close(model.top(*model.frozen(images)), served, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pooling", [SPATIAL, "vip", "cls"])
def test_the_whole_encoder_model_computes_what_the_service_does(
    syn_repo: Path, pooling: str
) -> None:
    model = classifier(load_encoder(syn_repo), len(CLASSES), pooling, "all").eval()
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        served = model.head(extract_features(model.encoder, images, pooling))  # type: ignore[arg-type]
        torch.testing.assert_close(model.logits(images), served, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("pooling", "blocks", "read"),
    [
        (
            "avg",
            TRAINED,
            tuple(f"blocks.{i}." for i in range(DEPTH - TRAINED, DEPTH)) + ("fc_norm.",),
        ),
        (SPATIAL, "all", READ),
    ],
)
def test_biases_alone_leave_the_encoders_matrices_and_class_token_frozen_and_the_head_whole(
    syn_repo: Path, pooling: str, blocks: int | str, read: tuple[str, ...]
) -> None:
    model = classifier(
        load_encoder(syn_repo),
        len(CLASSES),
        pooling,
        blocks,  # type: ignore[arg-type]
        parameters="biases",
    )
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    encoder = {
        f"encoder.{name}"
        for name, p in model.encoder.named_parameters()
        if p.ndim == 1 and name.startswith(read)
    }
    assert encoder and trained == encoder | {"head.linear.weight", "head.linear.bias"}


@pytest.mark.parametrize(("pooling", "trained"), [("avg", TRAINED), (SPATIAL, "all")])
def test_the_update_noise_is_sigma_c_over_b_on_the_fine_tuned_parameters_only(
    syn_repo: Path, pooling: str, trained: int | str
) -> None:
    model = classifier(load_encoder(syn_repo), len(CLASSES), pooling, trained)  # type: ignore[arg-type]
    clip, sigma, batch = 0.1, 1.3, 32
    clipper = PerExampleClipper(model, clip)
    _, update = empty_step_update(
        clipper, clip=clip, sensitivity=clip, sigma=sigma, batch=batch, micro_batch_size=8
    )
    assert update.numel() == sum(p.numel() for p in clipper.params) > 100_000
    assert update.std().item() == pytest.approx(sigma * clip / batch, rel=0.01)
    assert abs(update.mean().item()) < 4 * sigma * clip / batch / update.numel() ** 0.5
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


# ---------------------------------------------------------------- end to end
def test_the_export_verifies_and_one_dp_stage_covers_the_encoder_and_the_head(
    finetuned: tuple[Path, Path], data: tuple[Path, Path]
) -> None:
    repo = finetuned[0]
    assert verify_repo(repo).ok
    ledger = PrivacyLedger.read(repo)
    syn, dp = ledger.stages
    assert isinstance(syn, NonPrivateStage) and not syn.private_data
    assert isinstance(dp, DPStage) and dp.trained_components == (ENCODER, head_component("clf"))
    assert dp.dataset.name == "test/shapes" and dp.dataset.size == 24
    # the sample bound (every example), formed by the proved rule
    assert dp.mechanism_params == {ROUNDING_TERMS: 24, ROUNDING_SUM: FP64_CAPPED}
    assert dp.sensitivity == dp.clipping_norm * rounding_allowance(24, FP64_CAPPED)
    assert dp.noise_std == pytest.approx(dp.noise_multiplier * dp.sensitivity)
    assert dp.audit is not None and dp.audit.canaries == 64
    exact = epsilon(1.0, 8 / 24, 3, dp.delta, "rdp")
    for component in (ENCODER, head_component("clf")):
        summary = ledger.summary(component)
        assert [g.stages for g in summary.guarantees] == [["dp-finetune"]]
        assert exact <= summary.epsilon == dp.epsilon <= exact + 1e-6
    head, info = load_head(repo, "clf")
    assert info.labels == sorted(CLASSES) and info.pooling == "avg"
    assert info.metrics["test_data"] == "public" and 0 <= info.metrics["top1"] <= 1
    assert f"{ENCODER} + {head_component('clf')}" in (repo / CARD_FILE).read_text()


def test_frozen_blocks_are_the_init_repos_and_the_top_blocks_moved(
    syn_repo: Path, finetuned: tuple[Path, Path]
) -> None:
    before, after = (
        load_file(syn_repo / WEIGHTS_FILE),
        load_file(finetuned[0] / WEIGHTS_FILE),
    )
    assert before.keys() == after.keys()
    top = tuple(f"blocks.{i}." for i in range(DEPTH - TRAINED, DEPTH)) + ("fc_norm.",)
    for key in before:
        moved = not torch.equal(before[key], after[key])
        assert moved == key.startswith(top), key


def test_two_runs_with_the_same_settings_draw_their_own_secret(
    finetuned: tuple[Path, Path],
) -> None:
    first, second = finetuned
    seeds = [(Path(f"{r}.run") / "seed").read_text() for r in finetuned]
    assert seeds[0] != seeds[1]
    w1, w2 = load_file(first / WEIGHTS_FILE), load_file(second / WEIGHTS_FILE)
    assert not torch.equal(w1["blocks.11.mlp.fc1.weight"], w2["blocks.11.mlp.fc1.weight"])
    h1, h2 = load_head(first, "clf")[0], load_head(second, "clf")[0]
    assert not torch.equal(h1.linear.weight, h2.linear.weight)
    for repo, seed in zip(finetuned, seeds, strict=True):
        released = b"".join(p.read_bytes() for p in repo.rglob("*") if p.is_file())
        assert seed.encode() not in released


@pytest.fixture(scope="module")
def whole(
    syn_repo: Path, data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return finetune(syn_repo, data, tmp_path_factory.mktemp("whole") / "run", **WHOLE_ARGS)


def _normalised_publicly(head: LinearProbe, syn_repo: Path) -> bool:
    """Whether ``head``'s BatchNorm holds the statistics of the init encoder's procedural
    features (public: these runs give no --public-data), not of any private record's."""
    from training.recipes.probe import head_statistics

    public = head_statistics(load_encoder(syn_repo), SPATIAL)
    mean, var = head.norm.running_mean, head.norm.running_var
    assert mean is not None and var is not None
    return torch.allclose(mean, public.mean(0), rtol=1e-6, atol=1e-7) and torch.allclose(
        var, public.var(0, unbiased=False), rtol=1e-6
    )


def test_the_probe_and_the_fine_tuning_compose_within_the_total_epsilon(
    syn_repo: Path, whole: Path
) -> None:
    assert verify_repo(whole).ok
    ledger = PrivacyLedger.read(whole)
    syn, probe, dp = ledger.stages
    assert isinstance(syn, NonPrivateStage) and not syn.private_data
    assert isinstance(probe, DPStage) and probe.name == "linear-probe-dp:clf"
    # the probe trains the encoder's component too: the fine-tuning starts from it
    assert probe.trained_components == (ENCODER, head_component("clf"))
    assert probe.epsilon == pytest.approx(1.0, abs=0.01)
    assert isinstance(dp, DPStage) and dp.trained_components == (ENCODER, head_component("clf"))
    assert dp.hyperparameters["augmult"] == 2 and dp.hyperparameters["trainable_blocks"] == "all"
    runs = [probe.mechanism_tuple, dp.mechanism_tuple]
    both = composed_epsilon(runs, dp.delta, "rdp")
    assert 2.9 < both <= 3.0  # the fine-tuning took what the probe left
    for component in (ENCODER, head_component("clf")):
        summary = ledger.summary(component)
        assert [g.stages for g in summary.guarantees] == [["linear-probe-dp:clf", "dp-finetune"]]
        assert summary.epsilon == pytest.approx(both, abs=1e-6)
    head, info = load_head(whole, "clf")
    assert info.pooling == SPATIAL and 0 <= info.metrics["top1"] <= 1
    assert _normalised_publicly(head, syn_repo)


def test_the_whole_encoder_moved_where_its_feature_mode_reads_and_nowhere_else(
    syn_repo: Path, whole: Path
) -> None:
    before, after = (
        load_file(syn_repo / WEIGHTS_FILE),
        load_file(whole / WEIGHTS_FILE),
    )
    for key in before:
        moved = not torch.equal(before[key], after[key])
        assert moved == key.startswith(READ), key


def test_a_biases_only_fine_tuning_trains_the_vectors_its_feature_mode_reads(
    syn_repo: Path, data: tuple[Path, Path], tmp_path: Path
) -> None:
    out = finetune(syn_repo, data, tmp_path / "run", **WHOLE_ARGS, encoder_parameters="biases")
    assert verify_repo(out).ok
    assert_biases_only_trained(syn_repo, out, "dp-finetune", head_file("clf"), READ)


def test_the_released_labels_are_the_public_test_datas(
    syn_repo: Path, data: tuple[Path, Path], tmp_path: Path
) -> None:
    """A class the private records lack is still a label of the released classifier (its label
    space is --test-data's): which classes the private data holds is not released."""
    train = Path(shutil.copytree(data[0], tmp_path / "train"))
    shutil.rmtree(train / CLASSES[-1])
    out = finetune(syn_repo, (train, data[1]), tmp_path / "run")
    _, info = load_head(out, "clf")
    assert tuple(info.labels) == CLASSES
    without = FinetuneConfig(
        init=str(syn_repo), data=str(train), out=str(tmp_path / "x"), **RUN_ARGS
    )
    with pytest.raises(ConfigError, match=r"--classes.*--test-data"):
        train_finetune(without)  # the labels would be the private folders: refused
    with pytest.raises(ConfigError, match=r"--classes.*--test-data"):
        finetune(syn_repo, (train, data[1]), tmp_path / "y", classes=list(CLASSES[:2]))


def test_a_probe_kept_for_another_init_is_refused(
    syn_repo: Path, data: tuple[Path, Path], tmp_path: Path
) -> None:
    """The DP probe is kept in the run folder for a resume; stopped before its first checkpoint
    and re-run with ``--init`` holding another repo, the kept probe (fitted on the first
    repo's features) is refused by name, not released beside the other repo's ledger."""
    init, run = tmp_path / "init", tmp_path / "run"
    shutil.copytree(syn_repo, init)
    first = finetune(init, data, run, **WHOLE_ARGS, encoder_parameters="biases")
    (tmp_path / "run.run" / "checkpoint.pt").unlink()  # as if stopped right after its probe
    shutil.rmtree(init)
    shutil.copytree(first, init)
    shutil.rmtree(first)
    kept = rf"probe.pt was written with other settings \({INIT_LEDGER}\)"
    with pytest.raises(CheckpointError, match=kept):
        finetune(init, data, run, **WHOLE_ARGS, encoder_parameters="biases")


def test_a_fixed_head_fine_tuning_releases_the_probes_head_and_noises_the_encoder_alone(
    syn_repo: Path, data: tuple[Path, Path], tmp_path: Path
) -> None:
    """``fixed_head``: the head released is the DP probe's, bit for bit, its BatchNorm fixed to
    public statistics (the init encoder's procedural features: no --public-data); the
    fine-tuning's stage trains the encoder alone (its noise on the encoder's vectors, nothing of
    the head's), the probe's stage names the head, and the repo verifies."""
    out = finetune(
        syn_repo, data, tmp_path / "run", **WHOLE_ARGS, encoder_parameters="biases", fixed_head=True
    )
    assert verify_repo(out).ok
    (saved,) = tmp_path.rglob("probe.pt")
    probe = torch.load(saved, weights_only=True)["head"]
    released = load_file(out / head_file("clf"))
    assert released.keys() >= {"linear.weight", "linear.bias"}
    assert all(torch.equal(released[k], probe[k]) for k in ("linear.weight", "linear.bias"))
    assert _normalised_publicly(load_head(out, "clf")[0], syn_repo)
    ledger = PrivacyLedger.read(out)
    probe_stage, dp = ledger.stages[-2:]
    assert dp.also_trains == [] and dp.trained_components == (ENCODER,)
    assert probe_stage.also_trains == [head_component("clf")]
    assert dp.hyperparameters["fixed_head"] is True
    noised = set(dp.noised_tensors or {}) - {NOISED_CANARIES}
    assert noised and all(k.startswith(f"{WEIGHTS_FILE}:") for k in noised), sorted(noised)
    before, after = load_file(syn_repo / WEIGHTS_FILE), load_file(out / WEIGHTS_FILE)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert "fixed (--fixed-head)" in dp.description


def test_bad_settings_are_named(syn_repo: Path, data: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--trainable-blocks 13"):
        finetune(syn_repo, data, tmp_path / "a", trainable_blocks=13)
    with pytest.raises(ValueError, match="--fixed-head keeps the DP probe's head"):
        finetune(syn_repo, data, tmp_path / "d", fixed_head=True)
    with pytest.raises(ConfigError, match="a fixed head is a DP probe's"):
        classifier(load_encoder(syn_repo), len(CLASSES), "avg", TRAINED, train_head=False)
    with pytest.raises(ConfigError, match="--pooling pixels: the whole-encoder model reads"):
        classifier(load_encoder(syn_repo), len(CLASSES), "pixels", "all")  # reads no weight
    with pytest.raises(ConfigError, match="head name"):
        finetune(syn_repo, data, tmp_path / "b", head="no/slash")
    odd = write_image_folder(shapes(6, 2), tmp_path / "odd", ("a", "b", "c"))
    with pytest.raises(DataError, match=r"class folders \['circle', .* not among the classes"):
        finetune(syn_repo, (data[0], odd), tmp_path / "c")
    with pytest.raises(ConfigError, match=f"trained {head_component('x')} jointly"):
        save_head(syn_repo, LinearProbe(192, 2), HeadInfo("x", "avg", ["a", "b"]), None)


def _train_cli(syn_repo: Path, data: tuple[Path, Path], out: Path, settings: dict) -> None:
    """`vip-hub train-finetune` from ``syn_repo`` on ``data`` into ``out`` with ``settings``
    (None values left out)."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if v is not None]
    subprocess.run(
        [
            BIN / "vip-hub",
            "train-finetune",
            f"--init={syn_repo}",
            f"--data={data[0]}",
            f"--test-data={data[1]}",
            f"--out={out}",
            *args,
        ],
        check=True,
        capture_output=True,
    )


def test_the_cli_whole_encoder_run_verifies_loads_in_timm_and_classifies(
    syn_repo: Path, data: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``vip-hub train-finetune --trainable-blocks all`` on the generated subsample: the repo
    verifies, plain timm loads it, and the head's published top-1 is what the released encoder's
    spatial features and head give (what /v1/classify computes)."""
    import timm

    out = tmp_path / "vip-nano-whole"
    settings = {**RUN_ARGS, **WHOLE_ARGS, "seed": 7, "audit_canaries": 0}
    _train_cli(syn_repo, data, out, settings)
    assert main(["verify", str(out)]) == 0, capsys.readouterr()  # `vip-hub verify`
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    encoder = load_encoder(out)
    for key, value in encoder.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    from PIL import Image

    files = sorted(data[1].rglob("*.png"))
    labels = torch.tensor([sorted(CLASSES).index(p.parent.name) for p in files])
    head, info = load_head(out, "clf")
    with torch.no_grad():
        scores = head(encoder.embed([Image.open(p) for p in files], SPATIAL))
    assert info.metrics["top1"] == pytest.approx(float((scores.argmax(1) == labels).float().mean()))


@pytest.mark.slow
def test_the_cli_run_on_a_generated_subsample_verifies_and_classifies_through_the_hub(
    hub, syn_repo: Path, data: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "vip-nano-ft"
    settings = {**RUN_ARGS, "pooling": "vip", "seed": 7}
    _train_cli(syn_repo, data, out, settings)
    assert main(["verify", str(out)]) == 0, capsys.readouterr()  # `vip-hub verify`
    before, after = load_file(syn_repo / WEIGHTS_FILE), load_file(out / WEIGHTS_FILE)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("fc_norm."))

    push_repo(out, "vip/ft-test", token=WRITE_TOKEN)
    images = sorted(data[1].rglob("*.png"))[:3]
    r = httpx.post(
        f"{hub.url}/v1/classify",
        timeout=60,
        json={
            "model": "vip/ft-test",
            "head": "clf",
            "input": [base64.b64encode(p.read_bytes()).decode() for p in images],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    encoder = load_encoder(out)
    head = load_head(out, "clf")[0]
    from PIL import Image

    local = head(encoder.embed([Image.open(p) for p in images], "vip")).argmax(1)
    assert [row["labels"][0]["label"] for row in body["data"]] == [
        sorted(CLASSES)[i] for i in local
    ]
    stage = PrivacyLedger.read(out).stage("dp-finetune")
    assert (
        body["privacy"]["head"]["epsilon"] == body["privacy"]["encoder"]["epsilon"] == stage.epsilon
    )
