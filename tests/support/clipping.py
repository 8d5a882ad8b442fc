"""Clipping cases the DP tests share: a clipper's sum of one call, the Logit-DP sum of a linear
embedder in closed form and the adversary that maximises a neighbour's move of it, and a
token model for the ghost-norm and embedding paths; the update of a DP step that sampled nothing."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
from torch import nn

from training.dp.engine import Budget, DPEngine
from training.skeleton.distributed import Dist


def clipped_sum(clipper: object, *inputs: torch.Tensor) -> torch.Tensor:
    """The clipper's fp64 clipped sum of one call on ``inputs`` (taken: the next starts anew)."""
    if inputs[0].shape[0] == 0:  # the engine never calls a clipper on an empty sample
        return clipper.take_sum()
    clipper.accumulate(*inputs)
    return clipper.take_sum()


def linear_clipped_sum(
    w: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, bound: float, tau: float
) -> torch.Tensor:
    """The Logit-DP sum for the model e(x) = Wx / |Wx|, differentiably and in closed form:
    grad_W Z_ij = ((psi_j - Z_ij phi_i) / |W x_i|) x_i^T + ((phi_i - Z_ij psi_j) / |W x'_j|)
    x'_j^T."""
    n = x1.shape[0]
    if n == 0:
        return torch.zeros(w.numel(), dtype=w.dtype)
    h1, h2 = x1 @ w.T, x2 @ w.T
    r1, r2 = h1.norm(dim=1, keepdim=True), h2.norm(dim=1, keepdim=True)
    phi, psi = h1 / r1, h2 / r2
    z = phi @ psi.T
    eye = torch.eye(n, dtype=w.dtype)
    weights = ((z / tau).softmax(1) - eye + (z / tau).softmax(0) - eye) / (2 * tau)
    u = (psi[None] - phi[:, None] * z[..., None]) / r1[:, None]
    v = (phi[:, None] - psi[None] * z[..., None]) / r2[None]
    g = u[..., None] * x1[:, None, None, :] + v[..., None] * x2[None, :, None, :]
    clipped = g * torch.clamp(bound / g.flatten(2).norm(dim=2), max=1.0)[..., None, None]
    return (weights[..., None, None] * clipped).sum((0, 1)).reshape(-1)


def logit_dp_adversary(
    n: int, tau: float, bound: float, *, remove: bool, seed: int, steps: int = 60
) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """Weights and a batch of n examples chosen by gradient ascent to maximise the norm of the
    difference of the clipped sums with and without the last example (``remove``), or of the
    batch's own clipped sum (the capped mechanism's boundary: the batch with one more is
    skipped)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    x1 = torch.randn(n, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    x2 = torch.randn(n, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.Adam([w, x1, x2], lr=0.1)
    for _ in range(steps):
        diff = linear_clipped_sum(w, x1, x2, bound, tau)
        if remove:
            diff = diff - linear_clipped_sum(w, x1[:-1], x2[:-1], bound, tau)
        opt.zero_grad()
        (-diff.norm()).backward()
        opt.step()
    model = nn.Linear(6, 3, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w)
    return model, x1.detach(), x2.detach()


ADVERSARY_BOUND = 1e-3  # small: every pair is clipped, the adversary's best case


class TokenModel(nn.Module):
    """A captioning-like model on token ids: an embedding (repeated ids and padding), a wide layer
    (ghost norm over 100-150 tokens, in strips) and a narrow head (per-example products)."""

    def __init__(self, vocab: int = 13, dim: int = 320):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.head(nn.functional.gelu(self.hidden(self.norm(self.embed(ids)))))
        return (y - target).square().mean((1, 2))


def empty_step_update(
    clipper: Any, *, clip: float, sensitivity: float, sigma: float, batch: int, **engine: Any
) -> tuple[DPEngine, torch.Tensor]:
    """A DP step of ``clipper`` on an empty sample (n = 1,000, expected ``batch``, RDP) at learning
    rate 0: the engine and the flat update its optimiser received, the noise alone."""
    budget = Budget.plan(
        dataset_size=1000,
        batch_size=batch,
        steps=10,
        epsilon=None,
        sigma=sigma,
        delta=1e-5,
        accountant="rdp",
    )
    dp = DPEngine(
        clipper,
        torch.optim.SGD(clipper.params, lr=0.0),
        None,
        budget,
        sensitivity=sensitivity,
        clipping_norm=clip,
        seed=0,
        dist=Dist(device=torch.device("cpu")),
        **engine,
    )
    seen: dict[str, torch.Tensor] = {}
    dp.optimizer.step = lambda: seen.setdefault(  # type: ignore[method-assign]
        "update", torch.cat([p.grad.flatten() for p in clipper.params])
    )
    dp.step(0, [])  # nothing sampled: still a noisy step
    return dp, seen["update"]


def exact_gamma(k: int) -> Fraction:
    """Higham's gamma_k = k w / (1 - k w) for fp64 (w = 2^-53), in exact rationals."""
    w = Fraction(1, 2**53)
    return k * w / (1 - k * w)
