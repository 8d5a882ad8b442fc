"""One-run privacy auditing (Steinke, Nasr and Jagielski, NeurIPS 2023, arXiv 2305.08846).

m canaries are each put in the training data with probability 1/2 (a secret bit), training
runs once, every canary gets a score; the auditor guesses "in" for the r/2 highest scores and
"out" for the r/2 lowest and abstains on the rest. If the training is (epsilon, delta)-DP,
the number v of correct guesses is unlikely to be large: its p-value is (their Appendix D)

    p(eps) = f(v) + 2 m delta max_{i=1..v} (f(v - i) - f(v)) / i,
    f(x) = P[Binomial(r, e^eps / (1 + e^eps)) >= x],

and the lower bound is the largest eps with p(eps) <= beta. The guess counts are a grid
fixed before training, with beta split evenly across it (Bonferroni), so looking at the
scores to choose r cannot inflate the bound. ``vip-hub verify`` recomputes the bound from the
counts a ledger records, and the audit's ``ceiling`` (every guess right): about 5.3 at
m = 1,000 and 6.4 at m = 6,000 (beta 0.05, delta 1e-5), so a claim at or above it cannot be
shown violated and the audit then catches only gross bugs.

The scores come from white-box Dirac gradient canaries read off each step's noisy sum:
a canary's coordinate is y_t = c_t + N(0, sigma^2) in units of the sensitivity, where c_t is
1 when the canary was sampled at step t; the per-step log-likelihood ratio of "in" against
"out" is log(1 - q + q exp((2 y_t - 1) / (2 sigma^2))) and its sum over steps is the score.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_CANARIES",
    "DEFAULT_DELTA",
    "MAX_CANARIES",
    "MAX_GUESS_COUNTS",
    "bound_over_grid",
    "ceiling",
    "correct_guesses",
    "epsilon_lower_bound",
    "guess_grid",
    "log_likelihood_ratio",
    "p_value",
]

DEFAULT_BETA = 0.05
DEFAULT_DELTA = 1e-5
DEFAULT_CANARIES = 6000
"""m with the highest ceiling at beta 0.05 and delta 1e-5 (6.43; 5.27 at m = 1,000, falling again
beyond m ~ 6,000 through the 2 m delta term); its cost per step: the benchmarks' README."""
GRID_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
MAX_GUESS_COUNTS = len(GRID_FRACTIONS)
"""The most guess counts an audit records: its grid's (``guess_grid``)."""
MAX_CANARIES = 10**6
"""The most canaries an audit may record (every release so far: 6,000). More buy no audit a real
run wants: at beta 0.05 and delta 1e-5 the ceiling peaks at the default and falls beyond it (6.09
at 10^6), and even at delta 1e-12 it is 12.2 at 10^6, above any claim worth auditing, growing
only as log m. The ceiling and the bound take O(m) memory and time, in the run's export
(``training/dp/canaries.py``) as in ``verify``: under a second at the default, tens of seconds at
10^6, terabytes at 10^12."""
MAX_EPSILON = 50.0


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P-value of v or more correct guesses out of r, with m canaries, under (eps, delta)-DP."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    from scipy.stats import binom

    q = 1.0 / (1.0 + math.exp(-eps))
    tail = binom.sf(np.arange(v, -1, -1) - 1, r, q)  # tail[i] = P[Bin >= v - i], i = 0..v
    excess = float(np.max((tail[1:] - tail[0]) / np.arange(1, v + 1))) if v else 0.0
    return float(tail[0] + 2 * m * delta * excess)


@functools.lru_cache(maxsize=4096)
def epsilon_lower_bound(m: int, r: int, v: int, beta: float, delta: float) -> float:
    """The largest eps whose p-value is <= beta (0 when even eps = 0 is not rejected); computed
    once per process for each setting (``verify`` asks again for every ledger's ceiling)."""
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, MAX_EPSILON
    if p_value(m, r, v, hi, delta) <= beta:
        return hi
    for _ in range(60):  # p_value grows with eps: bisect to ~1e-13 relative
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) <= beta else (lo, mid)
    return lo


def guess_grid(m: int) -> list[int]:
    """Guess counts fixed before training: fractions of m, even (half "in", half "out"), at
    most m."""
    top = m - m % 2
    return sorted({min(max(2, 2 * round(m * f / 2)), top) for f in GRID_FRACTIONS if m * f >= 2})


def correct_guesses(
    scores: Sequence[float] | np.ndarray, secrets: Sequence[bool] | np.ndarray, r: int
) -> int:
    """Correct guesses when the r/2 highest scores are called "in" and the r/2 lowest "out"."""
    order = np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")
    bits = np.asarray(secrets, dtype=bool)
    half = r // 2
    return int(bits[order[len(order) - half :]].sum() + (~bits[order[:half]]).sum())


def bound_over_grid(m: int, results: Sequence[tuple[int, int]], beta: float, delta: float) -> float:
    """The lower bound at confidence 1 - beta from (r, v) pairs of a grid fixed in advance."""
    share = beta / len(results)
    return max(epsilon_lower_bound(m, r, v, share, delta) for r, v in results)


def ceiling(m: int, beta: float, delta: float) -> float:
    """The largest lower bound an audit of m canaries can reach: every guess right at the grid's
    best count. A claimed epsilon at or above it cannot be shown violated."""
    return bound_over_grid(m, [(r, r) for r in guess_grid(m)], beta, delta)


def log_likelihood_ratio(y: np.ndarray, sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """Per-step score of Dirac canaries observed as y = c + N(0, sigma^2), c in {0, 1} w.p. q."""
    z = (2.0 * np.asarray(y, dtype=np.float64) - 1.0) / (2.0 * noise_multiplier**2)
    return np.logaddexp(
        math.log1p(-sample_rate) if sample_rate < 1 else -np.inf, math.log(sample_rate) + z
    )
