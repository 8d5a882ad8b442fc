"""Issue 32, points 1 and 2: every stream a guarantee rests on is keyed by the whole 128-bit run
secret (no two streams of a run share a key or an output), and the noise sampler has the
Gaussian's tail far past the 5.77 sigma where torch's CPU float32 sampler stopped."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from training.dp.engine import NOISE_CHUNK, add_gaussian_noise
from training.dp.sampling import NOISE, standard_normal, step_generator, stream_words
from training.skeleton.config import RunConfig
from training.skeleton.distributed import Dist
from training.skeleton.run import Run
from vip_hub.errors import CheckpointError
from vip_hub.privacy.accounting import NOISE_SUPPORT

SECRET = 0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


def test_the_witness_streams_of_seed_7_now_differ() -> None:
    """Seed 7, 2^22-coordinate chunks: chunk 7 of step 2069 and chunk 7 of step 2416 were
    bit-identical (torch's CPU generator kept 32 bits of each stream's seed)."""
    assert NOISE_CHUNK == 1 << 22
    flat = torch.zeros(7 * NOISE_CHUNK + 4096)
    add_gaussian_noise(flat, 1.0, 7, 2069)
    first = flat[7 * NOISE_CHUNK :].clone()
    flat.zero_()
    add_gaussian_noise(flat, 1.0, 7, 2416)
    assert not torch.equal(first, flat[7 * NOISE_CHUNK :])


# ------------------------------------------------- numpy's SeedSequence and Philox, vectorised
def _hashes(entropy: np.ndarray) -> np.ndarray:
    """numpy's ``SeedSequence(words).generate_state(2, np.uint64)`` (Philox's key) for each row
    of ``entropy`` (uint32 words, more than the pool's 4), as (rows, 4) uint32."""
    mult_a, mix_l, mix_r = 0x931E8875, 0xCA01F9DD, 0x4973F715
    const = [0x43B0D7E5]

    def hashmix(value: np.ndarray) -> np.ndarray:
        value = value ^ np.uint32(const[0])
        const[0] = const[0] * mult_a & _U32
        value = value * np.uint32(const[0])
        return value ^ (value >> np.uint32(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = np.uint32(mix_l) * x - np.uint32(mix_r) * y
        return r ^ (r >> np.uint32(16))

    pool = [hashmix(entropy[:, i]) for i in range(4)]
    for src, dst in itertools.product(range(4), range(4)):
        if src != dst:
            pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, entropy.shape[1]):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[:, src]))
    out, const_b = [], 0x8B51F9DD
    for word in pool:  # generate_state: 4 words, one per pool entry
        value = word ^ np.uint32(const_b)
        const_b = const_b * 0x58F38DED & _U32
        value = value * np.uint32(const_b)
        out.append(value ^ (value >> np.uint32(16)))
    return np.stack(out, axis=1)


def _mulhilo(a: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 64-bit halves of a * b for a constant a and uint64 b."""
    m32, s32 = np.uint64(_U32), np.uint64(32)
    a_lo, a_hi = np.uint64(a & _U32), np.uint64(a >> 32)
    b_lo, b_hi = b & m32, b >> s32
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (ll >> s32) + (lh & m32) + (hl & m32)
    return hh + (lh >> s32) + (hl >> s32) + (mid >> s32), np.uint64(a) * b


def _philox_first(key: np.ndarray) -> np.ndarray:
    """The first raw 64-bit output of numpy's Philox (4x64-10, counter 1 after its increment) for
    each (key0, key1) row."""
    zero = np.zeros(len(key), dtype=np.uint64)
    ctr = [zero + np.uint64(1), zero, zero, zero]
    k0, k1 = key[:, 0].copy(), key[:, 1].copy()
    for r in range(10):
        if r:
            k0 += np.uint64(0x9E3779B97F4A7C15)
            k1 += np.uint64(0xBB67AE8584CAA73B)
        hi0, lo0 = _mulhilo(0xD2E7470EE14C6C93, ctr[0])
        hi1, lo1 = _mulhilo(0xCA5A826395121157, ctr[2])
        ctr = [hi1 ^ ctr[1] ^ k0, lo1, hi0 ^ ctr[3] ^ k1, lo0]
    return ctr[0]


def _keys_and_first_outputs(steps: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, ...]:
    words = np.array(stream_words(SECRET, NOISE, 0, 0), dtype=np.uint32)
    entropy = np.tile(words, (len(steps), 1))
    entropy[:, -2], entropy[:, -1] = steps, chunks
    with np.errstate(over="ignore"):
        key = _hashes(entropy).copy().view(np.uint64)
        return key, _philox_first(key)


def test_a_million_noise_streams_of_one_secret_share_no_key_and_no_first_output() -> None:
    steps, chunks = (a.ravel() for a in np.meshgrid(np.arange(10_000), np.arange(100)))
    rng = np.random.default_rng(0)
    sample = rng.choice(len(steps), 64, replace=False)
    key, first = _keys_and_first_outputs(steps[sample], chunks[sample])
    for i, j in enumerate(sample):  # the vectorised copy is numpy's own generator
        bits = step_generator(SECRET, NOISE, int(steps[j]), int(chunks[j])).bit_generator
        assert list(bits.state["state"]["key"]) == list(key[i])
        assert int(bits.random_raw()) == int(first[i])
    key, first = _keys_and_first_outputs(steps, chunks)
    assert len(np.unique(key.view(np.dtype((np.void, 16))))) == len(steps) == 1_000_000
    assert np.all(np.diff(np.sort(first)) != 0)


def test_streams_use_every_bit_of_the_secret() -> None:
    """Seeds that agree on their low 64 bits (all a 63-bit torch seed could carry) draw apart."""
    for bit in (0, 40, 70, 127):
        a = step_generator(SECRET, NOISE, 3, 1).random(4)
        b = step_generator(SECRET ^ (1 << bit), NOISE, 3, 1).random(4)
        assert not np.array_equal(a, b), bit


# ------------------------------------------------------------------------- the Gaussian's tail
def _forced(words: list[int]) -> float:
    """The sampler's draw when its generator's next raw 64-bit outputs are ``words``."""
    generator = step_generator(SECRET, NOISE, 0)
    state = generator.bit_generator.state
    state["buffer"] = np.array(words, dtype=np.uint64)
    state["buffer_pos"] = 0
    generator.bit_generator.state = state
    return float(standard_normal(generator, np.empty(1))[0])


def test_the_samplers_most_extreme_inputs_give_draws_past_8_sigma() -> None:
    """White-box: the ziggurat's base strip (index 0, largest offset) sends the draw to its tail,
    r - log(1 - u1)/r, accepted when -2 log(1 - u2) > (log(1 - u1)/r)^2. With u2 = 1 - 2^-53 the
    largest accepted u1 is 1 - 225 * 2^-53: |z| = 12.2255, inside the recorded support 12.2258
    (torch's CPU float32 Box-Muller stopped at 5.768)."""
    base = _U64 & ~0xFF  # index 0, every offset bit set
    near_one = _U64  # u = 1 - 2^-53
    z = _forced([base, ((1 << 53) - 225) << 11, near_one, near_one])
    assert 12.2 < abs(z) <= NOISE_SUPPORT
    z = _forced([base, ((1 << 53) - 10**6) << 11, near_one, near_one])  # a less extreme u1
    assert 8 < abs(z) < 12.2


@pytest.mark.slow
def test_the_noise_reaches_past_5_77_sigma_as_often_as_a_gaussian() -> None:
    """2 x 10^9 draws of the shipped noise: a Gaussian puts about 16 beyond |z| = 5.77 (torch's
    CPU float32 sampler none). Chunked (2^25 coordinates at a time); the bounds are the
    Poisson count's 10^-4 quantiles."""
    flat, draws, beyond = torch.empty(1 << 25), 0, 0
    for step in range(60):
        flat.zero_()
        add_gaussian_noise(flat, 1.0, SECRET, step)
        beyond += int((flat.abs() > 5.77).sum())
        draws += len(flat)
    expected = draws * 2 * stats.norm.sf(5.77)
    assert 15 < expected < 17
    assert stats.poisson.ppf(1e-4, expected) <= beyond <= stats.poisson.isf(1e-4, expected)


# -------------------------------------------------------------------------------- the secret
def test_a_run_secret_has_128_bits_and_a_run_folder_from_before_is_refused(tmp_path) -> None:
    from training.skeleton.checkpoint import load_checkpoint, save_checkpoint

    cfg = RunConfig(out=str(tmp_path / "repo"), seed=None)
    run = Run(cfg, Dist())
    text = (run.dir / "seed").read_text()
    assert len(text) == 32 and int(text, 16) == run.seed
    assert Run(cfg, Dist()).seed == run.seed  # a resumed run reads it back
    save_checkpoint(run.checkpoint_path, {"config": run.settings, "step": 3})
    assert load_checkpoint(run.checkpoint_path, run.settings)["step"] == 3
    (run.dir / "seed").write_text(str(2**61 + 12345))  # written before: a 62-bit integer
    with pytest.raises(CheckpointError, match="--restart"):
        Run(cfg, Dist())
    fresh = {Run(RunConfig(out=str(tmp_path / f"r{i}"), seed=None), Dist()).seed for i in range(3)}
    assert len(fresh) == 3 and max(fresh) >= 1 << 64  # each run its own; above 64 bits (p=1-2^-62)
