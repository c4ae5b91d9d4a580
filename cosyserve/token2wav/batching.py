"""Batched token2wav executor: concurrent requests' flow + HiFT work packed into shared batches.

Callers submit offline requests and streaming steps and get futures. One worker (a background
thread after :meth:`Token2WavBatcher.start`, or the caller through :meth:`~Token2WavBatcher.run_batch`)
takes the ``max_batch`` most urgent pending units and runs them with
:meth:`CosyVoice2Token2Wav.run_batch`: one flow batch per (streaming, finalize) kind and one HiFT
batch per mel shape. Results equal unbatched runs up to float rounding (noise is drawn per
request, in submission order).

Urgency is a deadline, earliest first. By default a stream's deadline is the moment its listener
runs out of audio: playback starts when its first piece is handed back and plays everything
returned since, so deadline = first return time + seconds returned. A stream with no audio yet,
and an offline request, is due when submitted (it is already being waited for). Callers that know
better (a client-side buffer, a priority) pass ``deadline`` explicitly, on the batcher's clock.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidInputError
from .cosyvoice2 import BatchItem, CosyVoice2Token2Wav, OfflineRequest, Token2WavStream


@dataclass(order=True)
class _Pending:
    deadline: float
    order: int
    work: BatchItem = field(compare=False)
    future: Future = field(compare=False)


@dataclass
class _Playback:
    """What a stream's listener has received: playback started at ``start`` with ``seconds`` of audio."""

    start: float | None = None
    seconds: float = 0.0


class Token2WavBatcher:
    """Earliest-deadline-first batching of token2wav work on one :class:`CosyVoice2Token2Wav`.

    Offline futures resolve to the waveform (N,) float32 on the CPU, step futures to the piece
    (S,) float32 on the CPU, as :meth:`CosyVoice2Token2Wav.offline` and
    :meth:`Token2WavStream.step` return them. Invalid submissions raise at once (a stream is then
    closed, as a direct step would close it); a failed batch fails all its futures and closes its
    streams. A stream may have one step pending at a time.
    """

    def __init__(self, model: CosyVoice2Token2Wav, *, max_batch: int = 16,
                 clock: Callable[[], float] = time.monotonic):
        if max_batch < 1:
            raise InvalidInputError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        self.clock = clock
        self._heap: list[_Pending] = []
        self._order = itertools.count()
        self._pending_streams: set[Token2WavStream] = set()
        self._playback: dict[Token2WavStream, _Playback] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batch_sizes: list[int] = []  # units per executed batch, for reports

    # ----- submission -----

    def submit_offline(self, request: OfflineRequest, *, deadline: float | None = None) -> Future:
        work = self.model.offline_work(request)
        return self._push(work, self.clock() if deadline is None else deadline)

    def submit_step(self, stream: Token2WavStream, tokens_so_far: Any, token_offset: int, finalize: bool, *,
                    deadline: float | None = None) -> Future:
        with self._cond:
            if stream in self._pending_streams:
                raise InvalidInputError(f"token2wav stream {stream.label!r} already has a step pending")
        work = stream.plan_step(tokens_so_far, token_offset, finalize)
        if deadline is None:
            playback = self._playback.get(stream)
            deadline = (playback.start + playback.seconds if playback and playback.start is not None
                        else self.clock())
        with self._cond:
            self._pending_streams.add(stream)
        return self._push(work, deadline)

    def _push(self, work: BatchItem, deadline: float) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise InvalidInputError("the token2wav batcher is closed")
            heapq.heappush(self._heap, _Pending(deadline, next(self._order), work, future))
            self._cond.notify()
        return future

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    # ----- execution -----

    def run_batch(self) -> int:
        """Run the ``max_batch`` most urgent pending units as one batch; returns how many ran.

        Deadlines choose the units; inside the batch they run in submission order, so that what
        each draws from a shared random generator does not depend on the deadlines."""
        with self._cond:
            batch = [heapq.heappop(self._heap) for _ in range(min(self.max_batch, len(self._heap)))]
            # streams closed outside the batcher (cancelled, idle, a failed plan) have no listener left
            self._playback = {s: p for s, p in self._playback.items() if not s.closed}
        if not batch:
            return 0
        batch.sort(key=lambda p: p.order)
        try:
            results = self.model.run_batch([p.work for p in batch])
        except BaseException as exc:
            for p in batch:
                self._settle(p.work)
                p.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return len(batch)
        self.batch_sizes.append(len(batch))
        now = self.clock()
        for p, result in zip(batch, results):
            if p.work.stream is None:
                p.future.set_result(result)
                continue
            audio = result.audio[0].float().cpu()
            self._settle(p.work, now, audio.numel() / self.model.sample_rate)
            p.future.set_result(audio)
        return len(batch)

    def _settle(self, work: BatchItem, now: float = 0.0, seconds: float = 0.0) -> None:
        """A unit finished: update its stream's playback, forget streams that ended."""
        stream = work.stream
        if stream is None:
            return
        with self._cond:
            self._pending_streams.discard(stream)
            if stream.closed:
                self._playback.pop(stream, None)
                return
            playback = self._playback.setdefault(stream, _Playback())
            if seconds > 0 and playback.start is None:
                playback.start = now
            playback.seconds += seconds

    def start(self) -> "Token2WavBatcher":
        """Run batches on a background thread until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="token2wav-batcher", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        device = self.model.device
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # graph capture uses the current device's streams
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._heap or self._closed)
                if self._closed and not self._heap:
                    return
            self.run_batch()

    def close(self) -> None:
        """Stop accepting work, finish what is pending, stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while self.run_batch():
            pass

    def __enter__(self) -> "Token2WavBatcher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
