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
def _rotate(ptr, dims, rotated, cos, sin):
    """Rotary embedding of one head, rounded like the reference: ``(x*cos) + roll(x)*sin``."""
    dtype = ptr.dtype.element_ty
    x = tl.load(ptr + dims).to(tl.float32)
    x_rolled = tl.load(ptr + rotated).to(tl.float32)
    return ((x * cos).to(dtype).to(tl.float32) + x_rolled * sin).to(dtype)


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, qkv_row_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
    k_cache_ptr, v_cache_ptr, cache_slot_stride, cache_head_stride, cache_pos_stride,
    out_ptr, scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One (row, query head): rotate q and the row's new k, store the new k/v in the cache (one
    writer per kv head), attend over cached positions 0..pos-1 plus the new key (online softmax in
    float32). The new key comes from registers, so no program reads what this launch writes."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    dtype = qkv_ptr.dtype.element_ty
    position = tl.load(positions_ptr + row).to(tl.int32)
    slot = tl.load(slots_ptr + row)
    dims = tl.arange(0, HEAD_DIM)
    rotated = (dims + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + position * HEAD_DIM + dims).to(tl.float32)
    sin = tl.load(sin_ptr + position * HEAD_DIM + dims).to(tl.float32)

    qkv_row = qkv_ptr + row * qkv_row_stride
    q = _rotate(qkv_row + head * HEAD_DIM, dims, rotated, cos, sin).to(tl.float32)
    k_new = _rotate(qkv_row + (NUM_HEADS + kv_head) * HEAD_DIM, dims, rotated, cos, sin)
    v_new = tl.load(qkv_row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + dims)
    cache_offset = slot * cache_slot_stride + kv_head * cache_head_stride
    if head % (NUM_HEADS // NUM_KV_HEADS) == 0:
        tl.store(k_cache_ptr + cache_offset + position * cache_pos_stride + dims, k_new)
        tl.store(v_cache_ptr + cache_offset + position * cache_pos_stride + dims, v_new)

    # Running max, normaliser and weighted sum, seeded with the new key.
    score_new = tl.sum(q * k_new.to(tl.float32), axis=0) * scale
    running_max = tl.zeros([1], dtype=tl.float32) + score_new
    normaliser = tl.zeros([1], dtype=tl.float32) + 1.0
    acc = v_new.to(tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(0, position, BLOCK_N):
        keys_at = start + offsets
        visible = keys_at < position
        tile = cache_offset + keys_at[:, None] * cache_pos_stride + dims[None, :]
        keys = tl.load(k_cache_ptr + tile, mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        probs = tl.exp(scores - new_max)
        correction = tl.exp(running_max - new_max)
        values = tl.load(v_cache_ptr + tile, mask=visible[:, None], other=0.0).to(tl.float32)
        normaliser = normaliser * correction + tl.sum(probs, axis=0)
        acc = acc * correction + tl.sum(probs[:, None] * values, axis=0)
        running_max = new_max
    out = acc / normaliser
    tl.store(out_ptr + row * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + dims, out.to(dtype))


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     num_heads: int, scale: float) -> torch.Tensor:
    batch = qkv.shape[0]
    _, num_kv_heads, _, head_dim = k_cache.shape
    out = torch.empty(batch, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    _decode_attention_kernel[(batch, num_heads)](
        qkv, qkv.stride(0), cos, sin, positions, slots,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out, scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_N=64, num_warps=4,
    )
    return out
