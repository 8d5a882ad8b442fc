"""Training checkpoints: one file, written atomically, loaded without unpickling code."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vip_hub.errors import CheckpointError
from vip_hub.paths import make_private_dir, private_writer

__all__ = ["check_settings", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FORMAT = 1


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` owner-only (it holds the run's secret seed), via a fsynced
    temp file and one rename (crash-safe), in an owner-only folder."""
    path = Path(path)
    make_private_dir(path.parent)
    with private_writer(path) as f:
        torch.save({"format": CHECKPOINT_FORMAT, **state}, f)


def load_checkpoint(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint (tensors and plain data only) and check it belongs to ``config``. A
    setting the checkpoint does not name (one added since it was written) matches when ``config``
    holds its value in ``defaults``: a new setting's default is what runs did before it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(state).__name__}, not a checkpoint's entries"
        )
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}"
        )
    check_settings(f"checkpoint {path}", state.get("config"), config, defaults)
    return state


def check_settings(
    what: str, saved: Any, config: dict[str, Any], defaults: Mapping[str, Any] | None = None
) -> None:
    """Refuse ``saved`` settings (of ``what``) other than ``config``, naming them; a setting
    ``saved`` does not name matches when ``config`` holds its value in ``defaults``."""
    if isinstance(saved, dict):
        added = {k: v for k, v in (defaults or {}).items() if k in config and k not in saved}
        saved = added | saved
    if saved != config:
        diff = sorted(
            k for k in set(saved or {}) | set(config) if (saved or {}).get(k) != config.get(k)
        )
        raise CheckpointError(
            f"{what} was written with other settings ({', '.join(diff)}); "
            "resume with the same settings, or pass --restart to start over"
        )
