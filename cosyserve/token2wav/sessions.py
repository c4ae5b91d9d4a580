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


@dataclass
class _Session:
    stream: Token2WavStream
    last_step: float  # time.monotonic() when its last step ended


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
        self._sessions: dict[str, _Session] = {}  # by request id: the streaming sessions open
        self._lock = threading.Lock()

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

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
        submitted = []  # (index, call, stream or None, future)
        for index, call in enumerate(calls):
            try:
                submitted.append((index, call, *self._submit(call)))
            except Exception as exc:
                results[index] = exc
        while self.batcher.run_batch():
            pass
        for index, call, stream, future in submitted:
            try:
                results[index] = _numpy(future.result())  # another caller's thread may still run it
            except Exception as exc:
                results[index] = exc
            if stream is not None:
                self._stepped(call.request_id, stream)
        return results

    def _submit(self, call: Token2WavCall) -> tuple[Token2WavStream | None, Future]:
        f = call.voice.features
        if call.token_offset is None:
            request = OfflineRequest(list(call.tokens), f.speech_tokens, f.speech_feat, f.embedding)
            return None, self.batcher.submit_offline(request)
        with self._lock:
            session = self._sessions.get(call.request_id)
        if session is not None:
            stream = session.stream
        else:
            stream = self.model.open_stream(f.speech_tokens, f.speech_feat, f.embedding, label=call.request_id)
            with self._lock:
                self._sessions[call.request_id] = _Session(stream, time.monotonic())
        try:
            return stream, self.batcher.submit_step(stream, list(call.tokens), call.token_offset, call.finalize)
        finally:
            self._stepped(call.request_id, stream)  # a failed plan closes the stream

    def _stepped(self, request_id: str, stream: Token2WavStream) -> None:
        """A step of ``request_id``'s session ended; the session goes once its stream has closed."""
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None or session.stream is not stream:
                return
            if stream.closed:
                del self._sessions[request_id]
            else:
                session.last_step = time.monotonic()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(request_id, None)
        if session is not None:
            session.stream.close()

    def close_idle(self) -> list[str]:
        """Close sessions whose last step is older than the idle timeout; returns their ids."""
        deadline = time.monotonic() - self.idle_timeout_s
        with self._lock:
            stale = [rid for rid, session in self._sessions.items() if session.last_step < deadline]
        for rid in stale:
            self.cancel(rid)
        return stale

    def close_all(self) -> None:
        """Close every open session (server shutdown)."""
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.stream.close()


def _one(results: list) -> np.ndarray:
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


def _numpy(waveform: torch.Tensor) -> np.ndarray:
    return waveform.detach().to("cpu", torch.float32).reshape(-1).numpy()
