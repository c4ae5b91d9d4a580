"""In-process back ends of :class:`~cosyserve.pipeline.tts.TTSPipeline`: the package objects
called directly (``offline_inference.py``, tests). The token2wav side is
:class:`~cosyserve.token2wav.sessions.LocalToken2Wav`.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from ..frontend.torch_models import load_frontend_models
from ..frontend.speakers import SpeakerRegistry
from ..llm.prompt import register_voice_prefixes
from ..llm.sampling import REFERENCE_SAMPLING, SamplingParams
from ..runtime import COSYVOICE2_DIR, LLM_DIR, SPK2INFO, resolve_device
from ..token2wav.cosyvoice2 import default_flow_dtype, load_token2wav
from ..token2wav.sessions import LocalToken2Wav
from .tts import DEFAULT_SPEAKER, TokenLimits, TTSPipeline, TTSRequest, VoiceResolver


class LocalSpeechTokens:
    """:class:`~cosyserve.pipeline.tts.SpeechTokenSource` over a ``cosyserve.llm`` backend."""

    def __init__(self, backend, sampling: SamplingParams = REFERENCE_SAMPLING):
        self.backend = backend
        self.sampling = sampling

    def generate(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> Iterator[Sequence[int]]:
        params = dataclasses.replace(self.sampling, max_tokens=limits.max_tokens, min_tokens=limits.min_tokens)
        stream = self.backend.generate_stream(prompt_ids, params, request_id)  # bad prompts raise here
        return _one_token_pieces(stream)

    def cancel(self, request_id: str) -> None:
        self.backend.cancel(request_id)


def _one_token_pieces(stream) -> Iterator[Sequence[int]]:
    with stream:  # leaving early cancels the request
        for token in stream:
            yield (token,)


@dataclass
class LocalTTS:
    """Everything needed to synthesise in this process; :meth:`request` builds a :class:`TTSRequest`."""

    pipeline: TTSPipeline
    voices: VoiceResolver
    llm_backend: object
    token2wav: LocalToken2Wav

    def request(self, target_text: str, *, reference_wav16=None, reference_text: str | None = None,
                speaker_id: str | None = None, limits: TokenLimits = TokenLimits(),
                request_id: str | None = None, text_frontend: bool = True) -> TTSRequest:
        voice = self.voices.resolve(reference_wav16, reference_text, speaker_id)
        return TTSRequest(request_id or uuid.uuid4().hex, target_text, voice, limits, text_frontend)

    def close(self) -> None:
        self.token2wav.model.close_all()
        self.llm_backend.close()


def load_local_tts(models_dir: str | Path, device: str = "auto", *, llm_backend: str = "torch",
                   strategy: str = "exponential", sampling: SamplingParams = REFERENCE_SAMPLING,
                   llm_options: dict | None = None, frontend_backend: str | None = None) -> LocalTTS:
    """Load the bundle layout ``<models_dir>/{CosyVoice2-0.5B, cosyvoice2_llm}`` on ``device``.

    fp32 on CPU; on CUDA the flow and HiFT's network run in fp16 and the LLM in bf16.
    ``frontend_backend``: the speech tokenizer's and CAM++'s (torch / onnxruntime; default torch on
    CUDA, onnxruntime on the CPU).
    """
    from transformers import AutoTokenizer

    from ..llm.backends import create_backend

    models_dir = Path(models_dir)
    model_dir, llm_dir = models_dir / COSYVOICE2_DIR, models_dir / LLM_DIR
    device = resolve_device(device)
    text_tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    registry = SpeakerRegistry.load(model_dir / SPK2INFO)
    tokenizer, speaker_encoder = load_frontend_models(model_dir / "speech_tokenizer_v2.onnx",
                                                      model_dir / "campplus.onnx", device, frontend_backend)
    voices = VoiceResolver(registry, tokenizer, speaker_encoder, default_speaker=DEFAULT_SPEAKER)
    token2wav = LocalToken2Wav(load_token2wav(model_dir, device, default_flow_dtype(device)))
    backend = create_backend(llm_backend, llm_dir, device, None, **(llm_options or {}))
    register_voice_prefixes(backend, text_tokenizer, registry)
    pipeline = TTSPipeline(text_tokenizer, LocalSpeechTokens(backend, sampling), token2wav, strategy=strategy)
    return LocalTTS(pipeline, voices, backend, token2wav)
