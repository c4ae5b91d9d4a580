"""Front-end models and speakers: generated ONNX stand-ins, sessions, prompt glue, spk2info registry."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file

from cosyserve.audio import prompt_audio_from_array, whisper_log_mel
from cosyserve.bundle.onnx_models import write_campplus_onnx, write_speech_tokenizer_onnx
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.frontend import (
    PromptFeatures,
    SpeakerEncoder,
    SpeakerRegistry,
    SpeechTokenizer,
    build_prompt_features,
    prompt_mel,
    trim_to_token_rate,
)
from cosyserve.frontend.prompt import COSYVOICE3_MEL_FMAX, device_prompt_mel

torch.set_num_threads(1)


def voice_like(seconds: float, rate: int = 16000, f0: float = 140.0, seed: int = 0) -> torch.Tensor:
    """Harmonic tone with a syllable-rate envelope and a little noise."""
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    phase = 2 * math.pi * (f0 * t + 3.0 * torch.sin(2 * math.pi * 0.7 * t))
    wave = sum(torch.sin(k * phase) / k for k in range(1, 10)) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3.0 * t) ** 2)
    noise = 0.003 * torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (0.2 * wave + noise).to(torch.float32)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx")
    write_speech_tokenizer_onnx(out / "speech_tokenizer_v2.onnx", "tiny", seed=1)
    write_campplus_onnx(out / "campplus.onnx", "tiny", seed=2)
    return out


@pytest.fixture(scope="module")
def tokenizer(onnx_dir: Path) -> SpeechTokenizer:
    return SpeechTokenizer(onnx_dir / "speech_tokenizer_v2.onnx", providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def encoder(onnx_dir: Path) -> SpeakerEncoder:
    return SpeakerEncoder(onnx_dir / "campplus.onnx")


# --- generated ONNX models ------------------------------------------------------------------


def test_tiny_models_build_fast_with_the_real_interface(tmp_path: Path):
    start = time.perf_counter()
    tok_path = write_speech_tokenizer_onnx(tmp_path / "tok.onnx", "tiny", seed=0)
    cam_path = write_campplus_onnx(tmp_path / "cam.onnx", "tiny", seed=0)
    assert time.perf_counter() - start < 3.0  # two torch.onnx traces of tiny modules
    tok = ort.InferenceSession(str(tok_path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in tok.get_inputs()] == [
        ("feats", "tensor(float)"), ("feats_length", "tensor(int32)")]
    assert [(o.name, o.type) for o in tok.get_outputs()] == [("indices", "tensor(int32)")]
    cam = ort.InferenceSession(str(cam_path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in cam.get_inputs()] == [("input", "tensor(float)")]
    assert cam.get_inputs()[0].shape[2] == 80
    assert [(o.name, o.type) for o in cam.get_outputs()] == [("output", "tensor(float)")]
    assert onnx.load(str(tok_path)).metadata_props[0].key == "cosyserve.stand_in"
    # Same seed, same bytes; another seed, other weights.
    write_speech_tokenizer_onnx(tmp_path / "again.onnx", "tiny", seed=0)
    write_speech_tokenizer_onnx(tmp_path / "other.onnx", "tiny", seed=5)
    assert (tmp_path / "again.onnx").read_bytes() == tok_path.read_bytes()
    assert (tmp_path / "other.onnx").read_bytes() != tok_path.read_bytes()
    with pytest.raises(ValueError, match="size"):
        write_campplus_onnx(tmp_path / "x.onnx", "huge", seed=0)


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5, 8, 123, 170, 3000])
def test_tokenizer_graph_length_and_code_range(onnx_dir: Path, frames: int):
    session = ort.InferenceSession(str(onnx_dir / "speech_tokenizer_v2.onnx"), providers=["CPUExecutionProvider"])
    feats = np.random.default_rng(frames).standard_normal((1, 128, frames)).astype(np.float32)
    (codes,) = session.run(None, {"feats": feats, "feats_length": np.array([frames], np.int32)})
    assert codes.shape == (1, math.ceil(math.ceil(frames / 2) / 2)) and codes.dtype == np.int32
    assert codes.min() >= 0 and codes.max() < 6561
    # Frames past feats_length are padding: the output is cut to the valid length.
    if frames >= 8:
        (short,) = session.run(None, {"feats": feats, "feats_length": np.array([frames // 2], np.int32)})
        assert short.shape == (1, math.ceil(math.ceil(frames // 2 / 2) / 2))


def test_campplus_graph_batch_and_time_pooling(onnx_dir: Path):
    session = ort.InferenceSession(str(onnx_dir / "campplus.onnx"), providers=["CPUExecutionProvider"])
    feats = np.random.default_rng(0).standard_normal((2, 150, 80)).astype(np.float32)
    (out,) = session.run(None, {"input": feats})
    assert out.shape == (2, 192) and out.dtype == np.float32
    (first,) = session.run(None, {"input": feats[:1]})
    np.testing.assert_allclose(first[0], out[0], rtol=1e-5, atol=1e-5)


# --- onnxruntime wrappers -------------------------------------------------------------------


def rename_io(src: Path, dst: Path, renames: dict[str, str]) -> Path:
    """Copy an ONNX model with its graph inputs/outputs renamed (everywhere they are used)."""
    model = onnx.load(str(src))
    for value in list(model.graph.input) + list(model.graph.output):
        value.name = renames.get(value.name, value.name)
    for node in model.graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    onnx.save(model, str(dst))
    return dst


def test_tokenizer_reads_names_from_the_session(onnx_dir: Path, tokenizer: SpeechTokenizer, tmp_path: Path):
    wav = voice_like(2.0)
    tokens = tokenizer.tokenize(wav)
    frames = whisper_log_mel(wav).shape[-1]
    assert tokens.dtype == torch.int32 and tokens.shape == (math.ceil(math.ceil(frames / 2) / 2),)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 6561
    renamed = rename_io(onnx_dir / "speech_tokenizer_v2.onnx", tmp_path / "renamed.onnx",
                        {"feats": "mel", "feats_length": "mel_len", "indices": "codes"})
    assert torch.equal(SpeechTokenizer(renamed, providers=["CPUExecutionProvider"]).tokenize(wav), tokens)


def test_speaker_encoder_reads_names_from_the_session(onnx_dir: Path, encoder: SpeakerEncoder, tmp_path: Path):
    embedding = encoder.embed(voice_like(2.0))
    assert embedding.shape == (192,) and embedding.dtype == torch.float32
    assert not torch.allclose(embedding, encoder.embed(voice_like(2.0, f0=230.0, seed=1)))
    renamed = rename_io(onnx_dir / "campplus.onnx", tmp_path / "renamed.onnx", {"input": "fbank", "output": "xvector"})
    torch.testing.assert_close(SpeakerEncoder(renamed).embed(voice_like(2.0)), embedding)


def test_wrappers_reject_bad_models_and_inputs(tokenizer: SpeechTokenizer, encoder: SpeakerEncoder, tmp_path: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        SpeechTokenizer(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(ModelLoadError, match="cannot load"):
        SpeakerEncoder(tmp_path / "junk.onnx")
    with pytest.raises(ModelLoadError, match="inputs"):  # CAM++ has one input, the tokenizer needs two
        SpeechTokenizer(encoder.path)
    with pytest.raises(InvalidInputError, match="30 s"):
        tokenizer.tokenize(torch.zeros(16000 * 31))
    with pytest.raises(InvalidInputError, match="1-D"):
        encoder.embed(torch.zeros(1, 16000))
    with pytest.raises(InvalidInputError, match="too short"):
        encoder.embed(torch.zeros(300))


# --- prompt glue ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens,n_frames,expected", [(50, 101, 50), (50, 90, 45), (10, 20, 10), (3, 100, 3)])
def test_trim_to_token_rate(n_tokens: int, n_frames: int, expected: int):
    tokens = torch.arange(n_tokens, dtype=torch.int32)
    feat = torch.arange(n_frames, dtype=torch.float32)[:, None].expand(n_frames, 80)
    kept_tokens, kept_feat = trim_to_token_rate(tokens, feat)
    assert torch.equal(kept_tokens, tokens[:expected])
    assert torch.equal(kept_feat, feat[: 2 * expected])


def test_trim_to_token_rate_rejects_empty():
    with pytest.raises(InvalidInputError, match="too short"):
        trim_to_token_rate(torch.zeros(0, dtype=torch.int32), torch.zeros(10, 80))


def test_build_prompt_features(tokenizer: SpeechTokenizer, encoder: SpeakerEncoder):
    prompt = prompt_audio_from_array(voice_like(1.99), 16000)
    features = build_prompt_features(prompt, tokenizer, encoder)
    mel = prompt_mel(prompt.wav24)
    tokens = tokenizer.tokenize(prompt.wav16)
    n = min(mel.shape[0] // 2, tokens.numel())
    assert features.speech_tokens.dtype == torch.int32 and torch.equal(features.speech_tokens, tokens[:n])
    assert features.speech_feat.shape == (2 * n, 80) and torch.equal(features.speech_feat, mel[: 2 * n])
    torch.testing.assert_close(features.embedding, encoder.embed(prompt.wav16))


@pytest.mark.parametrize("rate", [16000, 44100])
def test_the_device_prompt_mel_equals_the_hosts(rate: int):
    """A GPU front end's prompt mel (24 kHz resampled from the source on its device, the STFT over the
    frames of the clip's seconds bucket), here with the CPU as the device: the host path's values."""
    prompt = prompt_audio_from_array(voice_like(2.3, rate=rate), rate)
    on_device = device_prompt_mel(prompt, torch.device("cpu"), COSYVOICE3_MEL_FMAX)
    expected = prompt_mel(prompt.wav24, COSYVOICE3_MEL_FMAX)
    assert on_device.shape == expected.shape
    torch.testing.assert_close(on_device, expected, rtol=1e-4, atol=1e-4)


def test_cosyvoice3_prompt_mel_uses_the_nyquist_band(tokenizer: SpeechTokenizer, encoder: SpeakerEncoder):
    """CosyVoice3's prompt mel reaches 12 kHz (its yaml's fmax null), CosyVoice2's stops at 8 kHz:
    the same clip gives a mel of the same shape and other values."""
    prompt = prompt_audio_from_array(voice_like(1.99), 16000)
    cv2 = build_prompt_features(prompt, tokenizer, encoder)
    cv3 = build_prompt_features(prompt, tokenizer, encoder, COSYVOICE3_MEL_FMAX)
    assert cv3.speech_feat.shape == cv2.speech_feat.shape
    assert not torch.allclose(cv3.speech_feat, cv2.speech_feat)


def test_prompt_mel_matches_the_flow_fixture_prompt(parity_dir: Path):
    """The flow fixture's prompt_feat is the first frames of w24_c's 24 kHz mel (README §4.1)."""
    fixture_dir = parity_dir / "cosyvoice2"
    if not (fixture_dir / "flow_tiny_io.safetensors").is_file() or not (fixture_dir / "frontend.safetensors").is_file():
        pytest.skip("flow/frontend fixtures absent")
    flow_io = load_file(str(fixture_dir / "flow_tiny_io.safetensors"))
    wave = load_file(str(fixture_dir / "frontend.safetensors"))["w24_c/wave"][0]
    tokens, feat = trim_to_token_rate(flow_io["prompt_token"][0], prompt_mel(wave))
    assert torch.equal(tokens, flow_io["prompt_token"][0])
    assert float((feat - flow_io["prompt_feat"][0]).abs().max()) < 1e-3


# --- speaker registry -----------------------------------------------------------------------


def fake_features(n_tokens: int, seed: int) -> PromptFeatures:
    g = torch.Generator().manual_seed(seed)
    return PromptFeatures(speech_tokens=torch.randint(0, 6561, (n_tokens,), generator=g, dtype=torch.int32),
                          speech_feat=torch.randn(2 * n_tokens, 80, generator=g),
                          embedding=torch.randn(192, generator=g))


def released_style_spk2info() -> dict:
    """Shaped like the spk2info.pt the Triton runtime downloads (batch dims, extra keys)."""
    features = fake_features(87, seed=7)
    return {"001": {"name": "default", "spk_id": "001", "prompt_text": "希望你以后能够做的比我还好呦",
                    "prompt_text_token": torch.arange(14, dtype=torch.int32)[None],
                    "speech_feat": features.speech_feat[None], "speech_token": features.speech_tokens[None],
                    "embedding": features.embedding[None]}}


def test_registry_reads_released_layout_and_keeps_extra_keys(tmp_path: Path):
    path = tmp_path / "spk2info.pt"
    torch.save(released_style_spk2info(), path)
    registry = SpeakerRegistry.load(path)
    speaker = registry.get("001")
    assert speaker.prompt_text == "希望你以后能够做的比我还好呦"
    assert speaker.features.speech_tokens.shape == (87,) and speaker.features.speech_feat.shape == (174, 80)
    assert speaker.features.embedding.shape == (192,)
    registry.add("alice", fake_features(30, seed=1), prompt_text="hello there")
    registry.save()  # back to the file it was loaded from
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert set(saved) == {"001", "alice"}
    assert set(saved["001"]) == set(released_style_spk2info()["001"])  # extra keys kept
    assert torch.equal(saved["001"]["prompt_text_token"], torch.arange(14, dtype=torch.int32)[None])
    alice = saved["alice"]
    assert alice["speech_token"].shape == (1, 30) and alice["speech_token"].dtype == torch.int32
    assert alice["speech_feat"].shape == (1, 60, 80) and alice["embedding"].shape == (1, 192)
    assert alice["prompt_text"] == "hello there" and alice["spk_id"] == "alice"
    assert [p.name for p in tmp_path.iterdir()] == ["spk2info.pt"]  # no temp file left behind
    round_trip = SpeakerRegistry.load(path)
    assert round_trip.ids() == ["001", "alice"]
    assert torch.equal(round_trip.get("alice").features.speech_feat, registry.get("alice").features.speech_feat)


def test_registry_unknown_id_and_bad_entries(tmp_path: Path):
    registry = SpeakerRegistry(released_style_spk2info())
    with pytest.raises(InvalidInputError, match="unknown speaker id 'bob': 1 speakers are registered"):
        registry.get("bob")
    with pytest.raises(InvalidInputError, match="unknown"):
        registry.remove("bob")
    registry.remove("001")
    assert len(registry) == 0 and "001" not in registry
    with pytest.raises(InvalidInputError, match="non-empty"):
        registry.add("", fake_features(5, seed=0))
    entry = released_style_spk2info()["001"]
    with pytest.raises(ModelLoadError, match="missing"):
        SpeakerRegistry({"x": {k: v for k, v in entry.items() if k != "embedding"}})
    with pytest.raises(ModelLoadError, match="speech_feat"):
        SpeakerRegistry({"x": {**entry, "speech_feat": entry["speech_feat"][:, :-2]}})
    with pytest.raises(ModelLoadError, match="192"):
        SpeakerRegistry({"x": {**entry, "embedding": torch.zeros(1, 80)}})
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ModelLoadError, match="dict"):
        SpeakerRegistry.load(tmp_path / "list.pt")
    with pytest.raises(ModelLoadError, match="does not exist"):
        SpeakerRegistry.load(tmp_path / "missing.pt")


def test_register_speaker_from_audio(tokenizer: SpeechTokenizer, encoder: SpeakerEncoder, tmp_path: Path):
    registry = SpeakerRegistry()
    prompt = prompt_audio_from_array(voice_like(2.5), 16000)
    speaker = registry.register("carol", prompt, "some transcript", tokenizer, encoder)
    expected = build_prompt_features(prompt, tokenizer, encoder)
    assert speaker.prompt_text == "some transcript"
    assert torch.equal(speaker.features.speech_tokens, expected.speech_tokens)
    assert torch.equal(speaker.features.speech_feat, expected.speech_feat)
    loaded = SpeakerRegistry.load(registry.save(tmp_path / "spk.pt")).get("carol")
    assert torch.equal(loaded.features.embedding, expected.embedding)


def test_registry_concurrent_adds_and_lookups():
    registry = SpeakerRegistry(released_style_spk2info())
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for step in range(20):
                registry.add(f"spk{index}_{step}", fake_features(4, seed=step))
                assert registry.get("001").features.speech_tokens.numel() == 87
                registry.to_spk2info()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(registry) == 1 + 4 * 20
