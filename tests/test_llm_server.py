"""OpenAI-compatible server: real HTTP on 127.0.0.1, completions and chat, streaming and not."""

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from cosyserve.bundle.llm import ensure_llm_bundle
from cosyserve.llm import SamplingParams, create_backend
from cosyserve.llm.openai_server import StopMatcher, make_server

PROMPT = "<|sos|>Hello world, 你好<|task_id|><|s_1|><|s_2|>"


@pytest.fixture(scope="session")
def llm_dir(tmp_path_factory):
    return ensure_llm_bundle(tmp_path_factory.getbasetemp() / "llm_tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def server(llm_dir):
    from transformers import AutoTokenizer

    backend = create_backend("torch", llm_dir, "cpu", max_slots=4, max_model_len=256)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    httpd = make_server(backend, tokenizer, "cosyvoice2", port=0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", backend, tokenizer
    httpd.shutdown()
    httpd.server_close()
    backend.close()


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def speech_ids(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"<\|s_(\d+)\|>", text)]


def sse_events(body: str) -> list:
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_round_trip(server):
    url, backend, tokenizer = server
    body = {"model": "cosyvoice2", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    expected = backend.generate(tokenizer.encode(PROMPT, add_special_tokens=False), SamplingParams.greedy(max_tokens=8))
    status, text = post(url + "/v1/completions", body)
    assert status == 200
    reply = json.loads(text)
    choice = reply["choices"][0]
    assert reply["object"] == "text_completion" and reply["model"] == "cosyvoice2"
    assert speech_ids(choice["text"]) == expected and choice["finish_reason"] == "length"
    assert choice["text"] == "".join(f"<|s_{t}|>" for t in expected)
    assert reply["usage"]["completion_tokens"] == 8
    status, text = post(url + "/v1/completions", {**body, "stream": True})
    events = sse_events(text)
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert speech_ids("".join(e["choices"][0]["text"] for e in events)) == expected
    # Token ids as the prompt give the same result.
    status, text = post(url + "/v1/completions", {**body, "prompt": tokenizer.encode(PROMPT, add_special_tokens=False)})
    assert speech_ids(json.loads(text)["choices"][0]["text"]) == expected


def test_chat_round_trip(server):
    url, backend, tokenizer = server
    messages = [{"role": "user", "content": "Hello world, 你好"}, {"role": "assistant", "content": "<|s_1|><|s_2|>"}]
    body = {"model": "any", "messages": messages, "max_tokens": 6, "temperature": 0,
            "stop": ["<|eos1|>", "<|eos|>"], "repetition_penalty": 1.0, "top_k": 50, "top_p": 0.95, "seed": 42}
    expected = backend.generate(tokenizer.encode(PROMPT, add_special_tokens=False), SamplingParams.greedy(max_tokens=6))
    status, text = post(url + "/v1/chat/completions", body)
    assert status == 200
    message = json.loads(text)["choices"][0]["message"]
    assert message["role"] == "assistant" and speech_ids(message["content"]) == expected
    status, text = post(url + "/v1/chat/completions", {**body, "stream": True})
    events = sse_events(text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["object"] == "chat.completion.chunk"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert speech_ids(content) == expected and events[-1]["choices"][0]["finish_reason"] == "length"
    # A stop string inside the output ends it there.
    stop = f"<|s_{expected[2]}|>"
    status, text = post(url + "/v1/chat/completions", {**body, "stop": stop})
    choice = json.loads(text)["choices"][0]
    assert speech_ids(choice["message"]["content"]) == expected[:expected.index(expected[2])]
    assert choice["finish_reason"] == "stop"


def test_health_and_metrics_count_the_completions(server):
    """/health and /metrics (Prometheus) count the completions accepted, the tokens generated and the
    requests in flight (an autoscaler of LLM servers reads the last)."""
    url, _, tokenizer = server
    before = json.loads(urllib.request.urlopen(url + "/health").read())["completions"]
    status, _ = post(url + "/v1/completions", {"prompt": tokenizer.encode(PROMPT, add_special_tokens=False),
                                               "max_tokens": 5, "ignore_eos": True, "stream": False})
    assert status == 200
    assert json.loads(urllib.request.urlopen(url + "/health").read())["completions"] == before + 1
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["cosyserve_llm_server_completions_total"] == before + 1
    assert values["cosyserve_llm_server_generated_tokens_total"] >= 5
    assert values["cosyserve_llm_server_active_requests"] == 0


def test_bad_requests_get_400(server):
    url, _, _ = server
    for body in ({"prompt": "", "max_tokens": 4}, {"prompt": PROMPT, "max_tokens": 0},
                 {"prompt": PROMPT, "temperature": -1}, {"prompt": PROMPT, "top_p": 1.5},
                 {"prompt": PROMPT, "top_k": -1}, {"prompt": [158300]}, {"prompt": PROMPT, "n": 2}):
        status, text = post(url + "/v1/completions", {"model": "m", **body})
        assert status == 400, body
        assert json.loads(text)["error"]["type"] == "invalid_request_error"
    status, _ = post(url + "/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]})
    assert status == 400
    with urllib.request.urlopen(url + "/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "cosyvoice2"


def test_stop_matcher_holds_back_partial_matches():
    matcher = StopMatcher(["<|s_2|><|s_3|>"])
    assert matcher.add("<|s_1|>") == "<|s_1|>"
    assert matcher.add("<|s_2|>") == ""  # could be the start of the stop string: held back
    assert matcher.add("<|s_3|>") == "" and matcher.stopped and matcher.text == "<|s_1|>"
    matcher = StopMatcher(["<|s_2|><|s_3|>"])
    assert [matcher.add(p) for p in ("<|s_2|>", "<|s_4|>")] == ["", "<|s_2|><|s_4|>"]
    assert not matcher.stopped
