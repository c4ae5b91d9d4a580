"""The fused decode step's operations: a Triton kernel where Triton can run it, else PyTorch.

Triton runs a kernel on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (how the CPU
tests check the kernels themselves). Elsewhere every function computes the same thing with the
plain PyTorch reference ops, so the fused model structure also runs (and is tested) on the CPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .attention import DecodeMetadata, attention, decode_bias

try:
    from . import triton_kernels
except ImportError:  # Triton is not installed (it ships with CUDA builds of torch on Linux)
    triton_kernels = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(tensor: torch.Tensor) -> bool:
    return triton_kernels is not None and (tensor.is_cuda or INTERPRET)


def fused_decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused decode path is the default: CUDA with Triton, in bf16 or fp16 (float32
    keeps the reference path, which is exact against transformers), unless the environment sets
    ``COSYSERVE_LLM_FUSED_DECODE=0`` (to compare or rule out the kernels in a server)."""
    return (triton_kernels is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("COSYSERVE_LLM_FUSED_DECODE", "1") != "0")


def rms_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if triton_runs_on(residual):
        return triton_kernels.rms_norm(None, residual, weight, eps)
    return F.rms_norm(residual, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place; returns ``rms_norm(residual)``."""
    if triton_runs_on(residual):
        return triton_kernels.rms_norm(x, residual, weight, eps)
    residual.add_(x)
    return F.rms_norm(residual, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(rows, 2 * size) [gate | up] -> silu(gate) * up."""
    if triton_runs_on(gate_up):
        return triton_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def decode_attention(qkv: torch.Tensor, rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: DecodeMetadata, num_heads: int, scale: float) -> torch.Tensor:
    """Rotary embedding of q and k, the cache write of k and v, and attention for one decode token
    per row. qkv: (batch, (heads + 2 * kv_heads) * head_dim). Returns (batch, heads * head_dim)."""
    if triton_runs_on(qkv):
        return triton_kernels.decode_attention(qkv, rope.cos, rope.sin, meta.positions, meta.slot_ids,
                                               k_cache, v_cache, num_heads, scale, meta.kv_len)
    batch = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    qk = rope(qkv[:, : (num_heads + num_kv_heads) * head_dim].view(batch, -1, head_dim),
              rope.lookup(meta.positions))
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(batch, num_kv_heads, head_dim)
    if meta.bias is None:
        meta = DecodeMetadata(meta.slot_ids, meta.positions, meta.kv_len,
                              decode_bias(meta.positions, meta.kv_len, num_kv_heads, qkv.dtype))
    return attention(qk[:, :num_heads], qk[:, num_heads:], v, k_cache, v_cache, meta, scale)
