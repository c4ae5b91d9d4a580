"""In-process back ends of :class:`~cosyserve.pipeline.tts.TTSPipeline`: the package objects
called directly (``offline_inference.py``, tests), and the token2wav session bookkeeping that the
Triton ``token2wav`` model reuses.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from ..frontend.speakers import SpeakerRegistry
from ..llm.prompt import build_prefix_ids
from ..llm.sampling import SamplingParams
from ..token2wav.batching import Token2WavBatcher
from ..token2wav.cosyvoice2 import (CosyVoice2Token2Wav, OfflineRequest, Token2WavStream, default_flow_dtype,
                                    load_token2wav)
from .tts import DEFAULT_SPEAKER, TokenLimits, TTSPipeline, TTSRequest, Voice, VoiceResolver

COSYVOICE2_DIR = "CosyVoice2-0.5B"
LLM_DIR = "cosyvoice2_llm"
SPK2INFO = "spk2info.pt"
# The reference BLS's request to TensorRT-LLM (llm_layout.md §4); TRT-LLM has no RAS.
REFERENCE_SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1,
                                    seed=42, ras=False)
STREAM_IDLE_TIMEOUT_S = 600.0


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` = CUDA when available, else CPU; ``cpu``, ``cuda``, ``cuda:N`` as given."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was requested but CUDA is not available")
    return device


def register_voice_prefixes(backend, text_tokenizer, registry: SpeakerRegistry) -> None:
    """Precompute the LLM KV of every registered voice's ``<|sos|>{prompt_text}``."""
    for speaker_id in registry.ids():
        prompt_text = registry.get(speaker_id).prompt_text
        backend.register_prefix(f"voice:{speaker_id}", build_prefix_ids(text_tokenizer, prompt_text))


class LocalSpeechTokens:
    """:class:`~cosyserve.pipeline.tts.SpeechTokenSource` over a ``cosyserve.llm`` backend."""

    def __init__(self, backend, sampling: SamplingParams = REFERENCE_SAMPLING):
        self.backend = backend
        self.sampling = sampling

    def generate(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> Iterator[Sequence[int]]:
        params = dataclasses.replace(self.sampling, max_tokens=limits.max_tokens, min_tokens=limits.min_tokens)
        stream = self.backend.generate_stream(prompt_ids, params, request_id)  # bad prompts raise here
        return _one_token_pieces(stream)

    def cancel(self, request_id: str) -> None:
        self.backend.cancel(request_id)


def _one_token_pieces(stream) -> Iterator[Sequence[int]]:
    with stream:  # leaving early cancels the request
        for token in stream:
            yield (token,)


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
    """:class:`~cosyserve.pipeline.tts.Token2Wav` over :class:`CosyVoice2Token2Wav`, plus :meth:`run`,
    which packs several requests' work into shared flow/HiFT batches (the Triton ``token2wav``
    model hands it every request of a dynamic batch). The batches are formed by the same
    deadline-aware :class:`~cosyserve.token2wav.batching.Token2WavBatcher` that
    ``streaming_inference.py`` benchmarks, run on the caller's thread.

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


@dataclass
class LocalTTS:
    """Everything needed to synthesise in this process; :meth:`request` builds a :class:`TTSRequest`."""

    pipeline: TTSPipeline
    voices: VoiceResolver
    llm_backend: object
    token2wav: LocalToken2Wav

    def request(self, target_text: str, *, reference_wav16=None, reference_text: str | None = None,
                speaker_id: str | None = None, limits: TokenLimits = TokenLimits(),
                request_id: str | None = None) -> TTSRequest:
        voice = self.voices.resolve(reference_wav16, reference_text, speaker_id)
        return TTSRequest(request_id or uuid.uuid4().hex, target_text, voice, limits)

    def close(self) -> None:
        self.token2wav.model.close_all()
        self.llm_backend.close()


def load_local_tts(models_dir: str | Path, device: str = "auto", *, llm_backend: str = "torch",
                   strategy: str = "exponential", sampling: SamplingParams = REFERENCE_SAMPLING,
                   llm_options: dict | None = None) -> LocalTTS:
    """Load the bundle layout ``<models_dir>/{CosyVoice2-0.5B, cosyvoice2_llm}`` on ``device``.

    fp32 on CPU; on CUDA the flow runs in fp16 (HiFT stays fp32) and the LLM in bf16, as deployed.
    """
    from transformers import AutoTokenizer

    from ..llm.backends import create_backend

    models_dir = Path(models_dir)
    model_dir, llm_dir = models_dir / COSYVOICE2_DIR, models_dir / LLM_DIR
    device = resolve_device(device)
    text_tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    registry = SpeakerRegistry.load(model_dir / SPK2INFO)
    providers = None if device.type == "cuda" else ["CPUExecutionProvider"]
    voices = VoiceResolver(registry, SpeechTokenizer(model_dir / "speech_tokenizer_v2.onnx", providers),
                           SpeakerEncoder(model_dir / "campplus.onnx"), default_speaker=DEFAULT_SPEAKER)
    token2wav = LocalToken2Wav(load_token2wav(model_dir, device, default_flow_dtype(device)))
    backend = create_backend(llm_backend, llm_dir, device, None, **(llm_options or {}))
    register_voice_prefixes(backend, text_tokenizer, registry)
    pipeline = TTSPipeline(text_tokenizer, LocalSpeechTokens(backend, sampling), token2wav, strategy=strategy)
    return LocalTTS(pipeline, voices, backend, token2wav)
