"""Synthesis items and their fixed lengths, torch-free: read by the clients (``client_grpc.py``,
``client_http.py``), ``offline_inference.py`` and the benchmarks alike.

Items come from a manifest file or a HuggingFace dataset, and may be repeated to a request count.

Fixed output lengths (:class:`FixedLength`) are for benchmarks on random weights: a random-weight
LLM rarely samples the end of speech, so each utterance gets exactly ``round(tokens_per_second x
seconds)`` speech tokens (the request's ``max_tokens = min_tokens``). The seconds are one value for
every utterance, or a seeded uniform draw per utterance in dataset order, so
``offline_inference.py`` and ``client_grpc.py`` given the same items, range and seed produce the
same lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import InvalidInputError
from .schedule import TOKEN_RATE


@dataclass(frozen=True)
class FixedLength:
    """Force every utterance to ``round(tokens_per_second x seconds)`` speech tokens.

    ``seconds``: None = estimated elsewhere (from the text, by the offline pipeline); (s,) = s
    for all; (lo, hi) = uniform draw per utterance (``random.Random(seed)``, in dataset order).
    """

    tokens_per_second: float = TOKEN_RATE
    seconds: tuple[float, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tokens_per_second > 0:
            raise InvalidInputError(f"tokens per second must be > 0, got {self.tokens_per_second}")
        if self.seconds is not None and (len(self.seconds) not in (1, 2) or min(self.seconds) <= 0
                                         or self.seconds[0] > self.seconds[-1]):
            raise InvalidInputError(f"fixed output seconds must be one positive value or lo <= hi, got {self.seconds}")

    def draws(self, count: int) -> list[float | None]:
        """Per utterance: the seconds to generate, None where they are to be estimated from the text."""
        if self.seconds is None:
            return [None] * count
        rng = random.Random(self.seed)
        return [self.seconds[0] if len(self.seconds) == 1 else rng.uniform(*self.seconds) for _ in range(count)]

    def tokens(self, seconds: float) -> int:
        """Speech tokens for ``seconds`` of audio (at least one)."""
        return max(1, round(self.tokens_per_second * seconds))


@dataclass
class Utterance:
    """One synthesis request: ``reference_audio`` is a file path or ``{"array", "sampling_rate"}``.

    ``speech_tokens``: make exactly this many speech tokens (sent as ``max_tokens = min_tokens``);
    None leaves the lengths to the server.
    """

    id: str
    reference_text: str
    reference_audio: Any
    target_text: str
    speech_tokens: int | None = None


def load_manifest(path: str | Path) -> list[Utterance]:
    """Read ``utt|prompt_text|prompt_wav|target_text`` lines (blank lines skipped).

    ``utt`` may be a path: its stem is the id (and the output wav's name). Relative
    ``prompt_wav`` paths are relative to the manifest's directory.
    """
    path = Path(path)
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 4:
            raise InvalidInputError(
                f"{path}:{number}: expected 4 '|'-separated fields utt|prompt_text|prompt_wav|target_text, "
                f"got {len(fields)}"
            )
        utt, prompt_text, prompt_wav, target_text = (f.strip() for f in fields)
        items.append(Utterance(Path(utt).stem, prompt_text, str(path.parent / prompt_wav), target_text))
    return _checked_unique(items, str(path))


def load_hf_dataset(name: str, split: str) -> list[Utterance]:
    """Items of a HuggingFace dataset with ``id, prompt_text, prompt_audio, target_text`` columns
    (e.g. ``yuekai/seed_tts_cosy2``)."""
    try:
        import datasets
    except ImportError as e:
        raise InvalidInputError(
            f"--huggingface-dataset needs the `datasets` package ({e}); pip install datasets, "
            "or pass --manifest-path"
        ) from None
    dataset = datasets.load_dataset(name, split=split, trust_remote_code=True)
    items = [Utterance(str(row["id"]), row["prompt_text"], row["prompt_audio"], row["target_text"]) for row in dataset]
    return _checked_unique(items, f"{name}[{split}]")


def _checked_unique(items: list[Utterance], source: str) -> list[Utterance]:
    seen = set()
    for item in items:
        if item.id in seen:  # outputs are written as <id>.wav: a repeat would overwrite one
            raise InvalidInputError(f"{source}: utterance id {item.id!r} appears more than once")
        seen.add(item.id)
    if not items:
        raise InvalidInputError(f"{source}: no utterances")
    return items


def repeat_items(items: Sequence[Utterance], num_requests: int) -> list[Utterance]:
    """``num_requests`` requests cycling through ``items``; the k-th pass's ids get ``_r<k>``
    (k from 0), so every request has its own id (and output wav)."""
    if num_requests < 1:
        raise InvalidInputError(f"number of requests must be >= 1, got {num_requests}")
    return [replace(items[i % len(items)], id=f"{items[i % len(items)].id}_r{i // len(items)}")
            for i in range(num_requests)]


def with_fixed_lengths(items: Sequence[Utterance], fixed: FixedLength) -> list[Utterance]:
    """``items`` with ``speech_tokens`` from ``fixed``'s draws, one per item in order."""
    if fixed.seconds is None:
        raise InvalidInputError("fixed lengths for requests need the seconds (one value or lo hi)")
    return [replace(item, speech_tokens=fixed.tokens(seconds)) for item, seconds in zip(items, fixed.draws(len(items)))]


def split_round_robin(items: Sequence[Utterance], num_tasks: int) -> list[list[Utterance]]:
    """Deal ``items`` to ``min(num_tasks, len(items))`` tasks (each runs its share in order)."""
    if num_tasks < 1:
        raise InvalidInputError(f"number of tasks must be >= 1, got {num_tasks}")
    num_tasks = min(num_tasks, len(items))
    return [list(items[i::num_tasks]) for i in range(num_tasks)]


def load_reference_audio(source: Any) -> np.ndarray:
    """The prompt as the server takes it: mono float32 at 16 kHz.

    ``source`` is a file path, ``{"array", "sampling_rate"}`` (HuggingFace datasets < 4) or an
    audio decoder with ``get_all_samples()`` (datasets >= 4). Checked and resampled by
    :mod:`cosyserve.audio.io` with the server's rules (rate >= 16 kHz, 0.5-30 s, not silent),
    so a bad prompt fails here with InvalidInputError instead of at the server.
    """
    from .audio.io import prompt_audio_from_array, read_audio  # torch: imported only when needed

    if hasattr(source, "get_all_samples"):
        samples = source.get_all_samples()
        wav, rate = samples.data, samples.sample_rate  # (channels, samples)
    elif isinstance(source, Mapping):
        wav, rate = np.asarray(source["array"], dtype=np.float32), int(source["sampling_rate"])
    else:
        wav, rate = read_audio(source)
    return prompt_audio_from_array(wav, rate).wav16.numpy()
