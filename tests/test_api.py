"""The OpenAI-compatible API (``python -m cosyserve.api``) end to end: a real tritonserver on the
tiny bundle, the real API process, and the unmodified ``openai`` SDK as the client (CPU).

The template fixes every request at NUM_TOKENS speech tokens, so each response holds exactly
NUM_TOKENS x 960 samples at 24 kHz (lossy codecs add their encoder delay and padding).
Speech tokens are reproducible (seeded sampling) but the vocoder's source noise is drawn per
request, so two syntheses of the same tokens are compared by correlation, not bit for bit. The
random-weight vocoder's output hardly depends on the tokens, so which prompt the LLM got
(instruct, cross-lingual) is checked in test_front_end.py, not by listening here.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyserve.engine.front_end import MAX_TEXT_CHARS
from cosyserve.serving.tritonserver import terminate_with_parent
from conftest_triton import (REPO_ROOT, SAMPLES_PER_TOKEN, fill_to_capacity, free_ports, repository_spec, server_env,
                             wait_http, wait_until_idle)

pytest.importorskip("pytriton")
openai = pytest.importorskip("openai")
av = pytest.importorskip("av")
httpx = pytest.importorskip("httpx2")  # what the openai SDK is built on

NUM_TOKENS = 20  # two streamed chunks (18 tokens, then the rest)
SAMPLES = NUM_TOKENS * SAMPLES_PER_TOKEN
API_KEY = "test-key-1"
TEXT = "你好，世界。"


@pytest.fixture(scope="module")
def models_dir(api_models_dir: Path) -> Path:
    return api_models_dir


MAX_STREAMS = 2  # the engine's cap on the API tests' servers


def server_spec(models_dir: Path):
    """An engine that sends two streams at most (the 429 test runs two; the router's overload test
    too; its open-loop test stays under) and one cosyvoice2_offline instance with a queue of one:
    tests/test_api_router.py's servers are of this spec."""
    return repository_spec(models_dir, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, bls_instances=1, max_queue_size=1,
                           max_streams=MAX_STREAMS)


@pytest.fixture(scope="module")
def server(models_dir: Path, shared_triton):
    return shared_triton(server_spec(models_dir))


class APIProcess:
    def __init__(self, server, models_dir: Path, log: Path, triton_url: str | None = None):
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cosyserve.api", "--host", "127.0.0.1", "--port", str(self.port),
                 "--triton-url", triton_url or server.grpc_url, "--model-dir", str(models_dir / "CosyVoice2-0.5B"),
                 "--tokenizer-dir", str(models_dir / "cosyvoice2_llm"), "--max-upload-bytes", str(2 * 1024 * 1024)],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, preexec_fn=terminate_with_parent,
                env={**server_env(), "API_KEYS": API_KEY})
        wait_http(f"{self.url}/metrics", self.process)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def api(server, models_dir: Path, tmp_path_factory):
    process = APIProcess(server, models_dir, tmp_path_factory.mktemp("api") / "api.log")
    yield process
    process.stop()


@pytest.fixture
def client(api, idle_server) -> openai.OpenAI:
    """The SDK on the API; after the test no Triton stub crashed and no request is left running."""
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def http(api, method: str, path: str, *, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{api.url}{path}", headers=headers, timeout=120, **kwargs)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(stream)])
        return samples, stream.rate


def prompt_wav_bytes(seconds: float = 2.0, rate: int = 16000, nan: bool = False) -> bytes:
    from cosyserve.bundle import synthetic_prompt_wave

    wave = synthetic_prompt_wave(seconds, rate, seed=3).astype(np.float32)
    if nan:
        wave[100] = np.nan
    out = io.BytesIO()
    sf.write(out, wave, rate, format="WAV", subtype="FLOAT")
    return out.getvalue()


def correlation(pcm_a: bytes, pcm_b: bytes) -> float:
    a, b = (np.frombuffer(p, "<i2").astype(np.float64) for p in (pcm_a, pcm_b))
    assert a.size == b.size
    return float(np.corrcoef(a, b)[0, 1])


SAME_TOKENS = 0.9  # correlation of two syntheses of the same speech tokens (vocoder noise apart)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_every_response_format_decodes_to_the_expected_length(client):
    pcm = client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format="pcm").content
    assert len(pcm) == 2 * SAMPLES
    wav, rate = sf.read(io.BytesIO(client.audio.speech.create(model="x", voice="alloy", input=TEXT,
                                                              response_format="wav").content), dtype="int16")
    assert rate == 24000 and wav.size == SAMPLES
    assert correlation(wav.tobytes(), pcm) > SAME_TOKENS  # OpenAI voice names = the default speaker
    for fmt, rate, slack in (("flac", 24000, 0), ("mp3", 24000, 2 * 1152), ("aac", 24000, 2 * 1024),
                             ("opus", 48000, 0)):
        data = client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format=fmt).content
        samples, decoded_rate = decode(data)
        expected = SAMPLES * rate // 24000
        assert decoded_rate == rate, fmt
        assert expected <= samples.size <= expected + slack, (fmt, samples.size, expected)


def test_streaming_pcm_and_wav(client):
    chunks = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="001", input=TEXT,
                                                            response_format="pcm") as response:
        assert response.headers["content-type"] == "audio/pcm" and response.headers["x-model"] == "tts-1"
        chunks = list(response.iter_bytes(4096))
    pcm = b"".join(chunks)
    assert len(pcm) == 2 * SAMPLES
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="001", input=TEXT,
                                                            response_format="wav") as response:
        wav = response.read()
    assert wav[:4] == b"RIFF" and wav[4:8] == b"\xff\xff\xff\xff" and wav[40:44] == b"\xff\xff\xff\xff"
    assert correlation(wav[44:], pcm) > SAME_TOKENS


def test_sse_events_concatenate_to_the_plain_response(client):
    plain = client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format="pcm").content
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="001", input=TEXT, response_format="pcm", stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert correlation(b"".join(base64.b64decode(e["audio"]) for e in deltas), plain) > SAME_TOKENS
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == NUM_TOKENS and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_voice_object_instructions_and_extra_fields(client):
    base = client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format="pcm").content
    by_object = client.audio.speech.create(model="tts-1", voice={"id": "001"}, input=TEXT, response_format="pcm",
                                           extra_body={"stream": True, "language": "zh", "no_such_field": 1}).content
    assert correlation(by_object, base) > SAME_TOKENS
    instructed = client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format="pcm",
                                            instructions="用开心的语气说").content
    assert len(instructed) == 2 * SAMPLES


def test_voices_crud_zero_shot_and_cross_lingual(api, client):
    created = []
    for transcript in ("这是参考音频。", None):
        data = {"name": "my voice"} | ({"transcript": transcript} if transcript else {})
        response = http(api, "POST", "/v1/audio/voices", data=data,
                        files={"audio_sample": ("ref.wav", prompt_wav_bytes(), "audio/wav")})
        assert response.status_code == 200, response.text
        voice = response.json()
        assert voice["object"] == "audio.voice" and voice["name"] == "my voice" and voice["id"].startswith("voice_")
        assert voice["kind"] == ("zero_shot" if transcript else "cross_lingual")
        # prepared by the upload: its features computed by the front door and kept with the voice
        assert (api_voice_dir(api, voice["id"]) / "features.pt").exists()
        created.append(voice)
    listed = {v["id"]: v for v in http(api, "GET", "/v1/audio/voices").json()["data"]}
    assert "001" in listed and all(v["id"] in listed for v in created)
    assert http(api, "GET", f"/v1/audio/voices/{created[0]['id']}").json() == created[0]
    audio = [client.audio.speech.create(model="tts-1", voice=v["id"], input=TEXT, response_format="pcm").content
             for v in created]
    assert all(len(a) == 2 * SAMPLES for a in audio)
    again = client.audio.speech.create(model="tts-1", voice=created[0]["id"], input=TEXT, response_format="pcm")
    assert correlation(again.content, audio[0]) > SAME_TOKENS
    assert http(api, "DELETE", f"/v1/audio/voices/{created[1]['id']}").json()["deleted"] is True
    assert_error(http(api, "GET", f"/v1/audio/voices/{created[1]['id']}"), 404)
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="tts-1", voice=created[1]["id"], input=TEXT, response_format="pcm")
    assert_error(http(api, "DELETE", "/v1/audio/voices/001"), 400)


def api_voice_dir(api, voice_id: str) -> Path:
    model_dir = Path(api.process.args[api.process.args.index("--model-dir") + 1])
    return model_dir / "voices" / voice_id


def test_voices_survive_an_api_restart(server, models_dir, tmp_path):
    first = APIProcess(server, models_dir, tmp_path / "first.log")
    try:
        voice = http(first, "POST", "/v1/audio/voices", data={"name": "kept", "transcript": "这是参考音频。"},
                     files={"audio_sample": ("ref.wav", prompt_wav_bytes(), "audio/wav")}).json()
    finally:
        first.stop()
    second = APIProcess(server, models_dir, tmp_path / "second.log")
    try:
        assert http(second, "GET", f"/v1/audio/voices/{voice['id']}").json() == voice
        response = http(second, "POST", "/v1/audio/speech",
                        json={"model": "tts-1", "input": TEXT, "voice": voice["id"], "response_format": "pcm"})
        assert response.status_code == 200 and len(response.content) == 2 * SAMPLES
    finally:
        second.stop()


def test_bad_ids_uploads_and_keys(api, models_dir):
    for bad in ("..", "voice_../../etc", "voice_" + "0" * 32, "%2e%2e%2fspk2info.pt"):
        response = http(api, "GET", f"/v1/audio/voices/{bad}")
        assert 400 <= response.status_code < 500, (bad, response.text)
        response = http(api, "DELETE", f"/v1/audio/voices/{bad}")
        assert 400 <= response.status_code < 500, (bad, response.text)
    assert (models_dir / "CosyVoice2-0.5B" / "spk2info.pt").exists()
    for size in (2 * 1024 * 1024 + 10, 3 * 1024 * 1024):  # over the upload limit; over the body limit too
        assert_error(http(api, "POST", "/v1/audio/voices", data={"name": "big"},
                          files={"audio_sample": ("big.wav", b"\0" * size, "audio/wav")}), 413)
    assert_error(http(api, "POST", "/v1/audio/voices", data={"name": "nan", "transcript": "x"},
                      files={"audio_sample": ("nan.wav", prompt_wav_bytes(nan=True), "audio/wav")}), 400)
    assert_error(http(api, "POST", "/v1/audio/voices", data={"name": "garbage"},
                      files={"audio_sample": ("x.wav", b"not audio at all", "audio/wav")}), 400)
    # the transcript goes into every LLM prompt of the voice: one segment at most
    assert_error(http(api, "POST", "/v1/audio/voices", data={"name": "long", "transcript": "好" * 1001},
                      files={"audio_sample": ("a.wav", prompt_wav_bytes(), "audio/wav")}), 400, "transcript")
    assert_error(http(api, "GET", "/v1/audio/voices", key=None), 401)
    assert_error(http(api, "GET", "/v1/models", key="wrong"), 401)
    assert http(api, "GET", "/v1/models").json()["data"][0]["id"] == "cosyvoice2"


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": "x" * (MAX_TEXT_CHARS + 1)}, "input"),
    ({"input": "x" * 5000}, None),  # within the limit, but one segment of 5000: the BLS's 400
    ({"response_format": "ogg"}, "response_format"),
    ({"speed": 1.5}, "speed"),
    ({"speed": 9}, "speed"),
    ({"voice": "nobody"}, "voice"),
    ({"voice": {"name": "no id"}}, None),
])
def test_bad_requests_get_the_envelope_and_the_next_one_works(api, client, body, param):
    request = {"model": "tts-1", "input": TEXT, "voice": "001", "response_format": "pcm", **body}
    response = http(api, "POST", "/v1/audio/speech", json=request)
    assert_error(response, 404 if param == "voice" else 400, param)
    assert len(client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format="pcm").content) \
        == 2 * SAMPLES


def test_health_and_metrics(api, client):
    assert http(api, "GET", "/health", key=None).json()["status"] == "ok"
    client.audio.speech.create(model="tts-1", voice="001", input=TEXT, response_format="pcm")
    text = http(api, "GET", "/metrics", key=None).text
    values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['cosyserve_api_requests_total{endpoint="/v1/audio/speech",status="200"}'] >= 1
    assert values['cosyserve_api_time_to_first_audio_seconds_count{response_format="pcm"}'] >= 1
    assert values['cosyserve_api_speech_seconds_count{response_format="pcm"}'] >= 1
    assert values['cosyserve_api_audio_bytes_total{response_format="pcm"}'] >= 2 * SAMPLES
    assert not math.isnan(values['cosyserve_api_speech_seconds_sum{response_format="pcm"}'])


@pytest.mark.parametrize("message, status, expected", [
    ("unknown voice 'voice_" + "0" * 32 + "': no such voice", None, 404),
    ("unknown speaker id 'x': 1 speakers are registered", None, 404),
    ("prompt audio contains NaN or infinite samples", None, 400),
    ("Request for unknown model: 'cosyvoice2' is not found", None, 503),
    ("failed to connect to all addresses", "StatusCode.UNAVAILABLE", 503),
    ("Exceeds maximum queue size", None, 429),
    ("Request timeout expired", "StatusCode.UNAVAILABLE", 429),  # waited OFFLINE_BLS_MAX_QUEUE_MS in the queue
    ("overloaded: a stream on this server has 0.12 s of audio buffered, under the 0.3 s it keeps for every stream "
     "(admission_min_buffer_s); retry after 180 ms", "StatusCode.UNAVAILABLE", 429),
    ("model 'token2wav': the token2wav state pool is full (9 pages, 0 freed from unused voices); retry later",
     None, 429),
    ("request timed out after 3 s", "StatusCode.UNAVAILABLE", 504),
    ("request timed out after 3 s", None, 504),
    ("internal error: RuntimeError: the LLM produced no speech tokens", None, 500),
])
def test_triton_errors_map_to_statuses_with_their_message(message, status, expected):
    from tritonclient.utils import InferenceServerException

    from cosyserve.api.errors import triton_error

    error = triton_error(InferenceServerException(msg=message, status=status))
    assert error.status == expected and error.envelope()["error"]["message"] == message


def test_past_capacity_speech_is_429_with_retry_after_at_once(api, idle_server):
    """The engine at its cap of streams: a speech request is refused at once with 429 and Retry-After, then served once they end."""
    streams = fill_to_capacity(idle_server, "cosyvoice2", MAX_STREAMS, 0, num_tokens=1500)
    try:
        response = http(api, "POST", "/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": "001"})
        error = assert_error(response, 429)
        assert error["code"] == "overloaded" and "(max_streams)" in error["message"]
        assert int(response.headers["Retry-After"]) >= 1
        assert response.elapsed.total_seconds() < 2
    finally:
        for stream in streams:
            stream.close(cancel=True)
    wait_until_idle(idle_server.metrics_port)
    speech = http(api, "POST", "/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": "001",
                                                         "response_format": "pcm"})
    assert speech.status_code == 200 and len(speech.content) == 2 * SAMPLES_PER_TOKEN * NUM_TOKENS


def test_without_triton_health_and_speech_are_503(models_dir, tmp_path):
    (dead_port,) = free_ports(1)
    api = APIProcess(None, models_dir, tmp_path / "api.log", triton_url=f"127.0.0.1:{dead_port}")
    try:
        assert_error(http(api, "GET", "/health", key=None), 503)
        assert_error(http(api, "POST", "/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": "001"}), 503)
        assert http(api, "GET", "/v1/audio/voices").status_code == 200  # what needs no Triton still works
    finally:
        api.stop()


def test_run_sh_stop_ends_the_api_started_in_the_background(server, models_dir, tmp_path):
    """What run.sh stage 3 and ``run.sh stop`` run: cosyserve.api.service start (returns once
    /health answers) and stop."""
    from cosyserve.serving.tritonserver import is_running

    (port,) = free_ports(1)
    pid_file, log = tmp_path / "api.pid", tmp_path / "api.log"
    start = subprocess.run(
        [sys.executable, "-m", "cosyserve.api.service", "start", "--pid-file", str(pid_file), "--log", str(log), "--",
         "--host", "127.0.0.1", "--port", str(port), "--triton-url", server.grpc_url,
         "--model-dir", str(models_dir / "CosyVoice2-0.5B"), "--tokenizer-dir", str(models_dir / "cosyvoice2_llm")],
        cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stdout + start.stderr
    pid = int(pid_file.read_text())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            assert json.load(response)["status"] == "ok"
        stop = subprocess.run(["bash", str(REPO_ROOT / "run.sh"), "stop"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120, env={**server_env(), "API_PID_FILE": str(pid_file), "OUT_DIR": str(tmp_path),
                                                "SERVER_PID_FILE": str(tmp_path / "no_triton.pid")})
        assert stop.returncode == 0 and f"stopped cosyserve API (pid {pid})" in stop.stdout, stop.stdout + stop.stderr
        assert not pid_file.exists() and not is_running(pid)  # gone, or a zombie its new parent has not reaped
    finally:
        if is_running(pid):
            os.kill(pid, signal.SIGTERM)


# ----- the text-in WebSockets (ElevenLabs' stream-input and multi-stream-input) -----

def socket_url(api, voice: str = "001", multi: bool = False, **query) -> str:
    from urllib.parse import urlencode

    path = "multi-stream-input" if multi else "stream-input"
    return f"ws://127.0.0.1:{api.port}/v1/text-to-speech/{voice}/{path}?" + urlencode(
        {"model_id": "cosyvoice2", "output_format": "pcm_24000", **query})


class SocketReader:
    """A client socket's messages as they come (with their arrival times) on a thread of its own,
    until the server closes it; ``close_code`` then."""

    def __init__(self, ws) -> None:
        import threading

        self.ws, self.messages, self.close_code = ws, [], None

        def read() -> None:
            from websockets.exceptions import ConnectionClosed

            try:
                while True:
                    self.messages.append((time.monotonic(), json.loads(ws.recv())))
            except ConnectionClosed as exc:
                self.close_code = exc.rcvd.code if exc.rcvd is not None else None
        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def wait(self, timeout_s: float = 120) -> list[dict]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the server did not close the socket"
        return [message for _, message in self.messages]

    def samples(self, context: str | None = None) -> int:
        return sum(len(base64.b64decode(m["audio"])) // 2 for _, m in self.messages
                   if m.get("audio") and m.get("contextId") == context)


def test_text_in_socket_speaks_each_sentence_as_it_arrives(api, idle_server):
    from websockets.sync.client import connect

    text = "The first sentence is short. The second one is a little longer than the first. A third one ends it."
    with connect(socket_url(api), additional_headers={"xi-api-key": API_KEY}) as ws:
        reader = SocketReader(ws)
        ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5, "similarity_boost": 0.8}}))
        for word in text.split(" "):
            ws.send(json.dumps({"text": word + " "}))
            time.sleep(0.4)  # an LLM's pace: 2.5 words a second
        last_word_sent = time.monotonic()
        ws.send(json.dumps({"text": ""}))
        messages = reader.wait()
    audio_times = [at for at, m in reader.messages if m.get("audio")]
    assert audio_times and audio_times[0] < last_word_sent  # the first sentence spoke before the text was all there
    assert messages[-1] == {"isFinal": True} and reader.close_code == 1000
    assert reader.samples() == 3 * SAMPLES  # three sentences, three requests of NUM_TOKENS tokens each
    # the (estimated) alignment covers the text, sentence by sentence, each over its audio
    alignments = [m["alignment"] for m in messages if m.get("audio") == ""]
    assert "".join(c for a in alignments for c in a["chars"]) == text + " "
    assert all(sum(a["charDurationsMs"]) == 1000 * SAMPLES // 24000 for a in alignments)


def test_four_sockets_at_once_and_a_multi_context_one(api, idle_server):
    from websockets.sync.client import connect

    sockets = [connect(socket_url(api, xi_api_key=API_KEY)) for _ in range(3)]
    multi = connect(socket_url(api, multi=True, xi_api_key=API_KEY))
    try:
        readers = [SocketReader(ws) for ws in sockets + [multi]]
        for ws in sockets:
            ws.send(json.dumps({"text": " "}))
            ws.send(json.dumps({"text": "你好，世界。今天天气很好。"}))
            ws.send(json.dumps({"text": ""}))
        multi.send(json.dumps({"text": "One context. ", "context_id": "a"}))
        multi.send(json.dumps({"text": "Another context.", "context_id": "b", "flush": True}))
        multi.send(json.dumps({"close_socket": True}))
        for reader in readers:
            reader.wait()
    finally:
        for ws in sockets + [multi]:
            ws.close()
    for reader in readers[:3]:
        assert reader.close_code == 1000 and reader.samples() == 2 * SAMPLES  # two sentences each
    assert readers[3].close_code == 1000
    assert readers[3].samples("a") == SAMPLES and readers[3].samples("b") == SAMPLES
    finals = [m for _, m in readers[3].messages if m.get("isFinal")]
    assert sorted(m["contextId"] for m in finals) == ["a", "b"]


def test_a_closed_socket_stops_its_requests(api, idle_server):
    from websockets.sync.client import connect

    with connect(socket_url(api, xi_api_key=API_KEY)) as ws:
        reader = SocketReader(ws)
        ws.send(json.dumps({"text": "Sentence one is here. Sentence two is here. Sentence three is here. "}))
        deadline = time.monotonic() + 60
        while not any(m.get("audio") for _, m in reader.messages):
            assert time.monotonic() < deadline, "no audio"
            time.sleep(0.05)
    # closed with two sentences unspoken: idle_server checks that no LLM request, engine request or
    # token2wav stream is left


def test_the_text_socket_benchmark_measures_sockets_at_once(api, idle_server, tmp_path):
    from cosyserve.bench.text_socket import first_piece_words

    text = "First piece of the text. Second piece of it."
    assert first_piece_words(text) == 5
    out = tmp_path / "sockets.json"
    done = subprocess.run([sys.executable, "scripts/bench_text_socket.py", "--url", api.url, "--api-key", API_KEY,
                           "--sockets", "1", "2", "--chars-per-s", "100", "--text", text, "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    levels = json.loads(out.read_text())["levels"]
    assert [level["sockets"] for level in levels] == [1, 2]
    for level in levels:
        assert level["failed"] == 0 and level["first_audio_p50_ms"] is not None
        assert level["audio_s_mean"] == pytest.approx(2 * NUM_TOKENS / 25)  # two pieces of NUM_TOKENS tokens
    assert "| 2 | 0 |" in done.stdout


def test_pipecat_elevenlabs_service_speaks_through_the_socket(api, idle_server):
    """Pipecat's own ElevenLabsTTSService (the multi-context socket), pointed at this server: two
    sentences in, their audio out as TTSAudioRawFrames at 24 kHz, the turn ended by Pipecat."""
    pytest.importorskip("pipecat")
    import asyncio

    from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineTask
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    class Collector(FrameProcessor):
        def __init__(self) -> None:
            super().__init__()
            self.audio = bytearray()

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                assert frame.sample_rate == 24000
                self.audio += frame.audio
            await self.push_frame(frame, direction)

    async def run() -> bytes:
        # stop_frame_timeout_s: Pipecat ends a context that sent no audio for 3 s; the tiny model on
        # a busy 2-core CPU can take longer than that for a first sentence
        tts = ElevenLabsTTSService(api_key=API_KEY, url=f"ws://127.0.0.1:{api.port}", sample_rate=24000,
                                   settings=ElevenLabsTTSService.Settings(voice="001", model="cosyvoice2"),
                                   stop_frame_timeout_s=30.0)
        collector = Collector()
        task = PipelineTask(Pipeline([tts, collector]))
        running = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
        await task.queue_frames([TTSSpeakFrame("Hello there. How are you today?")])
        deadline = time.monotonic() + 120
        while len(collector.audio) < 2 * 2 * SAMPLES and time.monotonic() < deadline:  # both sentences
            await asyncio.sleep(0.05)
        await task.queue_frame(EndFrame())  # the pipeline ends once the audio is there (it ends the socket)
        await asyncio.wait_for(running, 60)
        return bytes(collector.audio)

    audio = asyncio.run(run())
    assert len(audio) // 2 == 2 * SAMPLES  # two sentences of NUM_TOKENS tokens each


@pytest.mark.parametrize("voice, query, first, words", [
    ("nobody", {}, {"text": " "}, "unknown"),
    ("001", {"model_id": "cosyvoice9"}, {"text": " "}, "not served"),
    ("001", {"output_format": "opus_48000_64"}, {"text": " "}, "output_format"),
    ("001", {"inactivity_timeout": "0"}, {"text": " "}, "inactivity_timeout"),
    ("001", {}, {"text": " "}, "missing API key"),
    ("001", {}, {"text": " ", "xi_api_key": "wrong"}, "invalid API key"),
])
def test_text_in_socket_refusals(api, idle_server, voice, query, first, words):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(socket_url(api, voice, **query)) as ws:
        reader = SocketReader(ws)
        try:
            ws.send(json.dumps(first))
        except ConnectionClosed:  # refused at once, from the connection's own query
            pass
        messages = reader.wait(30)
    assert reader.close_code == 1008 and words in messages[-1]["message"], messages


CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def test_playground_plays_audio_in_a_real_browser(api, tmp_path):
    """The page at / in headless Chromium (Debian's, driven by Playwright): upload a voice,
    synthesise with it, the PCM chunks reach Web Audio; then stream text into the text-in
    WebSocket with it; no console errors; a screenshot is left in the test's tmp dir."""
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = next((path for path in CHROMIUM if Path(path).exists()), None)
    if executable is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             args=["--autoplay-policy=no-user-gesture-required", "--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.add_init_script(f"localStorage.setItem('cosyserve-key', '{API_KEY}')")
            page.goto(api.url + "/")
            page.wait_for_function("document.querySelectorAll('#voice option').length > 0")
            reference = tmp_path / "reference.wav"
            reference.write_bytes(prompt_wav_bytes())
            page.fill("#voice-name", "browser voice")
            page.set_input_files("#voice-file", str(reference))
            page.fill("#voice-transcript", "这是参考音频。")
            page.click("#upload")  # the new voice is then selected
            page.wait_for_function("document.querySelector('#voice').value.startsWith('voice_')")
            page.fill("#text", TEXT)
            page.click("#speak")
            page.wait_for_function("window.playground.done", timeout=120_000)
            state = page.evaluate("window.playground")
            # the same voice over the text-in WebSocket, two sentences typed at 50 characters a second
            page.fill("#text", "The first sentence arrives. The second one follows it.")
            page.fill("#pace", "50")
            page.click("#stream")
            page.wait_for_function("window.playground.done", timeout=120_000)
            streamed = page.evaluate("window.playground")
            page.screenshot(path=str(tmp_path / "playground.png"))
        finally:
            browser.close()
    assert state["samplesScheduled"] == SAMPLES and state["chunks"] >= 1, state
    assert state["timeToFirstAudio"] > 0 and state["rtf"] > 0, state
    assert streamed["samplesScheduled"] == 2 * SAMPLES and streamed["timeToFirstAudio"] > 0, streamed
    assert not errors, errors
    assert (tmp_path / "playground.png").stat().st_size > 0
