"""CosyVoice3 as a kind of the engine (tiny random flow and HiFT, CPU): packed Euler steps of many
streams' windows, each row at its own step, against each stream's own ``Cv3FlowStream.push``; the
padded buffers against the unpadded step; a stream against one block-masked pass over all its
tokens; the re-run and offline passes against the model layer's full-attention flow and causal
HiFT (the reference's computation); streams that open, abort and finish leave nothing behind.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cosyserve.engine.core import EngineCore
from cosyserve.engine.kinds.cosyvoice3 import CosyVoice3Kind
from cosyserve.engine.request import EngineRequest
from cosyserve.engine.runners.llm import BackendLLM
from cosyserve.errors import InvalidInputError
from cosyserve.frontend.prompt import PromptFeatures, Voice
from cosyserve.llm.stream import Finished, TokenStream
from cosyserve.models.cosyvoice3.config import CausalHiftConfig, Cv3FlowConfig
from cosyserve.models.cosyvoice3.flow import CosyVoice3Flow, Cv3FlowStream
from cosyserve.models.cosyvoice3.hift import CausalHiFTGenerator, CausalHiftStream
from cosyserve.engine.front_end import SegmentPrompt, TokenLimits
from cosyserve.models.cosyvoice3.dit import WindowState
from cosyserve.schedule import ChunkScheduler
from cosyserve.token2wav.cosyvoice3_packed import ConditionRow, PackedWindowSampler, WindowJob, token_conditions

torch.set_num_threads(2)
MEL_ATOL = 1e-4  # fp32 rounding (measured ~1e-6)
# Small buckets and budgets, so the tiny streams (prompt 80 frames, windows 30..140) use several
# shapes, split steps into groups and leave some jobs (committed frames over 200) to the eager fallback.
SMALL_GRID = dict(job_buckets=(1, 2, 4), past_buckets=(0, 50, 100, 200), width_buckets=(64, 128, 256),
                  past_budget=400, width_budget=512)


def tiny_models() -> tuple[CosyVoice3Flow, CausalHiFTGenerator]:
    """The tiny flow and HiFT, seeded: each call builds the same weights anew."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        flow = CosyVoice3Flow(Cv3FlowConfig.tiny())
        hift = CausalHiFTGenerator(CausalHiftConfig.tiny()).f0_in_float64().fold_weight_norm()
    return flow.eval().requires_grad_(False), hift.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def random_features(prompt_tokens: int, seed: int) -> PromptFeatures:
    g = torch.Generator().manual_seed(seed)
    return PromptFeatures(torch.randint(0, 6561, (prompt_tokens,), generator=g).int(),
                          torch.randn(2 * prompt_tokens, 80, generator=g), torch.randn(192, generator=g))


@pytest.fixture(scope="module")
def features():
    return random_features(40, 1)  # 80 prompt frames: a 50-frame voice prefix


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


STREAMS = [tokens(130, 11), tokens(60, 12), tokens(95, 13)]
STARTS = [0, 3, 7]  # iterations the streams start at: their rows are at different Euler steps


def chunks_of(n: int):
    schedule = ChunkScheduler("exponential")
    while (chunk := schedule.next_chunk(n)) is not None:
        yield chunk
    yield schedule.final_chunk(n)


def drive(kind: CosyVoice3Kind, features, streams=STREAMS, starts=STARTS, vocode=False) -> list[list]:
    """The engine's use of a kind, without its LLM: every iteration starts the next chunk of each
    stream that has none under way (all at once), steps every job, collects the done ones."""
    plans = [list(chunks_of(len(ids))) for ids in streams]
    voicings, jobs, out = [None] * len(streams), [None] * len(streams), [[] for _ in streams]
    iteration = 0
    while any(plans) or any(jobs):
        ready = [i for i, plan in enumerate(plans) if plan and jobs[i] is None and iteration >= starts[i]]
        for i in ready:
            voicings[i] = voicings[i] or kind.open(features)
        started = kind.start_chunks([(voicings[i], streams[i][:plans[i][0].num_tokens], plans[i][0].token_offset,
                                      plans[i][0].finalize) for i in ready]) if ready else []
        for i, job in zip(ready, started):
            jobs[i] = job
            plans[i].pop(0)
        kind.step([job for job in jobs if job is not None])
        done = [i for i, job in enumerate(jobs) if job is not None and job.done]
        mels = [kind.mel(jobs[i]) for i in done]
        pieces = ([p.cpu().numpy() for p in kind.vocode([(voicings[i], mel, jobs[i].finalize) for i, mel in zip(done, mels)])]
                  if vocode else mels)
        for i, piece in zip(done, pieces):  # vocoded together, as the core does
            out[i].append(piece)
            if jobs[i].finalize:
                voicings[i].close()
            jobs[i] = None
        iteration += 1
    return out


def flow_stream_mels(flow, features, ids: list[int], prefix=None) -> list[torch.Tensor]:
    f = features
    stream = Cv3FlowStream(flow, f.speech_tokens.reshape(1, -1).long(), f.speech_feat[None], f.embedding[None],
                           prefix=prefix)
    mels, received = [], 0
    for chunk in chunks_of(len(ids)):
        mels.append(stream.push(torch.tensor(ids[received:chunk.num_tokens], dtype=torch.long)[None], chunk.finalize))
        received = chunk.num_tokens
    return mels


def prompt_of(features) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = features
    return f.speech_tokens.reshape(1, -1).long(), f.speech_feat[None], f.embedding[None]


@torch.inference_mode()
def rerun_pcm(flow, hift, features, ids: list[int]) -> list[np.ndarray]:
    """The reference runtime's stream: per chunk, the full-attention flow over every token so far,
    the frames already sent dropped, vocoded by one causal HiFT stream."""
    vocoder, sent, pieces = CausalHiftStream(hift), 0, []
    for chunk in chunks_of(len(ids)):
        lookahead = 0 if chunk.finalize else flow.cfg.pre_lookahead_len
        if chunk.num_tokens + features.speech_tokens.numel() <= lookahead:
            mel = torch.zeros(1, 80, 0)
        else:
            mel = flow.inference(torch.tensor([ids[:chunk.num_tokens]]), *prompt_of(features), streaming=False,
                                 finalize=chunk.finalize)
        new, sent = mel[:, :, sent:], max(sent, mel.shape[2])
        pieces.append(vocoder.push(new, chunk.finalize).reshape(-1).numpy())
    return pieces


@torch.inference_mode()
def offline_pcm(flow, hift, features, ids: list[int], streaming: bool = False) -> np.ndarray:
    """One flow pass over all tokens (full attention, or block-masked with ``streaming``), one HiFT call."""
    mel = flow.inference(torch.tensor([ids]), *prompt_of(features), streaming=streaming, finalize=True)
    return hift.inference(mel, finalize=True)[0].reshape(-1).numpy()


def max_diff(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> float:
    worst = 0.0
    for stream_got, stream_expected in zip(got, expected, strict=True):
        assert [m.shape for m in stream_got] == [m.shape for m in stream_expected]
        worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(stream_got, stream_expected) if a.numel()])
    return worst


@pytest.mark.parametrize("finalize", [False, True], ids=["look-ahead", "final"])
def test_a_windows_conditions_are_the_whole_sequences_frames(models, features, finalize):
    """token_conditions embeds only a window's tokens and their neighbours, its rows padded to one
    shape: each row's mu and cond are CosyVoice3Flow.prepare's frames of that window (windows from
    the start, inside the 80-frame prompt and after it; rows of different lengths in one call)."""
    flow = models[0]
    prompt_tokens, feat = features.speech_tokens.long()[None], features.speech_feat[None]
    rows, expected = [], []
    for n, start in [(30, 0), (57, 50), (90, 100), (12, 0), (75, 150)]:
        ids = torch.tensor(tokens(n, n))
        c = flow.prepare(ids[None], prompt_tokens, feat, features.embedding[None], finalize=finalize)
        rows.append(ConditionRow(torch.cat([prompt_tokens[0], ids]), start, finalize, feat))
        expected.append((c.mu[:, :, start:], c.cond[:, :, start:]))
    for (mu, cond), (mu_ref, cond_ref) in zip(token_conditions(flow, rows, torch.device("cpu")), expected):
        assert mu.shape == mu_ref.shape
        torch.testing.assert_close(mu, mu_ref, rtol=0, atol=MEL_ATOL)
        assert torch.equal(cond, cond_ref)  # copies of the prompt mel, and zeros


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_packed_windows_equal_each_streams_own_pushes(models, features, padded):
    """Without voice prefixes, every stream's chunks equal its Cv3FlowStream's, the final one included."""
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, max_voices=0, padded=padded, **SMALL_GRID)
    steps, sampler_step = [], kind.sampler.step
    kind.sampler.step = lambda jobs: (steps.append({job.step for job in jobs}), sampler_step(jobs))
    got = drive(kind, features)
    assert any(len(s) > 1 for s in steps)  # rows at different Euler steps in one step
    assert max_diff(got, [flow_stream_mels(flow, features, ids) for ids in STREAMS]) < MEL_ATOL
    assert sum(m.shape[2] for m in got[0]) == 2 * len(STREAMS[0])
    assert kind.sampler.calls > 0 and kind.open_streams == 0 and kind.cached_voices == 0
    if padded:  # some steps split into groups, some jobs fit no shape (over 200 committed frames)
        assert kind.sampler.calls > len(steps) and kind.sampler.eager_calls > 0


def test_streams_start_after_the_voices_shared_prefix(models, features):
    """A warmed voice's streams start after its prefix and equal pushes from that prefix; a voice
    not warmed takes its prefix from its first stream's first window, which its later streams use.
    The scheduler's budget counts a first window's prompt (cold_frames) only while it is not kept."""
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, max_voices=2, padded=True, **SMALL_GRID)
    assert kind.cold_frames(features) == 50
    kind.prepare_voices([features])
    prefix = kind.voice_prefix(features)
    assert prefix is not None and prefix.frames == 50 and kind.cold_frames(features) == 0
    got = drive(kind, features)
    assert max_diff(got, [flow_stream_mels(flow, features, ids, prefix) for ids in STREAMS]) < MEL_ATOL
    assert kind.prefix_hits == len(STREAMS)  # each stream's open (voice_prefix counts nothing)

    other = random_features(30, 2)
    starts = [0, 12]  # the second stream opens after the first one's first window committed
    assert kind.cold_frames(other) == 50
    got = drive(kind, other, STREAMS[:2], starts)
    offered = kind.voice_prefix(other)
    assert offered is not None and offered.frames == 50 and kind.cached_voices == 2
    assert kind.cold_frames(other) == 0
    expected = [flow_stream_mels(flow, other, STREAMS[0]), flow_stream_mels(flow, other, STREAMS[1], offered)]
    assert max_diff(got, expected) < MEL_ATOL
    # the offered prefix is the voice's own prefix (sampled apart by a stream that keeps it)
    kept = Cv3FlowStream(flow, other.speech_tokens.reshape(1, -1).long(), other.speech_feat[None],
                         other.embedding[None], keep_prefix=True)
    kept.push(torch.tensor([STREAMS[0][:18]]))
    torch.testing.assert_close(offered.state.kv, kept.prefix.state.kv, rtol=0, atol=MEL_ATOL)
    assert kind.open_streams == 0


def test_voices_prepared_beside_the_loop_start_their_streams_after_their_prefix(models, features):
    """prepare_beside: a new voice's prefix is computed on another thread (the core's preparation
    thread) by the prefixes' own sampler while the loop's sampler steps another voice's stream;
    launching says so meanwhile. The playing stream is unchanged; the new voice's streams then start
    after its prefix (no cold first window) and equal pushes from it."""
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, max_voices=2, padded=True, prepare_beside=True, **SMALL_GRID)
    assert kind.prepares_beside and not kind.cold_start and kind._prefix_sampler is not kind.sampler
    other = random_features(30, 2)
    launching, step = [], kind._prefix_sampler.step

    def watched(jobs):
        launching.append(kind.launching(other))
        step(jobs)

    kind._prefix_sampler.step = watched
    preparing = threading.Thread(target=kind.prepare_voices, args=([other],))
    preparing.start()
    playing = drive(kind, features, STREAMS[:1], [0])
    preparing.join()
    assert max_diff(playing, [flow_stream_mels(flow, features, STREAMS[0])]) < MEL_ATOL
    assert launching == [True] * 10 and not kind.launching(other) and kind._prefix_sampler.calls == 10
    prefix = kind.voice_prefix(other)
    assert prefix is not None and prefix.frames == 50
    hits = kind.prefix_hits
    got = drive(kind, other, STREAMS[1:], [0, 5])
    assert kind.prefix_hits == hits + 2  # both streams opened after the prefix: none started cold
    assert max_diff(got, [flow_stream_mels(flow, other, ids, prefix) for ids in STREAMS[1:]]) < MEL_ATOL
    kind.wait_prepared([other])  # on the CPU, at once
    assert kind.open_streams == 0


def test_padded_buffers_equal_the_unpadded_step(models, features):
    """Jobs, committed frames and windows padded to buckets (in shared buffers) change no frame."""
    flow, hift = models
    runs = [drive(CosyVoice3Kind(flow, hift, max_voices=1, padded=padded, **grid), features)
            for padded, grid in ((False, {}), (True, {}), (True, SMALL_GRID))]
    assert max_diff(runs[1], runs[0]) < 1e-5 and max_diff(runs[2], runs[0]) < 1e-5


def test_a_steps_jobs_are_cut_into_the_cheapest_padded_calls(models):
    """Jobs of alike shapes share a call; a job whose padding would cost more than a call of its own
    goes apart (5 windows as 4 + 1, not padded to 8; short windows apart from a prompt's); jobs past
    every shape run eagerly; every job is in exactly one call, and a step's cuts are kept."""
    flow, _ = models
    sampler = PackedWindowSampler(flow.decoder, padded=True)

    def job(width: int, start: int = 0) -> WindowJob:
        return WindowJob(WindowState(start, None, None), torch.zeros(3, 80, width), torch.zeros(1, 80), 0)

    def calls(jobs: list[WindowJob]) -> list[tuple[list[int], tuple | None]]:
        groups = sampler._groups(jobs)
        assert sorted(id(j) for group, _ in groups for j in group) == sorted(id(j) for j in jobs)
        return [([j.width for j in group], shape) for group, shape in groups]

    assert calls([job(60) for _ in range(4)]) == [([60] * 4, (4, 0, 64))]
    assert calls([job(500) for _ in range(5)]) == [([500] * 4, (4, 0, 512)), ([500], (1, 0, 512))]
    assert calls([job(500)] + [job(60) for _ in range(4)]) == [([60] * 4, (4, 0, 64)), ([500], (1, 0, 512))]
    assert calls([job(60), job(600)]) == [([60], (1, 0, 64)), ([600], None)]  # wider than every shape
    assert len(sampler._runs) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a capture that fails: no CUDA")
def test_a_failed_capture_runs_that_shape_eagerly(models, features, caplog):
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, max_voices=0, cuda_graphs=True, **SMALL_GRID)
    got = drive(kind, features, STREAMS[:1], [0])
    assert max_diff(got, [flow_stream_mels(flow, features, STREAMS[0])]) < MEL_ATOL
    assert kind.sampler.num_graphs == 0 and kind.sampler.replays == 0 and "runs eagerly" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_replay_the_eager_steps(features):
    """Every shape of the grid captured at load; the streams' steps replay them (none captured under load)."""
    flow, hift = (m.to("cuda") for m in tiny_models())  # built anew: HiFT holds a lock, which deepcopy cannot copy
    eager = CosyVoice3Kind(flow, hift, "cuda", max_voices=1, padded=True, **SMALL_GRID)  # the same shapes
    graphed = CosyVoice3Kind(flow, hift, "cuda", max_voices=1, cuda_graphs=True, **SMALL_GRID)
    assert graphed.sampler.capture_all() == len(graphed.sampler.grid())
    graphs = graphed.sampler.num_graphs
    assert max_diff(drive(graphed, features), drive(eager, features)) < MEL_ATOL
    assert graphed.sampler.replays > 0 and graphed.sampler.num_graphs == graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_voices_prepared_beside_running_streams_give_the_same_mels(features):
    """With CUDA graphs and prepare_beside: a new voice's prefix launched on another thread (the
    prefixes' sampler, its graphs and its CUDA stream) while a stream of another voice replays the
    loop's graphs behind long GPU work; the new voice's streams, which wait for its event on the
    device, equal an eager kind's that does everything in order (a missed wait would read garbage)."""
    flow, hift = (m.to("cuda") for m in tiny_models())
    eager = CosyVoice3Kind(flow, hift, "cuda", max_voices=2, padded=True, **SMALL_GRID)
    graphed = CosyVoice3Kind(flow, hift, "cuda", max_voices=2, cuda_graphs=True, prepare_beside=True, **SMALL_GRID)
    for kind in (eager, graphed):  # graphed: both samplers' grids captured; each: the voice's prefix offered
        kind.warm_up(features)
    assert graphed._prefix_sampler.num_graphs == len(graphed._prefix_sampler.grid()) > 0
    assert graphed.vocoder_graphs.num_graphs == 3 * 5 * 8  # f0, network x2; 1-16 rows; widths up to 256
    other = random_features(30, 2)
    eager.prepare_voices([other])  # the same padded shapes, in order on one thread
    expected = drive(eager, other, STREAMS[1:], [0, 5])
    expected_playing = drive(eager, features, STREAMS[:1], [0])
    torch.cuda._sleep(50_000_000)  # the loop's stream busy while the prefix is launched beside it
    preparing = threading.Thread(target=graphed.prepare_voices, args=([other],))
    preparing.start()
    playing = drive(graphed, features, STREAMS[:1], [0])
    preparing.join()
    got = drive(graphed, other, STREAMS[1:], [0, 5])
    torch.cuda.synchronize()
    assert max_diff(got, expected) < MEL_ATOL
    assert max_diff(playing, expected_playing) < MEL_ATOL
    assert graphed._prefix_sampler.replays == 10 and graphed.open_streams == 0


def test_the_rerun_and_offline_passes_equal_the_references_computation(models, features):
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, incremental=False, padded=True, **SMALL_GRID)
    streams = STREAMS[:2]
    got = drive(kind, features, streams, [0, 4], vocode=True)
    for i, ids in enumerate(streams):
        expected = rerun_pcm(flow, hift, features, ids)
        assert [p.size for p in got[i]] == [p.size for p in expected]
        assert sum(p.size for p in got[i]) == 960 * len(ids)
        assert np.abs(np.concatenate(got[i]) - np.concatenate(expected)).max() < 1e-4

    ids = tokens(70, 21)
    job = kind.start_offline(features, ids)
    while not job.done:
        kind.step([job])
    pcm = kind.vocode([(None, kind.mel(job), True)])[0].cpu().numpy()
    expected = offline_pcm(flow, hift, features, ids)
    assert pcm.size == expected.size == 960 * len(ids)
    assert np.abs(pcm - expected).max() < 1e-4
    assert kind.open_streams == 0


def test_a_stream_equals_one_block_masked_pass_over_all_its_tokens(models, features):
    """Chunk by chunk, a stream computes what one block-masked flow pass over all its tokens and one
    causal HiFT call give (960 samples per token), with or without the voice's kept prefix."""
    flow, hift = models
    for max_voices in (0, 1):
        kind = CosyVoice3Kind(flow, hift, max_voices=max_voices, padded=True, **SMALL_GRID)
        got = drive(kind, features, vocode=True)
        for ids, pieces in zip(STREAMS, got):
            audio = np.concatenate(pieces)
            assert audio.size == 960 * len(ids)
            expected = offline_pcm(flow, hift, features, ids, streaming=True)
            assert np.linalg.norm(audio - expected) / np.linalg.norm(expected) < 1e-2
            assert np.abs(audio).max() <= 0.99 + 1e-6


def test_streams_at_one_point_of_the_schedule_share_the_vocoders_decoder_call(models, features):
    """Streams whose chunks end together with windows of one shape are decoded in one batched HiFT
    call; each gets the audio it gets vocoded alone."""
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, max_voices=1, padded=True, **SMALL_GRID)
    batches, spectrum_from = [], hift.spectrum_from
    hift.spectrum_from = lambda mel, spec, finalize: (batches.append(mel.shape[0]),
                                                      spectrum_from(mel, spec, finalize))[1]
    try:
        together = drive(kind, features, [STREAMS[1], STREAMS[1][::-1]], [0, 0], vocode=True)
    finally:
        del hift.spectrum_from  # the class's method again
    assert max(batches) == 2
    for ids, pieces in zip([STREAMS[1], STREAMS[1][::-1]], together):
        alone = drive(CosyVoice3Kind(flow, hift, max_voices=1, padded=True, **SMALL_GRID), features, [ids], [0],
                      vocode=True)[0]
        assert [p.size for p in pieces] == [p.size for p in alone]
        assert np.abs(np.concatenate(pieces) - np.concatenate(alone)).max() < 1e-5


def test_the_least_recently_used_voice_prefix_goes(models, features):
    """With one voice kept: its second stream hits; another voice misses and takes its place; the
    first voice then misses again. Every stream's audio is the same as with nothing kept."""
    flow, hift = models
    plain = CosyVoice3Kind(flow, hift, max_voices=0)
    cached = CosyVoice3Kind(flow, hift, max_voices=1)
    expected = drive(plain, features, STREAMS[:1], [0], vocode=True)
    for _ in range(2):
        assert max_diff([[torch.from_numpy(p) for p in drive(cached, features, STREAMS[:1], [0], vocode=True)[0]]],
                        [[torch.from_numpy(p) for p in expected[0]]]) < 1e-5
    assert (cached.prefix_misses, cached.prefix_hits, cached.cached_voices) == (1, 1, 1)
    other = random_features(30, 2)
    drive(cached, other, STREAMS[:1], [0])
    assert (cached.prefix_misses, cached.cached_voices) == (2, 1)
    drive(cached, features, STREAMS[:1], [0])
    assert cached.prefix_misses == 3 and cached.open_streams == 0
    assert (plain.prefix_misses, plain.prefix_hits, plain.cached_voices) == (0, 0, 0)


def test_a_stream_without_room_for_its_state_re_runs_its_chunks(models, features):
    """When the device has less free memory than a 30 s stream's flow state, a new stream re-runs its
    chunks (the reference's computation, nothing kept) instead of exhausting the GPU; streams that
    opened with room stay incremental; the gauge counts the fallbacks."""
    flow, hift = models
    free = [1 << 40]
    kind = CosyVoice3Kind(flow, hift, max_voices=1, padded=True, free_memory=lambda: free[0], **SMALL_GRID)
    roomy = kind.open(features)
    free[0] = kind.stream_reserve_bytes - 1
    cramped = kind.open(features)
    gauges = kind.gauges()
    assert roomy.incremental and not cramped.incremental and gauges["rerun_fallbacks"][1] == 1
    assert gauges["window_graphs"][1] == 0 and gauges["window_calls"][1] == kind.sampler.calls
    roomy.close()
    cramped.close()
    got = drive(kind, features, STREAMS[:2], [0, 3], vocode=True)  # opened now: both without room
    for ids, pieces in zip(STREAMS[:2], got):
        expected = rerun_pcm(flow, hift, features, ids)
        assert np.abs(np.concatenate(pieces) - np.concatenate(expected)).max() < 1e-4
    assert kind.fallbacks == 3 and kind.open_streams == 0


def test_open_abort_and_finish_leave_no_stream_behind(models, features):
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, padded=True, **SMALL_GRID)
    ids = tokens(60, 31)
    finished, aborted, idle = (kind.open(features) for _ in range(3))
    assert kind.open_streams == 3
    jobs = kind.start_chunks([(finished, ids, 0, True), (aborted, ids[:18], 0, False)])
    for _ in range(4):
        kind.step(jobs)
    kind.abort([jobs[1]])
    assert jobs[1].window is None and aborted.job is None
    with pytest.raises(InvalidInputError, match="finished"):
        kind.start_chunks([(aborted, ids[:43], 15, False)])
    aborted.close()
    while not jobs[0].done:
        kind.step(jobs)
    (pcm,) = kind.vocode([(finished, kind.mel(jobs[0]), True)])
    assert pcm.numel() == 960 * len(ids)
    finished.close()
    idle.close()
    idle.close()  # harmless twice
    assert kind.open_streams == 0
    closing = kind.open(features)  # closed with a chunk under way
    (job,) = kind.start_chunks([(closing, ids[:18], 0, False)])
    kind.step([job])
    closing.close()
    assert kind.open_streams == 0 and job.window is None


def test_bad_token_ids_raise_before_any_work(models, features):
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift)
    good, bad = kind.open(features), kind.open(features)
    for ids in ([1, 2, 6561] + [0] * 20, [-1] * 20):
        with pytest.raises(InvalidInputError, match="0..6560"):
            kind.start_chunks([(good, tokens(20, 1), 0, False), (bad, ids, 0, False)])
        with pytest.raises(InvalidInputError, match="0..6560"):
            kind.start_offline(features, ids)
    assert good.received == good.emitted - 80 == 0 and good.job is None and kind.sampler.calls == 0
    (job,) = kind.start_chunks([(good, tokens(20, 1), 0, False)])  # the stream is untouched
    assert job.frames == 2 * (40 + 20 - 3)
    with pytest.raises(InvalidInputError, match="no speech tokens"):
        kind.start_offline(features, [])
    with pytest.raises(InvalidInputError, match="split the request"):
        kind.start_chunks([(bad, [0] * 7500, 0, False)])
    good.close()
    bad.close()
    assert kind.open_streams == 0


class ScriptedLLM:
    """An LLM back end that streams given speech tokens per request id from a thread."""

    def __init__(self, scripts: dict[str, list[int]]):
        self.scripts = scripts

    def generate_stream(self, prompt_ids, params, request_id=None) -> TokenStream:
        stream = TokenStream(request_id, lambda: None)

        def produce():
            for token in self.scripts[request_id]:
                stream.put(token)
            stream.put(Finished("stop"))
        threading.Thread(target=produce, daemon=True).start()
        return stream

    def close(self) -> None:
        pass


def run_scripted(kind, features, scripts: dict[str, list[int]], offline: tuple[str, ...] = ()):
    """Every request of ``scripts`` (id -> the speech tokens its LLM hands over; ``offline`` ids
    voiced offline) queued before the EngineCore's loop starts, run to its end; returns each
    request's PCM pieces, its end (None or the error) and the closed core."""
    core = EngineCore(kind, BackendLLM(ScriptedLLM(scripts)))
    pieces = {rid: [] for rid in scripts}
    ends: dict[str, BaseException | None] = {}
    done = threading.Event()

    def finish(rid):
        def record(error):
            ends[rid] = error
            if len(ends) == len(scripts):
                done.set()
        return record

    for rid in scripts:  # queued before the loop starts: their chunks start in the same iterations
        core.submit(EngineRequest(rid, iter([SegmentPrompt(rid, "text", [1, 2, 3])]), Voice("prompt text", features),
                                  TokenLimits(200), rid not in offline, pieces[rid].append, finish(rid)))
    core.start()
    try:
        assert done.wait(60)
    finally:
        core.close()
    return pieces, ends, core


@pytest.mark.parametrize("prepare_beside", [False, True], ids=["cold", "beside"])
def test_the_engine_core_voices_streams_and_offline_requests(models, features, prepare_beside):
    """Through EngineCore: concurrent streams and an offline request give the reference's audio,
    and every voicing is closed when they end. "beside": the voice's prefix computed on the core's
    preparation thread as the requests arrive, the streams starting after it."""
    flow, hift = models
    kind = CosyVoice3Kind(flow, hift, padded=True, prepare_beside=prepare_beside, **SMALL_GRID)
    scripts = {"s0": STREAMS[0], "s1": STREAMS[1], "off": tokens(50, 41)}
    pieces, ends, core = run_scripted(kind, features, scripts, offline=("off",))
    assert all(error is None for error in ends.values()), ends
    for rid in ("s0", "s1"):
        ids = scripts[rid]
        alone = drive(CosyVoice3Kind(flow, hift, max_voices=0), features, [ids], [0], vocode=True)[0]
        expected = np.concatenate(alone)
        got = np.concatenate(pieces[rid])
        assert got.size == expected.size == 960 * len(ids)
        assert np.abs(got - expected).max() < 1e-4
    offline = np.concatenate(pieces["off"])
    assert np.abs(offline - offline_pcm(flow, hift, features, scripts["off"])).max() < 1e-4
    assert kind.open_streams == 0 and core.active_requests == 0
    if prepare_beside:  # the voice's ten prompt steps on the prefixes' own sampler (the scripted tokens come
        assert kind._prefix_sampler.calls == 10  # at once, so the streams may open before it: cold, as without)


REFUSED_TOKEN = 4321  # a valid id that RefusingKind will not start a chunk with


class RefusingKind(CosyVoice3Kind):
    """Refuses (InvalidInputError) any set of chunks holding one with REFUSED_TOKEN among its new
    tokens, as a kind refuses a chunk it cannot start."""

    def start_chunks(self, chunks):
        if any(REFUSED_TOKEN in tokens[offset:] for _, tokens, offset, _ in chunks):
            raise InvalidInputError("chunk refused")
        return super().start_chunks(chunks)


def test_a_bad_chunk_fails_its_own_request_only(models, features):
    """One request's chunk cannot start: that request ends with the kind's error; the request whose
    chunks started beside it in the same iterations is voiced in full."""
    flow, hift = models
    kind = RefusingKind(flow, hift, padded=True, **SMALL_GRID)
    scripts = {"good": STREAMS[1], "bad": STREAMS[1][:20] + [REFUSED_TOKEN] + STREAMS[1][21:]}
    assert REFUSED_TOKEN not in scripts["good"]
    pieces, ends, core = run_scripted(kind, features, scripts)
    assert isinstance(ends["bad"], InvalidInputError) and "chunk refused" in str(ends["bad"])
    assert ends["good"] is None and sum(p.size for p in pieces["good"]) == 960 * len(scripts["good"])
    assert kind.open_streams == 0 and core.active_requests == 0


def test_load_engine_warms_cosyvoice3_up_on_a_synthetic_voice(tmp_path):
    """What a GPU server does before it reports ready (ENGINE_WARM_UP), here on the CPU with the
    tiny bundle: CosyVoice3 has no registered voice, so a synthetic clip voices the warm-up (through
    the front-end), a stream, four together and an offline request run through the whole loop
    (its LLM included), and the engine is idle after it."""
    from cosyserve.bundle import make_bundle
    from cosyserve.engine.service import BUNDLE_DIRS, load_engine

    models = make_bundle(tmp_path, "tiny", parts=("cosyvoice3", "cosyvoice3_llm"))
    model_dir, llm_dir, _ = BUNDLE_DIRS["cosyvoice3"]
    engine = load_engine("cosyvoice3", models / model_dir, models / llm_dir, torch.device("cpu"),
                         kind_options={"max_voices": 1}, llm_options={"max_slots": 8, "max_model_len": 1024},
                         warm_up=True)
    try:
        counters = engine.core.counters
        assert (counters.requests_finished, counters.requests_failed) == (1 + 4 + 1, 0)
        assert engine.core.active_requests == 0 and engine.core.kind.open_streams == 0
        assert engine.core.kind.cached_voices == 1  # the warm-up voice's prefix, from its first stream
    finally:
        engine.close()
