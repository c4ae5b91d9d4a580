"""Step-Audio-2-mini DiT flow (speech tokens -> mel): up-sampling conformer encoder V2 + DiT CFM."""

from .cfm import StepAudio2CFM, EstimatorCache
from .config import StepAudio2EncoderConfig, StepAudio2EstimatorConfig, StepAudio2FlowConfig
from .encoder_v2 import EncoderCache, UpsampleConformerEncoderV2
from .estimator import DiT
from .flow import StepAudio2Flow, FlowStreamCache, load_step_audio2_flow, load_step_audio2_flow_state_dict

__all__ = [
    "DiT",
    "StepAudio2CFM",
    "StepAudio2EncoderConfig",
    "StepAudio2EstimatorConfig",
    "StepAudio2Flow",
    "StepAudio2FlowConfig",
    "EncoderCache",
    "EstimatorCache",
    "FlowStreamCache",
    "UpsampleConformerEncoderV2",
    "load_step_audio2_flow",
    "load_step_audio2_flow_state_dict",
]
