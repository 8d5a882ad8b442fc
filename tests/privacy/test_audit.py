"""The one-run audit's arithmetic, checked against values computed independently."""

import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.stats import binom

from vip_hub.privacy.accounting import Accountant
from vip_hub.privacy.audit import (
    DEFAULT_CANARIES,
    bound_over_grid,
    ceiling,
    correct_guesses,
    epsilon_lower_bound,
    guess_grid,
    log_likelihood_ratio,
    p_value,
)
from vip_hub.privacy.ledger import Audit, AuditResult


@pytest.mark.parametrize(
    "m,r,delta,ceiling",
    [
        (200, 100, 0.0, 3.49),  # the notes' ceilings: every guess correct, beta 0.05
        (2000, 1000, 0.0, 5.81),
        (20_000, 10_000, 1e-5, 7.50),
    ],
)
def test_ceilings_when_every_guess_is_right(m, r, delta, ceiling):
    assert epsilon_lower_bound(m, r, r, 0.05, delta) == pytest.approx(ceiling, abs=0.005)


def test_all_correct_without_delta_is_the_closed_form():
    # P[Bin(r, p) >= r] = p^r = beta  =>  p = beta^(1/r), eps = log(p / (1 - p))
    for r in (10, 100, 1000):
        p = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, r, 0.05, 0.0) == pytest.approx(
            math.log(p / (1 - p)), rel=1e-9
        )


def test_p_value_against_a_direct_sum():
    m, r, v, eps, delta = 500, 60, 45, 1.2, 1e-4
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [binom.pmf(k, r, q) for k in range(r + 1)]
    tail = sum(pmf[v:])
    excess = max(sum(pmf[v - i : v]) / i for i in range(1, v + 1))
    assert p_value(m, r, v, eps, delta) == pytest.approx(tail + 2 * m * delta * excess, rel=1e-9)


def test_chance_level_guessing_proves_nothing():
    assert epsilon_lower_bound(1000, 1000, 500, 0.05, 1e-5) == 0.0
    assert epsilon_lower_bound(1000, 100, 55, 0.05, 0.0) == 0.0


def test_the_bound_grows_with_correct_guesses_and_falls_with_confidence():
    a = epsilon_lower_bound(1000, 200, 150, 0.05, 1e-5)
    b = epsilon_lower_bound(1000, 200, 180, 0.05, 1e-5)
    c = epsilon_lower_bound(1000, 200, 180, 0.01, 1e-5)
    assert 0 < a < b and c < b


def test_grid_is_fixed_in_advance_and_beta_is_split_across_it():
    grid = guess_grid(1000)
    assert grid == [20, 50, 100, 200, 500, 1000] and all(r % 2 == 0 for r in grid)
    results = [(r, r) for r in grid]
    assert bound_over_grid(1000, results, 0.05, 1e-5) == pytest.approx(
        max(epsilon_lower_bound(1000, r, r, 0.05 / len(grid), 1e-5) for r in grid)
    )


def test_the_grid_never_guesses_more_than_its_canaries():
    """An odd count rounded half up to 2 (m mod 4 = 3: 203 gave 204 guesses) made the ceiling
    raise in verify and the export; one canary, with no grid at all, is no audit."""
    for m in range(2, 5000):
        grid = guess_grid(m)
        assert grid and all(r % 2 == 0 and 2 <= r <= m for r in grid), m
    assert 0 < ceiling(203, 0.05, 1e-5) < 50
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        Audit(
            canaries=1,
            canary_norm=1.0,
            results=[AuditResult(guesses=1, correct=1)],
            beta=0.05,
            delta=1e-5,
            epsilon_lower_bound=0.0,
            ceiling=0.0,
            accountant_epsilon={a: 1.0 for a in Accountant},
        )


def test_guesses_take_the_top_and_bottom_halves():
    scores = [0.1, 5.0, 3.0, -2.0, 0.0, 4.0]
    bits = [False, True, False, False, True, True]
    # top 2 = indices 1, 5 (both in: 2 correct); bottom 2 = indices 3, 4 (3 out: 1 correct)
    assert correct_guesses(scores, bits, 4) == 3


def test_log_likelihood_ratio_is_the_exact_mixture_ratio():
    q, sigma = 0.2, 1.5
    y = np.array([-1.0, 0.0, 0.7, 2.5])
    in_density = (1 - q) * np.exp(-(y**2) / (2 * sigma**2)) + q * np.exp(
        -((y - 1) ** 2) / (2 * sigma**2)
    )
    out_density = np.exp(-(y**2) / (2 * sigma**2))
    np.testing.assert_allclose(
        log_likelihood_ratio(y, q, sigma), np.log(in_density / out_density), rtol=1e-12
    )


def test_the_ceiling_is_every_guess_right_and_the_default_count_maximises_it():
    assert ceiling(1000, 0.05, 1e-5) == pytest.approx(5.27, abs=0.005)  # the "about 5.3"
    assert ceiling(10_000, 0.05, 1e-5) == pytest.approx(6.39, abs=0.005)
    best = ceiling(DEFAULT_CANARIES, 0.05, 1e-5)
    assert best == pytest.approx(6.43, abs=0.005)
    assert all(ceiling(m, 0.05, 1e-5) < best for m in (1000, 5000, 5500, 6500, 7000, 20_000))
