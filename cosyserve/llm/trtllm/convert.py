"""CosyVoice2 LLM (HuggingFace Qwen2 layout) -> TensorRT-LLM checkpoint: mapping, tp split, checks.

A TensorRT-LLM checkpoint is a directory with ``config.json`` and one ``rank{r}.safetensors`` per
tensor-parallel rank. For ``QWenForCausalLM`` (``qwen_type`` qwen2) the tensors are::

    transformer.vocab_embedding.weight                  [vocab, hidden]          replicated
    transformer.layers.{i}.input_layernorm.weight       [hidden]                 replicated
    transformer.layers.{i}.attention.qkv.weight         [(q+k+v)/tp, hidden]     this rank's q, k, v rows
    transformer.layers.{i}.attention.qkv.bias           [(q+k+v)/tp]
    transformer.layers.{i}.attention.dense.weight       [hidden, hidden/tp]      o_proj, split on columns
    transformer.layers.{i}.post_layernorm.weight        [hidden]
    transformer.layers.{i}.mlp.fc.weight                [inter/tp, hidden]       gate_proj (the SiLU input)
    transformer.layers.{i}.mlp.gate.weight              [inter/tp, hidden]       up_proj (the multiplier)
    transformer.layers.{i}.mlp.proj.weight              [hidden, inter/tp]       down_proj
    transformer.ln_f.weight                             [hidden]
    lm_head.weight                                      [vocab_padded/tp, hidden]

(names and the fc/gate roles as in TensorRT-LLM's ``ModelWeightsLoader`` and ``GatedMLP``).

The head bias is not part of the checkpoint: TensorRT-LLM's Qwen ``lm_head`` has no bias and its
loader drops a provided ``lm_head.bias`` (with only a warning), so it is sent with every request
(:mod:`cosyserve.llm.trtllm.request`). The converters check it is there and well-formed.

``write_checkpoint`` is this package's own converter (used when TensorRT-LLM is not importable,
and by the tests); ``verify_checkpoint`` checks a checkpoint written by either converter against
the HuggingFace weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...errors import InvalidInputError, ModelLoadError
from ..models.config import Qwen2Config
from ..models.loader import read_checkpoint
from ..prompt import TOKENIZER_SIZE
from .request import lm_head_bias, read_tensor

ARCHITECTURE = "Qwen2ForCausalLM"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The engine's logits (and so the embedding bias) stay float32, TensorRT-LLM's default.
LOGITS_DTYPE = "float32"


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The head's row count in the engine: ``vocab_size`` rounded up to a multiple of ``tp_size``."""
    return -(-vocab_size // tp_size) * tp_size


def read_hf_config(llm_dir: str | Path) -> tuple[dict, Qwen2Config]:
    """The raw ``config.json`` and its validated Qwen2 view; the vocabulary must hold the speech ids."""
    llm_dir = Path(llm_dir)
    config = Qwen2Config.from_model_dir(llm_dir)
    if config.vocab_size < TOKENIZER_SIZE:
        raise ModelLoadError(f"{llm_dir}: vocab_size {config.vocab_size} < {TOKENIZER_SIZE}; this is not the "
                             "CosyVoice2 LLM with the extended speech vocabulary")
    return json.loads((llm_dir / "config.json").read_text()), config


def resolve_dtype(dtype: str, hf_config: dict) -> str:
    """``auto`` -> the checkpoint's dtype, float32 becoming float16 (TensorRT-LLM's own rule)."""
    if dtype == "auto":
        stored = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
        dtype = "float16" if stored == "float32" else stored
    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return dtype


def _check_tp(config: Qwen2Config, tp_size: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidInputError(f"tp_size must be a positive integer, got {tp_size!r}")
    for name, value in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp_size:
            raise InvalidInputError(f"tp_size {tp_size} does not divide {name} {value}; "
                                    "use a tp_size that divides the head and MLP sizes")


def checkpoint_config(hf_config: dict, config: Qwen2Config, dtype: str, tp_size: int) -> dict:
    """``config.json`` of the TensorRT-LLM checkpoint (the fields ``QWenConfig`` reads)."""
    return {
        "architecture": ARCHITECTURE,
        "qwen_type": "qwen2",
        "dtype": dtype,
        "logits_dtype": LOGITS_DTYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_size": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "norm_epsilon": config.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": config.rope_theta,
        "rotary_scaling": None,
        "max_position_embeddings": hf_config.get("max_position_embeddings", 32768),
        "seq_length": hf_config.get("seq_length", 8192),
        "use_logn_attn": False,
        "attn_bias": True,  # Qwen2 q/k/v projections have biases
        "mlp_bias": False,
        "tie_word_embeddings": False,  # the CosyVoice2 head is its own matrix
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }


def _shard(tensor: torch.Tensor, dim: int, tp_size: int, rank: int) -> torch.Tensor:
    return tensor.chunk(tp_size, dim=dim)[rank].contiguous()


def pad_rows(tensor: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """``tensor`` with extra rows of ``value`` appended up to ``rows`` (the tp vocabulary padding)."""
    if tensor.shape[0] > rows:
        raise InvalidInputError(f"cannot pad {tensor.shape[0]} rows down to {rows}")
    padding = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), value)
    return torch.cat([tensor, padding])


def rank_weights(state: dict[str, torch.Tensor], config: Qwen2Config, dtype: str, tp_size: int,
                 rank: int) -> dict[str, torch.Tensor]:
    """The tensors of ``rank{rank}.safetensors`` from the HuggingFace ``state`` (not modified)."""
    _check_tp(config, tp_size)
    torch_dtype = DTYPES[dtype]

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return state[name].to(torch_dtype)

    def column(name: str) -> torch.Tensor:  # output features split across ranks
        return _shard(get(name), 0, tp_size, rank)

    def row(name: str) -> torch.Tensor:  # input features split across ranks
        return _shard(get(name), 1, tp_size, rank)

    weights = {"transformer.vocab_embedding.weight": get("model.embed_tokens.weight").contiguous(),
               "transformer.ln_f.weight": get("model.norm.weight").contiguous()}
    for i in range(config.num_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        attn = hf + "self_attn."
        weights.update({
            trt + "input_layernorm.weight": get(hf + "input_layernorm.weight").contiguous(),
            trt + "post_layernorm.weight": get(hf + "post_attention_layernorm.weight").contiguous(),
            trt + "attention.qkv.weight": torch.cat([column(attn + f"{p}_proj.weight") for p in "qkv"]),
            trt + "attention.qkv.bias": torch.cat([column(attn + f"{p}_proj.bias") for p in "qkv"]),
            trt + "attention.dense.weight": row(attn + "o_proj.weight"),
            trt + "mlp.fc.weight": column(hf + "mlp.gate_proj.weight"),
            trt + "mlp.gate.weight": column(hf + "mlp.up_proj.weight"),
            trt + "mlp.proj.weight": row(hf + "mlp.down_proj.weight"),
        })
    head = pad_rows(get("lm_head.weight"), padded_vocab_size(config.vocab_size, tp_size))
    weights["lm_head.weight"] = _shard(head, 0, tp_size, rank)
    return weights


def write_checkpoint(llm_dir: str | Path, out_dir: str | Path, dtype: str = "auto", tp_size: int = 1) -> dict:
    """Convert with this package's mapping (no TensorRT-LLM needed); returns the written config."""
    hf_config, config = read_hf_config(llm_dir)
    dtype = resolve_dtype(dtype, hf_config)
    _check_tp(config, tp_size)
    state = read_checkpoint(llm_dir)
    lm_head_bias(state)  # refuse a checkpoint whose head bias is missing or malformed before writing
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(tp_size):
        save_file(rank_weights(state, config, dtype, tp_size, rank), str(out_dir / f"rank{rank}.safetensors"))
    trt_config = checkpoint_config(hf_config, config, dtype, tp_size)
    (out_dir / "config.json").write_text(json.dumps(trt_config, indent=4) + "\n")
    return trt_config


def verify_checkpoint(ckpt_dir: str | Path, llm_dir: str | Path) -> dict:
    """Check a TensorRT-LLM checkpoint (from either converter) against the HuggingFace weights.

    Checks the config fields this model depends on, then for every rank that the vocabulary
    embedding and this rank's head rows equal the HuggingFace ones (the speech rows at
    151663.., zero padding). Returns the checkpoint config; raises ModelLoadError on a mismatch.
    """
    ckpt_dir = Path(ckpt_dir)
    try:
        trt_config = json.loads((ckpt_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {ckpt_dir / 'config.json'}: {exc}") from exc
    _, config = read_hf_config(llm_dir)
    mapping = trt_config.get("mapping", {})
    tp_size, pp_size = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    expected = {"architecture": ARCHITECTURE, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                "num_hidden_layers": config.num_layers, "logits_dtype": LOGITS_DTYPE, "tie_word_embeddings": False}
    wrong = {k: (trt_config.get(k), v) for k, v in expected.items() if trt_config.get(k) != v}
    if wrong:
        raise ModelLoadError(f"{ckpt_dir}/config.json does not fit the CosyVoice2 LLM: "
                             + ", ".join(f"{k} is {got!r}, expected {want!r}" for k, (got, want) in wrong.items()))
    if pp_size != 1:
        raise ModelLoadError(f"{ckpt_dir}: pipeline parallelism (pp_size {pp_size}) is not supported")
    dtype = DTYPES.get(str(trt_config.get("dtype")))
    if dtype is None:
        raise ModelLoadError(f"{ckpt_dir}: dtype {trt_config.get('dtype')!r} is not one of {sorted(DTYPES)}")
    lm_head_bias(llm_dir)  # the runtime's embedding_bias comes from here
    embed = read_tensor(Path(llm_dir), "model.embed_tokens.weight")
    head = read_tensor(Path(llm_dir), "lm_head.weight")
    if embed is None or head is None:
        raise ModelLoadError(f"{llm_dir}: model.embed_tokens.weight and lm_head.weight are both needed")
    head = pad_rows(head.to(dtype), padded_vocab_size(config.vocab_size, tp_size))
    for rank in range(tp_size):
        path = ckpt_dir / f"rank{rank}.safetensors"
        if not path.exists():
            raise ModelLoadError(f"{path} is missing (tp_size {tp_size})")
        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
            for name in ("transformer.vocab_embedding.weight", "lm_head.weight"):
                if name not in names:
                    raise ModelLoadError(f"{path} has no {name}")
            if not torch.equal(handle.get_tensor("transformer.vocab_embedding.weight"), embed.to(dtype)):
                raise ModelLoadError(f"{path}: transformer.vocab_embedding.weight differs from "
                                     "model.embed_tokens.weight (speech ids would embed wrongly)")
            if not torch.equal(handle.get_tensor("lm_head.weight"), _shard(head, 0, tp_size, rank)):
                raise ModelLoadError(f"{path}: lm_head.weight is not rank {rank} of {tp_size} of the HuggingFace "
                                     "head (speech rows 151663.. misplaced or vocabulary padded differently)")
    return trt_config
