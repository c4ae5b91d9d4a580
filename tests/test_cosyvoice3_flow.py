"""CosyVoice3 flow (DiT): parity against the shared fixtures, config round trip, call contract."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.config import dump_hyperpyyaml, load_hyperpyyaml
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.models.cosyvoice3.config import Cv3FlowConfig
from cosyserve.models.cosyvoice3.dit import block_causal_mask
from cosyserve.models.cosyvoice3.flow import CosyVoice3Flow, load_cosyvoice3_flow
from cosyserve.parity import cv3_flow


@pytest.fixture(scope="module")
def tiny_flow(tmp_path_factory) -> CosyVoice3Flow:
    model_dir = tmp_path_factory.mktemp("cv3flow")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(CosyVoice3Flow(Cv3FlowConfig.tiny()).state_dict(), model_dir / "flow.pt")
    dump_hyperpyyaml({"flow": Cv3FlowConfig.tiny().to_yaml_node()}, model_dir / "cosyvoice3.yaml")
    return load_cosyvoice3_flow(model_dir)


def test_parity_cv3_flow(parity_dir):
    fixture_dir = parity_dir / "cosyvoice3"
    if not cv3_flow.detect(fixture_dir):
        pytest.skip(f"no cv3_flow fixtures in {fixture_dir}")
    results = cv3_flow.run(fixture_dir)
    failed = [r for r in results if not r.passed]
    names = {r.case for r in results}
    assert {"nonstream/mel", "stream_full/mel", "chunk0/mel", "chunk1/mel", "chunk0/mel_fullattn",
            "real manifest/strict load"} <= names
    assert not failed, failed


def test_yaml_round_trip(tmp_path):
    for cfg in (Cv3FlowConfig.tiny(), Cv3FlowConfig.real()):
        dump_hyperpyyaml({"flow": cfg.to_yaml_node()}, tmp_path / "cosyvoice3.yaml")
        assert Cv3FlowConfig.from_yaml_tree(load_hyperpyyaml(tmp_path / "cosyvoice3.yaml")) == cfg


def test_unsupported_option_is_rejected(tmp_path):
    node = Cv3FlowConfig.tiny().to_yaml_node()
    node.kwargs["decoder"].kwargs["cfm_params"].kwargs["content"]["solver"] = "midpoint"
    dump_hyperpyyaml({"flow": node}, tmp_path / "cosyvoice3.yaml")
    with pytest.raises(ModelLoadError, match="solver"):
        Cv3FlowConfig.from_yaml_tree(load_hyperpyyaml(tmp_path / "cosyvoice3.yaml"))


def test_block_causal_mask():
    mask = block_causal_mask(7, 3, torch.device("cpu"))
    assert mask[0].tolist() == [True] * 3 + [False] * 4
    assert mask[4].tolist() == [True] * 6 + [False]
    assert mask[6].all()


def test_streaming_prefix_blocks_do_not_see_the_future(tiny_flow):
    """With block masks, the frames of complete 50-frame blocks do not depend on later tokens."""
    gen = torch.Generator().manual_seed(1)
    prompt, tokens = torch.randint(0, 6561, (1, 10), generator=gen), torch.randint(0, 6561, (1, 60), generator=gen)
    feat, emb = torch.randn(1, 20, 80, generator=gen), torch.randn(1, 192, generator=gen)
    short = tiny_flow.inference(tokens[:, :40], prompt, feat, emb, streaming=True, finalize=False)
    long = tiny_flow.inference(tokens, prompt, feat, emb, streaming=True, finalize=False)
    assert short.shape == (1, 80, 2 * (40 - 3)) and long.shape == (1, 80, 2 * (60 - 3))
    # Frames 0..49 of prompt+target form a complete block; their inputs (tokens < 25 and the
    # look-ahead of 3) are the same in both calls, so they are equal; later frames differ.
    first_block = 50 - 20
    torch.testing.assert_close(short[:, :, :first_block], long[:, :, :first_block], rtol=0, atol=1e-6)
    assert not torch.allclose(short[:, :, first_block + 10:], long[:, :, first_block + 10:short.shape[2]])


def test_bad_inputs_are_rejected(tiny_flow):
    prompt, feat, emb = torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 8, 80), torch.ones(1, 192)
    with pytest.raises(InvalidInputError, match="0..6560"):
        tiny_flow.inference(torch.tensor([[6561]]), prompt, feat, emb, streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="prompt_feat"):
        tiny_flow.inference(torch.tensor([[1, 2]]), prompt, feat[:, :7], emb, streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="look-ahead"):
        tiny_flow.inference(torch.zeros(1, 0, dtype=torch.long), prompt[:, :0], feat[:, :0], emb,
                            streaming=True, finalize=False)


def test_wrong_checkpoint_is_a_load_error(tmp_path):
    torch.save({"input_embedding.weight": torch.zeros(3, 80)}, tmp_path / "flow.pt")
    with pytest.raises(ModelLoadError, match="does not match"):
        load_cosyvoice3_flow(tmp_path, config=Cv3FlowConfig.tiny())


def test_incremental_stream_equals_block_masked_recompute(tiny_flow):
    """Every push returns the new frames of the reference's streaming=True call on all tokens so far,
    whatever the chunk sizes (blocks completed one or several at a time, pushes that add no frame)."""
    from cosyserve.models.cosyvoice3.flow import Cv3FlowStream

    gen = torch.Generator().manual_seed(2)
    prompt, tokens = torch.randint(0, 6561, (1, 13), generator=gen), torch.randint(0, 6561, (1, 120), generator=gen)
    feat, emb = torch.randn(1, 26, 80, generator=gen), torch.randn(1, 192, generator=gen)
    stream, received, emitted = Cv3FlowStream(tiny_flow, prompt, feat, emb), 0, 0
    for size in (1, 2, 15, 40, 3, 27, 60, 0):
        finalize = size == 0
        new = stream.push(tokens[:, received:received + size] if size else tokens[:, received:], finalize)
        received = received + size if size else tokens.shape[1]
        if received <= 3 and not finalize:  # everything is look-ahead: no frame yet
            assert new.shape == (1, 80, 0)
            continue
        full = tiny_flow.inference(tokens[:, :received], prompt, feat, emb, streaming=True, finalize=finalize)
        torch.testing.assert_close(new, full[:, :, emitted:], rtol=0, atol=1e-5)
        emitted = full.shape[2]
        assert stream.committed % 50 == 0 or finalize
    assert emitted == 2 * tokens.shape[1] and stream.finished
    with pytest.raises(InvalidInputError, match="finished"):
        stream.push(tokens[:, :1])


def test_every_block_reads_its_frames_row_major(tiny_flow):
    """The DiT's blocks get x (B, T, D) contiguous in the full pass and in a stream's windows: a
    channels-first x (the position convolution's transposed output) made each layer norm copy it and
    each residual add run strided, about a sixth of a step's GPU time at real size."""
    from cosyserve.models.cosyvoice3.flow import Cv3FlowStream

    layouts = []
    hooks = [block.register_forward_pre_hook(lambda _, args: layouts.append(args[0].is_contiguous()))
             for block in tiny_flow.decoder.estimator.transformer_blocks]
    try:
        gen = torch.Generator().manual_seed(4)
        prompt, tokens = torch.randint(0, 6561, (1, 9), generator=gen), torch.randint(0, 6561, (1, 40), generator=gen)
        feat, emb = torch.randn(1, 18, 80, generator=gen), torch.randn(1, 192, generator=gen)
        tiny_flow.inference(tokens, prompt, feat, emb, streaming=True, finalize=True)
        full = len(layouts)
        Cv3FlowStream(tiny_flow, prompt, feat, emb).push(tokens, True)
    finally:
        for hook in hooks:
            hook.remove()
    assert 0 < full < len(layouts) and all(layouts)


def check_rotary_kernel() -> None:
    """The Triton rotary (q and k together, in place) against rotate_leading_ on each: cos/sin for every
    row (T, dim_head) or per row (B, T, dim_head), q/k views of a wider buffer, a frame count that
    leaves a program's tile part empty; float32, and bfloat16 with bfloat16 angles (each product rounded
    to bfloat16, as PyTorch's operators round them: the interpreter's own bfloat16 casts truncate, the
    kernel's rounding does not use them)."""
    from cosyserve.models.cosyvoice3.dit import RotaryEmbedding, rotary, rotate_leading_
    from cosyserve.models.cosyvoice3.rotary_triton import rotate_queries_keys_

    gen = torch.Generator().manual_seed(11)
    embed = RotaryEmbedding(16)
    cases = ((torch.float32, torch.float32, False, 37), (torch.float32, torch.float32, True, 64),
             (torch.bfloat16, torch.bfloat16, True, 5), (torch.bfloat16, torch.bfloat16, False, 33))
    for dtype, angle_dtype, per_row, frames in cases:
        angles = embed.angles(frames + 9)[9:]
        if per_row:  # rows at their own positions, as the packed sampler's
            angles = torch.stack([embed.angles(frames + s)[s:] for s in (0, 3, 50)])
        cos, sin = rotary(angles.to(angle_dtype))
        qk = (torch.randn(3, frames, 2 * 48, generator=gen) * 3).to(dtype)
        q, k = qk[..., :48], qk[..., 48:]  # channels contiguous, rows strided
        want_q, want_k = rotate_leading_(q.clone(), (cos, sin)), rotate_leading_(k.clone(), (cos, sin))
        rotate_queries_keys_(q, k, cos, sin)
        torch.testing.assert_close(q, want_q, rtol=0, atol=0)
        torch.testing.assert_close(k, want_k, rtol=0, atol=0)


def run_under_the_interpreter(check: str) -> None:
    """This module's ``check`` function in a process of its own under Triton's CPU interpreter."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    script = f"import tests.test_cosyvoice3_flow as t\nt.{check}()\nprint('ok')\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root)))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_the_rotary_kernel_under_the_interpreter():
    """The GPU's rotary kernel computes rotate_leading_'s values (Triton's CPU interpreter: no fused
    multiply-adds, so equal to the bit)."""
    run_under_the_interpreter("check_rotary_kernel")


def modulated_norm_cases(device: str, dtype: torch.dtype, batch: int, frames: int, dim: int, seed: int):
    """x, y (B, T, D) and the six modulation vectors (B, 1, D) of an adaptive norm, as the DiT's blocks
    make them (chunks of one linear output: a batch stride of 6 D)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, frames, dim, generator=gen) * 3 + 1).to(device, dtype)
    y = torch.randn(batch, frames, dim, generator=gen).to(device, dtype)
    vectors = (torch.randn(batch, 6 * dim, generator=gen) * 0.5).to(device, dtype)
    return x, y, tuple(m.unsqueeze(1) for m in vectors.chunk(6, dim=-1))


def torch_modulated_norm(x, shift, scale, gate=None, y=None):
    """modulated_layer_norm's PyTorch operators."""
    from cosyserve.models.cosyvoice3.dit import NORM_EPS
    from cosyserve.models.step_audio2.estimator import modulate

    if gate is not None:
        x = torch.addcmul(x, gate, y)
    return x, modulate(torch.nn.functional.layer_norm(x, x.shape[-1:], eps=NORM_EPS), shift, scale)


def assert_within_roundings(x, shift, scale, gate, y, got, want) -> None:
    """The kernel's (x', out) against PyTorch's, each element within a few rounding steps of x's dtype
    of the magnitude of the terms it sums: where they cancel, one step of a term (a norm rounded the
    other way, statistics summed in another order) is far more than one step of the result. Terms:
    |x| + |gate·y| for x'; |1 + scale|·(|x'| + |mean|)/std + |shift| for the modulated norm."""
    step = 4 * torch.finfo(x.dtype).eps  # a few roundings (eps: one step at 1)
    x, shift, scale = x.double(), shift.double(), scale.double()
    got_x, got_out = (t.double() for t in got)
    want_x, want_out = (t.double() for t in want)
    residual = x if gate is None else x + gate.double() * y.double()
    terms_x = x.abs() + (0 if gate is None else (gate.double() * y.double()).abs())
    mean, std = residual.mean(-1, keepdim=True), residual.std(-1, unbiased=False, keepdim=True)
    terms_out = (1 + scale).abs() * (residual.abs() + mean.abs()) / std + shift.abs()
    for got_v, want_v, terms in ((got_x, want_x, terms_x), (got_out, want_out, terms_out)):
        worst = ((got_v - want_v).abs() / (step * terms + 1e-30)).max().item()
        assert worst <= 1, f"{worst:.2f} of the allowed rounding steps"


def check_modulated_norm_kernel() -> None:
    """The Triton adaptive norm against PyTorch's operators, with and without the gated residual, in
    float32 and bfloat16 (each operator's result rounded as PyTorch rounds it: within a few roundings)."""
    from cosyserve.models.cosyvoice3.dit import NORM_EPS
    from cosyserve.models.cosyvoice3.norm_triton import modulated_norm

    for dtype in (torch.float32, torch.bfloat16):
        x, y, (shift, scale, gate, *_) = modulated_norm_cases("cpu", dtype, 3, 7, 64, seed=5)
        for gated in ((), (gate, y)):
            got = modulated_norm(x, shift, scale, NORM_EPS, *gated)
            assert got[0].dtype == dtype and got[1].dtype == dtype
            assert_within_roundings(x, shift, scale, *(gated or (None, None)), got,
                                    torch_modulated_norm(x, shift, scale, *gated))


def test_the_adaptive_norm_kernel_under_the_interpreter():
    """The GPU's adaptive-norm kernel computes modulated_layer_norm's PyTorch values (Triton's CPU
    interpreter)."""
    run_under_the_interpreter("check_modulated_norm_kernel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_adaptive_norm_kernel_gives_pytorchs_values():
    """At real size in bfloat16 on a GPU (4 jobs x 2 CFG rows x 512 frames x 1024 channels), through the
    DiT's dispatch: within a few bfloat16 roundings of PyTorch's operators, with and without the residual."""
    from cosyserve.models.cosyvoice3.dit import modulated_layer_norm

    x, y, (shift, scale, gate, *_) = modulated_norm_cases("cuda", torch.bfloat16, 8, 512, 1024, seed=6)
    for gated in ((), (gate, y)):
        assert_within_roundings(x, shift, scale, *(gated or (None, None)), modulated_layer_norm(x, shift, scale, *gated),
                                torch_modulated_norm(x, shift, scale, *gated))


def test_the_adaptive_norm_kernel_builds_for_a_hopper_gpu():
    """The kernel compiled here for sm_90 as a bfloat16 flow calls it, with and without the residual."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cosyserve.models.cosyvoice3.norm_triton import _modulated_norm_kernel

    signature = {name: "*bf16" for name in ("x_ptr", "y_ptr", "gate_ptr", "shift_ptr", "scale_ptr", "x_out_ptr",
                                            "out_ptr")}
    signature |= {"frames": "i32", "mod_sb": "i32", "eps": "fp32"}
    signature |= {name: "constexpr" for name in ("D", "RESIDUAL", "ROUND")}
    for residual in (False, True):
        source = ASTSource(fn=_modulated_norm_kernel, signature=signature,
                           constexprs={"D": 1024, "RESIDUAL": residual, "ROUND": 1})
        try:
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        except RuntimeError as exc:  # no CUDA toolchain in this Triton build
            pytest.skip(f"cannot compile for sm_90 here: {exc}")
        assert ".entry _modulated_norm_kernel" in ptx


def position_conv_case(device: str, dtype: torch.dtype, rows: int, frames: int, channels: int, groups: int,
                       seed: int):
    """A position convolution of the DiT's kind (kernel 31, ``groups`` groups) and its input (rows, channels,
    30 + frames), as the DiT gives it: its context, then the window's frames, channels-first (a strided copy)."""
    from cosyserve.models.cosyvoice3.dit import POS_CONV_KERNEL

    gen = torch.Generator().manual_seed(seed)
    conv = nn.Conv1d(channels, channels, POS_CONV_KERNEL, groups=groups)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * 0.05)
        conv.bias.copy_(torch.randn(channels, generator=gen))
    x = torch.randn(rows, frames + POS_CONV_KERNEL - 1, channels, generator=gen) * 2
    return conv.to(device, dtype), x.to(device, dtype).transpose(1, 2).contiguous()


def assert_conv_within_roundings(conv, x, got) -> None:
    """The kernel's output against PyTorch's convolution, each element within a few rounding steps of x's
    dtype of the sum of its products' magnitudes (the sums run in other orders) and the bias's."""
    want = conv(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    step = 4 * torch.finfo(x.dtype).eps
    terms = F.conv1d(x.double().abs(), conv.weight.double().abs(), conv.bias.double().abs(), groups=conv.groups)
    worst = ((got.double() - want.double()).abs() / (step * terms + 1e-30)).max().item()
    assert worst <= 1, f"{worst:.2f} of the allowed rounding steps"


def check_position_conv_kernel() -> None:
    """The Triton grouped convolution against PyTorch's, in float32 and bfloat16, with frames across
    several of its blocks and the last one partial, and an input whose rows are a strided view."""
    from cosyserve.models.cosyvoice3.conv_triton import BLOCK_FRAMES, grouped_conv1d

    for dtype in (torch.float32, torch.bfloat16):
        for rows, frames in ((2, 7), (3, 2 * BLOCK_FRAMES + 5)):
            conv, x = position_conv_case("cpu", dtype, rows, frames, 64, 4, seed=rows)
            assert_conv_within_roundings(conv, x, grouped_conv1d(x, conv))
        wide = torch.cat([x, x], dim=2)[:, :, :x.shape[2]]  # a row stride other than channels x frames
        assert_conv_within_roundings(conv, wide, grouped_conv1d(wide, conv))
    # a wrong tap order is not within the bound
    conv, x = position_conv_case("cpu", torch.float32, 2, 9, 64, 4, seed=9)
    with torch.no_grad():
        flipped = nn.Conv1d(64, 64, conv.kernel_size[0], groups=4)
        flipped.weight.copy_(conv.weight.flip(-1))
        flipped.bias.copy_(conv.bias)
    with pytest.raises(AssertionError):
        assert_conv_within_roundings(conv, x, grouped_conv1d(x, flipped))


def test_the_position_conv_kernel_under_the_interpreter():
    """The GPU's grouped-convolution kernel computes PyTorch's convolution (Triton's CPU interpreter)."""
    run_under_the_interpreter("check_position_conv_kernel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_position_conv_kernel_gives_pytorchs_values():
    """At real size in bfloat16 on a GPU (16 rows x 512 frames x 1,024 channels in 16 groups; and one row of
    64 frames): the kernel within a few bfloat16 roundings of PyTorch's convolution, and the DiT's dispatch
    (the convolution, then Mish) through it."""
    from cosyserve.models.cosyvoice3.conv_triton import grouped_conv1d
    from cosyserve.models.cosyvoice3.dit import _conv_mish

    for rows, frames in ((16, 512), (1, 64)):
        conv, x = position_conv_case("cuda", torch.bfloat16, rows, frames, 1024, 16, seed=rows)
        got = grouped_conv1d(x, conv)
        assert_conv_within_roundings(conv, x, got)
        layer = nn.Sequential(conv, nn.Mish())
        assert torch.equal(_conv_mish(layer, x), layer[1](got))


def test_the_position_conv_kernel_builds_for_a_hopper_gpu():
    """The kernel compiled here for sm_90 as a bfloat16 flow calls it."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cosyserve.models.cosyvoice3.conv_triton import BLOCK_FRAMES, BLOCK_REDUCE, _grouped_conv_kernel

    signature = {name: "*bf16" for name in ("x_ptr", "w_ptr", "bias_ptr", "y_ptr")}
    signature |= {"frames": "i32", "x_sb": "i32", "x_sc": "i32"}
    signature |= {name: "constexpr" for name in ("GROUP", "TAPS", "BLOCK_T", "BLOCK_R", "ROUND", "PRECISION",
                                                 "EXACT_DOT")}
    source = ASTSource(fn=_grouped_conv_kernel, signature=signature,
                       constexprs={"GROUP": 64, "TAPS": 31, "BLOCK_T": BLOCK_FRAMES, "BLOCK_R": BLOCK_REDUCE,
                                   "ROUND": 1, "PRECISION": "tf32", "EXACT_DOT": False})
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except RuntimeError as exc:  # no CUDA toolchain in this Triton build
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    assert ".entry _grouped_conv_kernel" in ptx and "mma" in ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_rotary_kernel_rounds_as_pytorch_does():
    """At real size in bfloat16 on a GPU: with float32 angles (where the GPU may fuse a product into the
    sum) within one bfloat16 rounding step of PyTorch's values, with bfloat16 angles (a bfloat16 flow's)
    equal to them; the channels after head 0 are untouched."""
    from cosyserve.models.cosyvoice3.dit import RotaryEmbedding, rotary, rotate_leading_
    from cosyserve.models.cosyvoice3.rotary_triton import rotate_queries_keys_

    for angle_dtype, rtol in ((torch.float32, 2 ** -7), (torch.bfloat16, 0)):
        embed = RotaryEmbedding(64).to("cuda", angle_dtype)
        cos, sin = rotary(torch.stack([embed.angles(512 + s)[s:] for s in (0, 100, 700, 1500)]))
        q = (torch.randn(4, 512, 1024, device="cuda") * 4).bfloat16()
        k = torch.randn(4, 512, 1024, device="cuda").bfloat16()
        want_q, want_k = rotate_leading_(q.clone(), (cos, sin)), rotate_leading_(k.clone(), (cos, sin))
        rotate_queries_keys_(q, k, cos, sin)
        for got, want in ((q, want_q), (k, want_k)):
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6 if rtol else 0)
            assert torch.equal(got[..., 64:], want[..., 64:])


def test_the_rotary_kernel_builds_for_a_hopper_gpu_with_no_fused_product():
    """The kernel compiled here for sm_90 as a bfloat16 flow calls it (bfloat16 q, k and angles) builds and
    fuses no product into a sum (a cast-based rounding let LLVM contract one into ``fma.rn.bf16``), so on
    the GPU its values are PyTorch's to the bit, as under the interpreter."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cosyserve.models.cosyvoice3.rotary_triton import _rotate_pair_kernel

    signature = {name: "*bf16" for name in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr")}
    signature |= {name: "i32" for name in ("positions", "frames", "q_sb", "q_st", "k_sb", "k_st", "rot_sb", "rot_st")}
    signature |= {name: "constexpr" for name in ("ROWS", "PAIRS", "ROUND")}
    source = ASTSource(fn=_rotate_pair_kernel, signature=signature, constexprs={"ROWS": 32, "PAIRS": 32, "ROUND": 1})
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except RuntimeError as exc:  # no CUDA toolchain in this Triton build
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    assert "fma.rn" not in ptx
