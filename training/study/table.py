"""The comparison the study releases: one row per classifier at the study's budget, each a DP
head in a released repo (so the dataset page composes every row's stages), and zero-shot
classification beside them only when a binomial test on its scoring records puts it above
chance; and the paired comparison of two rows' head draws on the same records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CONFIDENCE", "ChanceTest", "Paired", "Row", "chance_test", "paired"]

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
    draws: tuple[float, ...] = ()
    """Every draw's top-1 where the row's head was drawn several times (``top1``: the head
    released, their mean)."""

    def card(self) -> dict[str, Any]:
        """The row as the cards' ``probe_comparison`` keeps it (``draws`` only when several)."""
        row = {
            "model": self.model,
            "repo": self.repo_id,
            "privacy": self.privacy,
            "features": self.features,
            "top1": round(self.top1, 4),
        }
        if len(self.draws) > 1:
            row["draws"] = [round(d, 4) for d in self.draws]
        return row

    @staticmethod
    def spread(draws: list[float] | tuple[float, ...]) -> str:
        """Head draws' top-1 as the job prints them: each, their mean and range."""
        if len(draws) < 2:
            return "one draw"
        each = ", ".join(f"{d:.4f}" for d in draws)
        return f"draws {each}: mean {np.mean(draws):.4f}, range {max(draws) - min(draws):.4f}"


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
    from scipy.stats import binomtest  # 1.7 s of every command's start when imported with it

    correct, records = int((predicted == labels).sum()), len(labels)
    chance = float(np.bincount(labels).max()) / records
    interval = binomtest(correct, records, chance).proportion_ci(CONFIDENCE, "exact")
    return ChanceTest(correct, records, chance, interval.low, interval.high)


@dataclass(frozen=True)
class Paired:
    """Row A against row B on the same scoring records, each drawn k times (fresh secrets):
    the difference of their mean top-1 and its standard error from two independent sources, the
    records (paired: per record, A's share of right draws less B's) and the draws (each row's
    spread of top-1 over its draws, which the records cannot show)."""

    difference: float
    se_records: float
    se_draws: float

    @property
    def se(self) -> float:
        """The difference's standard error: both sources' variances added."""
        return float(np.hypot(self.se_records, self.se_draws))

    @property
    def z(self) -> float:
        """The difference in standard errors (inf when both are 0 and A differs from B)."""
        if self.se == 0:
            return 0.0 if self.difference == 0 else float(np.copysign(np.inf, self.difference))
        return self.difference / self.se

    def describe(self) -> str:
        """The difference in points, its standard error and z, in one line."""
        return (
            f"{100 * self.difference:+.2f} points (SE {100 * self.se:.2f}: records "
            f"{100 * self.se_records:.2f}, draws {100 * self.se_draws:.2f}; z {self.z:+.1f})"
        )


def paired(a: np.ndarray, b: np.ndarray) -> Paired:
    """Row A against row B from their draws' right answers, ``a`` (k_a, n) and ``b`` (k_b, n)
    booleans on the same n records in the same order (one draw: no draw term)."""
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    if a.shape[1] != b.shape[1] or a.shape[1] < 2:
        raise ValueError(f"two rows on the same records (at least 2), got {a.shape}, {b.shape}")
    per_record = a.mean(0) - b.mean(0)
    n = len(per_record)
    draws = sum(x.mean(1).var(ddof=1) / len(x) for x in (a, b) if len(x) > 1)
    return Paired(
        float(per_record.mean()), float(per_record.std(ddof=1) / np.sqrt(n)), float(np.sqrt(draws))
    )
