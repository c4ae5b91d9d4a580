"""A soak of a running server: many requests of every kind, memory sampled, failures classified.

:func:`run_soak` sends ``requests`` requests to a running Triton server over gRPC, ``concurrency``
at a time, in a seeded order (with ``duration_s``, only those started within that many seconds:
a soak for a time rather than a count):

* streaming (``cosyvoice2``) and offline (``cosyvoice2_offline``) requests in turn, each retried
  while the server refuses it as overloaded (:func:`cosyserve.errors.is_overload`, as a client told
  to retry would);
* ``cancel_fraction`` of them streams cancelled by the client after their first chunk;
* ``bad_fraction`` of them bad inputs (:data:`BAD_INPUTS`: empty text, 10k characters in one
  segment, NaN / Inf / empty / silent / 60 s reference audio, a wrong data type, an unknown
  speaker), each of which must be answered with its own clear error: a refusal of that request with
  the expected message, not an internal error, not audio;
* every ``burst_every`` requests, a burst of ``burst_size`` streams sent at once on top of the
  running ones (above capacity when it exceeds instances + queue): each is admitted (and served in
  full) or refused as overloaded, never anything else; refusals are not retried. The
  first burst comes halfway through the warm-up, so that the buffers a first burst widens are
  not counted as growth.

Meanwhile a sampler reads, every ``sample_interval_s`` seconds, the resident memory (``VmRSS``) of
tritonserver and of every Python stub process it runs (by instance name), and the GPU memory in
use (``nvidia-smi``, when there is one). After ``warmup`` requests (caches, allocator pools,
lazily built buffers), the memory slope is the least-squares fit of memory against requests
completed, in MB per 1,000 requests. At the end the server must be ready and idle: no LLM request,
no token2wav stream and no request in a BLS instance left (:data:`IDLE_GAUGES` back to 0).

A failure is unexpected when it is none of the above: an error on a valid request, a bad input that
got audio or an internal error, a burst stream failing with something other than a refusal, a
leftover request, a server no longer ready. ``scripts/soak.py`` is the command line; it exits 1
when any is seen.
"""

from __future__ import annotations

import json
import queue
import random
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..errors import is_overload
from ..schedule import SAMPLES_PER_TOKEN
from ..serving.processes import python_stubs
from ..serving.tritonserver import is_ready
from .prometheus import read_metrics

IDLE_GAUGES = ("cosyserve_llm_active_requests", "cosyserve_token2wav_open_streams", "cosyserve_requests_in_progress")


def _tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _text(name: str, text: str) -> grpcclient.InferInput:
    return _tensor(name, np.array([[text.encode("utf-8")]], dtype=object), "BYTES")


def _int(name: str, value: int) -> grpcclient.InferInput:
    return _tensor(name, np.array([[value]], np.int32), "INT32")


def _reference(wav: np.ndarray, datatype: str = "FP32", text: str = "希望你以后能够做的比我还好呦。") -> list:
    dtype = {"FP32": np.float32, "FP64": np.float64}[datatype]
    return [_tensor("reference_wav", wav.astype(dtype).reshape(1, -1), datatype),
            _int("reference_wav_len", max(wav.size, 1)), _text("reference_text", text)]


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * TOKENIZER_SAMPLE_RATE)) * 0.1).astype(np.float32)


def _with_sample(wav: np.ndarray, value: float) -> np.ndarray:
    wav = wav.copy()
    wav[len(wav) // 2] = value
    return wav


@dataclass(frozen=True)
class BadInput:
    """A request the server must refuse with its own clear error: ``inputs()`` besides the text,
    and a part of the message it must answer with."""

    name: str
    inputs: Callable[[], list]
    expected: str
    text: str = "你好。"
    text_frontend: bool = True


# Every kind of bad input the soak sends, in turn. 10k characters: the front door accepts texts of up to
# max_text_chars (100000) and splits them into segments; sent without the text front-end they are
# one segment, past the segment limit.
BAD_INPUTS = (
    BadInput("empty text", lambda: [], "target_text is empty", text=""),
    BadInput("10k characters", lambda: [], "a segment of 10000 characters", text="你" * 10000, text_frontend=False),
    BadInput("NaN audio", lambda: _reference(_with_sample(_noise(3), np.nan)), "NaN or infinite"),
    BadInput("Inf audio", lambda: _reference(_with_sample(_noise(3), np.inf)), "NaN or infinite"),
    BadInput("empty audio", lambda: _reference(np.zeros(0, np.float32)), "reference_wav"),
    BadInput("silent audio", lambda: _reference(np.zeros(3 * TOKENIZER_SAMPLE_RATE, np.float32)), "silent"),
    BadInput("60 s audio", lambda: _reference(_noise(60)), "s long"),
    BadInput("wrong dtype", lambda: _reference(_noise(3), "FP64"), "data-type is 'FP64'"),
    BadInput("unknown speaker", lambda: [_text("speaker_id", "no_such_speaker")], "unknown speaker"),
)


@dataclass(frozen=True)
class SoakConfig:
    url: str = "localhost:8001"
    http_port: int = 8000
    metrics_port: int = 8002
    server_pid: int | None = None  # tritonserver's pid (memory is sampled when known and local)
    requests: int = 1000
    duration_s: float | None = None  # requests not started by then are not sent (a soak for a time)
    concurrency: int = 4
    cancel_fraction: float = 0.10
    bad_fraction: float = 0.05
    burst_every: int = 100
    burst_size: int = 16
    tokens: int | None = None  # speech tokens per request (max = min); None: the server's limits
    cancel_tokens: int = 1500  # a cancelled stream asks for this many, so it is still running when cancelled
    warmup: int = 20
    sample_interval_s: float = 2.0
    request_timeout_s: float = 300.0
    model: str = "cosyvoice2"
    offline_model: str = "cosyvoice2_offline"
    seed: int = 0


@dataclass
class Outcome:
    """What one request got: ``result`` ok | cancelled | rejected (a bad input's expected error) |
    refused (a burst stream refused as overloaded) | unexpected; ``message`` for the last three."""

    kind: str  # stream | offline | cancel | bad:<name> | burst
    result: str
    message: str = ""
    refusals: int = 0  # refusals retried before the request was admitted
    seconds: float = 0.0


@dataclass
class MemorySample:
    seconds: float
    completed: int
    rss_mb: dict[str, float]  # tritonserver and each stub (by instance name)
    gpu_mb: float | None


def least_squares_slope(xs: list[float], ys: list[float]) -> float | None:
    """dy/dx of the least-squares line through the points; None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def process_rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def gpu_memory_mb() -> float | None:
    """GPU memory in use on every GPU together (nvidia-smi), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return float(sum(float(line) for line in out.split()))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class MemorySampler:
    """A thread sampling memory every ``interval_s`` s, with the count of requests completed then."""

    def __init__(self, server_pid: int | None, interval_s: float, completed: Callable[[], int]):
        self.server_pid = server_pid
        self.interval_s = interval_s
        self.completed = completed
        self.samples: list[MemorySample] = []
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-memory", daemon=True)

    def sample(self) -> MemorySample:
        rss: dict[str, float] = {}
        if self.server_pid is not None:
            server = process_rss_mb(self.server_pid)
            if server is not None:
                rss["tritonserver"] = server
            for stub in python_stubs(self.server_pid).values():
                value = process_rss_mb(stub.pid)
                if value is not None:
                    rss[stub.instance] = value
        sample = MemorySample(time.monotonic() - self._started, self.completed(), rss, gpu_memory_mb())
        self.samples.append(sample)
        return sample

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


def _message(exc: BaseException) -> str:
    return exc.message() if isinstance(exc, InferenceServerException) and exc.message() else str(exc)


class SoakClient:
    """Sends one request of each kind and says what it got (:class:`Outcome`)."""

    def __init__(self, config: SoakConfig):
        self.config = config

    def _limits(self, tokens: int | None) -> list:
        return [] if tokens is None else [_int("max_tokens", tokens), _int("min_tokens", tokens)]

    def _stream(self, inputs: list, cancel_after_first: bool = False) -> tuple[int, str | None]:
        """(samples received, error message or None); with ``cancel_after_first``, the client
        cancels the stream once its first chunk is in."""
        client = grpcclient.InferenceServerClient(self.config.url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        samples, cancel = 0, False
        try:
            client.async_stream_infer(self.config.model, inputs, enable_empty_final_response=True,
                                      outputs=[grpcclient.InferRequestedOutput("waveform")])
            while True:
                result, error = responses.get(timeout=self.config.request_timeout_s)
                if error is not None:
                    return samples, _message(error)
                chunk = result.as_numpy("waveform")
                samples += 0 if chunk is None else chunk.size
                if cancel_after_first and samples:
                    cancel = True
                    return samples, None
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return samples, None
        except queue.Empty:
            return samples, f"no response within {self.config.request_timeout_s:g} s"
        finally:
            client.stop_stream(cancel_requests=cancel)
            client.close()

    def _offline(self, inputs: list) -> tuple[int, str | None]:
        client = grpcclient.InferenceServerClient(self.config.url)
        try:
            response = client.infer(self.config.offline_model, inputs, client_timeout=self.config.request_timeout_s)
            return response.as_numpy("waveform").size, None
        except InferenceServerException as exc:
            return 0, _message(exc)
        finally:
            client.close()

    def _until_admitted(self, kind: str, send: Callable[[], tuple[int, str | None]],
                        check: Callable[[int, str | None], tuple[str, str]]) -> Outcome:
        started, refusals = time.monotonic(), 0
        while True:
            samples, error = send()
            if error is None or not is_overload(error):
                result, message = check(samples, error)
                return Outcome(kind, result, message, refusals, time.monotonic() - started)
            refusals += 1
            time.sleep(0.05 * min(refusals, 20))  # as a client told to retry after a moment would

    def _served(self, tokens: int | None) -> Callable[[int, str | None], tuple[str, str]]:
        def check(samples: int, error: str | None) -> tuple[str, str]:
            if error is not None:
                return "unexpected", error
            if samples == 0 or (tokens is not None and samples != tokens * SAMPLES_PER_TOKEN):
                return "unexpected", f"{samples} samples of audio for {tokens} speech tokens"
            return "ok", ""
        return check

    def valid(self, index: int) -> Outcome:
        tokens = self.config.tokens
        inputs = [_text("target_text", f"第{index}句，你好。"), *self._limits(tokens)]
        if index % 2:
            return self._until_admitted("offline", lambda: self._offline(inputs), self._served(tokens))
        return self._until_admitted("stream", lambda: self._stream(inputs), self._served(tokens))

    def cancel(self, index: int) -> Outcome:
        inputs = [_text("target_text", f"第{index}个，取消。"), *self._limits(self.config.cancel_tokens)]

        def check(samples: int, error: str | None) -> tuple[str, str]:
            if error is not None or not samples:
                return "unexpected", error or "the stream ended without audio"
            return "cancelled", ""

        return self._until_admitted("cancel", lambda: self._stream(inputs, cancel_after_first=True), check)

    def bad(self, index: int, bad: BadInput) -> Outcome:
        inputs = [_text("target_text", bad.text), *bad.inputs(), *self._limits(self.config.tokens)]
        if not bad.text_frontend:
            inputs.append(_tensor("text_frontend", np.array([[False]]), "BOOL"))

        def check(samples: int, error: str | None) -> tuple[str, str]:
            if error is None:
                return "unexpected", f"answered with {samples} samples of audio"
            if bad.expected not in error or error.startswith("internal error"):
                return "unexpected", error
            return "rejected", error

        send = (lambda: self._offline(inputs)) if index % 2 else (lambda: self._stream(inputs))
        return self._until_admitted(f"bad:{bad.name}", send, check)

    def burst(self, index: int) -> Outcome:
        tokens = self.config.tokens
        inputs = [_text("target_text", f"第{index}次，突发。"), *self._limits(tokens)]
        started = time.monotonic()
        samples, error = self._stream(inputs)
        if error is not None and is_overload(error):
            return Outcome("burst", "refused", error, 0, time.monotonic() - started)
        result, message = self._served(tokens)(samples, error)
        return Outcome("burst", result, message, 0, time.monotonic() - started)


def plan(config: SoakConfig) -> list[str]:
    """The kind of each request, in a seeded order: ``cancel``, ``bad``, else ``valid``. One bad
    input of each kind comes during the warm-up, so that what the large ones allocate once (a 60 s
    clip is 3.8 MB on the wire, and ~10 MB more in tritonserver and in the front door that checks it) is not
    counted as growth."""
    rng = random.Random(config.seed)
    cancels = round(config.requests * config.cancel_fraction)
    bads = round(config.requests * config.bad_fraction)
    early = min(bads, len(BAD_INPUTS), config.warmup, config.requests)
    kinds = ["cancel"] * cancels + ["bad"] * (bads - early) + ["valid"] * (config.requests - cancels - bads)
    rng.shuffle(kinds)
    for position in sorted(rng.sample(range(min(config.warmup, config.requests)), early)):
        kinds.insert(position, "bad")
    return kinds


@dataclass
class SoakReport:
    config: dict
    seconds: float
    outcomes: dict[str, dict[str, int]]  # kind -> result -> count
    failures: dict[str, int]  # "kind: message" -> count, unexpected ones only
    admitted: int  # requests admitted by the server (every one not refused)
    refused: int  # refusals: retried ones plus refused burst streams
    burst_admitted: int
    burst_refused: int
    memory_slope_mb_per_1000: dict[str, float | None]  # "total", "stubs", "tritonserver", "gpu", each instance
    memory_growth_mb: dict[str, float | None]  # from the first sample after the warm-up to the last
    leftovers: dict[str, float]  # the idle gauges at the end
    server_ready: bool
    samples: list[dict] = field(default_factory=list)

    @property
    def unexpected(self) -> int:
        return sum(self.failures.values()) + (0 if self.server_ready else 1) + sum(1 for v in self.leftovers.values() if v)

    def to_dict(self) -> dict:
        return {**asdict(self), "unexpected": self.unexpected}


def _normalised(message: str) -> str:
    """A failure's class: its message with numbers and ids blanked, cut to 160 characters."""
    return re.sub(r"\d+", "N", message)[:160]


def memory_trend(samples: list[MemorySample], warmup: int) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Per series (each process, ``stubs``, ``total``, ``gpu``): the least-squares slope in MB per
    1,000 completed requests and the growth in MB, over the samples taken after ``warmup`` requests."""
    after = [s for s in samples if s.completed >= warmup] or samples[-1:]
    names = sorted({name for s in after for name in s.rss_mb})
    series: dict[str, list[tuple[int, float]]] = {}
    for s in after:
        if s.rss_mb and all(name in s.rss_mb for name in names):
            stubs = sum(v for k, v in s.rss_mb.items() if k != "tritonserver")
            series.setdefault("total", []).append((s.completed, sum(s.rss_mb.values())))
            series.setdefault("stubs", []).append((s.completed, stubs))
        for name, value in s.rss_mb.items():
            series.setdefault(name, []).append((s.completed, value))
        if s.gpu_mb is not None:
            series.setdefault("gpu", []).append((s.completed, s.gpu_mb))
    slopes, growth = {}, {}
    for name, points in series.items():
        slope = least_squares_slope([p[0] for p in points], [p[1] for p in points])
        slopes[name] = None if slope is None else slope * 1000
        growth[name] = points[-1][1] - points[0][1]
    return slopes, growth


def idle_gauges(metrics_port: int, timeout_s: float = 30.0) -> dict[str, float]:
    """The idle gauges once both are 0, or as they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            values = read_metrics(metrics_port, host="127.0.0.1")
        except OSError as exc:
            return {"metrics unreadable: " + str(exc): 1.0}
        gauges = {name: values.get(name, 0.0) for name in IDLE_GAUGES}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def run_soak(config: SoakConfig, progress: Callable[[str], None] = lambda line: None) -> SoakReport:
    client = SoakClient(config)
    kinds = plan(config)
    bad_positions = [index for index, kind in enumerate(kinds) if kind == "bad"]
    bad_inputs = {index: BAD_INPUTS[k % len(BAD_INPUTS)] for k, index in enumerate(bad_positions)}  # in turn
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    sampler = MemorySampler(config.server_pid, config.sample_interval_s, lambda: len(outcomes))
    bursts: list = []
    burst_pool = ThreadPoolExecutor(max(config.burst_size, 1))
    started = time.monotonic()

    def one(index: int) -> None:
        if config.duration_s is not None and time.monotonic() - started > config.duration_s:
            return
        kind = kinds[index]
        if kind == "cancel":
            outcome = client.cancel(index)
        elif kind == "bad":
            outcome = client.bad(index, bad_inputs[index])
        else:
            outcome = client.valid(index)
        with lock:
            outcomes.append(outcome)
            done = len(outcomes)
        if outcome.result == "unexpected":
            progress(f"request {index} ({outcome.kind}): unexpected: {outcome.message}")
        if config.burst_every and done >= config.warmup // 2 and (done - config.warmup // 2) % config.burst_every == 0:
            bursts.extend(burst_pool.submit(client.burst, done * 1000 + i) for i in range(config.burst_size))
        if done % 50 == 0:
            progress(f"{done}/{config.requests} requests")

    sampler.start()
    try:
        with ThreadPoolExecutor(config.concurrency) as pool:
            list(pool.map(one, range(config.requests)))
        burst_outcomes = [future.result() for future in bursts]
    finally:
        burst_pool.shutdown()
        sampler.stop()
    seconds = time.monotonic() - started
    leftovers = idle_gauges(config.metrics_port)
    server_ready = is_ready(config.http_port)

    everything = outcomes + burst_outcomes
    table: dict[str, Counter] = {}
    for outcome in everything:
        table.setdefault(outcome.kind, Counter())[outcome.result] += 1
    failures = Counter(f"{o.kind}: {_normalised(o.message)}" for o in everything if o.result == "unexpected")
    retried = sum(o.refusals for o in everything)
    burst_refused = sum(o.result == "refused" for o in burst_outcomes)
    slopes, growth = memory_trend(sampler.samples, config.warmup)
    return SoakReport(
        config=asdict(config), seconds=seconds, outcomes={k: dict(v) for k, v in sorted(table.items())},
        failures=dict(failures), admitted=len(everything) - burst_refused, refused=retried + burst_refused,
        burst_admitted=len(burst_outcomes) - burst_refused, burst_refused=burst_refused,
        memory_slope_mb_per_1000=slopes, memory_growth_mb=growth, leftovers=leftovers, server_ready=server_ready,
        samples=[asdict(s) for s in sampler.samples])


def format_report(report: SoakReport) -> str:
    lines = [f"soak: {sum(sum(v.values()) for v in report.outcomes.values())} requests in {report.seconds:.0f} s, "
             f"{report.unexpected} unexpected failure(s)"]
    for kind, results in report.outcomes.items():
        lines.append(f"  {kind:<24} " + ", ".join(f"{result} {count}" for result, count in sorted(results.items())))
    lines.append(f"  admitted {report.admitted}, refused {report.refused} (bursts: {report.burst_admitted} "
                 f"admitted, {report.burst_refused} refused)")
    for name in ("total", "stubs", "tritonserver", "gpu"):
        if name in report.memory_slope_mb_per_1000:
            slope = report.memory_slope_mb_per_1000[name]
            lines.append(f"  memory {name:<12} slope {'n/a' if slope is None else f'{slope:+.1f}'} MB per 1000 "
                         f"requests, growth {report.memory_growth_mb[name]:+.1f} MB after the warm-up")
    processes = {k: v for k, v in report.memory_growth_mb.items() if k not in ("total", "stubs", "tritonserver", "gpu")}
    if processes:
        grown = sorted(processes.items(), key=lambda item: -item[1])[:3]
        lines.append("  grew most: " + ", ".join(f"{name} {mb:+.1f} MB" for name, mb in grown))
    if not report.memory_slope_mb_per_1000:
        lines.append("  memory: not sampled (no local tritonserver pid)")
    for failure, count in sorted(report.failures.items(), key=lambda item: -item[1]):
        lines.append(f"  UNEXPECTED x{count}: {failure}")
    if any(report.leftovers.values()):
        lines.append(f"  UNEXPECTED: left after the run: {report.leftovers}")
    if not report.server_ready:
        lines.append("  UNEXPECTED: the server is not ready after the run")
    return "\n".join(lines)


def write_report(report: SoakReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_dict(), indent=1))
