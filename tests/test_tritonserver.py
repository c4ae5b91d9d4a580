"""The tritonserver launcher against a real server and the echo models in tests/triton_models."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyserve.serving import tritonserver as ts

MODELS = Path(__file__).parent / "triton_models"
REPO_ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("tritonclient.grpc")
try:
    ts.find_tritonserver()
except ts.TritonServerError as e:
    pytest.skip(f"no tritonserver: {e}", allow_module_level=True)


def free_ports(n: int = 3) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start(repo: Path, log: Path, **kwargs) -> ts.TritonServer:
    http, grpc, metrics = free_ports()
    return ts.start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log,
                           die_with_parent=True, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start(MODELS, tmp_path_factory.mktemp("triton") / "server.log", timeout=120) as running:
        yield running
    assert not ts.is_running(running.pid)


def test_environment_puts_this_python_first():
    install = ts.find_tritonserver()
    env = ts.server_environment(install, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["PATH"].endswith(":/usr/bin")
    if install.library_dirs:  # bundled server: its libs come before the inherited ones
        assert env["LD_LIBRARY_PATH"].split(":")[0] == str(install.library_dirs[0])
        assert env["LD_LIBRARY_PATH"].endswith(":/opt/x")
    if install.backend_directory is not None:
        stub = install.backend_directory / "python" / "triton_python_backend_stub"
        assert f"{sys.version_info.major}.{sys.version_info.minor}" in str(stub.resolve())
        assert (install.backend_directory / "python" / "libtriton_python.so").resolve().is_file()


@pytest.mark.parametrize("numpy_version, fails", [("1.26.4", False), ("2.0.0", True), ("2.5.2", True)])
def test_bundled_stub_needs_numpy_below_2(monkeypatch, numpy_version, fails):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: numpy_version)
    if fails:
        with pytest.raises(ts.TritonServerError, match=r"numpy<2"):
            ts.check_numpy_for_bundled_stub()
    else:
        ts.check_numpy_for_bundled_stub()


def test_http_identity(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    values = np.linspace(-1, 1, 7, dtype=np.float32)
    text = np.array(["héllo, 世界".encode()], dtype=object)
    inputs = [httpclient.InferInput("INPUT0", [7], "FP32"), httpclient.InferInput("TEXT", [1], "BYTES")]
    inputs[0].set_data_from_numpy(values)
    inputs[1].set_data_from_numpy(text)
    result = client.infer("identity", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
    assert result.as_numpy("TEXT_OUT")[0].decode() == "héllo, 世界"


def test_grpc_identity_and_statistics(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = client.get_inference_statistics("identity", as_json=True)
    values = np.arange(5, dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [5], "FP32"), grpcclient.InferInput("TEXT", [1], "BYTES")]
    inputs[0].set_data_from_numpy(values)
    inputs[1].set_data_from_numpy(np.array([b"x"], dtype=object))
    np.testing.assert_array_equal(client.infer("identity", inputs).as_numpy("OUTPUT0"), values)
    after = client.get_inference_statistics("identity", as_json=True)

    def count(stats):
        return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))

    assert count(after) == count(before) + 1


def test_grpc_stream_decoupled(server):
    import queue

    import tritonclient.grpc as grpcclient

    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    values = np.arange(10, dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [10], "FP32"), grpcclient.InferInput("NUM_CHUNKS", [1], "INT32")]
    inputs[0].set_data_from_numpy(values)
    inputs[1].set_data_from_numpy(np.array([3], dtype=np.int32))
    client.async_stream_infer("echo_stream", inputs, request_id="r1", enable_empty_final_response=True)
    chunks = []
    while True:
        result, error = results.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            break
        chunks.append(result.as_numpy("OUTPUT0"))
    client.stop_stream()
    assert [len(c) for c in chunks] == [4, 3, 3]
    np.testing.assert_array_equal(np.concatenate(chunks), values)


def test_missing_repository_is_refused(tmp_path):
    with pytest.raises(ts.TritonServerError, match="not a directory"):
        start(tmp_path / "nope", tmp_path / "log")


def test_busy_port_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ts.TritonServerError, match=f"http port {port} is already in use"):
            ts.start_server(MODELS, http_port=port, grpc_port=free_ports(1)[0], metrics_port=free_ports(1)[0],
                            log_file=tmp_path / "log")


def test_failing_model_reports_server_errors(tmp_path):
    broken = tmp_path / "repo" / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text((MODELS / "identity" / "config.pbtxt").read_text().replace("identity", "broken"))
    (broken / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('distinctive-load-failure-42')\n"
    )
    with pytest.raises(ts.TritonServerError) as caught:
        start(tmp_path / "repo", tmp_path / "server.log", timeout=60)
    message = str(caught.value)
    assert "exited with code" in message
    errors = message.split("errors in ")[1].split("last 40 lines of")[0]
    assert "failed to load 'broken'" in errors and "distinctive-load-failure-42" in errors


def test_cli_start_and_stop(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "identity").symlink_to(MODELS / "identity")
    http, grpc, metrics = free_ports()
    pid_file = tmp_path / "server.pid"
    cli = [sys.executable, "-m", "cosyserve.serving.tritonserver"]
    started = subprocess.run(
        [*cli, "start", "--model-repo", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--log", str(tmp_path / "server.log"), "--pid-file", str(pid_file),
         "--timeout", "120"],
        capture_output=True, text=True, timeout=150, cwd=REPO_ROOT,
    )
    pid = ts.read_pid_file(pid_file)
    try:
        assert started.returncode == 0, started.stderr
        assert pid is not None and ts.is_running(pid)
        assert ts.is_ready(http)  # still serving after the launcher exited
    finally:
        stopped = subprocess.run([*cli, "stop", "--pid-file", str(pid_file)], capture_output=True, text=True,
                                 timeout=90, cwd=REPO_ROOT)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped tritonserver (pid {pid})" in stopped.stdout
    assert not ts.is_running(pid) and not pid_file.exists()
    again = subprocess.run([*cli, "stop", "--pid-file", str(pid_file)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


# --- the clients against fake_tts(_stream), stand-ins with the cosyvoice2 tensors -------------


def test_run_streaming_and_offline(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from cosyserve import clients

    wav = np.zeros(1234, dtype=np.float32)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = clients.build_inputs(grpcclient, wav, "五个字文本", "abcdef")
    audio, result = clients.run_streaming(client, "fake_tts_stream", inputs, clients.requested_outputs(grpcclient),
                                          "s1", timeout_s=30)
    assert audio.shape == (6 * 2400,) and audio[0] == 1234 and audio[1] == 5
    assert result.audio_s == pytest.approx(0.6) and len(result.chunk_arrivals_s) == 3
    assert result.chunk_arrivals_s == sorted(result.chunk_arrivals_s)
    assert result.latency_s >= result.chunk_arrivals_s[-1] > 0
    assert sum(result.chunk_durations_s) == pytest.approx(0.6)

    http = httpclient.InferenceServerClient(server.http_url)
    inputs = clients.build_inputs(httpclient, wav, "ref", "abc", speaker_id="spk")
    audio, result = clients.run_offline(http, "fake_tts", inputs, clients.requested_outputs(httpclient), "o1")
    assert audio.shape == (3 * 2400,) and audio[0] == 1234 and audio[1] == 3
    assert result.audio_s == pytest.approx(0.3) and result.latency_s > 0


def test_client_scripts(server, tmp_path):
    import json

    import soundfile as sf

    tone = 0.3 * np.sin(2 * np.pi * 200 * np.arange(24000) / 24000)
    sf.write(tmp_path / "prompt.wav", tone.astype(np.float32), 24000)  # sent resampled to 16 kHz
    manifest = tmp_path / "list.txt"
    manifest.write_text("".join(f"utt{i}|参考|prompt.wav|{'x' * (i + 1)}\n" for i in range(3)), encoding="utf-8")

    def run(script, *args):
        done = subprocess.run([sys.executable, str(REPO_ROOT / script), *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    for mode, model in (("streaming", "fake_tts_stream"), ("offline", "fake_tts")):
        log_dir = tmp_path / mode
        out = run("client_grpc.py", "--server-port", str(server.grpc_port), "--model-name", model, "--mode", mode,
                  "--num-tasks", "2", "--manifest-path", str(manifest), "--log-dir", str(log_dir),
                  "--json-report", str(log_dir / "report.json"))
        report = json.loads((log_dir / "report.json").read_text())
        assert report["requests"] == 3 and report["failed"] == 0 and report["num_tasks"] == 2
        assert report["audio_s"] == pytest.approx(0.6)  # (1 + 2 + 3) * 0.1 s
        assert report["latency"]["count"] == 3 and f"RTF: {report['rtf']:.4f}" in out
        [stats] = report["triton_stats"]["model_stats"]
        assert stats["name"] == model and stats["inference_count"] == 3
        assert sf.info(str(log_dir / "utt2.wav")).frames == 3 * 2400
        assert (log_dir / "rtf-list.txt").is_file() and (log_dir / "model_config-list.json").is_file()
        assert f"model {model}" in (log_dir / "stats_summary-list.txt").read_text()
        if mode == "streaming":
            assert report["first_chunk_latency"]["count"] == 3 and "underruns" in report
            assert all(len(r["chunk_arrivals_s"]) == 3 for r in report["per_request"])

    out = run("client_http.py", "--server-port", str(server.http_port), "--model-name", "fake_tts",
              "--reference-audio", "prompt.wav", "--reference-text", "ref", "--target-text", "abcd",
              "--output-audio", "http.wav")
    assert "RTF" in out and sf.info(str(tmp_path / "http.wav")).frames == 4 * 2400
