"""run.sh settings that fail before doing any work."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_sh(tmp_path, *stages, **env):
    full_env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "MPS_DIR": str(tmp_path / "mps"), **env}
    return subprocess.run(["bash", str(REPO_ROOT / "run.sh"), *stages], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)


def test_unknown_cuda_mps_setting_is_refused(tmp_path):
    proc = run_sh(tmp_path, "4", "4", CUDA_MPS="sometimes")
    assert proc.returncode == 1
    assert "CUDA_MPS must be auto, on or off (got sometimes)" in proc.stdout


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is not None, reason="MPS is installed here")
def test_mps_on_without_the_daemon_fails_before_launching(tmp_path):
    proc = run_sh(tmp_path, "3", "3", CUDA_MPS="on", MODEL_REPO=str(tmp_path / "repo"))
    assert proc.returncode == 1
    assert "nvidia-cuda-mps-control is not installed" in proc.stdout
    assert "CUDA_MPS=on but MPS could not be started" in proc.stdout
    assert "tritonserver ready" not in proc.stdout


def test_stop_without_server_or_daemon_is_quiet(tmp_path):
    proc = run_sh(tmp_path, "stop", SERVER_PID_FILE=str(tmp_path / "none.pid"))
    assert proc.returncode == 0, proc.stderr
    assert "MPS" not in proc.stdout


SCRIPTS = ["run.sh", "run_stepaudio2_dit_token2wav.sh"]


def run_script(tmp_path, script, *args, **env):
    full_env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "MODELS_DIR": str(tmp_path / "models"),
                "MODEL_REPO": str(tmp_path / "repo"), **env}
    return subprocess.run(["bash", str(REPO_ROOT / script), *args], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, args", [
    ("run.sh", ("--stage", "2", "--stop-stage", "2")), ("run.sh", ("--stage=2", "--stop_stage=2")),
    ("run.sh", ("--stage", "2")), ("run_stepaudio2_dit_token2wav.sh", ("--stage", "2", "--stop-stage", "2")),
])
def test_icefall_stage_options_run_the_same_stages(script, args, tmp_path):
    proc = run_script(tmp_path, script, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Stage 2:" in proc.stdout and "Stage 3" not in proc.stdout
    positional = run_script(tmp_path, script, "2", "2", MODEL_REPO=str(tmp_path / "positional"))
    assert positional.returncode == 0, positional.stdout[-2000:]
    for model in (tmp_path / "repo").iterdir():
        assert (model / "config.pbtxt").read_text() == \
            (tmp_path / "positional" / model.name / "config.pbtxt").read_text()


@pytest.mark.parametrize("args, message", [
    (("--stage",), "--stage needs a value"),
    (("--stage", "two"), "the stage must be an integer or one of: stop"),
    (("2", "--stop-stage", "x"), "the stop stage must be an integer, got 'x'"),
    (("--stage", "1", "2"), "the stage is given twice"),
    (("1", "2", "3"), "expected <stage> [<stop_stage>]"),
    (("stop", "3"), "stage stop takes no stop stage"),
])
def test_bad_stage_arguments_are_refused_before_any_work(args, message, tmp_path):
    proc = run_script(tmp_path, "run.sh", *args)
    assert proc.returncode == 1
    assert message in proc.stdout
    assert "Stage" not in proc.stdout.replace(message, "") and not (tmp_path / "repo").exists()


def test_stage_options_reach_stop(tmp_path):
    proc = run_sh(tmp_path, "--stage", "stop", SERVER_PID_FILE=str(tmp_path / "none.pid"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_line_over_200_characters(script):
    long_lines = [n for n, line in enumerate((REPO_ROOT / script).read_text().splitlines(), 1) if len(line) > 200]
    assert not long_lines, f"{script}: lines {long_lines}"
