"""Parity of the audio front-end against ``frontend.safetensors`` (fixture README §7).

For every waveform ``<name>/wave`` in the file, each stored feature present for it is
recomputed with :mod:`cosyserve.audio` and compared with the README §2 tolerances; the two
stored filter banks are compared with ours (computed, not loaded); the float WAV copies are
decoded with our reader. Sample rates come from ``fixture_meta.json`` or the WAV headers,
mel sizes from the stored tensor shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import soundfile as sf
import torch
from safetensors.torch import load_file

from ..audio.features import (
    campplus_features,
    kaldi_fbank,
    matcha_mel_spectrogram,
    resample,
    slaney_mel_filters,
    whisper_log_mel,
)
from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..audio.io import prompt_audio_from_array, read_audio
from ..schedule import OUTPUT_SAMPLE_RATE
from . import CaseResult, check, compare, is_cosyvoice3_fixture

SUITE = "cv2_frontend"
FEATURES_FILE = "frontend.safetensors"
# Recipe constants (not fixture values): the Matcha prompt mel's band and rate, Whisper's rate.
MATCHA_FMAX = 8000.0
# README §2 tolerances.
RESAMPLE_REL = 1e-6
LOG_MEL_MAX_ABS = 1e-3
FBANK_REL, FBANK_MAX_ABS = 1e-4, 1e-2
FILTER_MAX_ABS = 1e-7  # filters are O(1e-2): this is a few float32 ulps


def detect(fixture_dir: Path) -> bool:
    return not is_cosyvoice3_fixture(fixture_dir) and (Path(fixture_dir) / FEATURES_FILE).is_file()


def _waveform_info(fixture_dir: Path, names: list[str]) -> dict[str, dict]:
    """name -> {"sample_rate", "wav_file"} from fixture_meta.json, else from the WAV headers."""
    meta_path = fixture_dir / "fixture_meta.json"
    meta = json.loads(meta_path.read_text()).get("frontend", {}).get("waveforms", {}) if meta_path.is_file() else {}
    info = {}
    for name in names:
        entry = dict(meta.get(name, {}))
        wav_file = fixture_dir / entry.get("wav_file", f"frontend_{name}.wav")
        if "sample_rate" not in entry and wav_file.is_file():
            entry["sample_rate"] = sf.info(str(wav_file)).samplerate
        entry["wav_file"] = wav_file
        info[name] = entry
    return info


def _filter_cases(tensors: dict[str, torch.Tensor]) -> list[CaseResult]:
    recipes = {"filters/matcha_mel_basis": (OUTPUT_SAMPLE_RATE, MATCHA_FMAX),
               "filters/whisper_mel_128": (TOKENIZER_SAMPLE_RATE, None)}
    results = []
    for key, (sample_rate, fmax) in recipes.items():
        if key in tensors:
            n_mels, n_bins = tensors[key].shape
            ours = slaney_mel_filters(sample_rate, 2 * (n_bins - 1), n_mels, 0.0, fmax)
            results.append(compare(SUITE, key, ours, tensors[key], max_abs=FILTER_MAX_ABS))
    return results


def _waveform_cases(name: str, wave: torch.Tensor, sample_rate: int | None,
                    tensors: dict[str, torch.Tensor]) -> list[CaseResult]:
    def ref(feature: str) -> torch.Tensor | None:
        return tensors.get(f"{name}/{feature}")

    results = []
    if sample_rate is None:
        return [check(SUITE, f"{name}/sample_rate", False, "no sample rate in fixture_meta.json nor a WAV file")]
    if (stored_24k := ref("resampled_24k")) is not None:
        ours_24k = resample(wave, sample_rate, OUTPUT_SAMPLE_RATE)
        results.append(compare(SUITE, f"{name}/resampled_24k", ours_24k, stored_24k, rel_l2=RESAMPLE_REL))
        if (mel := ref("mel24_from_resampled")) is not None:
            n_mels = mel.shape[-2]
            results.append(compare(SUITE, f"{name}/mel24_from_resampled", matcha_mel_spectrogram(
                stored_24k, num_mels=n_mels), mel, max_abs=LOG_MEL_MAX_ABS))
            results.append(compare(SUITE, f"{name}/mel24_from_our_resample", matcha_mel_spectrogram(
                ours_24k, num_mels=n_mels), mel, max_abs=LOG_MEL_MAX_ABS))
    if (mel := ref("mel24")) is not None:
        results.append(compare(SUITE, f"{name}/mel24", matcha_mel_spectrogram(wave, num_mels=mel.shape[-2]),
                               mel, max_abs=LOG_MEL_MAX_ABS))
    if (fbank := ref("kaldi_fbank")) is not None:
        results.append(compare(SUITE, f"{name}/kaldi_fbank", kaldi_fbank(wave, num_mel_bins=fbank.shape[-1],
                               sample_frequency=sample_rate), fbank, rel_l2=FBANK_REL, max_abs=FBANK_MAX_ABS))
    if (campplus := ref("campplus_input")) is not None:
        results.append(compare(SUITE, f"{name}/campplus_input", campplus_features(wave), campplus,
                               rel_l2=FBANK_REL, max_abs=FBANK_MAX_ABS))
    if (log_mel := ref("whisper_logmel128")) is not None:
        results.append(compare(SUITE, f"{name}/whisper_logmel128", whisper_log_mel(wave, n_mels=log_mel.shape[-2]),
                               log_mel, max_abs=LOG_MEL_MAX_ABS))
    return results


def _wav_file_cases(name: str, wave: torch.Tensor, info: dict, tensors: dict[str, torch.Tensor]) -> list[CaseResult]:
    """Our decoder on the float WAV copy; for 16 kHz sources also the full prompt path's 24 kHz wave."""
    if not info["wav_file"].is_file():
        return []
    decoded, rate = read_audio(info["wav_file"])
    if rate != info["sample_rate"]:
        return [check(SUITE, f"{name}/wav_file", False, f"header rate {rate} Hz != {info['sample_rate']} Hz")]
    results = [compare(SUITE, f"{name}/wav_file", decoded[None], wave)]
    if (stored_24k := tensors.get(f"{name}/resampled_24k")) is not None:
        prompt = prompt_audio_from_array(decoded, rate)
        results.append(compare(SUITE, f"{name}/wav_file_prompt_24k", prompt.wav24[None], stored_24k,
                               rel_l2=RESAMPLE_REL))
    return results


def run(fixture_dir: Path) -> list[CaseResult]:
    fixture_dir = Path(fixture_dir)
    tensors = load_file(str(fixture_dir / FEATURES_FILE))
    names = sorted(key[: -len("/wave")] for key in tensors if key.endswith("/wave"))
    info = _waveform_info(fixture_dir, names)
    results = _filter_cases(tensors)
    for name in names:
        wave = tensors[f"{name}/wave"]
        results.extend(_waveform_cases(name, wave, info[name].get("sample_rate"), tensors))
        if "sample_rate" in info[name]:
            results.extend(_wav_file_cases(name, wave, info[name], tensors))
    return results
