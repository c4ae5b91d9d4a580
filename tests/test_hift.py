"""HiFT vocoder: parity against the shared fixtures, config round trips, loading, call contract."""

from __future__ import annotations

import pytest
import torch

from cosyserve.config import Tagged, dump_hyperpyyaml, load_hyperpyyaml
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.models.hift import HiFTGenerator, HiftConfig, load_hift
from cosyserve.models.hift.generator import MAX_MAGNITUDE, spectrum_to_wave, stft_spectrum
from cosyserve.parity import cv2_hift


@pytest.fixture(scope="module")
def tiny_state_dict() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return HiFTGenerator(HiftConfig.tiny()).state_dict()


@pytest.fixture(scope="module")
def tiny_hift(tmp_path_factory, tiny_state_dict) -> HiFTGenerator:
    path = tmp_path_factory.mktemp("hift") / "hift.pt"
    torch.save(tiny_state_dict, path)
    return load_hift(path, config=HiftConfig.tiny())


def test_parity_cv2_hift(parity_dir):
    fixture_dir = parity_dir / "cosyvoice2"
    if not cv2_hift.detect(fixture_dir):
        pytest.skip(f"no cv2_hift fixtures in {fixture_dir}")
    results = cv2_hift.run(fixture_dir)
    failed = [r for r in results if not r.passed]
    assert len(results) >= 20 and not failed, failed


# ----- config -----

def test_real_config_values():
    cfg = HiftConfig.real()
    assert (cfg.base_channels, cfg.f0_cond_channels, cfg.sampling_rate) == (512, 512, 24000)
    assert cfg.upsample_rates == (8, 5, 3) and cfg.source_resblock_kernel_sizes == (7, 7, 11)
    assert cfg.hop_length == 480


def test_yaml_node_round_trip(tmp_path):
    cfg = HiftConfig.tiny()
    node = cfg.to_yaml_node()
    assert node.target == "cosyvoice.hifigan.generator.HiFTGenerator"
    assert node.kwargs["f0_predictor"].target == "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"
    assert node.kwargs["istft_params"] == {"n_fft": 16, "hop_len": 4}
    assert HiftConfig.from_yaml_tree({"hift": node}) == cfg
    dump_hyperpyyaml({"sample_rate": 24000, "hift": node}, tmp_path / "cosyvoice2.yaml")
    assert HiftConfig.from_yaml_tree(load_hyperpyyaml(tmp_path / "cosyvoice2.yaml")) == cfg


def test_yaml_defaults_and_refs(tmp_path):
    assert HiftConfig.from_yaml_tree({}) == HiftConfig.real()
    (tmp_path / "c.yaml").write_text(
        "sample_rate: 24000\n"
        "hift: !new:cosyvoice.hifigan.generator.HiFTGenerator\n"
        "    sampling_rate: !ref <sample_rate>\n"
        "    base_channels: 64\n"
        "    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor\n"
        "        cond_channels: 16\n"
    )
    cfg = HiftConfig.from_yaml_tree(load_hyperpyyaml(tmp_path / "c.yaml"))
    assert (cfg.base_channels, cfg.f0_cond_channels, cfg.upsample_rates) == (64, 16, (8, 5, 3))


@pytest.mark.parametrize("node", [
    Tagged("new", "cosyvoice.hifigan.generator.HiFTGenerator", kwargs={"sampling_rate": 22050}),
    Tagged("new", "cosyvoice.hifigan.generator.CausalHiFTGenerator", kwargs={}),
    Tagged("new", "cosyvoice.hifigan.generator.HiFTGenerator", kwargs={"bogus": 1}),
    Tagged("new", "cosyvoice.hifigan.generator.HiFTGenerator", kwargs={"upsample_rates": [8, 5]}),
])
def test_bad_yaml_configs_rejected(node):
    with pytest.raises(ModelLoadError):
        HiftConfig.from_yaml_tree({"hift": node})


def test_fixture_json_layouts():
    generator, f0 = HiftConfig.tiny().to_kwargs()
    layouts = [
        {"kwargs": generator, "f0_predictor": {"kwargs": f0}},
        {"config": {"generator": generator, "f0_predictor": f0}},
        {**generator, "f0_predictor": {"type": "ConvRNNF0Predictor", **f0}},
    ]
    assert all(HiftConfig.from_fixture_json(d) == HiftConfig.tiny() for d in layouts)


# ----- loading -----

def test_state_dict_uses_parametrization_names(tiny_state_dict):
    assert "conv_pre.parametrizations.weight.original0" in tiny_state_dict
    assert "ups.0.parametrizations.weight.original0" in tiny_state_dict
    assert tiny_state_dict["ups.0.parametrizations.weight.original0"].shape == (32, 1, 1)  # input-channel axis
    assert "source_downs.0.weight" in tiny_state_dict  # source branch is not weight-normalised
    assert "f0_predictor.condnet.8.parametrizations.weight.original1" in tiny_state_dict


def _old_spelling(state_dict: dict) -> dict:
    renamed = {}
    for key, value in state_dict.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        renamed["generator." + key] = value
    return renamed


def test_load_accepts_prefix_old_names_and_folded(tmp_path, tiny_state_dict, tiny_hift):
    mel = torch.randn(1, 80, 6, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(1, 6 * 480, 9, generator=torch.Generator().manual_seed(2))
    expected, _ = tiny_hift.inference(mel, sine_noise=noise)
    folded = HiFTGenerator(HiftConfig.tiny())
    folded.load_state_dict(tiny_state_dict)
    folded_sd = folded.fold_weight_norm().state_dict()
    assert "conv_pre.weight" in folded_sd
    for name, state_dict in (("old.pt", _old_spelling(tiny_state_dict)), ("folded.pt", folded_sd)):
        torch.save(state_dict, tmp_path / name)
        model = load_hift(tmp_path / name, config=HiftConfig.tiny(), fold_weight_norm=False)
        speech, _ = model.inference(mel, sine_noise=noise)
        assert torch.allclose(speech, expected, atol=1e-6), name


def test_unfolded_model_keeps_upstream_keys(tmp_path, tiny_state_dict):
    torch.save(tiny_state_dict, tmp_path / "hift.pt")
    model = load_hift(tmp_path, config=HiftConfig.tiny(), fold_weight_norm=False)
    assert list(model.state_dict()) == list(tiny_state_dict)


def test_load_errors(tmp_path, tiny_state_dict):
    with pytest.raises(ModelLoadError, match="not found"):
        load_hift(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_hift(tmp_path / "junk.pt")
    torch.save(tiny_state_dict, tmp_path / "tiny.pt")
    with pytest.raises(ModelLoadError, match="does not match"):
        load_hift(tmp_path / "tiny.pt", config=HiftConfig.real())
    # Without a config the widths come from the checkpoint (config-less token2wav/ directories).
    assert load_hift(tmp_path / "tiny.pt").cfg == HiftConfig.tiny()
    partial = dict(tiny_state_dict)
    partial.pop("conv_post.bias")
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(ModelLoadError, match="conv_post.bias"):
        load_hift(tmp_path / "partial.pt", config=HiftConfig.tiny())


# ----- call contract -----

def test_inference_shapes_and_cache(tiny_hift):
    mel = torch.randn(2, 80, 10, generator=torch.Generator().manual_seed(3))
    cache = torch.full((2, 1, 960), 0.25)
    speech, source = tiny_hift.inference(mel, cache, generator=torch.Generator().manual_seed(0))
    assert speech.shape == (2, 4800) and source.shape == (2, 1, 4800) and speech.dtype == torch.float32
    assert torch.equal(source[:, :, :960], cache)
    assert speech.abs().max() <= 0.99


def test_generator_determinism_and_noise_injection(tiny_hift):
    mel = torch.randn(1, 80, 8, generator=torch.Generator().manual_seed(4))
    a, _ = tiny_hift.inference(mel, generator=torch.Generator().manual_seed(5))
    b, _ = tiny_hift.inference(mel, generator=torch.Generator().manual_seed(5))
    c, _ = tiny_hift.inference(mel, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    g = torch.Generator().manual_seed(5)
    torch.rand(1, 9, generator=g)
    noise = torch.empty(1, 9, 8 * 480).transpose(1, 2).normal_(generator=g)
    injected, _ = tiny_hift.inference(mel, sine_noise=noise)
    assert torch.equal(injected, a)


@pytest.mark.parametrize("kwargs", [
    {"mel": torch.zeros(1, 80, 0)},
    {"mel": torch.zeros(1, 40, 5)},
    {"mel": torch.zeros(80, 5)},
    {"mel": torch.zeros(1, 80, 2), "cache_source": torch.zeros(1, 1, 961)},
    {"mel": torch.zeros(1, 80, 2), "sine_noise": torch.zeros(1, 960, 8)},
])
def test_bad_inference_inputs(tiny_hift, kwargs):
    with pytest.raises(InvalidInputError):
        tiny_hift.inference(**kwargs)


def _reference_wave(spectrum: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor, limit: float) -> torch.Tensor:
    """What both vocoders computed before: torch.istft (which checks the window envelope on the host)."""
    bins = n_fft // 2 + 1
    magnitude = torch.exp(spectrum[:, :bins]).clamp(max=MAX_MAGNITUDE)
    phase = torch.sin(spectrum[:, bins:])
    complex_spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    return torch.istft(complex_spec, n_fft, hop, n_fft, window=window).clamp(-limit, limit)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_spectrum_to_wave_is_torch_istft_without_a_host_sync(device):
    cfg = HiftConfig.tiny()
    n_fft, hop = cfg.istft_n_fft, cfg.istft_hop_len
    window = torch.hann_window(n_fft, periodic=True, device=device)
    generator = torch.Generator().manual_seed(0)
    for batch, frames in ((1, 2), (3, 37), (16, 241)):
        spectrum = (torch.randn(batch, n_fft + 2, frames, generator=generator) * 2).to(device)
        expected = _reference_wave(spectrum, n_fft, hop, window, cfg.audio_limit)
        if device == "cuda":  # a host sync inside raises here
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            wave = spectrum_to_wave(spectrum, n_fft, hop, window, cfg.audio_limit)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        assert wave.shape == (batch, hop * (frames - 1))
        torch.testing.assert_close(wave, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_stft_spectrum_is_torch_stft_without_a_host_sync(device):
    """Both vocoders' excitation spectrum, a DFT product in float64 (no cuFFT plan per shape), equals
    torch.stft's (centred, reflect padding) [real ‖ imaginary] to float32 rounding, for rows and lengths
    of every kind; no host sync on a GPU, its first call included."""
    n_fft, hop = 16, 4
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float().to(device)
    generator = torch.Generator().manual_seed(1)
    for batch, samples in ((1, 9), (3, 481), (16, 480 * 60)):
        x = (torch.randn(batch, samples, generator=generator) * 0.3).to(device)
        spec = torch.stft(x, n_fft, hop, n_fft, window=window, return_complex=True)
        if device == "cuda":  # a host sync inside raises here
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = stft_spectrum(x, n_fft, hop, window)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        assert got.shape == (batch, n_fft + 2, 1 + samples // hop) and got.dtype == torch.float32
        torch.testing.assert_close(got, torch.cat([spec.real, spec.imag], dim=1), rtol=1e-5, atol=1e-5)
