"""The ``cosyvoice3`` Triton model (Python BLS): text + reference voice -> 24 kHz waveform with CosyVoice3.

Wire protocol of the reference's ``cosyvoice3`` model (``cosyvoice3.md`` §2.1), so NVIDIA's
``client_grpc.py --model-name cosyvoice3`` streams from it: ``target_text`` BYTES [1];
``reference_wav`` FP32 [-1] (16 kHz) with ``reference_wav_len`` INT32 [1] and ``reference_text``
BYTES [1] (optional in the config, as there, but CosyVoice3 has no built-in speaker: a request
without them gets a clear error). Output ``waveform`` FP32 [-1], 24 kHz; decoupled: one response
per chunk, then an empty final one (or the error with the final flag).

A voice is the content of the request: its prompt features are computed from the clip (kept for
the last ``clip_cache_size`` distinct clips by the front-end models and the resolver, keyed by
the samples) and its transcript is the request's. The reference keys its speaker cache by the
transcript alone, so two voices with one transcript collide there; not here. Or ``speaker_id``
names a voice uploaded through the HTTP API (``voices_dir``, shared with a CosyVoice2 server: the
clip is one, the features are CosyVoice3's own, in ``features.cosyvoice3.pt``).

Speech tokens come from the ``llm`` Triton model (our engine), or from OpenAI-compatible completions
servers when ``llm_url`` is set (``http://HOST:PORT/v1``, comma-separated for several: the reference
runs trtllm-serve; each request sends the prompt ids, generation ends on every CosyVoice3 class from
6561 on, as upstream's).

Modes (LLM prompt forms of ``cosyvoice3_llm_layout.md`` §4.2, built by
:func:`~cosyserve.llm.prompt.build_prompt_ids` with :data:`~cosyserve.llm.prompt.COSYVOICE3`; the
voice conditions token2wav in every mode):

* zero-shot (a clip with its transcript, or a stored voice with one):
  ``<|sos|>{system}{prompt_text}{target_text}<|task_id|>`` + the prompt speech tokens;
* cross-lingual (a stored voice without transcript): ``<|sos|>{system}{target_text}<|task_id|>``;
* instruct (the optional ``instruction`` BYTES input, as CosyVoice2's; any voice):
  ``<|sos|>You are a helpful assistant. {instruction}<|endofprompt|>{target_text}<|task_id|>``, or
  ``<|sos|>{instruction}{target_text}<|task_id|>`` where the instruction carries its own
  ``<|endofprompt|>`` (upstream's instruct strings). The voice's transcript and prompt speech tokens stay
  out of the LLM prompt, as upstream's ``inference_instruct2``. An empty instruction, or one longer than
  a segment (1000 characters), is an error of that request.

``{system}`` is ``You are a helpful assistant.<|endofprompt|>`` unless the text already carries
``<|endofprompt|>``. The reference's BLS serves zero-shot only.

Back ends, all BLS requests (the orchestration is :class:`~cosyserve.pipeline.tts.TTSPipeline`
with the CosyVoice3 prompt layout):

* ``audio_tokenizer`` (``speech_tokenizer_v3.onnx``, raw codes) and ``speaker_embedding`` (CAM++);
* the ``llm`` model (this package's engine on the CosyVoice3 HF checkpoint: output ids are
  151924 + code; it stops on the 200 stop classes and samples only in the speech-head window);
* ``token2wav`` (:mod:`cosyserve.serving.token2wav_cv3_model`): raw codes in, only the new samples
  out (incremental flow and vocoder), session keyed by this request's id.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..frontend.prompt import COSYVOICE3_MEL_FMAX
from ..frontend.speakers import SpeakerRegistry
from ..llm.prompt import COSYVOICE3
from ..llm.sampling import COSYVOICE3_SAMPLING
from ..llm.trtllm.request import TritonLLMInputs
from ..pipeline.tts import TTSPipeline, Voice, VoiceResolver
from .bls import CosyVoice2BLS, TritonSpeechTokens
from .bls_base import RemoteSpeechTokenizer, call_model, openai_speech_tokens
from .settings import BlsSettings

TOKEN2WAV = "token2wav"


class TritonCv3Token2Wav:
    """:class:`~cosyserve.pipeline.tts.Token2Wav` over CosyVoice3's ``token2wav`` model (raw codes on the
    wire; the voice goes with the offline call and a stream's first step only)."""

    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray:
        return self._call(request_id, tokens, voice)

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice, token_offset: int,
             finalize: bool) -> np.ndarray:
        return self._call(request_id, tokens, voice if token_offset == 0 else None,
                          token_offset=np.array([[token_offset]], np.int32), finalize=np.array([[finalize]], np.bool_))

    def cancel(self, request_id: str) -> None:
        self._call(request_id, [], None, cancel=np.array([[True]], np.bool_))

    def _call(self, request_id: str, tokens: Sequence[int], voice: Voice | None, **extra: np.ndarray) -> np.ndarray:
        inputs = {"target_speech_tokens": np.asarray(tokens, np.int32).reshape(1, -1), **extra}
        if voice is not None:
            f = voice.features
            inputs["prompt_speech_tokens"] = f.speech_tokens.numpy().astype(np.int32)[None]
            inputs["prompt_speech_feat"] = f.speech_feat.numpy().astype(np.float16)[None]
            inputs["prompt_spk_embedding"] = f.embedding.numpy().astype(np.float16)[None]
        return call_model(TOKEN2WAV, inputs, "waveform", request_id)


class CosyVoice3BLS(CosyVoice2BLS):
    """CosyVoice2's BLS (requests, speaker encoder, LLM response bookkeeping) with CosyVoice3's back
    ends: speech tokens from the Triton ``llm`` model in the CosyVoice3 layout, audio from CosyVoice3's
    ``token2wav`` model, voices from the request or the voice store (no registered speakers)."""

    features_file = "features.cosyvoice3.pt"  # next to CosyVoice2's features.pt of the same stored voice

    def speech_tokens(self, settings: BlsSettings, tokenizer, registry: SpeakerRegistry):
        if settings.llm_url:  # an OpenAI-compatible server of the CosyVoice3 LLM, as the reference's trtllm-serve
            return openai_speech_tokens(settings, tokenizer, registry, COSYVOICE3, COSYVOICE3_SAMPLING)
        inputs = TritonLLMInputs("cosyserve", COSYVOICE3_SAMPLING, self.decoupled, end_id=COSYVOICE3.eos_id)
        return TritonSpeechTokens(settings.llm_model_name, inputs, COSYVOICE3.speech_token_offset)

    def speaker_registry(self, settings: BlsSettings) -> SpeakerRegistry:
        return SpeakerRegistry()  # CosyVoice3 ships no spk2info.pt: every request brings its voice

    def voice_resolver(self, registry: SpeakerRegistry, settings: BlsSettings) -> VoiceResolver:
        return VoiceResolver(registry, RemoteSpeechTokenizer(token_offset=0), self.speaker_encoder(),
                             default_speaker=None, mel_fmax=COSYVOICE3_MEL_FMAX, store=self.voice_store(settings))

    def build_pipeline(self, tokenizer, settings: BlsSettings) -> TTSPipeline:
        pipeline = TTSPipeline(tokenizer, self.llm, TritonCv3Token2Wav(), strategy=settings.streaming_strategy,
                               max_text_chars=settings.max_text_chars, layout=COSYVOICE3)
        if settings.warm_up is not False:
            pipeline.text.warm_up()
        return pipeline
