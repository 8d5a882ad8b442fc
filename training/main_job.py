"""``vip-hub run`` (what ``make run`` does): train, compare, publish and serve private encoders.

1. write scikit-learn's bundled handwritten digits (the private dataset) as image folders,
   split into train and test, with captions by a public template rule and a public vocabulary;
2. (Syn) pretraining on procedural images: an MAE for vip-nano and one for dpcap-nano;
3. four private encoders on the digits' training split (declared as ``vip/sklearn-digits-train``),
   each at epsilon 8 and the default delta min(1e-5, 1/(10n)):
   ViP (DP-AdamW MAE), DP-Cap (DP-AdamW captioning), Logit-DP (contrastive, per-pair
   clipping) and its Naive-DP baseline (the whole batch clipped);
4. a DP linear probe on every encoder and on raw pixels, on the same split and with the same
   head protocol; each head's guarantee composes its encoder's stages on the same data; the
   comparison (accuracy on the public test split, each row's guarantee) goes into every card;
5. sign every repo with the job's key (``WORK/signing/main-job.key``, made once), start
   ``vip-hub serve`` on the embedded store trusting that key, and publish the repos through
   ``vip_hub.repo.push`` (the verified path ``vip-hub push`` takes);
6. print how to use them, and keep serving until interrupted.

Every step records a stamp of its inputs; a re-run skips steps whose outputs exist and whose
stamp matches. A failing step says which one failed and how to resume. The server is a child
process (``training`` never imports ``service``), reached over HTTP by the hub clients.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from vip_hub.errors import SignatureError, VipHubError
from vip_hub.local_hub import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_STORE, Port
from vip_hub.privacy.audit import DEFAULT_CANARIES
from vip_hub.privacy.ledger import Dataset, PrivacyLedger, privacy_headline
from vip_hub.repo.files import update_repo
from vip_hub.repo.push import is_published, push_repo
from vip_hub.repo.signing import (
    PRIVATE_SUFFIX,
    PUBLIC_SUFFIX,
    create_key,
    load_keys,
    sign_repo,
    verify_signature,
)
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import (
    HEADS_DIR,
    LEDGER_FILE,
    SIGNATURE_FILE,
    head_component,
)

from .procedural import render

__all__ = ["MainJobConfig", "run_main_job", "write_digits"]

ORG = "vip"
DATASET = f"{ORG}/sklearn-digits-train"
"""The private dataset's declared name: every DP stage of the job names it, so they compose."""


class MainJobConfig(BaseModel):
    """Sizes chosen so the whole job stays under 15 minutes on 2 CPU cores."""

    model_config = ConfigDict(extra="forbid")

    work_dir: str = Field("var/run", description="where the job keeps data, runs and repos")
    store: str = Field(str(DEFAULT_STORE), description="the hub store the server uses")
    host: str = Field(DEFAULT_HOST, description="interface the server binds")
    port: Port = Field(DEFAULT_PORT, description="port the server binds")
    img_size: int = Field(32, gt=0, description="input resolution of the encoders")
    patch_size: int = Field(8, gt=0, description="patch size of the encoders")
    syn_steps: int = Field(200, gt=0, description="(Syn)-ViP pretraining steps")
    syn_batch_size: int = Field(64, gt=0, description="(Syn)-ViP images per step")
    decoder_dim: int = Field(256, gt=0, description="MAE decoder width")
    decoder_depth: int = Field(2, gt=0, description="MAE decoder blocks")
    decoder_heads: int = Field(8, gt=0, description="MAE decoder heads")
    epsilon: float = Field(8.0, gt=0, description="epsilon of every DP encoder")
    dp_batch_size: int = Field(256, gt=0, description="expected batch of the DP encoders")
    dp_steps: int = Field(70, gt=0, description="steps of the DP encoders")
    dpcap_syn_steps: int = Field(
        60, gt=0, description="(Syn) pretraining steps of the DP-Cap encoder"
    )
    dpcap_steps: int = Field(30, gt=0, description="DP-Cap captioning steps")
    contrastive_batch_size: int = Field(
        32, gt=0, description="expected batch of Logit-DP and Naive-DP"
    )
    contrastive_steps: int = Field(30, gt=0, description="steps of Logit-DP and Naive-DP")
    temperature: float = Field(
        1.0, gt=0, description="InfoNCE temperature of Logit-DP and Naive-DP"
    )
    audit_canaries: int = Field(
        DEFAULT_CANARIES, ge=0, description="canaries of each DP run's one-run audit"
    )
    probe_epochs: int = Field(90, gt=0, description="linear-probe epochs")
    head_epsilon: float = Field(2.0, gt=0, description="epsilon of the released DP probe heads")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out share of the digits")
    seed: int = Field(0, description="seed of every run of the job")
    workers: int = Field(1, ge=0, description="data-loading processes")
    serve: bool = Field(
        True, description="keep serving after publishing (--no-serve: stop, e.g. in tests)"
    )
    restart: bool = Field(False, description="delete the work folder first (the hub store is kept)")


class StepFailed(VipHubError, RuntimeError):
    """A step of the main job failed; the message says which and how to resume."""


DIGIT_CLASSES = tuple(str(d) for d in range(10))


def write_digits(root: Path, test_fraction: float, seed: int) -> tuple[Path, Path]:
    """scikit-learn's 1,797 8x8 digits as PNG class folders ``train/`` (captioned by the data
    module's public template over the class names) and ``test/``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from .datasets import LabelledArrays, write_caption_folder, write_image_folder

    digits = load_digits()
    pixels = (digits.images * (255 / 16)).round().astype(np.uint8)
    idx = np.arange(len(digits.target))
    train, test = train_test_split(
        idx, test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    train_data, test_data = (
        LabelledArrays(pixels[i], digits.target[i], DIGIT_CLASSES, Dataset(name=name, size=len(i)))
        for i, name in ((train, DATASET), (test, "public/sklearn-digits-test"))
    )
    return (
        write_caption_folder(train_data, root / "train", DIGIT_CLASSES),
        write_image_folder(test_data, root / "test", DIGIT_CLASSES),
    )


def _stamp(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def _ledger_digest(repo: Path) -> str:
    return hashlib.sha256((repo / LEDGER_FILE).read_bytes()).hexdigest()


def _weights_digest(repo: Path) -> str:
    """The encoder's and decoder's tensor digests (unchanged when heads or cards change)."""
    artifacts = json.loads((repo / LEDGER_FILE).read_text())["artifacts"]
    return _stamp(
        {k: v for k, v in artifacts.items() if k.endswith(".safetensors") and "/" not in k}
    )


class _Steps:
    """Runs named steps, skipping those whose outputs exist with a matching input stamp."""

    def __init__(self, work: Path):
        self.file = work / "steps.json"
        self.done: dict[str, str] = json.loads(self.file.read_text()) if self.file.exists() else {}
        self.count = 0

    def run(
        self,
        name: str,
        inputs: dict[str, Any],
        outputs: list[Path],
        fn: Callable[[], Any],
        fresh: Callable[[], bool] = lambda: True,
    ) -> None:
        self.count += 1
        stamp = _stamp(inputs)
        if self.done.get(name) == stamp and all(p.exists() for p in outputs) and fresh():
            print(f"[{self.count}] {name}: up to date, skipped", flush=True)
            return
        print(f"[{self.count}] {name} ...", flush=True)
        try:
            fn()
        except KeyboardInterrupt:
            raise
        except Exception as e:
            raise StepFailed(
                f"step {self.count} ({name}) failed: {type(e).__name__}: {e}\n"
                "Fix the cause and run `make run` again: finished steps are skipped and training "
                "resumes from its last checkpoint (`vip-hub run --restart` starts over)."
            ) from e
        self.done[name] = stamp
        self.file.write_text(json.dumps(self.done, indent=1))


@dataclass(frozen=True)
class _Encoder:
    """One encoder the job trains and publishes: its folder and repo name, the comparison's label
    and the feature mode its probe reads."""

    name: str
    label: str
    pooling: str = "vip"

    @property
    def repo_id(self) -> str:
        return f"{ORG}/{self.name}"


SYN_VIP = _Encoder("vip-nano-syn", "(Syn)-ViP")
VIP = _Encoder("vip-nano-digits-dp", "ViP (DP-AdamW MAE)")
DPCAP = _Encoder("dpcap-nano-digits-dp", "DP-Cap (DP-AdamW captioning)", pooling="dpcap")
LOGIT_DP = _Encoder("vip-nano-digits-logit-dp", "Logit-DP (per-pair clipping)", pooling="avg")
NAIVE_DP = _Encoder("vip-nano-digits-naive-dp", "Naive-DP (whole batch clipped)", pooling="avg")
PUBLISHED = (SYN_VIP, VIP, DPCAP, LOGIT_DP, NAIVE_DP)
"""Published and compared, in this order; the (Syn) DP-Cap encoder only starts DP-Cap."""


def run_main_job(cfg: MainJobConfig) -> int:
    """Run the job; returns the exit status (serving blocks until interrupted)."""
    from .datasets import class_public_captions, class_vocabulary
    from .dpcap import DPCapConfig, train_dpcap
    from .logit_dp import ContrastiveMechanism, LogitDPConfig, train_logit_dp
    from .syn import SynConfig, train_syn
    from .vip import VipConfig, train_vip

    work = Path(cfg.work_dir)
    if cfg.restart and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    steps = _Steps(work)
    data = work / "digits"
    train = data / "train"
    folder = {e: work / e.name for e in PUBLISHED}
    syn_cap = work / "dpcap-nano-syn"
    vocab, public_captions = work / "digits-vocab.txt", work / "digits-public-captions.txt"
    split = {"test_fraction": cfg.test_fraction, "seed": cfg.seed}

    steps.run(
        "write the digits dataset",
        split,
        [train, data / "test"],
        lambda: write_digits(data, cfg.test_fraction, cfg.seed),
    )
    steps.run(
        "a public vocabulary and public captions over the class names",
        {"classes": DIGIT_CLASSES},
        [vocab, public_captions],
        lambda: (
            vocab.write_bytes(class_vocabulary(DIGIT_CLASSES)),
            public_captions.write_text("\n".join(class_public_captions(DIGIT_CLASSES)) + "\n"),
        ),
    )

    def syn(arch: str, out: Path, n_steps: int, repo_id: str | None) -> SynConfig:
        return SynConfig(
            out=str(out),
            arch=arch,
            img_size=cfg.img_size,
            patch_size=cfg.patch_size,
            steps=n_steps,
            batch_size=cfg.syn_batch_size,
            decoder_dim=cfg.decoder_dim,
            decoder_depth=cfg.decoder_depth,
            decoder_heads=cfg.decoder_heads,
            model_name=out.name,
            repo_id=repo_id,
            seed=cfg.seed,
            workers=cfg.workers,
        )

    for config, what in (
        (syn("vip-nano", folder[SYN_VIP], cfg.syn_steps, SYN_VIP.repo_id), "ViP"),
        (syn("dpcap-nano", syn_cap, cfg.dpcap_syn_steps, None), "DP-Cap"),
    ):
        steps.run(
            f"(Syn)-{what} pretraining on procedural images",
            config.model_dump(mode="json"),
            [Path(config.out)],
            lambda c=config: train_syn(c),
        )

    # The DP runs draw a secret seed (kept in their run folders for resume): with a published
    # seed anyone could regenerate the noise and subtract it.
    private = {
        "data": str(train),
        "epsilon": cfg.epsilon,
        "dataset_name": DATASET,
        "audit_canaries": cfg.audit_canaries,
        "workers": cfg.workers,
        "seed": None,
    }
    runs = [
        (
            VIP,
            folder[SYN_VIP],
            train_vip,
            VipConfig(
                init=str(folder[SYN_VIP]),
                batch_size=cfg.dp_batch_size,
                steps=cfg.dp_steps,
                micro_batch_size=128,
                **private,
                **_names(VIP, folder),
            ),
        ),
        (
            DPCAP,
            syn_cap,
            train_dpcap,
            DPCapConfig(
                init=str(syn_cap),
                vocab=str(vocab),
                public_captions=str(public_captions),
                batch_size=cfg.dp_batch_size,
                steps=cfg.dpcap_steps,
                micro_batch_size=128,
                **private,
                **_names(DPCAP, folder),
            ),
        ),
        *[
            (
                e,
                folder[SYN_VIP],
                train_logit_dp,
                LogitDPConfig(
                    init=str(folder[SYN_VIP]),
                    mechanism=m,
                    temperature=cfg.temperature,
                    batch_size=cfg.contrastive_batch_size,
                    steps=cfg.contrastive_steps,
                    **private,
                    **_names(e, folder),
                ),
            )
            for e, m in (
                (LOGIT_DP, ContrastiveMechanism.LOGIT_DP),
                (NAIVE_DP, ContrastiveMechanism.NAIVE),
            )
        ],
    ]
    for encoder, init, fn, config in runs:
        steps.run(
            f"{encoder.label} on the digits at epsilon {cfg.epsilon:g}",
            {**config.model_dump(mode="json"), "init": _weights_digest(init)},
            [folder[encoder]],
            lambda f=fn, c=config: f(c),
        )

    steps.run(
        "DP linear probes and the raw-pixel baseline",
        {
            "encoders": {e.name: _weights_digest(folder[e]) for e in PUBLISHED},
            "epochs": cfg.probe_epochs,
            "head_epsilon": cfg.head_epsilon,
        },
        [folder[e] / HEADS_DIR / "digits" for e in PUBLISHED],
        lambda: _probes(cfg, data, folder),
    )

    key = _signing_key(work)
    for e in PUBLISHED:
        _sign(folder[e], key)
    token = secrets.token_urlsafe(24)
    server = _start_server(cfg, token, key.with_suffix(PUBLIC_SUFFIX))
    try:
        endpoint = f"http://{cfg.host}:{cfg.port}"
        for e in PUBLISHED:
            repo = folder[e]
            steps.run(
                f"publish {e.repo_id}",
                {
                    "ledger": _ledger_digest(repo),
                    "store": str(Path(cfg.store).resolve()),
                    "signature": _file_digest(repo / SIGNATURE_FILE),
                },
                [],
                lambda r=repo, i=e.repo_id: print(
                    "    commit", push_repo(r, i, endpoint=endpoint, token=token)
                ),
                fresh=lambda r=repo, i=e.repo_id: is_published(
                    r, i, endpoint=endpoint, token=token
                ),
            )
        _print_usage(endpoint, data / "test" / "7")
        if not cfg.serve:
            return 0
        print("Serving; press Ctrl-C to stop.", flush=True)
        return server.wait()
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM (``docker stop``, a process manager) interrupts as Ctrl-C does:
    the server child is stopped and the current step can be resumed."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _names(encoder: _Encoder, folder: dict[_Encoder, Path]) -> dict[str, str]:
    return {"out": str(folder[encoder]), "model_name": encoder.name, "repo_id": encoder.repo_id}


def _probes(cfg: MainJobConfig, data: Path, folder: dict[_Encoder, Path]) -> None:
    """A DP head on every encoder and on raw pixels; the comparison (accuracy on the public test
    split of DP heads only, each with its guarantee: the head's stages composed with its
    encoder's) goes into every card. No model trained without DP on the private split is
    released or measured: its accuracy would be a figure with no guarantee."""
    from vip_hub.privacy.accounting import epsilon as accounted

    from .probe import DP_HEAD_LR, ProbeConfig, accuracy, fit_probe, load_labelled, run_probe

    rows = []
    for e in PUBLISHED:
        pc = ProbeConfig(
            encoder=str(folder[e]),
            data=str(data / "train"),
            test_data=str(data / "test"),
            head="digits",
            pooling=e.pooling,
            epochs=cfg.probe_epochs,
            dataset_name=DATASET,
            epsilon=cfg.head_epsilon,
            optimizer="sgd",
            lr=DP_HEAD_LR,
            seed=cfg.seed,
        )
        r = run_probe(pc)
        ledger = PrivacyLedger.parse((folder[e] / LEDGER_FILE).read_text())
        rows.append(
            _row(
                f"{e.label}: {e.name}",
                privacy_headline(ledger.summary(head_component(pc.head))),
                f"{e.pooling} pooling, frozen encoder",
                r.top1,
            )
        )
        print(
            f"    {e.name}: top-1 {r.top1:.4f} (DP head; encoder and head: {rows[-1]['privacy']})",
            flush=True,
        )
    train, test = (
        load_labelled(data / "train", DATASET),
        load_labelled(data / "test", "public/sklearn-digits-test"),
    )
    x = [_pixels(d.images) for d in (train, test)]
    y = [torch.as_tensor(d.labels) for d in (train, test)]
    public = _pixels([Image.fromarray(render(1, i, 8)) for i in range(256)])
    dp_cfg = ProbeConfig(
        encoder="",
        data="",
        dataset_name=DATASET,
        epochs=cfg.probe_epochs,
        epsilon=cfg.head_epsilon,
        optimizer="sgd",
        lr=DP_HEAD_LR,
        seed=cfg.seed,
    )
    dp_head, dp = fit_probe(x[0], y[0], 10, dp_cfg, public_x=public, desc="raw pixels, DP")
    eps = accounted(dp["sigma"], dp["sample_rate"], dp["steps"], dp["delta"], dp["accountant"])
    # This head is in no repo, so no dataset page lists it: its row says so (its figure is a release too).
    rows.append(
        _row(
            "raw pixels (no encoder)",
            f"(ε = {eps:.2f}, δ = {dp['delta']:.2g})-DP on {DATASET}: the head's own, a release outside "
            "the hub, so not in the dataset page's composition: add it",
            "64 pixel values",
            accuracy(dp_head, x[1], y[1]),
        )
    )
    print(f"    raw-pixel baseline: top-1 {rows[-1]['top1']:.4f} (DP head)", flush=True)
    for e in PUBLISHED:
        update_repo(folder[e], comparison=rows)
        verify_repo(folder[e]).raise_for_problems()


def _row(model: str, privacy: str, features: str, top1: float) -> dict[str, Any]:
    return {"model": model, "privacy": privacy, "features": features, "top1": round(top1, 4)}


def _pixels(images: list[Any]) -> torch.Tensor:
    """8x8 grey images as (N, 64) values in [0, 1]: the raw-pixel baseline's features."""
    return torch.stack(
        [
            torch.from_numpy(
                np.asarray(im.convert("L").resize((8, 8)), dtype=np.float32).ravel() / 255
            )
            for im in images
        ]
    )


def _signing_key(work: Path) -> Path:
    """The job's private signing key, kept in its work folder (made on the first run)."""
    private = work / "signing" / f"main-job{PRIVATE_SUFFIX}"
    if not private.exists():
        create_key(private.parent, "main-job", overwrite=True)
    return private


def _sign(repo: Path, key: Path) -> None:
    """Sign ``repo`` with ``key`` unless that key's signature over it still holds (a new one
    would differ, and be published again)."""
    try:
        if verify_signature(repo, load_keys([key.with_suffix(PUBLIC_SUFFIX)])) is not None:
            return
    except SignatureError:  # stale (a probe or card update changed the files), or another key's
        pass
    sign_repo(repo, key)


def _file_digest(path: Path) -> str:
    """SHA-256 hex of a file's bytes (a step's input stamp)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _start_server(cfg: MainJobConfig, token: str, trusted_key: Path) -> subprocess.Popen[bytes]:
    with socket.socket() as s:
        if s.connect_ex((cfg.host, cfg.port)) == 0:
            raise StepFailed(
                f"port {cfg.port} on {cfg.host} is in use: stop what holds it, or run "
                "`vip-hub run --port N`"
            )
    # the job's own user, a member of the organisation it publishes to
    env = {
        **os.environ,
        "VIP_HUB_AUTH__TOKENS": f"main-job:write:{token}",
        "VIP_HUB_AUTH__ORGS": json.dumps({ORG: ["main-job"]}),
        "VIP_HUB_HUB__TRUSTED_KEYS": str(trusted_key),
    }  # the hub accepts what the job signed
    cmd = [
        sys.executable,
        "-m",
        "vip_hub.cli.main",
        "serve",
        "--store",
        cfg.store,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
    ]
    print(f"[*] starting the server: {' '.join(cmd[2:])}", flush=True)
    server = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise StepFailed(
                f"the server exited with status {server.returncode} before it was ready"
            )
        try:
            with urllib.request.urlopen(f"http://{cfg.host}:{cfg.port}/healthz", timeout=2):
                return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise StepFailed("the server did not answer /healthz within 120 s")


def _print_usage(endpoint: str, sample_dir: Path) -> None:
    sample = next(iter(sorted(sample_dir.glob("*.png"))), None)
    image = f"$(base64 -w0 {sample})" if sample else "<base64 PNG>"
    models = "\n".join(f"                {endpoint}/{e.repo_id}   {e.label}" for e in PUBLISHED)
    print(
        f"""
vip-hub is up.

  Web page      {endpoint}/   (each model page shows its guarantee, its audit and the probe comparison)
{models}

  Embeddings    curl -s {endpoint}/v1/embeddings -H 'Content-Type: application/json' \\
                  -d '{{"model": "{VIP.repo_id}", "input": ["'{image}'"], "pooling": "avg"}}'

  Classify      curl -s {endpoint}/v1/classify -H 'Content-Type: application/json' \\
                  -d '{{"model": "{LOGIT_DP.repo_id}", "head": "digits", "input": ["'{image}'"], "top_k": 3}}'

  Caption       curl -s {endpoint}/v1/captions -H 'Content-Type: application/json' \\
                  -d '{{"model": "{DPCAP.repo_id}", "input": ["'{image}'"], "max_tokens": 12}}'

  timm          HF_ENDPOINT={endpoint} python -c 'import timm; m = timm.create_model("hf-hub:{VIP.repo_id}", pretrained=True); print(m)'
""",
        flush=True,
    )
