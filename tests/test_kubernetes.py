"""The Kubernetes manifests (deploy/kubernetes): each overlay renders with kustomize (kubectl's) and
every resource is valid against the Kubernetes schemas (kubernetes-validate, strict: unknown fields
are errors too); and the parts fit each other: the API reaches the Triton pods through a headless
service, GPU pods ask for a GPU, probes hit the endpoints the processes serve, and every pod mounts
the one models volume."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ("single-gpu", "disaggregated")
KUBERNETES_VERSION = "1.29.0"  # the oldest release the manifests promise (docs/deployment.md)


def render(overlay: str) -> dict[tuple[str, str], dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run([kubectl, "kustomize", str(REPO / "deploy/kubernetes/overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(result.stdout) if doc}


def pod_spec(resources: dict, name: str) -> dict:
    workload = resources.get(("Deployment", name)) or resources[("Job", name)]
    return workload["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_resource_is_valid_against_the_kubernetes_schemas(overlay):
    resources = render(overlay)
    assert len(resources) >= 7
    for (kind, name), resource in resources.items():
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_broken_resource():
    resources = render("single-gpu")
    broken = resources[("Deployment", "cosyserve-triton")]
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_tiers_fit_together(overlay):
    resources = render(overlay)
    triton_service = resources[("Service", "cosyserve-triton")]["spec"]
    assert triton_service["clusterIP"] == "None"  # headless: the router sees every pod
    assert {p["port"] for p in triton_service["ports"]} == {8000, 8001, 8002}
    api = pod_spec(resources, "cosyserve-api")["containers"][0]
    command = api["command"]
    assert command[:3] == ["python3", "-m", "cosyserve.api"]
    assert command[command.index("--triton-url") + 1] == "cosyserve-triton:8001"
    assert api["readinessProbe"]["httpGet"]["path"] == "/health"

    triton = pod_spec(resources, "cosyserve-triton")
    container = triton["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["START_STAGE"] == "1" and env["API_PORT"] == "" and env["MODELS_DIR"] == "/models"
    assert "START_STAGE" in (REPO / "Dockerfile.server").read_text()
    for variable in ("LLM_BACKEND", "LLM_URL", "MODELS_DIR", "API_PORT"):
        assert f"{variable}=${{{variable}" in (REPO / "run.sh").read_text(), variable
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    annotations = resources[("Deployment", "cosyserve-triton")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8002"

    hpa = resources[("HorizontalPodAutoscaler", "cosyserve-triton")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "cosyserve-triton"
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    assert metric in (REPO / "cosyserve/serving/frontdoor.py").read_text()  # a series the front door exports

    claim = resources[("PersistentVolumeClaim", "cosyserve-models")]["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]
    for name in ("cosyserve-api", "cosyserve-triton", "cosyserve-models") + (
            ("cosyserve-llm",) if overlay == "disaggregated" else ()):
        volumes = pod_spec(resources, name)["volumes"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "cosyserve-models"}} in volumes, name

    if overlay == "disaggregated":
        assert env["LLM_URL"] == "http://cosyserve-llm:8000/v1"
        llm = pod_spec(resources, "cosyserve-llm")["containers"][0]
        assert llm["command"][:3] == ["python3", "-m", "cosyserve.llm.openai_server"]
        assert llm["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert llm["readinessProbe"]["httpGet"]["path"] == "/health"
        assert resources[("Service", "cosyserve-llm")]["spec"]["ports"][0]["port"] == 8000
        annotations = resources[("Deployment", "cosyserve-llm")]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == "8000" and annotations["prometheus.io/path"] == "/metrics"
        llm_hpa = resources[("HorizontalPodAutoscaler", "cosyserve-llm")]["spec"]
        assert llm_hpa["scaleTargetRef"]["name"] == "cosyserve-llm"
        metric = llm_hpa["metrics"][0]["pods"]["metric"]["name"]
        assert metric in (REPO / "cosyserve/llm/openai_server.py").read_text()  # a series the LLM server exports
    else:
        assert "LLM_URL" not in env and ("Deployment", "cosyserve-llm") not in resources
