"""Random-weight model bundles with the exact layout and file formats of the released models.

There are no model weights on our machines, so every test and benchmark runs on bundles made
here: the real architecture and file formats with random weights. ``tiny`` builds in seconds on
a CPU (tests, CI); ``real`` has the released shapes (benchmarks: timing depends on shapes, not
on weight values).

Layout written under ``out_dir`` (the same directory names the download stage uses)::

    CosyVoice2-0.5B/            cosyvoice2.yaml flow.pt hift.pt campplus.onnx
                                speech_tokenizer_v2.onnx spk2info.pt
    cosyvoice2_llm/             HuggingFace Qwen2 checkpoint + tokenizer (llm_layout.md)
    Fun-CosyVoice3-0.5B-2512/   cosyvoice3.yaml flow.pt hift.pt campplus.onnx
                                speech_tokenizer_v3.onnx (part "cosyvoice3")
    cosyvoice3_llm/             HuggingFace Qwen2 checkpoint + tokenizer (part "cosyvoice3_llm",
                                cosyvoice3_llm_layout.md §7)
    assets/prompt_audio.wav     a synthetic 16 kHz prompt and assets/prompt_text.txt
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..runtime import COSYVOICE2_DIR, LLM_DIR, SPK2INFO
from .model_yaml import write_model_yaml

SIZES = ("tiny", "real")
PARTS = ("cosyvoice2", "llm", "step_audio2", "cosyvoice3", "cosyvoice3_llm")
ASSETS_DIR = "assets"
DEFAULT_SPEAKER_ID = "001"
# The prompt text shipped with the synthetic prompt; any text works with random weights.
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"


def synthetic_prompt_wave(seconds: float = 3.0, sample_rate: int = TOKENIZER_SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """A voiced, speech-like test signal: a gliding harmonic tone with syllable-rate envelope.

    It passes the prompt-audio validation (not silent, within length limits) and exercises
    every front-end path; it is not speech and no claim is made about how it sounds.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140.0 + 30.0 * np.sin(2 * math.pi * 0.7 * t) + 10.0 * np.sin(2 * math.pi * 5.0 * t)
    phase = 2 * math.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.55 + 0.45 * np.sin(2 * math.pi * 3.5 * t) ** 2
    wave = 0.25 * voice * envelope + 0.003 * rng.standard_normal(t.size)
    return (wave / np.abs(wave).max() * 0.6).astype(np.float32)


def _set_seed(seed: int) -> None:
    torch.manual_seed(seed)


def make_cosyvoice2_dir(out_dir: Path, size: str, seed: int) -> Path:
    """Write ``CosyVoice2-0.5B/`` (flow, HiFT, ONNX front-end models, yaml, spk2info)."""
    from ..frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
    from ..frontend.prompt import build_prompt_features
    from ..frontend.speakers import SpeakerRegistry
    from ..audio.io import prompt_audio_from_array
    from ..models.flow import CosyVoice2Flow, FlowConfig
    from ..models.hift import HiFTGenerator, HiftConfig
    from .onnx_models import write_campplus_onnx, write_speech_tokenizer_onnx

    model_dir = out_dir / COSYVOICE2_DIR
    model_dir.mkdir(parents=True, exist_ok=True)
    if size == "tiny":
        flow_cfg, hift_cfg = FlowConfig.tiny(), HiftConfig.tiny()
    else:
        flow_cfg, hift_cfg = FlowConfig.real(), HiftConfig.real()
    write_model_yaml(model_dir / "cosyvoice2.yaml", flow_cfg, hift_cfg)
    _set_seed(seed)
    torch.save(CosyVoice2Flow(flow_cfg).state_dict(), model_dir / "flow.pt")
    _set_seed(seed + 1)
    torch.save(HiFTGenerator(hift_cfg).state_dict(), model_dir / "hift.pt")
    write_speech_tokenizer_onnx(model_dir / "speech_tokenizer_v2.onnx", size, seed + 2)
    write_campplus_onnx(model_dir / "campplus.onnx", size, seed + 3)

    # spk2info.pt: the default speaker "001", computed through our own front-end from the
    # synthetic prompt, so the cached-speaker path has consistent features.
    prompt = prompt_audio_from_array(synthetic_prompt_wave(seed=seed), TOKENIZER_SAMPLE_RATE)
    features = build_prompt_features(
        prompt, SpeechTokenizer(model_dir / "speech_tokenizer_v2.onnx"), SpeakerEncoder(model_dir / "campplus.onnx")
    )
    registry = SpeakerRegistry()
    registry.add(DEFAULT_SPEAKER_ID, features, prompt_text=PROMPT_TEXT)
    registry.save(model_dir / SPK2INFO)
    return model_dir


def write_assets(out_dir: Path, seed: int) -> Path:
    import soundfile as sf  # only here: GPU images without libsndfile can still build LLM bundles

    assets = out_dir / ASSETS_DIR
    assets.mkdir(parents=True, exist_ok=True)
    sf.write(assets / "prompt_audio.wav", synthetic_prompt_wave(seed=seed), TOKENIZER_SAMPLE_RATE, subtype="FLOAT")
    (assets / "prompt_text.txt").write_text(PROMPT_TEXT + "\n", encoding="utf-8")
    return assets


def make_bundle(out_dir: str | Path, size: str = "tiny", seed: int = 0, parts: tuple[str, ...] = ("cosyvoice2", "llm")) -> Path:
    """Write the requested parts of a random-weight bundle into ``out_dir``; returns it."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown bundle parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_assets(out_dir, seed)
    if "cosyvoice2" in parts:
        make_cosyvoice2_dir(out_dir, size, seed)
    if "llm" in parts:
        from .llm import write_llm_bundle

        write_llm_bundle(out_dir / LLM_DIR, size, seed + 10)
    if "step_audio2" in parts:
        from .step_audio2 import make_step_audio2_dir

        cosyvoice2_dir = out_dir / COSYVOICE2_DIR
        if not (cosyvoice2_dir / "campplus.onnx").exists():  # Step-Audio2's front-end models are these
            make_cosyvoice2_dir(out_dir, size, seed + 20)
        make_step_audio2_dir(out_dir, size, seed + 20, cosyvoice2_dir)
    if "cosyvoice3" in parts:
        from .cosyvoice3 import make_cosyvoice3_dir

        make_cosyvoice3_dir(out_dir, size, seed + 30)
    if "cosyvoice3_llm" in parts:
        from ..llm.prompt import COSYVOICE3
        from ..runtime import COSYVOICE3_LLM_DIR
        from .llm import write_llm_bundle

        write_llm_bundle(out_dir / COSYVOICE3_LLM_DIR, size, seed + 40, COSYVOICE3)
    return out_dir
