"""Fixed output lengths for benchmarks on random weights (torch-free: the gRPC client uses it).

A random-weight LLM rarely samples the end of speech, so benchmarks fix how long each
utterance is: exactly ``round(tokens_per_second x seconds)`` speech tokens (the request's
``max_tokens = min_tokens``). The seconds are one value for every utterance, or a seeded
uniform draw per utterance in dataset order, so ``offline_inference.py`` and ``client_grpc.py``
given the same items, range and seed produce the same lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .errors import InvalidInputError
from .pipeline.schedule import TOKEN_RATE


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
