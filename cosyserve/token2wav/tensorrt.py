"""The flow estimator through ONNX and TensorRT (the reference runtime's TensorRT path).

1. :func:`export_estimator_onnx`: the estimator as ONNX in the reference's format, inputs
   ``x, mask, mu, t, spks, cond`` -> ``estimator_out`` (the velocity), with a dynamic batch (2 CFG
   rows per request, any number of requests) and a dynamic frame count. The attention pattern is
   part of the graph, so a streaming (block-causal) and a non-streaming (full attention) model
   are exported separately. Needs only torch (+ onnxruntime for :func:`check_estimator_onnx`).
2. :func:`build_estimator_engine`: a TensorRT plan from that ONNX file, with one optimisation
   profile over batch and frames (fp16 by default, as deployed).
3. :class:`TensorRTEstimator`: a drop-in for the estimator module that runs the plan(s);
   :class:`~cosyserve.token2wav.cosyvoice2.Token2WavOptions` ``tensorrt_plan`` installs it.

Steps 2 and 3 need the ``tensorrt`` Python package and a GPU; without it they fail at once with
:class:`TensorRTUnavailableError` saying what to install. They have not been run on our machines
(no TensorRT there); the ONNX export is checked against torch with onnxruntime on the CPU.
"""

from __future__ import annotations

import copy
import importlib
import threading
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import nn

from ..errors import CosyServeError, InvalidInputError, ModelLoadError
from ..models.flow import CausalConditionalDecoder

ESTIMATOR_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")
ESTIMATOR_OUTPUT = "estimator_out"
# Dimension names of the dynamic axes: batch = 2 x requests (CFG rows), frames = prompt + target mel frames.
_DYNAMIC_AXES = {"x": {0: "batch", 2: "frames"}, "mask": {0: "batch", 2: "frames"}, "mu": {0: "batch", 2: "frames"},
                 "t": {0: "batch"}, "spks": {0: "batch"}, "cond": {0: "batch", 2: "frames"},
                 ESTIMATOR_OUTPUT: {0: "batch", 2: "frames"}}
TENSORRT_INSTALL_HINT = ("Install TensorRT's Python package matching your CUDA (e.g. `pip install tensorrt`, or use "
                         "NVIDIA's TensorRT / Triton container), or run without a TensorRT plan (the PyTorch estimator, "
                         "optionally with cuda_graphs).")


class TensorRTUnavailableError(CosyServeError, RuntimeError):
    """The ``tensorrt`` package cannot be imported here."""


def require_tensorrt(what: str) -> ModuleType:
    """Import and return ``tensorrt``, or raise :class:`TensorRTUnavailableError` naming ``what`` needs it."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise TensorRTUnavailableError(f"{what} needs the tensorrt package, which cannot be imported ({exc}). "
                                       f"{TENSORRT_INSTALL_HINT}") from exc


def estimator_onnx_name(streaming: bool) -> str:
    """Upstream's file name for the non-streaming model; ``.streaming`` marks the block-causal one."""
    return f"flow.decoder.estimator{'.streaming' if streaming else ''}.fp32.onnx"


class _FixedMode(nn.Module):
    """The estimator with its ``streaming`` flag fixed: the six tensors of the ONNX signature in, velocity out."""

    def __init__(self, estimator: CausalConditionalDecoder, streaming: bool):
        super().__init__()
        self.estimator = estimator
        self.streaming = streaming

    def forward(self, x, mask, mu, t, spks, cond):
        return self.estimator(x, mask, mu, t, spks, cond, streaming=self.streaming)


def estimator_example_inputs(batch: int, frames: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random float32 CPU inputs (x, mask, mu, t, spks, cond); the mask hides the last frames of odd rows."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 1, frames)
    mask[1::2, :, frames - frames // 4:] = 0
    return (torch.randn(batch, 80, frames, generator=g), mask, torch.randn(batch, 80, frames, generator=g),
            torch.rand(batch, generator=g), torch.randn(batch, 80, generator=g),
            torch.randn(batch, 80, frames, generator=g))


def export_estimator_onnx(estimator: CausalConditionalDecoder, path: str | Path, *, streaming: bool = False,
                          opset: int = 18) -> Path:
    """Write the estimator (float32, CPU copy) as ONNX with dynamic batch and frames; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = _FixedMode(copy.deepcopy(estimator).to(device="cpu", dtype=torch.float32), streaming).eval()
    with torch.no_grad(), warnings.catch_warnings():
        # The TorchScript exporter is used on purpose (the torch.export one needs onnxscript);
        # its deprecation and constant-folding notes are expected.
        warnings.filterwarnings("ignore", message=".*(legacy TorchScript|Constant folding|feature will be removed)")
        # Frames > 2 chunks of 50 and a batch of 4 keep the tracer off any size-specialised path.
        torch.onnx.export(module, estimator_example_inputs(4, 123), str(path), input_names=list(ESTIMATOR_INPUTS),
                          output_names=[ESTIMATOR_OUTPUT], dynamic_axes=_DYNAMIC_AXES, opset_version=opset,
                          dynamo=False)
    return path


def check_estimator_onnx(path: str | Path, estimator: CausalConditionalDecoder, *, streaming: bool,
                         batch: int = 6, frames: int = 177, seed: int = 1) -> float:
    """rel-L2 between onnxruntime (CPU) on ``path`` and the torch estimator (float32) on fresh inputs."""
    import onnxruntime

    inputs = estimator_example_inputs(batch, frames, seed=seed)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run([ESTIMATOR_OUTPUT], {name: v.numpy() for name, v in zip(ESTIMATOR_INPUTS, inputs)})
    parameter = next(estimator.parameters())
    with torch.no_grad():
        want = estimator(*(v.to(parameter.device, parameter.dtype) for v in inputs), streaming=streaming)
    want = want.float().cpu()
    return float((torch.from_numpy(got) - want).norm() / want.norm())


def build_estimator_engine(onnx_path: str | Path, plan_path: str | Path, *, fp16: bool = True, max_requests: int = 16,
                           min_frames: int = 4, opt_frames: int = 500, max_frames: int = 3000,
                           workspace_gib: float = 8.0) -> Path:
    """Build a TensorRT plan from :func:`export_estimator_onnx`'s file; batch 2..2·max_requests rows."""
    trt = require_tensorrt("building the TensorRT estimator engine")
    if max_requests < 1 or not 1 <= min_frames <= opt_frames <= max_frames:
        raise InvalidInputError("need 1 <= max_requests and 1 <= min_frames <= opt_frames <= max_frames")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelLoadError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    rows = (2, 2, 2 * max_requests)
    for name in ESTIMATOR_INPUTS:
        if name == "t":
            shapes = [(b,) for b in rows]
        elif name == "spks":
            shapes = [(b, 80) for b in rows]
        else:
            channels = 1 if name == "mask" else 80
            shapes = [(b, channels, f) for b, f in zip(rows, (min_frames, opt_frames, max_frames))]
        profile.set_shape(name, *shapes)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ModelLoadError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    plan_path = Path(plan_path)
    plan_path.write_bytes(bytes(plan))
    return plan_path


class _Engine:
    """One deserialised plan and its execution context (calls serialised: one context)."""

    def __init__(self, trt: ModuleType, plan_path: Path):
        if not plan_path.is_file():
            raise ModelLoadError(f"TensorRT plan {plan_path} not found")
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise ModelLoadError(f"TensorRT cannot load {plan_path} (built for another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.dtypes = {name: torch.from_numpy(np.empty(0, trt.nptype(self.engine.get_tensor_dtype(name)))).dtype
                       for name in (*ESTIMATOR_INPUTS, ESTIMATOR_OUTPUT)}
        self.lock = threading.Lock()

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = inputs[0]
        with self.lock:
            bound = []
            for name, value in zip(ESTIMATOR_INPUTS, inputs):
                value = value.to(self.dtypes[name]).contiguous()
                bound.append(value)  # keep alive until the engine ran
                self.context.set_input_shape(name, tuple(value.shape))
                self.context.set_tensor_address(name, value.data_ptr())
            out = torch.empty(x.shape, dtype=self.dtypes[ESTIMATOR_OUTPUT], device=x.device)
            self.context.set_tensor_address(ESTIMATOR_OUTPUT, out.data_ptr())
            if not self.context.execute_async_v3(torch.cuda.current_stream(x.device).cuda_stream):
                raise RuntimeError("TensorRT estimator execution failed")
        return out.to(x.dtype)


class TensorRTEstimator(nn.Module):
    """Runs the estimator from TensorRT plans, keyed by the ``streaming`` flag; the torch
    ``fallback`` serves the mode without a plan and incremental-stream windows."""

    def __init__(self, fallback: CausalConditionalDecoder, plans: dict[bool, str | Path]):
        super().__init__()
        trt = require_tensorrt("the TensorRT flow estimator")
        self.fallback = fallback
        self._engines = {streaming: _Engine(trt, Path(path)) for streaming, path in plans.items() if path}

    def forward(self, x, mask, mu, t, spks, cond, *, streaming: bool, window=None) -> torch.Tensor:
        engine = self._engines.get(streaming)
        if engine is None or window is not None or x.device.type != "cuda":
            return self.fallback(x, mask, mu, t, spks, cond, streaming=streaming, window=window)
        return engine((x, mask, mu, t, spks, cond))
