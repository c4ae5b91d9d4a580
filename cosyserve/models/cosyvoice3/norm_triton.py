"""The DiT blocks' adaptive layer norms as one Triton kernel each (GPU; CPU tensors under
``TRITON_INTERPRET=1``, how the tests check it).

A block normalises its input twice, each time modulated by its time embedding's shift and scale,
and the second time after the attention's gated residual. In PyTorch each is three or four kernels
over the whole (rows, frames, channels) tensor (the residual's ``addcmul``, the layer norm, ``1 +
scale``, the modulation's ``addcmul``), the ``addcmul``s unvectorised because their modulation
operands broadcast over frames: ~55 us a block of a window step's ~200 on an H100 at 4 jobs x 512
frames (docs/benchmarks.md, twenty-third session, H2). Here one program normalises one frame's
channels, reading x (and the residual's branch) once and writing the modulated norm (and the new
x). The values are :func:`~cosyserve.models.cosyvoice3.dit.modulated_layer_norm`'s: each operator's
result rounded to x's dtype where PyTorch's is (the residual, the norm, ``1 + scale``, the
modulation), the statistics in float32 (summed in another order than PyTorch's, so a bfloat16
result may differ from PyTorch's by one rounding step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rotary_triton import ROUNDINGS, _rounded


# frames and the batch stride unspecialised: one build per (dtype, residual), made at warm-up, whatever a
# later call's frame count (Triton would otherwise build another for counts divisible by 16 or not)
@triton.jit(do_not_specialize=["frames", "mod_sb"])
def _modulated_norm_kernel(x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, x_out_ptr, out_ptr, frames, mod_sb, eps,
                           D: tl.constexpr, RESIDUAL: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    at = row.to(tl.int64) * D + cols
    mod = (row // frames).to(tl.int64) * mod_sb + cols  # the frame's batch row's modulation
    x = tl.load(x_ptr + at).to(tl.float32)
    if RESIDUAL:  # x + gate·y, one rounding (addcmul)
        gate = tl.load(gate_ptr + mod).to(tl.float32)
        x = _rounded(x + gate * tl.load(y_ptr + at).to(tl.float32), ROUND)
        tl.store(x_out_ptr + at, x.to(x_out_ptr.dtype.element_ty))
    mean = tl.sum(x, axis=0) / D
    centred = x - mean
    norm = _rounded(centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / D + eps), ROUND)
    scale = _rounded(1.0 + tl.load(scale_ptr + mod).to(tl.float32), ROUND)
    shift = tl.load(shift_ptr + mod).to(tl.float32)
    tl.store(out_ptr + at, _rounded(shift + norm * scale, ROUND).to(out_ptr.dtype.element_ty))


def fits(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor | None = None,
         y: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes x (B, T, D), the modulation vectors (B, 1, D) and, with ``gate``, the
    residual's branch y: x and y contiguous of one shape, D a power of two, every tensor of x's dtype
    (float32 or bfloat16) and device, the vectors' channels contiguous with one batch stride."""
    dim = x.shape[-1]
    vectors = [shift, scale] + ([] if gate is None else [gate])
    return (x.dim() == 3 and x.is_contiguous() and dim & (dim - 1) == 0 and x.dtype in ROUNDINGS
            and (gate is None or (y is not None and y.shape == x.shape and y.is_contiguous() and y.dtype == x.dtype
                                  and y.device == x.device))
            and all(v.dtype == x.dtype and v.device == x.device and v.shape == (x.shape[0], 1, dim)
                    and v.stride(-1) == 1 and v.stride(0) == shift.stride(0) for v in vectors))


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   gate: torch.Tensor | None = None, y: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', layer_norm(x')·(1 + scale) + shift) of x' = x + gate·y (x itself without ``gate``), the
    tensors as :func:`fits` takes them."""
    if not fits(x, shift, scale, gate, y):
        raise ValueError("modulated_norm takes a contiguous (B, T, D) x (and y) with D a power of two, and "
                         "(B, 1, D) modulation vectors of its dtype (float32 or bfloat16), channels contiguous")
    residual = gate is not None
    batch, frames, dim = x.shape
    out = torch.empty_like(x)
    x_out = torch.empty_like(x) if residual else x
    _modulated_norm_kernel[(batch * frames,)](
        x, y if residual else x, gate if residual else shift, shift, scale, x_out, out, frames, shift.stride(0), eps,
        D=dim, RESIDUAL=residual, ROUND=ROUNDINGS[x.dtype], num_warps=4 if dim >= 512 else 1)
    return x_out, out
