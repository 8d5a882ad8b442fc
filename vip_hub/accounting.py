"""Privacy accounting for Poisson-subsampled Gaussian mechanisms (DP-SGD / DP-AdamW).

A thin, validated layer over Opacus' accountants: RDP (the ViP paper's choice, the
default) and PRV (tight; reported beside it). Nothing here is a hand-written accountant.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from enum import StrEnum

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.accountant import IAccountant
from opacus.accountants.rdp import RDPAccountant as _RDP
from opacus.accountants.utils import get_noise_multiplier

__all__ = [
    "Accountant",
    "AccountingError",
    "Mechanism",
    "calibrate",
    "default_delta",
    "epsilon",
    "make_accountant",
]

# Opacus' default orders plus larger ones, so small-epsilon / many-step regimes are not
# cut off at alpha = 63 (which would only over-state epsilon, never under-state it).
RDP_ALPHAS: list[float] = list(_RDP.DEFAULT_ALPHAS) + [float(a) for a in range(64, 257, 4)]
PRV_EPS_ERROR = 0.01
MAX_SIGMA = 1e4


class Accountant(StrEnum):
    """Supported accountants."""

    RDP = "rdp"
    PRV = "prv"

    @property
    def other(self) -> "Accountant":
        return Accountant.PRV if self is Accountant.RDP else Accountant.RDP


class AccountingError(ValueError):
    """Raised for parameters no mechanism can have, or a budget no noise level reaches."""


Mechanism = tuple[float, float, int]
"""One homogeneous run of steps: (noise multiplier sigma, sample rate q, steps T)."""


def default_delta(n: int) -> float:
    """The ViP paper's delta for a dataset of ``n`` examples: 1 / (2n)."""
    if n <= 0:
        raise AccountingError(f"dataset size must be positive, got {n}")
    return 1.0 / (2 * n)


def make_accountant(accountant: Accountant | str = Accountant.RDP) -> IAccountant:
    """A fresh Opacus accountant to step during training."""
    return PRVAccountant() if Accountant(accountant) is Accountant.PRV else RDPAccountant()


def epsilon(
    sigma: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant | str = Accountant.RDP,
) -> float:
    """Epsilon after ``steps`` Poisson-sampled Gaussian steps at (sigma, q), for ``delta``."""
    return composed_epsilon([(sigma, sample_rate, steps)], delta, accountant)


def composed_epsilon(
    history: Sequence[Mechanism], delta: float, accountant: Accountant | str = Accountant.RDP
) -> float:
    """Epsilon of the composition of several runs (e.g. every DP stage on one dataset)."""
    accountant = _check_accountant(accountant)
    _check_delta(delta)
    if not history:
        return 0.0
    for sigma, q, steps in history:
        _check_mechanism(sigma, q, steps)
    acc = make_accountant(accountant)
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history]
    return _get_epsilon(acc, accountant, delta)


def calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.RDP,
    tolerance: float = 1e-3,
) -> float:
    """Smallest noise multiplier (to ``tolerance`` in epsilon) whose epsilon is <= target."""
    accountant = _check_accountant(accountant)
    _check_delta(delta)
    _check_mechanism(1.0, sample_rate, steps)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise AccountingError(f"target epsilon must be a positive number, got {target_epsilon}")
    # Opacus gives up at sigma 1e6; stop earlier with a clearer message.
    if epsilon(MAX_SIGMA, sample_rate, steps, delta, accountant) > target_epsilon:
        raise AccountingError(
            f"no noise multiplier reaches epsilon {target_epsilon} at delta {delta} with "
            f"sample rate {sample_rate} over {steps} steps (even sigma={MAX_SIGMA:g} gives more); "
            "raise the budget, or lower the sample rate or the number of steps"
        )
    kwargs = {"alphas": RDP_ALPHAS} if accountant is Accountant.RDP else {"eps_error": PRV_EPS_ERROR}
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", UserWarning)
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant.value,
                epsilon_tolerance=tolerance,
                **kwargs,
            )
        )


def accountant_epsilon(acc: IAccountant, delta: float) -> float:
    """Epsilon spent so far by a live Opacus accountant (as stepped during training)."""
    _check_delta(delta)
    if not acc.history:
        return 0.0
    kind = Accountant.PRV if isinstance(acc, PRVAccountant) else Accountant.RDP
    return _get_epsilon(acc, kind, delta)


def _get_epsilon(acc: IAccountant, kind: Accountant, delta: float) -> float:
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", UserWarning)
        if kind is Accountant.RDP:
            return float(acc.get_epsilon(delta=delta, alphas=RDP_ALPHAS))
        return float(acc.get_epsilon(delta=delta, eps_error=PRV_EPS_ERROR))


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
    if not (math.isfinite(sigma) and sigma > 0):
        raise AccountingError(f"noise multiplier sigma must be positive, got {sigma}")
    if int(steps) != steps or steps <= 0:
        raise AccountingError(f"steps must be a positive integer, got {steps}")
