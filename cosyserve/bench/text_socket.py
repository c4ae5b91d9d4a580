"""Text fed into the text-in WebSocket as an LLM writes it (``scripts/bench_text_socket.py``): N
sockets at once, each sending a text word by word at ``chars_per_s``, then ending it.

Per socket: **first audio after the first piece** (from the moment the last character of the text's
first piece (:class:`~cosyserve.api.text_stream.TextSplitter`'s first cut) was sent, to the first
audio message), **gaps** (playback underruns of a listener that starts with the first audio and
plays pieces back to back, :class:`~cosyserve.clients.Playback`: a gap between pieces is one), and
the **total time** from the first message to ``isFinal``. The audio is asked as ``pcm_24000``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlencode

from ..api.text_stream import TextSplitter
from ..clients import Playback
from ..schedule import OUTPUT_SAMPLE_RATE

DEFAULT_TEXT = ("Thanks for calling, this is the support line. Your order shipped yesterday and should arrive "
                "on Friday. Is there anything else I can help you with today?")


@dataclass
class SocketResult:
    first_audio_ms: float | None  # after the first piece's last character was sent
    underruns: int
    stall_s: float
    total_s: float
    audio_s: float
    error: str | None = None


def first_piece_words(text: str) -> int:
    """How many of ``text``'s words (sent one by one with a trailing space) complete its first piece."""
    splitter = TextSplitter()
    words = text.split(" ")
    for count, word in enumerate(words, 1):
        if splitter.feed(word + " "):
            return count
    return len(words)


async def one_socket(url: str, text: str, chars_per_s: float, api_key: str | None) -> SocketResult:
    import websockets

    headers = {"xi-api-key": api_key} if api_key else {}
    words = text.split(" ")
    first_piece = first_piece_words(text)
    playback, audio_s = Playback(), 0.0
    began = time.monotonic()
    piece_sent_at: float | None = None
    first_audio_at: float | None = None
    try:
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            async def send() -> None:
                nonlocal piece_sent_at
                await ws.send(json.dumps({"text": " "}))
                for count, word in enumerate(words, 1):
                    await asyncio.sleep(len(word + " ") / chars_per_s)
                    await ws.send(json.dumps({"text": word + " "}))
                    if count == first_piece:
                        piece_sent_at = time.monotonic()
                await ws.send(json.dumps({"text": ""}))

            sender = asyncio.create_task(send())
            async for raw in ws:
                message = json.loads(raw)
                if "error" in message:
                    raise RuntimeError(message.get("message"))
                if message.get("audio"):
                    now = time.monotonic()
                    first_audio_at = first_audio_at or now
                    seconds = len(base64.b64decode(message["audio"])) / 2 / OUTPUT_SAMPLE_RATE
                    playback.arrive(now, seconds)
                    audio_s += seconds
                if message.get("isFinal"):
                    break
            await sender
    except Exception as exc:
        return SocketResult(None, playback.underruns, playback.stall_s, time.monotonic() - began, audio_s,
                            f"{type(exc).__name__}: {exc}")
    first = None if first_audio_at is None or piece_sent_at is None else 1e3 * (first_audio_at - piece_sent_at)
    return SocketResult(first, playback.underruns, playback.stall_s, time.monotonic() - began, audio_s)


def socket_url(base: str, voice: str, model: str) -> str:
    """The single-context socket's URL on an API at ``base`` (http://host:port)."""
    return (base.replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
            + f"/v1/text-to-speech/{voice}/stream-input?" + urlencode({"model_id": model, "output_format": "pcm_24000"}))


async def run_level(url: str, sockets: int, text: str, chars_per_s: float, api_key: str | None) -> list[SocketResult]:
    return list(await asyncio.gather(*(one_socket(url, text, chars_per_s, api_key) for _ in range(sockets))))


def summary(sockets: int, results: list[SocketResult]) -> dict:
    firsts = sorted(r.first_audio_ms for r in results if r.first_audio_ms is not None)

    def quantile(q: float) -> float | None:
        return firsts[min(len(firsts) - 1, int(q * len(firsts)))] if firsts else None
    return {"sockets": sockets, "failed": sum(r.error is not None for r in results),
            "first_audio_p50_ms": quantile(0.5), "first_audio_p95_ms": quantile(0.95),
            "sockets_with_gaps": sum(r.underruns > 0 for r in results), "stall_s": sum(r.stall_s for r in results),
            "total_s_mean": statistics.fmean(r.total_s for r in results) if results else None,
            "audio_s_mean": statistics.fmean(r.audio_s for r in results) if results else None,
            "errors": sorted({r.error for r in results if r.error})[:3],
            "results": [asdict(r) for r in results]}


HEADER = ("| sockets | failed | first audio after the first piece p50 ms | p95 ms | sockets with gaps | stall s "
          "| total s (mean) | audio s (mean) |\n|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(s: dict) -> str:
    def cell(value, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return (f"| {s['sockets']} | {s['failed']} | {cell(s['first_audio_p50_ms'])} | {cell(s['first_audio_p95_ms'])} "
            f"| {s['sockets_with_gaps']} | {cell(s['stall_s'], 2)} | {cell(s['total_s_mean'], 2)} "
            f"| {cell(s['audio_s_mean'], 2)} |")
