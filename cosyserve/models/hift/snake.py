"""Snake activation of the HiFT vocoder: x + sin²(αx)/(α + 1e-9), per-channel α (linear scale).

HiFT runs ~70 Snakes per call and at streaming sizes is bound by kernel launches, so on CUDA the
activation is one Triton kernel (:func:`snake`); elsewhere it is the PyTorch reference
(:func:`snake_reference`), whose float32 arithmetic is upstream's.

Half precision: released checkpoints hold a few |α| below 1.5e-5, whose reciprocal exceeds the
float16 range (65504), and an α that rounds to 0 in float16 gives 1/1e-9. The reference therefore
takes the reciprocal in float32 and clamps it to the compute dtype's range (sin²(αx) ≈ (αx)² is
then tiny, so the term stays finite and correct to rounding); the kernel computes the whole
expression in float32 and rounds only the result.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# Upstream's guard against division by zero (HiFT's Snake, "no_div_by_zero").
ALPHA_EPS = 1e-9
# Elements of one (row, channel) time line handled by one kernel program.
BLOCK_T = 1024


def snake_reference(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x (B, C, T) + sin²(α·x)/(α + 1e-9) with α (C,); PyTorch ops, 4 kernels on a GPU in float32."""
    alpha = alpha[None, :, None]
    if x.dtype == torch.float32:
        return torch.addcmul(x, torch.sin(x * alpha).square_(), (alpha + ALPHA_EPS).reciprocal())
    inverse = (alpha.float() + ALPHA_EPS).reciprocal()
    limit = torch.finfo(x.dtype).max
    inverse = inverse.clamp(-limit, limit).to(x.dtype)
    return torch.addcmul(x, torch.sin(x * alpha.to(x.dtype)).square_(), inverse)


@functools.cache
def _triton_kernel():
    """The fused kernel, compiled lazily (None where Triton is missing)."""
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
    except ImportError:
        return None

    @triton.jit
    def snake_kernel(x_ptr, alpha_ptr, out_ptr, channels, length, eps, BLOCK: tl.constexpr):
        line = tl.program_id(0)  # row * channels + channel
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < length
        alpha = tl.load(alpha_ptr + line % channels).to(tl.float32)
        x = tl.load(x_ptr + line * length + offsets, mask=inside).to(tl.float32)
        s = libdevice.sin(alpha * x)  # the precise sine: the float32 path stays at upstream's rounding
        y = x + s * s * (1.0 / (alpha + eps))
        tl.store(out_ptr + line * length + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)

    return snake_kernel


def fused_snake_available(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_kernel() is not None


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake of x (B, C, T) with α (C,): one Triton kernel on CUDA (float32 arithmetic inside),
    :func:`snake_reference` elsewhere."""
    if torch.compiler.is_compiling() or not fused_snake_available(x):  # inductor fuses the reference itself
        return snake_reference(x, alpha)
    x = x.contiguous()
    out = torch.empty_like(x)
    batch, channels, length = x.shape
    if out.numel():
        grid = (batch * channels, -(-length // BLOCK_T))
        _triton_kernel()[grid](x, alpha, out, channels, length, ALPHA_EPS, BLOCK=BLOCK_T)
    return out


class Snake(nn.Module):
    """x + sin²(αx)/α with a learned per-channel α (linear scale)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha)
