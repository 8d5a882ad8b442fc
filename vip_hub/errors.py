"""Typed errors of the vip_hub library: one class per failure a user can act on.

Every error a user can fix (bad input, a ledger that does not hold, a refused checkpoint)
is a :class:`VipHubError`; the ``vip-hub`` command prints it as one line and exits 1. Any
other exception is a bug and keeps its traceback. The service maps these classes onto HTTP
statuses in one place (``service/errors.py``); nothing here knows about HTTP.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccountingError",
    "AuditError",
    "CheckpointError",
    "ClaimTooLowError",
    "ConfigError",
    "DataError",
    "LedgerError",
    "MissingInputError",
    "RepoFormatError",
    "SafetensorsError",
    "SignatureError",
    "StepFailed",
    "TamperedFileError",
    "UnsafePathError",
    "UnsupportedLayerError",
    "UntrustedSignerError",
    "VerificationError",
    "VipHubError",
]


class VipHubError(Exception):
    """Base class: a failure the user can act on (the message says what was wrong)."""


class ConfigError(VipHubError, ValueError):
    """An option, setting or argument that cannot be used (unknown architecture, bad size...)."""


class UnsupportedLayerError(ConfigError, TypeError):
    """A trainable parameter has no per-example gradient rule (a model the clipper cannot train)."""


class StepFailed(VipHubError, RuntimeError):
    """A step of the main job failed; the message says which and how to resume."""


class MissingInputError(VipHubError, FileNotFoundError):
    """A file, folder or repo named as input does not exist."""


class DataError(VipHubError, ValueError):
    """Training or evaluation data that cannot be used (no images, a corrupt image...)."""


class AccountingError(VipHubError, ValueError):
    """Parameters no mechanism can have, or a privacy budget no noise level reaches."""


class LedgerError(VipHubError, ValueError):
    """An invalid privacy ledger; ``problems`` names every offending field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid privacy ledger: " + "; ".join(self.problems))


class RepoFormatError(VipHubError, ValueError):
    """A folder or file that is not in the released-repo format."""


class UnsafePathError(RepoFormatError):
    """A repo path that could escape its folder or confuse a filesystem."""


class SafetensorsError(RepoFormatError):
    """A file that is not a well-formed safetensors file."""


class CheckpointError(VipHubError, ValueError):
    """A checkpoint that is refused (pickled code), unreadable, or from another run."""


class VerificationError(VipHubError):
    """A repo failed ``vip-hub verify``; ``problems`` lists every failed check.

    The subclass raised is that of the first problem, so callers can tell a tampered file
    (:class:`TamperedFileError`) from an understated claim (:class:`ClaimTooLowError`)."""

    def __init__(self, problems: list[Any]):
        self.problems = list(problems)
        super().__init__("verification failed: " + "; ".join(map(str, self.problems)))


class TamperedFileError(VerificationError):
    """A file's content, or a ledger copy, differs from what the ledger binds."""


class ClaimTooLowError(VerificationError):
    """A stage or guarantee claims less epsilon than its recomputation gives."""


class AuditError(VerificationError):
    """An empirical audit's lower bound exceeds the claim, or its recorded counts do not
    give the recorded bound."""


class SignatureError(VerificationError):
    """A repo's signature does not hold: malformed, not made by the key it names, leaving a
    file unsigned, or over files that changed after signing."""


class UntrustedSignerError(SignatureError):
    """A repo signed by a key that is not among the trusted ones."""
