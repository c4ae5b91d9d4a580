"""Open-loop load on the OpenAI-compatible speech API (``POST /v1/audio/speech``, 24 kHz PCM
streamed), so that what is measured is what a client of the whole stack gets: the API, its router
over one or several Triton servers (docs/api.md) and the servers behind it.

Every received block of the response body counts as a chunk arriving then (its duration from its
bytes), so first-chunk latency is the time to the first audio bytes and underruns are playback
stalls at that granularity, as in :func:`cosyserve.clients.playback_underruns`. A request that gets
an HTTP error is a failure, recorded with its status (429 refusals apart, so a run past capacity
shows how fast and how often the stack said "busy").
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Sequence

from ..clients import RequestResult, latency_stats, summarize
from ..schedule import OUTPUT_SAMPLE_RATE
from .openloop import poisson_arrivals, run_open_loop

BYTES_PER_SAMPLE = 2  # response_format pcm: s16le mono


@dataclass(frozen=True)
class SpeechTarget:
    """Where and what to ask: the API's base URL (http://host:port), the voice, the optional key."""

    url: str
    voice: str = "001"
    api_key: str | None = None
    model: str = "cosyvoice2"
    timeout_s: float = 600.0


def speech_request(target: SpeechTarget, text: str, item_id: str) -> RequestResult:
    """One streamed ``pcm`` speech request; never raises for a failed request (``error`` says why:
    ``"<status> <code>: <message>"`` from the API's error envelope, or the connection error)."""
    parsed = urllib.parse.urlsplit(target.url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=target.timeout_s)
    body = json.dumps({"model": target.model, "input": text, "voice": target.voice, "response_format": "pcm"})
    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    result = RequestResult(item_id)
    samples = 0
    start = time.perf_counter()
    try:
        connection.request("POST", f"{parsed.path.rstrip('/')}/v1/audio/speech", body, headers)
        response = connection.getresponse()
        if response.status != 200:
            result.error = _error_text(response.status, response.read())
            result.latency_s = time.perf_counter() - start  # how long the refusal took
            return result
        carry = b""  # an odd byte split between blocks belongs to the next sample
        while block := response.read1(65536):
            arrived = time.perf_counter() - start
            data = carry + block
            whole = len(data) - len(data) % BYTES_PER_SAMPLE
            carry = data[whole:]
            if whole:
                samples += whole // BYTES_PER_SAMPLE
                result.chunk_arrivals_s.append(arrived)
                result.chunk_durations_s.append(whole / BYTES_PER_SAMPLE / OUTPUT_SAMPLE_RATE)
        result.latency_s = time.perf_counter() - start
        result.audio_s = samples / OUTPUT_SAMPLE_RATE
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, or the body broke off mid-stream
        result.error = f"connection: {type(exc).__name__}: {exc}"
    finally:
        connection.close()
    return result


def _error_text(status: int, payload: bytes) -> str:
    try:
        error = json.loads(payload)["error"]
        return f"{status} {error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {payload[:200].decode(errors='replace')}"


def run_rate(target: SpeechTarget, texts: Sequence[str], rate: float, requests: int, seed: int,
             fault: Callable[[], None] | None = None, fault_at_s: float = 0.0) -> dict:
    """``requests`` requests arriving at ``rate`` a second (seeded Poisson), texts in turn: the
    summary of :func:`cosyserve.clients.summarize` (streaming) plus the open loop's numbers and
    refusals (429). ``fault`` (e.g. killing one server behind the API) is called ``fault_at_s``
    seconds into the run; the summary then splits the failures by :func:`fault_split`."""
    arrivals = poisson_arrivals(rate, seed, count=requests)
    timer = threading.Timer(fault_at_s, fault) if fault else None
    if timer:
        timer.start()
    try:
        run = run_open_loop(arrivals, lambda i: speech_request(target, texts[i % len(texts)], f"r{rate:g}-{i}"))
    finally:
        if timer:
            timer.cancel()
    summary = summarize(run.results, run.wall_s, "streaming")
    refused = [r for r in run.results if r.error and r.error.startswith("429 ")]
    summary["refused"] = len(refused)
    if refused:
        summary["refusal_latency"] = latency_stats(r.latency_s for r in refused)
    summary["errors"] = sorted({r.error.split(":")[0] for r in run.results if r.error})
    summary["open_loop"] = run.summary(arrivals, rate)
    if fault:
        summary["fault"] = fault_split(run.results, arrivals, fault_at_s)
    return summary


def fault_split(results: Sequence[RequestResult], arrivals_s: Sequence[float], fault_at_s: float) -> dict:
    """Failures of a run with a fault at ``fault_at_s``: of the requests that arrived before it
    (some were in flight on the failed server: they may end with an error, which must be a clear
    one) and of those that arrived after it (the router must serve every one of them)."""
    before = [r for r, t in zip(results, arrivals_s) if t < fault_at_s]
    after = [r for r, t in zip(results, arrivals_s) if t >= fault_at_s]
    return {"at_s": fault_at_s, "arrived_before": len(before), "arrived_after": len(after),
            "failed_before": sum(r.error is not None for r in before),
            "failed_after": sum(r.error is not None for r in after),
            "errors_before": sorted({r.error for r in before if r.error}),
            "errors_after": sorted({r.error for r in after if r.error})}


HEADER = ("| rate req/s | requests | failed | of them refused (429) | refusal p95 ms | first audio p50 ms | p95 ms | "
          "requests with underruns | stall s | peak in flight |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(summary: dict) -> str:
    first = summary.get("first_chunk_latency", {})
    under = summary.get("underruns", {})

    def ms(key: str) -> str:
        return f"{first[key]:.1f}" if key in first else "n/a"
    refusal = f"{summary['refusal_latency']['p95_ms']:.1f}" if "refusal_latency" in summary else "-"
    return (f"| {summary['open_loop']['arrival_rate']:g} | {summary['requests']} | {summary['failed']} | "
            f"{summary['refused']} | {refusal} | {ms('p50_ms')} | {ms('p95_ms')} | {under.get('requests_with_underrun', 'n/a')} | "
            f"{under.get('stall_s', 0.0):.2f} | {summary['open_loop']['peak_in_flight']} |")


def best_clean_rate(summaries: Sequence[dict]) -> float | None:
    """The highest rate whose requests all succeeded without a playback stall, or None."""
    clean = [s["open_loop"]["arrival_rate"] for s in summaries
             if s["failed"] == 0 and s.get("underruns", {}).get("requests_with_underrun") == 0]
    return max(clean) if clean else None

