"""vip-hub: released private vision encoders, their privacy ledger, and the repo format.

Public names are imported on first use, so ``vip-hub --help`` and light scripts do not pay
for torch, timm and opacus up front.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors as _errors
from .errors import *  # noqa: F403 - the error tree is light, and public whole (errors.__all__)

__version__ = "0.3.0"

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
__all__ = sorted([*_MODULE_OF, *_errors.__all__])


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
    # The same names as _EXPORTS (tests/project/test_public_api.py checks), re-exported for type
    # checkers.
    from .loading import Encoder as Encoder
    from .loading import load_encoder as load_encoder
    from .models.encoders import ARCHS as ARCHS
    from .models.encoders import EncoderSpec as EncoderSpec
    from .models.encoders import create_encoder as create_encoder
    from .models.encoders import get_arch as get_arch
    from .models.features import POOLINGS as POOLINGS
    from .models.features import Pooling as Pooling
    from .models.features import extract_features as extract_features
    from .models.features import feature_dim as feature_dim
    from .privacy.accounting import Accountant as Accountant
    from .privacy.accounting import calibrate as calibrate
    from .privacy.accounting import default_delta as default_delta
    from .privacy.accounting import epsilon as epsilon
    from .privacy.accounting import epsilons as epsilons
    from .privacy.accounting import max_steps_within as max_steps_within
    from .privacy.accounting import paper_delta as paper_delta
    from .privacy.ledger import Audit as Audit
    from .privacy.ledger import Dataset as Dataset
    from .privacy.ledger import DPStage as DPStage
    from .privacy.ledger import Guarantee as Guarantee
    from .privacy.ledger import NonPrivateStage as NonPrivateStage
    from .privacy.ledger import PrivacyLedger as PrivacyLedger
    from .privacy.ledger import PrivacySummary as PrivacySummary
    from .repo.files import export_encoder as export_encoder
    from .repo.files import update_repo as update_repo
    from .repo.verify import VerificationReport as VerificationReport
    from .repo.verify import verify_repo as verify_repo
