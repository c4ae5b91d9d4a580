"""CosyVoice2 flow (speech tokens -> mel): up-sampling conformer encoder + causal flow matching."""

from .cfm import CausalConditionalCFM, fixed_noise
from .config import CFMConfig, EncoderConfig, EstimatorConfig, FlowConfig
from .encoder import UpsampleConformerEncoder
from .estimator import CausalConditionalDecoder
from .flow import (
    CosyVoice2Flow,
    FlowConditions,
    flow_from_state_dict,
    load_flow,
    load_flow_state_dict,
    random_flow_state_dict,
)

__all__ = [
    "CFMConfig",
    "CausalConditionalCFM",
    "CausalConditionalDecoder",
    "CosyVoice2Flow",
    "EncoderConfig",
    "EstimatorConfig",
    "FlowConditions",
    "FlowConfig",
    "UpsampleConformerEncoder",
    "fixed_noise",
    "flow_from_state_dict",
    "load_flow",
    "load_flow_state_dict",
    "random_flow_state_dict",
]
