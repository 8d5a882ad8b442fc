"""Issues 32 and 52: every stream a guarantee rests on is keyed by the whole 128-bit run secret
(no two streams of a run share a key or an output), and the noise is Philox4x64-10 keyed by the
secret with (purpose, step, chunk, block) in its counter, drawn on the buffer's device, its
Gaussian reaching 8.57 sigma (torch's CPU float32 sampler stopped at 5.77)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from scipy import stats
from support.helpers import NEEDS_CUDA

import training.dp.sampling
from training.dp.engine import NOISE_CHUNK, add_gaussian_noise
from training.dp.sampling import (
    AUGMENT,
    CANARY_BITS,
    INIT,
    MASKING,
    NOISE,
    SAMPLING,
    box_muller_,
    init_seed,
    noise_uniforms,
    philox4x64,
    standard_normal,
    step_generator,
    stream_words,
)
from training.skeleton.config import RunConfig
from training.skeleton.distributed import Dist
from training.skeleton.run import Run
from vip_hub.errors import CheckpointError, ConfigError
from vip_hub.privacy.accounting import BOX_MULLER_SUPPORT, NOISE_SUPPORT

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


def _keys_and_first_outputs(steps: np.ndarray, ranks: np.ndarray) -> tuple[np.ndarray, ...]:
    words = np.array(stream_words(SECRET, SAMPLING, 0, 0), dtype=np.uint32)
    entropy = np.tile(words, (len(steps), 1))
    entropy[:, -2], entropy[:, -1] = steps, ranks
    with np.errstate(over="ignore"):
        key = _hashes(entropy).copy().view(np.uint64)
        return key, _philox_first(key)


def test_a_million_sampling_streams_of_one_secret_share_no_key_and_no_first_output() -> None:
    """The SeedSequence-keyed streams (Poisson sampling, canaries): 10^6 (step, rank) pairs."""
    steps, ranks = (a.ravel() for a in np.meshgrid(np.arange(10_000), np.arange(100)))
    rng = np.random.default_rng(0)
    sample = rng.choice(len(steps), 64, replace=False)
    key, first = _keys_and_first_outputs(steps[sample], ranks[sample])
    for i, j in enumerate(sample):  # the vectorised copy is numpy's own generator
        bits = step_generator(SECRET, SAMPLING, int(steps[j]), int(ranks[j])).bit_generator
        assert list(bits.state["state"]["key"]) == list(key[i])
        assert int(bits.random_raw()) == int(first[i])
    key, first = _keys_and_first_outputs(steps, ranks)
    assert len(np.unique(key.view(np.dtype((np.void, 16))))) == len(steps) == 1_000_000
    assert np.all(np.diff(np.sort(first)) != 0)


def test_streams_use_every_bit_of_the_secret() -> None:
    """Seeds that agree on their low 64 bits (all a 63-bit torch seed could carry) draw apart,
    in the SeedSequence streams and in the noise (both halves of Philox's key)."""
    for bit in (0, 40, 63, 64, 70, 127):
        a = step_generator(SECRET, SAMPLING, 3, 1).random(4)
        b = step_generator(SECRET ^ (1 << bit), SAMPLING, 3, 1).random(4)
        assert not np.array_equal(a, b), bit
        a, b = (standard_normal(s, NOISE, 3, 1, 0, 64) for s in (SECRET, SECRET ^ (1 << bit)))
        assert not torch.equal(a, b) and abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.5


def test_each_purpose_has_its_own_stream_and_the_public_init_seed_is_none_of_the_others() -> None:
    """The initialisation's seed is public (no guarantee rests on it): it must not be the first
    draw of the sampling, masking, augmentation or canary streams of any step, nor may any two
    purposes share a stream."""
    purposes = {SAMPLING, MASKING, AUGMENT, NOISE, CANARY_BITS, INIT}
    assert len(purposes) == 6
    for step in range(4):
        firsts = {p: int(step_generator(SECRET, p, step).integers(2**63)) for p in purposes}
        assert len(set(firsts.values())) == len(purposes)
        assert init_seed(SECRET) not in {v for p, v in firsts.items() if p != INIT}


# ---------------------------------------------- issue 52: Philox4x64-10 keyed by the whole secret
_U256 = (1 << 256) - 1


def _int64(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def _limbs(counter: int) -> list[int]:
    """A 256-bit counter as four int64 limbs (their bits), lowest first."""
    return [_int64((counter >> (64 * i)) & _U64) for i in range(4)]


def _numpy_words(key: int, counter: int, blocks: int) -> list[int]:
    """numpy's Philox4x64-10: the words of ``blocks`` blocks from ``counter`` on (it counts up
    before each block)."""
    bits = np.random.Philox(key=key, counter=(counter - 1) & _U256)
    return [int(w) for w in bits.random_raw(4 * blocks)]


_KEYS = [0, 1, SECRET, _U64, 1 << 64, (1 << 128) - 1, 0xFEDC_BA98 << 96]
_COUNTERS = [
    0,
    1,
    _U64 - 1,  # the low limb carries into the next within four blocks
    (1 << 128) - 2,  # two limbs carry
    (1 << 192) - 3,
    _U256 - 1,  # and the whole counter wraps to 0
    0x8000_0000_0000_0001 * sum(1 << (64 * i) for i in range(4)),  # every limb's sign bit set
]


@pytest.mark.parametrize("key", _KEYS)
def test_philox4x64_gives_numpys_words_bit_for_bit(key: int) -> None:
    """The tensor-operations Philox (what a device draws) against numpy's C one: edge counters
    (carries across limbs, the sign bit of every limb) and 1,000 random 256-bit counters."""
    rng = random.Random(key)
    for counter in [*_COUNTERS, *(rng.getrandbits(256) for _ in range(3))]:
        rows = torch.tensor([_limbs((counter + b) & _U256) for b in range(4)])
        got = [w & _U64 for w in philox4x64(key, rows).reshape(-1).tolist()]
        assert got == _numpy_words(key, counter, 4), hex(counter)
    counters = [rng.getrandbits(256) for _ in range(1000)]
    got = philox4x64(key, torch.tensor([_limbs(c) for c in counters])).tolist()
    assert [[w & _U64 for w in row] for row in got] == [_numpy_words(key, c, 1) for c in counters]


def test_philox4x64_refuses_a_key_beyond_128_bits() -> None:
    with pytest.raises(ConfigError, match="2\\^128"):
        philox4x64(1 << 128, torch.zeros(1, 4, dtype=torch.int64))


@pytest.mark.parametrize(
    ("purpose", "step", "chunk", "start", "count"),
    [
        (NOISE, 0, 0, 0, 4096),
        (NOISE, 7, 3, 5, 1001),  # from the middle of a block
        (NOISE, _U64, 1 << 63, 4093, 9),  # limbs at their extremes
        (_U64, 1, _U64, (1 << 40) + 2, 30),
        (0, 0, 0, 0, 8),  # the counter's first block: 0
    ],
)
def test_noise_words_are_the_secret_keyed_philox_at_the_documented_counter(
    purpose: int, step: int, chunk: int, start: int, count: int
) -> None:
    """Key = the secret, counter = block + chunk 2^64 + step 2^128 + purpose 2^192, the block's
    four words in order, each word w read as the 53-bit uniform (w >> 11) 2^-53; the same on the
    CPU (numpy's Philox) and through the device's tensor operations (run here on the CPU)."""
    counter = start // 4 + (chunk << 64) + (step << 128) + (purpose << 192)
    words = _numpy_words(SECRET, counter, (start % 4 + count + 3) // 4)[start % 4 :][:count]
    expected = torch.tensor([(w >> 11) * 2.0**-53 for w in words], dtype=torch.float64)
    assert torch.equal(noise_uniforms(SECRET, purpose, step, chunk, start, count), expected)
    layout = (start // 4, chunk, step, purpose)
    device = training.dp.sampling._philox_uniforms(SECRET, layout, start % 4, count, "cpu")
    assert torch.equal(device, expected)


def test_noise_uniforms_have_53_bits_in_0_1() -> None:
    u = noise_uniforms(SECRET, NOISE, 2, 1, 0, 1 << 20)
    k = u * 2.0**53
    assert torch.equal(k, k.round()) and 0 <= u.min() and u.max() < 1
    assert (k.remainder(2) == 1).float().mean().item() == pytest.approx(0.5, abs=0.005)  # bit 53
    assert u.max() > 1 - 1e-5 and u.min() < 1e-5


@pytest.mark.parametrize(
    "field", [{"secret": 1 << 128}, {"purpose": 1 << 64}, {"step": -1}, {"chunk": 1 << 64}]
)
def test_noise_streams_refuse_values_outside_their_limbs(field: dict[str, int]) -> None:
    args = {"secret": SECRET, "purpose": NOISE, "step": 0, "chunk": 0, **field}
    with pytest.raises(ConfigError):
        noise_uniforms(**args, start=0, count=4)


def test_the_gaussians_most_extreme_inputs_reach_8_57_sigma_and_the_support_is_that() -> None:
    """White-box: the smallest radius uniform 0 (so u = 2^-53) with the angle's 0, 1/4, 1/2, 3/4
    gives |z| = sqrt(106 ln 2) = 8.5717 on the cosine or the sine; the largest, 1 - 2^-53, gives
    r = 0 (not NaN); the recorded support c is that reach, within its rounding margin."""
    reach = math.sqrt(106 * math.log(2))
    angles = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.125, 0.3], dtype=torch.float64)
    u = torch.stack([torch.zeros_like(angles), angles])
    cos, sin = box_muller_(u)
    assert [abs(float(x)) for x in (cos[0], sin[1], cos[2], sin[3])] == pytest.approx(
        [reach] * 4, rel=1e-15
    )
    top = float(torch.stack([cos, sin]).abs().max())
    assert 8.57 < top <= NOISE_SUPPORT == BOX_MULLER_SUPPORT and NOISE_SUPPORT - top < 1e-10
    tiny = torch.tensor([[2.0**-53 * k for k in range(64)], [0.0] * 64], dtype=torch.float64)
    assert float(box_muller_(tiny).abs().max()) <= NOISE_SUPPORT  # the next few radii stay below
    one = torch.tensor([[1 - 2.0**-53], [0.3]], dtype=torch.float64)
    assert torch.equal(box_muller_(one), torch.zeros(2, 1, dtype=torch.float64))


def test_the_noise_is_standard_normal_in_both_halves_of_its_spans() -> None:
    """2^20 draws: mean, variance and Kolmogorov-Smirnov against N(0, 1), for all draws, the
    cosines and the sines; a cosine and the sine of the same radius are uncorrelated (so are
    their squares: E[r^4 cos^2 sin^2] = 1)."""
    z = standard_normal(SECRET, NOISE, 5, 2, 0, 1 << 20)
    spans = z.view(-1, 2, 2048)
    cos, sin = spans[:, 0].reshape(-1), spans[:, 1].reshape(-1)
    for part in (z, cos, sin):
        x, n = part.numpy(), len(part)
        assert abs(x.mean()) < 5 / n**0.5 and abs(x.var() - 1) < 5 * (2 / n) ** 0.5
        assert stats.kstest(x, "norm").pvalue > 1e-4
    n = len(cos)
    assert abs(float(torch.corrcoef(torch.stack([cos, sin]))[0, 1])) < 5 / n**0.5
    assert abs(float(torch.corrcoef(torch.stack([cos**2, sin**2]))[0, 1])) < 5 / n**0.5


def test_noise_of_distinct_purpose_step_or_chunk_is_independent() -> None:
    """Streams one field apart (purpose, step, chunk: neighbours and far values) are
    uncorrelated, also one word shifted (a stream that is another's continuation would not)."""
    n = 1 << 16
    base = standard_normal(SECRET, NOISE, 10, 3, 0, n + 1)
    for purpose, step, chunk in [
        (NOISE + 1, 10, 3),
        (NOISE, 11, 3),
        (NOISE, 10, 4),
        (NOISE, 10 + (1 << 40), 3),
        (NOISE, 10, 3 + (1 << 63)),
        (SAMPLING, 10, 3),
    ]:
        other = standard_normal(SECRET, purpose, step, chunk, 0, n + 1)
        assert not torch.equal(base, other)
        for a, b in ((base[:n], other[:n]), (base[1:], other[:n]), (base[:n], other[1:])):
            assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 5 / n**0.5


def test_noise_streams_of_distinct_purpose_step_and_chunk_share_no_word() -> None:
    """2,000 streams of one secret (2 purposes x 40 steps x 25 chunks), 1,024 words each: no two
    53-bit uniforms alike (a layout whose fields overlapped would repeat whole runs of them)."""
    draws = [
        noise_uniforms(SECRET, purpose, step, chunk, 0, 1024)
        for purpose, step, chunk in itertools.product((NOISE, NOISE + 1), range(40), range(25))
    ]
    words = (torch.cat(draws) * 2.0**53).long()
    assert len(torch.unique(words)) == len(words) == 2_048_000


def test_a_draw_does_not_depend_on_where_its_pieces_start() -> None:
    whole = standard_normal(SECRET, NOISE, 1, 0, 0, 3 * 4096 + 100)
    for start, count in [(5000, 4000), (4096, 4096), (1, 3), (12_000, 388)]:
        piece = standard_normal(SECRET, NOISE, 1, 0, start, count)
        assert torch.equal(piece, whole[start : start + count])


def test_the_engine_adds_chunk_ks_stream_scaled_in_float64_and_rounded_once() -> None:
    """Chunk k of the flat buffer gets stream (secret, NOISE, step, k) times std, added to the
    buffer in float64 and rounded once to float32."""
    flat = torch.full((NOISE_CHUNK + 5000,), 0.1)
    expected = flat.double()
    expected[:NOISE_CHUNK] += 2.5 * standard_normal(SECRET, NOISE, 9, 0, 0, NOISE_CHUNK)
    expected[NOISE_CHUNK:] += 2.5 * standard_normal(SECRET, NOISE, 9, 1, 0, 5000)
    add_gaussian_noise(flat, 2.5, SECRET, 9)
    assert torch.equal(flat, expected.float())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between ``a`` and ``b`` in units of the last place of the larger."""
    spacing = torch.from_numpy(np.spacing(np.maximum(a.abs().numpy(), b.abs().numpy())))
    return float(((a - b).abs() / spacing).max())


@NEEDS_CUDA
def test_cuda_draws_the_cpus_words_and_uniforms_and_its_gaussians_to_a_few_ulp() -> None:
    """The device's tensor-operations Philox gives numpy's words bit for bit, the same uniforms,
    Gaussians within 8 ulp (log, sqrt, cos and sin differ in their last bits between libraries)
    and, rounded to float32 after the add, the same noise within one float32 ulp."""
    rng = random.Random(5)
    for key in _KEYS:
        counters = [*_COUNTERS, *(rng.getrandbits(256) for _ in range(500))]
        rows = torch.tensor([_limbs(c) for c in counters], device="cuda")
        got = philox4x64(key, rows).cpu().tolist()
        assert [[w & _U64 for w in row] for row in got] == [
            _numpy_words(key, c, 1) for c in counters
        ]
    for start, count in [(0, 1 << 20), (4093, 10_000)]:
        cpu = noise_uniforms(SECRET, NOISE, 3, 2, start, count)
        assert torch.equal(noise_uniforms(SECRET, NOISE, 3, 2, start, count, "cuda").cpu(), cpu)
    cpu = standard_normal(SECRET, NOISE, 3, 2, 0, 1 << 20)
    cuda = standard_normal(SECRET, NOISE, 3, 2, 0, 1 << 20, "cuda").cpu()
    assert _ulps(cpu, cuda) <= 8
    extreme = torch.tensor([[0.0, 0.0], [0.0, 0.25]], dtype=torch.float64)
    assert float(box_muller_(extreme.cuda()).abs().max()) <= NOISE_SUPPORT
    flat = torch.zeros(NOISE_CHUNK + 5000)
    on_cuda = flat.cuda()
    add_gaussian_noise(flat, 1.0, SECRET, 4)
    add_gaussian_noise(on_cuda, 1.0, SECRET, 4)
    torch.testing.assert_close(on_cuda.cpu(), flat, rtol=2.0**-23, atol=1e-30)


@pytest.mark.slow
def test_the_noise_reaches_past_5_77_sigma_as_often_as_a_gaussian() -> None:
    """2 x 10^9 draws of the shipped noise: a Gaussian puts about 16 beyond |z| = 5.77 (torch's
    CPU float32 sampler none). Chunked (2^25 coordinates at a time); the bounds are the
    Poisson count's 10^-4 quantiles."""
    flat, draws, beyond = torch.empty(1 << 25), 0, 0
    for step in range(60):
        flat.zero_()
        add_gaussian_noise(flat, 1.0, SECRET, step)
        beyond += int(flat.abs_().gt_(5.77).sum())  # in place: a bool tensor's sum is 15x slower
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
    save_checkpoint(run.checkpoint_path, {"config": run.settings, "step": 3})
    assert Run(cfg, Dist()).seed == run.seed  # a resumed run reads it back
    assert load_checkpoint(run.checkpoint_path, run.settings)["step"] == 3
    (run.dir / "seed").write_text(str(2**61 + 12345))  # written before: a 62-bit integer
    with pytest.raises(CheckpointError, match="--restart"):
        Run(cfg, Dist())
    fresh = {Run(RunConfig(out=str(tmp_path / f"r{i}"), seed=None), Dist()).seed for i in range(3)}
    assert len(fresh) == 3 and max(fresh) >= 1 << 64  # each run its own; above 64 bits (p=1-2^-62)
