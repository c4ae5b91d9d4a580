"""The text front-end (cosyserve.text): upstream CosyVoice's text_normalize with wetext, and its splitting.

The expected strings are what wetext 0.1.8 + inflect give through upstream's rules (computed
with the libraries, each checked by reading it).
"""

import pytest

from cosyserve.errors import InvalidInputError
from cosyserve.text import TextFrontend, split_paragraph
from cosyserve.text.frontend import blocks, is_only_punctuation, keep_ascii_spaces


def words(text: str) -> list[str]:
    return text.split()


def word_count(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def frontend() -> TextFrontend:
    return TextFrontend(words)  # token counts only matter for splitting English (tested below)


@pytest.mark.parametrize("text, expected", [
    # numbers, dates, times
    ("今天是2026年11月24日，下午3:30开会。", "今天是二零二六年十一月二十四日，下午三点三十分开会。"),
    ("The meeting is on Nov. 24, 2026 at 3:30 pm.",
     "The meeting is on the twenty fourth of november, twenty twenty six at three thirty PM."),
    # money, percentages
    ("价格是$3.5M，涨了12.5%。", "价格是三点五美元M，涨了百分之十二点五。"),
    ("It costs $3.5M, up 12.5%!", "It costs three point five million dollars, up twelve point five percent!"),
    # units, signs, superscripts, measure words
    ("温度-5℃，面积20m²。", "温度负五摄氏度，面积二十平方米。"),
    ("I have 3 apples and 2.5 kg of bananas.", "I have three apples and two point five kilograms of bananas."),
    ("Dr. Smith lives at 221B Baker St.", "doctor Smith lives at two hundred twenty one B Baker St."),
    # mixed zh/en: the whole text takes the Chinese path; spaces stay only between ASCII characters
    ("他说OK，然后用了GPU 2块。", "他说OK，然后用了GPU两块。"),
    ("你好，我是Tom，今年25岁。I am 25.", "你好，我是Tom，今年二十五岁。I am二十五。"),
    # brackets dropped, a dash pause, two sentence ends in a row keep the first, a final full stop added
    ("（注意）这是【重点】——别忘了。", "注意这是重点 别忘了。"),
    ("好吗？！真的吗", "好吗？真的吗。"),
    # emoji: kept inside a sentence (upstream drops only segments made of punctuation/symbols)
    ("我有3个苹果😀和2.5公斤香蕉。", "我有三个苹果😀和二点五公斤香蕉。"),
    ("Hello! 😀😀", "Hello! 😀😀."),
    # markup: the front-end steps aside, as upstream does for <|...|>
    ("<|endofprompt|>keep 12 as is", "<|endofprompt|>keep 12 as is"),
])
def test_normalisation_table(frontend, text, expected):
    assert "".join(frontend.segments(text)) == expected


def test_switch_off_keeps_the_text(frontend):
    assert list(frontend.segments(" 3 apples ", enabled=False)) == [" 3 apples "]


def test_prompt_text_is_normalised_unsplit(frontend):
    assert frontend.normalize("今天是2026年11月24日，") == "今天是二零二六年十一月二十四日。"
    assert frontend.normalize("I have 3. You have 4.") == "I have three. You have four."


@pytest.mark.parametrize("text, message", [
    ("", "is empty"), ("  \n", "is empty"), ("😀😀", "no speakable characters"),
    ("！？。…", "no speakable characters"), ("x" * 1001, "1002 characters .* at most 1000"),
])
def test_unusable_text_is_a_clear_error(frontend, text, message):
    with pytest.raises(InvalidInputError, match=message):
        list(frontend.segments(text))


def test_text_limit():
    frontend = TextFrontend(words, max_text_chars=50)
    assert list(frontend.segments("a" * 49 + "."))
    with pytest.raises(InvalidInputError, match="51 characters; at most 50"):
        frontend.check("a" * 51)


def test_only_punctuation_segments_are_dropped():
    assert is_only_punctuation("😀😀。") and is_only_punctuation("")
    assert not is_only_punctuation("a.")
    # "😀!" alone would be dropped; a short tail merges into the sentence before it first
    assert split_paragraph("Hi.😀!", len, "en", max_len=1, min_len=0, merge_len=0) == ["Hi.", "😀!"]
    assert list(TextFrontend(words).segments("Hi.😀!")) == ["Hi.😀!"]


def test_spaces_between_chinese_characters_are_dropped():
    assert keep_ascii_spaces("你 好 a b 你") == "你好a b你"


def test_split_chinese_by_characters():
    sentence = "一二三四五六七八九十。"  # 11 characters
    segments = split_paragraph(sentence * 20, len, "zh")
    # 7 sentences fit in 80; the 8th would pass 80 with more than 60 already there: a new segment
    assert [len(s) for s in segments] == [77, 77, 66]
    assert "".join(segments) == sentence * 20


def test_split_merges_a_short_tail():
    sentence = "一二三四五六七八九十。"
    # the 8th sentence opens a second segment; with the tail it is 14 < 20 characters: merged back
    assert [len(s) for s in split_paragraph(sentence * 8 + "好的。", len, "zh")] == [91]
    # 22 characters are enough to stand alone
    assert [len(s) for s in split_paragraph(sentence * 9, len, "zh")] == [77, 22]


def test_split_english_by_tokens_keeps_closing_quotes():
    text = 'He said "stop." She waited; then she left! ' * 12
    segments = split_paragraph(text.strip(), word_count, "en", max_len=20, min_len=12, merge_len=5)
    assert all(s.endswith(('."', ";", "!")) for s in segments)
    assert all(len(words(s)) <= 20 for s in segments[:-1])  # the last one took the short tail
    assert "".join(segments) == text.strip()


def test_long_text_is_normalised_block_by_block(frontend):
    paragraph = "今天是2026年11月24日，天气很好，我们一起去公园散步，看到了很多花。" * 3 + "The price was $3.5 today! "
    text = paragraph * 100  # about 15,000 characters
    pieces = list(blocks(text, 500))
    assert "".join(pieces) == text and all(len(p) >= 500 for p in pieces[:-1])
    assert all(p.rstrip().endswith(("!", "。")) for p in pieces[:-1])
    segments = list(frontend.segments(text))
    assert "".join(segments) == "".join(frontend.segments(paragraph * 5)) * 20
    assert max(len(s) for s in segments) <= 100
