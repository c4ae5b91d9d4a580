"""Triton kernels of the fused decode step (imported only where Triton is installed).

Each kernel replaces several PyTorch kernels of one decode layer; :mod:`.fused` chooses between
them and the PyTorch reference. Where the reference rounds an intermediate to the activation
dtype (bf16/fp16), the kernels round it too, so that both paths agree up to accumulation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, size, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    """One row: ``residual += x`` (rounded to its dtype, stored) when ADD, then
    ``out = rms_norm(residual) * weight`` computed in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    residual = tl.load(residual_ptr + row * size + cols, mask=mask, other=0.0)
    if ADD:
        x = tl.load(x_ptr + row * size + cols, mask=mask, other=0.0)
        residual = (residual.to(tl.float32) + x.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * size + cols, residual, mask=mask)
    value = residual.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(value * value, axis=0) / size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (value * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, size = residual.shape
    out = torch.empty_like(residual)
    _rms_norm_kernel[(rows,)](residual if x is None else x, residual, weight, out, size, eps,
                              ADD=x is not None, BLOCK=triton.next_power_of_2(size), num_warps=4)
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, BLOCK: tl.constexpr):
    """out[r, c] = silu(gate[r, c]) * up[r, c], with silu rounded to the dtype as F.silu does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * 2 * size + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * size + size + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, double = gate_up.shape
    size = double // 2
    out = torch.empty(rows, size, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(size, block))](gate_up, out, size, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotate(ptr, offsets, rotated, cos, sin):
    """Rotary embedding, rounded like the reference: ``(x*cos) + roll(x)*sin`` with ``x*cos`` rounded."""
    dtype = ptr.dtype.element_ty
    x = tl.load(ptr + offsets).to(tl.float32)
    x_rolled = tl.load(ptr + rotated).to(tl.float32)
    return ((x * cos).to(dtype).to(tl.float32) + x_rolled * sin).to(dtype)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """Matrix product with float32 accumulation; exact float32 products when IEEE (float32 inputs)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, qkv_row_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
    k_cache_ptr, v_cache_ptr, cache_slot_stride, cache_head_stride, cache_pos_stride,
    stats_ptr, acc_ptr, scale, num_splits,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr, SPLIT_LEN: tl.constexpr, IEEE: tl.constexpr,
):
    """One (row, kv head, split of SPLIT_LEN cached positions), flash-decoding style.

    The kv head's GROUP query heads are the rows of one matrix product (padded to GROUP_PAD), so
    each key/value tile is read once. q and the row's new key are rotated here; split 0 stores the
    new key/value in the cache (once per kv head) and folds them into its partial result from
    registers, so no program reads what this launch writes. Each split leaves its running max,
    normaliser (``stats``) and unnormalised output (``acc``) for :func:`_combine_splits_kernel`.
    """
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    dtype = qkv_ptr.dtype.element_ty
    position = tl.load(positions_ptr + row).to(tl.int32)
    slot = tl.load(slots_ptr + row)
    dims = tl.arange(0, HEAD_DIM)
    rotated = (dims + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + position * HEAD_DIM + dims).to(tl.float32)
    sin = tl.load(sin_ptr + position * HEAD_DIM + dims).to(tl.float32)

    qkv_row = qkv_ptr + row * qkv_row_stride
    heads = tl.arange(0, GROUP_PAD)
    in_group = heads < group
    q_rows = (kv_head * group + tl.where(in_group, heads, 0))[:, None] * HEAD_DIM
    q = _rotate(qkv_row, q_rows + dims[None, :], q_rows + rotated[None, :], cos[None, :], sin[None, :])
    q = tl.where(in_group[:, None], q, 0.0).to(dtype)
    k_new = _rotate(qkv_row + (NUM_HEADS + kv_head) * HEAD_DIM, dims, rotated, cos, sin)
    v_new = tl.load(qkv_row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + dims)
    cache_offset = slot * cache_slot_stride + kv_head * cache_head_stride
    first = split == 0
    if first:
        tl.store(k_cache_ptr + cache_offset + position * cache_pos_stride + dims, k_new)
        tl.store(v_cache_ptr + cache_offset + position * cache_pos_stride + dims, v_new)

    keys_at = split * SPLIT_LEN + tl.arange(0, SPLIT_LEN)
    visible = keys_at < position
    tile = cache_offset + keys_at[:, None] * cache_pos_stride + dims[None, :]
    keys = tl.load(k_cache_ptr + tile, mask=visible[:, None], other=0.0)
    values = tl.load(v_cache_ptr + tile, mask=visible[:, None], other=0.0)
    scores = _dot(q, tl.trans(keys), IEEE) * scale  # (GROUP_PAD, SPLIT_LEN) fp32
    scores = tl.where(visible[None, :], scores, float("-inf"))
    score_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
    score_new = tl.where(first, score_new, float("-inf"))
    running_max = tl.maximum(tl.max(scores, axis=1), score_new)
    finite_max = tl.where(running_max == float("-inf"), 0.0, running_max)  # an empty split: all zeros
    probs = tl.exp(scores - finite_max[:, None])
    prob_new = tl.exp(score_new - finite_max)
    normaliser = tl.sum(probs, axis=1) + prob_new
    acc = _dot(probs.to(dtype), values, IEEE)
    acc += prob_new[:, None] * v_new.to(tl.float32)[None, :]

    part = (row * NUM_KV_HEADS + kv_head) * num_splits + split
    tl.store(stats_ptr + part * 2 * GROUP_PAD + heads, running_max)
    tl.store(stats_ptr + part * 2 * GROUP_PAD + GROUP_PAD + heads, normaliser)
    tl.store(acc_ptr + (part * GROUP_PAD + heads[:, None]) * HEAD_DIM + dims[None, :], acc)


@triton.jit
def _combine_splits_kernel(stats_ptr, acc_ptr, out_ptr, num_splits,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           GROUP_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """One (row, query head): the softmax-weighted sum of its kv head's split results."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    group: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    kv_head = head // group
    member = head % group
    splits = tl.arange(0, MAX_SPLITS)
    used = splits < num_splits
    part = (row * NUM_KV_HEADS + kv_head) * num_splits + splits
    split_max = tl.load(stats_ptr + part * 2 * GROUP_PAD + member, mask=used, other=float("-inf"))
    split_sum = tl.load(stats_ptr + part * 2 * GROUP_PAD + GROUP_PAD + member, mask=used, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + (part * GROUP_PAD + member)[:, None] * HEAD_DIM + dims[None, :],
                  mask=used[:, None], other=0.0)
    weights = tl.exp(split_max - tl.max(split_max, axis=0))  # split 0 always holds the new key: finite
    out = tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * split_sum, axis=0)
    tl.store(out_ptr + row * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


SPLIT_LEN = 64


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     num_heads: int, scale: float, kv_len: int) -> torch.Tensor:
    """Two launches: the splits over ``kv_len`` cached positions, then their combination."""
    batch = qkv.shape[0]
    _, num_kv_heads, _, head_dim = k_cache.shape
    group_pad = max(16, triton.next_power_of_2(num_heads // num_kv_heads))  # tl.dot needs >= 16 rows
    num_splits = triton.cdiv(kv_len, SPLIT_LEN)
    parts = batch * num_kv_heads * num_splits
    stats = torch.empty(parts, 2, group_pad, dtype=torch.float32, device=qkv.device)
    acc = torch.empty(parts, group_pad, head_dim, dtype=torch.float32, device=qkv.device)
    common = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, GROUP_PAD=group_pad)
    _decode_attention_kernel[(batch, num_kv_heads, num_splits)](
        qkv, qkv.stride(0), cos, sin, positions, slots,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        stats, acc, scale, num_splits, SPLIT_LEN=SPLIT_LEN,
        IEEE=qkv.dtype == torch.float32, num_warps=4, **common,
    )
    out = torch.empty(batch, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    _combine_splits_kernel[(batch, num_heads)](stats, acc, out, num_splits,
                                               MAX_SPLITS=triton.next_power_of_2(num_splits), num_warps=2, **common)
    return out
