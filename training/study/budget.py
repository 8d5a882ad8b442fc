"""The study's budget and its split rule: every released classifier is (``epsilon``, ``delta``)-DP
on the private records, encoder and head composed under RDP; a DP encoder spends
``encoder_epsilon`` and its head is calibrated to what remains (``remaining_epsilon``); a head on
an encoder that saw no private record gets all of it."""

from __future__ import annotations

from collections.abc import Sequence

from vip_hub.privacy.accounting import Accountant, remaining_epsilon
from vip_hub.privacy.ledger import DPStage, compose_releases

from .config import StudyConfig

__all__ = ["composed", "head_epsilon"]


def head_epsilon(
    cfg: StudyConfig, prior: Sequence[DPStage], sample_rate: float, steps: int
) -> float:
    """A head's own target epsilon (RDP at ``cfg.delta``) at (``sample_rate``, ``steps``): what
    the split rule leaves of ``cfg.epsilon`` after the encoder's DP stages ``prior`` on the
    private records. Calibrating to it gives at least that noise."""
    history = [s.mechanism_tuple for s in prior]
    return remaining_epsilon(cfg.epsilon, cfg.delta, history, sample_rate, steps, Accountant.RDP)


def composed(cfg: StudyConfig, stages: Sequence[DPStage], dataset: str) -> dict[Accountant, float]:
    """A classifier's guarantee: its DP ``stages`` composed at ``cfg.delta`` under every
    accountant (``compose_releases``); a stage on another dataset than ``dataset``, or a claim
    above ``cfg.epsilon`` under RDP, is an error."""
    names = {s.dataset.name for s in stages}
    if names != {dataset}:
        raise RuntimeError(f"stages on {sorted(names)}, expected only {dataset}")
    eps = compose_releases(stages, cfg.delta)
    if eps[Accountant.RDP] > cfg.epsilon:
        raise RuntimeError(f"composes to ({eps[Accountant.RDP]}, {cfg.delta}) > the budget")
    return eps
