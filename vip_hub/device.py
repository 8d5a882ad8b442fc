"""Which torch device to run on, from a setting or flag: ``auto``, ``cpu``, ``cuda`` or
``cuda:N``."""

from __future__ import annotations

import re

import torch

from .errors import ConfigError

__all__ = ["pick_device"]

_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` is CUDA when present, else CPU; a bare ``cuda`` is ``cuda:<local_rank>``.

    Raises ConfigError naming the problem for an unknown name or a GPU that is not there.
    """
    if not _NAME.fullmatch(name):
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N")
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
