"""HiFT in half precision: the Snake reciprocal clamp, the fused Snake, the network dtype option.

CPU tests check the PyTorch reference; the CUDA tests (skipped without a GPU) check the Triton
kernel against it and the float16 vocoder against the parity fixtures.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from cosyserve.errors import InvalidInputError
from cosyserve.models.hift import HiFTGenerator, HiftConfig, load_hift
from cosyserve.models.hift.snake import ALPHA_EPS, Snake, snake, snake_reference
from cosyserve.token2wav.cosyvoice2 import resolve_hift_dtype
from cosyserve.token2wav.graphs import HiftRunner

# |α| below 1/65504 ≈ 1.5e-5 overflows a float16 reciprocal; 0 and 1e-9 round to 0 in float16.
TINY_ALPHAS = [0.0, 1e-9, 3e-7, -2e-6, 1e-5, -1.2e-5, 0.5, 3.0]
HALF_DTYPES = (torch.float16, torch.bfloat16)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _upstream_snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Upstream's formula, evaluated in float64."""
    alpha = alpha.double()[None, :, None]
    x = x.double()
    return x + torch.sin(x * alpha) ** 2 / (alpha + ALPHA_EPS)


def _tiny_alpha_case(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, len(TINY_ALPHAS), 300, generator=gen)).to(device)
    return x, torch.tensor(TINY_ALPHAS, device=device)


def test_module_snake_is_the_reference_on_cpu():
    act = Snake(6).requires_grad_(False)
    with torch.no_grad():
        act.alpha.copy_(torch.tensor([0.3, 0.7, 1.0, 2.5, -0.4, 1e-3]))
    x = torch.randn(3, 6, 50)
    assert torch.equal(act(x), snake_reference(x, act.alpha))
    assert torch.equal(snake(x, act.alpha), snake_reference(x, act.alpha))  # CPU: the reference
    assert rel_l2(act(x), _upstream_snake(x, act.alpha)) < 1e-6


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_reciprocal_clamp_keeps_half_precision_finite(dtype):
    x, alpha = _tiny_alpha_case()
    # Without the clamp the reciprocal of the tiny alphas is infinite in float16 (the case to guard).
    naive = (alpha.half() + ALPHA_EPS).reciprocal()
    assert not bool(torch.isfinite(naive).all())
    got = snake_reference(x.to(dtype), alpha.to(dtype))
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    want = _upstream_snake(x.to(dtype), alpha.to(dtype))  # same rounded inputs, exact arithmetic
    assert rel_l2(got, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def _tiny_hift_with_tiny_alphas() -> HiFTGenerator:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = HiFTGenerator(HiftConfig.tiny()).fold_weight_norm().eval()
    snakes = [m for m in model.modules() if isinstance(m, Snake)]
    with torch.no_grad():
        for i, act in enumerate(snakes[::5]):
            act.alpha[i % act.alpha.numel()] = TINY_ALPHAS[i % 6]
    return model


def _zero_noise_call(model: HiFTGenerator, frames: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    mel = torch.randn(1, 80, frames, generator=gen).to(device)
    noise = torch.zeros(1, frames * model.hop_length, model.m_source.num_harmonics, device=device)
    return model.inference(mel, sine_noise=noise)


def test_half_network_keeps_f0_and_source_in_float32():
    model = _tiny_hift_with_tiny_alphas()
    want, want_source = _zero_noise_call(model, 12)
    # float32 is the reference computation, bit for bit.
    assert torch.equal(_zero_noise_call(copy.deepcopy(model).set_network_dtype(torch.float32), 12)[0], want)
    model.set_network_dtype(torch.bfloat16)
    assert model.network_dtype == torch.bfloat16 and model.source_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.f0_predictor.parameters())
    got, source = _zero_noise_call(model, 12)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert torch.equal(source, want_source)  # the excitation does not depend on the network dtype
    assert rel_l2(got, want) < 5e-2
    with pytest.raises(InvalidInputError):
        model.set_network_dtype(torch.float64)


def test_hift_dtype_option():
    assert resolve_hift_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_hift_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(InvalidInputError):
        resolve_hift_dtype("half", torch.device("cpu"))


# ----- CUDA -----

@CUDA
@pytest.mark.parametrize("dtype", (torch.float32, *HALF_DTYPES))
def test_fused_snake_matches_reference(dtype):
    x, alpha = _tiny_alpha_case("cuda")
    x, alpha = x.to(dtype), alpha.to(dtype)
    got = snake(x, alpha)
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    # float32 inside, so it is at least as close to the exact value as the reference.
    tolerance = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_l2(got, _upstream_snake(x, alpha)) < tolerance
    assert rel_l2(got, snake_reference(x, alpha)) < tolerance


@CUDA
def test_float16_hift_within_fixture_tolerance(parity_dir):
    """The float16 vocoder on the fixture's zero-noise cases, with PyTorch's default TF32 settings:
    within the end-to-end tolerance (rel-L2 < 1e-2, fixture README §2) of the reference waveform.
    (bfloat16 is not: 1.3e-2 measured, docs/benchmarks.md.)"""
    fixture_dir = parity_dir / "cosyvoice2"
    if not (fixture_dir / "hift_tiny.pt").is_file():
        pytest.skip(f"no HiFT fixtures in {fixture_dir}")
    from safetensors.torch import load_file

    cfg = HiftConfig.from_fixture_json(json.loads((fixture_dir / "hift_tiny_config.json").read_text()))
    model = load_hift(fixture_dir / "hift_tiny.pt", "cuda", config=cfg).set_network_dtype(torch.float16)
    io = load_file(str(fixture_dir / "hift_tiny_io.safetensors"))
    cases = sorted(k.split("/")[0] for k in io if k.endswith("_zero/speech"))
    assert cases
    for case in cases:
        mel = io[f"{case[:-len('_zero')]}/mel"].cuda()
        cache = io.get(f"{case}/cache_source")
        noise = torch.zeros(1, mel.shape[2] * model.hop_length, model.m_source.num_harmonics, device="cuda")
        speech, _ = model.inference(mel, None if cache is None else cache.cuda(), sine_noise=noise)
        assert rel_l2(speech.cpu(), io[f"{case}/speech"]) < 1e-2, case


@CUDA
def test_half_graphs_replay_the_eager_half_network():
    model = _tiny_hift_with_tiny_alphas().cuda().set_network_dtype(torch.float16)
    eager, graphs = HiftRunner(model, pad=True), HiftRunner(model, cuda_graphs=True)
    graphs.precapture(2, (30,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    mel = torch.randn(2, 80, 30, device="cuda", generator=gen)
    noise = 0.003 * torch.randn(2, 30 * model.hop_length, model.m_source.num_harmonics, device="cuda", generator=gen)
    want, got = eager(mel, None, noise)[0], graphs(mel, None, noise)[0]
    assert bool(torch.isfinite(got).all()) and not math.isnan(rel_l2(got, want))
    assert rel_l2(got, want) < 1e-5
