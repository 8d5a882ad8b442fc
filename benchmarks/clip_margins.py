"""What the proved clipped sum (issue 52, ``fp64-capped``) costs in clipping, on real images: how
far each example's norm bound sits above its exact norm, and how often the cross-term cap
(kappa = ``CROSS_CAP``) clips an example harder than its norm asks. Both change only the clip
factors, so where the bound is within 1e-6 of the norm and the cap never binds, the trained
model and its top-1 are those of exact clipping.

The committed (Syn)-ViP prior (``training/priors``) as the main job's ViP stage trains it (the MAE
at 28 px, its decoder), on public Fashion-MNIST test images; the exact per-example norms from
each example's own fp64 backward. Never fails; prints the figures.

    python benchmarks/clip_margins.py [--examples 256] [--batch 64] [--clip 1.0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, cast

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.data.labelled import fashion_mnist  # noqa: E402
from training.dp.clipping import PerExampleClipper, capped_factors  # noqa: E402
from training.priors import prior_path  # noqa: E402
from training.recipes.mae import load_mae  # noqa: E402


def images(count: int, size: int, mean: list[float], std: list[float]) -> torch.Tensor:
    """``count`` public test images, 3 channels at ``size`` px, normalised as the encoder's."""
    test = fashion_mnist("test")
    x = torch.as_tensor(test.images[:count], dtype=torch.float32) / 255.0
    x = x.reshape(count, 1, *x.shape[-2:]).expand(count, 3, -1, -1)
    x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--clip", type=float, default=1.0, help="C (the main job's ViP stage: 1.0)")
    args = ap.parse_args()
    torch.manual_seed(0)
    mae, init = load_mae(prior_path("vip-nano-scatter"), {})
    cfg = cast(dict[str, Any], mae.encoder.pretrained_cfg)  # set by timm's create_model
    x = images(args.examples, init.spec.img_size, cfg["mean"], cfg["std"])
    noise = torch.rand(args.examples, mae.num_patches)
    clipper = PerExampleClipper(mae, args.clip)
    exact_model = load_mae(prior_path("vip-nano-scatter"), {})[0].double()
    exact_model.load_state_dict(mae.state_dict())
    params = [p for p in exact_model.parameters() if p.requires_grad]
    gaps, capped, clipped = [], 0, 0
    for lo in range(0, args.examples, args.batch):
        rows = slice(lo, lo + args.batch)
        result = clipper.accumulate(x[rows], noise[rows])
        clipper.take_sum()
        for i, bound in zip(
            range(lo, min(lo + args.batch, args.examples)), result.norms, strict=True
        ):
            loss = exact_model(x[i : i + 1].double(), noise[i : i + 1].double()).sum()
            grads = torch.autograd.grad(loss, params)
            exact = torch.stack([g.square().sum() for g in grads]).sum().sqrt()
            gaps.append(float(bound / exact) - 1)
        uncapped = capped_factors(result.norms.square(), torch.zeros_like(result.norms), args.clip)
        capped += int((result.factors < uncapped * (1 - 1e-12)).sum())
        clipped += int((result.factors < 1).sum())
    gaps_t = torch.tensor(gaps)
    print(
        f"{args.examples} public Fashion-MNIST test images through the (Syn)-ViP prior's MAE, "
        f"C = {args.clip}: {clipped} clipped; norm bound / exact norm - 1: median "
        f"{gaps_t.median():.3g}, max {gaps_t.max():.3g} (min {gaps_t.min():.3g}); the cross-term "
        f"cap bound {capped} of {args.examples}"
    )


if __name__ == "__main__":
    main()
