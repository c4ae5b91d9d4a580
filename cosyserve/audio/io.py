"""Decoding and validation of prompt (reference) audio.

A prompt is accepted once and then kept at the two rates the models need: 16 kHz for the
speech tokenizer and the speaker encoder, 24 kHz for the flow's prompt mel. Like upstream
(``load_wav``), channels are averaged to mono and sources below 16 kHz are refused rather
than up-sampled. Anything unusable raises :class:`InvalidInputError` saying what was wrong
and what is accepted.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf
import torch

from ..errors import InvalidInputError
from ..schedule import OUTPUT_SAMPLE_RATE
from .features import TOKENIZER_SAMPLE_RATE, resample

MIN_SOURCE_SAMPLE_RATE = TOKENIZER_SAMPLE_RATE  # a lower rate would reach the tokenizer up-sampled
MIN_PROMPT_SECONDS = 0.5
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer's limit
# Peak below -80 dBFS counts as silence: such a prompt carries no voice to clone.
SILENCE_PEAK = 1e-4

AudioSource = str | os.PathLike | bytes | BinaryIO


@dataclass(frozen=True)
class PromptAudio:
    """A validated mono prompt (1-D float32 CPU tensors): at 16 kHz, and its source, from which the
    24 kHz copy is resampled where it is needed (:attr:`wav24` here; a GPU front end resamples on
    its device, off the caller's CPU)."""

    wav16: torch.Tensor  # (N16,) at 16 kHz
    source: torch.Tensor  # (N,) as validated, at source_rate (wav16 itself for a 16 kHz source)
    source_rate: int

    @property
    def wav24(self) -> torch.Tensor:
        """(N24,) at 24 kHz, resampled from the source."""
        return resample(self.source, self.source_rate, OUTPUT_SAMPLE_RATE)

    @property
    def duration_s(self) -> float:
        return self.wav16.numel() / TOKENIZER_SAMPLE_RATE


def read_audio(source: AudioSource) -> tuple[torch.Tensor, int]:
    """Decode a file (path, bytes or binary file object) with soundfile -> (mono (N,) float32, rate).

    Any format libsndfile reads is accepted (WAV, FLAC, OGG/Vorbis, Opus, MP3 with libsndfile
    >= 1.1, ...). Files longer than :data:`MAX_PROMPT_SECONDS` are refused before decoding.
    """
    if isinstance(source, (str, os.PathLike)) and not Path(source).is_file():
        raise InvalidInputError(f"audio file {os.fspath(source)!r} does not exist")
    handle = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        with sf.SoundFile(handle) as audio_file:
            rate = audio_file.samplerate
            if audio_file.frames > 0 and audio_file.frames / rate > MAX_PROMPT_SECONDS:
                raise InvalidInputError(f"prompt audio is {audio_file.frames / rate:.2f} s long; "
                                        f"at most {MAX_PROMPT_SECONDS:g} s is accepted")
            data = audio_file.read(dtype="float32", always_2d=True)  # (frames, channels)
    except (sf.SoundFileError, RuntimeError, TypeError) as exc:
        raise InvalidInputError(
            f"could not decode prompt audio ({exc}); send a file soundfile/libsndfile can read "
            "(WAV, FLAC, OGG, ...)") from exc
    return torch.from_numpy(np.ascontiguousarray(data.mean(axis=1))), rate


def _to_mono(wav: np.ndarray | torch.Tensor) -> torch.Tensor:
    wav = torch.as_tensor(wav)
    if not (wav.is_floating_point() and wav.dim() in (1, 2)):
        raise InvalidInputError(
            f"prompt audio must be a float waveform of shape (samples,) or (channels, samples); "
            f"got dtype {wav.dtype} shape {tuple(wav.shape)}")
    if wav.dim() == 2 and wav.shape[0] > wav.shape[1]:
        raise InvalidInputError(f"prompt audio of shape {tuple(wav.shape)} looks like (samples, channels); "
                                "pass (channels, samples)")
    wav = wav.detach().to("cpu", torch.float32)
    return wav.mean(dim=0) if wav.dim() == 2 else wav


def validate_waveform(wav: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Check a prompt waveform and return it as mono float32 ``(N,)``; raises InvalidInputError."""
    wav = _to_mono(wav)
    if wav.numel() == 0:
        raise InvalidInputError("prompt audio is empty")
    # the checks in numpy: torch's CPU reductions wake its thread pool, ~0.5 ms each on a busy server
    samples = wav.numpy()
    if not np.isfinite(samples).all():
        raise InvalidInputError("prompt audio contains NaN or infinite samples")
    if int(sample_rate) != sample_rate or sample_rate < MIN_SOURCE_SAMPLE_RATE:
        raise InvalidInputError(
            f"prompt audio sample rate {sample_rate} Hz is not supported; use an integer rate of at least "
            f"{MIN_SOURCE_SAMPLE_RATE} Hz")
    duration = wav.numel() / sample_rate
    if duration < MIN_PROMPT_SECONDS or duration > MAX_PROMPT_SECONDS:
        raise InvalidInputError(
            f"prompt audio is {duration:.2f} s long; between {MIN_PROMPT_SECONDS:g} s and "
            f"{MAX_PROMPT_SECONDS:g} s is accepted")
    if float(np.abs(samples).max()) < SILENCE_PEAK:
        raise InvalidInputError("prompt audio is silent (peak below -80 dBFS); send a recording of the voice")
    return wav


def prompt_audio_from_array(wav: np.ndarray | torch.Tensor, sample_rate: int) -> PromptAudio:
    """Validate a waveform (``(N,)`` or ``(channels, N)``, any rate >= 16 kHz) and resample it.

    The 24 kHz copy is resampled from the source rate directly (when it is asked for), so a 16 kHz
    source follows the Triton front door's path (16 k -> 24 k) and a file follows
    ``cli/frontend.py`` (source -> 24 k).
    """
    wav = validate_waveform(wav, sample_rate)
    sample_rate = int(sample_rate)
    return PromptAudio(wav16=resample(wav, sample_rate, TOKENIZER_SAMPLE_RATE), source=wav, source_rate=sample_rate)


def load_prompt_audio(source: AudioSource) -> PromptAudio:
    """Decode, validate and resample a prompt audio file."""
    wav, rate = read_audio(source)
    return prompt_audio_from_array(wav, rate)
