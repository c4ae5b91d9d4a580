"""A voice uploaded through the API and spoken at once (``scripts/bench_voice_upload.py``).

Each round: a request with the registered voice (the reference), ``POST /v1/audio/voices`` with a
``seconds``-long WAV never seen before (timed to its response), the first request with that voice
sent as soon as the upload returns, a second one, then the voice is deleted. Requests are streamed
``pcm`` (:func:`~.api_load.speech_request`); a request's figure is its first audio. Rounds run one
after another on an idle server.
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


def _first_audio_ms(target: SpeechTarget, text: str, item: str) -> float | None:
    result = speech_request(target, text, item)
    if result.error or not result.chunk_arrivals_s:
        raise RuntimeError(f"{item}: {result.error or 'no audio'}")
    return 1e3 * result.chunk_arrivals_s[0]


def run(target: SpeechTarget, text: str, rounds: int, seconds: float, transcript: str | None = UPLOAD_TRANSCRIPT,
        seed: int = 1000) -> dict:
    rows = []
    for k in range(rounds):
        registered = _first_audio_ms(target, text, f"registered-{k}")
        upload_ms, voice = upload(target, f"bench {k}", wav_bytes(seconds, seed + k), transcript)
        uploaded = SpeechTarget(target.url, voice["id"], target.api_key, target.model, target.timeout_s)
        try:
            first = _first_audio_ms(uploaded, text, f"first-{k}")
            second = _first_audio_ms(uploaded, text, f"second-{k}")
        finally:
            _call(target, "DELETE", f"/v1/audio/voices/{voice['id']}")
        rows.append({"registered_ms": registered, "upload_ms": upload_ms, "first_ms": first, "second_ms": second})
        print(" | ".join(f"{key} {value:.1f}" for key, value in rows[-1].items()), flush=True)
    summary = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    summary["upload_max_ms"] = max(row["upload_ms"] for row in rows)
    summary["first_over_registered"] = summary["first_ms"] / summary["registered_ms"]
    return {"rounds": rounds, "seconds": seconds, "model": target.model, "rows": rows, "median": summary}


def table(report: dict) -> str:
    m = report["median"]
    return "\n".join([
        f"Voices uploaded ({report['seconds']:g} s WAV) and spoken at once, {report['rounds']} rounds, "
        f"model {report['model']}: medians (ms)",
        "| upload | upload max | first request, new voice | second request | registered voice | first / registered |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {m['upload_ms']:.1f} | {m['upload_max_ms']:.1f} | {m['first_ms']:.1f} | {m['second_ms']:.1f} | "
        f"{m['registered_ms']:.1f} | {m['first_over_registered']:.2f} |"])
