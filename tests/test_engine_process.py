"""The engine core in a process of its own, fed over ZMQ by an EngineClient (the servers' layout).

Each test starts a real engine process on the tiny CosyVoice2 bundle (CPU): a stream and an
offline request through it, admission refusals, cancellation, stats, tokens forwarded from the
front door's side, and the death of the process (requests in flight end at once; it starts again).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from cosyserve.engine.client import EngineClient, remove_orphaned_socket_files
from cosyserve.engine.process import EngineSpec
from cosyserve.engine.runners.llm import BackendLLM
from cosyserve.engine.service import TTSEngine, load_frontend
from cosyserve.engine.wire import EngineProcessError
from cosyserve.errors import CapacityError, RequestCancelledError
from cosyserve.llm.stream import Finished, TokenStream
from cosyserve.engine.front_end import TokenLimits, TTSRequest

TOKENS = 30  # speech tokens per reply (min = max): 30 x 960 samples


def spec_for(bundle, **overrides) -> EngineSpec:
    values = dict(model="cosyvoice2", model_dir=str(bundle / "CosyVoice2-0.5B"), llm_dir=str(bundle / "cosyvoice2_llm"),
                  device="cpu", kind_options={"flow_dtype": torch.float32, "state_pool_bytes": 128 << 20},
                  llm_options={"max_slots": 8, "max_model_len": 1024})
    return EngineSpec(**{**values, **overrides})


@pytest.fixture(scope="module")
def frontend(tiny_bundle):
    return load_frontend("cosyvoice2", tiny_bundle / "CosyVoice2-0.5B", tiny_bundle / "cosyvoice2_llm",
                         torch.device("cpu"))


def served(spec: EngineSpec, frontend, token_source=None) -> TTSEngine:
    client = EngineClient.spawn(spec, token_source=token_source).wait_ready(300)
    return TTSEngine(client, *frontend)


@pytest.fixture(scope="module")
def engine(tiny_bundle, frontend):
    engine = served(spec_for(tiny_bundle, max_streams=2), frontend)
    yield engine
    engine.close()


def request(engine: TTSEngine, request_id: str, tokens: int = TOKENS) -> TTSRequest:
    return TTSRequest(request_id, "收到好友从远方寄来的生日礼物。", engine.voices.resolve(), TokenLimits(tokens, tokens))


class Collector:
    """One request's emits and its end, as a front door's callbacks."""

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []
        self.ended: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, engine: TTSEngine, req: TTSRequest, streaming: bool = True) -> "Collector":
        engine.submit(req, streaming=streaming, emit=self.pieces.append, finish=self.ended.put)
        return self

    def end(self, timeout: float = 120) -> BaseException | None:
        return self.ended.get(timeout=timeout)


def test_streams_and_offline_requests_through_the_process(engine):
    assert engine.sample_rate == 24000 and engine.core.info["model"] == "cosyvoice2"
    assert engine.core.info["pid"] != os.getpid()
    streams = [Collector().submit(engine, request(engine, f"s{k}")) for k in range(2)]
    for stream in streams:
        assert stream.end() is None
        assert len(stream.pieces) > 1  # chunk by chunk
        assert sum(p.size for p in stream.pieces) == TOKENS * 960
    audio = engine.synthesize(request(engine, "offline"))
    assert audio.dtype == np.float32 and audio.size == TOKENS * 960 and np.abs(audio).max() > 0
    time.sleep(0.6)  # a stats message or two
    stats = engine.stats()
    assert stats.requests == 0 and stats.counters["requests_finished"] >= 3
    assert stats.counters["tokens"] >= 3 * TOKENS and stats.counters["llm_busy_s"] > 0
    assert "open_streams" in stats.gauges and stats.gauges["open_streams"][1] == 0


def test_an_uploaded_voice_is_prepared_and_answered_through_the_process(engine):
    """prepare_voice's ``done`` comes back from the engine process once its loop has prepared the
    voice (its voice counter has moved by then); a request of that voice then streams."""
    wav = np.random.default_rng(3).uniform(-0.5, 0.5, 16000 * 3).astype(np.float32)
    voice = engine.voices.resolve(wav, "希望你以后能够做的比我还好呦。")
    before = engine.stats().counters["voice_s"]
    answered = threading.Event()
    engine.prepare_voice(voice, done=answered.set)
    assert answered.wait(60)
    deadline = time.monotonic() + 10
    while engine.stats().counters["voice_s"] <= before and time.monotonic() < deadline:
        time.sleep(0.05)  # the counters come with the next stats message
    assert engine.stats().counters["voice_s"] > before
    req = TTSRequest("uploaded", "收到好友从远方寄来的生日礼物。", voice, TokenLimits(TOKENS, TOKENS))
    collector = Collector().submit(engine, req)
    assert collector.end() is None and sum(p.size for p in collector.pieces) == TOKENS * 960


def test_a_new_clips_voice_is_prepared_as_the_front_end_computes_it(engine):
    """A new clip resolved by the front door (no request sent yet) reaches the engine process at once
    (voices_arriving): its voice is kept there before any request brings it."""
    def cached() -> float:
        return engine.stats().gauges["voices_cached"][1]

    before = cached()
    wav = np.random.default_rng(5).uniform(-0.5, 0.5, 16000 * 3).astype(np.float32)
    engine.voices.resolve(wav, "希望你以后能够做的比我还好呦。")
    deadline = time.monotonic() + 30
    while cached() <= before and time.monotonic() < deadline:
        time.sleep(0.05)  # the gauges come with the next stats message
    assert cached() == before + 1


def test_refusals_and_cancellation_end_their_request_only(engine):
    first = [Collector().submit(engine, request(engine, f"busy{k}", 200)) for k in range(2)]
    refused = Collector().submit(engine, request(engine, "refused"))
    error = refused.end(30)
    assert isinstance(error, CapacityError) and "overloaded" in str(error)
    engine.cancel("busy0")
    assert isinstance(first[0].end(30), RequestCancelledError)
    engine.cancel("busy1")
    assert isinstance(first[1].end(30), RequestCancelledError)
    assert Collector().submit(engine, request(engine, "after")).end() is None


class ScriptedSource:
    """A front door's own LLM (as a Triton LLM model): fixed tokens per segment, from a thread."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.asked: list[str] = []

    def generate_stream(self, prompt_ids, params, request_id) -> TokenStream:
        self.asked.append(request_id)
        stream = TokenStream(request_id, lambda: None)

        def produce() -> None:
            for token in range(min(self.tokens, params.max_tokens)):
                stream.put(token * 7 % 6561)
                time.sleep(0.001)
            stream.put(Finished("stop"))
        threading.Thread(target=produce, daemon=True).start()
        return stream

    def close(self) -> None:
        pass


def test_tokens_forwarded_from_the_front_door(tiny_bundle, frontend):
    source = ScriptedSource(25)
    engine = served(spec_for(tiny_bundle, llm="client", llm_options={}), frontend, BackendLLM(source))
    try:
        collector = Collector().submit(engine, request(engine, "fwd", 40))
        assert collector.end() is None
        assert source.asked == ["fwd"] and sum(p.size for p in collector.pieces) == 25 * 960
    finally:
        engine.close()


def test_a_killed_engine_ends_its_requests_and_starts_again(tiny_bundle, frontend):
    engine = served(spec_for(tiny_bundle), frontend)
    try:
        long = Collector().submit(engine, request(engine, "long", 400))
        while not long.pieces:
            time.sleep(0.01)
        pid = engine.core.process.pid
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        error = long.end(10)
        assert isinstance(error, EngineProcessError) and "exited with code -9" in str(error)
        assert time.monotonic() - killed < 2
        with pytest.raises(CapacityError, match="restarting"):
            engine.submit(request(engine, "meanwhile"), streaming=True, emit=lambda pcm: None, finish=lambda e: None)
        engine.core.wait_ready(300)
        assert engine.core.process.pid != pid
        collector = Collector().submit(engine, request(engine, "again"))
        assert collector.end() is None and sum(p.size for p in collector.pieces) == TOKENS * 960
    finally:
        engine.close()
    assert engine.core.process.poll() is not None  # close stops the process it started
    # and removes its socket files, which the killed engine left behind
    socket_file = engine.core.address.removeprefix("ipc://")
    assert not os.path.exists(f"{socket_file}-in") and not os.path.exists(f"{socket_file}-out")


def test_socket_files_of_gone_front_doors_are_removed(tmp_path):
    """A front door and its engine killed together leave their socket files; the next spawn removes
    those of front doors that are gone, and no other file."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    names = {pid: [f"cosyserve-engine-{pid}-0a1b2c3d-in", f"cosyserve-engine-{pid}-0a1b2c3d-out"]
             for pid in (gone.pid, os.getpid())}
    others = ["cosyserve-engine-notes.txt", f"other-{gone.pid}-0a1b2c3d-in"]
    for name in [*names[gone.pid], *names[os.getpid()], *others]:
        (tmp_path / name).touch()
    removed = remove_orphaned_socket_files(tmp_path)
    assert sorted(path.name for path in removed) == sorted(names[gone.pid])
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*names[os.getpid()], *others])
