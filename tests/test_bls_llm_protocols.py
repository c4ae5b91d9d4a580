"""The cosyvoice2 engine's external speech-token sources, end to end through a real tritonserver (CPU,
tiny random-weight bundle), and the LLM requests it builds (no server).

* ``llm_protocol: tensorrt_llm``: the engine sends what TensorRT-LLM needs (``embedding_bias``,
  ``stop_words_list``, ``seed``). The server runs our ``llm`` model under the name ``tensorrt_llm``;
  it checks those inputs (shape [1, vocab], the head bias, the end-of-speech stop words) and
  counts the requests that carried all three, accepted
  (``cosyserve_llm_tensorrt_llm_requests_total``).
* ``llm_url``: speech tokens from ``cosyserve.llm.openai_server`` (no Triton LLM model is used);
  a cancelled stream stops the generation on that server (its log says the client went away).

The template sets ``max_tokens = min_tokens = 40``: every request makes exactly 40 speech
tokens, 960 samples each, in a known chunk plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest_triton import (REPO_ROOT, SAMPLES_PER_TOKEN, Stream, build_model_repo,
                             expected_chunk_samples, grpc_input, metrics, serve_openai_llm, serve_repo, set_parameter,
                             stream_tts, token_limits, wait_for, wait_until_idle)
from cosyserve.errors import InvalidInputError
from cosyserve.llm.prompt import EOS_IDS, SOS_ID, SPEECH_TOKEN_OFFSET, TASK_ID
from cosyserve.llm.sampling import REFERENCE_SAMPLING
from cosyserve.llm.trtllm.request import (MASKED_LOGIT, TritonLLMInputs, check_embedding_bias, check_stop_words,
                                      decode_stop_words, embedding_bias, request_seed, resolve_protocol,
                                      triton_stop_words_list)

NUM_TOKENS = 40  # max_tokens = min_tokens in the template
# A request cancelled after its first chunk: the LLM is still generating then, even on a loaded machine.
LONG_TOKENS = 2000
TRTLLM_REQUESTS = "cosyserve_llm_tensorrt_llm_requests_total"  # requests with bias, stop words and seed
NP_TYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}


@pytest.fixture(scope="module")
def llm_dir(tiny_bundle: Path) -> Path:
    return tiny_bundle / "cosyvoice2_llm"


@pytest.fixture(scope="module")
def head_bias(llm_dir: Path) -> np.ndarray:
    return embedding_bias(llm_dir).numpy()


# ----- request building, no server ---------------------------------------------------------------

def declared_inputs(model: str) -> dict[str, tuple[type, list[int], bool]]:
    """name -> (numpy dtype, dims without the batch dimension, optional) of a model_repo template."""
    text = (REPO_ROOT / "model_repo" / model / "config.pbtxt").read_text()
    text = text[text.index("\ninput ["):text.index("\noutput [")]
    pattern = r'\{ name: "(\w+)", data_type: (TYPE_\w+), dims: \[ ([-\d, ]+) \](.*)\}'
    return {name: (NP_TYPES.get(dtype), [int(d) for d in dims.split(",")], "optional: true" in rest)
            for name, dtype, dims, rest in re.findall(pattern, text)}


def assert_declared(inputs: dict[str, np.ndarray], model: str) -> None:
    """Every tensor is an input of ``model``'s template, with its type and shape (batch 1)."""
    declared = declared_inputs(model)
    for name, array in inputs.items():
        assert name in declared, f"{name} is not an input of {model}"
        dtype, dims, _ = declared[name]
        assert array.dtype == dtype, (model, name, array.dtype)
        assert array.shape[0] == 1 and len(array.shape) == len(dims) + 1, (model, name, array.shape)
        assert all(d in (-1, n) for d, n in zip(dims, array.shape[1:])), (model, name, array.shape)
    required = {name for name, (_, _, optional) in declared.items() if not optional}
    assert required <= set(inputs), f"{model} needs {required - set(inputs)}"


def test_protocol_follows_the_model_name_unless_given():
    assert resolve_protocol("", "tensorrt_llm") == "tensorrt_llm"
    assert resolve_protocol(None, "llm") == "cosyserve"
    assert resolve_protocol("tensorrt_llm", "llm") == "tensorrt_llm"  # our model under its own name
    assert resolve_protocol("cosyserve", "tensorrt_llm") == "cosyserve"
    with pytest.raises(InvalidInputError, match="'openai' is not one of cosyserve, tensorrt_llm"):
        resolve_protocol("openai", "llm")


def test_cosyserve_requests_carry_the_llm_models_inputs_only():
    inputs = TritonLLMInputs("cosyserve", REFERENCE_SAMPLING, streaming=True)
    request = inputs.generate([SOS_ID, 100, TASK_ID], max_tokens=30, min_tokens=10)
    assert not {"embedding_bias", "stop_words_list", "seed"} & set(request)
    assert request["input_ids"].tolist() == [[SOS_ID, 100, TASK_ID]] and request["input_lengths"].tolist() == [[3]]
    assert request["request_output_len"].tolist() == [[30]] and request["min_tokens"].tolist() == [[10]]
    assert request["random_seed"].tolist() == [[REFERENCE_SAMPLING.seed]] and request["streaming"].tolist() == [[True]]
    assert request["end_id"].tolist() == [[EOS_IDS[0]]]
    assert "min_tokens" not in inputs.generate([1, 2], max_tokens=5)  # sent only when used
    for model in ("llm", "tensorrt_llm"):
        assert_declared(request, model)
        assert_declared(inputs.stop(), model)


def test_tensorrt_llm_requests_add_bias_stop_words_and_seed(llm_dir, head_bias):
    vocab = json.loads((llm_dir / "config.json").read_text())["vocab_size"]
    inputs = TritonLLMInputs("tensorrt_llm", REFERENCE_SAMPLING, streaming=False, llm_dir=llm_dir)
    request = inputs.generate([SOS_ID, 100, TASK_ID], max_tokens=30)
    assert request["embedding_bias"].shape == (1, vocab) and request["embedding_bias"].dtype == np.float32
    np.testing.assert_array_equal(request["embedding_bias"][0], head_bias)
    assert (request["embedding_bias"][0, :SPEECH_TOKEN_OFFSET] == MASKED_LOGIT).all()  # text rows masked
    assert decode_stop_words(request["stop_words_list"][0]) == [[EOS_IDS[1]], [EOS_IDS[2]]]
    assert request["seed"].tolist() == request["random_seed"].tolist() == [[REFERENCE_SAMPLING.seed]]
    assert request["streaming"].tolist() == [[False]]
    for model in ("tensorrt_llm", "llm"):  # NVIDIA's model, and ours, which accepts them too
        assert_declared(request, model)
    with pytest.raises(InvalidInputError, match="needs llm_dir"):
        TritonLLMInputs("tensorrt_llm", REFERENCE_SAMPLING, streaming=True)


def test_embedding_bias_check(head_bias):
    check_embedding_bias(head_bias, head_bias)
    check_embedding_bias(np.zeros_like(head_bias), head_bias)  # nothing to add
    with np.errstate(over="ignore"):
        rounded = head_bias.astype(np.float16).astype(np.float32)  # fp16 turns the -1e9 masks into -inf
    check_embedding_bias(rounded, head_bias)
    with pytest.raises(InvalidInputError, match=rf"shape \[1, 5\]; .* needs \[1, {head_bias.size}\]"):
        check_embedding_bias(head_bias[:5], head_bias)
    other = head_bias.copy()
    other[head_bias > MASKED_LOGIT] += 0.5  # another checkpoint's speech-token biases
    unmasked = np.where(head_bias > MASKED_LOGIT, head_bias, 0).astype(np.float32)  # text rows allowed
    for bias in (other, unmasked):
        with pytest.raises(InvalidInputError, match="neither zeros nor the lm_head bias"):
            check_embedding_bias(bias, head_bias)


def test_stop_words_check():
    words = triton_stop_words_list()[0]
    check_stop_words(words, EOS_IDS[0])
    check_stop_words(words, None)  # end_id defaults to <|eos1|>
    padded = np.array([[EOS_IDS[0], EOS_IDS[2], 0], [1, 2, -1]], np.int32)
    assert decode_stop_words(padded) == [[EOS_IDS[0]], [EOS_IDS[2]]]
    check_stop_words(padded, EOS_IDS[1])
    bad = {
        "not one end-of-speech id": np.array([[EOS_IDS[1], 5], [1, 2]], np.int32),
        r"stop word \[158225, 158226\]": np.array([[EOS_IDS[1], EOS_IDS[2]], [2, -1]], np.int32),
        "always stops at every end-of-speech id": np.array([[EOS_IDS[1]], [1]], np.int32),
        "not increasing word ends": np.array([[EOS_IDS[1], EOS_IDS[2]], [2, 1]], np.int32),
        r"shape \[1, 3, 2\]": np.zeros((3, 2), np.int32),
    }
    for message, array in bad.items():
        with pytest.raises(InvalidInputError, match=message):
            check_stop_words(array, EOS_IDS[0])


def test_seed_under_either_name():
    assert request_seed(None, None) is None
    assert request_seed(7, None) == request_seed(None, 7) == request_seed(7, 7) == 7
    with pytest.raises(InvalidInputError, match="seed 7 and random_seed 8 differ"):
        request_seed(7, 8)


def test_run_sh_stage2_openai_mode_and_protocol(tiny_bundle, tmp_path):
    repo = tmp_path / "repo"
    env = dict(os.environ, MODELS_DIR=str(tiny_bundle), MODEL_REPO=str(repo), DECOUPLED_MODE="False", DEVICE="cpu",
               VENV=str(Path(sys.prefix)), OUT_DIR=str(tmp_path / "out"), LLM_URL="http://127.0.0.1:8100/v1",
               LLM_PROTOCOL="tensorrt_llm")
    proc = subprocess.run(["bash", str(REPO_ROOT / "run.sh"), "2", "2"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in repo.iterdir()) == ["cosyvoice2"]  # the engine, its tokens from the server
    config = (repo / "cosyvoice2" / "config.pbtxt").read_text()
    assert 'key: "llm_url", value: { string_value: "http://127.0.0.1:8100/v1" }' in config
    assert 'key: "llm_protocol", value: { string_value: "tensorrt_llm" }' in config


# ----- a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openai_server(llm_dir, tmp_path_factory):
    """``cosyserve.llm.openai_server`` on the tiny LLM: (base url, log file)."""
    yield from serve_openai_llm(llm_dir, tmp_path_factory.mktemp("openai_llm") / "llm.log", max_slots=4)


@pytest.fixture(scope="module")
def server(tiny_bundle, openai_server, tmp_path_factory):
    """``cosyvoice2``, the engine, taking its tokens from ``tensorrt_llm`` (our llm model under that
    name) in TensorRT-LLM's full form (llm_protocol set), ``cosyvoice2_offline`` forwarding to it;
    ``cosyvoice2_openai``, a second engine, on the OpenAI server."""
    work = tmp_path_factory.mktemp("protocols_server")
    repo = build_model_repo(tiny_bundle, work / "repo", max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS,
                            bls_instances=1)
    (repo / "llm").rename(repo / "tensorrt_llm")
    llm_config = repo / "tensorrt_llm" / "config.pbtxt"
    llm_config.write_text(llm_config.read_text().replace('name: "llm"', 'name: "tensorrt_llm"'))
    shutil.copytree(repo / "cosyvoice2", repo / "cosyvoice2_openai")
    openai_config = repo / "cosyvoice2_openai" / "config.pbtxt"
    openai_config.write_text(openai_config.read_text().replace('name: "cosyvoice2"', 'name: "cosyvoice2_openai"'))
    set_parameter(openai_config, "llm_url", openai_server[0])  # llm_model_name stays "llm": there is none
    set_parameter(repo / "cosyvoice2" / "config.pbtxt", "llm_model_name", "tensorrt_llm")  # cosyvoice2_offline forwards there
    set_parameter(repo / "cosyvoice2" / "config.pbtxt", "llm_protocol", "tensorrt_llm")
    yield from serve_repo(repo, work)


def test_bls_speaks_tensorrt_llm_protocol_to_the_llm_model(idle_server):
    before = metrics(idle_server.metrics_port)
    chunks = stream_tts(idle_server, [grpc_input("target_text", "你好，世界。")], "cosyvoice2")
    assert [c.size for c in chunks] == expected_chunk_samples(NUM_TOKENS)
    offline = grpcclient.InferenceServerClient(idle_server.grpc_url).infer(
        "cosyvoice2_offline", [grpc_input("target_text", "今天天气不错。")]).as_numpy("waveform")
    assert offline.shape == (1, NUM_TOKENS * SAMPLES_PER_TOKEN) and np.isfinite(offline).all()
    after = wait_until_idle(idle_server.metrics_port)
    # Both came from the tensorrt_llm model, in TensorRT-LLM's full form, which it checked.
    assert after["cosyserve_llm_generated_tokens_total"] - before["cosyserve_llm_generated_tokens_total"] == \
        2 * NUM_TOKENS
    assert after[TRTLLM_REQUESTS] - before[TRTLLM_REQUESTS] == 2


def llm_request(bias: np.ndarray, **changes) -> list:
    """A direct request to the server's ``tensorrt_llm`` in TensorRT-LLM's full form; ``changes``
    replace (array) or leave out (None) inputs."""
    inputs = TritonLLMInputs("cosyserve", REFERENCE_SAMPLING, streaming=False).generate([SOS_ID, 100, TASK_ID], 6, 6)
    inputs.update(embedding_bias=bias[None], stop_words_list=triton_stop_words_list(),
                  seed=np.array([[7]], np.uint64), random_seed=np.array([[7]], np.uint64))
    inputs.update(changes)
    return [grpc_input(name, value) for name, value in inputs.items() if value is not None]


def call_llm(server, inputs: list) -> list[int]:
    stream = Stream(server.grpc_url)
    try:
        stream.send("tensorrt_llm", inputs, outputs=("output_ids", "sequence_length"))
        return [int(t) for ids in stream.responses("output_ids") for t in ids.reshape(-1)]
    finally:
        stream.close()


def test_llm_model_checks_what_a_tensorrt_llm_caller_sends(idle_server, head_bias):
    before = metrics(idle_server.metrics_port)[TRTLLM_REQUESTS]
    tokens = call_llm(idle_server, llm_request(head_bias))
    assert len(tokens) == 6
    assert call_llm(idle_server, llm_request(np.zeros_like(head_bias))) == tokens  # zeros: nothing added
    # The seed under either name; the request without `seed` is not in TensorRT-LLM's full form.
    assert call_llm(idle_server, llm_request(head_bias, random_seed=None)) == tokens
    assert call_llm(idle_server, llm_request(head_bias, seed=None)) == tokens
    eight = np.array([[8]], np.uint64)
    assert call_llm(idle_server, llm_request(head_bias, seed=eight, random_seed=eight)) != tokens
    assert metrics(idle_server.metrics_port)[TRTLLM_REQUESTS] - before == 4
    other = head_bias.copy()
    other[head_bias > MASKED_LOGIT] += 0.5
    bad = {
        f"embedding_bias has shape \\[1, {head_bias.size - 1}\\]": dict(embedding_bias=head_bias[None, 1:]),
        "neither zeros nor the lm_head bias": dict(embedding_bias=other[None]),
        "stop at": dict(stop_words_list=np.array([[[EOS_IDS[1]], [1]]], np.int32)),
        "seed 9 and random_seed 7 differ": dict(seed=np.array([[9]], np.uint64)),
    }
    for message, changes in bad.items():
        with pytest.raises(InferenceServerException, match=message):
            call_llm(idle_server, llm_request(head_bias, **changes))
    assert metrics(idle_server.metrics_port)[TRTLLM_REQUESTS] - before == 4


def test_openai_mode_streams_the_planned_chunks(idle_server):
    chunks = stream_tts(idle_server, [grpc_input("target_text", "Hello there.")], "cosyvoice2_openai")
    assert [c.size for c in chunks] == expected_chunk_samples(NUM_TOKENS)
    assert all(np.isfinite(c).all() for c in chunks)
    shorter = stream_tts(idle_server, [grpc_input("target_text", "好"), *token_limits(18)], "cosyvoice2_openai")
    assert [c.size for c in shorter] == expected_chunk_samples(18)


def test_openai_mode_cancel_stops_the_generation_on_the_server(idle_server, openai_server):
    log = openai_server[1]
    went_away = log.read_text().count("went away")
    stream = Stream(idle_server.grpc_url)
    stream.send("cosyvoice2_openai", [grpc_input("target_text", "你好"), *token_limits(LONG_TOKENS)])
    result, error = stream.next()
    assert error is None and result.as_numpy("waveform").size > 0
    wait_for(lambda: metrics(idle_server.metrics_port)["cosyserve_token2wav_open_streams"] == 1,
             "the stream open in the engine", timeout_s=5)  # its gauges reach Triton a stats period later
    stream.close(cancel=True)
    deadline = time.monotonic() + 20
    while log.read_text().count("went away") == went_away and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text().count("went away") == went_away + 1, "the server's generation was not stopped"
    assert wait_until_idle(idle_server.metrics_port, timeout_s=10)["cosyserve_token2wav_open_streams"] == 0
    after = stream_tts(idle_server, [grpc_input("target_text", "好")], "cosyvoice2_openai")
    assert sum(c.size for c in after) == NUM_TOKENS * SAMPLES_PER_TOKEN

