"""Run by test_training_runs under 1 process or ``torchrun --nproc_per_node 2``: each rank
holds its share of a known clipped sum, calls ``noisy_mean_gradient`` and rank 0 writes the
noise statistics of the resulting update to the JSON file named on the command line."""

import json
import sys

import torch
import torch.distributed as torch_dist

from training.distributed import Dist
from training.dp import noisy_mean_gradient

SIGMA, CLIP, BATCH, SIZE = 1.1, 0.1, 32.0, 400_000

dist = Dist.from_env("cpu")
param = torch.nn.Parameter(torch.zeros(SIZE))
param.grad = torch.full((SIZE,), 0.64 / dist.world)  # the clipped sum, split across ranks
noisy_mean_gradient([param], SIGMA, CLIP, BATCH, torch.Generator().manual_seed(3), dist)
update = param.grad
gathered = [torch.zeros_like(update) for _ in range(dist.world)]
if dist.world > 1:
    torch_dist.all_gather(gathered, update)
else:
    gathered = [update]
if dist.main:
    with open(sys.argv[1], "w") as f:
        json.dump({
            "world": dist.world, "sigma": SIGMA, "clip": CLIP, "batch": BATCH,
            "std": (update - 0.64 / BATCH).std().item(), "mean_signal": update.mean().item(),
            "ranks_agree": all(torch.equal(g, update) for g in gathered),
        }, f)
dist.close()
