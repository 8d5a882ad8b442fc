"""Run by test_training_runs under 1 process or ``torchrun --nproc_per_node 2``: every rank runs
one DP-engine step on its shard of a known clipped sum (q = 1, so both layouts sample every
example) and rank 0 writes the noise statistics of the update and the audit canaries' scores
to the JSON file named on the command line."""

import json
import sys

import torch
import torch.distributed as torch_dist

from training.dp.clipping import PerExampleClipper
from training.dp.engine import Budget, DPEngine
from training.skeleton.distributed import Dist

SIGMA, CLIP, N, WIDTH = 1.1, 0.1, 40, 400_000

dist = Dist.from_env("cpu")
layer = torch.nn.Linear(1, WIDTH)  # x = 0: each example's gradient is all-ones on the bias
layer.weight.requires_grad_(False)


class Sum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum(1)


model = Sum()
budget = Budget.plan(
    dataset_size=N, batch_size=N, steps=1, epsilon=None, sigma=SIGMA, delta=1e-5, accountant="rdp"
)
optimizer = torch.optim.SGD([layer.bias], lr=0.0)
engine = DPEngine(
    PerExampleClipper(model, CLIP),
    optimizer,
    None,
    budget,
    sensitivity=CLIP,
    clipping_norm=CLIP,
    seed=3,
    dist=dist,
    micro_batch_size=16,
    audit_canaries=100,
)
# capture the noisy mean gradient before the optimiser clears it
seen: dict[str, torch.Tensor] = {}
optimizer.step = lambda: seen.setdefault("update", layer.bias.grad.clone())  # type: ignore[method-assign]
local = engine.plan(0)
parts = [(torch.zeros(len(local), 1)[i : i + 16],) for i in range(0, len(local), 16)]
stats = engine.step(0, parts)
update = seen["update"]
gathered = [torch.zeros_like(update) for _ in range(dist.world)]
if dist.world > 1:
    torch_dist.all_gather(gathered, update)
else:
    gathered = [update]
signal = N * CLIP / WIDTH**0.5 / N  # every example's bias gradient, clipped to C, summed, / B
if dist.main:
    with open(sys.argv[1], "w") as f:
        json.dump(
            {
                "world": dist.world,
                "sigma": SIGMA,
                "clip": CLIP,
                "batch": N,
                "sampled": stats.sampled,
                "std": (update - signal).std().item(),
                "mean_signal": update.mean().item(),
                "ranks_agree": all(torch.equal(g, update) for g in gathered),
                "canary_scores": engine.canaries.scores.tolist(),
            },
            f,
        )
dist.close()
