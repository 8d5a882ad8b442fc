"""The L2 sensitivity of each DP mechanism's clipped sum, under add/remove-one adjacency.

Training scales its noise by it (noise std = sigma * sensitivity) and ``vip-hub verify``
recomputes it from a ledger stage's mechanism, clipping norm and ``mechanism_params``, so a
stage cannot claim a sensitivity its mechanism does not have.

The contrastive mechanisms (``Logit-DP``, ``Naive-DP``) are derived step by step in
``docs/logit_dp_sensitivity.md``; their ``mechanism_params`` are ``loss`` (``CONTRASTIVE_LOSS``),
``temperature`` and, for a Logit-DP run that skips every batch larger than a cap,
``max_batch``. An unknown key is an error: a misspelt cap must not change the claim silently.

Every mechanism's ``mechanism_params`` may also hold ``rounding_terms`` b, the most examples
one step's clipped sum holds, and ``rounding_sum``, how that sum was formed
(``rounding_allowance``; the rules and their proofs are in ``docs/architecture.md``, "Rounding
of the clipped sum"). What every clipper forms since issue 52 is ``fp64-capped``: every clipped
sum in fp64 from the operands' own values, each product over tokens at most ``PRODUCT_ROWS``
rows, each example's (pair's) clip factor also capped by ``CROSS_CAP`` times its token cross
term, the noise added in fp64 before the one rounding; it moves the neighbours' difference by at
most ``2 b (gamma(R + 1) / kappa + gamma(b + 1))`` times the exact sensitivity, proved. Two
older rules stay readable for releases made before it: ``fp32-blocked`` (the default when
``rounding_sum`` is absent) summed in fp32 and holds only under a model of blocked summation;
``fp64-once`` (the DP heads) summed per-example contributions in fp64 and rounded once, proved.
The DP engine records b = ``sample_bound(n, q)`` and refuses a step whose sample is larger.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

from ..errors import AccountingError

__all__ = [
    "CONTRASTIVE_LOSS",
    "CROSS_CAP",
    "MIN_CLIP",
    "FP32_BLOCKED",
    "FP64_CAPPED",
    "FP64_ONCE",
    "PRODUCT_ROWS",
    "ROUNDING_SUM",
    "ROUNDING_TERMS",
    "DP_ADAMW",
    "DP_SGD",
    "LOGIT_DP",
    "NAIVE_DP",
    "PER_EXAMPLE_MECHANISMS",
    "MechanismName",
    "PerExampleMechanism",
    "check_temperature",
    "logit_dp_sensitivity",
    "logit_dp_sensitivity_at",
    "naive_dp_sensitivity",
    "gamma64",
    "rounding_allowance",
    "rounding_params",
    "sample_bound",
    "sensitivity",
]

PerExampleMechanism = Literal["DP-SGD", "DP-Adam", "DP-AdamW"]
PER_EXAMPLE_MECHANISMS: tuple[str, ...] = get_args(PerExampleMechanism)
MechanismName = Literal[PerExampleMechanism, "Logit-DP", "Naive-DP"]
"""The mechanisms a DP stage may name (each fixes how its sensitivity is computed)."""
DP_SGD: Final = "DP-SGD"
"""The DP heads' mechanism (per-example clipping, SGD with momentum)."""
DP_ADAMW: Final = "DP-AdamW"
"""The DP encoder stages' mechanism (per-example clipping, AdamW), and the imports'."""
LOGIT_DP: Final = "Logit-DP"
"""Per-pair clipping of a contrastive loss's gradient (Kong et al. 2024)."""
NAIVE_DP: Final = "Naive-DP"
"""The contrastive batch's whole gradient clipped as one example."""
CONTRASTIVE_LOSS = "symmetric-infonce"
"""L = sum_i (CE(Z_i. / tau, i) + CE(Z_.i / tau, i)) / 2 over cosine similarities Z (the rows
and the columns of the similarity matrix each a softmax over the other view)."""

ROUNDING_TERMS = "rounding_terms"
"""The ``mechanism_params`` key of b, the most examples one step's fp32 clipped sum holds."""
ROUNDING_SUM = "rounding_sum"
"""The ``mechanism_params`` key of how the clipped sum was formed (``FP32_BLOCKED`` if absent)."""
FP32_BLOCKED = "fp32-blocked"
"""Summed in fp32 in up to ceil(log2 b) levels of blocks: the allowance is a model."""
FP64_ONCE = "fp64-once"
"""Each example's contribution summed in fp64, rounded once to fp32: the allowance is proved
(the DP heads before issue 52; read for their releases)."""
FP64_CAPPED = "fp64-capped"
"""Every clipped sum in fp64 from the operands' values, products over tokens of at most
``PRODUCT_ROWS`` rows, clip factors capped by ``CROSS_CAP`` times the token cross term, noise
added in fp64 before the one rounding: the allowance is proved, for every clipper."""
MIN_CLIP = 2.0**-64
"""``FP64_CAPPED``'s smallest clipping norm C, so that subnormal roundings stay within the
proof's slack (every clipper, and every clipping-norm option, refuses a smaller one)."""
PRODUCT_ROWS = 1 << 16
"""``FP64_CAPPED``: the most rows (tokens of one or more examples, or views of pairs) one fp64
product of a clipped sum adds up; a clipper splits a larger product."""
CROSS_CAP = 2.0**-12
"""``FP64_CAPPED``'s kappa: an example's clip factor c also keeps c X <= C / kappa, X the sum over
its token products of sum_t ||a_t|| ||g_t|| (what a product's rounding scales with), so the
rounding of every product stays proportional to C; only an example whose token terms cancel to
under kappa of their magnitude is clipped harder than its norm asks."""
_FP64_ONCE_MAX_TERMS = 1 << 22
"""The proof of ``FP64_ONCE``'s allowance needs b at most 2^22 (``docs/architecture.md``)."""
_FP64_CAPPED_MAX_TERMS = 1 << 32
"""The proof of ``FP64_CAPPED``'s allowance needs (b + 1) 2^-53 far below 1."""
_FP64_UNIT = 2.0**-53
"""fp64's unit roundoff w."""
_FP32_ROUNDING = 2.0**-23
"""Twice fp32's unit roundoff 2^-24: each neighbour's sum, per example in it and level of the
summation."""
_FP64_ROUNDING = 2.0**-52
"""Twice fp64's unit roundoff 2^-53."""
_SAMPLE_TAIL_BITS = 64
"""``sample_bound`` is exceeded with probability at most 2^-64 per step."""
_ROUNDING_KEYS = {ROUNDING_TERMS, ROUNDING_SUM}
_LOGIT_DP_KEYS = {"loss", "temperature", "max_batch", *_ROUNDING_KEYS}
_NAIVE_DP_KEYS = {"loss", "temperature", *_ROUNDING_KEYS}


def sensitivity(
    mechanism: str, clipping_norm: float, params: Mapping[str, Any] | None = None
) -> float:
    """The sensitivity of ``mechanism``'s clipped sum, times ``rounding_allowance`` when ``params``
    record ``rounding_terms`` (under the rule ``rounding_sum`` names).

    Per-example clipping to C: adding or removing one example adds or removes one vector of
    norm at most C, so the sensitivity is C. Logit-DP and Naive-DP: see their functions.
    """
    params = dict(params or {})
    terms, summation = params.get(ROUNDING_TERMS), params.get(ROUNDING_SUM)
    exact = _exact_sensitivity(mechanism, clipping_norm, params)
    if terms is None:
        if summation is not None:
            raise AccountingError(f"{mechanism}: {ROUNDING_SUM} without {ROUNDING_TERMS}")
        return exact
    return exact * rounding_allowance(terms, FP32_BLOCKED if summation is None else summation)


def gamma64(k: int) -> float:
    """Higham's gamma_k = k w / (1 - k w) for fp64 (w = 2^-53), rounded up: the relative error
    bound of k chained fp64 roundings."""
    kw = k * _FP64_UNIT
    return kw / (1.0 - kw) * (1.0 + 2.0**-50)


def rounding_allowance(terms: int, summation: str = FP32_BLOCKED) -> float:
    """The factor on the exact sensitivity that covers the rounding of a clipped sum of at most
    ``terms`` = b examples formed as ``summation`` says: for ``FP64_CAPPED``
    ``1 + 2 b (gamma(R + 1) / kappa + gamma(b + 1)) (1 + 2^-20)`` (R = ``PRODUCT_ROWS``, kappa =
    ``CROSS_CAP``, b at most 2^32); ``1 + b 2^-23 + (b + 1)^2 2^-52`` for ``FP64_ONCE`` (b at
    most 2^22); ``1 + b ceil(log2 b) 2^-23`` (at least one level) for ``FP32_BLOCKED``; see
    ``docs/architecture.md``."""
    if isinstance(terms, bool) or not isinstance(terms, int) or terms < 1:
        raise AccountingError(f"{ROUNDING_TERMS} must be a positive integer, got {terms!r}")
    if summation == FP64_CAPPED:
        if terms > _FP64_CAPPED_MAX_TERMS:
            raise AccountingError(
                f"{FP64_CAPPED}: the allowance is proved for at most {_FP64_CAPPED_MAX_TERMS} "
                f"terms, got {terms}"
            )
        per_term = gamma64(PRODUCT_ROWS + 1) / CROSS_CAP + gamma64(terms + 1)
        return 1.0 + 2.0 * terms * per_term * (1.0 + 2.0**-20)
    if summation == FP32_BLOCKED:
        return 1.0 + terms * max(1, math.ceil(math.log2(terms))) * _FP32_ROUNDING
    if summation == FP64_ONCE:
        if terms > _FP64_ONCE_MAX_TERMS:
            raise AccountingError(
                f"{FP64_ONCE}: the allowance is proved for at most {_FP64_ONCE_MAX_TERMS} terms, "
                f"got {terms}"
            )
        return 1.0 + terms * _FP32_ROUNDING + (terms + 1) ** 2 * _FP64_ROUNDING
    raise AccountingError(
        f"{ROUNDING_SUM} must be {FP64_CAPPED!r}, {FP64_ONCE!r} or {FP32_BLOCKED!r}, "
        f"got {summation!r}"
    )


def rounding_params(dataset_size: int, sample_rate: float) -> dict[str, Any]:
    """The ``mechanism_params`` a stage trained by the DP engine records for its rounding: b =
    ``sample_bound(n, q)`` and the rule every clipper forms its sums by, ``FP64_CAPPED``."""
    return {ROUNDING_TERMS: sample_bound(dataset_size, sample_rate), ROUNDING_SUM: FP64_CAPPED}


def sample_bound(dataset_size: int, sample_rate: float) -> int:
    """The most examples a Poisson sample of ``dataset_size`` at rate q holds, but with
    probability at most 2^-64: mean mu = n q plus t, where Bernstein's inequality
    P(X >= mu + t) <= exp(-t^2 / (2 (mu + t / 3))) reaches 2^-64; at most n."""
    if dataset_size < 1 or not 0 < sample_rate <= 1:
        raise AccountingError(
            f"no sample bound for {dataset_size} examples at sample rate {sample_rate!r}"
        )
    mu, tail = dataset_size * sample_rate, _SAMPLE_TAIL_BITS * math.log(2)
    t = tail / 3 + math.sqrt((tail / 3) ** 2 + 2 * tail * mu)
    return min(dataset_size, math.ceil(mu + t))


def _exact_sensitivity(mechanism: str, clipping_norm: float, params: dict[str, Any]) -> float:
    """The sensitivity of ``mechanism``'s clipped sum in exact arithmetic."""
    if mechanism in PER_EXAMPLE_MECHANISMS:
        _check_keys(mechanism, params, _ROUNDING_KEYS, loss=False)
        return float(clipping_norm)
    if mechanism == LOGIT_DP:
        _check_keys(mechanism, params, _LOGIT_DP_KEYS)
        tau = _temperature(mechanism, params)
        max_batch = params.get("max_batch")
        if max_batch is not None and (
            isinstance(max_batch, bool) or not isinstance(max_batch, int)
        ):
            raise AccountingError(f"Logit-DP: max_batch must be an integer, got {max_batch!r}")
        return logit_dp_sensitivity(clipping_norm, tau, max_batch)
    if mechanism == NAIVE_DP:
        _check_keys(mechanism, params, _NAIVE_DP_KEYS)
        if "temperature" in params:
            _temperature(mechanism, params)
        return naive_dp_sensitivity(clipping_norm)
    raise AccountingError(f"no sensitivity rule for mechanism {mechanism!r}")


def logit_dp_sensitivity_at(clipping_norm: float, temperature: float, n: int) -> float:
    """The bound for one batch size: ||G(X) - G(X minus one)|| <= this when |X| = n, where G is
    the Logit-DP clipped sum with pair clip B = ``clipping_norm`` (derivation, step 3).

    Delta(n) = (2B/tau) [r(n) + s(n)], r = (n-1)a / (1 + (n-1)a), s = (n-1)a / (a + n - 1),
    a = e^(2/tau); increasing in n, with limit (2B/tau)(1 + a).
    """
    _check_positive("clipping norm", clipping_norm)
    check_temperature(temperature)
    if n < 1:
        raise AccountingError(f"batch size must be at least 1, got {n}")
    if n == 1:
        return 0.0
    m = n - 1
    s = m / (1.0 + m * math.exp(-2.0 / temperature))  # (n-1)a / (a + n - 1)
    return 2.0 * clipping_norm / temperature * (_r(n, temperature) + s)


def _r(n: int, temperature: float) -> float:
    """r(n) = (n-1)a / (1 + (n-1)a), a = e^(2/tau), computed without overflow."""
    return 1.0 / (1.0 + math.exp(-2.0 / temperature) / (n - 1))


def logit_dp_sensitivity(
    clipping_norm: float, temperature: float, max_batch: int | None = None
) -> float:
    """Logit-DP's sensitivity for every batch size Poisson sampling can produce.

    Without a cap: sup_n Delta(n) = (2B/tau)(1 + e^(2/tau)). With ``max_batch`` m (the clipper
    then adds nothing for a batch of more than m examples): (2B/tau) m r(m), the largest norm
    of a batch of m examples' clipped sum, which is at least Delta(m).
    """
    _check_positive("clipping norm", clipping_norm)
    check_temperature(temperature)
    if max_batch is None:
        if 2.0 / temperature > 700.0:  # e^(2/tau) overflows a double
            raise AccountingError(
                f"Logit-DP at temperature {temperature:g} without max_batch has a sensitivity "
                "of e^(2/tau) B/tau, beyond floating point: record a max_batch"
            )
        return 2.0 * clipping_norm / temperature * (1.0 + math.exp(2.0 / temperature))
    if max_batch < 2:
        raise AccountingError(f"Logit-DP: max_batch must be at least 2, got {max_batch}")
    return 2.0 * clipping_norm / temperature * max_batch * _r(max_batch, temperature)


def naive_dp_sensitivity(clipping_norm: float) -> float:
    """Naive-DP (the whole-batch loss gradient clipped to C): both neighbours' clipped gradients
    have norm at most C and may point opposite ways, so 2C, for every batch size."""
    _check_positive("clipping norm", clipping_norm)
    return 2.0 * clipping_norm


def _check_keys(
    mechanism: str, params: Mapping[str, Any], allowed: set[str], loss: bool = True
) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise AccountingError(
            f"{mechanism}: unknown mechanism_params {unknown}; allowed: {sorted(allowed)}"
        )
    if loss and params.get("loss") != CONTRASTIVE_LOSS:
        raise AccountingError(
            f"{mechanism}: mechanism_params.loss must be {CONTRASTIVE_LOSS!r}, "
            f"got {params.get('loss')!r}"
        )


def _temperature(mechanism: str, params: Mapping[str, Any]) -> float:
    tau = params.get("temperature")
    if (
        isinstance(tau, bool)
        or not isinstance(tau, (int, float))
        or not math.isfinite(tau)
        or tau <= 0
    ):
        raise AccountingError(
            f"{mechanism}: mechanism_params.temperature must be a positive number, got {tau!r}"
        )
    return float(tau)


def check_temperature(temperature: float) -> None:
    """``AccountingError`` unless a contrastive loss's temperature is a finite positive number
    (the contrastive clippers' check too)."""
    _check_positive("temperature", temperature)


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise AccountingError(f"{name} must be a positive number, got {value!r}")
