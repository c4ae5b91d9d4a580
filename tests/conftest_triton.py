"""Helpers for the Triton end-to-end tests: the model repository, a server on free ports, requests.

The repository is built by run.sh stage 2's builder (:mod:`cosyserve.serving.model_repository`),
with ``cosyvoice2_offline`` (the same BLS with ``decoupled: False``, so one server exercises
streaming and offline without a second start-up) as busy as ``cosyvoice2``.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from cosyserve.bench.prometheus import read_metrics
from cosyserve.schedule import plan_chunks
from cosyserve.serving.model_repository import CosyVoice2Repository, build, fill
from cosyserve.serving.tritonserver import terminate_with_parent

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_TOKEN = 960
HELD_BACK_SAMPLES = 3840  # HiFT overlap withheld by a non-final chunk (8 mel frames x 480)


# The test servers' BLS instances load the text front-end on their first request of each language
# (TEXT_WARM_UP=false): loading both languages' grammars at start costs ~3.5 s of CPU per instance,
# 10 s of a 3-instance server's 32 s start on the CI machine. What the warm-up is for is tested on a
# server of its own (tests/test_faults.py, test_the_first_requests_after_ready_...).
TEST_TEXT_WARM_UP = "false"


def repository_spec(models_dir: Path, *, max_tokens: int, min_tokens: int, bls_instances: int,
                    max_batch_size: int = 16, max_queue_size: int | None = 0,
                    text_warm_up: str = TEST_TEXT_WARM_UP, max_streams: int = 0) -> CosyVoice2Repository:
    """The streaming CosyVoice2 repository on the CPU: the engine (``cosyvoice2``), ``bls_instances``
    instances of ``cosyvoice2_offline`` with a queue of ``max_queue_size`` waiting requests (0: no
    limit, run.sh's default; None: as many as instances), the engine's stream cap ``max_streams``
    (0: none), and the reference layout's models, which tests call directly."""
    return CosyVoice2Repository(models_dir, device="cpu", offline_bls_instances=bls_instances,
                                offline_bls_max_queue_size=max_queue_size, max_tokens=max_tokens,
                                min_tokens=min_tokens, max_batch_size=max_batch_size, text_warm_up=text_warm_up,
                                max_streams=max_streams, reference_models=True)


def template_values(models_dir: Path, *, max_tokens: int, min_tokens: int, bls_instances: int,
                    max_batch_size: int = 16) -> dict[str, dict[str, str]]:
    """The keys run.sh stage 2 fills, per model (``cosyvoice2_offline`` aside)."""
    models = repository_spec(models_dir, max_tokens=max_tokens, min_tokens=min_tokens, bls_instances=bls_instances,
                             max_batch_size=max_batch_size, text_warm_up="true").models()
    return {name: entry.values for name, entry in models.items() if name != "cosyvoice2_offline"}


def copy_of_bundle(tiny_bundle: Path, out: Path) -> Path:
    """``out`` with a copy of the bundle's CosyVoice2 directory (spk2info.pt and the voice store
    may change there) and links to the rest."""
    shutil.copytree(tiny_bundle / "CosyVoice2-0.5B", out / "CosyVoice2-0.5B")
    for name in ("cosyvoice2_llm", "assets"):
        (out / name).symlink_to(tiny_bundle / name)
    return out


def build_model_repo(models_dir: Path, repo: Path, *, max_tokens: int, min_tokens: int, bls_instances: int,
                     max_queue_size: int | None = 0, text_warm_up: str = TEST_TEXT_WARM_UP) -> Path:
    """Streaming ``cosyvoice2`` + its offline twin ``cosyvoice2_offline`` + the four shared models."""
    return build(repository_spec(models_dir, max_tokens=max_tokens, min_tokens=min_tokens,
                                 bls_instances=bls_instances, max_queue_size=max_queue_size,
                                 text_warm_up=text_warm_up), repo)


def set_parameter(config: Path, key: str, value: str) -> None:
    """Give the (filled) config's parameter ``key`` another value."""
    pattern = re.compile(r'(key: "%s", value: \{ string_value: )"[^"]*"' % re.escape(key))
    text, count = pattern.subn(lambda m: f'{m.group(1)}"{value}"', config.read_text())
    assert count == 1, f"parameter {key} is not in {config}"
    config.write_text(text)


# A decoupled Python model that calls the ``llm`` model through BLS, as the cosyvoice2 BLS does.
# Request inputs: ``mode`` "churn" (``calls`` short LLM streams, each read to its end) or "die" (read
# the first token of a long stream, then kill this stub).
LLM_CALLER_MODEL = '''
import os
import signal
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyserve.llm.prompt import SOS_ID, TASK_ID
from cosyserve.serving.triton_utils import FINAL, FinishedResponseIterators, optional_scalar, optional_text


def llm_stream(num_tokens: int):
    inputs = {"input_ids": np.array([[SOS_ID, 100, 200, TASK_ID]], np.int32),
              "request_output_len": np.array([[num_tokens]], np.int32),
              "min_tokens": np.array([[num_tokens]], np.int32), "streaming": np.array([[True]])}
    return pb_utils.InferenceRequest(model_name="llm", requested_output_names=["output_ids", "sequence_length"],
                                     inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()]).exec(decoupled=True)


class TritonPythonModel:
    def initialize(self, args):
        self.finished = FinishedResponseIterators()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if optional_text(request, "mode") == "die":
                next(iter(llm_stream(600)))
                os.kill(os.getpid(), signal.SIGKILL)
            for _ in range(optional_scalar(request, "calls")):
                responses = llm_stream(3)
                tokens = []
                for response in responses:
                    tokens.append(pb_utils.get_output_tensor_by_name(response, "output_ids"))
                    for _ in range(4):  # messages for the stub's utils thread, which then frees this
                        pb_utils.Logger.log_verbose("llm_caller")  # iterator late (not logged by default)
                # 3 tokens (one response each, or fewer carrying several), then the final flag alone
                assert tokens[-1] is None and sum(t.as_numpy().shape[-1] for t in tokens[:-1]) == 3
                self.finished.keep(responses)
                del responses, tokens  # a BLS going on with its work: only the kept reference is left
                busy_until = time.monotonic() + 0.01  # and allocating while the stub frees it
                while time.monotonic() < busy_until:
                    [np.arange(i) for i in range(20)]
                self.finished.release(sender.is_cancelled)
            sender.send(flags=FINAL)
        return None
'''

LLM_CALLER_CONFIG = '''
name: "NAME"
backend: "python"
max_batch_size: 1
model_transaction_policy { decoupled: true }
input [
  { name: "mode", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "calls", data_type: TYPE_INT32, dims: [ 1 ] }
]
output [ { name: "unused", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
'''


def build_llm_caller_repo(models_dir: Path, repo: Path, callers: list[str], send_timeout_s: float) -> Path:
    """The ``llm`` model (``send_timeout_s`` set) and one :data:`LLM_CALLER_MODEL` per name in ``callers``."""
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "model_repo" / "llm", repo / "llm")
    subs = template_values(models_dir, max_tokens=1, min_tokens=1, bls_instances=1)["llm"]
    config = repo / "llm" / "config.pbtxt"
    config.write_text(fill(config.read_text(), subs))
    set_parameter(config, "send_timeout_s", str(send_timeout_s))
    for name in callers:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(LLM_CALLER_MODEL)
        (repo / name / "config.pbtxt").write_text(LLM_CALLER_CONFIG.replace("NAME", name))
    return repo


# Lines of a server log that say a stub crashed (its Python stacks follow, see triton_utils).
STUB_CRASH = re.compile(r"Fatal Python error|Stub process .* is not healthy|malloc\(\)|double free|corrupted")


def crash_report(log_file: Path, since: int = 0) -> str:
    """The server log from byte ``since`` when it tells of a crashed stub, else ''."""
    with open(log_file, "rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    return text[-6000:] if STUB_CRASH.search(text) else ""


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def consecutive_free_ports(count: int, attempts: int = 50) -> int:
    """The first of ``count`` consecutive free ports (servers numbered from one base port)."""
    for _ in range(attempts):
        (first,) = free_ports(1)
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def expected_chunk_samples(num_tokens: int) -> list[int]:
    """Samples per streamed chunk for ``num_tokens`` speech tokens (exponential schedule).

    A non-final chunk voices its hop and withholds the HiFT overlap; the next one delivers it.
    """
    chunks = plan_chunks(num_tokens)
    sizes = []
    for i, chunk in enumerate(chunks):
        voiced = (chunk.num_tokens if chunk.finalize else chunk.num_tokens - 3) - chunk.token_offset
        carried = HELD_BACK_SAMPLES if i > 0 else 0
        withheld = 0 if chunk.finalize else HELD_BACK_SAMPLES
        sizes.append(SAMPLES_PER_TOKEN * voiced + carried - withheld)
    return sizes


def metrics(port: int) -> dict[str, float]:
    """cosyserve_* metrics from Triton's Prometheus endpoint, each summed over its label sets."""
    return read_metrics(port, host="127.0.0.1")


# How long the engine's metrics must stay unchanged to be taken as final: they reach Triton's metrics
# up to ~0.6 s after they change (the engine sends its stats every 0.25 s, the front door publishes
# them at most as often, polling every 0.05 s), so a request that begins and ends within that lag shows
# in no read until then. Two reads 0.3 s apart once agreed before it showed (CI: a CosyVoice3
# voice-prefix hit of one test counted in the next test's deltas).
QUIET_S = 1.2


def settled_metrics(port: int, prefix: str = "cosyserve_", timeout_s: float = 10.0,
                    until: Callable[[dict[str, float]], bool] = lambda values: True) -> dict[str, float]:
    """The metrics once ``until`` holds and no ``prefix`` metric has changed for :data:`QUIET_S`
    (after ``timeout_s``: as they are)."""
    def watched(values: dict[str, float]) -> dict[str, float]:
        return {name: value for name, value in values.items() if name.startswith(prefix)}
    deadline = time.monotonic() + timeout_s
    last, changed = metrics(port), time.monotonic()
    while True:
        time.sleep(0.1)
        values, now = metrics(port), time.monotonic()
        if watched(values) != watched(last) or not until(values):
            changed = now
        if now - changed >= QUIET_S or now > deadline:
            return values
        last = values


def pending_requests(port: int) -> float:
    """Requests waiting in Triton's queues, over every model (``nv_inference_pending_request_count``)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(value) for value in re.findall(r"^nv_inference_pending_request_count\{.*\} (\S+)$", page,
                                                    re.MULTILINE))


def wait_until_idle(port: int, timeout_s: float = 20.0) -> dict[str, float]:
    """The metrics once nothing is queued, no BLS instance holds a request, no LLM request is active,
    no token2wav stream is open, and the engine's latest stats are in (:func:`settled_metrics`)."""
    def idle(values: dict[str, float]) -> bool:
        return (values.get("cosyserve_llm_active_requests", 0) == 0
                and values.get("cosyserve_token2wav_open_streams", 0) == 0
                and values.get("cosyserve_engine_requests", 0) == 0
                and values.get("cosyserve_requests_in_progress", 0) == 0 and pending_requests(port) == 0)
    return settled_metrics(port, timeout_s=timeout_s, until=idle)


def grpc_input(name: str, value, datatype: str | None = None) -> grpcclient.InferInput:
    if isinstance(value, str):
        value, datatype = np.array([[value.encode("utf-8")]], dtype=object), "BYTES"
    value = np.asarray(value)
    datatype = datatype or {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL",
                            np.dtype(np.uint64): "UINT64", np.dtype(np.float16): "FP16"}[value.dtype]
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def token_limits(num_tokens: int) -> list:
    """BLS inputs that make the LLM produce exactly ``num_tokens`` speech tokens."""
    value = np.array([[num_tokens]], np.int32)
    return [grpc_input("max_tokens", value), grpc_input("min_tokens", value)]


class Stream:
    """One gRPC stream to a decoupled model: ``send`` a request, ``responses`` until the final flag."""

    def __init__(self, grpc_url: str):
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self._queue: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._queue.put((result, error)))

    def send(self, model: str, inputs: list, request_id: str = "", outputs: list[str] = ("waveform",)) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True,
                                       outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])

    def next(self, timeout_s: float = 120.0):
        """(result, error) of the next response."""
        return self._queue.get(timeout=timeout_s)

    def responses(self, output: str = "waveform", timeout_s: float = 120.0) -> list[np.ndarray]:
        """Every non-empty ``output`` until the final response; raises the stream's error."""
        arrays = []
        while True:
            result, error = self.next(timeout_s)
            if error is not None:
                raise error
            array = result.as_numpy(output)
            if array is not None:
                arrays.append(array)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return arrays

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def server_env() -> dict[str, str]:
    """One torch/OMP thread per model process: the CI machine has 2 cores."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def serve_repo(repo: Path, work: Path, extra_args: tuple[str, ...] = (), watch_stubs: bool = False,
               exit_timeout_s: int = 5):
    """Generator for a module fixture: tritonserver on ``repo`` (free ports, log ``work/server.log``,
    ``extra_args`` on its command line, the stub watch with ``watch_stubs``), yielded running and
    stopped afterwards."""
    from cosyserve.serving.tritonserver import start_server

    http, grpc, metrics_port = free_ports(3)
    # Triton waits up to 30 s on SIGTERM for requests still in flight (after a killed stub, some never
    # end); 5 s save minutes of CI time. Past it Triton exits with status 1, and unloading six Python
    # models takes ~4 s on an idle 2-core machine: a test that checks a graceful stop's status gives more.
    extra_args = (f"--exit-timeout-secs={exit_timeout_s}", *extra_args)
    server = start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics_port, extra_args=extra_args,
                          log_file=work / "server.log", timeout=300, env=server_env(), die_with_parent=True,
                          watch_stubs=watch_stubs)
    yield server
    server.stop()


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Poll ``url`` until it answers; fail if ``process`` exits first or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            assert process.poll() is None, f"process exited with {process.returncode}"
            assert time.monotonic() < deadline, f"{url} not ready after {timeout_s} s"
            time.sleep(0.3)


def serve_openai_llm(llm_dir: Path, log: Path, max_slots: int):
    """Generator for a module fixture: ``cosyserve.llm.openai_server`` on ``llm_dir`` (CPU),
    yielding (base url, log file) and terminated afterwards."""
    (port,) = free_ports(1)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "cosyserve.llm.openai_server", "--model-dir", str(llm_dir), "--host", "127.0.0.1",
             "--port", str(port), "--device", "cpu", "--max-slots", str(max_slots)],
            stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=REPO_ROOT, preexec_fn=terminate_with_parent)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process)
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        process.terminate()
        process.wait(timeout=30)


def stream_tts(server, inputs: list, model: str = "cosyvoice2") -> list[np.ndarray]:
    """One streaming request; the chunks, flattened."""
    stream = Stream(server.grpc_url)
    try:
        stream.send(model, inputs)
        return [chunk.reshape(-1) for chunk in stream.responses()]
    finally:
        stream.close()


def assert_server_idle(server, log_start: int) -> None:
    """After a test: no stub crashed since ``log_start``, no LLM request or token2wav stream is left, alive."""
    crash = crash_report(server.log_file, log_start)
    assert not crash, f"a model's stub crashed during the test; server log:\n{crash}"
    values = wait_until_idle(server.metrics_port)
    leftovers = f"{values}\nserver log:\n{crash_report(server.log_file) or 'no crash reported'}"
    assert values.get("cosyserve_llm_active_requests", 0) == 0, leftovers
    assert values.get("cosyserve_token2wav_open_streams", 0) == 0, leftovers
    assert values.get("cosyserve_engine_requests", 0) == 0, leftovers
    assert values.get("cosyserve_requests_in_progress", 0) == 0, leftovers
    # the flow engine's state: only cached voices hold pages once no stream is open
    assert values.get("cosyserve_token2wav_state_pages_in_use", 0) == \
        values.get("cosyserve_token2wav_state_voice_pages", 0), leftovers
    assert server.process.poll() is None, "tritonserver died"


def triton_gauge(server, name: str, model: str) -> float:
    """One of Triton's own per-model gauges (``nv_inference_pending_request_count``: queued requests)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    match = re.search(r'^%s\{model="%s",version="1"\} (\S+)$' % (name, model), page, re.MULTILINE)
    assert match, f"{name} of {model} is not in Triton's metrics"
    return float(match.group(1))


def wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.05)


def fill_to_capacity(server, model: str, instances: int, queued: int, num_tokens: int) -> list[Stream]:
    """``instances`` requests of ``num_tokens`` running on ``model`` and ``queued`` more waiting, one
    stream each (bounded queues: model_repo/cosyvoice2/config.pbtxt).

    The running ones go first and the queued ones only once every instance holds one: sent all at
    once, a request can still sit in the queue while an instance is about to take it, and the
    last one is then refused as past the queue's bound."""
    streams = [Stream(server.grpc_url) for _ in range(instances + queued)]

    def send(group: list[Stream]) -> None:
        for stream in group:
            stream.send(model, [grpc_input("target_text", "你好"), *token_limits(num_tokens)])

    def in_progress(values: dict[str, float] | None = None) -> float:  # taken by the engine (admitted)
        values = metrics(server.metrics_port) if values is None else values
        return values.get("cosyserve_engine_requests", values.get("cosyserve_requests_in_progress", 0))

    # the model's twin (offline / streaming) may be busy too: counted once the engine's gauge has settled
    before = in_progress(settled_metrics(server.metrics_port, "cosyserve_engine_requests"))
    send(streams[:instances])
    wait_for(lambda: in_progress() == before + instances, f"{instances} requests running")
    send(streams[instances:])
    wait_for(lambda: triton_gauge(server, "nv_inference_pending_request_count", model) == queued,
             f"{instances} requests running and {queued} queued")
    return streams
