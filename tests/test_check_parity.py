"""scripts/check_parity.py as a user runs it: passes on the reference fixtures, fails on altered ones."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_parity.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # every suite through the CLI; the suites run in-process in their modules too
def test_all_reference_fixtures_pass(parity_dir):
    for name in ("cosyvoice2", "dit"):
        result = run("--fixtures", str(parity_dir / name))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert " 0 failed" in result.stdout.splitlines()[-1]


def test_altered_reference_fails(parity_dir, tmp_path):
    fixtures = tmp_path / "cosyvoice2"
    shutil.copytree(parity_dir / "cosyvoice2", fixtures)
    io = load_file(fixtures / "flow_tiny_io.safetensors")
    io["nonstream/mel"] = io["nonstream/mel"] + 0.05
    save_file(io, fixtures / "flow_tiny_io.safetensors")
    result = run("--fixtures", str(fixtures), "--suite", "cv2_flow")
    assert result.returncode == 1
    failing = [line for line in result.stdout.splitlines() if line.rstrip().endswith("FAIL") or "FAIL " in line]
    assert any("nonstream/mel" in line for line in failing), result.stdout


def test_unknown_directory_is_an_error(tmp_path):
    result = run("--fixtures", str(tmp_path))
    assert result.returncode == 2 and "matches no known fixture format" in result.stderr


@pytest.mark.slow  # every suite through the CLI; the suites run in-process in their modules too
def test_cosyvoice3_fixtures_pass_with_only_cosyvoice3_suites(parity_dir):
    """The CosyVoice3 set shares CosyVoice2's file names; only the cv3 suites may claim it."""
    result = run("--fixtures", str(parity_dir / "cosyvoice3"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = [line.split()[0] for line in result.stdout.splitlines()[2:-1]]
    assert set(rows) == {"cv3_frontend", "cv3_flow", "cv3_hift", "cv3_token2wav"}, set(rows)
    assert " 0 failed" in result.stdout.splitlines()[-1]


def test_altered_cosyvoice3_reference_fails(parity_dir, tmp_path):
    fixtures = tmp_path / "cosyvoice3"
    shutil.copytree(parity_dir / "cosyvoice3", fixtures)
    stream = load_file(fixtures / "token2wav_stream.safetensors")
    stream["stream/waveform"][:, 40000:40480] += 0.05  # one frame of the last chunk
    save_file(stream, fixtures / "token2wav_stream.safetensors")
    result = run("--fixtures", str(fixtures), "--suite", "cv3_token2wav")
    assert result.returncode == 1
    failing = [line for line in result.stdout.splitlines() if line.rstrip().endswith("FAIL") or "FAIL " in line]
    assert any("stream/waveform[34560:57600]" in line for line in failing), result.stdout
