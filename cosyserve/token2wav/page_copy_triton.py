"""The Triton kernel of :class:`~.page_pool.PageCopy`: runs of contiguous elements moved from one
tensor to another, one program per (run, layer, part of the run), in one launch.

Why: a flow step moves whole pages of per-step keys/values between the page pool and the step's
key/value buffer (a window's context in, the blocks it completes out). As PyTorch ops each
direction took two or three passes over the data (an advanced-indexing gather, a transpose copy,
an ``index_copy_`` / ``index_put_`` whose element-wise kernels are far below the memory's speed):
on an H100, 8 new voices' prompt solve spent ~1.9 ms of each ~10.5 ms step writing its blocks, and
8 first windows ~1.1 ms of each ~5 ms step reading their context. A page's CFG row is, per layer,
``page_frames x width`` contiguous elements on both sides, so one vectorised copy per run does it.
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests check it so in CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements a program copies (16 per thread at 8 warps: 32-byte accesses in 16-bit types).
BLOCK = 4096


@triton.jit(do_not_specialize=["src_shift", "dst_shift"])
def _copy_runs_kernel(src_ptr, dst_ptr, src_start_ptr, dst_start_ptr, src_shift, dst_shift,
                      src_layer_stride, dst_layer_stride, run, BLOCK: tl.constexpr):
    index = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    src = tl.load(src_start_ptr + index) + src_shift + layer * src_layer_stride
    dst = tl.load(dst_start_ptr + index) + dst_shift + layer * dst_layer_stride
    offsets = part * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < run
    tl.store(dst_ptr + dst + offsets, tl.load(src_ptr + src + offsets, mask=ok), mask=ok)


def copy_runs(src: torch.Tensor, src_starts: torch.Tensor, src_shift: int, src_layer_stride: int,
              dst: torch.Tensor, dst_starts: torch.Tensor, dst_shift: int, dst_layer_stride: int,
              layers: int, run: int) -> None:
    """For each i and layer l < ``layers``: ``run`` elements of ``src``'s storage from element
    ``src_starts[i] + src_shift + l * src_layer_stride`` to ``dst``'s from ``dst_starts[i] +
    dst_shift + l * dst_layer_stride`` (starts: int64 tensors on the device, in elements of each
    tensor's storage from its first element)."""
    runs = src_starts.numel()
    if runs == 0:
        return
    grid = (runs, layers, triton.cdiv(run, BLOCK))
    _copy_runs_kernel[grid](src, dst, src_starts, dst_starts, src_shift, dst_shift, src_layer_stride,
                            dst_layer_stride, run, BLOCK=BLOCK, num_warps=8)
