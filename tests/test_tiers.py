"""The two test tiers (tests/conftest.py): what counts as starting a server, and the guard that fails a
test outside the e2e tier which starts one."""

import subprocess
import sys

import pytest

from conftest import E2E_MODULES, REPO_ROOT, starts_a_server


@pytest.mark.parametrize("argv", [
    ["/opt/tritonserver/bin/tritonserver", "--model-repository", "repo"],
    [sys.executable, "-m", "cosyserve.api", "--port", "8080"],
    [sys.executable, "-m", "cosyserve.api.service", "start", "--pid-file", "p"],
    [sys.executable, "-m", "cosyserve.llm.openai_server", "--model-dir", "d"],
    ["trtllm-serve", "serve", "d"],
    ["/usr/bin/chromium", "--headless"],
    ["/venv/lib/python3.11/site-packages/playwright/driver/node", "/venv/.../playwright/driver/package/cli.js", "run-driver"],
    ["bash", "/repo/run.sh", "2", "2"],
    ["bash", "run_stepaudio2_dit_token2wav.sh", "--stage", "7"],
])
def test_servers_and_recipe_stages_start_a_server(argv):
    assert starts_a_server(argv)


@pytest.mark.parametrize("argv", [
    [sys.executable, "-c", "pass"],
    [sys.executable, "scripts/fill_template.py", "x"],
    ["bash", "/repo/run.sh", "stop"],
    ["kubectl", "kustomize", "deploy/kubernetes/overlays/gpu"],
    "git status",
])
def test_other_processes_do_not(argv):
    assert not starts_a_server(argv)


def test_a_server_started_outside_the_e2e_tier_fails_the_test():
    with pytest.raises(RuntimeError, match="starts a server .* is not an end-to-end test"):
        subprocess.Popen(["/nonexistent/tritonserver", "--model-repository", "repo"])


def test_every_e2e_module_exists():
    assert all((REPO_ROOT / "tests" / f"{name}.py").is_file() for name in E2E_MODULES)
