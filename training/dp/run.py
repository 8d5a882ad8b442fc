"""The DP recipes' run skeleton: a ``Run`` (``training/skeleton/run.py``) with its privacy plan (the
budget of its configuration and the sensitivity of its mechanism, both checked before the run
folder is touched), the DP engine (``training/dp/engine.py``) that trains its model with AdamW
from the recipe's fields, and the export of the encoder with that mechanism's ledger stage."""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vip_hub.errors import AuditError
from vip_hub.loading import Encoder
from vip_hub.models.encoders import EncoderSpec
from vip_hub.privacy.accounting import epsilons
from vip_hub.privacy.audit import DEFAULT_BETA
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.privacy.sensitivity import DP_ADAMW, rounding_params, sensitivity
from vip_hub.repo.files import declared_spatial

from ..skeleton.config import DPRunConfig, run_folder
from ..skeleton.distributed import Dist
from ..skeleton.run import Run
from .clipping import PerExampleClipper
from .engine import Budget, Clipper, DPEngine

__all__ = ["INIT_LEDGER", "DPRun", "retrained_if_flagged", "trial_weights"]

INIT_LEDGER = "init_ledger_sha256"
"""The run setting holding the SHA-256 of the ``--init`` repo's ledger (``DPRun.from_init``)."""

_C = TypeVar("_C", bound=DPRunConfig)

_TRIAL: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("trial_weights", default=None)


@contextmanager
def trial_weights() -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block a ``DPRun`` (ViP, DP-Cap, Logit-DP, Naive-DP, DP fine-tuning) writes and
    signs nothing; the encoder weights its ``export_dp`` would release land in the dict yielded.
    For trials on public records standing in for private ones (``benchmarks/standin.py``),
    whose noise may be too small for any ledger to state."""
    kept: dict[str, torch.Tensor] = {}
    token = _TRIAL.set(kept)
    try:
        yield kept
    finally:
        _TRIAL.reset(token)


class DPRun(Run):
    """One DP recipe's run of ``cfg`` on ``dist`` over ``dataset_size`` private examples, clipped
    by ``mechanism`` (its ledger name, with ``params``) to ``clipping_norm`` (default
    ``--max-grad-norm``); its sensitivity covers the rounding of the fp64 sums of up to
    ``sample_bound`` examples (``rounding_params``: the most the engine sums, and the rule).
    Outside ``trial_weights`` a budget whose ledger epsilons cannot be computed (a noise
    multiplier far too small, an audit delta below PRV's resolution) is refused before the run
    folder is touched."""

    cfg: DPRunConfig

    def __init__(
        self,
        cfg: DPRunConfig,
        dist: Dist,
        dataset_size: int,
        mechanism: str = DP_ADAMW,
        params: dict[str, Any] | None = None,
        clipping_norm: float | None = None,
    ):
        self.budget = Budget.for_config(cfg, dataset_size)
        if _TRIAL.get() is None:  # the ledger states every accountant's epsilon: checked now,
            b = self.budget  # and its audit's at the audit's delta
            for delta in {b.delta, cfg.audit_delta} if cfg.audit_canaries else {b.delta}:
                epsilons(b.noise_multiplier, b.sample_rate, b.steps, delta)
        rounding = rounding_params(dataset_size, self.budget.sample_rate)
        self.mechanism, self.params = mechanism, {**(params or {}), **rounding}
        self.clipping_norm = cfg.max_grad_norm if clipping_norm is None else clipping_norm
        self.sensitivity = sensitivity(mechanism, self.clipping_norm, self.params)
        super().__init__(cfg, dist)

    def engine(
        self, model: nn.Module, clipper: Clipper | None = None, *, horizon: int | None = None
    ) -> DPEngine:
        """The engine training ``model`` with ``Run.adamw`` (cosine over ``horizon`` steps,
        default the run's) and ``clipper``, the mechanism's (default: per-example clipping)."""
        if clipper is None:
            clipper = PerExampleClipper(model, self.clipping_norm)
        self.dp = DPEngine.for_run(
            clipper,
            *self.adamw(model, horizon),
            self.budget,
            self,
            self.cfg,
            sensitivity=self.sensitivity,
            clipping_norm=self.clipping_norm,
        )
        return self.dp

    def export(self, write: Callable[[str | None], Any]) -> Path:
        """``Run.export``, except inside ``trial_weights``: nothing written, nothing signed."""
        if _TRIAL.get() is None:
            return super().export(write)
        self.dist.barrier()  # as an export's: every rank leaves the run together
        return Path(self.cfg.out)

    def from_init(self, init: Encoder) -> None:
        """Make ``init``'s ledger a setting of this run, before anything resumes: a run resumed
        with ``--init`` holding another repo is refused as for any changed setting (its export
        would state that repo's stages for weights grown from the first)."""
        self.settings[INIT_LEDGER] = _digest(init.ledger)

    def export_dp(
        self, encoder: VisionTransformer, spec: EncoderSpec, init: Encoder, **fields: Any
    ) -> Path:
        """``DPEngine.export`` of the encoder the engine trained from the repo ``init``: its
        encoder stages, then the stage of this run's mechanism (``fields``: the records, the
        card's texts, the stage's name, description and hyper-parameters, files); the repo
        declares the spatial modes ``init`` declares (the modes chosen for its lineage). Inside
        ``trial_weights`` it keeps the encoder's weights there and writes nothing."""
        if self.settings.get(INIT_LEDGER) != _digest(init.ledger):
            raise RuntimeError("the recipe exports from an init it did not record (from_init)")
        kept = _TRIAL.get()
        if kept is not None:
            kept.update({k: v.detach().cpu().clone() for k, v in encoder.state_dict().items()})
        files = {"spatial": declared_spatial(init.config), **fields.pop("files", {})}
        return self.dp.export(
            self,
            self.cfg,
            encoder,
            spec,
            init.ledger,
            files=files,
            mechanism=self.mechanism,
            mechanism_params=self.params,
            **fields,
        )


def _digest(ledger: PrivacyLedger) -> str:
    return hashlib.sha256(ledger.to_json().encode()).hexdigest()


def retrained_if_flagged(train: Callable[[_C], Path], cfg: _C) -> Path:
    """``train(cfg)``, and once more from a fresh secret (its run folder removed) when its export's
    one-run audit flags it and ``cfg`` draws its seed: an honest run is flagged with probability at
    most the audit's beta, and the verdict reads only the canaries' coordinates, never the private
    records, so the run released is distributed as one run. A second flag, or a flag on a fixed
    seed (whose run would repeat), is raised."""
    try:
        return train(cfg)
    except AuditError as e:
        if cfg.seed is not None:
            raise
        print(
            f"{cfg.out}: its one-run audit flagged the run ({e}); an honest run is flagged with "
            f"probability at most beta = {DEFAULT_BETA:g}: training it again from a fresh secret",
            file=sys.stderr,
            flush=True,
        )
    shutil.rmtree(run_folder(Path(cfg.out)), ignore_errors=True)
    try:
        return train(cfg)
    except AuditError as e:
        raise AuditError(
            [
                *e.problems,
                "a second run from a fresh secret was flagged too (two honest runs are flagged in "
                f"a row with probability at most beta^2 = {DEFAULT_BETA**2:g}): the DP engine is "
                "broken; report it",
            ]
        ) from e
