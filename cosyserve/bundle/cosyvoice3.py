"""The ``Fun-CosyVoice3-0.5B-2512/`` files of a random-weight bundle that the server reads.

Written with the released file names and formats (``flow.pt`` and ``hift.pt`` as plain fp32
state dicts in upstream's key order and weight-norm layout, as listed by the fixtures' real-size
manifests; ``cosyvoice3.yaml`` describing both), at the parity fixtures' tiny size or the
released size, plus the front-end ONNX models ``speech_tokenizer_v3.onnx`` and ``campplus.onnx``
(the stand-ins of :mod:`.onnx_models`: the v3 tokenizer has v2's interface, 128-bin 16 kHz
log-mel in, FSQ codes 0..6560 out; its stand-in graph is the same). The LLM checkpoint is the
bundle part ``cosyvoice3_llm`` (:mod:`.llm`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.cosyvoice3.config import CONFIG_FILE, CausalHiftConfig, Cv3FlowConfig
from ..models.cosyvoice3.flow import WEIGHTS_FILE as FLOW_FILE
from ..models.cosyvoice3.flow import CosyVoice3Flow
from ..models.cosyvoice3.hift import WEIGHTS_FILE as HIFT_FILE
from ..models.cosyvoice3.hift import CausalHiFTGenerator
from ..runtime import COSYVOICE3_DIR
from .model_yaml import write_model_yaml
from .onnx_models import write_campplus_onnx, write_speech_tokenizer_onnx

LLM_CLASS = "cosyvoice.llm.llm.CosyVoice3LM"


def cosyvoice3_configs(size: str) -> tuple[Cv3FlowConfig, CausalHiftConfig]:
    if size == "tiny":
        return Cv3FlowConfig.tiny(), CausalHiftConfig.tiny()
    return Cv3FlowConfig.real(), CausalHiftConfig.real()


SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
SPEAKER_ENCODER_FILE = "campplus.onnx"


def make_cosyvoice3_dir(out_dir: Path, size: str, seed: int) -> Path:
    """Write ``Fun-CosyVoice3-0.5B-2512/``: cosyvoice3.yaml, flow.pt, hift.pt and the front-end ONNX models."""
    model_dir = Path(out_dir) / COSYVOICE3_DIR
    model_dir.mkdir(parents=True, exist_ok=True)
    flow_cfg, hift_cfg = cosyvoice3_configs(size)
    write_model_yaml(model_dir / CONFIG_FILE, flow_cfg, hift_cfg, LLM_CLASS)
    torch.manual_seed(seed)
    torch.save(CosyVoice3Flow(flow_cfg).state_dict(), model_dir / FLOW_FILE)
    torch.manual_seed(seed + 1)
    torch.save(CausalHiFTGenerator(hift_cfg).state_dict(), model_dir / HIFT_FILE)
    write_speech_tokenizer_onnx(model_dir / SPEECH_TOKENIZER_FILE, size, seed + 2, version="v3")
    write_campplus_onnx(model_dir / SPEAKER_ENCODER_FILE, size, seed + 3)
    return model_dir
