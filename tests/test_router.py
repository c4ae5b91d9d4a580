"""TritonRouter's choices and failover (cosyserve/api/router.py) over stand-in TTS clients: which
server a stream goes to, what happens on refusals, outages and failures mid-stream, DNS changes.
tests/test_api.py runs the router over real Triton servers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from cosyserve.api.router import TritonRouter, resolve, split_urls
from cosyserve.api.triton import Synthesis

QUEUE_FULL = InferenceServerException(msg="Exceeds maximum queue size", status="StatusCode.UNAVAILABLE")
DOWN = InferenceServerException(msg="failed to connect to all addresses", status="StatusCode.UNAVAILABLE")
BAD_TEXT = InferenceServerException(msg="target_text has nothing to speak")


class FakeTTS:
    """What the router needs of a TritonTTS: ``stream`` yields ``chunks`` or raises ``fail`` (before
    the first chunk, or after ``fail_after`` chunks); ``ready``; ``close``."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.fail: Exception | None = None
        self.fail_after = 0
        self.chunks = 3
        self.is_ready = True
        self.calls = 0
        self.closed = False
        self.gate: asyncio.Event | None = None  # streams wait on it after their first chunk

    async def ready(self) -> bool:
        return self.is_ready

    async def stream(self, synthesis: Synthesis):
        self.calls += 1
        for i in range(self.chunks):
            if self.fail is not None and i == self.fail_after:
                raise self.fail
            yield np.full(4, i, np.float32)
            if self.gate is not None:
                await self.gate.wait()

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_router(urls: str = "a:1,b:1,c:1", resolver=lambda url: [url], **kwargs) -> tuple[TritonRouter, Clock]:
    clock = Clock()
    return TritonRouter(urls, resolver=resolver, clock=clock, connect=FakeTTS, **kwargs), clock


def tts(router: TritonRouter, url: str) -> FakeTTS:
    return router.backends[url].tts


async def collect(router: TritonRouter, voice: str | None = "001") -> list[np.ndarray]:
    return [chunk async for chunk in router.stream(Synthesis("hello", voice))]


def test_split_urls_takes_commas_and_rejects_what_is_not_host_port():
    assert split_urls("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert split_urls(["a:1,b:2", "c:3"]) == ["a:1", "b:2", "c:3"]
    for bad in ("", "a", "a:", ":1", "a:x"):
        with pytest.raises(ValueError):
            split_urls(bad)


def test_resolve_keeps_ip_literals_and_unresolvable_names_and_expands_localhost_once():
    assert resolve("10.1.2.3:8001") == ["10.1.2.3:8001"]
    assert resolve("[::1]:8001") == ["[::1]:8001"]
    assert resolve("no-such-host.invalid:8001") == ["no-such-host.invalid:8001"]
    assert resolve("localhost:8001") == ["127.0.0.1:8001"]


def test_a_voice_sticks_to_one_server_and_voices_spread():
    router, _ = make_router()
    first = {voice: router.order(voice)[0].url for voice in (f"v{i}" for i in range(60))}
    assert all(router.order(voice)[0].url == url for voice, url in first.items())  # stable
    assert set(first.values()) == {"a:1", "b:1", "c:1"}  # rendezvous hashing spreads voices


def test_affinity_yields_to_load_past_the_slack():
    router, _ = make_router(affinity_slack=2)
    home = router.order("001")[0]
    home.streams = 2
    assert router.order("001")[0] is home  # 2 more than the idle ones: still within the slack
    home.streams = 3
    choice = router.order("001")[0]
    assert choice is not home and choice.streams == 0


def test_without_a_voice_the_least_loaded_server_goes_first_and_ties_rotate():
    router, _ = make_router()
    router.backends["a:1"].streams = 1
    assert router.order(None)[0].url in ("b:1", "c:1")
    firsts = {router.order(None)[0].url for _ in range(4)}
    assert firsts == {"b:1", "c:1"}
    assert router.order(None)[-1].url == "a:1"


def test_an_overloaded_server_hands_the_request_to_the_next_and_is_passed_over_for_a_while():
    router, clock = make_router(overload_backoff_s=1.0)
    home = router.order("001")[0]
    home.tts.fail = QUEUE_FULL
    chunks = asyncio.run(collect(router))
    assert len(chunks) == 3
    assert home.failovers == {"overloaded": 1} and home.streams == 0 and home.tts.calls == 1
    served = [b for b in router.backends.values() if b.served]
    assert len(served) == 1 and served[0] is not home
    assert router.order("001")[-1] is home  # passed over: tried last
    clock.now += 1.01
    assert router.order("001")[0] is home  # back after the backoff


def test_an_unreachable_server_is_skipped_and_marked_not_ready():
    router, clock = make_router(down_backoff_s=5.0)
    home = router.order("001")[0]
    home.tts.fail = DOWN
    assert len(asyncio.run(collect(router))) == 3
    assert home.failovers == {"unavailable": 1} and home.ready is False
    clock.now += 2
    assert router.order("001")[-1] is home
    # a health check that finds it ready again ends the backoff at once
    home.tts.fail = None
    assert asyncio.run(router.ready()) is True
    assert home.ready is True and router.order("001")[0] is home


def test_when_every_server_refuses_the_client_gets_the_last_refusal():
    router, _ = make_router()
    for backend in router.backends.values():
        backend.tts.fail = QUEUE_FULL
    with pytest.raises(InferenceServerException, match="Exceeds maximum queue size"):
        asyncio.run(collect(router))
    assert sum(b.tts.calls for b in router.backends.values()) == 3
    assert all(b.streams == 0 for b in router.backends.values())


def test_an_error_of_the_request_itself_is_not_retried_elsewhere():
    router, _ = make_router()
    home = router.order("001")[0]
    home.tts.fail = BAD_TEXT
    with pytest.raises(InferenceServerException, match="nothing to speak"):
        asyncio.run(collect(router))
    assert sum(b.tts.calls for b in router.backends.values()) == 1 and home.failovers == {}


def test_a_server_dying_mid_stream_ends_that_stream_with_an_error_and_new_ones_go_elsewhere():
    router, _ = make_router()
    home = router.order("001")[0]
    home.tts.fail, home.tts.fail_after = DOWN, 1

    async def partial():
        got = []
        with pytest.raises(InferenceServerException):
            async for chunk in router.stream(Synthesis("hello", "001")):
                got.append(chunk)
        return got
    assert len(asyncio.run(partial())) == 1  # audio already sent is not replayed from another server
    assert home.ready is False and home.streams == 0
    assert router.order("001")[0] is not home


def test_streams_count_while_open_and_an_abandoned_stream_releases_its_server():
    router, _ = make_router()

    async def scenario():
        home = router.order("001")[0]
        home.tts.gate = asyncio.Event()
        stream = router.stream(Synthesis("hello", "001"))
        await anext(stream)
        assert home.streams == 1 and router.order(None)[-1] is home
        await stream.aclose()  # the HTTP client went away
        assert home.streams == 0
    asyncio.run(scenario())


def test_servers_follow_dns_and_a_vanished_one_is_closed_once_its_streams_end():
    addresses = {"svc:8001": ["10.0.0.1:8001", "10.0.0.2:8001"]}
    router, clock = make_router("svc:8001", resolver=lambda url: list(addresses[url]), resolve_every_s=10)
    assert list(router.backends) == ["10.0.0.1:8001", "10.0.0.2:8001"]

    async def scenario():
        leaving = router.backends["10.0.0.1:8001"]
        leaving.tts.gate = asyncio.Event()
        stream = router.stream(Synthesis("hello", None))
        await anext(stream)
        if leaving.streams == 0:  # the tie went to the other pod: use that one instead
            leaving = router.backends["10.0.0.2:8001"]
        addresses["svc:8001"] = [a for a in ("10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001") if a != leaving.url]
        clock.now += 10
        await router.refresh()
        assert leaving.removed and leaving.url in router.backends  # still streaming
        assert leaving not in router.order(None) and "10.0.0.3:8001" in router.backends
        leaving.tts.gate.set()
        assert len([c async for c in stream]) == 2
        assert leaving.url not in router.backends and leaving.tts.closed
    asyncio.run(scenario())


def test_bench_api_reads_the_error_envelope_and_finds_the_best_clean_rate():
    from cosyserve.bench.api_load import _error_text, best_clean_rate

    assert _error_text(429, b'{"error": {"code": "overloaded", "message": "Exceeds maximum queue size"}}') == \
        "429 overloaded: Exceeds maximum queue size"
    assert _error_text(502, b"<html>bad gateway</html>") == "502: <html>bad gateway</html>"

    def summary(rate, failed, stalled):
        return {"open_loop": {"arrival_rate": rate}, "failed": failed, "underruns": {"requests_with_underrun": stalled}}
    assert best_clean_rate([summary(1, 0, 0), summary(2, 0, 0), summary(5, 0, 3), summary(10, 2, 0)]) == 2
    assert best_clean_rate([summary(1, 1, 0)]) is None


def test_bench_api_splits_failures_at_a_fault_by_arrival():
    """bench_api's --kill-after: requests that arrived after the kill must all be served; those before
    may end with an error (they were on the killed server), and the split says which is which."""
    from cosyserve.bench.api_load import fault_split
    from cosyserve.clients import RequestResult

    results = [RequestResult("a"), RequestResult("b", error="502 server_error: stream ended"), RequestResult("c"),
               RequestResult("d", error="503 unavailable: no server")]
    split = fault_split(results, [0.0, 1.0, 2.5, 3.0], fault_at_s=2.0)
    assert (split["arrived_before"], split["failed_before"], split["arrived_after"], split["failed_after"]) == (2, 1, 2, 1)
    assert split["errors_before"] == ["502 server_error: stream ended"]
    assert split["errors_after"] == ["503 unavailable: no server"]


def test_the_request_model_selects_a_served_model_or_the_default():
    from cosyserve.api.app import model_for
    from cosyserve.api.errors import APIError

    served = ["cosyvoice2", "cosyvoice3"]
    assert model_for("cosyvoice3", served, "cosyvoice2") == "cosyvoice3"
    assert model_for("cosyvoice2", served, "cosyvoice2") == "cosyvoice2"
    for openai_name in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts"):  # clients hard-code these
        assert model_for(openai_name, served, "cosyvoice2") == "cosyvoice2"
    with pytest.raises(APIError, match="not served here; served: cosyvoice2") as raised:
        model_for("CosyVoice3", ["cosyvoice2"], "cosyvoice2")
    assert raised.value.status == 404
