"""``verify`` compares each privacy figure with its recomputation in one direction: an upper bound
(an epsilon, a delta; a sensitivity and the noise by the stored rounding alone) may be stated
above what it recomputes to, never below it by more than the recomputation's floating-point
noise; an audit's lower bound (and its ceiling) the reverse; and the rule between two figures
(an audit's bound against the accountants' epsilon) is checked on their recomputations, not on
what the ledger records."""

import json
from collections.abc import Callable
from typing import Any

import pytest
from scipy.optimize import brentq
from support.helpers import restate_truncation, rewrite_ledger_copies

from vip_hub import verify_repo
from vip_hub.errors import AuditError
from vip_hub.privacy.accounting import Accountant, epsilon
from vip_hub.privacy.audit import bound_over_grid, ceiling, guess_grid
from vip_hub.privacy.ledger import round_down, round_up
from vip_hub.repo.verify import RELATIVE_TOLERANCE
from vip_hub.repo_format import LEDGER_FILE

BELOW = 1 - 5e-5
"""Half the old 1e-4 tolerance below a recomputation: verified before, an understatement now."""
CANARIES = 200


def _recomputed(stage: dict, delta: float | None = None) -> dict[str, float]:
    """Each accountant's epsilon for ``stage``'s (sigma, q, T), at its delta or ``delta``."""
    sigma, q, steps = stage["noise_multiplier"], stage["sample_rate"], stage["steps"]
    return {a.value: epsilon(sigma, q, steps, delta or stage["delta"], a) for a in Accountant}


def _claim(ledger: dict, stage: dict, factor: float) -> None:
    """The stage's claim (RDP) and its guarantee at ``factor`` times their recomputation."""
    stage["epsilon"] = ledger["guarantees"][0]["epsilon"] = _recomputed(stage)["rdp"] * factor


def _reference(ledger: dict, stage: dict, factor: float) -> None:
    stage["reference_epsilon"]["prv"] = _recomputed(stage)["prv"] * factor


def _guarantee(ledger: dict, stage: dict, factor: float) -> None:
    ledger["guarantees"][0]["epsilon"] = _recomputed(stage)["rdp"] * factor


def _truncation(ledger: dict, stage: dict, factor: float) -> None:
    restate_truncation(ledger, stage, stage["truncation_delta"] * factor)


def _sensitivity(ledger: dict, stage: dict, factor: float) -> None:
    stage["sensitivity"] *= factor
    stage["noise_std"] = stage["noise_multiplier"] * stage["sensitivity"]


def _noise(ledger: dict, stage: dict, factor: float) -> None:
    stage["noise_std"] *= factor


def _rewritten(
    change: Callable[[dict, dict, float], None], factor: float
) -> Callable[[dict], dict]:
    def rewrite(ledger: dict) -> dict:
        change(ledger, ledger["stages"][1], factor)
        return ledger

    return rewrite


@pytest.mark.parametrize(
    ("change", "factor", "message"),
    [
        (_claim, BELOW, "stage 'dp-pretraining': claims epsilon"),
        (_reference, BELOW, "(prv) is not what that accountant gives"),
        (_guarantee, BELOW, "guarantee 'test-images': claims epsilon"),
        (_truncation, BELOW, "records a truncation delta of"),
        # 5e-7 below C = 0.1: inside the old absolute allowance of the stored rounding (1e-6)
        (_sensitivity, 1 - 5e-6, "claims sensitivity"),
        (_noise, 1 - 5e-6, "noise std"),
    ],
)
def test_a_figure_understated_inside_the_old_tolerance_fails(tiny_repo, change, factor, message):
    """Each upper bound 5e-5 (relative) below its recomputation, rewritten consistently in all
    three copies: 1e-4 (plus the rounding) either way let it verify, a claim under the truth."""
    rewrite_ledger_copies(tiny_repo, _rewritten(change, factor))
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert not report.ok and message in text, text


@pytest.mark.parametrize(
    ("change", "factor"),
    [
        (_claim, 1.01),
        (_reference, 1 + 5e-5),
        (_guarantee, 1.01),
        (_truncation, 2.0),
        (_noise, 1 + 1e-10),
    ],
)
def test_a_figure_overstated_verifies(tiny_repo, change, factor):
    """An upper bound stated above its recomputation is conservative: it verifies (a reference
    figure within the tolerance above, as a record of what its accountant gives)."""
    rewrite_ledger_copies(tiny_repo, _rewritten(change, factor))
    report = verify_repo(tiny_repo)
    assert report.ok, report.problems


@pytest.mark.parametrize(
    ("change", "message"),
    [(_sensitivity, "claims sensitivity"), (_noise, "noise std")],
)
def test_a_sensitivity_or_noise_other_than_the_mechanisms_fails(tiny_repo, change, message):
    """The sensitivity and the noise are records of what ran: 1 % above the mechanism's
    sensitivity (or above sigma times it), past the stored rounding, is another mechanism than
    the one the stage names, refused like one below it."""
    rewrite_ledger_copies(tiny_repo, _rewritten(change, 1.01))
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert not report.ok and message in text, text


@pytest.mark.parametrize(("past", "ok"), [(5e-7, True), (3e-6, False)])
def test_a_reference_figure_is_above_its_recomputation_by_the_tolerance_at_most(
    tiny_repo, past, ok
):
    """A reference epsilon may exceed what its accountant gives by ``RELATIVE_TOLERANCE`` and the
    stored rounding (1e-6), no more: ``past`` beyond the relative tolerance."""

    def change(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        actual = _recomputed(stage)["prv"]
        stage["reference_epsilon"]["prv"] = actual * (1 + RELATIVE_TOLERANCE) + past
        return ledger

    rewrite_ledger_copies(tiny_repo, change)
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert report.ok is ok, text
    assert ok or "(prv) is not what that accountant gives" in text, text


def test_a_guarantee_is_recomputed_at_its_delta_less_its_truncation(tiny_repo):
    """A guarantee's delta adds its stages' truncation deltas to the delta its epsilon is at:
    with a truncation delta stated (conservatively) at half the stage's delta, a guarantee
    claiming the epsilon of its whole delta claims less than its stages give."""

    def change(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        restate_truncation(ledger, stage, stage["delta"] / 2)
        guarantee = ledger["guarantees"][0]
        guarantee["epsilon"] = _recomputed(stage, guarantee["delta"])["rdp"]
        return ledger

    rewrite_ledger_copies(tiny_repo, change)
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert [p.where for p in report.problems] == ["guarantee 'test-images'"], text
    assert "claims epsilon" in text


def _with_audit(
    results: list[tuple[int, int]],
    beta: float,
    tweak: Callable[[dict, dict[str, float]], None] = lambda audit, figures: None,
    canaries: int = CANARIES,
) -> Callable[[dict], dict]:
    """The DP stage with an audit of ``canaries`` canaries at its delta (counted in its noised
    tensors and truncation delta), recorded as an export records it: the lower bound and ceiling
    rounded down, the accountants' epsilons up; then ``tweak`` of the audit and its recomputed
    figures (``bound``, ``ceiling`` and each accountant's)."""

    def change(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        stage["noised_tensors"]["canaries"] = canaries
        stage["noised_dimension"] += canaries
        restate_truncation(ledger, stage)
        delta = stage["delta"]
        figures = {
            "bound": bound_over_grid(canaries, results, beta, delta),
            "ceiling": ceiling(canaries, beta, delta),
            **_recomputed(stage),
        }
        stage["audit"] = audit = {
            "canaries": canaries,
            "canary_norm": 100.0,
            "results": [{"guesses": r, "correct": v} for r, v in results],
            "beta": beta,
            "delta": delta,
            "epsilon_lower_bound": round_down(figures["bound"]),
            "ceiling": round_down(figures["ceiling"]),
            "accountant_epsilon": {a.value: round_up(figures[a.value]) for a in Accountant},
        }
        tweak(audit, figures)
        return ledger

    return change


PARTIAL = [(r, r - r // 5) for r in guess_grid(CANARIES)]
"""Counts whose bound (about 1.5) is below the stage's accounted epsilon (about 3.5)."""


def _set(key: str, figure: str, factor: float) -> Callable[[dict, dict[str, float]], None]:
    def tweak(audit: dict, figures: dict[str, float]) -> None:
        if key == "accountant_epsilon":
            audit[key][figure] = figures[figure] * factor
        else:
            audit[key] = figures[figure] * factor

    return tweak


def test_an_audit_recorded_as_exported_verifies(tiny_repo):
    rewrite_ledger_copies(tiny_repo, _with_audit(PARTIAL, 0.05))
    report = verify_repo(tiny_repo)
    assert report.ok, report.problems
    assert report.recomputed["dp-pretraining/audit"] < min(_recomputed_of(report).values())


def _recomputed_of(report: Any) -> dict[str, float]:
    stage = report.ledger.stage("dp-pretraining")
    sigma, q, steps = stage.mechanism_tuple
    return {a.value: epsilon(sigma, q, steps, stage.audit.delta, a) for a in Accountant}


@pytest.mark.parametrize(
    ("tweak", "ok", "message"),
    [
        (_set("epsilon_lower_bound", "bound", 1 + 5e-5), False, "records eps_lb"),
        (_set("ceiling", "ceiling", 1 + 5e-5), False, "records a ceiling of"),
        (_set("accountant_epsilon", "pld", BELOW), False, "records pld epsilon"),
        # the conservative directions: a lower bound (or ceiling) below, an epsilon above
        (_set("epsilon_lower_bound", "bound", BELOW), True, ""),
        (_set("ceiling", "ceiling", BELOW), True, ""),
        (_set("accountant_epsilon", "pld", 1 + 5e-5), True, ""),
    ],
)
def test_an_audit_figure_is_checked_in_its_direction(tiny_repo, tweak, ok, message):
    """An audit's lower bound and ceiling may be recorded below what its counts give, not above;
    each accountant's epsilon above what it gives, not below (beyond the recomputation's noise)."""
    rewrite_ledger_copies(tiny_repo, _with_audit(PARTIAL, 0.05, tweak))
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert report.ok is ok and message in text, text
    assert all(p.kind is AuditError for p in report.problems)


def test_an_audit_bound_above_the_accountants_fails_on_the_recomputed_figures(tiny_repo):
    """A bound 1.5e-4 (relative) above the tightest accountant's epsilon, each recorded within its
    tolerance (the accountants' epsilons 1e-4 above theirs, conservative): the old rule compared
    the two records, each allowed its slack, and let it pass; the recomputed figures violate it."""
    stage = json.loads((tiny_repo / LEDGER_FILE).read_text())["stages"][1]
    accounted = min(_recomputed(stage).values())
    grid = [(r, r) for r in guess_grid(CANARIES)]  # every guess right: the bound is the ceiling
    target = accounted * (1 + 1.5e-4)
    beta = brentq(lambda b: ceiling(CANARIES, b, stage["delta"]) - target, 1e-9, 0.5, xtol=1e-15)

    def conservative(audit: dict, figures: dict[str, float]) -> None:
        for a in Accountant:
            audit["accountant_epsilon"][a.value] = figures[a.value] * (1 + 1e-4)
        assert 1 < figures["bound"] / min(figures[a.value] for a in Accountant) < 1 + 2e-4

    rewrite_ledger_copies(tiny_repo, _with_audit(grid, beta, conservative))
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert [p.kind for p in report.problems] == [AuditError], text
    assert "exceeds the accounted epsilon" in text


@pytest.mark.parametrize(
    "results",
    [
        PARTIAL[-1:],  # one count of the grid: all of beta on it, not a sixth
        [(6, 6)],  # a count the grid does not hold, chosen after the scores
        [(r - 2, v - 2) for r, v in PARTIAL],
    ],
)
def test_an_audit_whose_counts_are_not_its_grid_fails(tiny_repo, results):
    """The guess counts are the grid fixed before training, beta split across all of it: a ledger
    that records fewer or others (its bound restated from them) raises the bound and fails."""
    rewrite_ledger_copies(tiny_repo, _with_audit(results, 0.05))
    report = verify_repo(tiny_repo)
    text = "; ".join(map(str, report.problems))
    assert [p.kind for p in report.problems] == [AuditError], text
    assert "not the grid" in text


def test_an_audit_of_canaries_three_past_a_multiple_of_four_verifies(tiny_repo):
    """203 canaries: the grid's last count rounded up to 204 guesses, and verify raised a
    ValueError computing the ceiling; the grid stops at the canaries (202)."""
    results = [(r, r // 2) for r in guess_grid(203)]
    rewrite_ledger_copies(tiny_repo, _with_audit(results, 0.05, canaries=203))
    report = verify_repo(tiny_repo)
    assert report.ok, report.problems
