"""State kept between the calls of an incremental (streaming) flow session.

The flow is chunk-causal in streaming mode: attention is block-causal, convolutions only look
left (the pre-lookahead conv looks right, but only at real look-ahead tokens). Positions in a
*complete* attention block therefore never change once computed. A streaming call recomputes
a :class:`StreamWindow` of positions ``[start, end)``: ``start`` is the first position whose
block was incomplete last time, ``end`` the end of what is known now. Every stateful layer keeps
what later windows need from the positions before ``start`` (attention keys/values, the left
context of a causal convolution) and, after the call, takes over the first ``commit`` positions
of the window, the ones that became final.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

State = TypeVar("State")

# Growth factor of FrameBuffer's storage: appends stay amortised O(new frames) while at most a
# third of the storage is slack.
_GROWTH = 1.5


@dataclass(frozen=True)
class StreamWindow:
    """Where one call's input sits in the stream, and the per-layer state it continues from."""

    start: int  # absolute position of the window's first input frame
    commit: int  # leading window frames that are final after this call (their state is kept)
    states: dict[nn.Module, Any]  # persistent per-layer state of one network pass, keyed by layer

    def scaled(self, factor: int) -> StreamWindow:
        """The same window at ``factor`` times the frame rate (after an up-sampling layer)."""
        return StreamWindow(self.start * factor, self.commit * factor, self.states)

    def state(self, owner: nn.Module, create: Callable[[], State]) -> State:
        if owner not in self.states:
            self.states[owner] = create()
        return self.states[owner]


class FrameBuffer:
    """Committed frames of a tensor along ``dim``, with room to append.

    :meth:`extend` writes a window's frames right after the committed ones and returns a view of
    [committed ‖ window] without copying the committed part; frames past the new commit point are
    provisional and get overwritten by the next call.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.committed = 0
        self._storage: torch.Tensor | None = None
        self._shared = False  # the storage is another buffer's (fork): never written, replaced at extend

    def extend(self, frames: torch.Tensor, commit: int) -> torch.Tensor:
        """[committed ‖ frames] (a view, valid until the next call); then commit ``commit`` frames."""
        return FrameBuffer.extend_all([self], [frames], [commit])[0]

    @staticmethod
    def extend_all(buffers: list[FrameBuffer], frames: list[torch.Tensor], commits: list[int]) -> list[torch.Tensor]:
        """:meth:`extend` of each buffer with its frames and commit, the frames written by one
        ``_foreach_copy_`` (a batch of streams' windows: one operator, not one copy per buffer)."""
        targets = []
        for buffer, window in zip(buffers, frames):
            dim, new = buffer.dim, window.size(buffer.dim)
            end = buffer.committed + new
            if buffer._storage is None or buffer._shared or buffer._storage.size(dim) < end:
                capacity = max(end, int(_GROWTH * (0 if buffer._storage is None else buffer._storage.size(dim))))
                shape = list(window.shape)
                shape[dim] = capacity
                storage = window.new_empty(shape)
                if buffer.committed:
                    storage.narrow(dim, 0, buffer.committed).copy_(buffer._storage.narrow(dim, 0, buffer.committed))
                buffer._storage, buffer._shared = storage, False
            targets.append(buffer._storage.narrow(dim, buffer.committed, new))
        if targets:  # (_foreach_copy_ takes no empty list)
            torch._foreach_copy_(targets, frames)
        views = []
        for buffer, window, commit in zip(buffers, frames, commits):
            views.append(buffer._storage.narrow(buffer.dim, 0, buffer.committed + window.size(buffer.dim)))
            buffer.committed += commit
        return views

    def start_with(self, frames: torch.Tensor, commit: int) -> None:
        """A buffer without committed frames takes ``frames`` as they are (a view of the caller's
        tensor, which then lives as long as the buffer; later calls write after its committed
        frames), then commits ``commit`` of them: what :meth:`extend` does, without a copy."""
        if self.committed:
            raise ValueError("start_with needs a buffer without committed frames")
        self._storage = frames
        self.committed = commit

    def fork(self) -> FrameBuffer:
        """An independent buffer with the same committed frames, read from this buffer's storage until
        its first :meth:`extend`, which copies them into storage of its own (an extend copies them
        anyway when it outgrows the storage: a copy made here would be copied again there)."""
        twin = FrameBuffer(self.dim)
        twin._storage, twin.committed, twin._shared = self._storage, self.committed, self._storage is not None
        return twin

    def committed_frames(self) -> torch.Tensor | None:
        """A view of the committed frames (None before the first call)."""
        return None if self._storage is None else self._storage.narrow(self.dim, 0, self.committed)

    @property
    def nbytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()


@dataclass
class KeyValueCache:
    """Attention keys and values (B, H, T, d) of the committed positions."""

    keys: FrameBuffer = field(default_factory=lambda: FrameBuffer(dim=2))
    values: FrameBuffer = field(default_factory=lambda: FrameBuffer(dim=2))

    def extend(self, k: torch.Tensor, v: torch.Tensor, commit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys/values appended to the committed ones (see :meth:`FrameBuffer.extend`)."""
        return self.keys.extend(k, commit), self.values.extend(v, commit)

    def start_with(self, k: torch.Tensor, v: torch.Tensor, commit: int) -> None:
        """A cache without committed keys takes these as they are (see :meth:`FrameBuffer.start_with`)."""
        self.keys.start_with(k, commit)
        self.values.start_with(v, commit)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def fork(self) -> KeyValueCache:
        """An independent cache with the same committed keys and values (:meth:`FrameBuffer.fork`;
        other fields shared: they are replaced, never changed in place)."""
        return replace(self, keys=self.keys.fork(), values=self.values.fork())


def with_left_context(x: torch.Tensor, frames: int, owner: nn.Module, window: StreamWindow | None) -> torch.Tensor:
    """x (B, C, T) with ``frames`` frames prepended for a causal convolution.

    Without a window: zeros (the sequence starts here). In a stream window: the input frames that
    precede the window (zeros at the stream start); remembers the ones preceding the next window.
    """
    if window is None:
        return F.pad(x, (frames, 0))
    left = window.state(owner, lambda: x.new_zeros(x.size(0), x.size(1), frames))
    padded = torch.cat([left, x], dim=2)
    window.states[owner] = padded[:, :, window.commit:window.commit + frames]
    return padded


def fork_states(states: dict[nn.Module, Any]) -> dict[nn.Module, Any]:
    """One network pass's state for a stream forked from another's, no copy made: tensors (a causal
    convolution's left context) are shared, as a stream replaces them and never writes them in place;
    key/value caches fork (:meth:`KeyValueCache.fork`)."""
    return {owner: state if isinstance(state, torch.Tensor) else state.fork() for owner, state in states.items()}


def state_bytes(states: dict[nn.Module, Any]) -> int:
    """Memory held by one network pass's state: tensors, and objects with an ``nbytes`` property."""
    return sum(s.numel() * s.element_size() if isinstance(s, torch.Tensor) else s.nbytes for s in states.values())
