"""Overload, faults and a soak through a real tritonserver (CPU, tiny random-weight bundle).

One server: the streaming ``cosyvoice2`` with 2 BLS instances and a queue of 2, its offline twin
``cosyvoice2_offline`` with 1 instance and a queue of 1 (the bounded queue run.sh builds, see
model_repo/cosyvoice2/config.pbtxt). Requests past instances + queue are refused at once. Stub
processes are killed with SIGKILL to see what a client gets and that the server serves on.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest_triton import (TEST_TEXT_WARM_UP, Stream, assert_server_idle, fill_to_capacity, grpc_input, metrics,
                             serve_repo, set_parameter, stream_tts, token_limits, triton_gauge, wait_for,
                             wait_until_idle)
from cosyserve.bench.soak import BAD_INPUTS, SoakConfig, format_report, run_soak, write_report
from cosyserve.serving.model_repository import CosyVoice2Repository, build
from cosyserve.serving.tritonserver import is_ready

pytest.importorskip("pytriton")  # the bundled tritonserver

NUM_TOKENS = 40  # max_tokens = min_tokens: every request makes 40 speech tokens
STREAMS = 5  # more than any instance count: the engine takes them all at once
OFFLINE_INSTANCES, OFFLINE_QUEUE = 1, 1
LONG_TOKENS = 1500  # a request that is still generating when the test acts on it
REFUSED = "Exceeds maximum queue size"
# A token2wav stream whose BLS died is closed after this long without a step (600 s as shipped).
STREAM_IDLE_TIMEOUT_S = 4
EXPLICIT_MODEL_CONTROL = ("--model-control-mode=explicit", "--load-model=*")  # as run.sh stage 3
LLM_SEND_TIMEOUT_S = 2  # the llm model stops a request whose caller is gone after this (10 s as shipped)


@pytest.fixture(scope="module")
def server(tiny_bundle: Path, tmp_path_factory):
    # the text front-end loaded at start, as run.sh does: the module's first test measures it
    yield from serve_faults_repo(tiny_bundle, tmp_path_factory.mktemp("faults_server"), text_warm_up="true")


@pytest.fixture(scope="module")
def own_servers():
    """The killed-stub tests' servers, (generator, server) each; stopped at the module's end."""
    servers: list[tuple] = []
    yield servers
    for generator, _ in servers:
        next(generator, None)


@pytest.fixture
def own_server(own_servers: list, tiny_bundle: Path, tmp_path_factory, request):
    """A server no other kind of test uses, for a test that kills a model's stubs. Such a test ends
    with the model loaded again and the server idle and serving, so the next one may use the same
    server; one that exited meanwhile is replaced, one whose test failed is stopped (it may have been
    left with a model unloaded)."""
    if not own_servers or own_servers[-1][1].process.poll() is not None:
        generator = serve_faults_repo(tiny_bundle, tmp_path_factory.mktemp("own_server"))
        own_servers.append((generator, next(generator)))
    failed_before = request.session.testsfailed
    yield own_servers[-1][1]
    if request.session.testsfailed != failed_before:
        next(own_servers.pop()[0], None)


@pytest.fixture
def watched_server(tiny_bundle: Path, tmp_path):
    """A server of its own with the stub watch (run.sh's EXIT_ON_STUB_CRASH=true)."""
    yield from serve_faults_repo(tiny_bundle, tmp_path, watch_stubs=True)


def serve_faults_repo(tiny_bundle: Path, work: Path, watch_stubs: bool = False, text_warm_up: str = TEST_TEXT_WARM_UP):
    repo = build(CosyVoice2Repository(
        tiny_bundle, device="cpu", offline_bls_instances=OFFLINE_INSTANCES, offline_bls_max_queue_size=OFFLINE_QUEUE,
        max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, text_warm_up=text_warm_up, reference_models=True), work / "repo")
    token2wav_config = repo / "token2wav" / "config.pbtxt"
    token2wav_config.write_text(token2wav_config.read_text().replace(
        "parameters [", f'parameters [\n  {{ key: "stream_idle_timeout_s", value: {{ string_value: "{STREAM_IDLE_TIMEOUT_S}" }} }},', 1))
    set_parameter(repo / "llm" / "config.pbtxt", "send_timeout_s", str(LLM_SEND_TIMEOUT_S))
    # explicit model control: a model whose stub died can be loaded again (what run.sh stage 3 does)
    yield from serve_repo(repo, work, extra_args=EXPLICIT_MODEL_CONTROL, watch_stubs=watch_stubs)


def long_request(text: str = "你好") -> list:
    return [grpc_input("target_text", text), *token_limits(LONG_TOKENS)]


def assert_refused_at_once(server, model: str) -> None:
    """One more request on a stream (and a unary one when ``model`` is not decoupled): refused within
    a second with a clear message, the unary one with gRPC's UNAVAILABLE; the server stays ready."""
    refused = Stream(server.grpc_url)
    started = time.monotonic()
    refused.send(model, long_request())
    result, error = refused.next(timeout_s=10)
    waited = time.monotonic() - started
    refused.close()
    assert result is None and REFUSED in str(error), (result, error)
    assert waited < 1.0, f"the refusal took {waited:.2f} s"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready() and client.is_model_ready(model)
    if model == "cosyvoice2":  # decoupled: streams only
        return
    started = time.monotonic()
    with pytest.raises(InferenceServerException, match=REFUSED) as refusal:
        client.infer(model, long_request())
    assert time.monotonic() - started < 1.0 and refusal.value.status() == "StatusCode.UNAVAILABLE"
    assert client.is_server_ready() and client.is_model_ready(model)
    client.close()


def first_chunk(stream: Stream, timeout_s: float = 60):
    result, error = stream.next(timeout_s)
    assert error is None, error
    return result.as_numpy("waveform")


# ----- ready means warm (first in this module: the server's first requests) ---------------------

def test_the_first_requests_after_ready_are_as_fast_as_later_ones(idle_server):
    """The engine loads its text front-end at start (parameter warm_up): without it, a process's first
    English request waited 3.7 s for the normaliser, against ~0.75 s for a whole request here.
    Generous bound (a loaded 2-core machine): the first within 2x + 0.5 s of the fastest later one."""
    client = grpcclient.InferenceServerClient(idle_server.grpc_url)
    inputs = [grpc_input("target_text", "Hello there, it is 25 degrees."), *token_limits(SOAK_TOKENS)]

    def timed(model: str) -> float:
        started = time.monotonic()
        if model == "cosyvoice2":
            assert sum(c.size for c in stream_tts(idle_server, inputs)) == SOAK_TOKENS * 960
        else:
            assert client.infer(model, inputs).as_numpy("waveform").size == SOAK_TOKENS * 960
        return time.monotonic() - started

    for model in ("cosyvoice2", "cosyvoice2_offline"):
        first, later = timed(model), min(timed(model) for _ in range(4))
        print(f"{model}: first request {first * 1000:.0f} ms, fastest later one {later * 1000:.0f} ms")
        assert first < 2 * later + 0.5
    client.close()


def streams_with_a_chunk(streams: list[Stream], count: int, timeout_s: float = 60) -> list[Stream]:
    """The first ``count`` of ``streams`` to deliver an audio chunk (the others are not read)."""
    ready: list[Stream] = []
    deadline = time.monotonic() + timeout_s
    while len(ready) < count:
        assert time.monotonic() < deadline, f"{len(ready)} of {count} streams sent audio in {timeout_s} s"
        for stream in streams:
            if stream in ready:
                continue
            try:
                result, error = stream.next(timeout_s=0.05)
            except queue.Empty:
                continue
            assert error is None, error
            assert result.as_numpy("waveform").size > 0
            ready.append(stream)
    return ready


# ----- admission control ------------------------------------------------------------------------

def test_the_engine_takes_every_stream_at_once(idle_server):
    """No instance count bounds the streams: more than any instance count of the old BLS all send
    audio at once (the engine's admission is MAX_STREAMS, off here), and nothing queues in Triton."""
    streams = [Stream(idle_server.grpc_url) for _ in range(STREAMS)]
    try:
        for stream in streams:
            stream.send("cosyvoice2", long_request())
        # the one instance takes each request and returns at once: nothing stays queued
        wait_for(lambda: triton_gauge(idle_server, "nv_inference_pending_request_count", "cosyvoice2") == 0,
                 "no request queued", timeout_s=5)
        streams_with_a_chunk(streams, STREAMS)
        wait_for(lambda: metrics(idle_server.metrics_port)["cosyserve_engine_streams"] == STREAMS,
                 "every stream in the engine's gauge", timeout_s=5)  # a stats period after the change
    finally:
        for stream in streams:
            stream.close(cancel=True)
    wait_until_idle(idle_server.metrics_port)
    assert sum(c.size for c in stream_tts(idle_server, [grpc_input("target_text", "好")])) == NUM_TOKENS * 960


def test_offline_requests_past_instance_and_queue_are_refused_at_once(idle_server):
    streams = fill_to_capacity(idle_server, "cosyvoice2_offline", OFFLINE_INSTANCES, OFFLINE_QUEUE,
                               LONG_TOKENS)
    try:
        assert_refused_at_once(idle_server, "cosyvoice2_offline")
    finally:
        for stream in streams:
            stream.close(cancel=True)
    wait_until_idle(idle_server.metrics_port)


# ----- faults -----------------------------------------------------------------------------------

def stub_pids(server, model: str) -> list[int]:
    """Process ids of the Python backend stubs of ``model``'s instances (their argv names the model file)."""
    model_file = str((server.log_file.parent / "repo" / model / "1" / "model.py").resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that just ended
            continue
        if argv[0].endswith(b"triton_python_backend_stub") and argv[1:2] == [model_file.encode()]:
            pids.append(int(entry.name))
    return pids


def stream_error(stream: Stream, timeout_s: float) -> Exception | None:
    """Read ``stream`` to its end; its error, or None when it ended normally."""
    while True:
        result, error = stream.next(timeout_s)
        if error is not None:
            return error
        if result.get_response().parameters["triton_final_response"].bool_param:
            return None


def assert_idle_and_alive(server) -> None:
    """No LLM request and no token2wav stream left, tritonserver running (stub crashes allowed)."""
    values = wait_until_idle(server.metrics_port, timeout_s=STREAM_IDLE_TIMEOUT_S + LLM_SEND_TIMEOUT_S + 20)
    assert values["cosyserve_llm_active_requests"] == 0, values
    assert values["cosyserve_token2wav_open_streams"] == 0, values
    assert server.process.poll() is None, "tritonserver died"


def short_stream(server) -> int:
    return sum(c.size for c in stream_tts(server, [grpc_input("target_text", "好")]))


def streaming_long_request(server) -> Stream:
    """A LONG_TOKENS stream whose first chunk has come (its token2wav session is open)."""
    stream = Stream(server.grpc_url)
    stream.send("cosyvoice2", long_request())
    assert first_chunk(stream).size > 0
    return stream


def kill_stubs(server, model: str) -> tuple[list[int], float]:
    """SIGKILL every stub process of ``model``; their pids and when."""
    pids = stub_pids(server, model)
    assert pids, f"no stub process found for {model}"
    killed_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids, killed_at


# The engine's stub: every stage of a request runs there (the reference layout's models are not used).
@pytest.mark.parametrize("model", ["cosyvoice2"])
def test_a_killed_stub_fails_its_requests_until_the_model_is_loaded_again(own_server, model):
    """SIGKILL of the engine's stub process mid-stream, without the stub watch: usually Triton
    24.10's Python backend starts no new stub, and every request that reaches the dead instance fails
    with "Stub process '<instance>' is not healthy." until the model is loaded again (explicit model
    control); then it serves as before with nothing left of the failed request. Rarely tritonserver
    itself exits, which must be non-zero so that a supervisor restarts it. The stream in flight gets
    no answer: its responses were the dead process's to send, and Triton notices the death only
    when the next request reaches it, so a client needs its own deadline, or the server the stub
    watch (run.sh's default, the next test), which ends every request within seconds."""
    server = own_server
    stream = streaming_long_request(server)
    pids, killed_at = kill_stubs(server, model)
    time.sleep(1)
    stream.close(cancel=True)  # nothing more will come (see above)
    if server.process.poll() is not None:
        assert server.process.returncode != 0, "tritonserver exited with status 0 after a stub died"
        return
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="is not healthy"):
        short_stream(server)
    print(f"{model}: a new request failed {time.monotonic() - killed_at:.2f} s after the kill")
    started = time.monotonic()
    client.load_model(model)
    print(f"{model}: loaded again in {time.monotonic() - started:.1f} s")
    assert set(stub_pids(server, model)).isdisjoint(pids)
    assert short_stream(server) == NUM_TOKENS * 960
    assert_idle_and_alive(server)
    client.close()


STUB_WATCH_LINE = "cosyserve stub watch: the Python stub of model instance '{model}_0_"


@pytest.mark.parametrize("model", ["llm", "token2wav", "cosyvoice2"])
def test_a_killed_stub_ends_the_watched_server_and_its_requests_within_seconds(watched_server, model):
    """With the stub watch (run.sh's default), SIGKILL of any model's stubs (the engine's, or a
    reference model's it does not use) while a stream and an offline request are in flight: both fail
    within seconds, tritonserver is killed (non-zero exit status) with one log line naming the dead
    instance, and its health endpoint stops answering ready."""
    server = watched_server
    stream = streaming_long_request(server)
    offline = grpcclient.InferenceServerClient(server.grpc_url)
    offline_errors: queue.Queue = queue.Queue()
    offline.async_infer("cosyvoice2_offline", long_request(), lambda result, error: offline_errors.put(error))
    _, killed_at = kill_stubs(server, model)
    error = stream_error(stream, timeout_s=30)
    stream_failed_after = time.monotonic() - killed_at
    offline_error = offline_errors.get(timeout=30)
    offline_failed_after = time.monotonic() - killed_at
    server.process.wait(timeout=30)
    exited_after = time.monotonic() - killed_at
    stream.close()
    offline.close()
    print(f"{model}: stream failed after {stream_failed_after:.2f} s ({error}), offline after "
          f"{offline_failed_after:.2f} s ({offline_error}), server exited {server.process.returncode} after "
          f"{exited_after:.2f} s")
    assert error is not None and offline_error is not None
    assert stream_failed_after < 10 and offline_failed_after < 10 and exited_after < 10
    assert server.process.returncode != 0
    log = server.log_file.read_text(errors="replace")
    # The watcher's line, or tritonserver aborting by itself first: a stub killed while it holds the
    # shared-memory lock it talks to the server through ("boost::interprocess::lock_exception",
    # signal 6), seen with the engine's stub, which sends responses and polls cancellations all the
    # time. Either way the server is down within seconds, non-zero, for its supervisor to restart.
    assert STUB_WATCH_LINE.format(model=model) in log or "Signal (6) received" in log, log[-3000:]
    assert not is_ready(server.http_port)


# ----- per-request timeout -----------------------------------------------------------------------

REQUEST_TIMEOUT_S = 3  # a LONG_TOKENS request takes far longer on the CPU; a NUM_TOKENS one ~1 s
QUEUE_WAIT_MS = 500  # run.sh's BLS_MAX_QUEUE_MS / OFFLINE_BLS_MAX_QUEUE_MS
QUEUE_TIMEOUT = "Request timeout expired"


@pytest.fixture(scope="module")
def timeout_server(tiny_bundle: Path, tmp_path_factory):
    """The engine with a request timeout (run.sh's REQUEST_TIMEOUT_S), one cosyvoice2_offline instance
    with a bound on the time a request waits for it (OFFLINE_BLS_MAX_QUEUE_MS) and the stub watch."""
    work = tmp_path_factory.mktemp("timeout_server")
    repo = build(CosyVoice2Repository(
        tiny_bundle, device="cpu", offline_bls_instances=1, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS,
        request_timeout_s=REQUEST_TIMEOUT_S, offline_bls_max_queue_ms=QUEUE_WAIT_MS),
        work / "repo")
    # its last test stops it and checks the exit status: the unload gets Triton's default 30 s
    yield from serve_repo(repo, work, watch_stubs=True, exit_timeout_s=30)


def test_a_request_that_waits_past_the_queue_bound_is_refused_and_the_running_one_goes_on(timeout_server):
    """With cosyvoice2_offline's one instance busy, an offline request waits QUEUE_WAIT_MS in Triton's
    queue, then is refused with UNAVAILABLE "Request timeout expired" (the HTTP API: 429, its router:
    the next server); a stream meanwhile is the engine's and is served; the running requests are not
    disturbed."""
    server = timeout_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    running = streaming_long_request(server)
    offline_running = fill_to_capacity(server, "cosyvoice2_offline", 1, 0, LONG_TOKENS)
    try:
        assert short_stream(server) == NUM_TOKENS * 960  # no instance holds streams back

        started = time.monotonic()
        with pytest.raises(InferenceServerException, match=QUEUE_TIMEOUT) as refusal:
            client.infer("cosyvoice2_offline", long_request())
        waited = time.monotonic() - started
        assert refusal.value.status() == "StatusCode.UNAVAILABLE"
        assert QUEUE_WAIT_MS / 1000 <= waited < QUEUE_WAIT_MS / 1000 + 1.5, waited
        # the running stream went on until its own limit (REQUEST_TIMEOUT_S), not refused
        assert f"request timed out after {REQUEST_TIMEOUT_S} s" in str(stream_error(running, timeout_s=30))
    finally:
        for stream in [running, *offline_running]:
            stream.close(cancel=True)
    client.close()
    assert_idle_and_alive(server)


def test_a_request_past_its_timeout_fails_alone_and_releases_what_it_held(timeout_server):
    """A stream and an offline request still running after REQUEST_TIMEOUT_S end with "request
    timed out after 3 s" (the offline one with gRPC's UNAVAILABLE, which the API turns into 504);
    their LLM request and token2wav session are released at once; the other model's request, and
    the next ones, are served in full."""
    server = timeout_server
    log_start = server.log_file.stat().st_size
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stream = Stream(server.grpc_url)
    started = time.monotonic()
    stream.send("cosyvoice2", long_request())
    assert first_chunk(stream).size > 0  # a token2wav session is open
    # the offline model, meanwhile: a short request is served, a long one times out
    short = [grpc_input("target_text", "好"), *token_limits(NUM_TOKENS)]
    assert client.infer("cosyvoice2_offline", short).as_numpy("waveform").size == NUM_TOKENS * 960
    error = stream_error(stream, timeout_s=30)
    timed_out_after = time.monotonic() - started
    stream.close()
    assert error is not None and f"request timed out after {REQUEST_TIMEOUT_S} s" in str(error), error
    assert REQUEST_TIMEOUT_S <= timed_out_after < REQUEST_TIMEOUT_S + 3, timed_out_after
    values = wait_until_idle(server.metrics_port, timeout_s=10)  # released when it ends (a loaded 2-core machine)
    assert values["cosyserve_llm_active_requests"] == values["cosyserve_token2wav_open_streams"] == 0, values

    started = time.monotonic()
    with pytest.raises(InferenceServerException, match=f"request timed out after {REQUEST_TIMEOUT_S} s") as timeout:
        client.infer("cosyvoice2_offline", long_request())
    assert timeout.value.status() == "StatusCode.UNAVAILABLE"
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    values = wait_until_idle(server.metrics_port, timeout_s=10)
    assert values["cosyserve_llm_active_requests"] == 0, values

    assert short_stream(server) == NUM_TOKENS * 960
    assert client.infer("cosyvoice2_offline", short).as_numpy("waveform").size == NUM_TOKENS * 960
    assert_server_idle(server, log_start)
    client.close()
    # a graceful stop (SIGTERM: the models unload, their stubs end) is not taken for a crash
    server.stop()
    assert server.process.returncode == 0, server.log_file.read_text()[-4000:]
    assert "stub watch" not in server.log_file.read_text(errors="replace")


# ----- admission by playback ---------------------------------------------------------------------

ADMISSION_MIN_BUFFER_S = 1000  # more than any stream buffers: while one streams, every new request is refused


def one_stream_refused(server):
    """A new stream's first answer: (result, error, seconds it took)."""
    refused = Stream(server.grpc_url)
    started = time.monotonic()
    refused.send("cosyvoice2", [grpc_input("target_text", "好")])
    result, error = refused.next(timeout_s=30)
    waited = time.monotonic() - started
    refused.close()
    return result, error, waited


def serve_admitting(tiny_bundle: Path, tmp_path_factory, name: str, **admission):
    """The engine under the ``admission`` settings, one cosyvoice2_offline instance."""
    work = tmp_path_factory.mktemp(name)
    repo = build(CosyVoice2Repository(
        tiny_bundle, device="cpu", offline_bls_instances=1, max_tokens=NUM_TOKENS,
        min_tokens=NUM_TOKENS, text_warm_up=TEST_TEXT_WARM_UP, **admission), work / "repo")
    yield from serve_repo(repo, work)


@pytest.fixture(scope="module")
def admission_server(tiny_bundle: Path, tmp_path_factory):
    """Admitting requests only while every stream of the server has ADMISSION_MIN_BUFFER_S of audio
    buffered (run.sh's ADMISSION_MIN_BUFFER_S)."""
    yield from serve_admitting(tiny_bundle, tmp_path_factory, "admission_server",
                               admission_min_buffer_s=ADMISSION_MIN_BUFFER_S)


def test_while_a_stream_runs_short_of_audio_new_requests_are_refused_at_once(admission_server):
    """A stream is sending (its listener has less than ADMISSION_MIN_BUFFER_S buffered): a new stream
    and an offline request are refused at once with UNAVAILABLE "overloaded: ..." (the HTTP API: 429;
    its router: the next server); the running stream goes on, and once it has ended requests are
    served again. The front door counts admitted and refused requests."""
    server = admission_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = metrics(server.metrics_port)
    running = streaming_long_request(server)
    try:
        result, error, waited = one_stream_refused(server)
        assert result is None and "overloaded: a stream on this server has" in str(error), (result, error)
        assert waited < 1.0, waited
        with pytest.raises(InferenceServerException, match="overloaded: ") as refusal:
            client.infer("cosyvoice2_offline", [grpc_input("target_text", "好")])
        assert refusal.value.status() == "StatusCode.UNAVAILABLE"
        assert first_chunk(running).size > 0  # the running stream goes on
    finally:
        running.close(cancel=True)
    assert_idle_and_alive(server)
    assert short_stream(server) == NUM_TOKENS * 960
    after = metrics(server.metrics_port)
    assert after["cosyserve_requests_refused_total"] - before.get("cosyserve_requests_refused_total", 0) == 2
    assert after["cosyserve_requests_admitted_total"] - before.get("cosyserve_requests_admitted_total", 0) == 2
    client.close()


# ----- a cap on streams ---------------------------------------------------------------------------

MAX_STREAMS = 1
STREAM_CAP_REFUSAL = "overloaded: this server is sending 1 streams, its limit of 1 (max_streams)"


@pytest.fixture(scope="module")
def stream_cap_server(tiny_bundle: Path, tmp_path_factory):
    """Admitting a request only while the server sends fewer than MAX_STREAMS streams (run.sh's
    MAX_STREAMS)."""
    yield from serve_admitting(tiny_bundle, tmp_path_factory, "stream_cap_server", max_streams=MAX_STREAMS)


def test_past_max_streams_new_requests_are_refused_at_once(stream_cap_server):
    """An offline request in flight is not a stream: a stream is served meanwhile. Then, while one
    stream runs, a second stream and an offline request are refused at once with UNAVAILABLE
    "overloaded: ... (max_streams); retry after N ms" (the HTTP API: 429; its router: the next
    server); the running stream goes on, and once it has ended both are served. The front door
    counts admitted and refused requests."""
    server = stream_cap_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = metrics(server.metrics_port)
    offline = fill_to_capacity(server, "cosyvoice2_offline", OFFLINE_INSTANCES, 0, LONG_TOKENS)
    try:
        assert short_stream(server) == NUM_TOKENS * 960
    finally:
        for stream in offline:
            stream.close(cancel=True)
    assert_idle_and_alive(server)

    running = streaming_long_request(server)
    try:
        result, error, waited = one_stream_refused(server)
        assert result is None and STREAM_CAP_REFUSAL in str(error), (result, error)
        assert re.search(r"retry after \d+ ms", str(error)), error
        assert waited < 1.0, waited
        started = time.monotonic()
        with pytest.raises(InferenceServerException, match=re.escape(STREAM_CAP_REFUSAL)) as refusal:
            client.infer("cosyvoice2_offline", [grpc_input("target_text", "好")])
        assert refusal.value.status() == "StatusCode.UNAVAILABLE" and time.monotonic() - started < 1.0
        assert first_chunk(running).size > 0  # the running stream goes on
    finally:
        running.close(cancel=True)
    assert_idle_and_alive(server)
    assert short_stream(server) == NUM_TOKENS * 960
    short = [grpc_input("target_text", "好"), *token_limits(NUM_TOKENS)]
    assert client.infer("cosyvoice2_offline", short).as_numpy("waveform").size == NUM_TOKENS * 960
    after = metrics(server.metrics_port)
    assert after["cosyserve_requests_refused_total"] - before.get("cosyserve_requests_refused_total", 0) == 2
    assert after["cosyserve_requests_admitted_total"] - before.get("cosyserve_requests_admitted_total", 0) == 5
    client.close()


# ----- cancellations and a soak -----------------------------------------------------------------

# 120 take about 60 s on a 2-core CPU (each holds a BLS instance until its first chunk or cancel);
# COSYSERVE_CANCELLING_CLIENTS=200 (say) for more.
CANCELLING_CLIENTS = int(os.environ.get("COSYSERVE_CANCELLING_CLIENTS", "120"))


@pytest.mark.soak
def test_hundreds_of_clients_cancelling_mid_stream_leave_nothing_behind(idle_server):
    """Each client (8 at a time) retries while refused, then cancels its stream: every other one
    after its first chunk, the rest at once (still generating).
    Afterwards no LLM request or token2wav stream is left, and the next request is served."""
    before = metrics(idle_server.metrics_port)
    refusals = []

    def client(i: int) -> None:
        while True:
            stream = Stream(idle_server.grpc_url)
            try:
                stream.send("cosyvoice2", long_request(f"第{i}个"))
                try:
                    result, error = stream.next(60 if i % 2 else 0.2)
                except queue.Empty:  # admitted, no chunk yet: cancelled now
                    return
                if error is None:
                    assert result.as_numpy("waveform").size > 0
                    return
                assert REFUSED in str(error), error
                refusals.append(i)
            finally:
                stream.close(cancel=True)
            time.sleep(0.2)  # as a client told to retry would

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(CANCELLING_CLIENTS)))
    after = wait_until_idle(idle_server.metrics_port)
    generated = after["cosyserve_llm_generated_tokens_total"] - before["cosyserve_llm_generated_tokens_total"]
    print(f"{CANCELLING_CLIENTS} cancelled streams, {len(refusals)} refusals, {generated:.0f} tokens generated")
    assert generated < CANCELLING_CLIENTS * LONG_TOKENS / 4, "the cancelled LLM requests were not stopped early"
    assert sum(c.size for c in stream_tts(idle_server, [grpc_input("target_text", "好")])) == NUM_TOKENS * 960


# CI runs the short soak; COSYSERVE_SOAK_REQUESTS=5000 (say) for a long one.
SOAK_REQUESTS = int(os.environ.get("COSYSERVE_SOAK_REQUESTS", "200"))
SOAK_WARMUP = 40  # requests before memory counts: caches, allocator pools, lazily built buffers
SOAK_TOKENS = 5
# Growth of the stubs' resident memory from after the warm-up to the end of the soak, in MB.
SOAK_RSS_GROWTH_MB = 40
# The least-squares slope of tritonserver's and the stubs' resident memory together, in MB per
# 1000 requests after the warm-up. Measured here on a fresh server: +13 (+159 before the warm-up
# held a burst and each kind of bad input: one-off steps of ~10 MB); a leak of 1 MB per request
# would be +1000.
SOAK_SLOPE_MB_PER_1000 = 100


@pytest.mark.soak
def test_soak_with_cancels_bad_inputs_and_bursts_keeps_memory_flat(idle_server, tmp_path):
    """scripts/soak.py's run, short: SOAK_REQUESTS requests after a warm-up, 2 at a time, streaming
    and offline in turn, 10 % cancelled mid-stream, 5 % bad inputs of every kind, a burst of 8
    streams every 50 requests (the engine takes them: no cap is set). No unexpected failure; every bad
    input answered with its own clear error; memory flat; nothing left over. The report is written
    to the test's tmp_path (soak.json)."""
    config = SoakConfig(
        url=idle_server.grpc_url, http_port=idle_server.http_port, metrics_port=idle_server.metrics_port,
        server_pid=idle_server.pid, requests=SOAK_WARMUP + SOAK_REQUESTS, concurrency=2,
        burst_every=50, burst_size=8, tokens=SOAK_TOKENS, cancel_tokens=LONG_TOKENS, warmup=SOAK_WARMUP,
        sample_interval_s=1.0, request_timeout_s=120)
    report = run_soak(config)
    print(format_report(report))
    write_report(report, tmp_path / "soak.json")
    assert report.unexpected == 0, format_report(report)
    rejected = {kind.removeprefix("bad:") for kind, results in report.outcomes.items() if kind.startswith("bad:")}
    assert rejected == {bad.name for bad in BAD_INPUTS}, "not every kind of bad input was sent"
    for kind, results in report.outcomes.items():
        assert not kind.startswith("bad:") or set(results) == {"rejected"}, (kind, results)
    assert report.outcomes["cancel"] == {"cancelled": round(config.requests * config.cancel_fraction)}
    assert report.burst_refused == 0, "the engine takes a burst whole (no MAX_STREAMS here)"
    stubs = [name for name in report.memory_growth_mb if re.fullmatch(r".+_\d+_\d+", name)]
    assert {name.rsplit("_", 2)[0] for name in stubs} >= {"cosyvoice2", "cosyvoice2_offline", "llm", "token2wav"}
    assert report.memory_growth_mb["stubs"] < SOAK_RSS_GROWTH_MB
    assert report.memory_slope_mb_per_1000["total"] < SOAK_SLOPE_MB_PER_1000
