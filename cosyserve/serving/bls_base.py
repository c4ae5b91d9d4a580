"""What the ``cosyvoice2`` and ``cosyvoice2_dit`` Triton models (Python BLS) share.

Both take the same inputs (all ``[1, ...]``): ``target_text`` BYTES; optional ``reference_wav``
FP32 (16 kHz) with ``reference_wav_len`` INT32 and ``reference_text`` BYTES (zero-shot voice), or
``speaker_id`` BYTES (a voice of spk2info.pt); neither = the default speaker "001". Optional
``max_tokens`` / ``min_tokens`` INT32 override the template's speech-token limits for one request.
The ``cosyvoice2`` model also takes ``text_frontend`` BOOL and ``instruction`` BYTES (optional;
:mod:`cosyserve.serving.bls`). Output: ``waveform`` FP32. ``decoupled`` true streams one response per chunk, then an empty one
with the final flag (or the error with it); false answers once.

:class:`TTSBLS` does the Triton side (parameters, request parsing, responses); a subclass names
the speech-token source, the speaker encoder and the pipeline it drives
(:mod:`cosyserve.serving.bls`, :mod:`cosyserve.serving.dit_bls`).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..clients import Playback
from ..errors import CapacityError
from ..frontend.speakers import SpeakerRegistry
from ..llm.backends import create_backend
from ..llm.prompt import COSYVOICE2, SPEECH_TOKEN_OFFSET, PromptLayout, register_voice_prefixes
from ..llm.sampling import REFERENCE_SAMPLING, SamplingParams
from ..pipeline.local import LocalSpeechTokens
from ..pipeline.tts import TokenLimits, VoiceResolver, validate_text, with_timeout
from ..runtime import SPK2INFO
from ..schedule import OUTPUT_SAMPLE_RATE
from .playback_board import Admission, PlaybackBoard
from .settings import BlsSettings
from .triton_utils import (FINAL, Metric, error_response, limit_torch_threads, model_settings, optional_input,
                           optional_scalar, optional_text, raise_response_error, reference_wav, tensor)


# Audio buffered ahead of the listener's playback when a chunk is sent (seconds; below 0: it stalled).
BUFFER_BUCKETS = [-1.0, -0.2, 0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]


def bls_request(model_name: str, inputs: dict[str, np.ndarray], outputs: list[str], request_id: str = ""):
    return pb_utils.InferenceRequest(model_name=model_name, requested_output_names=outputs, request_id=request_id,
                                     inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])


def call_model(model_name: str, inputs: dict[str, np.ndarray], output: str, request_id: str = "") -> np.ndarray:
    """One BLS call; returns ``output`` without its batch dimension."""
    response = bls_request(model_name, inputs, [output], request_id).exec()
    raise_response_error(response, model_name)
    return pb_utils.get_output_tensor_by_name(response, output).as_numpy()[0]


class RemoteSpeechTokenizer:
    """``tokenize(wav16)`` through the ``audio_tokenizer`` model, whose ids are codes + ``token_offset``
    (CosyVoice2's: LLM ids; CosyVoice3's: raw codes)."""

    def __init__(self, token_offset: int = SPEECH_TOKEN_OFFSET):
        self.token_offset = token_offset

    def tokenize(self, wav16: torch.Tensor) -> torch.Tensor:
        wav = wav16.numpy().astype(np.float32)[None]
        inputs = {"reference_wav": wav, "reference_wav_len": np.array([[wav.shape[1]]], np.int32)}
        ids = call_model("audio_tokenizer", inputs, "prompt_speech_tokens")
        return torch.from_numpy(ids.astype(np.int32) - self.token_offset)


def openai_speech_tokens(settings: BlsSettings, tokenizer, registry: SpeakerRegistry, layout: PromptLayout = COSYVOICE2,
                         sampling: SamplingParams = REFERENCE_SAMPLING) -> LocalSpeechTokens:
    """Speech tokens from the OpenAI-compatible server(s) at ``settings.llm_url`` (comma-separated:
    the least loaded; model id: ``llm_model``, empty = the first the server lists) for prompts of
    ``layout``, with the registered voices' prefixes warmed there. Its ``backend`` reads each stream
    on a thread of its own; close it when unloading."""
    if not settings.llm_url:
        raise ValueError("model parameter 'llm_url' is missing or empty in config.pbtxt")
    backend = create_backend("openai", settings.llm_tokenizer_dir, base_url=settings.llm_url,
                             model=settings.llm_model or None, layout=layout.name)
    register_voice_prefixes(backend, tokenizer, registry)
    return LocalSpeechTokens(backend, sampling)


class ListenerMetrics:
    """The listener's side of every stream, as the server sees it: playback starts with the first
    chunk sent and plays the chunks back to back (:class:`~cosyserve.clients.Playback`)."""

    def __init__(self, model_name: str):
        self.buffer_s = Metric("cosyserve_bls_stream_buffer_seconds", "audio a stream's listener still had "
                               "buffered when its next chunk was sent (negative: playback had stalled)",
                               model_name, kind="histogram", buckets=BUFFER_BUCKETS)
        self.underruns = Metric("cosyserve_bls_stream_underruns", "chunks sent after the audio before them had "
                                "finished playing", model_name, kind="counter")
        self.stall_s = Metric("cosyserve_bls_stream_stall_seconds", "playback stalls of those underruns, in seconds",
                              model_name, kind="counter")

    def played(self, playback: Playback, seconds: float) -> None:
        """A chunk of ``seconds`` was sent now on the stream whose listener is ``playback``."""
        underruns, stall = playback.underruns, playback.stall_s
        buffered = playback.arrive(time.monotonic(), seconds)
        if buffered is not None:
            self.buffer_s.observe(buffered)
        if playback.underruns > underruns:
            self.underruns.increment(playback.underruns - underruns)
            self.stall_s.increment(playback.stall_s - stall)


@dataclass
class TTSInputs:
    """The inputs common to the cosyvoice2 and cosyvoice2_dit models, checked."""

    request_id: str  # unique even when clients reuse ids: it keys the LLM request and the token2wav session
    target_text: str
    reference_wav: np.ndarray | None
    reference_text: str | None
    speaker_id: str | None
    limits: TokenLimits
    text_frontend: bool  # optional input ``text_frontend`` (default true): normalise and split the text
    instruction: str | None  # optional input ``instruction``: instruct mode


def parse_tts_inputs(request, limits: TokenLimits, max_text_chars: int) -> TTSInputs:
    """Read and check a BLS request's text, voice and token-limit inputs (the voice is resolved by the caller)."""
    target_text = validate_text(optional_text(request, "target_text"), "target_text", max_text_chars)
    wav = reference_wav(request) if optional_input(request, "reference_wav") is not None else None
    text_frontend = optional_scalar(request, "text_frontend")
    return TTSInputs(f"{request.request_id() or 'tts'}-{uuid.uuid4().hex[:12]}", target_text, wav,
                     optional_text(request, "reference_text"), optional_text(request, "speaker_id"),
                     limits.override(optional_scalar(request, "max_tokens"), optional_scalar(request, "min_tokens")),
                     True if text_frontend is None else bool(text_frontend), optional_text(request, "instruction"))


class TTSBLS(ABC):
    """A text-to-speech BLS model over a pipeline with ``stream``, ``synthesize`` and ``max_text_chars``.

    Requests are handled one at a time per instance, inside ``execute``, on the request thread
    only: every ``pb_utils`` call of this stub comes from one thread. Concurrency comes from
    ``bls_instance_num`` instances, and the LLM batches across all of them.

    Subclasses supply :meth:`speech_tokens` (the LLM), :meth:`speaker_encoder`, :meth:`build_pipeline`
    and :meth:`build_request`; :meth:`release_finished` is where one whose back ends keep BLS
    response iterators lets go of them.
    """

    def __init__(self, config: dict):
        from transformers import AutoTokenizer

        settings = model_settings(config, BlsSettings)
        limit_torch_threads(settings.torch_threads)  # dozens of instances; each needs little CPU (prompt mel, resampling)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        registry = self.speaker_registry(settings)
        self.voices = self.voice_resolver(registry, settings)
        self.limits = TokenLimits(settings.max_tokens, settings.min_tokens)
        self.request_timeout_s = settings.request_timeout_s
        tokenizer = AutoTokenizer.from_pretrained(settings.llm_tokenizer_dir)
        self.llm = self.speech_tokens(settings, tokenizer, registry)
        self.pipeline = self.build_pipeline(tokenizer, settings)
        # an instance is busy from the moment execute takes a request until its last response is
        # out, including clean-up after a cancellation: the LLM and token2wav gauges miss that part
        self.in_progress = Metric("cosyserve_bls_requests_in_progress", "requests inside a BLS instance",
                                  config["name"])
        self.listeners = ListenerMetrics(config["name"])
        # Admission: every instance publishes its stream's playback end on the server's board; a new
        # request is refused while the server already sends max_streams streams, or while some stream
        # has less than admission_min_buffer_s of audio left.
        self.board = PlaybackBoard()
        self.admission = Admission(self.board, settings.max_streams, settings.admission_min_buffer_s)
        self.admitted = Metric("cosyserve_bls_requests_admitted", "requests an instance took and started",
                               config["name"], kind="counter")
        self.refused = Metric("cosyserve_bls_requests_refused", "requests refused because this server was sending "
                              "max_streams streams or a stream of it had less than admission_min_buffer_s of audio "
                              "buffered", config["name"], kind="counter")

    @abstractmethod
    def speech_tokens(self, settings: BlsSettings, tokenizer, registry: SpeakerRegistry):
        """The pipeline's :class:`~cosyserve.pipeline.tts.SpeechTokenSource`."""

    @abstractmethod
    def speaker_encoder(self):
        """What :class:`~cosyserve.pipeline.tts.VoiceResolver` embeds a reference clip with."""

    def speaker_registry(self, settings: BlsSettings) -> SpeakerRegistry:
        """The registered voices: ``spk2info.pt`` of ``model_dir``."""
        return SpeakerRegistry.load(settings.model_dir / SPK2INFO)

    def voice_resolver(self, registry: SpeakerRegistry, settings: BlsSettings) -> VoiceResolver:
        """How a request's voice inputs become a :class:`~cosyserve.pipeline.tts.Voice`."""
        return VoiceResolver(registry, RemoteSpeechTokenizer(), self.speaker_encoder(), store=self.voice_store(settings))

    def voice_store(self, settings: BlsSettings):
        """Where :class:`~cosyserve.pipeline.tts.VoiceResolver` finds voices uploaded through the HTTP
        API (:class:`~cosyserve.frontend.voice_store.VoiceStore`), or None: only registered voices."""
        return None

    @abstractmethod
    def build_pipeline(self, tokenizer, settings: BlsSettings):
        """The pipeline (``stream``, ``synthesize``, ``max_text_chars``) over :attr:`llm`."""

    @abstractmethod
    def build_request(self, inputs: TTSInputs) -> Any:
        """The pipeline's request for these checked inputs (the voice resolved here)."""

    def release_finished(self, is_cancelled) -> None:
        """Called before a request's last response is sent, while it is still open."""

    def execute(self, requests):
        self.in_progress.increment(len(requests))
        try:
            if self.decoupled:
                for request in requests:
                    self._stream(request)
                return None
            return [self._offline(request) for request in requests]
        finally:
            self.in_progress.increment(-len(requests))

    def _parse(self, request):
        return self.build_request(parse_tts_inputs(request, self.limits, self.pipeline.max_text_chars))

    def _admit(self, stream: bool) -> None:
        """Raise CapacityError ("overloaded: ...") when the server cannot take this request now
        (:meth:`~cosyserve.serving.playback_board.Admission.admit`), counting the decision."""
        try:
            self.admission.admit(stream)
        except CapacityError:
            self.refused.increment()
            raise
        self.admitted.increment()

    def _stream(self, request) -> None:
        sender = request.get_response_sender()
        last = None  # the final response: nothing more, or the error
        try:
            # closed here, on an error too: its clean-up makes BLS calls, which only work inside execute
            is_cancelled = with_timeout(sender.is_cancelled, self.request_timeout_s)
            self._admit(stream=True)
            playback = Playback()
            with closing(self.pipeline.stream(self._parse(request), is_cancelled)) as chunks:
                for chunk in chunks:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[tensor("waveform", chunk)]))
                    self._played(playback, chunk.size / OUTPUT_SAMPLE_RATE)
        except Exception as exc:
            last = error_response(exc)
        finally:
            self.board.publish(None)
        self.release_finished(sender.is_cancelled)  # before the final flag closes the sender
        sender.send(last, flags=FINAL)

    def _played(self, playback: Playback, seconds: float) -> None:
        self.listeners.played(playback, seconds)
        self.board.publish(playback.playback_end)

    def _offline(self, request):
        try:
            is_cancelled = with_timeout(request.is_cancelled, self.request_timeout_s)
            self._admit(stream=False)
            waveform = self.pipeline.synthesize(self._parse(request), is_cancelled)
            response = pb_utils.InferenceResponse(output_tensors=[tensor("waveform", waveform)])
        except Exception as exc:
            response = error_response(exc)
        self.release_finished(request.is_cancelled)
        return response

    def close(self) -> None:
        """Requests finish inside execute; only an OpenAI backend has threads (idle ones) to stop."""
        self.board.close()
        if isinstance(self.llm, LocalSpeechTokens):
            self.llm.backend.close()
