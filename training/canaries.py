"""White-box Dirac gradient canaries: the one-run audit of a DP training run.

Each of m canaries is a fake example whose gradient is zero on the model and ``norm *
sensitivity`` on one secret coordinate of its own, in a block outside the exported weights.
A secret bit (probability 1/2) decides whether the canary is in the training data at all;
an included canary is then Poisson-sampled at every step with the rate q of the real
examples, clipped by the project's one clipping function (``clip_factors``) to the
mechanism's sensitivity, and summed into the same flat buffer as the real clipped sums, so
it shares the step's single noise draw. After the noise, its coordinate reads
y = c + N(0, sigma^2) in units of the sensitivity (c = 1 when it was sampled), whatever the
model: the per-step log-likelihood ratio of "in" against "out" accumulates into its score.

After training, ``audit()`` guesses the bits from the scores over a grid of guess counts
fixed in advance and turns the counts into a lower bound on epsilon (``vip_hub.audit``),
recorded in the ledger beside the accountants' upper bounds. A clipping bug (canaries not
clipped) or too little noise shows up as a bound above the claim.
"""

from __future__ import annotations

import numpy as np
import torch

from vip_hub.accounting import Accountant, epsilon
from vip_hub.audit import DEFAULT_BETA, bound_over_grid, correct_guesses, guess_grid, log_likelihood_ratio
from vip_hub.ledger import Audit, AuditResult, round_down, round_up

from .clipping import clip_factors
from .sampling import CANARY_BITS, CANARY_SAMPLING, poisson_sample, step_generator

__all__ = ["CANARY_NORM", "DiracCanaries"]

CANARY_NORM = 2.0
"""A canary's gradient norm before clipping, in units of the sensitivity (above the bound)."""


class DiracCanaries:
    """m canaries of one run (seeded by its secret seed); rank 0 owns and observes them."""

    def __init__(self, count: int, sample_rate: float, seed: int, sensitivity: float, owner: bool):
        self.count, self.sample_rate, self.seed, self.sensitivity = count, sample_rate, seed, sensitivity
        self.owner = owner
        self.secrets = step_generator(seed, CANARY_BITS, 0).random(count) < 0.5
        self.scores = np.zeros(count, dtype=np.float64)

    def clipped_sum(self, step: int, device: torch.device) -> torch.Tensor:
        """This rank's contribution to the canary block at ``step``: each sampled canary in the
        data adds its clipped gradient; other ranks add zeros."""
        block = torch.zeros(self.count, device=device, dtype=torch.float32)
        if not self.owner:
            return block
        sampled = poisson_sample(self.count, self.sample_rate, self.seed, step, purpose=CANARY_SAMPLING)
        members = torch.as_tensor(sampled[self.secrets[sampled]], device=device, dtype=torch.long)
        raw = torch.full((len(members),), CANARY_NORM * self.sensitivity, device=device, dtype=torch.float64)
        block[members] = (clip_factors(raw.abs(), self.sensitivity) * raw).float()
        return block

    def observe(self, noisy_block: torch.Tensor, noise_multiplier: float) -> None:
        """Score the step's noisy canary block (before the division by the batch size)."""
        if self.owner:
            y = noisy_block.double().cpu().numpy() / self.sensitivity
            self.scores += log_likelihood_ratio(y, self.sample_rate, noise_multiplier)

    def audit(self, history: tuple[float, float, int], delta: float, beta: float = DEFAULT_BETA) -> Audit:
        """Guess the bits over the grid fixed in advance; the lower bound and the accountants'
        epsilon at ``delta`` for the run's (sigma, q, T)."""
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
            accountant_epsilon={a: round_up(epsilon(sigma, q, steps, delta, a)) for a in Accountant},
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scores": torch.from_numpy(self.scores.copy())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scores = state["scores"].double().numpy().copy()
