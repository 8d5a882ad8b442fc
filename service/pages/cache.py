"""Values computed once per key and kept, least recently used out first: a page's costly part
(a dataset's composition) is paid once per change of its inputs, however many views ask at once.
Keys name their inputs (e.g. a dataset and a digest of the commits its stages come from), so a
change of inputs is a new key and nothing needs invalidating."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["ComputedOnce"]

T = TypeVar("T")


class ComputedOnce(Generic[T]):
    """At most ``max_entries`` values by key; concurrent callers of one key wait for the one
    computation (a failed one is not kept: the next caller tries again)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._values: OrderedDict[Hashable, T] = OrderedDict()
        self._computing: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The value kept for ``key``, else ``compute()``'s, kept."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            computing = self._computing.setdefault(key, threading.Lock())
        with computing:
            with self._lock:
                if key in self._values:
                    return self._values[key]
            try:
                value = compute()
                with self._lock:
                    self._values[key] = value
                    while len(self._values) > self.max_entries:
                        self._values.popitem(last=False)
            finally:
                with self._lock:
                    self._computing.pop(key, None)
        return value
