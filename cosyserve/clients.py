"""Client-side logic shared by ``client_http.py``, ``client_grpc.py`` and the end-to-end tests.

Wire protocol of the ``cosyvoice2`` Triton model (same as NVIDIA's CosyVoice runtime):

* ``reference_wav`` FP32 [1, N]: prompt audio, mono, 16 kHz
* ``reference_wav_len`` INT32 [1, 1]: N
* ``reference_text`` BYTES [1, 1]: transcript of the prompt (UTF-8)
* ``target_text`` BYTES [1, 1]: text to synthesise (UTF-8)
* ``speaker_id`` BYTES [1, 1], optional: cached speaker to use / cache the prompt under
* ``max_tokens`` / ``min_tokens`` INT32 [1, 1], optional (this server's addition): speech-token
  limits of this request
* output ``waveform`` FP32 [1, M]: 24 kHz audio, in one response, or in one response per
  chunk when the model is decoupled (streaming)

Besides building requests, this module runs one request (offline or streaming, with the
synchronous tritonclient so that chunk arrival times are taken in the gRPC callback) and turns
per-request timings into the benchmark numbers (the items come from :mod:`cosyserve.data`):
latency percentiles, real-time factor, playback underruns and Triton's per-model statistics for
the run.
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .errors import InvalidInputError
from .schedule import OUTPUT_SAMPLE_RATE

PERCENTILES = (50, 90, 95, 99)


# --- requests ----------------------------------------------------------------------------


def _bytes_tensor(text: str) -> np.ndarray:
    return np.array([[text.encode("utf-8")]], dtype=object)


def build_inputs(
    protocol: Any,
    waveform: np.ndarray | None,
    reference_text: str,
    target_text: str,
    speaker_id: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    instruction: str | None = None,
    prepare_voice: bool = False,
) -> list:
    """The request's input tensors for ``protocol`` (``tritonclient.http`` or ``tritonclient.grpc``).

    ``waveform=None`` sends no reference (the server must know ``speaker_id`` already, or use
    its cached default speaker). ``max_tokens``/``min_tokens`` override the server's speech-token
    limits for this request (both equal: exactly that many tokens). ``instruction`` asks for
    instruct mode (the front door's optional ``instruction`` input). ``prepare_voice``: the request
    only has the server compute and keep the voice's state (no audio; ``target_text`` is not read).
    """
    if not target_text:
        raise InvalidInputError("target text is empty")
    tensors: list[tuple[str, np.ndarray, str]] = []
    if waveform is not None:
        waveform = np.asarray(waveform)
        if waveform.ndim != 1 or waveform.size == 0:
            raise InvalidInputError(f"reference waveform must be a non-empty 1-D array, got shape {waveform.shape}")
        tensors += [
            ("reference_wav", waveform.astype(np.float32).reshape(1, -1), "FP32"),
            ("reference_wav_len", np.array([[waveform.size]], dtype=np.int32), "INT32"),
            ("reference_text", _bytes_tensor(reference_text), "BYTES"),
        ]
    tensors.append(("target_text", _bytes_tensor(target_text), "BYTES"))
    if speaker_id is not None:
        tensors.append(("speaker_id", _bytes_tensor(speaker_id), "BYTES"))
    if instruction is not None:
        tensors.append(("instruction", _bytes_tensor(instruction), "BYTES"))
    if prepare_voice:
        tensors.append(("prepare_voice", np.array([[True]]), "BOOL"))
    for name, value, least in (("max_tokens", max_tokens, 1), ("min_tokens", min_tokens, 0)):
        if value is not None:
            if value < least:
                raise InvalidInputError(f"{name} must be >= {least}, got {value}")
            tensors.append((name, np.array([[value]], dtype=np.int32), "INT32"))
    inputs = []
    for name, value, datatype in tensors:
        tensor = protocol.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def requested_outputs(protocol: Any) -> list:
    return [protocol.InferRequestedOutput("waveform")]


@dataclass
class RequestResult:
    """Timings of one request; ``chunk_arrivals_s`` are seconds since the request was sent."""

    id: str
    audio_s: float = 0.0
    latency_s: float | None = None
    chunk_arrivals_s: list[float] = field(default_factory=list)
    chunk_durations_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def first_chunk_latency_s(self) -> float | None:
        return self.chunk_arrivals_s[0] if self.chunk_arrivals_s else None

    @property
    def second_chunk_latency_s(self) -> float | None:
        """Time from the first to the second chunk (NVIDIA's client's definition)."""
        arrivals = self.chunk_arrivals_s
        return arrivals[1] - arrivals[0] if len(arrivals) > 1 else None

    def underruns(self) -> tuple[int, float]:
        return playback_underruns(self.chunk_arrivals_s, self.chunk_durations_s)

    def to_dict(self) -> dict:
        count, stall = self.underruns()
        return {**asdict(self), "first_chunk_latency_s": self.first_chunk_latency_s,
                "second_chunk_latency_s": self.second_chunk_latency_s, "underruns": count, "stall_s": stall}


def run_offline(client: Any, model_name: str, inputs: list, outputs: list, item_id: str,
                sample_rate: int = OUTPUT_SAMPLE_RATE, timeout_s: float | None = None) -> tuple[np.ndarray, RequestResult]:
    """One ``infer`` call with a synchronous tritonclient (HTTP or gRPC).

    The whole audio counts as one chunk arriving at the end. ``timeout_s`` is passed as
    ``client_timeout`` (gRPC clients; HTTP clients take ``network_timeout`` when created).
    """
    kwargs = {"client_timeout": timeout_s} if timeout_s else {}
    start = time.perf_counter()
    response = client.infer(model_name, inputs, outputs=outputs, request_id=_request_id(item_id), **kwargs)
    latency = time.perf_counter() - start
    audio = response.as_numpy("waveform").reshape(-1).astype(np.float32)
    duration = audio.size / sample_rate
    return audio, RequestResult(item_id, duration, latency, [latency], [duration])


def run_streaming(client: Any, model_name: str, inputs: list, outputs: list, item_id: str,
                  sample_rate: int = OUTPUT_SAMPLE_RATE, timeout_s: float | None = None) -> tuple[np.ndarray, RequestResult]:
    """One request on a decoupled model over a gRPC stream (``tritonclient.grpc`` client).

    Each response's arrival time is taken in the stream callback; empty responses (such as
    the final-flag one) carry no audio and are not chunks.
    """
    arrivals: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), result, error)))
    chunks, result = [], RequestResult(item_id)
    try:
        start = time.perf_counter()
        client.async_stream_infer(model_name, inputs, outputs=outputs, request_id=_request_id(item_id),
                                  enable_empty_final_response=True)
        while True:
            try:
                arrived, response, error = arrivals.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no response for {item_id} within {timeout_s} s") from None
            if error is not None:
                raise error
            chunk = response.as_numpy("waveform")
            if chunk is not None and chunk.size:
                chunks.append(chunk.reshape(-1).astype(np.float32))
                result.chunk_arrivals_s.append(arrived - start)
                result.chunk_durations_s.append(chunk.size / sample_rate)
            if response.get_response().parameters["triton_final_response"].bool_param:
                result.latency_s = arrived - start
                break
    finally:
        client.stop_stream()
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    result.audio_s = audio.size / sample_rate
    return audio, result


def _request_id(item_id: str) -> str:
    return f"{item_id}-{uuid.uuid4().hex[:8]}"


# --- benchmark numbers ---------------------------------------------------------------------


class Playback:
    """A listener's playback of one stream, chunk by chunk as they arrive.

    Playback starts when the first chunk with audio arrives and plays chunks back to back. A chunk
    that arrives after everything delivered before it has finished playing is an underrun;
    playback resumes when it arrives. ``underruns`` and ``stall_s`` count them so far.
    """

    def __init__(self) -> None:
        self.playback_end: float | None = None
        self.underruns = 0
        self.stall_s = 0.0

    def arrive(self, arrival_s: float, duration_s: float) -> float | None:
        """A chunk of ``duration_s`` seconds arrives at ``arrival_s``. Returns the audio that was
        still buffered ahead of playback then (negative: how long playback had stalled), or None for
        the first chunk and chunks without audio."""
        if duration_s <= 0:
            return None
        if self.playback_end is None:
            self.playback_end = arrival_s + duration_s
            return None
        buffered = self.playback_end - arrival_s
        if buffered < 0:
            self.underruns += 1
            self.stall_s -= buffered
            self.playback_end = arrival_s
        self.playback_end += duration_s
        return buffered


def playback_underruns(arrivals_s: Sequence[float], durations_s: Sequence[float]) -> tuple[int, float]:
    """Count playback stalls of a stream and their total length in seconds (:class:`Playback`);
    chunks without audio are ignored."""
    if len(arrivals_s) != len(durations_s):
        raise InvalidInputError(f"{len(arrivals_s)} arrival times for {len(durations_s)} chunk durations")
    playback = Playback()
    for arrival, duration in zip(arrivals_s, durations_s):
        playback.arrive(arrival, duration)
    return playback.underruns, playback.stall_s


def latency_stats(values_s: Iterable[float | None]) -> dict[str, float]:
    """count, avg/min/max and percentiles (numpy's linear interpolation) in milliseconds."""
    values = np.array([v for v in values_s if v is not None], dtype=np.float64) * 1000.0
    if values.size == 0:
        return {"count": 0}
    stats = {"count": int(values.size), "avg_ms": float(values.mean()),
             "min_ms": float(values.min()), "max_ms": float(values.max())}
    for q, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        stats[f"p{q}_ms"] = float(value)
    return stats


def summarize(results: Sequence[RequestResult], wall_s: float, mode: str) -> dict:
    """Benchmark summary of one run (JSON-serialisable)."""
    ok = [r for r in results if r.error is None]
    audio_s = sum(r.audio_s for r in ok)
    underruns = [r.underruns() for r in ok]
    summary = {
        "mode": mode,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall_s,
        "audio_s": audio_s,
        "rtf": wall_s / audio_s if audio_s > 0 else None,
        "latency": latency_stats(r.latency_s for r in ok),
    }
    if mode == "streaming":
        summary["first_chunk_latency"] = latency_stats(r.first_chunk_latency_s for r in ok)
        summary["second_chunk_latency"] = latency_stats(r.second_chunk_latency_s for r in ok)
        summary["underruns"] = {
            "total": sum(count for count, _ in underruns),
            "requests_with_underrun": sum(1 for count, _ in underruns if count),
            "stall_s": sum(stall for _, stall in underruns),
        }
    return summary


def format_summary(summary: Mapping) -> str:
    rtf = summary["rtf"]
    lines = [
        f"Mode: {summary['mode']}",
        f"requests: {summary['requests']} (failed: {summary['failed']})",
        f"RTF: {rtf:.4f}" if rtf is not None else "RTF: n/a (no audio)",
        f"total audio duration: {summary['audio_s']:.3f} s",
        f"processing time: {summary['wall_s']:.3f} s",
    ]
    sections = [("total request latency", "latency"), ("first chunk latency", "first_chunk_latency"),
                ("second chunk latency (after the first chunk)", "second_chunk_latency")]
    for title, key in sections:
        if key in summary:
            stats = summary[key]
            if stats["count"]:
                lines.append(f"{title}: avg {stats['avg_ms']:.2f} ms, "
                             + ", ".join(f"p{q} {stats[f'p{q}_ms']:.2f} ms" for q in PERCENTILES))
            else:
                lines.append(f"{title}: no data")
    if "underruns" in summary:
        u = summary["underruns"]
        lines.append(f"playback underruns: {u['total']} in {u['requests_with_underrun']} requests, "
                     f"{u['stall_s']:.3f} s of stalls")
    return "\n".join(lines) + "\n"


# --- Triton statistics --------------------------------------------------------------------

_COUNTERS = {"count", "ns", "inference_count", "execution_count"}


def stats_delta(before: Mapping, after: Mapping) -> dict:
    """``get_inference_statistics(as_json=True)`` after minus before: what this run did.

    Only counters (count, ns, inference/execution counts) are subtracted; models without
    inferences during the run are dropped.
    """
    earlier = {(m["name"], m.get("version", "")): m for m in before.get("model_stats", [])}
    models = []
    for model in after.get("model_stats", []):
        delta = _subtract(model, earlier.get((model["name"], model.get("version", "")), {}))
        if delta.get("inference_count", 0) or delta.get("execution_count", 0):
            models.append(delta)
    return {"model_stats": models}


def _subtract(after: Any, before: Any, key: str = "") -> Any:
    if isinstance(after, Mapping):
        before = before if isinstance(before, Mapping) else {}
        return {k: _subtract(v, before.get(k), k) for k, v in after.items()}
    if isinstance(after, list):  # batch_stats: match entries by batch size
        earlier = {b.get("batch_size"): b for b in before or [] if isinstance(b, Mapping)}
        return [_subtract(b, earlier.get(b.get("batch_size")) if isinstance(b, Mapping) else None) for b in after]
    if key in _COUNTERS:  # protobuf JSON writes 64-bit counters as strings
        return int(after) - int(before or 0)
    return after


def format_triton_stats(delta: Mapping) -> str:
    """Per-model queue/compute times and batch sizes of :func:`stats_delta`'s output."""
    lines = []
    for model in delta.get("model_stats", []):
        stats = model.get("inference_stats", {})
        lines.append(f"model {model['name']} (version {model.get('version', '')}): "
                     f"{model.get('inference_count', 0)} inferences in {model.get('execution_count', 0)} executions")
        for part in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
            entry = stats.get(part, {})
            count, ns = int(entry.get("count", 0)), int(entry.get("ns", 0))
            if count:
                lines.append(f"  {part:<15} count {count:<6} total {ns / 1e6:10.2f} ms  avg {ns / 1e6 / count:8.2f} ms")
        for batch in model.get("batch_stats", []):
            infer = batch.get("compute_infer", {})
            count = int(infer.get("count", 0))
            if count:
                lines.append(f"  batch size {batch['batch_size']:<3} executed {count:<6} times, "
                             f"avg compute {int(infer.get('ns', 0)) / 1e6 / count:.2f} ms")
    return "\n".join(lines) + "\n" if lines else "no inferences recorded by Triton during the run\n"
