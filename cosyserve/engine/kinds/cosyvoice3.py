"""CosyVoice3's token2wav as a kind of the engine: the DiT flow's windows packed per Euler step
(:class:`~cosyserve.token2wav.cosyvoice3_packed.PackedWindowSampler`) and the causal HiFT.

A stream's chunk is, by ``incremental``:

* ``True`` (default): a window job, the frames after the stream's committed 50-frame blocks
  (:meth:`~cosyserve.models.cosyvoice3.flow.Cv3FlowStream.push`'s computation, its state committed
  after the job's last step). Streams of one voice start after the voice's prefix (its prompt-only
  blocks), kept for the last ``max_voices`` voices: computed at :meth:`CosyVoice3Kind.prepare_voices`,
  or taken from the first window of a voice's first stream (those frames do not depend on the
  target tokens), so a new voice costs no extra pass and never holds up the loop. With
  ``prepare_beside``, a new voice's prefix is computed as its request arrives, on the core's
  preparation thread, by a sampler of its own on a CUDA stream of its own (:data:`PREFIX_ROLE`), and
  its first stream starts after it as later ones do: the loop's steps never carry a whole prompt;
* ``False``: the reference's re-run, a full-attention pass over prompt + every token so far whose
  frames already sent are dropped (the reference Triton runtime's flow).

An offline request is one full-attention pass over prompt + all tokens. Every job takes one Euler
step per :meth:`CosyVoice3Kind.step`, packed with every other job (windows and passes at any step).
Each stream vocodes its new frames with its :class:`~cosyserve.models.cosyvoice3.hift.CausalHiftStream`
(960 samples per token that left the look-ahead), the batch's streams in one call whose convolution
stacks replay CUDA graphs (with ``cuda_graphs``: :class:`~cosyserve.token2wav.graphs.CausalHiftGraphs`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import InvalidInputError
from ...frontend.prompt import PromptFeatures
from ...lru import LruCache
from ...models.cosyvoice3.dit import WindowState
from ...models.cosyvoice3.flow import CosyVoice3Flow, Cv3VoicePrefix, load_cosyvoice3_flow
from ...models.cosyvoice3.hift import (CausalHiFTGenerator, CausalHiftStream, HiftNetwork, load_causal_hift,
                                       push_streams, warm_up_shapes)
from ...models.flow.cfm import N_TIMESTEPS, NOISE_FRAMES, fixed_noise
from ...runtime import host_to_device, role_stream
from ...schedule import OUTPUT_SAMPLE_RATE, ChunkScheduler
from ...speech_tokens import speech_token_ids
from ...token2wav.cosyvoice3_packed import (EMPTY_STATE, ConditionRow, PackedWindowSampler, WindowJob,
                                            token_conditions, warm_up_conditions)
from ...token2wav.graphs import CausalHiftGraphs
from ..device import synchronize
from ..scheduler import DEFAULT_MAX_BATCH_JOBS


DEFAULT_VOICE_PREFIXES = 8  # voices whose prompt-only flow states are kept (~360 MB each, bfloat16, a 5 s prompt)
RESERVE_TOKENS = 750  # a new incremental stream needs room for this long a reply's state (30 s)
# The stream role (runtime.role_stream) of voices' prefixes computed beside the loop: their sampler's
# graphs are captured on it and their steps run on it.
PREFIX_ROLE = "cosyvoice3-prefix"
# Euler steps of voices' prefixes queued on the device at most, beside the loop: the next is launched
# once the one this many before it has run. With a burst's ten packed steps queued at once (~9,000
# kernels), the other threads' launches wait until that queue drains (CosyVoice2's prompts, whose limit
# this is: token2wav.flow_engine.PREFIX_STEPS_AHEAD).
PREFIX_STEPS_AHEAD = 2


@dataclass(eq=False)
class _KeptPrefix:
    """A voice's kept prefix and, when it was computed beside the loop on a GPU, the event after
    which the device has it (a stream's CUDA stream waits for it before reading it)."""

    prefix: Cv3VoicePrefix
    ready: torch.cuda.Event | None = None


@dataclass(eq=False)
class Cv3Prompt:
    """A voice's prompt on the device: tokens (1, P) (and on the host, to prefix a chunk's tokens),
    mel (1, 2P, 80), speaker vector (1, 80), the frames of its shareable prefix and its key."""

    host_tokens: torch.Tensor
    tokens: torch.Tensor
    feat: torch.Tensor
    spks: torch.Tensor
    prefix_frames: int
    key: str  # PromptFeatures.key(); empty when no voice is kept

    @property
    def frames(self) -> int:
        return self.feat.shape[1]


@dataclass(eq=False)
class _Window:
    """A chunk's (or offline request's) window before its conditions exist: frames [start, end) of
    prompt + ``tokens`` of the stream ``voicing`` (None: offline), the first ``skip`` not returned."""

    voicing: "Cv3Voicing | None"
    prompt: Cv3Prompt
    tokens: list[int]
    finalize: bool
    start: int
    skip: int
    end: int
    commit: int = 0  # frames the stream commits after the last step
    offer: int = 0  # frames offered as the voice's prefix after the last step
    full: bool = False  # a full-attention pass from frame 0 (re-run, offline), not a window


@dataclass(eq=False)
class Cv3Job:
    """One chunk's (or offline request's) flow work; ``window`` None: it adds no frame (done at once)."""

    finalize: bool
    window: WindowJob | None
    skip: int = 0  # leading window frames not returned (sent before, or the prompt's)
    voicing: "Cv3Voicing | None" = None
    commit: int = 0  # window frames the stream commits after the last step
    offer: int = 0  # window frames offered as the voice's prefix after the last step

    @property
    def done(self) -> bool:
        return self.window is None or self.window.done

    @property
    def frames(self) -> int:
        """Estimator frames it adds to a batch."""
        return 0 if self.window is None else self.window.width


@dataclass(eq=False)
class Cv3Voicing:
    """A stream's token2wav state: its committed flow state, what it has received and sent, its vocoder."""

    kind: "CosyVoice3Kind" = field(repr=False)
    prompt: Cv3Prompt
    vocoder: CausalHiftStream
    incremental: bool = True  # its chunks are windows (else the reference's re-run passes)
    state: WindowState = EMPTY_STATE  # incremental: committed frames, prompt included
    emitted: int = 0  # incremental: frames returned so far, prompt included
    sent: int = 0  # re-run: target frames returned so far
    received: int = 0  # target tokens received (checked) so far
    finished: bool = False
    job: Cv3Job | None = None
    closed: bool = False

    def close(self) -> None:
        self.kind._close(self)


class CosyVoice3Kind:
    """Over a CosyVoice3 flow (in ``dtype`` on ``device``) and causal HiFT (float32, F0 in float64).
    ``cuda_graphs`` / ``padded``: the sampler's (:class:`PackedWindowSampler`, ``sampler_options``:
    its buckets and budgets). ``max_voices``: voices whose prefix is kept (real size, a 5 s prompt's
    holds ~360 MB in bfloat16). ``prepare_beside``: new voices' prefixes computed beside the loop
    (see the module docstring; incremental streams only)."""

    name = "cosyvoice3"
    final_full_pass = False  # a final chunk is one more window (offline requests are passes)
    sample_rate = OUTPUT_SAMPLE_RATE

    def __init__(self, flow: CosyVoice3Flow, hift: CausalHiFTGenerator, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, *, incremental: bool = True,
                 max_voices: int = DEFAULT_VOICE_PREFIXES, cuda_graphs: bool = False, padded: bool = False,
                 free_memory: Callable[[], int] | None = None, prepare_beside: bool = False,
                 **sampler_options) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.flow = flow.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.hift = hift.to(device=self.device).eval().requires_grad_(False)
        # the vocoder's convolution stacks from CUDA graphs (captured at warm-up), else eager
        self.vocoder_graphs = (CausalHiftGraphs(self.hift) if cuda_graphs and self.device.type == "cuda"
                               else None)
        self.cfg = self.flow.cfg
        self.sampler = PackedWindowSampler(self.flow.decoder, padded=padded, cuda_graphs=cuda_graphs,
                                           **sampler_options)
        self.incremental = incremental
        self.max_voices = max_voices if incremental else 0
        self._prefixes: LruCache[str, _KeptPrefix] = LruCache(self.max_voices)
        # Beside the loop (the core's preparation thread): a new voice's prefix as its request arrives.
        # Else on the loop, behind its batch, and a new voice's first stream offers it (cold start).
        self.prepares_beside = prepare_beside and self.max_voices > 0
        self.cold_start = not self.prepares_beside
        # the prefixes' own sampler (prompt-only windows: no committed frames), so that they share no
        # buffer or graph with the loop's steps, and their CUDA stream
        self._prefix_sampler = (PackedWindowSampler(self.flow.decoder, padded=padded, cuda_graphs=cuda_graphs,
                                                    role=PREFIX_ROLE, **{**sampler_options, "past_buckets": (0,)})
                                if self.prepares_beside else self.sampler)
        self._prefix_stream = (role_stream(self.device, PREFIX_ROLE)
                               if self.prepares_beside and self.device.type == "cuda" else None)
        self._launching: set[str] = set()  # voices whose prefix the preparation thread is launching
        self._launching_lock = threading.Lock()
        self._open = 0
        # An incremental stream keeps every committed frame's keys/values for all Euler steps (~1.8 MB
        # a frame in bfloat16 at real size) and grows with its reply: one opens only while the device
        # has room for a 30 s one; past that a stream re-runs its chunks (the reference's computation,
        # no state kept) rather than failing the GPU.
        cfg = self.cfg.estimator
        self.stream_reserve_bytes = (N_TIMESTEPS * cfg.depth * 2 * 2 * cfg.heads * cfg.dim_head * dtype.itemsize
                                     * self.cfg.token_mel_ratio * RESERVE_TOKENS)
        self.free_memory = free_memory or (lambda: _free_device_memory(self.device))
        self.fallbacks = 0  # streams that re-ran their chunks for want of memory

    @property
    def open_streams(self) -> int:
        """Voicings opened and not closed."""
        return self._open

    @property
    def cached_voices(self) -> int:
        return len(self._prefixes)

    def chunk_schedule(self, strategy: str) -> ChunkScheduler:
        return ChunkScheduler(strategy)

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The kind's state as gauges (``cosyserve_token2wav_<name>``): name -> (help, value)."""
        return {"open_streams": ("streams holding flow state in the engine", self.open_streams),
                "voices_cached": ("voices whose prompt-only flow states are kept", self.cached_voices),
                "voice_prefix_hits": ("streams that started after their voice's kept prefix", self.prefix_hits),
                "voice_prefix_misses": ("streams whose voice had no kept prefix", self.prefix_misses),
                "rerun_fallbacks": ("streams that re-ran their chunks because the device had no room for "
                                    "their flow state", self.fallbacks),
                "window_graphs": ("packed window shapes captured as CUDA graphs (the voices' prefixes' sampler "
                                  "included)", self.sampler.num_graphs
                                  + (self._prefix_sampler.num_graphs if self.prepares_beside else 0)),
                "vocoder_graphs": ("the vocoder's batched shapes captured as CUDA graphs",
                                   self.vocoder_graphs.num_graphs if self.vocoder_graphs is not None else 0),
                "window_calls": ("packed estimator calls (one Euler step of their jobs)", self.sampler.calls),
                "window_eager_calls": ("packed estimator calls outside every graphed shape", self.sampler.eager_calls)}

    def check_tokens(self, tokens) -> None:
        """InvalidInputError unless every id is a speech token 0..vocab-1 (host only, no device work)."""
        speech_token_ids(tokens, self.cfg.vocab_size)

    # ----- voices and streams -----

    def _prompt(self, features: PromptFeatures) -> Cv3Prompt:
        tokens = features.speech_tokens.reshape(1, -1).long()
        feat = features.speech_feat.reshape(1, -1, features.speech_feat.shape[-1])
        if feat.shape[2] != self.cfg.output_size or feat.shape[1] != self.cfg.token_mel_ratio * tokens.shape[1]:
            raise InvalidInputError(f"prompt_feat must be ({self.cfg.token_mel_ratio}·prompt tokens, "
                                    f"{self.cfg.output_size}); got {tuple(feat.shape[1:])} for "
                                    f"{tokens.shape[1]} tokens")
        self.check_tokens(tokens[0].tolist())
        spks = self.flow.speaker_vector(host_to_device(features.embedding.reshape(1, -1), self.device).to(self.dtype))
        key = features.key() if self.max_voices else ""
        return Cv3Prompt(tokens, host_to_device(tokens, self.device), host_to_device(feat, self.device).to(self.dtype),
                         spks, self.flow.voice_prefix_frames(tokens.shape[1]), key)

    def cold_frames(self, features: PromptFeatures) -> int:
        """The prompt's shareable frames when its voice's prefix is not kept: a stream opened now
        starts at frame 0, its first window the whole prompt and its first tokens (kept, it starts
        after the prefix, and the rest of the prompt is under a block of 50 frames)."""
        if self.max_voices and self._prefixes.peek(features.key()) is not None:
            return 0
        return self.flow.voice_prefix_frames(features.speech_tokens.numel())

    @torch.inference_mode()
    def open(self, features: PromptFeatures) -> Cv3Voicing:
        """A stream's state, after its voice's kept prefix when there is one."""
        prompt = self._prompt(features)
        incremental = self.incremental and self.free_memory() >= self.stream_reserve_bytes
        self.fallbacks += self.incremental and not incremental
        voicing = Cv3Voicing(self, prompt, CausalHiftStream(self.hift), emitted=prompt.frames, incremental=incremental)
        kept = self._prefixes.get(prompt.key) if incremental and self.max_voices else None
        if kept is not None:
            voicing.state = kept.prefix.state
            if kept.ready is not None:  # computed on the prefixes' stream: this stream reads it after that
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(kept.ready)
                for tensor in (voicing.state.kv, voicing.state.conv_context):
                    tensor.record_stream(stream)  # its memory is not reused while this stream may read it
        self._open += 1
        return voicing

    def voice_prefix(self, features: PromptFeatures) -> Cv3VoicePrefix | None:
        """The kept prefix of a voice, None if none is kept (its recency and the hit counts unchanged)."""
        kept = self._prefixes.peek(self._prompt(features).key) if self.max_voices else None
        return None if kept is None else kept.prefix

    def keeps(self, features: PromptFeatures) -> bool:
        return self.max_voices > 0 and self._prefixes.peek(features.key()) is not None

    def launching(self, features: PromptFeatures) -> bool:
        """The preparation thread is launching this voice's prefix: a stream opened now would start cold
        (the core plans its first chunk once the launch is done)."""
        with self._launching_lock:
            return features.key() in self._launching

    def solvable(self, job) -> bool:
        """Always: a stream opens only once its voice's launch is done (:meth:`launching`)."""
        return True

    def wait_prepared(self, voices: list[PromptFeatures]) -> None:
        """Until the device has computed these voices' prefixes (computed beside the loop)."""
        for features in voices:
            kept = self._prefixes.peek(features.key())
            if kept is not None and kept.ready is not None:
                kept.ready.synchronize()

    @property
    def prefix_hits(self) -> int:
        return self._prefixes.hits

    @property
    def prefix_misses(self) -> int:
        return self._prefixes.misses

    def _close(self, voicing: Cv3Voicing) -> None:
        if voicing.closed:
            return
        if voicing.job is not None:
            self.abort([voicing.job])
        voicing.closed = voicing.finished = True
        voicing.state = EMPTY_STATE
        self._open -= 1

    @torch.inference_mode()
    def prepare_voices(self, voices: list[PromptFeatures]) -> None:
        """Compute and keep the prefixes of the voices not kept yet, their Euler steps packed together:
        with :attr:`prepares_beside`, launched on the prefixes' stream (any thread, beside the loop),
        else in the caller's stream order (the loop's)."""
        if not self.max_voices:
            return
        prompts: dict[str, Cv3Prompt] = {}
        with self._on_prefix_stream():
            for features in voices:
                key = features.key()
                if key not in prompts and key not in self._prefixes:  # a kept voice costs no copy to the device
                    prompts[key] = self._prompt(features)  # a bad voice raises here, before any launch
            prompts = {key: prompt for key, prompt in prompts.items() if prompt.prefix_frames}
            with self._launching_lock:
                self._launching.update(prompts)
            try:
                rows = [ConditionRow(prompt.host_tokens[0], 0, False, prompt.feat) for prompt in prompts.values()]
                jobs = []
                for prompt, (mu, cond) in zip(prompts.values(), token_conditions(self.flow, rows, self.device)
                                              if rows else []):
                    frames = prompt.prefix_frames
                    jobs.append(self._prefix_sampler.new_job(EMPTY_STATE, self._noise(0, frames), mu[:, :, :frames],
                                                             cond[:, :, :frames], prompt.spks, keep=frames))
                launched: list[torch.cuda.Event] = []  # (beside the loop, on a GPU) the steps on the device
                while any(not job.done for job in jobs):
                    if len(launched) == PREFIX_STEPS_AHEAD:
                        launched.pop(0).synchronize()
                    self._prefix_sampler.step([job for job in jobs if not job.done])
                    if self._prefix_stream is not None:
                        launched.append(self._prefix_stream.record_event())
                states = [job.state_after(prompt.prefix_frames) for job, prompt in zip(jobs, prompts.values())]
                ready = self._prefix_stream.record_event() if self._prefix_stream is not None else None
                for key, state in zip(prompts, states):
                    self._prefixes.put(key, _KeptPrefix(Cv3VoicePrefix(state), ready))
            finally:
                with self._launching_lock:
                    self._launching.difference_update(prompts)

    def _on_prefix_stream(self):
        """Work of the voices' prefixes on their own CUDA stream (beside the loop, on a GPU). It waits for
        no other stream: a voice's features are host tensors, copied in its order, and the prefixes'
        memory is allocated on it (a stream that reads a prefix keeps it from reuse: :meth:`open`)."""
        return torch.cuda.stream(self._prefix_stream) if self._prefix_stream is not None else contextlib.nullcontext()

    def warm_up(self, features: PromptFeatures, tokens: int = 120) -> None:
        """Capture the sampler's graphs (CUDA graphs on) and run every stage once: a stream of
        ``tokens`` tokens through its chunk schedule, and an offline request (at load)."""
        if self.sampler.cuda_graphs:
            self.sampler.capture_all()
            if self.prepares_beside:
                self._prefix_sampler.capture_all()
        if self.vocoder_graphs is not None:  # up to the most chunk jobs a batch takes by default (vocoded together)
            self.vocoder_graphs.precapture(DEFAULT_MAX_BATCH_JOBS)
        if self.device.type == "cuda":  # cuDNN's plans of the conditions' padded shapes
            with torch.inference_mode():
                warm_up_conditions(self.flow, self._prompt(features).feat, self.device)
        ids = [0] * tokens
        voicing, schedule = self.open(features), self.chunk_schedule("exponential")
        try:
            while True:
                chunk = schedule.next_chunk(tokens) or schedule.final_chunk(tokens)
                (job,) = self.start_chunks([(voicing, ids[:chunk.num_tokens], chunk.token_offset, chunk.finalize)])
                self.solve([job])
                self.vocode([(voicing, self.mel(job), chunk.finalize)])
                if chunk.finalize:
                    break
        finally:
            voicing.close()
        if self.device.type == "cuda" and self.vocoder_graphs is None:  # an eager vocoder: cuDNN's plans of
            # its batched shapes (row and frame buckets; the graphs' captures built theirs)
            warm_up_shapes(self.hift, DEFAULT_MAX_BATCH_JOBS)
        job = self.start_offline(features, ids)
        self.solve([job])
        self.vocode([(None, self.mel(job), True)])
        synchronize(self.device)

    def solve(self, jobs: list[Cv3Job]) -> None:
        """Every Euler step of every job (started together), launched."""
        while not all(job.done for job in jobs):
            self.step(jobs)

    # ----- flow jobs -----

    def _noise(self, start: int, end: int) -> torch.Tensor:
        return fixed_noise(end, self.device, self.dtype)[:, :, start:end]

    def start_chunks(self, chunks: list[tuple[Cv3Voicing, list[int], int, bool]]) -> list[Cv3Job]:
        """Flow jobs of streams' chunks: (voicing, tokens so far, tokens already voiced, finalize).
        Every chunk is checked (InvalidInputError) before any starts; on any error no stream changes
        (the core then starts the chunks one by one)."""
        for voicing, tokens, offset, _ in chunks:
            if voicing.closed or voicing.finished or voicing.job is not None:
                raise InvalidInputError("this stream is finished, closed or has a chunk under way")
            if len(tokens) < voicing.received or not 0 <= offset <= len(tokens):
                raise InvalidInputError(f"chunk of {len(tokens)} tokens (offset {offset}) after "
                                        f"{voicing.received} tokens; send all tokens so far, offset within them")
            self.check_tokens(tokens[voicing.received:])
            self._check_length(voicing.prompt, tokens)
        with torch.inference_mode():
            windows = [self._plan_window(v, list(t), f) if v.incremental else self._plan_rerun(v, list(t), f)
                       for v, t, _, f in chunks]
            jobs = self._start_jobs(windows, [f for *_, f in chunks])
        for (voicing, tokens, _, finalize), job in zip(chunks, jobs):
            voicing.received, voicing.finished = len(tokens), finalize
            voicing.job = None if job.done else job
        return jobs

    def _check_length(self, prompt: Cv3Prompt, tokens: list[int]) -> None:
        frames = prompt.frames + self.cfg.token_mel_ratio * len(tokens)
        if frames > NOISE_FRAMES:
            raise InvalidInputError(f"{len(tokens)} speech tokens after the prompt make {frames} mel frames, over "
                                    f"the flow's {NOISE_FRAMES} ({NOISE_FRAMES // 50} s); split the request")

    def _plan_window(self, v: Cv3Voicing, tokens: list[int], finalize: bool) -> _Window | None:
        """Cv3FlowStream.push's window: the frames after the stream's committed state; None: it adds no frame."""
        p, chunk = v.prompt, self.cfg.estimator.static_chunk_size
        lookahead = 0 if finalize else self.cfg.pre_lookahead_len
        total = p.tokens.shape[1] + len(tokens)
        end = self.cfg.token_mel_ratio * (total - lookahead)
        if total <= lookahead or end <= v.emitted:
            return None
        start = v.state.frames
        commit = 0 if finalize else end // chunk * chunk - start  # a final state is never used
        offer = p.prefix_frames if (start == 0 and p.prefix_frames and self.max_voices
                                    and p.key not in self._prefixes) else 0
        return _Window(v, p, tokens, finalize, start, v.emitted - start, end, commit, offer)

    def _plan_rerun(self, v: Cv3Voicing, tokens: list[int], finalize: bool) -> _Window | None:
        """The reference's step: a full-attention pass over every token so far, less the frames sent."""
        if len(tokens) <= (0 if finalize else self.cfg.pre_lookahead_len):
            return None
        end = self.cfg.token_mel_ratio * (v.prompt.tokens.shape[1] + len(tokens)
                                          - (0 if finalize else self.cfg.pre_lookahead_len))
        return _Window(v, v.prompt, tokens, finalize, 0, v.prompt.frames + v.sent, end, full=True)

    def _start_jobs(self, windows: list[_Window | None], finalizes: list[bool]) -> list[Cv3Job]:
        """The planned windows' jobs (None: a job of a chunk that adds no frame), their conditions in one
        call; the streams' counts of frames returned move on only once every job exists."""
        planned = [w for w in windows if w is not None]
        rows = [ConditionRow(torch.cat([w.prompt.host_tokens[0], torch.tensor(w.tokens, dtype=torch.long)]),
                             w.start, w.finalize, w.prompt.feat) for w in planned]
        conditions = iter(token_conditions(self.flow, rows, self.device) if rows else [])
        jobs = []
        for w, finalize in zip(windows, finalizes):
            if w is None:
                jobs.append(Cv3Job(finalize, None))
                continue
            mu, cond = next(conditions)
            sampled = self.sampler.new_job(w.voicing.state if not w.full else EMPTY_STATE, self._noise(w.start, w.end),
                                           mu, cond, w.prompt.spks, keep=max(w.commit, w.offer), full=w.full)
            jobs.append(Cv3Job(w.finalize, sampled, w.skip, w.voicing, w.commit, w.offer))
        for w, job in zip(windows, jobs):
            if w is None or w.voicing is None:
                continue
            if w.full:
                w.voicing.sent = max(w.voicing.sent, job.frames - w.prompt.frames)
            else:
                w.voicing.emitted = w.end
        return jobs

    def start_offline(self, features: PromptFeatures, tokens: list[int]) -> Cv3Job:
        """An offline request's pass: full attention over prompt + all ``tokens``."""
        if not len(tokens):
            raise InvalidInputError("no speech tokens to synthesise")
        self.check_tokens(tokens)
        with torch.inference_mode():
            prompt = self._prompt(features)
            self._check_length(prompt, tokens)
            end = self.cfg.token_mel_ratio * (prompt.tokens.shape[1] + len(tokens))
            return self._start_jobs([_Window(None, prompt, list(tokens), True, 0, prompt.frames, end, full=True)],
                                    [True])[0]

    @torch.inference_mode()
    def step(self, jobs: list[Cv3Job]) -> None:
        """One Euler step of every job under way (the done ones are skipped), packed."""
        live = [job for job in jobs if not job.done]
        if not live:
            return
        self.sampler.step([job.window for job in live])
        for job in live:
            if job.done:
                self._complete(job)

    def _complete(self, job: Cv3Job) -> None:
        """After a window's last step: commit the stream's state, keep the voice's prefix it offers."""
        v, window = job.voicing, job.window
        if v is not None and v.incremental:
            if job.offer:
                self._prefixes.put(v.prompt.key, _KeptPrefix(Cv3VoicePrefix(window.state_after(job.offer))))
            v.state = window.state_after(job.commit)
        window.release()
        if v is not None:
            v.job = None

    def mel(self, job: Cv3Job) -> torch.Tensor:
        """A done job's new mel (1, 80, f) float32."""
        if job.window is None:
            return torch.zeros(1, self.cfg.output_size, 0, device=self.device)
        return job.window.x[:, :, job.skip:].float()

    def abort(self, jobs: list[Cv3Job]) -> None:
        """Release what unfinished jobs hold; their streams cannot go on (their state missed a commit)."""
        for job in jobs:
            if job.window is not None:
                job.window.release()
                job.window = None
            if job.voicing is not None and job.voicing.job is job:
                job.voicing.job = None
                job.voicing.finished = True

    # ----- vocoder -----

    @property
    def _vocoder_network(self) -> HiftNetwork:
        return self.vocoder_graphs if self.vocoder_graphs is not None else self.hift

    @torch.inference_mode()
    def vocode(self, items: list[tuple[Cv3Voicing | None, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """PCM (1-D float32 on the device, launched) of each (stream's voicing, or None for an
        offline request; mel; final chunk), all pushed together (:func:`push_streams`: the F0 and
        excitation in one batched call, the decoder batched over windows of one padded shape). An
        offline request's mel is a fresh vocoder stream's one final push, which equals one call on
        the whole mel and keeps its shapes among the bucketed ones."""
        pushed = push_streams([(voicing.vocoder if voicing is not None else CausalHiftStream(self.hift), mel, final)
                               for voicing, mel, final in items], self._vocoder_network)
        return [samples.detach().to(torch.float32).reshape(-1) for samples in pushed]


def _free_device_memory(device: torch.device) -> int:
    """Bytes the device can still give (free on the device and cached by PyTorch unused); the CPU: no bound."""
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def load_cosyvoice3_kind(model_dir: str | Path, device: torch.device | str = "cpu", *,
                         flow_dtype: torch.dtype | None = None, cuda_graphs: bool | None = None,
                         **options) -> CosyVoice3Kind:
    """``Fun-CosyVoice3-0.5B-2512/`` (cosyvoice3.yaml, flow.pt, hift.pt) -> :class:`CosyVoice3Kind`.
    ``flow_dtype`` None: bfloat16 on CUDA (a plain fp16 DiT gives NaNs), float32 on the CPU;
    ``cuda_graphs`` None: on CUDA; ``options``: the kind's."""
    device = torch.device(device)
    dtype = flow_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    flow = load_cosyvoice3_flow(model_dir, device, dtype)
    hift = load_causal_hift(model_dir, device)
    graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    return CosyVoice3Kind(flow, hift, device, dtype, cuda_graphs=graphs, **options)
