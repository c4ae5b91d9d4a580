"""Audio input and front-end features in plain torch (torchaudio is not a dependency).

``io``: decoding, validation and resampling of prompt audio (:class:`PromptAudio`).
``features``: resampling, the 24 kHz prompt mel, Kaldi fbank (CAM++) and Whisper log-mel
(speech tokenizer), each matching the reference implementation used upstream.
"""

from .features import (
    campplus_features,
    kaldi_fbank,
    kaldi_frame_count,
    matcha_mel_spectrogram,
    resample,
    slaney_mel_filters,
    whisper_log_mel,
)
from .io import PromptAudio, load_prompt_audio, prompt_audio_from_array, read_audio, validate_waveform

__all__ = [
    "PromptAudio",
    "campplus_features",
    "kaldi_fbank",
    "kaldi_frame_count",
    "load_prompt_audio",
    "matcha_mel_spectrogram",
    "prompt_audio_from_array",
    "read_audio",
    "resample",
    "slaney_mel_filters",
    "validate_waveform",
    "whisper_log_mel",
]
