"""Token2wav's two hot loops, optionally replayed from CUDA graphs.

On a GPU both are bound by kernel launches, not arithmetic: one flow call runs the estimator
10 Euler steps x (14 ResNet stages + 56 transformer blocks at the released size), several
thousand small kernels on a batch of 2 CFG rows; a HiFT call is a few hundred convolutions and
element-wise ops. A CUDA graph captures such a sequence once per input shape and replays it with
one launch.

* :class:`FlowSampler`: the CFM Euler loop over :class:`~cosyserve.models.flow.FlowConditions`.
  Graphs replay fixed shapes, so requests are padded on the right to a frame bucket
  (:func:`frame_bucket`: multiples of ``bucket_frames`` up to 8 of them, then about 25 % apart)
  and the batch to a :func:`row_bucket` (copies of row 0). That is exact up to rounding: the
  estimator's convolutions are causal, padded frames are zeroed before each of them and hidden as
  attention keys (the same rule that makes mixed-length batches exact). Bounded shapes let a
  server capture every graph it will need at start-up (:meth:`FlowSampler.precapture`), so no
  request pays for an eager run or a capture. The estimator may be ``torch.compile``-d
  (dynamic shapes, one compilation per attention kind): fewer, fused kernels per step.
* :class:`HiftRunner`: HiFT with injected source noise. HiFT is not causal (centred
  convolutions, reflect padding), so its graphs are keyed by the exact frame count (rows, which
  never interact, are padded to a power of two). Two graphs so the cached excitation can be
  pasted between them: the excitation, then the network and its inverse STFT.
* :class:`CausalHiftGraphs`: CosyVoice3's causal HiFT, its F0 predictor and network at the row and
  frame buckets its batched calls are padded to, all captured at load.

Shapes not captured in advance are captured the second time they are seen (``capture_after``); a
one-off shape runs eagerly, since capturing costs about three runs. A runner whose shapes were
captured in advance (the flow's frame buckets, HiFT's streaming chunk lengths) runs any other
shape eagerly instead (``capture_after=None``): no capture ever stalls a serving batch. All
graphs of a cache share one memory pool: replays are serialised, inputs are copied in and
outputs cloned out around each replay, so one graph's temporaries may overlap another's.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ..models.cosyvoice3.hift import WARM_UP_FRAMES, CausalHiFTGenerator, batched_shapes
from ..models.flow import CausalConditionalCFM, FlowConditions, fixed_noise
from ..models.flow.cfm import N_TIMESTEPS, NOISE_FRAMES
from ..models.hift import HiFTGenerator, SourceNoise
from ..runtime import LOOP_ROLE, role_stream

TensorFn = Callable[..., tuple[torch.Tensor, ...]]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class GraphCache:
    """``fn(*tensors) -> tuple of tensors`` replayed from a CUDA graph per input shape (at most ``max_graphs``).

    ``fn`` must be a pure function of its inputs' values with no host synchronisation. Shapes seen
    at most ``capture_after`` times run eagerly (``None``: every shape not captured with
    :meth:`capture` runs eagerly), and so do new shapes once ``max_graphs`` are held: a graph is
    never dropped while the process runs (destroying one frees the cuBLAS workspace of every graph
    captured on its stream: :func:`~cosyserve.runtime.role_stream`). Graphs are captured on the
    stream of ``role`` (the loop's, "main", unless told otherwise). A capture is preceded by
    ``warmup`` eager runs the first time (library handles, plans), one run later. Thread-safe (calls
    are serialised). ``pool``: a graph memory pool shared with other caches (their replays must not
    interleave with this one's: one thread replays them all), else one of its own.
    """

    def __init__(self, fn: TensorFn, *, max_graphs: int = 64, capture_after: int | None = 1, warmup: int = 2,
                 role: str = LOOP_ROLE, pool=None):
        if max_graphs < 1:
            raise InvalidInputError(f"max_graphs must be >= 1, got {max_graphs}")
        self.fn = fn
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self.warmup = warmup
        self.role = role
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: Counter = Counter()
        self._pool = pool
        self._lock = threading.Lock()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = self._key(inputs)
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None:
                self._seen[key] += 1
                if (self.capture_after is None or self._seen[key] <= self.capture_after
                        or len(self._graphs) >= self.max_graphs):
                    return self.fn(*inputs)
                entry = self._capture(key, inputs)
            return self._replay(entry, inputs)

    @staticmethod
    def _key(inputs: tuple[torch.Tensor, ...]) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)

    @torch.inference_mode()
    def capture(self, *inputs: torch.Tensor) -> None:
        """Capture the graph of these input shapes now (no-op if it exists); the values only warm up."""
        key = self._key(inputs)
        with self._lock:
            if key not in self._graphs:
                self._capture(key, inputs)

    @staticmethod
    def _replay(entry: _Graph, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for static, value in zip(entry.inputs, inputs):
            static.copy_(value)
        entry.graph.replay()
        return tuple(out.clone() for out in entry.outputs)

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = tuple(t.clone(memory_format=torch.contiguous_format) for t in inputs)
        graph, outputs = capture_graph(lambda: self.fn(*static), inputs[0].device, self._pool,
                                       self.warmup if not self._graphs else 1, self.role)
        entry = self._graphs[key] = _Graph(graph, static, tuple(outputs))
        return entry


def capture_graph(run: Callable[[], object], device: torch.device, pool, warmup: int = 1,
                  role: str = LOOP_ROLE) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run`` (pure GPU work, no host synchronisation) captured into a CUDA graph sharing ``pool``,
    on the stream of ``role`` (:func:`~cosyserve.runtime.role_stream`), after ``warmup`` eager runs
    there; returns the graph and what the captured run returned."""
    stream = role_stream(device, role)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up: library handles, cuDNN plans, lazy allocations
        for _ in range(warmup):
            run()
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads may keep running (and allocating) eagerly during the capture.
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        outputs = run()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, outputs


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Frame buckets: multiples of the step up to FINE_BUCKETS of them, then each about GROWTH x the last.
FINE_BUCKETS = 8
GROWTH = 1.25


def frame_bucket(frames: int, step: int = 50) -> int:
    """The padded length of a ``frames``-frame flow input: a multiple of ``step``, at most ~25 %
    (or one step) above ``frames``, from a small set of lengths; capped at the noise buffer."""
    bucket = _round_up(max(frames, 1), step)
    if bucket > FINE_BUCKETS * step:
        bucket = FINE_BUCKETS * step
        while bucket < frames:
            bucket = _round_up(int(bucket * GROWTH), step)
    return min(bucket, NOISE_FRAMES)


def frame_buckets(max_frames: int, step: int = 50) -> list[int]:
    """Every bucket a request of up to ``max_frames`` frames can fall in, ascending."""
    buckets = [frame_bucket(step, step)]
    while buckets[-1] < min(max_frames, NOISE_FRAMES):
        buckets.append(frame_bucket(buckets[-1] + 1, step))
    return buckets


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


def row_bucket(rows: int) -> int:
    """The padded batch of ``rows`` flow requests: a power of two, or 1.5 times one from 6 up
    (6, 12, 24...). Past 4 rows a flow batch is compute-bound, so its time grows with the padded
    rows: up to 16 rows the extra buckets bound the padding to a third (9 -> 12) instead of
    nearly as many rows again (5 -> 8, 9 -> 16), for 1.4x as many graphs."""
    power = _next_power_of_two(max(rows, 1))
    return power * 3 // 4 if power >= 8 and rows <= power * 3 // 4 else power


def row_buckets(max_rows: int) -> list[int]:
    """Every :func:`row_bucket` of 1..``max_rows`` rows, ascending."""
    return sorted({row_bucket(rows) for rows in range(1, max(max_rows, 1) + 1)})


def _powers_of_two(max_rows: int) -> list[int]:
    return [1 << k for k in range(_next_power_of_two(max(1, max_rows)).bit_length())]


def _pad_rows(v: torch.Tensor, rows: int) -> torch.Tensor:
    """``v`` with copies of its first row appended up to ``rows`` rows (padding rows are discarded)."""
    return torch.cat([v, v[:1].expand(rows - v.size(0), *v.shape[1:])]) if rows > v.size(0) else v


@dataclass
class FlowCounters:
    """Running totals of the rows and frames a :class:`FlowSampler` ran (padding included or not)."""

    calls: int = 0
    rows: int = 0  # requests
    frames: int = 0  # their frames (prompt + target), summed over requests
    padded_frames: int = 0  # frames computed: padded rows x padded length


class FlowSampler:
    """The flow's Euler loop: ``(conditions, streaming) -> x (B, 80, T)``, eager or from CUDA graphs.

    Eager without ``cuda_graphs``, ``pad`` and ``compile``: exactly ``CausalConditionalCFM.forward``.
    ``pad`` (implied by ``cuda_graphs``) runs the padded shapes; on its own it only serves tests.
    ``compile``: the estimator goes through ``torch.compile`` (dynamic shapes), with or without graphs.
    ``counters`` count what was run (metrics: how full the batches were, how much was padding).
    """

    def __init__(self, decoder: CausalConditionalCFM, *, cuda_graphs: bool = False, pad: bool = False,
                 compile: bool = False, bucket_frames: int = 50, max_graphs: int = 64,
                 n_timesteps: int = N_TIMESTEPS):
        if bucket_frames < 1:
            raise InvalidInputError(f"bucket_frames must be >= 1, got {bucket_frames}")
        self.decoder = decoder
        self.pad = pad or cuda_graphs
        self.cuda_graphs = cuda_graphs
        self.bucket_frames = bucket_frames
        self.n_timesteps = n_timesteps
        # One estimator call per Euler step; compiled once per attention kind (streaming or not).
        self.estimator = torch.compile(decoder.estimator, dynamic=True) if compile else None
        loops = {streaming: self._loop(streaming) for streaming in (False, True)}
        self._run: dict[bool, TensorFn] = (
            {s: GraphCache(fn, max_graphs=max_graphs) for s, fn in loops.items()} if cuda_graphs else loops)
        self.counters = FlowCounters()

    def _loop(self, streaming: bool) -> TensorFn:
        def euler(z, mask, mu, spks, cond):
            for _, x in self.decoder.euler_steps(z, mask, mu, spks, cond, streaming=streaming,
                                                 n_timesteps=self.n_timesteps, estimator=self.estimator):
                pass
            return (x,)
        return euler

    @property
    def num_graphs(self) -> int:
        return sum(run.num_graphs for run in self._run.values()) if self.cuda_graphs else 0

    @torch.inference_mode()
    def precapture(self, max_batch: int, max_frames: int, streaming: Sequence[bool] = (True, False)) -> int:
        """Capture the graphs of every padded shape up to ``max_batch`` requests of ``max_frames``
        frames, for these attention kinds; returns how many graphs there are. Needs ``cuda_graphs``.
        Longer or bigger batches then run eagerly (captured in advance or not at all)."""
        if not self.cuda_graphs:
            raise InvalidInputError("precapture needs cuda_graphs")
        param = next(self.decoder.estimator.parameters())
        for kind in streaming:
            for rows in row_buckets(max_batch):
                for frames in frame_buckets(max_frames, self.bucket_frames):
                    z = fixed_noise(frames, param.device, param.dtype).expand(rows, -1, -1)
                    mu = torch.zeros_like(z)
                    self._run[kind].capture(z, torch.ones_like(z[:, :1]), mu, mu[:, :, 0], mu)
            self._run[kind].capture_after = None
        return self.num_graphs

    @torch.inference_mode()
    def __call__(self, c: FlowConditions, streaming: bool) -> torch.Tensor:
        batch, frames = c.mu.size(0), c.mu.size(2)
        rows, padded = (row_bucket(batch), frame_bucket(frames, self.bucket_frames)) if self.pad else (batch, frames)
        counters = self.counters
        counters.calls, counters.rows = counters.calls + 1, counters.rows + batch
        counters.frames += sum(c.frames)
        counters.padded_frames += rows * padded
        if not self.pad:
            z = fixed_noise(frames, c.mu.device, c.mu.dtype).expand(batch, -1, -1)
            return self._run[streaming](z, c.mask, c.mu, c.spks, c.cond)[0]

        def fit(v: torch.Tensor) -> torch.Tensor:
            if v.dim() == 3:
                v = torch.nn.functional.pad(v, (0, padded - frames))
            return _pad_rows(v, rows)

        z = fixed_noise(padded, c.mu.device, c.mu.dtype).expand(rows, -1, -1)
        (x,) = self._run[streaming](z, fit(c.mask), fit(c.mu), fit(c.spks), fit(c.cond))
        return x[:batch, :, :frames]


class HiftRunner:
    """HiFT inference with injected sine noise: ``(mel, cache_source, sine_noise) -> (speech, source)``.

    Without ``cuda_graphs`` and ``pad`` it is :meth:`HiFTGenerator.inference`. With graphs, rows
    are padded to a power of two and two graphs per shape replay the work: the excitation (F0 and
    harmonic source, float32) and the network with its inverse STFT (in the network's dtype up to
    the spectrum); only pasting the cached excitation between them runs eagerly. ``pad``
    alone runs that decomposition eagerly (tests).
    """

    def __init__(self, hift: HiFTGenerator, *, cuda_graphs: bool = False, pad: bool = False, compile: bool = False,
                 max_graphs: int = 64):
        self.hift = hift
        self._excitation: TensorFn | None = None
        self._network: TensorFn | None = None
        # compile: the network goes through torch.compile (one compilation per shape), fusing the
        # element-wise work between the convolutions.
        speech = torch.compile(self._speech, dynamic=False) if compile else self._speech
        if cuda_graphs:
            self._excitation = GraphCache(self._source, max_graphs=max_graphs)
            self._network = GraphCache(speech, max_graphs=max_graphs)
        elif pad or compile:
            self._excitation, self._network = self._source, speech

    def _source(self, mel: torch.Tensor, sine_noise: torch.Tensor) -> tuple[torch.Tensor]:
        hift = self.hift
        phases = torch.zeros(mel.size(0), hift.m_source.num_harmonics, device=mel.device)
        return (hift.compute_source(hift.predict_f0(mel), SourceNoise(phases, sine_noise)),)

    def _speech(self, mel: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.hift.spectrum_to_wave(self.hift.predict_spectrum(mel, source)),)

    @property
    def num_graphs(self) -> int:
        caches = (self._excitation, self._network)
        return sum(c.num_graphs for c in caches if isinstance(c, GraphCache))

    @torch.inference_mode()
    def precapture(self, max_batch: int, frame_counts: Sequence[int]) -> int:
        """Capture the graphs for mels of exactly these frame counts, up to ``max_batch`` rows
        (padded to a power of two); every other shape then runs eagerly. Returns the number of
        graphs. Needs ``cuda_graphs``."""
        if not isinstance(self._network, GraphCache):
            raise InvalidInputError("HiFT precapture needs cuda_graphs")
        hift = self.hift
        device = hift.conv_pre.weight.device
        for rows in _powers_of_two(max_batch):
            for frames in frame_counts:
                samples = frames * hift.hop_length
                mel = torch.zeros(rows, hift.cfg.in_channels, frames, device=device)
                noise = torch.zeros(rows, samples, hift.m_source.num_harmonics, device=device)
                self._excitation.capture(mel, noise)
                self._network.capture(mel, torch.zeros(rows, 1, samples, device=device, dtype=hift.source_dtype))
        self._excitation.capture_after = self._network.capture_after = None
        return self.num_graphs

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, cache_source: torch.Tensor | None,
                 sine_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hift = self.hift
        if self._network is None:
            return hift.inference(mel, cache_source, sine_noise=sine_noise)
        batch, rows = mel.size(0), _next_power_of_two(mel.size(0))
        device = hift.conv_pre.weight.device
        mel = _pad_rows(mel.to(device, torch.float32), rows)  # float32: the F0 reads it; the network casts
        (source,) = self._excitation(mel, _pad_rows(sine_noise.to(device, torch.float32), rows))
        if cache_source is not None and cache_source.shape[-1] > 0:
            source[:batch, :, :cache_source.shape[-1]] = cache_source.to(source.device, source.dtype)
        (speech,) = self._network(mel, source)
        return speech[:batch], source[:batch]


class CausalHiftGraphs:
    """CosyVoice3's causal HiFT: its two convolution stacks, the F0 predictor and the network up to
    its spectrum (:class:`~cosyserve.models.cosyvoice3.hift.HiftNetwork`), replayed from CUDA graphs.
    Why: eager, a batch's call is several hundred small kernels that the loop's thread launches one by
    one, holding the GIL that the LLM's thread needs between its decode steps (and blocking in the
    driver, GIL held, once the launch queue is full); a replay is one launch, with the GIL released.

    :func:`~cosyserve.models.cosyvoice3.hift.push_streams` pads every call to a row and a frame bucket,
    so :meth:`precapture` captures every shape a serving batch meets (``batched_shapes``); any other
    (a window past the widest bucket) runs eagerly. The F0 predictor is always given each row's first
    frame (zeros for whole rows: the same values), so one graph serves both kinds of call. The graphs
    share one memory pool: only the loop's thread vocodes."""

    def __init__(self, hift: CausalHiFTGenerator):
        self.hift = hift
        pool = torch.cuda.graph_pool_handle()
        self._f0 = GraphCache(lambda mel, starts: (hift.predict_f0(mel, False, starts),),
                              capture_after=None, pool=pool)
        self._network = {final: GraphCache(lambda mel, spec, final=final: (hift.spectrum_from(mel, spec, final),),
                                           capture_after=None, pool=pool) for final in (False, True)}

    @property
    def num_graphs(self) -> int:
        return self._f0.num_graphs + sum(cache.num_graphs for cache in self._network.values())

    def predict_f0(self, mel: torch.Tensor, finalize: bool, starts: torch.Tensor | None = None) -> torch.Tensor:
        if finalize:  # push_streams pads a finished stream's look-ahead itself and never asks this
            return self.hift.predict_f0(mel, finalize, starts)
        if starts is None:
            starts = torch.zeros(mel.shape[0], dtype=torch.long, device=mel.device)
        return self._f0(mel, starts)[0]

    def spectrum_from(self, mel: torch.Tensor, source_spec: torch.Tensor, finalize: bool) -> torch.Tensor:
        return self._network[finalize](mel, source_spec)[0]

    @torch.inference_mode()
    def precapture(self, max_rows: int, max_frames: int = WARM_UP_FRAMES) -> int:
        """Capture the graphs of every ``batched_shapes(max_rows, max_frames)`` call; returns their number."""
        hift = self.hift
        device, channels = hift.conv_pre.weight.device, hift.cfg.in_channels
        spectrum_channels = hift.cfg.istft_n_fft + 2
        for rows, width in batched_shapes(max_rows, max_frames):
            mel = torch.zeros(rows, channels, width, device=device)
            self._f0.capture(mel, torch.zeros(rows, dtype=torch.long, device=device))
            for final, cache in self._network.items():
                cache.capture(mel, torch.zeros(rows, spectrum_channels, hift.spectrum_columns(width, final),
                                               device=device))
        return self.num_graphs
