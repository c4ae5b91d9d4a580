"""The ``audio_tokenizer`` and ``speaker_embedding`` Triton models over the ONNX front-end wrappers.

* ``audio_tokenizer``: ``reference_wav`` FP32 [-1] (16 kHz) + optional ``reference_wav_len``
  INT32 [1] -> ``prompt_speech_tokens`` INT32 [-1], LLM ids (speech token + 151663). CosyVoice3's
  (template ``audio_tokenizer_cosyvoice3``, :class:`AudioTokenizerV3Model`) reads
  ``speech_tokenizer_v3.onnx`` and answers raw codes 0..6560, as the reference's does.
* ``speaker_embedding``: ``reference_wav`` FP32 [-1] (+ optional length) ->
  ``prompt_spk_embedding`` FP16 [-1] (192 values, the raw CAM++ x-vector).

Audio is validated like any prompt (finite, not silent, 0.5-30 s). Each model keeps its
results for the last ``clip_cache_size`` distinct clips (parameter, default 256): every BLS
instance asks these shared models, so a voice reused across requests is computed once.
Metrics: ``cosyserve_clip_cache_hits_total``, ``cosyserve_clip_cache_misses_total``.
"""

from __future__ import annotations

import numpy as np

from ..audio.io import TOKENIZER_SAMPLE_RATE, validate_waveform
from ..clip_cache import ClipCache
from ..frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from ..llm.prompt import SPEECH_TOKEN_OFFSET
from .settings import FrontendSettings
from .triton_utils import Metric, limit_torch_threads, model_settings, reference_wav, respond_each, tensor


class _FrontendModel:
    """One ONNX wrapper, one request at a time; subclasses define ``_run(request) -> tensors``."""

    def __init__(self, config: dict, onnx_file: str, wrapper):
        settings = model_settings(config, FrontendSettings)
        # onnxruntime runs the model on its own thread; torch only checks audio
        limit_torch_threads(settings.torch_threads)
        providers = None if settings.torch_device().type == "cuda" else ["CPUExecutionProvider"]
        self.onnx_model = wrapper(settings.model_dir / onnx_file, providers)
        self.cache: ClipCache[np.ndarray] = ClipCache(settings.clip_cache_size)
        self.cache_lookups = {outcome: Metric(f"cosyserve_clip_cache_{outcome}_total",
                                              f"reference clips found ({outcome}) in the model's clip cache",
                                              config["name"], kind="counter") for outcome in ("hits", "misses")}
        self._counted = {"hits": 0, "misses": 0}

    def execute(self, requests) -> list:
        responses = respond_each(requests, self._run)
        for outcome, metric in self.cache_lookups.items():
            total = getattr(self.cache, outcome)
            metric.increment(total - self._counted[outcome])
            self._counted[outcome] = total
        return responses

    def close(self) -> None:
        """Nothing to release (the ONNX session goes with the process)."""


def _prompt_wav(request):
    return validate_waveform(reference_wav(request), TOKENIZER_SAMPLE_RATE)


class AudioTokenizerModel(_FrontendModel):
    ONNX_FILE = "speech_tokenizer_v2.onnx"
    TOKEN_OFFSET = SPEECH_TOKEN_OFFSET  # added to the codes on the wire

    def __init__(self, config: dict):
        super().__init__(config, self.ONNX_FILE, SpeechTokenizer)

    def _run(self, request) -> list:
        wav = _prompt_wav(request)
        tokens = self.cache.get_or_compute(
            wav, lambda: self.onnx_model.tokenize(wav).numpy().astype(np.int32) + self.TOKEN_OFFSET)
        return [tensor("prompt_speech_tokens", tokens)]


class AudioTokenizerV3Model(AudioTokenizerModel):
    ONNX_FILE = "speech_tokenizer_v3.onnx"
    TOKEN_OFFSET = 0


class SpeakerEmbeddingModel(_FrontendModel):
    def __init__(self, config: dict):
        super().__init__(config, "campplus.onnx", SpeakerEncoder)

    def _run(self, request) -> list:
        wav = _prompt_wav(request)
        embedding = self.cache.get_or_compute(wav, lambda: self.onnx_model.embed(wav).numpy().astype(np.float16))
        return [tensor("prompt_spk_embedding", embedding)]
