"""Helpers the tests share (``from support.helpers import ...``); fixtures: conftest.py."""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import importlib.util
import io
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from vip_hub import Dataset, DPStage, EncoderSpec, NonPrivateStage, create_encoder, export_encoder
from vip_hub.errors import VipHubError
from vip_hub.privacy.audit import bound_over_grid, ceiling, guess_grid
from vip_hub.privacy.ledger import Audit, AuditResult, PrivacyLedger, round_down
from vip_hub.repo.artifacts import read_safetensors_metadata, rewrite_safetensors_metadata
from vip_hub.repo.card import card_statements, guarantee_paragraphs
from vip_hub.repo.files import META_LEDGER
from vip_hub.repo.heads import HeadInfo, LinearProbe, save_head
from vip_hub.repo.verify import VerificationReport, verify_repo
from vip_hub.repo_format import (
    CARD_FILE,
    CARD_LEDGER_KEY,
    LEDGER_FILE,
    WEIGHTS_FILE,
    head_component,
)

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root folder."""
PROJECT_README = ROOT / tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
"""The project's README, as pyproject.toml names it (not a model repo's card)."""
BENCHMARKS_README = ROOT / "benchmarks" / PROJECT_README.name
"""The benchmarks' README, named as the project's is (the site's results/benchmarks.md)."""


def load_benchmark(name: str) -> Any:
    """The script ``benchmarks/NAME.py`` imported as module ``name`` (registered in
    ``sys.modules``, where dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


TINY = EncoderSpec("vip-nano", img_size=32)
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
"""Fashion-MNIST's four IDX files, by split (images, labels)."""

# Tests that must also hold on a GPU take ``device`` from here: CUDA runs where one is present.
NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


def staged_reports(monkeypatch: pytest.MonkeyPatch) -> list[VerificationReport]:
    """Let exports and updates swap in repos that would not verify (for tests of what verify,
    push and the hub then say of them), recording the report each repo they check got."""
    reports: list[VerificationReport] = []

    def record(folder: Path, *args: Any, **kwargs: Any) -> VerificationReport:
        reports.append(verify_repo(folder, *args, **kwargs))
        return VerificationReport()

    monkeypatch.setattr("vip_hub.repo.files.verify_repo", record)
    return reports


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
        noised_tensors={"unreleased:test": 1_000},
    )


def run_stages(ledger: PrivacyLedger) -> list[NonPrivateStage | DPStage]:
    """A ledger's stages without their training runs' random ids: what two runs of one
    configuration (and seed) share."""
    return [
        s.model_copy(update={"run_id": None}) if isinstance(s, DPStage) else s
        for s in ledger.stages
    ]


def random_text(size: int) -> bytes:
    """``size`` bytes of fresh random plain text (hex digits after a '#', which no pickle opcode
    is): a large file of a kind a repo may carry, which neither deduplicates nor compresses
    much."""
    return b"#" + os.urandom(size // 2).hex().encode()[: size - 1]


TINY_SYN: dict[str, Any] = dict(
    arch="vip-nano",
    img_size=32,
    patch_size=8,
    steps=2,
    batch_size=4,
    decoder_dim=32,
    decoder_depth=1,
    decoder_heads=2,
    workers=0,
    seed=0,
)
"""A (Syn) run at a test's size: two steps of batch 4 on procedural images, a one-block decoder."""


def tiny_syn(out: Path, **settings: Any) -> Path:
    """A (Syn) repo trained into ``out`` (``TINY_SYN``, with ``settings`` over it)."""
    from training.recipes.syn import SynConfig, train_syn

    return train_syn(SynConfig(out=str(out), **{**TINY_SYN, **settings}))


def with_front_matter(readme: str, extra: str) -> str:
    """A model card ``readme`` with the YAML lines ``extra`` added to its front matter."""
    _, front, body = readme.split("---\n", 2)
    return "---\n" + front + extra + "---\n" + body


def assert_biases_only_trained(
    init: Path, out: Path, stage: str, other_file: str, trained: tuple[str, ...] = ("",)
) -> None:
    """``out``, a DP stage ``stage`` run from ``init`` with ``encoder_parameters="biases"``,
    releases every encoder tensor of two or more dimensions bit for bit as ``init``'s and moves
    most of its one-dimensional ones (biases, normalisation scales) whose names start with one
    of ``trained``, leaving the others; its noise went to exactly those of the encoder and to
    matrices of the other trained component (``other_file``: a decoder, a head); its ledger
    stage says so."""
    from safetensors.torch import load_file

    before, after = load_file(init / WEIGHTS_FILE), load_file(out / WEIGHTS_FILE)
    assert before.keys() == after.keys()
    matrices = [k for k, v in before.items() if v.ndim > 1]
    vectors = [k for k, v in before.items() if v.ndim == 1 and k.startswith(trained)]
    assert matrices and vectors
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved <= set(vectors) and len(moved) > len(vectors) // 2, sorted(moved)
    dp = PrivacyLedger.read(out).stage(stage)
    assert dp.hyperparameters["encoder_parameters"] == "biases"
    assert dp.hyperparameters["encoder_trainable_parameters"] == sum(
        before[k].numel() for k in vectors
    )
    assert "of the encoder, its biases and normalisation scales only" in dp.description
    noised = dp.noised_tensors or {}
    assert {k.split(":", 1)[1] for k in noised if k.startswith(f"{WEIGHTS_FILE}:")} == set(vectors)
    other = load_file(out / other_file)
    assert any(
        v.ndim > 1 and any(k.startswith(f"{other_file}:") and k.endswith(name) for k in noised)
        for name, v in other.items()
    ), sorted(noised)


def add_audit_record(
    stage: dict,
    canaries: int,
    results: list[tuple[int, int]],
    lower: float,
    top: float,
    accountants: dict[str, float],
) -> dict:
    """``stage`` (in a ledger's JSON form) given an audit of ``canaries`` canaries, counted in its
    noised tensors, recording ``results`` (guesses, correct), the bound ``lower``, the ceiling
    ``top`` and each accountant's epsilon as given, not recomputed; returned."""
    stage["noised_tensors"]["canaries"] = canaries
    stage["noised_dimension"] += canaries
    stage["audit"] = {
        "canaries": canaries,
        "canary_norm": 100.0,
        "results": [{"guesses": r, "correct": v} for r, v in results],
        "beta": 0.05,
        "delta": 1e-5,
        "epsilon_lower_bound": lower,
        "ceiling": top,
        "accountant_epsilon": accountants,
    }
    return stage


def restate_truncation(ledger: dict, stage: dict, truncation: float | None = None) -> None:
    """Set ``stage``'s truncation delta (its recomputation from its fields by default) and the
    guarantee's delta with it, in a ledger's JSON form."""
    from vip_hub.privacy.accounting import truncation_delta

    stage["truncation_delta"] = truncation or truncation_delta(
        stage["noise_multiplier"],
        stage["sample_rate"],
        stage["steps"],
        stage["noise_support"],
        stage["noised_dimension"],
    )
    ledger["guarantees"][0]["delta"] = stage["delta"] + stage["truncation_delta"]


def import_nano(checkpoint: Path, out: Path, arch: str = "vip-nano", name: str = "x") -> Path:
    """``import_mae_checkpoint`` of ``checkpoint`` as a 32 px ``arch`` with one synthetic stage."""
    from vip_hub.repo.importer import import_mae_checkpoint

    return import_mae_checkpoint(
        checkpoint, out, arch=arch, img_size=32, stages=[synthetic_stage()], model_name=name
    )


def rewrite_ledger_copies(repo: Path, change: Callable[[dict], dict]) -> None:
    """Apply ``change`` to ``repo``'s ledger and write it consistently into its three copies (the
    ledger file, the weights' metadata, the card's front matter) and the card's text (each of
    its ``card_statements`` and guarantee paragraphs that changed, where the changed ledger
    still parses)."""
    before = json.loads((repo / LEDGER_FILE).read_text())
    ledger = change(json.loads(json.dumps(before)))
    text = json.dumps(ledger)
    (repo / LEDGER_FILE).write_text(text)
    meta = read_safetensors_metadata(repo / WEIGHTS_FILE)
    rewrite_safetensors_metadata(repo / WEIGHTS_FILE, {**meta, META_LEDGER: text})
    _, front, body = (repo / CARD_FILE).read_text().split("---\n", 2)
    data = yaml.safe_load(front)
    data[CARD_LEDGER_KEY] = ledger
    try:
        old, new = (_stated(PrivacyLedger.parse(x)) for x in (before, ledger))
    except (VipHubError, ValueError):
        old = new = []  # a ledger the test breaks: its text stays
    if len(old) == len(new):
        for was, now in zip(old, new, strict=True):
            body = body.replace(was, now)
    else:  # an audit or a stage added: the statements the text lacks, after it
        body += "".join(f"\n{line}\n" for line in new if line not in body)
    (repo / CARD_FILE).write_text("---\n" + yaml.safe_dump(data, sort_keys=False) + "---\n" + body)


def _stated(ledger: PrivacyLedger) -> list[str]:
    """What a card's text states from ``ledger``: its statements and guarantee paragraphs."""
    return [*card_statements(ledger), *guarantee_paragraphs(ledger)]


def tiny_encoder(seed: int = 0) -> torch.nn.Module:
    """A random vip-nano (32 px) initialised from ``seed``, leaving torch's generator where the
    initialisation left it: a copy of the one built once per process (its weight
    initialisation, not the copy, is what costs)."""
    built, state = _tiny_encoder(seed)
    torch.set_rng_state(state)
    return copy.deepcopy(built)


@functools.cache
def _tiny_encoder(seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return create_encoder(TINY, mae_init=True).eval(), torch.get_rng_state()


def tiny_repo_with_head(folder: Path, seed: int = 0, dp: bool = True) -> Path:
    """An exported tiny encoder with a 3-class probe head (non-DP, on sensitive labels)."""
    stages = [synthetic_stage(), dp_stage()] if dp else [synthetic_stage()]
    repo = export_encoder(folder, tiny_encoder(seed), TINY, stages, model_name=folder.name)
    torch.manual_seed(seed)
    head = LinearProbe(1152, 3)
    head.norm.running_mean.normal_()
    head.norm.running_var.uniform_(0.5, 2.0)
    save_head(
        repo,
        head.eval(),
        HeadInfo("toy", "vip", ["red", "green", "blue"], {"top1": 0.5}),
        NonPrivateStage(
            name="linear-probe:toy",
            component=head_component("toy"),
            dataset=Dataset(name="toy-labels", size=30),
            private_data=True,
        ),
    )
    return repo


def base_size_repo(folder: Path, seed: int = 0) -> Path:
    """A repo at real size: a random ViP-Base encoder (344 MB) with a 52 MB MAE decoder."""
    torch.manual_seed(seed)
    base = EncoderSpec("vip-base")
    model = create_encoder(base, mae_init=True).eval()
    decoder = {
        "decoder_embed.weight": torch.randn(512, 768),
        "decoder_pred.weight": torch.randn(16_384, 768),
    }
    return export_encoder(
        folder,
        model,
        base,
        [synthetic_stage(), dp_stage()],
        model_name=folder.name,
        decoder=decoder,
        decoder_config={"embed_dim": 512, "depth": 0},
    )


def published_hashes_of(data: Path, repo: Path) -> set[str]:
    """The plain SHA-256 digests of the private data (each file's, and the whole folder's as vip-hub
    < 0.3 fingerprinted it) that appear in any file of ``repo``: a released repo must hold none."""
    files = sorted(p for p in data.rglob("*") if p.is_file())
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    whole = hashlib.sha256()
    for p in files:
        whole.update(p.relative_to(data).as_posix().encode() + b"\0")
        whole.update(hashlib.sha256(p.read_bytes()).digest())
    digests.add(whole.hexdigest())
    released = b"".join(p.read_bytes() for p in repo.rglob("*") if p.is_file())
    return {d for d in digests if d.encode() in released}


def kill_mid_run(cmd: list[str], out: Path, step: int) -> Path:
    """Start a training command, SIGKILL it once its log (``OUT.run/log.jsonl``) reaches ``step``
    (between checkpoints), check it had not finished; returns the log's path."""
    log = out.parent / f"{out.name}.run" / "log.jsonl"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(line).get("step") == step for line in lines if line.endswith("}")):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "the run finished before it could be killed"
    return log


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    """An IDX file's bytes: magic (0, 0, type code, dimension count), big-endian dims, data."""
    dtype = {0x08: ">u1", 0x0D: ">f4"}[code]
    return (
        bytes([0, 0, code, array.ndim])
        + struct.pack(f">{array.ndim}I", *array.shape)
        + array.astype(dtype).tobytes()
    )


def write_fashion(folder: Path, n: dict[str, int] | None = None, gz: bool = True) -> Path:
    """The four Fashion-MNIST IDX files with random content (``n`` records per split)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, (images, labels) in IDX_FILES.items():
        count = (n or {"train": 30, "test": 10})[split]
        for stem, array in (
            (images, rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)),
            (labels, rng.integers(0, 10, count, dtype=np.uint8)),
        ):
            data = idx_bytes(array)
            (folder / (stem + ".gz" if gz else stem)).write_bytes(
                gzip.compress(data) if gz else data
            )
    return folder


def write_digits(root: Path, test_fraction: float, seed: int) -> tuple[Path, Path]:
    """scikit-learn's 1,797 8x8 digits (small, with real structure) as PNG class folders
    ``train/`` (captioned by the data module's template over the digits' names) and ``test/``,
    split stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from training.data.labelled import LabelledArrays, write_caption_folder, write_image_folder

    digits = load_digits()
    classes = [str(d) for d in range(10)]
    pixels = (digits.images * (255 / 16)).round().astype(np.uint8)
    splits = train_test_split(
        np.arange(len(digits.target)),
        test_size=test_fraction,
        random_state=seed,
        stratify=digits.target,
    )
    train, test = (
        LabelledArrays(pixels[i], digits.target[i], tuple(classes), Dataset(name=name, size=len(i)))
        for i, name in zip(splits, ("test/digits-train", "test/digits-test"), strict=True)
    )
    return (
        write_caption_folder(train, root / "train", classes),
        write_image_folder(test, root / "test", classes),
    )


def write_idx(folder: Path, prefix: str, n: int, seed: int) -> None:
    """Gzipped IDX files of ``n`` 28 x 28 grey images whose brightness follows their label."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.uint8) % 10
    images = (rng.integers(0, 60, (n, 28, 28)) + 19 * labels[:, None, None]).astype(np.uint8)
    (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
    (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))


def swap_after_verify(
    monkeypatch: pytest.MonkeyPatch,
    path: Path,
    change: Callable[[torch.Tensor], torch.Tensor] = lambda t: t + 1,
    change_metadata: Callable[[dict[str, str]], dict[str, str]] = lambda m: m,
) -> None:
    """Let ``vip_hub.loading``'s verification pass on the repo as it is, then replace ``path`` by
    a valid safetensors file of the same names and shapes whose floating tensors are ``change``d
    and whose metadata is ``change_metadata``'s (another repo's weights or settings, swapped in
    between the check and the load)."""
    from safetensors.torch import load_file, save_file

    import vip_hub.loading as loading

    real = loading.verify_repo

    def verify_then_swap(*args: Any, **kwargs: Any) -> Any:
        report = real(*args, **kwargs)
        meta = change_metadata(read_safetensors_metadata(path))
        tensors = {k: change(v) if v.is_floating_point() else v for k, v in load_file(path).items()}
        save_file(tensors, path, metadata=meta)
        return report

    monkeypatch.setattr(loading, "verify_repo", verify_then_swap)


def create_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
    stores: list[Any],
    repo_ids: list[str],
    held_back: Callable[[], bool],
    patience: float,
) -> list[bool | str]:
    """Create ``repo_ids[i]`` through ``stores[i]`` (HubStores, each its own index connection),
    all at once in threads, each stopped just before its INSERT INTO repos until every other
    reached its own, ``held_back()`` says one waits on a lock, or ``patience`` seconds passed:
    the widest check-then-insert race. Each creation's ``created``, or its Conflict's message."""
    from service.store.errors import Conflict
    from service.store.index import Transaction

    real, reached, ready = Transaction.execute, [0], threading.Condition()

    def execute(self: Transaction, sql: str, args: Any = ()) -> int:
        if sql.startswith("INSERT INTO repos"):
            with ready:
                reached[0] += 1
                ready.notify_all()
                until = time.monotonic() + patience
                while reached[0] < len(stores) and not held_back() and time.monotonic() < until:
                    ready.wait(0.02)
        return real(self, sql, args)

    monkeypatch.setattr(Transaction, "execute", execute)
    results: list[bool | str] = [False] * len(stores)

    def create(i: int) -> None:
        try:
            results[i] = stores[i].create_repo(repo_ids[i])[1]
        except Conflict as e:
            results[i] = str(e)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(Transaction, "execute", real)
    return results


WIDE_GREY = ("I;16", "I;16B", "I", "F")
"""Pillow's greyscale modes wider than 8 bits, which ``convert("RGB")`` clips at 255."""


def wide_grey(mode: str, seed: int = 0) -> tuple[bytes, Image.Image]:
    """A 40 x 24 greyscale image in the wide ``mode`` as a file's bytes (a 16-bit PNG for I;16, a
    TIFF otherwise) and its 8-bit version in RGB (a 16-bit value >> 8, a float in [0, 1] x 255)."""
    rng = np.random.default_rng(seed)
    grey = rng.integers(0, 256, (24, 40), dtype=np.uint8)
    wide = grey.astype(np.uint16) << 8 | rng.integers(0, 256, grey.shape, dtype=np.uint16)
    array = {
        "I;16": wide,
        "I;16B": wide.astype(">u2"),
        "I": wide.astype(np.int32),
        "F": grey / np.float32(255),
    }[mode]
    img = Image.fromarray(array)
    assert img.mode == mode
    buf = io.BytesIO()
    img.save(buf, "PNG" if mode == "I;16" else "TIFF")
    return buf.getvalue(), Image.fromarray(grey).convert("RGB")


def decode_image(data: bytes, index: int, limits: Any, min_side: int = 0) -> Image.Image:
    """What the inference engine does with an input's bytes: its header checked (``open_image``
    under ``limits``, an ``ImageLimits``), then decoded to RGB (``load_rgb``)."""
    from service.inference.images import load_rgb, open_image

    return load_rgb(open_image(data, index, limits), index, min_side)


def xorb_of(chunks: list[bytes]) -> tuple[str, bytes]:
    """A Xet xorb of uncompressed chunks (scheme 0): its hash and its bytes."""
    import blake3

    from service.store.xet import _DATA_KEY, xorb_hash

    name = xorb_hash([(blake3.blake3(c, key=_DATA_KEY).digest(), len(c)) for c in chunks])
    headers = [bytes([0]) + len(c).to_bytes(3, "little") for c in chunks]
    return name, b"".join(h + h + c for h, c in zip(headers, chunks, strict=True))


def lz4_chunk(packed: bytes, unpacked: int) -> bytes:
    """One chunk of LZ4-framed bytes ``packed`` (scheme 1) whose header states ``unpacked``."""
    return (
        bytes([0])
        + len(packed).to_bytes(3, "little")
        + bytes([1])
        + unpacked.to_bytes(3, "little")
        + packed
    )


def lz4_xorb(chunks: list[bytes]) -> bytes:
    """A Xet xorb of LZ4-framed chunks (scheme 1), each after its 8-byte header: the bytes of
    ``xorb_of(chunks)``'s xorb packed otherwise, under the same hash."""
    import lz4.frame

    return b"".join(lz4_chunk(lz4.frame.compress(c), len(c)) for c in chunks)


def turned_jpeg(seed: int = 0, corrupt: bool = False) -> tuple[bytes, Image.Image]:
    """A JPEG stored 40 x 24 whose EXIF Orientation (6) says "rotate 90° clockwise to show", and
    the 24 x 40 RGB image a viewer shows (its pixels decoded as stored, then turned); ``corrupt``:
    its EXIF also holds a text under a numeric tag (336), which Pillow cannot write back."""
    rng = np.random.default_rng(seed)
    stored = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    exif[0x010E] = "a description"  # ImageDescription, ASCII
    data = exif.tobytes()
    if corrupt:  # big-endian: tag 0x010E of type 2 (ASCII) renamed 0x0150
        data = data.replace(b"\x01\x0e\x00\x02", b"\x01\x50\x00\x02")
    buf = io.BytesIO()
    stored.save(buf, "JPEG", quality=95, exif=data)
    with Image.open(io.BytesIO(buf.getvalue())) as decoded:
        pixels = np.asarray(decoded.convert("RGB"))
    return buf.getvalue(), Image.fromarray(np.rot90(pixels, k=-1).copy())


def audit_of(stage: DPStage, canaries: int = 1000) -> Audit:
    """An audit of ``stage`` whose guesses are right 3 times in 5 at every count of the grid."""
    results = [(r, r * 3 // 5) for r in guess_grid(canaries)]
    return Audit(
        canaries=canaries,
        canary_norm=1.0,
        results=[AuditResult(guesses=r, correct=v) for r, v in results],
        beta=0.05,
        delta=stage.delta,
        epsilon_lower_bound=bound_over_grid(canaries, results, 0.05, stage.delta),
        ceiling=round_down(ceiling(canaries, 0.05, stage.delta)),
        accountant_epsilon=stage.epsilons,
    )
