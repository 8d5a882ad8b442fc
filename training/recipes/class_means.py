"""A DP class-means head: linear discriminant analysis on private class means and a public
covariance (issue 56).

One step of the DP engine on the whole private set (Poisson sampling at q = 1, T = 1: the
Gaussian mechanism) releases, for each class, the sum of its examples' clipped vectors
``[z, a]``: ``z`` the example's features standardised by the centring records' mean and
variance (the head's BatchNorm, fixed to those public statistics), ``a`` a constant, the
centring records' median norm of ``z``, so that the sum's last coordinate counts the class (each
example weighted by its clip factor, the same weight its features get). Everything after that
one noisy release is post-processing with public data: each class's mean is its noised sum over
its noised count; the head is LDA's linear rule with the Ledoit-Wolf covariance of the centring
records' ``z`` (``w_k = S^-1 m_k``, ``b_k = -w_k . m_k / 2 + log p_k``), written as the
study's ``LinearProbe`` (its BatchNorm fixed to the same statistics). A DP-SGD head spends its
budget over its noisy steps (``head_batches`` an epoch) on every coordinate; this head spends it
once on K + 1 coordinates a class, where the noise on a mean falls as 1 / n (Mehta et al. 2023
release a head from noised sufficient statistics in the same way). Its noise grows with the
dimension it reads, so the study gives it public principal components
(``StudyConfig.class_means_components``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.covariance import LedoitWolf
from torch import nn

from vip_hub.errors import DataError
from vip_hub.privacy.ledger import NOT_RELEASED, noised_key
from vip_hub.repo.heads import LinearProbe

from .probe import ProbeConfig, fix_normalisation, head_engine

__all__ = ["COUNT_FLOOR", "ClassSumLoss", "fit_class_means", "lda_rule"]

COUNT_FLOOR = 1e-3
"""A class's noised count is taken as at least this share of the largest one (post-processing:
keeps a class whose count the noise drove to zero or below from dividing by it)."""


class ClassSumLoss(nn.Module):
    """Minus the true class's score ``W [z, a]`` (``linear``: no bias, D + 1 inputs): its
    per-example gradient is ``-[z, a]`` in that class's row of ``W`` and zero elsewhere, so one
    step from zero at learning rate 1 leaves ``W`` the noised class sums of ``[z, a]`` over the
    expected batch."""

    def __init__(self, linear: nn.Linear, a: float):
        super().__init__()
        self.linear, self.a = linear, a

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scores = self.linear(torch.cat([z, z.new_full((len(z), 1), self.a)], 1))
        return -scores.gather(1, y[:, None])[:, 0]


def lda_rule(
    sums: torch.Tensor, counts: torch.Tensor, public_z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """LDA's weights (K, D) and biases (K,) on centred features from class ``sums`` (K, D),
    their ``counts`` (K,) and the Ledoit-Wolf covariance of the public centred ``public_z`` (the
    classes' total covariance: the public records carry no label the head reads)."""
    counts = counts.double().clamp(min=COUNT_FLOOR * float(counts.max().clamp(min=1e-12)))
    means = sums.double() / counts[:, None]
    fit = LedoitWolf(assume_centered=True).fit(public_z.double().numpy())
    weights = torch.from_numpy(np.linalg.solve(fit.covariance_, means.numpy().T).T)
    bias = -0.5 * (weights * means).sum(1) + torch.log(counts / counts.sum())
    return weights, bias


def fit_class_means(
    x: torch.Tensor,
    y: torch.Tensor,
    classes: int,
    cfg: ProbeConfig,
    public_x: torch.Tensor,
) -> tuple[LinearProbe, dict[str, Any]]:
    """A DP class-means head on the private features ``x`` (labels ``y``) at ``cfg.epsilon``
    (its clipping norm ``cfg.max_grad_norm``), its normalisation and covariance from the public
    centring features ``public_x``; the head (eval mode) and its DP parameters (``probe_stage``
    makes its ledger stage from them)."""
    if len(public_x) < 2:
        raise DataError(
            f"a class-means head takes its covariance from public features: {len(public_x)} given"
        )
    head = LinearProbe(x.shape[1], classes)
    fix_normalisation(head, public_x)
    with torch.no_grad():
        z, public_z = head.norm(x), head.norm(public_x)
        a = float(public_z.norm(dim=1).median())
        sums = nn.Linear(x.shape[1] + 1, classes, bias=False)
        nn.init.zeros_(sums.weight)
    optimizer = torch.optim.SGD(sums.parameters(), lr=1.0)
    engine, dp = head_engine(ClassSumLoss(sums, a), optimizer, len(x), 1.0, 1, cfg)
    batch = torch.as_tensor(engine.plan(0))
    engine.step(0, [(z[batch], y[batch])] if len(batch) else [])
    with torch.no_grad():
        noised = sums.weight.double()  # n cancels in the means
        weights, bias = lda_rule(noised[:, :-1] * a, noised[:, -1], public_z)
        head.linear.weight.copy_(weights.float())
        head.linear.bias.copy_(bias.float())
    dp["noised"] = {
        noised_key(NOT_RELEASED, f"class sums of [features, {a:.4g}]"): sums.weight.numel()
    }
    return head.eval(), dp
