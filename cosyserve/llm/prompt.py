"""Token-id layout of the HuggingFace-format CosyVoice2 LLM and the prompt it is fed.

Layout (see ``llm_layout.md`` §2): the Qwen2 text vocabulary and its special tokens fill ids
0..151662; speech token ``k`` (0..6560) is id ``151663 + k``; then the three end-of-speech ids,
``<|sos|>`` and ``<|task_id|>``. Rows from 158229 up to the padded vocabulary size (158336) are
padding that no tokenizer string maps to.

Prompt (the Triton BLS and ``offline_inference.py`` build the same ids)::

    zero-shot       <|sos|>{prompt_text}{target_text}<|task_id|> + prompt speech ids
    cross-lingual   <|sos|>{target_text}<|task_id|>
    instruct        <|sos|>{instruction}<|endofprompt|>{target_text}<|task_id|>

The shareable part between requests of one registered voice is ``<|sos|>{prompt_text}``
(:func:`build_prefix_ids`); the engine's prefix cache matches it token by token, so a merge of
the last prompt-text token with the first target-text token only shortens the reused part.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..errors import InvalidInputError

SPEECH_TOKEN_OFFSET = 151663
NUM_SPEECH_TOKENS = 6561
EOS_IDS = (158224, 158225, 158226)
SOS_ID = 158227
TASK_ID = 158228
# Every id from here up to the padded vocabulary size is a padding row (no token string).
TOKENIZER_SIZE = 158229
ENDOFPROMPT_ID = 151646

SOS = "<|sos|>"
TASK = "<|task_id|>"
ENDOFPROMPT = "<|endofprompt|>"

# The model's output window: speech tokens then the end-of-speech ids (all other logits are -inf).
OUTPUT_WINDOW_START = SPEECH_TOKEN_OFFSET
OUTPUT_WINDOW_SIZE = NUM_SPEECH_TOKENS + len(EOS_IDS)

# CosyVoice bounds the generated length by the target text length (Qwen2LM.inference).
MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0
# Absolute cap on generated speech tokens (about 80 s of audio at 25 tokens/s).
MAX_SPEECH_TOKENS = 2048


def speech_token_string(token: int) -> str:
    """The tokenizer string of raw speech token ``token`` (``<|s_N|>``)."""
    return f"<|s_{token}|>"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _speech_ids(prompt_speech_tokens: Sequence[int]) -> list[int]:
    ids = []
    for token in prompt_speech_tokens:
        token = int(token)
        if not 0 <= token < NUM_SPEECH_TOKENS:
            raise InvalidInputError(
                f"prompt speech token {token} is out of range; speech tokens are 0..{NUM_SPEECH_TOKENS - 1}")
        ids.append(SPEECH_TOKEN_OFFSET + token)
    return ids


def build_prompt_ids(
    tokenizer,
    target_text: str,
    prompt_text: str | None = None,
    prompt_speech_tokens: Sequence[int] | None = None,
    instruction: str | None = None,
) -> list[int]:
    """LLM input ids for one utterance; ``prompt_speech_tokens`` are raw codes 0..6560.

    ``instruction`` selects the instruct form; it replaces the prompt text and the reference
    drops the prompt speech tokens in that mode, so passing them too is an error.
    """
    if not target_text:
        raise InvalidInputError("target_text is empty; give the text to synthesise")
    if instruction is not None:
        if prompt_text is not None or prompt_speech_tokens is not None:
            raise InvalidInputError(
                "instruction mode takes no prompt_text or prompt_speech_tokens (the instruction is the LLM prompt)")
        prefix_text = instruction + ENDOFPROMPT
    else:
        prefix_text = prompt_text or ""
    ids = _encode(tokenizer, SOS + prefix_text + target_text + TASK)
    if ids[0] != SOS_ID or ids[-1] != TASK_ID:
        raise InvalidInputError(
            f"the tokenizer does not map {SOS} / {TASK} to ids {SOS_ID} / {TASK_ID}: not a CosyVoice2 LLM tokenizer")
    return ids + _speech_ids(prompt_speech_tokens or ())


def build_prefix_ids(tokenizer, prompt_text: str) -> list[int]:
    """The ids shared by every request of a voice with this prompt text: ``<|sos|>{prompt_text}``."""
    return _encode(tokenizer, SOS + prompt_text)


def register_voice_prefixes(backend, text_tokenizer, registry) -> None:
    """Precompute in ``backend`` the LLM KV of every voice of ``registry`` (a
    :class:`~cosyserve.frontend.speakers.SpeakerRegistry`): its ``<|sos|>{prompt_text}``."""
    for speaker_id in registry.ids():
        prompt_text = registry.get(speaker_id).prompt_text
        backend.register_prefix(f"voice:{speaker_id}", build_prefix_ids(text_tokenizer, prompt_text))


def length_bounds(tokenizer, target_text: str, max_cap: int = MAX_SPEECH_TOKENS) -> tuple[int, int]:
    """(min_tokens, max_tokens) for ``target_text``: 2x..20x its token count, capped at ``max_cap``."""
    num_text_tokens = len(_encode(tokenizer, target_text))
    max_tokens = max(1, min(int(num_text_tokens * MAX_TOKEN_TEXT_RATIO), max_cap))
    return min(int(num_text_tokens * MIN_TOKEN_TEXT_RATIO), max_tokens), max_tokens


def validate_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Return the ids as a list of ints or raise InvalidInputError naming what is wrong."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise InvalidInputError(f"prompt ids must be a list of ints, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise InvalidInputError("the prompt is empty; it needs at least one token id")
    limit = min(vocab_size, TOKENIZER_SIZE)
    ids = []
    for position, token in enumerate(prompt_ids):
        try:
            if isinstance(token, bool):
                raise TypeError
            token = operator.index(token)  # accepts numpy / torch integer scalars, refuses floats
        except TypeError:
            raise InvalidInputError(f"prompt id at position {position} is {token!r}, not an int") from None
        if not 0 <= token < limit:
            raise InvalidInputError(
                f"prompt id {token} at position {position} is not a known token; ids are 0..{limit - 1}")
        ids.append(token)
    return ids
