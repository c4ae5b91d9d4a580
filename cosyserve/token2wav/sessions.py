"""Token2wav sessions: requests' offline calls and streaming steps over
:class:`~cosyserve.token2wav.cosyvoice2.CosyVoice2Token2Wav`, packed into shared flow/HiFT batches,
with each streaming session's life (opened at its first step, closed at its final one, on cancel,
on an error, or when its caller vanished).

:class:`LocalToken2Wav` is what the reference layout's Triton ``token2wav`` model
(``REFERENCE_MODELS=true``, for callers of that model; the engine does not use it) runs every
request of a dynamic batch through.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..frontend.prompt import Voice
from ..runtime import STREAM_IDLE_TIMEOUT_S
from .batching import Token2WavBatcher
from .cosyvoice2 import CosyVoice2Token2Wav, OfflineRequest, Token2WavStream


@dataclass
class Token2WavCall:
    """One unit for :meth:`LocalToken2Wav.run`: offline (``token_offset`` None) or one streaming step."""

    request_id: str
    tokens: Sequence[int]
    voice: Voice
    token_offset: int | None = None
    finalize: bool = False


class SessionClock:
    """When each open streaming session last stepped, so that sessions whose caller vanished
    mid-stream can be closed (thread-safe)."""

    def __init__(self):
        self._last_step: dict[str, float] = {}
        self._lock = threading.Lock()

    def stepped(self, session_id: str, closed: bool) -> None:
        """A step of ``session_id`` ended; ``closed``: the session ended with it."""
        with self._lock:
            if closed:
                self._last_step.pop(session_id, None)
            else:
                self._last_step[session_id] = time.monotonic()

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._last_step.pop(session_id, None)

    def clear(self) -> None:
        with self._lock:
            self._last_step.clear()

    def idle(self, timeout_s: float) -> list[str]:
        """The sessions without a step for ``timeout_s`` seconds."""
        deadline = time.monotonic() - timeout_s
        with self._lock:
            return [sid for sid, last in self._last_step.items() if last < deadline]


class LocalToken2Wav:
    """Offline calls and streaming steps over :class:`CosyVoice2Token2Wav`; :meth:`run` packs several
    requests' work into shared flow/HiFT batches (the Triton ``token2wav`` model hands it every
    request of a dynamic batch). The batches are formed by the same
    deadline-aware :class:`~cosyserve.token2wav.batching.Token2WavBatcher`, run on the caller's thread.

    A request's streaming session opens at its first step and closes at its final step, on
    :meth:`cancel`, on any error, or after ``idle_timeout_s`` without a step (a caller that
    vanished mid-stream).
    """

    def __init__(self, model: CosyVoice2Token2Wav, idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
                 max_batch: int = 16):
        self.model = model
        self.idle_timeout_s = idle_timeout_s
        self.batcher = Token2WavBatcher(model, max_batch=max_batch)
        self._clock = SessionClock()

    @property
    def open_sessions(self) -> int:
        return self.model.open_streams

    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray:
        return _one(self.run([Token2WavCall(request_id, tokens, voice)]))

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice, token_offset: int,
             finalize: bool) -> np.ndarray:
        return _one(self.run([Token2WavCall(request_id, tokens, voice, token_offset, finalize)]))

    def run(self, calls: Sequence[Token2WavCall]) -> list[np.ndarray | Exception]:
        """Per call, its waveform (float32, 24 kHz) or the exception that failed it.

        Invalid calls fail alone; the valid ones run ``max_batch`` at a time, most urgent first
        (:class:`Token2WavBatcher`), and a batch that fails fails (and closes the streams of) its
        own calls only.
        """
        self.close_idle()
        results: list[np.ndarray | Exception | None] = [None] * len(calls)
        submitted = []  # (index, stream or None, future)
        for index, call in enumerate(calls):
            try:
                submitted.append((index, *self._submit(call)))
            except Exception as exc:
                results[index] = exc
        while self.batcher.run_batch():
            pass
        for index, stream, future in submitted:
            try:
                results[index] = _numpy(future.result())  # another caller's thread may still run it
            except Exception as exc:
                results[index] = exc
            if stream is not None:
                self._clock.stepped(stream.request_id, stream.closed)
        return results

    def _submit(self, call: Token2WavCall) -> tuple[Token2WavStream | None, Future]:
        f = call.voice.features
        if call.token_offset is None:
            request = OfflineRequest(list(call.tokens), f.speech_tokens, f.speech_feat, f.embedding)
            return None, self.batcher.submit_offline(request)
        if call.request_id in self.model.open_stream_ids:
            stream = self.model.get_stream(call.request_id)
        else:
            stream = self.model.open_stream(call.request_id, f.speech_tokens, f.speech_feat, f.embedding)
        try:
            return stream, self.batcher.submit_step(stream, list(call.tokens), call.token_offset, call.finalize)
        finally:
            self._clock.stepped(stream.request_id, stream.closed)  # a failed plan closes the stream

    def cancel(self, request_id: str) -> None:
        self._clock.forget(request_id)
        if request_id in self.model.open_stream_ids:
            self.model.get_stream(request_id).close()

    def close_idle(self) -> list[str]:
        """Close sessions whose last step is older than the idle timeout; returns their ids."""
        stale = self._clock.idle(self.idle_timeout_s)
        for rid in stale:
            self.cancel(rid)
        return stale


def _one(results: list) -> np.ndarray:
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


def _numpy(waveform: torch.Tensor) -> np.ndarray:
    return waveform.detach().to("cpu", torch.float32).reshape(-1).numpy()
