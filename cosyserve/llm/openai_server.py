"""OpenAI-compatible HTTP server over an LLM backend, standard library only.

    python -m cosyserve.llm.openai_server --model-dir models/cosyvoice2_llm --port 8000

Endpoints: ``POST /v1/completions`` (``prompt``: a string or a list of token ids),
``POST /v1/chat/completions`` (``messages``, rendered with the tokenizer's chat template),
``GET /v1/models``, ``GET /health`` (with the number of completions accepted), ``GET /metrics``
(Prometheus: requests in flight, completions, generated tokens; what an autoscaler of LLM servers
reads). Both POST endpoints take the fields trtllm-serve takes for
this model (``model``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
``stream``, ``repetition_penalty``) plus ``min_tokens``, ``ignore_eos`` and ``ras``; fields left
out keep :class:`SamplingParams` defaults (CosyVoice's RAS sampling). The text of a completion
is the generated speech tokens as ``<|s_N|>`` strings; ``stream: true`` sends server-sent events.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import uuid
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from ..errors import InvalidInputError
from .backends import create_backend
from .base import LLMBackend
from .prompt import speech_token_string
from .sampling import SamplingParams
from .stream import TokenStream

log = logging.getLogger(__name__)

# Request fields copied into SamplingParams (the OpenAI name, when it differs, maps to ours).
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} - {"max_tokens"}
_FINISH = {"stop": "stop", "length": "length"}


class CompletionRequest:
    """A parsed request: prompt ids, sampling parameters, stop strings, streaming flag."""

    def __init__(self, body: dict, chat: bool, app: "OpenAIApp"):
        if not isinstance(body, dict):
            raise InvalidInputError("the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise InvalidInputError("only n=1 is supported")
        if body.get("logprobs") or body.get("echo") or body.get("best_of", 1) != 1:
            raise InvalidInputError("logprobs, echo and best_of are not supported")
        self.chat = chat
        self.stream = bool(body.get("stream", False))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        self.prompt_ids = app.chat_ids(body.get("messages")) if chat else app.prompt_ids(body.get("prompt"))
        stop = body.get("stop") or []
        self.stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidInputError("stop must be a non-empty string or a list of them")
        options = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
        max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
        if max_tokens is not None:
            options["max_tokens"] = max_tokens
        try:
            self.params = SamplingParams(**options)
        except TypeError as exc:
            raise InvalidInputError(f"bad sampling field: {exc}") from None


class StopMatcher:
    """Applies stop strings to the growing text, holding back a tail that may start a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _held(self) -> int:
        """Length of the longest end of the text that is the beginning of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def add(self, piece: str) -> str:
        """Append ``piece``; returns the text now safe to send."""
        search_from = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        self.text += piece
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            return self.flush()
        safe = max(self.sent, len(self.text) - self._held())
        delta, self.sent = self.text[self.sent: safe], safe
        return delta

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta


class OpenAIApp:
    def __init__(self, backend: LLMBackend, tokenizer, model_name: str):
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self._tokenizer_lock = threading.Lock()
        self.metrics = CollectorRegistry()  # this server's own (several may share a process in tests)
        self.active = Gauge("cosyserve_llm_server_active_requests", "completions being generated",
                            registry=self.metrics)
        self.accepted = Counter("cosyserve_llm_server_completions", "completions accepted", registry=self.metrics)
        self.generated = Counter("cosyserve_llm_server_generated_tokens", "speech tokens generated",
                                 registry=self.metrics)

    @property
    def completions(self) -> int:
        return int(self.metrics.get_sample_value("cosyserve_llm_server_completions_total") or 0)

    def _encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty")
            return self._encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise InvalidInputError("prompt must be a string or a list of token ids (one prompt per request)")

    def chat_ids(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("messages must be a non-empty list")
        rendered = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
                raise InvalidInputError("each message needs role 'user' or 'assistant' (no other roles)")
            content = message.get("content", "")
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            if not isinstance(content, str):
                raise InvalidInputError("message content must be a string or a list of text parts")
            rendered.append({"role": message["role"], "content": content})
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False)
        return self._encode(text)

    def response_base(self, request: CompletionRequest, request_id: str) -> dict:
        kind = "chat.completion" if request.chat else "text_completion"
        return {"id": request_id, "object": kind + (".chunk" if request.chat and request.stream else ""),
                "created": int(time.time()), "model": self.model_name}


def _parse_json(body: bytes):
    try:
        return json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"the request body is not valid JSON: {exc}") from None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "OpenAIHTTPServer"

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # ---- plumbing ----------------------------------------------------------------------
    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})

    def _chunk(self, payload: dict | str) -> None:
        data = ("data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    # ---- routes ----------------------------------------------------------------------
    def do_GET(self) -> None:
        app = self.server.app
        if self.path == "/health":
            self._send_json(200, {"status": "ok", "completions": app.completions})
        elif self.path == "/metrics":
            data = generate_latest(app.metrics)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": app.model_name, "object": "model", "created": 0, "owned_by": "cosyserve"}]})
        else:
            self._send_error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # read first: keep-alive
        chat = {"/v1/completions": False, "/v1/chat/completions": True}.get(self.path)
        if chat is None:
            self._send_error(404, f"no route {self.path}")
            return
        app = self.server.app
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            request = CompletionRequest(_parse_json(body), chat, app)
            stream = app.backend.generate_stream(request.prompt_ids, request.params, request_id)
        except InvalidInputError as exc:
            self._send_error(400, str(exc))
            return
        app.accepted.inc()
        app.active.inc()
        try:
            if request.stream:
                self._stream_response(app, request, request_id, stream)
            else:
                self._full_response(app, request, request_id, stream)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client of %s went away; request cancelled", request_id)
        finally:
            stream.close()
            app.active.dec()
            app.generated.inc(stream.num_tokens)

    def _run(self, request: CompletionRequest, stream: TokenStream, matcher: StopMatcher):
        """Yield text deltas until the stream ends or a stop string matches."""
        for token in stream:
            delta = matcher.add(speech_token_string(token))
            if delta:
                yield delta
            if matcher.stopped:
                return
        tail = matcher.flush()
        if tail:
            yield tail

    def _finish_reason(self, stream: TokenStream, matcher: StopMatcher) -> str:
        return "stop" if matcher.stopped else _FINISH.get(stream.finish_reason or "", "stop")

    def _usage(self, request: CompletionRequest, stream: TokenStream) -> dict:
        prompt = len(request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": stream.num_tokens,
                "total_tokens": prompt + stream.num_tokens}

    def _full_response(self, app, request, request_id, stream) -> None:
        matcher = StopMatcher(request.stop)
        try:
            text = "".join(self._run(request, stream, matcher))
        except Exception as exc:
            self._send_error(500, f"generation failed: {exc}")
            return
        reason = self._finish_reason(stream, matcher)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                  if request.chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        self._send_json(200, {**app.response_base(request, request_id), "choices": [choice],
                              "usage": self._usage(request, stream)})

    def _stream_response(self, app, request, request_id, stream) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = app.response_base(request, request_id)

        def choice(delta: str | None, reason: str | None) -> dict:
            if request.chat:
                body = {} if delta is None else {"content": delta}
                return {"index": 0, "delta": body, "finish_reason": reason}
            return {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}

        if request.chat:
            self._chunk({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})
        matcher = StopMatcher(request.stop)
        try:
            for delta in self._run(request, stream, matcher):
                self._chunk({**base, "choices": [choice(delta, None)]})
            self._chunk({**base, "choices": [choice(None, self._finish_reason(stream, matcher))]})
            if request.include_usage:
                self._chunk({**base, "choices": [], "usage": self._usage(request, stream)})
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:
            self._chunk({"error": {"message": f"generation failed: {exc}", "type": "server_error", "code": 500}})
        self._chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


class OpenAIHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], app: OpenAIApp):
        super().__init__(address, Handler)
        self.app = app

    def handle_error(self, request, client_address) -> None:
        """A client that closes its kept-alive connection (a BLS instance or server that ends) is
        routine: logged at debug level, not as a traceback (hundreds of them when a server stops)."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            log.debug("connection from %s closed by the client", client_address)
            return
        super().handle_error(request, client_address)


def make_server(backend: LLMBackend, tokenizer, model_name: str, host: str = "127.0.0.1",
                port: int = 8000) -> OpenAIHTTPServer:
    """A ready server (port 0 picks a free port: ``server.server_address[1]``); call serve_forever()."""
    return OpenAIHTTPServer((host, port), OpenAIApp(backend, tokenizer, model_name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", default="torch", help="hf | torch | trtllm | openai")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on GPU)")
    parser.add_argument("--served-model-name", default=None, help="model name reported (default: directory name)")
    parser.add_argument("--max-slots", type=int, default=64, help="torch backend: concurrent requests")
    parser.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens per request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from transformers import AutoTokenizer

    options = {"max_model_len": args.max_model_len}
    if args.backend == "torch":
        options["max_slots"] = args.max_slots
    backend = create_backend(args.backend, args.model_dir, args.device, args.dtype, **options)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    server = make_server(backend, tokenizer, args.served_model_name or args.model_dir.name, args.host, args.port)
    log.info("serving %s (%s backend) on http://%s:%d/v1", args.model_dir, args.backend, args.host, args.port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
