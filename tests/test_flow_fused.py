"""The fused estimator step over packed rows (cosyserve.models.flow.fused) against the eager estimator.

CPU, fp32: the PyTorch reference ops, and the Triton kernels under the Triton interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, fixed_noise, random_flow_state_dict
from cosyserve.models.flow.cache import StreamWindow
from cosyserve.models.flow.fused import FusedEstimator

torch.set_num_threads(1)

REL_L2 = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tiny_cfm(seed: int = 3):
    """The tiny flow's CFM with random weights, biases and LayerNorm affines (so every epilogue matters)."""
    cfg = FlowConfig.tiny()
    flow = CosyVoice2Flow(cfg)
    state = random_flow_state_dict(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for name, value in state.items():
        if name.startswith("decoder.estimator") and (name.endswith("bias") or "norm" in name or ".block.2." in name):
            state[name] = value + 0.3 * torch.randn(value.shape, generator=g)
    flow.load_state_dict(state)
    return flow.decoder.eval()


@pytest.fixture(scope="module")
def cfm():
    return tiny_cfm()


def _request(frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 80, frames, generator=g), torch.randn(1, 80, frames, generator=g),
            torch.randn(1, 80, generator=g), torch.randn(1, 80, frames, generator=g))


def _eager_window(cfm, request, context: int, new: int, t: torch.Tensor, streaming: bool):
    """Eager guided velocity of frames [context, context + new) after a stream window over [0, context)."""
    x, mu, spks, cond = request
    states: dict = {}
    with torch.inference_mode():
        if context:
            window = StreamWindow(0, context, states)
            cfm.velocity(x[:, :, :context], torch.ones(1, 1, context), mu[:, :, :context], t, spks,
                         cond[:, :, :context], streaming=True, window=window)
        window = StreamWindow(context, 0, states) if context else None
        part = slice(context, context + new)
        v = cfm.velocity(x[:, :, part], torch.ones(1, 1, new), mu[:, :, part], t, spks, cond[:, :, part],
                         streaming=streaming, window=window)
    return v, states


def _packed_step(fused: FusedEstimator, cfm, requests, contexts, valids, frames, t, streaming, dt=0.25):
    """Run the fused step over all requests packed; return (fused (x_out, v) per request, eager v per request)."""
    pairs = len(requests)
    rows = fused.rows(valids * 2, contexts * 2, frames, streaming=streaming)
    state = fused.new_state(2 * pairs, rows.slots, frames)
    inp = fused.input_buffer(2 * pairs, frames)
    refs = []
    for q, (request, context, valid) in enumerate(zip(requests, contexts, valids)):
        v, states = _eager_window(cfm, request, context, valid, t, streaming)
        refs.append(v)
        state.load_stream_states((q, pairs + q), states, fused.attention_layers, fused.conv_layers)
        x, mu, spks, cond = request
        part = slice(context, context + valid)
        fused.fill_input(inp, (q, pairs + q), x[:, :, part], mu[:, :, part], spks, cond[:, :, part])
    time_bias = fused.time_bias(t.reshape(1))[0][:, None, :].expand(-1, 2 * pairs, -1)
    with torch.inference_mode():
        x_out, v = fused.step(rows, state, inp, time_bias, torch.full((pairs,), dt))
    got = [(x_out[q, :valid].T[None], v[q, :valid].T[None]) for q, valid in enumerate(valids)]
    return got, refs, inp


def check_packed_rows(fused: FusedEstimator, cfm, tol: float) -> None:
    """Mixed context lengths (block-aligned, unaligned, none), padded rows, and each row alone."""
    contexts, valids, frames = [100, 0, 30, 50], [40, 40, 25, 7], 40
    requests = [_request(c + v, seed=10 + q) for q, (c, v) in enumerate(zip(contexts, valids))]
    t = torch.tensor(0.3)
    got, refs, inp = _packed_step(fused, cfm, requests, contexts, valids, frames, t, streaming=True)
    for q, ((x_out, v), ref) in enumerate(zip(got, refs)):
        x = requests[q][0][:, :, contexts[q]:contexts[q] + valids[q]]
        assert _rel(v, ref) < tol, (q, _rel(v, ref))
        assert _rel(x_out, x + 0.25 * ref) < tol
        # The next step's input: x + dt v in both rows of the pair.
        assert torch.equal(inp[q, :valids[q], :80], inp[len(requests) + q, :valids[q], :80])
        assert _rel(inp[q, :valids[q], :80].T[None], x + 0.25 * ref) < tol
    alone, _, _ = _packed_step(fused, cfm, requests[2:3], contexts[2:3], valids[2:3], frames, t, streaming=True)
    assert _rel(alone[0][1], got[2][1]) < tol


def check_full_attention(fused: FusedEstimator, cfm, tol: float) -> None:
    valids, frames = [33, 20], 33
    requests = [_request(v, seed=20 + q) for q, v in enumerate(valids)]
    got, refs, _ = _packed_step(fused, cfm, requests, [0, 0], valids, frames, torch.tensor(0.6), streaming=False)
    for (_, v), ref in zip(got, refs):
        assert _rel(v, ref) < tol


def check_whole_call(fused: FusedEstimator, cfm, streaming: bool, tol: float) -> None:
    """All 10 Euler steps from the fixed noise equal the eager sampler (one request, 120 frames)."""
    frames = 120
    _, mu, spks, cond = _request(frames, seed=30)
    with torch.inference_mode():
        ref = cfm(mu, torch.ones(1, 1, frames), spks, cond, streaming=streaming)
        rows = fused.rows([frames] * 2, [0, 0], frames, streaming=streaming)
        state = fused.new_state(2, rows.slots, frames)
        inp = fused.input_buffer(2, frames)
        fused.fill_input(inp, (0, 1), fixed_noise(frames), mu, spks, cond)
        _, dt, time_bias = fused.schedule(10)
        got = fused.euler(rows, state, inp, dt, time_bias)
    assert _rel(got[0].T[None], ref) < tol


def check_padding_skipped() -> None:
    """fused_linear with ``live``: a block of rows with no live frame skips its products (its outputs
    are the epilogue of zeros, here the bias); rows with live frames equal the reference."""
    from cosyserve.models.flow.fused import fused_linear_reference
    from cosyserve.models.flow.fused_triton import fused_linear
    g = torch.Generator().manual_seed(5)
    a, w, bias = torch.randn(3, 48, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    live = torch.tensor([48, 5, 0], dtype=torch.int32)
    ref, out = torch.empty(3, 48, 24), torch.empty(3, 48, 24)
    fused_linear_reference(a, w, out=ref, bias=bias)
    fused_linear(a, w, out=out, bias=bias, live=live, tile=(16, 32, 32, 4, 1))
    assert _rel(out[0], ref[0]) < 1e-5 and _rel(out[1, :16], ref[1, :16]) < 1e-5
    assert torch.equal(out[1, 16:], bias.expand(32, -1)) and torch.equal(out[2], bias.expand(48, -1))


def test_packed_rows_equal_eager_windows(cfm):
    check_packed_rows(FusedEstimator(cfm), cfm, REL_L2)


def test_full_attention_rows(cfm):
    check_full_attention(FusedEstimator(cfm), cfm, REL_L2)


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "offline"])
def test_whole_call_equals_sampler(cfm, streaming: bool):
    check_whole_call(FusedEstimator(cfm), cfm, streaming, REL_L2)


def test_rows_validation(cfm):
    fused = FusedEstimator(cfm)
    with pytest.raises(ValueError, match="pairs"):
        fused.rows([4], [0], 4, streaming=True)
    with pytest.raises(ValueError, match="full attention"):
        fused.rows([4, 4], [50, 50], 4, streaming=False)
    with pytest.raises(ValueError, match="valid frames"):
        fused.rows([5, 5], [0, 0], 4, streaming=True)


@pytest.mark.slow  # ~1 minute in Triton's interpreter on 2 cores
def test_triton_kernels_under_interpreter():
    """The Triton kernels (the GPU fp16/bf16 path) compute the same step, run by Triton's CPU interpreter;
    padding rows skip their products."""
    pytest.importorskip("triton")
    script = (
        "import torch, tests.test_flow_fused as t\n"
        "from cosyserve.models.flow.fused import FusedEstimator\n"
        "cfm = t.tiny_cfm()\n"
        "fused = FusedEstimator(cfm, kernels='triton')\n"
        "t.check_packed_rows(fused, cfm, 1e-5)\n"
        "t.check_full_attention(fused, cfm, 1e-5)\n"
        "t.check_padding_skipped()\n"
        "t.check_block_attention()\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def check_block_attention() -> None:
    """The Triton attention against SDPA over the mask of :meth:`FusedEstimator.rows`, on real queries:
    context and new frames, padding, blocks of 8 frames with and without a left limit, full attention;
    padding queries come out as zeros."""
    from cosyserve.models.flow.attention_triton import block_attention
    from cosyserve.models.flow.fused import context_slots
    g = torch.Generator().manual_seed(7)
    heads, head_dim, frames = 2, 16, 20
    inner = heads * head_dim
    cases = [([20, 13, 1, 20], [0, 0, 0, 0], True), ([20, 7, 12, 20], [16, 3, 30, 0], True),
             ([17, 20, 9, 5], [0, 0, 0, 0], False)]
    for left in (-1, 1):
        for valid, context, streaming in cases:
            slots = context_slots(max(context), frames)
            rows = len(valid)
            chunk = 8 if streaming else 1 << 20  # (a block past every position: full attention)
            valid_t, context_t = torch.tensor(valid, dtype=torch.int32), torch.tensor(context, dtype=torch.int32)
            q = torch.randn(rows, frames, inner, generator=g)
            kv = torch.randn(rows, slots + frames, 2 * inner, generator=g)
            out = torch.full_like(q, float("nan"))
            block_attention(q, kv, valid_t, context_t, slots, heads, chunk, left, out, tile=(8, 16, 4, 1))
            # the reference mask, as rows() builds it for SDPA (blocks of 8 frames, ``left`` blocks back)
            ctx = torch.tensor(context)[:, None]
            new, slot = torch.arange(frames)[None, :], torch.arange(slots)[None, :]
            key_pos = torch.cat([slot.expand(rows, -1), ctx + new], dim=1)
            key_ok = torch.cat([slot < ctx, new < torch.tensor(valid)[:, None]], dim=1)
            seen = key_ok[:, None, :].expand(-1, frames, -1).clone()
            if streaming:
                qb, kb = (ctx + new)[:, :, None] // chunk, key_pos[:, None, :] // chunk
                seen &= kb <= qb
                if left >= 0:
                    seen &= kb >= qb - left
            bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf")).unsqueeze(1)

            def heads_of(t: torch.Tensor) -> torch.Tensor:
                return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)
            ref = torch.nn.functional.scaled_dot_product_attention(
                heads_of(q), heads_of(kv[:, :, :inner]), heads_of(kv[:, :, inner:]), attn_mask=bias)
            ref = ref.transpose(1, 2).reshape(rows, frames, inner)
            for r, v in enumerate(valid):
                assert _rel(out[r, :v], ref[r, :v]) < 1e-5, (left, streaming, r)
                assert torch.equal(out[r, v:], torch.zeros_like(out[r, v:]))


def test_attention_kind_is_chosen_and_checked(cfm):
    """The PyTorch path runs SDPA over a mask for every row; full attention always does; an unknown
    kind is refused."""
    fused = FusedEstimator(cfm)
    assert fused.attention == "sdpa" and fused.uses_bias(True) and fused.uses_bias(False)
    triton_rows = FusedEstimator(cfm, attention="triton")
    assert not triton_rows.uses_bias(True) and triton_rows.uses_bias(False)
    assert triton_rows.rows([4, 4], [0, 0], 4, streaming=True).attn_bias is None  # no mask built for it
    with pytest.raises(ValueError, match="attention"):
        FusedEstimator(cfm, attention="flash")
