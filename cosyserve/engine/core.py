"""The engine core: one loop that owns the GPU's token2wav work (flow and vocoder) for every request.

Each iteration (:meth:`EngineCore.step`), read top to bottom:

1. hand out the PCM of earlier batches that has reached the host;
2. take new requests (their LLM request started at submit) and cancellations; end requests past
   their timeout;
3. per request, take the tokens that arrived and plan its next chunk when its chunk schedule
   allows (one chunk in flight per stream: chunks run in order);
4. the :class:`~.scheduler.Scheduler` picks a batch of the waiting chunks (earliest deadline
   first, within a batch's budget); the kind starts them (their encoder, their state pages); a
   first chunk whose voice the preparation thread is still launching waits, started, until the kind
   can solve it (:meth:`~.kinds.protocol.PreparesBeside.solvable`), then joins the first batch that
   starts after it can (the same iteration's, if it became solvable while that batch started);
5. the kind solves the batch: all 10 Euler steps of every chunk, each step one packed call
   (:meth:`solve`), then vocodes it in one batched call; the PCM is copied to the host
   asynchronously;
6. the kind computes the state of the voices to keep, all of them together, launched behind the
   batch (uploaded voices; a new request's voice if the kind cannot start a stream without it, else
   only when the voice comes again: a clip used once then costs no pass of its own). A kind that
   computes voices beside the loop (:attr:`~.kinds.protocol.Kind.prepares_beside`) gets them from
   a :class:`~.preparer.VoicePreparer` thread instead, a request's voice as it is submitted (its
   state is then computed while the LLM generates the request's first tokens).

Nothing in an iteration waits for the GPU: the host plans and launches the next batch while the
GPU runs the last one, and a batch's PCM goes to the requests' ``emit`` once its copy is done (at
most :data:`MAX_BATCHES_IN_FLIGHT` batches are launched and not yet handed out). Finished segments
hand over to the next, finished requests call ``finish``.

Speech tokens come from an LLM that runs beside the loop (:mod:`.runners.llm`: our LLM engine on a
thread and a CUDA stream of its own, or an external back end): the loop only drains each request's
token stream, so the LLM's pace is its own, never one decode step per loop iteration.

Requests come from any thread (:meth:`submit`, :meth:`cancel`); everything else happens on the
loop's thread, which is also where ``emit`` and ``finish`` are called (keep them quick: hand the
data to another thread). In a server the core runs in a process of its own (:mod:`.process`), fed
by the front doors over IPC.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidInputError, RequestCancelledError, RequestTimeoutError
from ..llm.prompt import NUM_SPEECH_TOKENS
from ..lru import LruCache
from ..speech_tokens import speech_token_ids
from .device import HostCopy, make_current, synchronize
from .kinds.protocol import Kind, PreparesBeside
from .preparer import VoicePreparer, call_each
from .request import EngineRequest, RequestState, SegmentState
from .scheduler import Candidate, Scheduler
from .wire import EngineStats

log = logging.getLogger(__name__)

# How long an idle loop with requests waits for their LLM's tokens before looking again (seconds).
TOKEN_POLL_S = 0.001
# The interpreter's thread switch interval while a loop runs (seconds; Python's default is 5 ms). The
# loop and the LLM's thread share the GIL, and a thread back from a blocking call (a CUDA sync)
# waits up to this long for the other to let go of it: at 5 ms, each decode step or Euler step
# could stall behind the other thread's Python.
SWITCH_INTERVAL_S = 0.0005
# Voices (keys) of requests seen lately: with a cold-starting kind, a voice is kept when it comes again.
SEEN_VOICES = 1024
# Batches launched whose PCM is not handed out yet: the loop launches a batch while the GPU runs
# the one before; a third waits for the oldest (a chunk that arrives meanwhile is not queued behind
# more than one batch).
MAX_BATCHES_IN_FLIGHT = 2


@dataclass
class EngineCounters:
    """Running totals of the loop's time per stage (wall clock on the loop thread: launching the
    GPU's work, not running it; with ``sync_stages`` each stage waits for its GPU work, so the
    split is the GPU's too)."""

    iterations: int = 0
    start_s: float = 0.0  # encoder and planning of chunks that start
    voice_s: float = 0.0  # kept voices' state (their prompts' flow) launched, behind a batch or beside the loop
    flow_s: float = 0.0  # batches' Euler steps
    vocoder_s: float = 0.0  # HiFT and the PCM's copy to the host
    host_s: float = 0.0  # the rest of a busy iteration: requests, tokens, scheduling, emitting PCM
    idle_s: float = 0.0  # waiting for work, or for the GPU when nothing else is left
    flow_batches: int = 0
    flow_batch_jobs: int = 0  # jobs solved, summed over batches
    chunks: int = 0  # chunk (or offline) jobs finished
    tokens: int = 0  # speech tokens received from the LLM
    requests_finished: int = 0
    requests_failed: int = 0


class EngineCore:
    """One per GPU: ``kind`` (the token2wav kind, :class:`~.kinds.protocol.Kind`:
    :class:`~.kinds.cosyvoice2.CosyVoice2Kind` and the others),
    ``llm`` (:class:`~.runners.llm.FreeRunningLLM` or :class:`~.runners.llm.BackendLLM`), the chunk
    ``strategy`` of the kind's schedule, and the ``scheduler``."""

    def __init__(self, kind: Kind, llm, *, strategy: str = "exponential", scheduler: Scheduler | None = None,
                 sync_stages: bool = False) -> None:
        kind.chunk_schedule(strategy)  # an unknown strategy fails here, not per request
        self.kind = kind
        self.llm = llm
        self.strategy = strategy
        self.scheduler = scheduler or Scheduler()
        self.sync_stages = sync_stages
        self.counters = EngineCounters()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[RequestState] = []
        self._starting: set[str] = set()  # request ids in submit, their LLM request starting
        self._cancels: list[tuple[str, BaseException]] = []
        self._voices_inbox: list = []  # voices to prepare (prepare_voices), with the new requests'
        self._voices_done: list = []  # prepare_voices' callbacks, called once the inbox's voices are prepared
        self._seen_voices: LruCache[str, bool] = LruCache(SEEN_VOICES)  # with kind.cold_start
        # a kind that prepares voices beside the loop (PreparesBeside), on the preparation thread
        self._beside: PreparesBeside | None = kind if kind.prepares_beside else None
        self._preparer = (VoicePreparer(self._prepare_voices, kind.wait_prepared, key=_voice_key) if self._beside
                          else None)
        self._states: dict[str, RequestState] = {}  # admitted, not ended; guarded by _lock
        self._in_flight: deque[_Batch] = deque()  # launched, PCM not handed out (loop thread)
        # started, not solvable yet (a first chunk whose voice the preparation thread is still launching:
        # its encoder ran beside that launch); solved in a later iteration (loop thread)
        self._parked: list[tuple[SegmentState, RequestState]] = []
        self._thread: threading.Thread | None = None
        self._closing = False

    # ----- any thread -----

    def submit(self, request: EngineRequest) -> None:
        """Admit ``request`` (CapacityError: refused now), start its first segment's LLM request
        here (not at the loop's next iteration, which may be a batch away) and queue it for the loop.
        An error of the segment (its text, its prompt) ends the request from the loop, as any error."""
        request_id = request.request_id
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closed")
            if request_id in self._states or request_id in self._starting:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            self.scheduler.admit(request.streaming, self._states.values())
            self._starting.add(request_id)
        request.stamp("received")
        state = RequestState(request)
        try:
            self._next_segment(state)
        except Exception as exc:
            state.start_error = exc
        if self._preparer is not None and state.start_error is None and request.streaming:
            self._preparer.put([features for features in self._voices_to_keep([request.voice.features])
                                if not (self._beside.keeps(features) or self._beside.launching(features))])
        with self._lock:
            self._starting.discard(request_id)
            if not self._closing:
                self._states[request_id] = state
                self._inbox.append(state)
                self._wakeup.notify()
                return
        for seg in state.segments():
            seg.tokens.close()
        raise RuntimeError("the engine is closed")

    def voices_arriving(self, voices: list) -> None:
        """New clips' voices (PromptFeatures) whose requests are on their way: the front end has just
        computed them, together. A kind that prepares voices beside the loop and keeps every voice
        (not cold-starting) starts on them now, in one preparation, rather than as each request is
        submitted. Why: a burst's callers then build their prompts and submit one by one under the
        GIL (8 new clips on an H100: over ~25 ms, the preparation thread gathering all that time, or a
        voice that came late prepared alone after the others' whole launch, ~45 ms later)."""
        if self._preparer is not None and not self.kind.cold_start:
            self._preparer.put(voices, gathered=True)  # the front end's batch: no more to wait for

    def prepare_voices(self, voices: list, done: Callable[[], None] | None = None) -> None:
        """Have the loop compute and keep these voices' state (PromptFeatures) at its next iteration,
        behind its batch (or the preparation thread now, for a kind that prepares beside the loop):
        a voice uploaded now costs its first request nothing. Not waited for: ``done`` is called once
        their preparation is launched (on the loop), or computed (beside it), or when the engine
        closes first."""
        if self._preparer is not None:
            self._preparer.put(voices, done)
            return
        with self._lock:
            self._voices_inbox += voices
            if done is not None:
                self._voices_done.append(done)
            self._wakeup.notify()

    def cancel(self, request_id: str, error: BaseException | None = None) -> None:
        """End a request (its ``finish`` gets ``error``, by default RequestCancelledError);
        harmless once it has ended."""
        with self._lock:
            if request_id in self._states:
                self._cancels.append((request_id, error or RequestCancelledError(f"request {request_id} was cancelled")))
                self._wakeup.notify()

    @property
    def sample_rate(self) -> int:
        return self.kind.sample_rate

    @property
    def active_requests(self) -> int:
        with self._lock:
            return len(self._states)

    def stats(self) -> EngineStats:
        """Requests and streams in the engine, LLM requests generating, the loop's totals (and the
        LLM's, where it runs here) and the kind's gauges."""
        with self._lock:
            states = list(self._states.values())
        generating = self.llm.generating
        if generating is None:  # segments whose tokens are still coming
            generating = sum(not seg.llm_done for state in states for seg in state.segments())
        return EngineStats(len(states), sum(s.request.streaming for s in states), generating,
                           {**dataclasses.asdict(self.counters), **self.llm.counters()},
                           {name: (text, float(value)) for name, (text, value) in self.kind.gauges().items()})

    def start(self, warm_up: Callable[[], None] | None = None) -> "EngineCore":
        """Start the loop's thread. ``warm_up`` runs on that thread before its first step, and is
        waited for (its error raised here): what libraries keep per thread is then the loop's. cuDNN
        keeps its convolution plans per thread, ~1 ms of host each to build, so a kind's eager
        convolutions warmed up on another thread would build them all again on the loop's first chunks."""
        if self._thread is None:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            warmed: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(warm_up, warmed), name="engine-core", daemon=True)
            self._thread.start()
            if (error := warmed.get()) is not None:
                self._thread.join()
                self._thread = None
                raise error
            if self._preparer is not None:
                self._preparer.start()
        return self

    def close(self) -> None:
        """Stop the loop; requests still under way end with RequestCancelledError."""
        with self._lock:
            self._closing = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._preparer is not None:
            self._preparer.close()
        with self._lock:
            states = list(self._states.values())
        for state in states:
            self._end(state, RequestCancelledError("the engine was closed"))
        self._parked.clear()
        with self._lock:
            done, self._voices_done = self._voices_done, []
        call_each(done)
        self._in_flight.clear()
        self.llm.close()

    # ----- the loop -----

    def _run(self, warm_up: Callable[[], None] | None, warmed: queue.SimpleQueue) -> None:
        try:
            make_current(self.kind.device)
            if warm_up is not None:
                warm_up()
        except BaseException as exc:  # raised by start()
            warmed.put(exc)
            return
        warmed.put(None)
        self._loop()

    def _loop(self) -> None:
        while True:
            waited = time.perf_counter()
            with self._wakeup:
                idle = not (self._closing or self._inbox or self._cancels or self._voices_inbox or self._busy())
                if idle and not self._in_flight:
                    # requests waiting only for their LLM's tokens: look again shortly
                    self._wakeup.wait(TOKEN_POLL_S if self._states else None)
                if self._closing:
                    return
            if idle and self._in_flight:
                # nothing to launch: the oldest batch's PCM is next, unless the LLMs' tokens complete a
                # chunk first (a batch takes tens of ms: waiting it out left such a chunk that long, and
                # the GPU idle while the loop then started it, instead of launched behind it)
                self._in_flight[0].pcm.wait(TOKEN_POLL_S)
            self.counters.idle_s += time.perf_counter() - waited
            try:
                self.step()
            except Exception:  # the step's own requests have been failed; the loop goes on
                log.exception("engine step failed")

    def _busy(self) -> bool:
        """Work that needs no new event: chunks waiting to start (not for their voice's launch) or,
        started, to be solved."""
        return (any(seg.pending is not None and not self._waits_for_voice(state, seg)
                    for state in self._states.values() for seg in state.segments())
                or any(self._beside.solvable(seg.job) for seg, _ in self._parked if seg.job is not None))

    def _waits_for_voice(self, state: RequestState, seg: SegmentState) -> bool:
        """The segment's stream is not open and its voice, not kept, is queued for the preparation thread
        (open would compute it on the loop's thread), or is being launched there and not kept yet (open
        would wait for it): that chunk waits (a later iteration) rather than the loop, with every other
        stream's chunk."""
        if seg.flow is not None or seg.schedule is None or self._beside is None:
            return False
        features = state.request.voice.features
        return ((self._preparer.queued(features) and not self._beside.keeps(features))
                or self._beside.launching(features))

    def step(self) -> None:
        """One iteration (see the module docstring): launches a batch, waits for the GPU only
        when :data:`MAX_BATCHES_IN_FLIGHT` batches are out."""
        c = self.counters
        c.iterations += 1
        began = time.perf_counter()
        self._hand_out(wait=len(self._in_flight) >= MAX_BATCHES_IN_FLIGHT)
        voices, done = self._take_events()
        try:
            candidates = []
            for state in self._live():
                try:
                    candidates += self._plan(state)
                except Exception as exc:
                    self._end(state, exc)
            ready = self._unparked()
            if ready:  # windows: the batch takes no full pass (see the scheduler)
                candidates = [candidate for candidate in candidates if not candidate.full_pass]
            picked = self.scheduler.pick(candidates)
            start_begin = time.perf_counter()
            c.host_s += start_begin - began
            batch = ready + self._park(self._start_jobs(picked))
            if not any(candidate.full_pass for candidate in picked):
                # parked jobs that became solvable while these started (a start takes ~15-35 ms of host):
                # this batch, not one launched after it, whose steps would queue behind its own on the GPU
                batch += self._unparked()
            self._sync()
            flow_begin = time.perf_counter()
            c.start_s += flow_begin - start_begin
            if batch:
                self._solve(batch)
            vocoder_begin = time.perf_counter()
            c.flow_s += vocoder_begin - flow_begin
            if batch:
                self._vocode(batch)
            c.vocoder_s += time.perf_counter() - vocoder_begin
        finally:  # behind the batch: its chunks never wait for the preparation's launches
            self._prepare_voices(voices)
            call_each(done)

    # ----- stages -----

    def _take_events(self) -> tuple[list, list[Callable[[], None]]]:
        """New requests, cancellations and timeouts; the voices to prepare in this iteration (and
        the callbacks to answer then)."""
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            voices, self._voices_inbox = self._voices_inbox, []
            done, self._voices_done = self._voices_done, []
        for state in new:
            if state.start_error is not None:
                self._end(state, state.start_error)
        if self._preparer is None:
            voices += self._voices_to_keep([state.request.voice.features for state in new
                                            if not state.ended and state.request.streaming])
        for request_id, error in cancels:
            state = self._states.get(request_id)
            if state is not None:
                self._end(state, error)
        now = time.monotonic()
        for state in self._live():
            if state.timed_out(now):
                self._end(state, RequestTimeoutError(f"request timed out after {state.request.timeout_s:g} s"))
        return voices, done

    def _voices_to_keep(self, arriving: list) -> list:
        """Of new streams' voices, those whose state the kind computes now: all (a kind that cannot
        start a stream without it), or those seen before (a cold-starting kind: a clip sent with one
        request only is never prepared, one sent with every request is kept from its second on)."""
        if not self.kind.cold_start:
            return arriving
        again = []
        for features in arriving:
            key = features.key()
            if key in self._seen_voices:
                again.append(features)
            self._seen_voices.put(key, True)
        return again

    def _prepare_voices(self, voices: list) -> None:
        """The kind's state of these voices, computed now (together); a voice it cannot take is left
        to its requests' ``open``, which fails them with its error."""
        if not voices:
            return
        began = time.perf_counter()
        try:
            self.kind.prepare_voices(voices)
        except Exception:
            for features in voices:  # each alone: the others are still computed
                try:
                    self.kind.prepare_voices([features])
                except Exception:
                    pass
        self.counters.voice_s += time.perf_counter() - began

    def _live(self) -> list[RequestState]:
        with self._lock:
            return [s for s in self._states.values() if not s.ended and s.current is not None]

    def _next_segment(self, state: RequestState) -> None:
        """Start the LLM of the request's next segment (current if none is, else ahead)."""
        prompt = next(state.request.segments, None)
        if prompt is None:
            state.segments_left = False
            return
        request = state.request
        segment = SegmentState(prompt, self.llm.submit(prompt.ids, prompt.request_id, request.limits),
                               self.kind.chunk_schedule(self.strategy) if request.streaming else None)
        if state.current is None:
            state.current = segment
        else:
            state.ahead = segment

    def _plan(self, state: RequestState) -> list[Candidate]:
        """Take the arrived tokens; the current segment's next chunk if it is ready and none is under way."""
        for seg in state.segments():
            if not seg.llm_done:
                tokens, end = seg.tokens.drain()
                if tokens:
                    state.request.stamp("first_token")
                _check_llm_tokens(tokens)
                seg.received += tokens
                self.counters.tokens += len(tokens)
                if end is not None:
                    if end.error is not None:
                        raise end.error
                    seg.llm_done = True
        seg = state.current
        if state.ahead is None and state.segments_left and (seg.chunks or seg.llm_done):
            self._next_segment(state)
        if seg.job is not None or seg.emitting or seg.done:
            return []
        if seg.pending is None:
            if seg.schedule is not None:
                seg.pending = seg.schedule.next_chunk(len(seg.received))
                if seg.pending is None and seg.llm_done:
                    _check_tokens(seg.received)
                    seg.pending = seg.schedule.final_chunk(len(seg.received))
            elif seg.llm_done:
                _check_tokens(seg.received)
                seg.pending = _OFFLINE
        if seg.pending is None or self._waits_for_voice(state, seg):
            return []
        state.request.stamp("chunk_planned")
        chunk = seg.pending
        frames = 2 * (len(seg.received) if chunk is _OFFLINE else chunk.num_tokens - chunk.token_offset) + 50
        if seg.flow is None and chunk is not _OFFLINE:  # a stream's first window may carry its whole prompt
            frames += self.kind.cold_frames(state.request.voice.features)
        full_pass = chunk is _OFFLINE or (chunk.finalize and self.kind.final_full_pass)
        return [Candidate(state, seg, chunk, frames, full_pass)]

    def _start_jobs(self, picked: list[Candidate]) -> list[tuple[SegmentState, RequestState]]:
        """Start the picked chunks' flow jobs; the (segment, request) of each that started."""
        batch, chunks, owners = [], [], []
        for candidate in picked:
            seg, state, chunk = candidate.segment, candidate.state, candidate.chunk
            seg.pending = None
            try:
                if chunk is _OFFLINE:
                    seg.job = self.kind.start_offline(state.request.voice.features, seg.received)
                    state.request.stamp("chunk_started")
                    batch.append((seg, state))
                    continue
                if seg.flow is None:
                    seg.flow = self.kind.open(state.request.voice.features)
                chunks.append((seg.flow, seg.received[:chunk.num_tokens], chunk.token_offset, chunk.finalize))
                owners.append((seg, state))
            except Exception as exc:
                self._end(state, exc)
        if not chunks:
            return batch
        try:
            started = list(zip(owners, self.kind.start_chunks(chunks)))
        except Exception:
            # one bad chunk (its tokens, say) fails its own request only: start them one by one
            started = []
            for owner, chunk in zip(owners, chunks):
                try:
                    started.append((owner, self.kind.start_chunks([chunk])[0]))
                except Exception as exc:
                    self._end(owner[1], exc)
        for (seg, state), job in started:
            seg.job = job
            state.request.stamp("chunk_started")
            batch.append((seg, state))
        return batch

    def _unparked(self) -> list[tuple[SegmentState, RequestState]]:
        """The parked jobs that the kind can solve now (no longer parked)."""
        ready, self._parked = self._split_solvable(self._parked)
        return ready

    def _park(self, started: list[tuple[SegmentState, RequestState]]) -> list[tuple[SegmentState, RequestState]]:
        """Of the jobs just started, those the kind can solve now; the others are parked."""
        if self._beside is None:
            return started
        ready, parked = self._split_solvable(started)
        self._parked += parked
        return ready

    def _split_solvable(self, jobs: list[tuple[SegmentState, RequestState]]) -> tuple[list, list]:
        """(those the kind can solve now, the others) of these started jobs; one whose request ended
        meanwhile (its job given back) is in neither."""
        ready, waiting = [], []
        for seg, state in jobs:
            if seg.job is not None:
                (ready if self._beside.solvable(seg.job) else waiting).append((seg, state))
        return ready, waiting

    def _solve(self, batch: list[tuple[SegmentState, RequestState]]) -> None:
        """Every Euler step of the batch's jobs, launched."""
        jobs = [seg.job for seg, _ in batch]
        try:
            self.kind.solve(jobs)
        except Exception as exc:
            self.kind.abort(jobs)
            for seg, state in batch:
                seg.job = None
                self._end(state, exc)
            batch.clear()
            raise
        self._sync()
        self.counters.flow_batches += 1
        self.counters.flow_batch_jobs += len(jobs)

    def _vocode(self, batch: list[tuple[SegmentState, RequestState]]) -> None:
        """HiFT of the solved batch, launched, and its PCM's copy to the host; the batch joins
        those in flight."""
        finals = [seg.job.finalize for seg, _ in batch]
        items = [(seg.flow if seg.schedule is not None else None, self.kind.mel(seg.job), final)
                 for (seg, _), final in zip(batch, finals)]
        for seg, state in batch:
            seg.job = None
            seg.emitting = True
            state.request.stamp("launched")
        try:
            pcm = HostCopy(self.kind.vocode(items))
        except Exception as exc:
            for seg, state in batch:
                seg.emitting = False
                self._end(state, exc)
            raise
        self._in_flight.append(_Batch(batch, finals, pcm))

    def _hand_out(self, wait: bool) -> None:
        """Emit the PCM of the batches whose copy is done, oldest first; with ``wait``, wait for
        the oldest."""
        while self._in_flight and (wait or self._in_flight[0].pcm.ready()):
            wait = False
            batch = self._in_flight.popleft()
            try:
                pieces = batch.pcm.arrays()
            except Exception as exc:  # the GPU's work for the batch failed
                for seg, state in batch.owners:
                    seg.emitting = False
                    self._end(state, exc)
                continue
            self._emit(batch, pieces)

    def _emit(self, batch: _Batch, pieces: list) -> None:
        now = time.monotonic()
        for (seg, state), finalize, pcm in zip(batch.owners, batch.finals, pieces):
            seg.emitting = False
            self.counters.chunks += 1
            if state.ended:
                continue
            seg.chunks += 1
            state.emitted(pcm.size, self.kind.sample_rate, now)
            state.request.stamp("emitted")
            try:
                state.request.emit(pcm)
            except Exception as exc:  # the front door could not take it: the request ends
                self._end(state, exc)
                continue
            if finalize:
                self._segment_done(state)

    def _segment_done(self, state: RequestState) -> None:
        seg = state.current
        seg.done = True
        _close_voicing(seg)
        state.current, state.ahead = state.ahead, None
        if state.current is None and state.segments_left:
            try:
                self._next_segment(state)
            except Exception as exc:
                self._end(state, exc)
                return
        if state.current is None:
            self._end(state, None)

    def _end(self, state: RequestState, error: BaseException | None) -> None:
        """The request is over: release its LLM requests, jobs and state; call ``finish`` once."""
        if state.ended:
            return
        state.ended = True
        for seg in state.segments():
            if not seg.llm_done:
                seg.tokens.close()  # cancels the LLM request
            if seg.job is not None:
                self.kind.abort([seg.job])
                seg.job = None
            _close_voicing(seg)
        with self._lock:
            self._states.pop(state.request_id, None)
        if error is None:
            self.counters.requests_finished += 1
        else:
            self.counters.requests_failed += 1
        try:
            state.request.finish(error)
        except Exception:
            log.exception("finish callback of request %s failed", state.request_id)

    # ----- helpers -----

    def _sync(self) -> None:
        if self.sync_stages:
            synchronize(self.kind.device)


@dataclass(eq=False)
class _Batch:
    """A launched batch: its (segment, request) owners, whether each chunk is its segment's last,
    and their PCM on its way to the host."""

    owners: list[tuple[SegmentState, RequestState]]
    finals: list[bool]
    pcm: HostCopy


class _Offline:
    """The plan of an offline segment: all its tokens in one pass."""


_OFFLINE = _Offline()


def _close_voicing(seg: SegmentState) -> None:
    if seg.flow is not None:
        seg.flow.close()
        seg.flow = None


def _check_llm_tokens(tokens: list[int]) -> None:
    """Speech tokens an LLM back end handed on must be raw codes (a server-side fault otherwise, not
    the caller's: RuntimeError, not InvalidInputError)."""
    if tokens and not (0 <= min(tokens) and max(tokens) < NUM_SPEECH_TOKENS):  # the loop's path: plain ints
        try:
            speech_token_ids(tokens, NUM_SPEECH_TOKENS, "the LLM's speech tokens")  # its message
        except InvalidInputError as exc:
            raise RuntimeError(str(exc)) from None


def _check_tokens(tokens: list[int]) -> None:
    if not tokens:
        raise RuntimeError("the LLM produced no speech tokens for this request (nothing to synthesise)")


def _voice_key(features) -> object:
    """What makes two voices one to the preparation thread: PromptFeatures' content key (a front end's
    early copy and its request's are two objects); any other voice object stands for itself."""
    key = getattr(features, "key", None)
    return key() if callable(key) else features
