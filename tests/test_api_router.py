"""The HTTP API in front of two real Triton servers (tiny bundle, CPU): its router
(cosyserve/api/router.py) sends a stream elsewhere when a server refuses it as overloaded, and
when a server dies its running streams end with an error while new requests are served by the
other one."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from cosyserve.api.router import _affinity, resolve
from conftest_triton import SAMPLES_PER_TOKEN, fill_to_capacity, wait_until_idle
from test_api import API_KEY, MAX_STREAMS, APIProcess, TEXT, server_spec

pytest.importorskip("pytriton")
httpx = pytest.importorskip("httpx2")  # what the openai SDK is built on

NUM_TOKENS = 20  # per text segment
VOICE = "001"


@pytest.fixture(scope="module")
def models_dir(api_models_dir: Path) -> Path:
    """One model directory for both servers (and their shared voice store), as a replica set would mount it."""
    return api_models_dir


@pytest.fixture(scope="module")
def servers(models_dir: Path, shared_triton):
    """The two servers (one BLS instance and a queue of one: the overload test fills it), the one
    voice 001 prefers first (rendezvous ranking on their addresses); replica 0 is tests/test_api.py's server."""
    spec = server_spec(models_dir)
    pair = [shared_triton(spec), shared_triton(spec, replica=1)]
    pair.sort(key=lambda server: _affinity(VOICE, address(server)), reverse=True)
    return pair


@pytest.fixture(scope="module")
def api(servers, models_dir: Path, tmp_path_factory):
    process = APIProcess(None, models_dir, tmp_path_factory.mktemp("router_api") / "api.log",
                         triton_url=",".join(server.grpc_url for server in servers))
    yield process
    process.stop()


def address(server) -> str:
    """The server as the router names it (its gRPC address resolved)."""
    (resolved,) = resolve(server.grpc_url)
    return resolved


def speech(api, text: str = TEXT, **kwargs) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/audio/speech", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                      json={"model": "tts-1", "input": text, "voice": VOICE, "response_format": "pcm"}, **kwargs)


def api_metric(api, name: str, **labels: str) -> float:
    """The sample of ``name`` whose labels include ``labels`` (0 when there is none yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"{api.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def test_health_lists_both_servers(api, servers):
    body = httpx.get(f"{api.url}/health", timeout=10).json()
    assert body["status"] == "ok"
    assert {s["url"] for s in body["servers"]} == {address(s) for s in servers}
    assert all(s["ready"] for s in body["servers"])


def test_bench_api_drives_the_endpoint_open_loop(api, servers, tmp_path):
    """scripts/bench_api.py at one rate through the API and its router: every request streamed in
    full, first audio and underruns reported per rate."""
    import json
    import subprocess
    import sys

    from conftest_triton import REPO_ROOT

    report = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench_api.py", "--url", api.url, "--api-key", API_KEY,
                             "--rates", "2", "--requests-per-rate", "4", "--json-report", str(report)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "| 2 | 4 | 0 | 0 |" in result.stdout, result.stdout
    (summary,) = json.loads(report.read_text())
    assert summary["failed"] == 0 and summary["first_chunk_latency"]["count"] == 4
    assert summary["audio_s"] == 4 * NUM_TOKENS * SAMPLES_PER_TOKEN / 24000  # every sample arrived
    for server in servers:
        wait_until_idle(server.metrics_port)


def test_a_request_the_preferred_server_refuses_as_overloaded_is_served_by_the_other(api, servers):
    preferred, other = servers
    def counts() -> tuple[float, float]:
        return (api_metric(api, "cosyserve_api_triton_failovers_total", reason="overloaded", server=address(preferred)),
                api_metric(api, "cosyserve_api_triton_streams_served_total", server=address(other)))
    time.sleep(1.1)  # any earlier refusal's backoff on the preferred server is over: it is tried first
    failovers, served = counts()
    streams = fill_to_capacity(preferred, "cosyvoice2", MAX_STREAMS, 0, num_tokens=1500)  # its engine's cap
    try:
        started = time.monotonic()
        response = speech(api)
        assert response.status_code == 200, response.text
        assert len(response.content) == 2 * SAMPLES_PER_TOKEN * NUM_TOKENS
        assert counts() == (failovers + 1, served + 1)
        assert time.monotonic() - started < 60
    finally:
        for stream in streams:
            stream.close(cancel=True)
    wait_until_idle(preferred.metrics_port)
    wait_until_idle(other.metrics_port)


def test_a_killed_server_ends_its_streams_with_an_error_and_new_requests_go_to_the_other(api, servers):
    preferred, other = servers
    time.sleep(1.1)  # the overload test's backoff on the preferred server is over: long text goes there
    long_text = "。".join(["今天天气很好，我们一起去公园散步"] * 40) + "。"
    outcome: dict = {}
    first_bytes = threading.Event()

    def long_stream():
        try:
            with httpx.stream("POST", f"{api.url}/v1/audio/speech", headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": "tts-1", "input": long_text, "voice": VOICE, "response_format": "pcm"},
                              timeout=120) as response:
                outcome["status"] = response.status_code
                received = 0
                for data in response.iter_bytes():
                    received += len(data)
                    first_bytes.set()
                outcome["bytes"] = received
        except httpx.HTTPError as exc:
            outcome["error"] = exc
        finally:
            outcome["ended"] = time.monotonic()
            first_bytes.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first_bytes.wait(120) and "error" not in outcome
    assert api_metric(api, "cosyserve_api_triton_streams", server=address(preferred)) == 1
    killed = time.monotonic()
    os.killpg(preferred.pid, signal.SIGKILL)  # tritonserver and its stubs (its own process group)
    thread.join(60)
    assert not thread.is_alive(), "the stream on the killed server hangs"
    assert "error" in outcome, f"the stream on the killed server ended without an error: {outcome}"
    assert outcome["ended"] - killed < 10
    # new requests: served by the other server, not refused
    for _ in range(2):
        response = speech(api)
        assert response.status_code == 200, response.text
        assert len(response.content) == 2 * SAMPLES_PER_TOKEN * NUM_TOKENS
    assert api_metric(api, "cosyserve_api_triton_ready", server=address(preferred)) == 0
    body = httpx.get(f"{api.url}/health", timeout=10).json()
    assert body["status"] == "ok"
    assert {s["url"]: s["ready"] for s in body["servers"]} == {address(preferred): False, address(other): True}
    wait_until_idle(other.metrics_port)
