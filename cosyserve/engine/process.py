"""The engine core in a process of its own: ``python -m cosyserve.engine.process --address A --spec JSON``.

One per GPU. It loads the stack of :class:`EngineSpec` (:func:`~.service.load_engine`: the LLM, the
token2wav kind, the kept voices, the warm-up), then serves front doors over ZMQ (:mod:`.wire`): the
main thread reads requests from the input ROUTER, the loop thread runs the core, the LLM its own
thread, and one sender thread packs and sends PCM, ends and stats on the output ROUTER. Nothing a
front door does (text normalisation, tokenisation, voices, response sending, metrics) runs here, so
the loop has the process's GIL to itself but for these few threads.

A request's segments' LLM runs here (our engine, or an OpenAI-compatible server), or in the front
door that sent it (a Triton LLM model, which only a Triton stub can call): then the engine asks that
front door for each segment's tokens when the core starts its LLM request (``llm``) and the front
door forwards them (``tokens``, :class:`ForwardedTokens`).

The process ends when its parent does (checked every poll), on SIGTERM/SIGINT, or if its client
goes: a client that cannot be reached has its requests cancelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from ..errors import InvalidInputError
from ..frontend.prompt import Voice
from ..llm.stream import Finished, TokenStream
from .front_end import SegmentPrompt, TokenLimits
from . import wire
from .request import EngineRequest
from .scheduler import Scheduler

log = logging.getLogger(__name__)

POLL_MS = 100


@dataclass
class EngineSpec:
    """What an engine process loads (JSON): :func:`~.service.load_engine`'s arguments. ``llm``:
    ``engine`` (ours, free-running here; ``llm_options`` its :class:`~cosyserve.llm.engine.llm_engine.LLMEngine`
    keywords), ``openai`` (an OpenAI-compatible server; ``llm_options``: ``base_url``, ``model``) or
    ``client`` (tokens forwarded by the front doors). ``kind_options``: the kind's keywords, a dtype as
    ``{"dtype": "float16"}``."""

    model: str
    model_dir: str
    llm_dir: str
    device: str = "cpu"
    kind_options: dict = field(default_factory=dict)
    llm: str = "engine"
    llm_options: dict = field(default_factory=dict)
    strategy: str = "exponential"
    max_streams: int = 0
    min_buffer_s: float = 0.0
    max_batch_frames: int | None = None
    max_batch_jobs: int | None = None
    voices_dir: str | None = None
    frontend_backend: str | None = None
    spk2info: str | None = None
    warm_up: bool = False
    torch_threads: int = 0

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "kind_options": _options_to_json(self.kind_options)})

    @classmethod
    def from_json(cls, text: str) -> "EngineSpec":
        values = json.loads(text)
        values["kind_options"] = _options_from_json(values["kind_options"])
        return cls(**values)


def _options_to_json(options: dict) -> dict:
    return {k: {"dtype": str(v).removeprefix("torch.")} if isinstance(v, torch.dtype) else
            list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def _options_from_json(options: dict) -> dict:
    return {k: getattr(torch, v["dtype"]) if isinstance(v, dict) and set(v) == {"dtype"} else
            tuple(v) if isinstance(v, list) else v for k, v in options.items()}


class ForwardedTokens:
    """The LLM back end of an engine whose tokens come from its front doors: a segment's LLM request
    is asked of the client that sent it (``llm``), whose ``tokens`` messages fill its stream."""

    def __init__(self, send) -> None:
        self._send = send  # (client, *message)
        self._owners: dict[str, bytes] = {}  # segment id -> client
        self._streams: dict[str, TokenStream] = {}
        self._lock = threading.Lock()

    def expect(self, segment_ids: list[str], client: bytes) -> None:
        with self._lock:
            self._owners.update(dict.fromkeys(segment_ids, client))

    def generate_stream(self, prompt_ids, params, request_id) -> TokenStream:
        with self._lock:
            client = self._owners[request_id]
            stream = self._streams[request_id] = TokenStream(request_id, lambda: self._stop(request_id))
        self._send(client, wire.LLM_START, request_id, list(prompt_ids), params.max_tokens, params.min_tokens)
        return stream

    def put(self, segment_id: str, tokens: list[int], end: list | None) -> None:
        with self._lock:
            stream = self._streams.get(segment_id)
            if end is not None:
                self._streams.pop(segment_id, None)
                self._owners.pop(segment_id, None)
        if stream is None:
            return
        for token in tokens:
            stream.put(token)
        if end is not None:
            stream.put(Finished(end[0], wire.unpack_error(end[1])))

    def _stop(self, segment_id: str) -> None:
        with self._lock:
            self._streams.pop(segment_id, None)
            client = self._owners.pop(segment_id, None)
        if client is not None:
            self._send(client, wire.LLM_STOP, segment_id)

    def forget(self, segment_ids: list[str]) -> None:
        with self._lock:
            for segment_id in segment_ids:
                self._owners.pop(segment_id, None)

    def register_prefix(self, key, ids) -> None:
        """The front door's LLM keeps its own prefixes."""

    def close(self) -> None:
        pass


class EngineServer:
    """Serves ``engine`` (:class:`~.service.TTSEngine` with its core in this process) at ``address``
    (``<address>-in`` / ``<address>-out``, ZMQ endpoints)."""

    def __init__(self, engine, address: str, outbox: queue.SimpleQueue, forwarded: ForwardedTokens | None,
                 info: dict) -> None:
        self.engine = engine
        self.core = engine.core
        self.outbox = outbox
        self.forwarded = forwarded
        self.info = info
        self.address = address
        self.context = zmq.Context()
        self.inbound = self.context.socket(zmq.ROUTER)
        self.inbound.bind(f"{address}-in")
        self.outbound = self.context.socket(zmq.ROUTER)
        self.outbound.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to a gone client raises: its requests end
        self.outbound.bind(f"{address}-out")
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}  # request id -> client (guarded by _lock)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="engine-sender", daemon=True)

    def serve(self, parent_pid: int | None = None) -> None:
        """Read requests until stopped (or the parent process is gone)."""
        self._sender.start()
        while not self._stopping.is_set():
            if self.inbound.poll(POLL_MS):
                client, frame = self.inbound.recv_multipart()
                try:
                    self._handle(client, wire.unpack(frame))
                except Exception:
                    log.exception("engine: a message from a front door could not be handled")
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("engine: the front door that started this process is gone; stopping")
                break
        self.close()

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        self._stopping.set()
        self.engine.close()  # requests still open end with an error, sent before the sender stops
        self.outbox.put(None)
        self._sender.join(timeout=10)
        self.inbound.close(0)
        self.outbound.close(0)
        self.context.term()
        wire.remove_socket_files(self.address)

    # ----- the main thread -----

    def _handle(self, client: bytes, message: list) -> None:
        kind = message[0]
        if kind == wire.SUBMIT:
            self._submit(client, *message[1:])
        elif kind == wire.CANCEL:
            self.core.cancel(message[1])
        elif kind == wire.VOICES:
            ticket = message[2]
            self.core.prepare_voices([wire.unpack_voice(voice) for voice in message[1]],
                                     done=None if ticket is None else
                                     lambda: self.outbox.put((client, wire.VOICES_DONE, ticket)))
        elif kind == wire.ARRIVING:
            self.core.voices_arriving([wire.unpack_voice(voice) for voice in message[1]])
        elif kind == wire.TOKENS:
            self.forwarded.put(*message[1:])
        elif kind == wire.HELLO:
            with self._lock:
                self.clients.add(client)
            self.outbox.put((client, wire.WELCOME, {**self.info, "stats": wire.pack_stats(self.core.stats())}))
        else:
            log.warning("engine: unknown message %r", kind)

    def _submit(self, client: bytes, request_id: str, segments: list, voice: dict, max_tokens: int, min_tokens: int,
                streaming: bool, timeout_s: float, arrival: float, tokens_from_client: bool) -> None:
        prompts = [SegmentPrompt(segment_id, "", ids) for segment_id, ids in segments]
        segment_ids = [prompt.request_id for prompt in prompts]

        def emit(pcm: np.ndarray) -> None:
            self.outbox.put((client, wire.PCM, request_id, pcm))

        trace: dict[str, float] = {}

        def finish(error: BaseException | None) -> None:
            with self._lock:
                self.owners.pop(request_id, None)
            if self.forwarded is not None:
                self.forwarded.forget(segment_ids)
            self.outbox.put((client, wire.FINISH, request_id, wire.pack_error(error), trace))

        try:
            if tokens_from_client and self.forwarded is None:
                raise InvalidInputError("this engine runs its own LLM: a front door cannot forward tokens to it")
            request = EngineRequest(request_id, iter(prompts), Voice("", wire.unpack_voice(voice)),
                                    TokenLimits(max_tokens, min_tokens), streaming, emit, finish, timeout_s, arrival,
                                    trace)
            if tokens_from_client:
                self.forwarded.expect(segment_ids, client)
            with self._lock:
                self.owners[request_id] = client
            self.core.submit(request)
        except Exception as exc:  # refused (capacity, a duplicate id, a bad voice): this request only
            finish(exc)

    # ----- the sender thread -----

    def _send_loop(self) -> None:
        next_stats = time.monotonic()
        while True:
            try:
                item = self.outbox.get(timeout=max(0.0, next_stats - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                client, kind, *body = item
                if kind == wire.PCM:
                    body[1] = np.ascontiguousarray(body[1], np.float32).tobytes()
                self._send(client, wire.pack(kind, *body))
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + wire.STATS_PERIOD_S
                stats = wire.pack(wire.STATS, wire.pack_stats(self.core.stats()))
                with self._lock:
                    clients = list(self.clients)
                for client in clients:
                    self._send(client, stats)

    def _send(self, client: bytes, frame: bytes) -> None:
        try:
            self.outbound.send_multipart([client, frame])
        except zmq.ZMQError:  # the client is gone (or not connected yet): nobody will read this
            with self._lock:
                known = client in self.clients
                self.clients.discard(client)
                orphans = [rid for rid, owner in self.owners.items() if owner == client]
            if known or orphans:
                log.warning("engine: front door %r is gone; cancelling its %d requests", client, len(orphans))
            for request_id in orphans:
                self.core.cancel(request_id)


def load(spec: EngineSpec, outbox: queue.SimpleQueue):
    """The engine of ``spec`` (its loop running) and the forwarded-tokens back end, if any."""
    from ..llm.backends import create_backend
    from .service import MODEL_KINDS, load_engine

    device = torch.device(spec.device)
    if spec.torch_threads or device.type == "cuda":  # the loop launches GPU work: one CPU thread for torch
        torch.set_num_threads(spec.torch_threads or 1)
    forwarded = None
    llm_backend = None
    if spec.llm == "client":
        forwarded = llm_backend = ForwardedTokens(lambda client, *message: outbox.put((client, *message)))
    elif spec.llm == "openai":
        llm_backend = create_backend("openai", spec.llm_dir, layout=MODEL_KINDS[spec.model].layout.name,
                                     **spec.llm_options)
    elif spec.llm != "engine":
        raise ValueError(f"unknown llm {spec.llm!r}: engine, openai or client")
    scheduler_options = {k: v for k, v in (("max_batch_frames", spec.max_batch_frames),
                                           ("max_batch_jobs", spec.max_batch_jobs)) if v is not None}
    engine = load_engine(spec.model, spec.model_dir, spec.llm_dir, device, kind_options=spec.kind_options,
                         llm_backend=llm_backend, llm_options=spec.llm_options if spec.llm == "engine" else None,
                         strategy=spec.strategy,
                         scheduler=Scheduler(spec.max_streams, spec.min_buffer_s, **scheduler_options),
                         voices_dir=Path(spec.voices_dir) if spec.voices_dir else None,
                         frontend_backend=spec.frontend_backend, spk2info=spec.spk2info, warm_up=spec.warm_up)
    return engine, forwarded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="ZMQ endpoint prefix (ipc://... or tcp://...)")
    parser.add_argument("--spec", required=True, help="EngineSpec as JSON")
    parser.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    spec = EngineSpec.from_json(args.spec)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    started = time.perf_counter()
    engine, forwarded = load(spec, outbox)
    info = {"sample_rate": engine.sample_rate, "model": spec.model, "pid": os.getpid(),
            "load_s": round(time.perf_counter() - started, 3)}
    server = EngineServer(engine, args.address, outbox, forwarded, info)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    log.info("engine: %s on %s ready in %.1f s at %s", spec.model, spec.device, info["load_s"], args.address)
    server.serve(args.parent_pid)


if __name__ == "__main__":
    main()
