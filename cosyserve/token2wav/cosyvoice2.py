"""CosyVoice2 token2wav: speech tokens → 24 kHz waveform (flow + HiFT), offline and streaming.

Reproduces the Triton ``token2wav`` model (``CosyVoice2Model.token2wav``):

* offline (no ``token_offset``): flow non-streaming over all tokens, HiFT in one call;
* streaming: every call re-runs the flow over *all* tokens received so far (no flow cache) with
  ``streaming = not finalize``; the first ``token_mel_ratio · token_offset`` frames (already
  voiced) are dropped and the rest goes through a :class:`HiftStream` (8-frame mel cache,
  3840-sample excitation cache, Hamming cross-fade, 3840 samples withheld until the next chunk).

Token ids are raw speech tokens in [0, vocab_size) (6561), not LLM ids.

Work of several requests runs packed together through :meth:`CosyVoice2Token2Wav.run_batch`
(offline requests and streaming steps alike; :mod:`.batching` schedules it): one flow batch per
(streaming, finalize) kind, one HiFT batch per mel shape; each result equals the request run
alone up to float rounding. :class:`Token2WavOptions` holds the opt-in speed-ups (all off by
default, which keeps the reference computation): CUDA graphs captured ahead of time
(:mod:`.graphs`), a compiled estimator, and the incremental streaming flow engine
(:class:`~.flow_engine.FlowEngine`: the chunks of all streams of a batch packed into one step per
Euler step, each computing only its new frames); and HiFT's network dtype, whose default is
float32 on the CPU and float16 on CUDA.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CapacityError, InvalidInputError
from ..models.flow import CosyVoice2Flow, load_flow
from ..models.hift import HiFTGenerator, load_hift
from .flow_engine import EngineStream, FlowEngine
from .graphs import FlowSampler, HiftRunner
from ..runtime import host_to_device
from ..schedule import plan_chunks
from ..speech_tokens import speech_token_ids
from .vocoder_batch import source_noise, vocode_batch
from .vocoder_stream import MEL_CACHE_FRAMES, HiftStream, SineNoiseProvider, VocoderCall, VocoderChunk


# Frames a server captures flow graphs for by default: a 10 s prompt with 20 s of target speech.
DEFAULT_PRECAPTURE_FRAMES = 1500

HIFT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# What hift_dtype "auto" runs on a CUDA device (elsewhere: float32, the reference). Measured with
# scripts/bench_hift.py on an H100 (docs/benchmarks.md): the float16 network's waveform is within
# rel-L2 1.1e-3..1.5e-3 of float32 (TF32 off) at the streaming shapes and 4.1e-3 of upstream on the
# parity fixture (tolerance 1e-2); it is 0.1-0.3 ms faster per 1-row chunk and up to 1.5x faster at
# 16 rows. bfloat16 misses the fixture tolerance (1.3e-2).
AUTO_CUDA_HIFT_DTYPE = "float16"


def resolve_hift_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of HiFT's network for the option value ``name`` ("auto" or a key of HIFT_DTYPES)."""
    if name == "auto":
        name = AUTO_CUDA_HIFT_DTYPE if device.type == "cuda" else "float32"
    if name not in HIFT_DTYPES:
        raise InvalidInputError(f"hift_dtype must be 'auto' or one of {sorted(HIFT_DTYPES)}, got {name!r}")
    return HIFT_DTYPES[name]


FINAL_CHUNKS = ("reference", "streaming")


def default_state_pool_bytes(device: torch.device) -> int:
    """The flow engine's page pool when none is asked for: a third of the GPU memory free at load
    (the LLM, HiFT and activations need the rest), 512 MiB of host memory on the CPU (hundreds of
    pages of the tiny test models, two of the released one in fp32)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 3
    return 512 << 20


def default_flow_dtype(device: torch.device) -> torch.dtype:
    """The flow's dtype when none is asked for (CosyVoice2 and Step-Audio2): fp16 on CUDA, as deployed
    (HiFT's own dtype: ``Token2WavOptions.hift_dtype``), fp32 on CPU."""
    return torch.float16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class Token2WavOptions:
    """Opt-in speed-ups; the defaults reproduce the reference computation.

    ``cuda_graphs``: replay the flow's Euler loop (padded to a frame bucket, batch to a power of
    two) from CUDA graphs (:mod:`.graphs`); CUDA devices only. ``precapture_frames`` (> 0, with
    graphs): capture every flow graph for up to ``precapture_batch`` requests of up to that many
    frames (prompt + target) when the model is built, so that no request runs eagerly or waits
    for a capture (about a minute at start-up for 1500 frames and batch 16); with
    ``precapture_streaming`` False only the non-streaming (offline) graphs; the flow engine's step
    graphs (``incremental_stream``) are captured then too. ``hift_graphs``: also
    replay HiFT's network, keyed by exact shapes; with ``hift_precapture_frames`` (mel frame counts,
    e.g. :func:`streaming_vocoder_frames`) those shapes are captured for up to ``precapture_batch``
    rows when the model is built and every other shape runs eagerly, otherwise shapes are captured
    the second time they are seen (churn when chunk lengths vary). ``compile``: run
    the flow estimator through ``torch.compile`` (needs a C compiler and, on CUDA, Triton; the
    first call of each attention kind compiles). ``incremental_stream``: streaming steps run
    through the :class:`~.flow_engine.FlowEngine` and compute only their new frames (same output
    up to rounding); each stream holds per-frame state in a page pool of ``state_pool_bytes``
    (~115 MB per second of audio for the released model in fp16), a voice's prompt state is kept
    for up to ``max_voices`` voices. ``final``: how an incremental stream's final chunk is voiced:
    "reference" (the reference's non-streaming pass over prompt + all tokens, exactly its output)
    or "streaming" (streaming masks like every chunk before it, incremental and cheap; the last
    chunk's frames then differ from the reference's).
    ``tensorrt_plan`` / ``tensorrt_streaming_plan``: run the estimator from TensorRT plans
    (:mod:`.tensorrt`; non-streaming / streaming attention), CUDA only, not with ``cuda_graphs``.
    ``prefix_priority`` (with ``incremental_stream``, on CUDA): new voices' prompts run on a stream of
    high priority (the device runs their kernels first while others wait too; the flow engine's
    ``prefix_priority``): a burst of new voices waits for their prompts' solve, while playing streams
    have audio in hand (measured: docs/benchmarks.md, "New voices, fifteenth session").
    ``hift_dtype``: dtype of HiFT's up-sampling network ("float32", "float16", "bfloat16"; its F0,
    excitation and inverse STFT stay float32); "auto" is float32 on the CPU (the reference) and
    :data:`AUTO_CUDA_HIFT_DTYPE` on CUDA.
    """

    cuda_graphs: bool = False
    hift_graphs: bool = False
    compile: bool = False
    precapture_frames: int = 0
    precapture_batch: int = 16
    precapture_streaming: bool = True
    incremental_stream: bool = False
    final: str = "reference"
    state_pool_bytes: int = 0
    max_voices: int = 64
    prefix_priority: bool = True
    hift_precapture_frames: tuple[int, ...] = ()
    bucket_frames: int = 50
    max_graphs: int = 256
    tensorrt_plan: str | Path | None = None
    tensorrt_streaming_plan: str | Path | None = None
    hift_dtype: str = "auto"

    @property
    def tensorrt(self) -> bool:
        return bool(self.tensorrt_plan or self.tensorrt_streaming_plan)


@dataclass
class _Prompt:
    tokens: torch.Tensor  # (1, P) long
    feat: torch.Tensor  # (1, ratio·P, 80)
    embedding: torch.Tensor  # (1, spk_embed_dim)


@dataclass
class OfflineRequest:
    """One offline synthesis for :meth:`CosyVoice2Token2Wav.offline_batch` (arguments as for ``offline``)."""

    tokens: Any
    prompt_tokens: Any
    prompt_feat: Any
    embedding: Any
    generator: torch.Generator | None = None
    sine_noise: SineNoiseProvider | None = None


@dataclass
class BatchItem:
    """One unit of :meth:`CosyVoice2Token2Wav.run_batch`: validated tokens and where its mel goes."""

    tokens: torch.Tensor  # (1, n) on the CPU
    prompt: _Prompt
    finalize: bool
    streaming: bool
    skip_frames: int  # leading target frames already voiced (ratio · token_offset)
    stream: Token2WavStream | None  # None: offline
    generator: torch.Generator | None = None
    sine_noise: SineNoiseProvider | None = None

    @property
    def incremental(self) -> bool:
        return self.stream is not None and self.stream._engine_stream is not None and (
            not self.finalize or self.stream.owner.options.final == "streaming")


class CosyVoice2Token2Wav:
    """Flow + HiFT on one device. ``dtype`` is the flow's compute dtype; HiFT's network runs in
    ``options.hift_dtype`` (fp16 on CUDA by default; the reference deployment keeps HiFT in fp32).
    Open streams are tracked so servers and tests can check that no per-request state outlives its
    request."""

    def __init__(self, flow: CosyVoice2Flow, hift: HiFTGenerator, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, options: Token2WavOptions | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.options = options or Token2WavOptions()
        for wanted, name in ((self.options.cuda_graphs, "cuda_graphs"), (self.options.tensorrt, "a TensorRT plan")):
            if wanted and self.device.type != "cuda":
                raise InvalidInputError(f"{name} needs a CUDA device, got {str(self.device)!r}")
        if self.options.cuda_graphs and self.options.tensorrt:
            raise InvalidInputError("choose cuda_graphs or a TensorRT estimator plan, not both")
        self.flow = flow.to(device=self.device, dtype=dtype).eval()
        if self.options.tensorrt:
            from .tensorrt import TensorRTEstimator  # fails fast without the tensorrt package

            decoder = self.flow.decoder
            decoder.estimator = TensorRTEstimator(decoder.estimator, {False: self.options.tensorrt_plan,
                                                                      True: self.options.tensorrt_streaming_plan})
        self.hift = hift.to(device=self.device).eval()
        self.hift.set_network_dtype(resolve_hift_dtype(self.options.hift_dtype, self.device))
        options = self.options
        if options.compile and options.tensorrt:
            raise InvalidInputError("choose compile or a TensorRT estimator plan, not both")
        self.sampler = FlowSampler(self.flow.decoder, cuda_graphs=options.cuda_graphs, compile=options.compile,
                                   bucket_frames=options.bucket_frames, max_graphs=options.max_graphs)
        if options.precapture_frames > 0:
            if not options.cuda_graphs:
                raise InvalidInputError("precapture_frames needs cuda_graphs")
            self.sampler.precapture(options.precapture_batch, options.precapture_frames,
                                    (True, False) if options.precapture_streaming else (False,))
        self.vocoder = HiftRunner(self.hift, cuda_graphs=options.cuda_graphs and options.hift_graphs,
                                  max_graphs=options.max_graphs)
        if options.hift_precapture_frames:
            if not (options.cuda_graphs and options.hift_graphs):
                raise InvalidInputError("hift_precapture_frames needs cuda_graphs and hift_graphs")
            self.vocoder.precapture(options.precapture_batch, options.hift_precapture_frames)
        if options.final not in FINAL_CHUNKS:
            raise InvalidInputError(f"final must be one of {FINAL_CHUNKS}, got {options.final!r}")
        self.engine = None
        if options.incremental_stream:
            # after the flow and HiFT graphs: the pool is sized from the memory they leave free
            self.engine = FlowEngine(self.flow, options.state_pool_bytes or default_state_pool_bytes(self.device),
                                     max_voices=options.max_voices, cuda_graphs=options.cuda_graphs,
                                     precapture=options.precapture_frames > 0, counters=self.sampler.counters,
                                     prefix_priority=options.prefix_priority)
        self.counters = Token2WavCounters()
        self.sample_rate = self.hift.cfg.sampling_rate
        self._open_streams = 0  # a count for leak checks; the streams' owners keep the streams
        self._lock = threading.Lock()
        # With CUDA graphs, batches run one at a time: a capture must not overlap other threads' GPU work.
        self._run_lock = threading.Lock() if options.cuda_graphs else contextlib.nullcontext()

    # ----- offline -----

    def offline(self, tokens: Any, prompt_tokens: Any, prompt_feat: Any, embedding: Any, *,
                generator: torch.Generator | None = None, sine_noise: SineNoiseProvider | None = None) -> torch.Tensor:
        """All tokens at once → waveform (480·2·len(tokens),) float32 on the CPU.

        HiFT randomness: drawn on ``generator`` (default generator if None), or injected by
        ``sine_noise`` (called with the sample count).
        """
        return self.offline_batch([OfflineRequest(tokens, prompt_tokens, prompt_feat, embedding, generator,
                                                  sine_noise)])[0]

    def offline_batch(self, requests: Sequence[OfflineRequest]) -> list[torch.Tensor]:
        """:meth:`offline` of several requests in one flow batch (HiFT batched per equal length)."""
        return self.run_batch([self.offline_work(r) for r in requests])

    def offline_work(self, request: OfflineRequest) -> BatchItem:
        """Validate an offline request into a unit of :meth:`run_batch`."""
        prompt = self._prompt(request.prompt_tokens, request.prompt_feat, request.embedding)
        tokens = self._tokens(request.tokens, "tokens")
        if tokens.shape[1] == 0:
            raise InvalidInputError("tokens is empty; at least one speech token is required")
        return BatchItem(tokens, prompt, finalize=True, streaming=False, skip_frames=0, stream=None,
                     generator=request.generator, sine_noise=request.sine_noise)

    # ----- streaming -----

    def open_stream(self, prompt_tokens: Any, prompt_feat: Any, embedding: Any, *, label: str = "",
                    generator: torch.Generator | None = None,
                    sine_noise: SineNoiseProvider | None = None) -> "Token2WavStream":
        """Start a streaming session (``label`` names it in error messages; whoever opens it keeps
        it). HiFT randomness as in :meth:`offline`; one generator serves all chunks of the session in
        order."""
        prompt = self._prompt(prompt_tokens, prompt_feat, embedding)
        engine_stream = None
        if self.engine is not None:
            with self._run_lock:  # a new voice's prompt runs through the flow
                try:
                    engine_stream = self.engine.open(prompt.tokens, prompt.feat, prompt.embedding)
                except CapacityError:  # no pages for a new voice's prompt state: this stream re-runs
                    self.counters.engine_fallbacks += 1
        vocoder = HiftStream(self.hift, generator=generator, sine_noise=sine_noise)
        with self._lock:
            self._open_streams += 1
        return Token2WavStream(self, label, prompt, vocoder, engine_stream)

    @property
    def open_streams(self) -> int:
        """Streams opened and not closed yet."""
        with self._lock:
            return self._open_streams

    def _stream_closed(self) -> None:
        with self._lock:
            self._open_streams -= 1

    # ----- batched execution -----

    @torch.inference_mode()
    def run_batch(self, work: Sequence[BatchItem]) -> list[torch.Tensor | VocoderChunk]:
        """Run validated units (:meth:`offline_work`, :meth:`Token2WavStream.plan_step`) packed together.

        Returns, per unit, the offline waveform (N,) float32 on the CPU, or the streaming step's
        :class:`VocoderChunk`. On an error every stream of the batch is closed.
        """
        with self._run_lock:
            return self._run_batch(work)

    def _run_batch(self, work: Sequence[BatchItem]) -> list[torch.Tensor | VocoderChunk]:
        try:
            clock = _StageClock(self.device)
            mels = self._new_mels(work)
            flow_done = clock.mark()
            calls = [w.stream._vocoder.prepare(mel, finalize=w.finalize) if w.stream else
                     VocoderCall(mel, None, True, self.hift.hop_length, True) for w, mel in zip(work, mels)]
            outputs = self._vocode(work, calls)
            hift_done = clock.mark()
            self.counters.flow_s += clock.seconds(clock.start, flow_done)
            self.counters.hift_s += clock.seconds(flow_done, hift_done)
            results = []
            for w, mel, call, output in zip(work, mels, calls, outputs):
                if w.stream is None:
                    results.append(output[0][0].float().cpu())
                else:
                    results.append(w.stream._complete(call, output, mel.shape[2], w.finalize))
            return results
        except BaseException:
            for w in work:
                if w.stream is not None:
                    w.stream.close()
            raise

    def _new_mels(self, work: Sequence[BatchItem]) -> list[torch.Tensor]:
        """Each unit's not yet voiced mel (1, 80, f) float32: one flow batch per (streaming, finalize)."""
        mels: list[torch.Tensor | None] = [None] * len(work)
        groups: dict[tuple[bool, bool], list[int]] = {}
        incremental = [i for i, w in enumerate(work) if w.incremental]
        if incremental:
            # Streams whose next state pages cannot be had leave the engine and re-run from here
            # on (same output up to rounding, no state): under memory pressure the server slows
            # those streams down rather than failing them.
            chunks = [(work[i].stream._engine_stream, work[i].tokens, work[i].finalize) for i in incremental]
            fits = self.engine.fit(chunks)
            for i, fit in zip(incremental, fits):
                if not fit:
                    work[i].stream._leave_engine()
            incremental = [i for i, fit in zip(incremental, fits) if fit]
            chunks = [chunk for chunk, fit in zip(chunks, fits) if fit]
        if incremental:
            for i, mel in zip(incremental, self.engine.run(chunks)):
                mels[i] = mel
        for i, w in enumerate(work):
            if not w.incremental:
                groups.setdefault((w.streaming, w.finalize), []).append(i)
        for (streaming, finalize), members in groups.items():
            items = [work[i] for i in members]
            c = self.flow.batch_conditions([w.tokens for w in items], [w.prompt.tokens for w in items],
                                           [w.prompt.feat for w in items], [w.prompt.embedding for w in items],
                                           streaming=streaming, finalize=finalize)
            for i, mel in zip(members, c.target_mels(self.sampler(c, streaming))):
                mels[i] = mel[:, :, work[i].skip_frames:]
        return mels

    def _vocode(self, work: Sequence[BatchItem], calls: Sequence[VocoderCall]) -> list[tuple | None]:
        """HiFT (speech, source) of each needed call (None otherwise), batched per shape; noise drawn
        per unit in order (:func:`~.vocoder_batch.vocode_batch`)."""
        harmonics = self.hift.m_source.num_harmonics
        noises = [None if not call.needed else
                  source_noise(call, harmonics, self.device, *((w.stream._vocoder.generator, w.stream._vocoder.sine_noise)
                                                                if w.stream else (w.generator, w.sine_noise)))
                  for w, call in zip(work, calls)]
        return vocode_batch(self.vocoder, calls, noises)

    # ----- validation -----

    def _tokens(self, value: Any, name: str) -> torch.Tensor:
        """Speech-token ids as a (1, n) long CPU tensor (:func:`~cosyserve.speech_tokens.speech_token_ids`).
        Kept on the CPU: the flow checks ids again, which on the device would wait for queued GPU work."""
        return speech_token_ids(value, self.flow.cfg.vocab_size, name)[None]

    def _prompt(self, prompt_tokens: Any, prompt_feat: Any, embedding: Any) -> _Prompt:
        tokens = self._tokens(prompt_tokens, "prompt_tokens")
        cfg = self.flow.cfg
        feat = _float_tensor(prompt_feat, "prompt_feat")
        if feat.dim() == 2:
            feat = feat[None]
        expected = (1, cfg.token_mel_ratio * tokens.shape[1], cfg.output_size)
        if tuple(feat.shape) != expected:
            raise InvalidInputError(
                f"prompt_feat must be (1, {cfg.token_mel_ratio}·prompt tokens, {cfg.output_size}) = {expected} "
                f"(time-major mel, exactly {cfg.token_mel_ratio} frames per prompt token), got {tuple(feat.shape)}"
            )
        emb = _float_tensor(embedding, "embedding").reshape(1, -1)
        if emb.shape[1] != cfg.spk_embed_dim:
            raise InvalidInputError(f"embedding must hold {cfg.spk_embed_dim} values, got {emb.shape[1]}")
        # copied without waiting for the device's queue (a new voice's prompt arrives while streams play)
        return _Prompt(tokens, host_to_device(feat, self.device).to(self.dtype),
                       host_to_device(emb, self.device).to(self.dtype))


class Token2WavStream:
    """One request's streaming session (see :meth:`CosyVoice2Token2Wav.open_stream`).

    Call :meth:`step` with the cumulative tokens each time the scheduler emits a chunk; the
    returned pieces concatenate to the waveform. The session closes itself after the final step
    and on any error (its state may then be inconsistent); :meth:`close` is idempotent and also
    serves cancellation. Usable as a context manager.
    """

    def __init__(self, owner: CosyVoice2Token2Wav, label: str, prompt: _Prompt, vocoder: HiftStream,
                 engine_stream: EngineStream | None = None):
        self.owner = owner
        self.label = label
        self._prompt: _Prompt | None = prompt
        self._vocoder = vocoder
        self._engine_stream = engine_stream
        self._frames_done = 0  # mel frames already handed to the vocoder

    @property
    def closed(self) -> bool:
        return self._prompt is None

    @property
    def frames_done(self) -> int:
        """Target mel frames voiced so far (token_mel_ratio · the next token_offset)."""
        return self._frames_done

    def step(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> torch.Tensor:
        """Voice tokens[token_offset:] → waveform piece (S,) float32 on the CPU."""
        return self.step_chunk(tokens_so_far, token_offset, finalize).audio[0].float().cpu()

    def step_chunk(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> VocoderChunk:
        """:meth:`step` returning the vocoder call's details (mel given to HiFT, raw output...)."""
        return self.owner.run_batch([self.plan_step(tokens_so_far, token_offset, finalize)])[0]

    def plan_step(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> BatchItem:
        """Validate a step into a unit of :meth:`CosyVoice2Token2Wav.run_batch` (closes the stream if invalid).

        Run it before planning the next step: the check of ``token_offset`` reads the frames voiced so far.
        """
        if self._prompt is None:
            raise InvalidInputError(f"token2wav stream {self.label!r} is closed (finalized, cancelled or failed)")
        try:
            return self._plan(tokens_so_far, token_offset, finalize)
        except BaseException:
            self.close()
            raise

    def _plan(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> BatchItem:
        cfg = self.owner.flow.cfg
        tokens = self.owner._tokens(tokens_so_far, "tokens_so_far")
        if isinstance(token_offset, bool) or not isinstance(token_offset, int) or token_offset < 0:
            raise InvalidInputError(f"token_offset must be a non-negative int, got {token_offset!r}")
        if token_offset * cfg.token_mel_ratio != self._frames_done:
            raise InvalidInputError(
                f"token_offset {token_offset} does not continue the stream: {self._frames_done // cfg.token_mel_ratio} "
                "tokens have been voiced so far"
            )
        voiceable = tokens.shape[1] - (0 if finalize else cfg.pre_lookahead_len)
        if voiceable <= token_offset:
            raise InvalidInputError(
                f"{tokens.shape[1]} tokens with token_offset {token_offset}: a "
                f"{'final' if finalize else 'non-final'} step needs more than "
                f"{token_offset + (0 if finalize else cfg.pre_lookahead_len)} tokens"
                + ("" if finalize else f" (the last {cfg.pre_lookahead_len} are look-ahead only)")
            )
        return BatchItem(tokens, self._prompt, finalize=finalize, streaming=not finalize,
                     skip_frames=token_offset * cfg.token_mel_ratio, stream=self)

    def _complete(self, call: VocoderCall, hift_output: tuple | None, new_frames: int, finalize: bool) -> VocoderChunk:
        raw_speech, source = hift_output if hift_output is not None else (None, None)
        chunk = self._vocoder.complete(call, raw_speech, source)
        self._frames_done += new_frames
        if finalize:
            self.close()
        return chunk

    def _leave_engine(self) -> None:
        """Go on without the flow engine (its state pages freed): every later chunk re-runs."""
        self._engine_stream.close()
        self._engine_stream = None
        self.owner.counters.engine_fallbacks += 1

    def close(self) -> None:
        """Release the caches (idempotent)."""
        if self._prompt is None:
            return
        self._prompt = None
        self._vocoder.close()
        if self._engine_stream is not None:
            self._engine_stream.close()
        self.owner._stream_closed()

    def __enter__(self) -> "Token2WavStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class Token2WavCounters:
    """Running totals of device time per stage of :meth:`CosyVoice2Token2Wav.run_batch` (metrics).

    On a GPU: CUDA-event time of the stage on the stream, from the end of the previous stage to
    the stage's last kernel (GPU idle gaps while the host launches eager work included); on the
    CPU: wall time. ``flow`` is encoder + Euler loop (+ incremental steps), ``hift`` the vocoder.
    """

    flow_s: float = 0.0
    hift_s: float = 0.0
    engine_fallbacks: int = 0  # streams that left the flow engine for the re-run (state pool full)


class _StageClock:
    """Marks on the device's stream, read once the marked work has finished (no sync in between)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.mark()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()  # the caller is about to wait for these results anyway
        return start.elapsed_time(end) / 1000


def streaming_vocoder_frames(max_tokens: int, token_mel_ratio: int = 2, strategy: str = "exponential") -> tuple[int, ...]:
    """Mel frame counts of the HiFT calls of non-final streaming chunks (cached frames included)
    for streams of up to ``max_tokens`` tokens: the shapes worth capturing, since every stream
    repeats them (final chunks have any length)."""
    chunks = plan_chunks(max_tokens, strategy)
    frames = []
    for index, (chunk, following) in enumerate(zip(chunks[:-1], chunks[1:])):
        new = token_mel_ratio * (following.token_offset - chunk.token_offset)
        frames.append(new + (MEL_CACHE_FRAMES if index else 0))
    return tuple(dict.fromkeys(frames))


def _float_tensor(value: Any, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value
    if not tensor.is_floating_point():
        raise InvalidInputError(f"{name} must be floating point, got dtype {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidInputError(f"{name} contains NaN or infinite values")
    return tensor


def load_token2wav(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   options: Token2WavOptions | None = None) -> CosyVoice2Token2Wav:
    """Load ``flow.pt`` + ``hift.pt`` (configured by ``cosyvoice2.yaml`` when present) from a
    CosyVoice2 model directory. The flow runs in ``dtype``, HiFT's network in ``options.hift_dtype``."""
    flow = load_flow(model_dir, device, dtype)
    hift = load_hift(model_dir, device, torch.float32)
    return CosyVoice2Token2Wav(flow, hift, device, dtype, options)
