"""Step-Audio2 (NVIDIA's ``cosyvoice2_dit``) through the real Triton server (CPU, tiny random-weight bundle).

The repository is what ``run_stepaudio2_dit_token2wav.sh`` stage 2 builds (:class:`StepAudio2Repository`):
``cosyvoice2_dit``, the engine core with Step-Audio2's kind (CosyVoice2's LLM, prompt layout and
voices; Step-Audio-2-mini's DiT flow and HiFT, tokenizer and CAM++ in one loop) behind the front door
``cosyvoice2`` runs on, with NVIDIA's wire protocol. With ``MAX_TOKENS = MIN_TOKENS = 40`` every
request makes exactly 40 speech tokens: 960 samples each and a known chunk plan. The module's server
runs the LLM in the engine's loop (``LLM_URL`` empty); two variants are added to its repository:
``cosyvoice2_dit_equal`` (equal chunks) and ``cosyvoice2_dit_offline`` (not decoupled). The recipe's
tiny run (stages 0-6: its speech tokens from our OpenAI-compatible LLM server, as NVIDIA's from
trtllm-serve) and its disaggregated stages 7-8 start servers of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from tritonclient.utils import InferenceServerException

import tritonclient.grpc as grpcclient
from conftest_triton import (REPO_ROOT, SAMPLES_PER_TOKEN, Stream, consecutive_free_ports, free_ports, grpc_input,
                             metrics, serve_repo, server_env, stream_tts, token_limits, wait_for, wait_until_idle)

pytest.importorskip("pytriton")

from cosyserve.schedule import plan_stream_chunks  # noqa: E402

NUM_TOKENS = 40  # MAX_TOKENS = MIN_TOKENS in stage 2
HELD_BACK = 3840  # HiFT overlap withheld by a non-final chunk (8 mel frames x 480)
SCRIPT = REPO_ROOT / "run_stepaudio2_dit_token2wav.sh"
MODEL = "cosyvoice2_dit"
OPEN_STREAMS = "cosyserve_token2wav_open_streams"
TEXTS = ["你好，世界。", "今天天气不错。", "Hello there.", "身临其境，换新体验。", "一二三四五。", "Good morning!"]


def expected_chunk_samples(num_tokens: int, strategy: str = "exponential") -> list[int]:
    """Samples per streamed chunk: a non-final chunk voices its new tokens and withholds the HiFT
    overlap, which the next chunk delivers."""
    sizes = []
    for i, chunk in enumerate(plan_stream_chunks(num_tokens, strategy)):
        voiced = chunk.end - chunk.start - (0 if chunk.last else 3)
        sizes.append(SAMPLES_PER_TOKEN * voiced + (HELD_BACK if i else 0) - (0 if chunk.last else HELD_BACK))
    return sizes


def script_env(models: Path, out: Path, **extra: str) -> dict[str, str]:
    return dict(server_env(), VENV=str(Path(sys.prefix)), MODELS_DIR=str(models), OUT_DIR=str(out), DEVICE="cpu",
                MAX_TOKENS=str(NUM_TOKENS), MIN_TOKENS=str(NUM_TOKENS), LLM_MAX_SLOTS="8", TEXT_WARM_UP="false",
                **extra)


def run_script(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# ----- the server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from cosyserve.bundle import make_bundle

    return make_bundle(tmp_path_factory.mktemp("dit_models"), "tiny", seed=0, parts=("cosyvoice2", "llm", "step_audio2"))


def _variant(repo: Path, name: str, old: str, new: str) -> None:
    """A copy of the filled cosyvoice2_dit with one value replaced."""
    shutil.copytree(repo / MODEL, repo / name)
    config = repo / name / "config.pbtxt"
    text = config.read_text().replace(f'name: "{MODEL}"', f'name: "{name}"')
    assert text.count(old) == 1, old
    config.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("dit_server")
    repo = work / "repo"
    run_script("bash", str(SCRIPT), "2", "2", env=script_env(models, work, MODEL_REPO=str(repo), LLM_URL=""))
    assert sorted(p.name for p in repo.iterdir()) == [MODEL]
    _variant(repo, "cosyvoice2_dit_equal", '"exponential"', '"equal"')
    _variant(repo, "cosyvoice2_dit_offline", "decoupled: True", "decoupled: False")
    yield from serve_repo(repo, work)


def reference(wav: np.ndarray, text: str | None = "参考文本") -> list:
    inputs = [grpc_input("reference_wav", wav.reshape(1, -1).astype(np.float32)),
              grpc_input("reference_wav_len", np.array([[wav.size]], np.int32))]
    return inputs + ([grpc_input("reference_text", text)] if text is not None else [])


@pytest.fixture(scope="module")
def prompt(models) -> np.ndarray:
    wav, rate = sf.read(models / "assets" / "prompt_audio.wav", dtype="float32")
    assert rate == 16000
    return wav


# ----- cosyvoice2_dit --------------------------------------------------------------------------

def test_grpc_client_streams_concurrent_requests_in_planned_chunks(idle_server, models, tmp_path):
    """NVIDIA's client flags (client_grpc.py --model-name cosyvoice2_dit): every request streams
    cosyvoice2_dit's chunk plan, 960 samples per token."""
    wav, text = models / "assets" / "prompt_audio.wav", (models / "assets" / "prompt_text.txt").read_text().strip()
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("".join(f"utt{i}|{text}|{wav}|{TEXTS[i]}\n" for i in range(6)))
    report = tmp_path / "report.json"
    run_script(sys.executable, "client_grpc.py", "--server-port", str(idle_server.grpc_port), "--model-name", MODEL,
               "--mode", "streaming", "--num-tasks", "3", "--manifest-path", str(manifest),
               "--log-dir", str(tmp_path / "log"), "--json-report", str(report), "--log-interval", "0",
               env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=300)
    summary = json.loads(report.read_text())
    assert summary["requests"] == 6 and summary["failed"] == 0 and summary["first_chunk_latency"]["count"] == 6
    expected = expected_chunk_samples(NUM_TOKENS)
    for result in summary["per_request"]:
        assert [round(d * 24000) for d in result["chunk_durations_s"]] == expected
        assert round(result["audio_s"] * 24000) == SAMPLES_PER_TOKEN * NUM_TOKENS
    stats = {m["name"]: m for m in summary["triton_stats"]["model_stats"]}
    assert stats[MODEL]["inference_count"] == 6
    audio, rate = sf.read(tmp_path / "log" / "utt0.wav")
    assert rate == 24000 and audio.shape == (SAMPLES_PER_TOKEN * NUM_TOKENS,) and np.abs(audio).max() > 0


@pytest.mark.parametrize("model,strategy,num_tokens", [("cosyvoice2_dit_equal", "equal", 50),
                                                       (MODEL, "exponential", 100),
                                                       (MODEL, "exponential", 10)])
def test_strategies_and_per_request_token_limits(idle_server, prompt, model, strategy, num_tokens):
    inputs = [grpc_input("target_text", "你好"), *reference(prompt), *token_limits(num_tokens)]
    chunks = stream_tts(idle_server, inputs, model)
    assert [c.size for c in chunks] == expected_chunk_samples(num_tokens, strategy)
    assert all(np.isfinite(c).all() for c in chunks)


def test_offline_model_and_voices(idle_server, prompt):
    client = grpcclient.InferenceServerClient(idle_server.grpc_url)
    for voice in ([], [grpc_input("speaker_id", "001")], reference(prompt)):  # default speaker, spk2info, clip
        response = client.infer("cosyvoice2_dit_offline", [grpc_input("target_text", "你好"), *voice])
        audio = response.as_numpy("waveform")
        assert audio.shape == (1, SAMPLES_PER_TOKEN * NUM_TOKENS) and np.isfinite(audio).all() and audio.any()


def bad_requests(prompt: np.ndarray) -> dict[str, tuple[list, str]]:
    """name -> (cosyvoice2_dit inputs, part of the expected error message)."""
    text = grpc_input("target_text", "你好")
    return {
        "empty text": ([grpc_input("target_text", "   ")], "target_text is empty"),
        "over-long text": ([grpc_input("target_text", "长" * 100001)], "at most 100000"),
        "reference without text": ([text, *reference(prompt, text=None)], "needs reference_text"),
        "text without reference": ([text, grpc_input("reference_text", "abc")], "without reference_wav"),
        "NaN audio": ([text, *reference(np.full(16000, np.nan, np.float32))], "NaN"),
        "silent audio": ([text, *reference(np.zeros(16000, np.float32))], "silent"),
        "unknown speaker": ([text, grpc_input("speaker_id", "nobody")], "unknown speaker id 'nobody'"),
        "speaker and reference": ([text, grpc_input("speaker_id", "001"), *reference(prompt)], "not both"),
        "bad max_tokens": ([text, grpc_input("max_tokens", np.array([[0]], np.int32))], "max_tokens"),
    }


def test_bad_requests_get_clear_errors_and_the_server_stays_idle(idle_server, prompt):
    client = grpcclient.InferenceServerClient(idle_server.grpc_url)
    for name, (inputs, message) in bad_requests(prompt).items():
        with pytest.raises(InferenceServerException) as offline_error:
            client.infer("cosyvoice2_dit_offline", inputs)
        assert message in offline_error.value.message(), name
        assert offline_error.value.status() == "StatusCode.INVALID_ARGUMENT", name
        with pytest.raises(InferenceServerException) as stream_error:
            stream_tts(idle_server, inputs, MODEL)
        assert message in stream_error.value.message(), name
    assert client.is_server_live() and client.is_model_ready(MODEL)
    good = stream_tts(idle_server, [grpc_input("target_text", "好"), *reference(prompt)], MODEL)
    assert sum(c.size for c in good) == SAMPLES_PER_TOKEN * NUM_TOKENS
    # idle_server: nothing left in the engine (requests, LLM requests, streams), no stub crashed


def test_cancelled_streams_release_their_llm_requests_and_flow_state(idle_server):
    streams = [Stream(idle_server.grpc_url) for _ in range(3)]
    for stream in streams:
        stream.send(MODEL, [grpc_input("target_text", "你好"), *token_limits(600)])
    for stream in streams:
        result, error = stream.next()
        assert error is None and result.as_numpy("waveform").size > 0
    def generating_and_voiced() -> bool:  # the engine's gauges reach Triton a stats period after they change
        during = metrics(idle_server.metrics_port)
        return during[OPEN_STREAMS] == 3 and during["cosyserve_llm_active_requests"] >= 1
    wait_for(generating_and_voiced, "three streams voiced, their LLM generating", timeout_s=5)
    for stream in streams:
        stream.close(cancel=True)
    after = wait_until_idle(idle_server.metrics_port)
    assert after[OPEN_STREAMS] == 0 and after["cosyserve_llm_active_requests"] == 0
    again = stream_tts(idle_server, [grpc_input("target_text", "好")], MODEL)
    assert sum(c.size for c in again) == SAMPLES_PER_TOKEN * NUM_TOKENS


# ----- the recipe ------------------------------------------------------------------------------

def test_run_stepaudio2_dit_token2wav_sh_tiny_recipe(tmp_path):
    """Stages 0-6 with MODEL_SOURCE=tiny on the CPU (free ports), then ``stop``: the bundle, the
    repository (cosyvoice2_dit only), our LLM server and Triton (the engine's speech tokens from the
    server, as NVIDIA's from trtllm-serve), NVIDIA's client against cosyvoice2_dit (40 tokens each:
    960 samples per token), offline_inference.py and token2wav.py with --model step_audio2."""
    http, grpc, metrics_port, llm_port = free_ports(4)
    out = tmp_path / "out"
    env = script_env(tmp_path / "models", out, MODEL_SOURCE="tiny", MODEL_REPO=str(tmp_path / "repo"), NUM_TASKS="2",
                     HTTP_PORT=str(http), GRPC_PORT=str(grpc), METRICS_PORT=str(metrics_port), LLM_PORT=str(llm_port),
                     T2W_NUM_TOKENS="30", STRATEGY="equal", FIXED_OUTPUT_SECONDS="1.2")
    try:
        proc = run_script("bash", str(SCRIPT), "0", "6", env=env, timeout=900)
        assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == [MODEL]
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{llm_port}/health", timeout=10).read())
        assert health["completions"] >= 2, health  # stage 4's requests: the engine's tokens came from there
        wavs = sorted((out / "log_dit_concurrent_tasks_2_streaming").glob("*.wav"))
        assert len(wavs) == 2 and all(sf.info(str(w)).frames == NUM_TOKENS * SAMPLES_PER_TOKEN for w in wavs)
        report = json.loads((out / "dit_offline" / "report.json").read_text())  # stage 5
        assert report["model"] == "step_audio2" and report["items"] == 2
        assert all(item["speech_tokens"] == 30 and item["audio_s"] * 24000 == pytest.approx(30 * SAMPLES_PER_TOKEN)
                   for item in report["per_item"])
        for mode in ("streaming", "offline"):  # stage 6
            assert f"| fp32 | {mode} | 1 |" in proc.stdout, proc.stdout[-3000:]
    finally:
        stop = subprocess.run(["bash", str(SCRIPT), "stop"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert not (out / "tritonserver.pid").exists() and not (out / "llm_server.pid").exists()


def test_disaggregated_stages_7_and_8_on_cpu(models, tmp_path):
    from cosyserve.serving.tritonserver import is_running

    # servers i = 1, 2 listen on base + {i, 2 + i, 4 + i}; the LLM on base + 7
    base = consecutive_free_ports(8)
    env = script_env(models, tmp_path, NUM_GPUS="0", NUM_T2W_SERVERS="2", LLM_PORT=str(base + 7),
                     DISAGG_HTTP_BASE=str(base), DISAGG_GRPC_BASE=str(base + 2), DISAGG_METRICS_BASE=str(base + 4),
                     NUM_TASKS="2", BENCH_CONCURRENCY="2")
    run_script("bash", str(SCRIPT), "2", "2", env=env)
    try:
        proc = run_script("bash", str(SCRIPT), "7", "8", env=env, timeout=400)
        pid_files = sorted((tmp_path / "disaggregated").glob("tritonserver_*.pid")) + [tmp_path / "llm_server.pid"]
        pids = [int(p.read_text()) for p in pid_files]
        assert len(pids) == 3 and all(is_running(pid) for pid in pids)
    finally:
        run_script("bash", str(SCRIPT), "stop", env=env)
    assert not any(is_running(pid) for pid in pids) and not any(p.exists() for p in pid_files)
    summary = json.loads((tmp_path / "disaggregated" / "bench" / "summary.json").read_text())
    merged = summary["by_tasks_per_server"]["2"]
    assert len(summary["servers"]) == 2 and merged["requests"] == 4 and merged["failed"] == 0
    assert [s["requests"] for s in merged["servers"]] == [2, 2]
    assert merged["audio_s"] * 24000 == pytest.approx(4 * NUM_TOKENS * SAMPLES_PER_TOKEN)
    assert "| 2 | 2 | 4 | 4 | 0 |" in proc.stdout  # the combined table row
    for report in (tmp_path / "disaggregated" / "bench" / "tasks_2").glob("*/report.json"):
        for result in json.loads(report.read_text())["per_request"]:
            assert [round(d * 24000) for d in result["chunk_durations_s"]] == expected_chunk_samples(NUM_TOKENS)


def test_compose_file_runs_this_pipeline():
    import yaml

    compose = yaml.safe_load((REPO_ROOT / "docker-compose.dit.yml").read_text())
    (service,) = compose["services"].values()
    assert service["environment"]["RUN_SCRIPT"] == SCRIPT.name
    command = " ".join(service["command"])
    assert f"{SCRIPT.name} 0 3" in command and f"{SCRIPT.name} wait" in command
