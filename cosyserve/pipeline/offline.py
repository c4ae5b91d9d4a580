"""Offline batch TTS (``offline_inference.py``): a dataset in, wavs and a timing report out.

Three model kinds (``OfflineConfig.model``): CosyVoice2 (``CosyVoice2-0.5B/`` + ``cosyvoice2_llm/``),
CosyVoice3 (``Fun-CosyVoice3-0.5B-2512/`` + ``cosyvoice3_llm/``: its prompt layout, v3 speech
tokenizer, no registered voices, and the DiT token2wav one utterance at a time) and Step-Audio2
(CosyVoice2's LLM and voices with ``Step-Audio-2-mini/token2wav/``: its DiT flow + HiFT one
utterance at a time, the prompt cut to two mel frames per token: 960 samples per speech token).

Per batch of ``batch_size`` utterances: the voices are resolved (speech tokenizer + speaker
encoder on each prompt, or one registered speaker for all), the LLM generates every utterance's
speech tokens with all requests in flight together (the torch engine batches them; other back
ends take them as they can), then token2wav synthesises them ``token2wav_batch_size`` at a time
(:meth:`CosyVoice2Token2Wav.offline_batch`: one flow batch, HiFT batched per length; utterances
are sorted by length first so batches pad little). Three timers (front-end, LLM, token2wav) add up
to the total; writing files is not timed. RTF = total time / seconds of audio. A long text is
normalised and split into segments as the server does (:mod:`cosyserve.text`); each segment is
one LLM request and one token2wav utterance, and an item's wav is its segments' concatenation.

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
import time
import unicodedata
import uuid
import wave
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data import FixedLength, Utterance, load_reference_audio
from ..errors import InvalidInputError
from ..frontend.prompt import trim_to_token_rate
from ..frontend.torch_models import load_frontend_models
from ..frontend.speakers import SpeakerRegistry
from ..llm.backends import create_backend
from ..llm.base import BackendUnavailableError
from ..llm.prompt import COSYVOICE2, COSYVOICE3, MAX_SPEECH_TOKENS, register_voice_prefixes
from ..llm.sampling import COSYVOICE3_SAMPLING, REFERENCE_SAMPLING
from ..runtime import (COSYVOICE2_DIR, COSYVOICE3_DIR, COSYVOICE3_LLM_DIR, LLM_DIR, SPK2INFO, STEP_AUDIO2_DIR,
                       resolve_device)
from ..schedule import OUTPUT_SAMPLE_RATE, TOKEN_RATE
from ..token2wav.cosyvoice2 import OfflineRequest, Token2WavOptions, default_flow_dtype, load_token2wav
from ..token2wav.cosyvoice3 import load_cosyvoice3_token2wav
from ..token2wav.dit import DIT_SPEAKER_ONNX, DIT_TOKENIZER_ONNX, SpeakerPrompt, load_dit_token2wav
from ..token2wav.dit import OfflineRequest as DitOfflineRequest
from ..token2wav.sessions import LocalToken2Wav
from .cosyvoice3_token2wav import cosyvoice3_voices
from .local import LocalSpeechTokens
from .tts import DEFAULT_SPEAKER, SegmentPrompt, TokenLimits, TTSPipeline, TTSRequest, Voice, VoiceResolver

BACKENDS = ("torch", "hf", "trtllm", "vllm", "openai")
MODELS = ("cosyvoice2", "cosyvoice3", "step_audio2")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
VLLM_UNSUPPORTED = (
    "the vllm backend is not supported yet: vLLM's Qwen2 loader drops the CosyVoice2 LLM's lm_head bias "
    "(llm_layout.md §2), so it would sample text tokens instead of speech. Serve the LLM with a server that "
    "keeps the bias (python -m cosyserve.llm.openai_server) and use --backend openai --openai-base-url URL, "
    "or use --backend torch")


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
    model: str = "cosyvoice2"  # or cosyvoice3, step_audio2 (MODELS)
    backend: str = "torch"
    device: str = "auto"
    dtype: str | None = None  # flow dtype; default float16 on CUDA (as deployed), float32 on CPU
    llm_dtype: str | None = None  # default bfloat16 on CUDA, float32 on CPU
    batch_size: int = 16  # LLM requests in flight together
    token2wav_batch_size: int = 8
    token2wav_options: Token2WavOptions = field(default_factory=Token2WavOptions)
    fixed_length: FixedLength | None = None
    speaker_id: str | None = None  # use this registered voice for every utterance instead of its prompt
    seed: int = 0  # HiFT noise (per utterance, with its id) and the fixed-length draws
    llm_options: dict = field(default_factory=dict)  # e.g. engine_dir (trtllm), base_url (openai)
    frontend_backend: str | None = None  # speech tokenizer + CAM++: torch / onnxruntime; None: by device

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise InvalidInputError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.backend not in BACKENDS:
            raise InvalidInputError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.model == "cosyvoice3" and self.backend not in ("torch", "hf"):
            raise InvalidInputError(f"the {self.backend} backend does not serve CosyVoice3 here; use torch or hf")
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
    segments: int  # of the text, each one LLM request


@dataclass
class Timers:
    frontend_s: float = 0.0
    llm_s: float = 0.0
    token2wav_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.frontend_s + self.llm_s + self.token2wav_s


def create_llm(name: str, llm_dir: Path, device: torch.device, dtype: str | None, **options):
    """The LLM back end by name; those not installable here raise BackendUnavailableError saying what to install."""
    if name == "vllm":
        raise BackendUnavailableError(VLLM_UNSUPPORTED)
    return create_backend(name, llm_dir, device, dtype, **options)


class OfflineTTS:
    """The loaded models: voices, LLM back end, token2wav (layout of :func:`cosyserve.bundle.make_bundle`)."""

    def __init__(self, models_dir: str | Path, config: OfflineConfig):
        from transformers import AutoTokenizer

        self.config = config
        self.cosyvoice3 = config.model == "cosyvoice3"
        self.step_audio2 = config.model == "step_audio2"
        models_dir = Path(models_dir)
        model_dir, llm_dir = ((models_dir / COSYVOICE3_DIR, models_dir / COSYVOICE3_LLM_DIR) if self.cosyvoice3
                              else (models_dir / COSYVOICE2_DIR, models_dir / LLM_DIR))
        dit_dir = models_dir / STEP_AUDIO2_DIR  # step_audio2's token2wav; model_dir holds its voices
        for path in (model_dir, llm_dir, *((dit_dir,) if self.step_audio2 else ())):
            if not path.is_dir():
                raise InvalidInputError(f"{path} does not exist: --model-dir must hold {model_dir.name}/ and "
                                        f"{llm_dir.name}/ (step_audio2: and {STEP_AUDIO2_DIR}/) for --model "
                                        f"{config.model}")
        self.device = resolve_device(config.device)
        flow_dtype = DTYPES[config.dtype] if config.dtype else default_flow_dtype(self.device)
        self.text_tokenizer = AutoTokenizer.from_pretrained(llm_dir)
        if self.cosyvoice3:  # no registered voices; the DiT in float32 unless asked (plain fp16 gives NaNs upstream)
            self.voices = cosyvoice3_voices(model_dir, self.device, config.frontend_backend)
            registry = self.voices.registry
            self.token2wav = load_cosyvoice3_token2wav(model_dir, self.device,
                                                       DTYPES[config.dtype] if config.dtype else torch.float32)
            sampling, layout = COSYVOICE3_SAMPLING, COSYVOICE3
        else:  # CosyVoice2's LLM and voices; Step-Audio2's front-end files are CosyVoice2's under its own names
            registry = SpeakerRegistry.load(model_dir / SPK2INFO)
            tokenizer_file, speaker_file = ((dit_dir / DIT_TOKENIZER_ONNX, dit_dir / DIT_SPEAKER_ONNX) if
                                            self.step_audio2 else
                                            (model_dir / "speech_tokenizer_v2.onnx", model_dir / "campplus.onnx"))
            tokenizer, speaker_encoder = load_frontend_models(tokenizer_file, speaker_file, self.device,
                                                              config.frontend_backend)
            self.voices = VoiceResolver(registry, tokenizer, speaker_encoder, default_speaker=DEFAULT_SPEAKER)
            self.token2wav = (load_dit_token2wav(dit_dir, self.device, flow_dtype) if self.step_audio2 else
                              load_token2wav(model_dir, self.device, flow_dtype, config.token2wav_options))
            sampling, layout = REFERENCE_SAMPLING, COSYVOICE2
        self.llm_backend = create_llm(config.backend, llm_dir, self.device, config.llm_dtype, **config.llm_options)
        register_voice_prefixes(self.llm_backend, self.text_tokenizer, registry)
        self.llm = LocalSpeechTokens(self.llm_backend, sampling)
        # CosyVoice3's token2wav is the pipeline's Token2Wav itself; CosyVoice2's is wrapped in sessions;
        # Step-Audio2's only voices whole utterances (waveforms), so the pipeline only makes prompts
        self.pipeline = TTSPipeline(self.text_tokenizer, self.llm, self.token2wav if self.cosyvoice3 or
                                    self.step_audio2 else LocalToken2Wav(self.token2wav), layout=layout)

    def close(self) -> None:
        if self.step_audio2:
            self.token2wav.close()
        elif not self.cosyvoice3:
            self.token2wav.close_all()
        self.llm_backend.close()

    def voice(self, item: Utterance) -> Voice:
        if self.config.speaker_id:
            return self.voices.resolve(speaker_id=self.config.speaker_id)
        return self.voices.resolve(load_reference_audio(item.reference_audio), item.reference_text)

    def segment_limits(self, voice: Voice, item: Utterance, seconds: float | None,
                       segments: Sequence[SegmentPrompt]) -> list[TokenLimits]:
        fixed = self.config.fixed_length
        if fixed is None:
            return [TokenLimits()] * len(segments)
        tokens = fixed.tokens(seconds if seconds is not None else estimate_seconds(voice, item.target_text))
        shares = share_tokens(tokens, [spoken_characters(s.text) for s in segments])
        return [TokenLimits(max_tokens=min(n, MAX_SPEECH_TOKENS), min_tokens=min(n, MAX_SPEECH_TOKENS))
                for n in shares]

    def speech_tokens(self, requests: Sequence[tuple[list[int], TokenLimits]]) -> list[list[int]]:
        """Generate all requests with every one in flight at once."""
        def one(request: tuple[list[int], TokenLimits]) -> list[int]:
            ids, limits = request
            tokens = [t for piece in self.llm.generate(ids, uuid.uuid4().hex, limits) for t in piece]
            if not tokens:
                raise RuntimeError("the LLM produced no speech tokens (nothing to synthesise)")
            return tokens

        with ThreadPoolExecutor(max_workers=max(1, len(requests)), thread_name_prefix="llm-request") as pool:
            return list(pool.map(one, requests))

    def waveforms(self, ids: Sequence[str], tokens: Sequence[list[int]], voices: Sequence[Voice]) -> list[np.ndarray]:
        """token2wav of every utterance, shortest first, ``token2wav_batch_size`` per batch.

        HiFT noise comes from a generator per utterance seeded from its id and ``config.seed``, so
        the audio does not depend on batch sizes or order. CosyVoice3 and Step-Audio2: one utterance at a time."""
        if self.cosyvoice3:
            return [self.token2wav.offline(i, t, v) for i, t, v in zip(ids, tokens, voices)]
        order = sorted(range(len(tokens)), key=lambda i: len(tokens[i]))
        waves: list[np.ndarray | None] = [None] * len(tokens)
        size = self.config.token2wav_batch_size
        for start in range(0, len(order), size):
            members = order[start:start + size]
            if self.step_audio2:
                batch = [self._dit_offline(tokens[i], voices[i], ids[i]) for i in members]
            else:
                requests = [OfflineRequest(tokens[i], voices[i].features.speech_tokens,
                                           voices[i].features.speech_feat, voices[i].features.embedding,
                                           generator=self._generator(ids[i])) for i in members]
                batch = self.token2wav.offline_batch(requests)
            for i, wave_ in zip(members, batch):
                waves[i] = wave_.numpy()
        return waves

    def _dit_offline(self, tokens: list[int], voice: Voice, item_id: str) -> torch.Tensor:
        """One Step-Audio2 utterance (HiFT's noise seeded per item: a batch would share one generator)."""
        prompt_tokens, prompt_mel = trim_to_token_rate(voice.features.speech_tokens.reshape(-1),
                                                       voice.features.speech_feat)
        request = DitOfflineRequest(torch.as_tensor(tokens), SpeakerPrompt(prompt_tokens, prompt_mel,
                                                                           voice.features.embedding))
        return self.token2wav.offline([request], generator=self._generator(item_id))[0]


    def _generator(self, item_id: str) -> torch.Generator:
        seed = zlib.crc32(f"{self.config.seed}:{item_id}".encode())
        return torch.Generator(device=self.device).manual_seed(seed)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        segments = [list(tts.pipeline.segment_prompts(TTSRequest(item.id, item.target_text, voice)))
                    for item, voice in zip(batch, voices)]
        flat = [(segment, voice, segment_limits)
                for item, voice, s, item_segments in zip(batch, voices, seconds[start:start + len(batch)], segments)
                for segment, segment_limits in zip(item_segments, tts.segment_limits(voice, item, s, item_segments))]
        llm_start = time.perf_counter()
        tokens = tts.speech_tokens([(segment.ids, limits) for segment, _, limits in flat])
        t2w_start = time.perf_counter()
        waves = tts.waveforms([segment.request_id for segment, _, _ in flat], tokens, [voice for _, voice, _ in flat])
        synchronize(tts.device)
        done = time.perf_counter()
        timers.frontend_s += llm_start - began
        timers.llm_s += t2w_start - llm_start
        timers.token2wav_s += done - t2w_start
        ends = list(itertools.accumulate(len(item_segments) for item_segments in segments))
        for item, first, last in zip(batch, [0] + ends[:-1], ends):
            audio = np.concatenate(waves[first:last])
            path = output_dir / f"{item.id}.wav"
            write_wav(path, audio, OUTPUT_SAMPLE_RATE)
            results.append(ItemResult(item.id, sum(len(t) for t in tokens[first:last]),
                                      audio.size / OUTPUT_SAMPLE_RATE, path.name, last - first))
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
        "frontend_time_s": timers.frontend_s, "llm_time_s": timers.llm_s, "token2wav_time_s": timers.token2wav_s,
        "total_time_s": timers.total_s, "rtf": per_audio(timers.total_s), "llm_rtf": per_audio(timers.llm_s),
        "token2wav_rtf": per_audio(timers.token2wav_s),
        "llm_tokens_per_s": tokens / timers.llm_s if timers.llm_s > 0 else None,
        "per_item": [dataclasses.asdict(r) for r in results],
    }


def format_report_md(report: dict, per_item: bool = True) -> str:
    def num(value, digits: int = 4) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = [
        "# offline_inference report", "",
        f"model `{report['model']}`, backend `{report['backend']}` on `{report['device']}`"
        + (f" ({report['gpu']})" if report["gpu"] else "")
        + f", LLM batch {report['batch_size']}, token2wav batch {report['token2wav_batch_size']}", "",
        "| figure | value |", "|---|---:|",
        f"| utterances | {report['items']} |",
        f"| speech tokens | {report['speech_tokens']} |",
        f"| audio seconds | {num(report['audio_s'], 3)} |",
        f"| front-end time (s) | {num(report['frontend_time_s'], 3)} |",
        f"| llm_time (s) | {num(report['llm_time_s'], 3)} |",
        f"| token2wav_time (s) | {num(report['token2wav_time_s'], 3)} |",
        f"| total_time (s) | {num(report['total_time_s'], 3)} |",
        f"| RTF (total / audio) | {num(report['rtf'])} |",
        f"| LLM RTF | {num(report['llm_rtf'])} |",
        f"| token2wav RTF | {num(report['token2wav_rtf'])} |",
        f"| LLM tokens/s | {num(report['llm_tokens_per_s'], 1)} |",
    ]
    if per_item:
        lines += ["", "| id | speech tokens | audio s |", "|---|---:|---:|"]
        lines += [f"| {r['id']} | {r['speech_tokens']} | {r['audio_s']:.3f} |" for r in report["per_item"]]
    return "\n".join(lines) + "\n"


def write_reports(report: dict, output_dir: Path) -> None:
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    (output_dir / "report.md").write_text(format_report_md(report), encoding="utf-8")
