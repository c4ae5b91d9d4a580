"""Speech front-end: speech tokenizer and speaker encoder (onnxruntime or PyTorch), prompt
features, cached speakers."""

from .onnx_models import SpeakerEncoder, SpeechTokenizer
from .prompt import PromptFeatures, build_prompt_features, build_prompt_features_batch, prompt_mel, trim_to_token_rate
from .speakers import Speaker, SpeakerRegistry
from .torch_models import TorchSpeakerEncoder, TorchSpeechTokenizer, load_frontend_models

__all__ = [
    "PromptFeatures",
    "Speaker",
    "SpeakerEncoder",
    "SpeakerRegistry",
    "SpeechTokenizer",
    "TorchSpeakerEncoder",
    "TorchSpeechTokenizer",
    "build_prompt_features",
    "build_prompt_features_batch",
    "load_frontend_models",
    "prompt_mel",
    "trim_to_token_rate",
]
