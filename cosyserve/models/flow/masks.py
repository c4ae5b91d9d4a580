"""Attention masks shared by the encoder and the estimator (True = may attend)."""

from __future__ import annotations

import torch


def chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1,
               device: torch.device | str = "cpu", query_start: int = 0) -> torch.Tensor:
    """Block-causal (size, query_start + size) mask: query i sees keys of its own chunk and earlier ones.

    Queries sit at positions [query_start, query_start + size), keys at [0, query_start + size)
    (a stream window attends to the cached positions before it). Chunks are counted from
    position 0; ``num_left_chunks < 0`` keeps every earlier chunk, otherwise only that many
    chunks to the left of the query's own.
    """
    end = query_start + size
    query = torch.arange(query_start, end, device=device)[:, None] // chunk_size
    key = torch.arange(end, device=device)[None, :] // chunk_size
    visible = key <= query
    if num_left_chunks >= 0:
        visible &= key >= query - num_left_chunks
    return visible


def key_padding_mask(valid_end: torch.Tensor, key_len: int) -> torch.Tensor:
    """(B, 1, key_len) mask of the keys before each item's ``valid_end`` (B,)."""
    keys = torch.arange(key_len, device=valid_end.device)
    return (keys[None, :] < valid_end[:, None]).unsqueeze(1)


def attention_mask(queries: int, query_start: int, chunk_size: int | None, valid_end: torch.Tensor | None,
                   device: torch.device, num_left_chunks: int = -1) -> torch.Tensor | None:
    """Bool (B or 1, queries or 1, query_start + queries) mask, or None when everything is visible.

    ``chunk_size`` None = full attention, else block-causal; ``valid_end`` (B,) hides each item's
    keys from that position on (padding, look-ahead-only positions), None hides none.
    """
    mask = None
    if chunk_size is not None:
        mask = chunk_mask(queries, chunk_size, num_left_chunks, device, query_start)[None]
    if valid_end is not None:
        keys = key_padding_mask(valid_end, query_start + queries)
        mask = keys if mask is None else mask & keys
    return mask
