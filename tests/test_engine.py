"""The engine core (one loop: LLM, packed flow steps, batched HiFT) against the reference computation.

The LLM is replaced by scripted speech tokens (the flow and the vocoder are what is compared); the
reference is ``CosyVoice2Token2Wav`` re-running the flow over prompt + all tokens at every chunk of
the reference BLS's schedule (``plan_chunks``), HiFT with zero harmonic noise on both sides.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import numpy as np
import pytest
import torch

from cosyserve.engine.scheduler import Scheduler
from cosyserve.engine.service import load_engine
from cosyserve.errors import CapacityError, InvalidInputError, RequestCancelledError, RequestTimeoutError
from cosyserve.llm.stream import Finished, TokenStream
from cosyserve.engine.front_end import TokenLimits, TTSRequest
from cosyserve.schedule import plan_chunks
from cosyserve.token2wav.cosyvoice2 import load_token2wav

torch.set_num_threads(1)
REL_L2 = 1e-5  # fp32 rounding
HARMONICS = 9


def zero_noise(samples: int) -> torch.Tensor:
    return torch.zeros(1, samples, HARMONICS)


class ScriptedTokens:
    """An LLM back end that streams given speech tokens (per request id) from a thread, at
    ``token_interval_s`` each; ``fail`` ids end with an error instead."""

    def __init__(self, token_interval_s: float = 0.0):
        self.tokens: dict[str, list[int]] = {}
        self.fail: set[str] = set()
        self.interval = token_interval_s
        self.cancelled: list[str] = []
        self.log: list[tuple] = []  # ("generate", request id) as requests start; tests add their own events

    def generate_stream(self, prompt_ids, params, request_id=None) -> TokenStream:
        self.log.append(("generate", request_id))
        stream = TokenStream(request_id, lambda: self.cancelled.append(request_id))
        tokens = self.tokens[request_id.split(".")[0]]

        def produce():
            for token in tokens[:params.max_tokens]:
                if stream.finish_reason is not None:
                    return
                if self.interval:
                    time.sleep(self.interval)
                stream.put(token)
            stream.put(Finished("error", RuntimeError("scripted LLM failure")) if request_id in self.fail
                       else Finished("stop"))
        threading.Thread(target=produce, daemon=True).start()
        return stream

    def register_prefix(self, key, ids) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dirs(tiny_bundle):
    return tiny_bundle / "CosyVoice2-0.5B", tiny_bundle / "cosyvoice2_llm"


@pytest.fixture(scope="module")
def reference(model_dirs):
    return load_token2wav(model_dirs[0], "cpu", torch.float32)


@contextlib.contextmanager
def running_engine(model_dirs, llm, final="reference", pool_mb=256, **scheduler):
    """The cosyvoice2 engine on ``llm``'s tokens; on leaving, it must be idle (:func:`assert_idle`)."""
    engine = load_engine("cosyvoice2", *model_dirs, torch.device("cpu"),
                         kind_options={"flow_dtype": torch.float32, "final": final, "state_pool_bytes": pool_mb << 20},
                         llm_backend=llm, sine_noise=zero_noise, scheduler=Scheduler(**scheduler))
    try:
        yield engine
        assert_idle(engine)
    finally:
        engine.close()


def clip_voice(engine, seconds: float, seed: int):
    rng = np.random.default_rng(seed)
    return engine.voices.resolve(rng.standard_normal(int(16000 * seconds)).astype(np.float32) * 0.1, "你好。")


def reference_stream(reference, voice, tokens: list[int]) -> list[np.ndarray]:
    f = voice.features
    stream = reference.open_stream(f.speech_tokens, f.speech_feat, f.embedding,
                                   sine_noise=zero_noise)
    return [stream.step(tokens[:c.num_tokens], c.token_offset, c.finalize).numpy() for c in plan_chunks(len(tokens))]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_idle(engine) -> None:
    """Nothing outlives its request: no request, stream or page but the cached voices'."""
    flow = engine.core.kind.flow_engine
    deadline = time.monotonic() + 5
    while engine.core.active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.core.active_requests == 0
    assert flow.open_streams == 0
    assert flow.pool.pages - flow.pool.free_pages == flow.voice_pages


@pytest.mark.parametrize("final", ["reference", "streaming"])
def test_concurrent_streams_equal_the_reference(model_dirs, reference, final):
    llm = ScriptedTokens(token_interval_s=0.002)
    with running_engine(model_dirs, llm, final) as engine:
        rng = random.Random(3)
        voices = [engine.voices.resolve(), clip_voice(engine, 2.3, 1), clip_voice(engine, 3.1, 2)]
        requests = []
        for k in range(5):
            tokens = [rng.randrange(6561) for _ in range(rng.choice([20, 37, 64, 90]))]
            llm.tokens[f"r{k}"] = tokens
            requests.append((f"r{k}", voices[k % 3], tokens))
        results: dict[str, list[np.ndarray]] = {}

        def run(rid, voice, tokens):
            time.sleep(rng.random() * 0.05)  # arrivals spread over the engine's steps
            results[rid] = list(engine.stream(TTSRequest(rid, "你好，欢迎使用语音合成服务。", voice,
                                                         TokenLimits(len(tokens)))))
        threads = [threading.Thread(target=run, args=r) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for rid, voice, tokens in requests:
            expected = reference_stream(reference, voice, tokens)
            got = results[rid]
            assert [p.size for p in got[:-1]] == [p.size for p in expected[:-1]]  # the reference BLS's chunks
            if final == "reference":
                assert rel(np.concatenate(got), np.concatenate(expected)) < REL_L2
            else:  # only the last chunk's frames differ (streaming masks over the final block)
                assert rel(np.concatenate(got[:-1]), np.concatenate(expected[:-1])) < REL_L2
                assert sum(p.size for p in got) == 960 * len(tokens)
        assert engine.core.counters.flow_batch_jobs > engine.core.counters.flow_batches  # chunks shared batches


def test_streams_that_find_the_state_pool_full_re_run_their_chunks(model_dirs, reference):
    """A pool too small for the streams under way (on a GPU: many long replies at once): the chunks
    that find no free pages re-run (the reference's computation) from then on, the others stay in the
    flow engine; every request still equals the reference and none fails."""
    llm = ScriptedTokens(token_interval_s=0.002)
    with running_engine(model_dirs, llm, pool_mb=8) as engine:
        voice = engine.voices.resolve()
        rng = random.Random(7)
        for k in range(4):
            llm.tokens[f"p{k}"] = [rng.randrange(6561) for _ in range(90)]
        results: dict[str, list[np.ndarray]] = {}

        def run(rid):
            try:
                results[rid] = list(engine.stream(TTSRequest(rid, "你好，欢迎使用语音合成服务。", voice, TokenLimits(90))))
            except Exception as exc:  # reported below
                results[rid] = exc
        threads = [threading.Thread(target=run, args=(rid,)) for rid in llm.tokens]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not [r for r in results.values() if isinstance(r, Exception)], results
        for rid, tokens in llm.tokens.items():
            assert rel(np.concatenate(results[rid]), np.concatenate(reference_stream(reference, voice, tokens))) < REL_L2
        assert engine.core.kind.fallbacks > 0


def test_offline_equals_the_reference(model_dirs, reference):
    llm = ScriptedTokens()
    with running_engine(model_dirs, llm) as engine:
        voice = clip_voice(engine, 2.0, 5)
        llm.tokens["o1"] = tokens = [random.Random(5).randrange(6561) for _ in range(57)]
        got = engine.synthesize(TTSRequest("o1", "你好。", voice, TokenLimits(57)))
        f = voice.features
        expected = reference.offline(tokens, f.speech_tokens, f.speech_feat, f.embedding, sine_noise=zero_noise).numpy()
        assert rel(got, expected) < REL_L2


def test_cancel_error_and_timeout_release_everything(model_dirs):
    llm = ScriptedTokens(token_interval_s=0.01)
    with running_engine(model_dirs, llm) as engine:
        voice = engine.voices.resolve()
        for rid in ("cancel", "fail", "slow", "ok"):
            llm.tokens[rid] = list(range(100, 160))
        llm.fail.add("fail")
        outcomes: dict[str, BaseException | None] = {}
        events = {rid: threading.Event() for rid in ("cancel", "fail", "slow", "ok")}

        def finish(rid):
            def done(error):
                outcomes[rid] = error
                events[rid].set()
            return done
        for rid in events:
            engine.submit(TTSRequest(rid, "你好。", voice, TokenLimits(60)), streaming=True, emit=lambda pcm: None,
                          finish=finish(rid), timeout_s=0.2 if rid == "slow" else 0.0)
        time.sleep(0.1)
        engine.cancel("cancel")
        for event in events.values():
            assert event.wait(60)
        assert isinstance(outcomes["cancel"], RequestCancelledError)
        assert isinstance(outcomes["fail"], RuntimeError) and "scripted LLM failure" in str(outcomes["fail"])
        assert isinstance(outcomes["slow"], RequestTimeoutError)
        assert outcomes["ok"] is None
        assert "cancel" in llm.cancelled and "slow" in llm.cancelled


def test_admission_refuses_past_max_streams_and_bad_text_fails_alone(model_dirs):
    llm = ScriptedTokens(token_interval_s=0.01)
    with running_engine(model_dirs, llm, max_streams=1) as engine:
        voice = engine.voices.resolve()
        llm.tokens["a"] = llm.tokens["b"] = list(range(40))
        first = engine.stream(TTSRequest("a", "你好。", voice, TokenLimits(40)))
        next(first)  # "a" is streaming
        with pytest.raises(CapacityError, match="overloaded: .*max_streams"):
            engine.submit(TTSRequest("b", "你好。", voice, TokenLimits(40)), streaming=True, emit=print, finish=print)
        with pytest.raises(InvalidInputError, match="target_text is empty"):
            engine.submit(TTSRequest("c", "   ", voice), streaming=False, emit=print, finish=print)
        assert sum(p.size for p in first) > 0


LONG_TEXT = "一二三四五六七八九十。" * 20  # three segments (tests/test_front_end.py)


def test_long_text_segments_stream_in_order_with_the_next_llm_one_segment_ahead(model_dirs):
    llm = ScriptedTokens(token_interval_s=0.005)
    with running_engine(model_dirs, llm) as engine:
        llm.tokens["long"] = list(range(100, 140))
        plan = plan_chunks(40)
        pieces = []
        for piece in engine.stream(TTSRequest("long", LONG_TEXT, engine.voices.resolve(), TokenLimits(40, 40))):
            llm.log.append(("pcm", piece.size))
            pieces.append(piece)
        assert [e for e in llm.log if e[0] == "generate"] == [("generate", "long"), ("generate", "long.1"),
                                                             ("generate", "long.2")]
        assert len(pieces) == 3 * len(plan) and sum(p.size for p in pieces) == 3 * 40 * 960
        # a segment's LLM request starts while the segment before it is still being voiced
        pcm = [i for i, e in enumerate(llm.log) if e[0] == "pcm"]
        assert llm.log.index(("generate", "long.1")) < pcm[len(plan) - 1]
        assert llm.log.index(("generate", "long.2")) < pcm[2 * len(plan) - 1]
        llm.tokens["offline"] = list(range(200, 230))
        audio = engine.synthesize(TTSRequest("offline", LONG_TEXT, engine.voices.resolve(), TokenLimits(30, 30)))
        assert audio.shape == (3 * 30 * 960,)  # the segments' waveforms concatenated


def test_closing_a_long_stream_cancels_both_llm_requests_under_way(model_dirs):
    llm = ScriptedTokens(token_interval_s=0.01)
    with running_engine(model_dirs, llm) as engine:
        llm.tokens["long"] = list(range(100, 400))
        stream = engine.stream(TTSRequest("long", LONG_TEXT, engine.voices.resolve(), TokenLimits(300, 300)))
        next(stream)
        deadline = time.monotonic() + 10
        while ("generate", "long.1") not in llm.log and time.monotonic() < deadline:
            time.sleep(0.01)
        stream.close()
        assert_idle(engine)
        assert sorted(llm.cancelled) == ["long", "long.1"] and ("generate", "long.2") not in llm.log


def test_an_llm_that_produces_nothing_or_non_speech_tokens_fails_its_request(model_dirs):
    llm = ScriptedTokens()
    with running_engine(model_dirs, llm) as engine:
        voice = engine.voices.resolve()
        llm.tokens["silent"] = []
        llm.tokens["bad"] = [1, 2, 6561, 4, 5, 6, 7]
        for streaming in (True, False):
            for rid, message in (("silent", "no speech tokens"), ("bad", "LLM's speech tokens: .* got ids in 1..6561")):
                request = TTSRequest(rid, "你好。", voice, TokenLimits(7))
                with pytest.raises(RuntimeError, match=message):  # the server's fault, not the caller's
                    list(engine.stream(request)) if streaming else engine.synthesize(request)
        llm.tokens["ok"] = list(range(20))
        assert engine.synthesize(TTSRequest("ok", "你好。", voice, TokenLimits(20))).size == 20 * 960


@pytest.mark.parametrize("captured_shapes", [False, True])
def test_full_passes_solved_in_batches_equal_the_reference(captured_shapes):
    """Offline / final passes (full attention) and a stream's re-run (streaming masks) started as one
    encoder batch, solved as batches in eager shapes or in the padded shapes of the CUDA graphs
    (run eagerly here): each equals CosyVoice2Flow.inference."""
    from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, random_flow_state_dict
    from cosyserve.token2wav.flow_engine import FlowEngine
    from cosyserve.token2wav.step_graphs import EngineGraphs
    from cosyserve.token2wav.full_pass import FullPass, PassInput

    cfg = FlowConfig.tiny()
    flow = CosyVoice2Flow(cfg)
    flow.load_state_dict(random_flow_state_dict(cfg, seed=5))
    flow.eval()
    g = torch.Generator().manual_seed(1)
    voices = [(torch.randint(0, 6561, (1, p), generator=g), torch.randn(1, 2 * p, 80, generator=g),
               torch.randn(1, 192, generator=g)) for p in (30, 57, 20)]
    tokens = [torch.randint(0, 6561, (1, n), generator=g) for n in (40, 23, 31)]
    fused = FlowEngine(flow, pool_pages=4).fused
    full = FullPass(flow, fused, 10, EngineGraphs(fused, replay=False) if captured_shapes else None)
    finals = full.start([PassInput(t, *v) for t, v in zip(tokens[:2], voices[:2])])
    (rerun,) = full.start([PassInput(tokens[2], *voices[2], skip_frames=4)], streaming=True)
    assert not any(job.done for job in finals + [rerun])
    full.solve(finals)
    full.solve([rerun])
    assert all(job.done for job in finals + [rerun])
    for job, t, v in zip(finals, tokens, voices):
        assert rel(job.target_mel().numpy(), flow.inference(t, *v, streaming=False, finalize=True).numpy()) < REL_L2
    expected = flow.inference(tokens[2], *voices[2], streaming=True, finalize=False)[:, :, 4:]
    assert rel(rerun.target_mel().numpy(), expected.numpy()) < REL_L2


def test_warm_up_at_load_runs_every_stage_and_leaves_nothing_behind(model_dirs):
    """What a GPU server does before it reports ready (ENGINE_WARM_UP), here on the CPU: full passes of
    every size class, then requests through the whole loop (the LLM included); the engine is then idle."""
    engine = load_engine("cosyvoice2", *model_dirs, torch.device("cpu"),
                         kind_options={"flow_dtype": torch.float32, "state_pool_bytes": 256 << 20},
                         llm_options={"max_slots": 8, "max_model_len": 1024}, warm_up=True)
    try:
        assert engine.core.counters.requests_finished == 1 + 4 + 1  # one stream, four together, one offline
        assert engine.core.counters.requests_failed == 0
        assert_idle(engine)
    finally:
        engine.close()
