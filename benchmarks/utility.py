"""Fashion-MNIST at (epsilon 3, delta 1e-5), every row side by side in one run against
Tramer & Boneh's table (ICLR 2021): end-to-end CNN 86.0, ScatterNet + linear 89.7,
ScatterNet + CNN 89.0 (test top-1, %).

Rows built so far, each a DP linear head (``training.probe.fit_probe``: Opacus DP-SGD, Poisson
sampling, sigma from our accountant, noise and sampling from a per-run secret) on fixed features:

- raw pixels, scaled to [-1, 1] (a public per-example rule);
- ScatterNet: kymatio's ``Scattering2D(J=2)`` (81 x 7 x 7), GroupNorm over 27 groups of
  channels per example (no statistics across examples), as in the paper;
- (Syn)-ViP: the ``vip`` features of the encoder ``vip-hub train-syn`` makes with the main
  job's settings (procedural images only: no private data; the whole budget on the head).

The train split is private (declared ``public-benchmarks/fashion-mnist-train``, delta 1e-5
passed explicitly); the standard test split is public. Hyperparameters are fixed in code
(the paper's: batch n/8, clipping 0.1, learning rate 16, momentum 0.9), never tuned here.
Each row's non-private reference (the same features and head without DP) is printed here
only, never released. Features are cached under ``--work``; ``--train-size`` takes the first
N training records (a public rule), and the table says so.

    python benchmarks/utility.py [--train-size 60000] [--test-size 10000] [--epochs 100] \
        [--rows pixels,scatter,syn] [--device cpu|cuda] [--data FOLDER] [--work var/utility]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.datasets import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_TRAIN,
    LabelledArrays,
    fashion_mnist,
)
from training.probe import ProbeConfig, accuracy, fit_probe
from vip_hub.privacy.accounting import Accountant
from vip_hub.privacy.ledger import DPStage, compose_releases

EPSILON, DELTA = 3.0, 1e-5
PAPER = {"end-to-end CNN": 86.0, "ScatterNet + linear": 89.7, "ScatterNet + CNN": 89.0}
"""Tramer & Boneh 2021, Fashion-MNIST at (3, 1e-5), test top-1 in %."""
STEPS_PER_EPOCH = 8  # the paper's batch 8192 of 60,000: q = 1/8 at any n
CLIP, LR = 0.1, 16.0
SCATTER_J, SCATTER_GROUPS = 2, 27
SYN_SETTINGS = {
    "arch": "vip-nano",
    "img_size": 32,
    "patch_size": 8,
    "steps": 200,
    "batch_size": 64,
    "decoder_dim": 256,
    "decoder_depth": 2,
    "decoder_heads": 8,
    "seed": 0,
}
"""The main job's (Syn)-ViP pretraining (``training.main_job.MainJobConfig`` defaults)."""
CHUNK = 1000


@dataclass
class Features:
    """One row's features: train and test (N, D), and public features fixing the head's normalisation."""

    train: torch.Tensor
    test: torch.Tensor
    public: torch.Tensor
    what: str


def _identity_norm(dim: int) -> torch.Tensor:
    """Two public 'feature' rows with mean 0 and variance 1 per dimension: the head's BatchNorm
    is then the identity (the features are already normalised by a public per-example rule)."""
    return torch.cat([torch.ones(1, dim), -torch.ones(1, dim)])


def _pixels(data: LabelledArrays) -> torch.Tensor:
    """Grey pixels scaled to [-1, 1], flattened."""
    return torch.from_numpy(data.images.reshape(len(data), -1).astype(np.float32) / 127.5 - 1.0)


def pixel_features(train: LabelledArrays, test: LabelledArrays) -> Features:
    """Raw pixels; the head's normalisation is the identity."""
    x = _pixels(train)
    return Features(x, _pixels(test), _identity_norm(x.shape[1]), "784 pixels in [-1, 1]")


def scatter_features(train: LabelledArrays, test: LabelledArrays, device: str) -> Features:
    """ScatterNet (J = 2, L = 8) on 28 x 28, then GroupNorm over groups of channels, per example."""
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    scattering = ScatteringTorch2D(J=SCATTER_J, shape=(28, 28), L=8).to(device)

    def run(data: LabelledArrays, desc: str) -> torch.Tensor:
        out = []
        for start in tqdm(range(0, len(data), CHUNK), desc=desc, unit="chunk", leave=False):
            x = torch.from_numpy(data.images[start : start + CHUNK].astype(np.float32) / 255).to(
                device
            )
            s = scattering(x)  # (n, 81, 7, 7)
            out.append(torch.nn.functional.group_norm(s, SCATTER_GROUPS, eps=1e-5).flatten(1).cpu())
        return torch.cat(out)

    x = run(train, "scattering train")
    return Features(
        x,
        run(test, "scattering test"),
        _identity_norm(x.shape[1]),
        f"ScatterNet J={SCATTER_J} (81x7x7), GroupNorm({SCATTER_GROUPS}) per example",
    )


def syn_features(train: LabelledArrays, test: LabelledArrays, device: str, work: Path) -> Features:
    """The (Syn)-ViP encoder's ``vip`` features (trained once into ``work``); its head's
    normalisation is fixed to the features of public procedural images, as the probe does."""
    from training.procedural import SyntheticImages
    from training.syn import SynConfig, train_syn
    from vip_hub.loading import load_encoder

    repo = work / "vip-nano-syn"
    if not (repo / "config.json").exists():
        train_syn(SynConfig(out=str(repo), model_name=repo.name, device=device, **SYN_SETTINGS))
    encoder = load_encoder(repo, device=device)

    def run(data: LabelledArrays, desc: str) -> torch.Tensor:
        return torch.cat(
            [
                encoder.embed([data.pil(i) for i in range(s, min(s + CHUNK, len(data)))], "vip")
                for s in tqdm(range(0, len(data), CHUNK), desc=desc, unit="chunk", leave=False)
            ]
        )

    synth = SyntheticImages(encoder.spec.img_size, seed=1)
    public = encoder.embed(torch.stack([synth[i] for i in range(256)]), "vip")
    return Features(
        run(train, "(Syn)-ViP train"),
        run(test, "(Syn)-ViP test"),
        public,
        f"(Syn)-ViP vip-nano ({SYN_SETTINGS['steps']} steps on procedural images), vip features",
    )


def cached(path: Path, make: Callable[[], Features]) -> tuple[Features, float]:
    """Features from ``path`` (a tensor file this script wrote), else made and saved; and the seconds spent making them."""
    if path.exists():
        blob = torch.load(path, weights_only=True)
        return Features(blob["train"], blob["test"], blob["public"], blob["what"]), 0.0
    start = time.perf_counter()
    f = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"train": f.train, "test": f.test, "public": f.public, "what": f.what}, path)
    return f, time.perf_counter() - start


def head_config(n: int, epochs: int, epsilon: float | None) -> ProbeConfig:
    """The paper's DP-SGD settings (expected batch n / 8, clipping 0.1, lr 16) for a DP head; for
    the non-private reference the same schedule with SGD at lr 0.1."""
    dp = epsilon is not None
    return ProbeConfig(
        encoder="",
        data="",
        dataset_name=FASHION_MNIST_TRAIN,
        epsilon=epsilon,
        delta=DELTA if dp else None,
        batch_size=-(-n // STEPS_PER_EPOCH),
        epochs=epochs,
        warmup_epochs=max(1, epochs // 10),
        optimizer="sgd",
        lr=LR if dp else 0.1,
        max_grad_norm=CLIP,
        seed=0,
    )


def run_row(
    name: str, f: Features, train: LabelledArrays, test: LabelledArrays, epochs: int
) -> dict[str, object]:
    """A DP head and its non-private reference on one row's features."""
    y, yt = torch.as_tensor(train.labels), torch.as_tensor(test.labels)
    start = time.perf_counter()
    cfg = head_config(len(train), epochs, EPSILON)
    head, dp = fit_probe(
        f.train, y, len(FASHION_MNIST_CLASSES), cfg, public_x=f.public, desc=f"{name}, DP"
    )
    dp_time = time.perf_counter() - start
    stage = DPStage.from_parameters(
        name="utility-head",
        dataset=train.dataset,
        mechanism="DP-SGD",
        sample_rate=dp["sample_rate"],
        noise_multiplier=dp["sigma"],
        steps=dp["steps"],
        clipping_norm=CLIP,
        delta=dp["delta"],
        accountant=Accountant.RDP,
    )
    delta, eps = compose_releases([stage])
    start = time.perf_counter()
    ref, _ = fit_probe(
        f.train,
        y,
        len(FASHION_MNIST_CLASSES),
        head_config(len(train), epochs, None),
        desc=f"{name}, non-private",
    )
    return {
        "row": name,
        "features": f.what,
        "dp": 100 * accuracy(head, f.test, yt),
        "ref": 100 * accuracy(ref, f.test, yt),
        "eps": eps,
        "delta": delta,
        "sigma": dp["sigma"],
        "q": dp["sample_rate"],
        "steps": dp["steps"],
        "dp_s": dp_time,
        "ref_s": time.perf_counter() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data", help="the four IDX files' folder or an image folder (default: the Debian package)"
    )
    p.add_argument(
        "--work", default="var/utility", help="cache of features and the (Syn)-ViP encoder"
    )
    p.add_argument(
        "--train-size",
        type=int,
        default=60_000,
        help="the first N training records (a public rule)",
    )
    p.add_argument("--test-size", type=int, default=10_000, help="the first N test records")
    p.add_argument(
        "--epochs", type=int, default=100, help="epochs of every head (the paper's linear: 100)"
    )
    p.add_argument(
        "--rows", default="pixels,scatter,syn", help="comma-separated: pixels, scatter, syn"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="feature extraction device: cpu or cuda (heads train on CPU)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    full_train = fashion_mnist("train", args.data, work)
    train = full_train.first(args.train_size)
    test = fashion_mnist("test", args.data, work).first(args.test_size)
    makers: dict[str, tuple[str, Callable[[], Features]]] = {
        "pixels": ("raw pixels + DP linear", lambda: pixel_features(train, test)),
        "scatter": (
            "ScatterNet + DP linear (GroupNorm)",
            lambda: scatter_features(train, test, args.device),
        ),
        "syn": ("(Syn)-ViP + DP linear", lambda: syn_features(train, test, args.device, work)),
    }
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(makers))
    if unknown:
        p.error(f"unknown rows {unknown}: choose from {sorted(makers)}")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} CPUs  torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads  load average {os.getloadavg()}"
    )
    print(
        f"train: {len(train)} of {len(full_train)} private records ({train.dataset.name}), test: {len(test)} "
        f"public; (epsilon {EPSILON:g}, delta {DELTA:g}); heads: expected batch n/{STEPS_PER_EPOCH}, clip {CLIP}, "
        f"lr {LR:g}, SGD momentum 0.9, {args.epochs} epochs, warm-up + cosine; fixed in code, not tuned"
    )
    results = []
    for key in rows:
        name, make = makers[key]
        tag = f"{key}-{len(train)}-{len(test)}"
        features, feat_s = cached(work / "features" / f"{tag}.pt", make)
        load = os.getloadavg()[0]
        r = run_row(name, features, train, test, args.epochs) | {"feat_s": feat_s, "load": load}
        results.append(r)
        print(
            f"  {name}: DP {r['dp']:.2f} %, non-private {r['ref']:.2f} % "
            f"(features {feat_s:.0f} s{' cached' if not feat_s else ''}, DP head {r['dp_s']:.0f} s, "
            f"load {load:.1f})",
            flush=True,
        )
    print()
    print(
        "| features + head | top-1 at (3, 1e-5) | non-private reference | eps RDP / PRV / PLD | sigma, q, T | "
        "features s | DP head s | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        eps = r["eps"]
        print(
            f"| {r['row']} | **{r['dp']:.1f}** | {r['ref']:.1f} | {eps[Accountant.RDP]:.3f} / "
            f"{eps[Accountant.PRV]:.3f} / {eps[Accountant.PLD]:.3f} | {r['sigma']:.3f}, {r['q']:.3f}, "
            f"{r['steps']} | {r['feat_s']:.0f} | {r['dp_s']:.0f} | {r['load']:.1f} |"
        )
    for name, top1 in PAPER.items():
        print(f"| Tramer & Boneh: {name} | {top1} | - | 3 (RDP, Poisson assumed) | - | - | - | - |")
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
