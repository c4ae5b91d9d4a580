"""The ``audio_tokenizer`` and ``speaker_embedding`` Triton models over the front-end models.

* ``audio_tokenizer``: ``reference_wav`` FP32 [-1] (16 kHz) + optional ``reference_wav_len``
  INT32 [1] -> ``prompt_speech_tokens`` INT32 [-1], LLM ids (speech token + 151663).
* ``speaker_embedding``: ``reference_wav`` FP32 [-1] (+ optional length) ->
  ``prompt_spk_embedding`` FP16 [-1] (192 values, the raw CAM++ x-vector).

Audio is validated like any prompt (finite, not silent, 0.5-30 s). Each model keeps its
results for the last ``clip_cache_size`` distinct clips (parameter, default 256): every caller
asks these shared models, so a voice reused across requests is computed once. The
clips of one ``execute`` (Triton's dynamic batching) that miss the cache run as one batch.
``frontend_backend`` (parameter): ``torch`` (the PyTorch models, batched on the model's device;
the default on CUDA) or ``onnxruntime`` (the released graphs, one clip at a time; the default on
the CPU); :func:`~cosyserve.frontend.torch_models.frontend_backend`.
Metrics: ``cosyserve_clip_cache_hits_total``, ``cosyserve_clip_cache_misses_total``.
"""

from __future__ import annotations

import numpy as np

from ..audio.io import TOKENIZER_SAMPLE_RATE, validate_waveform
from ..clip_cache import ClipCache
from ..frontend.torch_models import load_speaker_encoder, load_speech_tokenizer
from ..llm.prompt import SPEECH_TOKEN_OFFSET
from .settings import FrontendSettings
from .triton_utils import Metric, limit_torch_threads, model_settings, reference_wav, respond_batch, tensor


class _FrontendModel:
    """One front-end model; subclasses define ``_compute(clips) -> [output array]`` and ``OUTPUT``."""

    OUTPUT = ""

    def __init__(self, config: dict, onnx_file: str, loader):
        settings = model_settings(config, FrontendSettings)
        # onnxruntime runs the model on its own thread; torch checks audio (and runs the torch back end)
        limit_torch_threads(settings.torch_threads)
        self.model = loader(settings.model_dir / onnx_file, settings.torch_device(), settings.frontend_backend)
        if hasattr(self.model, "capture_all"):  # the PyTorch back end's graphs, before the model is ready
            self.model.capture_all()
        self.cache: ClipCache[np.ndarray] = ClipCache(settings.clip_cache_size)
        self.cache_lookups = {outcome: Metric(f"cosyserve_clip_cache_{outcome}_total",
                                              f"reference clips found ({outcome}) in the model's clip cache",
                                              config["name"], kind="counter") for outcome in ("hits", "misses")}
        self._counted = {"hits": 0, "misses": 0}

    def execute(self, requests) -> list:
        responses = respond_batch(requests, _prompt_wav, self._run_batch)
        for outcome, metric in self.cache_lookups.items():
            total = getattr(self.cache, outcome)
            metric.increment(total - self._counted[outcome])
            self._counted[outcome] = total
        return responses

    def _run_batch(self, wavs: list) -> list:
        return [[tensor(self.OUTPUT, value)] for value in self.cache.get_or_compute_batch(wavs, self._compute)]

    def close(self) -> None:
        """Nothing to release (the model goes with the process)."""


def _prompt_wav(request):
    return validate_waveform(reference_wav(request), TOKENIZER_SAMPLE_RATE)


class AudioTokenizerModel(_FrontendModel):
    ONNX_FILE = "speech_tokenizer_v2.onnx"
    TOKEN_OFFSET = SPEECH_TOKEN_OFFSET  # added to the codes on the wire
    OUTPUT = "prompt_speech_tokens"

    def __init__(self, config: dict):
        super().__init__(config, self.ONNX_FILE, load_speech_tokenizer)

    def _compute(self, wavs: list) -> list[np.ndarray]:
        return [tokens.numpy().astype(np.int32) + self.TOKEN_OFFSET for tokens in self.model.tokenize_batch(wavs)]


class SpeakerEmbeddingModel(_FrontendModel):
    OUTPUT = "prompt_spk_embedding"

    def __init__(self, config: dict):
        super().__init__(config, "campplus.onnx", load_speaker_encoder)

    def _compute(self, wavs: list) -> list[np.ndarray]:
        return [embedding.numpy().astype(np.float16) for embedding in self.model.embed_batch(wavs)]
