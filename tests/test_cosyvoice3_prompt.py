"""LLM prompt layouts and stop rules: a table of token ids per mode for CosyVoice3 (and CosyVoice2, same code).

The CosyVoice3 tokenizer here has the released id layout (``cosyvoice3_llm_layout.md`` §2-3, §8)
over the tiny bundle's byte-level BPE: what differs from the released tokenizer is only the BPE
of plain text and the names of the 260 phone tokens (ids 151664..151923), which no prompt uses.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from cosyserve.bundle.llm import build_cosyvoice3_tokenizer, build_tokenizer
from cosyserve.errors import InvalidInputError
from cosyserve.llm.prompt import (
    COSYVOICE2,
    COSYVOICE3,
    ENDOFPROMPT,
    ENDOFPROMPT_ID,
    LAYOUTS,
    build_prefix_ids,
    build_prompt_ids,
    validate_prompt_ids,
)

SYSTEM = "You are a helpful assistant."
PROMPT_TEXT, TARGET = "Hello world, 你好。", "Numbers like 2024 are read aloud."
SPEECH = [0, 17, 6560]


@pytest.fixture(scope="module")
def cv2_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())


@pytest.fixture(scope="module")
def cv3_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=build_cosyvoice3_tokenizer())


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_cosyvoice3_check_values(cv3_tokenizer):
    """``cosyvoice3_llm_layout.md`` §8, against the layout constants and the tokenizer."""
    assert len(cv3_tokenizer) == COSYVOICE3.tokenizer_size == 158685
    expected = {"<|endoftext|>": 151643, ENDOFPROMPT: 151646, "<|endofsystem|>": 151663, "<|s_0|>": 151924,
                "<|s_6560|>": 158484, "<|sos|>": 158485, "<|eos1|>": 158486, "<|task_id|>": 158487,
                "<|fill|>": 158488, "<|s_6565|>": 158489, "<|s_6760|>": 158684}
    for text, token_id in expected.items():
        assert encode(cv3_tokenizer, text) == [token_id], text
    assert (COSYVOICE3.speech_token_offset, COSYVOICE3.sos_id, COSYVOICE3.eos_id, COSYVOICE3.task_id) == \
        (151924, 158485, 158486, 158487)
    assert COSYVOICE3.output_window_size == 6761 and LAYOUTS["cosyvoice3"] is COSYVOICE3


def test_stop_rules():
    # CosyVoice3 upstream: every class >= 6561 (sos, eos1, task_id, fill, 196 reserved) ends generation.
    assert COSYVOICE3.stop_ids == tuple(range(158485, 158685)) and len(COSYVOICE3.stop_ids) == 200
    assert COSYVOICE3.eos_id in COSYVOICE3.stop_ids
    speech = range(COSYVOICE3.speech_token_offset, COSYVOICE3.speech_token_offset + COSYVOICE3.num_speech_tokens)
    assert not set(speech) & set(COSYVOICE3.stop_ids)
    assert COSYVOICE3.speech_token_offset + COSYVOICE3.output_window_size == COSYVOICE3.stop_ids[-1] + 1
    # CosyVoice2: the three <|eos*|> ids, the first is the checkpoint's eos.
    assert COSYVOICE2.stop_ids == (158224, 158225, 158226) and COSYVOICE2.eos_id == 158224


def test_cosyvoice3_prompt_table(cv3_tokenizer):
    """Token ids of each mode: sos, text, task_id, prompt speech (``cosyvoice3_llm_layout.md`` §4)."""
    sos, task, speech0 = 158485, 158487, 151924

    def text(value: str) -> list[int]:
        return encode(cv3_tokenizer, value)

    table = {
        # mode: (arguments, expected ids)
        "zero-shot, transcript without <|endofprompt|> (the BLS adds the system part)": (
            dict(prompt_text=PROMPT_TEXT, prompt_speech_tokens=SPEECH),
            [sos, *text(SYSTEM), ENDOFPROMPT_ID, *text(PROMPT_TEXT + TARGET), task, *(speech0 + k for k in SPEECH)]),
        "zero-shot, upstream's prompt text with its own system part": (
            dict(prompt_text=f"{SYSTEM}{ENDOFPROMPT}{PROMPT_TEXT}", prompt_speech_tokens=SPEECH),
            [sos, *text(SYSTEM), ENDOFPROMPT_ID, *text(PROMPT_TEXT + TARGET), task, *(speech0 + k for k in SPEECH)]),
        "cross-lingual (no prompt text, no prompt speech)": (
            dict(), [sos, *text(SYSTEM), ENDOFPROMPT_ID, *text(TARGET), task]),
        "instruct, instruction only": (
            dict(instruction="请用广东话表达。"),
            [sos, *text(f"{SYSTEM} 请用广东话表达。"), ENDOFPROMPT_ID, *text(TARGET), task]),
        "instruct, upstream's full instruct string": (
            dict(instruction=f"{SYSTEM} 请用广东话表达。{ENDOFPROMPT}"),
            [sos, *text(f"{SYSTEM} 请用广东话表达。"), ENDOFPROMPT_ID, *text(TARGET), task]),
    }
    for mode, (kwargs, expected) in table.items():
        ids = build_prompt_ids(cv3_tokenizer, TARGET, layout=COSYVOICE3, **kwargs)
        assert ids == expected, mode
        assert ids.count(ENDOFPROMPT_ID) == 1, mode  # upstream asserts it is present
        assert validate_prompt_ids(ids, 158720, COSYVOICE3) == ids
    # The cached per-voice prefix is the head of the zero-shot prompt.
    prefix = build_prefix_ids(cv3_tokenizer, PROMPT_TEXT, COSYVOICE3)
    assert prefix == [sos, *text(SYSTEM), ENDOFPROMPT_ID, *text(PROMPT_TEXT)]


def test_cosyvoice3_requests_get_each_modes_prompt(cv3_tokenizer):
    """What the engine's ``cosyvoice3`` model sends the LLM for a request of each mode (its
    :class:`SegmentPrompter`, with the CosyVoice3 layout): the ids of the table above. Instruct drops
    the voice's transcript and prompt speech tokens from the LLM prompt (as CosyVoice2's instruct mode
    and upstream's ``inference_instruct2``)."""
    from types import SimpleNamespace

    import torch

    from cosyserve.engine.front_end import SegmentPrompter, TokenLimits, TTSRequest, Voice

    sos, task, speech0 = 158485, 158487, 151924
    features = SimpleNamespace(speech_tokens=torch.tensor(SPEECH, dtype=torch.int32))
    clip = Voice(PROMPT_TEXT, features)  # a reference clip with its transcript
    stored_bare = Voice("", features, "voice_" + "0" * 32, cross_lingual=True)  # stored without transcript

    def text(value: str) -> list[int]:
        return encode(cv3_tokenizer, value)

    table = {
        "zero-shot": (dict(voice=clip),
                      [sos, *text(SYSTEM), ENDOFPROMPT_ID, *text(PROMPT_TEXT + TARGET), task,
                       *(speech0 + k for k in SPEECH)]),
        "cross-lingual": (dict(voice=stored_bare), [sos, *text(SYSTEM), ENDOFPROMPT_ID, *text(TARGET), task]),
        "instruct, clip with transcript": (
            dict(voice=clip, instruction="请用广东话表达。"),
            [sos, *text(f"{SYSTEM} 请用广东话表达。"), ENDOFPROMPT_ID, *text(TARGET), task]),
        "instruct, cross-lingual voice, upstream's string": (
            dict(voice=stored_bare, instruction=f"{SYSTEM} 请用广东话表达。{ENDOFPROMPT}"),
            [sos, *text(f"{SYSTEM} 请用广东话表达。"), ENDOFPROMPT_ID, *text(TARGET), task]),
    }
    prompter = SegmentPrompter(cv3_tokenizer, layout=COSYVOICE3)

    def prompt_ids(request: TTSRequest) -> list[list[int]]:
        return [segment.ids for segment in prompter.segment_prompts(request)]

    for mode, (kwargs, expected) in table.items():
        request = TTSRequest(mode, TARGET, kwargs["voice"], TokenLimits(3, 3), text_frontend=False,
                             instruction=kwargs.get("instruction"))
        assert prompt_ids(request) == [expected], mode
    for bad in ("", " "):
        with pytest.raises(InvalidInputError, match="instruction is empty"):
            prompt_ids(TTSRequest("e", TARGET, clip, TokenLimits(3, 3), instruction=bad))
    with pytest.raises(InvalidInputError, match="instruction has"):
        prompt_ids(TTSRequest("long", TARGET, clip, TokenLimits(3, 3), instruction="x" * 100_000))


def test_cosyvoice2_prompt_table_unchanged(cv2_tokenizer):
    """The same builder with the CosyVoice2 layout: no system part, instruction + <|endofprompt|>."""
    sos, task, speech0 = 158227, 158228, 151663

    def text(value: str) -> list[int]:
        return encode(cv2_tokenizer, value)

    assert build_prompt_ids(cv2_tokenizer, TARGET, PROMPT_TEXT, SPEECH) == \
        [sos, *text(PROMPT_TEXT + TARGET), task, *(speech0 + k for k in SPEECH)]
    assert build_prompt_ids(cv2_tokenizer, TARGET) == [sos, *text(TARGET), task]
    assert build_prompt_ids(cv2_tokenizer, TARGET, instruction="Speak slowly.") == \
        [sos, *text("Speak slowly."), ENDOFPROMPT_ID, *text(TARGET), task]
    assert build_prefix_ids(cv2_tokenizer, PROMPT_TEXT) == [sos, *text(PROMPT_TEXT)]


def test_layout_mismatch_and_bad_ids_are_rejected(cv2_tokenizer, cv3_tokenizer):
    with pytest.raises(InvalidInputError, match="not a cosyvoice3 LLM tokenizer"):
        build_prompt_ids(cv2_tokenizer, TARGET, layout=COSYVOICE3)
    with pytest.raises(InvalidInputError, match="out of range"):
        build_prompt_ids(cv3_tokenizer, TARGET, PROMPT_TEXT, [6561], layout=COSYVOICE3)
    with pytest.raises(InvalidInputError, match="not a known token"):
        validate_prompt_ids([158685], 158720, COSYVOICE3)
