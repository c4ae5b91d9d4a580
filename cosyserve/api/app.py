"""The OpenAI-compatible HTTP API (FastAPI) in front of Triton's streaming ``cosyvoice2`` model
(and optionally more streaming models, e.g. ``cosyvoice3``, each on servers of its own, chosen by
the request's ``model``: :func:`model_for`).

Endpoints (docs/api.md): ``POST /v1/audio/speech``, ``POST/GET /v1/audio/voices``,
``GET/DELETE /v1/audio/voices/{id}``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
the playground page at ``/``, and ElevenLabs' text-in WebSockets
``/v1/text-to-speech/{voice_id}/stream-input`` and ``.../multi-stream-input`` (:mod:`.text_stream`).

A speech request waits for its first audio chunk before answering, so that everything Triton
rejects (bad text, unknown voice, overload) is still an HTTP error with OpenAI's envelope;
from then on the encoded audio is sent as it is produced.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Literal, Sequence

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile, WebSocket
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from tritonclient.utils import InferenceServerException

from ..errors import InvalidInputError
from ..frontend.voice_store import VOICES_DIR, UnknownVoiceError, VoiceStore
from ..engine.front_end import MAX_SEGMENT_CHARS, MAX_TEXT_CHARS
from ..runtime import SPK2INFO
from ..schedule import OUTPUT_SAMPLE_RATE, SAMPLES_PER_TOKEN
from .encoding import MEDIA_TYPES, make_encoder, output_format_encoder
from .errors import RETRY_AFTER_S, APIError, install_handlers, triton_error
from .router import TritonRouter
from .text_stream import (CLOSE_INTERNAL, CLOSE_POLICY, CLOSE_TRY_LATER, DEFAULT_INACTIVITY_TIMEOUT_S,
                          MAX_INACTIVITY_TIMEOUT_S, ProtocolError, SpeechSocket, api_key, close_reason,
                          error_message)
from .triton import Synthesis
from .voices import VoiceCatalog, prompt_wav16

STATIC_DIR = Path(__file__).parent / "static"
MAX_UPLOAD_BYTES = 10 * 1024 * 1024
# How long an upload waits for the servers to prepare its voice (seconds); past it, the first request does.
PREPARE_VOICE_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # the form fields besides the audio file


@dataclass
class Settings:
    triton_url: str  # gRPC host:port, or several comma-separated (TritonRouter spreads streams over them)
    model_dir: Path  # the CosyVoice2 directory: spk2info.pt (built-in voices)
    tokenizer_dir: Path  # the LLM's tokenizer: input tokens of the usage report
    voices_dir: Path | None = None  # default <model_dir>/voices, where the Triton front door looks too
    model: str = "cosyvoice2"  # the streaming Triton model
    # more streaming models: name -> their Triton servers (as triton_url); no built-in voices
    extra_models: dict[str, str] = field(default_factory=dict)
    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: no authentication
    max_input_chars: int = MAX_TEXT_CHARS  # what one BLS request takes (split into segments there)
    max_upload_bytes: int = MAX_UPLOAD_BYTES


class VoiceRef(BaseModel):
    id: str


class SpeechRequest(BaseModel):
    """OpenAI's ``audio.speech.create`` body; unknown fields are ignored, not rejected."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str
    voice: str | VoiceRef
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    stream: bool | None = None  # accepted (other servers take it); every response streams
    language: str | None = None  # accepted; CosyVoice2 reads the language from the text


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("cosyserve_api_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        buckets = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
        self.first_audio = Histogram("cosyserve_api_time_to_first_audio_seconds",
                                     "Speech request received -> first audio bytes ready", ["response_format"],
                                     buckets=buckets, registry=self.registry)
        self.total = Histogram("cosyserve_api_speech_seconds", "Speech request received -> last audio bytes sent",
                               ["response_format"], buckets=buckets, registry=self.registry)
        self.bytes_out = Counter("cosyserve_api_audio_bytes", "Audio bytes sent (encoded, before base64)",
                                 ["response_format"], registry=self.registry)
        self.audio_seconds = Counter("cosyserve_api_audio_seconds", "Seconds of audio synthesised",
                                     registry=self.registry)


def _bearer_key(request: Request | WebSocket) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _socket_key(websocket: WebSocket) -> str | None:
    """A WebSocket's API key: ElevenLabs' ``xi-api-key`` header, a Bearer header, or the query's
    ``xi_api_key`` / ``authorization`` (browsers cannot set headers on a WebSocket)."""
    query = websocket.query_params
    return api_key(websocket.headers.get("xi-api-key") or _bearer_key(websocket) or query.get("xi_api_key")
                   or query.get("authorization"))


def _socket_error(exc: BaseException) -> tuple[str, str, int]:
    """A failed speech request of a socket: (message, code, the socket's close code)."""
    if isinstance(exc, InferenceServerException):
        error = triton_error(exc)
        close = CLOSE_TRY_LATER if error.status in (429, 503) else CLOSE_POLICY if error.status < 500 else CLOSE_INTERNAL
        return error.message, error.code or "error", close
    return f"internal error: {exc}", "internal_error", CLOSE_INTERNAL


class BodyLimit:
    """ASGI middleware: a request body larger than ``limit`` bytes gets 413 (by its Content-Length,
    or while a chunked body is read)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        too_large = APIError(413, f"request body is larger than {self.limit} bytes", code="body_too_large")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_large.response()(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise too_large
            return message

        await self.app(scope, counting_receive, send)


class CountRequests:
    """ASGI middleware: counts responses by route template and status (pure ASGI, so streamed
    bodies pass straight through)."""

    def __init__(self, app, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.counter.labels(getattr(route, "path", "unmatched"), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class RouterCollector:
    """The routers' view of each Triton server (per model), read at scrape time (prometheus_client collector)."""

    def __init__(self, routers: dict[str, TritonRouter]):
        self.routers = routers

    def collect(self):
        labels = ["server", "model"]
        streams = GaugeMetricFamily("cosyserve_api_triton_streams", "Open streams per Triton server", labels=labels)
        ready = GaugeMetricFamily("cosyserve_api_triton_ready", "1 if the Triton server's last check or stream "
                                  "succeeded, 0 if it was unreachable or not ready", labels=labels)
        served = CounterMetricFamily("cosyserve_api_triton_streams_served", "Streams that delivered audio, per server",
                                     labels=labels)
        moved = CounterMetricFamily("cosyserve_api_triton_failovers", "Requests a server refused (overloaded) or "
                                    "could not take (unavailable) that went to another server",
                                    labels=[*labels, "reason"])
        for model, router in self.routers.items():
            for server in router.status():
                key = [server["url"], model]
                streams.add_metric(key, server["streams"])
                if server["ready"] is not None:
                    ready.add_metric(key, float(server["ready"]))
                served.add_metric(key, server["served"])
                for reason, count in server["failovers"].items():
                    moved.add_metric([*key, reason], count)
        yield from (streams, ready, served, moved)


def model_for(requested: str, served: Sequence[str], default: str) -> str:
    """The Triton model a request's ``model`` selects: a served one by name; another CosyVoice
    model name is an error (404); anything else (OpenAI's ``tts-1``, ``gpt-4o-mini-tts``...)
    means the default model, as clients hard-code those names."""
    if requested in served:
        return requested
    if requested.lower().startswith("cosyvoice"):
        raise APIError(404, f"model {requested!r} is not served here; served: {', '.join(served)}",
                       param="model", code="model_not_found")
    return default


def create_app(settings: Settings) -> FastAPI:
    store = VoiceStore(settings.voices_dir or settings.model_dir / VOICES_DIR)
    spk2info = settings.model_dir / SPK2INFO
    catalog = VoiceCatalog(spk2info if spk2info.exists() else None, store)  # CosyVoice3 ships none
    catalogs = {settings.model: catalog, **{name: VoiceCatalog(None, store) for name in settings.extra_models}}
    served = list(catalogs)
    metrics = Metrics()
    state: dict = {}

    async def lifespan(app: FastAPI):
        from transformers import AutoTokenizer

        state["tokenizer"] = AutoTokenizer.from_pretrained(str(settings.tokenizer_dir))
        routers = state["routers"] = {settings.model: TritonRouter(settings.triton_url, settings.model), **{
            name: TritonRouter(urls, name) for name, urls in settings.extra_models.items()}}
        metrics.registry.register(RouterCollector(routers))
        yield
        for router in routers.values():
            await router.close()

    app = FastAPI(title="cosyserve speech API", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    install_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES)
    app.add_middleware(CountRequests, counter=metrics.requests)  # outermost: counts the 413s too

    def authenticated(request: Request) -> None:
        if not settings.api_keys:
            return
        key = _bearer_key(request)
        if key is None:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="missing_api_key")
        if not any(secrets.compare_digest(key, allowed) for allowed in settings.api_keys):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    v1 = [Depends(authenticated)]

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "playground.html", media_type="text/html")

    @app.get("/health")
    async def health() -> JSONResponse:
        """Ready while the default model is (an extra model's servers being down must not take the
        API out of a load balancer); every model's servers are listed."""
        routers: dict[str, TritonRouter] = state["routers"]
        if await routers[settings.model].ready():
            others = {name: {"ready": await router.ready(), "servers": router.status()}
                      for name, router in routers.items() if name != settings.model}
            return JSONResponse({"status": "ok", "model": settings.model, "servers": routers[settings.model].status(),
                                 **({"models": others} if others else {})})
        raise APIError(503, f"Triton model {settings.model!r} at {settings.triton_url} is not ready",
                       code="triton_unavailable", retry_after_s=RETRY_AFTER_S)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "cosyserve"}
                                           for name in served]}

    @app.post("/v1/audio/speech", dependencies=v1)
    async def speech(body: SpeechRequest) -> StreamingResponse:
        started = time.monotonic()
        model = model_for(body.model, served, settings.model)
        synthesis = _synthesis(body, catalogs[model], settings.max_input_chars)
        chunks = state["routers"][model].stream(synthesis)
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            raise APIError(500, "Triton returned no audio for this request", code="triton_error") from None
        except InferenceServerException as exc:
            raise triton_error(exc) from None
        fmt = body.response_format
        metrics.first_audio.labels(fmt).observe(time.monotonic() - started)
        encoded = _encoded(first, chunks, make_encoder(fmt), metrics, fmt, started)
        headers = {"X-Model": body.model}
        if body.stream_format == "sse":
            input_tokens = len(state["tokenizer"].encode(body.input, add_special_tokens=False))
            return StreamingResponse(_sse_events(encoded, input_tokens), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return StreamingResponse(_bytes_only(encoded), media_type=MEDIA_TYPES[fmt], headers=headers)

    async def speech_socket(websocket: WebSocket, voice_id: str, multi: bool) -> None:
        """ElevenLabs' text-in WebSocket (:mod:`.text_stream`): the connection's checks, then the
        session. A bad connection is accepted, told why in an error message and closed."""
        await websocket.accept()
        query = websocket.query_params
        try:
            model = model_for(query.get("model_id") or settings.model, served, settings.model)
            speaker_id = catalogs[model].speaker_id(voice_id)
            output_format = query.get("output_format") or "mp3_44100_128"
            output_format_encoder(output_format)
            try:
                timeout = float(query.get("inactivity_timeout") or DEFAULT_INACTIVITY_TIMEOUT_S)
            except ValueError:
                timeout = -1.0
            if not 0 < timeout <= MAX_INACTIVITY_TIMEOUT_S:
                raise InvalidInputError(f"inactivity_timeout must be a number of seconds in (0, {MAX_INACTIVITY_TIMEOUT_S}]")
            key = _socket_key(websocket)
            if settings.api_keys and key is not None:
                check_key(key)
        except (APIError, UnknownVoiceError, InvalidInputError, ProtocolError) as exc:
            message = exc.message if isinstance(exc, APIError) else str(exc)
            await websocket.send_text(error_message(message, "invalid_request"))
            await websocket.close(CLOSE_POLICY, close_reason(message))
            return
        session = SpeechSocket(websocket, speaker_id, timeout, multi=multi,
                               stream=state["routers"][model].stream,
                               encoder=lambda: output_format_encoder(output_format),
                               check_key=check_key if settings.api_keys and key is None else None,
                               error_of=_socket_error)
        await session.run()

    def check_key(key: str | None) -> None:
        if key is None:
            raise ProtocolError("missing API key: send the header 'xi-api-key' (or 'Authorization: Bearer <key>'), "
                                "the query parameter xi_api_key, or xi_api_key in the first message")
        if not any(secrets.compare_digest(key, allowed) for allowed in settings.api_keys):
            raise ProtocolError("invalid API key")

    @app.websocket("/v1/text-to-speech/{voice_id}/stream-input")
    async def stream_input(websocket: WebSocket, voice_id: str) -> None:
        await speech_socket(websocket, voice_id, multi=False)

    @app.websocket("/v1/text-to-speech/{voice_id}/multi-stream-input")
    async def multi_stream_input(websocket: WebSocket, voice_id: str) -> None:
        await speech_socket(websocket, voice_id, multi=True)

    @app.post("/v1/audio/voices", dependencies=v1)
    async def create_voice(name: str = Form(...), audio_sample: UploadFile = File(...),
                           transcript: str | None = Form(None)) -> dict:
        data = await audio_sample.read(settings.max_upload_bytes + 1)
        if len(data) > settings.max_upload_bytes:
            raise APIError(413, f"audio_sample is larger than {settings.max_upload_bytes} bytes", param="audio_sample",
                           code="upload_too_large")
        if transcript is not None and len(transcript) > MAX_SEGMENT_CHARS:
            # it goes into every LLM prompt of the voice, as one segment
            raise APIError(400, f"transcript has {len(transcript)} characters; at most {MAX_SEGMENT_CHARS}",
                           param="transcript")
        try:
            wav16 = await run_in_threadpool(prompt_wav16, data)
        except InvalidInputError as exc:
            raise APIError(400, str(exc), param="audio_sample", code="invalid_audio") from None
        try:
            voice = await run_in_threadpool(store.create, name, wav16, transcript)
        except InvalidInputError as exc:
            raise APIError(400, str(exc), param="name") from None
        await prepare_voice(voice.id)
        return catalog.get(voice.id)

    async def prepare_voice(voice_id: str) -> None:
        """Each served model's server computes the new voice's features and engine state now, so its
        first request is as fast as a registered voice's; one that cannot (down, slow) does it on that
        first request instead: the upload stands either way."""
        routers = state["routers"].values()
        outcomes = await asyncio.gather(*(asyncio.wait_for(router.prepare_voice(voice_id), PREPARE_VOICE_TIMEOUT_S)
                                          for router in routers), return_exceptions=True)
        for router, outcome in zip(routers, outcomes):
            if isinstance(outcome, BaseException):
                log.warning("voice %s: %s could not prepare it now (%s: %s); its first request will",
                            voice_id, router.model, type(outcome).__name__, outcome)

    @app.get("/v1/audio/voices", dependencies=v1)
    async def list_voices() -> dict:
        return {"object": "list", "data": await run_in_threadpool(catalog.list)}

    @app.get("/v1/audio/voices/{voice_id}", dependencies=v1)
    async def get_voice(voice_id: str) -> dict:
        try:
            return catalog.get(voice_id)
        except UnknownVoiceError as exc:
            raise APIError(404, str(exc), param="voice_id", code="voice_not_found") from None

    @app.delete("/v1/audio/voices/{voice_id}", dependencies=v1)
    async def delete_voice(voice_id: str) -> dict:
        try:
            catalog.delete(voice_id)
        except UnknownVoiceError as exc:
            raise APIError(404, str(exc), param="voice_id", code="voice_not_found") from None
        except InvalidInputError as exc:
            raise APIError(400, str(exc), param="voice_id") from None
        return {"object": "audio.voice.deleted", "id": voice_id, "deleted": True}

    return app


def _synthesis(body: SpeechRequest, catalog: VoiceCatalog, max_chars: int) -> Synthesis:
    """The request's checks that need no Triton round trip."""
    if not body.input.strip():
        raise APIError(400, "input is empty; send the text to synthesise", param="input", code="empty_input")
    if len(body.input) > max_chars:
        raise APIError(400, f"input has {len(body.input)} characters; at most {max_chars} are accepted per request",
                       param="input", code="input_too_long")
    if body.speed != 1.0:
        raise APIError(400, f"speed {body.speed:g} cannot be honoured: audio is streamed as it is generated and "
                            "CosyVoice2 changes the speed only of a whole utterance; send speed 1.0",
                       param="speed", code="unsupported_speed")
    if body.instructions is not None and not body.instructions.strip():
        raise APIError(400, "instructions is empty; leave it out or describe the speaking style",
                       param="instructions")
    if body.instructions is not None and len(body.instructions) > max_chars:
        raise APIError(400, f"instructions has {len(body.instructions)} characters; at most {max_chars}",
                       param="instructions")
    voice = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    try:
        speaker_id = catalog.speaker_id(voice)
    except UnknownVoiceError as exc:
        raise APIError(404, str(exc), param="voice", code="voice_not_found") from None
    return Synthesis(body.input, speaker_id, body.instructions)


async def _encoded(first, chunks: AsyncIterator, encoder, metrics: Metrics, fmt: str,
                   started: float) -> AsyncIterator[tuple[bytes, int]]:
    """(encoded bytes, samples) per chunk, then the encoder's tail with 0 samples.

    A failure after the first chunk cannot change the HTTP status any more: it propagates, and
    the server aborts the chunked body, so clients see an incomplete response, not a short one.
    """
    samples = 0
    try:
        async for chunk in _prepend(first, chunks):
            samples += chunk.size
            data = encoder.encode(chunk)
            metrics.bytes_out.labels(fmt).inc(len(data))
            yield data, chunk.size
    finally:
        await chunks.aclose()  # stops the Triton request if the client went away
    data = encoder.finish()
    metrics.bytes_out.labels(fmt).inc(len(data))
    yield data, 0
    metrics.total.labels(fmt).observe(time.monotonic() - started)
    metrics.audio_seconds.inc(samples / OUTPUT_SAMPLE_RATE)


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _bytes_only(encoded: AsyncIterator[tuple[bytes, int]]) -> AsyncIterator[bytes]:
    async for data, _ in encoded:
        if data:
            yield data


async def _sse_events(encoded: AsyncIterator[tuple[bytes, int]], input_tokens: int) -> AsyncIterator[str]:
    """OpenAI's speech SSE stream: ``speech.audio.delta`` events, then ``speech.audio.done`` with usage."""
    samples = 0
    async for data, count in encoded:
        samples += count
        if data:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
    output_tokens = samples // SAMPLES_PER_TOKEN
    yield _event({"type": "speech.audio.done", "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                                                          "total_tokens": input_tokens + output_tokens}})


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
