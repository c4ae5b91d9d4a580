"""ONNX export of the flow estimator (dynamic batch + frames) checked with onnxruntime; TensorRT fails fast."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest
import torch

from cosyserve.config import dump_hyperpyyaml
from cosyserve.errors import InvalidInputError
from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, random_flow_state_dict
from cosyserve.token2wav.tensorrt import (ESTIMATOR_INPUTS, ESTIMATOR_OUTPUT, TensorRTUnavailableError,
                                          build_estimator_engine, check_estimator_onnx, estimator_example_inputs,
                                          export_estimator_onnx)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def flow() -> CosyVoice2Flow:
    model = CosyVoice2Flow(FlowConfig.tiny())
    model.load_state_dict(random_flow_state_dict(FlowConfig.tiny(), seed=3))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def exported(flow, tmp_path_factory) -> dict[bool, Path]:
    out = tmp_path_factory.mktemp("onnx")
    return {s: export_estimator_onnx(flow.decoder.estimator, out / f"est{int(s)}.onnx", streaming=s) for s in (False, True)}


def test_signature_has_dynamic_batch_and_frames(exported):
    graph = onnx.load(str(exported[False])).graph
    assert [i.name for i in graph.input] == list(ESTIMATOR_INPUTS)
    assert [o.name for o in graph.output] == [ESTIMATOR_OUTPUT]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*graph.input, *graph.output]}
    assert dims["x"] == dims["mu"] == dims["cond"] == dims[ESTIMATOR_OUTPUT] == ["batch", 80, "frames"]
    assert dims["mask"] == ["batch", 1, "frames"] and dims["t"] == ["batch"] and dims["spks"] == ["batch", 80]


@pytest.mark.parametrize("streaming", [False, True], ids=["full-attention", "block-causal"])
@pytest.mark.parametrize("batch, frames", [(2, 37), (6, 177), (10, 260)])
def test_onnxruntime_matches_torch(flow, exported, streaming, batch, frames):
    rel = check_estimator_onnx(exported[streaming], flow.decoder.estimator, streaming=streaming, batch=batch,
                               frames=frames, seed=batch)
    assert rel < 1e-5


def test_modes_really_differ(flow, exported):
    """The streaming file must carry the block-causal mask: same inputs, different velocity past frame 50."""
    import onnxruntime

    inputs = {n: v.numpy() for n, v in zip(ESTIMATOR_INPUTS, estimator_example_inputs(2, 120, seed=9))}
    full, causal = (onnxruntime.InferenceSession(str(exported[s]), providers=["CPUExecutionProvider"])
                    .run(None, inputs)[0] for s in (False, True))
    assert abs(full[:, :, :50] - causal[:, :, :50]).max() > 1e-3
    with torch.no_grad():
        want = flow.decoder.estimator(*estimator_example_inputs(2, 120, seed=9), streaming=True)
    assert float((torch.from_numpy(causal) - want).norm() / want.norm()) < 1e-5


def test_export_script_end_to_end(flow, tmp_path, capsys):
    dump_hyperpyyaml({"flow": FlowConfig.tiny().to_yaml_node()}, tmp_path / "cosyvoice2.yaml")
    torch.save(flow.state_dict(), tmp_path / "flow.pt")
    spec = importlib.util.spec_from_file_location("export_estimator_onnx", REPO / "scripts" / "export_estimator_onnx.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model-dir", str(tmp_path), "--modes", "streaming"]) == 0
    assert "ok" in capsys.readouterr().out
    assert (tmp_path / "flow.decoder.estimator.streaming.fp32.onnx").is_file()


@pytest.mark.skipif(HAVE_TENSORRT, reason="tensorrt is installed here")
def test_tensorrt_path_fails_fast_without_tensorrt(exported, tmp_path):
    with pytest.raises(TensorRTUnavailableError, match="pip install tensorrt"):
        build_estimator_engine(exported[False], tmp_path / "est.plan")
    assert not (tmp_path / "est.plan").exists()


def test_tensorrt_plan_option_needs_cuda(tmp_path):
    from cosyserve.models.hift import HiFTGenerator, HiftConfig
    from cosyserve.token2wav.cosyvoice2 import CosyVoice2Token2Wav, Token2WavOptions

    flow = CosyVoice2Flow(FlowConfig.tiny())
    with pytest.raises(InvalidInputError, match="CUDA"):
        CosyVoice2Token2Wav(flow, HiFTGenerator(HiftConfig.tiny()), options=Token2WavOptions(tensorrt_plan=tmp_path))
