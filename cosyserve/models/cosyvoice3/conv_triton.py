"""The DiT's grouped position convolutions as one Triton kernel each (GPU; CPU tensors under
``TRITON_INTERPRET=1``, how the tests check it).

The input embedding's two convolutions (1,024 channels in 16 groups of 64, kernel 31) run in cuDNN as
one kernel per group, ~35 us each however few frames a call has, plus layout transposes: ~1.3 ms of
every DiT call on an H100, whose other ~1 ms at a chunk's width is the 22 blocks' ~500 small kernels
(docs/benchmarks.md, twenty-fourth session). Here one program computes a tile of one group's output
channels over a run of frames as an implicit matrix product: the reduction runs over the group's
input channels times the kernel's taps, the weight's own contiguous layout, and the input's tap-shifted
frames are read where they lie (no unfolded copy). Products are summed in float32 and rounded to x's
dtype, then the bias is added and rounded again, as PyTorch's cuDNN path does (its sum runs in another
order, so a bfloat16 result may differ from PyTorch's by a rounding step).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import nn

from .rotary_triton import ROUNDINGS, _rounded

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_FRAMES = 64  # output frames of a program
BLOCK_REDUCE = 64  # (input channel, tap) pairs of one matrix-product step


# frames and the batch stride unspecialised: one build per dtype, made at warm-up, whatever a later call's
# frame count (Triton would otherwise build another for counts divisible by 16 or not)
@triton.jit(do_not_specialize=["frames", "x_sb"])
def _grouped_conv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, frames, x_sb, x_sc,
                         GROUP: tl.constexpr, TAPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                         ROUND: tl.constexpr, PRECISION: tl.constexpr, EXACT_DOT: tl.constexpr):
    block, group, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    out_channels = group * GROUP + tl.arange(0, GROUP)
    x_group = x_ptr + row.to(tl.int64) * x_sb + (group * GROUP).to(tl.int64) * x_sc
    in_frame = t < frames
    acc = tl.zeros((GROUP, BLOCK_T), dtype=tl.float32)
    for start in range(0, GROUP * TAPS, BLOCK_R):
        pairs = start + tl.arange(0, BLOCK_R)  # (input channel, tap) pairs, the weight's order
        real = pairs < GROUP * TAPS
        channel, tap = pairs // TAPS, pairs % TAPS
        w = tl.load(w_ptr + out_channels[:, None].to(tl.int64) * (GROUP * TAPS) + pairs[None, :], mask=real[None, :],
                    other=0.0)
        x = tl.load(x_group + channel[:, None] * x_sc + tap[:, None] + t[None, :],
                    mask=real[:, None] & in_frame[None, :], other=0.0)
        if EXACT_DOT:  # Triton's interpreter: its bfloat16 products come out wrong; float32 ones of the same
            w, x = w.to(tl.float32), x.to(tl.float32)  # values are exact, as a GPU's bfloat16 products are
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
    y = _rounded(_rounded(acc, ROUND) + tl.load(bias_ptr + out_channels)[:, None].to(tl.float32), ROUND)
    out = y_ptr + (row.to(tl.int64) * tl.num_programs(1) * GROUP + out_channels[:, None]) * frames + t[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=in_frame[None, :])


def fits(x: torch.Tensor, conv: nn.Conv1d) -> bool:
    """Whether the kernel takes ``conv(x)``: x (B, C, T + kernel − 1) with its frames contiguous, a grouped
    convolution without padding, stride or dilation whose groups have 16 or more channels, a power of two,
    weight and bias of x's dtype (float32 or bfloat16) and device."""
    channels = conv.in_channels // conv.groups
    return (x.dim() == 3 and x.stride(2) == 1 and x.shape[1] == conv.in_channels == conv.out_channels
            and x.shape[2] >= conv.kernel_size[0] and x.dtype in ROUNDINGS and channels >= 16
            and channels & (channels - 1) == 0 and conv.stride == (1,) and conv.dilation == (1,)
            and conv.padding == (0,) and conv.padding_mode == "zeros" and conv.bias is not None
            and conv.weight.is_contiguous() and all(p.dtype == x.dtype and p.device == x.device
                                                    for p in (conv.weight, conv.bias)))


def grouped_conv1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """``conv(x)`` (B, C, T) of x (B, C, T + kernel − 1), as :func:`fits` takes them."""
    if not fits(x, conv):
        raise ValueError("grouped_conv1d takes x (B, C, T + kernel - 1) with contiguous frames and a grouped "
                         "convolution (groups of 16+ channels, a power of two; no padding, stride or dilation) "
                         "of x's dtype (float32 or bfloat16)")
    rows, channels, _ = x.shape
    taps = conv.kernel_size[0]
    frames = x.shape[2] - taps + 1
    y = torch.empty(rows, channels, frames, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(frames, BLOCK_FRAMES), conv.groups, rows)
    _grouped_conv_kernel[grid](x, conv.weight, conv.bias, y, frames, x.stride(0), x.stride(1),
                               GROUP=channels // conv.groups, TAPS=taps, BLOCK_T=BLOCK_FRAMES, BLOCK_R=BLOCK_REDUCE,
                               ROUND=ROUNDINGS[x.dtype], PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                               EXACT_DOT=INTERPRETED, num_warps=4)
    return y
