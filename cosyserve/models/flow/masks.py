"""Attention masks shared by the encoder and the estimator (True = may attend)."""

from __future__ import annotations

import torch


def chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Block-causal (size, size) mask: query i sees keys of its own chunk and earlier ones.

    Chunks are counted from position 0; ``num_left_chunks < 0`` keeps every earlier chunk,
    otherwise only that many chunks to the left of the query's own.
    """
    chunk_of = torch.arange(size, device=device) // chunk_size
    query, key = chunk_of[:, None], chunk_of[None, :]
    visible = key <= query
    if num_left_chunks >= 0:
        visible &= key >= query - num_left_chunks
    return visible
