"""Text front-end: request text -> normalised, sentence-sized segments for the LLM.

The rules and their order are upstream CosyVoice's ``text_normalize`` with its ``wetext``
back end (used there when ``ttsfrd`` is not installed); see :mod:`cosyserve.text.frontend`.
"""

from .frontend import (MAX_SEGMENT_CHARS, MAX_TEXT_CHARS, TextFrontend, contains_chinese, is_only_punctuation,
                       split_paragraph)

__all__ = ["MAX_SEGMENT_CHARS", "MAX_TEXT_CHARS", "TextFrontend", "contains_chinese", "is_only_punctuation",
           "split_paragraph"]
