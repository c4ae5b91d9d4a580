"""When to hand speech tokens to token2wav while the LLM is still generating: the chunk schedules
of both token2wav kinds (torch-free, below token2wav and the pipeline that uses them).

**CosyVoice2** (:class:`ChunkScheduler`, the reference BLS's): a chunk is emitted whenever
``pending >= hop + lookahead`` tokens are waiting: the first hop is 15 tokens (+3 look-ahead
tokens the flow needs to see), then

* ``exponential``: hops of 25 * 2**i tokens (25, 50, 100, ...): the first chunk arrives fast
  and later chunks are larger, so the vocoder keeps ahead of playback with fewer calls;
* ``time_based``: the hop adapts to how far synthesis is ahead of real time: with a large
  playback buffer it grows to swallow everything pending, with a small one it stays at the
  minimum hop so audio keeps flowing.

Each chunk passes every token so far (the flow recomputes from ``token_offset``); the final call
always passes every token with ``finalize=True``.

**DiT** (:class:`StepAudio2ChunkScheduler`, NVIDIA's ``cosyvoice2_dit`` BLS; the engine's Step-Audio2
kind): each chunk carries only the *new* tokens [offset, offset+hop+3), sent whenever hop+3 are
pending; hop = 15, then 25·2^j (``exponential``) or stays 15 (``equal``).

What a speech token is in audio is defined here, the lowest layer, for every layer above:
:data:`TOKEN_RATE`, :data:`OUTPUT_SAMPLE_RATE` and :data:`SAMPLES_PER_TOKEN`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import InvalidInputError

STRATEGIES = ("exponential", "time_based")  # CosyVoice2's
TOKEN_RATE = 25  # speech tokens per second of audio
OUTPUT_SAMPLE_RATE = 24000  # Hz of the audio every model returns (CosyVoice2, CosyVoice3, Step-Audio2)
SAMPLES_PER_TOKEN = OUTPUT_SAMPLE_RATE // TOKEN_RATE  # 960: two mel frames of 480 samples


@dataclass
class Chunk:
    """One token2wav call: tokens[:num_tokens] with the first ``token_offset`` already voiced."""

    num_tokens: int
    token_offset: int
    finalize: bool


@dataclass
class ChunkScheduler:
    strategy: str = "exponential"
    first_hop: int = 15
    lookahead: int = 3
    token_rate: int = TOKEN_RATE
    clock: callable = field(default=time.monotonic, repr=False)
    token_offset: int = 0
    chunk_index: int = 0
    hop: int = field(init=False)
    _start: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidInputError(f"unknown streaming strategy {self.strategy!r}; choose one of {STRATEGIES}")
        if self.first_hop <= 0 or self.lookahead < 0:
            raise InvalidInputError("first_hop must be > 0 and lookahead >= 0")
        self.hop = self.first_hop

    def next_chunk(self, available: int) -> Chunk | None:
        """The chunk to synthesise now that ``available`` tokens exist, or None to wait."""
        if self._start is None:
            self._start = self.clock()
        if available - self.token_offset < self.hop + self.lookahead:
            return None
        chunk = Chunk(self.token_offset + self.hop + self.lookahead, self.token_offset, False)
        self.token_offset += self.hop
        self._advance(available)
        return chunk

    def final_chunk(self, available: int) -> Chunk:
        """The last call: every token, finalize=True (may voice zero new tokens)."""
        return Chunk(available, self.token_offset, True)

    def _advance(self, available: int) -> None:
        if self.strategy == "exponential":
            self.hop = self.token_rate * 2 ** self.chunk_index
        else:
            self.hop = self._time_based_hop(available)
        self.chunk_index += 1

    def _time_based_hop(self, available: int) -> int:
        elapsed = self.clock() - self._start
        audio_ahead = self.token_offset / self.token_rate - elapsed  # seconds buffered at the client
        per_chunk = elapsed / (self.chunk_index + 1)
        if self.chunk_index == 0 or per_chunk <= 0:
            return self.first_hop
        pending = available - self.token_offset
        headroom = audio_ahead / per_chunk  # how many chunk computations the buffer covers
        if headroom > 4:
            hop = (pending // self.first_hop + 1) * self.first_hop
        elif headroom > 2:
            hop = (pending // self.first_hop) * self.first_hop
        else:
            hop = self.first_hop
        return max(self.first_hop, hop)


def plan_chunks(total_tokens: int, strategy: str = "exponential", first_hop: int = 15, lookahead: int = 3) -> list[Chunk]:
    """The chunks an ``exponential`` stream produces when all tokens arrive before synthesis keeps up.

    Used by tests and benchmarks to know the expected chunk count for a token count.
    """
    scheduler = ChunkScheduler(strategy, first_hop, lookahead)
    chunks = []
    while (chunk := scheduler.next_chunk(total_tokens)) is not None:
        chunks.append(chunk)
    chunks.append(scheduler.final_chunk(total_tokens))
    return chunks


# ---------------------------------------------------------------------------------- Step-Audio2
DIT_STRATEGIES = ("exponential", "equal")
DIT_FIRST_HOP = 15
EXPONENTIAL_BASE_HOP = 25


@dataclass(frozen=True)
class TokenChunk:
    """Tokens [start, end) of the request's speech-token sequence; ``last`` = finalize."""

    start: int
    end: int
    last: bool


def step_audio2_chunk_hop(strategy: str, chunks_sent: int, first_hop: int = DIT_FIRST_HOP) -> int:
    """New tokens voiced by the next chunk after ``chunks_sent`` chunks (§3.7 of the spec)."""
    if strategy not in DIT_STRATEGIES:
        raise InvalidInputError(f"unknown chunk strategy {strategy!r}; choose one of {DIT_STRATEGIES}")
    if chunks_sent == 0 or strategy == "equal":
        return first_hop
    return EXPONENTIAL_BASE_HOP * 2 ** (chunks_sent - 1)


class StepAudio2ChunkScheduler:
    """Incremental chunking of a growing token stream (a Step-Audio2 chunk voices only its new tokens).

    :meth:`next_chunk` / :meth:`final_chunk` are :class:`ChunkScheduler`'s interface, which the
    engine drives: chunk ``k`` is tokens ``[:num_tokens]`` of which the first ``token_offset``
    were voiced before, so its new tokens are ``[token_offset, num_tokens)``.
    """

    def __init__(self, strategy: str = "exponential", lookahead: int = 3, first_hop: int = DIT_FIRST_HOP):
        step_audio2_chunk_hop(strategy, 0)  # validates the strategy
        self.strategy, self.lookahead, self.first_hop = strategy, lookahead, first_hop
        self.offset = 0
        self.chunks_sent = 0

    def next_chunk(self, available: int) -> Chunk | None:
        """The chunk to send now that ``available`` tokens exist, or None to wait."""
        hop = step_audio2_chunk_hop(self.strategy, self.chunks_sent, self.first_hop)
        if available - self.offset < hop + self.lookahead:
            return None
        chunk = Chunk(self.offset + hop + self.lookahead, self.offset, False)
        self.offset += hop
        self.chunks_sent += 1
        return chunk

    def final_chunk(self, available: int) -> Chunk:
        """The last chunk once the token stream has ended: the tokens from the offset on."""
        return Chunk(available, self.offset, True)

    def ready(self, available: int) -> list[TokenChunk]:
        """Every chunk that can be sent now that ``available`` tokens exist."""
        chunks = []
        while (chunk := self.next_chunk(available)) is not None:
            chunks.append(TokenChunk(chunk.token_offset, chunk.num_tokens, False))
        return chunks

    def finish(self, total: int) -> TokenChunk:
        """The last chunk once the token stream has ended: [offset, total)."""
        return TokenChunk(self.offset, total, True)


def plan_stream_chunks(total_tokens: int, strategy: str = "exponential", lookahead: int = 3) -> list[TokenChunk]:
    """The chunks of a stream whose ``total_tokens`` are all known in advance."""
    scheduler = StepAudio2ChunkScheduler(strategy, lookahead)
    return scheduler.ready(total_tokens) + [scheduler.finish(total_tokens)]
