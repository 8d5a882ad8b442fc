"""The privacy ledger: what data each training stage saw and what it cost.

A versioned JSON document (``"schema": "vip-hub/privacy-ledger/v1"``) stored three times
in a released repo (safetensors metadata, ``privacy_ledger.json``, the model card) and
recomputed by ``vip-hub verify``. See DESIGN.md, "The privacy ledger".

- ``stages``: in order; ``non-private`` stages (synthetic pretraining, a non-DP probe)
  and ``dp`` stages (Poisson-sampled Gaussian mechanism with all its parameters).
- ``guarantees``: one per private dataset, composing every DP stage that touched it.
- ``artifacts``: digests of the files the ledger describes, binding it to the weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .paths import UnsafePathError, validate_relpath
from .accounting import Accountant, composed_epsilon, default_delta, epsilon

SCHEMA_V1 = "vip-hub/privacy-ledger/v1"
ENCODER = "encoder"
_COMPONENT = r"^(encoder|heads/[A-Za-z0-9][A-Za-z0-9_.-]{0,63})$"
_DIGEST = r"^(sha256|tensors-sha256):[0-9a-f]{64}$"

__all__ = [
    "ENCODER",
    "SCHEMA_V1",
    "DPStage",
    "Dataset",
    "Guarantee",
    "LedgerError",
    "NonPrivateStage",
    "PrivacyLedger",
    "PrivacySummary",
    "Stage",
]


class LedgerError(ValueError):
    """An invalid ledger. The message names every offending field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid privacy ledger: " + "; ".join(problems))

    @classmethod
    def from_validation(cls, err: ValidationError) -> "LedgerError":
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "ledger"
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {msg}")
        return cls(problems)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Dataset(_Model):
    """A dataset as the ledger names it. ``fingerprint`` pins the exact contents."""

    name: str = Field(min_length=1, max_length=200)
    size: int | None = Field(default=None, gt=0, description="number of training examples n")
    fingerprint: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    description: str = ""

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.name, self.fingerprint)


class _Stage(_Model):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._:-]{0,99}$")
    component: str = Field(default=ENCODER, pattern=_COMPONENT)
    dataset: Dataset
    description: str = ""


class NonPrivateStage(_Stage):
    """A stage without DP. ``private_data`` says whether its data is sensitive (and so unprotected)."""

    type: Literal["non-private"] = "non-private"
    private_data: bool


class DPStage(_Stage):
    """A DP stage: Poisson sampling at rate q, clipping to C, Gaussian noise sigma*C, T steps."""

    type: Literal["dp"] = "dp"
    mechanism: Literal["DP-AdamW", "DP-Adam", "DP-SGD"]
    sampling: Literal["poisson"] = "poisson"
    sample_rate: float = Field(gt=0, le=1)
    noise_multiplier: float = Field(gt=0)
    steps: int = Field(gt=0)
    clipping_norm: float = Field(gt=0)
    expected_batch_size: float = Field(gt=0)
    delta: float = Field(gt=0, lt=1)
    accountant: Accountant = Accountant.RDP
    epsilon: float = Field(ge=0)
    reference_epsilon: dict[Accountant, float] = Field(default_factory=dict)
    hyperparameters: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "DPStage":
        n = self.dataset.size
        if n is None:
            raise ValueError("dataset.size is required for a DP stage (q and delta depend on it)")
        if abs(self.sample_rate * n - self.expected_batch_size) > 1e-6 * max(1.0, self.expected_batch_size):
            raise ValueError(
                f"expected_batch_size {self.expected_batch_size} != sample_rate * dataset.size "
                f"= {self.sample_rate * n:g}"
            )
        if self.accountant in self.reference_epsilon:
            raise ValueError("reference_epsilon must name other accountants than the stage's own")
        return self

    @property
    def mechanism_params(self) -> tuple[float, float, int]:
        """(sigma, q, T), the accountant's view of this stage."""
        return (self.noise_multiplier, self.sample_rate, self.steps)

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
        mechanism: str = "DP-AdamW",
        delta: float | None = None,
        accountant: Accountant | str = Accountant.RDP,
        component: str = ENCODER,
        description: str = "",
        hyperparameters: dict[str, Any] | None = None,
    ) -> "DPStage":
        """Build a DP stage, computing its epsilon under ``accountant`` and the other one."""
        if dataset.size is None:
            raise LedgerError([f"stages.{name}.dataset.size: required for a DP stage"])
        delta = default_delta(dataset.size) if delta is None else delta
        acc = Accountant(accountant)
        eps = {
            a: epsilon(noise_multiplier, sample_rate, steps, delta, a) for a in (acc, acc.other)
        }
        return _validated(
            cls,
            name=name,
            component=component,
            dataset=dataset,
            description=description,
            mechanism=mechanism,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
            steps=steps,
            clipping_norm=clipping_norm,
            expected_batch_size=sample_rate * dataset.size,
            delta=delta,
            accountant=acc,
            epsilon=eps[acc],
            reference_epsilon={acc.other: eps[acc.other]},
            hyperparameters=hyperparameters or {},
        )


Stage = Annotated[NonPrivateStage | DPStage, Field(discriminator="type")]


class Guarantee(_Model):
    """(epsilon, delta)-DP for one private dataset, composing the DP stages that touched it."""

    dataset: str
    fingerprint: str | None = None
    epsilon: float = Field(ge=0)
    delta: float = Field(gt=0, lt=1)
    accountant: Accountant = Accountant.RDP
    stages: list[str] = Field(min_length=1)

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.dataset, self.fingerprint)


@dataclass(frozen=True)
class PrivacySummary:
    """The headline guarantee of one component (what responses and list pages show)."""

    epsilon: float
    delta: float
    datasets: tuple[str, ...]
    accountant: Accountant | None
    unprotected_datasets: tuple[str, ...]

    @property
    def private_data(self) -> bool:
        return bool(self.datasets or self.unprotected_datasets)


class PrivacyLedger(_Model):
    """The whole record; see the module docstring."""

    schema_: Literal["vip-hub/privacy-ledger/v1"] = Field(default=SCHEMA_V1, alias="schema")
    privacy_unit: Literal["example"] = "example"
    adjacency: Literal["add-remove"] = "add-remove"
    stages: list[Stage] = Field(min_length=1)
    guarantees: list[Guarantee] = Field(default_factory=list)
    artifacts: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "PrivacyLedger":
        problems: list[str] = []
        seen: set[str] = set()
        for i, stage in enumerate(self.stages):
            if stage.name in seen:
                problems.append(f"stages.{i}.name: duplicate stage name {stage.name!r}")
            seen.add(stage.name)
        expected = _dp_stages_by_dataset(self.stages)
        unprotected = {
            s.dataset.key for s in self.stages if isinstance(s, NonPrivateStage) and s.private_data
        }
        claimed: set[tuple[str, str | None]] = set()
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
        for key, stages in expected.items():
            if key not in claimed:
                problems.append(f"guarantees: missing a guarantee for dataset {key[0]!r}")
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
    ) -> "PrivacyLedger":
        """A ledger whose guarantees are computed from its DP stages."""
        stages = list(stages)
        return _validated(
            cls, stages=stages, guarantees=compute_guarantees(stages), artifacts=artifacts or {}
        )

    def with_stage(self, stage: NonPrivateStage | DPStage) -> "PrivacyLedger":
        """A copy with ``stage`` appended and the guarantees recomputed."""
        return PrivacyLedger.build([*self.stages, stage], self.artifacts)

    def with_artifacts(self, artifacts: dict[str, str]) -> "PrivacyLedger":
        """A copy that binds the given file digests (replacing the old ones)."""
        return _validated(PrivacyLedger, **{**self.model_dump(by_alias=True), "artifacts": artifacts})

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any]) -> "PrivacyLedger":
        """Parse JSON text or a dict; raises LedgerError naming each offending field."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except ValueError as e:
                raise LedgerError([f"ledger: not valid JSON ({e})"]) from None
        if not isinstance(data, dict):
            raise LedgerError(["ledger: must be a JSON object"])
        if data.get("schema") != SCHEMA_V1:
            raise LedgerError([f"schema: expected {SCHEMA_V1!r}, got {data.get('schema')!r}"])
        return _validated(cls, **data)

    # ---------------------------------------------------------------- reading
    def dp_stages(self) -> list[DPStage]:
        return [s for s in self.stages if isinstance(s, DPStage)]

    def stage(self, name: str) -> NonPrivateStage | DPStage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def components(self) -> list[str]:
        return sorted({s.component for s in self.stages})

    def summary(self, component: str = ENCODER) -> PrivacySummary:
        """Headline guarantee of ``component``: a head inherits its encoder's stages."""
        stages = [s for s in self.stages if s.component in (ENCODER, component)]
        names = {s.name for s in stages}
        guarantees = [g for g in self.guarantees if names.intersection(g.stages)]
        unprotected = [
            s.dataset.name for s in stages if isinstance(s, NonPrivateStage) and s.private_data
        ]
        return PrivacySummary(
            epsilon=max((g.epsilon for g in guarantees), default=0.0),
            delta=max((g.delta for g in guarantees), default=0.0),
            datasets=tuple(g.dataset for g in guarantees),
            accountant=guarantees[0].accountant if guarantees else None,
            unprotected_datasets=tuple(dict.fromkeys(unprotected)),
        )


def _dp_stages_by_dataset(stages: Iterable[Any]) -> dict[tuple[str, str | None], list[DPStage]]:
    groups: dict[tuple[str, str | None], list[DPStage]] = {}
    for s in stages:
        if isinstance(s, DPStage):
            groups.setdefault(s.dataset.key, []).append(s)
    return groups


def compute_guarantees(stages: Iterable[NonPrivateStage | DPStage]) -> list[Guarantee]:
    """One guarantee per private dataset: its DP stages composed under the first one's accountant.

    When the stages name different deltas the composition is reported at the largest.
    """
    out = []
    for (name, fingerprint), group in _dp_stages_by_dataset(stages).items():
        accountant = group[0].accountant
        delta = max(s.delta for s in group)
        eps = (
            group[0].epsilon
            if len(group) == 1
            else composed_epsilon([s.mechanism_params for s in group], delta, accountant)
        )
        out.append(
            Guarantee(
                dataset=name,
                fingerprint=fingerprint,
                epsilon=eps,
                delta=delta,
                accountant=accountant,
                stages=[s.name for s in group],
            )
        )
    return out


def _validated(cls: type[Any], **fields: Any) -> Any:
    try:
        return cls(**fields)
    except ValidationError as e:
        raise LedgerError.from_validation(e) from None
