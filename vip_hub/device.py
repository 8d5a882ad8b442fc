"""Which torch device to run on, from a setting or flag: ``auto``, ``cpu``, ``cuda`` or
``cuda:N``. Importing this module does not import torch (the hub's processes check their
settings without it); :func:`pick_device` does."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_HELP", "check_device_name", "pick_device"]

DEVICE_HELP = "auto (CUDA when present), cpu, cuda or cuda:N"
"""The device names a setting or flag may give."""

_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> str:
    """``name`` if it is a device name this module knows (without asking torch for the devices);
    raises ConfigError naming it otherwise."""
    if not _NAME.fullmatch(name):
        raise ConfigError(f"unknown device {name!r}: use {DEVICE_HELP}")
    return name


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` is CUDA when present, else CPU; a bare ``cuda`` is ``cuda:<local_rank>``.

    Raises ConfigError naming the problem for an unknown name or a GPU that is not there.
    """
    import torch

    check_device_name(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.split(":")[1])
        if index >= count:
            raise ConfigError(
                f"device {name} was asked for, but this machine has {count} CUDA device(s)"
            )
    return torch.device(name)
