"""Step-Audio-2-mini DiT flow (speech tokens -> mel): up-sampling conformer encoder V2 + DiT CFM."""

from .cfm import DitCFM, EstimatorCache
from .config import DitEncoderConfig, DitEstimatorConfig, DitFlowConfig
from .encoder_v2 import EncoderCache, UpsampleConformerEncoderV2
from .estimator import DiT
from .flow import DitFlow, FlowStreamCache, load_dit_flow, load_dit_flow_state_dict

__all__ = [
    "DiT",
    "DitCFM",
    "DitEncoderConfig",
    "DitEstimatorConfig",
    "DitFlow",
    "DitFlowConfig",
    "EncoderCache",
    "EstimatorCache",
    "FlowStreamCache",
    "UpsampleConformerEncoderV2",
    "load_dit_flow",
    "load_dit_flow_state_dict",
]
