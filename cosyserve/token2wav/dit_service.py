"""The DiT token2wav as a service: speakers from reference clips or spk2info.pt, streams by request id.

This is what the ``token2wav_dit`` Triton model runs (``cosyserve.serving.token2wav_dit_model``)
and what the scripts call in-process; the pipeline reaches it (or its Triton model, through the
same calls) as a token2wav kind (:mod:`cosyserve.pipeline.dit`). It adds to :class:`~cosyserve.token2wav.dit.DitToken2Wav`:

* **speakers**: a 16 kHz reference clip (keyed, like the reference runtime, by the SHA-256 of its
  float32 samples) or a voice of ``spk2info.pt`` (keyed by its id) becomes a
  :class:`~cosyserve.token2wav.dit.SpeakerPrompt`: S3 tokens (``speech_tokenizer_v2_25hz.onnx``),
  24 kHz prompt mel and CAM++ embedding (``campplus.onnx``), cut to two mel frames per token.
  Offline and streaming use that same aligned prompt, so every speech token yields exactly 960
  output samples in both. The prompts of the last ``max_speakers`` speakers are kept.
* **streams**: opened by a request's first chunk (which must name the speaker), closed after its
  final chunk, on :meth:`cancel`, on any error, or when idle for ``idle_timeout_s`` (a caller
  that vanished mid-stream).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..audio.io import TOKENIZER_SAMPLE_RATE, prompt_audio_from_array
from ..errors import InvalidInputError
from ..frontend import SpeakerEncoder, SpeakerRegistry, SpeechTokenizer, build_prompt_features
from ..runtime import STREAM_IDLE_TIMEOUT_S, resolve_device
from .cosyvoice2 import default_flow_dtype
from .dit import (DEFAULT_MAX_SPEAKERS, DitToken2Wav, OfflineRequest, SpeakerPrompt, load_dit_token2wav,
                             speaker_key)
from .sessions import SessionClock

DIT_TOKENIZER_ONNX = "speech_tokenizer_v2_25hz.onnx"
DIT_SPEAKER_ONNX = "campplus.onnx"


@dataclass(frozen=True, eq=False)
class SpeakerRef:
    """Who speaks: a 16 kHz reference clip or the id of a spk2info.pt voice (exactly one)."""

    wav16: np.ndarray | None = None
    speaker_id: str | None = None

    def __post_init__(self) -> None:
        if (self.wav16 is None) == (not self.speaker_id):
            raise InvalidInputError("name the speaker with either a reference clip (reference_wav) or a speaker_id")

    @property
    def key(self) -> str:
        if self.speaker_id:
            return f"spk2info:{self.speaker_id}"
        return speaker_key(torch.from_numpy(np.ascontiguousarray(self.wav16, dtype=np.float32)))


class DitToken2WavService:
    """Raw speech tokens (0..6560) -> 24 kHz float32 waveforms, offline or as streams keyed by request id."""

    def __init__(self, model: DitToken2Wav, tokenizer: SpeechTokenizer, speaker_encoder: SpeakerEncoder,
                 registry: SpeakerRegistry | None = None, idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S):
        self.model = model
        self.tokenizer = tokenizer
        self.speaker_encoder = speaker_encoder
        self.registry = registry
        self.idle_timeout_s = idle_timeout_s
        self._prompts: OrderedDict[str, SpeakerPrompt] = OrderedDict()
        self._clock = SessionClock()
        self._lock = threading.Lock()  # guards _prompts

    @property
    def open_stream_ids(self) -> list[str]:
        return self.model.open_stream_ids

    @property
    def cached_speakers(self) -> list[str]:
        return self.model.cached_speakers

    # ---- speakers -----------------------------------------------------------------------------
    def prompt(self, speaker: SpeakerRef) -> tuple[str, SpeakerPrompt]:
        """(cache key, aligned prompt) of ``speaker``; computed on first sight, then cached."""
        key = speaker.key
        with self._lock:
            if key in self._prompts:
                self._prompts.move_to_end(key)
                return key, self._prompts[key]
        if speaker.speaker_id:
            if self.registry is None:
                raise InvalidInputError("this token2wav_dit has no spk2info.pt; "
                                        "send reference_wav instead of speaker_id")
            features = self.registry.get(speaker.speaker_id).features
        else:
            audio = prompt_audio_from_array(speaker.wav16, TOKENIZER_SAMPLE_RATE)
            features = build_prompt_features(audio, self.tokenizer, self.speaker_encoder)
        prompt = SpeakerPrompt(features.speech_tokens, features.speech_feat, features.embedding)
        with self._lock:
            self._prompts[key] = prompt
            while len(self._prompts) > self.model.max_speakers:
                self._prompts.popitem(last=False)
        return key, prompt

    # ---- offline ------------------------------------------------------------------------------
    def offline(self, tokens: Sequence[int], speaker: SpeakerRef) -> np.ndarray:
        """The whole waveform for ``tokens`` in one flow + HiFT pass."""
        _, prompt = self.prompt(speaker)
        request = OfflineRequest(torch.as_tensor(list(tokens), dtype=torch.long), prompt)
        return self.model.offline([request])[0].numpy()

    # ---- streams ------------------------------------------------------------------------------
    def step(self, request_id: str, tokens: Sequence[int], speaker: SpeakerRef | None, finalize: bool) -> np.ndarray:
        """Voice the next chunk of stream ``request_id``: its new tokens plus 3 look-ahead tokens, or
        the remaining tokens with ``finalize``. ``speaker`` is needed to open the stream (first chunk)
        and ignored afterwards."""
        self.close_idle()
        if not request_id:
            raise InvalidInputError("a token2wav_dit stream needs a request id to key its caches")
        if request_id in self.model.open_stream_ids:
            stream = self.model.get_stream(request_id)
        else:
            if speaker is None:
                raise InvalidInputError(f"no open stream for request id {request_id!r}: its first chunk must name "
                                        "the speaker (reference_wav or speaker_id)")
            key, prompt = self.prompt(speaker)
            stream = self.model.open_stream(request_id, key, prompt)
        try:
            return stream.step(list(tokens), finalize).numpy()
        finally:  # the stream closes itself after its final chunk and on errors
            self._clock.stepped(request_id, stream.closed)

    def cancel(self, request_id: str) -> bool:
        """Close stream ``request_id``; False if none was open."""
        self._clock.forget(request_id)
        if request_id not in self.model.open_stream_ids:
            return False
        try:
            self.model.get_stream(request_id).close()
        except InvalidInputError:  # closed meanwhile
            return False
        return True

    def close_idle(self) -> list[str]:
        """Close the streams without a chunk for ``idle_timeout_s``; returns their ids."""
        stale = self._clock.idle(self.idle_timeout_s)
        for rid in stale:
            self.cancel(rid)
        return stale

    def close(self) -> None:
        self.model.close()
        with self._lock:
            self._prompts.clear()
        self._clock.clear()


def load_dit_service(model_dir: str | Path, device: str | torch.device = "auto", *,
                     spk2info: str | Path | None = None, max_speakers: int = DEFAULT_MAX_SPEAKERS,
                     idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S) -> DitToken2WavService:
    """Load a Step-Audio-2-mini ``token2wav`` directory. On CUDA the flow runs in fp16 (HiFT stays
    fp32), as deployed; fp32 on CPU. ``spk2info`` (a CosyVoice2 ``spk2info.pt``) enables speaker ids."""
    model_dir = Path(model_dir)
    device = resolve_device(device)
    dtype = default_flow_dtype(device)
    providers = None if device.type == "cuda" else ["CPUExecutionProvider"]
    model = load_dit_token2wav(model_dir, device, dtype, max_speakers=max_speakers)
    registry = SpeakerRegistry.load(spk2info) if spk2info else None
    return DitToken2WavService(model, SpeechTokenizer(model_dir / DIT_TOKENIZER_ONNX, providers),
                               SpeakerEncoder(model_dir / DIT_SPEAKER_ONNX), registry, idle_timeout_s)
