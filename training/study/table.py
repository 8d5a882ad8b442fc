"""The comparison the study releases: one row per classifier at the study's budget, each a DP
head in a released repo (so the dataset page composes every row's stages), and zero-shot
classification beside them only when a binomial test on its scoring records puts it above
chance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import binomtest

__all__ = ["CONFIDENCE", "ChanceTest", "Row", "chance_test"]

CONFIDENCE = 0.95
"""Coverage of a zero-shot top-1's two-sided Clopper-Pearson interval (the usual 95 %)."""


@dataclass(frozen=True)
class Row:
    """One classifier of the comparison: what it is, the released repo that holds it, its
    guarantee (encoder and head composed), its features, and its top-1 on the scoring records."""

    model: str
    repo_id: str
    privacy: str
    features: str
    top1: float

    def card(self) -> dict[str, Any]:
        """The row as the cards' ``probe_comparison`` keeps it."""
        return {
            "model": self.model,
            "repo": self.repo_id,
            "privacy": self.privacy,
            "features": self.features,
            "top1": round(self.top1, 4),
        }


@dataclass(frozen=True)
class ChanceTest:
    """``correct`` right answers among ``records`` against ``chance`` (the largest class's share
    of the records: the best a classifier blind to the images can score), with the
    ``CONFIDENCE`` Clopper-Pearson interval of the top-1."""

    correct: int
    records: int
    chance: float
    low: float
    high: float

    @property
    def top1(self) -> float:
        """The share of the records answered right."""
        return self.correct / self.records

    @property
    def above_chance(self) -> bool:
        """Whether the whole interval lies above chance."""
        return self.low > self.chance

    def describe(self) -> str:
        """The top-1, its interval and the verdict, in one line."""
        verdict = "above chance" if self.above_chance else "not above chance"
        return (
            f"top-1 {self.top1:.4f} ({CONFIDENCE:.0%} interval {self.low:.4f}-{self.high:.4f} on "
            f"{self.records:,} records; chance, the largest class's share, {self.chance:.4f}): "
            f"{verdict}"
        )


def chance_test(predicted: np.ndarray, labels: np.ndarray) -> ChanceTest:
    """The binomial test of ``predicted`` against ``labels`` (class indices) at chance."""
    correct, records = int((predicted == labels).sum()), len(labels)
    chance = float(np.bincount(labels).max()) / records
    interval = binomtest(correct, records, chance).proportion_ci(CONFIDENCE, "exact")
    return ChanceTest(correct, records, chance, interval.low, interval.high)
