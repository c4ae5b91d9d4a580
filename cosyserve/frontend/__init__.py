"""Speech front-end: ONNX speech tokenizer and speaker encoder, prompt features, cached speakers."""

from .onnx_models import SpeakerEncoder, SpeechTokenizer
from .prompt import PromptFeatures, build_prompt_features, prompt_mel, trim_to_token_rate
from .speakers import Speaker, SpeakerRegistry

__all__ = [
    "PromptFeatures",
    "Speaker",
    "SpeakerEncoder",
    "SpeakerRegistry",
    "SpeechTokenizer",
    "build_prompt_features",
    "prompt_mel",
    "trim_to_token_rate",
]
