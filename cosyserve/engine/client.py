"""A front door's side of an engine process (:mod:`.process`): the core's ``submit``/``cancel``/
``stats`` over ZMQ, so that :class:`~.service.TTSEngine` works the same over either.

:meth:`EngineClient.spawn` starts the engine process (one per GPU) and waits until it is ready;
:class:`EngineClient` alone connects to one already running (several front doors may feed one
engine). One receiver thread hands each request's PCM to its ``emit`` and its end to ``finish``, as
the core's loop does in-process; a request refused by the engine (``overloaded: ...``) ends through
``finish`` too. Where the engine asks for a segment's tokens (its LLM runs on the front door's side,
a Triton LLM model), the client starts that request with ``token_source`` and forwards its tokens.

If the engine process dies, every request in flight ends within ``POLL_S`` with
:class:`~.wire.EngineProcessError`, and a spawned engine is started again (``restart``); requests
that arrive meanwhile are refused as overloaded. A connected engine that sends no stats for
``SILENT_S`` is taken for dead the same way.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from ..errors import CapacityError
from ..frontend.prompt import PromptFeatures
from .front_end import TokenLimits
from . import wire
from .request import EngineRequest

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the receiver looks at the process when nothing arrives
HELLO_EVERY_S = 0.2
SOCKET_PREFIX = "cosyserve-engine"  # a spawned engine's ipc files: <tmp>/<prefix>-<front door pid>-<id>-in|out
_SOCKET_FILE = re.compile(rf"{SOCKET_PREFIX}-(\d+)-[0-9a-f]{{8}}-(in|out)")
SILENT_S = 5.0  # a connected engine that sends nothing this long is taken for gone
READY_TIMEOUT_S = 900.0  # a GPU engine's load: weights, graphs and the warm-up
STOP_TIMEOUT_S = 30.0


class EngineClient:
    def __init__(self, address: str, *, token_source=None, process: subprocess.Popen | None = None,
                 respawn: Callable[[], subprocess.Popen] | None = None) -> None:
        """``token_source``: a :class:`~.runners.llm.BackendLLM` whose ``submit`` starts the LLM of a
        segment the engine asks for (None: the engine runs its own). ``process``/``respawn``: the
        engine process this client started, and how to start it again after it died. Requests can be
        sent once :meth:`wait_ready` has returned."""
        self.address = address
        self.token_source = token_source
        self.process = process
        self.respawn = respawn
        self.identity = uuid.uuid4().hex.encode()
        self.context = zmq.Context()
        self._requests: dict[str, EngineRequest] = {}
        self._llm_streams: dict[str, object] = {}
        self._voice_tickets: dict[str, Callable[[], None]] = {}  # prepare_voices' callbacks by ticket
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._closing = False
        self._stats = wire.EngineStats()
        self._base_counters: dict[str, float] = {}  # totals of engine processes that have ended
        self.info: dict = {}
        self._connect()
        self._receiver = threading.Thread(target=self._receive, name="engine-client", daemon=True)
        self._receiver.start()

    @classmethod
    def spawn(cls, spec, *, token_source=None, restart: bool = True,
              log_file: str | Path | None = None) -> "EngineClient":
        """Start ``python -m cosyserve.engine.process`` for ``spec`` (:class:`~.process.EngineSpec`)
        on a fresh IPC address and connect to it (it loads while the caller goes on: then
        :meth:`wait_ready`). Its output goes where this process's goes, or to ``log_file``. Socket files
        that killed front doors' engines left behind are removed first."""
        remove_orphaned_socket_files(Path(tempfile.gettempdir()))
        address = f"ipc://{tempfile.gettempdir()}/{SOCKET_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

        def start() -> subprocess.Popen:
            return _start_process(address, spec.to_json(), log_file)

        return cls(address, token_source=token_source, process=start(), respawn=start if restart else None)

    # ----- the core's interface -----

    @property
    def sample_rate(self) -> int:
        return self.info["sample_rate"]

    def submit(self, request: EngineRequest) -> None:
        """Send ``request``; its PCM comes to ``emit`` and its end (a refusal too) to ``finish``,
        from the receiver thread (its ``trace`` then holds the engine's stamps too)."""
        if not self._ready.is_set():
            raise CapacityError("overloaded: the engine is restarting; retry after 1000 ms")
        segments = [[prompt.request_id, list(prompt.ids)] for prompt in request.segments]
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine client is closed")
            self._requests[request.request_id] = request
        self._send(wire.SUBMIT, request.request_id, segments, wire.pack_voice(request.voice.features),
                   request.limits.max_tokens, request.limits.min_tokens, request.streaming, request.timeout_s,
                   request.arrival, self.token_source is not None)

    def prepare_voices(self, voices: list[PromptFeatures], done: Callable[[], None] | None = None) -> None:
        """Have the engine compute and keep these voices' state now (not waited for): ``done`` is
        called (on the receiver thread) once the engine core answers (:meth:`EngineCore.prepare_voices`:
        their preparation computed or launched), or when the engine is gone or restarting (it then
        computes them on their first request)."""
        if not self._ready.is_set():
            if done is not None:
                done()
            return
        ticket = None
        if done is not None:
            ticket = uuid.uuid4().hex
            with self._lock:
                self._voice_tickets[ticket] = done
        self._send(wire.VOICES, [wire.pack_voice(features) for features in voices], ticket)

    def voices_arriving(self, voices: list[PromptFeatures]) -> None:
        """:meth:`EngineCore.voices_arriving` in the engine process (not waited for; nothing when the
        engine is gone or restarting: the requests then bring their voices)."""
        if self._ready.is_set():
            self._send(wire.ARRIVING, [wire.pack_voice(features) for features in voices])

    def cancel(self, request_id: str, error: BaseException | None = None) -> None:
        with self._lock:
            known = request_id in self._requests
        if known:
            self._send(wire.CANCEL, request_id)

    def stats(self) -> wire.EngineStats:
        stats = self._stats
        counters = {name: value + self._base_counters.get(name, 0) for name, value in stats.counters.items()}
        return wire.EngineStats(stats.requests, stats.streams, stats.generating, counters, stats.gauges)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> "EngineClient":
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.process is not None and self.process.poll() is not None:
                raise wire.EngineProcessError(f"the engine process exited with code {self.process.returncode} "
                                              "while loading (its log is above)")
            if time.monotonic() > deadline:
                raise wire.EngineProcessError(f"the engine at {self.address} was not ready in {timeout_s:g} s")
        return self

    def close(self) -> None:
        """Stop the engine process this client started (its requests end with an error first) and
        the receiver."""
        with self._lock:
            self._closing = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._receiver.join(timeout=5)
        self._fail_all(wire.EngineProcessError("the engine was closed"))
        self.context.destroy(0)
        if self.process is not None:  # the engine this client started may have been killed, closing nothing
            wire.remove_socket_files(self.address)

    # ----- sockets -----

    def _connect(self) -> None:
        # one routing id on both sockets: the engine answers on its output socket to the id its input saw
        self.outbound = self.context.socket(zmq.DEALER)
        self.outbound.setsockopt(zmq.ROUTING_ID, self.identity)
        self.outbound.connect(f"{self.address}-in")
        self.inbound = self.context.socket(zmq.DEALER)
        self.inbound.setsockopt(zmq.ROUTING_ID, self.identity)
        self.inbound.connect(f"{self.address}-out")

    def _send(self, *message) -> None:
        frame = wire.pack(*message)
        with self._send_lock:
            self.outbound.send(frame)

    # ----- the receiver thread -----

    def _receive(self) -> None:
        said_hello = 0.0
        heard = time.monotonic()
        while True:
            with self._lock:
                if self._closing:
                    return
            if not self._ready.is_set() and time.monotonic() - said_hello >= HELLO_EVERY_S:
                said_hello = time.monotonic()
                self._send(wire.HELLO)
            if self.inbound.poll(int(POLL_S * 1000)):
                heard = time.monotonic()
                try:
                    self._handle(wire.unpack(self.inbound.recv()))
                except Exception:
                    log.exception("engine client: a message from the engine could not be handled")
                continue
            gone = None
            if self.process is not None and self.process.poll() is not None:
                gone = f"the engine process (pid {self.process.pid}) exited with code {self.process.returncode}"
            elif self.process is None and self._ready.is_set() and time.monotonic() - heard > SILENT_S:
                gone = f"the engine at {self.address} sent nothing for {SILENT_S:g} s"
            if gone is not None:
                self._engine_gone(gone)
                heard = time.monotonic()

    def _handle(self, message: list) -> None:
        kind = message[0]
        if kind == wire.PCM:
            request = self._requests.get(message[1])
            if request is not None:
                request.stamp("pcm_received")
                try:
                    request.emit(np.frombuffer(message[2], np.float32))
                except Exception as exc:  # the front door could not take it: the request ends
                    self.cancel(message[1], exc)
        elif kind == wire.FINISH:
            with self._lock:
                request = self._requests.pop(message[1], None)
            if request is not None:
                request.trace.update(message[3])
                _finish(request, wire.unpack_error(message[2]))
        elif kind == wire.STATS:
            self._stats = wire.unpack_stats(message[1])
        elif kind == wire.LLM_START:
            self._start_llm(*message[1:])
        elif kind == wire.LLM_STOP:
            stream = self._llm_streams.pop(message[1], None)
            if stream is not None:
                stream.close()
        elif kind == wire.VOICES_DONE:
            with self._lock:
                done = self._voice_tickets.pop(message[1], None)
            if done is not None:
                _call(done)
        elif kind == wire.WELCOME:
            self.info = message[1]
            self._stats = wire.unpack_stats(self.info.pop("stats"))
            self._ready.set()

    def _start_llm(self, segment_id: str, prompt_ids: list[int], max_tokens: int, min_tokens: int) -> None:
        try:
            stream = self.token_source.submit(prompt_ids, segment_id, TokenLimits(max_tokens, min_tokens))
        except Exception as exc:
            self._send(wire.TOKENS, segment_id, [], ["error", wire.pack_error(exc)])
            return
        self._llm_streams[segment_id] = stream
        threading.Thread(target=self._forward, args=(segment_id, stream), daemon=True,
                         name=f"forward-{segment_id}").start()

    def _forward(self, segment_id: str, stream) -> None:
        """A segment's tokens, as they come, to the engine: one message per burst."""
        end = ["stop", None]
        try:
            while True:
                self._send(wire.TOKENS, segment_id, stream.available(), None)
        except StopIteration:
            end = [stream.finish_reason or "stop", None]
        except Exception as exc:
            end = ["error", wire.pack_error(exc)]
        finally:
            self._llm_streams.pop(segment_id, None)
            self._send(wire.TOKENS, segment_id, [], end)

    def _engine_gone(self, why: str) -> None:
        log.error("engine client: %s; ending the requests in flight", why)
        self._ready.clear()
        self._base_counters = self.stats().counters
        self._stats = wire.EngineStats()
        self._fail_all(wire.EngineProcessError(f"{why}; this request was ended"))
        for stream in list(self._llm_streams.values()):
            stream.close()
        self._llm_streams.clear()
        if self.respawn is not None and self.process is not None:
            log.warning("engine client: starting the engine process again")
            self.process = self.respawn()  # ready again at its WELCOME (the receiver says hello meanwhile)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            requests, self._requests = list(self._requests.values()), {}
            tickets, self._voice_tickets = list(self._voice_tickets.values()), {}
        for request in requests:
            _finish(request, error)
        for done in tickets:  # those voices are computed on their first request
            _call(done)


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("engine client: a prepare_voices callback failed")


def _finish(request: EngineRequest, error: BaseException | None) -> None:
    try:
        request.finish(error)
    except Exception:
        log.exception("finish callback of request %s failed", request.request_id)


def python_executable() -> str:
    """This environment's interpreter, also inside a Triton Python stub (whose ``sys.executable`` is
    the stub, not Python)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.prefix) / "bin" / "python3")


def remove_orphaned_socket_files(directory: Path) -> list[Path]:
    """Remove the socket files in ``directory`` of engines spawned by front doors that are gone (the
    pid in the name): a front door and its engine killed together (SIGKILL) close nothing. Returns
    the files removed (another user's stay)."""
    removed = []
    for path in directory.glob(f"{SOCKET_PREFIX}-*"):
        match = _SOCKET_FILE.fullmatch(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _start_process(address: str, spec_json: str, log_file: str | Path | None) -> subprocess.Popen:
    env = dict(os.environ)
    # the checkout this package is imported from, whatever the child's own path says
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    output = open(log_file, "ab") if log_file is not None else None
    try:
        return subprocess.Popen([python_executable(), "-m", "cosyserve.engine.process", "--address", address,
                                 "--spec", spec_json, "--parent-pid", str(os.getpid())],
                                env=env, stdin=subprocess.DEVNULL, stdout=output or sys.stderr,
                                stderr=subprocess.STDOUT if output else sys.stderr)
    finally:
        if output is not None:
            output.close()
