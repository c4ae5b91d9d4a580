"""What a kind keeps per voice (its prompt's flow state), for the voices used last."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class KeptVoices(Generic[T]):
    """LRU of at most ``size`` voices' states keyed by :meth:`PromptFeatures.key
    <cosyserve.frontend.prompt.PromptFeatures.key>` (size 0 keeps nothing). Thread-safe; a state
    taken before its voice is evicted stays valid for its holder (states are never changed in place).
    ``hits``/``misses`` count :meth:`get`'s answers."""

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"voices kept must be >= 0, got {size}")
        self.size = size
        self._states: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str) -> T | None:
        """The voice's state (now the most recently used), or None."""
        with self._lock:
            state = self._states.get(key)
            if state is None:
                self.misses += 1
            else:
                self._states.move_to_end(key)
                self.hits += 1
            return state

    def put(self, key: str, state: T) -> None:
        """Keep ``state`` as the most recently used voice; the least recently used goes past ``size``."""
        if not self.size:
            return
        with self._lock:
            self._states[key] = state
            self._states.move_to_end(key)
            while len(self._states) > self.size:
                self._states.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._states

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    def keys(self) -> list[str]:
        """Least recently used first."""
        with self._lock:
            return list(self._states)
