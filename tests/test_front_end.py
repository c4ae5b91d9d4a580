"""What a request is before the engine runs it (cosyserve.engine.front_end): its segments' LLM prompts
(SegmentPrompter: text front-end and prompt layout), its voice (VoiceResolver over registered,
stored and uploaded voices) and its text and token limits. How the engine runs the segments is
tests/test_engine.py's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosyserve.errors import InvalidInputError
from cosyserve.llm.prompt import SOS_ID, SPEECH_TOKEN_OFFSET, TASK_ID
from cosyserve.engine.front_end import SegmentPrompter, TokenLimits, TTSRequest, Voice, validate_text

VOICE = Voice("提示文本。", SimpleNamespace(speech_tokens=torch.tensor([5, 6, 7], dtype=torch.int32)))
LONG_TEXT = "一二三四五六七八九十。" * 20  # three segments of 77, 77 and 66 characters


@pytest.fixture(scope="module")
def text_tokenizer(tiny_bundle):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_bundle / "cosyvoice2_llm")


@pytest.fixture(scope="module")
def prompter(text_tokenizer) -> SegmentPrompter:
    return SegmentPrompter(text_tokenizer)


def request(text: str = "你好，世界。", voice: Voice = VOICE, rid: str = "r1", **kwargs) -> TTSRequest:
    return TTSRequest(rid, text, voice, TokenLimits(3, 3), **kwargs)


def prompt_texts(text_tokenizer, prompter: SegmentPrompter, req: TTSRequest) -> list[str]:
    """The text part of each segment's prompt (between <|sos|> and <|task_id|> + 3 speech tokens)."""
    return [text_tokenizer.decode(p.ids[1:-4]) for p in prompter.segment_prompts(req)]


def test_prompt_ids_follow_the_reference_layout(text_tokenizer, prompter):
    (segment,) = prompter.segment_prompts(request())
    ids = segment.ids
    assert segment.request_id == "r1" and segment.text == "你好，世界。"
    assert ids[0] == SOS_ID and ids[-4] == TASK_ID
    assert ids[-3:] == [SPEECH_TOKEN_OFFSET + t for t in (5, 6, 7)]
    assert text_tokenizer.decode(ids[1:-4]) == "提示文本。你好，世界。"


def test_instruct_and_cross_lingual_prompts(text_tokenizer, prompter):
    """Instruct: ``<|sos|>{instruction}<|endofprompt|>{text}<|task_id|>`` without prompt speech
    tokens; a cross-lingual voice: ``<|sos|>{text}<|task_id|>``."""
    from cosyserve.llm.prompt import ENDOFPROMPT

    (instruct,) = prompter.segment_prompts(request(instruction="用开心的语气说"))
    (cross,) = prompter.segment_prompts(request(voice=Voice("", VOICE.features, "voice_x", cross_lingual=True)))
    assert instruct.ids[0] == SOS_ID and instruct.ids[-1] == TASK_ID
    assert text_tokenizer.decode(instruct.ids[1:-1]) == f"用开心的语气说{ENDOFPROMPT}你好，世界。"
    assert cross.ids[0] == SOS_ID and cross.ids[-1] == TASK_ID
    assert text_tokenizer.decode(cross.ids[1:-1]) == "你好，世界。"
    with pytest.raises(InvalidInputError, match="instruction is empty"):
        list(prompter.segment_prompts(request(instruction=" ")))


def test_long_text_is_one_prompt_per_segment_with_the_segments_request_ids(text_tokenizer, prompter):
    segments = list(prompter.segment_prompts(request(LONG_TEXT)))
    assert [s.request_id for s in segments] == ["r1", "r1.1", "r1.2"]
    assert prompt_texts(text_tokenizer, prompter, request(LONG_TEXT)) == [
        "提示文本。" + s for s in ["一二三四五六七八九十。" * 7] * 2 + ["一二三四五六七八九十。" * 6]]


def test_text_frontend_switch(text_tokenizer, prompter):
    assert prompt_texts(text_tokenizer, prompter, request("我有3个苹果。")) == ["提示文本。我有三个苹果。"]
    assert prompt_texts(text_tokenizer, prompter, request("我有3个苹果。", text_frontend=False)) == \
        ["提示文本。我有3个苹果。"]


def test_a_reference_transcript_is_normalised_a_registered_prompt_is_not(text_tokenizer, prompter):
    texts = [prompt_texts(text_tokenizer, prompter, request("好。", voice=Voice("我有3个。", VOICE.features, speaker_id)))
             for speaker_id in (None, "001")]
    assert texts == [["我有三个。好。"], ["我有3个。好。"]]


def test_unspeakable_or_too_long_text_fails_at_the_first_segment(text_tokenizer):
    prompter = SegmentPrompter(text_tokenizer, max_text_chars=300)
    for text, message in [("😀！", "no speakable characters"), ("好。" * 151, "302 characters; at most 300")]:
        segments = prompter.segment_prompts(request(text))  # lazy: nothing checked yet
        with pytest.raises(InvalidInputError, match=message):
            next(segments)


def test_stored_voices_are_resolved_by_id_and_their_features_computed_once(tiny_bundle, tmp_path):
    from cosyserve.bundle import synthetic_prompt_wave
    from cosyserve.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
    from cosyserve.frontend.speakers import SpeakerRegistry
    from cosyserve.frontend.voice_store import UnknownVoiceError, VoiceStore
    from cosyserve.engine.front_end import VoiceResolver

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
