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
