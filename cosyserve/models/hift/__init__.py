"""CosyVoice2 HiFT vocoder: mel (B, 80, T) → 24 kHz waveform (B, 480·T)."""

from .config import HiftConfig
from .generator import HiFTGenerator
from .loading import load_hift, load_hift_state_dict, normalise_hift_keys
from .source import SourceNoise, draw_source_noise

__all__ = [
    "HiftConfig",
    "HiFTGenerator",
    "SourceNoise",
    "draw_source_noise",
    "load_hift",
    "load_hift_state_dict",
    "normalise_hift_keys",
]
