"""One endpoint in front of several Triton servers: :class:`TritonRouter` spreads speech streams
over them (the same ``stream`` / ``ready`` / ``close`` as one :class:`~.triton.TritonTTS`).

Which server takes a stream:

* **Affinity by voice, bounded by load.** Servers are ranked per voice by rendezvous hashing
  (highest ``blake2b(voice | server)`` first), so the same voice keeps landing on the same server
  and that server's per-voice caches (the token2wav engine's prompt state, the LLM's prompt
  prefix) keep hitting. A ranked server is taken only while it runs at most ``affinity_slack``
  streams more than the least loaded one; past that the stream goes to the least loaded server.
  A request without a voice key goes to the least loaded server (ties in turn).
* **Failover before the first audio.** A server that refuses the request as overloaded (its
  queue bound, the token2wav state pool: HTTP 429's class, :func:`~.errors.triton_error`) or
  cannot be reached / is not ready (503's class) is skipped for ``overload_backoff_s`` /
  ``down_backoff_s`` and the same request goes to the next server. Such a request never started
  there, so trying it elsewhere is safe. Only when every server refused does the client see the
  last error. A failure after audio has been sent is passed on (the stream cannot be replayed
  elsewhere without repeating audio); a server that dies mid-stream therefore ends its streams
  with an error, and new requests go elsewhere.
* **Discovery.** Each configured ``host:port`` is resolved to all of its addresses (a Kubernetes
  headless service lists every pod), again every ``resolve_every_s`` seconds: pods that appear are
  added, and pods that vanish are dropped once their streams have ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import itertools
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tritonclient.utils import InferenceServerException

from .errors import triton_error
from .triton import Synthesis, TritonTTS

# Statuses (of :func:`triton_error`) after which a request is tried on another server, and how long
# the server is then passed over: a full queue clears in about a chunk's time, a dead server takes
# a restart.
OVERLOADED, UNAVAILABLE = 429, 503
OVERLOAD_BACKOFF_S = 1.0
DOWN_BACKOFF_S = 5.0
AFFINITY_SLACK = 2
RESOLVE_EVERY_S = 10.0


def split_urls(value: str | Sequence[str]) -> list[str]:
    """``host:port`` addresses from a comma-separated string (or a list of such strings)."""
    parts = [value] if isinstance(value, str) else list(value)
    urls = [u.strip() for part in parts for u in part.split(",") if u.strip()]
    if not urls:
        raise ValueError("no Triton gRPC address given")
    for url in urls:
        host, sep, port = url.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"Triton gRPC address {url!r} is not host:port")
    return list(dict.fromkeys(urls))


def resolve(url: str) -> list[str]:
    """``host:port`` -> one ``address:port`` per address of host (sorted; IPv4 ones only when there are
    any); an IP literal stays as it is, and a name that does not resolve (yet) keeps its own name, so
    the gRPC client retries it."""
    host, _, port = url.rpartition(":")
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return [url]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return [url]
    addresses = sorted({info[4][0] for info in infos})
    ipv4 = [a for a in addresses if ":" not in a]
    addresses = ipv4 or addresses  # "localhost" is one server, not one per address family
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses] or [url]


@dataclass
class Backend:
    """One Triton server as the router sees it."""

    url: str
    tts: TritonTTS
    streams: int = 0  # open streams through this router
    passed_over_until: float = 0.0  # monotonic time before which it is tried only as a last resort
    ready: bool | None = None  # the last health check (None: not checked yet)
    served: int = 0  # streams that delivered audio from it
    failovers: Counter = field(default_factory=Counter)  # requests moved away from it, by reason
    removed: bool = False  # its address vanished from DNS: no new streams, closed once idle


class TritonRouter:
    """Streams over the Triton servers of ``urls`` (each resolved to all its addresses)."""

    def __init__(self, urls: str | Sequence[str], model: str = "cosyvoice2", *, affinity_slack: int = AFFINITY_SLACK,
                 overload_backoff_s: float = OVERLOAD_BACKOFF_S, down_backoff_s: float = DOWN_BACKOFF_S,
                 resolve_every_s: float = RESOLVE_EVERY_S, resolver: Callable[[str], list[str]] = resolve,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Callable[[str, str], TritonTTS] = TritonTTS):
        self.urls = split_urls(urls)
        self.model = model
        self.affinity_slack = affinity_slack
        self.overload_backoff_s = overload_backoff_s
        self.down_backoff_s = down_backoff_s
        self.resolve_every_s = resolve_every_s
        self._resolver = resolver
        self._clock = clock
        self._connect = connect
        self._turn = itertools.count()
        self._resolved_at = clock()
        self.backends: dict[str, Backend] = {}
        self._update(self._resolve_all())

    # ----- the set of servers -----

    def _resolve_all(self) -> list[str]:
        return list(dict.fromkeys(address for url in self.urls for address in self._resolver(url)))

    def _update(self, addresses: list[str]) -> list[Backend]:
        """Add new addresses, mark vanished ones; returns backends now idle and removed (to close)."""
        for address in addresses:
            backend = self.backends.get(address)
            if backend is None:
                self.backends[address] = Backend(address, self._connect(address, self.model))
            else:
                backend.removed = False
        for address, backend in self.backends.items():
            if address not in addresses:
                backend.removed = True
        return self._drop_idle_removed()

    def _drop_idle_removed(self) -> list[Backend]:
        gone = [b for b in self.backends.values() if b.removed and b.streams == 0]
        for backend in gone:
            del self.backends[backend.url]
        return gone

    async def refresh(self, force: bool = False) -> None:
        """Re-resolve the configured names (at most every ``resolve_every_s`` unless ``force``)."""
        now = self._clock()
        if not force and now - self._resolved_at < self.resolve_every_s:
            return
        self._resolved_at = now
        addresses = await asyncio.to_thread(self._resolve_all)
        for backend in self._update(addresses):
            await backend.tts.close()

    # ----- choosing -----

    def order(self, voice: str | None) -> list[Backend]:
        """The servers to try for a stream of ``voice``, first choice first (see the module docstring)."""
        now = self._clock()
        live = [b for b in self.backends.values() if not b.removed]
        usable = [b for b in live if b.passed_over_until <= now]
        passed_over = sorted((b for b in live if b.passed_over_until > now), key=lambda b: b.passed_over_until)
        if not usable:
            return passed_over
        # ties in load are broken in turn, so idle servers share the requests
        turn = next(self._turn)
        position = {url: i for i, url in enumerate(self.backends)}
        by_load = sorted(usable, key=lambda b: (b.streams, (position[b.url] - turn) % len(position)))
        first: list[Backend] = []
        if voice:
            least = by_load[0].streams
            ranked = sorted(usable, key=lambda b: _affinity(voice, b.url), reverse=True)
            first = [b for b in ranked if b.streams <= least + self.affinity_slack][:1]
        return first + [b for b in by_load if b not in first] + passed_over

    # ----- streaming -----

    async def stream(self, synthesis: Synthesis) -> AsyncIterator[np.ndarray]:
        """The waveform chunks of one synthesis from the first server that takes it; raises the
        last server's InferenceServerException when none does (see the module docstring)."""
        await self.refresh()
        candidates = self.order(synthesis.speaker_id)
        if not candidates:
            raise InferenceServerException(msg=f"no Triton server is known for {', '.join(self.urls)}",
                                           status="StatusCode.UNAVAILABLE")
        last_error: InferenceServerException | None = None
        for backend in candidates:
            backend.streams += 1
            chunks = backend.tts.stream(synthesis)
            try:
                try:
                    first = await anext(chunks)
                except StopAsyncIteration:
                    return
                except InferenceServerException as exc:
                    reason = self._passed_over(backend, exc)
                    if reason is None:
                        raise
                    backend.failovers[reason] += 1
                    last_error = exc
                    continue
                backend.ready = True
                backend.served += 1
                yield first
                try:
                    async for chunk in chunks:
                        yield chunk
                except InferenceServerException as exc:
                    self._passed_over(backend, exc)  # a server dying mid-stream: new streams go elsewhere
                    raise
                return
            finally:
                await chunks.aclose()
                backend.streams -= 1
                for gone in self._drop_idle_removed():
                    await gone.tts.close()
        assert last_error is not None
        raise last_error

    async def prepare_voice(self, voice_id: str) -> None:
        """Have the server this voice's streams go to first compute and keep its state (a voice just
        uploaded); raises its InferenceServerException."""
        await self.refresh()
        candidates = self.order(voice_id)
        if candidates:
            async for _ in candidates[0].tts.stream(Synthesis(".", voice_id, prepare_voice=True)):
                pass

    def _passed_over(self, backend: Backend, exc: InferenceServerException) -> str | None:
        """Pass ``backend`` over for a while if ``exc`` says it is overloaded or unavailable; returns
        which ("overloaded", "unavailable"), or None for an error of the request itself."""
        status = triton_error(exc).status
        if status == OVERLOADED:
            backend.passed_over_until = self._clock() + self.overload_backoff_s
            return "overloaded"
        if status == UNAVAILABLE:
            backend.passed_over_until = self._clock() + self.down_backoff_s
            backend.ready = False
            return "unavailable"
        return None

    # ----- health -----

    async def ready(self) -> bool:
        """Checks every server; True when at least one is ready (those that are not are passed over)."""
        await self.refresh()
        backends = [b for b in self.backends.values() if not b.removed]
        answers = await asyncio.gather(*(b.tts.ready() for b in backends))
        now = self._clock()
        for backend, ok in zip(backends, answers):
            if ok and backend.ready is False:  # back after being down: no need to wait out its backoff
                backend.passed_over_until = 0.0
            elif not ok:
                backend.passed_over_until = max(backend.passed_over_until, now + self.down_backoff_s)
            backend.ready = ok
        return any(answers)

    def status(self) -> list[dict]:
        """Per server: address, last readiness, open streams, streams served, failovers by reason."""
        return [{"url": b.url, "ready": b.ready, "streams": b.streams, "served": b.served,
                 "failovers": dict(b.failovers)} for b in self.backends.values()]

    async def close(self) -> None:
        for backend in self.backends.values():
            await backend.tts.close()


def _affinity(voice: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{voice}|{url}".encode(), digest_size=8).digest(), "big")
