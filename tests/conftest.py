"""Shared test fixtures: one thread for torch (2-core CI), the parity fixture dir, tiny bundles; and the
tiers: ``-m e2e`` starts real servers, ``-m slow`` is in-process but minutes of CPU, and
``-m "not e2e and not slow" -n 2`` is the development loop (README). The whole suite is all three.

A test is end-to-end (marked ``e2e``) when its module is in :data:`E2E_MODULES`, or by its own
``@pytest.mark.e2e`` in a module of mostly in-process tests. The guard below keeps a new server test
from landing in the fast tier unnoticed: outside ``e2e`` tests, starting a server process fails.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
PARITY_DIR = Path(os.environ.get("COSYSERVE_PARITY_DIR", REPO_ROOT.parent / "shared" / "parity"))

# Test modules whose tests start servers: tritonserver, the API, an LLM server, a browser, or a recipe's
# stages (which build repositories and start servers) in a subprocess.
E2E_MODULES = {
    "test_api": "tritonserver, the API, the playground in Chromium",
    "test_api_cosyvoice3": "a CosyVoice3 tritonserver behind the API",
    "test_api_router": "two tritonservers behind the API's router",
    "test_bls_llm_protocols": "tritonserver on an OpenAI-compatible LLM server; run.sh stage 2",
    "test_cosyvoice3_e2e": "a CosyVoice3 tritonserver; run_cosyvoice3.sh's tiny recipe",
    "test_step_audio2_e2e": "the Step-Audio2 tritonserver (cosyvoice2_dit); the recipe's tiny run and stages 7-8",
    "test_faults": "nine tritonservers, some of them killed",
    "test_run_sh": "run.sh and the DiT recipe's stages",
    "test_run_sh_disaggregated": "run.sh stage 7: LLM servers, tritonserver, the API",
    "test_settings": "run.sh and the DiT recipe's stage 2",
    "test_triton_e2e": "tritonserver with the whole repository",
    "test_tritonserver": "tritonserver on echo models",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in E2E_MODULES:
            item.add_marker(pytest.mark.e2e)


# What a server process's command line looks like (argv[0], or the module run with -m), and the
# recipes: any stage but ``stop`` builds or starts something.
_SERVER_ARGV0 = re.compile(r"(^|/)(tritonserver|trtllm-serve|uvicorn|chromium|chromium-browser|chrome|headless_shell)$"
                           r"|/playwright/driver/node$")  # Playwright's driver, which then starts the browser
_SERVER_MODULES = {"cosyserve.api", "cosyserve.api.service", "cosyserve.llm.openai_server"}
_RECIPES = {"run.sh", "run_cosyvoice3.sh", "run_stepaudio2_dit_token2wav.sh"}


def starts_a_server(argv) -> bool:
    """Whether a subprocess with command line ``argv`` is a server or a recipe run that starts one."""
    args = [os.fspath(arg) for arg in ([argv] if isinstance(argv, (str, bytes, os.PathLike)) else argv)]
    args = [arg.decode() if isinstance(arg, bytes) else arg for arg in args]
    if not args:
        return False
    if _SERVER_ARGV0.search(args[0]) or any(a == "-m" and b in _SERVER_MODULES for a, b in zip(args, args[1:])):
        return True
    recipe = next((i for i, arg in enumerate(args) if Path(arg).name in _RECIPES), None)
    return recipe is not None and args[recipe + 1:] != ["stop"]


_running_test = None  # the test whose set-up, call or tear-down runs now
_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *more, **kwargs):
    if _running_test is not None and _running_test.get_closest_marker("e2e") is None and starts_a_server(args):
        raise RuntimeError(f"{_running_test.nodeid} starts a server ({args!r}) but is not an end-to-end test: add its "
                           "module to E2E_MODULES in tests/conftest.py (or mark it @pytest.mark.e2e)")
    _popen_init(self, args, *more, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running_test
    _running_test = item
    yield
    _running_test = None


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


@pytest.fixture(scope="session")
def shared_triton(tmp_path_factory):
    """server(spec, replica=0): a tritonserver on the CosyVoice2 repository ``spec``
    (:class:`cosyserve.serving.model_repository.CosyVoice2Repository`), one per equal spec for the
    whole session, so modules that need the same configuration share its start-up; ``replica``
    numbers servers of one spec that must be distinct (a router's). Started on first use; one that
    has exited (a test killed it) is started again; all are stopped at the session's end."""
    from conftest_triton import serve_repo
    from cosyserve.serving.model_repository import build

    running = {}  # (spec, replica) -> (generator of serve_repo, its server)

    def server(spec, replica: int = 0):
        key = (spec, replica)
        if key in running and running[key][1].process.poll() is not None:
            next(running.pop(key)[0], None)
        if key not in running:
            work = tmp_path_factory.mktemp("shared_triton")
            generator = serve_repo(build(spec, work / "repo"), work)
            running[key] = (generator, next(generator))
        return running[key][1]

    yield server
    for generator, _ in running.values():
        next(generator, None)


@pytest.fixture(scope="session")
def api_models_dir(tiny_bundle: Path, tmp_path_factory) -> Path:
    """The tiny bundle with a model directory of its own (a voice store lives in it), for the API's
    modules (tests/test_api.py, tests/test_api_router.py), whose servers are then of one spec."""
    from conftest_triton import copy_of_bundle

    return copy_of_bundle(tiny_bundle, tmp_path_factory.mktemp("api_models"))


@pytest.fixture
def idle_server(server):
    """The requesting module's ``server`` (a real tritonserver), checked after the test: no stub
    crashed, no LLM request or token2wav stream is left. Modules may define their own."""
    from conftest_triton import assert_server_idle

    log_start = server.log_file.stat().st_size
    yield server
    assert_server_idle(server, log_start)
