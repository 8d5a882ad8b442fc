"""The run secret and its keyed random streams; Poisson sampling of logical batches; the noise.

Every random draw is a pure function of ``(secret, purpose, step, index)``, so a resumed run draws
exactly the batches and noise an uninterrupted one would, and each rank, example and noise chunk
has its own independent stream:

- Poisson sampling and the canaries' bits: numpy's ``Philox`` keyed by a ``SeedSequence`` of the
  whole 128-bit secret and the three counters, each one 32-bit word, so distinct tuples are
  distinct inputs (``stream_words``, ``step_generator``);
- the noise (``standard_normal``): Philox4x64-10 keyed by the secret itself, with (purpose, step,
  chunk, block) as the four 64-bit limbs of its counter, so no two blocks of a run share an input;
  written in integer tensor operations (``philox4x64``: drawn on the device on CUDA; numpy's own
  ``Philox``, the same words, on the CPU), turned into N(0, 1) by Box-Muller on 53-bit uniforms
  (|z| <= ``vip_hub.privacy.accounting.NOISE_SUPPORT``, 8.57 sigma).

torch generators (``torch_generator``, ``init_seed``: masks, augmentations, initialisation) keep
32 to 64 bits of their seed and carry no guarantee.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import torch

from vip_hub.errors import AccountingError, ConfigError

__all__ = [
    "NOISE_CHUNK",
    "SECRET_BITS",
    "box_muller_",
    "init_seed",
    "micro_batches",
    "new_secret",
    "noise_uniforms",
    "philox4x64",
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


# ------------------------------------------------------------------------------------ the noise
NOISE_CHUNK = 1 << 22
"""Coordinates per noise chunk: chunk k of a step's noise is its own stream (k in its counter)."""
_SPAN = 1 << 12
"""Box-Muller's layout: in each span of 4,096 coordinates of a chunk, coordinate i < 2,048 is
r_i cos(theta_i) and coordinate 2,048 + i is r_i sin(theta_i), r_i from the span's word i and
theta_i from its word 2,048 + i (contiguous halves: 11 against 13 ns a draw alternating)."""
_LIMB, _M32 = 1 << 64, (1 << 32) - 1
_PHILOX_M = (0xD2E7470EE14C6C93, 0xCA5A826395121157)
_PHILOX_W = (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)
_PHILOX_ROUNDS = 10
_ULP = 2.0**-53


def _int64(x: int) -> int:
    """The int64 whose bits are those of x mod 2^64 (torch has no uint64 arithmetic on CUDA)."""
    x %= _LIMB
    return x - _LIMB if x >> 63 else x


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >> bits`` of the unsigned 64-bit words ``x`` holds (int64's shift copies the sign)."""
    return torch.bitwise_right_shift(x, bits) & ((1 << (64 - bits)) - 1)


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 64 bits of the unsigned 128-bit product m x, from 32-bit halves: int64
    multiplication keeps the low 64 bits of every product, and the middle sum stays below 2^34."""
    m_lo, m_hi = m & _M32, m >> 32
    x_lo, x_hi = x & _M32, _shr(x, 32)
    lo_hi, hi_lo = x_lo * m_hi, x_hi * m_lo
    mid = _shr(x_lo * m_lo, 32) + (lo_hi & _M32) + (hi_lo & _M32)
    hi = x_hi * m_hi + _shr(lo_hi, 32) + _shr(hi_lo, 32) + (mid >> 32)
    return hi, x * _int64(m)


def philox4x64(key: int, counter: torch.Tensor) -> torch.Tensor:
    """Philox4x64-10 (Salmon et al., SC 2011) under the 128-bit ``key`` of each row of ``counter``
    ((n, 4) int64: a 256-bit counter's 64-bit limbs, lowest first): (n, 4) words, as int64 bits."""
    if not 0 <= key < 1 << SECRET_BITS:
        raise ConfigError(f"a Philox key is an integer in [0, 2^{SECRET_BITS}), got {key}")
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key % _LIMB, key >> 64
    for _ in range(_PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ _int64(k0), lo1, hi0 ^ c3 ^ _int64(k1), lo0
        k0, k1 = (k0 + _PHILOX_W[0]) % _LIMB, (k1 + _PHILOX_W[1]) % _LIMB
    return torch.stack([c0, c1, c2, c3], -1)


def noise_uniforms(
    secret: int,
    purpose: int,
    step: int,
    chunk: int,
    start: int,
    count: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Words [start, start + count) of a noise chunk's stream as float64 uniforms (w >> 11) 2^-53
    in [0, 1): block b is Philox4x64-10 keyed by ``secret`` at counter (b, chunk, step, purpose)."""
    if not 0 <= secret < 1 << SECRET_BITS:
        raise ConfigError(f"a secret is an integer in [0, 2^{SECRET_BITS}), got {secret}")
    for name, value in (("purpose", purpose), ("step", step), ("chunk", chunk)):
        if not 0 <= value < _LIMB:
            raise ConfigError(f"noise {name} {value} is outside [0, 2^64)")
    if start < 0 or count < 0 or start + count > _LIMB:
        raise ConfigError(f"noise words [{start}, {start + count}) are outside [0, 2^64)")
    counter = (start // 4, chunk, step, purpose)
    device = torch.device(device)
    draw = _numpy_uniforms if device.type == "cpu" else _philox_uniforms
    return draw(secret, counter, start % 4, count, device)


def _numpy_uniforms(
    secret: int, counter: tuple[int, ...], skip: int, count: int, device: torch.device
) -> torch.Tensor:
    """``_philox_uniforms`` by numpy's Philox on the CPU: the same words, 16 times faster."""
    first = sum(limb << (64 * i) for i, limb in enumerate(counter))
    bits = np.random.Philox(key=secret, counter=(first - 1) % (1 << 256))  # it counts up first
    return torch.from_numpy(np.random.Generator(bits).random(skip + count)[skip:])


def _philox_uniforms(
    secret: int, counter: tuple[int, ...], skip: int, count: int, device: torch.device
) -> torch.Tensor:
    """Uniforms of the words from word ``skip`` of the block at ``counter`` on (its low limb
    counting up): ``philox4x64`` on ``device``, (w >> 11) 2^-53 of each word."""
    first, *high = counter
    blocks = -(-(skip + count) // 4)
    limbs = torch.empty(blocks, 4, dtype=torch.int64, device=device)
    limbs[:, 0] = torch.arange(first, first + blocks, device=device)
    limbs[:, 1:] = torch.tensor([_int64(v) for v in high], device=device)
    words = philox4x64(secret, limbs).reshape(-1)[skip : skip + count]
    return _shr(words, 11).double() * _ULP


def box_muller_(u: torch.Tensor) -> torch.Tensor:
    """N(0, 1) draws, in place, from float64 uniforms in [0, 1) paired along dim -2 (radius,
    angle): r = sqrt(-2 ln(u_0 + 2^-53)), u_0 + 2^-53 in (0, 1] so log(0) is impossible, and
    (r cos 2 pi u_1, r sin 2 pi u_1); |z| <= sqrt(106 ln 2) = 8.57. Returns ``u``."""
    radius, angle = u.unbind(-2)
    radius.add_(_ULP).log_().mul_(-2.0).sqrt_()
    cos = torch.cos(angle.mul_(2 * math.pi))
    angle.sin_().mul_(radius)
    radius.mul_(cos)
    return u


def standard_normal(
    secret: int,
    purpose: int,
    step: int,
    chunk: int,
    start: int,
    count: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Coordinates [start, start + count) of a noise chunk as float64 N(0, 1) draws on ``device``:
    ``box_muller_`` of the chunk's ``noise_uniforms`` in spans of 4,096 (``_SPAN``)."""
    first = start - start % _SPAN
    end = -(-(start + count) // _SPAN) * _SPAN
    u = noise_uniforms(secret, purpose, step, chunk, first, end - first, device)
    z = box_muller_(u.view(-1, 2, _SPAN // 2)).view(-1)
    return z[start - first : start - first + count]
