"""Strict loading of HiFT checkpoints (released ``hift.pt`` and its variants)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ...config import load_hyperpyyaml
from ...errors import ModelLoadError
from .config import HiftConfig
from .generator import HiFTGenerator

CHECKPOINT_NAME = "hift.pt"
CONFIG_NAME = "cosyvoice2.yaml"
_WEIGHT_NORM_G, _WEIGHT_NORM_V = "parametrizations.weight.original0", "parametrizations.weight.original1"


def normalise_hift_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Upstream's key clean-up plus old weight-norm spellings.

    * the substring ``generator.`` is removed wherever it occurs (checkpoints saved from the GAN
      wrapper carry it; upstream does the same plain string replace);
    * ``<layer>.weight_g`` / ``<layer>.weight_v`` (pre-parametrization torch) become
      ``<layer>.parametrizations.weight.original0`` / ``original1``.
    """
    renamed = {}
    for key, value in state_dict.items():
        key = key.replace("generator.", "")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + _WEIGHT_NORM_G
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + _WEIGHT_NORM_V
        renamed[key] = value
    return renamed


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state_dict = load_file(str(path))
        else:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch/pickle/safetensors raise many types for unreadable files
        raise ModelLoadError(f"cannot read HiFT checkpoint {path}: {exc}") from exc
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ModelLoadError(f"{path} is not a state dict of tensors")
    return state_dict


def load_hift_state_dict(model: HiFTGenerator, state_dict: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Strictly load ``state_dict`` (any accepted spelling) into ``model``.

    A checkpoint whose weight norm is already folded (plain ``.weight`` keys) is loaded into the
    folded model.
    """
    state_dict = normalise_hift_keys(state_dict)
    if not any(_WEIGHT_NORM_G in k for k in state_dict) and "conv_pre.weight" in state_dict:
        model.fold_weight_norm()
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as exc:
        expected = set(model.state_dict())
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        detail = f"missing {len(missing)} keys {missing[:5]}, unexpected {len(unexpected)} keys {unexpected[:5]}"
        if not missing and not unexpected:
            detail = str(exc).splitlines()[-1].strip()
        raise ModelLoadError(f"{source} does not match the HiFT config {model.cfg}: {detail}") from exc


def _released_config_with_checkpoint_widths(state_dict: dict[str, torch.Tensor]) -> HiftConfig:
    """The released hyper-parameters, with the two channel widths read from the tensors.

    Some model directories (Step-Audio-2-mini's ``token2wav/``) ship ``hift.pt`` without a
    config; the widths are then the only hyper-parameters that can differ from the released
    ones (e.g. in our tiny test bundles), and both are visible in the first conv of each branch.
    """
    state_dict = normalise_hift_keys(state_dict)

    def out_channels(prefix: str, default: int) -> int:
        for suffix in (_WEIGHT_NORM_V, "weight"):
            if f"{prefix}.{suffix}" in state_dict:
                return int(state_dict[f"{prefix}.{suffix}"].shape[0])
        return default

    real = HiftConfig.real()
    return dataclasses.replace(real, base_channels=out_channels("conv_pre", real.base_channels),
                               f0_cond_channels=out_channels("f0_predictor.condnet.0", real.f0_cond_channels))


def load_hift(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    config: HiftConfig | None = None,
    fold_weight_norm: bool = True,
) -> HiFTGenerator:
    """Build and strictly load a HiFT vocoder in eval mode.

    ``path`` is a model directory (``hift.pt``, hyper-parameters from its ``cosyvoice2.yaml``
    when present) or a checkpoint file (``.pt`` or ``.safetensors``). ``config`` overrides the
    hyper-parameters; without config or yaml the released CosyVoice2 values are used, with the
    channel widths read from the checkpoint.
    ``fold_weight_norm`` removes the weight-norm parametrizations after loading (same outputs,
    faster); pass False to keep upstream's state-dict layout.
    """
    path = Path(path)
    if path.is_dir():
        checkpoint = path / CHECKPOINT_NAME
        if config is None and (path / CONFIG_NAME).is_file():
            config = HiftConfig.from_yaml_tree(load_hyperpyyaml(path / CONFIG_NAME))
    else:
        checkpoint = path
    if not checkpoint.is_file():
        raise ModelLoadError(f"HiFT checkpoint {checkpoint} not found")
    state_dict = _read_state_dict(checkpoint)
    model = HiFTGenerator(config or _released_config_with_checkpoint_widths(state_dict))
    load_hift_state_dict(model, state_dict, source=str(checkpoint))
    if fold_weight_norm:
        model.fold_weight_norm()
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
