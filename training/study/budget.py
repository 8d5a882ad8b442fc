"""The study's budget and its split rule: every released classifier is (``epsilon``, ``delta``)-DP
on the private records, encoder and head composed under RDP; a DP encoder spends
``encoder_epsilon`` and its head's ``head_draws`` draws are calibrated to share what remains
(``remaining_epsilon``); the heads on an encoder that saw no private record share all of it."""

from __future__ import annotations

from collections.abc import Sequence

from vip_hub.privacy.accounting import Accountant, GaussianRun, remaining_epsilon
from vip_hub.privacy.ledger import DPStage, compose_releases

from .config import StudyConfig

__all__ = ["composed", "head_epsilon"]


def head_epsilon(
    cfg: StudyConfig, prior: Sequence[DPStage | GaussianRun], sample_rate: float, steps: int
) -> float:
    """Each head draw's own target epsilon (RDP at ``cfg.delta``) at (``sample_rate``,
    ``steps``): what the split rule leaves of ``cfg.epsilon`` after the encoder's DP stages
    ``prior`` (stages, or their (sigma, q, T)) on the private records, shared among
    ``cfg.head_draws`` draws. Calibrating each to it gives at least that noise."""
    history = [s.mechanism_tuple if isinstance(s, DPStage) else s for s in prior]
    return remaining_epsilon(
        cfg.epsilon, cfg.delta, history, sample_rate, steps, Accountant.RDP, cfg.head_draws
    )


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
