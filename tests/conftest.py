"""Shared test fixtures: one thread for torch (2-core CI), the parity fixture dir, tiny bundles."""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
PARITY_DIR = Path(os.environ.get("COSYSERVE_PARITY_DIR", REPO_ROOT.parent / "shared" / "parity"))


@pytest.fixture(scope="session")
def parity_dir() -> Path:
    if not PARITY_DIR.is_dir():
        pytest.skip(f"parity fixtures not found at {PARITY_DIR} (set COSYSERVE_PARITY_DIR)")
    return PARITY_DIR


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    """A tiny random-weight bundle (CosyVoice2 dir + HF LLM + assets), built once per session."""
    from cosyserve.bundle import make_bundle

    return make_bundle(tmp_path_factory.mktemp("bundle"), "tiny", seed=0)


@pytest.fixture
def idle_server(server):
    """The requesting module's ``server`` (a real tritonserver), checked after the test: no stub
    crashed, no LLM request or token2wav stream is left. Modules may define their own."""
    from conftest_triton import assert_server_idle

    log_start = server.log_file.stat().st_size
    yield server
    assert_server_idle(server, log_start)
