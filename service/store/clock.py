"""The store's wall clock: every age it compares (uploads' and xorbs' time-to-live, gc's grace,
staging quotas, multipart uploads) is measured from ``now()``, read through this module so that
tests move time forward instead of sleeping. File and object timestamps count the same seconds."""

from __future__ import annotations

import time

__all__ = ["now"]


def now() -> float:
    """Seconds since the epoch (``time.time()``)."""
    return time.time()
