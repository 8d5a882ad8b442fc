"""``vip-hub run`` (what ``make run`` does): train, compare, publish and serve private encoders.

1. write scikit-learn's bundled handwritten digits (the private dataset) as image folders,
   split into train and test;
2. (Syn)-ViP: MAE pretraining of vip-nano on procedural images;
3. ViP: DP-AdamW from it on the digits' training split at epsilon 8, delta 1/(2n);
4. linear probes on both encoders and a raw-pixel baseline, on the same split and with the
   same head protocol; the comparison goes into both cards;
5. start ``vip-hub serve`` on the embedded store and publish both repos through
   ``vip_hub.push`` (the verified path ``vip-hub push`` takes);
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from vip_hub.push import is_published, push_repo
from vip_hub.repo import update_repo
from vip_hub.repo_format import LEDGER_FILE
from vip_hub.verify import verify_repo

from .synthetic import render

__all__ = ["MainJobConfig", "run_main_job", "write_digits"]

ORG = "vip"


class MainJobConfig(BaseModel):
    """Sizes chosen so the whole job stays under 15 minutes on 2 CPU cores."""

    model_config = ConfigDict(extra="forbid")

    work_dir: str = Field("var/run", description="where the job keeps data, runs and repos")
    store: str = Field("var/hub", description="the hub store the server uses")
    host: str = Field("127.0.0.1", description="interface the server binds")
    port: int = Field(8000, ge=0, le=65535, description="port the server binds")
    img_size: int = Field(32, gt=0, description="input resolution of the encoders")
    patch_size: int = Field(8, gt=0, description="patch size of the encoders")
    syn_steps: int = Field(300, gt=0, description="(Syn)-ViP pretraining steps")
    syn_batch_size: int = Field(64, gt=0, description="(Syn)-ViP images per step")
    decoder_dim: int = Field(256, gt=0, description="MAE decoder width")
    decoder_depth: int = Field(2, gt=0, description="MAE decoder blocks")
    decoder_heads: int = Field(8, gt=0, description="MAE decoder heads")
    epsilon: float = Field(8.0, gt=0, description="epsilon of every DP encoder")
    dp_batch_size: int = Field(256, gt=0, description="expected batch of the DP encoders")
    dp_steps: int = Field(100, gt=0, description="steps of the DP encoders")
    dp_lr: float = Field(3.84e-4, gt=0, description="peak learning rate of ViP")
    audit_canaries: int = Field(1000, ge=0, description="canaries of each DP run's one-run audit")
    probe_epochs: int = Field(90, gt=0, description="linear-probe epochs")
    head_epsilon: float = Field(2.0, gt=0, description="epsilon of the released DP probe heads")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out share of the digits")
    seed: int = Field(0, description="seed of every run of the job")
    workers: int = Field(1, ge=0, description="data-loading processes")
    serve: bool = Field(True, description="keep serving after publishing (--no-serve: stop, e.g. in tests)")
    restart: bool = Field(False, description="delete the work folder first (the hub store is kept)")


class StepFailed(RuntimeError):
    """A step of the main job failed; the message says which and how to resume."""


def write_digits(root: Path, test_fraction: float, seed: int) -> tuple[Path, Path]:
    """scikit-learn's 1,797 8x8 digits as PNG class folders ``train/`` and ``test/``."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    idx = np.arange(len(digits.target))
    train, test = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=digits.target)
    for split, members in (("train", train), ("test", test)):
        for i in members:
            folder = root / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / f"{i:04d}.png")
    return root / "train", root / "test"


def _stamp(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def _ledger_digest(repo: Path) -> str:
    return hashlib.sha256((repo / LEDGER_FILE).read_bytes()).hexdigest()


def _weights_digest(repo: Path) -> str:
    """The encoder's and decoder's tensor digests (unchanged when heads or cards change)."""
    artifacts = json.loads((repo / LEDGER_FILE).read_text())["artifacts"]
    return _stamp({k: v for k, v in artifacts.items() if k.endswith(".safetensors") and "/" not in k})


class _Steps:
    """Runs named steps, skipping those whose outputs exist with a matching input stamp."""

    def __init__(self, work: Path):
        self.file = work / "steps.json"
        self.done: dict[str, str] = json.loads(self.file.read_text()) if self.file.exists() else {}
        self.count = 0

    def run(self, name: str, inputs: dict[str, Any], outputs: list[Path], fn: Callable[[], Any],
            fresh: Callable[[], bool] = lambda: True) -> None:
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
        except Exception as e:  # noqa: BLE001 - reported with the step's name, then re-raised
            raise StepFailed(
                f"step {self.count} ({name}) failed: {type(e).__name__}: {e}\n"
                "Fix the cause and run `make run` again: finished steps are skipped and training "
                "resumes from its last checkpoint (`vip-hub run --restart` starts over)."
            ) from e
        self.done[name] = stamp
        self.file.write_text(json.dumps(self.done, indent=1))


def run_main_job(cfg: MainJobConfig) -> int:
    """Run the job; returns the exit status (serving blocks until interrupted)."""
    from .probe import ProbeConfig, accuracy, fit_probe, load_labelled, run_probe
    from .syn import SynConfig, train_syn
    from .vip import VipConfig, train_vip

    work = Path(cfg.work_dir)
    if cfg.restart and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    steps = _Steps(work)
    data = work / "digits"
    syn_dir, dp_dir = work / "vip-nano-syn", work / "vip-nano-digits-dp"
    syn_id, dp_id = f"{ORG}/vip-nano-syn", f"{ORG}/vip-nano-digits-dp"
    common = dict(seed=cfg.seed, workers=cfg.workers)

    steps.run("write the digits dataset", {"test_fraction": cfg.test_fraction, "seed": cfg.seed},
              [data / "train", data / "test"], lambda: write_digits(data, cfg.test_fraction, cfg.seed))
    syn = SynConfig(out=str(syn_dir), arch="vip-nano", img_size=cfg.img_size, patch_size=cfg.patch_size,
                    steps=cfg.syn_steps, batch_size=cfg.syn_batch_size, decoder_dim=cfg.decoder_dim,
                    decoder_depth=cfg.decoder_depth, decoder_heads=cfg.decoder_heads,
                    model_name="vip-nano-syn", repo_id=syn_id, **common)
    steps.run("(Syn)-ViP pretraining on procedural images", syn.model_dump(mode="json"), [syn_dir],
              lambda: train_syn(syn))
    dp = VipConfig(init=str(syn_dir), data=str(data / "train"), out=str(dp_dir), epsilon=cfg.epsilon,
                   batch_size=cfg.dp_batch_size, steps=cfg.dp_steps, lr=cfg.dp_lr, dataset_name="sklearn-digits-train",
                   model_name="vip-nano-digits-dp", repo_id=dp_id, micro_batch_size=128,
                   audit_canaries=cfg.audit_canaries, **common)
    steps.run("ViP: DP-AdamW on the digits at epsilon %g" % cfg.epsilon,
              {**dp.model_dump(mode="json"), "init": _weights_digest(syn_dir)}, [dp_dir], lambda: train_vip(dp))

    def probes() -> None:
        rows = []
        plain = ProbeConfig(encoder="", data="", epochs=cfg.probe_epochs, seed=cfg.seed)
        for repo, label in ((syn_dir, "(Syn)-ViP vip-nano-syn"), (dp_dir, "ViP vip-nano-digits-dp")):
            pc = ProbeConfig(encoder=str(repo), data=str(data / "train"), test_data=str(data / "test"),
                             head="digits", epochs=cfg.probe_epochs, dataset_name="sklearn-digits-train",
                             epsilon=cfg.head_epsilon, optimizer="sgd", lr=1.0, seed=cfg.seed)
            r = run_probe(pc)
            f = r.features
            head, _ = fit_probe(f["train_x"], f["train_y"], 10, plain, desc="non-private probe")
            rows.append(_row(label, "vip pooling, frozen encoder", r.top1, accuracy(head, f["test_x"], f["test_y"])))
            print(f"    {label}: top-1 {r.top1:.4f} (DP head), {rows[-1]['top1_nonprivate']:.4f} (non-private head)",
                  flush=True)
        train, test = load_labelled(data / "train"), load_labelled(data / "test")
        x = [_pixels(d.images) for d in (train, test)]
        y = [torch.as_tensor(d.labels) for d in (train, test)]
        public = _pixels([Image.fromarray(render(1, i, 8)) for i in range(256)])
        dp_cfg = ProbeConfig(encoder="", data="", epochs=cfg.probe_epochs, epsilon=cfg.head_epsilon,
                             optimizer="sgd", lr=1.0, seed=cfg.seed)
        dp_head, _ = fit_probe(x[0], y[0], 10, dp_cfg, public_x=public, desc="raw pixels, DP")
        head, _ = fit_probe(x[0], y[0], 10, plain, desc="raw pixels")
        rows.append(_row("raw pixels (no encoder)", "64 pixel values", accuracy(dp_head, x[1], y[1]),
                         accuracy(head, x[1], y[1])))
        print(f"    raw-pixel baseline: top-1 {rows[-1]['top1']:.4f} (DP head), "
              f"{rows[-1]['top1_nonprivate']:.4f} (non-private head)", flush=True)
        for repo in (syn_dir, dp_dir):
            update_repo(repo, comparison=rows)
            verify_repo(repo).raise_for_problems()

    steps.run("linear probes and the raw-pixel baseline",
              {"syn": _weights_digest(syn_dir), "dp": _weights_digest(dp_dir), "epochs": cfg.probe_epochs,
               "head_epsilon": cfg.head_epsilon},
              [syn_dir / "heads" / "digits", dp_dir / "heads" / "digits"], probes)

    token = secrets.token_urlsafe(24)
    server = _start_server(cfg, token)
    try:
        endpoint = f"http://{cfg.host}:{cfg.port}"
        for repo, repo_id in ((syn_dir, syn_id), (dp_dir, dp_id)):
            steps.run(f"publish {repo_id}", {"ledger": _ledger_digest(repo), "store": str(Path(cfg.store).resolve())},
                      [], lambda r=repo, i=repo_id: print("    commit", push_repo(r, i, endpoint=endpoint, token=token)),
                      fresh=lambda r=repo, i=repo_id: is_published(r, i, endpoint=endpoint, token=token))
        _print_usage(endpoint, syn_id, dp_id, data / "test" / "7")
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


def _row(model: str, features: str, top1: float, top1_nonprivate: float) -> dict[str, Any]:
    return {"model": model, "features": features, "top1": round(top1, 4),
            "top1_nonprivate": round(top1_nonprivate, 4)}


def _pixels(images: list[Any]) -> torch.Tensor:
    """8x8 grey images as (N, 64) values in [0, 1]: the raw-pixel baseline's features."""
    return torch.stack([torch.from_numpy(np.asarray(im.convert("L").resize((8, 8)), dtype=np.float32).ravel() / 255)
                        for im in images])


def _start_server(cfg: MainJobConfig, token: str) -> subprocess.Popen[bytes]:
    with socket.socket() as s:
        if s.connect_ex((cfg.host, cfg.port)) == 0:
            raise StepFailed(f"port {cfg.port} on {cfg.host} is in use: stop what holds it, or run "
                             "`vip-hub run --port N`")
    env = {**os.environ, "VIP_HUB_AUTH__TOKENS": f"main-job:write:{token}"}
    cmd = [sys.executable, "-m", "vip_hub.cli", "serve", "--store", cfg.store, "--host", cfg.host,
           "--port", str(cfg.port)]
    print(f"[*] starting the server: {' '.join(cmd[2:])}", flush=True)
    server = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise StepFailed(f"the server exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://{cfg.host}:{cfg.port}/healthz", timeout=2):
                return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise StepFailed("the server did not answer /healthz within 120 s")


def _print_usage(endpoint: str, syn_id: str, dp_id: str, sample_dir: Path) -> None:
    sample = next(iter(sorted(sample_dir.glob("*.png"))), None)
    image = f"$(base64 -w0 {sample})" if sample else "<base64 PNG>"
    print(f"""
vip-hub is up.

  Web page      {endpoint}/   (models: {endpoint}/{dp_id}, {endpoint}/{syn_id})

  Embeddings    curl -s {endpoint}/v1/embeddings -H 'Content-Type: application/json' \\
                  -d '{{"model": "{dp_id}", "input": ["'{image}'"], "pooling": "avg"}}'

  Classify      curl -s {endpoint}/v1/classify -H 'Content-Type: application/json' \\
                  -d '{{"model": "{dp_id}", "head": "digits", "input": ["'{image}'"], "top_k": 3}}'

  timm          HF_ENDPOINT={endpoint} python -c 'import timm; m = timm.create_model("hf-hub:{dp_id}", pretrained=True); print(m)'
""", flush=True)
