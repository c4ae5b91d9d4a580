"""CosyVoice2 LLM stage: prompt building, sampling, and backends (hf reference, torch engine).

    from cosyserve.llm import SamplingParams, create_backend
    from cosyserve.llm.prompt import build_prompt_ids

    with create_backend("torch", "models/cosyvoice2_llm", device="cuda") as llm:
        for token in llm.generate_stream(build_prompt_ids(tokenizer, text, ...), SamplingParams()):
            ...  # raw speech tokens 0..6560
"""

from .backends import BACKENDS, create_backend
from .base import BackendUnavailableError, LLMBackend
from .prompt import EOS_IDS, SPEECH_TOKEN_OFFSET, build_prefix_ids, build_prompt_ids
from .sampling import SamplingParams
from .stream import TokenStream

__all__ = [
    "BACKENDS", "BackendUnavailableError", "EOS_IDS", "LLMBackend", "SPEECH_TOKEN_OFFSET", "SamplingParams",
    "TokenStream", "build_prefix_ids", "build_prompt_ids", "create_backend",
]
