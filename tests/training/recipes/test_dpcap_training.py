"""DP-Cap training: the per-example clipper on the captioner equals naive per-example clipping
(fp32, token embedding trainable); (Syn) dpcap-nano -> train-dpcap -> a verified repo that
captions; caption datasets (tar shards, captions.jsonl) and their errors; a ViP init refused;
resume after SIGKILL; 2-process torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from support.audit_breaks import BROKEN, SETTINGS, assert_refused, break_engine
from support.helpers import (
    TINY,
    assert_biases_only_trained,
    kill_mid_run,
    published_hashes_of,
    run_stages,
    synthetic_stage,
    tiny_encoder,
    tiny_syn,
)

import training.dp.run
from training.data.images import CaptionFolder, TarShards, open_captions
from training.data.labelled import (
    FASHION_MNIST_CLASSES,
    LabelledArrays,
    class_vocabulary,
    write_caption_folder,
    write_caption_texts,
)
from training.dp.clipping import PerExampleClipper
from training.recipes.dpcap import DPCapConfig, train_dpcap
from training.recipes.mae import load_mae
from vip_hub import export_encoder, verify_repo
from vip_hub.errors import ConfigError, DataError, MissingInputError
from vip_hub.loading import load_captioner
from vip_hub.models.encoders import EncoderSpec, create_encoder
from vip_hub.models.text_decoder import Captioner, TextDecoder, TextDecoderConfig
from vip_hub.privacy.audit import DEFAULT_CANARIES
from vip_hub.privacy.ledger import Dataset, PrivacyLedger
from vip_hub.repo_format import (
    CARD_FILE,
    CONFIG_BLOCK,
    CONFIG_FILE,
    CURVES_FILE,
    TEXT_DECODER_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
)

BIN = Path(sys.executable).parent
IMG, PATCH = 16, 8
DP_ARGS = dict(
    steps=6,
    batch_size=6,
    micro_batch_size=4,
    sigma=1.0,
    seed=5,
    workers=0,
    device="cpu",
    decoder_width=32,
    dataset_name="test/digit-captions",
    decoder_depth=1,
    decoder_heads=2,
    max_length=16,  # "this is a photo of a t - shirt / top" and [CLS], [SEP]
    checkpoint_every=2,
    eval_every=3,
)


def dpcap_config(init: Path, pairs: Path, vocab: Path, out: Path, **settings: Any) -> DPCapConfig:
    """A DP-Cap run from ``init`` on ``pairs`` with ``vocab`` into ``out``; ``settings`` its
    own (``DP_ARGS`` for a small run)."""
    return DPCapConfig(init=str(init), data=str(pairs), vocab=str(vocab), out=str(out), **settings)


def cli_args(settings: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


def make_pairs(root: Path, per_class: int = 8, classes: int = 3) -> Path:
    """Small random grey images of the first ``classes`` Fashion-MNIST classes, captioned by the
    data module's public template over the class names (the main job's rule)."""
    labels = np.repeat(np.arange(classes), per_class)
    images = np.random.default_rng(0).integers(0, 255, (len(labels), 8, 8), dtype=np.uint8)
    dataset = Dataset(name="test/captions", size=len(labels))
    data = LabelledArrays(images, labels, FASHION_MNIST_CLASSES, dataset)
    return write_caption_folder(data, root, FASHION_MNIST_CLASSES)


@pytest.fixture(scope="module")
def syn_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_syn(
        tmp_path_factory.mktemp("syn") / "dpcap-nano-syn",
        arch="dpcap-nano",
        img_size=IMG,
        patch_size=PATCH,
    )


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pairs(tmp_path_factory.mktemp("data") / "pairs")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / VOCAB_FILE
    path.write_bytes(class_vocabulary(FASHION_MNIST_CLASSES))
    return path


@pytest.fixture(scope="module")
def trained(
    syn_repo: Path, pairs: Path, vocab: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("dp") / "dpcap-nano-pairs"
    return train_dpcap(dpcap_config(syn_repo, pairs, vocab, out, **DP_ARGS))


# ---------------------------------------------------------------- clipping
def test_clipped_sum_on_the_captioner_equals_the_naive_per_example_computation() -> None:
    """Every trainable parameter (token embedding included; DP-Cap's class token and pos_embed are
    frozen), fp32, 1e-5 relative given the factors: some examples clipped, some not; repeated and
    padded tokens."""
    torch.manual_seed(0)
    spec = EncoderSpec("dpcap-nano", img_size=IMG, patch_size=PATCH)
    decoder = TextDecoder(
        TextDecoderConfig.for_encoder(
            spec,
            width=32,
            depth=1,
            num_heads=2,
            vocab_size=40,
            max_length=8,
            bos_id=1,
            eos_id=2,
            pad_id=0,
        )
    )
    model = Captioner(create_encoder(spec, mae_init=True), decoder)
    x = torch.randn(5, 3, IMG, IMG)
    text = torch.tensor(
        [
            [1, 5, 6, 2, 0, 0],
            [1, 7, 2, 0, 0, 0],
            [1, 9, 9, 9, 9, 2],
            [1, 5, 7, 30, 2, 0],
            [1, 39, 3, 3, 5, 2],
        ]
    )
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert "decoder.token_embed.weight" in params
    assert "encoder.cls_token" not in params and "encoder.pos_embed" not in params
    grads = [
        torch.autograd.grad(model(x[i : i + 1], text[i : i + 1]).sum(), list(params.values()))
        for i in range(5)
    ]
    norms = torch.stack([torch.sqrt(sum(g.double().square().sum() for g in gs)) for gs in grads])
    c = float(norms.median())

    clipper = PerExampleClipper(model, c)
    result = clipper.accumulate(x, text)
    # the norm bounds: at or above each example's norm, within the fp32 Grams' margin
    ratio = result.norms / norms
    assert bool((ratio >= 1 - 1e-5).all() and (ratio <= 1 + 5e-3).all()), ratio
    assert (result.factors < 1).any() and (result.factors == 1).any()
    expected = {  # each example's own gradient times the factor applied
        n: sum(gs[k].double() * f for gs, f in zip(grads, result.factors, strict=True))
        for k, n in enumerate(params)
    }
    by_param = dict(
        zip(map(id, clipper.params), clipper.sum.views(clipper.take_sum()), strict=True)
    )
    got = {n: by_param[id(p)] for n, p in params.items()}
    error = torch.sqrt(sum((got[n] - expected[n]).square().sum() for n in params))
    assert float(error / torch.sqrt(sum(e.square().sum() for e in expected.values()))) < 1e-5
    for n in params:
        assert torch.allclose(
            got[n], expected[n], rtol=1e-3, atol=1e-5 * float(expected[n].abs().max())
        ), n


def test_the_mae_keeps_the_dpcap_layout(syn_repo: Path) -> None:
    """(Syn) pretraining of a DP-Cap encoder: the class token and pos_embed stay frozen, the card
    names the family."""
    mae, loaded = load_mae(syn_repo)
    spec, ledger = loaded.spec, loaded.ledger
    assert spec.family.name == "dpcap" and ledger.stages[0].description.startswith("(Syn)-DP-Cap")
    assert not mae.encoder.cls_token.requires_grad and not mae.encoder.pos_embed.requires_grad
    assert mae.broadcast_parameters() == [mae.mask_token]
    PerExampleClipper(mae, 1.0)  # every trainable parameter has a rule


# ---------------------------------------------------------------- end to end
def test_train_dpcap_exports_a_verified_repo_that_captions(
    trained: Path, syn_repo: Path, pairs: Path, vocab: Path
) -> None:
    assert verify_repo(trained).ok
    ledger = PrivacyLedger.read(trained)
    syn, dp = ledger.stages
    assert (syn.type, syn.name) == ("non-private", "syn-pretrain") and syn == PrivacyLedger.read(
        syn_repo
    ).stages[0]
    assert (dp.type, dp.mechanism, dp.sampling, dp.clipping_norm, dp.steps) == (
        "dp",
        "DP-AdamW",
        "poisson",
        1.0,
        6,
    )
    assert dp.audit is not None and dp.audit.canaries == DEFAULT_CANARIES
    assert dp.dataset.size == 24 and dp.dataset.name == "test/digit-captions"
    assert not published_hashes_of(pairs, trained)  # no plain hash of the private pairs
    assert dp.noise_multiplier == 1.0 and 0 < dp.epsilon <= 8.0

    block = json.loads((trained / CONFIG_FILE).read_text())[CONFIG_BLOCK]
    assert block["family"] == "dpcap" and block["feature_dims"]["dpcap"] == 32
    assert (trained / VOCAB_FILE).read_bytes() == vocab.read_bytes()
    card = (trained / CARD_FILE).read_text()
    assert f"]({CURVES_FILE})" in card and "dp-captioning" in card

    before, after = (
        load_file(syn_repo / WEIGHTS_FILE),
        load_file(trained / WEIGHTS_FILE),
    )
    assert torch.equal(before["cls_token"], after["cls_token"]) and torch.equal(
        before["pos_embed"], after["pos_embed"]
    )
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], after["blocks.0.attn.qkv.weight"])

    log = [
        json.loads(line)
        for line in (trained.parent / f"{trained.name}.run" / "log.jsonl").read_text().splitlines()
    ]
    curve = [r["step"] for r in log if "public_loss" in r]
    assert curve == [0, 3, 6] and all(
        np.isfinite(r["public_loss"]) for r in log if "public_loss" in r
    )

    model = load_captioner(trained)
    images = [Image.open(p) for p in sorted(pairs.glob("*/*.png"))[:2]]
    captions = model.caption(images, max_tokens=6)
    assert len(captions) == 2 and all(isinstance(c, str) for c in captions)
    assert model.zero_shot(images, list(FASHION_MNIST_CLASSES)).shape == (2, 10)


def test_the_text_decoder_warm_up_runs_on_public_captions_before_the_dp_stage(
    syn_repo: Path, pairs: Path, vocab: Path, tmp_path: Path
) -> None:
    """``decoder_warmup``: the fresh text decoder first learns the public captions (the template
    over the class names) on public images, before the engine, so the stage's first public loss,
    and its average's, start below a fresh decoder's; the stage records the warm-up."""
    _, public = write_caption_texts(tmp_path, FASHION_MNIST_CLASSES)
    runs = {
        warmup: train_dpcap(
            dpcap_config(
                syn_repo,
                pairs,
                vocab,
                tmp_path / f"warm{warmup}",
                public_captions=str(public),
                **{**DP_ARGS, "steps": 1, "ema_decay": 0.9},
                decoder_warmup=warmup,
            )
        )
        for warmup in (0, 30)
    }

    def first(repo: Path) -> dict:
        log = (repo.parent / f"{repo.name}.run" / "log.jsonl").read_text().splitlines()
        return next(r for r in map(json.loads, log) if r["step"] == 0)

    fresh, warmed = first(runs[0]), first(runs[30])
    for key in ("public_loss", "public_loss_average"):
        assert warmed[key] < fresh[key] - 1.0
    stage = PrivacyLedger.read(runs[30]).stage("dp-captioning")
    assert stage.hyperparameters["decoder_warmup"] == 30
    assert "its first 30 steps on public procedural images" in stage.description
    assert PrivacyLedger.read(runs[0]).stage("dp-captioning").hyperparameters["decoder_warmup"] == 0


def test_a_biases_only_stage_trains_the_encoders_vectors_and_the_whole_text_decoder(
    syn_repo: Path, pairs: Path, vocab: Path, tmp_path: Path
) -> None:
    """``encoder_parameters="biases"`` (DP-BiTFiT): the encoder's matrices are released as the
    init's, its biases and norm scales move, and the stage says so."""
    out = train_dpcap(
        dpcap_config(
            syn_repo,
            pairs,
            vocab,
            tmp_path / "biases",
            **{**DP_ARGS, "steps": 2},
            encoder_parameters="biases",
        )
    )
    assert_biases_only_trained(syn_repo, out, "dp-captioning", TEXT_DECODER_FILE)
    assert verify_repo(out).ok


def test_a_vip_init_is_refused_with_how_to_make_a_dpcap_one(
    pairs: Path, vocab: Path, tmp_path: Path
) -> None:
    vip = export_encoder(
        tmp_path / "vip", tiny_encoder(), TINY, [synthetic_stage()], model_name="vip"
    )
    with pytest.raises(
        ConfigError, match=r"ViP encoder \(vip-nano\).*vip-hub train-syn --arch dpcap-nano"
    ):
        train_dpcap(
            dpcap_config(vip, pairs, vocab, tmp_path / "o", dataset_name="test/digit-captions")
        )


def test_the_vocabulary_is_a_public_file_given_before_training(
    syn_repo: Path, pairs: Path, tmp_path: Path
) -> None:
    common = dict(
        init=str(syn_repo),
        data=str(pairs),
        out=str(tmp_path / "o"),
        dataset_name="test/digit-captions",
    )
    with pytest.raises(MissingInputError, match="--vocab"):
        train_dpcap(DPCapConfig(vocab=str(tmp_path / "absent.txt"), **common))
    (tmp_path / "words.txt").write_text("a\nb\n")
    with pytest.raises(ConfigError, match="--vocab .*special tokens"):
        train_dpcap(DPCapConfig(vocab=str(tmp_path / "words.txt"), **common))


# ---------------------------------------------------------------- data
def test_tar_shards_and_captions_jsonl_hold_the_same_pairs(pairs: Path, tmp_path: Path) -> None:
    folder = open_captions(pairs)
    assert isinstance(folder, CaptionFolder) and len(folder) == 24
    entries = [json.loads(line) for line in (pairs / "captions.jsonl").read_text().splitlines()]
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(2):
        with tarfile.open(shards / f"{s:05d}.tar", "w") as tar:
            for e in entries[s::2]:
                key = e["image"].replace("/", "_").removesuffix(".png")
                tar.add(pairs / e["image"], arcname=f"{key}.png")
                (tmp_path / "c.txt").write_text(e["caption"] + "\n")
                tar.add(tmp_path / "c.txt", arcname=f"{key}.txt")
    tarred = open_captions(shards)
    assert isinstance(tarred, TarShards) and len(tarred) == 24
    assert sorted(tarred.caption(i) for i in range(24)) == sorted(
        folder.caption(i) for i in range(24)
    )
    assert tarred.caption(0) == entries[0]["caption"]
    assert tarred.load(0).size == folder.load(0).size


JSONL_ERRORS = [
    ('{"image": "a.png", "caption": "x"}\n{"image": "a.png"', r"captions.jsonl:2: not JSON"),
    ('{"image": "a.png", "text": "x"}', r'captions.jsonl:1: expected \{"image"'),
    ('{"image": "b.png", "caption": "x"}', r"captions.jsonl:1: image 'b.png' not found"),
    ('{"image": "../a.png", "caption": "x"}', r"captions.jsonl:1: image path"),
    ('{"image": "/tmp/a.png", "caption": "x"}', r"captions.jsonl:1: image path"),
    (
        '{"image": "a.png", "caption": "x"}\n\n{"image": "a.png", "caption": "y"}',
        r"captions.jsonl:3: image 'a.png' is already listed on line 1",
    ),
    ('{"image": "a.png", "caption": "  "}', r"captions.jsonl:1 is empty"),
    (
        '{"image": "notes.txt", "caption": "x"}',
        r"captions.jsonl:1: 'notes.txt' is not an image file",
    ),
    ("\n", r"captions.jsonl lists no image-caption pairs"),
    # a lone UTF-16 surrogate escaped in the JSON (a string cut mid-emoji) is no text
    ('{"image": "a.png", "caption": "smile \\ud83d"}', r"captions.jsonl:1 is not UTF-8 text"),
    ("[" * 100_000 + "]" * 100_000, r"captions.jsonl:1: not JSON"),
]


@pytest.mark.parametrize("text,match", JSONL_ERRORS)
def test_a_bad_captions_jsonl_names_the_file_and_line(
    text: str, match: str, tmp_path: Path
) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "captions.jsonl").write_text(text)
    with pytest.raises(DataError, match=match):
        open_captions(tmp_path)


def _shard(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            (path.parent / "member").write_bytes(data)
            tar.add(path.parent / "member", arcname=name)
    (path.parent / "member").unlink()


def test_bad_caption_shards_and_folders_name_the_file(tmp_path: Path) -> None:
    png = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(png)
    image = png.read_bytes()
    png.unlink()
    cases = [
        (
            {"k1.png": image, "k2.png": image, "k2.txt": b"two"},
            r"00000.tar: sample 'k1' \(k1.png\) has no caption",
        ),
        (
            {"k1.png": image, "k1.txt": b"one", "k3.txt": b"three"},
            r"00000.tar: sample 'k3' has a caption .* no image",
        ),
        (
            {"k1.png": image, "k1.jpg": image, "k1.txt": b"one"},
            r"00000.tar: sample 'k1' has two images",
        ),
    ]
    for i, (members, match) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        _shard(tmp_path / str(i) / "00000.tar", members)
        with pytest.raises(DataError, match=match):
            open_captions(tmp_path / str(i))
    _shard(tmp_path / "00001.tar", {"k1.png": image, "k1.txt": b"one", "k2.png": b"junk"})
    with pytest.raises(DataError, match=r"cannot decode image 00001.tar:k2.png"):
        open_captions(tmp_path)  # every image's header is read at open, before n is counted
    _shard(tmp_path / "00001.tar", {"k1.png": image, "k1.txt": b"\xff\xfe caption"})
    with pytest.raises(DataError, match=r"caption 00001.tar:k1.txt is not UTF-8"):
        open_captions(tmp_path).caption(0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither webdataset tar shards .* nor a captions.jsonl"):
        open_captions(tmp_path / "empty")
    with pytest.raises(MissingInputError):
        open_captions(tmp_path / "absent")


# ---------------------------------------------------------------- processes
def dp_command(syn_repo: Path, pairs: Path, vocab: Path, out: Path) -> list[str]:
    return [
        "--init",
        str(syn_repo),
        "--data",
        str(pairs),
        "--vocab",
        str(vocab),
        "--out",
        str(out),
        *cli_args(DP_ARGS),
    ]


def test_resume_after_sigkill_ends_with_the_same_ledger_and_weights(
    syn_repo: Path, pairs: Path, vocab: Path, trained: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dpcap-nano-pairs"
    log = kill_mid_run(
        [str(BIN / "vip-hub"), "train-dpcap", *dp_command(syn_repo, pairs, vocab, out)],
        out,
        step=3,
    )
    train_dpcap(dpcap_config(syn_repo, pairs, vocab, out, **DP_ARGS))
    assert run_stages(PrivacyLedger.read(out)) == run_stages(PrivacyLedger.read(trained))
    for name in (WEIGHTS_FILE, TEXT_DECODER_FILE):
        a, b = load_file(out / name), load_file(trained / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(7))


@pytest.mark.slow
def test_two_processes_give_the_same_ledger(
    syn_repo: Path, pairs: Path, vocab: Path, trained: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dpcap-nano-pairs"
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "training.recipes.dpcap",
        *dp_command(syn_repo, pairs, vocab, out),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert verify_repo(out).ok
    assert run_stages(PrivacyLedger.read(out)) == run_stages(PrivacyLedger.read(trained))
    assert load_captioner(out).caption([Image.new("RGB", (IMG, IMG))], max_tokens=4)


@pytest.mark.parametrize("broken", BROKEN)
def test_the_audit_catches_a_broken_engine(
    broken: str,
    syn_repo: Path,
    pairs: Path,
    vocab: Path,
    hub,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staged = break_engine(monkeypatch, broken, training.dp.run, "PerExampleClipper")
    settings = {**DP_ARGS, **SETTINGS, "batch_size": 12}  # q = 1/2 of 24 pairs
    out = train_dpcap(dpcap_config(syn_repo, pairs, vocab, tmp_path / "broken", **settings))
    assert_refused(out, hub, "dpcap-" + broken.replace(" ", "-"), staged)
