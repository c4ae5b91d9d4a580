"""Batched token2wav: packed flow + HiFT work equals unbatched runs; deadline order; incremental
streaming flow and padded (CUDA-graph) sampling equal the reference path."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cosyserve.errors import InvalidInputError
from cosyserve.frontend.prompt import PromptFeatures
from cosyserve.models.flow import EncoderConfig, EstimatorConfig, FlowConfig, flow_from_state_dict, random_flow_state_dict
from cosyserve.models.hift import HiFTGenerator, HiftConfig
from cosyserve.schedule import plan_chunks
from cosyserve.token2wav.sessions import LocalToken2Wav, Token2WavCall
from cosyserve.frontend.prompt import Voice
from cosyserve.token2wav.batching import Token2WavBatcher
from cosyserve.token2wav.cosyvoice2 import CosyVoice2Token2Wav, OfflineRequest, Token2WavOptions
from cosyserve.token2wav.graphs import FlowSampler, HiftRunner

torch.set_num_threads(1)

FLOW_CFG = FlowConfig(
    input_size=32,
    encoder=EncoderConfig(input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=1),
    estimator=EstimatorConfig(channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2),
)
# Mel frames agree to float rounding (different matmul shapes). Waveforms pass through the HiFT
# sine phase (1e4+ radians), where mel rounding can move sin(phase) by up to ~1e-3 (fixture README
# §2); measured here ~2.5e-7, so the bounds leave margin and still catch any wrong noise draw.
MEL_REL = 1e-5
WAVE_REL_ZERO_NOISE = 1e-4
WAVE_REL_SEEDED = 1e-3
PROMPTS = [6, 9, 6]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def parts() -> tuple:
    flow_weights = random_flow_state_dict(FLOW_CFG, seed=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        hift_weights = HiFTGenerator(HiftConfig.tiny()).state_dict()
    return flow_weights, hift_weights


def _model(parts, options: Token2WavOptions | None = None) -> CosyVoice2Token2Wav:
    hift = HiFTGenerator(HiftConfig.tiny())
    hift.load_state_dict(parts[1])
    return CosyVoice2Token2Wav(flow_from_state_dict(FLOW_CFG, parts[0], "random"), hift.fold_weight_norm(),
                               options=options)


@pytest.fixture(scope="module")
def t2w(parts) -> CosyVoice2Token2Wav:
    return _model(parts)


def _prompt(i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    p = PROMPTS[i % len(PROMPTS)]
    return {"prompt_tokens": torch.randint(0, 6561, (p,), generator=g),
            "prompt_feat": torch.randn(1, 2 * p, 80, generator=g), "embedding": torch.randn(192, generator=g)}


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed))


def _zero_noise(length: int) -> torch.Tensor:
    return torch.zeros(1, length, 9)


def _seeded(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(4242 + i)


# ----- offline -----

def test_offline_batch_equals_single(t2w):
    lengths = [25, 25, 40, 13]  # two equal lengths share one HiFT call
    for noise in ("zero", "seeded"):
        def request(i: int) -> OfflineRequest:
            extra = {"sine_noise": _zero_noise} if noise == "zero" else {"generator": _seeded(i)}
            return OfflineRequest(_tokens(lengths[i], i), **_prompt(i), **extra)

        batched = t2w.offline_batch([request(i) for i in range(len(lengths))])
        bound = WAVE_REL_ZERO_NOISE if noise == "zero" else WAVE_REL_SEEDED
        for i, wave in enumerate(batched):
            r = request(i)
            alone = t2w.offline(r.tokens, r.prompt_tokens, r.prompt_feat, r.embedding, generator=r.generator,
                                sine_noise=r.sine_noise)
            assert wave.shape == alone.shape == (lengths[i] * 960,)
            assert _rel(wave, alone) < bound, (noise, i, _rel(wave, alone))


def test_seeded_batch_consumes_each_generator_like_a_single_run(t2w):
    generators = [_seeded(0), _seeded(1)]
    t2w.offline_batch([OfflineRequest(_tokens(20, i), **_prompt(i), generator=g) for i, g in enumerate(generators)])
    for i, g in enumerate(generators):
        reference = _seeded(i)
        t2w.offline(_tokens(20, i), **_prompt(i), generator=reference)
        assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=reference))


# ----- streaming through the batcher -----

def _direct_stream(model, i: int, n: int, **noise) -> list[torch.Tensor]:
    tokens = _tokens(n, 10 + i)
    with model.open_stream(**_prompt(i), **noise) as stream:
        return [stream.step(tokens[:c.num_tokens], c.token_offset, c.finalize) for c in plan_chunks(n)]


def _batched_streams(model, lengths: list[int], noise_for, offline_every_round: bool = False) -> list[list]:
    """Step all streams round by round (chunk k of every stream in one batch), plus an offline request."""
    batcher = Token2WavBatcher(model, max_batch=8)
    plans = [plan_chunks(n) for n in lengths]
    tokens = [_tokens(n, 10 + i) for i, n in enumerate(lengths)]
    streams = [model.open_stream(**_prompt(i), **noise_for(i)) for i in range(len(lengths))]
    pieces: list[list] = [[] for _ in lengths]
    for k in range(max(len(p) for p in plans)):
        futures = [(i, batcher.submit_step(streams[i], tokens[i][:p[k].num_tokens], p[k].token_offset, p[k].finalize))
                   for i, p in enumerate(plans) if k < len(p)]
        offline = batcher.submit_offline(OfflineRequest(_tokens(17, 99), **_prompt(0), sine_noise=_zero_noise)) \
            if offline_every_round else None
        assert batcher.run_batch() == len(futures) + (offline is not None) and batcher.pending == 0
        for i, future in futures:
            pieces[i].append(future.result(timeout=0))
        if offline is not None:
            assert offline.result(timeout=0).shape == (17 * 960,)
    assert all(s.closed for s in streams) and model.open_streams == 0
    return pieces


def test_batched_streams_equal_direct_streams(t2w):
    lengths = [60, 60, 47]  # equal schedules group HiFT calls; the third differs in its last chunks
    batched = _batched_streams(t2w, lengths, lambda i: {"sine_noise": _zero_noise}, offline_every_round=True)
    for i, n in enumerate(lengths):
        direct = _direct_stream(t2w, i, n, sine_noise=_zero_noise)
        assert [p.shape for p in batched[i]] == [p.shape for p in direct]
        assert _rel(torch.cat(batched[i]), torch.cat(direct)) < WAVE_REL_ZERO_NOISE


def test_batched_seeded_streams_equal_direct_streams(t2w):
    batched = _batched_streams(t2w, [45, 45], lambda i: {"generator": _seeded(i)})
    for i in range(2):
        direct = _direct_stream(t2w, i, 45, generator=_seeded(i))
        assert _rel(torch.cat(batched[i]), torch.cat(direct)) < WAVE_REL_SEEDED


def test_earliest_deadline_runs_first(t2w):
    now = [100.0]
    batcher = Token2WavBatcher(t2w, max_batch=1, clock=lambda: now[0])
    order: list[str] = []
    for name, deadline in (("late", 105.0), ("urgent", 101.0), ("middle", 103.0)):
        future = batcher.submit_offline(OfflineRequest(_tokens(5, 0), **_prompt(0)), deadline=deadline)
        future.add_done_callback(lambda _, name=name: order.append(name))
    while batcher.run_batch():
        pass
    assert order == ["urgent", "middle", "late"]


def test_default_deadline_is_when_the_listener_runs_out_of_audio(t2w):
    now = [0.0]
    batcher = Token2WavBatcher(t2w, max_batch=1, clock=lambda: now[0])
    tokens = _tokens(60, 1)
    first, second = plan_chunks(60)[:2]
    buffered = t2w.open_stream(**_prompt(0))
    batcher.submit_step(buffered, tokens[:first.num_tokens], first.token_offset, first.finalize)
    batcher.run_batch()  # returned 10560 samples = 0.44 s at t = 0
    now[0] = 0.1
    order: list[str] = []
    batcher.submit_step(buffered, tokens[:second.num_tokens], second.token_offset, second.finalize) \
        .add_done_callback(lambda _: order.append("buffered"))  # due at 0.44
    fresh = t2w.open_stream(**_prompt(1))
    batcher.submit_step(fresh, tokens[:first.num_tokens], 0, False) \
        .add_done_callback(lambda _: order.append("fresh"))  # no audio yet: due now (0.1)
    while batcher.run_batch():
        pass
    assert order == ["fresh", "buffered"]
    buffered.close()
    fresh.close()


def test_served_path_batches_by_deadline(t2w, monkeypatch):
    """LocalToken2Wav (the Triton token2wav model's executor) schedules through the batcher: with more
    calls than ``max_batch``, streams that have no audio yet go before one whose listener is
    buffered, each batch keeps submission order, and every call gets its own piece."""
    served = LocalToken2Wav(t2w, max_batch=2)
    voices = [Voice("", PromptFeatures(*_prompt(i).values())) for i in range(3)]
    n = 60
    tokens = _tokens(n, 3).tolist()
    first, second = plan_chunks(n)[:2]
    calls = [Token2WavCall("buffered", tokens[:first.num_tokens], voices[0], 0, False)]
    assert served.run(calls)[0].shape == (10560,)  # 0.44 s the listener has not played yet

    batches: list[list[str]] = []
    run_batch = t2w.run_batch
    monkeypatch.setattr(t2w, "run_batch", lambda work: batches.append([w.stream.label for w in work])
                        or run_batch(work))
    calls = [Token2WavCall("buffered", tokens[:second.num_tokens], voices[0], second.token_offset, False),
             Token2WavCall("fresh-1", tokens[:first.num_tokens], voices[1], 0, False),
             Token2WavCall("fresh-2", tokens[:first.num_tokens], voices[2], 0, False)]
    pieces = served.run(calls)
    assert batches == [["fresh-1", "fresh-2"], ["buffered"]]
    assert pieces[0].size > 0 and pieces[1].shape == pieces[2].shape == (10560,)
    for rid in ("buffered", "fresh-1", "fresh-2"):
        served.cancel(rid)
    assert t2w.open_streams == 0


def test_served_sessions_by_request_id_end_on_finalize_cancel_error_idle_and_close(t2w):
    """LocalToken2Wav keeps one stream per request id from its first step to its last, a cancel, a
    failed step, ``idle_timeout_s`` without a step, or :meth:`close_all`; a finished id may be used again."""
    served = LocalToken2Wav(t2w, idle_timeout_s=0.2)
    voice = Voice("", PromptFeatures(*_prompt(0).values()))
    tokens = _tokens(60, 4).tolist()
    first, second = plan_chunks(60)[:2]

    def step(rid: str, chunk, finalize: bool = False):
        return served.run([Token2WavCall(rid, tokens[:chunk.num_tokens], voice, chunk.token_offset, finalize)])[0]

    assert step("a", first).shape == (10560,) and served.open_sessions == t2w.open_streams == 1
    assert step("a", second).size > 0 and served.open_sessions == 1  # the same session went on
    assert isinstance(step("a", first), InvalidInputError)  # out of order: the step fails, the session ends
    assert served.open_sessions == t2w.open_streams == 0
    assert step("a", first).shape == (10560,)  # the id is free again
    served.cancel("a")
    step("b", first)
    time.sleep(0.3)
    step("c", first)  # each run first closes the sessions idle past the timeout
    assert served.open_sessions == 1
    served.close_all()
    assert served.open_sessions == t2w.open_streams == 0


def test_background_worker_serves_concurrent_callers(t2w):
    results: dict[int, torch.Tensor] = {}
    with Token2WavBatcher(t2w, max_batch=4).start() as batcher:
        def client(i: int) -> None:
            request = OfflineRequest(_tokens(10 + i, i), **_prompt(i), sine_noise=_zero_noise)
            results[i] = batcher.submit_offline(request).result(timeout=60)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(results) == [0, 1, 2, 3]
    assert sum(batcher.batch_sizes) == 4
    for i, wave in results.items():
        alone = t2w.offline(_tokens(10 + i, i), **_prompt(i), sine_noise=_zero_noise)
        assert _rel(wave, alone) < WAVE_REL_ZERO_NOISE


def test_bad_submissions_and_failed_batches(t2w):
    batcher = Token2WavBatcher(t2w)
    stream = t2w.open_stream(**_prompt(0))
    with pytest.raises(InvalidInputError, match="does not continue"):
        batcher.submit_step(stream, _tokens(20, 0), 4, False)
    assert stream.closed and batcher.pending == 0

    stream = t2w.open_stream(**_prompt(0))
    batcher.submit_step(stream, _tokens(20, 0), 0, False)
    with pytest.raises(InvalidInputError, match="already has a step pending"):
        batcher.submit_step(stream, _tokens(30, 0), 17, False)
    batcher.run_batch()

    def broken_noise(length: int) -> torch.Tensor:
        raise RuntimeError("noise source failed")

    failing = t2w.open_stream(**_prompt(1), sine_noise=broken_noise)
    futures = [batcher.submit_step(failing, _tokens(20, 0), 0, False),
               batcher.submit_step(stream, _tokens(40, 0), 17, True)]
    batcher.run_batch()
    for future in futures:
        with pytest.raises(RuntimeError, match="noise source failed"):
            future.result(timeout=0)
    assert failing.closed and stream.closed and t2w.open_streams == 0
    with pytest.raises(InvalidInputError, match="max_batch"):
        Token2WavBatcher(t2w, max_batch=0)


# ----- opt-in speed-ups -----

def test_incremental_stream_equals_rerun(parts, t2w):
    incremental = _model(parts, Token2WavOptions(incremental_stream=True))
    n = 110  # four chunks: 18, 43, 93 tokens and the final one
    assert len(plan_chunks(n)) == 4
    direct = _direct_stream(t2w, 0, n, sine_noise=_zero_noise)
    fast = _direct_stream(incremental, 0, n, sine_noise=_zero_noise)
    assert [p.shape for p in fast] == [p.shape for p in direct]
    for a, b in zip(fast, direct):
        assert _rel(a, b) < WAVE_REL_ZERO_NOISE
    batched = _batched_streams(incremental, [n, 60], lambda i: {"sine_noise": _zero_noise})
    assert _rel(torch.cat(batched[0]), torch.cat(direct)) < WAVE_REL_ZERO_NOISE


def test_streams_without_state_pages_finish_on_the_rerun_path(parts, t2w):
    """A pool of 2 pages: two 110-token streams batched together outgrow it (4 pages each by their
    third chunk); whoever cannot get pages leaves the engine and re-runs, with the same audio, and
    every page comes back."""
    page_bytes = _model(parts, Token2WavOptions(incremental_stream=True)).engine.page_bytes
    small = _model(parts, Token2WavOptions(incremental_stream=True, state_pool_bytes=2 * page_bytes))
    assert small.engine.pool.pages == 2
    n = 110
    direct = [torch.cat(_direct_stream(t2w, i, n, sine_noise=_zero_noise)) for i in range(2)]
    batched = _batched_streams(small, [n, n], lambda i: {"sine_noise": _zero_noise})
    for got, want in zip(batched, direct):
        assert _rel(torch.cat(got), want) < WAVE_REL_ZERO_NOISE
    assert small.counters.engine_fallbacks == 2
    assert small.engine.open_streams == 0 and small.engine.pool.free_pages == small.engine.pool.pages


@pytest.mark.parametrize("streaming, finalize", [(False, True), (True, False)])
def test_padded_sampler_equals_eager(t2w, streaming, finalize):
    flow = t2w.flow
    requests = [(i, n) for i, n in enumerate([23, 31, 9])]
    c = flow.batch_conditions([_tokens(n, i)[None] for i, n in requests],
                              [_prompt(i)["prompt_tokens"][None] for i, _ in requests],
                              [_prompt(i)["prompt_feat"] for i, _ in requests],
                              [_prompt(i)["embedding"][None] for i, _ in requests],
                              streaming=streaming, finalize=finalize)
    eager = FlowSampler(flow.decoder)(c, streaming)
    padded = FlowSampler(flow.decoder, pad=True, bucket_frames=50)(c, streaming)  # 3 -> 4 rows, T -> 100
    assert padded.shape == eager.shape
    for got, want in zip(c.target_mels(padded), c.target_mels(eager)):
        assert _rel(got, want) < MEL_REL


def test_padded_hift_decomposition_equals_inference(t2w):
    """The graph path's HiFT (network part separate, rows padded to a power of two) equals inference."""
    g = torch.Generator().manual_seed(8)
    mel = torch.randn(3, 80, 20, generator=g)
    cache = torch.randn(3, 1, 3840, generator=g).tanh()
    noise = torch.randn(3, 20 * 480, 9, generator=g)
    speech, source = HiftRunner(t2w.hift, pad=True)(mel, cache, noise)  # 3 rows -> 4
    want_speech, want_source = t2w.hift.inference(mel, cache, sine_noise=noise)
    assert speech.shape == want_speech.shape == (3, 20 * 480)
    assert torch.equal(source, want_source) and _rel(speech, want_speech) < 1e-6
    assert _rel(speech[2], t2w.hift.inference(mel[2:], cache[2:], sine_noise=noise[2:])[0][0]) < 1e-6


def test_cuda_graphs_need_a_cuda_device(parts):
    with pytest.raises(InvalidInputError, match="CUDA"):
        _model(parts, Token2WavOptions(cuda_graphs=True))


def test_frame_buckets_are_few_and_bound_the_padding():
    from cosyserve.token2wav.graphs import frame_bucket, frame_buckets

    buckets = frame_buckets(1500, 50)
    assert buckets[:8] == list(range(50, 401, 50)) and buckets[-1] >= 1500 and len(buckets) == 14
    for frames in range(1, 1501):
        bucket = frame_bucket(frames, 50)
        assert bucket in buckets and frames <= bucket <= max(frames + 49, 1.25 * frames + 50)
    assert frame_bucket(15000, 50) == 15000  # capped at the noise buffer


@pytest.mark.slow  # ~2 minutes of inductor compilation on 2 cores
def test_compiled_estimator_equals_eager(t2w):
    """torch.compile of the estimator (dynamic shapes) gives the eager mel for two lengths, both attention kinds."""
    pytest.importorskip("torch._inductor")
    flow = t2w.flow
    compiled = FlowSampler(flow.decoder, compile=True)
    for streaming, finalize in ((True, False), (False, True)):
        for n in (23, 40):
            c = flow.batch_conditions([_tokens(n, 0)[None]], [_prompt(0)["prompt_tokens"][None]],
                                      [_prompt(0)["prompt_feat"]], [_prompt(0)["embedding"][None]],
                                      streaming=streaming, finalize=finalize)
            assert _rel(compiled(c, streaming), FlowSampler(flow.decoder)(c, streaming)) < MEL_REL


def test_precapture_needs_cuda_graphs(parts):
    with pytest.raises(InvalidInputError, match="precapture_frames needs cuda_graphs"):
        _model(parts, Token2WavOptions(precapture_frames=100))
    with pytest.raises(InvalidInputError, match="needs cuda_graphs"):
        FlowSampler(_model(parts).flow.decoder).precapture(1, 100)


def test_streaming_vocoder_frames_are_the_non_final_chunk_shapes():
    from cosyserve.token2wav.cosyvoice2 import streaming_vocoder_frames

    # hops 15, 25, 50, 100, 200 tokens; the first call has no cached frames, the others 8
    assert streaming_vocoder_frames(750) == (30, 58, 108, 208, 408)
    assert streaming_vocoder_frames(100) == (30, 58, 108)
    assert streaming_vocoder_frames(18) == (30,) and streaming_vocoder_frames(17) == ()  # 17: final chunk only


def test_hift_precapture_needs_graphs(parts):
    with pytest.raises(InvalidInputError, match="hift_precapture_frames needs cuda_graphs"):
        _model(parts, Token2WavOptions(hift_precapture_frames=(30,)))
    with pytest.raises(InvalidInputError, match="needs cuda_graphs"):
        HiftRunner(_model(parts).hift).precapture(1, (30,))


def test_work_counters_add_up(parts):
    """Stage times and flow batch fill, as the token2wav model exports them."""
    model = _model(parts)
    sampler = FlowSampler(model.flow.decoder, pad=True, bucket_frames=50)
    model.sampler = sampler
    requests = [OfflineRequest(_tokens(n, i), **_prompt(i), sine_noise=_zero_noise) for i, n in enumerate([23, 31, 9])]
    model.offline_batch(requests)
    frames = [2 * (PROMPTS[i % 3] + n) for i, n in enumerate([23, 31, 9])]
    assert (sampler.counters.calls, sampler.counters.rows, sampler.counters.frames) == (1, 3, sum(frames))
    assert sampler.counters.padded_frames == 4 * 100  # 3 rows -> 4, 80 frames -> bucket 100
    assert model.counters.flow_s > 0 and model.counters.hift_s > 0


def test_row_buckets_bound_the_padding():
    from cosyserve.token2wav.graphs import row_bucket, row_buckets

    assert row_buckets(16) == [1, 2, 4, 6, 8, 12, 16]
    for rows in range(1, 65):
        bucket = row_bucket(rows)
        assert rows <= bucket < 1.5 * rows or rows <= 2
        assert rows > 16 or rows <= 4 or bucket <= 4 * rows / 3
