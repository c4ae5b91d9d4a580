"""Speech tokens for the engine core. Whatever generates them runs beside the loop, never inside
it: each request's tokens arrive in a :class:`~cosyserve.llm.stream.TokenStream` that the loop
drains without blocking.

* :class:`FreeRunningLLM`: our :class:`~cosyserve.llm.engine.llm_engine.LLMEngine` on a thread and
  a CUDA stream of its own: it decodes at its own pace whatever the token2wav loop is doing, so a
  stream's first chunk waits for ~18 decode steps, not for ~18 loop iterations, and a long flow step
  never holds its tokens back. Paced (:class:`~cosyserve.llm.engine.llm_engine.Pacing`): a request's
  first 20 tokens at once, then 4x real time, so the GPU is not spent on tokens nobody needs yet
  while a first chunk waits for its flow (measured on an H200: unpaced, on a high-priority stream,
  one stream's first chunk took 235 ms, ~180 of them its flow waiting behind the rest of the reply's
  decode steps).
* :class:`BackendLLM`: any :mod:`cosyserve.llm` back end that generates on threads of its own (an
  OpenAI-compatible server), or the tokens a front door forwards from a Triton LLM model
  (:class:`~cosyserve.engine.process.ForwardedTokens`).
"""

from __future__ import annotations

import dataclasses

from ...llm.prompt import register_voice_prefixes
from ...llm.sampling import REFERENCE_SAMPLING, SamplingParams
from ...llm.stream import TokenStream
from ...runtime import role_stream
from ..front_end import TokenLimits


class BackendLLM:
    """A back end with ``generate_stream(prompt_ids, params, request_id)`` that generates on its own
    threads; each request gets ``sampling`` with its token limits."""

    def __init__(self, backend, sampling: SamplingParams = REFERENCE_SAMPLING) -> None:
        self.backend = backend
        self.sampling = sampling
        self._generate = backend.generate_stream  # (prompt_ids, params, request_id) -> TokenStream

    def submit(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> TokenStream:
        params = dataclasses.replace(self.sampling, max_tokens=limits.max_tokens, min_tokens=limits.min_tokens)
        return self._generate(prompt_ids, params, request_id)

    def register_voices(self, text_tokenizer, registry) -> None:
        register_voice_prefixes(self.backend, text_tokenizer, registry)

    @property
    def generating(self) -> int | None:
        """LLM requests under way, where the back end counts them here (None: it counts its own)."""
        return None

    def counters(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.backend.close()


class FreeRunningLLM(BackendLLM):
    """The in-process LLM engine, stepping on its own thread from the start (paced: ``engine.pacing``)."""

    def __init__(self, engine, sampling: SamplingParams = REFERENCE_SAMPLING) -> None:
        self.backend = engine
        self.sampling = sampling
        self._generate = engine.submit
        runner = engine.runner
        # a stream of its own, by default at the flow's priority: its decode steps interleave with the
        # flow's kernels (at a higher priority, unpaced, they starved a first chunk's flow until the
        # reply was decoded); LLMEngine(high_priority=True) for the highest
        engine.start(role_stream(runner.device, runner.stream_role) if runner.device.type == "cuda" else None)

    @property
    def generating(self) -> int:
        return self.backend.num_active

    def counters(self) -> dict[str, float]:
        counters = self.backend.counters
        return {"llm_busy_s": counters.busy_s, "llm_prefill_s": counters.prefill_s,
                "llm_decode_steps": counters.decode_steps, "llm_decode_rows": counters.decode_rows,
                "llm_prefills": counters.prefills}
