"""vip-hub: released private vision encoders, their privacy ledger, and the repo format.

Public names are imported on first use, so ``vip-hub --help`` and light scripts do not pay
for torch, timm and opacus up front.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "privacy.accounting": [
        "Accountant",
        "calibrate",
        "default_delta",
        "epsilon",
        "epsilons",
        "max_steps_within",
        "paper_delta",
    ],
    "errors": [
        "AccountingError",
        "AuditError",
        "CheckpointError",
        "ClaimTooLowError",
        "ConfigError",
        "DataError",
        "LedgerError",
        "MissingInputError",
        "RepoFormatError",
        "TamperedFileError",
        "VerificationError",
        "VipHubError",
    ],
    "models.features": ["POOLINGS", "Pooling", "extract_features", "feature_dim"],
    "privacy.ledger": [
        "Audit",
        "DPStage",
        "Dataset",
        "Guarantee",
        "NonPrivateStage",
        "PrivacyLedger",
        "PrivacySummary",
    ],
    "loading": ["Encoder", "load_encoder"],
    "models.encoders": ["ARCHS", "EncoderSpec", "create_encoder", "get_arch"],
    "repo.files": ["export_encoder", "update_repo"],
    "repo.verify": ["VerificationReport", "verify_repo"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'vip_hub' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from .errors import (
        AccountingError,
        AuditError,
        CheckpointError,
        ClaimTooLowError,
        ConfigError,
        DataError,
        LedgerError,
        MissingInputError,
        RepoFormatError,
        TamperedFileError,
        VerificationError,
        VipHubError,
    )
    from .loading import Encoder, load_encoder
    from .models.encoders import ARCHS, EncoderSpec, create_encoder, get_arch
    from .models.features import POOLINGS, Pooling, extract_features, feature_dim
    from .privacy.accounting import (
        Accountant,
        calibrate,
        default_delta,
        epsilon,
        epsilons,
        max_steps_within,
        paper_delta,
    )
    from .privacy.ledger import (
        Audit,
        Dataset,
        DPStage,
        Guarantee,
        NonPrivateStage,
        PrivacyLedger,
        PrivacySummary,
    )
    from .repo.files import export_encoder, update_repo
    from .repo.verify import VerificationReport, verify_repo
