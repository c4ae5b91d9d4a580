"""What every request to a CosyVoice2 TensorRT-LLM engine must carry besides the prompt.

* ``embedding_bias``: TensorRT-LLM builds the Qwen ``lm_head`` without a bias (and its checkpoint
  loader drops a provided ``lm_head.bias`` with a warning), so the CosyVoice2 head bias is added
  per request: the executor's ``embedding_bias`` is a vector over the vocabulary added to the
  logits before sampling. Without it text tokens, ``<|sos|>``, ``<|task_id|>`` and padding rows
  score 0 instead of -inf and the trained speech-token biases are missing (``llm_layout.md`` §2).
* ``end_id`` ``<|eos1|>`` plus ``<|eos2|>``/``<|eos3|>`` as stop words: all three end the speech.

Used by the ``trtllm`` backend (executor requests), by a BLS calling a Triton LLM model
(:class:`TritonLLMInputs`: protocol ``tensorrt_llm`` for NVIDIA's ``tensorrt_llm`` model,
``cosyserve`` for this package's ``llm`` model, whose engine applies the head bias itself), and
by the ``llm`` model to check what a TensorRT-LLM caller sends it (:func:`check_embedding_bias`,
:func:`check_stop_words`, :func:`request_seed`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ...errors import InvalidInputError, ModelLoadError
from ..models.loader import checkpoint_files
from ..prompt import EOS_IDS, OUTPUT_WINDOW_SIZE, OUTPUT_WINDOW_START, SOS_ID
from ..sampling import SamplingParams

# Stands in for the bias's -inf rows: exp() of it underflows to exactly 0 like -inf, while
# arithmetic on it (penalties, temperature, max-subtraction) can never produce NaN.
MASKED_LOGIT = -1.0e9
END_ID = EOS_IDS[0]
STOP_WORDS = [[token] for token in EOS_IDS[1:]]
# An id the head bias masks, so it is never sampled: the end id of requests that ignore eos.
NEVER_SAMPLED_ID = SOS_ID
_WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)
# What the requests of a BLS to a Triton LLM model carry (see TritonLLMInputs).
PROTOCOLS = ("cosyserve", "tensorrt_llm")
# A received embedding_bias may differ from the head bias by this much (an fp16 round trip does).
BIAS_TOLERANCE = 1e-3


def read_tensor(llm_dir: Path, name: str) -> torch.Tensor | None:
    """One tensor of a HuggingFace safetensors checkpoint, or None when no shard has it."""
    for path in checkpoint_files(llm_dir):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


def lm_head_bias(state_or_dir: dict[str, torch.Tensor] | str | Path) -> torch.Tensor:
    """``lm_head.bias`` as float32, checked: finite on the speech+eos rows, -inf everywhere else."""
    if isinstance(state_or_dir, dict):
        bias = state_or_dir.get("lm_head.bias")
    else:
        bias = read_tensor(Path(state_or_dir), "lm_head.bias")
    if bias is None:
        raise ModelLoadError("the checkpoint has no lm_head.bias: the CosyVoice2 LLM head needs its bias (-inf "
                             "outside the speech rows); was it saved by a loader that drops it (stock transformers)?")
    bias = bias.float()
    outside = torch.ones_like(bias, dtype=torch.bool)
    outside[_WINDOW] = False
    if not torch.isfinite(bias[_WINDOW]).all():
        raise ModelLoadError("lm_head.bias is not finite on the speech/eos rows")
    if not (bias[outside] == float("-inf")).all():
        raise ModelLoadError("lm_head.bias is finite outside the speech/eos rows; text, <|sos|>, <|task_id|> "
                             "and padding rows must be -inf in the CosyVoice2 head")
    return bias


def embedding_bias(llm_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``embedding_bias`` that puts the CosyVoice2 head bias into an engine: ``[vocab_size]``.

    The executor checks the length against the model's (unpadded) vocabulary and adds the batch
    dimension itself; the Triton ``tensorrt_llm`` model takes it as ``[1, vocab_size]``. Rows
    that are -inf in the checkpoint hold :data:`MASKED_LOGIT`. ``dtype`` must be the engine's
    logits dtype (the executor refuses others): float32 unless built with ``--logits_dtype``.
    """
    bias = lm_head_bias(llm_dir)
    return bias.masked_fill(~torch.isfinite(bias), MASKED_LOGIT).to(dtype)


def triton_stop_words_list() -> np.ndarray:
    """``stop_words_list`` for the Triton model: ``[1, 2, n]`` int32 (flat tokens, end offsets)."""
    tokens = [token for word in STOP_WORDS for token in word]
    offsets = np.cumsum([len(word) for word in STOP_WORDS])
    return np.array([[tokens, offsets]], dtype=np.int32)


# ----- requests to a Triton LLM model (TensorRT-LLM's tensor interface) ----------------------------

def resolve_protocol(protocol: str | None, model_name: str) -> str:
    """``protocol`` when given, else by the model's name: ``tensorrt_llm`` for the model of that
    name (NVIDIA's backend), ``cosyserve`` for any other (this package's ``llm`` model)."""
    return _known_protocol(protocol or ("tensorrt_llm" if model_name == "tensorrt_llm" else "cosyserve"))


def _known_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise InvalidInputError(f"llm_protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    return protocol


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype)


class TritonLLMInputs:
    """The input tensors (batch dimension 1) of requests to a Triton LLM model.

    ``cosyserve`` (the ``llm`` model, which has the head bias in its engine): prompt, limits,
    ``end_id``/``pad_id`` <|eos1|>, sampling, ``random_seed`` and ``streaming``. ``tensorrt_llm``:
    also ``embedding_bias`` (the head bias, ``[1, vocab]`` float32, read from ``llm_dir`` once),
    ``stop_words_list`` (<|eos2|>, <|eos3|>) and the seed under its current name ``seed`` as well
    (TensorRT-LLM's Triton backend read ``random_seed`` before, ``seed`` now). ``end_id``: the
    model's end-of-speech id (CosyVoice3: <|eos1|> 158486).
    """

    def __init__(self, protocol: str, sampling: SamplingParams, streaming: bool, llm_dir: str | Path | None = None,
                 end_id: int = END_ID):
        self.protocol = _known_protocol(protocol)
        s = sampling
        self.fixed = {
            "end_id": _scalar(end_id, np.int32), "pad_id": _scalar(end_id, np.int32),
            "runtime_top_p": _scalar(s.top_p, np.float32), "runtime_top_k": _scalar(s.top_k, np.int32),
            "temperature": _scalar(s.temperature, np.float32),
            "repetition_penalty": _scalar(s.repetition_penalty, np.float32),
            "streaming": _scalar(streaming, np.bool_),
        }
        seeds = ("random_seed",)
        if self.protocol == "tensorrt_llm":
            if llm_dir is None:
                raise InvalidInputError("the tensorrt_llm protocol needs llm_dir, the HuggingFace LLM directory "
                                        "whose lm_head.bias becomes each request's embedding_bias")
            self.fixed["embedding_bias"] = embedding_bias(llm_dir).numpy()[None]
            self.fixed["stop_words_list"] = triton_stop_words_list()
            seeds = ("random_seed", "seed")
        if s.seed is not None:  # None: each engine draws its own
            self.fixed.update((name, _scalar(s.seed, np.uint64)) for name in seeds)

    def generate(self, prompt_ids: list[int], max_tokens: int, min_tokens: int = 0) -> dict[str, np.ndarray]:
        """The inputs of one generation request."""
        ids = np.asarray(prompt_ids, np.int32)[None]
        inputs = {"input_ids": ids, "input_lengths": _scalar(ids.shape[1], np.int32),
                  "request_output_len": _scalar(max_tokens, np.int32), **self.fixed}
        if min_tokens:  # optional in TensorRT-LLM's interface: only sent when used
            inputs["min_tokens"] = _scalar(min_tokens, np.int32)
        return inputs

    @staticmethod
    def stop() -> dict[str, np.ndarray]:
        """The inputs of a request that stops the in-flight request of the same request id."""
        return {"input_ids": _scalar(END_ID, np.int32), "input_lengths": _scalar(1, np.int32),
                "request_output_len": _scalar(1, np.int32), "stop": _scalar(True, np.bool_)}


# ----- what an engine with the head bias built in accepts from a TensorRT-LLM caller -------------

def check_embedding_bias(bias: np.ndarray, head_bias: np.ndarray) -> None:
    """One request's ``embedding_bias`` (no batch dimension), sent to an engine whose head already
    adds ``head_bias`` (:func:`embedding_bias` of its checkpoint): it must be that bias (already
    applied) or zeros (nothing to add); any other bias would change the logits, which such an
    engine cannot do."""
    if bias.shape != head_bias.shape:
        raise InvalidInputError(f"embedding_bias has shape {[1, *bias.shape]}; this model's vocabulary needs "
                                f"[1, {head_bias.size}] (the lm_head bias of its checkpoint)")
    if not bias.any():
        return
    kept = head_bias > MASKED_LOGIT
    if not (np.allclose(bias[kept], head_bias[kept], rtol=BIAS_TOLERANCE, atol=BIAS_TOLERANCE)
            and (bias[~kept] <= MASKED_LOGIT).all()):
        raise InvalidInputError("embedding_bias is neither zeros nor the lm_head bias of this model's checkpoint "
                                "(cosyserve.llm.trtllm.request.embedding_bias); this engine applies that bias itself "
                                "and cannot add another: was the caller given another model's directory?")


def decode_stop_words(stop_words_list: np.ndarray) -> list[list[int]]:
    """TensorRT-LLM's ``[2, n]`` stop words (the words' tokens one after another; their end
    offsets, padded with -1) -> the words."""
    if stop_words_list.ndim != 2 or stop_words_list.shape[0] != 2:
        raise InvalidInputError(f"stop_words_list has shape {[1, *stop_words_list.shape]}; TensorRT-LLM's format is "
                                "[1, 2, n]: the words' tokens one after another, then their end offsets (-1 padded)")
    tokens, offsets = stop_words_list[0].tolist(), stop_words_list[1].tolist()
    ends = offsets[:offsets.index(-1)] if -1 in offsets else offsets
    words, start = [], 0
    for end in ends:
        if not start < end <= len(tokens):
            raise InvalidInputError(f"stop_words_list offsets {offsets} are not increasing word ends within its "
                                    f"{len(tokens)} tokens")
        words.append(tokens[start:end])
        start = end
    return words


def check_stop_words(stop_words_list: np.ndarray, end_id: int | None) -> None:
    """An engine that ends every request at each end-of-speech id, and at nothing else, honours
    ``stop_words_list`` only when the words and ``end_id`` (default <|eos1|>) are exactly those ids."""
    stops = {END_ID if end_id is None else end_id}
    for word in decode_stop_words(stop_words_list):
        if len(word) != 1 or word[0] not in EOS_IDS:
            raise InvalidInputError(f"stop word {word} is not one end-of-speech id {list(EOS_IDS)}: "
                                    "this model stops at those ids only")
        stops.add(word[0])
    if stops != set(EOS_IDS):
        raise InvalidInputError(f"end_id and stop_words_list stop at {sorted(stops)}, but this model always stops "
                                f"at every end-of-speech id {list(EOS_IDS)}: send those besides end_id as stop words")


def request_seed(seed: int | None, random_seed: int | None) -> int | None:
    """The seed of a request that may name it ``seed`` (current TensorRT-LLM) or ``random_seed`` (older)."""
    if seed is not None and random_seed is not None and seed != random_seed:
        raise InvalidInputError(f"seed {seed} and random_seed {random_seed} differ; they name the same seed "
                                "(current and older TensorRT-LLM): send one, or both equal")
    return random_seed if seed is None else seed
