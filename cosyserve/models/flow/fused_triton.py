"""Triton kernels of the fused estimator step (GPU, fp16/bf16); see :mod:`.fused` for the math.

Two kernels cover every layer except attention:

* :func:`fused_linear`: a GEMM over rows of frames with the estimator's epilogues. Rows are
  (row r, frame i) pairs of 3-D strided views, so a kernel reads or writes a channel slice of a
  wider buffer (the concatenated input of the up stage, the K/V slots of the cache) without a copy.
  Optional: a causal k-tap convolution read as ``taps`` shifted loads (frames before the window
  come from a per-row context tensor), bias, LayerNorm over the whole output row (one program
  holds the row), GELU or Mish, the padding mask, a per-row vector (the time bias), a second GEMM
  (the ResNet's 1x1 residual conv), the residual stream, a second LayerNorm written to a second
  output (the next block's pre-norm), or a column split into two outputs (Q, then K/V).
* :func:`cfg_euler`: the final 1x1 projection of the conditional and unconditional row of each
  request together, the guidance combine and the Euler update, written into the next step's input.

Under ``TRITON_INTERPRET=1`` both run on CPU tensors (the tests use that to check them in CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lanes import current_lane

ACT_NONE, ACT_GELU, ACT_MISH = 0, 1, 2
_RSQRT2 = tl.constexpr(0.7071067811865476)
# Mish = x tanh(softplus(x)) = x u(u+2) / (u(u+2) + 2) with u = exp(x); above this x it is x in fp32.
_MISH_LINEAR_FROM = tl.constexpr(20.0)


@triton.jit
def _row_layer_norm(acc, col_ok, w_ptr, b_ptr, rn, N, eps):
    acc = tl.where(col_ok[None, :], acc, 0.0)
    mean = tl.sum(acc, axis=1) / N
    centred = tl.where(col_ok[None, :], acc - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / N
    w = tl.load(w_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
    return centred * tl.rsqrt(var + eps)[:, None] * w[None, :] + b[None, :]


@triton.jit
def _epilogue(acc, acc2, rm, rn, r, i, row_ok, col_ok, bias_ptr, bias2_ptr, rowvec_ptr, rowvec_sr, valid_ptr,
              res_ptr, res_sr, res_si, ln_w_ptr, ln_b_ptr, out_ptr, out_sr, out_si, out2_ptr, out2_sr, out2_si,
              ln2_w_ptr, ln2_b_ptr, N, N_SPLIT, eps, tile_start,
              HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_ROWVEC: tl.constexpr, HAS_GEMM2: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              HAS_LN_OUT: tl.constexpr, HAS_SPLIT: tl.constexpr):
    """acc (and acc2) -> bias, LN, activation, mask, row vector, + acc2, + residual -> out (and out2)."""
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LN:
        acc = _row_layer_norm(acc, col_ok, ln_w_ptr, ln_b_ptr, rn, N, eps)
    if ACT == 1:
        acc = 0.5 * acc * (1.0 + tl.erf(acc * _RSQRT2))
    if ACT == 2:
        u = tl.exp(tl.minimum(acc, _MISH_LINEAR_FROM))
        n = u * (u + 2.0)
        acc = tl.where(acc > _MISH_LINEAR_FROM, acc, acc * n / (n + 2.0))
    if HAS_MASK:
        valid = tl.load(valid_ptr + r, mask=row_ok, other=0)
        acc = tl.where((i < valid)[:, None], acc, 0.0)
    if HAS_ROWVEC:
        acc += tl.load(rowvec_ptr + r[:, None] * rowvec_sr + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_GEMM2:
        acc += acc2 + tl.load(bias2_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + r[:, None] * res_sr + i[:, None] * res_si + rn[None, :],
                       mask=ok, other=0.0).to(tl.float32)
    if HAS_SPLIT:
        if tile_start < N_SPLIT:
            tl.store(out_ptr + r[:, None] * out_sr + i[:, None] * out_si + rn[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(out2_ptr + r[:, None] * out2_sr + i[:, None] * out2_si + (rn - N_SPLIT)[None, :],
                     acc.to(out2_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + r[:, None] * out_sr + i[:, None] * out_si + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=ok)
    if HAS_LN_OUT:
        normed = _row_layer_norm(acc, col_ok, ln2_w_ptr, ln2_b_ptr, rn, N, eps)
        tl.store(out2_ptr + r[:, None] * out2_sr + i[:, None] * out2_si + rn[None, :],
                 normed.to(out2_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _products(a_ptr, a_sr, a_si, ctx_ptr, ctx_sr, ctx_si, w_ptr, a2_ptr, a2_sr, a2_si, w2_ptr,
              acc, acc2, r, i, row_ok, rn, col_ok, K, K2, TAPS: tl.constexpr, HAS_GEMM2: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMM of one tile of :func:`_linear_kernel` (a causal conv with ``TAPS`` > 1), accumulated
    into acc, and the second GEMM into acc2."""
    w_type = w_ptr.dtype.element_ty
    rk = tl.arange(0, BLOCK_K)
    for tap in tl.static_range(TAPS):
        src = i - (TAPS - 1) + tap  # frame read by this tap; < 0: from the context before the window
        new_ok = row_ok & (src >= 0)
        a_rows = a_ptr + r * a_sr + src * a_si
        if TAPS > 1:
            ctx_ok = row_ok & (src < 0)
            ctx_rows = ctx_ptr + r * ctx_sr + (src + TAPS - 1) * ctx_si
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(a_rows[:, None] + kk[None, :], mask=new_ok[:, None] & k_ok[None, :], other=0.0).to(w_type)
            if TAPS > 1:
                a += tl.load(ctx_rows[:, None] + kk[None, :], mask=ctx_ok[:, None] & k_ok[None, :],
                             other=0.0).to(w_type)
            w = tl.load(w_ptr + rn[None, :] * (TAPS * K) + (tap * K + kk)[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc)
    if HAS_GEMM2:
        a2_rows = a2_ptr + r * a2_sr + i * a2_si
        for k0 in range(0, K2, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K2
            a = tl.load(a2_rows[:, None] + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(w_type)
            w = tl.load(w2_ptr + rn[None, :] * K2 + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc2 = tl.dot(a, w, acc2)
    return acc, acc2


@triton.jit
def _linear_kernel(
    a_ptr, a_sr, a_si, ctx_ptr, ctx_sr, ctx_si, w_ptr, bias_ptr,
    a2_ptr, a2_sr, a2_si, w2_ptr, bias2_ptr,
    rowvec_ptr, rowvec_sr, valid_ptr, live_ptr,
    res_ptr, res_sr, res_si, ln_w_ptr, ln_b_ptr,
    out_ptr, out_sr, out_si, out2_ptr, out2_sr, out2_si, ln2_w_ptr, ln2_b_ptr,
    scratch_ptr, scratch2_ptr, counter_ptr,
    M, FRAMES, K, K2, N, N_SPLIT, eps,
    TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, ACT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_ROWVEC: tl.constexpr, HAS_GEMM2: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_LN_OUT: tl.constexpr, HAS_SPLIT: tl.constexpr, ROW_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr,
):
    """ROW_TILES: the row epilogue (LayerNorm) needs whole rows, but the columns are split over
    several programs for parallelism. Each writes its raw GEMM tile to fp32 scratch; the last
    program of a row block to finish (an atomic counter) reads the whole rows back and runs the
    epilogue, then resets the counter for the next launch.

    HAS_LIVE: a block of rows that holds no live frame (i < live[r]: padding of a captured shape)
    skips its products; its epilogue then runs on zeros (finite values that nothing live reads)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < M
    col_ok = rn < N
    r = rm // FRAMES
    i = rm % FRAMES
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    work = True
    if HAS_LIVE:
        live = tl.load(live_ptr + r, mask=row_ok, other=0)
        work = tl.sum(((i < live) & row_ok).to(tl.int32), axis=0) > 0
    if work:
        acc, acc2 = _products(a_ptr, a_sr, a_si, ctx_ptr, ctx_sr, ctx_si, w_ptr, a2_ptr, a2_sr, a2_si, w2_ptr,
                              acc, acc2, r, i, row_ok, rn, col_ok, K, K2, TAPS, HAS_GEMM2, BLOCK_K)
    if not HAS_GEMM2:
        acc2 = acc
    if ROW_TILES > 1:
        tile = row_ok[:, None] & col_ok[None, :]
        tl.store(scratch_ptr + rm[:, None] * N + rn[None, :], acc, mask=tile)
        if HAS_GEMM2:
            tl.store(scratch2_ptr + rm[:, None] * N + rn[None, :], acc2, mask=tile)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + pid_m, 1, sem="acq_rel")
        if done == ROW_TILES - 1:
            rf = tl.arange(0, BLOCK_ROW)
            full = row_ok[:, None] & (rf < N)[None, :]
            rows_acc = tl.load(scratch_ptr + rm[:, None] * N + rf[None, :], mask=full, other=0.0,
                               cache_modifier=".cg")
            rows_acc2 = rows_acc
            if HAS_GEMM2:
                rows_acc2 = tl.load(scratch2_ptr + rm[:, None] * N + rf[None, :], mask=full, other=0.0,
                                    cache_modifier=".cg")
            _epilogue(rows_acc, rows_acc2, rm, rf, r, i, row_ok, rf < N, bias_ptr, bias2_ptr, rowvec_ptr, rowvec_sr,
                      valid_ptr, res_ptr, res_sr, res_si, ln_w_ptr, ln_b_ptr, out_ptr, out_sr, out_si,
                      out2_ptr, out2_sr, out2_si, ln2_w_ptr, ln2_b_ptr, N, N_SPLIT, eps, 0,
                      HAS_BIAS, HAS_LN, ACT, HAS_MASK, HAS_ROWVEC, HAS_GEMM2, HAS_RESIDUAL, HAS_LN_OUT, HAS_SPLIT)
            tl.atomic_xchg(counter_ptr + pid_m, 0)
    else:
        _epilogue(acc, acc2, rm, rn, r, i, row_ok, col_ok, bias_ptr, bias2_ptr, rowvec_ptr, rowvec_sr,
                  valid_ptr, res_ptr, res_sr, res_si, ln_w_ptr, ln_b_ptr, out_ptr, out_sr, out_si,
                  out2_ptr, out2_sr, out2_si, ln2_w_ptr, ln2_b_ptr, N, N_SPLIT, eps, pid_n * BLOCK_N,
                  HAS_BIAS, HAS_LN, ACT, HAS_MASK, HAS_ROWVEC, HAS_GEMM2, HAS_RESIDUAL, HAS_LN_OUT, HAS_SPLIT)


def _strides(t: torch.Tensor | None) -> tuple[int, int]:
    if t is None:
        return 0, 0
    if t.stride(-1) != 1:
        raise ValueError(f"fused_linear needs unit channel stride, got strides {t.stride()}")
    return t.stride(0), t.stride(1)


_scratch: dict[tuple[torch.device, str], tuple[torch.Tensor, torch.Tensor]] = {}
# Buffers outgrown by a larger shape stay allocated: CUDA graphs captured earlier still use them.
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def _row_scratch(device: torch.device, elements: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch (2 x elements) and zeroed counters of the split row epilogue of this thread's lane
    (:func:`~.lanes.work_lane`), grown on demand.

    Kernels of a lane run one after another on its stream, so one buffer serves them all (each launch
    leaves its counters at zero). Allocate before graph capture: :func:`reserve_row_scratch`.
    """
    key = (device, current_lane())
    held = _scratch.get(key)
    if held is None or held[0].numel() < 2 * elements or held[1].numel() < counters:
        size = max(2 * elements, 0 if held is None else held[0].numel())
        count = max(counters, 0 if held is None else held[1].numel())
        if key in _scratch:
            _retired.append(_scratch[key])
        held = (torch.empty(size, device=device, dtype=torch.float32),
                torch.zeros(count, device=device, dtype=torch.int32))
        _scratch[key] = held
    return held


def reserve_row_scratch(device: torch.device, rows: int, width: int) -> None:
    """Allocate this lane's split-epilogue scratch for ``rows`` row-frames of ``width`` channels now
    (outside a graph)."""
    _row_scratch(device, rows * width, rows)


def fused_linear(a, w, *, out, taps=1, context=None, bias=None, ln=None, act=ACT_NONE, valid=None, live=None,
                 row_vector=None, gemm2=None, residual=None, ln_out=None, split=None, eps=1e-5, tile=None) -> None:
    """See :func:`cosyserve.models.flow.fused.fused_linear_reference` for the arguments and semantics.

    ``tile``: (block_m, block_n, block_k, warps, stages) instead of the built-in choice (for tuning);
    a block_n below N with a row epilogue splits the columns over programs.
    """
    rows, frames, k = a.shape
    n = w.size(0)
    m = rows * frames
    # Tiles measured with ``scripts/bench_estimator.py --sweep`` on an H100 (docs/benchmarks.md):
    # up to 1,024 row-frames, a row epilogue splits its columns over 8 programs and every kernel
    # takes long K steps; up to 4,096, whole rows in 16-row blocks beat the split.
    full_row = ln is not None or ln_out is not None
    row_tiles, block_k, stages = 1, 64, 3
    if m <= 1024:
        block_m, block_n, warps, block_k, stages = (16, 32, 4, 256, 2) if full_row else (32, 64, 4, 256, 2)
        if full_row:
            row_tiles = triton.cdiv(n, block_n)
    elif m <= 4096:
        block_m, block_n, warps = (16, triton.next_power_of_2(n), 4) if full_row else (64, 128, 4)
    else:
        block_m, block_n, warps = (64, triton.next_power_of_2(n), 8) if full_row else (128, 128, 8)
    shortest_k = k if gemm2 is None else min(k, gemm2[0].size(2))
    block_k = min(block_k, max(32, triton.next_power_of_2(shortest_k)))
    if tile is not None:
        block_m, block_n, block_k, warps, stages = tile
        row_tiles = triton.cdiv(n, block_n) if full_row else 1
    out2, n_split = (None, 0)
    if split is not None:
        n_split, out2 = split
        while n_split % block_n:  # a tile must lie on one side of the split
            block_n //= 2
        if block_n < 16:
            raise ValueError(f"column split at {n_split} is not a multiple of 16")
    if ln_out is not None:
        out2 = ln_out[2]
    a2, w2, b2 = gemm2 if gemm2 is not None else (None, None, None)
    dummy = w
    scratch = counters = dummy
    if row_tiles > 1:
        buffer, counters = _row_scratch(a.device, m * n, triton.cdiv(m, block_m))
        scratch = buffer[:m * n]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _linear_kernel[grid](
        a, *_strides(a), context if context is not None else dummy, *_strides(context), w,
        bias if bias is not None else dummy,
        a2 if a2 is not None else dummy, *_strides(a2), w2 if w2 is not None else dummy,
        b2 if b2 is not None else dummy,
        row_vector if row_vector is not None else dummy, 0 if row_vector is None else row_vector.stride(0),
        valid if valid is not None else dummy, live if live is not None else dummy,
        residual if residual is not None else dummy, *_strides(residual),
        ln[0] if ln is not None else dummy, ln[1] if ln is not None else dummy,
        out, *_strides(out), out2 if out2 is not None else dummy, *_strides(out2),
        ln_out[0] if ln_out is not None else dummy, ln_out[1] if ln_out is not None else dummy,
        scratch, buffer[m * n:2 * m * n] if row_tiles > 1 else dummy, counters,
        m, frames, k, 0 if a2 is None else a2.size(2), n, n_split, eps,
        TAPS=taps, HAS_BIAS=bias is not None, HAS_LN=ln is not None, ACT=act, HAS_MASK=valid is not None,
        HAS_LIVE=live is not None, HAS_ROWVEC=row_vector is not None, HAS_GEMM2=gemm2 is not None,
        HAS_RESIDUAL=residual is not None, HAS_LN_OUT=ln_out is not None, HAS_SPLIT=split is not None, ROW_TILES=row_tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_ROW=triton.next_power_of_2(n),
        num_warps=warps, num_stages=stages,
    )


@triton.jit
def _cfg_euler_kernel(
    a_ptr, a_sr, a_si, w_ptr, bias_ptr, valid_ptr, dt_ptr, dt_sr,
    x_ptr, x_sr, x_si, x_out_ptr, x_out_sr, x_out_si, v_ptr, v_sr, v_si,
    PAIRS, FRAMES, K, N, cfg_rate,
    UPDATE_INPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m = PAIRS * FRAMES
    row_ok = rm < m
    col_ok = rn < N
    r = rm // FRAMES
    i = rm % FRAMES
    cond = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    uncond = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    cond_rows = a_ptr + r * a_sr + i * a_si
    uncond_rows = cond_rows + PAIRS * a_sr
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        a_mask = row_ok[:, None] & k_ok[None, :]
        cond = tl.dot(tl.load(cond_rows[:, None] + kk[None, :], mask=a_mask, other=0.0), w, cond)
        uncond = tl.dot(tl.load(uncond_rows[:, None] + kk[None, :], mask=a_mask, other=0.0), w, uncond)
    bias = tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    valid = tl.load(valid_ptr + r, mask=row_ok, other=0)
    keep = (i < valid)[:, None]
    cond = tl.where(keep, cond + bias, 0.0)
    uncond = tl.where(keep, uncond + bias, 0.0)
    velocity = (1.0 + cfg_rate) * cond - cfg_rate * uncond
    ok = row_ok[:, None] & col_ok[None, :]
    dt = tl.load(dt_ptr + r * dt_sr, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    x_cond = x_ptr + r[:, None] * x_sr + i[:, None] * x_si + rn[None, :]
    x_next = tl.load(x_cond, mask=ok, other=0.0).to(tl.float32) + dt * velocity
    tl.store(v_ptr + r[:, None] * v_sr + i[:, None] * v_si + rn[None, :], velocity.to(v_ptr.dtype.element_ty), mask=ok)
    tl.store(x_out_ptr + r[:, None] * x_out_sr + i[:, None] * x_out_si + rn[None, :],
             x_next.to(x_out_ptr.dtype.element_ty), mask=ok)
    if UPDATE_INPUT:  # the next step's input: both rows of the pair share x
        tl.store(x_cond, x_next.to(x_ptr.dtype.element_ty), mask=ok)
        tl.store(x_cond + PAIRS * x_sr, x_next.to(x_ptr.dtype.element_ty), mask=ok)


def cfg_euler(a, w, bias, valid, dt, x, x_out, velocity, cfg_rate: float, update_input: bool) -> None:
    """See :func:`cosyserve.models.flow.fused.cfg_euler_reference`."""
    rows, frames, k = a.shape
    pairs, n = rows // 2, w.size(0)
    block_m = 32 if pairs * frames <= 1024 else 64
    grid = (triton.cdiv(pairs * frames, block_m),)
    _cfg_euler_kernel[grid](
        a, *_strides(a), w, bias, valid, dt, dt.stride(0), x, *_strides(x), x_out, *_strides(x_out), velocity, *_strides(velocity),
        pairs, frames, k, n, cfg_rate,
        UPDATE_INPUT=update_input, BLOCK_M=block_m, BLOCK_N=triton.next_power_of_2(n), BLOCK_K=64 if k >= 64 else 32, num_warps=4, num_stages=3,
    )
