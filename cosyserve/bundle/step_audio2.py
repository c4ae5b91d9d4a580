"""The Step-Audio-2-mini ``token2wav/`` directory of a random-weight bundle (Step-Audio2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..config import dump_hyperpyyaml
from ..models.step_audio2 import StepAudio2Flow, StepAudio2FlowConfig
from ..models.step_audio2.config import StepAudio2EncoderConfig, StepAudio2EstimatorConfig
from ..models.hift import HiFTGenerator, HiftConfig
from ..runtime import STEP_AUDIO2_DIR
from ..token2wav.step_audio2 import STEP_AUDIO2_SPEAKER_ONNX, STEP_AUDIO2_TOKENIZER_ONNX


def tiny_step_audio2_config() -> StepAudio2FlowConfig:
    """The shrunk Step-Audio2 flow of the parity fixtures (same module tree, tiny widths)."""
    return StepAudio2FlowConfig(
        input_size=64,
        encoder=StepAudio2EncoderConfig(input_size=64, output_size=64, attention_heads=2, linear_units=128,
                                 num_blocks=2, num_up_blocks=2),
        estimator=StepAudio2EstimatorConfig(hidden_size=64, depth=2, num_heads=2, head_dim=32),
    )


def make_step_audio2_dir(out_dir: Path, size: str, seed: int, cosyvoice2_dir: Path) -> Path:
    """Write ``Step-Audio-2-mini/token2wav/``: flow.yaml, flow.pt, hift.pt and the two ONNX
    front-end models, copied from ``cosyvoice2_dir`` (they are the same files as CosyVoice2's; the
    released directory names the tokenizer ``speech_tokenizer_v2_25hz.onnx``)."""
    model_dir = out_dir / STEP_AUDIO2_DIR
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = tiny_step_audio2_config() if size == "tiny" else StepAudio2FlowConfig.real()
    dump_hyperpyyaml({"flow": cfg.to_yaml_node()}, model_dir / "flow.yaml")
    torch.manual_seed(seed)
    torch.save(StepAudio2Flow(cfg).state_dict(), model_dir / "flow.pt")
    torch.manual_seed(seed + 1)
    hift_cfg = HiftConfig.tiny() if size == "tiny" else HiftConfig.real()
    torch.save(HiFTGenerator(hift_cfg).state_dict(), model_dir / "hift.pt")
    shutil.copyfile(cosyvoice2_dir / "campplus.onnx", model_dir / STEP_AUDIO2_SPEAKER_ONNX)
    shutil.copyfile(cosyvoice2_dir / "speech_tokenizer_v2.onnx", model_dir / STEP_AUDIO2_TOKENIZER_ONNX)
    return model_dir
