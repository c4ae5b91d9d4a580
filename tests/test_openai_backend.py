"""The ``openai`` backend: token-string parsing, the wire protocol, and end to end against
``cosyserve.llm.openai_server`` serving a tiny random-weight LLM on 127.0.0.1 (streaming and not).

A small scripted server stands in for vendor servers (vLLM, trtllm-serve) where their behaviour
differs: split token strings, text a model without the head bias would produce, HTTP errors,
a stream that never ends (cancellation).
"""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from cosyserve.bundle.llm import write_llm_bundle
from cosyserve.errors import InvalidInputError, RequestCancelledError
from cosyserve.llm.backends import TorchBackend
from cosyserve.llm.openai_backend import EOS_STRINGS, OpenAIBackend, OpenAIServerError, SpeechTextParser
from cosyserve.llm.prompt import COSYVOICE3, build_prompt_ids
from cosyserve.llm.sampling import SamplingParams

REFERENCE = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=42, ras=False,
                           max_tokens=40)


# ---- parsing -----------------------------------------------------------------------------------
def test_parser_joins_token_strings_split_across_chunks():
    parser = SpeechTextParser()
    pieces = ["<|s_1|><|s_2", "3|><", "|s_", "6560|", "><|eo", "s2|>ignored"]
    assert [t for piece in pieces for t in parser.feed(piece)] == [1, 23, 6560]
    assert parser.ended
    parser.close()


@pytest.mark.parametrize("text, message", [
    ("hello", "not a speech token: 'hello'"),
    ("<|s_1|> <|s_2|>", "not a speech token: ' <|s_2|>'"),
    ("<|s_6561|>", "speech tokens are 0..6560"),
    ("<|sos|>", "not a speech token"),
])
def test_parser_refuses_anything_but_speech_tokens(text, message):
    with pytest.raises(OpenAIServerError, match=message):
        SpeechTextParser().feed(text)


@pytest.mark.parametrize("text, tokens", [
    ("<|s_5|><|s_6560|><|eos1|><|s_7|>", [5, 6560]),
    ("<|s_5|><|ta", [5]), ("<|s_5|><|fill|>", [5]), ("<|s_5|><|sos|>", [5]),
    ("<|s_5|><|s_6565|><|s_7|>", [5]),  # a reserved class: upstream stops on it, the flow could not take it
])
def test_cosyvoice3_parser_ends_on_every_class_past_the_speech_tokens(text, tokens):
    parser = SpeechTextParser(COSYVOICE3)
    assert parser.feed(text) == tokens
    if text.endswith("<|ta"):
        assert not parser.ended and parser.feed("sk_id|><|s_9|>") == [] and parser.ended
    assert parser.ended


def test_cosyvoice3_parser_refuses_text_tokens():
    with pytest.raises(OpenAIServerError, match=re.escape("not a speech token: '<|endofprompt|>'")):
        SpeechTextParser(COSYVOICE3).feed("<|s_1|><|endofprompt|>")


def test_parser_refuses_a_truncated_token_at_the_end():
    parser = SpeechTextParser()
    assert parser.feed("<|s_4|><|s_1") == [4]
    with pytest.raises(OpenAIServerError, match="ended inside a token string"):
        parser.close()


def test_base_url_is_required(monkeypatch):
    monkeypatch.delenv("COSYSERVE_OPENAI_BASE_URL", raising=False)
    with pytest.raises(InvalidInputError, match="base_url"):
        OpenAIBackend()
    with pytest.raises(InvalidInputError, match="not an http"):
        OpenAIBackend(base_url="127.0.0.1:8000")


def test_unreachable_server_fails_at_construction():
    with pytest.raises(OpenAIServerError, match="cannot reach the completions server"):
        OpenAIBackend(base_url="http://127.0.0.1:9/v1", timeout=5)


# ---- a scripted vendor server ------------------------------------------------------------------
class VendorHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, payload: dict) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(payload).encode())

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "cosyvoice2", "object": "model", "owned_by": "vllm"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        mode, pieces = self.server.mode, self.server.pieces
        if mode == "bad_request":
            self._json(400, {"error": {"message": "prompt is too long", "type": "invalid_request_error"}})
            return
        if not body["stream"]:
            self._json(200, {"choices": [{"index": 0, "text": "".join(pieces), "finish_reason": "length"}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for piece in pieces:
                self.wfile.write(b"data: " + json.dumps({"choices": [{"text": piece, "finish_reason": None}]}).encode()
                                 + b"\n\n")
                self.wfile.flush()
            deadline = time.time() + (10 if mode == "hang" else 0)
            while time.time() < deadline:  # keep the stream open until the client goes away
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b'data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        except (BrokenPipeError, ConnectionResetError):
            self.server.disconnects += 1


@pytest.fixture
def vendor():
    server = ThreadingHTTPServer(("127.0.0.1", 0), VendorHandler)
    server.daemon_threads = True
    server.bodies, server.mode, server.pieces, server.disconnects = [], "normal", [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def vendor_backend(server, **options) -> OpenAIBackend:
    return OpenAIBackend(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", timeout=20, **options)


def start_vendor() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), VendorHandler)
    server.daemon_threads = True
    server.bodies, server.mode, server.pieces, server.disconnects = [], "normal", [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_several_servers_share_the_requests_by_load_and_a_dead_one_is_passed_over():
    """base_url lists two servers: requests in flight at once go one each way (fewest in flight
    first); after one server goes away, every request is served by the other, none fails."""
    first, second = start_vendor(), start_vendor()
    for server in (first, second):
        server.mode, server.pieces = "hang", ["<|s_1|>"]  # streams stay open: both are in flight together
    urls = [f"http://127.0.0.1:{server.server_address[1]}/v1" for server in (first, second)]
    backend = OpenAIBackend(base_url=" , ".join(urls), timeout=20)
    assert [e.base_url for e in backend.endpoints] == urls
    streams = [backend.generate_stream([158227, 10, 158228], REFERENCE, request_id=f"r{k}") for k in range(4)]
    assert all(next(stream) == 1 for stream in streams)  # all four started
    assert (len(first.bodies), len(second.bodies)) == (2, 2)
    for stream in streams:
        stream.close()
    second.shutdown()
    second.server_close()  # gone: its port refuses connections
    first.mode = "normal"
    for k in range(3):
        assert list(backend.generate_stream([158227, 10, 158228], REFERENCE)) == [1]
    assert len(first.bodies) == 5 and backend.endpoints[1].unreachable >= 1
    first.shutdown()
    first.server_close()
    with pytest.raises(OpenAIServerError, match="cannot reach the completions server"):
        list(backend.generate_stream([158227, 10, 158228], REFERENCE))  # none left: a clear error
    backend.close()


def test_vendor_request_body_and_split_stream(vendor):
    vendor.pieces = ["<|s_5|><|s_", "17|>", "<|s_0|>"]
    backend = vendor_backend(vendor)
    assert (backend.model, backend.native) == ("cosyvoice2", False)
    stream = backend.generate_stream([158227, 10, 158228], REFERENCE)
    assert list(stream) == [5, 17, 0] and stream.finish_reason == "stop"
    assert vendor.bodies[0] == {"model": "cosyvoice2", "prompt": [158227, 10, 158228], "max_tokens": 40,
                                "temperature": 0.8, "top_p": 0.95, "seed": 42, "stream": True,
                                "stop": list(EOS_STRINGS), "top_k": 50, "repetition_penalty": 1.1}


def test_vendor_non_streaming_and_no_limit_fields(vendor):
    vendor.pieces = ["<|s_1|><|s_2|>"]
    backend = vendor_backend(vendor, stream=False)
    stream = backend.generate_stream([1, 2], SamplingParams(top_k=0, ignore_eos=True, seed=3, max_tokens=2))
    assert list(stream) == [1, 2] and stream.finish_reason == "length"
    body = vendor.bodies[0]
    assert body["ignore_eos"] is True and "stop" not in body and "top_k" not in body
    assert "repetition_penalty" not in body and "ras" not in body


def test_text_tokens_from_a_model_without_head_bias_fail_the_request(vendor):
    vendor.pieces = ["<|s_3|>", "Hello"]
    stream = vendor_backend(vendor).generate_stream([1], REFERENCE)
    assert next(stream) == 3
    with pytest.raises(OpenAIServerError, match="without the CosyVoice2 lm_head bias"):
        next(stream)


def test_http_400_is_an_invalid_input(vendor):
    vendor.mode = "bad_request"
    stream = vendor_backend(vendor).generate_stream([1], REFERENCE)
    with pytest.raises(InvalidInputError, match="HTTP 400: .*prompt is too long"):
        list(stream)


def test_cancel_closes_the_connection(vendor):
    vendor.mode, vendor.pieces = "hang", ["<|s_9|>"]
    backend = vendor_backend(vendor)
    stream = backend.generate_stream([1], REFERENCE, request_id="r1")
    assert next(stream) == 9
    started = time.time()
    assert backend.cancel("r1")
    with pytest.raises(RequestCancelledError):
        next(stream)
    assert time.time() - started < 5
    for _ in range(100):  # the server notices the disconnect at its next write
        if vendor.disconnects:
            break
        time.sleep(0.05)
    assert vendor.disconnects == 1
    assert not backend.cancel("r1")


# ---- end to end against cosyserve.llm.openai_server --------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny LLM on the torch engine behind cosyserve.llm.openai_server, on a free local port."""
    from transformers import AutoTokenizer

    openai_server = pytest.importorskip("cosyserve.llm.openai_server",
                                        reason="cosyserve.llm.openai_server is not written yet")
    llm_dir = write_llm_bundle(tmp_path_factory.mktemp("openai") / "cosyvoice2_llm", "tiny", 0)
    backend = TorchBackend(llm_dir, "cpu", torch.float32, max_slots=4, max_model_len=256)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    server = openai_server.make_server(backend, tokenizer, "cosyvoice2_llm", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield backend, tokenizer, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
    backend.close()


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("params", [REFERENCE, SamplingParams(seed=5, max_tokens=40)], ids=["reference", "ras"])
def test_same_tokens_as_the_engine_itself(served, stream, params):
    engine, tokenizer, url = served
    ids = build_prompt_ids(tokenizer, "hello world, this is a test")
    want = engine.generate(ids, params)
    client = OpenAIBackend(base_url=url, stream=stream)
    assert client.native  # the server identifies itself, so RAS and every default are sent explicitly
    tokens = client.generate_stream(ids, params)
    assert list(tokens) == want and len(want) > 0
    assert tokens.finish_reason == ("length" if len(want) == params.max_tokens else "stop")


def test_ignore_eos_runs_to_max_tokens(served):
    _, tokenizer, url = served
    stream = OpenAIBackend(base_url=url).generate_stream(
        build_prompt_ids(tokenizer, "short"), SamplingParams(seed=1, ignore_eos=True, max_tokens=25))
    assert len(list(stream)) == 25 and stream.finish_reason == "length"


def test_cancel_and_register_prefix_against_the_server(served):
    _, tokenizer, url = served
    client = OpenAIBackend(base_url=url)
    client.register_prefix("voice:x", build_prompt_ids(tokenizer, "a prompt")[:-1])
    stream = client.generate_stream(build_prompt_ids(tokenizer, "long"), SamplingParams(seed=2, ignore_eos=True,
                                                                                         max_tokens=200))
    next(stream)
    stream.close()  # a reader that stops early cancels its request
    assert stream.finish_reason == "cancelled"
    again = client.generate_stream(build_prompt_ids(tokenizer, "next"), REFERENCE)
    assert len(list(again)) > 0


def test_backend_registry_creates_it(served):
    from cosyserve.llm.backends import create_backend
    from cosyserve.llm.base import BackendUnavailableError

    _, _, url = served
    try:
        client = create_backend("openai", "unused-model-dir", "cpu", None, base_url=url)
    except BackendUnavailableError as exc:
        if "not implemented yet" in str(exc):
            pytest.skip("cosyserve.llm.backends does not point 'openai' at OpenAIBackend yet")
        raise
    assert isinstance(client, OpenAIBackend) and client.model == "cosyvoice2_llm"
