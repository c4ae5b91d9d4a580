"""The random-weight bundle: released layout, strict loading, and a full token2wav pass."""

import json

import pytest
import torch

from cosyserve.bundle import COSYVOICE2_DIR, DEFAULT_SPEAKER_ID, LLM_DIR, make_bundle
from cosyserve.config import load_hyperpyyaml
from cosyserve.frontend.speakers import SpeakerRegistry
from cosyserve.models.flow import FlowConfig
from cosyserve.models.hift import HiftConfig
from cosyserve.token2wav import load_token2wav


def test_layout_matches_released_files(tiny_bundle):
    model_dir = tiny_bundle / COSYVOICE2_DIR
    for name in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", "spk2info.pt"):
        assert (model_dir / name).is_file(), name
    llm_dir = tiny_bundle / LLM_DIR
    config = json.loads((llm_dir / "config.json").read_text())
    assert config["vocab_size"] == 158336 and config["tie_word_embeddings"] is False
    assert (tiny_bundle / "assets" / "prompt_audio.wav").is_file()


def test_yaml_describes_the_written_models(tiny_bundle):
    tree = load_hyperpyyaml(tiny_bundle / COSYVOICE2_DIR / "cosyvoice2.yaml")
    assert FlowConfig.from_yaml_tree(tree) == FlowConfig.tiny()
    assert HiftConfig.from_yaml_tree(tree) == HiftConfig.tiny()


def test_default_speaker_and_token2wav_run(tiny_bundle):
    model_dir = tiny_bundle / COSYVOICE2_DIR
    speaker = SpeakerRegistry.load(model_dir / "spk2info.pt").get(DEFAULT_SPEAKER_ID)
    feats = speaker.features
    assert feats.speech_feat.shape[-2] == 2 * feats.speech_tokens.shape[-1]
    t2w = load_token2wav(model_dir, "cpu", torch.float32)
    tokens = torch.randint(0, 6561, (1, 20), generator=torch.Generator().manual_seed(0))
    wav = t2w.offline(tokens, feats.speech_tokens.reshape(1, -1), feats.speech_feat.reshape(1, -1, 80),
                      feats.embedding.reshape(1, -1))
    assert wav.shape == (20 * 2 * 480,) and torch.isfinite(wav).all() and wav.abs().max() > 0


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="size"):
        make_bundle(tmp_path, "huge")
    with pytest.raises(ValueError, match="unknown bundle parts"):
        make_bundle(tmp_path, "tiny", parts=("vocoder",))


def test_dit_directory_loads_strictly(tmp_path):
    from cosyserve.bundle.step_audio2 import tiny_step_audio2_config
    from cosyserve.runtime import STEP_AUDIO2_DIR
    from cosyserve.models.step_audio2 import StepAudio2FlowConfig
    from cosyserve.token2wav.step_audio2 import load_step_audio2

    make_bundle(tmp_path, "tiny", seed=1, parts=("step_audio2",))
    model_dir = tmp_path / STEP_AUDIO2_DIR
    for name in ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):
        assert (model_dir / name).is_file(), name
    assert StepAudio2FlowConfig.from_yaml_tree(load_hyperpyyaml(model_dir / "flow.yaml")) == tiny_step_audio2_config()
    t2w = load_step_audio2(model_dir, "cpu", torch.float32)
    assert t2w.hift.cfg == HiftConfig.tiny()  # widths read from the config-less hift.pt
