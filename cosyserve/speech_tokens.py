"""The one check of speech token ids at token2wav's door: raw codes of the speech tokenizer, not
LLM ids (an LLM's speech token ``k`` is ``layout.speech_token_offset + k``: shift it back first)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import InvalidInputError


def speech_token_ids(tokens: Any, vocab_size: int, name: str = "speech tokens") -> torch.Tensor:
    """``tokens`` (a sequence, array or tensor; (n,) or (1, n)) as a 1-D int64 CPU tensor, or
    InvalidInputError naming ``name`` unless every id is an integer in 0..vocab_size-1. No device
    work: a kind checks a chunk before it starts anything."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.size == 0:
        return torch.zeros(0, dtype=torch.long)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InvalidInputError(f"{name} must be a 1-D sequence of integer ids; got {array.dtype} of shape "
                                f"{array.shape}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise InvalidInputError(f"{name}: speech token ids must be in 0..{vocab_size - 1} (raw codes; shift LLM ids "
                                f"back first); got ids in {low}..{high}")
    return torch.from_numpy(array.astype(np.int64))
