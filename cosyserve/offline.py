"""Offline batch TTS (``offline_inference.py``): a dataset in, wavs and a timing report out, over the engine.

The model kind (``OfflineConfig.model``, a key of :data:`~cosyserve.engine.service.MODEL_KINDS`)
is a parameter: :func:`~cosyserve.engine.service.load_engine` loads its stack from the bundle's
directories (:data:`~cosyserve.engine.service.BUNDLE_DIRS`) and everything else is one path. The LLM is the engine's own
(``torch``: our LLM engine, free-running beside the loop) or a :mod:`cosyserve.llm` back end
generating on its own threads (``hf``, ``trtllm``, ``openai``). The engine runs in this process:
an offline run has no front door to share it with.

Per batch of ``batch_size`` utterances: the voices are resolved (speech tokenizer + speaker
encoder on each prompt, or one registered speaker for all) and the text normalised and split into
segments as the server does (:mod:`cosyserve.text`); that is the front-end time. Then every
segment goes to the engine at once as an offline request of its own (its own token limits), and
the LLM batches their decode steps, the engine batches their flow passes (at most ``token2wav_batch_size``
flow jobs per batch) and vocodes them together; that is the engine time, up to the last
segment's waveform. An item's wav is its segments' concatenation. RTF = (front-end + engine time)
/ seconds of audio; writing files is not timed. The engine's own counters
(:class:`~cosyserve.engine.core.EngineCounters`: time of its loop in flow starts, flow batches,
vocoder, host work, idle; ``llm_busy_s``: our LLM engine's busy time on its own thread, beside the
loop) say where the engine time went.

HiFT's noise is a function of ``seed`` and the call's length only (:class:`SeededSineNoise`), so
the audio does not depend on batch sizes or on which requests share a vocoder call.

Benchmarks on random weights need realistic lengths (a random LLM rarely samples the end of
speech): with :class:`~cosyserve.data.FixedLength` every utterance generates exactly
``round(rate x seconds)`` tokens (``min_tokens = max_tokens``, at most ``MAX_SPEECH_TOKENS``), the
seconds being given (one value, or a seeded uniform draw per utterance between two values) or
estimated from the text (:func:`estimate_seconds`), and shared among its segments by their
spoken characters.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
import unicodedata
import wave
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .data import FixedLength, Utterance, load_reference_audio
from .engine.core import EngineCounters
from .engine.request import EngineRequest
from .engine.scheduler import Scheduler
from .engine.service import BUNDLE_DIRS, MODEL_KINDS, TTSEngine, load_engine
from .errors import InvalidInputError
from .llm.backends import create_backend
from .llm.base import BackendUnavailableError
from .llm.prompt import MAX_SPEECH_TOKENS
from .models.hift.config import HiftConfig
from .runtime import resolve_device
from .schedule import TOKEN_RATE
from .token2wav.cosyvoice2 import Token2WavOptions
from .engine.front_end import SegmentPrompt, TokenLimits, TTSRequest, Voice

BACKENDS = ("torch", "hf", "trtllm", "vllm", "openai")
MODELS = tuple(MODEL_KINDS)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
VLLM_UNSUPPORTED = (
    "the vllm backend is not supported yet: vLLM's Qwen2 loader drops the CosyVoice2 LLM's lm_head bias "
    "(llm_layout.md §2), so it would sample text tokens instead of speech. Serve the LLM with a server that "
    "keeps the bias (python -m cosyserve.llm.openai_server) and use --backend openai --openai-base-url URL, "
    "or use --backend torch")

# The token2wav kind's options (load_engine's ``kind_options``) from the command line's: the flow
# dtype (None: the kind's default) and Token2WavOptions (CosyVoice2's speed-ups; CosyVoice3 takes
# its CUDA graphs; Step-Audio2 none).
KIND_OPTIONS: dict[str, Callable[[torch.dtype | None, Token2WavOptions], dict]] = {
    "cosyvoice2": lambda dtype, o: {"flow_dtype": dtype, "cuda_graphs": o.cuda_graphs, "compile": o.compile,
                                    "precapture_frames": o.precapture_frames, "precapture_batch": o.precapture_batch,
                                    "precapture_streaming": o.precapture_streaming},
    "cosyvoice3": lambda dtype, o: {"flow_dtype": dtype, "cuda_graphs": o.cuda_graphs},
    "step_audio2": lambda dtype, o: {"dtype": dtype},
}


def spoken_characters(text: str) -> int:
    """Letters and digits: a speaking-rate unit that does not depend on the tokenizer (a CJK
    character is a syllable; within one language, letters are proportional to speech)."""
    return sum(1 for ch in text if unicodedata.category(ch)[0] in "LN")


def share_tokens(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (rounded cumulatively, so the parts add up), at least 1 each."""
    weights = [max(w, 1) for w in weights]
    bounds = [0] + [round(total * c / sum(weights)) for c in itertools.accumulate(weights)]
    return [max(1, b - a) for a, b in zip(bounds, bounds[1:])]


def estimate_seconds(voice: Voice, target_text: str) -> float:
    """The prompt's speaking rate applied to the target text: prompt seconds x target / prompt characters."""
    prompt_chars = spoken_characters(voice.prompt_text)
    if prompt_chars == 0:
        raise InvalidInputError("cannot estimate the output length: the voice's prompt text has no letters; "
                                "give --fixed-output-seconds")
    return voice.features.speech_tokens.numel() / TOKEN_RATE * spoken_characters(target_text) / prompt_chars


@dataclass
class OfflineConfig:
    model: str = "cosyvoice2"  # a key of MODEL_KINDS (MODELS)
    backend: str = "torch"
    device: str = "auto"
    dtype: str | None = None  # flow dtype; None: the kind's default (CosyVoice2 fp16 on CUDA, fp32 on the CPU)
    llm_dtype: str | None = None  # default bfloat16 on CUDA, float32 on CPU
    batch_size: int = 16  # utterances submitted to the engine together
    token2wav_batch_size: int = 8  # flow jobs per batch (the engine's max_batch_jobs)
    token2wav_options: Token2WavOptions = field(default_factory=Token2WavOptions)
    fixed_length: FixedLength | None = None
    speaker_id: str | None = None  # use this registered voice for every utterance instead of its prompt
    seed: int = 0  # HiFT noise and the fixed-length draws
    llm_options: dict = field(default_factory=dict)  # e.g. engine_dir (trtllm), base_url (openai)
    frontend_backend: str | None = None  # speech tokenizer + CAM++: torch / onnxruntime; None: by device

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise InvalidInputError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.backend not in BACKENDS:
            raise InvalidInputError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.model == "cosyvoice3" and self.backend not in ("torch", "hf", "openai"):
            raise InvalidInputError(f"the {self.backend} backend does not serve CosyVoice3 here; use torch, hf "
                                    "or openai")
        for name in ("batch_size", "token2wav_batch_size"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("dtype", "llm_dtype"):
            if getattr(self, name) not in (None, *DTYPES):
                raise InvalidInputError(f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")


@dataclass
class ItemResult:
    id: str
    speech_tokens: int
    audio_s: float
    wav: str
    segments: int  # of the text, each one LLM request and one offline request of the engine


ENGINE_COUNTERS = ("llm_busy_s", *(f.name for f in dataclasses.fields(EngineCounters)))


@dataclass
class Timers:
    """Wall time on the calling thread (front-end: voices and segment prompts; engine: submit to the
    last waveform) and the engine's counters over the same batches."""

    frontend_s: float = 0.0
    engine_s: float = 0.0
    engine: dict = field(default_factory=lambda: dict.fromkeys(ENGINE_COUNTERS, 0))

    @property
    def total_s(self) -> float:
        return self.frontend_s + self.engine_s

    def add_counters(self, before: dict, after: dict) -> None:
        for name in ENGINE_COUNTERS:
            self.engine[name] += after[name] - before[name]


class SeededSineNoise:
    """HiFT's harmonic-source noise as a function of ``seed`` and the call's length only (the
    kinds' ``sine_noise``): the same utterance gets the same noise whatever it is batched with."""

    def __init__(self, seed: int, device: torch.device, harmonics: int = HiftConfig().nb_harmonics + 1) -> None:
        self.seed, self.device, self.harmonics = seed, device, harmonics

    def __call__(self, samples: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{samples}".encode()))
        return torch.randn(1, samples, self.harmonics, generator=generator).to(self.device)


def create_llm(name: str, llm_dir: Path, device: torch.device, dtype: str | None, **options):
    """An LLM back end by name (not ``torch``: that is the engine's own); those not installable
    here raise BackendUnavailableError saying what to install."""
    if name == "vllm":
        raise BackendUnavailableError(VLLM_UNSUPPORTED)
    return create_backend(name, llm_dir, device, dtype, **options)


class OfflineTTS:
    """The engine of ``config.model`` over a bundle root (layout of :func:`cosyserve.bundle.make_bundle`)."""

    def __init__(self, models_dir: str | Path, config: OfflineConfig):
        self.config = config
        models_dir = Path(models_dir)
        token2wav_dir, llm_dir, spk2info = BUNDLE_DIRS[config.model]
        model_dir, llm_dir = models_dir / token2wav_dir, models_dir / llm_dir
        spk2info = models_dir / spk2info if spk2info else None
        for path in (model_dir, llm_dir, *((spk2info,) if spk2info else ())):
            if not path.exists():
                raise InvalidInputError(f"{path} does not exist: --model-dir must hold {token2wav_dir}/ and "
                                        f"{llm_dir.name}/{f' and {spk2info.relative_to(models_dir)}' if spk2info else ''}"
                                        f" for --model {config.model}")
        self.device = resolve_device(config.device)
        spec = MODEL_KINDS[config.model]
        llm_backend, llm_options = None, {}
        if config.backend == "torch":
            llm_options = {"dtype": DTYPES[config.llm_dtype] if config.llm_dtype else None, **config.llm_options}
        else:
            options = dict(config.llm_options)
            if config.backend == "openai":
                options.setdefault("layout", spec.layout.name)
            llm_backend = create_llm(config.backend, llm_dir, self.device, config.llm_dtype, **options)
        dtype = DTYPES[config.dtype] if config.dtype else None
        try:
            self.engine: TTSEngine = load_engine(
                config.model, model_dir, llm_dir, self.device,
                kind_options=KIND_OPTIONS[config.model](dtype, config.token2wav_options), llm_backend=llm_backend,
                llm_options=llm_options,
                scheduler=Scheduler(max_batch_jobs=config.token2wav_batch_size),
                sine_noise=SeededSineNoise(config.seed, self.device), frontend_backend=config.frontend_backend,
                spk2info=spk2info)
        except BaseException:
            if llm_backend is not None:
                llm_backend.close()
            raise
        self.voices = self.engine.voices
        self.sample_rate = self.engine.sample_rate

    def close(self) -> None:
        self.engine.close()

    def voice(self, item: Utterance) -> Voice:
        if self.config.speaker_id:
            return self.voices.resolve(speaker_id=self.config.speaker_id)
        return self.voices.resolve(load_reference_audio(item.reference_audio), item.reference_text)

    def segments(self, item: Utterance, voice: Voice) -> list[SegmentPrompt]:
        """The item's text segments' LLM prompts (the text front-end, as the server runs it)."""
        return list(self.engine.prompter.segment_prompts(TTSRequest(item.id, item.target_text, voice)))

    def segment_limits(self, voice: Voice, item: Utterance, seconds: float | None,
                       segments: Sequence[SegmentPrompt]) -> list[TokenLimits]:
        fixed = self.config.fixed_length
        if fixed is None:
            return [TokenLimits()] * len(segments)
        tokens = fixed.tokens(seconds if seconds is not None else estimate_seconds(voice, item.target_text))
        shares = share_tokens(tokens, [spoken_characters(s.text) for s in segments])
        return [TokenLimits(max_tokens=min(n, MAX_SPEECH_TOKENS), min_tokens=min(n, MAX_SPEECH_TOKENS))
                for n in shares]

    def run(self, requests: Sequence[tuple[SegmentPrompt, Voice, TokenLimits]]) -> list[np.ndarray]:
        """Every (segment, voice, limits) as an offline request of the engine, all submitted at once;
        their waveforms in order (blocking). The first failure is raised after all have ended."""
        waves: list[list[np.ndarray]] = [[] for _ in requests]
        errors: list[BaseException | None] = [None] * len(requests)
        left = len(requests)
        done = threading.Condition()

        def finisher(i: int) -> Callable[[BaseException | None], None]:
            def finish(error: BaseException | None) -> None:
                nonlocal left
                with done:
                    errors[i] = error
                    left -= 1
                    done.notify()
            return finish

        submitted = 0
        try:
            for i, (segment, voice, limits) in enumerate(requests):
                self.engine.core.submit(EngineRequest(segment.request_id, iter([segment]), voice, limits, False,
                                                      waves[i].append, finisher(i)))
                submitted += 1
        except BaseException:
            for segment, _, _ in requests[:submitted]:
                self.engine.cancel(segment.request_id)
            raise
        finally:
            with done:
                left -= len(requests) - submitted
                done.wait_for(lambda: left == 0)
        for error in errors:
            if error is not None:
                raise error
        return [np.concatenate(pieces) if pieces else np.zeros(0, np.float32) for pieces in waves]


def _counters(tts: OfflineTTS) -> dict:
    return {"llm_busy_s": 0.0, **tts.engine.stats().counters}  # an LLM on its own threads: no busy time here


def synthesize_items(tts: OfflineTTS, items: Sequence[Utterance], output_dir: Path, *,
                     progress: Callable[[int], None] | None = None, timers: Timers | None = None) -> list[ItemResult]:
    """Synthesise ``items`` batch by batch into ``output_dir/<id>.wav``; adds the time spent to ``timers``."""
    timers = timers if timers is not None else Timers()
    output_dir.mkdir(parents=True, exist_ok=True)
    fixed = tts.config.fixed_length
    seconds = fixed.draws(len(items)) if fixed else [None] * len(items)
    results = []
    for start in range(0, len(items), tts.config.batch_size):
        batch = items[start:start + tts.config.batch_size]
        began = time.perf_counter()
        voices = [tts.voice(item) for item in batch]
        segments = [tts.segments(item, voice) for item, voice in zip(batch, voices)]
        requests = [(segment, voice, limits)
                    for item, voice, s, item_segments in zip(batch, voices, seconds[start:start + len(batch)], segments)
                    for segment, limits in zip(item_segments, tts.segment_limits(voice, item, s, item_segments))]
        engine_start = time.perf_counter()
        before = _counters(tts)
        waves = tts.run(requests)
        done = time.perf_counter()
        timers.add_counters(before, _counters(tts))
        timers.frontend_s += engine_start - began
        timers.engine_s += done - engine_start
        ends = list(itertools.accumulate(len(item_segments) for item_segments in segments))
        for item, first, last in zip(batch, [0] + ends[:-1], ends):
            audio = np.concatenate(waves[first:last])
            path = output_dir / f"{item.id}.wav"
            write_wav(path, audio, tts.sample_rate)
            # every kind voices a speech token as sample_rate / TOKEN_RATE samples (960 at 24 kHz)
            tokens = round(audio.size * TOKEN_RATE / tts.sample_rate)
            results.append(ItemResult(item.id, tokens, audio.size / tts.sample_rate, path.name, last - first))
        if progress:
            progress(len(batch))
    return results


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM mono WAV (the standard library's writer: no audio package needed)."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(sample_rate)
        handle.writeframes(pcm.tobytes())


def build_report(results: Sequence[ItemResult], timers: Timers, config: OfflineConfig, device: torch.device,
                 extra: dict | None = None) -> dict:
    """The run's figures: wall times on the calling thread (front-end, engine, total), RTF = total /
    audio, and the engine's counters over the same batches (``engine``: seconds of its loop per
    stage, steps, jobs, tokens; the LLM and flow stages overlap the whole engine time)."""
    audio = sum(r.audio_s for r in results)
    tokens = sum(r.speech_tokens for r in results)

    def per_audio(seconds: float) -> float | None:
        return seconds / audio if audio > 0 else None

    return {
        **(extra or {}),
        "model": config.model, "backend": config.backend, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "flow_dtype": config.dtype, "llm_dtype": config.llm_dtype, "batch_size": config.batch_size,
        "token2wav_batch_size": config.token2wav_batch_size,
        "token2wav_options": {k: str(v) for k, v in dataclasses.asdict(config.token2wav_options).items()},
        "fixed_length": dataclasses.asdict(config.fixed_length) if config.fixed_length else None,
        "items": len(results), "speech_tokens": tokens, "audio_s": audio,
        "frontend_time_s": timers.frontend_s, "engine_time_s": timers.engine_s, "total_time_s": timers.total_s,
        "rtf": per_audio(timers.total_s), "engine_rtf": per_audio(timers.engine_s),
        "tokens_per_s": tokens / timers.engine_s if timers.engine_s > 0 else None,
        "engine": dict(timers.engine),
        "per_item": [dataclasses.asdict(r) for r in results],
    }


def format_report_md(report: dict, per_item: bool = True) -> str:
    def num(value, digits: int = 4) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    engine = report["engine"]
    lines = [
        "# offline_inference report", "",
        f"model `{report['model']}`, backend `{report['backend']}` on `{report['device']}`"
        + (f" ({report['gpu']})" if report["gpu"] else "")
        + f", {report['batch_size']} utterances submitted together, up to {report['token2wav_batch_size']} "
          "flow jobs per step", "",
        "| figure | value |", "|---|---:|",
        f"| utterances | {report['items']} |",
        f"| speech tokens | {report['speech_tokens']} |",
        f"| audio seconds | {num(report['audio_s'], 3)} |",
        f"| front-end time (s) | {num(report['frontend_time_s'], 3)} |",
        f"| engine time (s) | {num(report['engine_time_s'], 3)} |",
        f"| total_time (s) | {num(report['total_time_s'], 3)} |",
        f"| RTF (total / audio) | {num(report['rtf'])} |",
        f"| engine RTF | {num(report['engine_rtf'])} |",
        f"| speech tokens / engine s | {num(report['tokens_per_s'], 1)} |",
        "", "Where the engine's loop spent its time (seconds; llm_busy_s: the LLM's, on its own thread):", "",
        "| llm_busy_s | start_s | flow_s | vocoder_s | host_s | idle_s | iterations | flow batches | jobs per batch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| " + " | ".join(num(engine[k], 3) for k in ("llm_busy_s", "start_s", "flow_s", "vocoder_s", "host_s", "idle_s"))
        + f" | {engine['iterations']} | {engine['flow_batches']} | "
        + num(engine["flow_batch_jobs"] / engine["flow_batches"] if engine["flow_batches"] else None, 2) + " |",
    ]
    if per_item:
        lines += ["", "| id | speech tokens | audio s |", "|---|---:|---:|"]
        lines += [f"| {r['id']} | {r['speech_tokens']} | {r['audio_s']:.3f} |" for r in report["per_item"]]
    return "\n".join(lines) + "\n"


def write_reports(report: dict, output_dir: Path) -> None:
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    (output_dir / "report.md").write_text(format_report_md(report), encoding="utf-8")
