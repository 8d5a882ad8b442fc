"""The run secret and its keyed random streams; Poisson sampling of logical batches.

Every random draw is a pure function of ``(secret, purpose, step, index)``: numpy's counter-based
``Philox`` keyed by a ``SeedSequence`` of the whole 128-bit secret and the three counters, each
one 32-bit word, so distinct tuples are distinct inputs (``stream_words``). A resumed run draws
exactly the batches and noise an uninterrupted one would, and each rank, example and noise chunk
has its own independent stream. Draws a guarantee rests on (Poisson sampling, the noise, the
canaries' bits) use these numpy streams only; torch generators (``torch_generator``,
``init_seed``: masks, augmentations, initialisation) keep 32 to 64 bits of their seed and carry
no guarantee.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import torch

from vip_hub.errors import AccountingError, ConfigError

__all__ = [
    "SECRET_BITS",
    "init_seed",
    "micro_batches",
    "new_secret",
    "poisson_sample",
    "rank_share",
    "standard_normal",
    "step_generator",
    "stream_words",
    "torch_generator",
]

# Stream tags keep the per-purpose random streams of one step independent.
SAMPLING, MASKING, AUGMENT, NOISE, CANARY_BITS, INIT = 1, 2, 3, 4, 5, 6

SECRET_BITS = 128
"""Bits of a run's secret: what keys every stream a guarantee rests on."""
_WORD = 1 << 32


def new_secret() -> int:
    """A fresh run secret of ``SECRET_BITS`` bits from the operating system's CSPRNG."""
    return int.from_bytes(secrets.token_bytes(SECRET_BITS // 8), "little")


def stream_words(seed: int, purpose: int, step: int, index: int = 0) -> list[int]:
    """The key material of one stream: the seed as four 32-bit words, then purpose, step and index
    one word each (a fixed layout: distinct tuples give distinct word lists)."""
    if not 0 <= seed < 1 << SECRET_BITS:
        raise ConfigError(f"a seed is an integer in [0, 2^{SECRET_BITS}), got {seed}")
    for name, value in (("purpose", purpose), ("step", step), ("index", index)):
        if not 0 <= value < _WORD:
            raise ConfigError(f"stream {name} {value} is outside [0, 2^32)")
    return [(seed >> (32 * i)) % _WORD for i in range(SECRET_BITS // 32)] + [purpose, step, index]


def step_generator(seed: int, purpose: int, step: int, index: int = 0) -> np.random.Generator:
    """The numpy stream for one purpose at one step and ``index`` (a rank, an example or a chunk
    of the noise: each its own independent stream): Philox keyed by the whole seed."""
    words = np.array(stream_words(seed, purpose, step, index), dtype=np.uint32)
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(words)))


def standard_normal(generator: np.random.Generator, out: np.ndarray) -> np.ndarray:
    """Fill the float64 ``out`` with N(0, 1) draws: numpy's ziggurat on 53-bit values, whose
    support reaches ``vip_hub.privacy.accounting.NOISE_SUPPORT`` (12.2 sigma)."""
    return generator.standard_normal(out=out)


def torch_generator(
    seed: int, purpose: int, step: int, index: int = 0, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A torch generator seeded from the same stream (63 bits, of which a CPU generator keeps 32:
    for masks and augmentations only, never for a draw a guarantee rests on)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(step_generator(seed, purpose, step, index).integers(2**63)))
    return g


def init_seed(seed: int) -> int:
    """A ``torch.manual_seed`` value for a model's initialisation (public: no guarantee rests on
    it), derived from ``seed``, which may have more bits than torch takes."""
    return int(step_generator(seed, INIT, 0).integers(2**63))


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
