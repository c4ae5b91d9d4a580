"""A voice uploaded through the API and spoken at once (``scripts/bench_voice_upload.py``).

Each round: a request with the registered voice (the reference), ``POST /v1/audio/voices`` with a
``seconds``-long WAV never seen before (timed to its response), the first request with that voice
sent as soon as the upload returns, a second one, then the voice is deleted. Requests are streamed
``pcm`` (:func:`~.api_load.speech_request`); a request's figure is its first audio. Rounds run one
after another on an idle server. With a Triton metrics port, each request's first chunk is also
split into the server's stages (its trace's counters read before and after it: one request at a time).
"""

from __future__ import annotations

import http.client
import io
import json
import statistics
import time
import urllib.parse
import uuid

import numpy as np
import soundfile as sf

from ..bundle import synthetic_prompt_wave
from .api_load import SpeechTarget, speech_request
from .prometheus import first_chunk_stage_ms, scrape_metrics

UPLOAD_TRANSCRIPT = "希望你以后能够做的比我还好呦。"


def wav_bytes(seconds: float, seed: int, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, synthetic_prompt_wave(seconds, seed=seed).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _call(target: SpeechTarget, method: str, path: str, body: bytes = b"", content_type: str | None = None) -> tuple[int, dict]:
    parsed = urllib.parse.urlsplit(target.url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=target.timeout_s)
    headers = {"Content-Type": content_type} if content_type else {}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    try:
        connection.request(method, f"{parsed.path.rstrip('/')}{path}", body, headers)
        response = connection.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if payload else {}
    finally:
        connection.close()


def upload(target: SpeechTarget, name: str, wav: bytes, transcript: str | None) -> tuple[float, dict]:
    """``POST /v1/audio/voices`` (multipart): milliseconds to the response, and the voice object."""
    boundary = uuid.uuid4().hex
    fields = [("name", name)] + ([("transcript", transcript)] if transcript else [])
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
             for key, value in fields]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="audio_sample"; filename="voice.wav"\r\n'
                 f"Content-Type: audio/wav\r\n\r\n".encode() + wav + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    start = time.perf_counter()
    status, voice = _call(target, "POST", "/v1/audio/voices", body, f"multipart/form-data; boundary={boundary}")
    elapsed = 1e3 * (time.perf_counter() - start)
    if status != 200:
        raise RuntimeError(f"upload failed: {status} {voice}")
    return elapsed, voice


REQUESTS = ("registered", "first", "second")


def _first_audio(target: SpeechTarget, text: str, item: str,
                 metrics_at: tuple[int, str] | None) -> tuple[float, dict[str, float]]:
    """The request's first audio (ms) and, with ``metrics_at`` (port, host), its first chunk's stages (ms)."""
    before = scrape_metrics(*metrics_at) if metrics_at else {}
    result = speech_request(target, text, item)
    if result.error or not result.chunk_arrivals_s:
        raise RuntimeError(f"{item}: {result.error or 'no audio'}")
    stages = first_chunk_stage_ms(before, scrape_metrics(*metrics_at)) if metrics_at else {}
    return 1e3 * result.chunk_arrivals_s[0], stages


def run(target: SpeechTarget, text: str, rounds: int, seconds: float, transcript: str | None = UPLOAD_TRANSCRIPT,
        seed: int = 1000, metrics_at: tuple[int, str] | None = None) -> dict:
    rows, stages = [], []
    for k in range(rounds):
        registered, registered_stages = _first_audio(target, text, f"registered-{k}", metrics_at)
        upload_ms, voice = upload(target, f"bench {k}", wav_bytes(seconds, seed + k), transcript)
        uploaded = SpeechTarget(target.url, voice["id"], target.api_key, target.model, target.timeout_s)
        try:
            first, first_stages = _first_audio(uploaded, text, f"first-{k}", metrics_at)
            second, second_stages = _first_audio(uploaded, text, f"second-{k}", metrics_at)
        finally:
            _call(target, "DELETE", f"/v1/audio/voices/{voice['id']}")
        rows.append({"registered_ms": registered, "upload_ms": upload_ms, "first_ms": first, "second_ms": second})
        stages.append(dict(zip(REQUESTS, (registered_stages, first_stages, second_stages))))
        print(" | ".join(f"{key} {value:.1f}" for key, value in rows[-1].items()), flush=True)
    summary = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    summary["upload_max_ms"] = max(row["upload_ms"] for row in rows)
    summary["first_over_registered"] = summary["first_ms"] / summary["registered_ms"]
    report = {"rounds": rounds, "seconds": seconds, "model": target.model, "rows": rows, "median": summary}
    if metrics_at:
        report["stages"] = stages
        report["median_stage_ms"] = {request: _median_stages([row[request] for row in stages]) for request in REQUESTS}
    return report


def _median_stages(traced: list[dict[str, float]]) -> dict[str, float]:
    """Per stage, the median over the requests whose first chunk was traced."""
    traced = [stages for stages in traced if stages]
    return {stage: statistics.median(stages[stage] for stages in traced if stage in stages)
            for stage in dict.fromkeys(stage for stages in traced for stage in stages)}


def table(report: dict) -> str:
    m = report["median"]
    return "\n".join([
        f"Voices uploaded ({report['seconds']:g} s WAV) and spoken at once, {report['rounds']} rounds, "
        f"model {report['model']}: medians (ms)",
        "| upload | upload max | first request, new voice | second request | registered voice | first / registered |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {m['upload_ms']:.1f} | {m['upload_max_ms']:.1f} | {m['first_ms']:.1f} | {m['second_ms']:.1f} | "
        f"{m['registered_ms']:.1f} | {m['first_over_registered']:.2f} |", *_stage_table(report)])


def _stage_table(report: dict) -> list[str]:
    """The medians of each request's first-chunk stages (the server's trace), when they were read."""
    medians = report.get("median_stage_ms")
    stages = list(dict.fromkeys(stage for request in REQUESTS for stage in (medians or {}).get(request, {})))
    if not stages:
        return [] if medians is None else ["", "first-chunk stages: none traced"]
    lines = ["", "First chunk, the server's stages (medians, ms):", "| request | " + " | ".join(stages) + " |",
             "|---|" + "---:|" * len(stages)]
    for request in REQUESTS:
        values = medians[request]
        lines.append(f"| {request} | " + " | ".join(f"{values[stage]:.1f}" if stage in values else "-"
                                                     for stage in stages) + " |")
    return lines
