"""Crash points, for the crash tests alone: with ``VIP_HUB_CRASH_AT=<step>`` in its environment
the server process ends at once (``os._exit``, no cleanup, as under SIGKILL) when it reaches
that step, so a test kills a publish at a named moment instead of after a guessed sleep. Unset,
as it is outside the tests, a crash point does nothing.

Steps, in the order a publish meets them:

- ``upload-partial``: part of an upload's bytes written to its temp file (an LFS or Xet object,
  or a file's content inline in a commit body);
- ``commit-verified``: a commit's tree verified and its signature checked, nothing stored;
- ``commit-blobs-stored``: its new blobs moved into the blob store, the index not written;
- ``commit-indexed``: the commit and its branch move written, its upload records not dropped.
"""

from __future__ import annotations

import os

__all__ = ["CRASH_ENV", "CRASH_STATUS", "STEPS", "crash_point"]

CRASH_ENV = "VIP_HUB_CRASH_AT"
CRASH_STATUS = 137  # what a shell reports for a SIGKILLed process
STEPS = frozenset({"upload-partial", "commit-verified", "commit-blobs-stored", "commit-indexed"})


def crash_point(step: str) -> None:
    """End the process here when ``VIP_HUB_CRASH_AT`` names ``step`` (one of :data:`STEPS`)."""
    assert step in STEPS, step
    if os.environ.get(CRASH_ENV) == step:
        os._exit(CRASH_STATUS)
