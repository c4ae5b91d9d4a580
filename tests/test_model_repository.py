"""cosyserve.serving.model_repository: which models each option builds, and a failing build."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cosyserve.serving.model_repository import (TEMPLATES, CosyVoice2Repository, StepAudio2Repository, TemplateError,
                                                build)


def parameter(repo: Path, model: str, key: str) -> str:
    text = (repo / model / "config.pbtxt").read_text()
    return re.search(r'key: "%s", value: \{ string_value: "([^"]*)"' % key, text).group(1)


def test_streaming_repository_is_the_engine_with_an_offline_twin(tmp_path):
    repo = build(CosyVoice2Repository(Path("/m"), offline_bls_instances=3), tmp_path / "repo")
    assert sorted(p.name for p in repo.iterdir()) == ["cosyvoice2", "cosyvoice2_offline"]
    offline = (repo / "cosyvoice2_offline" / "config.pbtxt").read_text()
    assert 'name: "cosyvoice2_offline"' in offline and "count: 3," in offline
    engine = (repo / "cosyvoice2" / "config.pbtxt").read_text()
    assert "decoupled: True" in engine and "count: 1," in engine  # one engine per GPU
    assert parameter(repo, "cosyvoice2", "llm_model_name") == ""  # the LLM engine in the loop
    with_reference = build(CosyVoice2Repository(Path("/m"), reference_models=True), tmp_path / "reference")
    assert sorted(p.name for p in with_reference.iterdir()) == ["audio_tokenizer", "cosyvoice2", "cosyvoice2_offline",
                                                                "llm", "speaker_embedding", "token2wav"]
    assert (with_reference / "llm" / "1" / "model.py").is_file()
    assert parameter(with_reference, "cosyvoice2", "llm_model_name") == ""  # the engine does not use them


def test_llm_choices(tmp_path):
    trt = build(CosyVoice2Repository(Path("/m"), llm_backend="trtllm", trt_engine_dir="/e", decoupled=False),
                tmp_path / "trt")
    assert sorted(p.name for p in trt.iterdir()) == ["cosyvoice2", "tensorrt_llm"]
    assert parameter(trt, "tensorrt_llm", "gpt_model_path") == "/e"
    assert parameter(trt, "cosyvoice2", "llm_model_name") == "tensorrt_llm"
    remote = build(CosyVoice2Repository(Path("/m"), llm_url="http://h:1/v1,x"), tmp_path / "remote")
    assert sorted(p.name for p in remote.iterdir()) == ["cosyvoice2", "cosyvoice2_offline"]
    assert parameter(remote, "cosyvoice2", "llm_url") == "http://h:1/v1,x"


def test_dit_repository_is_the_engine_with_step_audio2s_kind(tmp_path):
    """run_stepaudio2_dit_token2wav.sh's repository is one model, cosyvoice2_dit, from the engine's
    template with model_kind step_audio2: the DiT directory as model_dir, CosyVoice2's spk2info.pt,
    the LLM at llm_url (empty: in the loop); its settings give the kind's options."""
    import torch

    from cosyserve.serving.settings import EngineSettings, parse_settings

    repo = build(StepAudio2Repository(Path("/d"), Path("/c"), Path("/l"), llm_url="http://h:1/v1", device="cpu",
                               token2wav_dtype="bfloat16"), tmp_path / "dit")
    assert sorted(p.name for p in repo.iterdir()) == ["cosyvoice2_dit"]
    config = (repo / "cosyvoice2_dit" / "config.pbtxt").read_text()
    assert 'name: "cosyvoice2_dit"' in config and "decoupled: True" in config and "count: 1," in config
    front_door = (TEMPLATES / "cosyvoice2" / "1" / "model.py").read_text()
    assert (repo / "cosyvoice2_dit" / "1" / "model.py").read_text() == front_door
    expected = {"model_kind": "step_audio2", "model_dir": "/d", "spk2info": "/c/spk2info.pt", "llm_tokenizer_dir": "/l",
                "llm_url": "http://h:1/v1", "llm_model": "", "llm_model_name": "", "max_voices": "8"}
    assert {key: parameter(repo, "cosyvoice2_dit", key) for key in expected} == expected
    settings = parse_settings(EngineSettings, dict(re.findall(r'key: "([a-z0-9_]+)", value: \{ string_value: "([^"]*)"',
                                                              config)))
    assert settings.spk2info == Path("/c/spk2info.pt") and settings.model_kind == "step_audio2"
    assert settings.kind_options(torch.device("cpu")) == {"dtype": torch.bfloat16, "max_voices": 8}
    in_loop = build(StepAudio2Repository(Path("/d"), Path("/c"), Path("/l"), decoupled=False), tmp_path / "in_loop")
    assert parameter(in_loop, "cosyvoice2_dit", "llm_url") == ""  # the LLM in the engine's loop
    assert "decoupled: False" in (in_loop / "cosyvoice2_dit" / "config.pbtxt").read_text()


def test_a_template_that_does_not_fit_leaves_the_repository_alone(tmp_path):
    templates = tmp_path / "templates"
    for model in ("cosyvoice2", "cosyvoice2_offline"):
        (templates / model).mkdir(parents=True)
        (templates / model / "config.pbtxt").write_text((TEMPLATES / model / "config.pbtxt").read_text())
    (templates / "cosyvoice2_offline" / "config.pbtxt").write_text('name: "cosyvoice2_offline"\nmax_batch_size: 1\n')
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    with pytest.raises(TemplateError, match="do not appear"):
        build(CosyVoice2Repository(Path("/m")), out, templates)
    assert [p.name for p in out.iterdir()] == ["old"]


def test_command_line_refuses_a_bad_flag_value(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cosyserve.serving.model_repository", "cosyvoice2", str(tmp_path / "r"),
                           "--models-dir", "/m", "--decoupled", "maybe"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "expected True or False, got 'maybe'" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_the_stream_cap_reaches_every_streaming_bls(tmp_path):
    """MAX_STREAMS (max_streams) is a parameter of each model that streams (CosyVoice2's engine, whose
    offline requests obey it too); 0, the default, is no cap; a negative cap is refused. So is
    ADMISSION_MIN_BUFFER_S."""
    from cosyserve.serving.model_repository import CosyVoice3Repository

    cv2 = build(CosyVoice2Repository(Path("/m"), max_streams=6), tmp_path / "cv2")
    assert parameter(cv2, "cosyvoice2", "max_streams") == "6"  # the engine's: offline requests obey it too
    assert parameter(build(CosyVoice2Repository(Path("/m")), tmp_path / "off"), "cosyvoice2", "max_streams") == "0"
    dit = build(StepAudio2Repository(Path("/d"), Path("/c"), Path("/l"), llm_url="u", max_streams=3), tmp_path / "dit")
    assert parameter(dit, "cosyvoice2_dit", "max_streams") == "3"
    cv3 = build(CosyVoice3Repository(Path("/m"), max_streams=2), tmp_path / "cv3")
    assert parameter(cv3, "cosyvoice3", "max_streams") == "2"
    with pytest.raises(ValueError, match="max_streams is 0"):
        build(CosyVoice2Repository(Path("/m"), max_streams=-1), tmp_path / "bad")
    # the buffer rule (ADMISSION_MIN_BUFFER_S) reaches every streaming BLS the same way
    dit = build(StepAudio2Repository(Path("/d"), Path("/c"), Path("/l"), llm_url="u", admission_min_buffer_s=0.5), tmp_path / "dit2")
    cv3 = build(CosyVoice3Repository(Path("/m"), admission_min_buffer_s=0.5), tmp_path / "cv32")
    assert parameter(dit, "cosyvoice2_dit", "admission_min_buffer_s") == "0.5"
    assert parameter(cv3, "cosyvoice3", "admission_min_buffer_s") == "0.5"


def test_cosyvoice3_is_the_engine_with_cosyvoice3s_kind(tmp_path):
    """run_cosyvoice3.sh's repository is one model, cosyvoice3, from the engine's template (the
    front door cosyvoice2 runs on) with model_kind cosyvoice3; TOKEN2WAV_INCREMENTAL_STREAM reaches
    it (true by default: the block-masked incremental flow; false: the reference's full-attention
    re-run) and reads back as its setting."""
    import torch

    from cosyserve.serving.model_repository import CosyVoice3Repository
    from cosyserve.serving.settings import EngineSettings, parse_settings

    default = build(CosyVoice3Repository(Path("/m")), tmp_path / "on")
    rerun = build(CosyVoice3Repository(Path("/m"), token2wav_incremental_stream="false"), tmp_path / "off")
    assert sorted(p.name for p in default.iterdir()) == ["cosyvoice3"]
    assert parameter(default, "cosyvoice3", "model_kind") == "cosyvoice3"
    assert parameter(default, "cosyvoice3", "incremental_stream") == "true"
    assert parameter(rerun, "cosyvoice3", "incremental_stream") == "false"
    assert 'name: "cosyvoice3"' in (default / "cosyvoice3" / "config.pbtxt").read_text()
    settings = parse_settings(EngineSettings, {"model_dir": "/m", "llm_tokenizer_dir": "/l", "model_kind": "cosyvoice3",
                                               "incremental_stream": "false"})
    assert settings.kind_options(torch.device("cpu"))["incremental"] is False
