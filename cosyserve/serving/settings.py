"""Typed settings of each Triton model, parsed once from its ``config.pbtxt`` parameters.

One frozen dataclass per model; each field is the parameter of the same name, and its default
applies when the parameter is missing or empty. Field types say how a value is read: ``str``,
``int``, ``float``, ``Path``, ``Path | None``, ``int | None`` (``auto`` = None) and ``bool | None``
(true/false/1/0/yes/no in any case, ``auto`` = None). "auto" is resolved by the settings' own
methods, nowhere else. The model repository builder (:mod:`.model_repository`) takes its defaults
from here, and tests/test_settings.py checks that the run scripts' variables agree.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from ..engine.scheduler import DEFAULT_MAX_BATCH_FRAMES, DEFAULT_MAX_BATCH_JOBS
from ..runtime import STREAM_IDLE_TIMEOUT_S, resolve_device, resolve_device_dtype
from ..engine.front_end import DEFAULT_FEATURE_CACHE_SIZE, DEFAULT_MAX_TOKENS, MAX_TEXT_CHARS
from ..token2wav.cosyvoice2 import (DEFAULT_PRECAPTURE_FRAMES, Token2WavOptions, default_flow_dtype,
                                    streaming_vocoder_frames)

AUTO = "auto"
FLAGS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
# A send only waits for the server to hand the response on (to a gRPC stream, or to the calling
# BLS stub, which takes it at once); this long means that caller is gone.
DEFAULT_SEND_TIMEOUT_S = 10.0

Settings = TypeVar("Settings")


def parse_settings(cls: type[Settings], params: dict[str, str]) -> Settings:
    """``cls`` from a model's parameters; raises ValueError naming the parameter that is wrong."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        text = (params.get(field.name) or "").strip()
        if not text:
            if field.default is dataclasses.MISSING:
                raise ValueError(f"model parameter {field.name!r} is missing or empty in config.pbtxt")
            continue
        try:
            values[field.name] = _parse(hints[field.name], text)
        except ValueError as exc:
            raise ValueError(f"model parameter {field.name}: {exc}") from None
    return cls(**values)


def _parse(kind: object, text: str) -> object:
    if kind == bool | None:
        if text.lower() == AUTO:
            return None
        if text.lower() not in FLAGS:
            raise ValueError(f"expected true, false or auto, got {text!r}")
        return FLAGS[text.lower()]
    if kind == int | None:
        return None if text.lower() == AUTO else int(text)
    if kind in (Path, Path | None):
        return Path(text)
    if kind in (int, float, str):
        return kind(text)
    raise TypeError(f"no parser for settings of type {kind}")


def parameter_value(value: object) -> str:
    """A setting as its parameter text (None -> ``auto``), what :func:`parse_settings` reads back."""
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What every model process on a device takes: ``device`` (auto: CUDA when available) and
    ``torch_threads`` (0: the model's own default)."""

    device: str = AUTO
    torch_threads: int = 0

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


@dataclass(frozen=True, kw_only=True)
class GpuSharingSettings(ProcessSettings):
    """How a GPU-heavy process shares the GPU under CUDA MPS (``triton_utils.apply_mps_settings``)."""

    mps_thread_percentage: str = ""
    mps_priority: str = ""


@dataclass(frozen=True)
class Token2WavSettings(GpuSharingSettings):
    """The ``token2wav`` model (:class:`~cosyserve.serving.token2wav_model.Token2WavModel`).

    ``dtype`` of the flow (auto: fp16 on CUDA, fp32 on CPU); ``hift_dtype`` of HiFT's network (auto:
    :data:`~cosyserve.token2wav.cosyvoice2.AUTO_CUDA_HIFT_DTYPE` on CUDA, fp32 on CPU); ``cuda_graphs``
    (auto: on with CUDA: replay the flow's ODE loop from CUDA graphs); ``precapture_frames`` (auto:
    1500 with graphs, else 0: capture every flow graph for ``max_batch`` requests of up to that many
    frames at load; 0: lazily); ``hift_graphs`` (auto: as ``cuda_graphs``: HiFT graphs of the
    non-final streaming chunk shapes of the exponential schedule for up to ``hift_max_tokens``
    tokens, captured at load; other shapes run eagerly); ``compile`` (torch.compile the flow
    estimator); ``incremental_stream`` (streaming steps run through the flow engine and compute only
    their new frames, at ~115 MB of state per second of audio per stream in fp16); ``final``
    (reference | streaming: how such a stream's final chunk is voiced); ``state_pool_gb`` (the
    engine's state memory; 0: a third of the GPU memory free at load, 2 GB on the CPU);
    ``max_voices`` (voice prompt states kept); ``max_batch`` (units per flow batch).
    """

    model_dir: Path
    dtype: str = AUTO
    cuda_graphs: bool | None = None
    precapture_frames: int | None = None
    hift_graphs: bool | None = None
    hift_max_tokens: int = 750
    hift_dtype: str = AUTO
    compile: bool | None = False
    incremental_stream: bool | None = True
    final: str = "reference"
    state_pool_gb: float = 0.0
    max_voices: int = 64
    max_batch: int = 16
    stream_idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S

    def flow_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == AUTO:
            return default_flow_dtype(device)
        return resolve_device_dtype(device, self.dtype)[1]

    def options(self, device: torch.device) -> Token2WavOptions:
        cuda_graphs = device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        hift_graphs = cuda_graphs if self.hift_graphs is None else self.hift_graphs
        precapture = self.precapture_frames
        if precapture is None:
            precapture = DEFAULT_PRECAPTURE_FRAMES if cuda_graphs else 0
        incremental = bool(self.incremental_stream)
        return Token2WavOptions(
            # incremental streams run their non-final chunks through the engine: only the
            # non-streaming (offline, final pass) flow graphs are needed then
            cuda_graphs=cuda_graphs, compile=bool(self.compile), precapture_frames=precapture,
            precapture_streaming=not incremental,
            precapture_batch=self.max_batch, hift_graphs=hift_graphs,
            hift_precapture_frames=streaming_vocoder_frames(self.hift_max_tokens) if hift_graphs else (),
            incremental_stream=incremental, final=self.final,
            state_pool_bytes=int(self.state_pool_gb * (1 << 30)), max_voices=self.max_voices,
            hift_dtype=self.hift_dtype)


@dataclass(frozen=True)
class LLMSettings(GpuSharingSettings):
    """The ``llm`` model: ``llm_backend`` (torch | hf, :func:`~cosyserve.llm.backends.create_backend`);
    ``model_dir`` (optional: precompute the LLM prefixes of its registered voices); ``send_timeout_s``
    (a response send that takes longer cancels its request)."""

    llm_dir: Path
    model_dir: Path | None = None
    llm_backend: str = "torch"
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S


@dataclass(frozen=True)
class EngineSettings:
    """The ``cosyvoice2``, ``cosyvoice3`` and ``cosyvoice2_dit`` models: the engine core
    (:mod:`cosyserve.engine`) of ``model_kind`` (cosyvoice2 | cosyvoice3 | step_audio2,
    :data:`~cosyserve.engine.service.MODEL_KINDS`) behind a thin front door. ``spk2info``: the
    registered voices (empty: ``model_dir``'s spk2info.pt; Step-Audio2's token2wav directory has
    none: CosyVoice2's).

    Speech tokens: ``llm_url`` (OpenAI-compatible servers; model ``llm_model``, empty: the first
    one lists) when set, else the Triton model ``llm_model_name`` (speaking ``llm_protocol``,
    empty: by the name) when set (``tensorrt_llm``: TensorRT-LLM; the reference layout), else our
    LLM engine in the loop (``llm_max_slots`` requests decoded at once, ``llm_max_model_len``
    positions each). ``device`` (auto: CUDA when available); the flow in ``token2wav_dtype``
    (auto: fp16 on CUDA for CosyVoice2 and Step-Audio2, bfloat16 for CosyVoice3's DiT: a plain fp16 DiT
    gives NaNs upstream), HiFT's network in ``hift_dtype`` (CosyVoice2's; the others' HiFT is fp32);
    ``cuda_graphs`` (auto: on with CUDA: the flow's steps and HiFT's streaming shapes from CUDA
    graphs; Step-Audio2's kind runs eagerly); ``final`` (CosyVoice2: reference | streaming: how a
    stream's last chunk is voiced);
    ``incremental_stream`` (CosyVoice3: true: a stream's flow samples only its new frames under the
    DiT's block mask; false: the reference's full-attention re-run over all tokens every chunk);
    ``state_pool_gb`` (CosyVoice2's flow state pages; 0: a third of the GPU memory free after the
    LLM loads); ``max_voices`` (voice prompt states kept); ``frontend_backend`` (the speech tokenizer's and speaker encoder's: torch, onnxruntime,
    auto); ``max_batch_frames`` / ``max_batch_jobs`` (a flow batch's budget);
    ``prepare_threads`` (threads that resolve voices and build prompts: a new clip's front-end
    runs there, never in the loop); ``engine_warm_up`` (auto: on with CUDA: the server reports
    ready only once every shape is captured and a few requests have run through the loop).
    """

    model_dir: Path
    llm_tokenizer_dir: Path
    llm_model_name: str = ""  # empty: the LLM engine in the loop
    llm_protocol: str = ""
    llm_url: str = ""
    llm_model: str = ""
    streaming_strategy: str = "exponential"
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    torch_threads: int = 0
    max_text_chars: int = MAX_TEXT_CHARS  # the whole request text (cosyvoice2 splits it into segments)
    voices_dir: Path | None = None  # voices uploaded through the HTTP API; default <model_dir>/voices
    warm_up: bool | None = True  # load the text front-end at start (auto: on)
    # seconds a request may run once an instance has taken it (0: no limit); past that it ends with
    # "request timed out after N s" and releases its LLM request and token2wav session
    request_timeout_s: float = 0.0
    # refuse a new request while a stream of this server has less audio buffered ahead of its
    # listener than this many seconds (0: admit every request); the engine's Scheduler
    admission_min_buffer_s: float = 0.0
    # refuse a new request while this server already sends this many streams (0: no cap); the engine's Scheduler
    max_streams: int = 0
    model_kind: str = "cosyvoice2"
    spk2info: Path | None = None
    device: str = AUTO
    llm_max_slots: int = 64
    llm_max_model_len: int = 2048
    token2wav_dtype: str = AUTO
    cuda_graphs: bool | None = None
    hift_dtype: str = AUTO
    hift_max_tokens: int = 750
    final: str = "reference"
    incremental_stream: bool | None = True
    state_pool_gb: float = 0.0
    max_voices: int = 64
    frontend_backend: str = AUTO
    max_batch_frames: int = DEFAULT_MAX_BATCH_FRAMES
    max_batch_jobs: int = DEFAULT_MAX_BATCH_JOBS
    prepare_threads: int = 4
    engine_warm_up: bool | None = None

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def kind_options(self, device: torch.device) -> dict:
        """The token2wav kind's options (:func:`~cosyserve.engine.service.load_engine`'s ``kind_options``)."""
        graphs = device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        dtype = None if self.token2wav_dtype == AUTO else resolve_device_dtype(device, self.token2wav_dtype)[1]
        if self.model_kind == "step_audio2":  # the flow's dtype (auto: fp16 on CUDA); HiFT is fp32
            return {"dtype": dtype, "max_voices": self.max_voices}
        if self.model_kind == "cosyvoice3":
            return {"flow_dtype": dtype, "incremental": self.incremental_stream is not False, "cuda_graphs": graphs,
                    "max_voices": self.max_voices}
        return {"flow_dtype": dtype, "cuda_graphs": graphs, "hift_graphs": graphs,
                "hift_precapture_frames": streaming_vocoder_frames(self.hift_max_tokens) if graphs else (),
                "final": self.final, "state_pool_bytes": int(self.state_pool_gb * (1 << 30)),
                "max_voices": self.max_voices, "hift_dtype": self.hift_dtype}

    def warm_up_engine(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.engine_warm_up is None else self.engine_warm_up


@dataclass(frozen=True)
class FrontendSettings(ProcessSettings):
    """The ``audio_tokenizer`` and ``speaker_embedding`` models: ``clip_cache_size`` clips' results
    kept; ``frontend_backend`` torch, onnxruntime or auto (torch on CUDA, onnxruntime on the CPU)."""

    model_dir: Path
    clip_cache_size: int = DEFAULT_FEATURE_CACHE_SIZE
    frontend_backend: str = AUTO


# The settings of each model of ``model_repo/`` that takes parameters (tensorrt_llm is NVIDIA's).
@dataclass(frozen=True)
class OfflineProxySettings:
    """The ``cosyvoice2_offline`` model (:mod:`.offline_proxy`) has no parameters: it forwards to ``cosyvoice2``."""


MODEL_SETTINGS: dict[str, type] = {
    "cosyvoice2_offline": OfflineProxySettings,
    "token2wav": Token2WavSettings, "llm": LLMSettings, "cosyvoice2": EngineSettings, "cosyvoice2_dit": EngineSettings,
    "audio_tokenizer": FrontendSettings, "speaker_embedding": FrontendSettings,
}
