"""Values computed from a reference clip (prompt features, speech tokens, speaker embeddings),
kept for the clips seen last: voice agents send the same clip with every request."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Generic, Sequence, TypeVar

import numpy as np

from .lru import LruCache

T = TypeVar("T")


class ClipCache(Generic[T]):
    """An :class:`~cosyserve.lru.LruCache` of ``size`` values keyed by a hash of the clip's samples;
    size 0 keeps nothing.

    Thread-safe. Two threads missing on the same clip at once both compute it (the front ends
    are pure, so either result is right); no lock is held while computing.
    """

    def __init__(self, size: int):
        self._values: LruCache[bytes, T] = LruCache(size)

    @property
    def hits(self) -> int:
        return self._values.hits

    @property
    def misses(self) -> int:
        return self._values.misses

    def __len__(self) -> int:
        return len(self._values)

    def get_or_compute(self, samples: Any, compute: Callable[[], T]) -> T:
        """The value for ``samples`` (a numpy array or torch tensor), computed by ``compute()`` on a miss."""
        return self.get_or_compute_batch([samples], lambda missing: [compute()])[0]

    def get_or_compute_batch(self, clips: Sequence[Any], compute: Callable[[list], list[T]]) -> list[T]:
        """The values for ``clips``; the missing ones are computed by one ``compute(missing clips)``
        call (a batch for the model), a clip repeated in ``clips`` once."""
        if self._values.size == 0:
            return compute(list(clips))
        keys = [_clip_key(samples) for samples in clips]
        found: dict[bytes, T] = {}
        missing: dict[bytes, Any] = {}
        for key, samples in zip(keys, clips):
            if key in missing:  # computed once for both: the second is a hit
                self._values.hits += 1
            elif (value := self._values.get(key)) is not None:
                found[key] = value
            else:
                missing[key] = samples
        if missing:
            computed = dict(zip(missing, compute(list(missing.values()))))
            found.update(computed)
            for key, value in computed.items():
                self._values.put(key, value)
        return [found[key] for key in keys]


def _clip_key(samples: Any) -> bytes:
    if hasattr(samples, "detach"):  # torch tensor
        samples = samples.detach().cpu().contiguous().numpy()
    array = np.ascontiguousarray(samples)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).digest()
