"""End to end through a real tritonserver (CPU, tiny random-weight bundle).

One server runs the whole model repository with a streaming ``cosyvoice2`` and an offline
``cosyvoice2_offline`` BLS. The template sets ``max_tokens = min_tokens = 40``, so every
request makes exactly 40 speech tokens (960 samples each) and a known chunk plan. The bundle's
spk2info.pt gets a second voice ("spk2") to exercise registered voices besides the default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from cosyserve.bench.workload import mixed_long_text
from cosyserve.engine.request import FIRST_CHUNK_STAGES

from conftest_triton import (REPO_ROOT, SAMPLES_PER_TOKEN, Stream, build_llm_caller_repo, build_model_repo,
                             copy_of_bundle, crash_report, expected_chunk_samples, free_ports, grpc_input, metrics,
                             serve_repo, server_env, settled_metrics, stream_tts, template_values, token_limits,
                             wait_for, wait_until_idle)

pytest.importorskip("pytriton")  # the bundled tritonserver

NUM_TOKENS = 40  # max_tokens = min_tokens in the template
BLS_INSTANCES = 2  # per cosyvoice2 model: requests served at once
# Requests that get stopped part-way: long enough that the LLM still generates when the stop
# comes, even on a loaded machine (the BLS notices a cancellation between chunks).
LONG_TOKENS = 1500
TARGET_TEXTS = ["你好，世界。", "今天天气不错。", "Hello there.", "身临其境，换新体验。", "一二三四五。", "Good morning!"]


@pytest.fixture(scope="module")
def models_dir(tiny_bundle: Path, tmp_path_factory) -> Path:
    """The tiny bundle with a second registered voice, "spk2", in a copy of its spk2info.pt."""
    from cosyserve.audio.io import prompt_audio_from_array
    from cosyserve.bundle import synthetic_prompt_wave
    from cosyserve.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
    from cosyserve.frontend.speakers import SpeakerRegistry

    out = copy_of_bundle(tiny_bundle, tmp_path_factory.mktemp("e2e_models"))
    model_dir = out / "CosyVoice2-0.5B"
    registry = SpeakerRegistry.load(model_dir / "spk2info.pt")
    registry.register("spk2", prompt_audio_from_array(synthetic_prompt_wave(seed=7), 16000), "另一个声音。",
                      SpeechTokenizer(model_dir / "speech_tokenizer_v2.onnx"),
                      SpeakerEncoder(model_dir / "campplus.onnx"))
    registry.save()
    return out


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e_server")
    # no queue limit: the bursts below send more requests at once than instances + run.sh's queue
    repo = build_model_repo(models_dir, work / "repo", max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS,
                            bls_instances=BLS_INSTANCES, max_queue_size=0)
    yield from serve_repo(repo, work)


def grpc_client(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def run_script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def write_manifest(path: Path, models_dir: Path, count: int) -> Path:
    wav = models_dir / "assets" / "prompt_audio.wav"
    prompt_text = (models_dir / "assets" / "prompt_text.txt").read_text().strip()
    lines = [f"utt{i}|{prompt_text}|{wav}|{TARGET_TEXTS[i % len(TARGET_TEXTS)]}" for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


# ----- the benchmark / example clients ---------------------------------------------------------

@pytest.mark.parametrize("mode", ["streaming", "offline"])
def test_grpc_client(idle_server, models_dir, tmp_path, mode):
    manifest = write_manifest(tmp_path / "manifest.txt", models_dir, 6)
    report = tmp_path / "report.json"
    model = "cosyvoice2" if mode == "streaming" else "cosyvoice2_offline"
    run_script("client_grpc.py", "--server-port", str(idle_server.grpc_port), "--model-name", model,
               "--mode", mode, "--num-tasks", "3", "--manifest-path", str(manifest),
               "--log-dir", str(tmp_path / "log"), "--json-report", str(report), "--log-interval", "0")
    summary = json.loads(report.read_text())
    assert summary["requests"] == 6 and summary["failed"] == 0
    assert summary["rtf"] > 0 and summary["latency"]["count"] == 6
    for result in summary["per_request"]:
        assert round(result["audio_s"] * 24000) == SAMPLES_PER_TOKEN * NUM_TOKENS
        if mode == "streaming":
            chunk_samples = [round(d * 24000) for d in result["chunk_durations_s"]]
            assert chunk_samples == expected_chunk_samples(NUM_TOKENS)
            assert result["chunk_arrivals_s"] == sorted(result["chunk_arrivals_s"])
    if mode == "streaming":
        assert summary["first_chunk_latency"]["count"] == 6
    stats = {m["name"]: m for m in summary["triton_stats"]["model_stats"]}
    assert stats[model]["inference_count"] == 6 and stats["cosyvoice2"]["inference_count"] == 6  # offline: forwarded
    # the engine did every stage in its own process: the reference layout's models were not called
    assert all(stats.get(m, {}).get("inference_count", 0) == 0
               for m in ("llm", "token2wav", "audio_tokenizer", "speaker_embedding"))
    assert (tmp_path / "log" / "utt0.wav").is_file()


def test_grpc_client_open_loop(idle_server, models_dir, tmp_path):
    """``--arrival-rate``: the requests start at the seeded Poisson arrival times, whatever is in
    flight, each on a client of its own or an idle one; every number of a streaming run per request."""
    from cosyserve.bench.openloop import poisson_arrivals

    manifest = write_manifest(tmp_path / "manifest.txt", models_dir, 3)
    report = tmp_path / "report.json"
    run_script("client_grpc.py", "--server-port", str(idle_server.grpc_port), "--model-name", "cosyvoice2",
               "--mode", "streaming", "--arrival-rate", "4", "--num-requests", "4", "--seed", "5",
               "--manifest-path", str(manifest), "--log-dir", str(tmp_path / "log"), "--json-report", str(report),
               "--log-interval", "0")
    summary = json.loads(report.read_text())
    assert summary["requests"] == 4 and summary["failed"] == 0 and summary["num_tasks"] is None
    open_loop = summary["open_loop"]
    assert open_loop["arrival_rate"] == 4.0 and open_loop["arrivals_s"] == poisson_arrivals(4.0, 5, count=4)
    assert 1 <= open_loop["peak_in_flight"] <= 4 and open_loop["start_lag_max_ms"] < 500
    assert summary["wall_s"] >= open_loop["arrivals_s"][-1]
    assert summary["first_chunk_latency"]["count"] == 4 and "requests_with_underrun" in summary["underruns"]
    for result in summary["per_request"]:
        assert [round(d * 24000) for d in result["chunk_durations_s"]] == expected_chunk_samples(NUM_TOKENS)
    assert sorted(r["id"] for r in summary["per_request"]) == ["utt0_r0", "utt0_r1", "utt1_r0", "utt2_r0"]


def test_http_client(idle_server, models_dir, tmp_path):
    out = tmp_path / "out.wav"
    run_script("client_http.py", "--server-port", str(idle_server.http_port), "--model-name", "cosyvoice2_offline",
               "--reference-audio", str(models_dir / "assets" / "prompt_audio.wav"),
               "--reference-text", "希望你以后能够做的比我还好呦。", "--target-text", "你好，世界。",
               "--output-audio", str(out))
    audio, rate = sf.read(out)
    assert rate == 24000 and audio.shape == (SAMPLES_PER_TOKEN * NUM_TOKENS,)


# ----- voices, limits --------------------------------------------------------------------------

def test_registered_voices_and_default_speaker(idle_server):
    client = grpc_client(idle_server)

    def offline(*extra):
        response = client.infer("cosyvoice2_offline", [grpc_input("target_text", "你好"), *extra])
        return response.as_numpy("waveform").reshape(-1)

    # No voice inputs = "001"; "spk2" travels to token2wav as prompt tensors (fp16).
    for audio in (offline(), offline(grpc_input("speaker_id", "001")), offline(grpc_input("speaker_id", "spk2"))):
        assert audio.shape == (SAMPLES_PER_TOKEN * NUM_TOKENS,) and np.isfinite(audio).all() and audio.any()


def test_per_request_token_limits_stream_in_planned_chunks(idle_server):
    chunks = stream_tts(idle_server, [grpc_input("target_text", "你好"), *token_limits(100)])
    assert [c.size for c in chunks] == expected_chunk_samples(100)


# ----- long text --------------------------------------------------------------------------------

def test_long_text_streams_its_segments_in_order_as_one_stream(idle_server):
    """Three segments, 20 tokens each: three chunk plans back to back in one stream; the first
    chunk arrives before the later segments' LLM requests have finished (they start after it)."""
    text = "一二三四五六七八九十。" * 20 + "最后还有3句话。"  # segments of 77, 77 and 66 + 8 characters
    idle = wait_until_idle(idle_server.metrics_port)
    before = idle["cosyserve_llm_generated_tokens_total"]
    stream = Stream(idle_server.grpc_url)
    try:
        stream.send("cosyvoice2", [grpc_input("target_text", text), *token_limits(20)])
        result, error = stream.next()
        assert error is None
        generated_at_first_chunk = metrics(idle_server.metrics_port)["cosyserve_llm_generated_tokens_total"] - before
        chunks = [result.as_numpy("waveform").reshape(-1)] + [c.reshape(-1) for c in stream.responses()]
    finally:
        stream.close()
    assert generated_at_first_chunk < 3 * 20
    assert [c.size for c in chunks] == expected_chunk_samples(20) * 3
    audio = np.concatenate(chunks)
    assert audio.size == 3 * 20 * SAMPLES_PER_TOKEN and np.isfinite(audio).all()
    values = wait_until_idle(idle_server.metrics_port)
    assert values["cosyserve_llm_generated_tokens_total"] - before == 3 * 20
    # the server's view of the listener: every chunk after the first one is observed once, across segments
    def delta(name: str) -> float:
        return values.get(name, 0.0) - idle.get(name, 0.0)
    assert delta("cosyserve_stream_buffer_seconds_count") == len(chunks) - 1
    underruns, stall = delta("cosyserve_stream_underruns_total"), delta("cosyserve_stream_stall_seconds_total")
    assert 0 <= underruns < len(chunks) and (stall > 0) == (underruns > 0), (underruns, stall)
    offline = grpc_client(idle_server).infer("cosyvoice2_offline", [grpc_input("target_text", text), *token_limits(20)])
    assert offline.as_numpy("waveform").size == 3 * 20 * SAMPLES_PER_TOKEN


def generated_tokens(port: int) -> float:
    """The LLM's tokens so far, once idle and settled: an earlier request's last tokens reach Triton's
    metrics up to two stats periods (0.5 s) after it ends (once, the previous test's 60 offline tokens
    were missed)."""
    wait_until_idle(port)
    time.sleep(0.5)
    return settled_metrics(port, prefix="cosyserve_llm_")["cosyserve_llm_generated_tokens_total"]


def test_a_20000_character_mixed_text_streams_as_one_request(idle_server):
    """Issue 17: 20,000 characters of Chinese and English (numbers, prices, years) through the text
    front-end, ~220 segments of 5 tokens each, streamed as one request: every segment's chunk plan
    back to back, 960 samples for every token the LLM generated."""
    text = mixed_long_text(20_000, seed=0)
    before = generated_tokens(idle_server.metrics_port)
    chunks = stream_tts(idle_server, [grpc_input("target_text", text), *token_limits(5)])
    tokens = generated_tokens(idle_server.metrics_port) - before
    segments = tokens // 5
    assert tokens == 5 * segments and segments > 150
    assert [c.size for c in chunks] == expected_chunk_samples(5) * int(segments)
    audio = np.concatenate(chunks)
    assert audio.size == tokens * SAMPLES_PER_TOKEN and np.isfinite(audio).all()


def test_text_front_end_switch_and_errors(idle_server):
    client = grpc_client(idle_server)
    off = [grpc_input("text_frontend", np.array([[False]]))]
    audio = client.infer("cosyvoice2_offline", [grpc_input("target_text", "一二三。" * 30), *off, *token_limits(5)])
    assert audio.as_numpy("waveform").size == 5 * SAMPLES_PER_TOKEN  # one segment: the text as it is
    for inputs, message in [
        ([grpc_input("target_text", "😀！？")], "no speakable characters"),
        ([grpc_input("target_text", "好。" * 50_001)], "100002 characters; at most 100000"),
        ([grpc_input("target_text", "一二三。" * 300), *off], "text_frontend off"),
    ]:
        for model in ("cosyvoice2", "cosyvoice2_offline"):
            with pytest.raises(InferenceServerException, match=message):
                if model == "cosyvoice2":
                    stream_tts(idle_server, inputs)
                else:
                    client.infer(model, inputs)


# ----- robustness ------------------------------------------------------------------------------

def _reference(wav: np.ndarray, length: int | None = None, text: str | None = "参考文本") -> list:
    inputs = [grpc_input("reference_wav", wav.reshape(1, -1).astype(np.float32)),
              grpc_input("reference_wav_len", np.array([[wav.size if length is None else length]], np.int32))]
    return inputs + ([grpc_input("reference_text", text)] if text is not None else [])


def bad_requests(prompt: np.ndarray) -> dict[str, tuple[list, str]]:
    """name -> (inputs, part of the expected error message)."""
    text = grpc_input("target_text", "你好")
    return {
        "empty text": ([grpc_input("target_text", "   ")], "target_text is empty"),
        "over-long text": ([grpc_input("target_text", "长" * 1001)], "at most 1000"),
        "reference without text": ([text, *_reference(prompt, text=None)], "needs reference_text"),
        "text without reference": ([text, grpc_input("reference_text", "abc")], "without reference_wav"),
        "zero-length audio": ([text, *_reference(np.zeros(0, np.float32), 0)], "reference_wav is empty"),
        "NaN audio": ([text, *_reference(np.full(16000, np.nan, np.float32))], "NaN"),
        "too short audio": ([text, *_reference(prompt[:1600])], "0.10 s long"),
        "silent audio": ([text, *_reference(np.zeros(16000, np.float32))], "silent"),
        "length beyond audio": ([text, *_reference(prompt, prompt.size + 1)], "reference_wav_len"),
        "wrong dtype": ([text, grpc_input("reference_wav", prompt.reshape(1, -1).astype(np.float64), "FP64")], "FP32"),
        "wrong shape": ([grpc_input("target_text", np.array([[b"a", b"b"]], dtype=object), "BYTES")], "shape"),
        "batch of two": ([grpc_input("target_text", np.array([[b"a"], [b"b"]], dtype=object), "BYTES")],
                         "one utterance"),
        "unknown speaker": ([text, grpc_input("speaker_id", "nobody")], "unknown speaker id 'nobody'"),
        "speaker and reference": ([text, grpc_input("speaker_id", "001"), *_reference(prompt)], "not both"),
        "bad max_tokens": ([text, grpc_input("max_tokens", np.array([[0]], np.int32))], "max_tokens"),
        "invalid UTF-8": ([grpc_input("target_text", np.array([[b"\xff\xfe"]], dtype=object), "BYTES")], "UTF-8"),
    }


def test_bad_requests_get_clear_errors_and_the_server_stays_healthy(idle_server, models_dir):
    prompt, _ = sf.read(models_dir / "assets" / "prompt_audio.wav", dtype="float32")
    client = grpc_client(idle_server)
    for name, (inputs, message) in bad_requests(prompt).items():
        with pytest.raises(InferenceServerException) as offline_error:
            client.infer("cosyvoice2_offline", inputs)
        assert message in offline_error.value.message(), name
        assert offline_error.value.status() == "StatusCode.INVALID_ARGUMENT", name
        with pytest.raises(InferenceServerException) as stream_error:
            stream_tts(idle_server, inputs)
        assert message in stream_error.value.message(), name
    assert client.is_server_live()
    assert client.is_model_ready("cosyvoice2") and client.is_model_ready("cosyvoice2_offline")
    good = client.infer("cosyvoice2_offline", [grpc_input("target_text", "好"), *_reference(prompt)])
    assert good.as_numpy("waveform").size == SAMPLES_PER_TOKEN * NUM_TOKENS
    assert sum(c.size for c in stream_tts(idle_server, [grpc_input("target_text", "好")])) == NUM_TOKENS * 960


# ----- the llm and token2wav models on their own ---------------------------------------------------

def test_llm_model_speaks_tensorrt_llm_tensors(idle_server):
    from cosyserve.llm.prompt import EOS_IDS, SOS_ID, SPEECH_TOKEN_OFFSET, TASK_ID

    def request(streaming: bool, n: int) -> list:
        return [grpc_input("input_ids", np.array([[SOS_ID, 100, 200, TASK_ID]], np.int32)),
                grpc_input("input_lengths", np.array([[4]], np.int32)),
                grpc_input("request_output_len", np.array([[n]], np.int32)),
                grpc_input("min_tokens", np.array([[n]], np.int32)),
                grpc_input("end_id", np.array([[EOS_IDS[0]]], np.int32)),
                grpc_input("random_seed", np.array([[42]], np.uint64)),
                grpc_input("streaming", np.array([[streaming]]))]

    stream = Stream(idle_server.grpc_url)
    try:
        stream.send("llm", request(True, 12), outputs=("output_ids", "sequence_length"))
        pieces = stream.responses("output_ids")
        stream.send("llm", request(False, 12), outputs=("output_ids", "sequence_length"))
        whole = stream.responses("output_ids")
    finally:
        stream.close()
    # one response per burst of ready tokens: one token each, unless the engine got ahead of the
    # sender (a loaded machine), which joins a burst into one (1, 1, k) response
    assert all(p.shape[:2] == (1, 1) and p.shape[2] >= 1 for p in pieces)
    assert sum(p.shape[2] for p in pieces) == 12
    assert len(whole) == 1 and whole[0].shape == (1, 1, 12)
    streamed = np.concatenate([p.reshape(-1) for p in pieces])
    np.testing.assert_array_equal(streamed, whole[0].reshape(-1))  # same seed, same tokens
    assert ((streamed >= SPEECH_TOKEN_OFFSET) & (streamed < SPEECH_TOKEN_OFFSET + 6561)).all()


def test_token2wav_model_offline_streaming_and_cancel(idle_server):
    from cosyserve.llm.prompt import SPEECH_TOKEN_OFFSET

    client = grpc_client(idle_server)
    tokens = (np.arange(30, dtype=np.int32) * 97 % 6561 + SPEECH_TOKEN_OFFSET)[None]
    offline = client.infer("token2wav", [grpc_input("target_speech_tokens", tokens)]).as_numpy("waveform")
    assert offline.shape == (1, 30 * SAMPLES_PER_TOKEN)

    def step(offset: int, finalize: bool, n: int, request_id: str = "t2w-1"):
        return client.infer("token2wav", [grpc_input("target_speech_tokens", tokens[:, :n]),
                                          grpc_input("token_offset", np.array([[offset]], np.int32)),
                                          grpc_input("finalize", np.array([[finalize]]))], request_id=request_id)

    with pytest.raises(InferenceServerException, match="needs a request id"):
        step(0, False, 18, request_id="")
    with pytest.raises(InferenceServerException, match="LLM ids"):
        client.infer("token2wav", [grpc_input("target_speech_tokens", np.array([[5, 6, 7]], np.int32))])
    assert step(0, False, 18).as_numpy("waveform").shape == (1, 15 * SAMPLES_PER_TOKEN - 3840)
    assert metrics(idle_server.metrics_port)["cosyserve_token2wav_open_streams"] == 1
    cancel = client.infer("token2wav", [grpc_input("target_speech_tokens", np.zeros((1, 0), np.int32)),
                                        grpc_input("cancel", np.array([[True]]))], request_id="t2w-1")
    assert cancel.as_numpy("waveform").size == 0
    assert metrics(idle_server.metrics_port)["cosyserve_token2wav_open_streams"] == 0
    with pytest.raises(InferenceServerException, match="does not continue"):  # the session is gone
        step(15, True, 30)


# ----- load, cancellation ----------------------------------------------------------------------

def test_fifty_sequential_streams_then_concurrent_bursts(idle_server):
    limits = token_limits(18)
    expected = expected_chunk_samples(18)
    stream = Stream(idle_server.grpc_url)
    try:
        for i in range(50):
            stream.send("cosyvoice2", [grpc_input("target_text", TARGET_TEXTS[i % len(TARGET_TEXTS)]), *limits],
                        request_id=f"seq{i}")
            assert [c.size for c in stream.responses()] == expected, f"request {i}"
    finally:
        stream.close()

    for burst in range(3):
        results = {}

        def one(i: int) -> None:
            try:
                results[i] = [c.size for c in stream_tts(idle_server, [grpc_input("target_text", "你好"), *limits])]
            except Exception as exc:  # reported below
                results[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert results == {i: expected for i in range(8)}, f"burst {burst}"


def test_cancelled_streams_free_llm_slots_and_token2wav_sessions(idle_server):
    before = metrics(idle_server.metrics_port)
    streams = [Stream(idle_server.grpc_url) for _ in range(BLS_INSTANCES)]
    for stream in streams:
        stream.send("cosyvoice2", [grpc_input("target_text", "你好"), *token_limits(LONG_TOKENS)])
    for stream in streams:
        result, error = stream.next()
        assert error is None and result.as_numpy("waveform").size > 0
    # They generate at once: the llm model's execute() hands each request to the engine (whose gauges
    # reach Triton's metrics a stats period after they change)
    wait_for(lambda: (metrics(idle_server.metrics_port)["cosyserve_llm_active_requests"] == BLS_INSTANCES
                      and metrics(idle_server.metrics_port)["cosyserve_token2wav_open_streams"] == BLS_INSTANCES),
             "both requests generating and voiced", timeout_s=5)
    for stream in streams:
        stream.close(cancel=True)
    after = wait_until_idle(idle_server.metrics_port, timeout_s=10)
    generated = after["cosyserve_llm_generated_tokens_total"] - before["cosyserve_llm_generated_tokens_total"]
    assert generated < BLS_INSTANCES * LONG_TOKENS, "the LLM requests were not stopped early"
    assert sum(c.size for c in stream_tts(idle_server, [grpc_input("target_text", "好")])) == NUM_TOKENS * 960


def test_client_that_disconnects_mid_stream_frees_everything(idle_server, tmp_path):
    script = tmp_path / "vanishing_client.py"
    script.write_text(
        "import os, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from conftest_triton import Stream, grpc_input, token_limits\n"
        "stream = Stream(sys.argv[1])\n"
        f"stream.send('cosyvoice2', [grpc_input('target_text', 'hi'), *token_limits({LONG_TOKENS})])\n"
        "result, error = stream.next()\n"
        "assert error is None, error\n"
        "print('first chunk', flush=True)\n"
        "os.kill(os.getpid(), 9)\n")
    before = metrics(idle_server.metrics_port)
    proc = subprocess.run([sys.executable, str(script), idle_server.grpc_url, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == -signal.SIGKILL and "first chunk" in proc.stdout, proc.stderr[-2000:]
    after = wait_until_idle(idle_server.metrics_port, timeout_s=10)
    assert after["cosyserve_llm_generated_tokens_total"] - before["cosyserve_llm_generated_tokens_total"] < LONG_TOKENS


# ----- the llm model and BLS callers of it, on a second server ----------------------------------

LLM_SEND_TIMEOUT_S = 2  # the llm model's send_timeout_s there (10 s as shipped)


@pytest.fixture(scope="module")
def llm_callers(models_dir: Path, tmp_path_factory):
    """The llm model with two BLS callers (conftest_triton.LLM_CALLER_MODEL); one is killed."""
    from cosyserve.serving.tritonserver import start_server

    work = tmp_path_factory.mktemp("llm_callers")
    repo = build_llm_caller_repo(models_dir, work / "repo", ["llm_caller", "doomed_caller"], LLM_SEND_TIMEOUT_S)
    http, grpc, metrics_port = free_ports(3)
    srv = start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics_port, log_file=work / "server.log",
                       timeout=300, env=server_env(), die_with_parent=True)
    yield srv
    srv.stop(timeout=5)  # no graceful exit: the sends to the killed caller never return


def call_llm_caller(server, model: str, mode: str, calls: int = 0) -> None:
    stream = Stream(server.grpc_url)
    try:
        stream.send(model, [grpc_input("mode", mode), grpc_input("calls", np.array([[calls]], np.int32))], outputs=())
        stream.responses()
    finally:
        stream.close()


def test_a_bls_stub_survives_many_decoupled_calls(llm_callers):
    """Triton 24.10's stub frees a finished decoupled BLS response iterator without the GIL when
    Python let go of it first (heap corruption, the stub dies within a few hundred calls); the
    caller keeps them in FinishedResponseIterators, as the cosyvoice2 BLS does."""
    log_start = llm_callers.log_file.stat().st_size
    call_llm_caller(llm_callers, "llm_caller", "churn", calls=150)
    assert not crash_report(llm_callers.log_file, log_start)


def test_llm_requests_of_a_caller_that_died_are_stopped(llm_callers):
    """Sends to a dead BLS stub block for ever in Triton 24.10; the llm model's watchdog stops the request."""
    before = metrics(llm_callers.metrics_port)
    with pytest.raises(InferenceServerException, match="not healthy"):
        call_llm_caller(llm_callers, "doomed_caller", "die")
    deadline = time.monotonic() + LLM_SEND_TIMEOUT_S + 15
    while (after := metrics(llm_callers.metrics_port))["cosyserve_llm_active_requests"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["cosyserve_llm_active_requests"] == 0, after
    generated = after["cosyserve_llm_generated_tokens_total"] - before["cosyserve_llm_generated_tokens_total"]
    assert generated < 600  # of the 600 the doomed caller asked for
    call_llm_caller(llm_callers, "llm_caller", "churn", calls=2)  # the llm model serves on


# ----- run.sh ----------------------------------------------------------------------------------

def test_run_sh_stage2_fills_the_same_templates(models_dir, tmp_path):
    """run.sh stage 2 must fill every template with the keys this test suite uses."""
    repo = tmp_path / "repo"
    env = dict(os.environ, MODELS_DIR=str(models_dir), MODEL_REPO=str(repo), DECOUPLED_MODE="True", DEVICE="cpu",
               OFFLINE_BLS_INSTANCE_NUM=str(BLS_INSTANCES), MAX_TOKENS=str(NUM_TOKENS), MIN_TOKENS=str(NUM_TOKENS),
               REFERENCE_MODELS="true", VENV=str(Path(sys.prefix)), OUT_DIR=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(REPO_ROOT / "run.sh"), "2", "2"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ours = build_model_repo(models_dir, tmp_path / "ours", max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS,
                            bls_instances=BLS_INSTANCES, text_warm_up="true")  # run.sh's default
    models = template_values(models_dir, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, bls_instances=BLS_INSTANCES)
    assert sorted(models) == sorted(p.name for p in repo.iterdir() if p.name != "cosyvoice2_offline")
    for model in [*models, "cosyvoice2_offline"]:
        assert (repo / model / "config.pbtxt").read_text() == (ours / model / "config.pbtxt").read_text(), model


def test_front_end_models_count_clip_cache_hits(idle_server):
    """A clip sent twice to a front-end model is computed once; the metrics say so, per model."""
    from cosyserve.bench.prometheus import cosyserve_samples, read_page
    from cosyserve.bundle import synthetic_prompt_wave

    def lookups() -> dict[tuple[str, str], float]:
        page = read_page(idle_server.metrics_port, host="127.0.0.1")
        return {(s.labels["model"], s.name.removeprefix("cosyserve_clip_cache_").removesuffix("_total")): s.value
                for s in cosyserve_samples(page) if s.name.startswith("cosyserve_clip_cache_")}

    wav = synthetic_prompt_wave(seed=31).astype(np.float32).reshape(1, -1)
    client = grpcclient.InferenceServerClient(idle_server.grpc_url)
    before = lookups()
    for model in ("audio_tokenizer", "speaker_embedding"):
        outputs = [client.infer(model, [grpc_input("reference_wav", wav)]) for _ in range(2)]
        first, second = (o.as_numpy(o.get_response().outputs[0].name) for o in outputs)
        assert np.array_equal(first, second)
    after = lookups()
    for model in ("audio_tokenizer", "speaker_embedding"):
        assert after[(model, "misses")] - before.get((model, "misses"), 0) == 1
        assert after[(model, "hits")] - before.get((model, "hits"), 0) == 1


def test_work_counters_say_where_the_time_went(idle_server):
    """One stream moves the engine's counters: its LLM's tokens, the loop's stage times and
    iterations, the flow batches (a chunk at a time: one stream's chunks run in order)."""
    before = metrics(idle_server.metrics_port)
    chunks = stream_tts(idle_server, [grpc_input("target_text", "你好"), *token_limits(100)])
    assert len(chunks) == 4  # plan_chunks(100): 3 non-final chunks and the final one
    after = wait_until_idle(idle_server.metrics_port, timeout_s=10)
    grew = {name[len("cosyserve_"):]: after[name] - before.get(name, 0.0) for name in after if name.endswith("_total")}
    assert grew["llm_generated_tokens_total"] == 100
    assert grew["engine_flow_batch_jobs_total"] == 4  # alone: every chunk had a batch to itself
    assert grew["engine_flow_batches_total"] == 4
    assert grew["engine_iterations_total"] >= 4  # a batch per iteration at most
    stages = sum(grew[f"engine_{stage}_seconds_total"] for stage in ("start", "flow", "vocoder", "host"))
    assert grew["engine_flow_seconds_total"] > 0 and stages > 0
    # its first chunk's way, stage by stage (front door, IPC, engine, IPC, send): all there, in order
    assert grew["first_chunks_traced_total"] == 1
    way = {stage: grew[f"first_chunk_{stage}_seconds_total"] for stage, _ in FIRST_CHUNK_STAGES}
    assert min(way.values()) >= 0 and way["prefill"] + way["chunk_tokens"] > 0 and way["gpu"] > 0