"""Random-weight stand-ins for the two ONNX front-end models (``speech_tokenizer_v2.onnx``,
``campplus.onnx``), built node by node with the ``onnx`` helper API.

The released graphs cannot be downloaded here. These files reproduce their *interfaces*
exactly (input/output names, dtypes, shapes, value ranges; llm_layout.md §6) so that the
serving code, which reads names from the session by position like upstream, is exercised for
real. The graph bodies are simplified stand-ins, NOT the real topologies: ``real`` only gives
parameter counts and layer widths of the released models' order of magnitude (S3 tokenizer
v2 ~ 124 M parameters, CAM++ ~ 7 M) so that timings are roughly representative; ``tiny``
builds in milliseconds for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..frontend.onnx_models import SPEAKER_EMBEDDING_DIM

SIZES = ("tiny", "real")
OPSET = 17  # LayerNormalization; widely supported by onnxruntime and TensorRT
IR_VERSION = 8  # the IR version that goes with opset 17
FSQ_DIMS = 8  # S3 tokenizer v2: 8 dims x 3 levels = 6561 codes
FSQ_LEVELS = 3


class _GraphBuilder:
    """Accumulates nodes and random initialisers; every helper returns its output's name."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def _fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, value: np.ndarray, prefix: str = "const") -> str:
        name = self._fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape: tuple[int, ...], fan_in: int) -> str:
        value = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(fan_in))
        return self.const(value, "w")

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = self._fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, d_in: int, d_out: int) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight((d_in, d_out), d_in)),
                       self.const(np.zeros(d_out, np.float32), "b"))

    def layer_norm(self, x: str, dim: int) -> str:
        return self.op("LayerNormalization", x, self.const(np.ones(dim, np.float32), "ln_g"),
                       self.const(np.zeros(dim, np.float32), "ln_b"), axis=-1, epsilon=1e-5)

    def conv1d(self, x: str, c_in: int, c_out: int, kernel: int, stride: int = 1) -> str:
        return self.op("Conv", x, self.weight((c_out, c_in, kernel), c_in * kernel),
                       self.const(np.zeros(c_out, np.float32), "b"),
                       kernel_shape=[kernel], strides=[stride], pads=[kernel // 2, kernel // 2])

    def gelu(self, x: str) -> str:
        erf = self.op("Erf", self.op("Div", x, self.const(np.float32(math.sqrt(2.0)))))
        return self.op("Mul", self.op("Mul", x, self.const(np.float32(0.5))),
                       self.op("Add", erf, self.const(np.float32(1.0))))

    def self_attention(self, x: str, dim: int, heads: int) -> str:
        """Multi-head self-attention over (B, T, dim) with fused q/k/v projection."""
        head_dim = dim // heads
        q, k, v = (self.op("Reshape", part, self.const(np.array([0, 0, heads, head_dim], np.int64)))
                   for part in self._split3(self.linear(x, dim, 3 * dim), dim))
        q = self.op("Transpose", q, perm=[0, 2, 1, 3])  # (B, H, T, d)
        k = self.op("Transpose", k, perm=[0, 2, 3, 1])  # (B, H, d, T)
        v = self.op("Transpose", v, perm=[0, 2, 1, 3])
        scores = self.op("Mul", self.op("MatMul", q, k), self.const(np.float32(1.0 / math.sqrt(head_dim))))
        context = self.op("MatMul", self.op("Softmax", scores, axis=-1), v)
        context = self.op("Reshape", self.op("Transpose", context, perm=[0, 2, 1, 3]),
                          self.const(np.array([0, 0, dim], np.int64)))
        return self.linear(context, dim, dim)

    def _split3(self, x: str, dim: int) -> list[str]:
        outs = [self._fresh("split") for _ in range(3)]
        self.nodes.append(helper.make_node("Split", [x, self.const(np.array([dim] * 3, np.int64))], outs, axis=-1))
        return outs

    def transformer_block(self, x: str, dim: int, heads: int, ffn_dim: int) -> str:
        x = self.op("Add", x, self.self_attention(self.layer_norm(x, dim), dim, heads))
        ffn = self.linear(self.gelu(self.linear(self.layer_norm(x, dim), dim, ffn_dim)), ffn_dim, dim)
        return self.op("Add", x, ffn)

    def save(self, path: str | Path, inputs: list, outputs: list, name: str, doc: str,
             metadata: dict[str, str]) -> Path:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="cosyserve", doc_string=doc)
        model.ir_version = IR_VERSION
        helper.set_model_props(model, metadata)
        onnx.checker.check_model(model)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, path)
        return path


@dataclass(frozen=True)
class _TokenizerSize:
    dim: int
    heads: int
    layers: int
    ffn_dim: int


@dataclass(frozen=True)
class _CampplusSize:
    channels: int
    blocks: int


# 'real' follows the released S3 tokenizer v2 widths (Whisper-style encoder, 1280 wide, 20
# heads, 6 layers) and a CAM++-sized conv stack; 'tiny' is for tests.
_TOKENIZER_SIZES = {"tiny": _TokenizerSize(32, 2, 1, 64), "real": _TokenizerSize(1280, 20, 6, 5120)}
_CAMPPLUS_SIZES = {"tiny": _CampplusSize(32, 1), "real": _CampplusSize(512, 9)}


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def write_speech_tokenizer_onnx(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a stand-in ``speech_tokenizer_v2.onnx`` with the real I/O contract.

    Inputs: ``feats`` float32 (1, 128, T) Whisper log-mel, ``feats_length`` int32 (1,) = T.
    Output: ``indices`` int32 (1, T') with T' = ceil(ceil(L/2)/2) for L = feats_length (two
    stride-2 convolutions; frames past L are padding), codes in [0, 6561).
    Body (simplified stand-in, not the real topology): two stride-2 Conv1d + GELU, pre-norm
    transformer blocks, a projection to 8 dims quantised like S3 tokenizer v2's FSQ:
    round(tanh(z)) in {-1, 0, 1} -> +1 -> base-3 digits -> index.
    """
    _check_size(size)
    cfg = _TOKENIZER_SIZES[size]
    g = _GraphBuilder(seed)
    h = g.gelu(g.conv1d("feats", 128, cfg.dim, 3, stride=2))
    h = g.gelu(g.conv1d(h, cfg.dim, cfg.dim, 3, stride=2))
    h = g.op("Transpose", h, perm=[0, 2, 1])  # (1, T', dim)
    for _ in range(cfg.layers):
        h = g.transformer_block(h, cfg.dim, cfg.heads, cfg.ffn_dim)
    # Random weights map every frame near one common direction; removing the time mean lets
    # the codes follow the input's variation over time (real tokens vary frame to frame).
    h = g.op("Sub", h, g.op("ReduceMean", h, axes=[1], keepdims=1))
    z = g.linear(g.layer_norm(h, cfg.dim), cfg.dim, FSQ_DIMS)
    digits = g.op("Add", g.op("Round", g.op("Tanh", z)), g.const(np.float32(1.0)))
    powers = (FSQ_LEVELS ** np.arange(FSQ_DIMS, dtype=np.float32))[:, None]
    codes = g.op("Squeeze", g.op("MatMul", digits, g.const(powers)), g.const(np.array([2], np.int64)))
    codes = g.op("Cast", codes, to=TensorProto.INT32)  # exact: codes < 6561 are exact in float32
    # Valid output frames from the valid input length: ceil(ceil(L / 2) / 2).
    one, two = g.const(np.array([1], np.int32)), g.const(np.array([2], np.int32))
    valid = g.op("Div", g.op("Add", g.op("Div", g.op("Add", "feats_length", one), two), one), two)
    g.nodes.append(helper.make_node(
        "Slice", [codes, g.const(np.array([0], np.int64)), g.op("Cast", valid, to=TensorProto.INT64),
                  g.const(np.array([1], np.int64))], ["indices"]))
    return g.save(
        path,
        inputs=[helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
                helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "T_tokens"])],
        name="speech_tokenizer_v2_stand_in",
        doc="cosyserve random-weight stand-in for speech_tokenizer_v2.onnx: real I/O, simplified body.",
        metadata={"cosyserve.stand_in": "true", "size": size, "seed": str(seed)},
    )


def write_campplus_onnx(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a stand-in ``campplus.onnx`` with the real I/O contract.

    Input: ``input`` float32 (B, frames, 80) mean-normalised Kaldi fbank. Output: ``output``
    float32 (B, 192) speaker embedding (not normalised; the flow normalises it).
    Body (simplified stand-in, not the real CAM++ topology): Conv1d stem, residual Conv1d +
    ReLU blocks, statistics pooling (mean and standard deviation over time), linear 192.
    """
    _check_size(size)
    cfg = _CAMPPLUS_SIZES[size]
    g = _GraphBuilder(seed)
    h = g.op("Relu", g.conv1d(g.op("Transpose", "input", perm=[0, 2, 1]), 80, cfg.channels, 5))
    for _ in range(cfg.blocks):
        h = g.op("Add", h, g.op("Relu", g.conv1d(h, cfg.channels, cfg.channels, 3)))
    mean = g.op("ReduceMean", h, axes=[2], keepdims=1)
    variance = g.op("ReduceMean", g.op("Pow", g.op("Sub", h, mean), g.const(np.float32(2.0))), axes=[2], keepdims=0)
    std = g.op("Sqrt", g.op("Add", variance, g.const(np.float32(1e-5))))
    pooled = g.op("Concat", g.op("Squeeze", mean, g.const(np.array([2], np.int64))), std, axis=1)
    embedding = g.linear(pooled, 2 * cfg.channels, SPEAKER_EMBEDDING_DIM)
    g.nodes.append(helper.make_node("Identity", [embedding], ["output"]))
    return g.save(
        path,
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "frames", 80])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", SPEAKER_EMBEDDING_DIM])],
        name="campplus_stand_in",
        doc="cosyserve random-weight stand-in for campplus.onnx: real I/O, simplified body.",
        metadata={"cosyserve.stand_in": "true", "size": size, "seed": str(seed)},
    )
