"""CosyVoice3's token2wav alone (``token2wav.py --model cosyvoice3``): speech tokens -> 24 kHz audio,
offline or streamed in the ``cosyvoice3`` BLS's chunks, timed per flow dtype.

* The model: :func:`~cosyserve.token2wav.cosyvoice3.load_cosyvoice3_token2wav` on
  ``Fun-CosyVoice3-0.5B-2512/`` (cosyvoice3.yaml, flow.pt, hift.pt); a bundle root holding that
  directory is taken too (:func:`cosyvoice3_model_dir`).
* The voice: a reference clip and its transcript through the resolver of ``offline_inference.py
  --model cosyvoice3`` (:func:`cosyvoice3_voices`: ``speech_tokenizer_v3.onnx``, CAM++, CosyVoice3's
  prompt-mel band). CosyVoice3 ships no registered voices. token2wav reads only the clip's features:
  without a transcript the voice is a cross-lingual one (:func:`load_cosyvoice3_voice`), same audio.
* Offline: one :meth:`CosyVoice3Token2Wav.offline` call per utterance (full attention).
* Streaming: the chunks of the ``cosyvoice3`` BLS, whose pipeline drives a
  :class:`~cosyserve.schedule.ChunkScheduler` (``exponential``: 15 new tokens + 3 look-ahead, then
  25, 50, 100, ...; or ``time_based``) over the tokens received so far; here every token is there from
  the start (an infinitely fast LLM), so ``exponential`` gives :func:`~cosyserve.schedule.plan_chunks`.
  Each step sends all tokens so far, the last one with ``finalize``; the pieces are the new samples.

Both modes give 960 samples per token (2 mel frames x 480 samples). A variant is a flow dtype
(``fp32``, ``fp16``, ``bf16``; the causal HiFT stays float32), with ``+rerun`` for the streaming
flow of the reference runtime (full attention over the whole prefix every chunk, the
``token2wav`` model's ``incremental_stream=false``) instead of the incremental block-masked one, or
``+graphs`` for the incremental flow's windows replayed from CUDA graphs (the model's ``cuda_graphs``;
the warm-up run captures them);
the first run of each is an untimed warm-up; the last timed run's audio is compared with the first variant's
(rel-L2; nothing random is drawn, so fp32 against itself is 0, and ``fp32,fp32+rerun`` gives the
distance between the two streaming flows).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..audio.io import TOKENIZER_SAMPLE_RATE, prompt_audio_from_array
from ..data import load_reference_audio
from ..errors import InvalidInputError
from ..frontend.torch_models import load_frontend_models
from ..frontend.prompt import COSYVOICE3_MEL_FMAX, Voice, build_prompt_features
from ..frontend.speakers import SpeakerRegistry
from ..models.cosyvoice3.config import CONFIG_FILE, Cv3FlowConfig, config_from_model_dir
from ..runtime import COSYVOICE3_DIR, resolve_device
from ..schedule import OUTPUT_SAMPLE_RATE, STRATEGIES, Chunk, ChunkScheduler
from ..token2wav.cosyvoice3 import FLOW_SECTION, VOCODER_SECTION, CosyVoice3Token2Wav, load_cosyvoice3_token2wav
from .tts import VoiceResolver

log = logging.getLogger(__name__)

MODES = ("offline", "streaming")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # token2wav.py's variant names
HEADER = ["variant", "mode", "utterances", "audio s", "wall ms", "RTF", "first call ms (median)", "calls",
          "rel-L2 vs first"]
PROFILE_HEADER = ["variant", "utterance tokens", "wall ms", "flow ms (host)", "vocoder ms (host)", "calls",
                  "GPU activities", "GPU busy ms"]
PROFILE_KEYS = ("tokens", "wall_ms", "flow_host_ms", "vocoder_host_ms", "calls", "gpu_activities", "gpu_busy_ms")


def cosyvoice3_voices(model_dir: str | Path, device: torch.device | str = "cpu",
                      frontend_backend: str | None = None) -> VoiceResolver:
    """Reference clip + transcript -> CosyVoice3 :class:`Voice`: ``speech_tokenizer_v3.onnx`` (raw
    codes), CAM++ (back end: :func:`~cosyserve.frontend.torch_models.frontend_backend`), the prompt
    mel up to the Nyquist frequency; no registered (default) voice."""
    model_dir = Path(model_dir)
    tokenizer, speaker_encoder = load_frontend_models(model_dir / "speech_tokenizer_v3.onnx",
                                                      model_dir / "campplus.onnx", device, frontend_backend)
    return VoiceResolver(SpeakerRegistry(), tokenizer, speaker_encoder, default_speaker=None,
                         mel_fmax=COSYVOICE3_MEL_FMAX)


def cosyvoice3_model_dir(path: str | Path) -> Path:
    """``Fun-CosyVoice3-0.5B-2512/`` itself, or a bundle root holding it."""
    path = Path(path)
    for candidate in (path, path / COSYVOICE3_DIR):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    raise InvalidInputError(f"{path} holds no {CONFIG_FILE} (nor {COSYVOICE3_DIR}/{CONFIG_FILE}): give the "
                            f"{COSYVOICE3_DIR} directory (cosyvoice3.yaml, flow.pt, hift.pt, campplus.onnx, "
                            "speech_tokenizer_v3.onnx)")


def load_cosyvoice3_voice(model_dir: str | Path, reference_audio, reference_text: str | None = None,
                          device: torch.device | str = "cpu") -> Voice:
    """The voice of a reference clip (a path, or what :func:`~cosyserve.data.load_reference_audio`
    takes), as ``offline_inference.py --model cosyvoice3`` builds it. token2wav reads only its
    features; without ``reference_text`` it is a cross-lingual voice (no transcript)."""
    wav16 = load_reference_audio(reference_audio)
    resolver = cosyvoice3_voices(model_dir, device)
    if reference_text is not None and reference_text.strip():
        return resolver.resolve(wav16, reference_text)
    audio = prompt_audio_from_array(wav16, TOKENIZER_SAMPLE_RATE)  # what resolve does, less the transcript
    features = build_prompt_features(audio, resolver.tokenizer, resolver.speaker_encoder, resolver.mel_fmax)
    return Voice("", features, cross_lingual=True, reference_wav16=wav16)


RERUN = "+rerun"  # a variant's suffix: the reference's re-run streaming flow
GRAPHS = "+graphs"  # a variant's suffix: the incremental flow's windows from CUDA graphs


def variant_dtype(name: str) -> str:
    return name.removesuffix(RERUN).removesuffix(GRAPHS)


def parse_dtype_variants(specs: str) -> list[str]:
    """``fp32,fp32+rerun,bf16+graphs`` -> variant names (a flow dtype, optionally ``+rerun`` or
    ``+graphs``). CosyVoice2's ``+incremental``/``+batchN``... do not apply here."""
    names = [spec.strip() for spec in specs.split(",") if spec.strip()]
    for name in names:
        if variant_dtype(name) not in DTYPES or name.count("+") > 1:
            raise InvalidInputError(f"variant {name!r}: --model cosyvoice3 takes flow dtypes ({', '.join(DTYPES)}), "
                                    f"each optionally with {RERUN} or {GRAPHS}; incremental and batchN are "
                                    "CosyVoice2's")
    if not names:
        raise InvalidInputError("no variants given")
    return names


def check_tokens(tokens: Sequence[torch.Tensor], vocab_size: int) -> None:
    """Every utterance non-empty, every id in 0..vocab_size-1 (says which utterance and id is wrong)."""
    for k, ids in enumerate(tokens):
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.numel() == 0:
            raise InvalidInputError(f"utterance {k + 1} has no speech tokens")
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.numel():
            raise InvalidInputError(f"utterance {k + 1}: speech token id {int(bad[0])} is outside 0..{vocab_size - 1} "
                                    "(raw CosyVoice3 speech codes)")


def bls_scheduler(strategy: str = "exponential") -> ChunkScheduler:
    """A fresh schedule of the ``cosyvoice3`` BLS (its pipeline's, :class:`ChunkScheduler`)."""
    if strategy not in STRATEGIES:
        raise InvalidInputError(f"unknown streaming strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return ChunkScheduler(strategy)


@dataclass
class Synthesis:
    """One utterance: its waveform, the wall time of each token2wav call and the chunks sent."""

    wave: np.ndarray = field(repr=False)
    call_s: list[float]
    chunks: list[Chunk]
    pieces: list[np.ndarray] = field(default_factory=list, repr=False)  # streaming: each step's samples


def synthesize(t2w: CosyVoice3Token2Wav, tokens: Sequence[int] | torch.Tensor, voice: Voice, mode: str = "offline",
               strategy: str = "exponential", request_id: str = "token2wav-cli") -> Synthesis:
    """Offline: one call. Streaming: the BLS's chunks, as the pipeline sends them when all tokens are
    there (``next_chunk`` asked again after every step, so ``time_based`` sees the real elapsed time)."""
    tokens = [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]
    if mode == "offline":
        start = time.perf_counter()
        wave = t2w.offline(request_id, tokens, voice)
        return Synthesis(wave, [time.perf_counter() - start], [Chunk(len(tokens), 0, True)])
    if mode != "streaming":
        raise InvalidInputError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    scheduler = bls_scheduler(strategy)
    pieces, calls, chunks = [], [], []
    try:
        while True:
            chunk = scheduler.next_chunk(len(tokens)) or scheduler.final_chunk(len(tokens))
            start = time.perf_counter()
            pieces.append(t2w.step(request_id, tokens[:chunk.num_tokens], voice, chunk.token_offset, chunk.finalize))
            calls.append(time.perf_counter() - start)  # pieces come back on the CPU: the device is done
            chunks.append(chunk)
            if chunk.finalize:
                break
    finally:
        t2w.cancel(request_id)  # harmless after the final step; closes the session on an error
    return Synthesis(np.concatenate(pieces), calls, chunks, pieces)


def profile_utterance(t2w: CosyVoice3Token2Wav, tokens, voice: Voice, mode: str, strategy: str) -> dict:
    """One more synthesis of ``tokens`` under ``torch.profiler``: its wall time, the host time of the
    steps' flow and vocoder ranges (what the CPU spent in them, waiting on the GPU included), and the
    GPU's activities (kernels, copies) and their summed time. The profiler slows host-bound code."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if t2w.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        done = synthesize(t2w, tokens, voice, mode, strategy, "token2wav-profile")
        wall = time.perf_counter() - start
    events = prof.events()
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def host_ms(section: str) -> float:
        return sum(e.cpu_time_total for e in events if e.name == section and e.device_type == cpu) / 1e3

    gpu = [e for e in events if e.device_type == cuda and e.name not in (FLOW_SECTION, VOCODER_SECTION)]
    return {"tokens": len(torch.as_tensor(tokens).reshape(-1)), "wall_ms": 1e3 * wall, "calls": len(done.call_s),
            "flow_host_ms": host_ms(FLOW_SECTION), "vocoder_host_ms": host_ms(VOCODER_SECTION),
            "gpu_activities": len(gpu), "gpu_busy_ms": sum(e.device_time for e in gpu) / 1e3}


@dataclass
class VariantRun:
    name: str
    row: list
    report: dict
    check: np.ndarray | None = field(default=None, repr=False)  # the last timed run's audio, all utterances
    last: np.ndarray | None = field(default=None, repr=False)  # the last utterance of the last run


def _one_run(t2w: CosyVoice3Token2Wav, tokens: Sequence[torch.Tensor], voice: Voice, mode: str, strategy: str,
             tag: str) -> tuple[float, list[Synthesis]]:
    """Every utterance once, one after the other: the wall time and each utterance's synthesis."""
    start = time.perf_counter()
    done = [synthesize(t2w, ids, voice, mode, strategy, f"token2wav-{tag}-{k}") for k, ids in enumerate(tokens)]
    return time.perf_counter() - start, done


def run_variant(name: str, model_dir: Path, tokens: Sequence[torch.Tensor], voice: Voice, *, device: torch.device,
                mode: str, strategy: str, runs: int, reference: np.ndarray | None, profile: bool = False) -> VariantRun:
    """Load the model in the variant's dtype, one warm-up (it captures a graph variant's shapes),
    ``runs`` timed runs; the last one's audio is the check (replayed from the graphs, for graph variants)."""
    graphs = name.endswith(GRAPHS)
    t2w = load_cosyvoice3_token2wav(model_dir, device, DTYPES[variant_dtype(name)],
                                    incremental=not name.endswith(RERUN), cuda_graphs=graphs)
    try:
        _one_run(t2w, tokens, voice, mode, strategy, "warmup")
        timed = [_one_run(t2w, tokens, voice, mode, strategy, f"run{r}") for r in range(max(1, runs))]
        profiled = profile_utterance(t2w, tokens[-1], voice, mode, strategy) if profile else None
    finally:
        del t2w
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check = np.concatenate([s.wave for s in timed[-1][1]])
    walls = [wall for wall, _ in timed]
    audio_s = sum(s.wave.size for s in timed[0][1]) / OUTPUT_SAMPLE_RATE
    wall = statistics.median(walls)
    first_calls = [s.call_s[0] for _, done in timed for s in done]
    calls = sum(len(s.call_s) for s in timed[0][1])
    rel = rel_l2(check, reference if reference is not None else check)
    row = [name, mode if mode == "offline" else f"streaming ({strategy})", len(tokens), audio_s, 1e3 * wall,
           wall / audio_s, 1e3 * statistics.median(first_calls), calls, rel]
    report = {"walls_s": walls, "audio_s": audio_s, "samples": [int(s.wave.size) for s in timed[0][1]],
              "call_latencies_s": [[s.call_s for s in done] for _, done in timed],
              "chunks": [[dataclasses.asdict(c) for c in s.chunks] for s in timed[0][1]],
              "rel_l2_vs_first": rel, **({"profile": profiled} if profiled else {})}
    return VariantRun(name, row, report, check, timed[-1][1][-1].wave)


@dataclass
class Cv3Token2WavReport:
    rows: list[list] = field(default_factory=list)
    results: dict = field(default_factory=dict)
    last: np.ndarray | None = field(default=None, repr=False)
    prompt_tokens: int = 0
    device: str = "cpu"

    @property
    def profile_rows(self) -> list[list]:
        """The profiled variants' rows (:data:`PROFILE_HEADER`)."""
        return [[name, *(result["profile"][key] for key in PROFILE_KEYS)]
                for name, result in self.results.items() if "profile" in result]

    def to_json(self, mode: str, strategy: str) -> dict:
        return {"device": self.device, "model": "cosyvoice3", "mode": mode,
                **({"strategy": strategy} if mode == "streaming" else {}), "results": self.results}


def run_cosyvoice3(model_dir: str | Path, tokens: Sequence[torch.Tensor], reference_audio,
                   reference_text: str | None = None, *, device: str | torch.device = "auto", variants: str = "fp32",
                   mode: str = "offline", strategy: str = "exponential", runs: int = 1, profile: bool = False,
                   on_start: Callable[[int], None] | None = None,
                   on_row: Callable[[list], None] | None = None) -> Cv3Token2WavReport:
    """Every variant over every utterance. Bad inputs (directory, tokens, variants, mode, strategy,
    clip) raise :class:`InvalidInputError` before any model is loaded; a variant that fails to run
    is logged and reported as a failed row, the others go on (as for CosyVoice2)."""
    model_dir = cosyvoice3_model_dir(model_dir)
    if mode not in MODES:
        raise InvalidInputError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "streaming":
        bls_scheduler(strategy)  # validates the strategy
    names = parse_dtype_variants(variants)
    check_tokens(tokens, config_from_model_dir(model_dir, Cv3FlowConfig).vocab_size)
    device = resolve_device(device)
    voice = load_cosyvoice3_voice(model_dir, reference_audio, reference_text, device)
    out = Cv3Token2WavReport(prompt_tokens=int(voice.features.speech_tokens.numel()), device=str(device))
    if on_start:
        on_start(out.prompt_tokens)
    reference = None
    for name in names:
        try:
            run = run_variant(name, model_dir, tokens, voice, device=device, mode=mode, strategy=strategy, runs=runs,
                              reference=reference, profile=profile)
        except Exception as exc:  # report it and go on with the other variants
            log.exception("variant %s failed", name)
            summary = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            out.rows.append([name, summary])
            out.results[name] = {"error": repr(exc)}
        else:
            reference = run.check if reference is None else reference
            out.rows.append(run.row)
            out.results[name] = run.report
            out.last = run.last
        if on_row:
            on_row(out.rows[-1])
    return out


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("nan")
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm > 0 else float(np.linalg.norm(a - b))
