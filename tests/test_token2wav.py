"""CosyVoice2 token2wav: parity, the streaming composition, session lifecycle, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from cosyserve.config import dump_hyperpyyaml
from cosyserve.errors import InvalidInputError
from cosyserve.models.flow import (
    CosyVoice2Flow,
    EncoderConfig,
    EstimatorConfig,
    FlowConfig,
    flow_from_state_dict,
    random_flow_state_dict,
)
from cosyserve.models.hift import HiFTGenerator, HiftConfig
from cosyserve.parity import cv2_token2wav
from cosyserve.token2wav import CosyVoice2Token2Wav, HiftStream, crossfade, load_token2wav

TINY_FLOW = FlowConfig(
    input_size=32,
    encoder=EncoderConfig(input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=1),
    estimator=EstimatorConfig(channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2),
)
PROMPT_TOKENS = 6


@pytest.fixture(scope="module")
def weights() -> tuple[dict, dict]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hift = HiFTGenerator(HiftConfig.tiny()).state_dict()
    return random_flow_state_dict(TINY_FLOW, seed=1), hift


@pytest.fixture(scope="module")
def t2w(weights) -> CosyVoice2Token2Wav:
    flow = flow_from_state_dict(TINY_FLOW, weights[0], "random")
    hift = HiFTGenerator(HiftConfig.tiny())
    hift.load_state_dict(weights[1])
    return CosyVoice2Token2Wav(flow, hift.fold_weight_norm().eval())


@pytest.fixture()
def prompt() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "prompt_tokens": torch.randint(0, 6561, (PROMPT_TOKENS,), generator=g),
        "prompt_feat": torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=g),
        "embedding": torch.randn(192, generator=g),
    }


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(n))


# ----- parity -----

def test_parity_cv2_token2wav(parity_dir):
    fixture_dir = parity_dir / "cosyvoice2"
    if not cv2_token2wav.detect(fixture_dir):
        pytest.skip(f"no cv2_token2wav fixtures in {fixture_dir}")
    results = cv2_token2wav.run(fixture_dir)
    failed = [r for r in results if not r.passed]
    assert len(results) >= 20 and not failed, failed


class _RecordedHift:
    """Replays the reference's raw HiFT outputs, so only the composition is under test."""

    hop_length = 480

    def __init__(self, ref: dict, prefix: str):
        self.calls = iter(range(100))
        self.ref, self.prefix = ref, prefix

    def inference(self, mel, cache_source, generator, sine_noise):
        key = f"{self.prefix}/chunk{next(self.calls)}"
        assert torch.equal(mel, self.ref[f"{key}/hift_mel_in"])
        expected_cache = self.ref[f"{key}/hift_cache_source_in"]
        assert (cache_source is None and expected_cache.numel() == 0) or torch.equal(cache_source, expected_cache)
        return self.ref[f"{key}/hift_speech"], self.ref[f"{key}/hift_source"]


def test_composition_matches_reference_exactly(parity_dir):
    path = parity_dir / "cosyvoice2" / "token2wav_stream.safetensors"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    ref = load_file(str(path))
    n_chunks = sum(1 for k in ref if k.startswith("stream/") and k.endswith("/hift_speech"))
    stream = HiftStream(_RecordedHift(ref, "stream"))
    pieces = []
    for i in range(n_chunks):
        mel_in = ref[f"stream/chunk{i}/hift_mel_in"]
        new_frames = mel_in[:, :, 0 if i == 0 else stream.mel_cache_frames:]
        pieces.append(stream.push(new_frames, finalize=i == n_chunks - 1).audio)
    wave = torch.cat(pieces, dim=1)
    assert wave.shape == ref["stream/waveform"].shape
    assert (wave - ref["stream/waveform"]).abs().max() < 1e-6
    assert stream.finished and not stream.has_cache


def test_crossfade_formula():
    new, old = torch.ones(1, 3840 * 2), torch.full((1, 3840), 2.0)
    out = crossfade(new, old)
    n = torch.arange(7680, dtype=torch.float64)
    w = 0.54 - 0.46 * torch.cos(2 * math.pi * n / 7679)
    expected = (w[:3840] + 2.0 * w[3840:]).float()
    assert torch.allclose(out[0, :3840], expected, atol=1e-6) and torch.equal(out[0, 3840:], new[0, 3840:])
    assert torch.equal(new, torch.ones(1, 7680))  # input untouched


# ----- streaming behaviour -----

SCHEDULE = [(18, 0, False), (43, 15, False), (60, 40, True)]


def test_stream_sample_counts_and_seed_reproducibility(t2w, prompt):
    tokens = _tokens(60)
    runs = []
    for _ in range(2):
        with t2w.open_stream(**prompt, generator=torch.Generator().manual_seed(4242)) as stream:
            pieces = [stream.step(tokens[:n], offset, final) for n, offset, final in SCHEDULE]
        runs.append(pieces)
    assert [p.shape[0] for p in runs[0]] == [10560, 24000, 23040]
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in runs[0])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    offline = t2w.offline(tokens, **prompt, generator=torch.Generator().manual_seed(4242))
    assert offline.shape == (60 * 960,)
    assert t2w.open_streams == 0


def test_finalize_closes_and_step_after_raises(t2w, prompt):
    stream = t2w.open_stream(**prompt)
    assert t2w.open_streams == 1
    stream.step(_tokens(10), 0, True)
    assert stream.closed and t2w.open_streams == 0
    with pytest.raises(InvalidInputError, match="closed"):
        stream.step(_tokens(10), 5, True)


def test_close_is_idempotent_and_counted_once(t2w, prompt):
    old = t2w.open_stream(**prompt)
    old.close()
    old.close()
    new = t2w.open_stream(**prompt)
    old.close()  # must not count the newer stream as closed
    assert t2w.open_streams == 1 and not new.closed
    new.close()
    assert t2w.open_streams == 0


def test_context_manager_and_errors_release_state(t2w, prompt):
    with pytest.raises(RuntimeError):
        with t2w.open_stream(**prompt) as stream:
            stream.step(_tokens(10), 0, False)
            raise RuntimeError("client went away")
    assert stream.closed and t2w.open_streams == 0

    stream = t2w.open_stream(**prompt)
    stream.step(_tokens(10), 0, False)
    with pytest.raises(InvalidInputError, match="6561"):
        stream.step(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 6561, 1, 2]), 7, False)
    assert stream.closed and t2w.open_streams == 0
    with pytest.raises(InvalidInputError):
        stream.step(_tokens(12), 7, True)


@pytest.mark.parametrize("tokens, offset, finalize, match", [
    (12, 3, False, "does not continue"),  # first step must start at 0
    (3, 0, False, "look-ahead"),  # nothing voiceable yet
    (0, 0, True, "more than 0"),
])
def test_bad_step_arguments(t2w, prompt, tokens, offset, finalize, match):
    stream = t2w.open_stream(**prompt)
    with pytest.raises(InvalidInputError, match=match):
        stream.step(_tokens(tokens), offset, finalize)
    assert t2w.open_streams == 0


@pytest.mark.parametrize("field, value, match", [
    ("prompt_tokens", torch.tensor([-1, 5, 6, 7, 8, 9]), "raw codes"),
    ("prompt_tokens", torch.tensor([151663, 5, 6, 7, 8, 9]), "raw codes"),
    ("prompt_tokens", torch.ones(6), "integer"),
    ("prompt_feat", torch.zeros(1, 11, 80), "prompt_feat"),
    ("embedding", torch.zeros(191), "192"),
    ("embedding", torch.full((192,), float("nan")), "NaN"),
])
def test_bad_prompts(t2w, prompt, field, value, match):
    with pytest.raises(InvalidInputError, match=match):
        t2w.open_stream(**{**prompt, field: value})
    with pytest.raises(InvalidInputError, match=match):
        t2w.offline(_tokens(5), **{**prompt, field: value})
    assert t2w.open_streams == 0


def test_offline_rejects_bad_tokens(t2w, prompt):
    for tokens in (torch.tensor([0, 6561]), torch.tensor([[1, 2], [3, 4]]), []):
        with pytest.raises(InvalidInputError):
            t2w.offline(tokens, **prompt)


def test_load_token2wav_from_model_dir(tmp_path, weights, prompt):
    tree = {"flow": TINY_FLOW.to_yaml_node(), "hift": HiftConfig.tiny().to_yaml_node()}
    dump_hyperpyyaml(tree, tmp_path / "cosyvoice2.yaml")
    torch.save(weights[0], tmp_path / "flow.pt")
    torch.save(weights[1], tmp_path / "hift.pt")
    loaded = load_token2wav(tmp_path)
    assert isinstance(loaded.flow, CosyVoice2Flow) and loaded.hift.cfg == HiftConfig.tiny()
    assert loaded.offline(_tokens(4), **prompt).shape == (4 * 960,)
