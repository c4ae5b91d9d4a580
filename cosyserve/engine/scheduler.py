"""What the engine core admits and which chunk jobs make its next batch.

**Admission** (at submit, on the caller's thread): a new request is refused at once with a
:class:`~cosyserve.errors.CapacityError` "overloaded: ..." (gRPC ``UNAVAILABLE``, API ``429``)
while the engine already sends ``max_streams`` streams (0: no cap), or while a playing stream has
less than ``min_buffer_s`` seconds of audio buffered ahead of its listener (0: off): the loop is
then falling behind, and one more stream would make every stream stall. Offline requests obey
both rules without being counted as streams.

**Deadlines** (in the loop): each iteration solves one batch of chunks to the end (all Euler
steps); the scheduler decides which waiting chunks make it. Earliest deadline first
(:attr:`~.request.RequestState.deadline`: a playing stream's chunk is due when its listener runs
dry, a first chunk ``FIRST_CHUNK_BUDGET_S`` after arrival, offline work never), while the batch's
frames stay within ``max_batch_frames`` and its jobs within ``max_batch_jobs``: a bigger batch
takes longer, and a chunk that arrives meanwhile waits for it. A stream's first window counts the
prompt frames it carries when its voice's state is not kept (:meth:`~.kinds.protocol.Kind.cold_frames`:
CosyVoice3's new clips), so new voices arriving together are spread over batches. Full passes (offline requests, and
a kind's final chunks where it voices them as a pass over everything: CosyVoice2's reference
final) and windows never share a batch: each kind is a call of its own at every Euler step, so a
batch of both would take the time of two, and the window of a stream's first chunk would wait for
it. A chunk that does not fit waits for the next batch; the most urgent one always starts,
however large.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import CapacityError
from .request import RequestState

# Estimator frames of a batch (both CFG rows of a window count once; a full pass counts all its
# frames), and its jobs: past the largest captured step shape (16 windows) a step runs eagerly,
# several times slower. 4,096 frames hold 8 new CosyVoice3 clips' first windows (a whole prompt each):
# since the DiT's layout fix (950eafa) a step of 4 jobs x 512 frames takes ~3.6 ms on an H100 (H2,
# 2026-12-07), half its time before, so a batch of twice the frames takes about what 2,048 took then;
# at 2,048 the second four new clips waited a whole batch.
DEFAULT_MAX_BATCH_FRAMES = 4096
DEFAULT_MAX_BATCH_JOBS = 16
STREAM_CAP_RETRY_AFTER_MS = 500


@dataclass(eq=False)
class Candidate:
    """A chunk ready to start: its request, segment and the kind-independent chunk plan."""

    state: RequestState
    segment: Any
    chunk: Any  # schedule.Chunk, or None for an offline segment
    # estimator frames it adds to a batch: its window (a cold stream's first one with its prompt), or its whole pass
    frames: int
    full_pass: bool = False  # a pass over everything (batched only with others), not a window


class Scheduler:
    def __init__(self, max_streams: int = 0, min_buffer_s: float = 0.0,
                 max_batch_frames: int = DEFAULT_MAX_BATCH_FRAMES, max_batch_jobs: int = DEFAULT_MAX_BATCH_JOBS,
                 clock: Callable[[], float] = time.monotonic):
        self.max_streams = max_streams
        self.min_buffer_s = min_buffer_s
        self.max_batch_frames = max_batch_frames
        self.max_batch_jobs = max_batch_jobs
        self.clock = clock

    def admit(self, streaming: bool, states: Iterable[RequestState]) -> None:
        """Raise CapacityError when a new request must be refused now (see the module docstring)."""
        states = [s for s in states if not s.ended]
        if self.max_streams > 0:
            streams = sum(s.request.streaming for s in states)
            if streams >= self.max_streams:
                raise CapacityError(f"overloaded: this server is sending {streams} streams, its limit of "
                                    f"{self.max_streams} (max_streams); retry after {STREAM_CAP_RETRY_AFTER_MS} ms")
        if self.min_buffer_s > 0:
            now = self.clock()
            buffered = [s.deadline - now for s in states if s.request.streaming and s.first_emit is not None]
            least = min(buffered, default=None)
            if least is not None and least < self.min_buffer_s:
                raise CapacityError(
                    f"overloaded: a stream on this server has {least:.2f} s of audio buffered, under the "
                    f"{self.min_buffer_s:g} s it keeps for every stream (admission_min_buffer_s); retry after "
                    f"{max(100, round(1000 * (self.min_buffer_s - least)))} ms")

    def pick(self, candidates: list[Candidate]) -> list[Candidate]:
        """The next batch, most urgent first (see the module docstring)."""
        chosen, frames, jobs = [], 0, 0
        for candidate in sorted(candidates, key=lambda c: c.state.deadline):
            if jobs and (frames + candidate.frames > self.max_batch_frames or jobs >= self.max_batch_jobs
                         or candidate.full_pass != chosen[0].full_pass):
                continue
            jobs += 1
            chosen.append(candidate)
            frames += candidate.frames
        return chosen
