"""run.sh stage 7 on the CPU (tiny bundle): two LLM servers apart, a Triton server (BLS + token2wav)
that takes its speech tokens from them, the API in front; speech requests through the API (spread
over both LLM servers), then `run.sh stop` ends all of it. The GPU layout (LLM_GPUS=0,1
T2W_GPUS=2,3) differs only in CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest_triton import REPO_ROOT, SAMPLES_PER_TOKEN, consecutive_free_ports, free_ports, server_env
from cosyserve.serving.tritonserver import is_running

pytest.importorskip("pytriton")
httpx = pytest.importorskip("httpx2")

NUM_TOKENS = 20


def test_stage_7_serves_through_the_api_over_an_llm_server_and_stops_cleanly(tiny_bundle: Path, tmp_path):
    http, grpc, metrics, api_port = free_ports(4)  # server i listens on DISAGG_*_BASE + i
    llm_port = consecutive_free_ports(2)  # LLM server i listens on DISAGG_LLM_PORT + i - 1
    disagg = tmp_path / "disaggregated"
    env = dict(server_env(), VENV=str(Path(sys.prefix)), MODELS_DIR=str(tiny_bundle), DEVICE="cpu", CUDA_MPS="off",
               LLM_GPUS="cpu,cpu", T2W_GPUS="cpu", BLS_INSTANCE_NUM="1", OFFLINE_BLS_INSTANCE_NUM="1", TEXT_WARM_UP="false",
               MAX_TOKENS=str(NUM_TOKENS), MIN_TOKENS=str(NUM_TOKENS), LLM_MAX_SLOTS="4",
               DISAGG_LLM_PORT=str(llm_port), DISAGG_HTTP_BASE=str(http - 1), DISAGG_GRPC_BASE=str(grpc - 1),
               DISAGG_METRICS_BASE=str(metrics - 1), DISAGG_DIR=str(disagg), API_PORT=str(api_port),
               API_PID_FILE=str(tmp_path / "api.pid"), API_LOG=str(tmp_path / "api.log"),
               SERVER_PID_FILE=str(tmp_path / "none.pid"))

    def run(*stages: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "run.sh", *stages], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=400)

    started = run("7", "7")
    pid_files = [disagg / "llm_server_1.pid", disagg / "llm_server_2.pid", disagg / "tritonserver_1.pid",
                 tmp_path / "api.pid"]
    try:
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        pids = [int(p.read_text()) for p in pid_files]
        assert all(is_running(pid) for pid in pids)
        repo = disagg / "model_repo"
        assert not (repo / "llm").exists()  # speech tokens come from the LLM server
        assert f"http://127.0.0.1:{llm_port}/v1,http://127.0.0.1:{llm_port + 1}/v1" in \
            (repo / "cosyvoice2" / "config.pbtxt").read_text()
        def completions() -> list[int]:
            return [httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["completions"]
                    for port in (llm_port, llm_port + 1)]

        before = completions()  # each server has the registered voices' prefix completions
        for _ in range(2):  # the BLS sends one request to each LLM server (fewest sent first, when idle)
            response = httpx.post(f"http://127.0.0.1:{api_port}/v1/audio/speech", timeout=120, json={
                "model": "cosyvoice2", "input": "你好，世界。", "voice": "001", "response_format": "pcm"})
            assert response.status_code == 200, response.text
            assert len(response.content) == 2 * NUM_TOKENS * SAMPLES_PER_TOKEN
        assert [after - was for after, was in zip(completions(), before)] == [1, 1], (before, completions())
        health = httpx.get(f"http://127.0.0.1:{api_port}/health", timeout=10).json()
        assert [s["url"] for s in health["servers"]] == [f"127.0.0.1:{grpc}"]
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert not any(is_running(pid) for pid in pids)
    assert not any((disagg / f"llm_server_{k}.pid").exists() for k in (1, 2))
