"""A CosyVoice text-to-speech Python BLS over the reference layout's models: text (+ voice) -> 24 kHz
waveform. The ``cosyvoice3`` model runs on it (:mod:`.cosyvoice3_bls`) until CosyVoice3 becomes a kind
of the engine; CosyVoice2's ``cosyvoice2`` model is the engine core (:mod:`.frontdoor`).

Inputs, outputs and responses: :mod:`cosyserve.serving.bls_base`. Streaming chunks follow
ChunkScheduler (template parameter ``streaming_strategy``). The text is normalised and split into
segments (:mod:`cosyserve.text`) unless the optional ``text_frontend`` BOOL input is false;
parameter ``max_text_chars`` bounds it. Besides spk2info.pt, ``speaker_id`` may name a voice uploaded
through the HTTP API into the voice store (parameter ``voices_dir``, default ``<model_dir>/voices``);
the optional ``instruction`` BYTES input selects CosyVoice2's instruct mode. The orchestration is
:class:`~cosyserve.pipeline.tts.TTSPipeline`; this module only supplies its back ends as BLS
requests to the ``audio_tokenizer``, ``speaker_embedding``, LLM and ``token2wav`` models.

Speech tokens come from one of:

* a Triton LLM model with TensorRT-LLM's tensor interface, named by parameter ``llm_model_name``
  (``llm``, this package's; ``tensorrt_llm``, NVIDIA's). Parameter ``llm_protocol`` says what its
  requests carry (:class:`~cosyserve.llm.trtllm.request.TritonLLMInputs`): ``tensorrt_llm`` adds the
  head bias as ``embedding_bias``, the stop words and ``seed``, which a TensorRT-LLM engine needs;
  ``cosyserve`` leaves them out; empty = ``tensorrt_llm`` for the model of that name, else
  ``cosyserve``. The ``llm`` model accepts both, so the BLS runs unchanged against either name.
* an OpenAI-compatible completions server, when parameter ``llm_url`` (``http://HOST:PORT/v1``)
  is set (no Triton LLM model then), through :mod:`cosyserve.llm.openai_backend` as the DiT BLS
  does (:func:`openai_speech_tokens`); a cancelled request closes its connection, which stops
  the generation on the server.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..frontend.speakers import SpeakerRegistry
from ..frontend.voice_store import FEATURES_FILE, VOICES_DIR, VoiceStore
from ..llm.prompt import NUM_SPEECH_TOKENS, SPEECH_TOKEN_OFFSET
from ..llm.sampling import REFERENCE_SAMPLING
from ..pipeline.tts import DEFAULT_SPEAKER, TokenLimits, TTSPipeline, TTSRequest, Voice
from ..llm.trtllm.request import TritonLLMInputs, resolve_protocol
from .bls_base import TTSBLS, TTSInputs, bls_request, call_model, openai_speech_tokens
from .settings import BlsSettings
from .triton_utils import FinishedResponseIterators, raise_response_error


class RemoteSpeakerEncoder:
    """``embed(wav16)`` through the ``speaker_embedding`` model (fp16 on the wire)."""

    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        embedding = call_model("speaker_embedding", {"reference_wav": wav16.numpy().astype(np.float32)[None]},
                               "prompt_spk_embedding")
        return torch.from_numpy(embedding.astype(np.float32))


class TritonSpeechTokens:
    """:class:`~cosyserve.pipeline.tts.SpeechTokenSource` over a TensorRT-LLM-style model (always decoupled).

    Every response iterator is read to its final response (the stub never frees an abandoned
    one) and then kept in ``finished`` until the stub lets go of it: call ``finished.release``
    while the request being served is still open (see
    :class:`~cosyserve.serving.triton_utils.FinishedResponseIterators`). Not thread-safe: one per
    stub, used from the request thread.
    """

    def __init__(self, model_name: str, inputs: TritonLLMInputs, speech_token_offset: int = SPEECH_TOKEN_OFFSET):
        self.model_name = model_name
        self.inputs = inputs
        self.speech_token_offset = speech_token_offset  # LLM id of speech token 0 (the layout's)
        self.finished = FinishedResponseIterators()
        self._unfinished: dict[str, object] = {}  # request id -> its response iterator, until read to the end

    def generate(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> Iterator[Sequence[int]]:
        inputs = self.inputs.generate(prompt_ids, limits.max_tokens, limits.min_tokens)
        responses = bls_request(self.model_name, inputs, ["output_ids", "sequence_length"], request_id).exec(decoupled=True)
        self._unfinished[request_id] = responses
        return self._speech_tokens(request_id, responses)

    def _speech_tokens(self, request_id: str, responses) -> Iterator[Sequence[int]]:
        ended = False  # an end-of-speech id was seen; the rest is still read (see the class docstring)
        for response in responses:
            raise_response_error(response, self.model_name)
            output_ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if output_ids is None or ended:  # None: the empty response that carries the final flag
                continue
            length = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            raw = output_ids.as_numpy()[0][0][:length].astype(np.int64) - self.speech_token_offset
            speech = (raw >= 0) & (raw < NUM_SPEECH_TOKENS)
            if not speech.all():
                ended = True
                raw = raw[:int(np.argmin(speech))]
            yield raw.tolist()
        self.finished.keep(self._unfinished.pop(request_id))

    def cancel(self, request_id: str) -> None:
        """Stop the request, then read what it still sends (up to its final response)."""
        stop_responses = bls_request(self.model_name, self.inputs.stop(), ["output_ids"], request_id).exec(decoupled=True)
        for response in stop_responses:
            if response.has_error():
                pb_utils.Logger.log_warn(f"stopping LLM request {request_id}: {response.error().message()}")
        self.finished.keep(stop_responses)
        responses = self._unfinished.pop(request_id, None)
        if responses is not None:
            for _ in responses:  # the stopped request ends within a token
                pass
            self.finished.keep(responses)


class TritonToken2Wav:
    """:class:`~cosyserve.pipeline.tts.Token2Wav` over the ``token2wav`` model (sessions keyed by request id)."""

    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray:
        return self._call(request_id, tokens, voice, with_prompt=True)

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice, token_offset: int,
             finalize: bool) -> np.ndarray:
        # The prompt is only read when the session opens, at the first step.
        return self._call(request_id, tokens, voice, with_prompt=token_offset == 0,
                          token_offset=np.array([[token_offset]], np.int32), finalize=np.array([[finalize]], np.bool_))

    def cancel(self, request_id: str) -> None:
        self._call(request_id, [], None, with_prompt=False, cancel=np.array([[True]], np.bool_))

    def _call(self, request_id: str, tokens: Sequence[int], voice: Voice | None, with_prompt: bool,
              **extra: np.ndarray) -> np.ndarray:
        inputs = {"target_speech_tokens": np.asarray(tokens, np.int32).reshape(1, -1) + SPEECH_TOKEN_OFFSET, **extra}
        if with_prompt and voice.speaker_id != DEFAULT_SPEAKER:  # token2wav holds the default speaker itself
            f = voice.features
            inputs["prompt_speech_tokens"] = f.speech_tokens.numpy().astype(np.int32)[None] + SPEECH_TOKEN_OFFSET
            inputs["prompt_speech_feat"] = f.speech_feat.numpy().astype(np.float16)[None]
            inputs["prompt_spk_embedding"] = f.embedding.numpy().astype(np.float16)[None]
        return call_model("token2wav", inputs, "waveform", request_id)


class CosyVoice2BLS(TTSBLS):
    """The CosyVoice2 pipeline: speech tokens from a Triton LLM model or an OpenAI-compatible server,
    audio from the ``token2wav`` model."""

    features_file = FEATURES_FILE  # a stored voice's features, this model's own (a voice serves every model)

    def speech_tokens(self, settings: BlsSettings, tokenizer, registry: SpeakerRegistry):
        if settings.llm_url:
            return openai_speech_tokens(settings, tokenizer, registry)
        model_name = settings.llm_model_name
        protocol = resolve_protocol(settings.llm_protocol, model_name)
        # Tokens as they come when streaming, and offline too under a request timeout: the deadline
        # is checked as each piece arrives, so one response with every token would let the LLM run on.
        streaming = self.decoupled or bool(settings.request_timeout_s)
        # the tensorrt_llm protocol's embedding_bias is the head bias of this (HuggingFace) directory
        return TritonSpeechTokens(model_name, TritonLLMInputs(protocol, REFERENCE_SAMPLING, streaming,
                                                              settings.llm_tokenizer_dir))

    def speaker_encoder(self) -> RemoteSpeakerEncoder:
        return RemoteSpeakerEncoder()

    def voice_store(self, settings: BlsSettings) -> VoiceStore:
        return VoiceStore(settings.voices_dir or settings.model_dir / VOICES_DIR, features_file=self.features_file)

    def build_pipeline(self, tokenizer, settings: BlsSettings) -> TTSPipeline:
        pipeline = TTSPipeline(tokenizer, self.llm, TritonToken2Wav(),
                               strategy=settings.streaming_strategy, max_text_chars=settings.max_text_chars)
        if settings.warm_up is not False:  # before the server reports ready, not on the first request
            pipeline.text.warm_up()
        return pipeline

    def build_request(self, inputs: TTSInputs) -> TTSRequest:
        voice = self.voices.resolve(inputs.reference_wav, inputs.reference_text, inputs.speaker_id)
        return TTSRequest(inputs.request_id, inputs.target_text, voice, inputs.limits, inputs.text_frontend,
                          inputs.instruction)

    def release_finished(self, is_cancelled) -> None:
        if isinstance(self.llm, TritonSpeechTokens):
            self.llm.finished.release(is_cancelled)
