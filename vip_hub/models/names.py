"""The encoder registry's names, without torch, so the command line's choices read them too:
the sizes, and an architecture's name (``<family>-<size>``)."""

from __future__ import annotations

__all__ = ["SIZES", "arch_name", "family_archs"]

SIZES = ("nano", "tiny", "small", "base", "large")


def arch_name(family: str, size: str) -> str:
    """An architecture's name: ``<family>-<size>``, e.g. ``vip-base``."""
    return f"{family}-{size}"


def family_archs(family: str) -> tuple[str, ...]:
    """The architecture names of ``family``, smallest first."""
    return tuple(arch_name(family, size) for size in SIZES)
