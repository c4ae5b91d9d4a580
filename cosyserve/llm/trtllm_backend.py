"""The ``trtllm`` backend: a TensorRT-LLM engine (``trtllm-build`` output) on its C++ executor.

    backend = create_backend("trtllm", "models/cosyvoice2_llm", "cuda", engine_dir="trt_engines_bfloat16")

``model_dir`` is the HuggingFace LLM directory, as for every backend: the engine has no head
bias (TensorRT-LLM's Qwen ``lm_head`` has none), so every request carries it as
``embedding_bias`` read from there (:mod:`cosyserve.llm.trtllm.request`). ``engine_dir`` is the
engine. The engine is loaded with ``ModelRunnerCpp.from_dir``, but requests go to the runner's
executor directly: ``ModelRunnerCpp.generate`` waits on responses for its own batch only, so
concurrent callers would take each other's responses. One thread here awaits all responses and
hands each token to its request's :class:`TokenStream`; ``cancel`` is the executor's.

Sampling: temperature, top_k (0 = no limit, at most 1024 in TensorRT-LLM), top_p,
repetition_penalty, seed, min_tokens and max_tokens map to the executor's; temperature 0 is
top_k 1. Repetition-aware sampling does not exist in TensorRT-LLM: ``ras`` is ignored with a
warning (the reference's TensorRT-LLM path has none either). ``<|eos1|>`` is the end id and
``<|eos2|>``/``<|eos3|>`` are stop words; TensorRT-LLM's ``min_tokens`` holds back the end id
only, so an early ``<|eos2|>``/``<|eos3|>`` still ends a request (the torch engine masks all three). ``register_prefix`` runs the prefix once so that KV-cache block reuse can serve it later.

Single-GPU engines only (tp 1): multi-GPU engines need MPI ranks; serve those with the Triton
``tensorrt_llm`` model. Not run on our machines (no TensorRT-LLM there): see docs/deployment.md.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from ..errors import InvalidInputError, ModelLoadError
from .trtllm import require_tensorrt_llm
from .trtllm.request import END_ID, NEVER_SAMPLED_ID, STOP_WORDS, embedding_bias
from ..runtime import resolve_device_dtype
from .base import LLMBackend
from .prompt import EOS_IDS, NUM_SPEECH_TOKENS, SPEECH_TOKEN_OFFSET, validate_prompt_ids
from .sampling import SamplingParams, random_seed
from .stream import Finished, TokenStream, cancelled_error

log = logging.getLogger(__name__)

MAX_TOP_K = 1024  # TensorRT-LLM's top-k sampling kernels take k <= 1024
RESPONSE_POLL = timedelta(milliseconds=20)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# executor FinishReason name -> TokenStream finish reason
_FINISH = {"END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "CANCELLED": "cancelled"}


class TrtllmRequestError(RuntimeError):
    """The executor failed a request (its message is the executor's)."""


def sampling_config_kwargs(params: SamplingParams, seed: int) -> dict:
    """Keyword arguments of ``tensorrt_llm.bindings.executor.SamplingConfig`` for ``params``."""
    if params.top_k > MAX_TOP_K:
        raise InvalidInputError(f"top_k {params.top_k} is above TensorRT-LLM's limit {MAX_TOP_K}; "
                                f"use 1..{MAX_TOP_K} or 0 (no limit)")
    greedy = params.temperature == 0
    return {
        "beam_width": 1,
        "top_k": 1 if greedy else (params.top_k or None),
        "top_p": None if greedy else params.top_p,
        "temperature": None if greedy else params.temperature,
        "repetition_penalty": params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        "min_tokens": params.min_tokens or None,
        "seed": seed,
    }


def stop_kwargs(params: SamplingParams) -> dict:
    """end_id / stop_words / bad_words of an executor request.

    Normally <|eos1|> ends the request and <|eos2|>, <|eos3|> are stop words. With ``ignore_eos``
    the three are banned (bad words) and the end id is one the head bias never lets be sampled.
    """
    if params.ignore_eos:
        return {"end_id": NEVER_SAMPLED_ID, "stop_words": None, "bad_words": [[token] for token in EOS_IDS]}
    return {"end_id": END_ID, "stop_words": STOP_WORDS, "bad_words": None}


def read_engine_config(engine_dir: Path) -> dict:
    """``pretrained_config`` of a ``trtllm-build`` output, checked for what this backend supports."""
    path = engine_dir / "config.json"
    try:
        config = json.loads(path.read_text())["pretrained_config"]
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a TensorRT-LLM engine config (trtllm-build --output_dir): {exc}") from exc
    world_size = int(config.get("mapping", {}).get("world_size", 1))
    if world_size != 1:
        raise ModelLoadError(f"{engine_dir} is a {world_size}-GPU engine; the trtllm backend runs single-GPU "
                             "engines (serve multi-GPU engines with the Triton tensorrt_llm model)")
    if config.get("logits_dtype", "float32") not in _DTYPES:
        raise ModelLoadError(f"{path}: logits_dtype {config.get('logits_dtype')!r} is not supported")
    return config


@dataclass(eq=False)
class _Request:
    request_id: str
    stream: TokenStream
    executor_id: int = -1


class TrtllmBackend(LLMBackend):
    name = "trtllm"

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cuda", dtype=None, *,
                 engine_dir: str | Path | None = None, kv_cache_free_gpu_memory_fraction: float = 0.5,
                 enable_kv_cache_reuse: bool = True, max_tokens_in_paged_kv_cache: int | None = None,
                 max_model_len: int | None = None):
        tensorrt_llm = require_tensorrt_llm("the 'trtllm' LLM backend")
        from tensorrt_llm.bindings import executor as trtllm
        from tensorrt_llm.runtime import ModelRunnerCpp

        if engine_dir is None:
            raise InvalidInputError("the trtllm backend needs engine_dir=<trtllm-build --output_dir>; "
                                    "model_dir is the HuggingFace LLM directory (the head bias is read there)")
        device = torch.device(device)
        if device.type != "cuda" or (device.index or 0) != 0:
            raise InvalidInputError(f"the trtllm backend runs on the first visible GPU (device 'cuda'), got "
                                    f"{str(device)!r}; choose the GPU with CUDA_VISIBLE_DEVICES")
        engine_dir = Path(engine_dir)
        config = read_engine_config(engine_dir)
        if dtype is not None and str(resolve_device_dtype(device, dtype)[1]).removeprefix("torch.") != config.get("dtype"):
            raise InvalidInputError(f"the engine was built in {config.get('dtype')}; its dtype cannot be changed "
                                    f"at load time (got {dtype})")
        bias = embedding_bias(model_dir, _DTYPES[config.get("logits_dtype", "float32")])  # before the slow part
        self._trtllm = trtllm
        self.enable_kv_cache_reuse = enable_kv_cache_reuse
        runner = ModelRunnerCpp.from_dir(
            engine_dir=str(engine_dir), rank=tensorrt_llm.mpi_rank(),
            kv_cache_free_gpu_memory_fraction=kv_cache_free_gpu_memory_fraction,
            kv_cache_enable_block_reuse=enable_kv_cache_reuse,
            max_tokens_in_paged_kv_cache=max_tokens_in_paged_kv_cache)
        max_seq_len = min(runner.max_seq_len, max_model_len or runner.max_seq_len)  # prompt + generated
        self._start(runner.executor, runner.vocab_size, runner.max_input_len, max_seq_len, bias)

    def _start(self, executor, vocab_size: int, max_input_len: int, max_seq_len: int, bias: torch.Tensor) -> None:
        if bias.numel() != vocab_size:
            raise ModelLoadError(f"the head bias has {bias.numel()} entries but the engine's vocabulary is "
                                 f"{vocab_size}: engine and HuggingFace directory do not belong together")
        self.executor, self.vocab_size, self.bias = executor, vocab_size, bias
        self.max_input_len, self.max_seq_len = max_input_len, max_seq_len
        self._lock = threading.Lock()
        self._by_request_id: dict[str, _Request] = {}
        self._by_executor_id: dict[int, _Request] = {}
        self._warned_ras = False
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve_responses, name="trtllm-responses", daemon=True)
        self._thread.start()

    # ---- LLMBackend ---------------------------------------------------------------------------
    def generate_stream(self, prompt_ids, params: SamplingParams, request_id: str | None = None) -> TokenStream:
        ids = validate_prompt_ids(prompt_ids, self.vocab_size)
        params.validate()
        if len(ids) > self.max_input_len or len(ids) >= self.max_seq_len:
            raise InvalidInputError(f"prompt has {len(ids)} tokens; this engine takes at most "
                                    f"{min(self.max_input_len, self.max_seq_len - 1)} (trtllm-build --max_input_len)")
        if params.ras and params.temperature > 0 and not self._warned_ras:
            self._warned_ras = True
            log.warning("TensorRT-LLM has no repetition-aware sampling; ras=True is ignored")
        seed = params.seed if params.seed is not None else random_seed()
        trtllm = self._trtllm
        executor_request = trtllm.Request(
            input_token_ids=ids, max_tokens=min(params.max_tokens, self.max_seq_len - len(ids)), streaming=True,
            sampling_config=trtllm.SamplingConfig(**sampling_config_kwargs(params, seed)),
            output_config=trtllm.OutputConfig(exclude_input_from_output=True),
            pad_id=END_ID, embedding_bias=self.bias, **stop_kwargs(params))
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        request = _Request(request_id, TokenStream(request_id, lambda: self.cancel(request_id)))
        with self._lock:  # held across enqueue so that no response can arrive before the request is known
            if request_id in self._by_request_id:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            request.executor_id = self.executor.enqueue_request(executor_request)
            self._by_request_id[request_id] = request
            self._by_executor_id[request.executor_id] = request
        return request.stream

    def cancel(self, request_id: str) -> bool:
        request = self._forget_request_id(request_id)
        if request is None:
            return False
        self.executor.cancel_request(request.executor_id)
        request.stream.put(cancelled_error(request_id))
        return True

    def register_prefix(self, key: str, ids: list[int]) -> None:
        validate_prompt_ids(ids, self.vocab_size)
        if self.enable_kv_cache_reuse:  # one pass over the prefix leaves its KV blocks reusable
            self.generate(ids, SamplingParams.greedy(max_tokens=1, ras=False))

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        with self._lock:
            pending = list(self._by_request_id.values())
            self._by_request_id.clear()
            self._by_executor_id.clear()
        for request in pending:
            request.stream.put(Finished("error", TrtllmRequestError("the trtllm backend was closed")))
        self.executor.shutdown()

    # ---- response thread ----------------------------------------------------------------------
    def _forget_request_id(self, request_id: str) -> _Request | None:
        with self._lock:
            request = self._by_request_id.pop(request_id, None)
            if request is not None:
                self._by_executor_id.pop(request.executor_id, None)
            return request

    def _serve_responses(self) -> None:
        while not self._closing.is_set():
            for response in self.executor.await_responses(timeout=RESPONSE_POLL):
                with self._lock:
                    request = self._by_executor_id.get(response.request_id)
                if request is not None:  # None: cancelled, its late responses are dropped
                    self._dispatch(request, response)

    def _dispatch(self, request: _Request, response) -> None:
        if response.has_error():
            self._finish(request, Finished("error", TrtllmRequestError(response.error_msg)))
            return
        result = response.result
        for token in result.output_token_ids[0]:
            if SPEECH_TOKEN_OFFSET <= token < SPEECH_TOKEN_OFFSET + NUM_SPEECH_TOKENS:
                request.stream.put(token - SPEECH_TOKEN_OFFSET)
            elif token in EOS_IDS:  # a stop word (or the end id, where the executor returns it)
                self._finish(request, Finished("stop"))
                return
            else:
                self._finish(request, Finished("error", TrtllmRequestError(
                    f"the engine produced token {token}, which is neither speech nor end of speech: "
                    "was it built from another model, or did the request lose its embedding_bias?")))
                return
        if result.is_final:
            reason = _FINISH.get(result.finish_reasons[0].name, "length")
            self._finish(request, cancelled_error(request.request_id) if reason == "cancelled" else Finished(reason))

    def _finish(self, request: _Request, event: Finished) -> None:
        if self._forget_request_id(request.request_id) is request:
            request.stream.put(event)
