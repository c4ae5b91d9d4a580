"""Speech tokens → waveform: CosyVoice2 flow + HiFT, offline and streaming."""

from .cosyvoice2 import CosyVoice2Token2Wav, Token2WavOptions, Token2WavStream, load_token2wav
from .vocoder_stream import MEL_CACHE_FRAMES, HiftStream, SineNoiseProvider, VocoderChunk, crossfade

__all__ = [
    "MEL_CACHE_FRAMES",
    "CosyVoice2Token2Wav",
    "HiftStream",
    "SineNoiseProvider",
    "Token2WavOptions",
    "Token2WavStream",
    "VocoderChunk",
    "crossfade",
    "load_token2wav",
]
