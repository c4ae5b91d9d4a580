"""The ``openai`` backend: speech tokens from an OpenAI-compatible completions server.

    backend = create_backend("openai", "models/cosyvoice2_llm", base_url="http://127.0.0.1:8100/v1")

Any server with ``POST /v1/completions`` works: trtllm-serve, vLLM, SGLang, or this package's
``python -m cosyserve.llm.openai_server``. ``base_url`` (or the environment variable
``COSYSERVE_OPENAI_BASE_URL``) is the API root ending in ``/v1``. ``GET /v1/models`` is read at
start-up (the connectivity check): ``model`` defaults to its first entry, and a model owned by
``cosyserve`` marks this package's server.

Each request is one completion whose ``prompt`` is the token ids themselves (no re-tokenising
on the server), with ``stop`` = the three end-of-speech strings, and ``stream`` true (server-sent
events, tokens handed on as they arrive) or false (one JSON answer). The completion text is a
run of ``<|s_N|>`` strings (the tokenizer's names of the speech ids); it is parsed back into raw
speech tokens, and any other text is an error. Sampling: temperature, top_p and seed are
standard fields. This package's server gets every :class:`SamplingParams` field (its defaults
are CosyVoice's, not OpenAI's, and it implements repetition-aware sampling); other servers get
top_k, repetition_penalty, min_tokens and ignore_eos (the extensions vLLM, SGLang and
trtllm-serve accept) only where they change something, and no RAS (ignored with a warning).

Head bias: stock Qwen2 loaders (vLLM, SGLang, trtllm-serve) drop ``lm_head.bias`` (see
``llm_layout.md`` §2), so their models can sample text tokens; this backend then fails the
request with that explanation rather than pass text on as speech. ``cosyserve.llm.openai_server``
keeps the bias. ``cancel`` closes the request's connection (servers abort on disconnect).
Only the standard library's HTTP client is used.

Several servers: ``base_url`` may list API roots separated by commas (e.g. one LLM server per GPU).
Each request goes to the one with the fewest requests in flight from this backend; a server that
cannot be connected to is passed over for the next one before the request fails. All of them must
serve the model (``GET /models`` of each at start-up).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import re
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import CosyServeError, InvalidInputError
from .base import LLMBackend
from .prompt import COSYVOICE2, COSYVOICE3, LAYOUTS, PromptLayout, validate_prompt_ids
from .sampling import SamplingParams, random_seed
from .stream import Finished, TokenStream, cancelled_error

log = logging.getLogger(__name__)

BASE_URL_ENV = "COSYSERVE_OPENAI_BASE_URL"
EOS_STRINGS = ("<|eos1|>", "<|eos2|>", "<|eos3|>")
# CosyVoice3's names of its classes 6561..6564 (sos, eos, task_id, fill): upstream stops on every class
# from 6561 on; its Triton reference sends stop <|eos1|> only, which lets the others through to the flow.
COSYVOICE3_END_STRINGS = ("<|eos1|>", "<|sos|>", "<|task_id|>", "<|fill|>")
END_STRINGS = {COSYVOICE2.name: EOS_STRINGS, COSYVOICE3.name: COSYVOICE3_END_STRINGS}
_TOKEN = re.compile(r"<\|(?:s_(\d+)|[a-z][a-z_0-9]*)\|>")
# A string that a complete token string can start with: kept until the rest arrives.
_TOKEN_PREFIX = re.compile(r"<(?:\|[a-z_0-9]*\|?)?")
FINISH_REASONS = ("stop", "length")  # OpenAI's names are TokenStream's


class OpenAIServerError(CosyServeError, RuntimeError):
    """The completions server could not be reached, failed, or answered something unusable."""


class SpeechTextParser:
    """Incremental ``<|s_N|>...`` text -> speech tokens; a token string may arrive in pieces. The
    layout's end strings end the speech; with ``stop_past_speech`` (CosyVoice3, whose classes from
    6561 on all stop upstream) so does ``<|s_N|>`` with N past the speech tokens."""

    def __init__(self, layout: PromptLayout = COSYVOICE2):
        self.end_strings = END_STRINGS[layout.name]
        self.num_speech_tokens = layout.num_speech_tokens
        self.stop_past_speech = layout is COSYVOICE3
        self._pending = ""
        self.ended = False  # an end-of-speech string was seen (servers usually strip it)

    def feed(self, text: str) -> list[int]:
        if self.ended:
            return []
        text, tokens, position = self._pending + text, [], 0
        while match := _TOKEN.match(text, position):
            if match.group(1) is None:
                if match.group(0) not in self.end_strings:
                    break  # another special token: reported below as text
                self.ended, self._pending = True, ""
                return tokens
            token = int(match.group(1))
            if token >= self.num_speech_tokens:
                if self.stop_past_speech:
                    self.ended, self._pending = True, ""
                    return tokens
                raise OpenAIServerError(
                    f"the server returned <|s_{token}|>; speech tokens are 0..{self.num_speech_tokens - 1}")
            tokens.append(token)
            position = match.end()
        rest = text[position:]
        if rest and not _TOKEN_PREFIX.fullmatch(rest):
            raise OpenAIServerError(
                f"the server returned text that is not a speech token: {rest[:40]!r}. Its model samples "
                "text tokens, i.e. it runs without the CosyVoice2 lm_head bias (stock vLLM/SGLang/trtllm-serve "
                "Qwen2 loaders drop it); serve the model with cosyserve.llm.openai_server instead")
        self._pending = rest
        return tokens

    def close(self) -> None:
        if self._pending:
            raise OpenAIServerError(f"the completion ended inside a token string: {self._pending!r}")


@dataclass(eq=False)
class _Request:
    request_id: str
    ids: list[int]
    params: SamplingParams
    stream: TokenStream
    cancelled: bool = False
    sock: socket.socket | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Endpoint:
    """One completions server: where it is, the model it serves for us, its load from this backend."""

    base_url: str
    scheme: str
    host: str
    port: int | None
    path: str
    model: str = ""
    native: bool = False  # cosyserve.llm.openai_server
    active: int = 0  # requests in flight
    served: int = 0  # requests sent
    unreachable: int = 0  # connections that failed

    @classmethod
    def parse(cls, base_url: str) -> "_Endpoint":
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInputError(f"base_url {base_url!r} is not an http(s) URL like http://127.0.0.1:8000/v1")
        return cls(base_url, parts.scheme, parts.hostname, parts.port, parts.path.rstrip("/"))


class OpenAIBackend(LLMBackend):
    name = "openai"

    def __init__(self, model_dir: str | Path | None = None, device=None, dtype=None, *, base_url: str | None = None,
                 model: str | None = None, stream: bool = True, api_key: str | None = None, timeout: float = 600.0,
                 layout: str = COSYVOICE2.name):
        # model_dir, device and dtype belong to the server; they are accepted for the common signature.
        if layout not in LAYOUTS:
            raise InvalidInputError(f"unknown LLM layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        self.layout = LAYOUTS[layout]  # the prompt ids' vocabulary and the end strings
        base_url = base_url or os.environ.get(BASE_URL_ENV)
        if not base_url:
            raise InvalidInputError(f"the openai backend needs base_url=http://HOST:PORT/v1 (or {BASE_URL_ENV})")
        self.endpoints = [_Endpoint.parse(url.strip()) for url in base_url.split(",") if url.strip()]
        if not self.endpoints:
            raise InvalidInputError(f"base_url {base_url!r} names no server")
        self.stream, self.timeout = stream, timeout
        self._headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.base_url = base_url
        for endpoint in self.endpoints:
            endpoint.model, endpoint.native = self._select_model(endpoint, model)
        self.model, self.native = self.endpoints[0].model, self.endpoints[0].native
        self._lock = threading.Lock()
        self._active: dict[str, _Request] = {}
        self._warned_ras = False

    # ---- LLMBackend ---------------------------------------------------------------------------
    def generate_stream(self, prompt_ids, params: SamplingParams, request_id: str | None = None) -> TokenStream:
        ids = validate_prompt_ids(prompt_ids, self.layout.tokenizer_size, self.layout)
        params.validate()
        if params.ras and params.temperature > 0 and not self.native and not self._warned_ras:
            self._warned_ras = True
            log.warning("OpenAI-compatible servers have no repetition-aware sampling; ras=True is ignored")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        request = _Request(request_id, ids, params, TokenStream(request_id, lambda: self.cancel(request_id)))
        with self._lock:
            if request_id in self._active:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            self._active[request_id] = request
        threading.Thread(target=self._run, args=(request,), name=f"openai-{request_id}", daemon=True).start()
        return request.stream

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            request = self._active.get(request_id)
            if request is None:
                return False
            request.cancelled = True
            sock = request.sock
        if sock is not None:
            try:  # wakes the reader blocked in recv(); the server sees the disconnect and aborts
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        return True

    def register_prefix(self, key: str, ids: list[int]) -> None:
        """One 1-token completion over the prefix on every server, so that those with prefix caching
        keep its KV."""
        ids = validate_prompt_ids(ids, self.layout.tokenizer_size, self.layout)
        for endpoint in self.endpoints:
            body = {**self.completion_body(ids, SamplingParams.greedy(max_tokens=1, ras=False), endpoint),
                    "stream": False}
            connection = self._connect(endpoint)
            try:
                self._post(connection, endpoint, "/completions", body).read()  # the token itself is of no interest
            finally:
                connection.close()

    def close(self) -> None:
        with self._lock:
            request_ids = list(self._active)
        for request_id in request_ids:
            self.cancel(request_id)

    # ---- protocol -----------------------------------------------------------------------------
    def completion_body(self, ids: list[int], params: SamplingParams, endpoint: _Endpoint | None = None) -> dict:
        """The JSON body of ``POST /completions`` for one request (to ``endpoint``, default the first)."""
        endpoint = endpoint or self.endpoints[0]
        body = {"model": endpoint.model, "prompt": ids, "max_tokens": params.max_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "seed": params.seed if params.seed is not None else random_seed(),
                "stream": self.stream}
        body.update({"ignore_eos": True} if params.ignore_eos else {"stop": list(END_STRINGS[self.layout.name])})
        if endpoint.native:  # cosyserve.llm.openai_server: left-out fields would take CosyVoice defaults
            body.update(top_k=params.top_k, repetition_penalty=params.repetition_penalty,
                        min_tokens=params.min_tokens, ras=params.ras, ras_window=params.ras_window,
                        ras_tau=params.ras_tau)
            return body
        if params.top_k:  # 0 = no limit = the field left out
            body["top_k"] = params.top_k
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
        if params.min_tokens:
            body["min_tokens"] = params.min_tokens
        return body

    def _connect(self, endpoint: _Endpoint) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if endpoint.scheme == "https" else http.client.HTTPConnection
        connection = kind(endpoint.host, endpoint.port, timeout=self.timeout)
        try:
            connection.connect()
        except OSError as exc:
            raise OpenAIServerError(f"cannot reach the completions server at {endpoint.base_url}: {exc}") from exc
        return connection

    def _post(self, connection: http.client.HTTPConnection, endpoint: _Endpoint, path: str,
              body: dict) -> http.client.HTTPResponse:
        try:
            connection.request("POST", endpoint.path + path, json.dumps(body), self._headers)
            response = connection.getresponse()
        except OSError as exc:
            raise OpenAIServerError(f"cannot reach the completions server at {endpoint.base_url}: {exc}") from exc
        if response.status != 200:
            detail = response.read().decode("utf-8", "replace")[:500]
            # 400/422: the server refused this request (e.g. prompt longer than its context)
            kind = InvalidInputError if response.status in (400, 422) else OpenAIServerError
            raise kind(f"the completions server answered HTTP {response.status}: {detail}")
        return response

    def _select_model(self, endpoint: _Endpoint, wanted: str | None) -> tuple[str, bool]:
        """(model id, served by cosyserve.llm.openai_server) from the server's ``GET /models``."""
        connection = self._connect(endpoint)
        try:
            connection.request("GET", endpoint.path + "/models", headers=self._headers)
            response = connection.getresponse()
            payload = response.read()
            if response.status != 200:
                raise OpenAIServerError(f"GET {endpoint.base_url}/models answered HTTP {response.status}")
            models = {entry["id"]: entry for entry in json.loads(payload).get("data") or []}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OpenAIServerError(
                f"cannot list the models of the completions server at {endpoint.base_url}: {exc}") from exc
        finally:
            connection.close()
        if not models:
            raise OpenAIServerError(f"the completions server at {endpoint.base_url} lists no model")
        model = wanted or next(iter(models))
        if model not in models:
            raise InvalidInputError(f"model {model!r} is not served at {endpoint.base_url}; it serves {sorted(models)}")
        return model, models[model].get("owned_by") == "cosyserve"

    def _open(self) -> tuple[http.client.HTTPConnection, _Endpoint]:
        """A connection to the least loaded server that answers (fewest requests in flight, then fewest
        sent, then at random: a Triton server runs many BLS instances, each with its own backend and
        counts, which must not all start on the first server); one that cannot be reached is passed
        over for the next."""
        errors, tried = [], []
        while True:
            with self._lock:  # chosen and counted at once: requests starting together spread
                candidates = [e for e in self.endpoints if e not in tried]
                if not candidates:
                    raise OpenAIServerError("; ".join(errors))
                endpoint = min(candidates, key=lambda e: (e.active, e.served, random.random()))
                endpoint.active += 1
                endpoint.served += 1
            tried.append(endpoint)
            try:
                return self._connect(endpoint), endpoint
            except OpenAIServerError as exc:
                with self._lock:
                    endpoint.active -= 1
                    endpoint.unreachable += 1
                errors.append(str(exc))

    # ---- one request on its own thread --------------------------------------------------------
    def _run(self, request: _Request) -> None:
        connection = endpoint = None
        try:
            connection, endpoint = self._open()
            with self._lock:  # the socket itself: http.client drops its own reference for HTTP/1.0 answers
                request.sock = connection.sock
            if request.cancelled:
                event = cancelled_error(request.request_id)
            else:
                body = self.completion_body(request.ids, request.params, endpoint)
                event = self._read(request, self._post(connection, endpoint, "/completions", body))
        except Exception as exc:  # reported to this request's reader only
            event = cancelled_error(request.request_id) if request.cancelled else Finished("error", exc)
        finally:
            if connection is not None:
                connection.close()
            with self._lock:
                self._active.pop(request.request_id, None)
                if endpoint is not None:
                    endpoint.active -= 1
        request.stream.put(event)

    def _read(self, request: _Request, response: http.client.HTTPResponse) -> Finished:
        parser = SpeechTextParser(self.layout)
        reason = None
        chunks = _events(response) if self.stream else [json.loads(response.read())]
        for chunk in chunks:
            if request.cancelled:
                return cancelled_error(request.request_id)
            if "error" in chunk:
                raise OpenAIServerError(f"the completions server reported: {chunk['error']}")
            if not chunk.get("choices"):  # e.g. a usage-only chunk
                continue
            choice = chunk["choices"][0]
            for token in parser.feed(choice.get("text") or ""):
                request.stream.put(token)
            reason = choice.get("finish_reason") or reason
            if parser.ended:
                break
        if request.cancelled:
            return cancelled_error(request.request_id)
        parser.close()
        if parser.ended:
            return Finished("stop")
        if reason not in FINISH_REASONS:
            raise OpenAIServerError(f"the completion ended with finish_reason {reason!r} (connection lost, "
                                    "or the server aborted the request)")
        return Finished(reason)


def _events(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON payloads of a server-sent-event stream, up to ``data: [DONE]``."""
    while line := response.readline():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except json.JSONDecodeError as exc:
            raise OpenAIServerError(f"the completions server sent an unreadable event: {data[:200]!r}") from exc
