"""White-box Dirac gradient canaries: the one-run audit of a DP training run.

Each of m canaries is a fake example whose gradient is zero on the model and ``CANARY_NORM``
times the sensitivity on one secret coordinate of its own, in a block outside the exported
weights. A secret bit (probability 1/2) decides whether the canary is in the training data;
the canaries in it (``members``) are drawn by the engine's own Poisson sampler in the same
sample as the real examples at every step (one draw from one stream, alike on every rank), and
rank 0 adds the ones drawn. A sampled
canary is clipped by the project's one clipping function (``clip_factors``) to the sensitivity
the clipper's own bound gives, and summed into the same flat buffer as the real clipped sums,
so it shares the step's single noise draw. After the noise, its coordinate reads
y = c + N(0, sigma^2) in units of the stated sensitivity, whatever the model: c = 1 when it was
sampled (more when the clipper's bound exceeds the stated one), else 0; the per-step
log-likelihood ratio of "in" against "out" accumulates into its score.

After training, ``audit()`` guesses the bits from the scores over a grid of guess counts
fixed in advance and turns the counts into a lower bound on epsilon (``vip_hub.privacy.audit``),
recorded in the ledger beside the audit's ceiling and the accountants' upper bounds. Too
little noise or a clip bound above the stated one shows up as a bound above the claim, where
the ceiling lies above it.
"""

from __future__ import annotations

import numpy as np
import torch

from vip_hub.privacy.accounting import Accountant, epsilon
from vip_hub.privacy.audit import (
    DEFAULT_BETA,
    bound_over_grid,
    ceiling,
    correct_guesses,
    guess_grid,
    log_likelihood_ratio,
)
from vip_hub.privacy.ledger import Audit, AuditResult, round_down, round_up

from .clipping import clip_factors
from .sampling import CANARY_BITS, step_generator

__all__ = ["CANARY_NORM", "DiracCanaries"]

CANARY_NORM = 100.0
"""A canary's gradient norm before clipping, in units of the sensitivity: far above the bound,
so a clip bound up to 100 times the stated one shows in full."""


class DiracCanaries:
    """m canaries of one run (bits from its secret seed, known to every rank, which all draw the
    same sample); the owner (rank 0) adds the drawn ones and observes the block. ``bound``: the
    sensitivity the clipper's own clip bound gives."""

    def __init__(
        self,
        count: int,
        sample_rate: float,
        seed: int,
        sensitivity: float,
        bound: float,
        owner: bool,
    ):
        self.count, self.sample_rate, self.sensitivity, self.bound = (
            count,
            sample_rate,
            sensitivity,
            bound,
        )
        self.owner = owner
        self.secrets = step_generator(seed, CANARY_BITS, 0).random(count) < 0.5
        self.members = np.flatnonzero(self.secrets)
        self.scores = np.zeros(count, dtype=np.float64)

    def clipped_sum(self, sampled: np.ndarray, device: torch.device) -> torch.Tensor:
        """This rank's canary block at a step, in fp64 as the clipped sum it joins: the clipped
        gradient of each canary in ``sampled`` (the ids the engine's Poisson sample drew, members
        only), zeros elsewhere."""
        block = torch.zeros(self.count, device=device, dtype=torch.float64)
        raw = torch.full(
            (len(sampled),), CANARY_NORM * self.sensitivity, device=device, dtype=torch.float64
        )
        ids = torch.as_tensor(sampled, device=device, dtype=torch.long)
        block[ids] = clip_factors(raw, self.bound) * raw
        return block

    def observe(self, noisy_block: torch.Tensor, noise_multiplier: float) -> None:
        """Score the step's noisy canary block (before the division by the batch size)."""
        if self.owner:
            y = noisy_block.double().cpu().numpy() / self.sensitivity
            self.scores += log_likelihood_ratio(y, self.sample_rate, noise_multiplier)

    def audit(
        self, history: tuple[float, float, int], delta: float, beta: float = DEFAULT_BETA
    ) -> Audit:
        """Guess the bits over the grid fixed in advance; the lower bound and the accountants'
        epsilon at ``delta`` for the run's (sigma, q, T), and the audit's ceiling."""
        grid = guess_grid(self.count)
        results = [(r, correct_guesses(self.scores, self.secrets, r)) for r in grid]
        sigma, q, steps = history
        return Audit(
            canaries=self.count,
            canary_norm=CANARY_NORM,
            results=[AuditResult(guesses=r, correct=v) for r, v in results],
            beta=beta,
            delta=delta,
            epsilon_lower_bound=round_down(bound_over_grid(self.count, results, beta, delta)),
            ceiling=round_down(ceiling(self.count, beta, delta)),
            accountant_epsilon={
                a: round_up(epsilon(sigma, q, steps, delta, a)) for a in Accountant
            },
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scores": torch.from_numpy(self.scores.copy())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scores = state["scores"].double().numpy().copy()
