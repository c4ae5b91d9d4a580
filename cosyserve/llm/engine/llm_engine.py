"""Continuous-batching engine: thread-safe submit/cancel, one step at a time.

Each :meth:`LLMEngine.step` (called by the background thread, or by the caller when no thread
was started) does, in order: take new requests and cross-thread calls, drop cancelled requests,
prefill the requests the :class:`~.scheduler.Scheduler` admits into free slots as one padded
batch (prefix-cache hits start after the cached tokens), then run one decode step for every
running request. The scheduler decides; the engine moves KV, runs the model and delivers tokens.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import InvalidInputError, RequestCancelledError
from ..prompt import validate_prompt_ids
from ..sampling import SamplingParams, random_seed
from ..stream import Finished, TokenStream, cancelled_error
from .model_runner import ModelRunner, PrefillItem
from .prefix_cache import PrefixCache
from .scheduler import Scheduler, SlotMove
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pacing:
    """How far a request's tokens may run ahead of real time when the engine steps on its own thread:
    its first ``burst`` tokens at once, then ``tokens_per_s``. While every running request is ahead
    of that, the thread waits instead of decoding (a new request wakes it).

    A TTS reader consumes speech tokens at 25 a second; an LLM that generates every request's tokens
    as fast as it can spends the GPU on tokens nobody needs yet, in small decode batches, while the
    chunk that a listener waits for shares the GPU with them."""

    burst: int = 20
    tokens_per_s: float = 100.0

    def delay(self, seqs: list[Sequence], now: float) -> float:
        """Seconds until one of ``seqs`` may take a token (0: now)."""
        wait = float("inf")
        for seq in seqs:
            if seq.started_at is None:
                return 0.0
            ahead = len(seq.output) + 1 - self.burst
            if ahead <= 0:
                return 0.0
            wait = min(wait, seq.started_at + ahead / self.tokens_per_s - now)
        return max(wait, 0.0)


@dataclass
class StepStats:
    prefilled: int  # requests admitted and prefilled in this step
    decoded: int  # requests that got a decode token in this step


@dataclass
class EngineCounters:
    """Running totals of the engine's work (read them from any thread; written by the stepping one).

    Times are wall clock: a step ends with its sampled tokens on the host, so they include the GPU
    work and any wait for a GPU shared with other processes (a slower mean decode step under load
    is contention, not bigger batches: compare with ``decode_rows / decode_steps``).
    """

    busy_s: float = 0.0  # prefill + decode
    prefill_s: float = 0.0
    prefills: int = 0  # requests prefilled
    decode_steps: int = 0
    decode_rows: int = 0  # requests advanced, summed over decode steps


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_slots: int = 64,
        max_model_len: int = 2048,
        max_prefill_tokens: int = 8192,
        prefix_cache_size: int = 64,
        use_cuda_graphs: bool | None = None,
        pacing: Pacing | None = None,
        high_priority: bool = False,
        steps_per_replay: int = 1,
    ):
        device = torch.device(device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.max_slots, self.max_model_len = max_slots, max_model_len
        self.runner = ModelRunner(model_dir, device, dtype, max_slots, max_model_len, use_cuda_graphs,
                                  high_priority=high_priority, steps_per_replay=steps_per_replay)
        self.prefixes = PrefixCache(prefix_cache_size)
        self.scheduler = Scheduler(max_slots, max_prefill_tokens, self.prefixes)
        self.counters = EngineCounters()
        self.pacing = pacing  # applies to the engine's own thread (start); None: as fast as it can
        # Shared with submitting threads, guarded by _lock.
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._active: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._closing = False

    # ---- public, any thread ----------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               on_token: Callable[[int], None] | None = None) -> TokenStream:
        """Queue a request; bad input raises InvalidInputError here and never reaches the batch."""
        ids = validate_prompt_ids(prompt_ids, self.runner.config.vocab_size, self.layout)
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(f"prompt has {len(ids)} tokens; this engine holds at most "
                                    f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closed")
            if request_id in self._active:
                raise InvalidInputError(f"request id {request_id!r} is already in use")
            seq = Sequence(
                request_id=request_id, prompt_ids=ids, params=params,
                seed=params.seed if params.seed is not None else random_seed(),
                max_new_tokens=min(params.max_tokens, self.max_model_len - len(ids)),
                stream=TokenStream(request_id, lambda: self.cancel(request_id)), on_token=on_token,
                layout=self.layout,
            )
            self._active[request_id] = seq
            self._inbox.append(seq)
            self._wakeup.notify()
        return seq.stream

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its slot is freed at the next step boundary. False if it is not active."""
        with self._lock:
            seq = self._active.get(request_id)
            if seq is None:
                return False
            seq.cancelled = True
            self._wakeup.notify()
        return True

    def register_prefix(self, key: str, ids: list[int]) -> None:
        """Compute and keep the KV of ``ids`` (e.g. ``build_prefix_ids``) for reuse by later prompts."""
        ids = validate_prompt_ids(ids, self.runner.config.vocab_size, self.layout)
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(f"prefix of {len(ids)} tokens does not fit max_model_len {self.max_model_len}")
        self._call(lambda: self.prefixes.put(key, ids, self.runner.compute_prefix_kv(ids)))

    def teacher_forced_logits(self, prompt_ids: list[int], forced: list[int]) -> torch.Tensor:
        """Logits (1 + len(forced), window) after the prompt and after each forced window index."""
        ids = validate_prompt_ids(prompt_ids, self.runner.config.vocab_size, self.layout)
        return self._call(lambda: self._score(ids, forced))

    @property
    def layout(self):
        """The checkpoint's :class:`~cosyserve.llm.prompt.PromptLayout` (CosyVoice2 or CosyVoice3)."""
        return self.runner.layout

    @property
    def has_work(self) -> bool:
        """Whether a :meth:`step` would do anything (for a caller that steps the engine itself)."""
        with self._lock:
            return bool(self._inbox or self._calls) or self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def start(self, cuda_stream: torch.cuda.Stream | None = None) -> "LLMEngine":
        """Run steps on a background thread whenever there is work; its kernels go to
        ``cuda_stream`` (None: the current stream)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(cuda_stream,), name="llm-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            pending = list(self._active.values())
        for seq in pending:
            self._finish(seq, Finished("cancelled", RequestCancelledError("the engine was closed")))

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> StepStats:
        with self._lock:
            new, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        self.scheduler.add(new)
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as exc:  # reported to the caller, the engine goes on
                future.set_exception(exc)
        self._drop_cancelled()
        counters, started = self.counters, time.perf_counter()
        prefilled = self._prefill()
        prefilled_at = time.perf_counter()
        running = self.scheduler.running
        decoded = len(running)
        if decoded:
            steps = self.runner.decode(decoded, max(seq.position for seq in running))
            self._append_tokens(running, *steps)
        if prefilled:
            counters.prefills += prefilled
            counters.prefill_s += prefilled_at - started
        if decoded:
            counters.decode_steps += len(steps)
            counters.decode_rows += decoded * len(steps)
        counters.busy_s += time.perf_counter() - started
        return StepStats(prefilled, decoded)

    def _loop(self, cuda_stream: torch.cuda.Stream | None) -> None:
        if cuda_stream is not None:
            torch.cuda.set_stream(cuda_stream)  # this thread's current stream from now on
        while True:
            with self._wakeup:
                while not self._closing:
                    if self._inbox or self._calls or self.scheduler.waiting:
                        break
                    if not self.scheduler.running:
                        self._wakeup.wait()
                        continue
                    delay = self.pacing.delay(self.scheduler.running, time.monotonic()) if self.pacing else 0.0
                    if delay <= 0:
                        break
                    self._wakeup.wait(delay)
                if self._closing:
                    return
            try:
                self.step()
            except Exception as exc:  # a failed step fails the requests in flight, not the engine
                log.exception("LLM engine step failed")
                for seq in self.scheduler.take_all():
                    self._finish(seq, Finished("error", exc))

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps (inline when no thread runs)."""
        if self._thread is None:
            return fn()
        future: Future = Future()
        with self._lock:
            self._calls.append((fn, future))
            self._wakeup.notify()
        return future.result()

    def _drop_cancelled(self) -> None:
        cancelled, moves = self.scheduler.take_cancelled()
        for seq in cancelled:
            self._finish(seq, cancelled_error(seq.request_id))
        self._move(moves)

    def _prefill(self) -> int:
        admitted = self.scheduler.admit()
        if not admitted:
            return 0
        now = time.monotonic()
        for a in admitted:
            a.seq.started_at = now
            if a.prefix is not None:
                self.runner.load_prefix(a.seq.slot, a.prefix.kv, a.cached)
        seqs = [a.seq for a in admitted]
        slots = [seq.slot for seq in seqs]
        self.runner.sampler.set_requests(slots, [s.params for s in seqs], [s.seed for s in seqs],
                                         [s.prompt_window_ids for s in seqs])
        self._append_tokens(seqs, self.runner.prefill([PrefillItem(a.seq.slot, a.seq.prompt_ids, a.cached)
                                                       for a in admitted]))
        return len(admitted)

    def _append_tokens(self, seqs: list[Sequence], *steps: list[int]) -> None:
        """Each step's token (one list a step, a token per sequence) to its sequence, up to its stop;
        then the finished ones' slots are freed."""
        finished = [seq for index, seq in enumerate(seqs) if any(seq.append(tokens[index]) for tokens in steps)]
        if finished:
            self._forget(finished)
            self._move(self.scheduler.release(finished))

    def _move(self, moves: list[SlotMove]) -> None:
        for move in moves:
            self.runner.move_slot(move.src, move.dst, move.length)

    def _finish(self, seq: Sequence, event: Finished) -> None:
        seq.finish(event)
        self._forget([seq])

    def _forget(self, seqs: list[Sequence]) -> None:
        with self._lock:
            for seq in seqs:
                self._active.pop(seq.request_id, None)

    def _score(self, ids: list[int], forced: list[int]) -> torch.Tensor:
        slot = len(self.scheduler.running)
        if slot >= self.max_slots or len(ids) + len(forced) > self.max_model_len:
            raise InvalidInputError("no free slot or the sequence does not fit max_model_len")
        rows = [self.runner.prefill_logits([PrefillItem(slot, ids, 0)])[0]]
        for offset, token in enumerate(forced):
            position = len(ids) + offset
            self.runner.set_decode_input(slot, token, position)
            rows.append(self.runner.decode_logits(slot + 1, position)[slot])
        return torch.stack(rows).cpu()
