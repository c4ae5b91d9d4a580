"""One CosyVoice2 + DiT token2wav request end to end: LLM speech tokens -> DiT chunks -> audio.

The ``cosyvoice2_dit`` BLS (``cosyserve.serving.dit_bls``) and ``scripts/dit_offline.py`` run this
with different back ends: the LLM is any :class:`~cosyserve.pipeline.tts.SpeechTokenSource`
(here an OpenAI-compatible server through ``cosyserve.llm.openai_backend``, or an in-process
engine), the token2wav any :class:`DitToken2WavBackend` (BLS requests to ``token2wav_dit``, or
:class:`~cosyserve.token2wav.dit_service.DitToken2WavService` itself).

It differs from :class:`~cosyserve.pipeline.tts.TTSPipeline` (CosyVoice2 flow) where the DiT
deployment differs: chunks carry only the *new* tokens (+3 look-ahead), the token2wav keeps the
request's caches keyed by request id, the speaker travels as a reference clip or speaker id (the
token2wav derives its prompt features itself), and the schedule is
:class:`~cosyserve.schedule.DitChunkScheduler` (``exponential`` or ``equal``).

Streaming consumes the LLM's token iterator directly: back ends buffer tokens on their own
thread, so generation goes on while a chunk is voiced. Whenever a request ends early (client
cancelled, error), the LLM request is stopped and the token2wav stream closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..errors import RequestCancelledError
from ..llm.prompt import build_prompt_ids
from ..pipeline.tts import (MAX_SEGMENT_CHARS, SpeechTokenSource, TokenLimits, Voice, VoiceResolver, never_cancelled,
                            validate_text)
from ..schedule import DitChunkScheduler, TokenChunk
from ..token2wav.dit_service import SpeakerRef


class DitToken2WavBackend(Protocol):
    """Raw speech tokens -> float32 24 kHz audio; streams keyed by request id (see DitToken2WavService)."""

    def offline(self, tokens: Sequence[int], speaker: SpeakerRef) -> np.ndarray: ...

    def step(self, request_id: str, tokens: Sequence[int], speaker: SpeakerRef | None,
             finalize: bool) -> np.ndarray: ...

    def cancel(self, request_id: str) -> bool: ...


class SkipSpeakerEmbedding:
    """The speaker encoder handed to :class:`VoiceResolver` here: the DiT token2wav computes the
    CAM++ embedding itself (from the clip it is sent), so the resolver only needs the LLM prompt."""

    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0)


@dataclass(frozen=True)
class DitTTSRequest:
    request_id: str  # unique among in-flight requests: keys the LLM request and the token2wav stream
    target_text: str
    voice: Voice  # prompt text + prompt speech tokens for the LLM
    speaker: SpeakerRef  # what the token2wav conditions on
    limits: TokenLimits = field(default_factory=TokenLimits)


def dit_request(voices: VoiceResolver, request_id: str, target_text: str, *, reference_wav16: Any = None,
                reference_text: str | None = None, speaker_id: str | None = None,
                limits: TokenLimits = TokenLimits()) -> DitTTSRequest:
    """Validate a request's voice inputs (a reference clip with its transcript, a speaker id, or
    neither = the default speaker) and build it."""
    voice = voices.resolve(reference_wav16, reference_text, speaker_id)
    if reference_wav16 is not None:
        speaker = SpeakerRef(wav16=np.asarray(reference_wav16, np.float32))
    else:
        speaker = SpeakerRef(speaker_id=voice.speaker_id)
    return DitTTSRequest(request_id, target_text, voice, speaker, limits)


class DitTTSPipeline:
    """Text + voice -> 24 kHz waveform, whole (:meth:`synthesize`) or chunk by chunk (:meth:`stream`)."""

    def __init__(self, text_tokenizer: Any, llm: SpeechTokenSource, token2wav: DitToken2WavBackend, *,
                 strategy: str = "exponential", max_text_chars: int = MAX_SEGMENT_CHARS):
        DitChunkScheduler(strategy)  # an unknown strategy fails at start-up, not per request
        self.text_tokenizer = text_tokenizer
        self.llm = llm
        self.token2wav = token2wav
        self.strategy = strategy
        self.max_text_chars = max_text_chars

    def _generate(self, request: DitTTSRequest) -> Iterator[Sequence[int]]:
        validate_text(request.target_text, "target_text", self.max_text_chars)
        tokens = request.voice.features.speech_tokens.reshape(-1).tolist()
        ids = build_prompt_ids(self.text_tokenizer, request.target_text, request.voice.prompt_text, tokens)
        return self.llm.generate(ids, request.request_id, request.limits)

    def synthesize(self, request: DitTTSRequest, is_cancelled: Callable[[], bool] = never_cancelled) -> np.ndarray:
        """Every speech token first, then one offline token2wav call."""
        tokens: list[int] = []
        finished = False
        try:
            for piece in self._generate(request):
                tokens.extend(int(t) for t in piece)
                _raise_if(is_cancelled, request.request_id)
            finished = True
        finally:
            if not finished:
                self.llm.cancel(request.request_id)
        return self.token2wav.offline(tokens, request.speaker)

    def stream(self, request: DitTTSRequest,
               is_cancelled: Callable[[], bool] = never_cancelled) -> Iterator[np.ndarray]:
        """Waveform chunks in order (their concatenation is the utterance), one per scheduled chunk.

        Closing the generator early, an error, or ``is_cancelled()`` turning true stops the LLM
        request and closes the token2wav stream.
        """
        rid = request.request_id
        scheduler = DitChunkScheduler(self.strategy)
        tokens: list[int] = []
        sent = 0
        llm_done = finished = False

        def voice(chunk: TokenChunk) -> np.ndarray:
            nonlocal sent
            audio = self.token2wav.step(rid, tokens[chunk.start:chunk.end], request.speaker if sent == 0 else None,
                                        chunk.last)
            sent += 1
            return audio

        try:
            for piece in self._generate(request):
                tokens.extend(int(t) for t in piece)
                _raise_if(is_cancelled, rid)
                for chunk in scheduler.ready(len(tokens)):
                    yield voice(chunk)
                    _raise_if(is_cancelled, rid)
            llm_done = True
            if tokens:  # no token, no audio: the LLM ended the utterance at once
                yield voice(scheduler.finish(len(tokens)))
            finished = True
        finally:
            if not finished:
                if not llm_done:
                    self.llm.cancel(rid)
                if sent:
                    self.token2wav.cancel(rid)


def _raise_if(is_cancelled: Callable[[], bool], request_id: str) -> None:
    if is_cancelled():
        raise RequestCancelledError(f"request {request_id} was cancelled")
