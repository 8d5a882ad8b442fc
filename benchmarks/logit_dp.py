"""Cost of one contrastive step as the batch grows, side by side (ratios; never fails).

(a) a non-private step: the summed symmetric InfoNCE, one backward;
(b) Logit-DP with ``training.dp.pair_clipping.PairClipper``: pair norms from per-view Jacobians
    (d cotangents in one batched backward, each layer's bounded as it arrives and kept), then
    the clipped sum from them in fp64 (the proved rule, issue 52);
(c) Logit-DP the naive way: every pair gradient grad Z_ij materialised (``torch.func.vmap``
    over pairs, in chunks), clipped, weighted and summed;
(d) Naive-DP with ``BatchClipper``: the whole-batch gradient clipped.

Each variant's step forms its clipped sum (noise and the optimiser cost the same for all and are
left out). Time: the variants run interleaved round by round in one process;
the ratios use each variant's fastest round (on a shared machine the least disturbed one), with
the median of the per-round ratios beside them; the load average is printed before and after.
Memory: each (variant, n) runs once more in its own process (``benchmarks/own_process.py``);
the peak resident set size (VmHWM, reset after set-up) minus the set-up's.

    python benchmarks/logit_dp.py [--ns 16,32,64,128] [--rounds 5] [--dim 16] [--variants abcd]
        [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from own_process import in_own_process, load_average, peak, reset_peak  # noqa: E402

LABELS = {
    "a": "non-private",
    "b": "Logit-DP, PairClipper",
    "c": "Logit-DP, pair grads materialised",
    "d": "Naive-DP, BatchClipper",
}
TAU, BOUND = 0.2, 1e-3


def make_steps(
    args: argparse.Namespace, n: int, variants: list[str]
) -> dict[str, Callable[[], None]]:
    """One step function per variant on one shared model and batch of n images (two views)."""
    import torch
    import torch.nn.functional as F
    from timm.models.vision_transformer import VisionTransformer
    from torch.func import functional_call, grad, vmap

    from training.dp.clipping import clip_factors
    from training.dp.pair_clipping import (
        BatchClipper,
        ContrastiveEmbedder,
        PairClipper,
        embed,
        symmetric_infonce,
    )

    torch.manual_seed(0)
    encoder = VisionTransformer(
        img_size=args.img_size,
        patch_size=args.patch,
        embed_dim=args.width,
        depth=args.depth,
        num_heads=4,
        num_classes=0,
        global_pool="avg",
        fc_norm=True,
    )
    model = ContrastiveEmbedder(encoder, dim=args.dim)
    x1, x2 = (torch.randn(n, 3, args.img_size, args.img_size) for _ in range(2))
    params = [p for p in model.parameters() if p.requires_grad]
    batch, pair = BatchClipper(model, BOUND, TAU), PairClipper(model, BOUND, TAU)

    def a() -> None:
        e = embed(model, x1, x2)
        symmetric_infonce(e[:n] @ e[n:].T, TAU).sum().backward()

    named = {k: v for k, v in model.named_parameters() if v.requires_grad}
    buffers = dict(model.named_buffers())

    def similarity(p: dict, xi: torch.Tensor, xj: torch.Tensor) -> torch.Tensor:
        e = F.normalize(functional_call(model, (p, buffers), (torch.stack([xi, xj]),)), dim=1)
        return e[0] @ e[1]

    pair_grads = vmap(grad(similarity), in_dims=(None, 0, 0))
    chunk = max(1, (1 << 24) // sum(p.numel() for p in params))

    def c() -> None:
        detached = {k: v.detach() for k, v in named.items()}
        with torch.no_grad():
            e = embed(model, x1, x2)
            z = (e[:n] @ e[n:].T).requires_grad_(True)
        with torch.enable_grad():
            (weights,) = torch.autograd.grad(symmetric_infonce(z, TAU).sum(), z)
        ii, jj = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        ii, jj, w = ii.flatten(), jj.flatten(), weights.flatten()
        total = {k: torch.zeros_like(v) for k, v in detached.items()}
        for s in range(0, n * n, chunk):
            g = pair_grads(detached, x1[ii[s : s + chunk]], x2[jj[s : s + chunk]])
            norms = torch.sqrt(sum(t.reshape(t.shape[0], -1).square().sum(1) for t in g.values()))
            f = clip_factors(norms, BOUND) * w[s : s + chunk]
            for k, t in g.items():
                total[k] += torch.einsum("b,b...->...", f, t)
        for k, v in named.items():
            v.grad = total[k]

    def body(variant: str) -> Callable[[], object]:
        clippers: dict[str, BatchClipper | PairClipper] = {"b": pair, "d": batch}
        clipped = clippers.get(variant)
        if clipped is not None:
            return lambda: (clipped.accumulate(x1, x2), clipped.take_sum())
        return {"a": a, "c": c}[variant]

    def wrap(body: Callable[[], object]) -> Callable[[], None]:
        def step() -> None:
            body()
            for p in params:
                p.grad = None

        return step

    return {v: wrap(body(v)) for v in variants}


def peak_memory(args: argparse.Namespace, n: int, variant: str) -> float:
    """MiB of peak memory one step of ``variant`` needs beyond the set-up, in this process."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    step = make_steps(args, n, [variant])[variant]
    step()
    base = reset_peak()
    step()
    return (peak() - base) / 2**20


def interleaved_times(
    args: argparse.Namespace, n: int, variants: list[str]
) -> dict[str, list[float]]:
    steps = make_steps(args, n, variants)
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v, step in steps.items():
            t = time.perf_counter()
            step()
            times[v].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="16,32,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=16, help="projection (embedding) dimension d")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--img-size", type=int, default=32)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--variants", default="abcd")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--naive-up-to", type=int, default=128, help="largest n at which (c) runs")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"ViT width {args.width}, depth {args.depth}, {args.img_size} px / patch {args.patch}, "
        f"projection d = {args.dim}, tau {TAU}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} threads: time = fastest of {args.rounds} interleaved rounds "
        "(median of per-round ratios in brackets), memory = peak beyond set-up, own process"
    )
    for n in (int(s) for s in args.ns.split(",")):
        print(f"n={n:4d} load average before {load_average()}")
        variants = [v for v in args.variants if v != "c" or n <= args.naive_up_to]
        memory = {}
        for v in variants:
            got = in_own_process(peak_memory, args, n, v)
            if isinstance(got, str):
                print(f"n={n} ({v}) failed: {got}")
                continue
            memory[v] = got
        times = interleaved_times(args, n, list(memory))
        fastest = {v: min(ts) for v, ts in times.items()}
        for v in memory:
            median = statistics.median(times[v])
            label = LABELS[v]
            print(
                f"n={n:4d} ({v}) {label:42s} {fastest[v]:9.3f} s (median {median:8.3f})   "
                f"peak +{memory[v]:8.1f} MiB"
            )

        def ratio(
            p: str,
            q: str,
            fastest: dict[str, float] = fastest,
            memory: dict[str, float] = memory,
            times: dict[str, list[float]] = times,
        ) -> str:
            time_ratio, memory_ratio = fastest[p] / fastest[q], memory[p] / max(memory[q], 1e-3)
            rounds = statistics.median(x / y for x, y in zip(times[p], times[q], strict=True))
            return f"{p}/{q} time {time_ratio:6.2f} ({rounds:6.2f}) memory {memory_ratio:6.2f}"

        pairs = [("b", "a"), ("d", "a"), ("c", "b")]
        print(
            f"n={n:4d} "
            + "   ".join(ratio(p, q) for p, q in pairs if p in fastest and q in fastest)
        )
        print(f"n={n:4d} load average after {load_average()}")


if __name__ == "__main__":
    main()
