"""How much is a (Syn) prior worth? Non-private linear probes on Fashion-MNIST's spatial features
of candidate encoders, beside raw pixels and randomly initialised encoders of the same shapes, in
one run (issue 36).

Only the public test split is read, never the private training split: every row is a
non-private softmax-regression head (``training.recipes.probe.fit_probe`` with
``training.study.heads.head_config``'s non-private settings: SGD 0.1, momentum 0.9, batch n / 8,
warm-up and cosine, the ``LinearProbe``'s BatchNorm) trained on public test records
0..``--fit-size``-1 (4,000), its mode **chosen on the rest of records 0-4,999** and the row
**reported on records 5,000-9,999**, which neither saw (a smaller test split keeps these
proportions of its first half). An encoder's candidate modes are spatial modes
(``spatial-b<block>-g<grid>``: one block's patch tokens average-pooled to a grid, a LayerNorm
without parameters per example) for every ``--block-step``-th block and every grid in ``GRIDS``
that its patch grid allows, read through the encoder's own transform (what the hub serves); the
per-mode scores on the choosing records are printed too. Raw pixels (the study's,
``training.study.features.pixels``) are normalised per example (a LayerNorm without
parameters), like the spatial maps. A random-weights reference
(``create_encoder(mae_init=True)`` under ``--seed``) is added for every distinct (architecture,
image size, patch size) among the candidates, so each prior is compared with its own shapes'
random weights.

Nothing here is private (no DP, no ledger, no private record): it ranks priors, it releases
nothing.

    python benchmarks/prior.py REPO [REPO ...] [--fit-size 4000] [--epochs 50] \
        [--block-step 3] [--rows all|references|candidates] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from timm.models.vision_transformer import VisionTransformer

from training.data.labelled import FASHION_MNIST_TEST, LabelledArrays, fashion_mnist
from training.recipes.probe import accuracy, fit_probe
from training.study.config import BENCHMARK
from training.study.features import pixels as raw_pixels
from training.study.heads import head_config
from vip_hub.loading import load_encoder
from vip_hub.models.encoders import EncoderSpec, create_encoder
from vip_hub.models.features import LN_EPS, SpatialMode, extract_features

SELECTION = 5_000
"""Test records 0..SELECTION-1 train the heads and choose each row's mode; the rest report it
(half and half of a test split smaller than twice that)."""
FIT = 4_000
"""Of those, the first FIT train the heads (at most four fifths of them in a smaller split)."""
GRIDS = (2, 4, 7)
"""Grids tried (those no finer than the encoder's patch grid)."""
CHUNK = 500


@dataclass
class Row:
    """One row: the chosen mode, its top-1 on the selection and on the report records (%), and
    every mode's selection score."""

    name: str
    mode: str
    dims: int
    select_top1: float
    report_top1: float
    scores: dict[str, float]
    seconds: float


def candidate_modes(model: VisionTransformer, block_step: int) -> tuple[str, ...]:
    """Spatial modes tried for ``model``: every ``block_step``-th block (counting from the last
    down) on each of ``GRIDS`` no finer than its patch grid."""
    depth, side = len(model.blocks), min(model.patch_embed.grid_size)
    blocks = sorted(range(depth, 0, -block_step))
    return tuple(SpatialMode((b,), g).name for g in GRIDS if g <= side for b in blocks)


@torch.inference_mode()
def embed(
    model: VisionTransformer, data: LabelledArrays, modes: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Every mode's features of ``data`` through the model's own transform, one forward pass per
    chunk."""
    transform = create_transform(**resolve_data_config({}, model=model))
    out: dict[str, list[torch.Tensor]] = {m: [] for m in modes}
    for s in range(0, len(data), CHUNK):
        batch = torch.stack(
            [transform(data.pil(i).convert("RGB")) for i in range(s, min(s + CHUNK, len(data)))]
        )
        for m, f in extract_features(model.eval(), batch, modes).items():
            out[m].append(f.half())  # halves the memory: 20,000 x 9,408 values at grid 7
    return {m: torch.cat(v) for m, v in out.items()}


def pixels(data: LabelledArrays) -> torch.Tensor:
    """Raw pixels normalised per example (a LayerNorm without parameters)."""
    x = raw_pixels(data)
    return F.layer_norm(x, x.shape[-1:], eps=LN_EPS)


def splits(n: int, fit: int) -> tuple[slice, slice, slice]:
    """Of ``n`` public test records: those that train the heads, those that choose each row's mode
    and those that report it."""
    half = min(SELECTION, n // 2)
    fit = min(fit, half * 4 // 5)
    return slice(0, fit), slice(fit, half), slice(half, None)


def probe_row(
    name: str, features: dict[str, torch.Tensor], labels: torch.Tensor, epochs: int, fit: int
) -> Row:
    """Fit a head per mode on the public records ``splits`` gives for training, choose the best on
    the choosing records, report it on the rest."""
    began = time.process_time()
    train, sel, rep = splits(len(labels), fit)
    y = labels[train]
    study = BENCHMARK.updated({"probe_epochs": epochs})
    cfg = head_config(study, len(y), None, dataset=FASHION_MNIST_TEST)
    classes = int(labels.max()) + 1
    heads, scores = {}, {}
    for mode, x in features.items():
        heads[mode], _ = fit_probe(x[train].float(), y, classes, cfg, desc=f"{name} {mode}")
        scores[mode] = 100 * accuracy(heads[mode], x[sel].float(), labels[sel])
    best = max(scores, key=lambda m: scores[m])
    report = 100 * accuracy(heads[best], features[best][rep].float(), labels[rep])
    row = Row(
        name,
        best,
        features[best].shape[1],
        scores[best],
        report,
        scores,
        time.process_time() - began,
    )
    shown = ", ".join(f"{m} {v:.1f}" for m, v in sorted(scores.items(), key=lambda kv: -kv[1]))
    print(f"{name}: {shown}; chosen {best}, {report:.1f} on the report records", flush=True)
    return row


def encoder_row(
    name: str,
    model: VisionTransformer,
    test: LabelledArrays,
    epochs: int,
    fit: int,
    block_step: int,
) -> Row:
    """A row for ``model``: its candidate modes' features of the public records, then
    ``probe_row``."""
    modes = candidate_modes(model, block_step)
    return probe_row(name, embed(model, test, modes), torch.as_tensor(test.labels), epochs, fit)


def random_encoder(spec: EncoderSpec, seed: int) -> VisionTransformer:
    """A randomly initialised encoder of ``spec`` (the MAE recipe's initialisation)."""
    torch.manual_seed(seed)
    return create_encoder(spec, mae_init=True)


def run(
    repos: Sequence[str],
    fit: int,
    epochs: int,
    block_step: int,
    seed: int,
    data: str | None = None,
    rows_wanted: str = "all",
) -> list[Row]:
    """Rows for raw pixels and each distinct shape's random weights (``rows_wanted`` "all" or
    "references"), and every repo in ``repos`` ("all" or "candidates"), on the public test split
    alone."""
    test = fashion_mnist("test", data)
    refs, cands = rows_wanted in ("all", "references"), rows_wanted in ("all", "candidates")
    rows = []
    if refs:
        labels = torch.as_tensor(test.labels)
        rows.append(probe_row("raw pixels", {"pixels": pixels(test)}, labels, epochs, fit))
    loaded = {r: load_encoder(r) for r in repos}
    shapes: dict[tuple[str, int, int, int | None], Callable[[], VisionTransformer]] = {}
    for enc in loaded.values():
        s = enc.spec
        key = (s.arch, s.img_size, s.patch_size, s.depth)
        shapes.setdefault(key, functools.partial(random_encoder, s, seed))
    for (arch, size, patch, depth), make in shapes.items() if refs else ():
        name = f"random {arch} ({depth} blocks) {size} px patch {patch}"
        rows.append(encoder_row(name, make(), test, epochs, fit, block_step))
    for r, enc in loaded.items() if cands else ():
        rows.append(encoder_row(Path(r).name, enc.model, test, epochs, fit, block_step))
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    """The rows as a Markdown table."""
    out = [
        f"| features | mode chosen on test {FIT:,}-{SELECTION - 1:,} | dims | top-1 there | "
        f"top-1 on test {SELECTION:,}-9,999 | probe CPU s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r.name} | {r.mode} | {r.dims:,} | {r.select_top1:.1f} | **{r.report_top1:.1f}** "
            f"| {r.seconds:.0f} |"
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the table (and write every score to ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repos", nargs="*", help="encoder repo folders (candidate priors)")
    p.add_argument(
        "--fit-size", type=int, default=FIT, help="first N public test records train the heads"
    )
    p.add_argument("--epochs", type=int, default=50, help="head epochs (8 steps each)")
    p.add_argument("--block-step", type=int, default=3, help="try every k-th block")
    p.add_argument("--seed", type=int, default=0, help="the random-weights references' seed")
    p.add_argument("--data", default=None, help="Fashion-MNIST folder (default: the package)")
    p.add_argument(
        "--rows",
        choices=("all", "references", "candidates"),
        default="all",
        help="references: raw pixels and random weights only (split a comparison over processes)",
    )
    p.add_argument("--json", default=None, help="write every row and score here")
    a = p.parse_args(argv)
    began, cpu = time.monotonic(), time.process_time()
    rows = run(a.repos, a.fit_size, a.epochs, a.block_step, a.seed, a.data, a.rows)
    print("\n".join(table(rows)))
    print(
        f"wall {time.monotonic() - began:.0f} s, CPU {time.process_time() - cpu:.0f} s, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
