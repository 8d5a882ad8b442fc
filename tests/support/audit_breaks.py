"""Broken DP engines the one-run audit must catch, and the refusal every family's test checks:
a recipe trained at a claim the audit can reach (``CLAIM``, where the ceiling lies above it)
with its noise zeroed or its clipper's bound 10x the stated one (the noise still sigma times
the stated sensitivity) has its export refused, as a repo whose audit bound exceeds the claim,
which ``verify``, ``vip-hub push`` and the hub refuse too."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

import training.dp.engine
from vip_hub.errors import AuditError
from vip_hub.privacy.ledger import DPStage, PrivacyLedger
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import VerificationReport, verify_repo
from vip_hub.repo_format import LEDGER_FILE

from .helpers import staged_reports
from .live import WRITE_TOKEN

CLAIM = 2.5
BROKEN = ("noise zeroed", "clip bound x10")
SETTINGS = dict(epsilon=CLAIM, sigma=None, delta=1e-5, audit_delta=1e-5, steps=4)
"""A recipe's budget for these tests: the claim at the audit's delta; each test sets q = 1/2."""


def break_engine(
    monkeypatch: pytest.MonkeyPatch, broken: str, recipe: ModuleType, clipper: str
) -> list[VerificationReport]:
    """Zero the engine's noise, or make ``recipe``'s ``clipper`` clip at 10x the bound it is
    given; the export then writes its repo anyway, and the reports its check gave are returned
    (``staged_reports``)."""
    if broken == "noise zeroed":
        monkeypatch.setattr(
            training.dp.engine,
            "add_gaussian_noise",
            lambda flat, std, seed, step: None,
        )
    else:
        real = getattr(recipe, clipper)
        monkeypatch.setattr(
            recipe, clipper, lambda model, max_norm, *rest: real(model, 10 * max_norm, *rest)
        )
    return staged_reports(monkeypatch)


def assert_refused(  # type: ignore[no-untyped-def]
    repo: Path, hub, name: str, staged: list[VerificationReport]
) -> DPStage:
    """The repo's audit bound exceeds its claim: its export refused it (``staged``, the reports
    its check gave), and verify, push and the hub refuse it."""
    assert any(
        p.kind is AuditError and "exceeds the accounted epsilon" in p.message
        for report in staged
        for p in report.problems
    )
    dp = next(
        s
        for s in PrivacyLedger.parse((repo / LEDGER_FILE).read_text()).stages
        if isinstance(s, DPStage)
    )
    audit = dp.audit
    assert audit is not None and audit.can_fail and dp.delta == audit.delta
    assert dp.epsilon <= CLAIM < audit.epsilon_lower_bound <= audit.ceiling, (dp.epsilon, audit)
    report = verify_repo(repo)
    assert any(
        p.kind is AuditError and "exceeds the accounted epsilon" in p.message
        for p in report.problems
    )
    with pytest.raises(AuditError):  # vip-hub push checks before sending anything
        push_repo(repo, f"vip/audit-{name}", endpoint=hub.url, token=WRITE_TOKEN)
    api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)  # the unmodified client: the hub refuses
    api.create_repo(f"vip/audit-{name}")
    with pytest.raises(HfHubHTTPError, match="exceeds the accounted epsilon"):
        api.upload_folder(folder_path=repo, repo_id=f"vip/audit-{name}")
    return dp
