"""The DiT's rotary embedding of queries and keys as one Triton kernel (GPU; CPU tensors under
``TRITON_INTERPRET=1``, how the tests check it).

Upstream rotates the first ``dim_head`` channels of the query and key projections (head 0 only).
In PyTorch that is six small kernels for each of the two (a product with cos, the pair swap's
negation and concatenation, a product with sin, the sum, the copy back into the projection), twelve
per block: at real size 264 of a window step's ~840 kernels, ~44 us a block on an H100 for 4 jobs of
512 frames, each kernel too small to fill the GPU. Here one program rotates a tile of frames of
both, in place, with the arithmetic of :func:`~cosyserve.models.cosyvoice3.dit.rotate_leading_`:
``x·cos + rotate_pairs(x)·sin`` in the promoted dtype of x and the angles (float32 or bfloat16), each
product and the sum rounded to it as PyTorch's operators round them. With bfloat16 angles (a bfloat16
flow's) that is bit for bit; with float32 ones the GPU may fuse a product into the sum, which can
change the last float32 bit, below the rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 32  # (batch row, frame) positions a program rotates
ROUNDINGS = {torch.float32: 0, torch.bfloat16: 1}  # the dtypes PyTorch's operators may round to here


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """float32 x, rounded to bfloat16 (to nearest, ties to even) with ROUND 1. In integer arithmetic:
    with a cast to bfloat16 instead, LLVM narrows the product and the sum to bfloat16 and contracts
    them into one ``fma.rn.bf16``, which skips the product's own rounding (seen in the sm_90 PTX)."""
    if ROUND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        x = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _rotate_in_place(ptr, sb, st, b, t, even, ok, cos_e, cos_o, sin_e, sin_o, ROUND: tl.constexpr):
    """One tensor's pairs of a tile of positions: (x_e, x_o) <- (x_e·cos − x_o·sin, x_o·cos + x_e·sin)."""
    x = ptr + b[:, None] * sb + t[:, None] * st + even
    x_e = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    x_o = tl.load(x + 1, mask=ok, other=0.0).to(tl.float32)
    out_e = _rounded(_rounded(x_e * cos_e, ROUND) + _rounded(-x_o * sin_e, ROUND), ROUND)
    out_o = _rounded(_rounded(x_o * cos_o, ROUND) + _rounded(x_e * sin_o, ROUND), ROUND)
    tl.store(x, out_e.to(ptr.dtype.element_ty), mask=ok)
    tl.store(x + 1, out_o.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_pair_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, positions, frames,
                        q_sb, q_st, k_sb, k_st, rot_sb, rot_st,
                        ROWS: tl.constexpr, PAIRS: tl.constexpr, ROUND: tl.constexpr):
    pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = (pos < positions)[:, None]
    b, t = pos // frames, pos % frames
    even = 2 * tl.arange(0, PAIRS)[None, :]
    rot = b[:, None] * rot_sb + t[:, None] * rot_st + even
    cos_e = tl.load(cos_ptr + rot, mask=ok, other=0.0).to(tl.float32)
    cos_o = tl.load(cos_ptr + rot + 1, mask=ok, other=0.0).to(tl.float32)
    sin_e = tl.load(sin_ptr + rot, mask=ok, other=0.0).to(tl.float32)
    sin_o = tl.load(sin_ptr + rot + 1, mask=ok, other=0.0).to(tl.float32)
    _rotate_in_place(q_ptr, q_sb, q_st, b, t, even, ok, cos_e, cos_o, sin_e, sin_o, ROUND)
    _rotate_in_place(k_ptr, k_sb, k_st, b, t, even, ok, cos_e, cos_o, sin_e, sin_o, ROUND)


def rotate_queries_keys_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first ``cos.shape[-1]`` channels of q and k (B, T, C), each channel contiguous
    (stride 1), in place. ``cos``, ``sin`` (T, dim_head) for every row or (B, T, dim_head), of one
    dtype and strides; x and the angles promote to float32 or bfloat16 (:data:`ROUNDINGS`)."""
    batch, frames, _ = q.shape
    if (k.shape != q.shape or k.dtype != q.dtype or q.stride(2) != 1 or k.stride(2) != 1
            or cos.stride() != sin.stride() or cos.dtype != sin.dtype):
        raise ValueError("rotate_queries_keys_ takes q and k of one shape and dtype, channels contiguous, "
                         "and cos, sin alike")
    if cos.shape[-1] % 2 or cos.stride(-1) != 1:
        raise ValueError("cos and sin must have an even, contiguous last dimension")
    rounding = ROUNDINGS.get(torch.promote_types(q.dtype, cos.dtype))
    if rounding is None:
        raise ValueError(f"rotate_queries_keys_ computes in float32 or bfloat16, not {q.dtype} with {cos.dtype}")
    rot_sb = cos.stride(0) if cos.dim() == 3 else 0
    positions = batch * frames
    _rotate_pair_kernel[(triton.cdiv(positions, ROWS_PER_PROGRAM),)](
        q, k, cos, sin, positions, frames, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        rot_sb, cos.stride(-2), ROWS=ROWS_PER_PROGRAM, PAIRS=cos.shape[-1] // 2,
        ROUND=rounding)
