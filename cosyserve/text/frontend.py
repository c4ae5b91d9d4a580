"""Upstream CosyVoice's text front-end (``CosyVoiceFrontEnd.text_normalize`` with ``wetext``), reimplemented.

Per request text, in upstream's order:

1. ``text_frontend`` off, or SSML-like markup (``<|`` and ``|>``) in the text: the text is used
   as it is, as one segment.
2. The language is chosen once for the whole text: Chinese if it holds a CJK ideograph
   (U+4E00..U+9FFF), else English.
3. Chinese: ``wetext`` TN (zh, erhua kept), newlines dropped, spaces removed unless between two
   ASCII characters, ``²``/``³`` spelt out, ``.`` -> ``。``, `` - `` -> ``，``, brackets and
   backticks dropped, ``——`` -> space, trailing commas -> ``。``; then split by character counts.
   English: ``wetext`` TN (en), remaining digit runs spelt out with ``inflect``; then split by
   LLM text-token counts.
4. Splitting (:func:`split_paragraph`): sentences end at sentence punctuation (a closing quote
   stays with its sentence); sentences are packed greedily into segments of at most 80 units,
   a segment being closed only once it has more than 60; a last segment under 20 joins the one
   before it.
5. Segments that are only punctuation or symbols (emoji included) are dropped.

The language is passed to ``wetext`` explicitly: upstream pins ``wetext`` 0.0.4, whose ``auto``
picks zh exactly when the text holds a CJK ideograph, i.e. the same choice as step 2. (0.0.4
downloads its FST files from ModelScope at run time; 0.1.x ships them in the wheel, so this
works offline.)

Long texts: ``wetext`` costs about 0.25 ms per character and grows faster than linearly, so
normalising 100,000 characters up front would hold back the first audio by half a minute. The
text is therefore cut into blocks of at least :data:`BLOCK_CHARS` characters at hard sentence
ends (``。！？；!?;`` or a newline, with a closing quote), and each block goes through steps 3-5
on its own when the caller asks for its segments (:meth:`TextFrontend.segments` is lazy). A text
shorter than a block is treated exactly as upstream treats it; in longer ones the only
difference is that segments are not merged across block boundaries.
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from typing import Callable, Iterator

import regex

from ..errors import InvalidInputError

MAX_TEXT_CHARS = 100_000  # one request's text (the configurable default)
MAX_SEGMENT_CHARS = 1000  # one LLM prompt: a segment, or the whole text with the front-end off
BLOCK_CHARS = 500  # see the module docstring: normalisation works block by block

SEGMENT_MAX_LEN, SEGMENT_MIN_LEN, MERGE_LEN = 80, 60, 20  # upstream's token_max_n, token_min_n, merge_len
ZH_SENTENCE_ENDS = "。？！；：、.?!;"
EN_SENTENCE_ENDS = ".?!;:"
COMMAS = "，,"
CLOSING_QUOTES = "\"”"

_CJK = re.compile(r"[\u4e00-\u9fff]")
_BLOCK_END = re.compile(r"[。！？；!?;\n]+[\"”]?\s*")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_ONLY_PUNCTUATION = regex.compile(r"[\p{P}\p{S}]*")


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def is_only_punctuation(text: str) -> bool:
    """Empty, or nothing but punctuation and symbols (emoji are symbols)."""
    return _ONLY_PUNCTUATION.fullmatch(text) is not None


def has_speakable_characters(text: str) -> bool:
    """Anything but punctuation, symbols, separators and control characters."""
    return any(unicodedata.category(ch)[0] not in "PSZC" for ch in text)


def keep_ascii_spaces(text: str) -> str:
    """Drop each space unless both its neighbours are non-space ASCII (Chinese needs no spaces)."""
    def kept(i: int) -> bool:
        return 0 < i < len(text) - 1 and all(ch.isascii() and ch != " " for ch in (text[i - 1], text[i + 1]))

    return "".join(ch for i, ch in enumerate(text) if ch != " " or kept(i))


def spell_out_numbers(text: str, number_to_words: Callable[[str], str]) -> str:
    """Every run of digits (``str.isdigit``) replaced by its words."""
    return "".join(number_to_words("".join(run)) if is_digit else "".join(run)
                   for is_digit, run in itertools.groupby(text, key=str.isdigit))


def chinese_rules(text: str) -> str:
    """Upstream's clean-up of normalised Chinese text (step 3 of the module docstring)."""
    text = keep_ascii_spaces(text.replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for dropped in ("（", "）", "【", "】", "`"):
        text = text.replace(dropped, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def split_paragraph(text: str, length: Callable[[str], int], lang: str, *, max_len: int = SEGMENT_MAX_LEN,
                    min_len: int = SEGMENT_MIN_LEN, merge_len: int = MERGE_LEN,
                    comma_split: bool = False) -> list[str]:
    """Upstream's paragraph splitting; ``length`` counts a text's units (characters for zh, LLM
    text tokens for en).

    As upstream: the text gets a final full stop when it does not end a sentence, and of two
    sentence ends in a row the second is dropped (``好吗？！`` -> ``好吗？``).
    """
    if not text:
        return []
    ends = (ZH_SENTENCE_ENDS if lang == "zh" else EN_SENTENCE_ENDS) + (COMMAS if comma_split else "")
    if text[-1] not in ends:
        text += "。" if lang == "zh" else "."
    sentences: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch not in ends:
            continue
        if i > start:
            sentences.append(text[start:i + 1])
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            if sentences:
                sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1
    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > max_len and length(current) > min_len:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < merge_len:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def blocks(text: str, block_chars: int = BLOCK_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at least ``block_chars`` characters, each ending at a
    hard sentence end (the last one at the end of the text)."""
    start = 0
    while start < len(text):
        end = _BLOCK_END.search(text, start + block_chars)
        stop = end.end() if end else len(text)
        yield text[start:stop]
        start = stop


@functools.cache
def _normalizer(lang: str):
    from wetext import Normalizer

    return Normalizer(lang=lang, operator="tn", remove_erhua=False)


@functools.cache
def _number_to_words() -> Callable[[str], str]:
    import inflect

    return inflect.engine().number_to_words


class TextFrontend:
    """Request text -> the segments the LLM voices one after another.

    ``encode`` is the LLM's text tokenizer (text -> ids); it measures English segments.
    """

    def __init__(self, encode: Callable[[str], list[int]], *, max_text_chars: int = MAX_TEXT_CHARS,
                 max_segment_chars: int = MAX_SEGMENT_CHARS, block_chars: int = BLOCK_CHARS):
        self.encode = encode
        self.max_text_chars = max_text_chars
        self.max_segment_chars = max_segment_chars
        self.block_chars = block_chars

    def check(self, text: str, what: str = "target_text") -> str:
        """Reject what cannot be voiced at all, before any work is done for the request."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"{what} is empty; send the text to synthesise (1 to {self.max_text_chars} "
                                    "characters)")
        if len(text) > self.max_text_chars:
            raise InvalidInputError(f"{what} has {len(text)} characters; at most {self.max_text_chars} are accepted "
                                    "per request")
        if not has_speakable_characters(text):
            raise InvalidInputError(f"{what} has no speakable characters (only punctuation, symbols or emoji)")
        return text

    def segments(self, text: str, enabled: bool = True, what: str = "target_text") -> Iterator[str]:
        """The segments of a checked text, in order, each normalised when its block is reached.

        Raises :class:`InvalidInputError` when nothing speakable is left, or for a segment longer
        than ``max_segment_chars`` (a run without sentence punctuation; with the front-end off,
        the whole text).
        """
        self.check(text, what)
        if not enabled or ("<|" in text and "|>" in text):
            yield self._bounded(text, what, "with text_frontend off the whole text is one LLM prompt")
            return
        lang = "zh" if contains_chinese(text) else "en"
        found = False
        for block in blocks(text.strip(), self.block_chars):
            for segment in self._block_segments(block.strip(), lang):
                found = True
                yield self._bounded(segment, what, "it has no sentence punctuation to split at")
        if not found:
            raise InvalidInputError(f"{what} has no speakable characters left after text normalisation")

    def warm_up(self) -> None:
        """Load both languages' normalisers now (wetext's grammars, inflect): a process's first
        request of a language otherwise pays for it (measured on CPU: 0.6 s Chinese, 3.7 s English)."""
        for sample in ("今天是2024年1月1日，气温25度。", "It is 25 degrees on January 1, 2024."):
            list(self.segments(sample))

    def normalize(self, text: str, enabled: bool = True) -> str:
        """The whole text normalised, unsplit (upstream's ``split=False``, used for prompt texts)."""
        if not enabled or not text or ("<|" in text and "|>" in text):
            return text
        lang = "zh" if contains_chinese(text) else "en"
        return "".join(self._normalized(block.strip(), lang) for block in blocks(text.strip(), self.block_chars))

    def _normalized(self, text: str, lang: str) -> str:
        if not text:
            return text
        try:
            normalized = _normalizer(lang).normalize(text)
        except Exception as exc:  # wetext asserts on input its grammar cannot tag
            raise InvalidInputError(f"text normalisation ({lang}) failed on {text[:80]!r}: {exc!r}; "
                                    "send text_frontend=false to skip it") from exc
        if lang == "zh":
            return chinese_rules(normalized)
        return spell_out_numbers(normalized, _number_to_words())

    def _block_segments(self, block: str, lang: str) -> list[str]:
        normalized = self._normalized(block, lang)
        length = len if lang == "zh" else (lambda s: len(self.encode(s)))
        return [s for s in split_paragraph(normalized, length, lang) if not is_only_punctuation(s)]

    def _bounded(self, segment: str, what: str, why: str) -> str:
        if len(segment) > self.max_segment_chars:
            raise InvalidInputError(f"{what}: a segment of {len(segment)} characters ({why}); at most "
                                    f"{self.max_segment_chars} are accepted per LLM prompt: {segment[:40]!r}...")
        return segment
