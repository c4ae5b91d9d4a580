"""Speech tokens for the engine core: our LLM engine stepped by the core's loop, or any back end
that generates on threads of its own (an OpenAI-compatible server, a Triton LLM model).

Either way each request's tokens arrive in a :class:`~cosyserve.llm.stream.TokenStream` that the
loop drains without blocking. :class:`LoopLLM` owns an :class:`~cosyserve.llm.engine.llm_engine.LLMEngine`
with no thread of its own: each :meth:`LoopLLM.step` is one engine step (admissions and a bounded
prefill, then one decode step for every running request), so LLM and flow steps alternate on one
thread and one CUDA context, with no process between them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ...llm.prompt import register_voice_prefixes
from ...llm.sampling import REFERENCE_SAMPLING, SamplingParams
from ...llm.stream import TokenStream
from ...pipeline.tts import TokenLimits


class LoopLLM:
    """The in-process LLM engine, stepped by the caller. ``external`` False: tokens appear only
    when :meth:`step` runs."""

    external = False

    def __init__(self, engine, sampling: SamplingParams = REFERENCE_SAMPLING) -> None:
        self.engine = engine
        self.sampling = sampling
        device = engine.runner.device
        # On a GPU the LLM's kernels go to a stream of their own, so that a decode step runs beside
        # the flow step the loop launched just before it; reading the sampled tokens then waits for
        # the LLM's work only.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def submit(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> TokenStream:
        params = dataclasses.replace(self.sampling, max_tokens=limits.max_tokens, min_tokens=limits.min_tokens)
        return self.engine.submit(prompt_ids, params, request_id)

    def step(self) -> int:
        """One engine step; returns the requests it advanced."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            stats = self.engine.step()
        return stats.prefilled + stats.decoded

    def register_voices(self, text_tokenizer, registry) -> None:
        register_voice_prefixes(self.engine, text_tokenizer, registry)

    def close(self) -> None:
        self.engine.close()


class BackendLLM:
    """A :mod:`cosyserve.llm` back end that generates on its own threads (``external``: the loop
    polls its streams)."""

    external = True
    has_work = False

    def __init__(self, backend, sampling: SamplingParams = REFERENCE_SAMPLING) -> None:
        self.backend = backend
        self.sampling = sampling

    def submit(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> TokenStream:
        params = dataclasses.replace(self.sampling, max_tokens=limits.max_tokens, min_tokens=limits.min_tokens)
        return self.backend.generate_stream(prompt_ids, params, request_id)

    def step(self) -> int:
        return 0

    def register_voices(self, text_tokenizer, registry) -> None:
        register_voice_prefixes(self.backend, text_tokenizer, registry)

    def close(self) -> None:
        self.backend.close()
