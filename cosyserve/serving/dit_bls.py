"""The ``cosyvoice2_dit`` Triton model (Python BLS): text (+ voice) -> 24 kHz waveform with the DiT token2wav.

Inputs as ``cosyvoice2`` (all ``[1, ...]``): ``target_text`` BYTES; optional ``reference_wav`` FP32
(16 kHz) + ``reference_wav_len`` INT32 + ``reference_text`` BYTES, or ``speaker_id`` BYTES (a voice
of spk2info.pt), or neither (the default speaker "001"); optional ``max_tokens`` / ``min_tokens``
INT32 overriding the template's speech-token limits. Output: ``waveform`` FP32.

Back ends (:class:`~cosyserve.serving.dit_pipeline.DitTTSPipeline` does the orchestration):

* LLM prompt speech tokens: the ``audio_tokenizer`` model (CosyVoice2's S3 tokenizer);
* speech tokens: any OpenAI-compatible completions server at parameter ``llm_url`` (``.../v1``),
  through :mod:`cosyserve.llm.openai_backend` (our ``cosyserve.llm.openai_server``, trtllm-serve...);
* audio: the ``token2wav_dit`` model, one BLS request per chunk (new tokens only; the speaker on the
  first chunk; request id = this request's). NVIDIA's BLS also sends a request parameter
  ``priority`` = chunk index + 1; Triton 2.51 does not take it as the scheduling priority (its
  verbose log shows priority 10 for every such request), so it is not sent here.

Chunk schedule: parameter ``streaming_strategy`` (``exponential`` | ``equal``). ``decoupled`` true
streams one response per chunk then a final flag; false answers once (offline token2wav).
"""

from __future__ import annotations

from contextlib import closing
from typing import Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from ..frontend.speakers import SpeakerRegistry
from ..llm.prompt import SPEECH_TOKEN_OFFSET
from ..pipeline.local import SPK2INFO
from ..pipeline.tts import TokenLimits, VoiceResolver
from .bls import RemoteSpeechTokenizer, openai_speech_tokens, parse_tts_inputs
from .dit_pipeline import DitTTSPipeline, DitTTSRequest, SkipSpeakerEmbedding, dit_request
from .dit_runtime import SpeakerRef
from .settings import BlsSettings
from .triton_utils import FINAL, error_response, limit_torch_threads, model_settings, raise_response_error, tensor

TOKEN2WAV_DIT = "token2wav_dit"


class TritonDitToken2Wav:
    """:class:`~cosyserve.serving.dit_pipeline.DitToken2WavBackend` over the ``token2wav_dit`` model."""

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
        request = pb_utils.InferenceRequest(
            model_name=TOKEN2WAV_DIT, requested_output_names=["waveform"], request_id=request_id,
            inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
        response = request.exec()
        raise_response_error(response, TOKEN2WAV_DIT)
        return pb_utils.get_output_tensor_by_name(response, "waveform").as_numpy()[0]


class CosyVoice2DitBLS:
    """Requests are handled one at a time per instance, inside ``execute`` (the threading that
    Triton's Python stub survives, see :class:`~cosyserve.serving.bls.CosyVoice2BLS`); concurrency
    comes from ``bls_instance_num`` instances, and the LLM server batches across all of them. The
    LLM stream is read by the OpenAI backend's own thread, so tokens keep coming while a chunk is
    voiced."""

    def __init__(self, config: dict):
        from transformers import AutoTokenizer

        settings = model_settings(config, BlsSettings)
        limit_torch_threads(settings.torch_threads)  # as the cosyvoice2 BLS: many light instances
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        registry = SpeakerRegistry.load(settings.model_dir / SPK2INFO)
        self.voices = VoiceResolver(registry, RemoteSpeechTokenizer(), SkipSpeakerEmbedding())
        self.limits = TokenLimits(settings.max_tokens, settings.min_tokens)
        tokenizer = AutoTokenizer.from_pretrained(settings.llm_tokenizer_dir)
        self.llm = openai_speech_tokens(settings, tokenizer, registry)
        self.pipeline = DitTTSPipeline(tokenizer, self.llm, TritonDitToken2Wav(), strategy=settings.streaming_strategy)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        return [self._offline(request) for request in requests]

    def _parse(self, request) -> DitTTSRequest:
        f = parse_tts_inputs(request, self.limits, self.pipeline.max_text_chars)
        return dit_request(self.voices, f.request_id, f.target_text, reference_wav16=f.reference_wav,
                           reference_text=f.reference_text, speaker_id=f.speaker_id, limits=f.limits)

    def _stream(self, request) -> None:
        sender = request.get_response_sender()
        try:
            # closed here, on an error too: its clean-up calls token2wav_dit, which only works inside execute
            with closing(self.pipeline.stream(self._parse(request), sender.is_cancelled)) as chunks:
                for chunk in chunks:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[tensor("waveform", chunk)]))
            sender.send(flags=FINAL)
        except Exception as exc:
            sender.send(error_response(exc), flags=FINAL)

    def _offline(self, request):
        try:
            waveform = self.pipeline.synthesize(self._parse(request), request.is_cancelled)
            return pb_utils.InferenceResponse(output_tensors=[tensor("waveform", waveform)])
        except Exception as exc:
            return error_response(exc)

    def close(self) -> None:
        self.llm.backend.close()
