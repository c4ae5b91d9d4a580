"""Attention over the slot KV cache: padded-batch prefill (SDPA) and single-token decode.

Cache layout per layer: ``(slots, kv_heads, max_len, head_dim)``. Row ``b`` of a decode batch is
slot ``b`` (the engine keeps running requests in slots 0..n-1), so decode reads the cache through
a view with no gather. Every call first writes the new keys/values at ``(slot_ids, positions)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillMetadata:
    """A padded batch of ``num_seqs`` rows of ``seq_len`` new tokens (flattened row-major)."""

    slot_ids: torch.Tensor  # (tokens,) slot written by each token; padding goes to the spare slot
    positions: torch.Tensor  # (tokens,) position of each token
    read_slots: torch.Tensor  # (num_seqs,) slot of each row
    # (num_seqs, 1, seq_len, kv_len) bool, True where a key is visible; None when no row has
    # cached tokens: then each row attends causally to its own new tokens only.
    mask: torch.Tensor | None
    num_seqs: int
    seq_len: int


@dataclass
class DecodeMetadata:
    """One new token for each of slots 0..batch_size-1; keys past each row's position are masked."""

    slot_ids: torch.Tensor  # (batch,) = arange(batch)
    positions: torch.Tensor  # (batch,)
    kv_len: int  # keys read per row (a bucket >= every position + 1)
    # (batch * kv_heads, 1, kv_len): 0 for visible keys, -inf after the position. None for the fused
    # decode kernel, which masks by position itself.
    bias: torch.Tensor | None


def decode_bias(positions: torch.Tensor, kv_len: int, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask shared by all layers of one decode step."""
    keys = torch.arange(kv_len, device=positions.device)
    visible = keys[None, :] <= positions[:, None]
    bias = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
    batch = positions.shape[0]
    return bias[:, None, None, :].expand(batch, kv_heads, 1, kv_len).reshape(batch * kv_heads, 1, kv_len)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PrefillMetadata | DecodeMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (tokens, heads, d); k, v: (tokens, kv_heads, d). Returns (tokens, heads * d)."""
    k_cache[meta.slot_ids, :, meta.positions] = k
    v_cache[meta.slot_ids, :, meta.positions] = v
    if isinstance(meta, DecodeMetadata):
        return _decode(q, k_cache, v_cache, meta, scale)
    return _prefill(q, k, v, k_cache, v_cache, meta, scale)


def _prefill(q, k, v, k_cache, v_cache, meta: PrefillMetadata, scale: float) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    rows, length = meta.num_seqs, meta.seq_len
    q = q.reshape(rows, length, heads, head_dim).transpose(1, 2)
    if meta.mask is None:
        # Padding sits after each row's tokens, so plain causal attention is exact for real tokens.
        keys, values = (x.view(rows, length, -1, head_dim).transpose(1, 2) for x in (k, v))
    else:
        kv_len = meta.mask.shape[-1]
        keys = k_cache[:, :, :kv_len].index_select(0, meta.read_slots)
        values = v_cache[:, :, :kv_len].index_select(0, meta.read_slots)
    out = F.scaled_dot_product_attention(q, _repeat_kv(keys, heads), _repeat_kv(values, heads),
                                         attn_mask=meta.mask, is_causal=meta.mask is None, scale=scale)
    return out.transpose(1, 2).reshape(tokens, heads * head_dim)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(rows, kv_heads, len, d) -> (rows, heads, len, d); query head h reads kv head h // group,
    as HF's repeat_kv. (expand + reshape: repeat_interleave with an int synchronises on CUDA.)"""
    rows, kv_heads, length, head_dim = x.shape
    group = heads // kv_heads
    return x[:, :, None].expand(rows, kv_heads, group, length, head_dim).reshape(rows, heads, length, head_dim)


def _decode(q, k_cache, v_cache, meta: DecodeMetadata, scale: float) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    # The `group` query heads sharing a kv head form the rows of one small matrix product, so
    # grouped-query attention needs no copy of the cache.
    q = q.reshape(batch * kv_heads, heads // kv_heads, head_dim)
    keys = k_cache[:batch, :, : meta.kv_len].reshape(batch * kv_heads, meta.kv_len, head_dim)
    values = v_cache[:batch, :, : meta.kv_len].reshape(batch * kv_heads, meta.kv_len, head_dim)
    scores = torch.baddbmm(meta.bias, q, keys.transpose(1, 2), alpha=scale)
    probs = scores.softmax(dim=-1)  # accumulates in float32 even for bf16 scores
    return torch.bmm(probs, values).view(batch, heads * head_dim)
