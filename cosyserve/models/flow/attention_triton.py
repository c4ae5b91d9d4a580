"""The estimator's attention over packed rows as one Triton kernel (GPU, fp16/bf16): a flash-attention
forward pass whose mask is computed from per-row positions instead of read from a dense bias.

Row ``r`` of a packed step (:class:`~.fused.StepRows`) has ``context[r]`` cached frames in key slots
``[0, context[r])`` (positions 0..), ``slots`` slots in all, then ``frames`` new frames whose first
``valid[r]`` are real (positions ``context[r]`` on). A real query at position p sees:

* the real keys (cached frames below ``context[r]``, new frames below ``valid[r]``),
* of its own block or earlier ones, blocks being ``chunk`` positions from position 0 (block-causal),
  no earlier than ``left_chunks`` blocks back (when that is >= 0); a ``chunk`` past every position
  gives full attention.

This is the mask :meth:`~.fused.FusedEstimator.rows` builds as a bias for SDPA. Padding queries (from
``valid[r]`` on) are written as zeros: nothing real attends to a padding frame.

What the dense bias cannot skip, the kernel does not compute: key tiles past the row's real keys or
its block, query tiles past its real frames. A prompt's solve (no context, blocks of 50 frames, rows
padded to the bucket of the longest) visits ~a third of the query-key pairs that SDPA computes.
Rows, frames, heads and the key loop bounds are data: one launch serves any packing of a captured
shape (CUDA graphs replay it with new positions).

Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests check it against SDPA that way).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend(acc, l_i, m_i, q, k_base, v_base, kv_si, first, end, key_pos0, q_block, offs_d,
            qk_scale, chunk, LEFT_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over keys [first, end) of one range (cached slots, or new frames): key j is
    at k_base + j * kv_si, its position key_pos0 + j; scores in log2 units (``qk_scale``)."""
    for start in range(first, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        k = tl.load(k_base + offs_n[None, :] * kv_si + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale
        k_block = (key_pos0 + offs_n) // chunk
        ok = key_ok[None, :] & (k_block[None, :] <= q_block[:, None])
        if LEFT_CHUNKS >= 0:
            ok = ok & (k_block[None, :] >= q_block[:, None] - LEFT_CHUNKS)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * kv_si + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_kernel(q_ptr, q_sr, q_si, kv_ptr, kv_sr, kv_si, o_ptr, o_sr, o_si, valid_ptr, context_ptr,
                      FRAMES, SLOTS, INNER, chunk, qk_scale, LEFT_CHUNKS: tl.constexpr, HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_rh = tl.program_id(1)
    r = pid_rh // HEADS
    h = pid_rh % HEADS
    valid = tl.load(valid_ptr + r)
    context = tl.load(context_ptr + r)
    q0 = pid_m * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_real = offs_m < valid
    q = tl.load(q_ptr + r * q_sr + offs_m[:, None] * q_si + h * HEAD_DIM + offs_d[None, :],
                mask=q_real[:, None], other=0.0)
    q_block = (context + offs_m) // chunk
    # the tile's key range: up to the end of its last real query's block; from LEFT_CHUNKS blocks
    # before its first query's (a tile of padding queries only: an empty range)
    last = tl.minimum(q0 + BLOCK_M, valid) - 1
    new_end = tl.minimum(valid, ((context + last) // chunk + 1) * chunk - context)
    new_end = tl.where(q0 < valid, new_end, 0)
    cached_first = 0
    new_first = 0
    if LEFT_CHUNKS >= 0:
        lowest = ((context + q0) // chunk - LEFT_CHUNKS) * chunk  # first visible position
        cached_first = tl.maximum(tl.minimum(lowest, context), 0)
        new_first = tl.minimum(tl.maximum(lowest - context, 0), new_end)
    cached_end = tl.where(q0 < valid, context, 0)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    k_base = kv_ptr + r * kv_sr + h * HEAD_DIM
    v_base = k_base + INNER
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, kv_si, cached_first, cached_end, 0, q_block,
                            offs_d, qk_scale, chunk, LEFT_CHUNKS, BLOCK_N)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base + SLOTS * kv_si, v_base + SLOTS * kv_si, kv_si, new_first,
                            new_end, context, q_block, offs_d, qk_scale, chunk, LEFT_CHUNKS, BLOCK_N)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = tl.where(q_real[:, None], out, 0.0)
    tl.store(o_ptr + r * o_sr + offs_m[:, None] * o_si + h * HEAD_DIM + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(offs_m < FRAMES)[:, None])


def _tile(frames: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, stages)."""
    return (64, 64, 4, 2) if frames > 32 else (32, 64, 4, 2)


def block_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, context: torch.Tensor, slots: int,
                    heads: int, chunk: int, left_chunks: int, out: torch.Tensor,
                    tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q (R, frames, inner), kv (R, slots + frames, 2 inner) [keys ‖ values], valid and context (R,)
    int32 -> ``out`` (R, frames, inner); see the module docstring.
    ``tile``: (block_m, block_n, warps, stages) instead of the built-in choice (for tuning)."""
    rows, frames, inner = q.shape
    head_dim = inner // heads
    if q.stride(2) != 1 or kv.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("attention needs channels contiguous in q, kv and out")
    block_m, block_n, warps, stages = tile or _tile(frames)
    grid = (triton.cdiv(frames, block_m), rows * heads)
    _attention_kernel[grid](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), out, out.stride(0), out.stride(1),
        valid, context, frames, slots, inner, chunk, _LOG2E / math.sqrt(head_dim), LEFT_CHUNKS=left_chunks,
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out
