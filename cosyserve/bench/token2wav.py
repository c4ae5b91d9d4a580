"""Benchmark helpers shared by ``token2wav.py`` (offline) and ``streaming_inference.py`` (streams).

A *variant* is one way of running token2wav, written
``dtype[+graphs|+flowgraphs][+precapture][+compile][+incremental][+batchN]``: ``fp32``,
``fp16+flowgraphs``, ``fp16+flowgraphs+precapture+batch16``... (flow dtype, :class:`Token2WavOptions`:
CUDA graphs of flow and HiFT or of the flow only, flow graphs captured at load for up to
:data:`DEFAULT_PRECAPTURE_FRAMES` frames, compiled estimator, incremental streaming flow; and how many
requests share a batch). Variants with graphs captured lazily get a second untimed warm-up run,
since a shape is captured the second time it is seen. Offline runs synthesise utterances ``batch`` at a time with
:meth:`CosyVoice2Token2Wav.offline_batch`. Streaming runs play ``concurrency`` listeners at once,
each stepping its stream chunk by chunk as soon as the previous piece is back (tokens are all there
from the start, or arrive at ``token_rate`` per second), directly or through a
:class:`Token2WavBatcher` (``batch`` > 1); per chunk they record the compute latency, the arrival
time and the audio length, from which playback underruns follow
(:func:`cosyserve.clients.playback_underruns`).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..clients import latency_stats, playback_underruns
from ..errors import InvalidInputError
from ..frontend.prompt import PromptFeatures
from ..schedule import TOKEN_RATE, Chunk, plan_chunks
from ..token2wav.batching import Token2WavBatcher
from ..token2wav.cosyvoice2 import (DEFAULT_PRECAPTURE_FRAMES, CosyVoice2Token2Wav, OfflineRequest, Token2WavOptions,
                                    load_token2wav)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STRATEGIES = ("exponential", "equal")
LOOKAHEAD = 3


@dataclass(frozen=True)
class Variant:
    dtype: str = "fp32"
    cuda_graphs: bool = False
    hift_graphs: bool = False
    precapture: bool = False
    compile: bool = False
    incremental: bool = False
    batch: int = 1

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """``fp16+graphs+incremental+batch16`` (any order after the dtype); ``flowgraphs``: no HiFT graphs."""
        dtype, *flags = spec.strip().split("+")
        if dtype not in DTYPES:
            raise InvalidInputError(f"variant {spec!r}: dtype must be one of {sorted(DTYPES)}")
        fields: dict = {"dtype": dtype}
        for flag in flags:
            if flag in ("graphs", "flowgraphs"):
                fields.update(cuda_graphs=True, hift_graphs=flag == "graphs")
            elif flag in ("incremental", "precapture", "compile"):
                fields[flag] = True
            elif flag.startswith("batch") and flag[5:].isdigit() and int(flag[5:]) >= 1:
                fields["batch"] = int(flag[5:])
            else:
                raise InvalidInputError(f"variant {spec!r}: unknown part {flag!r} "
                                        "(graphs, flowgraphs, precapture, compile, incremental, batchN)")
        if fields.get("precapture") and not fields.get("cuda_graphs"):
            raise InvalidInputError(f"variant {spec!r}: precapture needs graphs or flowgraphs")
        return cls(**fields)

    @property
    def name(self) -> str:
        graphs = ("graphs" if self.hift_graphs else "flowgraphs") if self.cuda_graphs else None
        flags = [graphs] * bool(graphs) + [f for f in ("precapture", "compile", "incremental") if getattr(self, f)]
        return "+".join([self.dtype] + flags + ([f"batch{self.batch}"] if self.batch > 1 else []))

    @property
    def warmups(self) -> int:
        return 2 if self.cuda_graphs and not self.precapture else 1

    def load(self, model_dir: str | Path, device: str | torch.device) -> CosyVoice2Token2Wav:
        options = Token2WavOptions(cuda_graphs=self.cuda_graphs, hift_graphs=self.hift_graphs, compile=self.compile,
                                   precapture_frames=DEFAULT_PRECAPTURE_FRAMES if self.precapture else 0,
                                   precapture_batch=self.batch, incremental_stream=self.incremental)
        return load_token2wav(model_dir, device, DTYPES[self.dtype], options)


def parse_variants(specs: str) -> list[Variant]:
    return [Variant.parse(spec) for spec in specs.split(",") if spec.strip()]


def prompt_features(model_dir: Path, speaker_id: str = "001", reference_audio: Path | None = None) -> PromptFeatures:
    """A cached speaker of ``spk2info.pt``, or a reference wav run through the ONNX front-end."""
    from ..frontend import SpeakerEncoder, SpeakerRegistry, SpeechTokenizer, build_prompt_features

    if reference_audio is None:
        return SpeakerRegistry.load(model_dir / "spk2info.pt").get(speaker_id).features
    from ..audio.io import load_prompt_audio

    return build_prompt_features(load_prompt_audio(reference_audio),
                                 SpeechTokenizer(model_dir / "speech_tokenizer_v2.onnx"),
                                 SpeakerEncoder(model_dir / "campplus.onnx"))


def chunk_plan(total_tokens: int, strategy: str = "exponential", hop: int = TOKEN_RATE) -> list[Chunk]:
    """The token2wav calls of one stream: ``exponential`` = the Triton BLS schedule
    (:func:`plan_chunks`), ``equal`` = ``hop`` new tokens per call (+ the look-ahead), then the rest."""
    if strategy == "exponential":
        return plan_chunks(total_tokens)
    if strategy != "equal":
        raise InvalidInputError(f"unknown chunk strategy {strategy!r}; choose one of {STRATEGIES}")
    if hop < 1:
        raise InvalidInputError(f"hop must be >= 1 token, got {hop}")
    offsets = range(0, max(total_tokens - LOOKAHEAD, 0), hop)
    chunks = [Chunk(offset + hop + LOOKAHEAD, offset, False) for offset in offsets
              if offset + hop + LOOKAHEAD <= total_tokens]
    return chunks + [Chunk(total_tokens, chunks[-1].token_offset + hop if chunks else 0, True)]


def random_tokens(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 6561, (n,), generator=generator) for n in lengths]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_kwargs(prompt: PromptFeatures) -> dict:
    return {"prompt_tokens": prompt.speech_tokens, "prompt_feat": prompt.speech_feat, "embedding": prompt.embedding}


# ----- offline -----

@dataclass
class OfflineResult:
    wall_s: float
    audio_s: float
    batch_latencies_s: list[float]
    waves: list[torch.Tensor] = field(repr=False)

    @property
    def rtf(self) -> float:
        return self.wall_s / self.audio_s


def run_offline(t2w: CosyVoice2Token2Wav, tokens: list[torch.Tensor], prompt: PromptFeatures, batch: int = 1,
                zero_noise: bool = False) -> OfflineResult:
    """Synthesise every utterance, ``batch`` per :meth:`offline_batch` call; wall time and audio."""
    noise = {"sine_noise": _zero_noise(t2w)} if zero_noise else {}
    waves, latencies = [], []
    synchronize(t2w.device)
    start = time.perf_counter()
    for i in range(0, len(tokens), batch):
        begin = time.perf_counter()
        waves += t2w.offline_batch([OfflineRequest(t, **_prompt_kwargs(prompt), **noise) for t in tokens[i:i + batch]])
        latencies.append(time.perf_counter() - begin)  # waves are on the CPU: the device is done
    wall = time.perf_counter() - start
    audio = sum(w.numel() for w in waves) / t2w.sample_rate
    return OfflineResult(wall, audio, latencies, waves)


def _zero_noise(t2w: CosyVoice2Token2Wav):
    harmonics = t2w.hift.m_source.num_harmonics
    return lambda length: torch.zeros(1, length, harmonics)


# ----- streaming -----

@dataclass
class StreamResult:
    chunk_latencies_s: list[float] = field(default_factory=list)  # chunk ready (tokens there) -> piece back
    arrivals_s: list[float] = field(default_factory=list)  # piece back, since the stream started
    durations_s: list[float] = field(default_factory=list)  # audio seconds per piece
    pieces: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def audio_s(self) -> float:
        return sum(self.durations_s)

    def underruns(self) -> tuple[int, float]:
        return playback_underruns(self.arrivals_s, self.durations_s)


@dataclass
class StreamingRun:
    wall_s: float
    streams: list[StreamResult]

    @property
    def audio_s(self) -> float:
        return sum(s.audio_s for s in self.streams)

    def summary(self) -> dict:
        underruns = [s.underruns() for s in self.streams]
        return {
            "streams": len(self.streams), "wall_s": self.wall_s, "audio_s": self.audio_s,
            "rtf": self.wall_s / self.audio_s,
            "first_chunk": latency_stats(s.chunk_latencies_s[0] for s in self.streams),
            "chunk": latency_stats(x for s in self.streams for x in s.chunk_latencies_s),
            "chunk_index_median_ms": [1e3 * median([s.chunk_latencies_s[k] for s in self.streams
                                                    if k < len(s.chunk_latencies_s)])
                                      for k in range(max(len(s.chunk_latencies_s) for s in self.streams))],
            "underruns": sum(c for c, _ in underruns), "streams_with_underrun": sum(1 for c, _ in underruns if c),
            "stall_s": sum(s for _, s in underruns),
        }


def run_streams(t2w: CosyVoice2Token2Wav, tokens: list[torch.Tensor], prompt: PromptFeatures, *,
                concurrency: int = 1, strategy: str = "exponential", hop: int = TOKEN_RATE, batch: int = 1,
                token_rate: float | None = None, zero_noise: bool = False) -> StreamingRun:
    """Play every token sequence as a stream, ``concurrency`` listeners at a time (one thread each)."""
    noise = {"sine_noise": _zero_noise(t2w)} if zero_noise else {}
    batcher = Token2WavBatcher(t2w, max_batch=batch).start() if batch > 1 else None
    results: list[StreamResult | None] = [None] * len(tokens)
    errors: list[BaseException] = []
    next_index = iter(range(len(tokens)))
    lock = threading.Lock()

    def listener() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            try:
                results[i] = _play(t2w, batcher, f"bench-{i}", tokens[i], prompt, noise, strategy, hop, token_rate)
            except BaseException as exc:  # reported after all threads ended
                errors.append(exc)
                return

    synchronize(t2w.device)
    start = time.perf_counter()
    threads = [threading.Thread(target=listener, name=f"listener-{k}") for k in range(max(1, concurrency))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if batcher is not None:
        batcher.close()
    if errors:
        raise errors[0]
    return StreamingRun(wall, results)


def _play(t2w, batcher, request_id, tokens, prompt, noise, strategy, hop, token_rate) -> StreamResult:
    result = StreamResult()
    stream = t2w.open_stream(request_id, **_prompt_kwargs(prompt), **noise)
    start = time.perf_counter()
    try:
        for chunk in chunk_plan(tokens.numel(), strategy, hop):
            ready = start + (chunk.num_tokens / token_rate if token_rate else 0.0)
            if (wait := ready - time.perf_counter()) > 0:
                time.sleep(wait)
            begin = max(ready, time.perf_counter())
            args = (tokens[:chunk.num_tokens], chunk.token_offset, chunk.finalize)
            piece = batcher.submit_step(stream, *args).result() if batcher else stream.step(*args)
            end = time.perf_counter()  # pieces come back on the CPU: the device is done
            result.chunk_latencies_s.append(end - begin)
            result.arrivals_s.append(end - start)
            result.durations_s.append(piece.numel() / t2w.sample_rate)
            result.pieces.append(piece)
    finally:
        stream.close()
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----- command lines -----

def add_common_args(parser) -> None:
    """Arguments of both benchmark command lines (``token2wav.py``, ``streaming_inference.py``)."""
    parser.add_argument("--model-dir", type=Path, required=True, help="CosyVoice2-0.5B directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens-file", type=Path,
                        help="raw speech token ids (0..6560), whitespace separated; one utterance per line")
    source.add_argument("--num-tokens", type=int, nargs="+",
                        help="random utterances of these lengths (25 tokens = 1 s of audio)")
    parser.add_argument("--speaker-id", default="001", help="cached speaker of spk2info.pt used as the prompt")
    parser.add_argument("--reference-audio", type=Path, help="prompt wav instead of a cached speaker")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", default="fp32",
                        help="comma-separated dtype[+graphs][+incremental][+batchN], e.g. fp32,fp16,fp16+graphs+batch16")
    parser.add_argument("--runs", type=int, default=1, help="timed runs per variant (after one warm-up run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--output-json", type=Path, help="write every number here")


def utterance_tokens(args) -> list[torch.Tensor]:
    if args.tokens_file:
        lines = [line.split() for line in args.tokens_file.read_text().splitlines() if line.strip()]
        if not lines:
            raise InvalidInputError(f"{args.tokens_file} holds no tokens")
        return [torch.tensor([int(x) for x in line], dtype=torch.long) for line in lines]
    return random_tokens(args.num_tokens, args.seed)


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
