"""token2wav alone (``token2wav.py``): speech tokens -> 24 kHz audio through the engine's kind of
any model (:data:`~cosyserve.engine.service.MODEL_KINDS`: CosyVoice2, CosyVoice3, Step-Audio2), as if
the LLM were infinitely fast, timed per variant.

The kind is driven as the engine's loop drives it (:mod:`cosyserve.engine.core`), without the LLM:
a group of ``batch`` utterances starts together (offline: one :meth:`start_offline` job each;
streaming: each utterance a stream, :meth:`open`, its chunks from the kind's own
:meth:`chunk_schedule` over all its tokens, each chunk started with :meth:`start_chunks` when the
stream's previous one has been vocoded), the jobs started together are solved together
(:meth:`solve`) and vocoded together (:meth:`vocode`). Every
token yields 960 samples, in both modes.

A *variant* is ``dtype[+graphs][+rerun][+batchN]``: the flow dtype (``fp32``, ``fp16``, ``bf16``),
``+graphs`` CUDA graphs of the kind (CosyVoice2: flow windows and HiFT; CosyVoice3: the packed
windows; captured by the kind's warm-up before the runs), ``+rerun`` (CosyVoice3) the reference's
re-run streaming flow (full attention over every token so far, each chunk) instead of the
incremental one, ``+batchN`` N utterances voiced together. The first run of each variant is an
untimed warm-up; HiFT's noise is a function of the seed and the call's length
(:class:`~cosyserve.offline.SeededSineNoise`), so the last timed run's audio is compared
with the first variant's (rel-L2: 0 for a variant against itself).
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

from ..audio.io import load_prompt_audio
from ..engine.device import synchronize
from ..engine.service import BUNDLE_DIRS, MODEL_KINDS
from ..errors import InvalidInputError
from ..frontend.prompt import PromptFeatures, build_prompt_features
from ..frontend.speakers import SpeakerRegistry
from ..frontend.torch_models import load_frontend_models
from ..offline import SeededSineNoise
from ..runtime import SPK2INFO, resolve_device
from ..schedule import OUTPUT_SAMPLE_RATE, Chunk
from ..speech_tokens import speech_token_ids

log = logging.getLogger(__name__)

MODES = ("offline", "streaming")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FLOW_SECTION, VOCODER_SECTION = "token2wav.flow", "token2wav.vocoder"  # torch.profiler ranges
HEADER = ["variant", "mode", "utterances", "chunks", "audio s", "wall ms", "RTF", "first chunk ms (median)",
          "rel-L2 vs first"]
PROFILE_HEADER = ["variant", "utterance tokens", "wall ms", "flow ms (host)", "vocoder ms (host)", "calls",
                  "GPU activities", "GPU busy ms"]
PROFILE_KEYS = ("tokens", "wall_ms", "flow_host_ms", "vocoder_host_ms", "calls", "gpu_activities", "gpu_busy_ms")

# Per kind: the variant flags it takes and the kind's options (load_engine's kind_options) of a variant.
VARIANT_OPTIONS: dict[str, tuple[frozenset[str], Callable[["Variant"], dict]]] = {
    "cosyvoice2": (frozenset({"graphs"}), lambda v: {"flow_dtype": DTYPES[v.dtype], "cuda_graphs": v.graphs,
                                                     "hift_graphs": v.graphs}),
    "cosyvoice3": (frozenset({"graphs", "rerun"}), lambda v: {"flow_dtype": DTYPES[v.dtype], "cuda_graphs": v.graphs,
                                                              "incremental": not v.rerun}),
    "step_audio2": (frozenset(), lambda v: {"dtype": DTYPES[v.dtype]}),
}


@dataclass(frozen=True)
class Variant:
    dtype: str = "fp32"
    graphs: bool = False
    rerun: bool = False
    batch: int = 1

    @classmethod
    def parse(cls, spec: str, model: str) -> "Variant":
        """``fp16+graphs+batch4`` (any order after the dtype), checked against what ``model`` takes."""
        dtype, *flags = spec.strip().split("+")
        allowed = VARIANT_OPTIONS[model][0]
        if dtype not in DTYPES:
            raise InvalidInputError(f"variant {spec!r}: --model {model} takes flow dtypes ({', '.join(DTYPES)})")
        fields: dict = {"dtype": dtype}
        for flag in flags:
            if flag in allowed and flag not in fields:
                fields[flag] = True
            elif flag.startswith("batch") and flag[5:].isdigit() and int(flag[5:]) >= 1 and "batch" not in fields:
                fields["batch"] = int(flag[5:])
            else:
                raise InvalidInputError(f"variant {spec!r}: --model {model} takes flow dtypes ({', '.join(DTYPES)}), "
                                        f"each with {', '.join(f'+{f}' for f in sorted(allowed)) or 'no flag'} "
                                        "and +batchN at most once")
        return cls(**fields)

    @property
    def name(self) -> str:
        flags = [f for f in ("graphs", "rerun") if getattr(self, f)] + ([f"batch{self.batch}"] if self.batch > 1 else [])
        return "+".join([self.dtype, *flags])


def parse_variants(specs: str, model: str) -> list[Variant]:
    variants = [Variant.parse(spec, model) for spec in specs.split(",") if spec.strip()]
    if not variants:
        raise InvalidInputError("no variants given")
    return variants


def load_kind(model: str, model_dir: Path, device: torch.device, variant: Variant, seed: int = 0):
    """The engine's token2wav kind of ``model`` in ``variant``'s options."""
    options = VARIANT_OPTIONS[model][1](variant)
    return MODEL_KINDS[model].load_kind(model_dir, device, options, SeededSineNoise(seed, device))


def resolve_model_dir(model: str, path: str | Path) -> Path:
    """The kind's directory (its front-end files) itself, or a bundle root holding it."""
    path, spec = Path(path), MODEL_KINDS[model]
    sub = BUNDLE_DIRS[model][0]
    for candidate in (path, path / sub):
        if (candidate / spec.speech_tokenizer).is_file():
            return candidate
    raise InvalidInputError(f"{path} holds no {spec.speech_tokenizer} (nor {sub}/{spec.speech_tokenizer}): give "
                            f"the {sub} directory of --model {model}")


def load_voice(model: str, model_dir: Path, device: torch.device, reference_audio: Path | None = None,
               speaker_id: str = "001", spk2info: Path | None = None) -> PromptFeatures:
    """A reference clip through the kind's front-end files (its speech tokenizer, CAM++, prompt-mel
    band), or a registered voice of ``spk2info`` (default: the model directory's spk2info.pt)."""
    spec = MODEL_KINDS[model]
    if reference_audio is None:
        path = spk2info or model_dir / SPK2INFO
        if not path.is_file():
            raise InvalidInputError(f"{path} does not exist: --model {model} needs --reference-audio, or --spk2info "
                                    "(a spk2info.pt) and --speaker-id")
        return SpeakerRegistry.load(path).get(speaker_id).features
    tokenizer, speaker_encoder = load_frontend_models(model_dir / spec.speech_tokenizer, model_dir / "campplus.onnx",
                                                      device)
    return build_prompt_features(load_prompt_audio(reference_audio), tokenizer, speaker_encoder, spec.mel_fmax)


def check_tokens(tokens: Sequence[torch.Tensor], vocab_size: int) -> None:
    """Every utterance non-empty, every id in 0..vocab_size-1 (says which utterance is wrong)."""
    for k, ids in enumerate(tokens):
        if speech_token_ids(torch.as_tensor(ids).reshape(-1), vocab_size, f"utterance {k + 1}").numel() == 0:
            raise InvalidInputError(f"utterance {k + 1} has no speech tokens")


# ----- driving a kind -----

@dataclass
class Synthesis:
    """One utterance: its waveform, the chunks sent and each chunk's time (chunk started -> its PCM)."""

    wave: np.ndarray = field(repr=False)
    chunks: list[Chunk]
    call_s: list[float]
    pieces: list[np.ndarray] = field(default_factory=list, repr=False)


@dataclass(eq=False)
class _Voicing:
    tokens: list[int]
    voicing: object = None  # the kind's stream state (None: offline)
    schedule: object = None
    job: object = None
    chunk: Chunk | None = None
    started: float = 0.0
    done: bool = False
    result: Synthesis = field(default_factory=lambda: Synthesis(np.zeros(0, np.float32), [], []))


def synthesize(kind, features: PromptFeatures, utterances: Sequence[Sequence[int]], mode: str = "offline",
               strategy: str = "exponential") -> list[Synthesis]:
    """``utterances`` voiced together by ``kind``, as the engine's loop voices requests whose tokens
    are all there: their jobs solved as one batch, then vocoded together."""
    if mode not in MODES:
        raise InvalidInputError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    items = [_Voicing([int(t) for t in torch.as_tensor(u).reshape(-1).tolist()]) for u in utterances]
    try:
        for item in items:
            if mode == "offline":
                item.chunk, item.started = Chunk(len(item.tokens), 0, True), time.perf_counter()
                item.job = kind.start_offline(features, item.tokens)
            else:
                item.schedule, item.voicing = kind.chunk_schedule(strategy), kind.open(features)
        if mode == "streaming":
            _start_next(kind, items)
        while any(item.job is not None for item in items):
            finished = [item for item in items if item.job is not None]
            with torch.profiler.record_function(FLOW_SECTION):
                kind.solve([item.job for item in finished])
            with torch.profiler.record_function(VOCODER_SECTION):
                pieces = [pcm.cpu().numpy() for pcm in
                          kind.vocode([(item.voicing, kind.mel(item.job), item.job.finalize) for item in finished])]
            synchronize(torch.device(getattr(kind, "device", "cpu")))
            now = time.perf_counter()
            for item, pcm in zip(finished, pieces):
                item.result.pieces.append(pcm)
                item.result.chunks.append(item.chunk)
                item.result.call_s.append(now - item.started)
                item.done, item.job = item.chunk.finalize, None
            if mode == "streaming":
                _start_next(kind, [item for item in finished if not item.done])
    except BaseException:
        kind.abort([item.job for item in items if item.job is not None])
        raise
    finally:
        for item in items:
            if item.voicing is not None:
                item.voicing.close()
    for item in items:
        item.result.wave = np.concatenate(item.result.pieces) if item.result.pieces else np.zeros(0, np.float32)
    return [item.result for item in items]


def _start_next(kind, items: list[_Voicing]) -> None:
    """Each stream's next chunk (all its tokens are there), started together."""
    if not items:
        return
    for item in items:
        n = len(item.tokens)
        item.chunk = item.schedule.next_chunk(n) or item.schedule.final_chunk(n)
        item.started = time.perf_counter()
    jobs = kind.start_chunks([(item.voicing, item.tokens[:item.chunk.num_tokens], item.chunk.token_offset,
                               item.chunk.finalize) for item in items])
    for item, job in zip(items, jobs):
        item.job = job


def profile_utterance(kind, features: PromptFeatures, tokens, mode: str, strategy: str) -> dict:
    """One more synthesis of ``tokens`` under ``torch.profiler``: its wall time, the host time of the
    flow steps and vocoder calls (what the CPU spent in them, waiting on the GPU included), and the
    GPU's activities (kernels, copies) and their summed time. The profiler slows host-bound code."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(getattr(kind, "device", "cpu"))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        (done,) = synthesize(kind, features, [tokens], mode, strategy)
        wall = time.perf_counter() - start
    events = prof.events()
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def host_ms(section: str) -> float:
        return sum(e.cpu_time_total for e in events if e.name == section and e.device_type == cpu) / 1e3

    gpu = [e for e in events if e.device_type == cuda and e.name not in (FLOW_SECTION, VOCODER_SECTION)]
    return {"tokens": len(torch.as_tensor(tokens).reshape(-1)), "wall_ms": 1e3 * wall, "calls": len(done.call_s),
            "flow_host_ms": host_ms(FLOW_SECTION), "vocoder_host_ms": host_ms(VOCODER_SECTION),
            "gpu_activities": len(gpu), "gpu_busy_ms": sum(e.device_time for e in gpu) / 1e3}


# ----- variants -----

@dataclass
class VariantRun:
    row: list
    report: dict
    check: np.ndarray | None = field(default=None, repr=False)  # the last timed run's audio, all utterances
    last: np.ndarray | None = field(default=None, repr=False)  # the last utterance of the last run


def _one_run(kind, features, tokens, variant: Variant, mode: str, strategy: str) -> tuple[float, list[Synthesis]]:
    """Every utterance once, ``variant.batch`` at a time: the wall time and each utterance's synthesis."""
    start = time.perf_counter()
    done = []
    for i in range(0, len(tokens), variant.batch):
        done += synthesize(kind, features, tokens[i:i + variant.batch], mode, strategy)
    return time.perf_counter() - start, done


def run_variant(model: str, variant: Variant, model_dir: Path, tokens, features: PromptFeatures, *,
                device: torch.device, mode: str, strategy: str, runs: int, reference: np.ndarray | None,
                profile: bool = False, seed: int = 0) -> VariantRun:
    """Load the kind in the variant's options (``+graphs``: its warm-up captures them), one untimed
    warm-up run, ``runs`` timed runs."""
    kind = load_kind(model, model_dir, device, variant, seed)
    try:
        kind.chunk_schedule(strategy)  # an unknown strategy fails here
        if variant.graphs:
            kind.warm_up(features)
        _one_run(kind, features, tokens, variant, mode, strategy)
        timed = [_one_run(kind, features, tokens, variant, mode, strategy) for _ in range(max(1, runs))]
        profiled = profile_utterance(kind, features, tokens[-1], mode, strategy) if profile else None
    finally:
        del kind
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check = np.concatenate([s.wave for s in timed[-1][1]])
    walls = [wall for wall, _ in timed]
    audio_s = sum(s.wave.size for s in timed[0][1]) / OUTPUT_SAMPLE_RATE
    wall = statistics.median(walls)
    rel = rel_l2(check, reference if reference is not None else check)
    row = [variant.name, mode, len(tokens),
           sum(len(s.chunks) for s in timed[0][1]), audio_s, 1e3 * wall, wall / audio_s,
           1e3 * statistics.median(s.call_s[0] for _, done in timed for s in done), rel]
    report = {"walls_s": walls, "audio_s": audio_s, "samples": [int(s.wave.size) for s in timed[0][1]],
              "call_latencies_s": [[s.call_s for s in done] for _, done in timed],
              "chunks": [[dataclasses.asdict(c) for c in s.chunks] for s in timed[0][1]],
              "rel_l2_vs_first": rel, **({"profile": profiled} if profiled else {})}
    return VariantRun(row, report, check, timed[-1][1][-1].wave)


@dataclass
class Token2WavReport:
    model: str
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
        return {"device": self.device, "model": self.model, "mode": mode,
                **({"strategy": strategy} if mode == "streaming" else {}), "results": self.results}


def run_token2wav(model: str, model_dir: str | Path, tokens: Sequence[torch.Tensor], *, reference_audio=None,
                  speaker_id: str = "001", spk2info: Path | None = None, device: str | torch.device = "auto",
                  variants: str = "fp32", mode: str = "offline", strategy: str = "exponential", runs: int = 1,
                  profile: bool = False, seed: int = 0, on_start: Callable[[int], None] | None = None,
                  on_row: Callable[[list], None] | None = None) -> Token2WavReport:
    """Every variant over every utterance. Bad inputs (directory, tokens, variants, mode, voice)
    raise :class:`InvalidInputError` before any kind is loaded; a variant that fails to run is
    logged and reported as a failed row, the others go on."""
    if model not in MODEL_KINDS:
        raise InvalidInputError(f"unknown model kind {model!r}; choose one of {sorted(MODEL_KINDS)}")
    if mode not in MODES:
        raise InvalidInputError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    model_dir = resolve_model_dir(model, model_dir)
    names = parse_variants(variants, model)
    check_tokens(tokens, MODEL_KINDS[model].layout.num_speech_tokens)
    device = resolve_device(device)
    features = load_voice(model, model_dir, device, reference_audio, speaker_id, spk2info)
    out = Token2WavReport(model, prompt_tokens=int(features.speech_tokens.numel()), device=str(device))
    if on_start:
        on_start(out.prompt_tokens)
    reference = None
    for variant in names:
        try:
            run = run_variant(model, variant, model_dir, tokens, features, device=device, mode=mode, strategy=strategy,
                              runs=runs, reference=reference, profile=profile, seed=seed)
        except InvalidInputError:
            raise  # the same for every variant (a strategy the kind does not take, say)
        except Exception as exc:  # report it and go on with the other variants
            log.exception("variant %s failed", variant.name)
            summary = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            out.rows.append([variant.name, summary])
            out.results[variant.name] = {"error": repr(exc)}
        else:
            reference = run.check if reference is None else reference
            out.rows.append(run.row)
            out.results[variant.name] = run.report
            out.last = run.last
        if on_row:
            on_row(out.rows[-1])
    return out


# ----- command line helpers -----

def random_tokens(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 6561, (n,), generator=generator) for n in lengths]


def utterance_tokens(args) -> list[torch.Tensor]:
    if args.tokens_file:
        lines = [line.split() for line in args.tokens_file.read_text().splitlines() if line.strip()]
        if not lines:
            raise InvalidInputError(f"{args.tokens_file} holds no tokens")
        return [torch.tensor([int(x) for x in line], dtype=torch.long) for line in lines]
    return random_tokens(args.num_tokens, args.seed)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rel_l2(a, b) -> float:
    """|a - b| / |b| of two arrays or tensors (nan when their shapes differ)."""
    a, b = (x.detach().to("cpu", torch.float64).numpy() if torch.is_tensor(x) else np.asarray(x, np.float64)
            for x in (a, b))
    if a.shape != b.shape:
        return float("nan")
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm > 0 else float(np.linalg.norm(a - b))


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
