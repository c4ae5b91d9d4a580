"""Zero-shot prompt features: speech tokens, prompt mel and speaker embedding of a reference clip.

Glue of the reference (fixture README §7, llm_layout.md §3): the flow needs exactly two mel
frames per prompt token (25 tokens/s vs 50 mel frames/s), so both are cut to
``token_len = min(mel_frames // 2, n_tokens)``: the first ``token_len`` tokens and the first
``2 * token_len`` mel frames. The LLM prompt uses the same trimmed tokens.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..audio.features import TOKENIZER_SAMPLE_RATE, matcha_mel_spectrogram, resample
from ..audio.io import PromptAudio
from ..errors import InvalidInputError
from ..runtime import bucket, device_to_host, host_to_device
from ..schedule import OUTPUT_SAMPLE_RATE
from .graphs import GRAPH_SECONDS
from .onnx_models import SpeakerEncoder, SpeechTokenizer
from .torch_models import TorchSpeakerEncoder, TorchSpeechTokenizer

TOKEN_MEL_RATIO = 2  # mel frames per speech token
MEL_HOP = 480  # the prompt mel's hop at 24 kHz (50 frames a second)


@dataclass(frozen=True)
class PromptFeatures:
    """What a cached speaker or a reference clip contributes to a request (CPU tensors)."""

    speech_tokens: torch.Tensor  # int32 (P,), ids in [0, 6561)
    speech_feat: torch.Tensor  # float32 (2P, 80), 24 kHz log-mel, time-major as the flow takes it
    embedding: torch.Tensor  # float32 (192,), raw CAM++ output

    def key(self) -> str:
        """What identifies the voice to token2wav: a digest of its content (shapes and values), so
        that two clips with one transcript never collide. Every kind keys its kept voice state by it.
        Computed once per object (the engine's loop asks at a request's arrival and at its first chunk)."""
        key = self.__dict__.get("_key")
        if key is None:
            key = voice_key(self.speech_tokens, self.speech_feat, self.embedding)
            object.__setattr__(self, "_key", key)  # frozen, and its tensors are never changed in place
        return key


def voice_key(speech_tokens: torch.Tensor, speech_feat: torch.Tensor, embedding: torch.Tensor) -> str:
    """:meth:`PromptFeatures.key` of these tensors (any device, any batch shape: values are what count)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (speech_tokens.to(torch.long), speech_feat.float(), embedding.float()):
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Voice:
    """Who speaks: the prompt the LLM continues and the features token2wav is conditioned on.

    ``features`` holds raw speech tokens 0..6560, the prompt mel (2P, 80) and the speaker
    embedding (192,). ``speaker_id`` names a registered voice (spk2info.pt) or a stored one
    (:class:`~cosyserve.frontend.voice_store.VoiceStore`); it lets back ends reuse what they cache
    per voice (LLM prefix, default speaker inside token2wav). ``cross_lingual``: the voice has no
    transcript, so the LLM prompt carries neither prompt text nor prompt speech tokens
    (CosyVoice2's cross-lingual mode); token2wav still uses the features. ``reference_wav16``: the
    16 kHz clip a zero-shot voice was made from, as the request sent it; a token2wav that derives
    its own prompt from the clip (Step-Audio2's) is sent that.
    """

    prompt_text: str
    features: PromptFeatures
    speaker_id: str | None = None
    cross_lingual: bool = False
    reference_wav16: np.ndarray | None = field(default=None, compare=False, repr=False)


COSYVOICE2_MEL_FMAX = 8000.0
COSYVOICE3_MEL_FMAX = None  # cosyvoice3.yaml: fmax null, the Nyquist frequency (12 kHz)


def prompt_mel(wav24: torch.Tensor, fmax: float | None = COSYVOICE2_MEL_FMAX, min_frames: int = 0) -> torch.Tensor:
    """24 kHz prompt waveform ``(N,)`` -> log-mel ``(N // 480, 80)`` (time-major); ``fmax`` None: Nyquist.
    ``min_frames``: :func:`~cosyserve.audio.features.matcha_mel_spectrogram`'s."""
    return matcha_mel_spectrogram(wav24, fmax=fmax, min_frames=min_frames).transpose(0, 1).contiguous()


def device_prompt_mel(audio: PromptAudio, device: torch.device, fmax: float | None) -> torch.Tensor:
    """:func:`prompt_mel` of a prompt on ``device`` (resampled to 24 kHz there), its STFT over the
    frames of the prompt's seconds bucket (:data:`~.graphs.GRAPH_SECONDS`): a few FFT plans in all,
    made at load by :func:`warm_device_prompt_mel`, not one per new clip length."""
    seconds = bucket(-(-audio.source.numel() // audio.source_rate), GRAPH_SECONDS) or GRAPH_SECONDS[-1]
    wav24 = resample(host_to_device(audio.source, device), audio.source_rate, OUTPUT_SAMPLE_RATE)
    return prompt_mel(wav24, fmax, min_frames=seconds * OUTPUT_SAMPLE_RATE // MEL_HOP)


def warm_device_prompt_mel(device: torch.device, fmax: float | None) -> None:
    """Run :func:`device_prompt_mel` once per seconds bucket (its resampling kernel, mel filters and
    FFT plans made now, on the current stream)."""
    for seconds in GRAPH_SECONDS:
        wav = torch.full((seconds * TOKENIZER_SAMPLE_RATE,), 0.1)
        device_prompt_mel(PromptAudio(wav, wav, TOKENIZER_SAMPLE_RATE), device, fmax)


def trim_to_token_rate(speech_tokens: torch.Tensor, speech_feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut tokens ``(n,)`` and mel ``(T, 80)`` to ``P = min(T // 2, n)`` tokens and ``2P`` frames."""
    token_len = min(speech_feat.shape[0] // TOKEN_MEL_RATIO, speech_tokens.numel())
    if token_len == 0:
        raise InvalidInputError(f"prompt audio yields {speech_tokens.numel()} speech tokens and "
                                f"{speech_feat.shape[0]} mel frames; too short to condition the voice")
    return speech_tokens[:token_len], speech_feat[:TOKEN_MEL_RATIO * token_len]


def _voice_features(tokens: torch.Tensor, mel: torch.Tensor, embedding: torch.Tensor) -> PromptFeatures:
    tokens, feat = trim_to_token_rate(tokens, device_to_host(mel).clone())  # not kept in pinned memory
    return PromptFeatures(speech_tokens=tokens.to(torch.int32), speech_feat=feat, embedding=embedding)


def build_prompt_features(prompt_audio: PromptAudio, tokenizer, speaker_encoder,
                          mel_fmax: float | None = COSYVOICE2_MEL_FMAX) -> PromptFeatures:
    """Run the speech tokenizer (``tokenize``), the prompt mel and the speaker encoder (``embed``) on
    a validated prompt (``mel_fmax``: the model's prompt-mel band edge, :data:`COSYVOICE3_MEL_FMAX`
    for CosyVoice3). Any object with those methods serves (local models, remote Triton models)."""
    return _voice_features(tokenizer.tokenize(prompt_audio.wav16), prompt_mel(prompt_audio.wav24, mel_fmax),
                           speaker_encoder.embed(prompt_audio.wav16))


def build_prompt_features_batch(prompt_audios: Sequence[PromptAudio],
                                tokenizer: SpeechTokenizer | TorchSpeechTokenizer,
                                speaker_encoder: SpeakerEncoder | TorchSpeakerEncoder,
                                mel_fmax: float | None = COSYVOICE2_MEL_FMAX, *, device: torch.device | None = None,
                                stream: torch.cuda.Stream | None = None) -> list[PromptFeatures]:
    """:func:`build_prompt_features` of several prompts, the tokenizer and the speaker encoder each
    called once for all of them (``start_batch``: one batch on the device with the PyTorch back
    end). ``device`` (and ``stream``, on CUDA): where the prompt mels are computed
    (None: the CPU). On a device the three are launched (each model on its stream) before any
    result is waited for, so that they overlap."""
    wavs16 = [audio.wav16 for audio in prompt_audios]
    tokens_done, embeddings_done = tokenizer.start_batch(wavs16), speaker_encoder.start_batch(wavs16)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        mels = [prompt_mel(audio.wav24, mel_fmax) if device is None else device_prompt_mel(audio, device, mel_fmax)
                for audio in prompt_audios]
        return [_voice_features(audio_tokens, mel, embedding)
                for audio_tokens, mel, embedding in zip(tokens_done(), mels, embeddings_done())]
