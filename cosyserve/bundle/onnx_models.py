"""Random-weight stand-ins for the front-end ONNX models (``speech_tokenizer_v2.onnx``,
``speech_tokenizer_v3.onnx``, ``campplus.onnx``), made the way the released files were made.

The released graphs are ``torch.onnx.export`` (TorchScript exporter) traces of the upstream
modules; these are traces of the same architectures (:mod:`cosyserve.frontend.s3_tokenizer`,
:mod:`cosyserve.frontend.campplus`, whose module names are the upstream ones) with random
weights, so node scopes, initializer forms (anonymous ``onnx::MatMul_N`` weights, named biases,
BatchNorms folded into the convolutions before them), operator sets and input/output contracts
are the released ones (llm_layout.md §6): the torch loaders that read a stand-in read the
released file the same way. v2 is exported at opset 17 (LayerNormalization nodes), v3 at
opset 15 (decomposed layer norms), as the released v2/v3 graphs are. ``real`` has the released
sizes (S3 tokenizer 1280 wide, 20 heads, 6 (v2) or 12 (v3) blocks; CAM++ 3D-Speaker defaults);
``tiny`` builds in a fraction of a second for tests.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import onnx
import torch
from onnx import helper
from torch import nn

from ..frontend.campplus import Campplus, CampplusSize
from ..frontend.s3_tokenizer import N_MELS, S3Tokenizer

SIZES = ("tiny", "real")
TOKENIZER_VERSIONS = {"v2": 17, "v3": 15}  # version -> opset of the released graph
CAMPPLUS_OPSET = 13
# (width, blocks) per size and version; the head size is fixed at 64 (20 heads at 1280).
_TOKENIZER_SIZES = {("tiny", "v2"): (128, 2), ("tiny", "v3"): (128, 2),
                    ("real", "v2"): (1280, 6), ("real", "v3"): (1280, 12)}
_CAMPPLUS_SIZES = {"tiny": CampplusSize(head_channels=8, init_channels=32, growth=8, bottleneck=16, layers=(2, 2, 2)),
                   "real": CampplusSize()}


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")


class _TokenizerGraph(S3Tokenizer):
    """The released graph's contract: (1, 128, T) log-mel + (1,) length -> (1, T') codes, cut to the
    valid length (a subclass, so that the modules stay at the graph's root scope)."""

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        codes, lengths = super().forward(feats, feats_length)
        keep = torch.arange(codes.shape[1], device=codes.device) < lengths[0]
        return codes[:, keep]


def _randomise(model: nn.Module, seed: int) -> None:
    """Torch's default initialisation, then BatchNorm statistics and affine terms drawn at random
    so that folding them into the convolutions is not the identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                bound = (3.0 / (module.weight[0].numel())) ** 0.5
                module.weight.copy_((torch.rand(module.weight.shape, generator=generator) * 2 - 1) * bound)
                if module.bias is not None:
                    module.bias.copy_((torch.rand(module.bias.shape, generator=generator) * 2 - 1) * 0.1)
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=generator))
                module.running_var.copy_(1 + 0.2 * torch.rand(module.running_var.shape, generator=generator))


def _export(module: nn.Module, args: tuple, path: str | Path, input_names: list[str], output_names: list[str],
            dynamic_axes: dict, opset: int, metadata: dict[str, str]) -> Path:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # the TorchScript exporter is the one that made the released files; torch marks it deprecated
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, buffer, dynamo=False, input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes, opset_version=opset,
                          do_constant_folding=True)
    model = onnx.load_from_string(buffer.getvalue())
    helper.set_model_props(model, metadata)
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def write_speech_tokenizer_onnx(path: str | Path, size: str = "tiny", seed: int = 0, version: str = "v2") -> Path:
    """Write a stand-in ``speech_tokenizer_{version}.onnx``.

    Inputs: ``feats`` float32 (1, 128, T) Whisper log-mel, ``feats_length`` int32 (1,) = T.
    Output: ``indices`` int32 (1, T') with T' = ceil(ceil(L/2)/2) for L = feats_length, codes in
    [0, 6561).
    """
    _check_size(size)
    if version not in TOKENIZER_VERSIONS:
        raise ValueError(f"version must be one of {sorted(TOKENIZER_VERSIONS)}, got {version!r}")
    width, blocks = _TOKENIZER_SIZES[size, version]
    model = _TokenizerGraph(width, blocks)
    _randomise(model, seed)
    frames = 64
    return _export(model, (torch.zeros(1, N_MELS, frames), torch.tensor([frames], dtype=torch.int32)),
                   path, ["feats", "feats_length"], ["indices"], {"feats": {2: "T"}, "indices": {1: "T_tokens"}},
                   TOKENIZER_VERSIONS[version],
                   {"cosyserve.stand_in": "true", "size": size, "seed": str(seed), "version": version})


def write_campplus_onnx(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a stand-in ``campplus.onnx``: ``input`` float32 (B, frames, 80) mean-normalised Kaldi
    fbank -> ``output`` float32 (B, 192) raw speaker embedding (the flow normalises it)."""
    _check_size(size)
    model = Campplus(_CAMPPLUS_SIZES[size])
    _randomise(model, seed)
    return _export(model, (torch.zeros(1, 200, 80),), path, ["input"], ["output"],
                   {"input": {0: "batch", 1: "frames"}, "output": {0: "batch"}}, CAMPPLUS_OPSET,
                   {"cosyserve.stand_in": "true", "size": size, "seed": str(seed)})
