"""One interface over every LLM backend, and the registry that creates them by name.

=========  ==========================================================================
``hf``     transformers Qwen2ForCausalLM with the lm_head bias kept (the reference)
``torch``  this package's engine: slot KV cache, continuous batching, CUDA graphs
``trtllm`` TensorRT-LLM engine (``trtllm_backend``; needs the ``tensorrt_llm`` package)
``openai`` client of an OpenAI-compatible server such as trtllm-serve (``openai_backend``)
=========  ==========================================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CosyServeError, InvalidInputError
from .sampling import SamplingParams
from .stream import TokenStream

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


class BackendUnavailableError(CosyServeError, RuntimeError):
    """The backend cannot run here: a package it needs is not installed."""


def resolve_device_dtype(device: str | torch.device, dtype: torch.dtype | str | None) -> tuple[torch.device, torch.dtype]:
    """Default dtype: bfloat16 on GPU, float32 on CPU; dtype names like "bf16" are accepted."""
    device = torch.device(device)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InvalidInputError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


class LLMBackend(ABC):
    """Thread-safe: many callers may stream at once (the torch engine batches them together)."""

    name: str

    @abstractmethod
    def generate_stream(self, prompt_ids: list[int], params: SamplingParams,
                        request_id: str | None = None) -> TokenStream:
        """Start a request; iterate the stream for raw speech tokens 0..6560 (eos not yielded).

        Bad requests raise InvalidInputError here, before anything is queued."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> list[int]:
        return list(self.generate_stream(prompt_ids, params, request_id))

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Stop a request (its reader gets RequestCancelledError); False if it is not active."""

    @abstractmethod
    def register_prefix(self, key: str, ids: list[int]) -> None:
        """Precompute the KV of a shared prompt prefix (a voice's ``<|sos|>{prompt_text}``)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the backend's threads and release its memory."""

    def __enter__(self) -> "LLMBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
