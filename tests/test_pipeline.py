"""The backend-agnostic TTS orchestration (cosyserve.pipeline.tts) and its in-process back ends.

Fakes pin down the chunk schedule, cancellation and error handling exactly; the tiny bundle
(cosyserve.pipeline.local) checks the same contracts with the real LLM engine and token2wav.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest_triton import SAMPLES_PER_TOKEN, expected_chunk_samples
from cosyserve.errors import InvalidInputError, RequestCancelledError
from cosyserve.llm.prompt import SOS_ID, SPEECH_TOKEN_OFFSET, TASK_ID
from cosyserve.schedule import plan_chunks
from cosyserve.pipeline.tts import TokenLimits, TTSPipeline, TTSRequest, Voice, validate_text

VOICE = Voice("提示文本。", SimpleNamespace(speech_tokens=torch.tensor([5, 6, 7], dtype=torch.int32)))


class FakeLLM:
    """Yields tokens 0, 1, 2, ... one per piece, optionally slowly or failing part-way."""

    def __init__(self, delay_s: float = 0.0, fail_at: int | None = None):
        self.delay_s, self.fail_at = delay_s, fail_at
        self.prompts: list[list[int]] = []
        self.cancelled: list[str] = []

    def generate(self, prompt_ids, request_id, limits):
        self.prompts.append(prompt_ids)

        def tokens():
            for i in range(limits.max_tokens):
                if request_id in self.cancelled:
                    return
                if i == self.fail_at:
                    raise RuntimeError("LLM broke")
                time.sleep(self.delay_s)
                yield [i]

        return tokens()

    def cancel(self, request_id):
        self.cancelled.append(request_id)


class FakeToken2Wav:
    """Records calls; returns as many samples as the real model would."""

    def __init__(self, fail_at_step: int | None = None):
        self.steps: list[tuple[int, int, bool]] = []
        self.offline_calls: list[int] = []
        self.cancelled: list[str] = []
        self.fail_at_step = fail_at_step

    def offline(self, request_id, tokens, voice):
        self.offline_calls.append(len(tokens))
        return np.zeros(SAMPLES_PER_TOKEN * len(tokens), np.float32)

    def step(self, request_id, tokens, voice, token_offset, finalize):
        if len(self.steps) == self.fail_at_step:
            raise RuntimeError("token2wav broke")
        self.steps.append((len(tokens), token_offset, finalize))
        return np.zeros(10, np.float32)

    def cancel(self, request_id):
        self.cancelled.append(request_id)


@pytest.fixture(scope="module")
def text_tokenizer(tiny_bundle):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_bundle / "cosyvoice2_llm")


def make(text_tokenizer, llm=None, token2wav=None):
    return TTSPipeline(text_tokenizer, llm or FakeLLM(), token2wav or FakeToken2Wav())


def request(n: int, rid: str = "r1") -> TTSRequest:
    return TTSRequest(rid, "你好，世界。", VOICE, TokenLimits(n, n))


@pytest.mark.parametrize("n", [1, 17, 18, 40, 100, 250])
@pytest.mark.parametrize("delay_s", [0.0, 0.002])
def test_stream_chunks_follow_the_plan_whatever_the_llm_speed(text_tokenizer, n, delay_s):
    token2wav = FakeToken2Wav()
    chunks = list(make(text_tokenizer, FakeLLM(delay_s), token2wav).stream(request(n)))
    assert token2wav.steps == [(c.num_tokens, c.token_offset, c.finalize) for c in plan_chunks(n)]
    assert len(chunks) == len(plan_chunks(n)) and token2wav.cancelled == []


def test_stream_runs_on_the_calling_thread(text_tokenizer):
    """Inside Triton every back-end call is a pb_utils call: they must all come from one thread."""
    threads = set()

    class RecordingLLM(FakeLLM):
        def generate(self, prompt_ids, request_id, limits):
            for piece in super().generate(prompt_ids, request_id, limits):
                threads.add(threading.get_ident())
                yield piece

    class RecordingToken2Wav(FakeToken2Wav):
        def step(self, *args):
            threads.add(threading.get_ident())
            return super().step(*args)

    def is_cancelled():
        threads.add(threading.get_ident())
        return False

    chunks = list(make(text_tokenizer, RecordingLLM(0.001), RecordingToken2Wav()).stream(request(60), is_cancelled))
    assert len(chunks) == len(plan_chunks(60)) and threads == {threading.get_ident()}


def test_prompt_ids_follow_the_reference_layout(text_tokenizer):
    llm = FakeLLM()
    make(text_tokenizer, llm).synthesize(request(3))
    ids = llm.prompts[0]
    assert ids[0] == SOS_ID and ids[-4] == TASK_ID
    assert ids[-3:] == [SPEECH_TOKEN_OFFSET + t for t in (5, 6, 7)]
    assert text_tokenizer.decode(ids[1:-4]) == "提示文本。你好，世界。"


def test_instruct_and_cross_lingual_prompts(text_tokenizer):
    """Instruct: ``<|sos|>{instruction}<|endofprompt|>{text}<|task_id|>`` without prompt speech
    tokens; a cross-lingual voice: ``<|sos|>{text}<|task_id|>``; token2wav keeps the voice."""
    from cosyserve.llm.prompt import ENDOFPROMPT

    llm, token2wav = FakeLLM(), FakeToken2Wav()
    pipeline = make(text_tokenizer, llm, token2wav)
    pipeline.synthesize(TTSRequest("i", "你好，世界。", VOICE, TokenLimits(3, 3), instruction="用开心的语气说"))
    cross = Voice("", VOICE.features, "voice_x", cross_lingual=True)
    pipeline.synthesize(TTSRequest("c", "你好，世界。", cross, TokenLimits(3, 3)))
    instruct_ids, cross_ids = llm.prompts
    assert instruct_ids[0] == SOS_ID and instruct_ids[-1] == TASK_ID
    assert text_tokenizer.decode(instruct_ids[1:-1]) == f"用开心的语气说{ENDOFPROMPT}你好，世界。"
    assert cross_ids[0] == SOS_ID and cross_ids[-1] == TASK_ID
    assert text_tokenizer.decode(cross_ids[1:-1]) == "你好，世界。"
    with pytest.raises(InvalidInputError, match="instruction is empty"):
        pipeline.synthesize(TTSRequest("e", "你好。", VOICE, TokenLimits(3, 3), instruction=" "))


def test_stored_voices_are_resolved_by_id_and_their_features_computed_once(tiny_bundle, tmp_path):
    from cosyserve.bundle import synthetic_prompt_wave
    from cosyserve.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
    from cosyserve.frontend.speakers import SpeakerRegistry
    from cosyserve.frontend.voice_store import UnknownVoiceError, VoiceStore
    from cosyserve.pipeline.tts import VoiceResolver

    model_dir = tiny_bundle / "CosyVoice2-0.5B"
    calls = []

    class CountingTokenizer(SpeechTokenizer):
        def tokenize(self, wav16):
            calls.append("tokenize")
            return super().tokenize(wav16)

    store = VoiceStore(tmp_path / "voices")
    resolver = VoiceResolver(SpeakerRegistry.load(model_dir / "spk2info.pt"),
                             CountingTokenizer(model_dir / "speech_tokenizer_v2.onnx"),
                             SpeakerEncoder(model_dir / "campplus.onnx"), store=store)
    wave = synthetic_prompt_wave(2.0, seed=5).astype(np.float32)
    zero_shot = store.create("a", wave, "参考文本。")
    cross = store.create("b", wave, None)
    first = resolver.resolve(speaker_id=zero_shot.id)
    again = VoiceResolver(resolver.registry, resolver.tokenizer, resolver.speaker_encoder,
                          store=VoiceStore(store.root)).resolve(speaker_id=zero_shot.id)  # another instance
    assert calls == ["tokenize"] and (store.root / zero_shot.id / "features.pt").exists()
    assert first.prompt_text == "参考文本。" and not first.cross_lingual and first.speaker_id == zero_shot.id
    assert torch.equal(first.features.speech_tokens, again.features.speech_tokens)
    assert resolver.resolve(speaker_id=cross.id).cross_lingual
    assert {v.id for v in store.list()} == {zero_shot.id, cross.id}
    store.delete(zero_shot.id)
    with pytest.raises(UnknownVoiceError):
        resolver.resolve(speaker_id=zero_shot.id)
    for bad in ("../spk2info.pt", "voice_../../x", "voice_" + "g" * 32):
        with pytest.raises(UnknownVoiceError):
            store.get(bad)
    assert not list(store.root.glob(".*"))  # no staging or deleted directories left behind


def test_offline_makes_one_token2wav_call_with_every_token(text_tokenizer):
    token2wav = FakeToken2Wav()
    audio = make(text_tokenizer, token2wav=token2wav).synthesize(request(37))
    assert token2wav.offline_calls == [37] and token2wav.steps == []
    assert audio.size == 37 * SAMPLES_PER_TOKEN


def test_cancellation_between_chunks_stops_the_llm_and_closes_the_session(text_tokenizer):
    llm, token2wav = FakeLLM(delay_s=0.002), FakeToken2Wav()
    cancelled = threading.Event()
    stream = make(text_tokenizer, llm, token2wav).stream(request(300), cancelled.is_set)
    next(stream)
    cancelled.set()
    with pytest.raises(RequestCancelledError):
        list(stream)
    assert llm.cancelled == ["r1"] and token2wav.cancelled == ["r1"]
    assert len(token2wav.steps) == 1


def test_closing_the_stream_early_cancels_too(text_tokenizer):
    llm, token2wav = FakeLLM(delay_s=0.002), FakeToken2Wav()
    stream = make(text_tokenizer, llm, token2wav).stream(request(300))
    next(stream)
    stream.close()
    assert llm.cancelled == ["r1"] and token2wav.cancelled == ["r1"]


def test_llm_failure_closes_the_token2wav_session(text_tokenizer):
    token2wav = FakeToken2Wav()
    with pytest.raises(RuntimeError, match="LLM broke"):
        list(make(text_tokenizer, FakeLLM(fail_at=30), token2wav).stream(request(100)))
    assert token2wav.cancelled == ["r1"]


def test_token2wav_failure_stops_the_llm(text_tokenizer):
    llm = FakeLLM(delay_s=0.002)
    with pytest.raises(RuntimeError, match="token2wav broke"):
        list(make(text_tokenizer, llm, FakeToken2Wav(fail_at_step=1)).stream(request(300)))
    assert llm.cancelled == ["r1"]


def test_offline_cancellation_stops_the_llm(text_tokenizer):
    llm, token2wav = FakeLLM(), FakeToken2Wav()
    with pytest.raises(RequestCancelledError):
        make(text_tokenizer, llm, token2wav).synthesize(request(50), lambda: True)
    assert llm.cancelled == ["r1"] and token2wav.offline_calls == []


class SilentLLM(FakeLLM):
    """Ends every utterance before its first speech token."""

    def generate(self, prompt_ids, request_id, limits):
        return iter([])


def test_an_llm_that_produces_nothing_is_an_error(text_tokenizer):
    token2wav = FakeToken2Wav()
    pipeline = make(text_tokenizer, SilentLLM(), token2wav)
    with pytest.raises(RuntimeError, match="no speech tokens"):
        pipeline.synthesize(request(5))
    with pytest.raises(RuntimeError, match="no speech tokens"):
        list(pipeline.stream(request(5)))
    assert token2wav.steps == [] and token2wav.offline_calls == [] and token2wav.cancelled == []


def test_tokens_outside_the_speech_vocabulary_are_refused(text_tokenizer):
    class BadLLM(FakeLLM):
        def generate(self, prompt_ids, request_id, limits):
            return iter([[1, 2, 6561]])

    with pytest.raises(RuntimeError, match="outside 0..6560"):
        make(text_tokenizer, BadLLM()).synthesize(request(3))


def test_text_and_limit_validation():
    assert validate_text("hi") == "hi"
    for bad, message in [("", "empty"), ("  \n", "empty"), ("x" * 1001, "at most 1000")]:
        with pytest.raises(InvalidInputError, match=message):
            validate_text(bad)
    limits = TokenLimits(100, 20)
    assert limits.override(None, None) == limits
    assert limits.override(10, None) == TokenLimits(10, 10)  # min clipped to the new max
    assert limits.override(300, 300) == TokenLimits(300, 300)
    for bad in [(0, 0), (5000, 0), (10, -1)]:
        with pytest.raises(InvalidInputError):
            limits.override(*bad)


# ----- long text: segments ---------------------------------------------------------------------

LONG_TEXT = "一二三四五六七八九十。" * 20  # three segments of 77, 77 and 66 characters


class LoggingLLM(FakeLLM):
    def __init__(self, log: list, **kwargs):
        super().__init__(**kwargs)
        self.log = log

    def generate(self, prompt_ids, request_id, limits):
        self.log.append(("generate", request_id))
        return super().generate(prompt_ids, request_id, limits)


class LoggingToken2Wav(FakeToken2Wav):
    def __init__(self, log: list, **kwargs):
        super().__init__(**kwargs)
        self.log = log

    def step(self, request_id, tokens, voice, token_offset, finalize):
        self.log.append(("step", request_id, len(tokens), token_offset, finalize))
        return super().step(request_id, tokens, voice, token_offset, finalize)

    def offline(self, request_id, tokens, voice):
        self.log.append(("offline", request_id, len(tokens)))
        return super().offline(request_id, tokens, voice)


def long_request(n: int, text: str = LONG_TEXT, **kwargs) -> TTSRequest:
    return TTSRequest("r1", text, VOICE, TokenLimits(n, n), **kwargs)


def test_segments_stream_in_order_with_the_next_llm_one_segment_ahead(text_tokenizer):
    log: list = []
    llm = LoggingLLM(log)
    chunks = list(make(text_tokenizer, llm, LoggingToken2Wav(log)).stream(long_request(40)))
    plan = [(c.num_tokens, c.token_offset, c.finalize) for c in plan_chunks(40)]
    assert len(chunks) == 3 * len(plan)
    assert [e[2:] for e in log if e[0] == "step"] == plan * 3
    assert [text_tokenizer.decode(p[1:-4]) for p in llm.prompts] == [
        "提示文本。" + s for s in ["一二三四五六七八九十。" * 7] * 2 + ["一二三四五六七八九十。" * 6]]
    # segment k+1's LLM request starts right after segment k's first chunk, before the rest is voiced
    first = log.index(("step", "r1", *plan[0]))
    assert log[:first + 2] == [("generate", "r1"), ("step", "r1", *plan[0]), ("generate", "r1.1")]
    second = log.index(("step", "r1.1", *plan[0]))
    assert log[second + 1] == ("generate", "r1.2")
    assert [e[1] for e in log if e[0] == "step"] == ["r1"] * len(plan) + ["r1.1"] * len(plan) + ["r1.2"] * len(plan)


def test_offline_concatenates_the_segments(text_tokenizer):
    log: list = []
    audio = make(text_tokenizer, LoggingLLM(log), LoggingToken2Wav(log)).synthesize(long_request(30))
    assert audio.size == 3 * 30 * SAMPLES_PER_TOKEN
    # the next LLM request is under way while token2wav voices the current segment
    assert log == [("generate", "r1"), ("generate", "r1.1"), ("offline", "r1", 30), ("generate", "r1.2"),
                   ("offline", "r1.1", 30), ("offline", "r1.2", 30)]


def test_cancelling_a_long_stream_stops_both_llm_requests(text_tokenizer):
    llm, token2wav = FakeLLM(delay_s=0.002), FakeToken2Wav()
    stream = make(text_tokenizer, llm, token2wav).stream(long_request(300))
    next(stream), next(stream)  # the first chunk is sent before the next segment's LLM request starts
    stream.close()
    assert llm.cancelled == ["r1", "r1.1"] and token2wav.cancelled == ["r1"]


def test_text_frontend_switch(text_tokenizer):
    llm = FakeLLM()
    pipeline = make(text_tokenizer, llm)
    pipeline.synthesize(long_request(3, "我有3个苹果。"))
    pipeline.synthesize(long_request(3, "我有3个苹果。", text_frontend=False))
    assert [text_tokenizer.decode(p[1:-4]) for p in llm.prompts] == ["提示文本。我有三个苹果。", "提示文本。我有3个苹果。"]


def test_a_reference_transcript_is_normalised_a_registered_prompt_is_not(text_tokenizer):
    llm = FakeLLM()
    pipeline = make(text_tokenizer, llm)
    for speaker_id in (None, "001"):
        voice = Voice("我有3个。", VOICE.features, speaker_id)
        pipeline.synthesize(TTSRequest("r", "好。", voice, TokenLimits(3, 3)))
    assert [text_tokenizer.decode(p[1:-4]) for p in llm.prompts] == ["我有三个。好。", "我有3个。好。"]


def test_unspeakable_or_too_long_text_fails_before_any_work(text_tokenizer):
    llm, token2wav = FakeLLM(), FakeToken2Wav()
    pipeline = TTSPipeline(text_tokenizer, llm, token2wav, max_text_chars=300)
    for text, message in [("😀！", "no speakable characters"), ("好。" * 151, "302 characters; at most 300")]:
        with pytest.raises(InvalidInputError, match=message):
            pipeline.synthesize(long_request(3, text))
        with pytest.raises(InvalidInputError, match=message):
            list(pipeline.stream(long_request(3, text)))
    assert llm.prompts == [] and token2wav.steps == [] and token2wav.offline_calls == []


# ----- in-process back ends on the tiny bundle -------------------------------------------------

@pytest.fixture(scope="module")
def local_tts(tiny_bundle):
    from cosyserve.pipeline.local import load_local_tts

    tts = load_local_tts(tiny_bundle, "cpu")
    yield tts
    tts.close()


def _wait_idle(tts, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while tts.llm_backend.engine.num_active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tts.llm_backend.engine.num_active == 0
    assert tts.token2wav.open_sessions == 0


def test_local_stream_and_offline_lengths(local_tts):
    chunks = list(local_tts.pipeline.stream(local_tts.request("你好，世界。", limits=TokenLimits(60, 60))))
    assert [c.size for c in chunks] == expected_chunk_samples(60)
    audio = local_tts.pipeline.synthesize(local_tts.request("你好，世界。", limits=TokenLimits(25, 25)))
    assert audio.shape == (25 * SAMPLES_PER_TOKEN,) and np.isfinite(audio).all()
    _wait_idle(local_tts)


def test_local_voices(local_tts, tiny_bundle):
    wav, rate = sf.read(tiny_bundle / "assets" / "prompt_audio.wav", dtype="float32")
    zero_shot = local_tts.request("你好", reference_wav16=wav, reference_text="参考。", limits=TokenLimits(20, 20))
    assert zero_shot.voice.prompt_text == "参考。" and zero_shot.voice.speaker_id is None
    assert local_tts.pipeline.synthesize(zero_shot).size == 20 * SAMPLES_PER_TOKEN
    assert local_tts.request("你好").voice.speaker_id == "001"
    for kwargs, message in [
        (dict(reference_wav16=wav), "needs reference_text"),
        (dict(reference_text="x"), "without reference_wav"),
        (dict(reference_wav16=wav, reference_text="x", speaker_id="001"), "not both"),
        (dict(speaker_id="nobody"), "unknown speaker id"),
        (dict(reference_wav16=wav[:800], reference_text="x"), "long"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            local_tts.request("你好", **kwargs)


def test_local_cancellation_frees_the_engine_and_the_session(local_tts):
    stream = local_tts.pipeline.stream(local_tts.request("你好", limits=TokenLimits(500, 500)))
    next(stream)
    assert local_tts.token2wav.open_sessions == 1
    stream.close()
    _wait_idle(local_tts)
