"""The engine core's loop against a fake kind and a fake LLM (no model): batches, the PCM's way out
(at most MAX_BATCHES_IN_FLIGHT batches launched and not handed out), and failures and cancellations
that end only their own requests."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosyserve.engine import core as core_module
from cosyserve.engine.core import MAX_BATCHES_IN_FLIGHT, EngineCore
from cosyserve.engine.front_end import SegmentPrompt, TokenLimits
from cosyserve.engine.request import EngineRequest
from cosyserve.engine.scheduler import Scheduler
from cosyserve.errors import RequestCancelledError
from cosyserve.llm.stream import Finished, TokenStream
from cosyserve.schedule import SAMPLES_PER_TOKEN, ChunkScheduler, plan_chunks

BAD_TOKEN = 6560  # a chunk holding it fails in the fake kind's solve


@dataclass(eq=False)
class FakeJob:
    finalize: bool
    tokens: int  # tokens it voices
    bad: bool
    done: bool = False
    voice: object = None  # its stream's voice

    @property
    def frames(self) -> int:
        return 2 * self.tokens


@dataclass(eq=False)
class FakeVoicing:
    voice: object = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class FakeKind:
    """PCM of a chunk: 960 samples per token it voices, each equal to the chunk's index in its stream."""

    name: str = "fake"
    sample_rate: int = 24000
    device: torch.device = torch.device("cpu")
    max_voices: int = 0
    final_full_pass: bool = True  # final chunks (and offline requests) are passes: never batched with windows
    cold_start: bool = False  # True: voices are objects with key() (FakeVoice)
    prepares_beside: bool = False  # True: prepare_voices is called on the core's preparation thread
    batches: list[int] = field(default_factory=list)  # jobs per solved batch
    aborted: int = 0
    prepared: list[list] = field(default_factory=list)  # the voices of each prepare_voices call that succeeded
    events: list[str] = field(default_factory=list)  # prepare (voices) and solve (batches), in order
    threads: list[str] = field(default_factory=list)  # the thread of each prepare_voices call that succeeded
    launching_voices: set = field(default_factory=set)  # voices "being launched on another thread"
    unsolvable_voices: set = field(default_factory=set)  # voices whose streams' jobs are not solvable yet
    started: list = field(default_factory=list)  # the voice of each chunk started
    computing: threading.Event = field(default_factory=lambda: _set_event())  # cleared: "the device is computing"
    prompt_frames: int = 0  # frames a stream's first window carries for its voice (cold_frames)

    def chunk_schedule(self, strategy: str) -> ChunkScheduler:
        return ChunkScheduler(strategy)

    def gauges(self) -> dict:
        return {}

    def prepare_voices(self, voices) -> None:
        if "bad voice" in voices:
            raise ValueError("bad voice")
        self.prepared.append(list(voices))
        self.events.append("prepare")
        self.threads.append(threading.current_thread().name)

    def keeps(self, features) -> bool:
        return any(features in voices for voices in self.prepared)

    def launching(self, features) -> bool:
        return features in self.launching_voices

    def wait_prepared(self, voices) -> None:
        self.computing.wait(5)

    def cold_frames(self, features) -> int:
        return self.prompt_frames

    def open(self, features) -> FakeVoicing:
        assert features not in self.launching_voices, "open would wait for the voice's launch"
        if features == "bad voice":
            raise ValueError("bad voice")
        return FakeVoicing(features)

    def start_chunks(self, chunks) -> list[FakeJob]:
        self.started += [voicing.voice for voicing, _, _, _ in chunks]
        return [FakeJob(final, len(tokens) - offset if final else len(tokens) - offset - 3, BAD_TOKEN in tokens,
                        voice=voicing.voice) for voicing, tokens, offset, final in chunks]

    def solvable(self, job: FakeJob) -> bool:
        return job.voice not in self.unsolvable_voices

    def start_offline(self, features, tokens) -> FakeJob:
        return FakeJob(True, len(tokens), BAD_TOKEN in tokens)

    def solve(self, jobs: list[FakeJob]) -> None:
        assert not any(job.done for job in jobs)
        assert all(self.solvable(job) for job in jobs), "a job solved before the kind could"
        if any(job.bad for job in jobs):
            raise RuntimeError("bad chunk")
        assert len({job.finalize for job in jobs}) == 1, "a batch of passes and windows"
        self.batches.append(len(jobs))
        self.events.append("solve")
        for job in jobs:
            job.done = True

    def mel(self, job: FakeJob) -> torch.Tensor:
        return torch.zeros(1, 80, job.frames)

    def abort(self, jobs) -> None:
        self.aborted += len(jobs)

    def vocode(self, items) -> list[torch.Tensor]:
        return [torch.full((mel.size(2) * 480,), float(mel.size(2))) for _, mel, _ in items]


class FakeLLM:
    """Every request's tokens are there at once (``tokens`` of them, id 1; BAD_TOKEN for ids [0])."""

    generating = None

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def submit(self, prompt_ids, request_id, limits) -> TokenStream:
        stream = TokenStream(request_id, on_close=lambda: None)
        token = BAD_TOKEN if prompt_ids == [0] else 1
        for _ in range(self.tokens):
            stream.put(token)
        stream.put(Finished("length"))
        return stream

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@dataclass
class Listener:
    pieces: list[np.ndarray] = field(default_factory=list)
    ended: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


def submit(core: EngineCore, request_id: str, *, bad: bool = False, streaming: bool = True,
           voice: object = None) -> Listener:
    listener = Listener()
    segments = iter([SegmentPrompt(request_id, "text", [0] if bad else [1])])
    core.submit(EngineRequest(request_id, segments, SimpleNamespace(features=voice), TokenLimits(200, 0), streaming,
                              listener.pieces.append, listener.ended.put))
    return listener


class HeldCopy:
    """HostCopy whose copy is never done until the loop waits for it (how a busy GPU looks)."""

    made: list["HeldCopy"] = []

    def __init__(self, tensors) -> None:
        self.tensors = tensors
        self.taken = False
        HeldCopy.made.append(self)

    def ready(self) -> bool:
        return False

    def wait(self, timeout_s: float) -> bool:
        time.sleep(timeout_s)
        return False

    def arrays(self) -> list[np.ndarray]:
        self.taken = True
        return [t.numpy() for t in self.tensors]


def test_streams_are_voiced_in_batches_and_in_order():
    tokens = 150
    kind = FakeKind()
    core = EngineCore(kind, FakeLLM(tokens)).start()
    try:
        listeners = [submit(core, f"r{k}") for k in range(6)] + [submit(core, "offline", streaming=False)]
        for listener in listeners:
            assert listener.ended.get(timeout=30) is None
    finally:
        core.close()
    chunks = plan_chunks(tokens)
    for listener in listeners[:-1]:
        voiced = [2 * (c.num_tokens - c.token_offset - (0 if c.finalize else 3)) for c in chunks]
        assert [p.size for p in listener.pieces] == [480 * f for f in voiced]
        assert [p[0] for p in listener.pieces] == voiced  # in the stream's order
    assert sum(p.size for p in listeners[-1].pieces) == tokens * SAMPLES_PER_TOKEN
    assert max(kind.batches) > 1 and sum(kind.batches) == 6 * len(chunks) + 1
    assert core.counters.flow_batches == len(kind.batches) and core.counters.chunks == sum(kind.batches)


@pytest.mark.parametrize("prompt_frames, first_batch", [(0, 4), (1500, 2), (4000, 1)])
def test_a_streams_first_window_counts_the_prompt_it_carries(prompt_frames, first_batch):
    """The batch's frame budget (4,096) holds the prompts that cold streams' first windows carry
    (CosyVoice3's new clips): new clips arriving together are spread over batches instead of making
    one batch that holds up every playing stream's next chunk."""
    kind = FakeKind(prompt_frames=prompt_frames)
    core = EngineCore(kind, FakeLLM(30))  # not started: stepped here
    listeners = [submit(core, f"r{k}") for k in range(4)]
    core.step()
    assert kind.batches == [first_batch]
    for _ in range(50):
        core.step()
    for listener in listeners:
        assert listener.ended.get(timeout=5) is None
    core.close()


def test_the_kind_is_warmed_up_on_the_thread_that_then_vocodes(monkeypatch):
    """cuDNN keeps its convolution plans per thread: a warm-up on another thread would leave the loop's
    first chunks to build them again."""
    kind, threads = FakeKind(), []
    vocode = kind.vocode
    monkeypatch.setattr(kind, "vocode", lambda items: threads.append(threading.get_ident()) or vocode(items))
    core = EngineCore(kind, FakeLLM(30)).start(warm_up=lambda: threads.append(("warm-up", threading.get_ident())))
    try:
        assert submit(core, "r").ended.get(timeout=30) is None
    finally:
        core.close()
    (label, warm_thread), *vocoding = threads
    assert label == "warm-up" and warm_thread != threading.get_ident() and set(vocoding) == {warm_thread}


def test_a_failed_warm_up_is_raised_by_start_and_leaves_no_loop():
    def fail():
        raise RuntimeError("no device memory for the graphs")

    core = EngineCore(FakeKind(), FakeLLM(30))
    with pytest.raises(RuntimeError, match="no device memory"):
        core.start(warm_up=fail)
    assert core._thread is None
    core.start()  # a later start runs the loop
    try:
        assert submit(core, "r").ended.get(timeout=30) is None
    finally:
        core.close()


def test_at_most_two_batches_are_out_before_the_loop_waits_for_the_oldest(monkeypatch):
    monkeypatch.setattr(core_module, "HostCopy", HeldCopy)
    HeldCopy.made = []
    core = EngineCore(FakeKind(), FakeLLM(30), scheduler=Scheduler(max_batch_jobs=1))  # not started: stepped here
    listeners = [submit(core, f"r{k}") for k in range(MAX_BATCHES_IN_FLIGHT + 1)]
    for k in range(MAX_BATCHES_IN_FLIGHT):
        core.step()
        assert len(HeldCopy.made) == k + 1 and not any(c.taken for c in HeldCopy.made)
    assert not any(listener.pieces for listener in listeners)
    core.step()  # a third batch: the first one's PCM is handed out first
    assert len(HeldCopy.made) == MAX_BATCHES_IN_FLIGHT + 1 and HeldCopy.made[0].taken
    assert len(listeners[0].pieces) == 1 and not listeners[1].pieces
    core.close()


def test_new_voices_arriving_together_are_prepared_in_one_call_behind_the_batch():
    kind = FakeKind()
    core = EngineCore(kind, FakeLLM(30))  # not started: stepped here
    listeners = [submit(core, f"r{k}", voice=f"voice {k}") for k in range(3)]
    listeners.append(submit(core, "bad", voice="bad voice"))
    listeners.append(submit(core, "offline", streaming=False, voice="offline voice"))
    core.step()
    # one call for all, then (one of them refused) each alone; offline requests keep no voice state
    assert kind.prepared == [["voice 0"], ["voice 1"], ["voice 2"]] and core.counters.voice_s > 0
    # launched behind the iteration's batch (whose chunks were ready at once here): never ahead of it
    assert kind.events[:4] == ["solve"] + ["prepare"] * 3
    for _ in range(50):
        core.step()
    error = listeners[3].ended.get(timeout=5)
    assert isinstance(error, ValueError) and "bad voice" in str(error)
    for listener in listeners[:3] + listeners[4:]:
        assert listener.ended.get(timeout=5) is None
    core.close()
    kind.prepared.clear()
    core = EngineCore(kind, FakeLLM(30))
    for k in range(3):
        submit(core, f"again{k}", voice=f"voice {k}")
    core.step()
    assert kind.prepared == [["voice 0", "voice 1", "voice 2"]]
    core.close()


@dataclass(frozen=True)
class FakeVoice:
    name: str

    def key(self) -> str:
        return self.name


def test_a_cold_starting_kind_keeps_a_requests_voice_only_when_it_comes_again():
    """With ``cold_start``, a clip sent once is never prepared (its stream starts without it); the
    same clip in a later request is prepared then; an uploaded voice is prepared at once."""
    kind = FakeKind(cold_start=True)
    core = EngineCore(kind, FakeLLM(30))  # not started: stepped here
    first = [submit(core, f"a{k}", voice=FakeVoice(f"clip {k}")) for k in range(2)]
    core.prepare_voices([FakeVoice("uploaded")])
    core.step()
    assert kind.prepared == [[FakeVoice("uploaded")]] and core.counters.voice_s > 0
    again = [submit(core, "b0", voice=FakeVoice("clip 1")), submit(core, "b1", voice=FakeVoice("clip 2"))]
    core.step()
    assert kind.prepared[1:] == [[FakeVoice("clip 1")]]
    for _ in range(50):
        core.step()
    for listener in first + again:
        assert listener.ended.get(timeout=5) is None
    core.close()


def test_prepared_voices_are_answered_once_the_loop_has_launched_them():
    """An uploaded voice's preparation is answered (``done``) after the kind's prepare call, at the
    loop's next iteration; one still waiting when the engine closes is answered then."""
    kind = FakeKind()
    core = EngineCore(kind, FakeLLM(30))  # not started: stepped here
    answered = []
    core.prepare_voices(["voice 9"], done=lambda: answered.append([list(v) for v in kind.prepared]))
    assert not answered
    core.step()
    assert answered == [[["voice 9"]]]
    core.prepare_voices(["voice 10"], done=lambda: answered.append("at close"))
    core.close()
    assert answered[-1] == "at close" and kind.prepared == [["voice 9"]]


def test_a_kind_preparing_beside_the_loop_gets_each_voice_as_it_comes_on_a_thread_of_its_own():
    """With ``prepares_beside``, a request's voice is handed to the preparation thread as the request
    is submitted (no loop iteration needed), an uploaded one as it comes (answered once launched; a
    bad voice fails only itself); the loop itself never prepares; requests still finish."""
    kind = FakeKind(prepares_beside=True)
    core = EngineCore(kind, FakeLLM(30))  # the loop not started: only the preparation thread runs
    core._preparer.start()
    answered = threading.Event()
    listener = submit(core, "r0", voice="voice 1")
    core.prepare_voices(["bad voice", "voice 2"], done=answered.set)
    assert answered.wait(5)
    deadline = time.monotonic() + 5
    while sorted(v for call in kind.prepared for v in call) != ["voice 1", "voice 2"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(v for call in kind.prepared for v in call) == ["voice 1", "voice 2"]
    assert set(kind.threads) == {"engine-voices"} and core.counters.voice_s > 0
    for _ in range(50):
        core.step()
    assert listener.ended.get(timeout=5) is None and len(kind.prepared) <= 3
    late = threading.Event()
    core.close()
    core.prepare_voices(["voice 3"], done=late.set)  # after close: answered at once, not prepared
    assert late.is_set() and "engine-core" not in kind.threads


def test_voices_arriving_are_prepared_together_before_their_requests_and_not_again():
    """The front end's new clips (voices_arriving) go to the preparation thread at once, in one call;
    their requests, submitted later, hand over no voice the kind keeps or is launching. A cold-starting
    kind prepares nothing for them."""
    kind = FakeKind(prepares_beside=True)
    core = EngineCore(kind, FakeLLM(30))
    core._preparer.start()
    core.voices_arriving([FakeVoice("clip 1"), FakeVoice("clip 2")])
    deadline = time.monotonic() + 5
    while not kind.prepared and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kind.prepared == [[FakeVoice("clip 1"), FakeVoice("clip 2")]]
    kind.launching_voices.add(FakeVoice("clip 3"))
    listeners = [submit(core, f"r{k}", voice=FakeVoice(f"clip {k}")) for k in (1, 2)]
    submit(core, "r3", voice=FakeVoice("clip 3"))
    assert not core._preparer.queued(FakeVoice("clip 3"))  # being launched: not handed over again
    kind.launching_voices.clear()
    for _ in range(50):
        core.step()
    assert [listener.ended.get(timeout=5) for listener in listeners] == [None, None]
    assert kind.prepared == [[FakeVoice("clip 1"), FakeVoice("clip 2")]]
    core.close()
    cold = FakeKind(cold_start=True)
    core = EngineCore(cold, FakeLLM(30))
    core.voices_arriving([FakeVoice("clip 1")])
    core.step()
    assert cold.prepared == []
    core.close()


def test_an_uploaded_voice_prepared_beside_the_loop_is_answered_once_the_device_has_computed_it():
    """The upload's answer waits for the kind's wait_prepared (the device computing the voice), on a
    thread of its own: the preparation thread meanwhile launches the next voices."""
    kind = FakeKind(prepares_beside=True)
    kind.computing.clear()
    core = EngineCore(kind, FakeLLM(30))
    core._preparer.start()
    answered = threading.Event()
    core.prepare_voices(["uploaded"], done=answered.set)
    deadline = time.monotonic() + 5
    while not kind.prepared and time.monotonic() < deadline:
        time.sleep(0.01)
    core.prepare_voices(["next"])
    while len(kind.prepared) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kind.prepared == [["uploaded"], ["next"]] and not answered.is_set()
    kind.computing.set()
    assert answered.wait(5)
    core.close()


def test_a_stream_whose_voice_is_being_launched_waits_without_holding_up_the_others():
    """While the preparation thread launches a voice, the loop plans no first chunk of its streams (open
    would wait, and every other stream's chunk with it): the others are voiced meanwhile, and it starts
    once the launch is done."""
    kind = FakeKind(prepares_beside=True, launching_voices={"new voice"})
    kind.prepared += [["voice 1"], ["new voice"]]  # kept (the new one since its launch began)
    core = EngineCore(kind, FakeLLM(30))  # stepped by hand; the preparation thread not started
    waiting = submit(core, "new", voice="new voice")
    playing = submit(core, "registered", voice="voice 1")
    for _ in range(50):
        core.step()
    assert playing.ended.get(timeout=5) is None and waiting.pieces == [] and waiting.ended.empty()
    assert not core._busy()  # its pending chunk does not spin the loop
    kind.launching_voices.clear()
    for _ in range(50):
        core.step()
    assert waiting.ended.get(timeout=5) is None and sum(p.size for p in waiting.pieces) > 0
    core.close()


def test_a_first_chunk_started_while_its_voice_is_launched_is_solved_once_the_kind_can():
    """A voice kept while its launch goes on: its streams' first chunks start at once (their encoders
    beside the launch) and, while the kind cannot solve them yet, wait started without holding up the
    other streams or spinning the loop; a request that ends meanwhile gives its job back; the others are
    solved in a later batch, with no full pass in it."""
    kind = FakeKind(prepares_beside=True, unsolvable_voices={"new voice"})
    kind.prepared += [["voice 1"], ["new voice"]]  # kept (the new one since its last solve was planned)
    core = EngineCore(kind, FakeLLM(30))  # stepped by hand; the preparation thread not started
    waiting = submit(core, "new", voice="new voice")
    leaving = submit(core, "leaving", voice="new voice")
    playing = submit(core, "registered", voice="voice 1")
    for _ in range(50):
        core.step()
    assert playing.ended.get(timeout=5) is None and kind.started.count("new voice") == 2
    assert waiting.pieces == leaving.pieces == [] and waiting.ended.empty() and not core._busy()
    core.cancel("leaving")
    core.step()
    assert isinstance(leaving.ended.get(timeout=5), RequestCancelledError) and kind.aborted == 1
    kind.unsolvable_voices.clear()
    assert core._busy()
    offline = submit(core, "offline", streaming=False, voice="voice 1")  # a full pass, ready in the next step
    batches = len(kind.batches)
    core.step()
    assert kind.batches[batches:] == [1] and not core._parked  # the parked window alone
    for _ in range(50):
        core.step()
    assert waiting.ended.get(timeout=5) is None and offline.ended.get(timeout=5) is None
    assert sum(p.size for p in waiting.pieces) == 30 * SAMPLES_PER_TOKEN
    assert kind.started.count("new voice") == 2 + 1  # then its last chunk
    core.close()


def test_a_parked_chunk_that_becomes_solvable_while_a_batch_starts_joins_that_batch():
    """The kind can solve a parked first chunk from some moment during another batch's start (its
    voice's launch ends meanwhile): the chunk is solved in that batch, not in one launched after it."""
    kind = FakeKind(prepares_beside=True, unsolvable_voices={"new voice"})
    kind.prepared += [["voice 1"], ["new voice"]]
    core = EngineCore(kind, FakeLLM(30))  # stepped by hand
    parked = submit(core, "new", voice="new voice")
    for _ in range(5):
        core.step()
    assert kind.started == ["new voice"] and not kind.batches and core._parked
    start_chunks = kind.start_chunks

    def start_while_the_launch_ends(chunks):
        kind.unsolvable_voices.clear()
        return start_chunks(chunks)

    kind.start_chunks = start_while_the_launch_ends
    playing = submit(core, "registered", voice="voice 1")
    core.step()
    assert kind.batches == [2] and not core._parked
    for _ in range(50):
        core.step()
    assert parked.ended.get(timeout=5) is None and playing.ended.get(timeout=5) is None
    core.close()


def test_a_stream_whose_new_voice_waits_for_the_preparation_thread_is_not_opened_by_the_loop():
    """A voice not kept and queued for the preparation thread (busy with earlier voices; here not
    started) is not computed by the loop through open: the stream's first chunk waits while a kept
    voice's stream, queued too, is voiced; it starts once the thread has prepared its voice."""
    kind = FakeKind(prepares_beside=True)
    kind.prepared.append(["voice 1"])  # kept already (registered)
    opened: list = []
    kind_open = kind.open
    kind.open = lambda features: opened.append(features) or kind_open(features)
    core = EngineCore(kind, FakeLLM(30))  # stepped by hand; the preparation thread started later
    waiting = submit(core, "new", voice="new voice")
    playing = submit(core, "registered", voice="voice 1")
    for _ in range(50):
        core.step()
    assert playing.ended.get(timeout=5) is None and opened == ["voice 1"]
    assert waiting.pieces == [] and waiting.ended.empty() and not core._busy()
    core._preparer.start()
    deadline = time.monotonic() + 5
    while not kind.keeps("new voice") and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(50):
        core.step()
    assert waiting.ended.get(timeout=5) is None and sum(p.size for p in waiting.pieces) > 0
    assert opened == ["voice 1", "new voice"] and set(kind.threads) == {"engine-voices"}
    core.close()


def test_a_failed_batch_ends_its_requests_and_the_others_go_on():
    kind = FakeKind()
    core = EngineCore(kind, FakeLLM(60), scheduler=Scheduler(max_batch_jobs=1)).start()
    try:
        bad = submit(core, "bad", bad=True)
        good = [submit(core, f"good{k}") for k in range(3)]
        error = bad.ended.get(timeout=30)
        assert isinstance(error, RuntimeError) and "bad chunk" in str(error) and not bad.pieces
        for listener in good:
            assert listener.ended.get(timeout=30) is None
            assert sum(p.size for p in listener.pieces) == 60 * SAMPLES_PER_TOKEN
    finally:
        core.close()
    assert kind.aborted == 1 and core.counters.requests_failed == 1


def test_a_request_cancelled_while_its_pcm_is_out_gets_none_of_it(monkeypatch):
    monkeypatch.setattr(core_module, "HostCopy", HeldCopy)
    HeldCopy.made = []
    kind = FakeKind()
    core = EngineCore(kind, FakeLLM(30))
    listener = submit(core, "r0")
    core.step()
    assert len(HeldCopy.made) == 1
    core.cancel("r0")
    core.step()
    assert isinstance(listener.ended.get(timeout=1), RequestCancelledError)
    core._hand_out(wait=True)
    assert not listener.pieces and kind.aborted == 0  # the job was solved: nothing to give back
    core.close()


def test_the_loop_hands_out_pcm_while_requests_only_wait_for_tokens():
    """A batch out and nothing else to do: the loop waits for the batch, not for new work."""
    kind = FakeKind()
    gate = threading.Event()

    class SlowLLM(FakeLLM):
        def submit(self, prompt_ids, request_id, limits):
            stream = TokenStream(request_id, on_close=lambda: None)
            for _ in range(18):
                stream.put(1)

            def rest():
                gate.wait(30)
                for _ in range(12):
                    stream.put(1)
                stream.put(Finished("length"))
            threading.Thread(target=rest, daemon=True).start()
            return stream

    core = EngineCore(kind, SlowLLM(30)).start()
    try:
        listener = submit(core, "r0")
        for _ in range(300):
            if listener.pieces:
                break
            threading.Event().wait(0.01)
        assert len(listener.pieces) == 1  # the first chunk, while the rest of the tokens have not come
        gate.set()
        assert listener.ended.get(timeout=30) is None
    finally:
        core.close()
    assert sum(p.size for p in listener.pieces) == 30 * SAMPLES_PER_TOKEN


def test_tokens_that_come_while_a_batch_is_out_start_their_chunk_behind_it(monkeypatch):
    """Nothing to launch and a batch out: the loop looks at the LLMs' tokens again every poll while it
    waits for that batch's PCM, so a stream whose first chunk's tokens come meanwhile is launched
    behind the batch (two in flight) instead of after the batch's PCM is handed out."""
    release, gate = threading.Event(), threading.Event()

    class GatedCopy(HeldCopy):  # the GPU busy with the first batch until released
        def ready(self) -> bool:
            return release.is_set()

        def wait(self, timeout_s: float) -> bool:
            return release.wait(timeout_s)

        def arrays(self) -> list[np.ndarray]:
            release.wait(30)
            return super().arrays()

    class LateLLM(FakeLLM):  # r1's tokens come once the gate opens
        def submit(self, prompt_ids, request_id, limits):
            if request_id != "r1":
                return super().submit(prompt_ids, request_id, limits)
            stream = TokenStream(request_id, on_close=lambda: None)

            def late():
                gate.wait(30)
                for _ in range(self.tokens):
                    stream.put(1)
                stream.put(Finished("length"))
            threading.Thread(target=late, daemon=True).start()
            return stream

    monkeypatch.setattr(core_module, "HostCopy", GatedCopy)
    HeldCopy.made = []
    kind = FakeKind()
    core = EngineCore(kind, LateLLM(30)).start()
    try:
        listeners = [submit(core, "r0"), submit(core, "r1")]
        for _ in range(500):
            if HeldCopy.made:
                break
            time.sleep(0.01)
        time.sleep(0.05)  # the loop is waiting for r0's first batch
        gate.set()
        for _ in range(500):
            if len(kind.batches) == 2:
                break
            time.sleep(0.01)
        assert kind.batches == [1, 1] and not listeners[0].pieces  # r1's first chunk launched behind r0's
        release.set()
        for listener in listeners:
            assert listener.ended.get(timeout=30) is None
    finally:
        release.set()
        gate.set()
        core.close()


@pytest.mark.parametrize("sizes", [[3, 0, 5], [1]])
def test_host_copy_hands_back_each_tensor_flat(sizes):
    from cosyserve.engine.device import HostCopy

    tensors = [torch.arange(n, dtype=torch.float32).reshape(1, -1) + 10 * i for i, n in enumerate(sizes)]
    copy = HostCopy(tensors)
    assert copy.ready() and copy.wait(0)
    for array, tensor in zip(copy.arrays(), tensors, strict=True):
        np.testing.assert_array_equal(array, tensor.reshape(-1).numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_copy_from_the_gpu_is_ready_after_its_event():
    from cosyserve.engine.device import HostCopy

    tensors = [torch.randn(n, device="cuda") for n in (4800, 0, 12000)]
    HostCopy(tensors).arrays()  # its pinned block now cached: allocating one (cudaHostAlloc) waits for the device
    torch.cuda._sleep(50_000_000)  # the copy queues behind ~tens of ms of GPU work
    copy = HostCopy(tensors)
    assert not copy.wait(0.001)  # a poll's time is not enough
    assert copy.wait(10) and copy.ready()
    arrays = copy.arrays()
    assert copy.ready()
    for array, tensor in zip(arrays, tensors, strict=True):
        np.testing.assert_array_equal(array, tensor.cpu().numpy())
