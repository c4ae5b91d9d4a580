"""CosyVoice3 through the real Triton server (CPU, tiny random-weight bundle).

The repository is what ``run_cosyvoice3.sh`` stage 2 builds (:class:`CosyVoice3Repository`):
``cosyvoice3``, the engine core with CosyVoice3's kind (its LLM, the DiT flow and causal HiFT, the
v3 tokenizer and CAM++ in one loop) behind the front door, with the reference's wire protocol. A
streamed request gives 960 samples per speech token, in zero-shot,
instruct (``instruction`` input) and cross-lingual (a stored voice without transcript) mode alike;
bad input gets a clear error and leaves no session open. (Which LLM prompt each mode makes:
tests/test_cosyvoice3_prompt.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from tritonclient.utils import InferenceServerException

from conftest_triton import (REPO_ROOT, SAMPLES_PER_TOKEN, Stream, assert_server_idle, grpc_input, metrics, serve_repo,
                             settled_metrics, stream_tts, token_limits, wait_until_idle)

pytest.importorskip("pytriton")

from cosyserve.bundle import make_bundle, synthetic_prompt_wave  # noqa: E402
from cosyserve.frontend.voice_store import VOICES_DIR, VoiceStore  # noqa: E402
from cosyserve.runtime import COSYVOICE3_DIR  # noqa: E402
from cosyserve.schedule import plan_chunks  # noqa: E402
from cosyserve.serving.model_repository import CosyVoice3Repository, build  # noqa: E402

MODEL = "cosyvoice3"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("cv3_models"), "tiny", parts=("cosyvoice3", "cosyvoice3_llm"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    work = tmp_path_factory.mktemp("cv3_e2e")
    # MIN_TOKENS 1: the tiny random-weight LLM may draw a stop class first (200 of CosyVoice3's 6,761
    # classes, ~3 % of requests), and a request without limits (as NVIDIA's client sends it) then has
    # nothing to synthesise; with it, the LLM still decides the length
    repo = build(CosyVoice3Repository(models, device="cpu", text_warm_up="false", min_tokens=1), work / "repo")
    yield from serve_repo(repo, work)


def voice_inputs(seconds: float = 2.0, text: str = "希望你以后能够做的比我还好呦。") -> list:
    wav = synthetic_prompt_wave(seconds=seconds)[None]
    return [grpc_input("reference_wav", wav), grpc_input("reference_wav_len", np.array([[wav.shape[1]]], np.int32)),
            grpc_input("reference_text", text)]


def test_streamed_request_gives_960_samples_per_token(server):
    start = server.log_file.stat().st_size
    for num_tokens in (10, 60):
        chunks = stream_tts(server, voice_inputs() + [grpc_input("target_text", "今天天气不错，我们去散步吧。")]
                            + token_limits(num_tokens), MODEL)
        assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * num_tokens
        assert len(chunks) == len(plan_chunks(num_tokens))
        audio = np.concatenate(chunks)
        assert np.isfinite(audio).all() and np.abs(audio).max() <= 0.99 + 1e-6
    # As NVIDIA's client sends it: the four inputs only; the LLM decides the length.
    chunks = stream_tts(server, voice_inputs() + [grpc_input("target_text", "Hello there.")], MODEL)
    total = sum(c.size for c in chunks)
    assert total > 0 and total % SAMPLES_PER_TOKEN == 0
    assert_server_idle(server, start)


def test_streams_of_one_clip_share_its_voice_prefix(server):
    """A clip's first stream starts cold (no pass of its own) and its first window offers the voice's
    prompt-only flow states, kept (the kind's max_voices): the second stream finds them; audio as
    long as ever."""
    wav = synthetic_prompt_wave(seconds=3.0)[None]
    clip = [grpc_input("reference_wav", wav), grpc_input("reference_wav_len", np.array([[wav.shape[1]]], np.int32)),
            grpc_input("reference_text", "另一段参考音频的文本。")]
    before = settled_metrics(server.metrics_port)  # the earlier tests' voices counted
    for _ in range(2):
        chunks = stream_tts(server, clip + [grpc_input("target_text", "你好。")] + token_limits(30), MODEL)
        assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * 30
    after = wait_until_idle(server.metrics_port)  # the engine's gauges reach Triton's metrics a stats period late
    names = {k: f"cosyserve_token2wav_voice_prefix_{k}" for k in ("misses", "hits")}
    counts = {k: after[name] - before.get(name, 0) for k, name in names.items()}
    assert counts == {"misses": 1, "hits": 1}, f"not one miss (the cold first stream), then one hit: {counts}"
    assert after["cosyserve_token2wav_voices_cached"] >= 1


@pytest.mark.parametrize("inputs, message", [
    ([], "no default speaker"),
    ([grpc_input("reference_wav", synthetic_prompt_wave(seconds=2.0)[None])], "needs reference_text"),
    (voice_inputs(seconds=0.1), "between 0.5 s and 30 s"),
    (voice_inputs() + [grpc_input("instruction", " ")], "instruction is empty"),
    ([grpc_input("instruction", "请用广东话表达。")], "no default speaker"),  # instruct still needs a voice
])
def test_bad_input_gets_a_clear_error_and_the_server_stays_up(server, inputs, message):
    start = server.log_file.stat().st_size
    stream = Stream(server.grpc_url)
    try:
        stream.send(MODEL, inputs + [grpc_input("target_text", "你好。")])
        with pytest.raises(InferenceServerException, match=message):
            list(stream.responses())
    finally:
        stream.close()
    assert sum(c.size for c in stream_tts(server, voice_inputs() + [grpc_input("target_text", "你好。")]
                                          + token_limits(5), MODEL)) == 5 * SAMPLES_PER_TOKEN
    assert_server_idle(server, start)


def test_instruct_and_cross_lingual_requests_give_960_samples_per_token(server, models):
    """Instruct (``instruction``, with a clip or a stored voice, as an instruction or upstream's full
    instruct string) and cross-lingual (a voice stored without transcript, as the HTTP API uploads one):
    the LLM prompt differs, the audio is the same contract as zero-shot."""
    start = server.log_file.stat().st_size
    store = VoiceStore(models / COSYVOICE3_DIR / VOICES_DIR)  # the BLS's voices_dir (empty: <model_dir>/voices)
    bare = store.create("bare", synthetic_prompt_wave(2.0, seed=3), None)
    num_tokens = 20
    target = [grpc_input("target_text", "今天天气不错，我们去散步吧。")] + token_limits(num_tokens)
    cases = {
        "instruct, reference clip": voice_inputs() + [grpc_input("instruction", "请用广东话表达。")],
        "instruct, stored voice, upstream's string": [
            grpc_input("speaker_id", bare.id),
            grpc_input("instruction", "You are a helpful assistant. 请用尽可能快地语速说一句话。<|endofprompt|>")],
        "cross-lingual, stored voice": [grpc_input("speaker_id", bare.id)],
    }
    for mode, inputs in cases.items():
        chunks = stream_tts(server, inputs + target, MODEL)
        assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * num_tokens, mode
        assert len(chunks) == len(plan_chunks(num_tokens)), mode
        audio = np.concatenate(chunks)
        assert np.isfinite(audio).all() and np.abs(audio).max() > 0, mode
    assert (store.root / bare.id / "features.cosyvoice3.pt").exists()  # CosyVoice3 features, computed by the server and saved
    assert_server_idle(server, start)


def test_grpc_client_streams_from_cosyvoice3(server, models, tmp_path):
    """client_grpc.py (NVIDIA's flags) with ``--model-name cosyvoice3``: fixed lengths, so 960 samples per token."""
    wav, text = models / "assets" / "prompt_audio.wav", (models / "assets" / "prompt_text.txt").read_text().strip()
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("".join(f"utt{i}|{text}|{wav}|{target}\n" for i, target in enumerate(["你好。", "Good morning!"])))
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "client_grpc.py", "--server-addr", "127.0.0.1", "--server-port", str(server.grpc_port),
         "--model-name", MODEL, "--mode", "streaming", "--num-tasks", "2", "--manifest-path", str(manifest),
         "--fixed-output-seconds", "1.2", "--log-dir", str(tmp_path / "log"), "--json-report", str(report),
         "--log-interval", "0"],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(report.read_text())
    assert summary["requests"] == 2 and summary["failed"] == 0
    for result in summary["per_request"]:
        assert round(result["audio_s"] * 24000) == SAMPLES_PER_TOKEN * 30  # 1.2 s at 25 tokens/s
        assert len(result["chunk_durations_s"]) == len(plan_chunks(30))


def test_run_cosyvoice3_sh_tiny_recipe(tmp_path):
    """run_cosyvoice3.sh 0..4 with MODEL_SOURCE=tiny on the CPU (free ports), then ``stop``; the
    flow with TOKEN2WAV_INCREMENTAL_STREAM=false (the reference's full-attention re-run; the other
    tests here stream with the incremental flow), and the speech tokens from an OpenAI-compatible
    server of the CosyVoice3 LLM (LLM_URL, as the reference's trtllm-serve; the other tests use the
    LLM in the engine's loop): its streams give 960 samples per token too."""
    from conftest_triton import free_ports, serve_openai_llm, server_env

    http, grpc, metrics_port = free_ports(3)
    env = dict(server_env(), VENV=sys.prefix, MODEL_SOURCE="tiny", MODELS_DIR=str(tmp_path / "models"),
               MODEL_REPO=str(tmp_path / "repo"), OUT_DIR=str(tmp_path / "out"), DEVICE="cpu", TEXT_WARM_UP="false", TOKEN2WAV_INCREMENTAL_STREAM="false", MAX_TOKENS="20", MIN_TOKENS="20",
               NUM_TASKS="2", HTTP_PORT=str(http),
               GRPC_PORT=str(grpc), METRICS_PORT=str(metrics_port), SERVER_LOG=str(tmp_path / "server.log"),
               SERVER_PID_FILE=str(tmp_path / "server.pid"))
    script = str(REPO_ROOT / "run_cosyvoice3.sh")
    bundle = subprocess.run(["bash", script, "0", "0"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert bundle.returncode == 0, bundle.stdout[-3000:] + bundle.stderr[-3000:]
    llm_server = serve_openai_llm(tmp_path / "models" / "cosyvoice3_llm", tmp_path / "llm_server.log", max_slots=4)
    env["LLM_URL"], _ = next(llm_server)
    try:
        proc = subprocess.run(["bash", script, "1", "4"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["cosyvoice3"]
        completions = json.loads(urllib.request.urlopen(env["LLM_URL"].removesuffix("/v1") + "/health").read())
        assert completions["completions"] >= 2, completions
        config = (tmp_path / "repo" / "cosyvoice3" / "config.pbtxt").read_text()
        assert re.search(r'key: "incremental_stream", value: \{ string_value: "false" \}', config)
        wavs = sorted((tmp_path / "out" / "log_cosyvoice3_concurrent_tasks_2_streaming").glob("*.wav"))
        assert len(wavs) == 2 and all(sf.info(str(w)).frames == 20 * SAMPLES_PER_TOKEN for w in wavs)
    finally:
        subprocess.run(["bash", script, "stop"], cwd=REPO_ROOT, env=env, capture_output=True, timeout=120)
        llm_server.close()
    assert not (tmp_path / "server.pid").exists() or not (tmp_path / "server.pid").read_text().strip()
