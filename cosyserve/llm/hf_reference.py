"""The reference backend: stock transformers Qwen2ForCausalLM with the lm_head bias put back.

Stock ``Qwen2ForCausalLM`` builds ``lm_head`` without a bias and drops ``lm_head.bias`` from the
checkpoint (``llm_layout.md`` §2). :func:`load_hf_model` loads it, checks that the bias is the
only tensor left out, and replaces the head with a biased ``Linear`` holding the same weight.
Generation is a plain forward loop over transformers' KV cache, one request at a time on a
worker thread, sampled by the same :class:`Sampler` as the torch engine (so seeded draws agree).
"""

from __future__ import annotations

import queue
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import InvalidInputError, ModelLoadError
from ..runtime import resolve_device_dtype
from .base import LLMBackend
from .models.loader import checkpoint_files
from .prompt import NUM_SPEECH_TOKENS, OUTPUT_WINDOW_SIZE, OUTPUT_WINDOW_START, validate_prompt_ids
from .sampling import Sampler, SamplingParams, random_seed
from .stream import Finished, TokenStream, cancelled_error

WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)


def _read_tensor(model_dir: Path, name: str) -> torch.Tensor:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise ModelLoadError(f"{model_dir} has no tensor {name!r}; the CosyVoice2 LLM head needs it")


def load_hf_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None):
    """transformers Qwen2ForCausalLM with ``lm_head.bias`` kept (strict: nothing else may be left out)."""
    from transformers import Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    device, dtype = resolve_device_dtype(device, dtype)
    # transformers reports the dropped lm_head.bias as a warning; it is checked and restored below.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = set(info.get("missing_keys", ()))
    unexpected = set(info.get("unexpected_keys", ())) - {"lm_head.bias"}
    mismatched = info.get("mismatched_keys", ())
    if missing or unexpected or mismatched:
        raise ModelLoadError(f"{model_dir}: transformers load was not clean (missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}, mismatched {list(mismatched)})")
    if model.lm_head.bias is None:
        old = model.lm_head
        head = nn.Linear(old.in_features, old.out_features, bias=True, device="meta")
        head.weight = old.weight
        head.bias = nn.Parameter(_read_tensor(model_dir, "lm_head.bias").to(dtype), requires_grad=False)
        model.lm_head = head
    return model.to(device).eval().requires_grad_(False)


@dataclass(eq=False)
class _Request:
    request_id: str
    ids: list[int]
    params: SamplingParams
    seed: int
    stream: TokenStream
    cancelled: bool = False


class HFBackend(LLMBackend):
    """One request at a time through transformers; the parity reference for the torch engine."""

    name = "hf"

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
                 max_model_len: int = 2048):
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model = load_hf_model(model_dir, self.device, self.dtype)
        self.max_model_len = max_model_len
        self.sampler = Sampler(1, self.device)
        self._slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self._lock = threading.Lock()
        self._active: dict[str, _Request] = {}
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="hf-backend", daemon=True)
        self._worker.start()

    def generate_stream(self, prompt_ids, params: SamplingParams, request_id: str | None = None) -> TokenStream:
        ids = validate_prompt_ids(prompt_ids, self.model.config.vocab_size)
        params.validate()
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        stream = TokenStream(request_id, lambda: self.cancel(request_id))
        with self._lock:
            if request_id in self._active:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            request = _Request(request_id, ids, params, params.seed if params.seed is not None else random_seed(), stream)
            self._active[request_id] = request
        self._queue.put(request)
        return stream

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            request = self._active.get(request_id)
            if request is not None:
                request.cancelled = True
            return request is not None

    def register_prefix(self, key: str, ids: list[int]) -> None:
        validate_prompt_ids(ids, self.model.config.vocab_size)  # no prefix cache in the reference

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join()

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 logits over the whole vocabulary at every position of ``ids``: (len, vocab)."""
        return self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0].float().cpu()

    def _work(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                request.stream.put(self._generate(request))
            except Exception as exc:  # reported to this request's reader only
                request.stream.put(Finished("error", exc))
            with self._lock:
                self._active.pop(request.request_id, None)

    @torch.inference_mode()
    def _generate(self, request: _Request) -> Finished:
        ids = request.ids
        window_ids = [t - OUTPUT_WINDOW_START for t in ids if WINDOW.start <= t < WINDOW.stop]
        self.sampler.set_requests([0], [request.params], [request.seed], [window_ids])
        inputs, cache = torch.tensor([ids], device=self.device), None
        for _ in range(min(request.params.max_tokens, self.max_model_len - len(ids))):
            if request.cancelled:
                return cancelled_error(request.request_id)
            out = self.model(input_ids=inputs, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = int(self.sampler.sample(out.logits[:, -1, WINDOW].float(), self._slot)[0])
            if token >= NUM_SPEECH_TOKENS:
                return Finished("stop")
            request.stream.put(token)
            inputs = torch.tensor([[token + OUTPUT_WINDOW_START]], device=self.device)
        return Finished("length")
