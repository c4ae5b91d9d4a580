"""Audio features and prompt-audio input: reference parity, recipe properties, validation errors."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyserve.audio import (
    campplus_features,
    kaldi_fbank,
    load_prompt_audio,
    matcha_mel_spectrogram,
    prompt_audio_from_array,
    read_audio,
    resample,
    slaney_mel_filters,
    whisper_log_mel,
)
from cosyserve.errors import InvalidInputError
from cosyserve.parity import cv2_frontend

torch.set_num_threads(1)


def tone(seconds: float, rate: int, freq: float = 440.0, amp: float = 0.5) -> torch.Tensor:
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    return (amp * torch.sin(2 * math.pi * freq * t)).to(torch.float32)


# --- parity with the reference --------------------------------------------------------------


def test_frontend_parity_suite(parity_dir: Path):
    fixture_dir = parity_dir / "cosyvoice2"
    if not cv2_frontend.detect(fixture_dir):
        pytest.skip(f"no {cv2_frontend.FEATURES_FILE} in {fixture_dir}")
    results = cv2_frontend.run(fixture_dir)
    failed = [f"{r.case}: max-abs {r.max_abs:.3e} rel {r.rel_l2:.3e} {r.note}" for r in results if not r.passed]
    assert not failed, failed
    cases = {r.case.split("/")[-1] for r in results}
    assert {"resampled_24k", "mel24", "kaldi_fbank", "campplus_input", "whisper_logmel128",
            "matcha_mel_basis", "whisper_mel_128", "wav_file"} <= cases


# --- resampling -----------------------------------------------------------------------------


def naive_sinc_resample(x: torch.Tensor, orig: int, new: int, width: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """The defining sum y[n] = sum_i x[i] h((i - n*orig/new) * cutoff), as a dense float64 matrix."""
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    cutoff = min(orig, new) * rolloff / orig  # in cycles per input sample, times 2
    n_out = -(-x.numel() * new // orig)
    t = (torch.arange(x.numel(), dtype=torch.float64)[None, :]
         - torch.arange(n_out, dtype=torch.float64)[:, None] * orig / new) * cutoff
    t = t.clamp(-width, width)
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(math.pi * t) / (math.pi * t))
    window = torch.cos(math.pi * t / (2 * width)) ** 2
    return (sinc * window * cutoff) @ x.double()


@pytest.mark.parametrize("orig,new", [(16000, 24000), (44100, 16000), (24000, 16000), (22050, 24000), (48000, 16000)])
def test_resample_matches_defining_formula(orig: int, new: int):
    x = torch.randn(997, generator=torch.Generator().manual_seed(orig + new))
    ours = resample(x, orig, new)
    assert ours.shape == (math.ceil(997 * new / orig),) and ours.dtype == torch.float32
    ref = naive_sinc_resample(x, orig, new)
    assert float((ours.double() - ref).norm() / ref.norm()) < 1e-6


def test_resample_keeps_leading_dims_and_identity():
    x = torch.randn(2, 3, 800)
    out = resample(x, 16000, 24000)
    assert out.shape == (2, 3, 1200)
    torch.testing.assert_close(out[1, 2], resample(x[1, 2], 16000, 24000))
    assert torch.equal(resample(x, 16000, 16000), x)
    with pytest.raises(ValueError):
        resample(x, 16000, 0)


def test_resample_preserves_a_tone_and_removes_aliases():
    # 1 kHz survives 44.1k -> 16k; 10 kHz (above the new Nyquist) is filtered out.
    low = resample(tone(1.0, 44100, 1000.0), 44100, 16000)[1000:-1000]
    expected = tone(1.0, 16000, 1000.0)[1000:-1000]
    assert float((low - expected).abs().max()) < 5e-3  # passband ripple of the width-6 Hann sinc
    high = resample(tone(1.0, 44100, 10000.0), 44100, 16000)[1000:-1000]
    assert float(high.abs().max()) < 5e-3  # > 40 dB down from the 0.5 input amplitude


# --- spectral features ----------------------------------------------------------------------


def test_slaney_filters_are_unit_area_triangles():
    filters = slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0)
    assert filters.shape == (80, 961) and filters.dtype == torch.float32
    assert bool((filters >= 0).all())
    # Above 8 kHz nothing is kept; Slaney normalisation gives each filter area ~1 per Hz-width / 2.
    assert float(filters[:, 641:].abs().max()) == 0.0
    hz_per_bin = 24000 / 1920
    areas = filters.double().sum(dim=1) * hz_per_bin
    assert torch.allclose(areas, torch.ones_like(areas), atol=0.05)


def test_feature_frame_counts_and_silence_values():
    wav16 = torch.zeros(16000 + 123)
    wav24 = torch.zeros(24000 + 7)
    fbank = kaldi_fbank(wav16)
    assert fbank.shape == (1 + (wav16.numel() - 400) // 160, 80)
    assert torch.allclose(fbank, torch.full_like(fbank, math.log(torch.finfo(torch.float32).eps)))
    mel = matcha_mel_spectrogram(wav24)
    assert mel.shape == (80, wav24.numel() // 480)
    assert torch.allclose(mel, torch.full_like(mel, math.log(1e-5)))
    assert whisper_log_mel(wav16).shape == (128, wav16.numel() // 160)
    assert kaldi_fbank(torch.zeros(399)).shape == (0, 80)


def test_campplus_features_are_mean_normalised_fbank():
    wav = tone(1.0, 16000, 300.0) + 0.01 * torch.randn(16000, generator=torch.Generator().manual_seed(0))
    feats = campplus_features(wav)
    fbank = kaldi_fbank(wav)
    assert feats.shape == (1, *fbank.shape)
    torch.testing.assert_close(feats[0], fbank - fbank.mean(dim=0))
    assert float(feats.mean(dim=1).abs().max()) < 1e-4


def test_mel_peaks_follow_the_tone_frequency():
    low = matcha_mel_spectrogram(tone(1.0, 24000, 300.0)).mean(dim=1).argmax()
    high = matcha_mel_spectrogram(tone(1.0, 24000, 3000.0)).mean(dim=1).argmax()
    assert int(high) > int(low) + 10


def test_whisper_floor_is_global_over_the_batch():
    loud, quiet = tone(1.0, 16000, amp=0.5), tone(1.0, 16000, amp=1e-6)
    batch = whisper_log_mel(torch.stack([loud, quiet]))
    assert batch.shape == (2, 128, 100)
    floor = (float(batch.max()) * 4 - 4 - 8 + 4) / 4  # (max_log - 8 + 4) / 4 in the output scale
    assert float(batch.min()) == pytest.approx(floor, abs=1e-5)
    # Alone, the quiet item is floored relative to its own (much lower) max.
    assert float(whisper_log_mel(quiet).min()) < float(batch[1].min()) - 0.5


def padded_batch(clips: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([c.numel() for c in clips])
    return torch.stack([torch.nn.functional.pad(c, (0, int(lengths.max()) - c.numel())) for c in clips]), lengths


def test_batched_features_equal_each_clip_alone():
    """Zero-padded batches: Whisper log-mel per clip (own end reflection, own floor), CAM++ input
    per clip (own mean), padding frames of the fbank zero."""
    g = torch.Generator().manual_seed(3)
    clips = [0.1 * torch.randn(n, generator=g) for n in (8000, 3 * 16000 + 77, 401, 12345)]
    clips[1] = clips[1] * 1e-4  # a quiet clip: its floor must not come from the loud ones
    batch, lengths = padded_batch(clips)
    log_mel, feats = whisper_log_mel(batch, lengths=lengths), campplus_features(batch, lengths)
    for i, wav in enumerate(clips):
        alone = whisper_log_mel(wav)
        # the batched FFT/matmul may sum in another order than the clip's own (SIMD paths differ by CPU)
        torch.testing.assert_close(log_mel[i, :, :alone.shape[-1]], alone, rtol=0, atol=1e-5)
        alone = campplus_features(wav)[0]
        torch.testing.assert_close(feats[i, :alone.shape[0]], alone, rtol=0, atol=1e-5)
        assert not feats[i, alone.shape[0]:].any()
    with pytest.raises(ValueError, match="too short"):  # a batch's clips are checked by its caller
        whisper_log_mel(clips[0][:200])


def test_batched_features_match_the_reference_fixtures(parity_dir: Path):
    fixture_dir = parity_dir / "cosyvoice2"
    if not cv2_frontend.detect(fixture_dir):
        pytest.skip(f"no {cv2_frontend.FEATURES_FILE} in {fixture_dir}")
    from safetensors.torch import load_file

    stored = load_file(str(fixture_dir / cv2_frontend.FEATURES_FILE))
    names = ("w16_a", "w16_b")  # 27200 and 19683 samples: different lengths in one batch
    batch, lengths = padded_batch([stored[f"{name}/wave"][0] for name in names])
    log_mel, feats = whisper_log_mel(batch, lengths=lengths), campplus_features(batch, lengths)
    for i, name in enumerate(names):
        reference = stored[f"{name}/whisper_logmel128"][0]
        assert float((log_mel[i, :, :reference.shape[-1]] - reference).abs().max()) < cv2_frontend.LOG_MEL_MAX_ABS
        reference = stored[f"{name}/campplus_input"][0]
        ours = feats[i, :reference.shape[0]]
        assert float((ours - reference).norm() / reference.norm()) < cv2_frontend.FBANK_REL
        assert float((ours - reference).abs().max()) < cv2_frontend.FBANK_MAX_ABS


def test_too_short_for_stft_is_a_value_error():
    with pytest.raises(ValueError):
        matcha_mel_spectrogram(torch.zeros(100))
    with pytest.raises(ValueError):
        whisper_log_mel(torch.zeros(100))


# --- prompt audio input ---------------------------------------------------------------------


def test_prompt_audio_from_16k_and_44k_sources():
    prompt = prompt_audio_from_array(tone(2.0, 16000), 16000)
    assert prompt.wav16.shape == (32000,) and prompt.wav24.shape == (48000,)
    assert prompt.duration_s == pytest.approx(2.0)
    torch.testing.assert_close(prompt.wav24, resample(tone(2.0, 16000), 16000, 24000))
    prompt = prompt_audio_from_array(tone(1.5, 44100).numpy(), 44100)
    assert prompt.wav16.shape == (24000,) and prompt.wav24.shape == (36000,)


def test_stereo_is_mixed_to_mono(tmp_path: Path):
    left, right = tone(1.0, 16000, 440.0), tone(1.0, 16000, 660.0)
    path = tmp_path / "stereo.flac"
    sf.write(path, torch.stack([left, right], dim=1).numpy(), 16000, subtype="PCM_24")
    wav, rate = read_audio(path)
    assert rate == 16000 and wav.shape == (16000,)
    assert float((wav - (left + right) / 2).abs().max()) < 1e-5
    prompt = prompt_audio_from_array(torch.stack([left, right]), 16000)
    torch.testing.assert_close(prompt.wav16, (left + right) / 2)


def test_load_prompt_audio_from_path_bytes_and_file_object(tmp_path: Path):
    path = tmp_path / "prompt.wav"
    sf.write(path, tone(1.0, 48000).numpy(), 48000, subtype="FLOAT")
    from_path = load_prompt_audio(path)
    from_bytes = load_prompt_audio(path.read_bytes())
    with open(path, "rb") as handle:
        from_handle = load_prompt_audio(handle)
    assert from_path.wav16.shape == (16000,) and from_path.wav24.shape == (24000,)
    assert torch.equal(from_path.wav24, from_bytes.wav24) and torch.equal(from_path.wav16, from_handle.wav16)


@pytest.mark.parametrize("wav,rate,message", [
    (torch.zeros(0), 16000, "empty"),
    (torch.full((16000,), float("nan")), 16000, "NaN"),
    (torch.cat([tone(1.0, 16000), torch.tensor([float("inf")])]), 16000, "infinite"),
    (torch.zeros(16000), 16000, "silent"),
    (1e-6 * tone(1.0, 16000), 16000, "silent"),
    (tone(0.3, 16000), 16000, "0.30 s"),
    (tone(31.0, 16000), 16000, "31.00 s"),
    (tone(1.0, 8000), 8000, "8000 Hz"),
    (torch.zeros(16000, dtype=torch.int16), 16000, "float waveform"),
    (torch.zeros(1, 2, 16000), 16000, "float waveform"),
    (torch.zeros(16000, 2), 16000, "channels, samples"),
])
def test_invalid_prompt_audio_is_rejected(wav, rate, message):
    with pytest.raises(InvalidInputError, match=message):
        prompt_audio_from_array(wav, rate)


def test_undecodable_missing_and_too_long_files(tmp_path: Path):
    with pytest.raises(InvalidInputError, match="could not decode"):
        load_prompt_audio(b"RIFF not really a wave file" * 10)
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_prompt_audio(tmp_path / "missing.wav")
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros(16000 * 31, np.int16), 16000, format="WAV", subtype="PCM_16")
    with pytest.raises(InvalidInputError, match="at most 30 s"):
        load_prompt_audio(buffer.getvalue())
