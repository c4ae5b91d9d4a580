"""The ``cosyvoice2`` Triton model (Python BLS): text (+ voice) -> 24 kHz waveform.

Inputs (all ``[1, ...]``): ``target_text`` BYTES; optional ``reference_wav`` FP32 (16 kHz) with
``reference_wav_len`` INT32 and ``reference_text`` BYTES (zero-shot voice), or ``speaker_id``
BYTES (a voice of spk2info.pt); neither = the default speaker "001". Optional ``max_tokens`` /
``min_tokens`` INT32 override the template's speech-token limits for one request.
Output: ``waveform`` FP32.

``decoupled`` true streams chunks (ChunkScheduler, template parameter ``streaming_strategy``),
then a final flag; false answers once. The orchestration is :class:`~cosyserve.pipeline.tts.TTSPipeline`;
this module only supplies its back ends as BLS requests to the ``audio_tokenizer``,
``speaker_embedding``, LLM and ``token2wav`` models.

Speech tokens come from one of:

* a Triton LLM model with TensorRT-LLM's tensor interface, named by parameter ``llm_model_name``
  (``llm``, this package's; ``tensorrt_llm``, NVIDIA's). Parameter ``llm_protocol`` says what its
  requests carry (:class:`~cosyserve.trtllm.request.TritonLLMInputs`): ``tensorrt_llm`` adds the
  head bias as ``embedding_bias``, the stop words and ``seed``, which a TensorRT-LLM engine needs;
  ``cosyserve`` leaves them out; empty = ``tensorrt_llm`` for the model of that name, else
  ``cosyserve``. The ``llm`` model accepts both, so the BLS runs unchanged against either name.
* an OpenAI-compatible completions server, when parameter ``llm_url`` (``http://HOST:PORT/v1``)
  is set (no Triton LLM model then), through :mod:`cosyserve.llm.openai_backend` as the DiT BLS
  does (:func:`openai_speech_tokens`); a cancelled request closes its connection, which stops
  the generation on the server.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from contextlib import closing
from typing import Iterator, Sequence

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..frontend.speakers import SpeakerRegistry
from ..llm.backends import create_backend
from ..llm.prompt import NUM_SPEECH_TOKENS, SPEECH_TOKEN_OFFSET
from ..pipeline.local import REFERENCE_SAMPLING, SPK2INFO, LocalSpeechTokens, register_voice_prefixes
from ..pipeline.tts import DEFAULT_SPEAKER, TokenLimits, TTSPipeline, TTSRequest, Voice, VoiceResolver, validate_text
from ..trtllm.request import TritonLLMInputs, resolve_protocol
from .settings import BlsSettings
from .triton_utils import (FINAL, FinishedResponseIterators, error_response, limit_torch_threads, model_settings,
                           optional_input, optional_scalar, optional_text, raise_response_error, reference_wav, tensor)


def _bls(model_name: str, inputs: dict[str, np.ndarray], outputs: list[str], request_id: str = ""):
    return pb_utils.InferenceRequest(model_name=model_name, requested_output_names=outputs, request_id=request_id,
                                     inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])


def _exec(model_name: str, inputs: dict[str, np.ndarray], output: str, request_id: str = "") -> np.ndarray:
    """One BLS call; returns ``output`` without its batch dimension."""
    response = _bls(model_name, inputs, [output], request_id).exec()
    raise_response_error(response, model_name)
    return pb_utils.get_output_tensor_by_name(response, output).as_numpy()[0]


class RemoteSpeechTokenizer:
    """``tokenize(wav16)`` through the ``audio_tokenizer`` model."""

    def tokenize(self, wav16: torch.Tensor) -> torch.Tensor:
        wav = wav16.numpy().astype(np.float32)[None]
        inputs = {"reference_wav": wav, "reference_wav_len": np.array([[wav.shape[1]]], np.int32)}
        ids = _exec("audio_tokenizer", inputs, "prompt_speech_tokens")
        return torch.from_numpy(ids.astype(np.int32) - SPEECH_TOKEN_OFFSET)


class RemoteSpeakerEncoder:
    """``embed(wav16)`` through the ``speaker_embedding`` model (fp16 on the wire)."""

    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        embedding = _exec("speaker_embedding", {"reference_wav": wav16.numpy().astype(np.float32)[None]},
                          "prompt_spk_embedding")
        return torch.from_numpy(embedding.astype(np.float32))


def openai_speech_tokens(settings: BlsSettings, tokenizer, registry: SpeakerRegistry) -> LocalSpeechTokens:
    """Speech tokens from the OpenAI-compatible server at ``settings.llm_url`` (model id:
    ``llm_model``, empty = the first the server lists), with the registered voices' prefixes warmed
    there. Its ``backend`` reads each stream on a thread of its own; close it when unloading."""
    if not settings.llm_url:
        raise ValueError("model parameter 'llm_url' is missing or empty in config.pbtxt")
    backend = create_backend("openai", settings.llm_tokenizer_dir, base_url=settings.llm_url,
                             model=settings.llm_model or None)
    register_voice_prefixes(backend, tokenizer, registry)
    return LocalSpeechTokens(backend, REFERENCE_SAMPLING)


class TritonSpeechTokens:
    """:class:`~cosyserve.pipeline.tts.SpeechTokenSource` over a TensorRT-LLM-style model (always decoupled).

    Every response iterator is read to its final response (the stub never frees an abandoned
    one) and then kept in ``finished`` until the stub lets go of it: call ``finished.release``
    while the request being served is still open (see
    :class:`~cosyserve.serving.triton_utils.FinishedResponseIterators`). Not thread-safe: one per
    stub, used from the request thread.
    """

    def __init__(self, model_name: str, inputs: TritonLLMInputs):
        self.model_name = model_name
        self.inputs = inputs
        self.finished = FinishedResponseIterators()
        self._unfinished: dict[str, object] = {}  # request id -> its response iterator, until read to the end

    def generate(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> Iterator[Sequence[int]]:
        inputs = self.inputs.generate(prompt_ids, limits.max_tokens, limits.min_tokens)
        responses = _bls(self.model_name, inputs, ["output_ids", "sequence_length"], request_id).exec(decoupled=True)
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
            raw = output_ids.as_numpy()[0][0][:length].astype(np.int64) - SPEECH_TOKEN_OFFSET
            speech = (raw >= 0) & (raw < NUM_SPEECH_TOKENS)
            if not speech.all():
                ended = True
                raw = raw[:int(np.argmin(speech))]
            yield raw.tolist()
        self.finished.keep(self._unfinished.pop(request_id))

    def cancel(self, request_id: str) -> None:
        """Stop the request, then read what it still sends (up to its final response)."""
        stop_responses = _bls(self.model_name, self.inputs.stop(), ["output_ids"], request_id).exec(decoupled=True)
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
        return _exec("token2wav", inputs, "waveform", request_id)


@dataclass
class TTSInputs:
    """The inputs common to the cosyvoice2 and cosyvoice2_dit models, checked."""

    request_id: str  # unique even when clients reuse ids: it keys the LLM request and the token2wav session
    target_text: str
    reference_wav: np.ndarray | None
    reference_text: str | None
    speaker_id: str | None
    limits: TokenLimits


def parse_tts_inputs(request, limits: TokenLimits, max_text_chars: int) -> TTSInputs:
    """Read and check a BLS request's text, voice and token-limit inputs (the voice is resolved by the caller)."""
    target_text = validate_text(optional_text(request, "target_text"), "target_text", max_text_chars)
    wav = reference_wav(request) if optional_input(request, "reference_wav") is not None else None
    return TTSInputs(f"{request.request_id() or 'tts'}-{uuid.uuid4().hex[:12]}", target_text, wav,
                     optional_text(request, "reference_text"), optional_text(request, "speaker_id"),
                     limits.override(optional_scalar(request, "max_tokens"), optional_scalar(request, "min_tokens")))


class CosyVoice2BLS:
    """Requests are handled one at a time per instance, inside ``execute``, on the request thread
    only: every ``pb_utils`` call of this stub comes from one thread. Concurrency comes from
    ``bls_instance_num`` instances, and the LLM batches across all of them.
    """

    def __init__(self, config: dict):
        from transformers import AutoTokenizer

        settings = model_settings(config, BlsSettings)
        # dozens of instances; each needs little CPU (prompt mel, resampling)
        limit_torch_threads(settings.torch_threads)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        registry = SpeakerRegistry.load(settings.model_dir / SPK2INFO)
        self.voices = VoiceResolver(registry, RemoteSpeechTokenizer(), RemoteSpeakerEncoder())
        self.limits = TokenLimits(settings.max_tokens, settings.min_tokens)
        tokenizer = AutoTokenizer.from_pretrained(settings.llm_tokenizer_dir)
        if settings.llm_url:
            self.llm = openai_speech_tokens(settings, tokenizer, registry)
        else:
            model_name = settings.llm_model_name
            protocol = resolve_protocol(settings.llm_protocol, model_name)
            # the tensorrt_llm protocol's embedding_bias is the head bias of this (HuggingFace) directory
            self.llm = TritonSpeechTokens(model_name, TritonLLMInputs(protocol, REFERENCE_SAMPLING, self.decoupled,
                                                                      settings.llm_tokenizer_dir))
        self.pipeline = TTSPipeline(tokenizer, self.llm, TritonToken2Wav(), strategy=settings.streaming_strategy)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        return [self._offline(request) for request in requests]

    def _parse(self, request) -> TTSRequest:
        f = parse_tts_inputs(request, self.limits, self.pipeline.max_text_chars)
        voice = self.voices.resolve(f.reference_wav, f.reference_text, f.speaker_id)
        return TTSRequest(f.request_id, f.target_text, voice, f.limits)

    def _stream(self, request) -> None:
        sender = request.get_response_sender()
        last = None  # the final response: nothing more, or the error
        try:
            # closed here, on an error too: its clean-up makes BLS calls, which only work inside execute
            with closing(self.pipeline.stream(self._parse(request), sender.is_cancelled)) as chunks:
                for chunk in chunks:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[tensor("waveform", chunk)]))
        except Exception as exc:
            last = error_response(exc)
        self._release_finished(sender.is_cancelled)  # before the final flag closes the sender
        sender.send(last, flags=FINAL)

    def _offline(self, request):
        try:
            waveform = self.pipeline.synthesize(self._parse(request), request.is_cancelled)
            response = pb_utils.InferenceResponse(output_tensors=[tensor("waveform", waveform)])
        except Exception as exc:
            response = error_response(exc)
        self._release_finished(request.is_cancelled)
        return response

    def _release_finished(self, is_cancelled) -> None:
        if isinstance(self.llm, TritonSpeechTokens):
            self.llm.finished.release(is_cancelled)

    def close(self) -> None:
        """Requests finish inside execute; only an OpenAI backend has threads (idle ones) to stop."""
        if isinstance(self.llm, LocalSpeechTokens):
            self.llm.backend.close()
