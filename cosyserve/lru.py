"""The least-recently-used store of the project's caches: voices' flow states kept by the engine's kinds,
values computed from reference clips (:mod:`cosyserve.clip_cache`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class LruCache(Generic[K, T]):
    """At most ``size`` values (size 0 keeps nothing), the least recently used evicted first; the
    engine's kinds key voices' states by :meth:`PromptFeatures.key
    <cosyserve.frontend.prompt.PromptFeatures.key>`. Thread-safe; a value taken before it is evicted
    stays valid for its holder (values are never changed in place). ``hits``/``misses`` count
    :meth:`get`'s answers."""

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"cache size must be >= 0, got {size}")
        self.size = size
        self._values: OrderedDict[K, T] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: K) -> T | None:
        """The value (now the most recently used), or None."""
        with self._lock:
            value = self._values.get(key)
            if value is None:
                self.misses += 1
            else:
                self._values.move_to_end(key)
                self.hits += 1
            return value

    def put(self, key: K, value: T) -> None:
        """Keep ``value`` as the most recently used; the least recently used goes past ``size``."""
        if not self.size:
            return
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)

    def peek(self, key: K) -> T | None:
        """The value, or None, leaving its recency and the counts as they are."""
        with self._lock:
            return self._values.get(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._values

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def keys(self) -> list[K]:
        """Least recently used first."""
        with self._lock:
            return list(self._values)
