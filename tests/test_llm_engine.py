"""The torch engine against the transformers reference (CPU, float32, tiny bundle), sampling and scheduling."""

import importlib.util
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from cosyserve.bundle.llm import ensure_llm_bundle
from cosyserve.errors import InvalidInputError, RequestCancelledError
from cosyserve.llm import BackendUnavailableError, SamplingParams, create_backend
from cosyserve.llm.engine.llm_engine import LLMEngine
from cosyserve.llm.prompt import NUM_SPEECH_TOKENS, OUTPUT_WINDOW_SIZE, OUTPUT_WINDOW_START, SOS_ID, TASK_ID
from cosyserve.llm.sampling import Sampler

WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)


def prompt(n_text: int, n_speech: int, salt: int = 0) -> list[int]:
    text = [(37 * i + 11 * salt) % 150000 + 100 for i in range(n_text)]
    speech = [OUTPUT_WINDOW_START + (53 * i + salt) % NUM_SPEECH_TOKENS for i in range(n_speech)]
    return [SOS_ID, *text, TASK_ID, *speech]


PROMPTS = [prompt(4, 0, 1), prompt(25, 30, 2), prompt(9, 3, 3)]


@pytest.fixture(scope="session")
def llm_dir(tmp_path_factory):
    return ensure_llm_bundle(tmp_path_factory.getbasetemp() / "llm_tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def hf(llm_dir):
    backend = create_backend("hf", llm_dir, "cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def engine(llm_dir):
    backend = create_backend("torch", llm_dir, "cpu", max_slots=4, max_model_len=256)
    yield backend
    backend.close()


def test_greedy_matches_hf_single_and_batched(hf, engine):
    # Different max_tokens: requests leave mid-batch, so slots are compacted while others run.
    params = [SamplingParams.greedy(max_tokens=n) for n in (20, 7, 14)]
    reference = [hf.generate(ids, p) for ids, p in zip(PROMPTS, params)]
    assert [engine.generate(ids, p) for ids, p in zip(PROMPTS, params)] == reference
    streams = [engine.generate_stream(ids, p) for ids, p in zip(PROMPTS, params)]
    assert [list(s) for s in streams] == reference
    assert [len(r) for r in reference] == [20, 7, 14]  # random weights: eos is practically never drawn


def test_logits_match_hf(hf, engine):
    ids = PROMPTS[1]
    forced = hf.generate(ids, SamplingParams.greedy(max_tokens=10))[:-1]
    ours = engine.engine.teacher_forced_logits(ids, forced)
    theirs = hf.logits(ids + [t + OUTPUT_WINDOW_START for t in forced])[len(ids) - 1:, WINDOW]
    assert ours.shape == theirs.shape == (10, OUTPUT_WINDOW_SIZE)
    assert (ours - theirs).abs().max() < 1e-4


def test_seeded_sampling_is_batch_invariant(hf, engine):
    params = SamplingParams(seed=1234, max_tokens=25)  # default: RAS, top-k 25, top-p 0.8
    alone = engine.generate(PROMPTS[1], params)
    others = [engine.generate_stream(ids, SamplingParams(seed=i, max_tokens=30)) for i, ids in enumerate(PROMPTS)]
    inside = engine.generate_stream(PROMPTS[1], params)
    assert list(inside) == alone
    assert all(len(list(s)) == 30 for s in others)
    assert hf.generate(PROMPTS[1], params) == alone  # same sampler, same noise
    assert engine.generate(PROMPTS[1], SamplingParams(seed=1235, max_tokens=25)) != alone


def test_ras_resamples_repeated_tokens():
    sampler = Sampler(2, torch.device("cpu"))
    logits = torch.zeros(1, OUTPUT_WINDOW_SIZE)
    logits[0, 42] = 1.0  # the nucleus (top_k=1) is always token 42
    sampler.set_requests([0], [SamplingParams(top_k=1, seed=3)], [3], [[]])
    sampler.set_requests([1], [SamplingParams(top_k=1, ras=False, seed=3)], [3], [[]])
    with_ras = [int(sampler.sample(logits, torch.tensor([0]))) for _ in range(23)]
    without = [int(sampler.sample(logits, torch.tensor([1]))) for _ in range(23)]
    assert without == [42] * 23
    # 42 is accepted, then rejected while it is among the last 10 tokens, then accepted again.
    assert [i for i, t in enumerate(with_ras) if t == 42] == [0, 11, 22]


def test_min_tokens_and_repetition_penalty_in_sampler():
    sampler = Sampler(1, torch.device("cpu"))
    logits = torch.zeros(1, OUTPUT_WINDOW_SIZE)
    logits[0, NUM_SPEECH_TOKENS] = 50.0  # eos1 overwhelmingly likely
    logits[0, 7] = 10.0
    sampler.set_requests([0], [SamplingParams(min_tokens=3, seed=0)], [0], [[]])
    tokens = [int(sampler.sample(logits, torch.tensor([0]))) for _ in range(4)]
    assert NUM_SPEECH_TOKENS not in tokens[:3] and tokens[3] == NUM_SPEECH_TOKENS
    logits[0, NUM_SPEECH_TOKENS] = 0.0
    logits[0, 8] = 5.0
    sampler.set_requests([0], [SamplingParams.greedy(repetition_penalty=100.0)], [0], [[7]])
    assert int(sampler.sample(logits, torch.tensor([0]))) == 8  # 7 seen in the prompt: 10 / 100 < 5
    sampler.set_requests([0], [SamplingParams.greedy()], [0], [[7]])
    assert int(sampler.sample(logits, torch.tensor([0]))) == 7


@pytest.fixture(scope="module")
def eos_dir(llm_dir, tmp_path_factory):
    """The tiny bundle with a huge eos1 bias: eos is the greedy choice at every step."""
    path = tmp_path_factory.mktemp("eos") / "llm"
    shutil.copytree(llm_dir, path)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.bias"][OUTPUT_WINDOW_START + NUM_SPEECH_TOKENS] = 1000.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_eos_min_tokens_and_ignore_eos_counts(eos_dir):
    engine = LLMEngine(eos_dir, max_slots=2, max_model_len=128)
    streams = [engine.submit(PROMPTS[0], SamplingParams.greedy()),
               engine.submit(PROMPTS[2], SamplingParams.greedy(min_tokens=5)),
               engine.submit(PROMPTS[1], SamplingParams(ignore_eos=True, max_tokens=12, seed=1))]
    while engine.num_active:
        engine.step()
    assert [len(list(s)) for s in streams] == [0, 5, 12]
    assert [s.finish_reason for s in streams] == ["stop", "stop", "length"]
    too_long = engine.submit(PROMPTS[0], SamplingParams(ignore_eos=True, max_tokens=1000))
    while engine.num_active:
        engine.step()
    assert len(list(too_long)) == 128 - len(PROMPTS[0])  # capped by max_model_len


def test_cancel_frees_the_slot_at_once(llm_dir):
    engine = LLMEngine(llm_dir, max_slots=2, max_model_len=256).start()
    try:
        stream = engine.submit(PROMPTS[1], SamplingParams(ignore_eos=True, max_tokens=200), request_id="long")
        assert [next(stream), next(stream)]
        assert engine.cancel("long") and not engine.cancel("unknown")
        with pytest.raises(RequestCancelledError):
            list(stream)
        deadline = time.monotonic() + 2
        while (engine.num_running or engine.num_active) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_running == 0 and engine.num_active == 0
        with engine.submit(PROMPTS[0], SamplingParams(ignore_eos=True, max_tokens=200)) as closing:
            next(closing)  # the reader walks away after one token: the request is cancelled too
        assert len(list(engine.submit(PROMPTS[2], SamplingParams(ignore_eos=True, max_tokens=5)))) == 5
        assert engine.num_running == 0 and engine.num_active == 0
    finally:
        engine.close()


def test_bad_requests_fail_alone(hf, engine):
    params = SamplingParams.greedy(max_tokens=40)
    good = engine.generate_stream(PROMPTS[1], params)
    first = next(good)
    bad_prompts = [[], [158300], [-5], [SOS_ID, "x"]]
    for ids in bad_prompts:
        with pytest.raises(InvalidInputError):
            engine.generate_stream(ids, SamplingParams())
    for field, value in (("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                         ("top_k", -1), ("repetition_penalty", 0.0), ("temperature", float("nan")),
                         ("min_tokens", 50)):
        with pytest.raises(InvalidInputError):
            SamplingParams(**{field: value, "max_tokens": 40} if field != "max_tokens" else {field: value})
    with pytest.raises(InvalidInputError, match="max_model_len"):
        engine.generate_stream(list(range(300)), SamplingParams())
    assert [first, *good] == hf.generate(PROMPTS[1], params)


def test_prefix_cache_reuses_kv_and_keeps_tokens(llm_dir):
    engine = LLMEngine(llm_dir, max_slots=2, max_model_len=256)
    params = SamplingParams.greedy(max_tokens=12)

    def run(ids):
        stream = engine.submit(ids, params)
        while engine.num_active:
            engine.step()
        return list(stream)

    ids = PROMPTS[1]
    expected = run(ids)
    engine.register_prefix("voice", ids[:20])
    engine.register_prefix("other", [SOS_ID, 999, 998])
    assert engine.prefixes.match(ids)[1] == 20
    assert run(ids) == expected
    assert engine.prefixes.match(ids[:10] + [5])[1] == 10  # partial overlap: shared tokens only
    assert engine.prefixes.match(ids[:20])[1] == 19  # at least one token is always computed


def test_backend_registry(llm_dir, monkeypatch):
    from cosyserve.llm.openai_backend import BASE_URL_ENV

    monkeypatch.delenv(BASE_URL_ENV, raising=False)
    with pytest.raises(InvalidInputError, match="unknown LLM backend"):
        create_backend("vllm", llm_dir)
    with pytest.raises(InvalidInputError, match="base_url"):
        create_backend("openai", llm_dir)  # the client needs to know where its server is
    if importlib.util.find_spec("tensorrt_llm") is None:
        with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
            create_backend("trtllm", llm_dir, "cuda", engine_dir=llm_dir)


def test_concurrent_submitters(engine):
    params = SamplingParams.greedy(max_tokens=9)
    expected = [engine.generate(ids, params) for ids in PROMPTS]
    results = [None] * 6

    def worker(i):
        results[i] = engine.generate(PROMPTS[i % 3], params)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected * 2


class _EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay() runs the graph body."""

    def __init__(self, body, shape):
        self.body, self.shape = body, shape

    def replay(self):
        self.body(*self.shape)


def _eager_prefill_graphs(engine: LLMEngine) -> None:
    """The bodies captured on a GPU for every prefill shape, run eagerly when replayed."""
    runner = engine.runner
    runner.prefill_graphs = {shape: _EagerGraph(runner.prefill_step, shape) for shape in runner.prefill_shapes()}


def test_lone_prefill_graph_body_matches_hf(hf, llm_dir):
    # A lone request's prefill (with prefix-cache hits too) through the graph body.
    engine = LLMEngine(llm_dir, max_slots=2, max_model_len=256)
    _eager_prefill_graphs(engine)
    engine.register_prefix("voice", PROMPTS[1][:12])
    params = SamplingParams.greedy(max_tokens=8)
    for ids in (PROMPTS[0], PROMPTS[1]):
        stream = engine.submit(ids, params)
        while engine.num_active:
            engine.step()
        assert list(stream) == hf.generate(ids, params)


def test_requests_admitted_together_share_a_prefill_graph_and_each_match_hf(hf, llm_dir):
    # Three requests of different lengths, one of them after a prefix-cache hit, admitted in one
    # step: one replay of the 4-row graph (its fourth row is padding on the spare slot), then
    # decode. Each stream is what the request alone gives, and sampled requests keep their seeds.
    def engine_of_graph_bodies() -> tuple[LLMEngine, list]:
        engine = LLMEngine(llm_dir, max_slots=4, max_model_len=256)
        replays, body = [], engine.runner.prefill_step
        engine.runner.prefill_step = lambda *shape: (replays.append(shape), body(*shape))
        _eager_prefill_graphs(engine)
        engine.register_prefix("voice", PROMPTS[1][:12])
        return engine, replays

    def run(engine: LLMEngine, cases) -> list[list[int]]:
        streams = [engine.submit(ids, params) for ids, params in cases]
        while engine.num_active:
            engine.step()
        return [list(stream) for stream in streams]

    greedy = SamplingParams.greedy(max_tokens=8)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=8, seed=7)
    cases = [(PROMPTS[0], greedy), (PROMPTS[1], sampled), (PROMPTS[2], greedy)]
    together, replays = engine_of_graph_bodies()
    results = run(together, cases)
    assert [shape[0] for shape in replays] == [4]
    alone, _ = engine_of_graph_bodies()
    for tokens, case in zip(results, cases):
        assert len(tokens) == 8 and tokens == run(alone, [case])[0]
        if case[1] is greedy:
            assert tokens == hf.generate(*case)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_requests_prefilled_together_get_what_each_gets_alone(llm_dir):
    # The captured graphs themselves: three requests in one 4-row prefill replay, then each alone in
    # a 1-row one (float32, so that the two batch shapes' rounding cannot tip a greedy choice).
    engine = LLMEngine(llm_dir, "cuda", torch.float32, max_slots=4, max_model_len=256)
    assert (4, 64, 128) in engine.runner.prefill_graphs
    engine.register_prefix("voice", PROMPTS[1][:12])
    params = SamplingParams.greedy(max_tokens=8)
    streams = [engine.submit(ids, params) for ids in PROMPTS]
    while engine.num_active:
        engine.step()
    together = [list(stream) for stream in streams]
    alone = []
    for ids in PROMPTS:
        stream = engine.submit(ids, params)
        while engine.num_active:
            engine.step()
        alone.append(list(stream))
    assert together == alone and all(len(tokens) == 8 for tokens in together)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_high_priority_llm_steps_on_a_stream_of_its_own_and_samples_the_same(llm_dir):
    # high_priority: the graphs captured on, and the engine's thread stepping on, a high-priority stream
    # of their own role; greedy tokens as at the default priority (float32: the same kernels either way)
    from cosyserve.runtime import role_stream

    params, tokens, streams = SamplingParams.greedy(max_tokens=8), {}, {}
    for high in (False, True):
        engine = LLMEngine(llm_dir, "cuda", torch.float32, max_slots=4, max_model_len=256, high_priority=high)
        streams[high] = role_stream(engine.runner.device, engine.runner.stream_role)
        engine.start(streams[high])
        try:
            tokens[high] = [list(engine.submit(ids, params)) for ids in PROMPTS]
        finally:
            engine.close()
    assert streams[True].priority < streams[False].priority == 0
    assert streams[True].cuda_stream != streams[False].cuda_stream
    assert tokens[True] == tokens[False] and all(len(t) == 8 for t in tokens[True])


def _run_to_end(engine: LLMEngine, requests: list) -> list[tuple[list[int], str]]:
    streams = [engine.submit(ids, params) for ids, params in requests]
    while engine.num_active:
        engine.step()
    return [(list(stream), stream.finish_reason) for stream in streams]


@pytest.mark.parametrize("steps_per_replay", [2, 3])
def test_several_decode_steps_per_replay_give_the_tokens_of_one(llm_dir, eos_dir, steps_per_replay):
    """Tokens fed back on the device for several steps a replay: each request gets the tokens it gets
    one step a replay, with requests stopping inside a replay (length, eos after min_tokens, the
    model length), others running on after them in compacted slots, and seeded sampling."""
    requests = [(PROMPTS[0], SamplingParams.greedy(max_tokens=20)),
                (PROMPTS[1], SamplingParams.greedy(max_tokens=7)),
                (PROMPTS[2], SamplingParams(seed=7, max_tokens=14)),
                (PROMPTS[1], SamplingParams(ignore_eos=True, max_tokens=1000, seed=3))]
    eos_requests = [(PROMPTS[0], SamplingParams.greedy()), (PROMPTS[2], SamplingParams.greedy(min_tokens=5)),
                    (PROMPTS[1], SamplingParams(ignore_eos=True, max_tokens=13, seed=1))]
    results = {}
    for steps in (1, steps_per_replay):
        engine = LLMEngine(llm_dir, max_slots=2, max_model_len=128, steps_per_replay=steps)
        results[steps] = _run_to_end(engine, requests), engine.counters.decode_steps
        results[steps, "eos"] = _run_to_end(LLMEngine(eos_dir, max_slots=2, max_model_len=128,
                                                      steps_per_replay=steps), eos_requests)
    (one, one_steps), (several, several_steps) = results[1], results[steps_per_replay]
    assert several == one
    assert [len(tokens) for tokens, _ in one] == [20, 7, 14, 128 - len(PROMPTS[1])]
    assert [reason for _, reason in one] == ["length"] * 4
    assert results[steps_per_replay, "eos"] == results[1, "eos"]
    assert [(len(tokens), reason) for tokens, reason in results[1, "eos"]] == [(0, "stop"), (5, "stop"), (13, "length")]
    assert several_steps % steps_per_replay == 0 and one_steps <= several_steps < one_steps + 4 * steps_per_replay


def test_steps_per_replay_is_bounded(llm_dir):
    for steps in (0, 9):
        with pytest.raises(ValueError, match="steps_per_replay"):
            LLMEngine(llm_dir, max_slots=2, max_model_len=128, steps_per_replay=steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_replay_of_four_decode_steps_samples_what_four_replays_of_one_do(llm_dir):
    # the captured graphs of 4 steps each (float32: the same kernels as one step's), requests stopping
    # inside a replay and slots compacted meanwhile
    requests = [(ids, SamplingParams.greedy(max_tokens=n)) for ids, n in zip(PROMPTS, (21, 6, 14))]
    results = {}
    for steps in (1, 4):
        engine = LLMEngine(llm_dir, "cuda", torch.float32, max_slots=4, max_model_len=256, steps_per_replay=steps)
        assert engine.runner.decode_graphs
        results[steps] = _run_to_end(engine, requests)
    assert results[4] == results[1] and [len(tokens) for tokens, _ in results[1]] == [21, 6, 14]


def test_token_stream_bursts_hold_every_token_once_and_end_like_iteration():
    from cosyserve.llm.stream import Finished, TokenStream

    stream = TokenStream("r", on_close=lambda: None)
    for token in (5, 6, 7):
        stream.put(token)
    assert stream.available() == [5, 6, 7]  # all that was queued, in order
    stream.put(8)
    stream.put(Finished("stop"))
    assert stream.available() == [8]  # the end is read ahead but not yet reported
    with pytest.raises(StopIteration):
        stream.available()
    assert stream.finish_reason == "stop" and stream.num_tokens == 4

    failing = TokenStream("f", on_close=lambda: None)
    failing.put(1)
    failing.put(Finished("error", RuntimeError("engine failed")))
    assert failing.available() == [1]
    with pytest.raises(RuntimeError, match="engine failed"):
        failing.available()


def test_engine_counts_its_steps(llm_dir):
    engine = LLMEngine(llm_dir, "cpu", max_slots=4, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    streams = [engine.submit(p, params) for p in PROMPTS[:2]]
    while engine.num_active:
        engine.step()
    assert [len(list(s)) for s in streams] == [6, 6]
    c = engine.counters
    # prefill yields each request's first token, then 5 decode steps advance both requests
    assert (c.prefills, c.decode_steps, c.decode_rows) == (2, 5, 10)
    assert 0 < c.prefill_s < c.busy_s


def test_pacing_lets_a_reply_burst_then_follow_real_time():
    """The engine's own thread decodes while some running request is behind its budget (its first
    ``burst`` tokens at once, then ``tokens_per_s``), and otherwise waits until the earliest one is."""
    from types import SimpleNamespace

    from cosyserve.llm.engine.llm_engine import Pacing

    pacing = Pacing(burst=20, tokens_per_s=100.0)
    fresh = SimpleNamespace(started_at=None, output=[])
    assert pacing.delay([fresh], now=5.0) == 0.0  # not prefilled yet
    early = SimpleNamespace(started_at=10.0, output=[0] * 18)
    assert pacing.delay([early], now=10.0) == 0.0  # inside its burst
    ahead = SimpleNamespace(started_at=10.0, output=[0] * 40)  # its 41st token is due 0.21 s in
    assert pacing.delay([ahead], now=10.0) == pytest.approx(0.21)
    assert pacing.delay([ahead], now=10.3) == 0.0
    behind = SimpleNamespace(started_at=9.0, output=[0] * 40)
    assert pacing.delay([ahead, behind], now=10.0) == 0.0  # one request behind: a step for all
    later = SimpleNamespace(started_at=10.0, output=[0] * 60)
    assert pacing.delay([ahead, later], now=10.0) == pytest.approx(0.21)  # the earliest due


def test_a_paced_engine_thread_bursts_then_keeps_to_the_rate(llm_dir):
    """On its own thread with Pacing(burst=4, 40 tokens/s), 16 tokens take at least (16 - 4) / 40 =
    0.3 s (unpaced, the tiny model gives them in a few ms); a request submitted meanwhile is served too."""
    from cosyserve.llm.engine.llm_engine import Pacing

    engine = LLMEngine(llm_dir, max_slots=2, max_model_len=256, pacing=Pacing(burst=4, tokens_per_s=40.0)).start()
    try:
        began = time.monotonic()
        paced = engine.submit(PROMPTS[1], SamplingParams(ignore_eos=True, max_tokens=16, min_tokens=16))
        first_four = [next(paced) for _ in range(4)]
        assert len(first_four) == 4
        newcomer = engine.submit(PROMPTS[0], SamplingParams(ignore_eos=True, max_tokens=2, min_tokens=2))
        assert len(list(newcomer)) == 2
        assert len(list(paced)) == 12
        assert time.monotonic() - began >= (16 - 4) / 40.0 - 0.01
    finally:
        engine.close()
