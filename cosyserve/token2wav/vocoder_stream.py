"""Streaming HiFT vocoding with overlapping chunks (the Triton token2wav / token2wav_dit scheme).

HiFT is not causal, so each chunk is vocoded together with the last ``mel_cache_frames`` (8) mel
frames of the previous chunk; the excitation of those frames is reused (pasted over the new
excitation) so the harmonic phase continues, and the overlapping 8·480 = 3840 output samples are
cross-faded with a symmetric Hamming window of twice that length. The overlap of a non-final
chunk is withheld until the next chunk has faded into it. The fade is not gain-neutral (the two
window halves sum to ≈1.08), exactly like the reference; it is evaluated in float64.

The class knows nothing about the mel producer, so the CosyVoice2 and Step-Audio2 flows share it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import InvalidInputError
from ..models.hift import HiFTGenerator

MEL_CACHE_FRAMES = 8

# Given the sample count L of a HiFT call, returns the harmonic-source noise (1, L, H) to inject
# instead of drawing it (zero-noise tests, recorded noise). See HiFTGenerator.inference.
SineNoiseProvider = Callable[[int], torch.Tensor]


@functools.lru_cache(maxsize=8)
def hamming_fade_window(overlap: int, device: torch.device) -> torch.Tensor:
    """Symmetric Hamming window of length 2·overlap in float64: first half fades in, second fades out."""
    return torch.hamming_window(2 * overlap, periodic=False, dtype=torch.float64, device=device)


def crossfade(new: torch.Tensor, old_tail: torch.Tensor) -> torch.Tensor:
    """Blend the last ``n`` samples of the previous chunk into the first ``n`` of ``new`` (n = old_tail length).

    new[:n] = new[:n]·w[:n] + old_tail·w[n:], w = symmetric Hamming(2n), computed in float64 and
    rounded back to ``new``'s dtype. Returns a new tensor.
    """
    n = old_tail.shape[-1]
    window = hamming_fade_window(n, new.device)
    out = new.clone()
    blended = new[..., :n].double() * window[:n] + old_tail.double() * window[n:]
    out[..., :n] = blended.to(new.dtype)
    return out


@dataclass
class VocoderCall:
    """The HiFT call of one streaming chunk (see :meth:`HiftStream.prepare`)."""

    mel_in: torch.Tensor  # (1, 80, F) cached mel frames followed by the new frames
    cache_source: torch.Tensor | None  # (1, 1, C) excitation of the cached frames, or None
    finalize: bool
    hop_length: int
    needed: bool  # False: nothing new to voice and nothing withheld to flush, so no HiFT call

    @property
    def samples(self) -> int:
        return self.mel_in.shape[2] * self.hop_length


@dataclass
class VocoderChunk:
    """One streaming HiFT call: what it saw, what it made, what was emitted."""

    mel_in: torch.Tensor  # (1, 80, F) cached mel frames followed by the new frames
    source: torch.Tensor  # (1, 1, hop·F) excitation used (cached part pasted in)
    raw_speech: torch.Tensor  # (1, hop·F) HiFT output before the cross-fade
    audio: torch.Tensor  # (1, S) float32 samples emitted by this call


class HiftStream:
    """Per-request HiFT state: cached mel frames, excitation and withheld output samples.

    Feed consecutive mel chunks with :meth:`push`; concatenating the returned audio gives the
    stream's waveform (hop samples per mel frame in total). After the final chunk, or after
    :meth:`close`, the caches are released.
    """

    def __init__(self, hift: HiFTGenerator, *, generator: torch.Generator | None = None,
                 sine_noise: SineNoiseProvider | None = None, mel_cache_frames: int = MEL_CACHE_FRAMES):
        self.hift = hift
        self.generator = generator
        self.sine_noise = sine_noise
        self.mel_cache_frames = mel_cache_frames
        self.overlap_samples = mel_cache_frames * hift.hop_length
        self._mel: torch.Tensor | None = None
        self._source: torch.Tensor | None = None
        self._speech_tail: torch.Tensor | None = None
        self.finished = False

    @property
    def has_cache(self) -> bool:
        return self._mel is not None

    def close(self) -> None:
        """Release the caches (idempotent)."""
        self._mel = self._source = self._speech_tail = None
        self.finished = True

    @torch.inference_mode()
    def push(self, mel: torch.Tensor, *, finalize: bool) -> VocoderChunk:
        """Vocode the next mel chunk (1, 80, F); ``finalize`` marks the last one."""
        call = self.prepare(mel, finalize=finalize)
        if not call.needed:
            return self.complete(call, None, None)
        sine_noise = self.sine_noise(call.samples) if self.sine_noise else None
        raw_speech, source = self.hift.inference(call.mel_in, call.cache_source, self.generator, sine_noise)
        return self.complete(call, raw_speech, source)

    @torch.inference_mode()
    def prepare(self, mel: torch.Tensor, *, finalize: bool) -> VocoderCall:
        """The HiFT call the next chunk needs (no state change); run it, then :meth:`complete`.

        Split from :meth:`push` so that a batcher can run the calls of many streams together.
        """
        if self.finished:
            raise InvalidInputError("this vocoder stream is finished; open a new one")
        if mel.dim() != 3 or mel.shape[0] != 1:
            raise InvalidInputError(f"streaming vocoder expects a mel of shape (1, 80, F), got {tuple(mel.shape)}")
        mel_in = torch.cat([self._mel.to(mel), mel], dim=2) if self._mel is not None else mel
        needed = not (mel.shape[2] == 0 and (not finalize or mel_in.shape[2] == 0))
        return VocoderCall(mel_in, self._source, finalize, self.hift.hop_length, needed)

    @torch.inference_mode()
    def complete(self, call: VocoderCall, raw_speech: torch.Tensor | None,
                 source: torch.Tensor | None) -> VocoderChunk:
        """Take the HiFT output of ``call`` (None when not ``call.needed``): cross-fade, cache, emit."""
        if not call.needed:
            # Nothing new to voice (and nothing withheld to flush): no HiFT call, state unchanged.
            empty = call.mel_in.new_zeros(1, 0, dtype=torch.float32)
            if call.finalize:
                self.close()
            return VocoderChunk(call.mel_in, call.mel_in.new_zeros(1, 1, 0), empty, empty)
        speech = crossfade(raw_speech, self._speech_tail) if self._speech_tail is not None else raw_speech
        if call.finalize:
            self.close()
            audio = speech
        else:
            self._mel = call.mel_in[:, :, -self.mel_cache_frames:]
            self._source = source[:, :, -self.overlap_samples:]
            self._speech_tail = speech[:, -self.overlap_samples:]
            audio = speech[:, : max(speech.shape[1] - self.overlap_samples, 0)]
        return VocoderChunk(call.mel_in, source, raw_speech, audio)
