"""Hyper-parameters of the CosyVoice2 HiFT vocoder and its F0 predictor.

Defaults are the released CosyVoice2 values (``cosyvoice2.yaml``: 24 kHz, up-sampling 8·5·3,
iSTFT n_fft 16 / hop 4 → 480 samples per mel frame). The upstream constructor's own defaults
describe the 22.05 kHz CosyVoice1 vocoder, which this package does not implement, so a key
missing from a config falls back to the CosyVoice2 value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ...config import Tagged, tagged_kwargs
from ...errors import ModelLoadError

GENERATOR_CLASS = "cosyvoice.hifigan.generator.HiFTGenerator"
F0_PREDICTOR_CLASS = "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"

# Sample rate for which upstream picks the CosyVoice1 source module (SineGen), not SineGen2.
_COSYVOICE1_SAMPLE_RATE = 22050

_Ints = tuple[int, ...]
_Dilations = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class HiftConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10
    upsample_rates: _Ints = (8, 5, 3)
    upsample_kernel_sizes: _Ints = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: _Ints = (3, 7, 11)
    resblock_dilation_sizes: _Dilations = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: _Ints = (7, 7, 11)
    source_resblock_dilation_sizes: _Dilations = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_num_class: int = 1
    f0_in_channels: int = 80
    f0_cond_channels: int = 512

    def __post_init__(self) -> None:
        if self.sampling_rate == _COSYVOICE1_SAMPLE_RATE:
            raise ModelLoadError(
                "HiFT at 22050 Hz (CosyVoice1, SineGen source) is not supported; CosyVoice2 uses 24000 Hz")
        n_stages = len(self.upsample_rates)
        lengths = {
            "upsample_kernel_sizes": len(self.upsample_kernel_sizes),
            "source_resblock_kernel_sizes": len(self.source_resblock_kernel_sizes),
            "source_resblock_dilation_sizes": len(self.source_resblock_dilation_sizes),
        }
        bad = {k: n for k, n in lengths.items() if n != n_stages}
        if bad or len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ModelLoadError(
                f"inconsistent HiFT config: {n_stages} upsample_rates but {bad or lengths}, "
                f"{len(self.resblock_kernel_sizes)} resblock kernels vs "
                f"{len(self.resblock_dilation_sizes)} dilation lists"
            )
        if self.base_channels % 2**n_stages:
            raise ModelLoadError(f"base_channels {self.base_channels} must be divisible by 2**{n_stages}")

    @property
    def hop_length(self) -> int:
        """Output samples per mel frame (480 for CosyVoice2)."""
        return math.prod(self.upsample_rates) * self.istft_hop_len

    @classmethod
    def real(cls) -> "HiftConfig":
        """The released CosyVoice2-0.5B vocoder."""
        return cls()

    @classmethod
    def tiny(cls) -> "HiftConfig":
        """The architecture at the parity fixtures' tiny width (32 base / conditioning channels)."""
        return cls(base_channels=32, f0_cond_channels=32)

    # ----- construction from configs -----

    @classmethod
    def from_kwargs(cls, generator: dict[str, Any], f0_predictor: dict[str, Any] | None = None) -> "HiftConfig":
        """From upstream constructor kwargs (``HiFTGenerator(**generator)``, ``ConvRNNF0Predictor(**f0_predictor)``)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in generator.items():
            if key == "istft_params":
                values["istft_n_fft"] = int(value["n_fft"])
                values["istft_hop_len"] = int(value["hop_len"])
            elif key in known:
                values[key] = _freeze(value)
            elif key != "f0_predictor":
                raise ModelLoadError(f"unknown HiFTGenerator argument {key!r}")
        for key, value in (f0_predictor or {}).items():
            if key not in ("num_class", "in_channels", "cond_channels"):
                raise ModelLoadError(f"unknown ConvRNNF0Predictor argument {key!r}")
            values[f"f0_{key}"] = int(value)
        return cls(**values)

    @classmethod
    def from_yaml_tree(cls, tree: dict) -> "HiftConfig":
        """From a parsed ``cosyvoice2.yaml`` (``load_hyperpyyaml``); released values where absent."""
        node = tree.get("hift")
        if node is None:
            return cls.real()
        kwargs = dict(tagged_kwargs(node, "HiFTGenerator", "cosyvoice2.yaml: hift"))
        f0_node = kwargs.pop("f0_predictor", None)
        f0_kwargs = None
        if f0_node is not None:
            f0_kwargs = tagged_kwargs(f0_node, "ConvRNNF0Predictor", "cosyvoice2.yaml: hift.f0_predictor")
        return cls.from_kwargs(kwargs, f0_kwargs)

    @classmethod
    def from_fixture_json(cls, data: dict) -> "HiftConfig":
        """From a fixture's JSON description. Accepted layouts:
        ``{"kwargs": {...}, "f0_predictor": {"kwargs": {...}}}`` (hift_tiny_config.json),
        ``{"config": {"generator": {...}, "f0_predictor": {...}}}`` (real-size manifests) and
        a flat kwargs dict with an optional nested ``f0_predictor`` dict (DiT tiny_config.json).
        """
        if "config" in data:
            return cls.from_kwargs(data["config"]["generator"], data["config"].get("f0_predictor"))
        if "kwargs" in data:
            f0 = data.get("f0_predictor")
            return cls.from_kwargs(data["kwargs"], None if f0 is None else f0["kwargs"])
        generator = {k: v for k, v in data.items() if k != "f0_predictor"}
        f0 = data.get("f0_predictor")
        f0_kwargs = None if f0 is None else {k: v for k, v in f0.items() if k not in ("type", "class")}
        return cls.from_kwargs(generator, f0_kwargs)

    # ----- export -----

    def to_kwargs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Upstream constructor kwargs of the generator (without f0_predictor) and of the F0 predictor."""
        values = {k: _thaw(v) for k, v in asdict(self).items()}
        f0 = {k[len("f0_"):]: values.pop(k) for k in ("f0_num_class", "f0_in_channels", "f0_cond_channels")}
        generator: dict[str, Any] = {}
        for key, value in values.items():
            if key == "istft_n_fft":
                generator["istft_params"] = {"n_fft": value, "hop_len": values["istft_hop_len"]}
            elif key != "istft_hop_len":
                generator[key] = value
        return generator, f0

    def to_yaml_node(self) -> Tagged:
        """The ``hift:`` node of a cosyvoice2.yaml, in upstream's style."""
        generator, f0 = self.to_kwargs()
        generator["f0_predictor"] = Tagged("new", F0_PREDICTOR_CLASS, kwargs=f0)
        return Tagged("new", GENERATOR_CLASS, kwargs=generator)


def _freeze(value: Any) -> Any:
    """Lists from YAML/JSON become (nested) tuples so the config is hashable and comparable."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
