"""The ``cosyvoice2_dit`` Triton model (Python BLS): text (+ voice) -> 24 kHz waveform with the DiT token2wav.

Inputs, outputs and responses as ``cosyvoice2``: :mod:`cosyserve.serving.bls_base`.

Back ends (:class:`~cosyserve.pipeline.tts.TTSPipeline` does the orchestration, with the DiT kind of
:mod:`cosyserve.pipeline.dit`):

* LLM prompt speech tokens: the ``audio_tokenizer`` model (CosyVoice2's S3 tokenizer);
* speech tokens: any OpenAI-compatible completions server at parameter ``llm_url`` (``.../v1``),
  through :mod:`cosyserve.llm.openai_backend` (our ``cosyserve.llm.openai_server``, trtllm-serve...);
* audio: the ``token2wav_dit`` model, one BLS request per chunk (new tokens only; the speaker on the
  first chunk; request id = this request's). NVIDIA's BLS also sends a request parameter
  ``priority`` = chunk index + 1; Triton 2.51 does not take it as the scheduling priority (its
  verbose log shows priority 10 for every such request), so it is not sent here.

Chunk schedule: parameter ``streaming_strategy`` (``exponential`` | ``equal``); offline requests use
the offline token2wav.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..frontend.speakers import SpeakerRegistry
from ..llm.prompt import SPEECH_TOKEN_OFFSET
from ..pipeline.dit import SkipSpeakerEmbedding, dit_pipeline, dit_request
from ..pipeline.tts import TTSPipeline, TTSRequest
from ..token2wav.dit_service import SpeakerRef
from .bls_base import TTSBLS, TTSInputs, call_model, openai_speech_tokens
from .settings import BlsSettings

TOKEN2WAV_DIT = "token2wav_dit"


class TritonDitToken2Wav:
    """:class:`~cosyserve.pipeline.dit.DitToken2WavCalls` over the ``token2wav_dit`` model."""

    def offline(self, tokens: Sequence[int], speaker: SpeakerRef) -> np.ndarray:
        return self._call("", tokens, speaker)

    def step(self, request_id: str, tokens: Sequence[int], speaker: SpeakerRef | None, finalize: bool) -> np.ndarray:
        return self._call(request_id, tokens, speaker, finalize=np.array([[finalize]], np.bool_))

    def cancel(self, request_id: str) -> bool:
        self._call(request_id, [], None, cancel=np.array([[True]], np.bool_))
        return True

    def _call(self, request_id: str, tokens: Sequence[int], speaker: SpeakerRef | None,
              **extra: np.ndarray) -> np.ndarray:
        inputs = {"target_speech_tokens": np.asarray(tokens, np.int32).reshape(1, -1) + SPEECH_TOKEN_OFFSET, **extra}
        if speaker is not None and speaker.speaker_id:
            inputs["speaker_id"] = np.array([[speaker.speaker_id.encode("utf-8")]], dtype=object)
        elif speaker is not None:
            inputs["reference_wav"] = speaker.wav16.astype(np.float32).reshape(1, -1)
            inputs["reference_wav_len"] = np.array([[speaker.wav16.size]], np.int32)
        return call_model(TOKEN2WAV_DIT, inputs, "waveform", request_id)


class CosyVoice2DitBLS(TTSBLS):
    """Speech tokens from an OpenAI-compatible server (read by the OpenAI backend's own thread, so
    tokens keep coming while a chunk is voiced), audio from the ``token2wav_dit`` model."""

    def speech_tokens(self, settings: BlsSettings, tokenizer, registry: SpeakerRegistry):
        return openai_speech_tokens(settings, tokenizer, registry)

    def speaker_encoder(self) -> SkipSpeakerEmbedding:
        return SkipSpeakerEmbedding()

    def build_pipeline(self, tokenizer, settings: BlsSettings) -> TTSPipeline:
        return dit_pipeline(tokenizer, self.llm, TritonDitToken2Wav(), strategy=settings.streaming_strategy)

    def build_request(self, inputs: TTSInputs) -> TTSRequest:
        return dit_request(self.voices, inputs.request_id, inputs.target_text, reference_wav16=inputs.reference_wav,
                           reference_text=inputs.reference_text, speaker_id=inputs.speaker_id, limits=inputs.limits)
