"""What every request to a CosyVoice2 TensorRT-LLM engine must carry besides the prompt.

* ``embedding_bias``: TensorRT-LLM builds the Qwen ``lm_head`` without a bias (and its checkpoint
  loader drops a provided ``lm_head.bias`` with a warning), so the CosyVoice2 head bias is added
  per request: the executor's ``embedding_bias`` is a vector over the vocabulary added to the
  logits before sampling. Without it text tokens, ``<|sos|>``, ``<|task_id|>`` and padding rows
  score 0 instead of -inf and the trained speech-token biases are missing (``llm_layout.md`` §2).
* ``end_id`` ``<|eos1|>`` plus ``<|eos2|>``/``<|eos3|>`` as stop words: all three end the speech.

Used by the ``trtllm`` backend (executor requests) and by a BLS calling the Triton
``tensorrt_llm`` model (:func:`triton_stop_words_list`, and the bias with a batch dimension).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from ..llm.models.loader import checkpoint_files
from ..llm.prompt import EOS_IDS, OUTPUT_WINDOW_SIZE, OUTPUT_WINDOW_START, SOS_ID

# Stands in for the bias's -inf rows: exp() of it underflows to exactly 0 like -inf, while
# arithmetic on it (penalties, temperature, max-subtraction) can never produce NaN.
MASKED_LOGIT = -1.0e9
END_ID = EOS_IDS[0]
STOP_WORDS = [[token] for token in EOS_IDS[1:]]
# An id the head bias masks, so it is never sampled: the end id of requests that ignore eos.
NEVER_SAMPLED_ID = SOS_ID
_WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)


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
