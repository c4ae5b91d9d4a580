"""Read the weights of a torch-exported ONNX graph back into the torch module it was exported from.

The released front-end models (``speech_tokenizer_v2/v3.onnx``, ``campplus.onnx``) were produced
by ``torch.onnx.export``: most initializers have anonymous names (``onnx::Conv_2216``,
``onnx::MatMul_2536``), but every node is named after the module that emitted it
(``/blocks.0/attn/query/MatMul``, ``/blocks.0/mlp/mlp.0/Add``, ``/head/layer1/layer1.0/conv1/Conv``).
So weights are found by the *consuming node's scope*, which maps back to the module's dotted
path, never by initializer name (that is also how the ``s3tokenizer`` package reads them).
Children of called containers repeat the parent's name (``mlp/mlp.0``); the prefix is dropped.

Supported layers, in the forms the exporter writes them: ``Linear`` (MatMul + Add), ``Conv1d``/
``Conv2d`` (Conv; a following BatchNorm may have been folded into it), ``LayerNorm``
(LayerNormalization, or ReduceMean/.../Mul/Add below opset 17) and ``BatchNorm`` (a
BatchNormalization node, or absent when folded into the convolution before it).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from ..errors import ModelLoadError


def module_path(node_name: str) -> str:
    """``/blocks.0/mlp/mlp.0/MatMul`` -> ``blocks.0.mlp.0`` (the op's own name is dropped)."""
    parts = [part for part in node_name.split("/")[:-1] if part]
    path: list[str] = []
    for index, part in enumerate(parts):
        parent = parts[index - 1] if index else ""
        path.append(part[len(parent) + 1:] if parent and part.startswith(parent + ".") else part)
    return ".".join(path)


class ScopedWeights:
    """The constant inputs of every node of an ONNX graph, grouped by the module that emitted it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            model = onnx.load(str(path))
        except Exception as exc:  # onnx raises its own untyped errors for bad files
            raise ModelLoadError(f"cannot read ONNX model {path}: {exc}") from exc
        constants = {init.name: init for init in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                constants[node.output[0]] = node.attribute[0].t
        # module path -> [(op_type, input position, array, node)]
        self.by_module: dict[str, list[tuple[str, int, np.ndarray, onnx.NodeProto]]] = defaultdict(list)
        for node in model.graph.node:
            if node.op_type == "Constant":
                continue
            for position, name in enumerate(node.input):
                if name in constants:
                    self.by_module[module_path(node.name)].append(
                        (node.op_type, position, numpy_helper.to_array(constants[name]), node))
        self.metadata = {prop.key: prop.value for prop in model.metadata_props}

    def _find(self, path: str, op_type: str, position: int | None = None, ndim: int | None = None,
              required: bool = True) -> np.ndarray | None:
        for op, pos, array, _ in self.by_module.get(path, ()):
            if op == op_type and (position is None or pos == position) and (ndim is None or array.ndim == ndim):
                return array
        if required:
            raise ModelLoadError(f"{self.path}: no {op_type} weight for module {path!r}; is this the right model?")
        return None

    def node(self, path: str, op_type: str) -> onnx.NodeProto | None:
        return next((node for op, _, _, node in self.by_module.get(path, ()) if op == op_type), None)

    def linear(self, path: str, bias: bool = True) -> dict[str, np.ndarray]:
        weights = {"weight": self._find(path, "MatMul", ndim=2).T}
        if bias:
            weights["bias"] = self._find(path, "Add", ndim=1)
        return weights

    def conv(self, path: str) -> dict[str, np.ndarray]:
        """Weight and, when the graph has one, bias (a folded BatchNorm gives one)."""
        weights = {"weight": self._find(path, "Conv", position=1)}
        bias = self._find(path, "Conv", position=2, required=False)
        if bias is not None:
            weights["bias"] = bias
        return weights

    def layer_norm(self, path: str) -> dict[str, np.ndarray]:
        if self.node(path, "LayerNormalization") is not None:
            return {"weight": self._find(path, "LayerNormalization", position=1),
                    "bias": self._find(path, "LayerNormalization", position=2)}
        return {"weight": self._find(path, "Mul", ndim=1), "bias": self._find(path, "Add", ndim=1)}

    def batch_norm(self, path: str) -> dict[str, np.ndarray] | None:
        """``None`` when the exporter folded this BatchNorm into the convolution before it."""
        node = self.node(path, "BatchNormalization")
        if node is None:
            return None
        scale, bias, mean, var = (self._find(path, "BatchNormalization", position=i) for i in range(1, 5))
        eps = next((attr.f for attr in node.attribute if attr.name == "epsilon"), 1e-5)
        return {"weight": scale, "bias": bias, "running_mean": mean, "running_var": var, "eps": np.float32(eps)}


def load_into(module: nn.Module, tensors: dict[str, np.ndarray], path: str, source: Path) -> None:
    """Copy ``tensors`` (name -> array) into ``module``'s parameters/buffers, checking every shape."""
    for name, array in tensors.items():
        if name == "eps":
            module.eps = float(array)
            continue
        target = getattr(module, name, None)
        if not isinstance(target, torch.Tensor):
            raise ModelLoadError(f"{source}: module {path!r} has no {name!r} to load")
        if tuple(target.shape) != array.shape:
            raise ModelLoadError(f"{source}: {path}.{name} has shape {array.shape} in the ONNX graph, "
                                 f"the model expects {tuple(target.shape)}; is this the right model size?")
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.array(array)))
