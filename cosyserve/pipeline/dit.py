"""The Step-Audio-2-mini DiT token2wav as a kind of :class:`~cosyserve.pipeline.tts.TTSPipeline`
(the ``cosyvoice2_dit`` Triton model, ``scripts/dit_offline.py``).

The DiT deployment differs from CosyVoice2's where NVIDIA's ``cosyvoice2_dit`` BLS does:

* chunks carry only the *new* tokens (+3 look-ahead): the token2wav keeps the request's caches
  keyed by request id, and the schedule is :class:`~cosyserve.schedule.DitChunkScheduler`
  (``exponential`` or ``equal``);
* the speaker travels as a reference clip or a speaker id: the token2wav derives its prompt
  features itself, so the voice resolver only computes the LLM's prompt speech tokens
  (:class:`SkipSpeakerEmbedding`);
* the text goes to the LLM as it is (no normalisation, one segment of at most
  ``MAX_SEGMENT_CHARS``), and an LLM that ends at once gets no audio rather than an error.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..frontend.prompt import Voice
from ..schedule import DitChunkScheduler
from ..text import MAX_SEGMENT_CHARS
from ..token2wav.dit_service import SpeakerRef
from .tts import SpeechTokenSource, TokenLimits, Token2WavKind, TTSPipeline, TTSRequest, VoiceResolver

DIT = Token2WavKind(DitChunkScheduler, silent_when_empty=True)


class DitToken2WavCalls(Protocol):
    """The DiT token2wav's own calls: :class:`~cosyserve.token2wav.dit_service.DitToken2WavService`
    in-process, or BLS requests to the ``token2wav_dit`` model (``cosyserve.serving.dit_bls``)."""

    def offline(self, tokens: Sequence[int], speaker: SpeakerRef) -> np.ndarray: ...

    def step(self, request_id: str, tokens: Sequence[int], speaker: SpeakerRef | None,
             finalize: bool) -> np.ndarray: ...

    def cancel(self, request_id: str) -> bool: ...


def speaker_of(voice: Voice) -> SpeakerRef:
    """A zero-shot voice is its reference clip; any other names a voice of spk2info.pt."""
    if voice.reference_wav16 is not None:
        return SpeakerRef(wav16=voice.reference_wav16)
    return SpeakerRef(speaker_id=voice.speaker_id)


class DitToken2WavAdapter:
    """:class:`~cosyserve.pipeline.tts.Token2Wav` over the DiT token2wav's calls: a step sends the
    chunk's new tokens only, and the speaker with the first (which opens the stream)."""

    def __init__(self, calls: DitToken2WavCalls):
        self.calls = calls

    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray:
        return self.calls.offline(tokens, speaker_of(voice))

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice, token_offset: int,
             finalize: bool) -> np.ndarray:
        speaker = speaker_of(voice) if token_offset == 0 else None
        return self.calls.step(request_id, tokens[token_offset:], speaker, finalize)

    def cancel(self, request_id: str) -> None:
        self.calls.cancel(request_id)


class SkipSpeakerEmbedding:
    """The speaker encoder handed to :class:`~cosyserve.pipeline.tts.VoiceResolver` here: the DiT
    token2wav computes the CAM++ embedding itself (from the clip it is sent)."""

    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0)


def dit_pipeline(text_tokenizer: Any, llm: SpeechTokenSource, token2wav: DitToken2WavCalls, *,
                 strategy: str = "exponential") -> TTSPipeline:
    """The pipeline over the DiT token2wav (an unknown ``strategy`` fails here)."""
    return TTSPipeline(text_tokenizer, llm, DitToken2WavAdapter(token2wav), strategy=strategy,
                       max_text_chars=MAX_SEGMENT_CHARS, kind=DIT)


def dit_request(voices: VoiceResolver, request_id: str, target_text: str, *, reference_wav16: Any = None,
                reference_text: str | None = None, speaker_id: str | None = None,
                limits: TokenLimits = TokenLimits()) -> TTSRequest:
    """Validate a request's voice inputs (a reference clip with its transcript, a speaker id, or
    neither = the default speaker) and build it; its text is sent as it is."""
    voice = voices.resolve(reference_wav16, reference_text, speaker_id)
    return TTSRequest(request_id, target_text, voice, limits, text_frontend=False)
