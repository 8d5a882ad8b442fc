"""The privacy ledger: what data each training stage saw and what it cost.

A versioned JSON document (``"schema": "vip-hub/privacy-ledger/v4"``) stored three times in
a released repo (safetensors metadata, the ledger file ``LEDGER_FILE``, the model card) and
recomputed by ``vip-hub verify`` (see ``docs/architecture.md``, "The privacy ledger").

- ``stages``: in order; ``non-private`` stages (synthetic pretraining, a non-DP probe) and
  ``dp`` stages: a Gaussian mechanism on clipped sums (sensitivity, noise), its sampling,
  its epsilon under all three accountants and, when the run audited itself, an ``audit``.
- ``guarantees``: one per private dataset, composing every DP stage that touched it. A
  dataset's identity is its declared name (never a folder, a split or a hash); stages on
  the same name compose, and two spellings of one name are refused. The ledger holds no
  hash of the private data (v2 ledgers published an unsalted SHA-256 of it); its size n is
  treated as public.
- ``artifacts``: digests of the files the ledger describes, binding it to the weights.

A DP stage written by a training run carries the run's random ``run_id`` (an optional field:
ledgers written before it, and imports, have none and are still v3); it identifies the stage
across repos (``DPStage.identity``), so a release copied or trained further counts once. It also
names the tensors its noise went to (``noised_tensors``, summing to its noised dimension d): an
optional field of v4, whose absence ``verify`` refuses (d could not be checked).

Every epsilon is stored rounded *up* to ``EPSILON_DECIMALS`` decimals (an audit's lower
bound rounded *down*), so the document does not depend on floating-point noise (the number
of ranks, the machine) and a claim stays an upper bound.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import unicodedata
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ..errors import LedgerError, UnsafePathError
from ..paths import validate_relpath
from ..repo_format import (
    COMPONENT_PATTERN,
    ENCODER,
    HEAD_COMPONENT_PATTERN,
    LEDGER_FILE,
    FrontMatterLimits,
)
from .accounting import (
    MAX_STEPS,
    NOISE_SUPPORT,
    Accountant,
    composed_epsilon,
    epsilons,
    is_weak_delta,
    resolve_delta,
    truncation_delta,
)
from .audit import MAX_CANARIES, MAX_GUESS_COUNTS
from .sensitivity import DP_ADAMW, MechanismName

SCHEMA: Final = "vip-hub/privacy-ledger/v4"  # Final: typed as its literal, as schema_ is
EPSILON_DECIMALS = 6
_DIGEST = r"^(sha256|tensors-sha256):[0-9a-f]{64}$"

_OLD_SCHEMAS = {
    "vip-hub/privacy-ledger/v1": " (written by vip-hub < 0.2: export the repo again)",
    "vip-hub/privacy-ledger/v2": (
        " (written by vip-hub < 0.3, whose ledgers carried an unsalted SHA-256 of the private "
        "dataset: retrain or export again with this version, and withdraw the old release)"
    ),
    "vip-hub/privacy-ledger/v3": (
        " (written by an earlier vip-hub, whose stages omit the noise sampler's support and the "
        "delta its truncation adds (the CPU noise stopped at 5.77 sigma) and whose noise was "
        "keyed by 32 bits: retrain with this version, and withdraw the old release)"
    ),
}

MAX_COUNT = 2**53
"""The largest dataset size, noised dimension or tensor count a ledger may state: every integer
up to it is a float exactly (the accounting computes in floats; 10^400 would overflow)."""
MAX_DEPTH = FrontMatterLimits.max_depth
"""How deep a ledger may nest lists and mappings: its card copy may not nest deeper."""
MAX_STAGES = 32
"""The most stages a ledger may record: ``verify`` recomputes each one's epsilon under every
accountant and each dataset's composition (PRV's grows faster than the stages), on every upload."""

DATASET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$"
"""A private dataset's declared name as recipes and probes take it: namespaced, ``org/name``."""

Sampling = Literal["poisson", "shuffle"]

NOT_RELEASED = "unreleased"
"""The file part of a noised tensor's key (``noised_key``) that no repo carries: trained and
noised, but not released (Logit-DP's projection head)."""
NOISED_CANARIES = "canaries"
"""The key of ``DPStage.noised_tensors`` that counts the audit's canary coordinates."""

__all__ = [
    "DATASET_NAME_PATTERN",
    "ENCODER",
    "NOISED_CANARIES",
    "NOT_RELEASED",
    "RUN_ID_PATTERN",
    "EPSILON_DECIMALS",
    "MAX_COUNT",
    "SCHEMA",
    "Audit",
    "AuditResult",
    "DPStage",
    "Dataset",
    "Guarantee",
    "LedgerError",
    "NonPrivateStage",
    "PrivacyLedger",
    "PrivacySummary",
    "Stage",
    "compose_releases",
    "dataset_identity",
    "new_run_id",
    "noised_key",
    "privacy_headline",
    "round_down",
    "round_up",
    "rounding_before_2026_12_03",
    "shown_delta",
    "shown_epsilon",
    "truncated",
]


def round_up(eps: float) -> float:
    """``eps`` rounded up to ``EPSILON_DECIMALS`` decimals (exactly: the result is >= eps)."""
    return float(
        Decimal(eps).quantize(Decimal(1).scaleb(-EPSILON_DECIMALS), rounding=ROUND_CEILING)
    )


_ROUNDING_BEFORE: ContextVar[bool] = ContextVar("rounding_before_2026_12_03", default=False)


@contextlib.contextmanager
def rounding_before_2026_12_03() -> Iterator[None]:
    """Figures shown as cards written before 2026-12-03 showed them (ε rounded up from its
    binary value, δ to the nearest): what ``verify`` also accepts of an older card's text."""
    token = _ROUNDING_BEFORE.set(True)
    try:
        yield
    finally:
        _ROUNDING_BEFORE.reset(token)


def shown_epsilon(eps: float, decimals: int = 2, *, lower_bound: bool = False) -> str:
    """``eps`` for reading at ``decimals`` decimals, rounded up (a claim shown stays an upper
    bound), or down for a ``lower_bound``; a float is the number its shortest text names (0.1
    reads 0.10, though its binary value is a little above)."""
    rounding = ROUND_FLOOR if lower_bound else ROUND_CEILING
    exact = Decimal(eps) if _ROUNDING_BEFORE.get() else Decimal(repr(eps))
    shown = exact.quantize(Decimal(1).scaleb(-decimals), rounding=rounding)
    return f"{shown:.{decimals}f}"


def shown_delta(delta: float, digits: int = 3) -> str:
    """``delta`` for reading at ``digits`` significant digits, rounded up as ``shown_epsilon``
    rounds (a guarantee's delta adds its samplers' truncation delta: 1e-5 and 5e-14 read
    1.01e-05)."""
    if delta <= 0 or _ROUNDING_BEFORE.get():
        return f"{delta:.{digits}g}"
    exact = Decimal(repr(delta))
    up = exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=ROUND_CEILING)
    return f"{float(up):.{digits}g}"


def round_down(eps: float) -> float:
    """``eps`` rounded down to ``EPSILON_DECIMALS`` decimals (for lower bounds)."""
    return float(Decimal(eps).quantize(Decimal(1).scaleb(-EPSILON_DECIMALS), rounding=ROUND_FLOOR))


def _from_validation(err: ValidationError) -> LedgerError:
    problems = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "ledger"
        problems.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return LedgerError(problems)


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


class Dataset(_Model):
    """A dataset as the ledger names it: its declared name is its identity (stages on one name
    compose); ``size`` is the n its stage saw (a subset's, for a head on part of it)."""

    name: str = Field(min_length=1, max_length=200)
    size: int | None = Field(
        default=None,
        gt=0,
        le=MAX_COUNT,
        description="number of training examples n (treated as public)",
    )
    description: str = ""

    @property
    def key(self) -> str:
        """What identifies the dataset across stages, repos and the hub's dataset pages."""
        return self.name


class _Stage(_Model):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._:-]{0,99}$")
    component: str = Field(default=ENCODER, pattern=COMPONENT_PATTERN)
    also_trains: list[Annotated[str, Field(pattern=HEAD_COMPONENT_PATTERN)]] = Field(
        default_factory=list,
        description="heads trained together with the component by this one stage (one "
        "mechanism: an end-to-end fine-tuning's classifier); written only when not empty",
    )
    dataset: Dataset
    description: str = ""

    @field_validator("also_trains")
    @classmethod
    def _distinct(cls, heads: list[str]) -> list[str]:
        if len(set(heads)) != len(heads):
            raise ValueError(f"a head is listed twice in {heads}")
        return heads

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without joint heads (or a run id, or noised tensors) a stage is written as before the
        field existed."""
        data = handler(self)
        if not self.also_trains:
            data.pop("also_trains", None)
        for optional in ("run_id", "noised_tensors"):
            if data.get(optional, "") is None:
                data.pop(optional)
        return data

    @property
    def trained_components(self) -> tuple[str, ...]:
        """Every component whose weights this stage trained: its own, then its joint heads."""
        return (self.component, *self.also_trains)


class NonPrivateStage(_Stage):
    """A stage without DP. ``private_data`` says whether its data is sensitive (and so
    unprotected)."""

    type: Literal["non-private"] = "non-private"
    private_data: bool


class AuditResult(_Model):
    """One guess count of the grid fixed before training: r guesses, v of them correct."""

    guesses: int = Field(gt=0)
    correct: int = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> AuditResult:
        if self.correct > self.guesses:
            raise ValueError(f"{self.correct} correct guesses out of {self.guesses}")
        return self


class Audit(_Model):
    """A one-run empirical audit (Steinke, Nasr and Jagielski 2023) of a DP stage: a lower
    bound on epsilon at ``delta`` with confidence ``1 - beta``, beside the accountants'
    upper bounds at the same delta."""

    method: Literal["one-run-dirac-canaries"] = "one-run-dirac-canaries"
    canaries: int = Field(
        ge=2,
        le=MAX_CANARIES,
        description="m: canaries, each in the data with probability 1/2 (two at least: a guess "
        "count is even)",
    )
    canary_norm: float = Field(
        gt=0, description="a canary's gradient norm before clipping, in units of the sensitivity"
    )
    results: list[AuditResult] = Field(
        min_length=1,
        max_length=MAX_GUESS_COUNTS,
        description="one per guess count of the grid, fixed in advance",
    )
    beta: float = Field(gt=0, lt=1, description="1 - confidence, split evenly over the grid")
    delta: float = Field(gt=0, lt=1)
    epsilon_lower_bound: float = Field(ge=0)
    ceiling: float = Field(
        ge=0,
        description="the largest lower bound this audit could reach: every guess right "
        "at the grid's best count, given the canaries, beta and delta",
    )
    accountant_epsilon: dict[Accountant, float] = Field(
        description="each accountant's epsilon at this delta"
    )

    @model_validator(mode="after")
    def _consistent(self) -> Audit:
        if any(r.guesses > self.canaries for r in self.results):
            raise ValueError(f"more guesses than the {self.canaries} canaries")
        if set(self.accountant_epsilon) != set(Accountant):
            raise ValueError("accountant_epsilon must give every accountant's epsilon")
        if self.epsilon_lower_bound > self.ceiling:
            raise ValueError(
                f"lower bound {self.epsilon_lower_bound} above the audit's ceiling {self.ceiling}"
            )
        return self

    @property
    def accounted(self) -> float:
        """The tightest accountant's epsilon at the audit's delta: the claim the audit tests."""
        return min(self.accountant_epsilon.values())

    @property
    def can_fail(self) -> bool:
        """Whether a violation of the accounted epsilon could show: the ceiling lies above it."""
        return self.ceiling > self.accounted


RUN_ID_PATTERN = "[0-9a-f]{32}"
"""A training run's id (``new_run_id``), as its DP stage records it."""


class DPStage(_Stage):
    """A DP stage: T steps of a Gaussian mechanism on a clipped sum of sensitivity ``sensitivity``,
    with noise of standard deviation ``noise_std`` = sigma * sensitivity, on batches sampled
    as ``sampling`` says (the accountants assume Poisson sampling at rate q). ``run_id``: drawn at
    random by the training run (a copy of a release carries its stages' ids; see ``identity``).
    The noise sampler draws |z| <= ``noise_support`` on ``noised_dimension`` coordinates, the
    elements of ``noised_tensors``; the delta that truncation adds (``truncation_delta``) is part
    of the stage's guarantee: (epsilon, delta + truncation_delta)."""

    type: Literal["dp"] = "dp"
    run_id: str | None = Field(
        default=None,
        pattern=f"^{RUN_ID_PATTERN}$",
        description="the training run's random id (a UUID4 as 32 hex digits); absent in imports "
        "and ledgers written before it existed; written only when set",
    )
    mechanism: MechanismName
    mechanism_params: dict[str, Any] = Field(
        default_factory=dict,
        description="what fixes the sensitivity beyond C (Logit-DP: loss, temperature...)",
    )
    sampling: Sampling = "poisson"
    sample_rate: float = Field(gt=0, le=1)
    noise_multiplier: float = Field(gt=0)
    steps: int = Field(gt=0, le=MAX_STEPS)
    clipping_norm: float = Field(gt=0)
    sensitivity: float = Field(
        gt=0, description="L2 sensitivity of the clipped sum (add/remove one example)"
    )
    noise_std: float = Field(
        gt=0, description="standard deviation of the noise added to the clipped sum"
    )
    expected_batch_size: float = Field(gt=0)
    delta: float = Field(gt=0, lt=1, description="the delta the accountants' epsilon is at")
    noise_support: float = Field(
        gt=0, description="c: every draw of the noise sampler has |z| <= c (units of noise_std)"
    )
    noised_dimension: int = Field(
        gt=0, le=MAX_COUNT, description="d: the coordinates the noise is added to"
    )
    noised_tensors: dict[str, Annotated[int, Field(gt=0, le=MAX_COUNT)]] | None = Field(
        default=None,
        description="what d counts, each with its number of elements: '<repo file>:<tensor>' for "
        "a tensor a repo file holds (verify checks it against the file), 'unreleased:<name>' for "
        "one no repo file holds, 'canaries' for the audit's canary coordinates; absent in stages "
        "written before it, which verify refuses",
    )
    truncation_delta: float = Field(
        ge=0,
        le=1,
        description="what the sampler's truncation at c adds to delta "
        "(vip_hub.privacy.accounting.truncation_delta of sigma, q, T, c, d)",
    )
    accountant: Accountant = Accountant.RDP
    epsilon: float = Field(ge=0)
    reference_epsilon: dict[Accountant, float]
    audit: Audit | None = None
    hyperparameters: dict[str, Any] = Field(default_factory=dict)

    @field_validator("mechanism_params")
    @classmethod
    def _counts_in_range(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The sensitivity is computed in floats: an integer past ``MAX_COUNT`` (a
        ``rounding_terms``, a ``max_batch``, a temperature of 10^400) would overflow it."""
        for key, value in params.items():
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_COUNT:
                raise ValueError(f"{key} is an integer past {MAX_COUNT}")
        return params

    @model_validator(mode="after")
    def _consistent(self) -> DPStage:
        n = self.dataset.size
        if n is None:
            raise ValueError("dataset.size is required for a DP stage (q and delta depend on it)")
        if abs(self.sample_rate * n - self.expected_batch_size) > 1e-6 * max(
            1.0, self.expected_batch_size
        ):
            raise ValueError(
                f"expected_batch_size {self.expected_batch_size} != sample_rate * dataset.size "
                f"= {self.sample_rate * n:g}"
            )
        if set(self.reference_epsilon) != set(self.accountant.others):
            raise ValueError(
                f"reference_epsilon must give exactly the other accountants' figures "
                f"({', '.join(a.value for a in self.accountant.others)})"
            )
        if self.noised_tensors is not None:
            counted = sum(self.noised_tensors.values())
            if counted != self.noised_dimension:
                raise ValueError(
                    f"noised_dimension {self.noised_dimension} is not the {counted} elements its "
                    "noised_tensors count"
                )
            canaries = self.audit.canaries if self.audit is not None else None
            if self.noised_tensors.get(NOISED_CANARIES) != canaries:
                raise ValueError(
                    f"noised_tensors count {self.noised_tensors.get(NOISED_CANARIES)} "
                    f"canaries, the audit {canaries}"
                )
            unnamed = [k for k in self.noised_tensors if k != NOISED_CANARIES and ":" not in k]
            if unnamed:
                raise ValueError(f"noised tensors {unnamed} name no file ('<file>:<tensor>')")
        return self

    @property
    def mechanism_tuple(self) -> tuple[float, float, int]:
        """(sigma, q, T), the accountant's view of this stage."""
        return (self.noise_multiplier, self.sample_rate, self.steps)

    @property
    def epsilons(self) -> dict[Accountant, float]:
        """Every accountant's epsilon, the claim's first."""
        return {self.accountant: self.epsilon, **self.reference_epsilon}

    @property
    def weak_delta(self) -> bool:
        """Whether its delta is above 1/(10n) (flagged by ``verify`` and every page)."""
        return is_weak_delta(self.delta, self.dataset.size or 1)

    @property
    def identity(self) -> str:
        """What makes two stages one release of one training run (counted once by
        ``compose_releases``): a SHA-256 of its run id and its mechanism (dataset, n, mechanism,
        sampling, q, sigma, T, clipping); its delta, epsilons, names and texts are left out, so a
        copy that restates them is still the same stage. Two runs with the same settings differ
        by their random run ids; a stage without one (an import) is identified by its mechanism
        alone; a forged run id on another mechanism makes another stage (which can only
        overstate a composition)."""
        fields = {
            "run_id": self.run_id,
            "dataset": [self.dataset.name, self.dataset.size],
            "mechanism": [self.mechanism, self.mechanism_params, self.sampling],
            "gaussian": [*self.mechanism_tuple, self.clipping_norm, self.sensitivity],
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_parameters(
        cls,
        *,
        name: str,
        dataset: Dataset,
        sample_rate: float,
        noise_multiplier: float,
        steps: int,
        clipping_norm: float,
        noised_tensors: Mapping[str, int],
        noise_support: float = NOISE_SUPPORT,
        mechanism: str = DP_ADAMW,
        sensitivity: float | None = None,
        mechanism_params: dict[str, Any] | None = None,
        sampling: str = "poisson",
        delta: float | None = None,
        accountant: Accountant | str = Accountant.RDP,
        audit: Audit | None = None,
        run_id: str | None = None,
        component: str = ENCODER,
        also_trains: Iterable[str] = (),
        description: str = "",
        hyperparameters: dict[str, Any] | None = None,
    ) -> DPStage:
        """Build a DP stage, computing its epsilon under every accountant (the named one is the
        claim) and the delta its sampler's truncation adds (``noise_support``: vip-hub's own
        sampler's by default) on the elements of ``noised_tensors`` (keys: ``noised_key``, and
        ``NOISED_CANARIES`` for the audit's canaries). ``sensitivity`` defaults to
        ``clipping_norm`` (per-example clipping); ``also_trains``: heads trained jointly with
        ``component``; ``run_id``: the training run's random id (``new_run_id``)."""
        if dataset.size is None:
            raise LedgerError([f"stages.{name}.dataset.size: required for a DP stage"])
        delta = resolve_delta(delta, dataset.size)
        acc = Accountant(accountant)
        eps = {
            a: round_up(e) for a, e in epsilons(noise_multiplier, sample_rate, steps, delta).items()
        }
        sensitivity = clipping_norm if sensitivity is None else sensitivity
        noised_dimension = sum(noised_tensors.values())
        return _validated(
            cls,
            name=name,
            component=component,
            also_trains=list(also_trains),
            dataset=dataset,
            description=description,
            mechanism=mechanism,
            mechanism_params=mechanism_params or {},
            sampling=sampling,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
            steps=steps,
            clipping_norm=clipping_norm,
            sensitivity=sensitivity,
            noise_std=noise_multiplier * sensitivity,
            expected_batch_size=sample_rate * dataset.size,
            delta=delta,
            noise_support=noise_support,
            noised_dimension=noised_dimension,
            noised_tensors=dict(noised_tensors),
            truncation_delta=truncation_delta(
                noise_multiplier, sample_rate, steps, noise_support, noised_dimension
            ),
            accountant=acc,
            epsilon=eps[acc],
            reference_epsilon={a: eps[a] for a in acc.others},
            audit=audit,
            run_id=run_id,
            hyperparameters=hyperparameters or {},
        )


Stage = Annotated[NonPrivateStage | DPStage, Field(discriminator="type")]


class Guarantee(_Model):
    """(epsilon, delta)-DP for one private dataset, composing the DP stages that touched it."""

    dataset: str
    epsilon: float = Field(ge=0)
    delta: float = Field(gt=0, lt=1)
    accountant: Accountant = Accountant.RDP
    stages: list[str] = Field(min_length=1)

    @property
    def key(self) -> str:
        return self.dataset


@dataclass(frozen=True)
class PrivacySummary:
    """What a component's weights promise: the guarantee of every private dataset its stages
    (a head's include its encoder's) saw, and the private datasets used without DP. This is
    what cards, pages, the hub index, commit messages, ``verify`` and responses show."""

    component: str
    guarantees: tuple[Guarantee, ...]
    unprotected_datasets: tuple[str, ...]
    assumed_poisson: tuple[str, ...] = ()
    """DP stages accounted as Poisson-sampled that were not (imported releases that shuffled)."""
    epsilon_without_amplification: float | None = None
    """With ``assumed_poisson``: the largest epsilon that holds without amplification by sampling
    (each such stage's examples in every one of its epochs), under PLD."""

    @property
    def epsilon(self) -> float | None:
        """The largest epsilon; 0 without private data; None when some private data has no
        guarantee."""
        if self.unprotected_datasets:
            return None
        return max((g.epsilon for g in self.guarantees), default=0.0)

    @property
    def delta(self) -> float:
        return max((g.delta for g in self.guarantees), default=0.0)

    @property
    def datasets(self) -> tuple[str, ...]:
        """The private datasets with a DP guarantee."""
        return tuple(g.dataset for g in self.guarantees)

    @property
    def accountant(self) -> Accountant | None:
        return self.guarantees[0].accountant if self.guarantees else None

    @property
    def private_data(self) -> bool:
        return bool(self.guarantees or self.unprotected_datasets)

    @property
    def caveat(self) -> str | None:
        """What a reader must be told wherever the epsilon is shown, if anything."""
        if not self.assumed_poisson:
            return None
        assert self.epsilon_without_amplification is not None  # summary() computes it always
        return (
            f"as reported, assuming Poisson sampling ({', '.join(self.assumed_poisson)} did not "
            "sample so; without amplification by sampling: ε = "
            f"{shown_epsilon(self.epsilon_without_amplification)} under PLD)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (responses, the hub index)."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "datasets": list(self.datasets),
            "accountant": self.accountant.value if self.accountant else None,
            "private_data": self.private_data,
            "unprotected_datasets": list(self.unprotected_datasets),
            "caveat": self.caveat,
            "epsilon_without_amplification": self.epsilon_without_amplification,
        }


def privacy_headline(summary: PrivacySummary) -> str:
    """One line stating a component's guarantee, as the card, pages and CLI show it."""
    digits = 2 if _ROUNDING_BEFORE.get() else 3  # the headline's δ had two digits then
    parts = [
        f"(ε = {shown_epsilon(g.epsilon)}, δ = {shown_delta(g.delta, digits)})-DP on {g.dataset} "
        f"[{g.accountant.value.upper()}]"
        for g in summary.guarantees
    ]
    parts += [f"NO guarantee for {d} (used without DP)" for d in summary.unprotected_datasets]
    line = "; ".join(parts) if parts else "no private data (ε = 0)"
    return f"{line}, {summary.caveat}" if summary.caveat else line


class PrivacyLedger(_Model):
    """The whole record; see the module docstring."""

    schema_: Literal["vip-hub/privacy-ledger/v4"] = Field(default=SCHEMA, alias="schema")
    privacy_unit: Literal["example"] = "example"
    adjacency: Literal["add-remove"] = "add-remove"
    stages: list[Stage] = Field(min_length=1, max_length=MAX_STAGES)
    guarantees: list[Guarantee] = Field(default_factory=list, max_length=MAX_STAGES)
    artifacts: dict[str, str] = Field(default_factory=dict)

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[Any]) -> list[Any]:
        seen: set[str] = set()
        for i, stage in enumerate(stages):
            if stage.name in seen:
                raise ValueError(f"stages.{i}.name: duplicate stage name {stage.name!r}")
            seen.add(stage.name)
        return stages

    @model_validator(mode="after")
    def _consistent(self) -> PrivacyLedger:
        problems: list[str] = []
        expected = _dp_stages_by_dataset(self.stages)
        unprotected = {
            s.dataset.key for s in self.stages if isinstance(s, NonPrivateStage) and s.private_data
        }
        for i, s in enumerate(self.stages):
            if isinstance(s, NonPrivateStage) and not s.private_data and s.dataset.key in expected:
                problems.append(
                    f"stages.{i}.private_data: false, but {s.dataset.name!r} is the private "
                    f"dataset of DP stage {expected[s.dataset.key][0].name!r}"
                )
        claimed: set[str] = set()
        for i, g in enumerate(self.guarantees):
            if g.key in claimed:
                problems.append(f"guarantees.{i}.dataset: two guarantees for {g.dataset!r}")
            claimed.add(g.key)
            if g.key not in expected:
                problems.append(f"guarantees.{i}.dataset: no DP stage trained on {g.dataset!r}")
            elif sorted(g.stages) != sorted(s.name for s in expected[g.key]):
                problems.append(
                    f"guarantees.{i}.stages: {g.stages} must list exactly the DP stages on "
                    f"{g.dataset!r}: {[s.name for s in expected[g.key]]}"
                )
            if g.key in unprotected:
                problems.append(
                    f"guarantees.{i}.dataset: {g.dataset!r} was also used by a non-private "
                    "stage, so no DP guarantee can be claimed for it"
                )
        for key, group in expected.items():
            if key not in claimed:
                problems.append(f"guarantees: missing a guarantee for dataset {key!r}")
            if problem := _delta_problem(key, max(s.delta for s in group), group):
                problems.append(problem)
        problems += _spellings(self.stages)
        for path, digest in self.artifacts.items():
            try:
                validate_relpath(path)
            except UnsafePathError as e:
                problems.append(f"artifacts: {e}")
            if not re.match(_DIGEST, digest):
                problems.append(f"artifacts.{path}: digest {digest!r} is not sha256:<hex64>")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ----------------------------------------------------------------- building
    @classmethod
    def build(
        cls, stages: Iterable[NonPrivateStage | DPStage], artifacts: dict[str, str] | None = None
    ) -> PrivacyLedger:
        """A ledger whose guarantees are computed from its DP stages."""
        stages = list(stages)
        return _validated(
            cls, stages=stages, guarantees=compute_guarantees(stages), artifacts=artifacts or {}
        )

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any]) -> PrivacyLedger:
        """Parse JSON text or a dict; raises LedgerError naming each offending field."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except (ValueError, RecursionError) as e:
                raise LedgerError([f"ledger: not valid JSON ({e})"]) from None
        if not isinstance(data, dict):
            raise LedgerError(["ledger: must be a JSON object"])
        if problems := _values_problems(data):
            raise LedgerError(problems)
        if data.get("schema") != SCHEMA:
            raise LedgerError(
                [
                    f"schema: expected {SCHEMA!r}, got {data.get('schema')!r}"
                    f"{_OLD_SCHEMAS.get(str(data.get('schema')), '')}"
                ]
            )
        try:
            text = json.dumps(data)
        except (TypeError, ValueError) as e:  # a dict given, not parsed JSON
            raise LedgerError([f"ledger: holds a value JSON cannot ({e})"]) from None
        try:  # strict: "steps": "100" or "private_data": "no" is refused, not converted
            return cls.model_validate_json(text, strict=True)
        except ValidationError as e:
            raise _from_validation(e) from None

    @classmethod
    def read(cls, repo: str | os.PathLike[str]) -> PrivacyLedger:
        """The ledger of the repo folder ``repo`` (its ledger file, parsed; a missing
        file is LedgerError naming it)."""
        path = Path(repo) / LEDGER_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise LedgerError([f"{path}: no such file (not a vip-hub repo?)"]) from None
        return cls.parse(text)

    # ---------------------------------------------------------------- reading
    def dp_stages(self) -> list[DPStage]:
        return [s for s in self.stages if isinstance(s, DPStage)]

    def stage(self, name: str) -> NonPrivateStage | DPStage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def components(self) -> list[str]:
        """Every component some stage trained (a joint stage's heads included)."""
        return sorted({c for s in self.stages for c in s.trained_components})

    def summary(self, component: str = ENCODER, delta: float | None = None) -> PrivacySummary:
        """What ``component``'s weights promise: its own stages composed (a head's include its
        encoder's; the encoder's leave out a DP head trained later on the same data), at the
        ledger's deltas, or each epsilon recomputed at ``delta`` (the hub's, to compare)."""
        stages = [s for s in self.stages if {ENCODER, component} & set(s.trained_components)]
        unprotected = [
            s.dataset.name for s in stages if isinstance(s, NonPrivateStage) and s.private_data
        ]
        guarantees = compute_guarantees(stages, delta)
        assumed = tuple(
            s.name for s in stages if isinstance(s, DPStage) and s.sampling != "poisson"
        )
        return PrivacySummary(
            component=component,
            guarantees=tuple(guarantees),
            unprotected_datasets=tuple(dict.fromkeys(unprotected)),
            assumed_poisson=assumed,
            epsilon_without_amplification=_without_amplification(stages, guarantees)
            if assumed
            else None,
        )


def _values_problems(data: Any) -> list[str]:
    """Nesting deeper than ``MAX_DEPTH``, else where ``data`` holds NaN or an infinity (JSON and
    YAML read them; no copy written by ``to_json`` holds one, and NaN equals no copy of itself),
    by path: one walk, not recursed."""
    found = []
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            found.append((where or "ledger", value))
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                return [f"ledger: nests lists and objects deeper than {MAX_DEPTH} levels"]
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((child, f"{where}.{key}".lstrip("."), depth + 1) for key, child in items)
    return [f"{where}: {value} is not a number a ledger may hold" for where, value in sorted(found)]


def _skeleton(text: str) -> str:
    """``text`` with each non-ASCII character that Unicode's confusables table confuses with an
    ASCII one (a Cyrillic ``а``, a Greek ``ο``) replaced by that character."""
    if text.isascii():
        return text
    from confusable_homoglyphs import confusables

    out = []
    for c in text:
        found = not c.isascii() and confusables.is_confusable(c, greedy=True)
        look_alikes = sorted(
            h["c"]
            for f in found or []
            for h in f["homoglyphs"]
            if len(h["c"]) == 1 and h["c"].isascii()
        )
        out.append(look_alikes[0] if look_alikes else c)
    return "".join(out)


def dataset_identity(name: str) -> str:
    """The dataset a name reads as: two names with one identity (``Digits`` and ``digits``,
    ``org/a_b`` and ``org/a-b``, a fullwidth letter, a look-alike of another script, an invisible
    character) name one dataset, whose stages compose."""
    shown = "".join(
        c
        for c in unicodedata.normalize("NFKC", name)
        if unicodedata.category(c) not in ("Cc", "Cf")
    )
    return re.sub(r"[\s_.-]+", "-", _skeleton(shown.strip().casefold()).casefold())


def _spellings(stages: Iterable[Any]) -> list[str]:
    """One dataset named in two ways (``dataset_identity``) would escape composition: refused."""
    seen: dict[str, str] = {}
    problems = []
    for s in stages:
        name, identity = s.dataset.name, dataset_identity(s.dataset.name)
        if seen.setdefault(identity, name) != name:
            problems.append(
                f"stages.{s.name}.dataset.name: {name!r} and {seen[identity]!r} name one dataset "
                "in two ways: use one name, so its stages compose"
            )
    return problems


def _dp_stages_by_dataset(stages: Iterable[Any]) -> dict[str, list[DPStage]]:
    groups: dict[str, list[DPStage]] = {}
    for s in stages:
        if isinstance(s, DPStage):
            groups.setdefault(s.dataset.key, []).append(s)
    return groups


def compute_guarantees(
    stages: Iterable[NonPrivateStage | DPStage], at_delta: float | None = None
) -> list[Guarantee]:
    """One guarantee per private dataset: its DP stages composed under the first one's accountant,
    at ``at_delta`` (every epsilon recomputed from (sigma, q, T)), else at the stages' delta (the
    largest when they name different ones); the guarantee's delta adds every stage's
    ``truncation_delta`` to it."""
    out = []
    for name, group in _dp_stages_by_dataset(stages).items():
        accountant = group[0].accountant
        delta = max(s.delta for s in group) if at_delta is None else at_delta
        if problem := _delta_problem(name, delta, group):
            raise LedgerError([problem])
        eps = (
            group[0].epsilon
            if len(group) == 1 and delta == group[0].delta
            else round_up(  # below 0 at a large delta: (0, delta) holds then too
                max(0.0, composed_epsilon([s.mechanism_tuple for s in group], delta, accountant))
            )
        )
        out.append(
            Guarantee(
                dataset=name,
                epsilon=eps,
                delta=delta + truncated(group),
                accountant=accountant,
                stages=[s.name for s in group],
            )
        )
    return out


def _delta_problem(dataset: str, delta: float, stages: list[DPStage]) -> str | None:
    """A guarantee's delta (``delta`` and its stages' truncation deltas) must stay below 1."""
    if delta + truncated(stages) < 1:
        return None
    return (
        f"guarantees: delta {delta:.6g} on {dataset!r} plus its stages' truncation deltas "
        f"{truncated(stages):.6g} is not below 1: no guarantee"
    )


def truncated(stages: Iterable[DPStage]) -> float:
    """What the stages' truncated noise samplers add to the delta of their composition."""
    return sum(s.truncation_delta for s in stages)


def compose_releases(
    stages: Iterable[DPStage], delta: float, accountants: Iterable[Accountant] = tuple(Accountant)
) -> dict[Accountant, float]:
    """Every distinct given DP stage (e.g. every release on one dataset, across repos; stages of
    one ``identity`` counted once) composed at ``delta``, each epsilon recomputed from its
    (sigma, q, T) whatever delta and epsilon the stage states: epsilon under each of
    ``accountants``, rounded up."""
    distinct = {s.identity: s for s in stages}
    if not distinct:
        raise LedgerError(["compose_releases: no DP stage to compose"])
    history = [s.mechanism_tuple for s in distinct.values()]
    return {a: round_up(composed_epsilon(history, delta, a)) for a in accountants}


def noised_key(file: str, tensor: str) -> str:
    """A noised tensor's key in ``DPStage.noised_tensors``: the repo file that holds it (a weights
    file, or ``NOT_RELEASED``) and its name there."""
    return f"{file}:{tensor}"


def new_run_id() -> str:
    """A training run's random id (a UUID4, 122 random bits, as 32 hex digits), recorded in its
    DP stage: public, and drawn apart from the run's secrets."""
    return uuid.uuid4().hex


def _without_amplification(stages: list[Any], guarantees: list[Guarantee]) -> float:
    """The largest epsilon over ``guarantees`` when every non-Poisson stage is taken as its
    examples in each of its epochs (q = 1, T = ceil(qT)) under PLD, at each guarantee's delta."""
    groups = _dp_stages_by_dataset(stages)
    worst = 0.0
    for g in guarantees:
        history = [
            s.mechanism_tuple
            if s.sampling == "poisson"
            else (s.noise_multiplier, 1.0, math.ceil(s.sample_rate * s.steps - 1e-9))
            for s in groups[g.key]
        ]
        delta = max(s.delta for s in groups[g.key])
        worst = max(worst, round_up(composed_epsilon(history, delta, Accountant.PLD)))
    return worst


def _validated(cls: type[Any], **fields: Any) -> Any:
    try:
        return cls(**fields)
    except ValidationError as e:
        raise _from_validation(e) from None
