"""The Triton model repository, built from the ``model_repo/`` templates: one builder for every pipeline.

``run.sh`` stage 2 (CosyVoice2: ``cosyvoice2``, the engine core, with ``cosyvoice2_offline`` and
``tensorrt_llm`` when its LLM is TensorRT-LLM; the reference layout's models on request),
``run_cosyvoice3.sh`` stage 2 (CosyVoice3: ``cosyvoice3``, the engine core from the same template),
``run_stepaudio2_dit_token2wav.sh`` stage 2 (Step-Audio2: ``cosyvoice2_dit``, the engine core from
the same template) and the tests all call :func:`build`::

    python -m cosyserve.serving.model_repository cosyvoice2 OUT_DIR --models-dir models --device cpu
    python -m cosyserve.serving.model_repository step_audio2 OUT_DIR --step-audio2-dir models/Step-Audio-2-mini/token2wav \\
        --cosyvoice2-dir models/CosyVoice2-0.5B --llm-dir models/cosyvoice2_llm --llm-url http://h:8100/v1
    python -m cosyserve.serving.model_repository cosyvoice3 OUT_DIR --models-dir models --device cpu

Every field of :class:`CosyVoice2Repository` / :class:`StepAudio2Repository` / :class:`CosyVoice3Repository` is a ``--flag`` of the same
name (``_`` -> ``-``). A template is a ``config.pbtxt`` with ``${key}`` placeholders; :func:`fill`
replaces them (``scripts/fill_template.py`` is its command line, with NVIDIA's syntax).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..runtime import COSYVOICE3_DIR, COSYVOICE3_LLM_DIR, SPK2INFO
from ..token2wav.step_audio2 import DEFAULT_MAX_VOICES
from .settings import EngineSettings, LLMSettings, Token2WavSettings, parameter_value

TEMPLATES = Path(__file__).resolve().parents[2] / "model_repo"
# Parameters that repositories filled with the keys of NVIDIA's runtime (which has none of them)
# leave empty: llm_protocol / llm_url / llm_model of cosyvoice2 (by llm_model_name / a Triton LLM
# model; the first model the server lists), spk2info (<model_dir>/spk2info.pt),
# text_warm_up (on), model_kind (cosyvoice2), voices_dir (<model_dir>/voices), request_timeout_s (no
# limit), admission_min_buffer_s and max_streams (off) and
# mps_thread_percentage / mps_priority (no cap, normal priority), frontend_backend (auto: torch on
# CUDA, onnxruntime on the CPU); max_queue_size and
# queue_timeout_microseconds 0 are no limit.
DEFAULTS = {"max_queue_size": "0", "queue_timeout_microseconds": "0", "max_queue_delay_microseconds": "0",
            "llm_protocol": "", "llm_url": "", "engine_warm_up": "",
            "text_warm_up": "", "request_timeout_s": "", "admission_min_buffer_s": "", "max_streams": "",
            "mps_thread_percentage": "", "mps_priority": "", "frontend_backend": "",
            "model_kind": "", "voices_dir": "", "token2wav_incremental_stream": "", "spk2info": "", "llm_model": ""}
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


# ----- templates -----

class TemplateError(ValueError):
    """The substitutions do not fit the template."""


def split_unescaped(text: str, delimiter: str, maxsplit: int = -1) -> list[str]:
    """Split ``text`` on ``delimiter`` where it is not preceded by a backslash.

    Escapes are kept in the parts (so that a later split still sees them); see :func:`unescape`.
    """
    parts, start, i = [], 0, 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == delimiter and (maxsplit < 0 or len(parts) < maxsplit):
            parts.append(text[start:i])
            start = i + 1
        i += 1
    return parts + [text[start:]]


def unescape(text: str) -> str:
    """``\\x`` -> ``x`` (a trailing backslash stays)."""
    return re.sub(r"\\(.)", r"\1", text, flags=re.DOTALL)


def parse_substitutions(spec: str) -> dict[str, str]:
    """``"a:1,b:x\\,y:z"`` -> ``{"a": "1", "b": "x,y:z"}``."""
    substitutions = {}
    for item in split_unescaped(spec, ","):
        if not item:
            continue
        key_value = split_unescaped(item, ":", maxsplit=1)
        key = unescape(key_value[0]).strip()
        if len(key_value) != 2 or not key:
            raise TemplateError(f"substitution {item!r} is not key:value")
        substitutions[key] = unescape(key_value[1])
    return substitutions


def fill(template: str, substitutions: dict[str, str]) -> str:
    """Replace ``${key}`` by its value; raises :class:`TemplateError` on unknown or unfilled keys."""
    present = set(PLACEHOLDER.findall(template))
    unknown = sorted(set(substitutions) - present)
    if unknown:
        raise TemplateError(f"key(s) {', '.join(unknown)} do not appear as ${{...}} in the template")
    values = {**DEFAULTS, **substitutions}
    filled = PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)
    # Values are inserted verbatim and never re-scanned, so what is left came from the template.
    left = sorted({m.group(1) for m in PLACEHOLDER.finditer(template) if m.group(1) not in values})
    if left:
        raise TemplateError("unfilled placeholder(s): " + ", ".join(f"${{{k}}}" for k in left))
    return filled


# ----- repositories -----

@dataclass(frozen=True)
class ModelEntry:
    """One model of a repository: ``template`` (a ``model_repo/`` folder) filled with ``values``."""

    template: str
    values: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class EngineRepository:
    """What every engine repository sets (the run scripts' variables in the comments): the
    engine template's values that do not depend on the model kind."""

    llm_url: str = EngineSettings.llm_url                      # LLM_URL: no LLM in the loop then
    decoupled: bool = True                                     # DECOUPLED_MODE
    streaming_strategy: str = EngineSettings.streaming_strategy  # STREAMING_STRATEGY
    device: str = EngineSettings.device                        # DEVICE
    max_tokens: int = EngineSettings.max_tokens                # MAX_TOKENS
    min_tokens: int = EngineSettings.min_tokens                # MIN_TOKENS
    text_warm_up: str = parameter_value(EngineSettings.warm_up)  # TEXT_WARM_UP (the text front-end)
    engine_warm_up: str = parameter_value(EngineSettings.engine_warm_up)  # ENGINE_WARM_UP
    request_timeout_s: float = EngineSettings.request_timeout_s  # REQUEST_TIMEOUT_S
    admission_min_buffer_s: float = EngineSettings.admission_min_buffer_s  # ADMISSION_MIN_BUFFER_S (0: off)
    # Streams the engine sends at most; a new request past that is refused at once ("overloaded:
    # ..."); 0: no cap.
    max_streams: int = EngineSettings.max_streams              # MAX_STREAMS
    frontend_backend: str = EngineSettings.frontend_backend    # FRONTEND_BACKEND (auto: torch on CUDA)

    def engine_values(self, model_dir: str, llm_dir: str) -> dict[str, str]:
        """The engine template's values that every model kind's repository sets alike."""
        return {"model_dir": model_dir, "triton_max_batch_size": str(self.max_batch_size), "device": self.device,
                "llm_tokenizer_dir": llm_dir, "streaming_strategy": self.streaming_strategy, "llm_url": self.llm_url,
                "max_tokens": str(self.max_tokens), "min_tokens": str(self.min_tokens),
                "text_warm_up": self.text_warm_up, "engine_warm_up": self.engine_warm_up,
                "request_timeout_s": parameter_value(self.request_timeout_s),
                "admission_min_buffer_s": parameter_value(self.admission_min_buffer_s),
                "max_streams": _max_streams(self.max_streams), "decoupled_mode": str(self.decoupled),
                "frontend_backend": self.frontend_backend}


@dataclass(frozen=True)
class CosyVoice2Repository(EngineRepository):
    """What ``run.sh`` stage 2 builds (its variables in the comments): ``cosyvoice2``, the engine
    core behind its front door, with ``cosyvoice2_offline`` beside a decoupled one (one response
    per request, from the same engine), ``tensorrt_llm`` with LLM_BACKEND=trtllm, and with
    ``reference_models`` the reference layout's own models (``llm``, ``token2wav``,
    ``audio_tokenizer``, ``speaker_embedding``: to call them directly; the engine does not)."""

    models_dir: Path                                           # MODELS_DIR (CosyVoice2-0.5B, cosyvoice2_llm)
    # torch: our LLM engine in the cosyvoice2 model's loop | trtllm: the tensorrt_llm model
    llm_backend: str = "torch"                                 # LLM_BACKEND
    llm_engine: str = LLMSettings.llm_backend                  # LLM_ENGINE (the reference llm model's)
    llm_protocol: str = EngineSettings.llm_protocol            # LLM_PROTOCOL
    trt_engine_dir: str = ""                                   # TRT_ENGINE_DIR
    trt_kv_cache_tokens: int = 2560                            # TRT_KV_CACHE_TOKENS
    offline_bls_instances: int = 1                             # OFFLINE_BLS_INSTANCE_NUM
    # cosyvoice2_offline's waiting requests at most (past that: refused at once, UNAVAILABLE); 0: no
    # limit; None: as many as instances. And how long one may wait (ms; 0: no limit).
    offline_bls_max_queue_size: int | None = 0                 # OFFLINE_BLS_MAX_QUEUE_SIZE
    offline_bls_max_queue_ms: float = 0                        # OFFLINE_BLS_MAX_QUEUE_MS
    max_batch_size: int = Token2WavSettings.max_batch          # TRITON_MAX_BATCH_SIZE
    max_queue_delay_microseconds: int = 0                      # MAX_QUEUE_DELAY_MICROSECONDS
    token2wav_dtype: str = Token2WavSettings.dtype             # TOKEN2WAV_*
    token2wav_cuda_graphs: str = parameter_value(Token2WavSettings.cuda_graphs)
    token2wav_final: str = Token2WavSettings.final
    token2wav_state_pool_gb: float = Token2WavSettings.state_pool_gb
    token2wav_max_voices: int = Token2WavSettings.max_voices
    token2wav_hift_dtype: str = Token2WavSettings.hift_dtype
    reference_models: bool = False                             # REFERENCE_MODELS

    def models(self) -> dict[str, ModelEntry]:
        """Model name -> entry; ``cosyvoice2_offline`` next to a decoupled ``cosyvoice2`` (HTTP
        clients cannot read decoupled models)."""
        model_dir, llm_dir = f"{self.models_dir}/CosyVoice2-0.5B", f"{self.models_dir}/cosyvoice2_llm"
        common = {"model_dir": model_dir, "triton_max_batch_size": str(self.max_batch_size),
                  "max_queue_delay_microseconds": str(self.max_queue_delay_microseconds), "device": self.device}
        token2wav = {"token2wav_dtype": self.token2wav_dtype, "token2wav_cuda_graphs": self.token2wav_cuda_graphs,
                     "token2wav_final": self.token2wav_final,
                     "token2wav_state_pool_gb": f"{self.token2wav_state_pool_gb:g}",
                     "token2wav_max_voices": str(self.token2wav_max_voices),
                     "token2wav_hift_dtype": self.token2wav_hift_dtype}
        models = {}
        if self.reference_models:
            models["token2wav"] = ModelEntry("token2wav", {
                **common, **token2wav, "token2wav_incremental_stream": "auto", "token2wav_precapture_frames": "auto",
                "token2wav_compile": "auto", "token2wav_hift_graphs": "auto", "mps_thread_percentage": "",
                "mps_priority": ""})
            frontend = {**common, "frontend_backend": self.frontend_backend}
            models["audio_tokenizer"] = ModelEntry("audio_tokenizer", frontend)
            models["speaker_embedding"] = ModelEntry("speaker_embedding", frontend)
            models["llm"] = ModelEntry("llm", {**common, "llm_dir": llm_dir, "llm_engine": self.llm_engine,
                                               "mps_thread_percentage": "", "mps_priority": ""})
        # The engine's speech tokens: the completions server at llm_url, the tensorrt_llm model, or
        # (llm_model_name empty) our LLM engine in its own loop.
        llm_model = "tensorrt_llm" if self.llm_backend == "trtllm" and not self.llm_url else ""
        if llm_model:
            kv_tokens = str(self.trt_kv_cache_tokens)
            models["tensorrt_llm"] = ModelEntry("tensorrt_llm", {
                "triton_backend": "tensorrtllm", "triton_max_batch_size": str(self.max_batch_size),
                "decoupled_mode": "True", "max_beam_width": "1", "engine_dir": self.trt_engine_dir,
                "max_tokens_in_paged_kv_cache": kv_tokens, "max_attention_window_size": kv_tokens,
                "kv_cache_free_gpu_mem_fraction": "0.5", "exclude_input_in_output": "True",
                "enable_kv_cache_reuse": "False", "batching_strategy": "inflight_fused_batching",
                "max_queue_delay_microseconds": str(self.max_queue_delay_microseconds),
                "encoder_input_features_data_type": "TYPE_FP16", "logits_datatype": "TYPE_FP32"})
        models["cosyvoice2"] = ModelEntry("cosyvoice2", {
            **self.engine_values(model_dir, llm_dir), **token2wav, "llm_model_name": llm_model,
            "llm_protocol": self.llm_protocol})
        if self.decoupled:
            models["cosyvoice2_offline"] = ModelEntry("cosyvoice2_offline", {
                "triton_max_batch_size": str(self.max_batch_size), "bls_instance_num": str(self.offline_bls_instances),
                **_queue_policy(self.offline_bls_max_queue_size, self.offline_bls_instances,
                                self.offline_bls_max_queue_ms)})
        return models


def _queue_policy(size: int | None, instances: int, max_wait_ms: float) -> dict[str, str]:
    """A BLS model's queue bounds (its ``default_queue_policy``): waiting requests at most (None: as
    many as instances) and how long each may wait, in microseconds (0: no limit for either)."""
    if size is None:
        size = instances
    if size < 0:
        raise ValueError(f"a queue size is 0 (no limit) or more, got {size}")
    if max_wait_ms < 0:
        raise ValueError(f"a queue wait is 0 (no limit) or more milliseconds, got {max_wait_ms:g}")
    return {"max_queue_size": str(size), "queue_timeout_microseconds": str(round(max_wait_ms * 1000))}


def _max_streams(cap: int) -> str:
    if cap < 0:
        raise ValueError(f"max_streams is 0 (no cap) or more streams, got {cap}")
    return str(cap)


@dataclass(frozen=True)
class StepAudio2Repository(EngineRepository):
    """What ``run_stepaudio2_dit_token2wav.sh`` stage 2 builds (its variables in the comments):
    ``cosyvoice2_dit``, the engine core with Step-Audio2's kind (CosyVoice2's LLM, prompt layout and
    voices; Step-Audio-2-mini's DiT flow and HiFT) behind the front door ``cosyvoice2`` runs on, with
    NVIDIA's wire protocol (its ``cosyvoice2_dit`` BLS, ``token2wav_dit`` and ``audio_tokenizer`` are
    one process here). Speech tokens from the OpenAI-compatible server(s) at ``llm_url``, else from
    the LLM in the engine's loop."""

    step_audio2_dir: Path                                      # DIT_MODEL_DIR (Step-Audio-2-mini/token2wav)
    cosyvoice2_dir: Path                                       # COSYVOICE2_DIR (its spk2info.pt: the voices)
    llm_dir: Path                                              # LLM_DIR (the tokenizer; the LLM without llm_url)
    llm_model: str = EngineSettings.llm_model                  # LLM_MODEL (empty: the first llm_url lists)
    max_batch_size: int = 1                                    # TRITON_MAX_BATCH_SIZE
    token2wav_dtype: str = EngineSettings.token2wav_dtype      # TOKEN2WAV_DTYPE
    token2wav_max_voices: int = DEFAULT_MAX_VOICES             # TOKEN2WAV_MAX_VOICES
    voices_dir: str = ""                                       # VOICES_DIR (empty: <step_audio2_dir>/voices)

    def models(self) -> dict[str, ModelEntry]:
        return {"cosyvoice2_dit": ModelEntry("cosyvoice2", {
            **self.engine_values(str(self.step_audio2_dir), str(self.llm_dir)), "model_kind": "step_audio2",
            "spk2info": f"{self.cosyvoice2_dir}/{SPK2INFO}", "llm_model": self.llm_model,
            "voices_dir": self.voices_dir, "llm_model_name": "", "llm_protocol": "",
            "token2wav_dtype": self.token2wav_dtype, "token2wav_max_voices": str(self.token2wav_max_voices),
            # CosyVoice2's and CosyVoice3's own settings: not read by Step-Audio2's kind
            "token2wav_cuda_graphs": "", "token2wav_final": "", "token2wav_state_pool_gb": "",
            "token2wav_hift_dtype": ""})}


@dataclass(frozen=True)
class CosyVoice3Repository(EngineRepository):
    """What ``run_cosyvoice3.sh`` stage 2 builds (its variables in the comments): ``cosyvoice3``, the
    engine core with CosyVoice3's kind (DiT flow + causal HiFT, the LLM in its loop or at
    ``llm_url``) behind the same front door as ``cosyvoice2`` (the reference's five models are one
    process here: its LLM, token2wav, vocoder, tokenizer and speaker encoder run in the loop)."""

    models_dir: Path                                           # MODELS_DIR (Fun-CosyVoice3-0.5B-2512, cosyvoice3_llm)
    max_batch_size: int = 1                                    # TRITON_MAX_BATCH_SIZE
    token2wav_dtype: str = EngineSettings.token2wav_dtype      # TOKEN2WAV_DTYPE
    token2wav_incremental_stream: str = parameter_value(EngineSettings.incremental_stream)  # TOKEN2WAV_INCREMENTAL_STREAM
    token2wav_max_voices: int = 8                              # TOKEN2WAV_MAX_VOICES
    token2wav_cuda_graphs: str = parameter_value(EngineSettings.cuda_graphs)  # TOKEN2WAV_CUDA_GRAPHS
    voices_dir: str = ""                                       # VOICES_DIR (empty: <model dir>/voices)

    def models(self) -> dict[str, ModelEntry]:
        model_dir, llm_dir = f"{self.models_dir}/{COSYVOICE3_DIR}", f"{self.models_dir}/{COSYVOICE3_LLM_DIR}"
        return {"cosyvoice3": ModelEntry("cosyvoice2", {
            **self.engine_values(model_dir, llm_dir), "model_kind": "cosyvoice3", "voices_dir": self.voices_dir,
            "llm_model_name": "", "llm_protocol": "", "token2wav_dtype": self.token2wav_dtype,
            "token2wav_incremental_stream": self.token2wav_incremental_stream,
            "token2wav_max_voices": str(self.token2wav_max_voices), "token2wav_cuda_graphs": self.token2wav_cuda_graphs,
            # CosyVoice2's own settings: not read by CosyVoice3's kind
            "token2wav_final": "", "token2wav_state_pool_gb": "", "token2wav_hift_dtype": ""})}


PIPELINES = {"cosyvoice2": CosyVoice2Repository, "step_audio2": StepAudio2Repository, "cosyvoice3": CosyVoice3Repository}


def build(spec: CosyVoice2Repository | StepAudio2Repository | CosyVoice3Repository, out: str | Path, templates: str | Path = TEMPLATES) -> Path:
    """Replace ``out`` with the repository ``spec`` describes; returns ``out``.

    Every template is filled before ``out`` is touched: when one does not fit
    (:class:`TemplateError`), ``out`` stays as it was."""
    out, templates = Path(out), Path(templates)
    configs = {}
    for name, entry in spec.models().items():
        text = fill((templates / entry.template / "config.pbtxt").read_text(), entry.values)
        configs[name] = text.replace(f'name: "{entry.template}"', f'name: "{name}"', 1)
    shutil.rmtree(out, ignore_errors=True)
    for name, entry in spec.models().items():
        shutil.copytree(templates / entry.template, out / name)
        (out / name / "config.pbtxt").write_text(configs[name])
    return out


# ----- command line -----

def _flag_type(annotation: object):
    if annotation is bool:
        return _boolean
    if annotation == int | None:
        return _optional_int
    return annotation if annotation in (int, float, Path) else str


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "auto") else int(text)


def _boolean(text: str) -> bool:
    value = {"true": True, "false": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None
               ) -> tuple[CosyVoice2Repository | StepAudio2Repository | CosyVoice3Repository, Path, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipelines = parser.add_subparsers(dest="pipeline", required=True)
    for name, spec in PIPELINES.items():
        sub = pipelines.add_parser(name, help=spec.__doc__)
        sub.add_argument("out", type=Path, help="the repository folder (replaced)")
        sub.add_argument("--templates", type=Path, default=TEMPLATES, help="the model_repo/ folder of templates")
        hints = typing.get_type_hints(spec)
        for field in dataclasses.fields(spec):
            required = field.default is dataclasses.MISSING
            sub.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=_flag_type(hints[field.name]),
                             required=required, default=None if required else field.default,
                             help=None if required else f"default: {field.default!r}")
    args = vars(parser.parse_args(argv))
    spec = PIPELINES[args.pop("pipeline")]
    out, templates = args.pop("out"), args.pop("templates")
    return spec(**args), out, templates


def main(argv: Sequence[str] | None = None) -> int:
    spec, out, templates = parse_args(argv)
    try:
        build(spec, out, templates)
    except (ValueError, OSError) as e:  # TemplateError, or a setting out of range
        print(f"model_repository: {e}", file=sys.stderr)
        return 1
    for name in sorted(spec.models()):
        print(f"{out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
