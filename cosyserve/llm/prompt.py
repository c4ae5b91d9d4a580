"""Token-id layouts of the HuggingFace-format CosyVoice2 and CosyVoice3 LLMs and the prompts they are fed.

CosyVoice2 (``llm_layout.md`` §2): the Qwen2 text vocabulary and its special tokens fill ids
0..151662; speech token ``k`` (0..6560) is id ``151663 + k``; then the three end-of-speech ids,
``<|sos|>`` and ``<|task_id|>``. Rows from 158229 up to the padded vocabulary size (158336) are
padding that no tokenizer string maps to. The module-level constants are this layout's.

CosyVoice3 (``cosyvoice3_llm_layout.md`` §2-3, :data:`COSYVOICE3`): 278 more text special tokens
(``<|endofsystem|>``, phones) take the text vocabulary to 151924; class ``c`` of the speech head
(0..6760) is id ``151924 + c``: speech tokens 0..6560, then ``<|sos|>`` 158485, ``<|eos1|>``
158486, ``<|task_id|>`` 158487, ``<|fill|>`` 158488 and 196 reserved classes; 158685 entries,
padded to 158720.

Prompt (the Triton front door and ``offline_inference.py`` build the same ids)::

    CosyVoice2 zero-shot       <|sos|>{prompt_text}{target_text}<|task_id|> + prompt speech ids
               cross-lingual   <|sos|>{target_text}<|task_id|>
               instruct        <|sos|>{instruction}<|endofprompt|>{target_text}<|task_id|>
    CosyVoice3 zero-shot       <|sos|>{system}{prompt_text}{target_text}<|task_id|> + prompt speech ids
               cross-lingual   <|sos|>{system}{target_text}<|task_id|>
               instruct        <|sos|>You are a helpful assistant. {instruction}<|endofprompt|>{target_text}<|task_id|>

CosyVoice3's text must contain ``<|endofprompt|>`` (upstream asserts it); where the prompt and
target text lack it, ``{system}`` = ``You are a helpful assistant.<|endofprompt|>`` is put in
front, as the reference Triton BLS does; an instruction that already ends its system part with
``<|endofprompt|>`` is used as given (upstream's instruct strings carry it).

The shareable part between requests of one registered voice is ``<|sos|>{prompt_text}``
(:func:`build_prefix_ids`; with CosyVoice3's system part in front); the engine's prefix cache
matches it token by token, so a merge of the last prompt-text token with the first target-text
token only shortens the reused part.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidInputError, ModelLoadError

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


COSYVOICE3_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class PromptLayout:
    """Where one model's ids are, which ids end generation, and how its prompt text is formed."""

    name: str
    speech_token_offset: int  # id of speech token 0 (raw codes 0..num_speech_tokens-1 follow)
    num_speech_tokens: int
    sos_id: int
    task_id: int
    stop_ids: tuple[int, ...]  # generating any of these ends the utterance (never passed to the flow)
    eos_id: int  # the end-of-speech id of the HF checkpoint's generation config
    tokenizer_size: int  # ids from here to the padded vocabulary are padding rows
    output_window_size: int  # the head's classes: ids [speech_token_offset, + size)
    vocab_size: int  # the checkpoint's padded vocabulary (config.json ``vocab_size``): tells the layouts apart
    head_bias: bool  # the converted lm_head has a bias (CosyVoice2: -inf outside the window; CosyVoice3: none)
    system_prompt: str | None = None  # CosyVoice3: the text must carry <|endofprompt|>

    def prompt_text(self, target_text: str, prompt_text: str | None, instruction: str | None) -> str:
        """The text between ``<|sos|>`` and ``<|task_id|>`` for the mode the arguments select."""
        if instruction is not None:
            if self.system_prompt is None:
                return instruction + ENDOFPROMPT + target_text
            if ENDOFPROMPT in instruction:  # upstream's instruct strings carry their system part
                return instruction + target_text
            return f"{self.system_prompt} {instruction}{ENDOFPROMPT}{target_text}"
        return self.system_part(prompt_text or "", target_text) + (prompt_text or "") + target_text

    def system_part(self, prompt_text: str, target_text: str = "") -> str:
        """What goes before the prompt text: the system prompt where the text lacks ``<|endofprompt|>``."""
        if self.system_prompt is None or ENDOFPROMPT in prompt_text + target_text:
            return ""
        return self.system_prompt + ENDOFPROMPT


COSYVOICE2 = PromptLayout(
    name="cosyvoice2", speech_token_offset=SPEECH_TOKEN_OFFSET, num_speech_tokens=NUM_SPEECH_TOKENS, sos_id=SOS_ID,
    task_id=TASK_ID, stop_ids=EOS_IDS, eos_id=EOS_IDS[0], tokenizer_size=TOKENIZER_SIZE,
    output_window_size=OUTPUT_WINDOW_SIZE, vocab_size=158336, head_bias=True)
# Upstream's CosyVoice3LM stops on every class from 6561 (its sos) to 6760; the HF/TensorRT-LLM
# reference path stops on <|eos1|> only, which lets sos/task_id/fill/reserved ids through to the flow.
COSYVOICE3 = PromptLayout(
    name="cosyvoice3", speech_token_offset=151924, num_speech_tokens=NUM_SPEECH_TOKENS, sos_id=158485, task_id=158487,
    stop_ids=tuple(range(151924 + NUM_SPEECH_TOKENS, 151924 + 6761)), eos_id=158486, tokenizer_size=158685,
    output_window_size=6761, vocab_size=158720, head_bias=False, system_prompt=COSYVOICE3_SYSTEM_PROMPT)
LAYOUTS = {layout.name: layout for layout in (COSYVOICE2, COSYVOICE3)}


def layout_for_vocab_size(vocab_size: int) -> PromptLayout:
    """The layout of an HF-format checkpoint, told by its padded vocabulary size (158336 / 158720)."""
    for layout in LAYOUTS.values():
        if layout.vocab_size == vocab_size:
            return layout
    known = ", ".join(f"{layout.vocab_size} ({layout.name})" for layout in LAYOUTS.values())
    raise ModelLoadError(f"vocab_size {vocab_size} is not a CosyVoice LLM's; known: {known}")


def speech_token_string(token: int) -> str:
    """The tokenizer string of raw speech token ``token`` (``<|s_N|>``)."""
    return f"<|s_{token}|>"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _speech_ids(prompt_speech_tokens: Sequence[int], layout: PromptLayout) -> list[int]:
    ids = []
    for token in prompt_speech_tokens:
        token = int(token)
        if not 0 <= token < layout.num_speech_tokens:
            raise InvalidInputError(
                f"prompt speech token {token} is out of range; speech tokens are 0..{layout.num_speech_tokens - 1}")
        ids.append(layout.speech_token_offset + token)
    return ids


def build_prompt_ids(
    tokenizer,
    target_text: str,
    prompt_text: str | None = None,
    prompt_speech_tokens: Sequence[int] | None = None,
    instruction: str | None = None,
    layout: PromptLayout = COSYVOICE2,
) -> list[int]:
    """LLM input ids for one utterance; ``prompt_speech_tokens`` are raw codes 0..6560.

    ``instruction`` selects the instruct form; it replaces the prompt text and the reference
    drops the prompt speech tokens in that mode, so passing them too is an error. Without
    ``prompt_text`` and speech tokens the form is cross-lingual. (CosyVoice3 upstream truncates
    the prompt speech tokens to half the prompt's mel frames; its Triton BLS does not: the caller
    chooses by what it passes.)
    """
    if not target_text:
        raise InvalidInputError("target_text is empty; give the text to synthesise")
    if instruction is not None:
        if prompt_text is not None or prompt_speech_tokens is not None:
            raise InvalidInputError(
                "instruction mode takes no prompt_text or prompt_speech_tokens (the instruction is the LLM prompt)")
    ids = _encode(tokenizer, SOS + layout.prompt_text(target_text, prompt_text, instruction) + TASK)
    if ids[0] != layout.sos_id or ids[-1] != layout.task_id:
        raise InvalidInputError(
            f"the tokenizer does not map {SOS} / {TASK} to ids {layout.sos_id} / {layout.task_id}: not a "
            f"{layout.name} LLM tokenizer")
    return ids + _speech_ids(prompt_speech_tokens or (), layout)


def build_prefix_ids(tokenizer, prompt_text: str, layout: PromptLayout = COSYVOICE2) -> list[int]:
    """The ids shared by every request of a voice with this prompt text: ``<|sos|>{prompt_text}``
    (CosyVoice3: with the system part in front where the prompt text lacks ``<|endofprompt|>``)."""
    return _encode(tokenizer, SOS + layout.system_part(prompt_text) + prompt_text)


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


def validate_prompt_ids(prompt_ids: Sequence[int], vocab_size: int, layout: PromptLayout = COSYVOICE2) -> list[int]:
    """Return the ids as a list of ints or raise InvalidInputError naming what is wrong."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise InvalidInputError(f"prompt ids must be a list of ints, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise InvalidInputError("the prompt is empty; it needs at least one token id")
    limit = min(vocab_size, layout.tokenizer_size)
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
