"""cosyserve.serving.model_repository: which models each option builds, and a failing build."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cosyserve.serving.model_repository import (TEMPLATES, CosyVoice2Repository, DitRepository, TemplateError,
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


def test_dit_repository(tmp_path):
    repo = build(DitRepository(Path("/d"), Path("/c"), Path("/l"), "http://h:1/v1", device="cpu"), tmp_path / "dit")
    assert sorted(p.name for p in repo.iterdir()) == ["audio_tokenizer", "cosyvoice2_dit", "token2wav_dit"]
    assert parameter(repo, "token2wav_dit", "spk2info") == "/c/spk2info.pt"
    assert parameter(repo, "audio_tokenizer", "model_dir") == "/c"


def test_a_template_that_does_not_fit_leaves_the_repository_alone(tmp_path):
    templates = tmp_path / "templates"
    for model in ("cosyvoice2_dit", "token2wav_dit", "audio_tokenizer"):
        (templates / model).mkdir(parents=True)
        (templates / model / "config.pbtxt").write_text((TEMPLATES / model / "config.pbtxt").read_text())
    (templates / "token2wav_dit" / "config.pbtxt").write_text('name: "token2wav_dit"\nmax_batch_size: 1\n')
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    with pytest.raises(TemplateError, match="do not appear"):
        build(DitRepository(Path("/d"), Path("/c"), Path("/l"), "u"), out, templates)
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
    dit = build(DitRepository(Path("/d"), Path("/c"), Path("/l"), "u", max_streams=3), tmp_path / "dit")
    assert parameter(dit, "cosyvoice2_dit", "max_streams") == "3"
    cv3 = build(CosyVoice3Repository(Path("/m"), max_streams=2), tmp_path / "cv3")
    assert parameter(cv3, "cosyvoice3", "max_streams") == "2"
    with pytest.raises(ValueError, match="max_streams is 0"):
        build(CosyVoice2Repository(Path("/m"), max_streams=-1), tmp_path / "bad")
    # the buffer rule (ADMISSION_MIN_BUFFER_S) reaches every streaming BLS the same way
    dit = build(DitRepository(Path("/d"), Path("/c"), Path("/l"), "u", admission_min_buffer_s=0.5), tmp_path / "dit2")
    cv3 = build(CosyVoice3Repository(Path("/m"), admission_min_buffer_s=0.5), tmp_path / "cv32")
    assert parameter(dit, "cosyvoice2_dit", "admission_min_buffer_s") == "0.5"
    assert parameter(cv3, "cosyvoice3", "admission_min_buffer_s") == "0.5"


def test_cosyvoice3_token2wav_takes_the_streaming_flow_mode(tmp_path):
    """TOKEN2WAV_INCREMENTAL_STREAM reaches CosyVoice3's token2wav (true by default: the block-masked
    incremental flow; false: the reference's full-attention re-run) and reads back as its setting."""
    from cosyserve.serving.model_repository import CosyVoice3Repository
    from cosyserve.serving.settings import Cv3Token2WavSettings, parse_settings

    default = build(CosyVoice3Repository(Path("/m")), tmp_path / "on")
    rerun = build(CosyVoice3Repository(Path("/m"), token2wav_incremental_stream="false"), tmp_path / "off")
    assert parameter(default, "token2wav", "incremental_stream") == "true"
    assert parameter(rerun, "token2wav", "incremental_stream") == "false"
    settings = parse_settings(Cv3Token2WavSettings, {"model_dir": "/m", "incremental_stream": "false"})
    assert settings.incremental_stream is False
