"""Model settings (cosyserve.serving.settings): parsing, "auto" rules, and agreement with the run
scripts: the repositories run.sh and run_stepaudio2_dit_token2wav.sh build with their default
variables parse back to the settings' defaults."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosyserve.serving.settings import (MODEL_SETTINGS, EngineSettings, LLMSettings, Token2WavSettings, parameter_value,
                                        parse_settings)
from cosyserve.token2wav.cosyvoice2 import DEFAULT_PRECAPTURE_FRAMES
from cosyserve.token2wav.step_audio2 import DEFAULT_MAX_VOICES

REPO_ROOT = Path(__file__).resolve().parents[1]
PARAMETER = re.compile(r'\{ key: "([a-z0-9_]+)", value: \{ string_value: "([^"]*)" \} \}')
# Fields the run scripts set to where things are (or must set), not to a default.
LOCATIONS = {"model_dir", "llm_dir", "llm_tokenizer_dir", "spk2info", "llm_url"}
# Where a model's kind has defaults of its own: Step-Audio2's voice states are larger than CosyVoice2's pages.
KIND_DEFAULTS = {"cosyvoice2_dit": {"model_kind": "step_audio2", "max_voices": DEFAULT_MAX_VOICES}}


def parameters(config: Path) -> dict[str, str]:
    return dict(PARAMETER.findall(config.read_text()))


def test_parse_reads_each_type_and_auto():
    settings = parse_settings(Token2WavSettings, {
        "model_dir": "/m", "cuda_graphs": "AUTO", "hift_graphs": "Yes", "compile": "0", "precapture_frames": "auto",
        "stream_idle_timeout_s": "2.5", "max_batch": "4", "dtype": "", "unrelated": "x"})
    assert settings == Token2WavSettings(Path("/m"), cuda_graphs=None, hift_graphs=True, compile=False,
                                         precapture_frames=None, stream_idle_timeout_s=2.5, max_batch=4)
    assert parse_settings(LLMSettings, {"llm_dir": "/l", "model_dir": ""}).model_dir is None
    for value in (None, True, False, 7, "x"):
        assert parameter_value(value) in ("auto", "true", "false", "7", "x")


def test_parse_names_the_wrong_parameter():
    with pytest.raises(ValueError, match="'model_dir' is missing or empty"):
        parse_settings(EngineSettings, {"llm_tokenizer_dir": "/t"})
    with pytest.raises(ValueError, match="cuda_graphs: expected true, false or auto, got 'maybe'"):
        parse_settings(Token2WavSettings, {"model_dir": "/m", "cuda_graphs": "maybe"})
    with pytest.raises(ValueError, match="max_tokens"):
        parse_settings(EngineSettings, {"model_dir": "/m", "llm_tokenizer_dir": "/t", "max_tokens": "many"})


def test_token2wav_auto_rules():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = Token2WavSettings(Path("/m"))
    assert auto.flow_dtype(cpu) == torch.float32 and auto.flow_dtype(cuda) == torch.float16
    assert Token2WavSettings(Path("/m"), dtype="bfloat16").flow_dtype(cpu) == torch.bfloat16
    on_cpu, on_cuda = auto.options(cpu), auto.options(cuda)
    assert not on_cpu.cuda_graphs and not on_cpu.hift_graphs and on_cpu.precapture_frames == 0
    assert on_cuda.cuda_graphs and on_cuda.hift_graphs and on_cuda.precapture_frames == DEFAULT_PRECAPTURE_FRAMES
    assert on_cuda.hift_precapture_frames and on_cuda.precapture_batch == auto.max_batch
    no_hift = Token2WavSettings(Path("/m"), hift_graphs=False, precapture_frames=0).options(cuda)
    assert no_hift.cuda_graphs and not no_hift.hift_graphs and not no_hift.hift_precapture_frames
    assert no_hift.precapture_frames == 0


def _defaults_env(tmp_path: Path) -> dict[str, str]:
    """Only what the scripts need to run stage 2: every setting keeps its default."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return {**keep, "MODELS_DIR": str(tmp_path / "models"), "MODEL_REPO": str(tmp_path / "repo"),
            "OUT_DIR": str(tmp_path / "out"), "VENV": str(Path(sys.prefix))}


@pytest.mark.parametrize("script", ["run.sh", "run_stepaudio2_dit_token2wav.sh"])
def test_run_script_defaults_are_the_settings_defaults(script, tmp_path):
    proc = subprocess.run(["bash", str(REPO_ROOT / script), "2", "2"], cwd=REPO_ROOT, env=_defaults_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    models = sorted(p.name for p in (tmp_path / "repo").iterdir())
    assert models
    for model in models:
        cls = MODEL_SETTINGS.get(model) or MODEL_SETTINGS[model.removesuffix("_offline")]
        params = parameters(tmp_path / "repo" / model / "config.pbtxt")
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(params) <= names, f"{model}: parameters that {cls.__name__} does not read"
        settings = parse_settings(cls, params)
        for field in dataclasses.fields(cls):
            if field.name in LOCATIONS or field.default is dataclasses.MISSING:
                continue
            expected = KIND_DEFAULTS.get(model, {}).get(field.name, field.default)
            assert getattr(settings, field.name) == expected, (script, model, field.name)


def test_run_sh_default_queue_is_the_builders(tmp_path):
    """run.sh's OFFLINE_BLS_MAX_QUEUE_SIZE defaults to the builder's (0, no limit); None in the
    builder is as many as there are instances. The engine (cosyvoice2) never queues in Triton."""
    from cosyserve.serving.model_repository import CosyVoice2Repository

    proc = subprocess.run(["bash", str(REPO_ROOT / "run.sh"), "2", "2"], cwd=REPO_ROOT, env=_defaults_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    built = CosyVoice2Repository(tmp_path / "models").models()
    text = (tmp_path / "repo" / "cosyvoice2_offline" / "config.pbtxt").read_text()
    assert re.search(r"max_queue_size: (\d+)", text).group(1) == built["cosyvoice2_offline"].values["max_queue_size"]
    assert built["cosyvoice2_offline"].values["max_queue_size"] == "0"
    assert "max_queue_size" not in (tmp_path / "repo" / "cosyvoice2" / "config.pbtxt").read_text()
    per_instance = CosyVoice2Repository(tmp_path, offline_bls_max_queue_size=None, offline_bls_instances=2).models()
    assert per_instance["cosyvoice2_offline"].values["max_queue_size"] == "2"