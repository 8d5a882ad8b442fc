"""The DP noise's draw, side by side: numpy's float64 ziggurat on the CPU (the sampler before issue
52, reproduced here) against Philox4x64-10 + Box-Muller (``training.dp.engine.add_gaussian_noise``,
drawn on the buffer's device). Interleaved rounds on one float32 buffer; medians of wall time
and of CPU time (all threads); never fails.

    python benchmarks/noise.py [--numel 34800000] [--rounds 7] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.dp.engine import add_gaussian_noise  # noqa: E402
from training.dp.sampling import NOISE, NOISE_CHUNK, step_generator  # noqa: E402

SECRET = 0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210


def ziggurat_noise(flat: torch.Tensor, std: float, seed: int, step: int) -> None:
    """The noise as it was drawn before: each 2^22-coordinate chunk from numpy's float64 ziggurat
    on its own SeedSequence-keyed Philox stream, on the CPU's threads, copied to the device."""
    cpu = flat.device.type == "cpu"
    size = 1 << 18 if cpu else NOISE_CHUNK
    chunks = flat.split(NOISE_CHUNK)
    in_numpy = cpu and flat.dtype in (torch.float32, torch.float64)

    def chunk(k: int) -> None:
        generator = step_generator(seed, NOISE, step, k)
        draw = np.empty(min(size, len(chunks[k])))
        for piece in chunks[k].split(size):
            z = generator.standard_normal(out=draw[: len(piece)])
            z *= std
            if in_numpy:
                out = piece.numpy()
                np.add(out, z, out=out, casting="unsafe")
            else:
                piece.add_(torch.from_numpy(z).to(piece.device))

    with ThreadPoolExecutor(min(torch.get_num_threads(), len(chunks))) as pool:
        list(pool.map(chunk, range(len(chunks))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=34_800_000, help="vip-tiny's MAE: 34.8 M")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    flat = torch.zeros(args.numel, device=args.device)

    def sync() -> None:
        if flat.device.type == "cuda":
            torch.cuda.synchronize()

    variants: dict[str, Callable[[torch.Tensor, float, int, int], None]] = {
        "ziggurat (numpy, CPU)": ziggurat_noise,
        "Philox4x64 + Box-Muller": add_gaussian_noise,
    }
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for fn in variants.values():
        fn(flat, 1.0, SECRET, 0)  # warm-up
    print(
        f"{args.numel:,} coordinates, float32 buffer on {args.device}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for r in range(args.rounds):
        for name, fn in variants.items():
            sync()
            w, c = time.perf_counter(), time.process_time()
            fn(flat, 1.0, SECRET, r + 1)
            sync()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    for name in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{name:26s} wall {w * 1e3:8.1f} ms ({w / args.numel * 1e9:5.2f} ns a coordinate), "
            f"CPU {c * 1e3:8.1f} ms"
        )
    old, new = variants
    ratios = [b / a for a, b in zip(wall[old], wall[new], strict=True)]
    print(f"new/old wall: median of per-round ratios {statistics.median(ratios):.2f}")
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
