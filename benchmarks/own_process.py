"""Peak memory of one step, each in a process of its own (``dp_step.py`` and ``logit_dp.py``).

``in_own_process(fn, *args)`` runs ``fn`` in a fresh process forked from a server that imported
the benchmark script, torch and timm once (multiprocessing's ``forkserver``), so a process costs
a fork, not a Python start-up, and its peak is its own. The server starts with glibc told to give
every block of 64 KiB or more back on free (``MALLOC_MMAP_THRESHOLD_``), which every child
inherits: a peak then counts live tensors, not the allocator's cache. On the CPU,
``reset_peak()`` sets the process's peak resident set size (VmHWM) to its current one and
``peak()`` reads it.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

__all__ = ["in_own_process", "load_average", "peak", "reset_peak"]

T = TypeVar("T")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def load_average() -> str:
    """The machine's 1, 5 and 15-minute load averages, as the benchmarks print them."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def reset_peak() -> int:
    """Reset this process's peak resident set size to its current one; that size, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak() -> int:
    """This process's peak resident set size since the last ``reset_peak``, in bytes."""
    return _status_kib("VmHWM") * 1024


def in_own_process(fn: Callable[..., T], *args: object) -> T | str:
    """``fn(*args)`` in a process of its own (see the module): its result, or the last line of
    its error (the step's own, such as CUDA out of memory, or a killed child's)."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the server as it starts
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", "timm"])
    try:
        with ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1) as pool:
            return pool.submit(fn, *args).result()
    except Exception as error:
        lines = str(error).strip().splitlines()
        return lines[-1] if lines else type(error).__name__
