"""Step-Audio2's token2wav as a kind of the engine, against the one-request computation
(StepAudio2Stream and offline_waveforms of cosyserve.token2wav.step_audio2).

A tiny random flow and HiFT (as tests/test_step_audio2_flow.py builds them), HiFT with zero harmonic noise on
both sides. The streams are driven in the engine core's order of work: per iteration, chunks that
are ready start together, one packed step of every job under way, the jobs that finished vocoded
together; streams start at different iterations and receive their tokens at different rates, so
jobs of different streams are at different Euler steps within one estimator call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from cosyserve.bundle.step_audio2 import tiny_step_audio2_config
from cosyserve.engine.core import EngineCore
from cosyserve.engine.runners.llm import BackendLLM
from cosyserve.engine.kinds.step_audio2 import StepAudio2Kind, aligned_features
from cosyserve.engine.request import EngineRequest
from cosyserve.errors import InvalidInputError
from cosyserve.frontend.prompt import PromptFeatures, Voice
from cosyserve.llm.stream import Finished, TokenStream
from cosyserve.models.step_audio2.flow import StepAudio2Flow
from cosyserve.models.hift import HiftConfig, HiFTGenerator
from cosyserve.engine.front_end import SegmentPrompt, TokenLimits
from cosyserve.token2wav.step_audio2 import (OfflineRequest, StepAudio2Models, StepAudio2Stream, VoicePrompt,
                                             build_voice_state, offline_waveforms)

torch.set_num_threads(1)
SAMPLES_PER_TOKEN = 960


def zero_sine_noise(samples: int) -> torch.Tensor:
    return torch.zeros(1, samples, 9)


@pytest.fixture(scope="module")
def reference() -> StepAudio2Models:
    torch.manual_seed(0)
    flow = StepAudio2Flow(tiny_step_audio2_config()).eval()
    torch.manual_seed(1)
    hift = HiFTGenerator(HiftConfig.tiny()).eval()
    return StepAudio2Models(flow, hift)


@pytest.fixture()
def kind(reference) -> StepAudio2Kind:
    return StepAudio2Kind(reference, max_voices=4, sine_noise=zero_sine_noise)


def features(seed: int, tokens: int = 20, frames: int = 41) -> PromptFeatures:
    """A voice's features as the front end gives them; 41 frames for 20 tokens: the kind aligns them."""
    g = torch.Generator().manual_seed(seed)
    return PromptFeatures(torch.randint(0, 6561, (tokens,), generator=g).to(torch.int32),
                          torch.randn(frames, 80, generator=g), torch.randn(192, generator=g))


def voice_prompt(f: PromptFeatures) -> VoicePrompt:
    f = aligned_features(f)
    return VoicePrompt(f.speech_tokens, f.speech_feat, f.embedding)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_audio_equal(actual: np.ndarray, expected: torch.Tensor | np.ndarray) -> None:
    expected = np.asarray(expected)
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


# ---------------------------------------------------------------------------------- a core by hand
@dataclass(eq=False)
class Stream:
    voice: PromptFeatures
    tokens: list[int]
    strategy: str
    start: int  # iteration of its first token
    rate: int  # tokens per iteration
    schedule: object = None
    voicing: object = None
    job: object = None
    chunks: list = field(default_factory=list)  # (token_offset, num_tokens, finalize) as run
    pcm: list = field(default_factory=list)
    done: bool = False

    def received(self, iteration: int) -> int:
        return max(0, min(len(self.tokens), (iteration - self.start + 1) * self.rate))


def drive(kind: StepAudio2Kind, streams: list[Stream], offline: list[tuple] = (), offline_at: int = 2):
    """Run ``streams`` (and offline requests (features, tokens), started at ``offline_at``) to the end;
    returns the offline PCM and the most jobs stepped together."""
    offline_jobs, offline_pcm, most = [], [], 0
    for s in streams:
        s.schedule = kind.chunk_schedule(s.strategy)
    iteration = 0
    while not all(s.done for s in streams) or any(not job.done for job in offline_jobs) or iteration <= offline_at:
        if iteration == offline_at:
            offline_jobs = [kind.start_offline(f, tokens) for f, tokens in offline]
        starting = []
        for s in streams:
            available = s.received(iteration)
            if s.done or s.job is not None or available == 0:
                continue
            chunk = s.schedule.next_chunk(available)
            if chunk is None and available == len(s.tokens):
                chunk = s.schedule.final_chunk(available)
            if chunk is not None:
                s.voicing = s.voicing or kind.open(s.voice)
                s.chunks.append((chunk.token_offset, chunk.num_tokens, chunk.finalize))
                starting.append(s)
        jobs = kind.start_chunks([(s.voicing, s.tokens[:c[1]], c[0], c[2]) for s in starting for c in s.chunks[-1:]])
        for s, job in zip(starting, jobs):
            s.job = job
        under_way = [s.job for s in streams if s.job is not None] + [j for j in offline_jobs if not j.done]
        most = max(most, len(under_way))
        kind.step(under_way)
        finished = [s for s in streams if s.job is not None and s.job.done]
        items = [(s.voicing, kind.mel(s.job), s.job.finalize) for s in finished]
        ended = [j for j in offline_jobs if j.done and not getattr(j, "vocoded", False)]
        items += [(None, kind.mel(j), True) for j in ended]
        for piece, s in zip((p.cpu().numpy() for p in kind.vocode(items)), finished + ended):
            if isinstance(s, Stream):
                s.pcm.append(piece)
                if s.job.finalize:
                    s.voicing.close()
                    s.done = True
                s.job = None
            else:
                s.vocoded = True
                offline_pcm.append(piece)
        iteration += 1
    return offline_pcm, most


def reference_pieces(reference: StepAudio2Models, s: Stream) -> list[torch.Tensor]:
    voice = build_voice_state(reference.flow, voice_prompt(s.voice))
    with StepAudio2Stream(reference, voice, sine_noise=zero_sine_noise) as stream:
        return [stream.step(s.tokens[offset:end], finalize) for offset, end, finalize in s.chunks]


# ---------------------------------------------------------------------------------- tests
def test_streams_equal_the_one_stream_computation(kind, reference):
    voices = [features(0), features(1, tokens=16, frames=37)]
    streams = [Stream(voices[0], random_tokens(70, 10), "exponential", start=0, rate=4),
               Stream(voices[1], random_tokens(47, 11), "equal", start=3, rate=9),
               Stream(voices[0], random_tokens(21, 12), "exponential", start=7, rate=21),
               Stream(voices[1], random_tokens(2, 13), "equal", start=1, rate=1)]
    _, most = drive(kind, streams)
    assert most >= 3  # jobs of several streams shared estimator steps
    for i, s in enumerate(streams):
        assert s.chunks[-1][2] and len(s.chunks) > (i < 2)
        expected = reference_pieces(reference, s)
        for piece, want in zip(s.pcm, expected, strict=True):
            assert_audio_equal(piece, want.numpy())
        assert sum(p.size for p in s.pcm) == SAMPLES_PER_TOKEN * len(s.tokens)
    assert kind.open_streams == 0


def test_offline_equals_the_one_request_computation_also_packed_with_streams(kind, reference):
    voice, other = features(2), features(3, tokens=30, frames=60)
    requests = [(voice, random_tokens(33, 20)), (other, random_tokens(9, 21))]
    streams = [Stream(other, random_tokens(40, 22), "exponential", start=0, rate=40)]
    pcm, most = drive(kind, streams, requests)
    assert most == 3
    for (f, tokens), piece in zip(requests, pcm, strict=True):
        (want,) = offline_waveforms(reference, [OfflineRequest(torch.tensor(tokens), voice_prompt(f))],
                                    sine_noise=zero_sine_noise)
        assert piece.size == SAMPLES_PER_TOKEN * len(tokens)
        assert_audio_equal(piece, want.numpy())
    alone = kind._run([None], [kind.start_offline(*requests[0])])[0].cpu().numpy()
    assert_audio_equal(alone, pcm[0])


def test_open_abort_and_finish_leave_nothing(kind):
    voice = features(4)
    finished, aborted, unused = kind.open(voice), kind.open(voice), kind.open(voice)
    assert kind.open_streams == 3
    tokens = random_tokens(30, 30)
    jobs = kind.start_chunks([(finished, tokens, 0, True), (aborted, tokens[:18], 0, False)])
    kind.step(jobs)
    kind.abort(jobs[1:])
    aborted.close()
    assert jobs[1].done and jobs[1].read is None and not jobs[1].new_att
    while not jobs[0].done:
        kind.step(jobs[:1])
    kind.vocode([(finished, kind.mel(jobs[0]), True)])
    finished.close()
    unused.close()
    unused.close()  # idempotent
    assert kind.open_streams == 0 and finished.cache is None and aborted.cache is None
    with pytest.raises(InvalidInputError, match="closed"):
        kind.start_chunks([(finished, tokens, 0, True)])


@pytest.mark.parametrize("bad", [[1, 6561, 2, 3, 4], [5, -1, 2, 3, 4], [1.5, 2.0, 3.0, 4.0, 5.0]])
def test_bad_token_ids_raise_before_any_model_work(kind, monkeypatch, bad):
    voice = features(5)
    good, bad_stream = kind.open(voice), kind.open(voice)
    before = good.cache
    calls = []
    monkeypatch.setattr(kind.flow.encoder, "forward_chunk", lambda *a: calls.append(a))
    monkeypatch.setattr(kind.flow, "encode", lambda *a: calls.append(a))
    with pytest.raises(InvalidInputError):
        kind.start_chunks([(good, random_tokens(18, 40), 0, False), (bad_stream, bad, 0, True)])
    with pytest.raises(InvalidInputError):
        kind.start_offline(voice, bad)
    with pytest.raises(InvalidInputError, match="look-ahead"):
        kind.start_chunks([(good, [1, 2, 3], 0, False)])
    assert calls == [] and good.cache is before
    good.close()
    bad_stream.close()
    assert kind.open_streams == 0


def test_second_voice_evicts_the_first_whose_streams_still_finish(reference):
    kind = StepAudio2Kind(reference, max_voices=1, sine_noise=zero_sine_noise)
    first, second = features(6), features(7, tokens=24, frames=48)
    s = Stream(first, random_tokens(50, 50), "exponential", start=0, rate=50)
    s.schedule = kind.chunk_schedule("exponential")
    s.voicing = kind.open(first)
    chunk = s.schedule.next_chunk(50)
    s.chunks.append((chunk.token_offset, chunk.num_tokens, False))
    s.pcm += [p.cpu().numpy() for p in kind._run([s.voicing], kind.start_chunks([(s.voicing, s.tokens[:chunk.num_tokens], 0, False)]))]
    other = kind.open(second)  # evicts the first voice
    assert kind.cached_voices == [aligned_features(second).key()]
    s.start = 1
    drive(kind, [s, Stream(second, random_tokens(19, 51), "equal", start=0, rate=5, voicing=other)])
    for piece, want in zip(s.pcm, reference_pieces(reference, s), strict=True):
        assert_audio_equal(piece, want.numpy())
    assert kind.open_streams == 0
    kind.prepare_voices([first])
    assert kind.cached_voices == [aligned_features(first).key()]


# ---------------------------------------------------------------------------------- through the core
class ScriptedLLM:
    """A back end that hands every request's speech tokens at once (the core's loop is stepped by hand)."""

    def __init__(self, tokens: dict[str, list[int]]):
        self.tokens = tokens

    def generate_stream(self, prompt_ids, params, request_id) -> TokenStream:
        stream = TokenStream(request_id, lambda: None)
        for token in self.tokens[request_id]:
            stream.put(token)
        stream.put(Finished("stop"))
        return stream

    def close(self) -> None:
        pass


def test_engine_core_runs_the_kind(kind, reference):
    voice = features(8)
    tokens = {"a": random_tokens(45, 60), "b": random_tokens(12, 61), "c": random_tokens(25, 62)}
    core = EngineCore(kind, BackendLLM(ScriptedLLM(tokens)))
    out: dict[str, list] = {rid: [] for rid in tokens}
    ended: dict[str, object] = {}
    for rid, streaming in (("a", True), ("b", True), ("c", False)):
        core.submit(EngineRequest(rid, iter([SegmentPrompt(rid, "", [])]), Voice("", voice), TokenLimits(), streaming,
                                  out[rid].append, lambda error, rid=rid: ended.__setitem__(rid, error)))
    for _ in range(200):
        if len(ended) == 3:
            break
        core.step()
    assert ended == {"a": None, "b": None, "c": None} and core.active_requests == 0
    assert kind.open_streams == 0
    for rid in ("a", "b"):
        s = Stream(voice, tokens[rid], "exponential", 0, 0, chunks=[
            (c.token_offset, c.num_tokens, c.finalize) for c in _plan(kind, len(tokens[rid]))])
        for piece, want in zip(out[rid], reference_pieces(reference, s), strict=True):
            assert_audio_equal(piece, want.numpy())
    (want,) = offline_waveforms(reference, [OfflineRequest(torch.tensor(tokens["c"]), voice_prompt(voice))],
                                sine_noise=zero_sine_noise)
    assert_audio_equal(out["c"][0], want.numpy())


def _plan(kind, total: int):
    schedule = kind.chunk_schedule("exponential")
    chunks = []
    while (chunk := schedule.next_chunk(total)) is not None:
        chunks.append(chunk)
    return chunks + [schedule.final_chunk(total)]


# ---------------------------------------------------------------------------------- load_engine
def test_load_engine_serves_step_audio2_on_the_tiny_bundle(tmp_path):
    """``load_engine("step_audio2", ...)``: CosyVoice2's LLM (in the loop), prompt layout, sampling and
    voices (spk2info.pt from CosyVoice2-0.5B) with Step-Audio-2-mini's token2wav directory; a stream of
    the default speaker and an offline request of a clip give 960 samples per token, the registered
    voices' states are built at load and nothing stays open."""
    import soundfile as sf

    from cosyserve.bundle import make_bundle
    from cosyserve.engine.service import MODEL_KINDS, load_engine
    from cosyserve.llm.prompt import COSYVOICE2
    from cosyserve.llm.sampling import REFERENCE_SAMPLING
    from cosyserve.runtime import COSYVOICE2_DIR, LLM_DIR, SPK2INFO, STEP_AUDIO2_DIR
    from cosyserve.engine.front_end import TTSRequest

    spec = MODEL_KINDS["step_audio2"]
    assert spec.layout is COSYVOICE2 and spec.sampling == REFERENCE_SAMPLING and spec.registered_voices
    models = make_bundle(tmp_path, "tiny", seed=0, parts=("cosyvoice2", "llm", "step_audio2"))
    engine = load_engine("step_audio2", models / STEP_AUDIO2_DIR, models / LLM_DIR, torch.device("cpu"),
                         spk2info=models / COSYVOICE2_DIR / SPK2INFO, kind_options={"max_voices": 2},
                         llm_options={"max_slots": 4, "max_model_len": 1024})
    try:
        kind = engine.core.kind
        assert isinstance(kind, StepAudio2Kind) and kind.max_voices == 2
        assert len(kind.cached_voices) == min(2, len(engine.voices.registry.ids()))  # warmed at load
        chunks = list(engine.stream(TTSRequest("s", "你好，世界。", engine.voices.resolve(), TokenLimits(40, 40))))
        assert [c.size for c in chunks] == [10560, 27840]  # 15 tokens less HiFT's overlap, then the rest
        wav, rate = sf.read(models / "assets" / "prompt_audio.wav", dtype="float32")
        clip = engine.voices.resolve(wav, "参考文本")
        audio = engine.synthesize(TTSRequest("o", "Hello there.", clip, TokenLimits(25, 25)))
        assert audio.size == 25 * SAMPLES_PER_TOKEN and np.isfinite(audio).all() and np.abs(audio).max() > 0
        assert kind.gauges()["open_streams"][1] == 0 and engine.core.active_requests == 0
    finally:
        engine.close()
