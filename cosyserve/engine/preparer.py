"""A thread that prepares voices beside the engine's loop, for kinds whose ``prepare_voices`` may run
so (:attr:`~.kinds.protocol.Kind.prepares_beside`): a new request's voice as it is submitted, an
uploaded voice as it is stored. On the loop's thread, a voice's preparation would hold up the loop
for as long as it takes to launch, and its chunks queued behind it on the loop's CUDA stream.

Voices that keep arriving close together (each within :data:`PREPARE_GAP_S` of the one before: a
burst of requests, whose callers each build their prompts first) are prepared together: one packed
solve costs much less than two, one after the other (on an H100: 36 ms for one 5.5 s prompt alone,
77 ms for 8), and a voice that misses it waits for that solve's whole launch before its own.

An uploaded voice is answered once the device has computed it (a second thread waits for that, so
that the next voices are launched meanwhile): a request sent then does not share the GPU with its
own voice's preparation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger(__name__)

# A burst's gaps and span here are wider than the front end's (runtime.BURST_GAP_S, BURST_MAX_S): 8 new
# clips answered together reach the engine over ~20 ms, their callers building prompts and submitting
# under the GIL (one H100: the LLM prefilled them in two groups 7 ms apart, and one voice missed the
# preparation of the other seven by more than 2 ms). A new voice's preparation runs beside its LLM
# prefill and first tokens (~25 ms or more), so a few ms of gathering rarely delay its first chunk.
PREPARE_GAP_S = 0.005
PREPARE_MAX_S = 0.025


class VoicePreparer:
    """Calls ``prepare(voices)`` on a thread of its own with every voice queued since its last call
    (voices arriving together are prepared together); then, on a second thread, ``wait(voices)``
    (until the device has computed them) and each of their ``done`` callbacks. ``done`` callbacks
    still queued at :meth:`close` are called then."""

    def __init__(self, prepare: Callable[[list], None], wait: Callable[[list], None],
                 name: str = "engine-voices", *, gather_s: float = PREPARE_GAP_S,
                 gather_max_s: float = PREPARE_MAX_S, key: Callable[[Any], Hashable] = id) -> None:
        self._prepare = prepare
        self._key = key  # what makes two voices one: one queued already is not queued again
        self._wait = wait
        self._name = name
        self._gather_s, self._gather_max_s = gather_s, gather_max_s
        self._lock = threading.Condition()
        self._voices: list = []
        self._done: list[Callable[[], None]] = []
        self._launched: queue.SimpleQueue = queue.SimpleQueue()  # (voices, done) for the waiting thread
        self._closing = False
        self._gathered = False  # the queue holds a gathered burst: prepare it at once
        self._threads: list[threading.Thread] = []

    def start(self) -> "VoicePreparer":
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name=self._name, daemon=True),
                             threading.Thread(target=self._answer, name=f"{self._name}-ready", daemon=True)]
            for thread in self._threads:
                thread.start()
        return self

    def put(self, voices: list, done: Callable[[], None] | None = None, *, gathered: bool = False) -> None:
        """Queue ``voices`` for the next preparation (``done`` called once it is computed). ``gathered``:
        a burst gathered already (a front-end batch): the thread starts on the queue without waiting
        for more."""
        with self._lock:
            if self._closing:
                if done is not None:
                    call_each([done])
                return
            queued = {self._key(voice) for voice in self._voices}
            for voice in voices:  # a voice queued again would keep a gathering preparation waiting
                key = self._key(voice)
                if key not in queued:
                    queued.add(key)
                    self._voices.append(voice)
            if done is not None:
                self._done.append(done)
            self._gathered = self._gathered or gathered
            self._lock.notify()

    def queued(self, voice) -> bool:
        """Whether this voice (or one of its key) waits in the queue, not yet taken by the thread: a
        stream of it opened now would have its voice computed on the opener's thread (the loop's),
        once the thread's current preparation is launched (CosyVoice2: ~85 ms for 7 new voices on an
        H100, the loop held all that time)."""
        key = self._key(voice)
        with self._lock:
            return any(self._key(v) == key for v in self._voices)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        if self._threads:
            self._threads[0].join()
            self._launched.put(None)
            self._threads[1].join()
            self._threads = []
        with self._lock:  # the waiting thread has answered every launched voice before its sentinel
            done, self._done, self._voices = self._done, [], []
        call_each(done)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._closing or self._voices or self._done):
                    self._lock.wait()
                if self._closing:
                    return
                if not self._gathered:
                    self._gather()
                voices, self._voices, self._gathered = self._voices, [], False
                done, self._done = self._done, []
            if voices:
                try:
                    self._prepare(voices)
                except Exception:  # prepare fails no request: a voice it could not take fails at open
                    log.exception("engine: preparing voices failed")
            if done:
                self._launched.put((voices, done))

    def _gather(self) -> None:
        """(Lock held) wait while voices keep arriving within the gather time of each other."""
        last_by = time.monotonic() + self._gather_max_s
        while self._voices and not self._closing:
            seen, left = len(self._voices), last_by - time.monotonic()
            if left <= 0:
                return
            self._lock.wait(min(self._gather_s, left))
            if len(self._voices) == seen:
                return

    def _answer(self) -> None:
        while (item := self._launched.get()) is not None:
            voices, done = item
            if voices:
                try:
                    self._wait(voices)
                except Exception:
                    log.exception("engine: waiting for prepared voices failed")
            call_each(done)


def call_each(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("engine: a prepare_voices callback failed")
