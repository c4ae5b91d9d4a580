"""The token2wav flow engine (incremental, packed streams, voice prefixes) against the full re-run of every prefix."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from cosyserve.errors import CapacityError, InvalidInputError
from cosyserve.frontend.prompt import voice_key
from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, random_flow_state_dict
from cosyserve.schedule import plan_chunks
from cosyserve.models.flow.packed_encoder import EncoderWindow, encode_windows
from cosyserve.runtime import HIGH_PRIORITY, LOOP_ROLE, role_stream
from cosyserve.token2wav.flow_engine import (PREFIX_FOLLOW_LEAD, PREFIX_FOLLOWED_PROMPTS, PREFIX_LANE, FlowEngine,
                                             StepLaunch)
from cosyserve.token2wav.prefix_encoder import PrefixEncoder
from cosyserve.token2wav.step_graphs import PREFIX_SHAPES, EngineGraphs, StepBuffers

torch.set_num_threads(1)

REL_L2 = 1e-5  # fp32: the bound for "equal up to rounding"
LOOKAHEAD = 3


@pytest.fixture(scope="module")
def flow() -> CosyVoice2Flow:
    cfg = FlowConfig.tiny()
    model = CosyVoice2Flow(cfg)
    model.load_state_dict(random_flow_state_dict(cfg, seed=5))
    return model.eval()


def _voice(prompt_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 6561, (1, prompt_tokens), generator=g),
            torch.randn(1, 2 * prompt_tokens, 80, generator=g), torch.randn(1, 192, generator=g))


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 6561, (1, count), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _engine(flow: CosyVoice2Flow, pages: int = 200, **kwargs) -> FlowEngine:
    return FlowEngine(flow, pool_pages=pages, **kwargs)


def _captured_shapes(engine: FlowEngine) -> None:
    """The CUDA-graph path's fixed shapes (padding pairs, frames and context slots, one shared context
    buffer per graph set: the chunks' and the prompts'), run eagerly."""
    engine.graphs = EngineGraphs(engine.fused, replay=False)
    engine.prefix_graphs = EngineGraphs(engine.fused, PREFIX_SHAPES, replay=False, lane=engine.prefix_lane)


def upstream_schedule(prompt_tokens: int, total: int) -> list[tuple[int, bool]]:
    """Upstream CosyVoice's own Python streaming: the first hop padded so that prompt + hop ends on
    the 25-token grid, then 25, 50, 100 (capped), each with 3 look-ahead tokens; then the final."""
    first = 25 - prompt_tokens % 25 or 25
    chunks, count, hop = [], first, 25
    while count + LOOKAHEAD < total:
        chunks.append((count + LOOKAHEAD, False))
        count += hop
        hop = min(2 * hop, 100)
    return chunks + [(total, True)]


def triton_schedule(total: int) -> list[tuple[int, bool]]:
    """The reference BLS's: 15 + 3 look-ahead, then 25 * 2^k."""
    chunks = plan_chunks(total)
    return [(c.num_tokens, c.finalize) for c in chunks]


class Reference:
    """One stream's chunks and the full re-run's mel for each (streaming masks throughout)."""

    def __init__(self, flow, voice, tokens, schedule):
        self.flow, self.voice, self.tokens, self.schedule = flow, voice, tokens, schedule
        self.done = 0

    def expected(self, count: int, finalize: bool) -> torch.Tensor:
        full = self.flow.inference(self.tokens[:, :count], *self.voice, streaming=True, finalize=finalize)
        return full[:, :, self.done:]


@pytest.mark.parametrize("schedule_kind", ["triton", "upstream"])
@pytest.mark.parametrize("prompt_tokens", [20, 28, 53, 75])
def test_chunks_equal_full_rerun(flow, schedule_kind: str, prompt_tokens: int):
    """Every chunk of a stream equals the full re-run, with the voice prefix cached or not (P mod 25
    across 0..3 and beyond: the prompt tail crossing into the target through the look-ahead)."""
    engine = _engine(flow)
    voice, tokens = _voice(prompt_tokens, seed=prompt_tokens), _tokens(140, seed=1)
    schedule = triton_schedule(140) if schedule_kind == "triton" else upstream_schedule(prompt_tokens, 140)
    for repeat in range(2):  # the second stream starts from the cached prefix
        stream = engine.open(*voice)
        ref = Reference(flow, voice, tokens, schedule)
        chunks = []
        for count, finalize in schedule:
            got = engine.run([(stream, tokens[:, :count], finalize)])[0]
            expected = ref.expected(count, finalize)
            assert got.shape == expected.shape and _rel(got, expected) < REL_L2, (repeat, count, _rel(got, expected))
            chunks.append((got, expected))
            ref.done += got.size(2)
        assert stream.closed
        # the mels handed out are the caller's: later runs (same shapes, same workspaces) leave them alone
        assert all(_rel(got, expected) < REL_L2 for got, expected in chunks)
    assert engine.cached_voices == 1 and engine.open_streams == 0


@pytest.mark.parametrize("shapes", ["exact", "captured"])
def test_mixed_voices_and_batch_compositions(flow, shapes: str):
    """Streams of several voices (cached and not) at different points of their schedules, packed in
    random groups: each chunk equals the full re-run, and a packed row equals the same row alone.
    "captured": the CUDA-graph path's fixed shapes (padding pairs, frames and context slots, one
    shared context buffer), run eagerly."""
    engine, alone = _engine(flow), _engine(flow)
    if shapes == "captured":
        _captured_shapes(engine)
    voices = [_voice(p, seed=10 + p) for p in (20, 33, 60)]
    rng = random.Random(0)
    streams = []
    for k in range(5):
        voice = voices[k % len(voices)]
        tokens = _tokens(rng.randint(60, 130), seed=100 + k)
        schedule = triton_schedule(tokens.size(1)) if k % 2 else upstream_schedule(voice[0].size(1), tokens.size(1))
        streams.append((engine.open(*voice), alone.open(*voice), Reference(flow, voice, tokens, schedule), iter(schedule)))
    pending = {k: next(s[3]) for k, s in enumerate(streams)}
    while pending:
        group = rng.sample(sorted(pending), rng.randint(1, len(pending)))
        chunks = [(streams[k][0], streams[k][2].tokens[:, :pending[k][0]], pending[k][1]) for k in group]
        mels = engine.run(chunks)
        for k, mel in zip(group, mels):
            _, lone, ref, schedule = streams[k]
            count, finalize = pending[k]
            assert _rel(mel, ref.expected(count, finalize)) < REL_L2, (k, count)
            solo = alone.run([(lone, ref.tokens[:, :count], finalize)])[0]
            assert _rel(mel, solo) < REL_L2
            ref.done += mel.size(2)
            following = next(schedule, None)
            if following is None:
                del pending[k]
            else:
                pending[k] = following
    assert engine.open_streams == 0
    assert engine.pool.free_pages == engine.pool.pages - sum(len(v.state.pages) for v in engine._voices.values())
    if shapes == "captured":
        assert engine.graphs.captured > 1  # several shapes were used


def test_pages_return_after_finish_cancel_and_error(flow):
    engine = _engine(flow)
    voice, tokens = _voice(60, seed=3), _tokens(150, seed=4)
    engine.open(*voice).close()  # computes the prefix
    voice_pages = engine.pool.pages - engine.pool.free_pages
    assert voice_pages == 2  # 50 * floor((60 - 3) / 25) frames = 100 frames = 2 pages

    cancelled = engine.open(*voice)
    engine.run([(cancelled, tokens[:, :93], False)])
    assert engine.pool.pages - engine.pool.free_pages > voice_pages
    cancelled.close()
    cancelled.close()  # idempotent
    failed = engine.open(*voice)
    engine.run([(failed, tokens[:, :43], False)])
    with pytest.raises(InvalidInputError, match="extend"):
        engine.run([(failed, _tokens(60, seed=9), False)])
    assert failed.closed
    with pytest.raises(InvalidInputError, match="closed"):
        engine.run([(failed, tokens[:, :60], False)])
    assert engine.open_streams == 0 and engine.pool.pages - engine.pool.free_pages == voice_pages


def test_full_pool_refuses_a_stream_and_evicts_unused_voices(flow):
    engine = _engine(flow, pages=5)
    engine.open(*_voice(60, seed=1)).close()  # 2 pages kept for the voice, unused
    stream = engine.open(*_voice(20, seed=2))  # no prefix pages
    tokens = _tokens(160, seed=5)
    engine.run([(stream, tokens[:, :103], False)])  # 200 complete frames: 4 pages, the unused voice's freed
    assert engine.cached_voices == 1 and engine.pool.free_pages == 1
    with pytest.raises(CapacityError, match="state pool is full"):
        engine.run([(stream, tokens[:, :153], False)])  # 300 frames: 2 more pages
    assert stream.closed and engine.pool.free_pages == engine.pool.pages


def test_fit_says_which_chunks_get_pages(flow):
    """fit counts each chunk's new pages against the free ones, in order, dropping unused voices
    first; a chunk it accepts then runs without a CapacityError."""
    engine = _engine(flow, pages=5)
    engine.open(*_voice(60, seed=1)).close()  # 2 pages kept for an unused voice
    first, second = engine.open(*_voice(20, seed=2)), engine.open(*_voice(20, seed=3))
    tokens = _tokens(160, seed=5)
    # prompt 20 + 83 tokens - 3 look-ahead = 100 tokens complete: 200 frames, 4 pages each
    assert engine.fit([(first, tokens[:, :83], False), (second, tokens[:, :83], False)]) == [True, False]
    assert engine.cached_voices == 2  # the unused voice made room; the two in use stay
    assert engine.fit([(first, tokens[:, :20], False), (second, tokens[:, :83], True)]) == [True, True]  # 0 pages
    engine.run([(first, tokens[:, :83], False)])
    assert engine.pool.free_pages == 1
    assert engine.fit([(second, tokens[:, :33], False)]) == [False]  # 50 tokens: 100 frames, 2 pages
    assert engine.fit([(second, tokens[:, :8], False)]) == [True]  # 25 tokens: 50 frames, the 1 free page
    second.close()
    first.close()
    assert engine.pool.free_pages == engine.pool.pages


def test_page_pressure_drops_only_the_voices_it_needs_least_recently_used_first(flow):
    engine = _engine(flow, pages=6)
    older, newer = _voice(60, seed=1), _voice(60, seed=2)
    engine.open(*older).close()
    engine.open(*newer).close()  # 2 pages each, unused; 2 pages free
    stream = engine.open(*_voice(20, seed=3))
    engine.run([(stream, _tokens(160, seed=5)[:, :63], False)])  # 150 complete frames: 3 pages
    assert engine.cached_voices == 2 and engine.pool.free_pages == 1  # the older voice made room, not both
    keys = {voice_key(*newer), voice_key(*older)}
    assert keys & set(engine._voices) == {voice_key(*newer)}
    stream.close()


def test_voices_are_keyed_by_content(flow):
    """Same prompt tokens, different clip: two voices (the reference keys speakers by transcript alone)."""
    engine = _engine(flow)
    tokens, feat, embedding = _voice(40, seed=7)
    engine.open(tokens, feat, embedding).close()
    engine.open(tokens, feat + 0.1, embedding).close()
    engine.open(tokens, feat, embedding).close()
    assert engine.cached_voices == 2


def test_unaligned_chunk_sizes_and_left_chunk_limit():
    """Encoder blocks (10 tokens = 20 frames) that do not line up with estimator blocks (30 frames,
    the page size then), and an estimator that only looks one block back."""
    from cosyserve.models.flow import EncoderConfig, EstimatorConfig

    cfg = FlowConfig(
        input_size=32,
        encoder=EncoderConfig(input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=1,
                              static_chunk_size=10),
        estimator=EstimatorConfig(channels=(32,), attention_head_dim=8, num_heads=2, n_blocks=1, num_mid_blocks=1,
                                  static_chunk_size=30, num_decoding_left_chunks=1),
    )
    model = CosyVoice2Flow(cfg)
    model.load_state_dict(random_flow_state_dict(cfg, seed=2))
    model.eval()
    engine = _engine(model)
    voice, tokens = _voice(29, seed=1), _tokens(80, seed=2)
    stream = engine.open(*voice)
    assert stream.voice.frames == 30 and engine.pool.page_frames == 30
    ref = Reference(model, voice, tokens, [])
    for count, finalize in [(5, False), (17, False), (18, False), (40, False), (41, False), (66, False), (80, True)]:
        got = engine.run([(stream, tokens[:, :count], finalize)])[0]
        assert _rel(got, ref.expected(count, finalize)) < REL_L2, count
        ref.done += got.size(2)


def test_window_and_pages_stay_bounded(flow):
    """Each chunk recomputes at most its new frames plus one open estimator block; a stream holds one
    page per complete block beyond its voice's."""
    engine = _engine(flow)
    voice, tokens = _voice(20, seed=3), _tokens(400, seed=4)
    stream = engine.open(*voice)
    block = flow.cfg.estimator.static_chunk_size
    for count in range(28, 400, 25):
        frames = 2 * (20 + count - LOOKAHEAD)
        window = frames - stream.context_frames
        new = engine.run([(stream, tokens[:, :count], False)])[0].shape[2]
        assert new == 50 and window < new + block
        assert stream.private_pages == stream.context_frames // block - stream.voice.frames // block
    stream.close()
    assert engine.open_streams == 0


def test_reference_chunks_of_the_fixture(parity_dir):
    """The fixture's Triton schedule: the engine's non-final chunks equal the reference's chunk{i}/mel
    (its final chunk is the non-streaming pass, which runs outside the engine: check_parity)."""
    import json

    from safetensors.torch import load_file

    from cosyserve.models.flow import flow_from_state_dict

    fixtures = parity_dir / "cosyvoice2"
    if not (fixtures / "flow_tiny_io.safetensors").is_file():
        pytest.skip(f"no flow fixtures in {fixtures}")
    cfg = FlowConfig.from_fixture_json(json.loads((fixtures / "flow_tiny_config.json").read_text()))
    model = flow_from_state_dict(cfg, torch.load(fixtures / "flow_tiny.pt", weights_only=True), "flow_tiny.pt")
    io = load_file(fixtures / "flow_tiny_io.safetensors")
    chunks = json.loads((fixtures / "fixture_meta.json").read_text())["flow_io"]["chunks"]
    engine = _engine(model)
    stream = engine.open(io["prompt_token"], io["prompt_feat"], io["embedding"])
    done = 0
    for i, chunk in enumerate(chunks):
        if chunk["finalize"]:
            continue
        got = engine.run([(stream, io["token"][:, :chunk["num_tokens"]], False)])[0]
        assert _rel(got, io[f"chunk{i}/mel"][:, :, done:]) < REL_L2
        done += got.size(2)


def test_bad_chunks_fail_clearly_and_close_the_stream(flow):
    voice, tokens = _voice(20, seed=5), _tokens(60, seed=6)
    engine = _engine(flow)
    other = tokens.clone()
    other[0, 2] += 1
    for bad, message in [(other[:, :30], "extend the 18 tokens"), (tokens[:, :10], "extend"),
                         (tokens[:, :18], "no frames beyond the 30"), (torch.cat([tokens, tokens])[:, :30], r"\(1, n\)"),
                         (tokens[:, :30].float(), "integer")]:
        stream = engine.open(*voice)
        engine.run([(stream, tokens[:, :18], False)])
        with pytest.raises(InvalidInputError, match=message):
            engine.run([(stream, bad, False)])
        assert stream.closed
    with pytest.raises(InvalidInputError, match="prompt_feat"):
        engine.open(voice[0], voice[1][:, :-1], voice[2])
    with pytest.raises(InvalidInputError, match="batch size"):
        engine.open(torch.cat([voice[0]] * 2), torch.cat([voice[1]] * 2), torch.cat([voice[2]] * 2))
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - sum(
        len(v.state.pages) for v in engine._voices.values())


def test_a_long_prompt_is_cached_in_pieces(flow):
    """A 430-token prompt runs through the flow in three pieces (253, 378, 430 tokens): the cached
    prefix equals one pass over the whole prompt, and the chunks after it equal the full re-run."""
    engine = _engine(flow)
    voice, tokens = _voice(430, seed=11), _tokens(60, seed=12)
    stream = engine.open(*voice)
    assert stream.voice.frames == 50 * ((430 - 3) // 25) and engine.counters.calls == 3
    # windows of 500, 250 and the rest's complete blocks (a prompt's open block is not computed)
    assert engine.counters.frames == 500 + 250 + 100 == stream.voice.frames
    ref = Reference(flow, voice, tokens, [])
    for count, finalize in triton_schedule(60):
        got = engine.run([(stream, tokens[:, :count], finalize)])[0]
        assert _rel(got, ref.expected(count, finalize)) < REL_L2, count
        ref.done += got.size(2)


def test_a_preparation_does_not_wait_for_a_chunk_run_under_way(flow, monkeypatch):
    """A chunk run holds the engine only for its own kind of work: a voice prepared on another thread
    while a solve is still launching (held here until the voice is done) is computed meanwhile, and
    both come out as the full re-run says. (Under load a solve's launch takes tens of ms; the
    preparation thread once waited ~90 ms for the lock that the loop's launches held.)"""
    engine = _engine(flow)
    kept = _voice(60, seed=50)
    engine.prepare([(*kept, "kept")])
    tokens = _tokens(40, seed=9)
    playing, ref = engine.open(*kept, key="kept"), Reference(flow, kept, tokens, [])
    prepared, solving = threading.Event(), threading.Event()
    solve_windows = FlowEngine._solve_windows

    def held_solve(self, windows, graphs, *args):
        if threading.current_thread() is threading.main_thread():
            solving.set()
            assert prepared.wait(60), "the preparation waited for the chunk's solve"
        return solve_windows(self, windows, graphs, *args)

    monkeypatch.setattr(FlowEngine, "_solve_windows", held_solve)
    voice = _voice(75, seed=51)
    preparing = threading.Thread(target=lambda: (solving.wait(60), engine.prepare([(*voice, "new")]), prepared.set()))
    preparing.start()
    count, finalize = triton_schedule(40)[0]
    mel = engine.run([(playing, tokens[:, :count], finalize)])[0]
    preparing.join()
    assert prepared.is_set() and _rel(mel, ref.expected(count, finalize)) < REL_L2
    stream = engine.open(*voice, key="new")
    new_ref = Reference(flow, voice, tokens, [])
    assert _rel(engine.run([(stream, tokens[:, :count], finalize)])[0], new_ref.expected(count, finalize)) < REL_L2


def _hold_launch_after(monkeypatch, steps: int, then=None) -> tuple[threading.Event, threading.Event]:
    """Hold a preparation thread once it has launched ``steps`` of its last solve's steps, until a
    stream's window asks for the next (then call ``then``, which may raise); returns (held, asked)."""
    held, asked = threading.Event(), threading.Event()
    add, event = StepLaunch.add, StepLaunch.event

    def held_add(self, launched):
        if self.launched == steps:
            held.set()
            assert asked.wait(60), "no window waited for the next step"
            if then is not None:
                then()
        add(self, launched)

    def watched_event(self, step):
        if step == steps:
            asked.set()
        return event(self, step)

    monkeypatch.setattr(StepLaunch, "add", held_add)
    monkeypatch.setattr(StepLaunch, "event", watched_event)
    return held, asked


def test_a_stream_opened_while_its_voice_is_launched_follows_the_prompt_step_by_step(flow, monkeypatch):
    """A voice is kept once its prompt's last solve is planned, before its steps are launched, so
    that a stream can open at once: its first window waits for each of the prompt's steps before
    its own (here the preparation thread is held after 4 steps until the window asks for the 5th:
    without the wait it would read pages not written yet), and its chunks equal the full re-run.
    The window starts at once; ``solvable`` says "not yet" while more than PREFIX_FOLLOW_LEAD steps
    are left to launch."""
    engine = _engine(flow)
    voice = _voice(75, seed=61)
    held, _ = _hold_launch_after(monkeypatch, 4)
    preparing = threading.Thread(target=engine.prepare, args=([(*voice, "new")],))
    preparing.start()
    assert held.wait(60) and not engine.launching("new") and 10 - 4 > PREFIX_FOLLOW_LEAD
    stream = engine.open(*voice, key="new")
    tokens = _tokens(60, seed=12)
    ref = Reference(flow, voice, tokens, [])
    for k, (count, finalize) in enumerate(triton_schedule(60)):
        (window,) = engine.start([(stream, tokens[:, :count], finalize)])
        assert engine.solvable(window) == (k > 0)
        engine.solve([window])
        mel = engine.finish(window)
        assert _rel(mel, ref.expected(count, finalize)) < REL_L2, count
        ref.done += mel.size(2)
    preparing.join()
    assert not engine.launching("new") and engine.cached_voices == 1
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - engine.voice_pages


def test_a_solve_of_several_prompts_is_followed_only_once_launched(flow, monkeypatch):
    """Streams follow a prompt solve step by step only when it holds at most PREFIX_FOLLOWED_PROMPTS
    prompts: for one of two, a stream opens and starts its first window at once, and ``solvable`` says
    "not yet" until every step is launched (solved earlier anyway, it still follows the prompt and
    gives the full re-run's chunks)."""
    engine = _engine(flow)
    voices = [_voice(75, seed=63), _voice(90, seed=64)]
    held, _ = _hold_launch_after(monkeypatch, 9)
    preparing = threading.Thread(target=engine.prepare, args=([(*v, f"v{k}") for k, v in enumerate(voices)],))
    preparing.start()
    assert held.wait(60) and PREFIX_FOLLOWED_PROMPTS < 2 and 10 - 9 <= PREFIX_FOLLOW_LEAD
    assert not engine.launching("v0") and not engine.launching("v1")
    stream = engine.open(*voices[1], key="v1")
    tokens = _tokens(40, seed=13)
    count, finalize = triton_schedule(40)[0]
    (window,) = engine.start([(stream, tokens[:, :count], finalize)])
    assert not engine.solvable(window)
    engine.solve([window])
    mel = engine.finish(window)
    preparing.join()
    assert _rel(mel, Reference(flow, voices[1], tokens, []).expected(count, finalize)) < REL_L2
    assert not engine.launching("v0") and not engine.launching("v1")
    stream.close()
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - engine.voice_pages


def test_a_voice_whose_launch_fails_fails_the_stream_waiting_for_it(flow, monkeypatch):
    """The preparation fails after a stream opened on its voice: the preparation raises, the voice
    is not kept, the stream's chunk fails with the reason, and every page comes back."""
    engine = _engine(flow)
    voice = _voice(75, seed=62)

    def device_fault():
        raise RuntimeError("device fault")

    held, _ = _hold_launch_after(monkeypatch, 4, then=device_fault)
    failures = []
    preparing = threading.Thread(target=lambda: _record_failure(failures, engine.prepare, [(*voice, "new")]))
    preparing.start()
    assert held.wait(60)
    stream = engine.open(*voice, key="new")
    with pytest.raises(RuntimeError, match="could not be computed: device fault"):
        engine.run([(stream, _tokens(18, seed=1), False)])
    preparing.join()
    assert [str(exc) for exc in failures] == ["device fault"] and engine.cached_voices == 0
    assert stream.closed and engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages


def _record_failure(failures: list, call, *args) -> None:
    try:
        call(*args)
    except BaseException as exc:  # checked by the test
        failures.append(exc)


@pytest.mark.parametrize("shapes", ["exact", "captured"])
def test_voices_prepared_on_another_thread_while_a_stream_runs(flow, shapes: str):
    """New voices prepared on a thread of their own (as the engine core's preparation thread does)
    while a stream of a kept voice runs its chunks on this one: its chunks and then the new voices'
    streams' equal the full re-run, each new voice is computed once (its prompt's first pieces in one
    packed solve) and every page comes back. "captured": the prompts' first pieces (up to 480 frames
    here) in the prompts' own no-context shapes, the chunks in theirs."""
    engine = _engine(flow)
    if shapes == "captured":
        _captured_shapes(engine)
    kept = _voice(60, seed=40)
    engine.prepare([(*kept, "kept")])
    calls = engine.counters.calls
    voices = [_voice(n, seed=41 + n) for n in (28, 75, 240)]
    failures = []

    def prepare():
        try:
            engine.prepare([(*voice, f"new{k}") for k, voice in enumerate(voices)])
        except BaseException as exc:  # reported below
            failures.append(exc)

    preparing = threading.Thread(target=prepare)
    tokens = _tokens(100, seed=8)
    playing, ref = engine.open(*kept, key="kept"), Reference(flow, kept, tokens, [])
    preparing.start()
    for count, finalize in triton_schedule(100):
        mel = engine.run([(playing, tokens[:, :count], finalize)])[0]
        assert _rel(mel, ref.expected(count, finalize)) < REL_L2, count
        ref.done += mel.size(2)
    preparing.join()
    assert not failures and engine.cached_voices == 4 and engine.counters.calls > calls
    calls = engine.counters.calls
    streams = [engine.open(*voice, key=f"new{k}") for k, voice in enumerate(voices)]
    assert engine.counters.calls == calls  # kept: nothing computed again
    refs = [Reference(flow, voice, tokens, []) for voice in voices]
    for count, finalize in triton_schedule(100):
        mels = engine.run([(stream, tokens[:, :count], finalize) for stream in streams])
        for k, (r, mel) in enumerate(zip(refs, mels)):
            assert _rel(mel, r.expected(count, finalize)) < REL_L2, (k, count)
            r.done += mel.size(2)
    if shapes == "captured":  # the three first pieces together (the longest completes 450 frames), no context
        assert (4, 512, 0) in engine.prefix_graphs._buffers
        assert all(frames <= 256 for _, frames, _ in engine.graphs._buffers)
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - engine.voice_pages


@pytest.mark.parametrize("shapes, prefix_priority", [("exact", False), ("captured", False), ("captured", True)])
def test_voices_prepared_together_equal_each_prepared_alone(flow, shapes: str, prefix_priority: bool):
    """New voices of several lengths (one prompt piece for 60 and 240 tokens, two for 300, none for
    one too short for a prefix) prepared in one call: the k-th pieces of all of them share a packed
    solve, and each voice's streams then give the chunks of the full re-run; a voice kept already
    costs nothing. "captured": the first pieces (up to 500 frames) run in the no-context shape of
    their width (512); ``prefix_priority``: in the high-priority prompt lane."""
    engine = _engine(flow, prefix_priority=prefix_priority)
    assert engine.prefix_lane == (PREFIX_LANE + HIGH_PRIORITY if prefix_priority else PREFIX_LANE)
    if shapes == "captured":
        _captured_shapes(engine)
    lengths = (60, 240, 300, 20)
    voices = [_voice(n, seed=20 + n) for n in lengths]
    engine.prepare([(*voice, f"v{n}") for voice, n in zip(voices, lengths)])
    assert engine.counters.calls == 2 and engine.cached_voices == 4 and engine.open_streams == 0
    if shapes == "captured":  # the first pieces of 3 voices in the prompts' shapes, the second piece of one eager
        assert sorted(engine.prefix_graphs._buffers) == [(4, 512, 0)] and not engine.graphs._buffers
    engine.prepare([(*voices[0], "v60")])
    assert engine.counters.calls == 2
    if shapes == "captured":  # a lone prompt of 150 tokens (5 complete blocks, 250 frames): the 256-frame shape
        engine.prepare([(*_voice(150, seed=5), "v150")])
        assert (1, 256, 0) in engine.prefix_graphs._buffers and engine.counters.calls == 3
    tokens = _tokens(60, seed=7)
    for voice, n in zip(voices, lengths):
        stream = engine.open(*voice, key=f"v{n}")
        assert stream.voice.frames == 50 * max(0, (n - 3) // 25) and engine.counters.calls >= 2
        ref = Reference(flow, voice, tokens, [])
        for count, finalize in triton_schedule(60):
            got = engine.run([(stream, tokens[:, :count], finalize)])[0]
            assert _rel(got, ref.expected(count, finalize)) < REL_L2, (n, count)
            ref.done += got.size(2)
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - engine.voice_pages


@torch.inference_mode()
def test_a_step_takes_rows_of_its_own_attention_kind_only(flow):
    """A step's buffers (and the CUDA graph captured over them) are built for block-causal or full
    attention; rows of the other kind are refused, not run under the wrong mask."""
    fused = FlowEngine(flow, pool_pages=8).fused
    full = StepBuffers(fused, 1, 16, 0, streaming=False)
    with pytest.raises(ValueError, match="streaming"):
        full.set_rows(fused.rows([16, 16], [0, 0], 16, streaming=True, slots=0))
    full.set_rows(fused.rows([16, 9], [0, 0], 16, streaming=False, slots=0))
    assert full.rows.streaming is False and full.valid.tolist() == [16, 9]


def test_first_prompt_pieces_padded_to_fixed_shapes_equal_the_packed_encoder(flow):
    """PrefixEncoder (rows padded to 4, tokens to a multiple of 32, as its CUDA graphs run) gives the mu
    and the encoder state (committed keys and values, conv contexts) of encode_windows over the same pieces."""
    lookahead = flow.cfg.pre_lookahead_len
    pieces = [_tokens(n, seed=n) for n in (28, 75, 101)]
    commits = [(n - lookahead) // 25 * 25 for n in (28, 75, 101)]
    padded_states, packed_states = [{} for _ in pieces], [{} for _ in pieces]
    got = PrefixEncoder(flow, (1, 2, 4, 8), 128, 32, replay=False)(pieces, commits, padded_states)
    windows = [EncoderWindow(flow.input_embedding(t[0]), 0, c, lookahead, st)
               for t, c, st in zip(pieces, commits, packed_states)]
    want = [flow.project(out[None]) for out in encode_windows(flow.encoder, windows)]
    for a, b in zip(got, want):
        assert a.shape == b.shape and _rel(a, b) < REL_L2
    for padded, packed in zip(padded_states, packed_states):
        assert padded.keys() == packed.keys()
        for owner, state in packed.items():
            if isinstance(state, torch.Tensor):
                assert _rel(padded[owner], state) < REL_L2
            else:
                assert padded[owner].keys.committed == state.keys.committed > 0
                assert _rel(padded[owner].keys.committed_frames(), state.keys.committed_frames()) < REL_L2
                assert _rel(padded[owner].values.committed_frames(), state.values.committed_frames()) < REL_L2


def _scheduled_chunks(engine: FlowEngine, streams: list, tokens: torch.Tensor, schedule) -> list[list[torch.Tensor]]:
    """Every chunk of ``schedule`` (token counts, finalize) of every stream, packed together, on the CPU;
    as the engine core runs them: a batch's windows start at once and are solved once ``solvable`` (a
    first window may follow a prompt solve still being launched)."""
    got = [[] for _ in streams]
    for count, finalize in schedule:
        windows = engine.start([(stream, tokens[:, :count], finalize) for stream in streams])
        while not all(engine.solvable(window) for window in windows):
            time.sleep(0.0005)
        engine.solve(windows)
        for k, window in enumerate(windows):
            got[k].append(engine.finish(window).float().cpu())
    return got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_each_role_has_a_cuda_stream_of_its_own():
    """Graph families are captured on their roles' streams: a role always gets the same stream, two
    roles never the same CUDA stream (torch's pool hands out its 32 in turn), so that no two
    families share a cuBLAS workspace."""
    device = torch.device("cuda")
    streams = [role_stream(device, f"test-role-{k}") for k in range(8)]
    assert len({s.cuda_stream for s in streams}) == len(streams)
    assert role_stream(device, "test-role-3") is streams[3]
    for _ in range(40):  # other code taking streams from the pool does not change a role's
        torch.cuda.Stream(device)
    assert role_stream(device, "test-role-0") is streams[0]
    # a high-priority role's kernels run before the others' on the device (new voices' prompts, opted in)
    assert role_stream(device, PREFIX_LANE + HIGH_PRIORITY).priority < role_stream(device, LOOP_ROLE).priority == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefix_priority", [False, True])
def test_on_a_gpu_voices_prepared_beside_running_streams_give_the_same_chunks(flow, prefix_priority: bool):
    """On a GPU with CUDA graphs: new voices prepared on another thread (their prompts on the prefix
    stream, in the prompts' lane: own graphs, workspaces and scratch; of high priority, opted in)
    while a stream of a kept voice runs chunks behind long GPU work on this thread's stream, then the
    new voices' streams packed together, give the chunks of an engine that does everything in order
    on one thread, eagerly (fp16: within rounding; a race would show as garbage)."""
    device = torch.device("cuda")
    gpu_flow = copy.deepcopy(flow).to(device, torch.float16)
    engine = FlowEngine(gpu_flow, pool_pages=64, cuda_graphs=True, precapture=True, prefix_priority=prefix_priority)
    serial = FlowEngine(gpu_flow, pool_pages=64)
    kept = _voice(60, seed=40)
    voices = [_voice(n, seed=50 + n) for n in (30, 80, 150, 240)]
    tokens = _tokens(120, seed=3)
    schedule = triton_schedule(120)

    def chunks(e: FlowEngine, streams: list) -> list[list[torch.Tensor]]:
        return _scheduled_chunks(e, streams, tokens, schedule)

    serial.prepare([(*kept, "kept")] + [(*voice, f"new{k}") for k, voice in enumerate(voices)])
    expected_kept = chunks(serial, [serial.open(*kept, key="kept")])[0]
    expected = chunks(serial, [serial.open(*voice, key=f"new{k}") for k, voice in enumerate(voices)])

    engine.prepare([(*kept, "kept")])
    playing = engine.open(*kept, key="kept")
    preparing = threading.Thread(target=engine.prepare, args=([(*voice, f"new{k}") for k, voice in enumerate(voices)],))
    got_kept = []
    for i, (count, finalize) in enumerate(schedule):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work ahead of each chunk on this stream
        got_kept.append(engine.run([(playing, tokens[:, :count], finalize)])[0].float().cpu())
        if i == 0:
            preparing.start()
    preparing.join()
    got = chunks(engine, [engine.open(*voice, key=f"new{k}") for k, voice in enumerate(voices)])
    torch.cuda.synchronize()
    for want, have in zip([expected_kept] + expected, [got_kept] + got):
        assert len(want) == len(have)
        for a, b in zip(have, want):
            assert _rel(a, b) < 2e-2
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - engine.voice_pages


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_streams_opened_while_their_voices_are_launched_give_the_same_chunks(flow, monkeypatch):
    """On a GPU with CUDA graphs: streams opened on new voices as soon as they are kept, their
    prompts' last solve still being launched on the prefix stream (each of its steps followed by
    ~5 ms of GPU sleep there), wait for each prompt step on the device: their chunks equal those of
    an engine that does everything in order, eagerly (fp16: within rounding; a missed wait would
    read pages not written yet)."""
    device = torch.device("cuda")
    gpu_flow = copy.deepcopy(flow).to(device, torch.float16)
    engine = FlowEngine(gpu_flow, pool_pages=64, cuda_graphs=True, precapture=True)
    serial = FlowEngine(gpu_flow, pool_pages=64)
    voices = [_voice(n, seed=70 + n) for n in (80, 150, 240)]
    tokens = _tokens(120, seed=4)
    schedule = triton_schedule(120)

    def chunks(e: FlowEngine, streams: list) -> list[list[torch.Tensor]]:
        return _scheduled_chunks(e, streams, tokens, schedule)

    serial.prepare([(*voice, f"new{k}") for k, voice in enumerate(voices)])
    expected = chunks(serial, [serial.open(*voice, key=f"new{k}") for k, voice in enumerate(voices)])
    add = StepLaunch.add

    def slow_add(self, launched):
        torch.cuda._sleep(10_000_000)  # on the prefix stream, before the next step
        add(self, launched)

    monkeypatch.setattr(StepLaunch, "add", slow_add)
    preparing = threading.Thread(target=engine.prepare, args=([(*voice, f"new{k}") for k, voice in enumerate(voices)],))
    preparing.start()
    while engine.cached_voices < len(voices) and preparing.is_alive():
        time.sleep(0.0005)
    streams = [engine.open(*voice, key=f"new{k}") for k, voice in enumerate(voices)]
    opened_early = any(stream._launch is not None for stream in streams)
    got = chunks(engine, streams)
    preparing.join()
    torch.cuda.synchronize()
    assert opened_early
    for want, have in zip(expected, got):
        assert len(want) == len(have)
        for a, b in zip(have, want):
            assert _rel(a, b) < 2e-2
    assert engine.open_streams == 0 and engine.pool.free_pages == engine.pool.pages - engine.voice_pages
