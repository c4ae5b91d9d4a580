"""One request inside the engine: text segments -> speech tokens -> chunk jobs -> PCM, and its listener.

An :class:`EngineRequest` is what a front door submits: the segments' LLM prompts (computed
lazily, in order), the voice, token limits, streaming or not, and two callbacks that the engine
calls from its loop thread: ``emit`` with each piece of PCM (float32, 24 kHz) and ``finish`` once
with None or the error that ended the request. :class:`RequestState` is the engine's record of it.

A request voices its segments one after the other as one stream. Each :class:`SegmentState` owns
its LLM token stream, its chunk schedule (:class:`~cosyserve.schedule.ChunkScheduler`, the
reference BLS's chunks), its flow and vocoder state, and at most one chunk job in flight: a
stream's chunks must run in order. The LLM request of the next segment starts as soon as the
current one has sent its first chunk (or its LLM has ended), so it generates while the current
segment is voiced, as the reference pipeline does.

``trace`` collects when the request's first chunk passed each stage (CLOCK_MONOTONIC stamps, one
clock for every process of a host; :data:`FIRST_CHUNK_STAGES`): the front door's, then the engine's.

Deadlines: a playing stream's next chunk is due when its listener would run out of audio
(first emit + seconds emitted); a stream with nothing emitted yet is due ``first_chunk_budget_s``
after it arrived; an offline request has no deadline (it is served after every due chunk).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..frontend.prompt import Voice
from ..llm.stream import TokenStream
from .front_end import SegmentPrompt, TokenLimits

# When a stream's first chunk is due, counted from its arrival (seconds).
FIRST_CHUNK_BUDGET_S = 0.15

# A first chunk's way, stamp by stamp: the stage named here ends at its stamp and began at the one
# before. Front door: ``arrival`` (it took the request), ``submitted`` (text front-end, voice and
# prompts done); engine: ``received``, ``first_token`` (prefill, behind other LLM work),
# ``chunk_planned`` (the rest of the chunk's tokens decoded and seen by the loop), ``chunk_started``
# (waiting for a place in a batch, the stream's state opened, the encoder launched), ``launched``
# (the batch's Euler steps and HiFT launched), ``emitted`` (the GPU's work for the chunk and what
# was queued before it, the PCM on the host); front door: ``pcm_received`` (IPC back), ``sent``
# (handed to the client's connection).
FIRST_CHUNK_STAGES = (("prepare", "submitted"), ("ipc_in", "received"), ("prefill", "first_token"),
                      ("chunk_tokens", "chunk_planned"), ("chunk_start", "chunk_started"), ("launch", "launched"),
                      ("gpu", "emitted"), ("ipc_out", "pcm_received"), ("send", "sent"))


def first_chunk_stages(trace: dict[str, float]) -> dict[str, float] | None:
    """Seconds per stage of a complete first-chunk ``trace`` (starting at ``arrival``); None when a
    stamp is missing (a request that ended before its first chunk)."""
    stamps = ["arrival", *(stamp for _, stamp in FIRST_CHUNK_STAGES)]
    if any(stamp not in trace for stamp in stamps):
        return None
    return {stage: max(0.0, trace[stamp] - trace[previous])
            for (stage, stamp), previous in zip(FIRST_CHUNK_STAGES, stamps)}


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    segments: Iterator[SegmentPrompt]  # lazy: a text error surfaces at the first next()
    voice: Voice
    limits: TokenLimits
    streaming: bool
    emit: Callable[[np.ndarray], None]  # PCM pieces in order (offline: one per segment)
    finish: Callable[[BaseException | None], None]  # exactly once, last
    timeout_s: float = 0.0  # 0: no limit; past it the request ends with RequestTimeoutError
    arrival: float = field(default_factory=time.monotonic)
    trace: dict[str, float] = field(default_factory=dict)  # first-chunk stamps (FIRST_CHUNK_STAGES)

    def stamp(self, name: str) -> None:
        """Record when the first chunk passed ``name`` (the first time only)."""
        self.trace.setdefault(name, time.monotonic())


@dataclass(eq=False)
class SegmentState:
    prompt: SegmentPrompt
    tokens: TokenStream
    schedule: Any  # the kind's chunk schedule (None offline)
    received: list[int] = field(default_factory=list)
    llm_done: bool = False
    flow: Any = None  # the kind's stream state (flow and vocoder), opened at the first chunk
    pending: Any = None  # the next chunk's plan, waiting to start
    job: Any = None  # the chunk's flow job, until it is vocoded
    emitting: bool = False  # a chunk's PCM is on its way to the host
    chunks: int = 0  # chunks emitted
    done: bool = False


@dataclass(eq=False)
class RequestState:
    request: EngineRequest
    current: SegmentState | None = None
    ahead: SegmentState | None = None  # the next segment, its LLM started early
    segments_left: bool = True
    first_emit: float | None = None
    seconds_emitted: float = 0.0
    admitted: float = field(default_factory=time.monotonic)
    ended: bool = False
    start_error: BaseException | None = None  # its first segment could not start (ended by the loop)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def deadline(self) -> float:
        """When this request's next chunk is due on the monotonic clock (inf: offline)."""
        if not self.request.streaming:
            return math.inf
        if self.first_emit is None:
            return self.request.arrival + FIRST_CHUNK_BUDGET_S
        return self.first_emit + self.seconds_emitted

    def emitted(self, samples: int, sample_rate: int, now: float) -> None:
        if samples and self.first_emit is None:
            self.first_emit = now
        self.seconds_emitted += samples / sample_rate

    def timed_out(self, now: float) -> bool:
        return bool(self.request.timeout_s) and now - self.admitted > self.request.timeout_s

    def segments(self) -> list[SegmentState]:
        return [s for s in (self.current, self.ahead) if s is not None]
