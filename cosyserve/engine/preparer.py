"""A thread that prepares voices beside the engine's loop, for kinds whose ``prepare_voices`` may run
so (:attr:`~.kinds.protocol.Kind.prepares_beside`): a new request's voice as it is submitted, an
uploaded voice as it is stored. On the loop's thread, a voice's preparation would hold up the loop
for as long as it takes to launch, and its chunks queued behind it on the loop's CUDA stream.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class VoicePreparer:
    """Calls ``prepare(voices)`` on a thread of its own with every voice queued since its last call
    (voices arriving together are prepared together), then each of their ``done`` callbacks (once
    the preparation is launched). ``done`` callbacks still queued at :meth:`close` are called then."""

    def __init__(self, prepare: Callable[[list], None], name: str = "engine-voices") -> None:
        self._prepare = prepare
        self._name = name
        self._lock = threading.Condition()
        self._voices: list = []
        self._done: list[Callable[[], None]] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> "VoicePreparer":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def put(self, voices: list, done: Callable[[], None] | None = None) -> None:
        with self._lock:
            if self._closing:
                if done is not None:
                    call_each([done])
                return
            self._voices += voices
            if done is not None:
                self._done.append(done)
            self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            done, self._done, self._voices = self._done, [], []
        call_each(done)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._closing or self._voices or self._done):
                    self._lock.wait()
                if self._closing:
                    return
                voices, self._voices = self._voices, []
                done, self._done = self._done, []
            if voices:
                try:
                    self._prepare(voices)
                except Exception:  # prepare fails no request: a voice it could not take fails at open
                    log.exception("engine: preparing voices failed")
            call_each(done)


def call_each(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("engine: a prepare_voices callback failed")
