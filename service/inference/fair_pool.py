"""Preprocessing threads that serve requests round-robin, one image at a time.

A request is a generator that does one unit of work (one image) per ``next``. A worker takes the
request at the head of the ring, runs one unit, and puts the request at the back, so a request
of many large images cannot hold the threads while a one-image request waits behind it (a plain
FIFO pool decodes the whole large request first).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Generator

__all__ = ["FairPool"]

log = logging.getLogger(__name__)


class FairPool:
    """``threads`` workers running queued requests' steps round-robin."""

    def __init__(self, threads: int, name: str = "preprocess"):
        self._ring: deque[Generator[None, None, None]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, request: Generator[None, None, None]) -> None:
        """Queue a request; its steps run in order, interleaved with other requests' steps."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the preprocessing pool is shut down")
            self._ring.append(request)
            self._cv.notify()

    def shutdown(self) -> None:
        """Refuse new requests, finish the queued ones, and stop the workers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._ring and not self._closed:
                    self._cv.wait()
                if not self._ring:
                    return
                request = self._ring.popleft()
            try:
                next(request)  # one step, outside the lock: only this worker holds the request now
            except StopIteration:
                continue
            except (
                Exception
            ):  # a request reports its own failures; this is a bug, logged, not fatal
                log.exception("a preprocessing step raised")
                continue
            with self._cv:
                self._ring.append(request)
                self._cv.notify()
