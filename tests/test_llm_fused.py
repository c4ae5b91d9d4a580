"""The fused decode path (cosyserve.llm.layers.fused): PyTorch fallbacks on the CPU, the Triton
kernels under the Triton interpreter on the CPU, and the kernels on CUDA (skipped without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosyserve.bundle.llm import ensure_llm_bundle
from cosyserve.bench import llm_decode
from cosyserve.llm.engine.model_runner import ModelRunner
from cosyserve.llm.layers import fused
from cosyserve.llm.layers.attention import DecodeMetadata, attention, decode_bias
from cosyserve.llm.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 14, 2, 64, 160


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return ensure_llm_bundle(tmp_path_factory.getbasetemp() / "llm_tiny_fused", "tiny", seed=0)


def reference_decode_attention(qkv, rope, k_cache, v_cache, positions):
    """The unfused decode path: rope, cache write and attention as the reference model runs them."""
    batch = qkv.shape[0]
    qk = rope(qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(batch, -1, HEAD_DIM), rope.lookup(positions))
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(batch, KV_HEADS, HEAD_DIM)
    kv_len = MAX_LEN
    meta = DecodeMetadata(torch.arange(batch, device=qkv.device), positions, kv_len,
                          decode_bias(positions, kv_len, KV_HEADS, qkv.dtype))
    return attention(qk[:, :HEADS], qk[:, HEADS:], v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)


def random_decode_inputs(batch: int, dtype: torch.dtype, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(device, dtype)
    cache = torch.randn(2, batch + 1, KV_HEADS, MAX_LEN, HEAD_DIM, generator=generator).to(device, dtype)
    # Position 0 (no cached key), block edges of the kernel (63, 64, 65) and a long row.
    positions = torch.tensor([0, 63, 64, 65, 1, 150, 7, 100][:batch]).to(device)
    rope = RotaryEmbedding(HEAD_DIM, MAX_LEN, 1e6, dtype, torch.device(device))
    return qkv, cache, positions, rope


def check_fused_ops(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """Each fused op against its unfused PyTorch formula on fresh random inputs (outputs poisoned first)."""
    generator = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    x, residual, weight = rand(5, 896), rand(5, 896), rand(896)
    expected_residual = residual + x
    expected = torch.nn.functional.rms_norm(expected_residual, (896,), weight, 1e-6)
    updated = residual.clone()
    normed = fused.add_rms_norm(x, updated, weight, 1e-6)
    assert torch.equal(updated, expected_residual)
    assert rel_err(normed, expected) < tolerance
    assert rel_err(fused.rms_norm(residual, weight, 1e-6), torch.nn.functional.rms_norm(residual, (896,), weight, 1e-6)) < tolerance
    gate_up = rand(3, 2 * 4864)
    reference = torch.nn.functional.silu(gate_up[:, :4864]) * gate_up[:, 4864:]
    assert rel_err(fused.silu_mul(gate_up), reference) < tolerance

    qkv, cache, positions, rope = random_decode_inputs(8, dtype, device, seed=2)
    ref_cache, fused_cache = cache.clone(), cache.clone()
    expected = reference_decode_attention(qkv, rope, ref_cache[0], ref_cache[1], positions)
    meta = DecodeMetadata(torch.arange(8, device=device), positions, MAX_LEN, None)
    out = fused.decode_attention(qkv, rope, fused_cache[0], fused_cache[1], meta, HEADS, HEAD_DIM ** -0.5)
    assert rel_err(out, expected) < tolerance, rel_err(out, expected)
    # The rotated keys and the values at each row's position, up to the last bit of the rotation
    # (fused multiply-add or not); one misplaced row would be an error of about 2e-2.
    assert rel_err(fused_cache, ref_cache) < tolerance / 100


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_fallbacks_match_reference_in_fp32():
    check_fused_ops("cpu", torch.float32, 1e-6)


@pytest.mark.skipif(fused.triton_kernels is None, reason="Triton is not installed")
@pytest.mark.slow  # Triton's interpreter, as tests/test_flow_fused.py's
def test_triton_kernels_under_the_interpreter():
    """The kernels themselves, run by the Triton interpreter on CPU tensors (fp32 and fp16)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_triton_kernels_on_cuda(dtype, tolerance):
    check_fused_ops("cuda", dtype, tolerance)


def greedy_tokens(llm_dir, device: str, dtype: torch.dtype, fused_decode: bool) -> list[list[int]]:
    runner = ModelRunner(llm_dir, torch.device(device), dtype, 4, 256, use_cuda_graphs=device != "cpu",
                         fused_decode=fused_decode)
    return llm_decode.greedy_tokens(runner, llm_decode.random_prompts(3, 40, seed=0), steps=20)


def test_fused_structure_keeps_greedy_tokens_on_cpu(llm_dir):
    """The fused model structure (fallback ops) against the reference path, fp32 on the CPU."""
    assert not fused.fused_decode_available(torch.device("cpu"), torch.float32)
    tokens = {path: greedy_tokens(llm_dir, "cpu", torch.float32, on) for path, on in llm_decode.PATHS.items()}
    assert tokens["fused"] == tokens["reference"]
    assert len(tokens["fused"]) == 3 and all(len(row) == 21 for row in tokens["fused"])
    assert llm_decode.greedy_agreement(tokens).startswith("greedy tokens, fused vs reference: 3/3 rows identical")


def test_forced_step_logits_of_both_paths_agree_on_cpu(llm_dir):
    prompts, inputs = llm_decode.random_prompts(3, 30, seed=3), [5, 600, 6000]
    logits = {path: llm_decode.forced_step_logits(
        ModelRunner(llm_dir, torch.device("cpu"), torch.float32, 4, 256, False, fused_decode=on), prompts, inputs)
        for path, on in {**llm_decode.PATHS, "float32": False}.items()}
    assert logits["fused"].shape == (3, logits["fused"].shape[1]) and rel_err(logits["fused"], logits["float32"]) < 1e-5
    assert "argmax = float32's in 3/3 rows" in llm_decode.logits_accuracy(logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_decode_on_cuda_is_as_accurate_as_the_reference(llm_dir):
    """bf16 logits of one decode step against float32; and graph replays of the fused step give
    the eager step's tokens."""
    assert fused.fused_decode_available(torch.device("cuda"), torch.bfloat16)
    prompts, inputs = llm_decode.random_prompts(3, 30, seed=3), [5, 600, 6000]
    dtypes = {"reference": torch.bfloat16, "fused": torch.bfloat16, "float32": torch.float32}
    logits = {path: llm_decode.forced_step_logits(
        ModelRunner(llm_dir, torch.device("cuda"), dtypes[path], 4, 256, False, fused_decode=path == "fused"),
        prompts, inputs) for path in dtypes}
    errors = {path: rel_err(logits[path], logits["float32"]) for path in llm_decode.PATHS}
    assert errors["fused"] <= 1.5 * errors["reference"] + 1e-3, errors
    graphs = greedy_tokens(llm_dir, "cuda", torch.bfloat16, True)
    eager = llm_decode.greedy_tokens(ModelRunner(llm_dir, torch.device("cuda"), torch.bfloat16, 4, 256, False,
                                                   fused_decode=True), llm_decode.random_prompts(3, 40, seed=0), 20)
    assert graphs == eager


if __name__ == "__main__":  # run by test_triton_kernels_under_the_interpreter with TRITON_INTERPRET=1
    assert fused.INTERPRET and fused.triton_runs_on(torch.zeros(1))
    check_fused_ops("cpu", torch.float32, 1e-5)
    # Not bf16: the interpreter converts float32 to bf16 by truncation, the GPU rounds to nearest.
    check_fused_ops("cpu", torch.float16, 2e-3)
    print("ok")
