"""The engine core: one loop that owns the GPU and steps the LLM, the flow and the vocoder.

Each iteration (:meth:`EngineCore.step`), read top to bottom:

1. take new requests and cancellations; end requests past their timeout;
2. per request, take the tokens that arrived and plan its next chunk when its chunk schedule
   allows (one chunk in flight per stream: chunks run in order);
3. start the waiting chunks the :class:`~.scheduler.Scheduler` picks (earliest deadline first,
   within the step's frame budget): the kind runs their encoder and takes their state pages;
4. one packed Euler step of every flow job under way, whatever its step (the kind's
   :meth:`step`: chunks of different streams and at different steps in one estimator call);
5. LLM steps (prefill of newly admitted prompts, then one decode step for every request still
   generating, :mod:`.runners.llm`) beside the flow step on the GPU: at least one, and more while
   the flow step is still running there;
6. jobs that took their last step are vocoded together and their PCM handed to the requests'
   ``emit``; finished segments hand over to the next, finished requests call ``finish``.

Nothing blocks on one request: a new request's first chunk joins the step after its tokens are
there, and a long pass (the reference's final chunk, an offline request) takes one step per
iteration like every other job. Requests come from any thread (:meth:`submit`, :meth:`cancel`);
everything else happens on the loop's thread, which is also where ``emit`` and ``finish`` are
called (keep them quick: hand the data to another thread).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..errors import InvalidInputError, RequestCancelledError, RequestTimeoutError
from ..llm.prompt import NUM_SPEECH_TOKENS
from ..speech_tokens import speech_token_ids
from .device import synchronize, work_done_event
from .request import EngineRequest, RequestState, SegmentState
from .scheduler import Candidate, Scheduler

log = logging.getLogger(__name__)

# How long the loop waits for tokens from an external LLM before looking again (seconds).
EXTERNAL_POLL_S = 0.001


@dataclass
class EngineCounters:
    """Running totals of the loop's time per stage (wall clock on the loop thread; with
    ``sync_stages`` each stage waits for its GPU work, so the split is the GPU's too)."""

    iterations: int = 0
    llm_s: float = 0.0  # LLM steps
    start_s: float = 0.0  # encoder and planning of chunks that start
    flow_s: float = 0.0  # packed Euler steps
    vocoder_s: float = 0.0  # HiFT and emitting PCM
    host_s: float = 0.0  # the rest of a busy iteration: requests, tokens, scheduling
    idle_s: float = 0.0  # waiting for work
    flow_steps: int = 0
    flow_step_jobs: int = 0  # jobs advanced, summed over packed steps
    chunks: int = 0  # chunk (or offline) jobs finished
    tokens: int = 0  # speech tokens received from the LLM
    requests_finished: int = 0
    requests_failed: int = 0


class EngineCore:
    """One per GPU: ``kind`` (the token2wav kind: :class:`~.kinds.cosyvoice2.CosyVoice2Kind`),
    ``llm`` (:class:`~.runners.llm.LoopLLM` or :class:`~.runners.llm.BackendLLM`), the chunk
    ``strategy`` of the kind's schedule, and the ``scheduler``."""

    def __init__(self, kind, llm, *, strategy: str = "exponential", scheduler: Scheduler | None = None,
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
        self._cancels: list[tuple[str, BaseException]] = []
        self._states: dict[str, RequestState] = {}  # admitted, not ended; guarded by _lock
        self._jobs: list[tuple[SegmentState, RequestState]] = []  # flow jobs under way (loop thread)
        self._thread: threading.Thread | None = None
        self._closing = False

    # ----- any thread -----

    def submit(self, request: EngineRequest) -> None:
        """Admit ``request`` (CapacityError: refused now) and queue it for the loop."""
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closed")
            if request.request_id in self._states:
                raise InvalidInputError(f"request id {request.request_id!r} is already in use")
            self.scheduler.admit(request.streaming, self._states.values())
            state = RequestState(request)
            self._states[request.request_id] = state
            self._inbox.append(state)
            self._wakeup.notify()

    def cancel(self, request_id: str, error: BaseException | None = None) -> None:
        """End a request (its ``finish`` gets ``error``, by default RequestCancelledError);
        harmless once it has ended."""
        with self._lock:
            if request_id in self._states:
                self._cancels.append((request_id, error or RequestCancelledError(f"request {request_id} was cancelled")))
                self._wakeup.notify()

    @property
    def active_requests(self) -> int:
        with self._lock:
            return len(self._states)

    @property
    def generating(self) -> int:
        """LLM requests under way (segments whose tokens are still coming)."""
        with self._lock:
            return sum(not seg.llm_done for state in self._states.values() for seg in state.segments())

    @property
    def active_streams(self) -> int:
        with self._lock:
            return sum(s.request.streaming for s in self._states.values())

    def start(self) -> "EngineCore":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop; requests still under way end with RequestCancelledError."""
        with self._lock:
            self._closing = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            states = list(self._states.values())
        for state in states:
            self._end(state, RequestCancelledError("the engine was closed"))
        self._jobs.clear()
        self.llm.close()

    # ----- the loop -----

    def _loop(self) -> None:
        while True:
            waited = time.perf_counter()
            with self._wakeup:
                if not (self._closing or self._inbox or self._cancels or self._busy()):
                    # requests waiting only for an external LLM's tokens: look again shortly
                    self._wakeup.wait(EXTERNAL_POLL_S if self._states else None)
                if self._closing:
                    return
            self.counters.idle_s += time.perf_counter() - waited
            try:
                self.step()
            except Exception:  # the step's own requests have been failed; the loop goes on
                log.exception("engine step failed")

    def _busy(self) -> bool:
        """Work that needs no new event: jobs under way or waiting to start, an LLM with work."""
        return bool(self._jobs) or self.llm.has_work or any(
            seg.pending is not None for state in self._states.values() for seg in state.segments())

    def step(self) -> None:
        """One iteration (see the module docstring). The flow step is launched before the LLM step:
        on a GPU the two run side by side (the LLM on a stream of its own), and the host waits for
        the flow's work only when the vocoder reads the mels."""
        c = self.counters
        c.iterations += 1
        began = time.perf_counter()
        self._take_events()
        candidates = []
        for state in self._live():
            try:
                candidates += self._plan(state)
            except Exception as exc:
                self._end(state, exc)
        picked = self.scheduler.pick(candidates, sum(seg.job.frames for seg, _ in self._jobs), len(self._jobs))
        start_begin = time.perf_counter()
        self._start_jobs(picked)
        self._sync()
        flow_begin = time.perf_counter()
        flow_running = self._flow_step() if self._jobs else None
        llm_begin = time.perf_counter()
        # LLM steps while the flow step runs on the GPU: a stream's tokens then come at the LLM's
        # own pace, not one per (longer) flow step
        while self.llm.has_work:
            self.llm.step()
            if flow_running is None or flow_running.query():
                break
        vocoder_begin = time.perf_counter()
        self._finish_jobs()
        end = time.perf_counter()
        c.start_s += flow_begin - start_begin
        c.flow_s += llm_begin - flow_begin
        c.llm_s += vocoder_begin - llm_begin
        c.vocoder_s += end - vocoder_begin
        c.host_s += start_begin - began

    # ----- stages -----

    def _take_events(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for state in new:
            try:
                self._next_segment(state)
            except Exception as exc:
                self._end(state, exc)
        for request_id, error in cancels:
            state = self._states.get(request_id)
            if state is not None:
                self._end(state, error)
        now = time.monotonic()
        for state in self._live():
            if state.timed_out(now):
                self._end(state, RequestTimeoutError(f"request timed out after {state.request.timeout_s:g} s"))

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
        if seg.job is not None or seg.done:
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
        if seg.pending is None:
            return []
        chunk = seg.pending
        frames = 2 * (len(seg.received) if chunk is _OFFLINE else chunk.num_tokens - chunk.token_offset) + 50
        return [Candidate(state, seg, chunk, frames)]

    def _start_jobs(self, picked: list[Candidate]) -> None:
        chunks, owners = [], []
        for candidate in picked:
            seg, state, chunk = candidate.segment, candidate.state, candidate.chunk
            seg.pending = None
            try:
                if chunk is _OFFLINE:
                    seg.job = self.kind.start_offline(state.request.voice.features, seg.received)
                    self._jobs.append((seg, state))
                    continue
                if seg.flow is None:
                    seg.flow = self.kind.open(state.request.voice.features)
                chunks.append((seg.flow, seg.received[:chunk.num_tokens], chunk.token_offset, chunk.finalize))
                owners.append((seg, state))
            except Exception as exc:
                self._end(state, exc)
        if not chunks:
            return
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
            self._jobs.append((seg, state))

    def _flow_step(self):
        """One packed Euler step of every job under way, launched; returns what tells when the
        device has finished it (a CUDA event; None on the CPU, where it has)."""
        jobs = [seg.job for seg, _ in self._jobs]
        try:
            self.kind.step(jobs)
        except Exception as exc:
            self.kind.abort(jobs)
            for seg, state in list(self._jobs):
                self._end(state, exc)
            raise
        self._sync()
        self.counters.flow_steps += 1
        self.counters.flow_step_jobs += len(jobs)
        return work_done_event(self.kind.device)

    def _finish_jobs(self) -> None:
        done = [(seg, state) for seg, state in self._jobs if seg.job.done]
        if not done:
            return
        self._jobs = [(seg, state) for seg, state in self._jobs if not seg.job.done]
        items = []
        for seg, _ in done:
            finalize = seg.job.finalize
            items.append((seg.flow if seg.schedule is not None else None, self.kind.mel(seg.job), finalize))
        try:
            pieces = self.kind.vocode(items)
        except Exception as exc:
            for seg, state in done:
                self._end(state, exc)
            raise
        now = time.monotonic()
        for (seg, state), pcm in zip(done, pieces):
            finalize = seg.job.finalize
            seg.job = None
            self.counters.chunks += 1
            if state.ended:
                continue
            seg.chunks += 1
            state.emitted(pcm.size, self.kind.sample_rate, now)
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
        self._jobs = [(seg, s) for seg, s in self._jobs if s is not state]
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
