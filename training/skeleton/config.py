"""Recipe configurations, declared once, and the one way every entry point reads them.

Each recipe declares its settings as one pydantic model (a subclass of ``RunConfig``, or of
``DPRunConfig`` for DP recipes, with its AdamW defaults and warm-up rule given once to
``with_adamw``) and itself as one ``Recipe``. From that declaration come the
``vip-hub train-<name>`` options, the arguments of ``torchrun -m training.recipes.<name>`` (the same
ones), and TOML files given with ``--config FILE`` (keys named like the fields; options given
on the command line win). Field descriptions are the help texts.
"""

from __future__ import annotations

import argparse
import enum
import sys
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

from vip_hub.device import DEVICE_HELP, check_device_name
from vip_hub.errors import ConfigError
from vip_hub.privacy.accounting import DEFAULT_DELTA_RULE, Accountant
from vip_hub.privacy.audit import DEFAULT_CANARIES, DEFAULT_DELTA, MAX_CANARIES
from vip_hub.privacy.ledger import DATASET_NAME_PATTERN
from vip_hub.privacy.sensitivity import MIN_CLIP
from vip_hub.repo.files import card_repo_id
from vip_hub.repo_format import SIGNATURE_FILE

from ..dp.sampling import SECRET_BITS

__all__ = [
    "ADAMW_BETAS",
    "DPRunConfig",
    "DeviceName",
    "accountant_field",
    "device_field",
    "check_outside_data",
    "overlap",
    "EncoderParameters",
    "Recipe",
    "RunConfig",
    "WarmupRule",
    "WeakDeltaOption",
    "add_config_args",
    "config_from_args",
    "field_help",
    "recipe_main",
    "run_folder",
    "tenth_of_steps",
    "tenth_of_steps_to_1000",
    "two_fifths_of_steps",
    "with_adamw",
]


DeviceName = Annotated[str, AfterValidator(check_device_name)]
"""A run's device: a name ``vip_hub.device`` knows, refused as the settings are read."""


def device_field(default: str = "auto") -> Any:
    """A run's or head's ``device`` field."""
    return Field(default, description=DEVICE_HELP)


class RunConfig(BaseModel):
    """What every training run has: where it writes, how long, cadences, device and seed."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    NOT_RUN_SETTINGS: ClassVar[tuple[str, ...]] = (
        "out",
        "device",
        "workers",
        "checkpoint_every",
        "restart",
        "model_name",
        "repo_id",
        "signing_key",
    )
    """Fields that name outputs or resources, not the run: they may change across a resume."""

    out: str = Field(
        description="folder the released repo is written to (the run folder is OUT.run/)"
    )
    steps: int = Field(
        1000, gt=0, description="training steps (a DP run may stop earlier, within its budget)"
    )
    seed: int | None = Field(
        0, ge=0, lt=1 << SECRET_BITS, description="seed of every random stream"
    )
    device: DeviceName = device_field()
    bf16: bool = Field(
        True, description="bf16 autocast on CUDA (off: fp32 as on the CPU, which never autocasts)"
    )
    workers: int = Field(1, ge=0, description="data-loading processes")
    checkpoint_every: int = Field(100, gt=0, description="steps between checkpoints")
    eval_every: int | None = Field(
        None, gt=0, description="steps between evaluations (default: steps // 20)"
    )
    model_name: str | None = Field(
        None, description="model name on the card (default: the folder's name)"
    )
    repo_id: str | None = Field(None, description="hub id shown on the card, e.g. vip/vip-nano")
    restart: bool = Field(False, description="discard the run folder's checkpoint and start over")
    signing_key: str | None = Field(
        None,
        description=f"private key that signs the exported repo, {SIGNATURE_FILE} "
        "(default: VIP_HUB_SIGNING_KEY; neither: unsigned)",
    )

    @field_validator("out")
    @classmethod
    def _names_a_folder(cls, value: str) -> str:
        """``--out`` ends in the repo folder's name (its run folder is named after it)."""
        if not Path(value).name:
            raise ValueError(f"{value!r} names no folder: give a path that ends in the repo's name")
        return value

    @model_validator(mode="after")
    def _names_a_repo(self) -> RunConfig:
        """The card's repo id (``repo_id``, else from ``model_name`` or ``--out``'s name) is one
        the hub client sends: checked before training, not at its export."""
        card_repo_id(self.model_name or Path(self.out).name, self.repo_id)
        return self

    def run_settings(self) -> dict[str, Any]:
        """The fields that must match for a checkpoint to be resumed."""
        return self.model_dump(mode="json", exclude=set(self.NOT_RUN_SETTINGS))

    @classmethod
    def run_defaults(cls) -> dict[str, Any]:
        """The run settings' defaults, as ``run_settings`` writes them (a checkpoint written
        before a setting existed ran at its default)."""
        return {
            name: to_jsonable_python(field.get_default(call_default_factory=True))
            for name, field in cls.model_fields.items()
            if name not in cls.NOT_RUN_SETTINGS and not field.is_required()
        }


class WeakDeltaOption(BaseModel):
    """The option every DP recipe and DP head shares: train at a delta above 1/n only when asked."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    allow_weak_delta: bool = Field(
        False,
        description="allow a --delta above 1/n (refused otherwise: at such a delta a mechanism "
        "may publish a random record); a delta above 1/(10n) is flagged weak wherever shown",
    )


def accountant_field() -> Any:
    """A DP run's or head's ``accountant`` field: the one whose epsilon is the claim."""
    return Field(Accountant.RDP, description="the accountant whose epsilon is the claim")


class DPRunConfig(RunConfig, WeakDeltaOption):
    """What every DP recipe has: data, budget, batch, clipping, accountant and audit."""

    data: str = Field(description="the private training data (see the recipe for its layout)")
    epsilon: float | None = Field(
        8.0, gt=0, description="target epsilon; training stops before exceeding it"
    )
    sigma: float | None = Field(
        None, gt=0, description="noise multiplier (default: calibrated from --epsilon)"
    )
    delta: float | None = Field(
        None, gt=0, lt=1, description=f"delta (default {DEFAULT_DELTA_RULE})"
    )
    batch_size: int = Field(256, gt=0, description="expected logical batch size B (q = B/n)")
    dataset_size: int | None = Field(
        None, gt=0, description="n, checked against the examples found"
    )
    dataset_name: str = Field(
        pattern=DATASET_NAME_PATTERN,
        description="the private data's declared name, namespaced (e.g. org/fashion-mnist-train): "
        "its identity in every ledger; stages on one name compose",
    )
    micro_batch_size: int = Field(
        32, gt=0, description="physical batch that fits memory (does not change the result)"
    )
    max_grad_norm: float = Field(0.1, ge=MIN_CLIP, description="clipping norm C")
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="release the iterates' exponential moving average, decay d a step from the "
        "initial weights (post-processing: no privacy cost; De et al. 2022); 0: the last iterate",
    )
    accountant: Accountant = accountant_field()
    audit_canaries: int = Field(
        DEFAULT_CANARIES,
        ge=0,
        le=MAX_CANARIES,
        description="canaries of the one-run audit (0 turns it off)",
    )
    audit_delta: float = Field(
        DEFAULT_DELTA, gt=0, lt=1, description="delta at which the audit bounds epsilon"
    )
    seed: int | None = Field(
        None,
        ge=0,
        lt=1 << SECRET_BITS,
        description="seed of every random stream (default: a secret random one)",
    )
    checkpoint_every: int = Field(50, gt=0, description="steps between checkpoints")
    steps: int = Field(
        100, gt=0, description="training steps (the run stops earlier if the budget says so)"
    )

    @field_validator("audit_canaries")
    @classmethod
    def _audit_has_a_guess(cls, m: int) -> int:
        if m == 1:  # its ledger would refuse the audit only once the training is done
            raise ValueError("one canary leaves no guess to count: 2 at least, or 0 for no audit")
        return m

    @model_validator(mode="after")
    def _out_outside_data(self) -> DPRunConfig:
        check_outside_data("--out", self.out, self.data)
        init = getattr(self, "init", None)  # the recipes that start from a repo declare it
        if init is not None and Path(init).exists():
            if overlap(self.out, init):
                raise ValueError(
                    f"--out {self.out} and --init {init} overlap: the export replaces --out "
                    "whole, so the repo the run starts from would be lost or changed; give a "
                    "folder apart from it"
                )
        return self


def run_folder(out: Path) -> Path:
    """The run folder of a run exporting to ``out`` (its secret seed, checkpoints): ``OUT.run``."""
    return out.with_name(out.name + ".run")


def overlap(a: str | Path, b: str | Path) -> bool:
    """Whether folder ``a`` and folder ``b`` (resolved) are one, or one holds the other."""
    first, second = Path(a).resolve(), Path(b).resolve()
    return first.is_relative_to(second) or second.is_relative_to(first)


def check_outside_data(option: str, folder: str, data: str) -> None:
    """ValueError when the repo ``folder`` (given as ``option``) and the private ``data`` overlap:
    a release (and a run's folder, its secret seed) inside ``data`` would be written among the
    private examples, which a later run would count; ``data`` inside ``folder`` or its run folder
    would be deleted by the export, which replaces ``folder`` whole, or by --restart."""
    out, private = Path(folder).resolve(), Path(data).resolve()
    if out.is_relative_to(private):
        raise ValueError(
            f"{option} {folder} is inside --data {data}: the release would be written among the "
            "private examples; give a folder outside it"
        )
    if private.is_relative_to(out) or private.is_relative_to(run_folder(out)):
        raise ValueError(
            f"--data {data} is inside {option} {folder} or its run folder "
            f"{run_folder(out).name}: the export replaces the one whole and --restart deletes "
            "the other, with the private examples in them; give folders apart"
        )


C = TypeVar("C", bound=RunConfig)

EncoderParameters = Literal["all", "biases"]
"""What of the encoder a DP stage trains beside a decoder or a head: every parameter it would
train, or its one-dimensional ones only (biases and normalisation scales)."""

WarmupRule = Callable[[int], int]
"""A recipe's default warm-up from its steps; its docstring is the ``--warmup-steps`` default."""


def tenth_of_steps(steps: int) -> int:
    """steps // 10, at least 1"""
    return max(1, steps // 10)


def tenth_of_steps_to_1000(steps: int) -> int:
    """min(1000, steps // 10)"""
    return max(1, min(1000, steps // 10))


def two_fifths_of_steps(steps: int) -> int:
    """0.4 x steps, the paper's"""
    return max(1, round(0.4 * steps))


def _lr_field(default: float, note: str | None = None) -> Any:
    """A recipe's ``lr`` field: AdamW's peak learning rate, ``default`` unless given."""
    return Field(default, gt=0, description="peak learning rate" + (f" ({note})" if note else ""))


def _warmup_field(rule: WarmupRule) -> Any:
    """A recipe's ``warmup_steps`` field: None stands for ``rule(steps)``."""
    return Field(None, ge=0, description=f"warm-up steps (default: {rule.__doc__})")


def _weight_decay_field(default: float) -> Any:
    """A recipe's ``weight_decay`` field: AdamW's decoupled weight decay."""
    return Field(default, ge=0, description="AdamW weight decay (touches no data: no privacy cost)")


ADAMW_BETAS = (0.9, 0.95)
"""AdamW's betas, as in MAE: the recipes' ``beta1`` and ``beta2`` defaults."""


def _beta_field(n: typing.Literal[1, 2]) -> Any:
    """A recipe's ``beta1`` or ``beta2`` field (``ADAMW_BETAS``)."""
    return Field(ADAMW_BETAS[n - 1], ge=0, lt=1, description=f"AdamW beta{n}")


def with_adamw(
    base: type[C], *, lr: float, warmup: WarmupRule, weight_decay: float, lr_note: str | None = None
) -> type[C]:
    """``base`` with a recipe's AdamW fields (peak ``lr``, warm-up ``warmup(steps)`` unless given,
    ``weight_decay``, betas (0.9, 0.95) as in MAE): the one declaration of its defaults."""
    rule, peak, decay = warmup, lr, weight_decay  # the class body's own names hide the arguments

    class AdamWConfig(base):  # type: ignore[misc, valid-type]  # a base given at run time
        lr: float = _lr_field(peak, lr_note)
        warmup_steps: int | None = _warmup_field(rule)
        weight_decay: float = _weight_decay_field(decay)
        beta1: float = _beta_field(1)
        beta2: float = _beta_field(2)

        def warmup(self) -> int:
            """The warm-up steps: ``warmup_steps``, else the recipe's rule of its steps."""
            return rule(self.steps) if self.warmup_steps is None else self.warmup_steps

        def adamw_hyperparameters(self, schedule: str = "cosine", **horizon: int) -> dict[str, Any]:
            """The optimiser's settings as the ledger records them (``horizon``: the decay's,
            where it is not the steps)."""
            return {
                "lr": self.lr,
                "warmup_steps": self.warmup(),
                **horizon,
                "schedule": schedule,
                "weight_decay": self.weight_decay,
                "betas": [self.beta1, self.beta2],
            }

    return AdamWConfig


@dataclass(frozen=True)
class Recipe:
    """A recipe: its configuration and its training function (its command and what it does are
    listed in ``training.commands.RECIPES``)."""

    config: type[RunConfig]
    # (config, training.skeleton.distributed.Dist) -> the exported repo
    train: Callable[[Any, Any], Path]


def _base(tp: Any) -> Any:
    """``X | None`` -> X."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def field_help(model: type[BaseModel], name: str) -> str:
    """``model``'s field ``name``'s description as argparse help: its '%' escaped (argparse
    %-formats help, so a literal one would break ``--help``)."""
    return (model.model_fields[name].description or "").replace("%", "%%")


def add_config_args(parser: argparse.ArgumentParser, cls: type[BaseModel]) -> None:
    """One option per field of ``cls`` (defaults and help from the declaration) and ``--config``."""
    parser.add_argument(
        "--config", type=Path, help="TOML file of settings (command-line options win)"
    )
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        tp = _base(field.annotation)
        text = field_help(cls, name)
        if tp is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"{text} (default: {field.default})",
            )
            continue
        choices = None
        members = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        if len(members) > 1 and any(typing.get_origin(a) is typing.Literal for a in members):
            tp = str  # a number or a named value (``int | Literal["all"]``): pydantic parses it
        elif typing.get_origin(tp) is typing.Literal:
            choices, tp = list(typing.get_args(tp)), str
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            choices = [e.value for e in tp]
        kind = str if isinstance(tp, type) and issubclass(tp, (str, Path)) else tp
        default = "required" if field.is_required() else f"default: {_shown(field.default)}"
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            choices=choices,
            default=argparse.SUPPRESS,
            help=text if "(default" in text else f"{text} ({default})",  # its own, in words
        )


def _shown(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def config_from_args(cls: type[BaseModel], args: argparse.Namespace) -> Any:
    """The configuration from ``--config`` (if any) overridden by the options given."""
    values: dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path is not None:
        try:
            values = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--config {path}: {e}") from None
    values.update({k: v for k, v in vars(args).items() if k in cls.model_fields})
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        problems = "; ".join(  # a rule across options (no location) names them itself
            (f"--{'.'.join(map(str, err['loc'])).replace('_', '-')}: " if err["loc"] else "")
            + err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from None


def recipe_main(command: str, argv: list[str] | None = None) -> int:
    """``torchrun ... -m training.recipes.<recipe>`` entry point: the arguments of ``vip-hub
    <command>``."""
    from vip_hub.cli.main import main as cli_main

    return cli_main([command, *(sys.argv[1:] if argv is None else argv)])
