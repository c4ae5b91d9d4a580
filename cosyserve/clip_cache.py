"""Values computed from a reference clip (prompt features, speech tokens, speaker embeddings),
kept for the clips seen last: voice agents send the same clip with every request."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, TypeVar

import numpy as np

T = TypeVar("T")


class ClipCache(Generic[T]):
    """LRU of ``size`` values keyed by a hash of the clip's samples; size 0 keeps nothing.

    Thread-safe. Two threads missing on the same clip at once both compute it (the front ends
    are pure, so either result is right); the lock is never held while computing.
    """

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"cache size must be >= 0, got {size}")
        self.size = size
        self._values: OrderedDict[bytes, T] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._values)

    def get_or_compute(self, samples: Any, compute: Callable[[], T]) -> T:
        """The value for ``samples`` (a numpy array or torch tensor), computed by ``compute()`` on a miss."""
        if self.size == 0:
            return compute()
        key = _clip_key(samples)
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                self.hits += 1
                return self._values[key]
            self.misses += 1
        value = compute()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value


def _clip_key(samples: Any) -> bytes:
    if hasattr(samples, "detach"):  # torch tensor
        samples = samples.detach().cpu().contiguous().numpy()
    array = np.ascontiguousarray(samples)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).digest()
