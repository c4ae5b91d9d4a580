"""The incremental, batched streaming flow of CosyVoice2: many streams' chunks in one packed step.

The reference re-runs the flow over prompt + all tokens on every streaming chunk and drops the
frames voiced before. Under streaming masks the flow is chunk-causal, which makes most of that
work repeat itself exactly:

* encoder: attention is block-causal over 25-token blocks counted from the first prompt token
  (50-frame blocks after up-sampling); the pre-lookahead conv ties token i to tokens i+1..i+3,
  which a non-final chunk always has (its look-ahead tokens); every other conv is causal;
* estimator: attention is block-causal over 50-frame blocks, convs are causal, and the initial
  noise of frame k is fixed (frame k of the fixed buffer).

So once a block is complete, its outputs (mu, and the ODE state at each Euler step, in both CFG
rows) never change. A block still open does: it is bidirectional inside. A stream therefore keeps
the encoder's keys/values and conv context of its complete token blocks and, per Euler step, the
keys/values of every estimator attention layer and the left input frames of every causal conv of
its complete frame blocks; each chunk computes only its *window* (the open block of the previous
chunk plus the new frames, ~25 extra frames on average) against that cached context. Its output
equals the full re-run with the earlier frames dropped, up to float rounding (the re-run revises
the open block and drops it again, as here).

:class:`FlowEngine` runs the windows of several streams together: the encoder over all windows
as one batch (:func:`~cosyserve.models.flow.packed_encoder.encode_windows`), then all 10 guided
Euler steps of the batch (:meth:`FlowEngine.solve`), each one
:class:`~cosyserve.models.flow.fused.FusedEstimator` step over all streams' rows, every row
attending to its own context (CUDA graphs of the step per shape bucket on a GPU,
:class:`~.step_graphs.EngineGraphs`). The host builds a batch's indices once; its steps are device work only.

State lives in a :class:`~.page_pool.PagePool`: one page holds one estimator block (50 frames) of K/V for
every step, layer and CFG row (114.7 MB in fp16 for the released model). A stream's context is
its voice's pages followed by its own.

A voice's prompt frames depend only on the voice (prompt tokens, prompt mel, speaker embedding,
the fixed noise): the first ``50 * floor((P - 3) / 25)`` frames of a P-token prompt are complete
blocks before any target token arrives. :class:`VoicePrefix` computes them once per voice,
keyed by content, and every stream of that voice starts from them (pages shared, refcounted),
so a first chunk computes its ~36-80 new frames rather than prompt + new frames. A new voice's
prefix is computed as soon as the voice is known (:meth:`FlowEngine.prepare`, from any thread: a
request's voice as it arrives, while the LLM generates its first tokens), on a CUDA stream and in a
work lane of its own (its own step graphs, workspaces and scratch), so that it runs beside the
chunks on the GPU and never holds up the ones queued behind it; a stream of the voice waits for it
on the device only. Such a stream may open before the prefix is done: once its last solve is planned,
a stream's first window is started (its encoder pass runs beside the prompt's steps) and, once the
caller finds it :meth:`~FlowEngine.solvable`, solved, each of its Euler steps waiting for the prompt's
(on the device; on the host only for a step not launched yet) right before its own, so that its
chunk's steps follow the prompt's step by step rather than after all of them.

Every chunk's mel equals the full re-run's (``CosyVoice2Flow.inference`` over prompt + all tokens
so far, streaming masks) up to float rounding; a final chunk through the engine
(``TOKEN2WAV_FINAL=streaming``) equals ``inference(streaming=True, finalize=True)``. The
reference's final chunk, a non-streaming pass over everything, is not incremental and runs
outside the engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..errors import CapacityError, InvalidInputError
from ..frontend.prompt import voice_key
from ..models.flow import CosyVoice2Flow, fixed_noise
from ..models.flow.cache import FrameBuffer, fork_states
from ..models.flow.cfm import N_TIMESTEPS
from ..models.flow.fused import FusedEstimator, context_slots
from ..models.flow.lanes import work_lane
from ..models.flow.packed_encoder import EncoderWindow, encode_windows
from ..runtime import HIGH_PRIORITY, host_to_device, role_stream
from .graphs import FlowCounters
from .page_pool import PageCopy, PagePool
from .prefix_encoder import PrefixEncoder
from .step_graphs import PREFIX_PAIRS, PREFIX_SHAPES, EngineGraphs, StepBuffers

# Voices whose prefix is kept when nothing else limits them (pages are freed earlier under pressure).
DEFAULT_MAX_VOICES = 64
# A voice's prompt runs through the flow in pieces, each ending on a block boundary so that the next
# window starts on one: a first piece of up to PREFIX_FIRST_PIECE_TOKENS (a window of at most 500
# frames without context, in a captured PREFIX_SHAPES shape: a 3-10 s prompt is one solve), then pieces
# of PREFIX_PIECE_TOKENS (windows of at most 250 frames, eager).
PREFIX_FIRST_PIECE_TOKENS = 250
PREFIX_PIECE_TOKENS = 125
# The work lane (models.flow.lanes.work_lane) of new voices' prompts: their workspaces and scratch; as a
# stream role (runtime.role_stream), the stream their graphs are captured and launched on. With
# FlowEngine's ``prefix_priority``, PREFIX_LANE + runtime.HIGH_PRIORITY: a high-priority stream.
PREFIX_LANE = "prefix"
# A first prompt piece's encoder pass is padded to a multiple of this many tokens (PrefixEncoder: one
# CUDA graph per width and rows, captured at load).
PREFIX_TOKEN_BUCKET = 32
# Euler steps of new voices' prompts queued on the device at most: the preparation thread launches
# the next once the one this many before it has run. Why: with all 10 step graphs of 8 prompts queued
# (~6,000 kernels), the other threads' launches blocked until that queue had drained (a trace of 8
# new clips on an H100: the loop's and the LLM's graph launches each waited 35-40 ms).
PREFIX_STEPS_AHEAD = 2
# A stream may open on a voice as soon as its prompt's last solve is planned (its encoder state and
# earlier pieces launched), and its first window start (its encoder pass, beside the prompt's steps on
# the GPU); the window is solved (:meth:`FlowEngine.solvable`) once at most this many of the prompt's
# steps are left to launch: its steps then wait, on the host, for at most as many of the prompt's
# steps to be launched (~3 prompt steps of GPU time) while the steps before run together with the
# prompt's. Why: a new voice's first chunk followed the prompt's whole solve (~36 ms for one voice on
# an H100), its own ten steps only then.
PREFIX_FOLLOW_LEAD = 3
# ... but only for a solve of at most this many prompts; a bigger one's windows are solved once all its
# steps are launched. Why: one prompt leaves the GPU room for a chunk beside it, eight fill it (~110 ms
# of kernels on an H100), and a chunk that follows them held the loop for their last steps with no gain
# (same call, old and new code: one new clip +39.6 -> +31.6 ms, eight +58.9 -> +123.2 ms p95).
PREFIX_FOLLOWED_PROMPTS = 1


@dataclass
class _FlowState:
    """Where an incremental flow stands: encoder state, committed mu, estimator context per step."""

    encoder_states: dict
    mu: FrameBuffer
    conv: torch.Tensor  # (steps, 2 CFG rows, conv width): conv context at frame_commit
    pages: list[int] = field(default_factory=list)  # estimator blocks [0, frame_commit), voice first
    token_commit: int = 0  # tokens (prompt included) in complete encoder blocks
    frame_commit: int = 0  # frames (prompt included) in complete estimator blocks


class StepLaunch:
    """The Euler steps of a prompt solve as the preparation thread launches them, one event each (None
    on the CPU, where a launched step is computed): a stream forked from one of its voices before it
    is done waits for step k (:meth:`event`) before its own step k."""

    def __init__(self, solve_from: int) -> None:
        # steps launched from which a window following them is solved (FlowEngine.solvable)
        self.solve_from = solve_from
        self._launched = threading.Condition()
        self._events: list[torch.cuda.Event | None] = []
        self._error: BaseException | None = None

    @property
    def launched(self) -> int:
        with self._launched:
            return len(self._events)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def add(self, event: torch.cuda.Event | None) -> None:
        with self._launched:
            self._events.append(event)
            self._launched.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._launched:
            self._error = error
            self._launched.notify_all()

    def event(self, step: int) -> torch.cuda.Event | None:
        """Step ``step``'s event, once launched (waits for it, the GIL let go); RuntimeError if the
        launch failed first."""
        with self._launched:
            self._launched.wait_for(lambda: len(self._events) > step or self._error is not None)
            if len(self._events) <= step:
                raise RuntimeError(f"the voice's prompt could not be computed: {self._error}")
            return self._events[step]


@dataclass
class VoicePrefix:
    """A voice's flow state after its prompt alone (read-only; streams fork it)."""

    key: str
    prompt_tokens: torch.Tensor  # (1, P) long, on the device
    prompt_feat: torch.Tensor  # (1, 2P, 80)
    spks: torch.Tensor  # (1, 80) projected speaker vector
    state: _FlowState
    streams: int = 0  # open streams forked from it
    ready: torch.cuda.Event | None = None  # on a GPU: recorded on the prefix stream once it is computed
    # While its prompt's last solve is being launched (kept from then on, ready not yet set): the
    # solve's steps, and (on a GPU) an event recorded before them (its encoder state and earlier pieces).
    launch: StepLaunch | None = None
    encoded: torch.cuda.Event | None = None

    @property
    def frames(self) -> int:
        return self.state.frame_commit


class EngineStream:
    """One request's incremental flow: :meth:`FlowEngine.run` steps it; :meth:`close` frees its pages."""

    def __init__(self, engine: FlowEngine, voice: VoicePrefix) -> None:
        self.engine = engine
        self.voice = voice
        prefix = voice.state
        engine.pool.share(prefix.pages)
        # conv is shared, never written in place (a commit replaces it): the prompt's steps may still write it
        self._state = _FlowState(fork_states(prefix.encoder_states), prefix.mu.fork(), prefix.conv,
                                 list(prefix.pages), prefix.token_commit, prefix.frame_commit)
        # the prompt's steps that the first window waits for, one by one (a voice still being launched)
        self._launch = voice.launch
        # target tokens so far, kept on the CPU: checking that a chunk extends them must not wait on the GPU
        self._target = torch.zeros(1, 0, dtype=torch.long)
        self._prompt_frames = voice.prompt_feat.size(1)
        self._frames_out = self._prompt_frames  # frames (prompt included) returned, or prompt
        self.closed = False

    @property
    def frames_returned(self) -> int:
        """Target mel frames returned so far."""
        return self._frames_out - self._prompt_frames

    @property
    def context_frames(self) -> int:
        """Frames (prompt included) whose estimator state is cached: the next window starts here."""
        return self._state.frame_commit

    @property
    def private_pages(self) -> int:
        return len(self._state.pages) - len(self.voice.state.pages)

    def close(self) -> None:
        """Free the stream's pages and its share of the voice's (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.engine._closed(self, self._state.pages)
        self._state = None


@dataclass
class _Window:
    """One stream's part of a packed run (frames are absolute, prompt included)."""

    stream: EngineStream
    state: _FlowState
    finalize: bool
    frames: int  # frames known after this chunk
    frame_start: int  # first window frame = cached context length
    frame_commit: int  # frames complete after this chunk
    token_commit: int
    mu: torch.Tensor  # (1, 80, frames - frame_start)
    new_pages: list[int]
    x: torch.Tensor  # (1, 80, width): the ODE state: the fixed noise, once solved the mel
    kept: torch.Tensor | None = None  # once solved: (steps, 2 CFG rows, conv width) conv context at frame_commit

    @property
    def width(self) -> int:
        return self.frames - self.frame_start

    @property
    def done(self) -> bool:
        return self.kept is not None


@dataclass
class _Steps:
    """A packed solve as planned (:meth:`FlowEngine._plan_steps`), ready to launch."""

    windows: list[_Window]
    buffers: StepBuffers
    rows: torch.Tensor  # the windows' rows of the call (conditional ones, then unconditional)
    context: PageCopy | None  # the windows' context pages, read into the step's keys/values
    blocks: PageCopy | None  # the pages of the blocks they complete, written from them
    conv: torch.Tensor | None  # (steps, rows, conv width), or None: stacked at each step
    kept: torch.Tensor  # (steps, rows, conv width): the windows' conv context at their commits, once run
    waits: list[StepLaunch]  # prompt solves whose steps the windows' steps follow


class FlowEngine:
    """Incremental streaming flow over packed rows (see the module docstring). Thread-safe.

    ``pool_bytes``: memory of the page pool (allocated at construction), or ``pool_pages`` pages
    of :attr:`page_bytes` each. ``max_voices``: voice
    prefixes kept (least recently used dropped first; under page pressure unused ones go early).
    ``kernels``: the :class:`FusedEstimator` kernels ("auto": Triton on CUDA in fp16/bf16).
    ``cuda_graphs``: replay the step from CUDA graphs (:class:`~.step_graphs.EngineGraphs`; captured at
    construction with ``precapture``, else when a shape is first used). ``counters``: where runs,
    windows and their frames (computed, and with the padding of a captured shape) are counted.
    """

    def __init__(self, flow: CosyVoice2Flow, pool_bytes: int = 0, *, pool_pages: int = 0,
                 max_voices: int = DEFAULT_MAX_VOICES, kernels: str = "auto", n_timesteps: int = N_TIMESTEPS,
                 cuda_graphs: bool = False, precapture: bool = False, counters: FlowCounters | None = None,
                 prefix_priority: bool = False) -> None:
        self.flow = flow
        # new voices' prompts: their lane and stream role (prefix_priority: a stream whose kernels the
        # device runs before the LLM's and the chunks' while both wait: the solve gates those voices'
        # first chunks, the others' work is mostly ahead of need then)
        self.prefix_lane = PREFIX_LANE + HIGH_PRIORITY if prefix_priority else PREFIX_LANE
        weight = flow.spk_embed_affine_layer.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.fused = FusedEstimator(flow.decoder, kernels=kernels)
        self.n_timesteps = n_timesteps
        _, self._dt, self._time_bias = self.fused.schedule(n_timesteps)
        layers = len(self.fused.attention_layers)
        page_frames = flow.cfg.estimator.static_chunk_size
        self.page_bytes = PagePool.page_bytes(n_timesteps, layers, page_frames, 2 * self.fused.inner, self.dtype)
        pages = pool_pages or pool_bytes // self.page_bytes
        if pages < 1:
            raise InvalidInputError(
                f"the token2wav state pool of {pool_bytes} bytes holds no page of {self.page_bytes} bytes")
        self.pool = PagePool(pages, n_timesteps, layers, page_frames, 2 * self.fused.inner, self.device, self.dtype,
                             kernels=self.fused.kernels)
        self.max_voices = max_voices
        self.counters = counters or FlowCounters()
        self.graphs = EngineGraphs(self.fused) if cuda_graphs else None
        self.prefix_graphs = EngineGraphs(self.fused, PREFIX_SHAPES, lane=self.prefix_lane) if cuda_graphs else None
        self.first_pieces = PrefixEncoder(flow, PREFIX_PAIRS, flow.cfg.pre_lookahead_len + PREFIX_FIRST_PIECE_TOKENS,
                                          PREFIX_TOKEN_BUCKET, replay=cuda_graphs, role=self.prefix_lane)
        # new voices' prompts run on a stream of their own, beside the chunks (see prepare), where
        # their graphs were captured (runtime.role_stream)
        self._prefix_stream = role_stream(self.device, self.prefix_lane) if self.device.type == "cuda" else None
        if precapture:
            self.capture_graphs()
        self._voices: OrderedDict[str, VoicePrefix] = OrderedDict()
        # voices, pages, counters: held for bookkeeping only, never across a launch, so that the
        # preparation thread never waits for the chunks' launches (under load those hold it for tens of ms)
        self._lock = threading.RLock()
        self._chunks_lock = threading.Lock()  # one chunk run (start, solve, finish) at a time: the chunks' buffers
        self._prepare_lock = threading.Lock()  # one preparation at a time (the prefix lane's buffers)
        self._preparing: dict[str, threading.Event] = {}  # keys being prepared, set once launched
        self._consumers: set[torch.cuda.Stream] = set()  # CUDA streams that ran voices' streams
        self._retired: list[tuple[list[torch.cuda.Event], list[VoicePrefix]]] = []  # dropped, maybe still read
        self.open_streams = 0

    def capture_graphs(self) -> dict[str, tuple[int, float]]:
        """Capture every shape of the chunks' and the prompts' step graphs and of the prompts' first
        encoder pass now (at load: a shape captured while chunks run would stall them). Returns, per
        set, the graphs it holds and the seconds its capture took."""
        timings = {}
        with torch.inference_mode():
            for name, graphs in (("chunks' steps", self.graphs), ("prompts' steps", self.prefix_graphs)):
                if graphs is not None:
                    began = time.perf_counter()
                    graphs.capture_all()
                    timings[name] = (graphs.captured, time.perf_counter() - began)
            began = time.perf_counter()
            with self._on_prefix_stream():
                self.first_pieces.capture_all()
            timings["prompts' first encoder passes"] = (self.first_pieces.captured, time.perf_counter() - began)
        return timings

    # ----- voices and streams -----

    @property
    def cached_voices(self) -> int:
        with self._lock:
            return len(self._voices)

    @property
    def voice_pages(self) -> int:
        """Pages holding cached voices' prompt state; the others in use belong to open streams."""
        with self._lock:
            return sum(len(voice.state.pages) for voice in self._voices.values())

    def open(self, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor,
             key: str | None = None) -> EngineStream:
        """A stream of this voice (prompt_tokens (1, P) long, prompt_feat (1, 2P, 80), embedding
        (1, 192)), starting from the voice's kept prefix. ``key``: the voice's
        :func:`~cosyserve.frontend.prompt.voice_key`, if the caller has it (computing it reads device
        tensors back).

        A voice not kept is computed here and kept; better, :meth:`prepare` computes it as soon as
        the voice is known (a voice being prepared on another thread is waited for until its last
        solve is being launched). The stream's work on the caller's CUDA stream waits, on the device,
        for the prefix's (its first window for each of the prompt's steps still under way)."""
        key = key or voice_key(prompt_tokens, prompt_feat, embedding)
        while True:
            with self._lock:
                voice = self._voices.get(key)
                launching = self._preparing.get(key)
                if voice is not None:
                    self._voices.move_to_end(key)
                    voice.streams += 1
                    self.open_streams += 1
                    self._wait_for(voice)
                    return EngineStream(self, voice)
            if launching is not None:
                launching.wait()
            else:
                self.prepare([(prompt_tokens, prompt_feat, embedding, key)])

    def keeps(self, key: str) -> bool:
        """This voice's prefix is kept (computed, or its last solve being launched)."""
        with self._lock:
            return key in self._voices

    def launching(self, key: str) -> bool:
        """Another thread is computing this voice's prefix (:meth:`prepare`) and has not kept it yet
        (its last solve is not planned): :meth:`open` would wait for it."""
        with self._lock:
            return key in self._preparing

    def solvable(self, window: _Window) -> bool:
        """The window's steps can be launched now without the caller waiting long on the host for a
        prompt solve's launch: its stream follows none, or one with at most :data:`PREFIX_FOLLOW_LEAD`
        steps left to launch (none, for a solve of more than :data:`PREFIX_FOLLOWED_PROMPTS` prompts),
        or one that failed (solving it then raises the failure). A stream opened on a voice still being
        launched starts its first window at once (:meth:`start`: its encoder pass beside the prompt's
        steps); the caller solves it once this says so."""
        launch = window.stream._launch
        return launch is None or launch.failed or launch.launched >= launch.solve_from

    def wait_prepared(self, key: str) -> None:
        """Block the calling thread (not the GIL) until the device has computed the prefix of this
        voice (launched by :meth:`prepare`); at once if it is not kept."""
        with self._lock:
            voice = self._voices.get(key)
        if voice is not None and voice.ready is not None:
            voice.ready.synchronize()

    def _wait_for(self, voice: VoicePrefix) -> None:
        """Make the caller's CUDA stream wait for the voice's prefix (computed on the prefix stream);
        for one still being launched, for what precedes its last solve's steps (the stream's first
        window waits for each of those)."""
        event = voice.ready if voice.ready is not None else voice.encoded
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        self._consumers.add(stream)

    def _prefix_waits_for_consumers(self) -> None:
        """Order the prefix stream's next work after everything the streams' CUDA streams have
        launched so far: pages (and memory) they freed may be reused by it then."""
        if self._prefix_stream is not None:
            for stream in self._consumers:
                self._prefix_stream.wait_stream(stream)

    def prepare(self, voices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]) -> None:
        """Compute and keep the prefixes of the voices not kept yet ((prompt_tokens, prompt_feat,
        embedding, key) as for :meth:`open`): launched, not waited for. The voices' prompts run
        together, each piece of every voice one window of a packed solve (a prompt of up to 10 s is
        one piece), so that several new voices cost about what one does. A bad prompt raises (no
        voice of the call is then kept).

        Any thread may call it while another runs chunks: on a GPU the prompts run on the engine's
        prefix stream, in a work lane of their own (:attr:`prefix_lane`: their own graphs, workspaces
        and scratch), so that a new voice never holds up the chunks queued on the chunks' stream, and
        each stream of the voice waits for it on the device (:meth:`open`). The voices are kept from
        the moment their last solve is planned, before its steps are launched: a stream may open then,
        and its first window start (see :meth:`solvable`)."""
        with self._prepare_lock, torch.inference_mode():
            with self._lock:
                new: dict[str, tuple] = {}
                for prompt_tokens, prompt_feat, embedding, key in voices:
                    if key not in self._voices and key not in new:
                        new[key] = (prompt_tokens, prompt_feat, embedding)
                        self._preparing[key] = threading.Event()
                if not new:
                    return
                self._follow_caller(list(new.values()))
            kept_voices: list[VoicePrefix] = []  # kept so far (a group's, before its last solve's steps)
            try:
                with work_lane(self.prefix_lane), self._on_prefix_stream():
                    prefixes = []
                    for key, (prompt_tokens, prompt_feat, embedding) in new.items():
                        self.flow.check_prompt(prompt_tokens, prompt_feat, embedding, batch=1)
                        prefixes.append(self._empty_prefix(key, prompt_tokens, prompt_feat, embedding))
                    for group in range(0, len(prefixes), PREFIX_PAIRS[-1]):
                        self._compute_prefixes(prefixes[group:group + PREFIX_PAIRS[-1]], kept_voices)
                    ready = self._prefix_stream.record_event() if self._prefix_stream is not None else None
                with self._lock:
                    for voice in prefixes:
                        voice.ready, voice.launch, voice.encoded = ready, None, None
                    self._trim_voices(max(self.max_voices, len(prefixes)))
            except BaseException as exc:
                with self._lock:  # streams opened on these voices fail at the steps they wait for
                    for voice in kept_voices:
                        if voice.launch is not None:
                            voice.launch.fail(exc)
                        if self._voices.get(voice.key) is voice:
                            del self._voices[voice.key]
                            self.pool.release(voice.state.pages)
                raise
            finally:
                with self._lock:
                    for key in new:
                        waiting = self._preparing.pop(key, None)
                        if waiting is not None:
                            waiting.set()

    def _follow_caller(self, inputs: list[tuple]) -> None:
        """Order the prefix stream after the caller's CUDA stream (where the prompts' tensors were
        made, and where streams freed pages) and after the streams' own; keep the prompts' device
        tensors from reuse until the prefix stream has read them."""
        if self._prefix_stream is None:
            return
        self._prefix_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._prefix_waits_for_consumers()
        for tensor in (t for values in inputs for t in values):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(self._prefix_stream)

    def _on_prefix_stream(self):
        return torch.cuda.stream(self._prefix_stream) if self._prefix_stream is not None else contextlib.nullcontext()

    def _empty_prefix(self, key: str, prompt_tokens, prompt_feat, embedding) -> VoicePrefix:
        spks = self.flow.speaker_vector(host_to_device(embedding, self.device).to(self.dtype))
        conv = torch.zeros(self.n_timesteps, 2, self.fused.conv_width, device=self.device, dtype=self.dtype)
        return VoicePrefix(key, host_to_device(prompt_tokens, self.device).long(),
                           host_to_device(prompt_feat, self.device).to(self.dtype), spks,
                           _FlowState({}, FrameBuffer(dim=2), conv))

    def _compute_prefixes(self, voices: list[VoicePrefix], kept_voices: list[VoicePrefix]) -> None:
        """Each voice's prompt alone, as non-final chunks without output: their complete blocks are
        the prefix. The k-th pieces of all voices are one packed solve: the first pieces
        (PREFIX_FIRST_PIECE_TOKENS, no context) through :class:`PrefixEncoder` and the prompts'
        captured step shapes, the later ones
        (PREFIX_PIECE_TOKENS, prompts over 10 s) eagerly (the chunks' graphs belong to their lane).
        The voices are kept (:meth:`_keep`, added to ``kept_voices``) once the last solve is planned and
        committed, before its steps are launched."""
        lookahead = self.flow.cfg.pre_lookahead_len
        streams, pieces = [], []
        with self._lock:
            for voice in voices:
                total = voice.prompt_tokens.size(1)
                streams.append(EngineStream(self, voice))
                pieces.append(list(range(lookahead + PREFIX_FIRST_PIECE_TOKENS, total, PREFIX_PIECE_TOKENS))
                              + [total] if total - lookahead >= self.flow.cfg.encoder.static_chunk_size else [])
        rounds = max(len(ends) for ends in pieces)
        windows: list[_Window] = []
        try:
            for k in range(rounds):
                chunks = [(stream, stream.voice.prompt_tokens[:, :ends[k]], False)
                          for stream, ends in zip(streams, pieces) if k < len(ends)]
                windows = [_complete_blocks(w) for w in self._windows(chunks, self.first_pieces if k == 0 else None)]
                with self._lock:
                    self._prefix_waits_for_consumers()  # its pages may have been freed just now
                solved = [w for w in windows if w.width]  # (a last piece shorter than a block commits nothing)
                plan = self._plan_steps(solved, self.prefix_graphs if k == 0 else None) if solved else None
                for window in solved:
                    self._commit(window, share=True)  # (written by the steps launched below)
                windows = []
                launch = None
                if plan is not None and k == rounds - 1:
                    lead = PREFIX_FOLLOW_LEAD if len(solved) <= PREFIX_FOLLOWED_PROMPTS else 0
                    launch = StepLaunch(self.n_timesteps - lead)
                if k == rounds - 1:
                    kept_voices += self._keep(voices, streams, launch)
                if plan is not None:
                    self._launch_steps(plan, PREFIX_STEPS_AHEAD, launch)
            if not rounds:
                kept_voices += self._keep(voices, streams, None)
        except BaseException:
            if self._prefix_stream is not None:
                self._prefix_stream.synchronize()  # what it launched writes to the pages freed here
            with self._lock:
                for window in windows:
                    self.pool.release(window.new_pages)
                for stream in streams:
                    if stream._state is not None:  # (a kept voice's pages are released with it)
                        self.pool.release(stream._state.pages)
            raise

    def _keep(self, voices: list[VoicePrefix], streams: list[EngineStream], launch: StepLaunch | None) -> list[VoicePrefix]:
        """Keep these voices now, each with its stream's state, and let their :meth:`open` go on: on
        a GPU, streams then wait for what the prefix stream has launched so far (``encoded``) and,
        their first windows, for each step of ``launch`` (the last solve, not launched yet)."""
        encoded = self._prefix_stream.record_event() if self._prefix_stream is not None else None
        with self._lock:
            for voice, stream in zip(voices, streams):
                voice.state, stream._state, stream.closed = stream._state, None, True  # its pages are the voice's
                voice.launch, voice.encoded = launch, encoded
                self._voices[voice.key] = voice
                waiting = self._preparing.pop(voice.key, None)
                if waiting is not None:
                    waiting.set()
        return voices

    def _trim_voices(self, keep: int, free_pages: int = 0) -> int:
        """Drop least recently used voices without open streams down to ``keep`` voices, or (with
        ``free_pages``) until that many pages are free; returns pages freed. A dropped voice costs
        its prompt's flow pass again on its next stream, so under page pressure only as many go
        as the pages asked for need. A voice whose prefix the device has not finished stays (its
        pages are still being written); once one goes, the prefix stream's next work waits for what
        the streams' CUDA streams launched so far (the last reads of its pages and tensors)."""
        freed, dropped = 0, []
        for key in list(self._voices):
            enough = self.pool.free_pages >= free_pages if free_pages else len(self._voices) <= keep
            if enough:
                break
            voice = self._voices[key]
            if (voice.streams == 0 and voice.launch is None and voice.encoded is None
                    and (voice.ready is None or voice.ready.query())):
                del self._voices[key]
                self.pool.release(voice.state.pages)
                freed += len(voice.state.pages)
                dropped.append(voice)
        if dropped and self._prefix_stream is not None:
            self._prefix_waits_for_consumers()  # their pages may be written by it next
            # Their tensors were allocated on the prefix stream, which may reuse that memory at once:
            # they are let go once what the streams' CUDA streams launched so far (their last reads) has run.
            self._retired = [(marks, voices) for marks, voices in self._retired if not all(m.query() for m in marks)]
            self._retired.append(([stream.record_event() for stream in self._consumers], dropped))
        return freed

    def _closed(self, stream: EngineStream, pages: list[int]) -> None:
        with self._lock:
            self.pool.release(pages)
            stream.voice.streams -= 1
            self.open_streams -= 1

    # ----- chunks -----

    def fit(self, chunks: list[tuple[EngineStream, torch.Tensor, bool]]) -> list[bool]:
        """Whether each chunk's new state pages can be had, in order (unused voices are dropped
        first when too few pages are free); chunks as for :meth:`run`. A chunk that does not fit
        must not be run: its stream leaves the engine (:meth:`EngineStream.close` returns its pages)
        and the caller voices it another way (the full re-run, which keeps no state)."""
        page = self.pool.page_frames
        with self._lock:
            needs = []
            for stream, tokens, finalize in chunks:
                if finalize or stream.closed:
                    needs.append(0)  # a final chunk only reads its context; a closed one fails in run
                    continue
                _, frame_commit = self._commits(stream.voice.prompt_tokens.size(1) + tokens.size(1))
                needs.append(max(0, frame_commit - stream.context_frames) // page)
            free = self.pool.free_pages
            if sum(needs) > free:
                self._trim_voices(0, free_pages=sum(needs))
                free = self.pool.free_pages
            fits = []
            for need in needs:
                fits.append(need <= free)
                free -= need if need <= free else 0
            return fits

    def run(self, chunks: list[tuple[EngineStream, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """Step several streams at once: per (stream, target tokens so far (1, n), finalize), the
        float32 mel (1, 80, f) of the frames not returned before.

        A non-final chunk returns frames up to 2(n - 3) (the last 3 tokens are look-ahead), a final
        one up to 2n and closes its stream. A stream that fails (bad tokens, no state pages) is
        closed; an error in the packed run closes every stream of the run.
        """
        windows = self.start(chunks)
        self.solve(windows)
        return [self.finish(w) for w in windows]

    def start(self, chunks: list[tuple[EngineStream, torch.Tensor, bool]]) -> list[_Window]:
        """The chunks' windows (encoder run, state pages taken), ready for :meth:`solve`; chunks as
        for :meth:`run`. Once solved, each is voiced by :meth:`finish`. On an error the chunks'
        streams are closed."""
        with self._chunks_lock, torch.inference_mode():
            try:
                return self._windows([(stream, torch.cat([stream.voice.prompt_tokens,
                                                          self._validated(stream, tokens, finalize)], dim=1),
                                       finalize) for stream, tokens, finalize in chunks])
            except BaseException:
                for stream, _, _ in chunks:
                    stream.close()
                raise

    def solve(self, windows: list[_Window]) -> None:
        """Every guided Euler step of every window (started, none solved yet), each step packed
        into one estimator call; launched, not waited for. An error closes every stream of the call
        (their pages freed)."""
        with self._chunks_lock, torch.inference_mode():
            try:
                self._solve_windows(windows, self.graphs)
            except BaseException:
                self.abort(windows)
                raise

    def finish(self, w: _Window) -> torch.Tensor:
        """A done window's mel (1, 80, f) float32 of the frames not returned before; its complete
        blocks become its stream's context (a final window closes the stream)."""
        with self._chunks_lock:
            stream = w.stream
            mel = w.x[:, :, stream._frames_out - w.frame_start:].to(torch.float32, copy=True)
            self._commit(w)
            stream._frames_out = w.frames
            if w.finalize:
                stream.close()
            return mel

    def abort(self, windows: list[_Window]) -> None:
        """Give up windows not finished: their new pages are freed and their streams closed."""
        with self._lock:
            for w in windows:
                self.pool.release(w.new_pages)
                w.new_pages = []
                w.stream.close()

    def _validated(self, stream: EngineStream, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        flow = self.flow
        if stream.closed:
            raise InvalidInputError("the flow stream is closed (finalized, cancelled or failed)")
        flow.check_ids("tokens_so_far", tokens)
        if tokens.size(0) != 1:
            raise InvalidInputError(f"tokens_so_far must be (1, n), got {tuple(tokens.shape)}")
        flow.check_length(stream.voice.prompt_tokens.size(1), tokens.size(1), finalize)
        tokens = tokens.to("cpu", torch.long)
        seen = stream._target.size(1)
        if tokens.size(1) < seen or not torch.equal(tokens[:, :seen], stream._target):
            raise InvalidInputError(f"tokens_so_far must extend the {seen} tokens of the previous step")
        lookahead = 0 if finalize else flow.cfg.pre_lookahead_len
        frames = stream._prompt_frames + flow.cfg.token_mel_ratio * (tokens.size(1) - lookahead)
        if frames <= stream._frames_out:
            raise InvalidInputError(
                f"{tokens.size(1)} tokens give no frames beyond the {stream.frames_returned} already returned"
                + ("" if finalize else f" (the last {lookahead} tokens are look-ahead only)"))
        stream._target = tokens
        return host_to_device(tokens, self.device)

    def _commits(self, total_tokens: int) -> tuple[int, int]:
        """Tokens and frames (prompt included) in complete encoder and estimator blocks once a
        non-final chunk has ``total_tokens`` (prompt + target so far, look-ahead included)."""
        cfg = self.flow.cfg
        tokens = _floor_to(total_tokens - cfg.pre_lookahead_len, cfg.encoder.static_chunk_size)
        return tokens, _floor_to(cfg.token_mel_ratio * tokens, self.pool.page_frames)

    def _windows(self, chunks: list[tuple[EngineStream, torch.Tensor, bool]],
                 first_pieces: PrefixEncoder | None = None) -> list[_Window]:
        """Run the encoder over the streams' new tokens, all windows at once (``chunks``: stream,
        prompt + target tokens so far (1, n), finalize; or, new voices' first prompt pieces,
        ``first_pieces``' padded pass); plan their estimator windows and pages."""
        flow, cfg = self.flow, self.flow.cfg
        ratio, lookahead = cfg.token_mel_ratio, cfg.pre_lookahead_len
        plans = []
        for stream, tokens, finalize in chunks:
            state = stream._state
            valid_tokens = tokens.size(1) - (0 if finalize else lookahead)
            token_commit, frame_commit = ((state.token_commit, state.frame_commit) if finalize
                                          else self._commits(tokens.size(1)))
            plans.append((stream, state, finalize, valid_tokens, token_commit, frame_commit))
        if first_pieces is not None:
            mus = first_pieces([tokens for _, tokens, _ in chunks],
                               [token_commit for _, _, _, _, token_commit, _ in plans],
                               [state.encoder_states for _, state, _, _, _, _ in plans])
        else:
            encoder_windows = [
                EncoderWindow(flow.input_embedding(tokens[0, state.token_commit:].clamp(min=0)), state.token_commit,
                              token_commit - state.token_commit, 0 if finalize else lookahead, state.encoder_states)
                for (_, tokens, _), (_, state, finalize, _, token_commit, _) in zip(chunks, plans)]
            outputs = encode_windows(flow.encoder, encoder_windows)
            mus = flow.project(torch.cat(outputs)[None]).split([o.size(0) for o in outputs], dim=2)
        mus = FrameBuffer.extend_all([state.mu for _, state, *_ in plans], list(mus),
                                     [ratio * (token_commit - state.token_commit)
                                      for _, state, _, _, token_commit, _ in plans])
        windows = []
        try:
            for (stream, state, finalize, valid_tokens, token_commit, frame_commit), mu in zip(plans, mus):
                frame_start = state.frame_commit
                frames = ratio * valid_tokens
                windows.append(_Window(stream, state, finalize, frames, frame_start, frame_commit,
                                       token_commit, mu[:, :, frame_start:],
                                       self._allocate((frame_commit - frame_start) // self.pool.page_frames),
                                       fixed_noise(frames, self.device, self.dtype)[:, :, frame_start:]))
        except BaseException:
            with self._lock:
                for window in windows:
                    self.pool.release(window.new_pages)
            raise
        return windows

    def _allocate(self, pages: int) -> list[int]:
        """``pages`` free pages, dropping unused voices if need be; CapacityError when there are none."""
        with self._lock:
            allocated = self.pool.allocate(pages)
            if allocated is None:
                freed = self._trim_voices(0, free_pages=pages)
                allocated = self.pool.allocate(pages)
                if allocated is None:
                    raise CapacityError(f"the token2wav state pool is full ({self.pool.pages} pages, {freed} freed "
                                        "from unused voices); retry later")
            return allocated

    def _solve_windows(self, windows: list[_Window], graphs: EngineGraphs | None) -> None:
        """Every guided Euler step of every window (all at step 0), launched: :meth:`_plan_steps`,
        then :meth:`_launch_steps`."""
        self._launch_steps(self._plan_steps(windows, graphs))

    def _plan_steps(self, windows: list[_Window], graphs: EngineGraphs | None) -> _Steps:
        """What the windows' steps share, built once: the step's buffers (replayed from ``graphs``
        where they hold its shape), the rows' layout and mask, the input (later steps update x in
        place), the page and key indices of the windows' context and of the blocks they complete,
        and each window's conv context at its commit per step (``w.kept``, written by the steps)."""
        fused, page = self.fused, self.pool.page_frames
        count, steps = len(windows), self.n_timesteps
        widths = [w.width for w in windows]
        contexts = [w.frame_start for w in windows]
        buffers = graphs.get(count, max(widths), max(contexts)) if graphs is not None else None
        if buffers is None:
            buffers = StepBuffers(fused, count, max(widths), context_slots(max(contexts), max(widths)))
        pairs, frames = buffers.pairs, buffers.frames
        with self._lock:
            counters = self.counters
            counters.calls, counters.rows = counters.calls + 1, counters.rows + count
            counters.frames = counters.frames + sum(widths)
            counters.padded_frames = counters.padded_frames + count * frames
        idle = [0] * (pairs - count)  # padding pairs of a captured shape: no frames, no context
        buffers.set_rows(fused.rows((widths + idle) * 2, (contexts + idle) * 2, frames, streaming=True,
                                    slots=buffers.slots))
        inp = buffers.inp
        inp.zero_()
        for j, w in enumerate(windows):
            voice = w.stream.voice
            cond = self.flow.prompt_condition(voice.prompt_feat, w.frame_start, w.frames)
            fused.fill_input(inp, (j, pairs + j), w.x, w.mu, voice.spks, cond)
        buffers.commit.copy_(host_to_device([w.frame_commit - w.frame_start for w in windows] + idle, self.device,
                                            torch.long).repeat(2))
        # The windows' context pages and the pages they complete, each page's CFG rows at their keys
        # in kv_flat's (row * key_stride + slot) numbering.
        rows = host_to_device(np.concatenate([np.arange(count), np.arange(pairs, pairs + count)]), self.device,
                              torch.long)
        context_pages = [number for w in windows for number in w.state.pages]
        new_pages = [number for w in windows if not w.finalize for number in w.new_pages]
        context_keys = page_key_starts([len(w.state.pages) for w in windows], pairs, buffers.key_stride, 0, page)
        new_keys = page_key_starts([0 if w.finalize else len(w.new_pages) for w in windows], pairs,
                                   buffers.key_stride, buffers.slots, page)
        context = PageCopy(self.pool, context_pages, context_keys, buffers.kv_flat) if context_pages else None
        blocks = PageCopy(self.pool, new_pages, new_keys, buffers.kv_flat) if new_pages else None
        # the prompt solves that streams opened before their end wait for, step by step (first windows)
        waits = list({id(w.stream._launch): w.stream._launch for w in windows if w.stream._launch is not None}.values())
        # conv context of every window at every step, (steps, rows of the call, conv width); stacked
        # per step instead when a prompt's steps may still be writing some of it
        conv = None if waits else torch.stack([w.state.conv for w in windows], dim=2).flatten(1, 2)
        kept = torch.empty(steps, 2, count, fused.conv_width, device=self.device, dtype=self.dtype)
        for j, w in enumerate(windows):
            w.kept = kept[:, :, j]
        return _Steps(windows, buffers, rows, context, blocks, conv, kept.flatten(1, 2), waits)

    def _launch_steps(self, plan: _Steps, steps_ahead: int = 0, launch: StepLaunch | None = None) -> None:
        """The planned steps: each gathers the context at its step from the pages, runs (or replays)
        the fused step and writes the completed blocks back; a few device ops per step, no host work
        per window or page, no host sync. A step first waits for that step of the prompt solves in
        ``plan.waits``. With ``steps_ahead`` (on a GPU) a step is launched once the one that many
        before it has run; ``launch`` is told of each step launched."""
        buffers, windows, rows = plan.buffers, plan.windows, plan.rows
        conv_all = buffers.state.conv_all
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        launched: list[torch.cuda.Event] = []  # (with steps_ahead) the steps on the device
        for step in range(self.n_timesteps):
            for prompt in plan.waits:
                event = prompt.event(step)
                if event is not None:
                    stream.wait_event(event)
            if steps_ahead and len(launched) == steps_ahead:
                launched.pop(0).synchronize()
            if plan.context is not None:
                plan.context.read(step)
            conv = (plan.conv[step] if plan.conv is not None
                    else torch.stack([w.state.conv[step] for w in windows], dim=1).flatten(0, 1))
            conv_all.index_copy_(0, rows, conv)
            x_out = buffers.step(self._time_bias[step], self._dt[step])
            plan.kept[step] = buffers.kept.index_select(0, rows)
            if plan.blocks is not None:
                plan.blocks.write(step)
            event = stream.record_event() if stream is not None and (steps_ahead or launch is not None) else None
            if steps_ahead and event is not None:
                launched.append(event)
            if launch is not None:
                launch.add(event)
        for j, w in enumerate(windows):
            w.x = x_out[j, :w.width].T[None].clone()  # x_out is the shape's workspace
            w.stream._launch = None  # its later windows follow this one on its CUDA stream

    def _commit(self, w: _Window, *, share: bool = False) -> None:
        """A solved (or, ``share``, planned) window's complete blocks and conv context become its
        stream's state. The conv context is replaced, never written in place (streams share their
        voice's): with ``share``, by the call's tensor that the steps write (a prompt piece, committed
        before its steps are launched), else by a copy of its own."""
        if not w.finalize:
            w.state.conv = w.kept if share else w.kept.clone()
        self._take_blocks(w)

    @staticmethod
    def _take_blocks(w: _Window) -> None:
        """The window's complete blocks become the stream's context."""
        w.state.pages += w.new_pages
        w.state.token_commit, w.state.frame_commit = w.token_commit, w.frame_commit


def _complete_blocks(w: _Window) -> _Window:
    """A prompt piece's window cut to the blocks it completes. Only those are kept (each stream's
    first chunk computes the open block again, with its own tokens), and they do not depend on the
    frames after them: attention is block-causal and the convs are causal."""
    keep = w.frame_commit - w.frame_start
    return replace(w, frames=w.frame_commit, mu=w.mu[:, :, :keep], x=w.x[:, :, :keep])


def page_key_starts(pages: list[int], pairs: int, key_stride: int, offset: int, page: int) -> np.ndarray:
    """First keys (in :attr:`StepBuffers.kv_flat`'s ``row * key_stride + slot`` numbering) of
    ``pages[j]`` whole pages per window j, from slot ``offset`` of the window's rows on, (pages, 2):
    page by page (window by window), its conditional row's (row j), then its unconditional row's
    (pairs + j); each page's frames follow its first key."""
    window = np.repeat(np.arange(len(pages)), pages)
    index = np.concatenate([np.arange(n) for n in pages]) if pages else np.zeros(0, dtype=np.int64)
    return np.stack([window, pairs + window], axis=1) * key_stride + offset + index[:, None] * page


def _floor_to(value: int, multiple: int) -> int:
    return value // multiple * multiple
