"""The PyTorch front-end (S3 tokenizer v2/v3, CAM++) against onnxruntime on the bundle's graphs,
batched against one clip at a time, and the choice of back end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.bundle import synthetic_prompt_wave
from cosyserve.bundle.onnx_models import write_campplus_onnx, write_speech_tokenizer_onnx
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from cosyserve.frontend.onnx_weights import module_path
from cosyserve.frontend.torch_models import (
    TorchSpeakerEncoder,
    TorchSpeechTokenizer,
    frontend_backend,
    load_frontend_models,
)

torch.set_num_threads(1)

# 0.5 s to the 30 s limit, odd lengths included (partial STFT hops, odd token counts)
CLIP_SECONDS = (0.5, 1.37, 3.0, 7.9, 30.0)


def clip(seconds: float, seed: int) -> torch.Tensor:
    return torch.from_numpy(synthetic_prompt_wave(seconds, seed=seed).astype(np.float32))


@pytest.fixture(scope="module")
def clips() -> list[torch.Tensor]:
    return [clip(seconds, seed) for seed, seconds in enumerate(CLIP_SECONDS)]


@pytest.fixture(scope="module", params=["v2", "v3"])
def tokenizer_pair(request, tmp_path_factory):
    path = write_speech_tokenizer_onnx(tmp_path_factory.mktemp("tok") / f"speech_tokenizer_{request.param}.onnx",
                                       "tiny", seed=11, version=request.param)
    return SpeechTokenizer(path, providers=["CPUExecutionProvider"]), TorchSpeechTokenizer(path)


@pytest.fixture(scope="module")
def encoder_pair(tmp_path_factory):
    path = write_campplus_onnx(tmp_path_factory.mktemp("cam") / "campplus.onnx", "tiny", seed=12)
    return SpeakerEncoder(path), TorchSpeakerEncoder(path)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_codes_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Speech codes of two different computations (back ends, batched or not): as many, and equal
    but for a code whose value sat on a rounding edge (float sums may differ in their last bit from
    one CPU to another); a wrong floor, mean or mask changes far more than one in a hundred."""
    assert tokens.dtype == expected.dtype == torch.int32 and tokens.shape == expected.shape
    assert int((tokens != expected).sum()) <= max(1, expected.numel() // 100), (tokens, expected)


def test_node_scopes_map_to_module_paths():
    assert module_path("/blocks.0/mlp/mlp.0/MatMul") == "blocks.0.mlp.0"
    assert module_path("/xvector/xvector.block1/tdnnd1/cam_layer/linear_local/Conv") == "xvector.block1.tdnnd1.cam_layer.linear_local"
    assert module_path("/conv1/Conv") == "conv1"


def test_tokens_equal_onnxruntime_for_every_clip(tokenizer_pair, clips):
    reference, model = tokenizer_pair
    for wav in clips:
        assert_codes_match(model.tokenize(wav), reference.tokenize(wav))
    assert len(set(model.tokenize(clips[-1]).tolist())) > 20  # the stand-in's codes follow the audio


def test_token_batch_equals_one_by_one(tokenizer_pair, clips):
    _, model = tokenizer_pair
    batch = model.tokenize_batch(clips)
    assert [t.numel() for t in batch] == [model.tokenize(w).numel() for w in clips]
    for tokens, wav in zip(batch, clips):
        assert_codes_match(tokens, model.tokenize(wav))


def test_embeddings_match_onnxruntime_and_batch_equals_one_by_one(encoder_pair, clips):
    reference, model = encoder_pair
    batch = model.embed_batch(clips)
    for embedding, wav in zip(batch, clips):
        expected = reference.embed(wav)
        assert embedding.shape == (192,) and embedding.dtype == torch.float32
        assert rel_l2(model.embed(wav), expected) <= 1e-4
        assert rel_l2(embedding, expected) <= 1e-4
    assert rel_l2(batch[0], batch[1]) > 1e-2  # different clips, different voices


def test_torch_backend_refuses_what_onnxruntime_refuses(tokenizer_pair, encoder_pair):
    (ort_tok, torch_tok), (ort_enc, torch_enc) = tokenizer_pair, encoder_pair
    bad_clips = [(torch.zeros(16000 * 31), "30 s"), (torch.zeros(1, 16000), "1-D"), (torch.zeros(150), "too short"),
                 (torch.zeros(0), "non-empty")]
    for wav, message in bad_clips:
        for tokenize in (ort_tok.tokenize, torch_tok.tokenize, lambda w: torch_tok.tokenize_batch([clip(1.0, 0), w])):
            with pytest.raises(InvalidInputError, match=message):
                tokenize(wav)
    for wav, message in [(torch.zeros(1, 16000), "1-D"), (torch.zeros(300), "too short")]:
        for embed in (ort_enc.embed, torch_enc.embed, lambda w: torch_enc.embed_batch([clip(1.0, 0), w])):
            with pytest.raises(InvalidInputError, match=message):
                embed(wav)
    assert torch_tok.tokenize_batch([]) == [] and torch_enc.embed_batch([]) == []


def test_torch_loaders_reject_other_files(tokenizer_pair, encoder_pair, tmp_path: Path):
    (_, torch_tok), (_, torch_enc) = tokenizer_pair, encoder_pair
    with pytest.raises(ModelLoadError, match="does not exist"):
        TorchSpeechTokenizer(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(ModelLoadError, match="cannot read"):
        TorchSpeakerEncoder(tmp_path / "junk.onnx")
    with pytest.raises(ModelLoadError, match="not an S3 speech tokenizer"):
        TorchSpeechTokenizer(torch_enc.path)
    with pytest.raises(ModelLoadError, match="not a CAM"):
        TorchSpeakerEncoder(torch_tok.path)


def test_backend_choice(tokenizer_pair, encoder_pair):
    assert frontend_backend("cuda") == "torch" and frontend_backend("cpu") == "onnxruntime"
    assert frontend_backend("cpu", "torch") == "torch" and frontend_backend("cuda", "onnxruntime") == "onnxruntime"
    with pytest.raises(InvalidInputError, match="backend"):
        frontend_backend("cpu", "tensorrt")
    (_, torch_tok), (_, torch_enc) = tokenizer_pair, encoder_pair
    tokenizer, encoder = load_frontend_models(torch_tok.path, torch_enc.path, "cpu")
    assert isinstance(tokenizer, SpeechTokenizer) and isinstance(encoder, SpeakerEncoder)
    tokenizer, encoder = load_frontend_models(torch_tok.path, torch_enc.path, "cpu", backend="torch")
    assert isinstance(tokenizer, TorchSpeechTokenizer) and isinstance(encoder, TorchSpeakerEncoder)
    assert tokenizer.tf32 and encoder.tf32  # TF32 on CUDA, as onnxruntime's CUDA provider
    exact = load_frontend_models(torch_tok.path, torch_enc.path, "cpu", backend="torch-fp32")
    assert all(isinstance(model, cls) and not model.tf32
               for model, cls in zip(exact, (TorchSpeechTokenizer, TorchSpeakerEncoder)))
    assert frontend_backend("cuda", "torch-fp32") == "torch-fp32"


def test_stand_ins_have_the_released_graph_forms(tokenizer_pair, encoder_pair):
    """What the released graphs hold and the ``s3tokenizer`` package's converter relies on: weights
    under anonymous ``onnx::`` names found by node scope, biases and the FSMN kernels under their
    module names, LayerNormalization nodes in v2 and decomposed layer norms in v3; CAM++ with the
    BatchNorms after convolutions folded and the pre-activation ones kept."""
    import onnx

    (_, torch_tok), (_, torch_enc) = tokenizer_pair, encoder_pair
    graph = onnx.load(str(torch_tok.path)).graph
    nodes = {node.name: node for node in graph.node}
    initializers = {init.name for init in graph.initializer}
    query = nodes["/blocks.0/attn/query/MatMul"]
    assert query.input[1].startswith("onnx::MatMul_") and "blocks.0.attn.query.bias" in initializers
    assert {"blocks.0.attn.fsmn_block.weight", "quantizer.project_in.bias"} <= initializers
    assert "/blocks.1/mlp/mlp.2/MatMul" in nodes and "/conv2/Conv" in nodes
    if "v2" in torch_tok.path.name:
        assert nodes["/blocks.0/attn_ln/LayerNormalization"].op_type == "LayerNormalization"
    else:
        assert "/blocks.0/attn_ln/Mul" in nodes and not any(n.op_type == "LayerNormalization" for n in graph.node)
    graph = onnx.load(str(torch_enc.path)).graph
    batch_norms = {module_path(node.name) for node in graph.node if node.op_type == "BatchNormalization"}
    assert "xvector.block1.tdnnd1.nonlinear1.batchnorm" in batch_norms
    assert not any(path.startswith("head.") or path.startswith("xvector.tdnn.") for path in batch_norms)


def test_voices_of_a_batch_equal_the_onnxruntime_voices(tokenizer_pair, encoder_pair, clips):
    """The one place a voice is computed, batched on the PyTorch back end vs clip by clip on onnxruntime."""
    from cosyserve.audio import prompt_audio_from_array
    from cosyserve.frontend import build_prompt_features, build_prompt_features_batch

    (ort_tok, torch_tok), (ort_enc, torch_enc) = tokenizer_pair, encoder_pair
    prompts = [prompt_audio_from_array(wav, 16000) for wav in clips[:4]]
    batch = build_prompt_features_batch(prompts, torch_tok, torch_enc)
    for features, prompt in zip(batch, prompts):
        expected = build_prompt_features(prompt, ort_tok, ort_enc)
        assert_codes_match(features.speech_tokens, expected.speech_tokens)
        assert torch.equal(features.speech_feat, expected.speech_feat)  # the same computation: the mel on the CPU
        assert rel_l2(features.embedding, expected.embedding) <= 1e-4


def test_bad_clips_get_the_same_errors_on_both_back_ends(tokenizer_pair, encoder_pair):
    """Silence, NaN, 0.1 s, 60 s and an unsupported rate, as a request sends them: the voice path
    refuses each with one message, whichever back end computes the voice."""
    from cosyserve.audio import prompt_audio_from_array
    from cosyserve.frontend import build_prompt_features_batch

    good = clip(1.0, 0)
    nan = good.clone()
    nan[100] = float("nan")
    bad_clips = {"silence": (torch.zeros(16000), 16000), "nan": (nan, 16000), "0.1 s": (good[:1600], 16000),
                 "60 s": (clip(60.0, 1), 16000), "8 kHz": (good, 8000)}

    def error(tokenizer, encoder, wav, rate) -> str:
        with pytest.raises(InvalidInputError) as caught:
            build_prompt_features_batch([prompt_audio_from_array(wav, rate)], tokenizer, encoder)
        return str(caught.value)

    (ort_tok, torch_tok), (ort_enc, torch_enc) = tokenizer_pair, encoder_pair
    messages = {name: error(torch_tok, torch_enc, *bad) for name, bad in bad_clips.items()}
    assert messages == {name: error(ort_tok, ort_enc, *bad) for name, bad in bad_clips.items()}
    assert "silent" in messages["silence"] and "NaN" in messages["nan"] and "30 s" in messages["60 s"]
    assert "0.10 s" in messages["0.1 s"] and "8000 Hz" in messages["8 kHz"]
