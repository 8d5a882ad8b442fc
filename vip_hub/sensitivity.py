"""The L2 sensitivity of each DP mechanism's clipped sum, under add/remove-one adjacency.

Training scales its noise by it (noise std = sigma * sensitivity) and ``vip-hub verify``
recomputes it from a ledger stage's mechanism, clipping norm and ``mechanism_params``, so a
stage cannot claim a sensitivity its mechanism does not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import AccountingError

__all__ = ["PER_EXAMPLE_MECHANISMS", "sensitivity"]

PER_EXAMPLE_MECHANISMS = ("DP-SGD", "DP-Adam", "DP-AdamW")


def sensitivity(mechanism: str, clipping_norm: float, params: Mapping[str, Any] | None = None) -> float:
    """The sensitivity of ``mechanism``'s clipped sum.

    Per-example clipping to C: adding or removing one example adds or removes one vector of
    norm at most C, so the sensitivity is C.
    """
    if mechanism in PER_EXAMPLE_MECHANISMS:
        return float(clipping_norm)
    raise AccountingError(f"no sensitivity rule for mechanism {mechanism!r}")
