"""TensorRT-LLM support, tested without TensorRT-LLM: checkpoint layout, head bias, Triton template, fail-fast.

The layout test runs the converted tensors through a plain-torch reading of TensorRT-LLM's Qwen
layers (fused qkv, GatedMLP with fc = SiLU input and gate = multiplier) and checks the logits
plus the per-request embedding bias against transformers on the HuggingFace checkpoint.
"""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cosyserve.bundle.llm import write_llm_bundle
from cosyserve.errors import InvalidInputError, ModelLoadError, RequestCancelledError
from cosyserve.llm.base import BackendUnavailableError
from cosyserve.llm.prompt import EOS_IDS, OUTPUT_WINDOW_SIZE, OUTPUT_WINDOW_START, SOS_ID, SPEECH_TOKEN_OFFSET
from cosyserve.llm.sampling import SamplingParams
from cosyserve.llm.trtllm_backend import TrtllmBackend, sampling_config_kwargs, stop_kwargs
from cosyserve.llm.trtllm.convert import (
    pad_rows, padded_vocab_size, rank_weights, read_hf_config, resolve_dtype, verify_checkpoint, write_checkpoint)
from cosyserve.llm.trtllm.request import MASKED_LOGIT, embedding_bias, triton_stop_words_list

REPO = Path(__file__).resolve().parents[1]
WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)
HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
no_trtllm = pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed: the fail-fast path cannot be exercised")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_llm_bundle(tmp_path_factory.mktemp("trtllm") / "cosyvoice2_llm", "tiny", 0)


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trtllm") / "ckpt_tp1"
    write_checkpoint(hf_dir, out, "auto", tp_size=1)
    return out


def hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(hf_dir / "model.safetensors"))


# ---- checkpoint layout ------------------------------------------------------------------------
def test_config_has_the_fields_trtllm_qwen_reads(ckpt, hf_dir):
    config = json.loads((ckpt / "config.json").read_text())
    hf = json.loads((hf_dir / "config.json").read_text())
    assert config["architecture"] == "Qwen2ForCausalLM" and config["qwen_type"] == "qwen2"
    assert config["vocab_size"] == hf["vocab_size"] == 158336
    assert config["dtype"] == "bfloat16" and config["logits_dtype"] == "float32"
    assert (config["attn_bias"], config["mlp_bias"], config["tie_word_embeddings"]) == (True, False, False)
    assert config["head_size"] == hf["hidden_size"] // hf["num_attention_heads"]
    assert config["rotary_base"] == hf["rope_theta"] and config["norm_epsilon"] == hf["rms_norm_eps"]
    assert config["position_embedding_type"] == "rope_gpt_neox" and config["hidden_act"] == "silu"
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}


def test_rank_file_has_exactly_the_qwen_tensors(ckpt, hf_dir):
    weights = load_file(str(ckpt / "rank0.safetensors"))
    _, cfg = read_hf_config(hf_dir)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    expected = {"transformer.vocab_embedding.weight": (158336, cfg.hidden_size),
                "transformer.ln_f.weight": (cfg.hidden_size,), "lm_head.weight": (158336, cfg.hidden_size)}
    for i in range(cfg.num_layers):
        p = f"transformer.layers.{i}."
        expected.update({p + "input_layernorm.weight": (cfg.hidden_size,),
                         p + "post_layernorm.weight": (cfg.hidden_size,),
                         p + "attention.qkv.weight": (qkv, cfg.hidden_size), p + "attention.qkv.bias": (qkv,),
                         p + "attention.dense.weight": (cfg.hidden_size, cfg.hidden_size),
                         p + "mlp.fc.weight": (cfg.intermediate_size, cfg.hidden_size),
                         p + "mlp.gate.weight": (cfg.intermediate_size, cfg.hidden_size),
                         p + "mlp.proj.weight": (cfg.hidden_size, cfg.intermediate_size)})
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "lm_head.bias" not in weights  # TensorRT-LLM's Qwen head has no bias: it goes per request


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_neox(x, theta):  # x: (heads, seq, dim); rotate_half convention ("rope_gpt_neox")
    dim, seq = x.shape[-1], x.shape[-2]
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = torch.cat([freqs.cos()] * 2, -1).float(), torch.cat([freqs.sin()] * 2, -1).float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def trtllm_layout_logits(weights: dict, config: dict, ids: list[int]) -> torch.Tensor:
    """Logits of TensorRT-LLM's Qwen2 graph (as its layers are defined) on the checkpoint tensors."""
    w = {k: v.float() for k, v in weights.items()}
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_size"]
    eps = config["norm_epsilon"]
    x = w["transformer.vocab_embedding.weight"][torch.tensor(ids)]
    seq = len(ids)
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qkv = h @ w[p + "attention.qkv.weight"].T + w[p + "attention.qkv.bias"]
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q = _rope_neox(q.view(seq, heads, dim).transpose(0, 1), config["rotary_base"])
        k = _rope_neox(k.view(seq, kv_heads, dim).transpose(0, 1), config["rotary_base"])
        v = v.view(seq, kv_heads, dim).transpose(0, 1)
        k, v = (t.repeat_interleave(heads // kv_heads, 0) for t in (k, v))
        attn = torch.softmax(q @ k.transpose(1, 2) / dim ** 0.5 + causal, -1) @ v
        x = x + attn.transpose(0, 1).reshape(seq, heads * dim) @ w[p + "attention.dense.weight"].T
        h = _rms_norm(x, w[p + "post_layernorm.weight"], eps)
        inter = torch.nn.functional.silu(h @ w[p + "mlp.fc.weight"].T) * (h @ w[p + "mlp.gate.weight"].T)
        x = x + inter @ w[p + "mlp.proj.weight"].T
    return _rms_norm(x, w["transformer.ln_f.weight"], eps) @ w["lm_head.weight"].T


def test_layout_plus_embedding_bias_reproduces_the_hf_model(ckpt, hf_dir):
    from cosyserve.llm.hf_reference import load_hf_model

    config = json.loads((ckpt / "config.json").read_text())
    ids = [SOS_ID, 1000, 1001, 1002, 158228, SPEECH_TOKEN_OFFSET + 5, SPEECH_TOKEN_OFFSET + 17]
    got = trtllm_layout_logits(load_file(str(ckpt / "rank0.safetensors")), config, ids) + embedding_bias(hf_dir)
    with torch.inference_mode():
        want = load_hf_model(hf_dir, "cpu", torch.float32)(input_ids=torch.tensor([ids])).logits[0]
    assert torch.allclose(got[:, WINDOW], want[:, WINDOW], rtol=1e-4, atol=1e-4), \
        (got[:, WINDOW] - want[:, WINDOW]).abs().max()
    outside = torch.ones(got.shape[1], dtype=torch.bool)
    outside[WINDOW] = False
    assert (want[:, outside] == float("-inf")).all()
    assert (got[:, outside] < MASKED_LOGIT / 2).all()  # as impossible to sample as -inf
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_tensor_parallel_shards_reassemble_the_full_tensors(ckpt, hf_dir):
    full = load_file(str(ckpt / "rank0.safetensors"))
    state, (_, cfg) = hf_state(hf_dir), read_hf_config(hf_dir)
    ranks = [rank_weights(state, cfg, "bfloat16", 2, r) for r in range(2)]
    sizes = [cfg.num_heads * cfg.head_dim // 2, cfg.num_kv_heads * cfg.head_dim // 2, cfg.num_kv_heads * cfg.head_dim // 2]
    for name, tensor in full.items():
        parts = [r[name] for r in ranks]
        if name.endswith(("qkv.weight", "qkv.bias")):  # each rank: its q rows, then its k rows, then its v rows
            split = [p.split(sizes) for p in parts]
            rebuilt = torch.cat([torch.cat([s[j] for s in split]) for j in range(3)])
        elif name.endswith(("dense.weight", "proj.weight")):  # row-parallel: split on input features
            rebuilt = torch.cat(parts, dim=1)
        elif name.endswith(("fc.weight", "gate.weight")) or name == "lm_head.weight":
            rebuilt = torch.cat(parts, dim=0)
        else:  # replicated
            assert torch.equal(parts[0], parts[1])
            rebuilt = parts[0]
        assert torch.equal(rebuilt, tensor), name


def test_vocabulary_padding_for_tensor_parallelism():
    assert padded_vocab_size(158336, 1) == padded_vocab_size(158336, 8) == 158336  # 1237 * 128
    assert padded_vocab_size(158336, 3) == 158337
    padded = pad_rows(torch.ones(5, 2), 6)
    assert padded.shape == (6, 2) and torch.equal(padded[5], torch.zeros(2))
    with pytest.raises(InvalidInputError):
        pad_rows(torch.ones(5, 2), 4)


def test_tp_size_must_divide_heads(hf_dir):
    state, (_, cfg) = hf_state(hf_dir), read_hf_config(hf_dir)
    with pytest.raises(InvalidInputError, match="tp_size 3 does not divide num_attention_heads"):
        rank_weights(state, cfg, "bfloat16", 3, 0)


def test_resolve_dtype():
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}) == "float16"  # TensorRT-LLM's rule
    assert resolve_dtype("float32", {}) == "float32"
    with pytest.raises(InvalidInputError, match="int8"):
        resolve_dtype("int8", {})


def test_embedding_bias_is_the_head_bias_with_finite_masks(hf_dir):
    bias = embedding_bias(hf_dir)
    want = hf_state(hf_dir)["lm_head.bias"].float()
    assert bias.shape == (158336,) and bias.dtype == torch.float32
    assert torch.equal(bias[WINDOW], want[WINDOW])
    assert torch.isfinite(bias).all() and (bias[:OUTPUT_WINDOW_START] == MASKED_LOGIT).all()
    assert (bias[WINDOW.stop:] == MASKED_LOGIT).all()
    assert embedding_bias(hf_dir, torch.float16).dtype == torch.float16


def _copy_with_state(hf_dir: Path, out: Path, state: dict) -> Path:
    out.mkdir()
    shutil.copy(hf_dir / "config.json", out / "config.json")
    save_file(state, str(out / "model.safetensors"))
    return out


def test_checkpoint_without_head_bias_is_refused(hf_dir, tmp_path):
    state = hf_state(hf_dir)
    del state["lm_head.bias"]
    stock = _copy_with_state(hf_dir, tmp_path / "stock", state)
    with pytest.raises(ModelLoadError, match="no lm_head.bias"):
        write_checkpoint(stock, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_head_bias_finite_outside_speech_rows_is_refused(hf_dir, tmp_path):
    state = hf_state(hf_dir)
    state["lm_head.bias"] = torch.zeros_like(state["lm_head.bias"])  # what a stock-HF round trip writes back
    with pytest.raises(ModelLoadError, match="finite outside the speech"):
        write_checkpoint(_copy_with_state(hf_dir, tmp_path / "zero", state), tmp_path / "out")


def test_verify_catches_a_misplaced_head_and_a_wrong_vocab(ckpt, hf_dir, tmp_path):
    assert verify_checkpoint(ckpt, hf_dir)["vocab_size"] == 158336
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    weights = load_file(str(broken / "rank0.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"].roll(1, 0)  # speech rows off by one
    save_file(weights, str(broken / "rank0.safetensors"))
    with pytest.raises(ModelLoadError, match="lm_head.weight is not rank 0"):
        verify_checkpoint(broken, hf_dir)
    config = json.loads((ckpt / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "vocab_size": 151936}))
    with pytest.raises(ModelLoadError, match="vocab_size is 151936, expected 158336"):
        verify_checkpoint(broken, hf_dir)


# ---- command lines and fail-fast ---------------------------------------------------------------
def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_convert_script_with_own_converter(hf_dir, tmp_path):
    out = tmp_path / "ckpt"
    result = run_script("convert_checkpoint.py", "--model_dir", str(hf_dir), "--output_dir", str(out),
                        "--dtype", "bfloat16", "--tp_size", "2", "--converter", "cosyserve")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    assert "checked against the HuggingFace weights" in result.stdout


@no_trtllm
def test_convert_script_fails_fast_without_tensorrt_llm(hf_dir, tmp_path):
    result = run_script("convert_checkpoint.py", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "o"),
                        "--converter", "tensorrt_llm")
    assert result.returncode == 2
    assert "pip install tensorrt_llm" in result.stderr and "trtllm-python-py3" in result.stderr


@no_trtllm
def test_test_llm_script_fails_fast_without_tensorrt_llm(hf_dir, tmp_path):
    result = run_script("test_llm.py", "--engine_dir", str(tmp_path), "--tokenizer_dir", str(hf_dir))
    assert result.returncode == 2
    assert "'trtllm' LLM backend needs the tensorrt_llm package" in result.stderr


@no_trtllm
def test_trtllm_backend_fails_fast_without_tensorrt_llm(hf_dir, tmp_path):
    with pytest.raises(BackendUnavailableError, match="pip install tensorrt_llm"):
        TrtllmBackend(hf_dir, "cuda", engine_dir=tmp_path)


# ---- request mapping and the response loop (fake executor) ------------------------------------
def test_sampling_config_mapping():
    reference = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, min_tokens=3)
    assert sampling_config_kwargs(reference, 42) == {
        "beam_width": 1, "top_k": 50, "top_p": 0.95, "temperature": 0.8, "repetition_penalty": 1.1,
        "min_tokens": 3, "seed": 42}
    greedy = sampling_config_kwargs(SamplingParams.greedy(top_k=0), 1)
    assert (greedy["top_k"], greedy["temperature"], greedy["repetition_penalty"]) == (1, None, None)
    assert sampling_config_kwargs(SamplingParams(top_k=0), 1)["top_k"] is None  # 0 = no limit
    with pytest.raises(InvalidInputError, match="1024"):
        sampling_config_kwargs(SamplingParams(top_k=2000), 1)
    assert stop_kwargs(SamplingParams()) == {"end_id": EOS_IDS[0], "stop_words": [[EOS_IDS[1]], [EOS_IDS[2]]],
                                             "bad_words": None}
    ignoring = stop_kwargs(SamplingParams(ignore_eos=True))
    assert ignoring["end_id"] == SOS_ID and ignoring["bad_words"] == [[t] for t in EOS_IDS]


class FakeExecutor:
    """Executor stand-in: enqueued requests get scripted streaming responses."""

    def __init__(self, script):
        self.script, self.requests, self.cancelled, self.pending = script, [], [], []

    def enqueue_request(self, request):
        self.requests.append(request)
        request_id = len(self.requests)
        for tokens, final, reason in self.script(request):
            result = types.SimpleNamespace(output_token_ids=[tokens], is_final=final,
                                           finish_reasons=[types.SimpleNamespace(name=reason)])
            self.pending.append(types.SimpleNamespace(request_id=request_id, has_error=lambda: False, result=result))
        return request_id

    def await_responses(self, timeout):
        responses, self.pending = self.pending, []
        return responses

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)

    def shutdown(self):
        pass


@pytest.fixture
def fake_backend(hf_dir):
    def make(script):
        backend = TrtllmBackend.__new__(TrtllmBackend)
        backend._trtllm = types.SimpleNamespace(Request=lambda **kw: kw, SamplingConfig=lambda **kw: kw,
                                                OutputConfig=lambda **kw: kw)
        backend.enable_kv_cache_reuse = True
        backend._start(FakeExecutor(script), 158336, 1000, 1024, embedding_bias(hf_dir))
        return backend
    return make


def test_backend_streams_speech_tokens_and_stops_at_eos(fake_backend):
    s = SPEECH_TOKEN_OFFSET
    backend = fake_backend(lambda r: [([s + 3, s + 4], False, "NOT_FINISHED"), ([s + 6560, EOS_IDS[1]], True, "STOP_WORDS")])
    with backend:
        stream = backend.generate_stream([SOS_ID, 10, 158228], SamplingParams(seed=7, max_tokens=100))
        assert list(stream) == [3, 4, 6560] and stream.finish_reason == "stop"
        request = backend.executor.requests[0]
        assert request["input_token_ids"] == [SOS_ID, 10, 158228] and request["max_tokens"] == 100
        assert request["streaming"] and request["output_config"] == {"exclude_input_from_output": True}
        assert request["sampling_config"]["seed"] == 7 and request["embedding_bias"].shape == (158336,)
        assert request["end_id"] == EOS_IDS[0] and request["stop_words"] == [[EOS_IDS[1]], [EOS_IDS[2]]]


def test_backend_reports_length_and_clamps_to_the_engine(fake_backend):
    backend = fake_backend(lambda r: [([SPEECH_TOKEN_OFFSET + 1], True, "LENGTH")])
    with backend:
        stream = backend.generate_stream(list(range(1000)), SamplingParams(max_tokens=500))
        assert list(stream) == [1] and stream.finish_reason == "length"
        assert backend.executor.requests[0]["max_tokens"] == 24  # max_seq_len 1024 - 1000 prompt tokens
        with pytest.raises(InvalidInputError, match="at most 1000"):
            backend.generate_stream(list(range(1001)), SamplingParams())


def test_backend_fails_a_request_that_samples_text(fake_backend):
    backend = fake_backend(lambda r: [([SPEECH_TOKEN_OFFSET + 2, 1234], False, "NOT_FINISHED")])
    with backend:
        stream = backend.generate_stream([1, 2], SamplingParams())
        assert next(stream) == 2
        with pytest.raises(RuntimeError, match="token 1234, which is neither speech nor end of speech"):
            next(stream)


def test_backend_cancel(fake_backend):
    backend = fake_backend(lambda r: [])
    with backend:
        stream = backend.generate_stream([1, 2], SamplingParams(), request_id="r1")
        with pytest.raises(InvalidInputError, match="already in use"):
            backend.generate_stream([1, 2], SamplingParams(), request_id="r1")
        assert backend.cancel("r1") and not backend.cancel("r1")
        assert backend.executor.cancelled == [1]
        with pytest.raises(RequestCancelledError):
            list(stream)


# ---- Triton template ---------------------------------------------------------------------------
# The substitutions NVIDIA's CosyVoice run.sh stage 2 passes for its tensorrt_llm model.
REFERENCE_FILL = ("triton_backend:tensorrtllm,triton_max_batch_size:16,decoupled_mode:True,max_beam_width:1,"
                  "engine_dir:/engines/x,max_tokens_in_paged_kv_cache:2560,max_attention_window_size:2560,"
                  "kv_cache_free_gpu_mem_fraction:0.5,exclude_input_in_output:True,enable_kv_cache_reuse:False,"
                  "batching_strategy:inflight_fused_batching,max_queue_delay_microseconds:0,"
                  "encoder_input_features_data_type:TYPE_FP16,logits_datatype:TYPE_FP32")


def parse_model_config(text: str):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    text_format = pytest.importorskip("google.protobuf.text_format")
    return text_format.Parse(text, model_config_pb2.ModelConfig()), model_config_pb2


def tensors(config, pb2, kind: str) -> dict[str, str]:
    return {t.name: pb2.DataType.Name(t.data_type) for t in getattr(config, kind)}


def test_tensorrt_llm_template_fills_with_the_reference_keys_and_matches_the_llm_model(tmp_path):
    template = REPO / "model_repo" / "tensorrt_llm" / "config.pbtxt"
    filled = tmp_path / "config.pbtxt"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "fill_template.py"), str(template),
                             REFERENCE_FILL, "--output", str(filled)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    config, pb2 = parse_model_config(filled.read_text())
    assert config.backend == "tensorrtllm" and config.max_batch_size == 16
    assert config.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["gpt_model_path"] == "/engines/x" and params["gpt_model_type"] == "inflight_fused_batching"
    assert params["max_attention_window_size"] == "2560" and params["exclude_input_in_output"] == "True"
    inputs, outputs = tensors(config, pb2, "input"), tensors(config, pb2, "output")
    assert inputs["embedding_bias"] == "TYPE_FP32" and inputs["stop_words_list"] == "TYPE_INT32"
    assert inputs["seed"] == inputs["random_seed"] == "TYPE_UINT64"
    assert outputs["generation_logits"] == "TYPE_FP32" and inputs["encoder_input_features"] == "TYPE_FP16"
    required = {"input_ids", "input_lengths", "request_output_len"}
    assert {t.name for t in config.input if not t.optional} == required

    llm_template = REPO / "model_repo" / "llm" / "config.pbtxt"
    if not llm_template.exists():
        pytest.skip("model_repo/llm/config.pbtxt is not there to compare with")
    llm, _ = parse_model_config(re.sub(r"\$\{[^}]*\}", "1", llm_template.read_text()))
    llm_inputs, llm_outputs = tensors(llm, pb2, "input"), tensors(llm, pb2, "output")
    assert {k: inputs.get(k) for k in llm_inputs} == llm_inputs
    assert {k: outputs.get(k) for k in llm_outputs} == llm_outputs


def test_triton_stop_words_list_is_trtllm_offsets_format():
    words = triton_stop_words_list()
    assert words.dtype == np.int32 and words.shape == (1, 2, 2)
    assert words[0, 0].tolist() == [EOS_IDS[1], EOS_IDS[2]] and words[0, 1].tolist() == [1, 2]


@no_trtllm
def test_backend_registry_fails_fast_without_tensorrt_llm(hf_dir, tmp_path):
    from cosyserve.llm.backends import create_backend

    with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
        create_backend("trtllm", hf_dir, "cuda", None, engine_dir=tmp_path)
