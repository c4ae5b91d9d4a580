"""The API selects CosyVoice3 by the request's ``model`` (issue 20): a real CosyVoice3 Triton server
(CPU, tiny bundle) behind ``python -m cosyserve.api --model-url cosyvoice3=...``, the default
``cosyvoice2`` model's server absent. A voice uploaded through the API serves CosyVoice3 from the
shared voice store, with CosyVoice3's own features (``features.cosyvoice3.pt``); ``instructions`` and a
voice uploaded without a transcript reach the cosyvoice3 model as its instruct and cross-lingual modes."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest_triton import REPO_ROOT, SAMPLES_PER_TOKEN, free_ports, serve_repo, server_env, wait_http
from cosyserve.serving.tritonserver import terminate_with_parent

pytest.importorskip("pytriton")
httpx = pytest.importorskip("httpx2")
pytest.importorskip("av")  # the API decodes uploads with PyAV

from cosyserve.bundle import make_bundle, synthetic_prompt_wave  # noqa: E402
from cosyserve.serving.model_repository import CosyVoice3Repository, build  # noqa: E402

NUM_TOKENS = 20


@pytest.fixture(scope="module")
def voices(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared_voices")


@pytest.fixture(scope="module")
def cv3_server(tmp_path_factory, voices):
    models = make_bundle(tmp_path_factory.mktemp("cv3_api_models"), "tiny", parts=("cosyvoice3", "cosyvoice3_llm"))
    work = tmp_path_factory.mktemp("cv3_api")
    repo = build(CosyVoice3Repository(models, device="cpu", text_warm_up="false",
                                      max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, voices_dir=str(voices)),
                 work / "repo")
    yield from serve_repo(repo, work)


@pytest.fixture(scope="module")
def api(cv3_server, tiny_bundle: Path, voices: Path, tmp_path_factory):
    port, dead = free_ports(2)  # nothing listens on `dead`: the default model's server is down
    log = tmp_path_factory.mktemp("cv3_api_log") / "api.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "cosyserve.api", "--host", "127.0.0.1", "--port", str(port),
             "--triton-url", f"127.0.0.1:{dead}", "--model-url", f"cosyvoice3={cv3_server.grpc_url}",
             "--model-dir", str(tiny_bundle / "CosyVoice2-0.5B"), "--tokenizer-dir", str(tiny_bundle / "cosyvoice2_llm"),
             "--voices-dir", str(voices)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, preexec_fn=terminate_with_parent, env=server_env())
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/metrics", process)
    yield url
    process.terminate()
    process.wait(timeout=30)


def speech(api: str, model: str, voice: str, **fields) -> httpx.Response:
    return httpx.post(f"{api}/v1/audio/speech", timeout=300, json={
        "model": model, "input": "今天天气不错，我们去散步吧。", "voice": voice, "response_format": "pcm", **fields})


def upload(api: str, name: str, transcript: str | None = None, seed: int = 4) -> str:
    out = io.BytesIO()
    sf.write(out, synthetic_prompt_wave(2.0, 16000, seed=seed), 16000, format="WAV")
    created = httpx.post(f"{api}/v1/audio/voices", timeout=60, files={"audio_sample": ("v.wav", out.getvalue())},
                         data={"name": name, **({"transcript": transcript} if transcript is not None else {})})
    assert created.status_code == 200, created.text
    return created.json()["id"]


def test_model_cosyvoice3_speaks_an_uploaded_voice(api, voices):
    voice = upload(api, "narrator", "希望你以后能够做的比我还好呦。")
    response = speech(api, "cosyvoice3", voice)
    assert response.status_code == 200, response.text
    audio = np.frombuffer(response.content, np.int16)
    assert audio.size == NUM_TOKENS * SAMPLES_PER_TOKEN and np.abs(audio).max() > 0
    assert (voices / voice / "features.cosyvoice3.pt").exists()  # CosyVoice3's own features
    assert not (voices / voice / "features.pt").exists()  # CosyVoice2's were never needed

    models = httpx.get(f"{api}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["cosyvoice2", "cosyvoice3"]


def test_model_cosyvoice3_instruct_and_cross_lingual(api, voices):
    """``instructions`` (CosyVoice3's instruct mode: the BLS's ``instruction`` input) and a voice uploaded
    without a transcript (cross-lingual), alone and together: 960 samples per generated token."""
    zero_shot = upload(api, "teller", "希望你以后能够做的比我还好呦。", seed=5)
    bare = upload(api, "foreigner", seed=6)
    assert httpx.get(f"{api}/v1/audio/voices/{bare}", timeout=10).json()["kind"] == "cross_lingual"
    for voice, fields in [(zero_shot, {"instructions": "请用广东话表达。"}), (bare, {}),
                          (bare, {"instructions": "You are a helpful assistant. 请用尽可能快地语速说一句话。<|endofprompt|>"})]:
        response = speech(api, "cosyvoice3", voice, **fields)
        assert response.status_code == 200, (voice, fields, response.text)
        audio = np.frombuffer(response.content, np.int16)
        assert audio.size == NUM_TOKENS * SAMPLES_PER_TOKEN and np.abs(audio).max() > 0, (voice, fields)
    assert (voices / bare / "features.cosyvoice3.pt").exists()
    # an instruction is one LLM prompt: longer than a segment, the BLS refuses it (400, its message)
    response = speech(api, "cosyvoice3", zero_shot, instructions="慢" * 1001)
    assert response.status_code == 400, response.text
    assert "instruction has 1001 characters" in response.json()["error"]["message"]


def test_bench_api_drives_cosyvoice3_open_loop_with_an_uploaded_voice(api, tmp_path):
    """scripts/bench_api.py --model cosyvoice3 at one rate: every request streamed in full."""
    import json

    voice = upload(api, "bench", "希望你以后能够做的比我还好呦。", seed=7)
    report = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench_api.py", "--url", api, "--model", "cosyvoice3",
                             "--voice", voice, "--rates", "2", "--requests-per-rate", "4", "--json-report", str(report)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (summary,) = json.loads(report.read_text())
    assert summary["failed"] == 0 and summary["first_chunk_latency"]["count"] == 4, result.stdout
    assert summary["audio_s"] == 4 * NUM_TOKENS * SAMPLES_PER_TOKEN / 24000  # every sample arrived


def test_clear_errors_per_model(api):
    # CosyVoice3 has no built-in voices, so OpenAI's voice names stand for none
    response = speech(api, "cosyvoice3", "alloy")
    assert response.status_code == 404 and "no built-in voices" in response.json()["error"]["message"]
    # a CosyVoice model this API does not serve
    response = speech(api, "cosyvoice4", "alloy")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    # the default model's server is down: 503, and the API stays up for cosyvoice3
    response = speech(api, "tts-1", "alloy")
    assert response.status_code == 503, response.text
    assert httpx.get(f"{api}/health", timeout=10).status_code == 503
