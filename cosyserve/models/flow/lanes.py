"""Work lanes: which of the fused step's buffers (workspaces, Triton scratch) a thread's steps use.

Work that runs on a CUDA stream of its own, beside the default lane's (new voices' prompts beside the
engine's chunks), must share no buffer with it: each lane has its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...runtime import LOOP_ROLE

_lane = threading.local()


@contextmanager
def work_lane(name: str) -> Iterator[None]:
    """Steps run by this thread inside the block (and graphs captured there) use the workspaces and
    Triton scratch of lane ``name``: work on a CUDA stream of its own, beside the default lane's
    (new voices' prompts beside the engine's chunks), must share no buffer with it."""
    previous = current_lane()
    _lane.name = name
    try:
        yield
    finally:
        _lane.name = previous


def current_lane() -> str:
    """This thread's lane (:func:`work_lane`); the loop's outside every block (its name is the loop's
    CUDA stream role, :data:`~cosyserve.runtime.LOOP_ROLE`: a lane's step graphs are captured on its role's stream)."""
    return getattr(_lane, "name", LOOP_ROLE)
