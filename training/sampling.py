"""Poisson sampling of logical batches, split into physical micro-batches.

Every random draw is a pure function of ``(seed, step, rank)`` (counter-based streams), so
the sampler's whole state is the step counter: a resumed run draws exactly the batches an
uninterrupted one would, and each rank has its own independent stream.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vip_hub.errors import AccountingError, ConfigError

__all__ = ["micro_batches", "poisson_sample", "rank_share", "step_generator", "torch_generator"]

# Stream tags keep the per-purpose random streams of one step independent.
SAMPLING, MASKING, AUGMENT, NOISE, CANARY_BITS = 1, 2, 3, 4, 5


def step_generator(seed: int, purpose: int, step: int, index: int = 0) -> np.random.Generator:
    """The numpy stream for one purpose at one step and ``index`` (a rank, an example or a chunk
    of the noise: each its own independent stream)."""
    return np.random.default_rng([seed, purpose, step, index])


def torch_generator(
    seed: int, purpose: int, step: int, index: int = 0, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A torch generator seeded from the same counter-based stream."""
    g = torch.Generator(device=device)
    g.manual_seed(int(step_generator(seed, purpose, step, index).integers(2**63)))
    return g


def rank_share(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The part of ``indices`` that rank ``rank`` of ``world`` owns (every index on exactly one
    rank)."""
    return indices[indices % world == rank]


def poisson_sample(
    n: int, sample_rate: float, seed: int, step: int, rank: int = 0, purpose: int = SAMPLING
) -> np.ndarray:
    """Indices in [0, n) each included independently with probability ``sample_rate``, sorted.

    Drawn as a Binomial(n, q) count then that many distinct indices, which has the same
    distribution as n coin flips and stays O(count) for very large n.
    """
    if not 0.0 < sample_rate <= 1.0:
        raise AccountingError(f"sample rate must be in (0, 1], got {sample_rate}")
    rng = step_generator(seed, purpose, step, rank)
    k = int(rng.binomial(n, sample_rate))
    return np.sort(rng.choice(n, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)


def micro_batches(indices: np.ndarray, size: int) -> list[np.ndarray]:
    """Split a logical batch into physical micro-batches of at most ``size`` (at least one,
    possibly empty: an empty Poisson sample is still a step)."""
    if size <= 0:
        raise ConfigError(f"micro-batch size must be positive, got {size}")
    parts = max(1, math.ceil(len(indices) / size))
    return [indices[i * size : (i + 1) * size] for i in range(parts)]
