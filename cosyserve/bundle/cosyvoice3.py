"""The ``Fun-CosyVoice3-0.5B-2512/`` token2wav files of a random-weight bundle.

Written with the released file names and formats (``flow.pt`` and ``hift.pt`` as plain fp32
state dicts in upstream's key order and weight-norm layout, as listed by the fixtures' real-size
manifests; ``cosyvoice3.yaml`` describing both), at the parity fixtures' tiny size or the
released size. The LLM, the v3 speech tokenizer and CAM++ of that directory are not written here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.cosyvoice3.config import CONFIG_FILE, CausalHiftConfig, Cv3FlowConfig
from ..models.cosyvoice3.flow import WEIGHTS_FILE as FLOW_FILE
from ..models.cosyvoice3.flow import CosyVoice3Flow
from ..models.cosyvoice3.hift import WEIGHTS_FILE as HIFT_FILE
from ..models.cosyvoice3.hift import CausalHiFTGenerator
from .model_yaml import write_model_yaml

COSYVOICE3_DIR = "Fun-CosyVoice3-0.5B-2512"
LLM_CLASS = "cosyvoice.llm.llm.CosyVoice3LM"


def cosyvoice3_configs(size: str) -> tuple[Cv3FlowConfig, CausalHiftConfig]:
    if size == "tiny":
        return Cv3FlowConfig.tiny(), CausalHiftConfig.tiny()
    return Cv3FlowConfig.real(), CausalHiftConfig.real()


def make_cosyvoice3_dir(out_dir: Path, size: str, seed: int) -> Path:
    """Write ``Fun-CosyVoice3-0.5B-2512/``: cosyvoice3.yaml, flow.pt, hift.pt."""
    model_dir = Path(out_dir) / COSYVOICE3_DIR
    model_dir.mkdir(parents=True, exist_ok=True)
    flow_cfg, hift_cfg = cosyvoice3_configs(size)
    write_model_yaml(model_dir / CONFIG_FILE, flow_cfg, hift_cfg, LLM_CLASS)
    torch.manual_seed(seed)
    torch.save(CosyVoice3Flow(flow_cfg).state_dict(), model_dir / FLOW_FILE)
    torch.manual_seed(seed + 1)
    torch.save(CausalHiFTGenerator(hift_cfg).state_dict(), model_dir / HIFT_FILE)
    return model_dir
