"""The synthetic benchmark set: prompts and texts shaped like seed-tts' wenetspeech4tts split."""

from __future__ import annotations

import random
from pathlib import Path

from . import BenchError

# Common Chinese characters: the texts are random strings of them (meaningless, tokenizable).
CHARACTERS = ("的一是在不了有和人这中大为上个国我以要他时来用们生到"
              "作地于出就分对成会可也你能而子那得着下自之年过发后里"
              "如家多经么去法学都同现当没动面起看定天还进好小部其些"
              "主样理心她本前开但因只从想实日者意无力它与长把机十民"
              "第公此已工使情明性知全三又关点正业外将两高间由问很最"
              "重并物手应向头文")
PROMPT_SECONDS = (3.0, 8.0)
CHARACTERS_PER_SECOND = 4.5  # Mandarin read speech, about
TARGET_CHARACTERS = (18, 45)  # about 4-10 s of speech
PROMPT_SAMPLE_RATE = 16000


def chinese_sentence(rng: random.Random, length: int) -> str:
    """``length`` characters with a comma every 5-12 and a full stop at the end."""
    text, clause = [], rng.randint(5, 12)
    for i in range(length):
        text.append(rng.choice(CHARACTERS))
        clause -= 1
        if clause == 0 and i < length - 1:
            text.append("，")
            clause = rng.randint(5, 12)
    return "".join(text) + "。"


def write_synthetic_manifest(out_dir: Path, count: int = 26, seed: int = 0) -> Path:
    """``count`` items like the wenetspeech4tts benchmark split, in ``out_dir/manifest.txt``.

    Prompts: 3-8 s of the bundle's speech-like test signal (voiced, not silent) as 16-bit wavs at
    16 kHz; prompt text about 4.5 characters a second of prompt; target texts of 18-45 characters.
    """
    import soundfile as sf

    from ..bundle import synthetic_prompt_wave

    if count < 1:
        raise BenchError(f"the synthetic manifest needs at least one prompt, got {count}")
    rng = random.Random(seed)
    (out_dir / "wavs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        seconds = round(rng.uniform(*PROMPT_SECONDS), 2)
        wav = f"wavs/prompt_{i:03d}.wav"
        sf.write(out_dir / wav, synthetic_prompt_wave(seconds, PROMPT_SAMPLE_RATE, seed=seed * 1000 + i),
                 PROMPT_SAMPLE_RATE, subtype="PCM_16")
        prompt_text = chinese_sentence(rng, max(2, round(seconds * CHARACTERS_PER_SECOND)))
        target_text = chinese_sentence(rng, rng.randint(*TARGET_CHARACTERS))
        lines.append(f"bench_{i:03d}|{prompt_text}|{wav}|{target_text}\n")
    manifest = out_dir / "manifest.txt"
    manifest.write_text("".join(lines), encoding="utf-8")
    return manifest


ENGLISH_WORDS = ("the", "voice", "agent", "reads", "every", "chapter", "aloud", "while", "listeners", "wait",
                 "for", "news", "about", "weather", "markets", "and", "sports", "today", "model", "server")


def english_sentence(rng: random.Random) -> str:
    """A plain English sentence of 6-14 words, now and then with a number, a year or a price
    (what the text front-end normalises)."""
    words = [rng.choice(ENGLISH_WORDS) for _ in range(rng.randint(6, 14))]
    extra = rng.choice(["", f" in {rng.randint(1990, 2030)}", f" for ${rng.randint(1, 99)}.{rng.randint(10, 99)}",
                        f" at {rng.randint(2, 98)}%"])
    return " ".join(words).capitalize() + extra + "."


def mixed_long_text(chars: int, seed: int = 0) -> str:
    """About ``chars`` characters of alternating Chinese and English sentences (at least ``chars``,
    at most one sentence more): the long-text workload of the text front-end issue."""
    rng = random.Random(seed)
    parts, length = [], 0
    while length < chars:
        sentence = chinese_sentence(rng, rng.randint(*TARGET_CHARACTERS)) if len(parts) % 2 == 0 \
            else " " + english_sentence(rng) + " "
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts).strip()


def write_long_text_manifest(out_dir: Path, base: Path, chars: int, seed: int = 0) -> Path:
    """One item: the first voice of the manifest ``base`` reading :func:`mixed_long_text`."""
    from ..data import load_manifest

    first = load_manifest(base)[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "long_text.txt"
    manifest.write_text(f"long_{chars}|{first.prompt_text}|{Path(first.prompt_wav).resolve()}|"
                        f"{mixed_long_text(chars, seed)}\n", encoding="utf-8")
    return manifest
