"""Cost of one DP-AdamW step, side by side on the same MAE and batch (ratios; never fails).

(a) a non-private AdamW step: mean loss, one backward;
(b) our DP-AdamW step: book-keeping ghost clipping (``training.clipping``), noise, AdamW;
(c) the reference approach: per-example gradients materialised with ``torch.func.vmap``,
    clipped, summed, noised.

Each variant runs in its own process so peak memory is its own: the peak is read on CUDA
from the allocator, on CPU as the peak resident set size (VmHWM, reset after set-up) minus
the set-up's. Prints time and memory per variant and the ratios b/a and c/b.

    python benchmarks/dp_step.py [--arch vip-tiny] [--img-size 224] [--batch 32] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_variant(variant: str, arch: str, img_size: int, batch: int, steps: int, device: str) -> dict:
    import torch
    from torch.func import functional_call, grad, vmap

    from training.clipping import PerExampleClipper
    from training.distributed import Dist
    from training.dp import noisy_mean_gradient
    from training.loop import new_mae
    from training.mae import DecoderConfig
    from training.optim import make_adamw
    from vip_hub.models import EncoderSpec

    dev = torch.device(device)
    torch.manual_seed(0)
    mae = new_mae(EncoderSpec(arch, img_size=img_size), DecoderConfig()).to(dev)
    opt = make_adamw(mae, 1e-4, 0.005)
    x = torch.randn(batch, 3, img_size, img_size, device=dev)
    noise = torch.rand(batch, mae.num_patches, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    clipper = PerExampleClipper(mae, 0.1)
    params = {k: v for k, v in mae.named_parameters() if v.requires_grad}
    buffers = dict(mae.named_buffers())
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)

    def loss_one(p, xi, ni):
        return functional_call(mae, (p, buffers), (xi[None], ni[None])).sum()

    def step() -> None:
        with amp:
            if variant == "a":
                mae(x, noise).mean().backward()
            elif variant == "b":
                clipper.accumulate(x, noise)
                noisy_mean_gradient(clipper.params, 1.0, 0.1, batch, gen, Dist(device=dev))
            else:
                detached = {k: v.detach() for k, v in params.items()}
                per = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(detached, x, noise)
                norms = torch.sqrt(sum(g.float().reshape(batch, -1).square().sum(1) for g in per.values()))
                f = (0.1 / (norms + 1e-6)).clamp(max=1.0)
                for k, p in params.items():
                    p.grad = torch.einsum("b,b...->...", f, per[k].float()).to(p.dtype)
                noisy_mean_gradient(list(params.values()), 1.0, 0.1, batch, gen, Dist(device=dev))
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (allocations, AdamW state)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = _rss_kib("VmRSS") * 1024
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _rss_kib("VmHWM") * 1024
    return {"variant": variant, "time_s": sorted(times)[len(times) // 2], "peak_extra_mib": (peak - base) / 2**20,
            "base_mib": base / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="vip-tiny")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--variants", default="abc")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args.arch, args.img_size, args.batch, args.steps, args.device)))
        return
    print(f"{args.arch}, {args.img_size} px, batch {args.batch}, {args.device}, median of {args.steps} steps")
    results = {}
    for v in args.variants:
        cmd = [sys.executable, __file__, "--child", v, "--arch", args.arch, "--img-size", str(args.img_size),
               "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(f"({v}) failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results[v] = r
        label = {"a": "non-private AdamW", "b": "DP-AdamW (ghost clipping)", "c": "vmap per-example grads"}[v]
        print(f"({v}) {label:28s} {r['time_s']:8.3f} s/step   peak +{r['peak_extra_mib']:8.1f} MiB "
              f"(over {r['base_mib']:.0f} MiB set-up)")
    if "a" in results and "b" in results:
        a, b = results["a"], results["b"]
        print(f"b/a: time {b['time_s'] / a['time_s']:.2f}  memory {b['peak_extra_mib'] / max(a['peak_extra_mib'], 1e-9):.2f}"
              "   (targets on CPU for vip-tiny at batch 32: <= 1.3 and <= 1.3)")
    if "b" in results and "c" in results:
        b, c = results["b"], results["c"]
        print(f"c/b: time {c['time_s'] / b['time_s']:.2f}  memory {c['peak_extra_mib'] / max(b['peak_extra_mib'], 1e-9):.2f}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
