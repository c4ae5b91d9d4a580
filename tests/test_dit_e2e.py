"""The CosyVoice2 + DiT token2wav pipeline end to end (CPU, tiny random-weight bundle).

Processes as deployed: our OpenAI-compatible LLM server (``cosyserve.llm.openai_server``) and a
real tritonserver with ``cosyvoice2_dit`` (BLS), ``token2wav_dit`` and ``audio_tokenizer``, on free
127.0.0.1 ports. The repository is made by ``run_stepaudio2_dit_token2wav.sh`` stage 2 with
``MAX_TOKENS = MIN_TOKENS = 40`` (passed on to the LLM server as max_tokens/min_tokens), so every
request makes exactly 40 speech tokens, i.e. 960 samples each and a known chunk plan. Two
variants are added: ``cosyvoice2_dit_equal`` (equal chunks) and ``cosyvoice2_dit_offline``
(not decoupled). Open token2wav_dit streams are read from Triton's metrics
(``cosyserve_token2wav_dit_open_streams``); stopped LLM requests from the LLM server's log.

The in-process pipeline (scripted LLM, real DiT service) and the scripts of stages 5-8 are tested
here too; stage 7 starts its own LLM server and two CPU token2wav servers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from tritonclient.utils import InferenceServerException

import tritonclient.grpc as grpcclient
from conftest_triton import (REPO_ROOT, SAMPLES_PER_TOKEN, Stream, free_ports, grpc_input, metrics, serve_openai_llm,
                             serve_repo, server_env, stream_tts, token_limits)

pytest.importorskip("pytriton")

from cosyserve.errors import InvalidInputError, RequestCancelledError  # noqa: E402
from cosyserve.llm.prompt import SPEECH_TOKEN_OFFSET  # noqa: E402
from cosyserve.schedule import plan_stream_chunks  # noqa: E402

NUM_TOKENS = 40  # MAX_TOKENS = MIN_TOKENS in stage 2
HELD_BACK = 3840  # HiFT overlap withheld by a non-final chunk (8 mel frames x 480)
SCRIPT = REPO_ROOT / "run_stepaudio2_dit_token2wav.sh"
OPEN_STREAMS = "cosyserve_token2wav_dit_open_streams"
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
                MAX_TOKENS=str(NUM_TOKENS), MIN_TOKENS=str(NUM_TOKENS), LLM_MAX_SLOTS="8", **extra)


def run_script(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def open_streams(server) -> float:
    return metrics(server.metrics_port)[OPEN_STREAMS]


def wait_no_open_streams(server, timeout_s: float = 20) -> float:
    deadline = time.monotonic() + timeout_s
    while (count := open_streams(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


# ----- servers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from cosyserve.bundle import make_bundle

    return make_bundle(tmp_path_factory.mktemp("dit_models"), "tiny", seed=0, parts=("cosyvoice2", "llm", "dit"))


@pytest.fixture(scope="module")
def llm_server(models, tmp_path_factory):
    """Our OpenAI-compatible server on the tiny LLM: (base url, log file)."""
    yield from serve_openai_llm(models / "cosyvoice2_llm", tmp_path_factory.mktemp("dit_llm") / "llm.log", max_slots=8)


def _variant(repo: Path, name: str, **replacements: str) -> None:
    """A copy of the filled cosyvoice2_dit with some values replaced."""
    shutil.copytree(repo / "cosyvoice2_dit", repo / name)
    config = repo / name / "config.pbtxt"
    text = config.read_text().replace('name: "cosyvoice2_dit"', f'name: "{name}"')
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    config.write_text(text)


@pytest.fixture(scope="module")
def server(models, llm_server, tmp_path_factory):
    work = tmp_path_factory.mktemp("dit_server")
    repo = work / "repo"
    run_script("bash", str(SCRIPT), "2", "2", env=script_env(models, work, MODEL_REPO=str(repo), LLM_URL=llm_server[0],
                                                              BLS_INSTANCE_NUM="3"))
    assert sorted(p.name for p in repo.iterdir()) == ["audio_tokenizer", "cosyvoice2_dit", "token2wav_dit"]
    _variant(repo, "cosyvoice2_dit_equal", **{'"exponential"': '"equal"', "count: 3": "count: 1"})
    _variant(repo, "cosyvoice2_dit_offline", **{"decoupled: True": "decoupled: False", "count: 3": "count: 1"})
    yield from serve_repo(repo, work)


@pytest.fixture
def idle_server(server):
    """The server, checked to hold no token2wav_dit stream after the test and to be alive."""
    yield server
    assert wait_no_open_streams(server) == 0
    assert server.process.poll() is None, "tritonserver died"


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
    wav, text = models / "assets" / "prompt_audio.wav", (models / "assets" / "prompt_text.txt").read_text().strip()
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("".join(f"utt{i}|{text}|{wav}|{TEXTS[i]}\n" for i in range(6)))
    report = tmp_path / "report.json"
    run_script(sys.executable, "client_grpc.py", "--server-port", str(idle_server.grpc_port), "--model-name",
               "cosyvoice2_dit", "--mode", "streaming", "--num-tasks", "3", "--manifest-path", str(manifest),
               "--log-dir", str(tmp_path / "log"), "--json-report", str(report), "--log-interval", "0",
               env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    summary = json.loads(report.read_text())
    assert summary["requests"] == 6 and summary["failed"] == 0 and summary["first_chunk_latency"]["count"] == 6
    expected = expected_chunk_samples(NUM_TOKENS)
    for result in summary["per_request"]:
        assert [round(d * 24000) for d in result["chunk_durations_s"]] == expected
        assert round(result["audio_s"] * 24000) == SAMPLES_PER_TOKEN * NUM_TOKENS
    stats = {m["name"]: m for m in summary["triton_stats"]["model_stats"]}
    assert stats["cosyvoice2_dit"]["inference_count"] == 6
    assert stats["token2wav_dit"]["inference_count"] == 6 * len(expected)  # one request per chunk
    # the LLM prompt tokens: one clip, so at most once per BLS instance (each caches its prompt features)
    assert 1 <= stats["audio_tokenizer"]["inference_count"] <= 3
    audio, rate = sf.read(tmp_path / "log" / "utt0.wav")
    assert rate == 24000 and audio.shape == (SAMPLES_PER_TOKEN * NUM_TOKENS,) and np.abs(audio).max() > 0


@pytest.mark.parametrize("model,strategy,num_tokens", [("cosyvoice2_dit_equal", "equal", 50),
                                                       ("cosyvoice2_dit", "exponential", 100),
                                                       ("cosyvoice2_dit", "exponential", 10)])
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
        "over-long text": ([grpc_input("target_text", "长" * 1001)], "at most 1000"),
        "reference without text": ([text, *reference(prompt, text=None)], "needs reference_text"),
        "text without reference": ([text, grpc_input("reference_text", "abc")], "without reference_wav"),
        "NaN audio": ([text, *reference(np.full(16000, np.nan, np.float32))], "NaN"),
        "silent audio": ([text, *reference(np.zeros(16000, np.float32))], "silent"),
        "unknown speaker": ([text, grpc_input("speaker_id", "nobody")], "unknown speaker id 'nobody'"),
        "speaker and reference": ([text, grpc_input("speaker_id", "001"), *reference(prompt)], "not both"),
        "bad max_tokens": ([text, grpc_input("max_tokens", np.array([[0]], np.int32))], "max_tokens"),
    }


def test_bad_requests_get_clear_errors_and_the_server_stays_up(idle_server, prompt):
    client = grpcclient.InferenceServerClient(idle_server.grpc_url)
    for name, (inputs, message) in bad_requests(prompt).items():
        with pytest.raises(InferenceServerException) as offline_error:
            client.infer("cosyvoice2_dit_offline", inputs)
        assert message in offline_error.value.message(), name
        assert offline_error.value.status() == "StatusCode.INVALID_ARGUMENT", name
        with pytest.raises(InferenceServerException) as stream_error:
            stream_tts(idle_server, inputs, "cosyvoice2_dit")
        assert message in stream_error.value.message(), name
    assert client.is_server_live() and client.is_model_ready("cosyvoice2_dit")
    good = stream_tts(idle_server, [grpc_input("target_text", "好"), *reference(prompt)], "cosyvoice2_dit")
    assert sum(c.size for c in good) == SAMPLES_PER_TOKEN * NUM_TOKENS


# ----- token2wav_dit on its own ----------------------------------------------------------------

def test_token2wav_dit_streams_by_request_id_and_cancels(idle_server, prompt):
    client = grpcclient.InferenceServerClient(idle_server.grpc_url)
    ids = (np.arange(30, dtype=np.int32) * 97 % 6561 + SPEECH_TOKEN_OFFSET)[None]

    def call(tokens: np.ndarray, request_id: str = "", finalize: bool | None = None, speaker: list = (),
             cancel: bool = False) -> np.ndarray:
        inputs = [grpc_input("target_speech_tokens", tokens), *speaker]
        if finalize is not None:
            inputs.append(grpc_input("finalize", np.array([[finalize]])))
        if cancel:
            inputs.append(grpc_input("cancel", np.array([[True]])))
        return client.infer("token2wav_dit", inputs, request_id=request_id).as_numpy("waveform").reshape(-1)

    clip = reference(prompt, text=None)
    assert call(ids, speaker=clip).size == 30 * SAMPLES_PER_TOKEN  # offline
    assert call(ids[:, :10], speaker=[grpc_input("speaker_id", "001")]).size == 10 * SAMPLES_PER_TOKEN
    # A stream: 15 new tokens + 3 look-ahead, then the rest; NVIDIA's BLS repeats the speaker (ignored).
    assert call(ids[:, :18], "s1", False, clip).size == 15 * SAMPLES_PER_TOKEN - HELD_BACK
    assert open_streams(idle_server) == 1
    assert call(ids[:, 15:], "s1", True, clip).size == 15 * SAMPLES_PER_TOKEN + HELD_BACK
    assert open_streams(idle_server) == 0
    # cancel closes a stream; it cannot go on afterwards
    call(ids[:, :18], "s2", False, clip)
    assert call(np.zeros((1, 0), np.int32), "s2", cancel=True).size == 0
    assert open_streams(idle_server) == 0
    errors = {
        "no open stream for request id 's2'": lambda: call(ids[:, 15:], "s2", True),
        "must name the speaker": lambda: call(ids[:, :18], "s3", False),
        "needs a request id": lambda: call(ids[:, :18], "", False, clip),
        "LLM ids": lambda: call(np.array([[5, 6, 7]], np.int32), speaker=clip),
        "not both": lambda: call(ids, speaker=[*clip, grpc_input("speaker_id", "001")]),
        "unknown speaker id": lambda: call(ids, speaker=[grpc_input("speaker_id", "nobody")]),
        "a chunk that is not the last needs tokens": lambda: call(np.zeros((1, 0), np.int32), "s4", False, clip),
    }
    for message, request in errors.items():
        with pytest.raises(InferenceServerException, match=message):
            request()
    assert open_streams(idle_server) == 0  # failed requests keep no stream


# ----- cancellation ----------------------------------------------------------------------------

def test_cancelled_streams_stop_their_llm_requests_and_close_token2wav_streams(idle_server, llm_server):
    log = llm_server[1]
    stopped_before = log.read_text().count("went away")
    streams = [Stream(idle_server.grpc_url) for _ in range(3)]  # 3 BLS instances: all run at once
    for stream in streams:
        stream.send("cosyvoice2_dit", [grpc_input("target_text", "你好"), *token_limits(600)])
    for stream in streams:
        result, error = stream.next()
        assert error is None and result.as_numpy("waveform").size > 0
    assert open_streams(idle_server) == 3
    for stream in streams:
        stream.close(cancel=True)
    assert wait_no_open_streams(idle_server, timeout_s=10) == 0
    deadline = time.monotonic() + 10
    while log.read_text().count("went away") - stopped_before < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text().count("went away") - stopped_before == 3, "the LLM requests were not stopped"
    after = stream_tts(idle_server, [grpc_input("target_text", "好")], "cosyvoice2_dit")
    assert sum(c.size for c in after) == SAMPLES_PER_TOKEN * NUM_TOKENS


# ----- in-process pipeline -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def service(models):
    from cosyserve.token2wav.dit_service import load_dit_service

    return load_dit_service(models / "Step-Audio-2-mini" / "token2wav", "cpu",
                            spk2info=models / "CosyVoice2-0.5B" / "spk2info.pt")


class ScriptedLLM:
    """A SpeechTokenSource: ``count`` tokens in pieces of 7, optionally failing after ``fail_after``."""

    def __init__(self, count: int, fail_after: int | None = None):
        self.count, self.fail_after, self.cancelled = count, fail_after, []

    def generate(self, prompt_ids, request_id, limits):
        for start in range(0, self.count, 7):
            if self.fail_after is not None and start >= self.fail_after:
                raise RuntimeError("LLM server went down")
            yield [(start + i) * 131 % 6561 for i in range(min(7, self.count - start))]

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def _pipeline(models, service, llm, strategy="exponential"):
    from transformers import AutoTokenizer

    from cosyserve.pipeline.dit import dit_pipeline

    return dit_pipeline(AutoTokenizer.from_pretrained(models / "cosyvoice2_llm"), llm, service, strategy=strategy)


def _request(service, rid: str = "r"):
    from cosyserve.pipeline.tts import VoiceResolver
    from cosyserve.pipeline.dit import SkipSpeakerEmbedding, dit_request

    voices = VoiceResolver(service.registry, service.tokenizer, SkipSpeakerEmbedding())
    return dit_request(voices, rid, "你好")  # the default speaker "001"


@pytest.mark.parametrize("strategy,count", [("exponential", 100), ("equal", 50), ("equal", 0)])
def test_pipeline_streams_the_planned_chunks(models, service, strategy, count):
    pipeline = _pipeline(models, service, ScriptedLLM(count), strategy)
    chunks = list(pipeline.stream(_request(service)))
    assert [c.size for c in chunks] == (expected_chunk_samples(count, strategy) if count else [])
    assert service.open_stream_ids == []
    assert pipeline.synthesize(_request(service)).size == SAMPLES_PER_TOKEN * count


def test_pipeline_cancel_and_llm_errors_close_the_token2wav_stream(models, service):
    llm, seen = ScriptedLLM(100), []
    chunks = _pipeline(models, service, llm).stream(_request(service, "c1"), is_cancelled=lambda: bool(seen))
    seen.append(next(chunks))  # the client cancels once it has the first chunk
    assert service.open_stream_ids == ["c1"]
    with pytest.raises(RequestCancelledError):
        next(chunks)
    assert service.open_stream_ids == [] and llm.cancelled == ["c1"]

    with pytest.raises(RuntimeError, match="went down"):
        list(_pipeline(models, service, ScriptedLLM(100, fail_after=30)).stream(_request(service, "c2")))
    assert service.open_stream_ids == []

    stream = _pipeline(models, service, ScriptedLLM(100)).stream(_request(service, "c3"))
    next(stream)
    stream.close()  # the client went away
    assert service.open_stream_ids == []


def test_service_closes_idle_streams(service):
    from cosyserve.token2wav.dit_service import SpeakerRef

    service.step("idle", list(range(18)), SpeakerRef(speaker_id="001"), False)
    service.idle_timeout_s = 0.0
    try:
        assert service.close_idle() == ["idle"] and service.open_stream_ids == []
    finally:
        service.idle_timeout_s = 600.0
    with pytest.raises(InvalidInputError, match="either a reference clip"):
        SpeakerRef()


# ----- scripts: stages 5, 6, 7 + 8 --------------------------------------------------------------

def test_offline_and_token2wav_scripts(models, llm_server, tmp_path):
    env = dict(server_env(), PYTHONPATH=str(REPO_ROOT))
    wav, text = models / "assets" / "prompt_audio.wav", (models / "assets" / "prompt_text.txt").read_text().strip()
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(f"a|{text}|{wav}|{TEXTS[0]}\nb|{text}|{wav}|{TEXTS[1]}\n")
    run_script(sys.executable, "scripts/dit_offline.py", "--models-dir", str(models), "--manifest-path", str(manifest),
               "--output-dir", str(tmp_path / "offline"), "--device", "cpu", "--llm-backend", "openai", "--llm-url",
               llm_server[0], "--max-tokens", "30", "--min-tokens", "30", env=env)
    for name in "ab":
        audio, rate = sf.read(tmp_path / "offline" / f"{name}.wav")
        assert rate == 24000 and audio.shape == (30 * SAMPLES_PER_TOKEN,)
    dit_dir = models / "Step-Audio-2-mini" / "token2wav"
    out = run_script(sys.executable, "scripts/dit_token2wav.py", "--model-dir", str(dit_dir),
                     "--reference-audio", str(wav), "--num-tokens", "50", "--mode", "streaming", "--strategy", "equal",
                     "--device", "cpu", "--output", str(tmp_path / "t2w.wav"), env=env)
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["50"])
    assert row[1] == str(len(plan_stream_chunks(50, "equal")))
    assert sf.read(tmp_path / "t2w.wav")[0].shape == (50 * SAMPLES_PER_TOKEN,)


def _free_port_block(count: int) -> int:
    """A port ``base`` such that base+1..base+count are free."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + count < 65536 and all(_port_free(base + i) for i in range(1, count + 1)):
            return base
    raise RuntimeError("no free port range")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_disaggregated_stages_7_and_8_on_cpu(models, tmp_path):
    from cosyserve.serving.tritonserver import is_running

    base = _free_port_block(7)  # servers i = 1, 2 listen on base + {i, 2 + i, 4 + i}; the LLM on base + 7
    env = script_env(models, tmp_path, NUM_GPUS="0", NUM_T2W_SERVERS="2", LLM_PORT=str(base + 7), BLS_INSTANCE_NUM="1",
                     DISAGG_HTTP_BASE=str(base), DISAGG_GRPC_BASE=str(base + 2), DISAGG_METRICS_BASE=str(base + 4),
                     NUM_TASKS="2", BENCH_CONCURRENCY="2")
    run_script("bash", str(SCRIPT), "2", "2", env=env)
    try:
        proc = run_script("bash", str(SCRIPT), "7", "8", env=env, timeout=300)
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

