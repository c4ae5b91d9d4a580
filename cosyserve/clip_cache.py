"""Values computed from a reference clip (prompt features, speech tokens, speaker embeddings),
kept for the clips seen last: voice agents send the same clip with every request."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, Sequence, TypeVar

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
        return self.get_or_compute_batch([samples], lambda missing: [compute()])[0]

    def get_or_compute_batch(self, clips: Sequence[Any], compute: Callable[[list], list[T]]) -> list[T]:
        """The values for ``clips``; the missing ones are computed by one ``compute(missing clips)``
        call (a batch for the model), a clip repeated in ``clips`` once."""
        if self.size == 0:
            return compute(list(clips))
        keys = [_clip_key(samples) for samples in clips]
        found: dict[bytes, T] = {}
        missing: dict[bytes, Any] = {}
        with self._lock:
            for key, samples in zip(keys, clips):
                if key in self._values:
                    self._values.move_to_end(key)
                    self.hits += 1
                    found[key] = self._values[key]
                elif key in missing:  # computed once for both: the second is a hit
                    self.hits += 1
                else:
                    self.misses += 1
                    missing[key] = samples
        if missing:
            computed = dict(zip(missing, compute(list(missing.values()))))
            found.update(computed)
            with self._lock:
                self._values.update(computed)
                while len(self._values) > self.size:
                    self._values.popitem(last=False)
        return [found[key] for key in keys]


def _clip_key(samples: Any) -> bytes:
    if hasattr(samples, "detach"):  # torch tensor
        samples = samples.detach().cpu().contiguous().numpy()
    array = np.ascontiguousarray(samples)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).digest()
