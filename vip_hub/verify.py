"""``vip-hub verify``: check a released repo's privacy claims and its files.

A repo verifies when
- its three ledger copies (privacy_ledger.json, model.safetensors metadata, README.md front
  matter) are valid and equal;
- every file the ledger lists has the digest it lists, and no weights file is unlisted;
- config.json and the weights agree on the architecture;
- no DP stage claims less epsilon than the accountant gives for its parameters, and no
  guarantee claims less than the composition of its stages (beyond ``RELATIVE_TOLERANCE``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .accounting import AccountingError, composed_epsilon
from .artifacts import SafetensorsError, digest_file, read_safetensors_header
from .card import card_ledger
from .ledger import LedgerError, PrivacyLedger
from .paths import UnsafePathError, validate_relpath
from .repo import CARD_FILE, CONFIG_FILE, LEDGER_FILE, META_ARCH, META_LEDGER, WEIGHTS_FILE

__all__ = ["Problem", "RELATIVE_TOLERANCE", "VerificationError", "VerificationReport", "verify_repo"]

RELATIVE_TOLERANCE = 1e-4
"""A claim may sit below the recomputed epsilon by this fraction (rounding), no more."""


@dataclass(frozen=True)
class Problem:
    """One failed check: ``where`` names the file, stage or field."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class VerificationError(Exception):
    """A repo failed verification; ``problems`` lists every failed check."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("verification failed: " + "; ".join(map(str, problems)))


@dataclass
class VerificationReport:
    """What was checked, what failed, and the ledger (when one could be read)."""

    ledger: PrivacyLedger | None = None
    problems: list[Problem] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    recomputed: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def raise_for_problems(self) -> "VerificationReport":
        if self.problems:
            raise VerificationError(self.problems)
        return self


def repo_files(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Map every file under ``folder`` (hidden entries skipped) to its repo-relative path."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    out = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in names:
            if not name.startswith("."):
                p = Path(dirpath, name)
                out[p.relative_to(root).as_posix()] = p
    return out


def verify_repo(
    repo: str | os.PathLike[str] | Mapping[str, Path], *, check_accounting: bool = True
) -> VerificationReport:
    """Verify a repo folder, or a mapping of repo paths to local files (e.g. a hub commit)."""
    files = dict(repo) if isinstance(repo, Mapping) else repo_files(repo)
    report = VerificationReport()
    for rel in files:
        try:
            validate_relpath(rel)
        except UnsafePathError as e:
            report.fail(rel, str(e))
    missing = [f for f in (WEIGHTS_FILE, CONFIG_FILE, LEDGER_FILE, CARD_FILE) if f not in files]
    for name in missing:
        report.fail(name, "missing: every released repo carries it")
    copies = _ledger_copies(files, report)
    report.checks.append("ledger copies parsed")
    ledger = _compare_copies(copies, report)
    if ledger is None:
        return report
    report.ledger = ledger
    _check_artifacts(files, ledger, report)
    _check_config(files, report)
    if check_accounting:
        _check_accounting(ledger, report)
    return report


def _ledger_copies(files: Mapping[str, Path], report: VerificationReport) -> dict[str, PrivacyLedger]:
    readers = {
        LEDGER_FILE: lambda p: PrivacyLedger.parse(p.read_bytes()),
        WEIGHTS_FILE: _weights_copy,
        CARD_FILE: lambda p: card_ledger(p.read_text(encoding="utf-8")),
    }
    copies = {}
    for name, read in readers.items():
        if name not in files:
            continue
        try:
            copies[name] = read(files[name])
        except (LedgerError, SafetensorsError, UnicodeDecodeError, ValueError) as e:
            report.fail(name, f"ledger copy unreadable: {e}")
    return copies


def _weights_copy(path: Path) -> PrivacyLedger:
    header, _ = read_safetensors_header(path)
    text = (header.get("__metadata__") or {}).get(META_LEDGER)
    if text is None:
        raise LedgerError([f"{WEIGHTS_FILE}: metadata has no {META_LEDGER} entry"])
    return PrivacyLedger.parse(text)


def _compare_copies(copies: dict[str, PrivacyLedger], report: VerificationReport) -> PrivacyLedger | None:
    """Compare every copy with the first readable one (privacy_ledger.json first); return it."""
    if not copies:
        return None
    ref_name, reference = next(iter(copies.items()))
    for name, other in copies.items():
        if other != reference:
            where, a, b = _first_difference(reference.to_dict(), other.to_dict())
            report.fail(
                name,
                f"its ledger copy disagrees with {ref_name} at {where or 'top level'}: "
                f"{json.dumps(b)} vs {json.dumps(a)}",
            )
    report.checks.append("ledger copies equal")
    return reference


def _first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{where}.{k}".lstrip("."))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}.{i}".lstrip("."))
    return where, a, b


def _check_artifacts(files: Mapping[str, Path], ledger: PrivacyLedger, report: VerificationReport) -> None:
    for rel, claimed in ledger.artifacts.items():
        if rel not in files:
            report.fail(rel, "listed in the ledger's artifacts but missing from the repo")
            continue
        try:
            actual = digest_file(files[rel], rel)
        except (SafetensorsError, OSError) as e:
            report.fail(rel, f"cannot be digested: {e}")
            continue
        if actual != claimed:
            report.fail(rel, f"content changed since export (digest {actual}, ledger says {claimed})")
    for rel in files:
        if (rel.endswith(".safetensors") or rel == CONFIG_FILE) and rel not in ledger.artifacts:
            report.fail(rel, "not listed in the ledger's artifacts: its provenance is unknown")
    report.checks.append("file digests")


def _check_config(files: Mapping[str, Path], report: VerificationReport) -> None:
    if CONFIG_FILE not in files or WEIGHTS_FILE not in files:
        return
    try:
        config = json.loads(files[CONFIG_FILE].read_bytes())
        header, _ = read_safetensors_header(files[WEIGHTS_FILE])
    except (ValueError, SafetensorsError, OSError) as e:
        report.fail(CONFIG_FILE, f"unreadable: {e}")
        return
    arch = (header.get("__metadata__") or {}).get(META_ARCH)
    if not isinstance(config, dict) or "architecture" not in config:
        report.fail(CONFIG_FILE, "has no 'architecture' entry (timm needs one)")
    elif (config.get("vip_hub") or {}).get("arch") != arch:
        report.fail(CONFIG_FILE, f"vip_hub.arch disagrees with {WEIGHTS_FILE} metadata ({arch!r})")
    report.checks.append("config matches weights")


def _check_accounting(ledger: PrivacyLedger, report: VerificationReport) -> None:
    for stage in ledger.dp_stages():
        claims = {stage.accountant: stage.epsilon, **stage.reference_epsilon}
        for accountant, claimed in claims.items():
            try:
                actual = composed_epsilon([stage.mechanism_params], stage.delta, accountant)
            except AccountingError as e:
                report.fail(f"stage {stage.name!r}", str(e))
                continue
            report.recomputed[f"{stage.name}/{accountant.value}"] = actual
            if _understated(claimed, actual):
                report.fail(
                    f"stage {stage.name!r}",
                    f"claims epsilon {claimed:.6g} but the {accountant.value} accountant gives "
                    f"{actual:.6g} for sigma={stage.noise_multiplier:g}, q={stage.sample_rate:.6g}, "
                    f"steps={stage.steps}, delta={stage.delta:.6g}",
                )
    for g in ledger.guarantees:
        history = [ledger.stage(name).mechanism_params for name in g.stages]  # type: ignore[union-attr]
        try:
            actual = composed_epsilon(history, g.delta, g.accountant)
        except AccountingError as e:
            report.fail(f"guarantee {g.dataset!r}", str(e))
            continue
        report.recomputed[f"guarantee:{g.dataset}"] = actual
        if _understated(g.epsilon, actual):
            report.fail(
                f"guarantee {g.dataset!r}",
                f"claims epsilon {g.epsilon:.6g} but composing stages {g.stages} gives {actual:.6g}",
            )
    report.checks.append("epsilon recomputed")


def _understated(claimed: float, actual: float) -> bool:
    return claimed < actual * (1 - RELATIVE_TOLERANCE)
