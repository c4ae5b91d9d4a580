"""The registry that creates LLM back ends by name (their interface: :mod:`.base`).

=========  ==========================================================================
``hf``     transformers Qwen2ForCausalLM with the lm_head bias kept (the reference)
``torch``  this package's engine: slot KV cache, continuous batching, CUDA graphs
``trtllm`` TensorRT-LLM engine (``trtllm_backend``; needs the ``tensorrt_llm`` package)
``openai`` client of an OpenAI-compatible server such as trtllm-serve (``openai_backend``)
=========  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import InvalidInputError
from ..runtime import resolve_device_dtype
from .base import LLMBackend
from .stream import TokenStream


class TorchBackend(LLMBackend):
    name = "torch"

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None, **engine_options):
        from .engine.llm_engine import LLMEngine

        device, dtype = resolve_device_dtype(device, dtype)
        self.engine = LLMEngine(model_dir, device, dtype, **engine_options).start()

    def generate_stream(self, prompt_ids, params, request_id=None) -> TokenStream:
        return self.engine.submit(prompt_ids, params, request_id)

    def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)

    def register_prefix(self, key: str, ids: list[int]) -> None:
        self.engine.register_prefix(key, ids)

    def close(self) -> None:
        self.engine.close()


def _create_hf(model_dir, device, dtype, **options) -> LLMBackend:
    from .hf_reference import HFBackend

    return HFBackend(model_dir, device, dtype, **options)


def _create_trtllm(model_dir, device, dtype, **options) -> LLMBackend:
    from .trtllm_backend import TrtllmBackend  # raises BackendUnavailableError without tensorrt_llm

    return TrtllmBackend(model_dir, device, dtype, **options)


def _create_openai(model_dir, device, dtype, **options) -> LLMBackend:
    from .openai_backend import OpenAIBackend

    return OpenAIBackend(model_dir, device, dtype, **options)


BACKENDS: dict[str, Callable[..., LLMBackend]] = {
    "hf": _create_hf,
    "torch": TorchBackend,
    "trtllm": _create_trtllm,
    "openai": _create_openai,
}


def create_backend(name: str, model_dir: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | str | None = None, **options) -> LLMBackend:
    """Create a backend by name; ``options`` go to its constructor (e.g. ``max_slots`` for torch)."""
    if name not in BACKENDS:
        raise InvalidInputError(f"unknown LLM backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name](model_dir, device, dtype, **options)
