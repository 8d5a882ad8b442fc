"""Privacy accounting for Poisson-subsampled Gaussian mechanisms (DP-SGD, DP-AdamW, Logit-DP).

Three accountants, none written here: Opacus' RDP (the ViP paper's choice, the default) and
PRV, and Google's PLD (``dp_accounting``). Every DP stage of a ledger carries all three
epsilons; the one it names is the claim, the other two are reference figures.

PLD settings: add/remove-one adjacency, value discretisation interval ``PLD_INTERVAL``
(1e-3) with dp_accounting's pessimistic discretisation, so the figure stays an upper bound;
at 1e-3 it is within 0.05% of the 1e-4 figure and takes 0.03-0.15 s for 10,000 steps.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from ..errors import AccountingError

if TYPE_CHECKING:  # for the annotations: at run time the functions import dp_accounting
    from dp_accounting.dp_event import ComposedDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

__all__ = [
    "Accountant",
    "AccountingError",
    "DEFAULT_DELTA_CAP",
    "DEFAULT_DELTA_RULE",
    "GaussianRun",
    "MAX_STEPS",
    "BOX_MULLER_SUPPORT",
    "CURAND_FLOAT32_SUPPORT",
    "NOISE_SAMPLER",
    "NOISE_SAMPLERS",
    "NOISE_SUPPORT",
    "ZIGGURAT_SAMPLER",
    "ZIGGURAT_SUPPORT",
    "calibrate",
    "check_delta",
    "composed_epsilon",
    "default_delta",
    "resolve_delta",
    "is_weak_delta",
    "epsilon",
    "epsilons",
    "max_steps_within",
    "noise_sampler",
    "paper_delta",
    "remaining_epsilon",
    "truncation_delta",
]

DEFAULT_DELTA_CAP = 1e-5
"""The default delta is never above this, whatever n."""
DEFAULT_DELTA_RULE = f"min({DEFAULT_DELTA_CAP:g}, 1/(10n))"
"""The default delta in words, for help texts (:func:`default_delta` computes it)."""
PRV_EPS_ERROR = 0.01
PRV_MAX_EPSILON = 1000.0
"""Past this epsilon (under RDP) the PRV accountant's grid outgrows memory: refused by name."""
PLD_MAX_EPSILON = 1e5
"""Past this epsilon (under RDP) the PLD accountant's grid outgrows memory (gigabytes at 10^6,
tens at 10^8): refused by name."""
MAX_STEPS = 10**7
"""The most steps of one run the accountants are asked about (the PLD accountant takes seconds
and gigabytes at 10^7, minutes at 10^8): far beyond any training run."""
PLD_INTERVAL = 1e-3
MIN_SIGMA, MAX_SIGMA = 1e-2, 1e4
"""The noise multipliers a calibration searches between."""
EPSILON_TOLERANCE = 1e-3
"""How far below its target a calibrated epsilon may fall (the search stays within the target)."""


class Accountant(StrEnum):
    """Supported accountants."""

    RDP = "rdp"
    PRV = "prv"
    PLD = "pld"

    @property
    def others(self) -> tuple[Accountant, ...]:
        """The accountants a ledger reports beside this one, for reference."""
        return tuple(a for a in Accountant if a is not self)


GaussianRun = tuple[float, float, int]
"""One homogeneous run of steps: (noise multiplier sigma, sample rate q, steps T)."""


ZIGGURAT_R = 3.6541528853610088
"""Where numpy's float64 ziggurat (``random_standard_normal``) starts its tail."""
BOX_MULLER_SUPPORT = math.sqrt(106 * math.log(2)) * (1 + 2**-40)
"""c = 8.5717 of vip-hub's noise sampler (``training.dp.sampling.standard_normal``): Box-Muller
r cos(2 pi v), r sin(2 pi v) with r = sqrt(-2 ln u) and u = (k + 1) 2^-53 >= 2^-53 (k a 53-bit
integer), so |z| <= sqrt(106 ln 2), reached at u = 2^-53 with v = 0 (cosine) or 1/4 (sine); the
factor 1 + 2^-40 covers the rounding of log, sqrt, cos or sin and the product (a few ulp)."""
ZIGGURAT_SUPPORT = ZIGGURAT_R + math.sqrt(106 * math.log(2))
"""c = 12.226 of numpy's float64 ziggurat, vip-hub's sampler before Philox on the device (issue
52): its tail returns r + x with x = -log(1 - u1) / r accepted only when -2 log(1 - u2) > x^2,
and u2 is a multiple of 2^-53 below 1, so x^2 < 2 * 53 ln 2."""
CURAND_FLOAT32_SUPPORT = math.sqrt(66 * math.log(2))
"""c = 6.76 of torch's CUDA float32 ``normal`` (curand's Box-Muller on 32-bit uniforms offset by
2^-33), the reference code's sampler, with which imported releases are recorded."""
NOISE_SAMPLER = "philox4x64-10 box-muller-53"
"""The noise sampler vip-hub ships: Philox4x64-10 keyed by the run's secret, Box-Muller."""
ZIGGURAT_SAMPLER = "numpy float64 ziggurat"
"""The noise sampler of the releases before Philox (issue 52): numpy's float64 ziggurat."""
NOISE_SAMPLERS: dict[str, float] = {
    NOISE_SAMPLER: BOX_MULLER_SUPPORT,
    ZIGGURAT_SAMPLER: ZIGGURAT_SUPPORT,
    "curand float32 box-muller": CURAND_FLOAT32_SUPPORT,
}
"""Every noise sampler a ledger may name by its support c: ``verify`` refuses any other c."""
NOISE_SUPPORT = NOISE_SAMPLERS[NOISE_SAMPLER]
"""c: no draw of the noise sampler vip-hub ships exceeds it in absolute value."""


def noise_sampler(support: float) -> str | None:
    """The known sampler (``NOISE_SAMPLERS``) whose support is ``support``, else None."""
    return next(
        (name for name, c in NOISE_SAMPLERS.items() if math.isclose(support, c, rel_tol=1e-12)),
        None,
    )


def truncation_delta(
    sigma: float, sample_rate: float, steps: int, support: float, dimension: int
) -> float:
    """The delta a Gaussian sampler truncated to radius ``support`` adds to a run of ``steps``
    Poisson-sampled steps at (sigma, q) on ``dimension`` noised coordinates.

    Box-Muller draws coordinates in pairs sharing one radius r <= c, so the support is a disk
    per pair, not a box (a per-coordinate sampler's interval is the one-coordinate case). A
    neighbour shifts pair j by b_j (sum |b_j|^2 <= s^2, s = 1/sigma, at most d pairs); an output
    one dataset gives and the other cannot has r_j > c - |b_j| for some j, of mass at most
    sum_j P(c - |b_j| < r <= c) <= e^(-c^2/2) sum_j (e^(c |b_j|) - 1) / (1 - e^(-c^2/2))
    <= e^(-c^2/2) (c sqrt(d) s + e^(c s) - 1 - c s) / (1 - e^(-c^2/2)), counted once per step
    the record is sampled in: q T times that, at most 1 (``docs/architecture.md``, "The
    noise")."""
    x, half_square = support / sigma, 0.5 * support * support
    log_tail = -half_square - math.log(-math.expm1(-half_square))
    # log(e^x - 1 - x), without overflow: above x = 1; below, of (e - 2) x^2 >= it (its ratio to
    # x^2 grows with x), which no float underflow makes log(0)
    if x > 1:
        rest = x + math.log1p(-(1 + x) * math.exp(-x))
    else:
        rest = math.log(math.e - 2) + 2 * math.log(x) if x > 0 else -math.inf
    per_step = math.exp(log_tail) * x * math.sqrt(dimension) + math.exp(min(log_tail + rest, 0.0))
    return min(1.0, sample_rate * steps * per_step)


def default_delta(n: int) -> float:
    """The default delta for a dataset of ``n`` examples: min(1e-5, 1/(10n)), well below 1/n
    (at 1/(2n) a mechanism may publish one random record with probability 1/2)."""
    return min(DEFAULT_DELTA_CAP, _strong_delta_bound(n))


def resolve_delta(delta: float | None, n: int) -> float:
    """``delta`` when given, else ``default_delta(n)``: the delta a stage on ``n`` examples
    states."""
    return default_delta(n) if delta is None else delta


def _strong_delta_bound(n: int) -> float:
    """1/(10n): a larger delta is flagged weak wherever it is shown."""
    return 1.0 / (10 * _checked_size(n))


def is_weak_delta(delta: float, n: int) -> bool:
    """Whether ``delta`` is weak for ``n`` examples: above 1/(10n) (``verify`` and every page flag
    such a stage; the ViP paper's 1/(2n) and DP-Cap's 1/n are)."""
    return delta > _strong_delta_bound(n)


def check_delta(delta: float, n: int, allow_weak: bool) -> None:
    """Refuse a training delta above 1/n (a mechanism that publishes a random record can meet
    it) unless ``allow_weak`` (``--allow-weak-delta``) says it is meant."""
    if delta > 1.0 / _checked_size(n) and not allow_weak:
        raise AccountingError(
            f"delta {delta:g} is above 1/n = {1.0 / n:g} for n = {n}: such a guarantee allows "
            f"publishing a random record; use the default {DEFAULT_DELTA_RULE}, or pass "
            "--allow-weak-delta if this delta is meant"
        )


def paper_delta(n: int) -> float:
    """The ViP paper's delta, 1/(2n): an explicit choice (``--delta``) in training, never its
    default; what ``import-mae`` records of the paper's own checkpoints."""
    return 1.0 / (2 * _checked_size(n))


def _checked_size(n: int) -> int:
    if n <= 0:
        raise AccountingError(f"dataset size must be positive, got {n}")
    return n


def epsilon(
    sigma: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant | str = Accountant.RDP,
) -> float:
    """Epsilon after ``steps`` Poisson-sampled Gaussian steps at (sigma, q), for ``delta``."""
    return composed_epsilon([(sigma, sample_rate, steps)], delta, accountant)


def epsilons(sigma: float, sample_rate: float, steps: int, delta: float) -> dict[Accountant, float]:
    """Epsilon under every accountant, for one homogeneous run."""
    return {a: epsilon(sigma, sample_rate, steps, delta, a) for a in Accountant}


def composed_epsilon(
    history: Sequence[GaussianRun], delta: float, accountant: Accountant | str = Accountant.RDP
) -> float:
    """Epsilon of the composition of several runs (e.g. every DP stage on one dataset)."""
    kind = _check_accountant(accountant)
    _check_delta(delta)
    if not history:
        return 0.0
    for sigma, q, steps in history:
        _check_mechanism(sigma, q, steps)
    try:
        eps = _epsilon(
            tuple((float(s), float(q), int(t)) for s, q, t in history), float(delta), kind
        )
    except ArithmeticError as e:  # a noise multiplier whose square under- or overflows
        size = "large" if max(s for s, _, _ in history) > MAX_SIGMA else "small"
        raise AccountingError(
            f"the {kind.value} accountant cannot compute epsilon for {list(history)} ({e}): "
            f"the noise multiplier is far too {size} for its arithmetic"
        ) from None
    if not math.isfinite(eps):  # PLD's grid at a delta below its resolution: no bound at all
        raise AccountingError(
            f"the {kind.value} accountant gives no finite epsilon at delta {delta:g} for "
            f"{list(history)}: the delta is too small for it to resolve; use a larger delta"
        )
    # RDP's and PRV's conversions go below 0 at large deltas (0.1 and up at sigma 1); a
    # mechanism that is (eps, delta)-DP for an eps < 0 is (0, delta)-DP, as PLD states it
    return max(eps, 0.0)


_WARNING_FILTERS = threading.RLock()
"""Held while an accountant runs with the warnings silenced: ``warnings.catch_warnings`` saves
and restores the process's filters, so two threads inside it at once could leave them silenced."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The accountants' numerical warnings silenced, one thread at a time (re-entrant: a PLD
    calibration computes epsilons inside it)."""
    with _WARNING_FILTERS, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            yield


@functools.lru_cache(maxsize=4096)
def _epsilon(history: tuple[GaussianRun, ...], delta: float, kind: Accountant) -> float:
    """The accountants are deterministic: each (history, delta) is computed once per process."""
    with _quiet():
        if kind is not Accountant.RDP:
            _check_grid(history, delta, kind)
        if kind is Accountant.PLD:
            return _pld_epsilon(history, delta)
        if kind is Accountant.RDP:
            return _rdp_epsilon(history, delta)
        from opacus.accountants import PRVAccountant

        acc = PRVAccountant()
        acc.history = list(history)
        try:
            return float(acc.get_epsilon(delta=delta, eps_error=PRV_EPS_ERROR))
        except ValueError as e:  # a delta below its grid's floating-point resolution
            raise AccountingError(
                f"delta {delta:g} is too small for the PRV accountant to resolve ({e}): "
                "use a larger delta"
            ) from None
        except RuntimeError as e:  # a delta above every delta(eps) of its grid
            if "Cannot compute epsilon" not in str(e):
                raise
            raise AccountingError(
                f"delta {delta:g} is too large for the PRV accountant to resolve: use a smaller "
                "delta"
            ) from None


def _check_grid(history: tuple[GaussianRun, ...], delta: float, kind: Accountant) -> None:
    """Refuse by name a history whose epsilon (under RDP) the PRV or PLD grid cannot hold."""
    rdp = _epsilon(history, delta, Accountant.RDP)
    most = PLD_MAX_EPSILON if kind is Accountant.PLD else PRV_MAX_EPSILON
    if rdp > most:
        raise AccountingError(
            f"epsilon {rdp:.3g} (RDP) is beyond what the {kind.value.upper()} accountant can "
            f"compute (up to {most:g}): the noise multiplier is far too small for a DP release"
        )


_PRUNE_MARGIN = 1e-9
"""An RDP order is skipped only where its bound exceeds the least epsilon by more than this
share, so that rounding in opacus' series and sums cannot skip the least order."""


def _rdp_epsilon(history: tuple[GaussianRun, ...], delta: float) -> float:
    """Opacus' RDP epsilon of ``history``: the least conversion (``get_privacy_spent``) over the
    orders of ``rdp_alphas``, computing an order's RDP (a series or a sum of up to 256 terms)
    only where it could give the least. RDP never falls as the order grows and is never
    negative, so the RDP of the largest order computed below another bounds that order's from
    below; an order whose bound converts to more than the least epsilon found, starting from
    the orders 2, 4, ..., 256, cannot give the least and is skipped."""
    from opacus.accountants.analysis.rdp import get_privacy_spent

    def curve(order: float) -> float:  # what opacus' RDPAccountant sums at the order
        return sum([_rdp_per_step(sigma, q, order) * steps for sigma, q, steps in history])

    def converted(orders: list[float], rdp: list[float]) -> float:
        return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])

    orders = sorted(rdp_alphas())
    known = {a: curve(a) for a in orders if math.log2(a).is_integer()}
    least = converted(list(known), list(known.values()))
    for a in orders:
        if a in known:
            continue
        below = max((k for k in known if k < a), default=None)
        bound = converted([a], [known[below] if below is not None else 0.0])
        if not bound > least + _PRUNE_MARGIN * abs(least):  # NaN too: compute it
            known[a] = curve(a)
            least = min(least, converted([a], [known[a]]))
    kept = sorted(known)
    return converted(kept, [known[a] for a in kept])


@functools.lru_cache(maxsize=1 << 16)
def _rdp_per_step(sigma: float, sample_rate: float, order: float) -> float:
    """Opacus' RDP of one Poisson-sampled Gaussian step at ``order``, computed once per process
    for each (sigma, q, order) whatever the steps and the runs it is composed with."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return float(compute_rdp(q=sample_rate, noise_multiplier=sigma, steps=1, orders=[order])[0])


def calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.RDP,
    tolerance: float = EPSILON_TOLERANCE,
) -> float:
    """Smallest noise multiplier (to ``tolerance`` in epsilon) whose epsilon is <= target."""
    kind = _check_accountant(accountant)
    _check_delta(delta)
    _check_mechanism(1.0, sample_rate, steps)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise AccountingError(f"target epsilon must be a positive number, got {target_epsilon}")
    if epsilon(MAX_SIGMA, sample_rate, steps, delta, kind) > target_epsilon:
        raise AccountingError(
            f"no noise multiplier reaches epsilon {target_epsilon} at delta {delta} with "
            f"sample rate {sample_rate} over {steps} steps (even sigma={MAX_SIGMA:g} gives more); "
            "raise the budget, or lower the sample rate or the number of steps"
        )
    return _calibrate(
        float(target_epsilon), float(delta), float(sample_rate), int(steps), kind, float(tolerance)
    )


@functools.lru_cache(maxsize=1024)
def _calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    kind: Accountant,
    tolerance: float,
) -> float:
    """``calibrate``'s search, once per process for each setting (the accountants are
    deterministic). RDP and PRV: ``_least_sigma``; PLD: dp_accounting's own calibration."""
    with _quiet():
        if kind is Accountant.PLD:
            import dp_accounting

            # PLD is tighter than RDP, so RDP's sigma bounds PLD's from above; a bracket that
            # starts at tiny sigmas would build enormous privacy-loss distributions.
            hi = calibrate(target_epsilon, delta, sample_rate, steps, Accountant.RDP, tolerance)
            # ... except where PLD's grid, which rounds its losses up, lies above RDP
            while hi < MAX_SIGMA and epsilon(hi, sample_rate, steps, delta, kind) > target_epsilon:
                hi = min(hi * 1.3, MAX_SIGMA)
            lo = hi * 0.7
            while lo > MIN_SIGMA and epsilon(lo, sample_rate, steps, delta, kind) <= target_epsilon:
                hi, lo = lo, lo * 0.7
            sigma = dp_accounting.calibrate_dp_mechanism(
                _pld_accountant,
                lambda s: _pld_event([(s, sample_rate, steps)]),
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
                tol=tolerance / 10,
            )
        else:
            sigma = _least_sigma(
                lambda s: epsilon(s, sample_rate, steps, delta, kind) - target_epsilon, tolerance
            )
    return float(sigma)


def max_steps_within(
    target: float,
    sigma: float,
    sample_rate: float,
    delta: float,
    steps: int,
    accountant: Accountant | str = Accountant.RDP,
) -> int:
    """The most steps (<= ``steps``) whose epsilon stays within ``target`` (0 if none)."""
    if epsilon(sigma, sample_rate, steps, delta, accountant) <= target:
        return steps
    lo, hi = 0, steps  # epsilon(lo) <= target < epsilon(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon(sigma, sample_rate, mid, delta, accountant) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def remaining_epsilon(
    total_epsilon: float,
    delta: float,
    prior: Sequence[GaussianRun],
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.RDP,
    runs: int = 1,
) -> float:
    """The epsilon to calibrate each of ``runs`` more runs at (``sample_rate``, ``steps``) to,
    so that their composition with ``prior`` stays within ``total_epsilon``: one run's epsilon
    at the smallest noise multiplier (``_least_sigma``) whose composition is within the total.
    Calibrating each to it gives at least that noise, so the composition stays within."""
    kind = _check_accountant(accountant)
    _check_mechanism(1.0, sample_rate, steps)
    if runs < 1:
        raise AccountingError(f"runs must be at least 1, got {runs}")
    if not prior and runs == 1:
        return total_epsilon
    spent = composed_epsilon(prior, delta, kind)
    if spent >= total_epsilon:
        raise AccountingError(
            f"the earlier runs already spend epsilon {spent:.4g} >= {total_epsilon:g} at delta "
            f"{delta:g}: nothing is left for another"
        )

    def excess(sigma: float) -> float:
        more = [(sigma, sample_rate, steps)] * runs
        return composed_epsilon([*prior, *more], delta, kind) - total_epsilon

    if excess(MAX_SIGMA) > 0:
        raise AccountingError(
            f"even sigma={MAX_SIGMA:g} at sample rate {sample_rate} over {steps} steps "
            f"({runs} runs) takes the composition past epsilon {total_epsilon:g} (the earlier "
            f"runs spend {spent:.4g})"
        )
    return epsilon(_least_sigma(excess, EPSILON_TOLERANCE), sample_rate, steps, delta, kind)


def _least_sigma(excess: Callable[[float], float], tolerance: float) -> float:
    """The smallest noise multiplier in [``MIN_SIGMA``, ``MAX_SIGMA``] at which ``excess`` (an
    epsilon minus its target, falling as sigma grows; at most 0 at ``MAX_SIGMA``) is at most 0,
    found to well within ``tolerance`` in epsilon: a bracket by doubling or halving from 1, then
    Brent's method on log sigma (scipy's ``brentq``, a few evaluations where bisection takes ~15),
    then the first point at or above its root that is within."""
    from scipy.optimize import brentq

    def f(t: float) -> float:  # finite for brentq: only the sign and the slope near 0 matter
        return min(excess(math.exp(t)), 1e6)

    step, floor, ceiling = math.log(2), math.log(MIN_SIGMA), math.log(MAX_SIGMA)
    lo = hi = 0.0  # log sigma
    while hi < ceiling and f(hi) > 0:  # double until within (brentq refuses a bracket that is not)
        lo, hi = hi, min(hi + step, ceiling)
    if hi == 0.0:  # sigma 1 is within: halve until it is not
        while f(lo) <= 0:
            if lo <= floor:
                return MIN_SIGMA
            hi, lo = lo, max(lo - step, floor)
    xtol = tolerance * 1e-2  # in log sigma: epsilon moves about epsilon * xtol across it
    t = brentq(f, lo, hi, xtol=xtol)
    while f(t) > 0:
        t = min(t + xtol, hi)
    return math.exp(t)


@functools.cache
def rdp_alphas() -> list[float]:
    """Opacus' default RDP orders plus larger ones, so small-epsilon / many-step regimes are not
    cut off at alpha = 63 (which would only over-state epsilon, never under-state it)."""
    from opacus.accountants.rdp import RDPAccountant

    return list(RDPAccountant.DEFAULT_ALPHAS) + [float(a) for a in range(64, 257, 4)]


def _pld_accountant() -> PLDAccountant:
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.privacy_accountant import NeighboringRelation

    return PLDAccountant(
        NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=PLD_INTERVAL
    )


def _pld_event(history: Sequence[GaussianRun]) -> ComposedDpEvent:
    from dp_accounting import dp_event

    return dp_event.ComposedDpEvent(
        [
            dp_event.SelfComposedDpEvent(
                dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), int(steps)
            )
            for sigma, q, steps in history
        ]
    )


def _pld_epsilon(history: Sequence[GaussianRun], delta: float) -> float:
    acc = _pld_accountant()
    acc.compose(_pld_event(history))
    return float(acc.get_epsilon(delta))


def _check_accountant(accountant: Accountant | str) -> Accountant:
    try:
        return Accountant(accountant)
    except ValueError:
        raise AccountingError(
            f"unknown accountant {accountant!r}; choose one of "
            f"{', '.join(a.value for a in Accountant)}"
        ) from None


def _check_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise AccountingError(f"delta must be in (0, 1), got {delta}")


def _check_mechanism(sigma: float, sample_rate: float, steps: int) -> None:
    if not (0.0 < sample_rate <= 1.0):
        raise AccountingError(f"sample rate q must be in (0, 1], got {sample_rate}")
    if sample_rate < sys.float_info.min:  # subnormal: PLD's grid overflowed on it
        raise AccountingError(
            f"sample rate q must be at least {sys.float_info.min:.3g} (a normal float), got "
            f"{sample_rate}"
        )
    if not (math.isfinite(sigma) and sigma > 0):
        raise AccountingError(f"noise multiplier sigma must be positive, got {sigma}")
    if int(steps) != steps or steps <= 0:
        raise AccountingError(f"steps must be a positive integer, got {steps}")
    if steps > MAX_STEPS:
        raise AccountingError(f"steps must be at most {MAX_STEPS:,}, got {steps}")
