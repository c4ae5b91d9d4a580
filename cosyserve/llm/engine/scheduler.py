"""Which requests the engine's next step prefills and decodes; the engine (:mod:`.llm_engine`) runs them.

Running requests always occupy slots 0..n-1: a request that leaves is replaced by the last one,
so decode batches are contiguous and need no gather. The scheduler keeps that order and tells the
engine which KV it must move (:class:`SlotMove`). Waiting requests are admitted first come, first
served, while slots are free and the padded prefill batch (longest uncached prompt x requests)
stays within ``max_prefill_tokens``; a request whose prompt starts with a registered prefix is
prefilled from after the cached tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .prefix_cache import CachedPrefix, PrefixCache
from .sequence import Sequence


@dataclass(frozen=True)
class SlotMove:
    """Move the KV of ``length`` positions from slot ``src`` to slot ``dst``."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Admission:
    """A request admitted to slot ``seq.slot``: prefill it from ``cached`` on, after loading ``prefix``."""

    seq: Sequence
    prefix: CachedPrefix | None
    cached: int


class Scheduler:
    """Not thread-safe: used by the engine's stepping thread only."""

    def __init__(self, max_slots: int, max_prefill_tokens: int, prefixes: PrefixCache):
        self.max_slots = max_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.prefixes = prefixes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index == slot

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def take_cancelled(self) -> tuple[list[Sequence], list[SlotMove]]:
        """Remove the cancelled requests, waiting or running; returns them and the KV moves that
        keep the running ones contiguous."""
        cancelled = [seq for seq in self.waiting if seq.cancelled]
        if cancelled:
            self.waiting = deque(seq for seq in self.waiting if not seq.cancelled)
        running = [seq for seq in self.running if seq.cancelled]
        return cancelled + running, self.release(running)

    def admit(self) -> list[Admission]:
        """Move the waiting requests that fit into slots; they are to be prefilled together."""
        admitted: list[Admission] = []
        longest = 0
        while self.waiting and len(self.running) < self.max_slots:
            seq = self.waiting[0]
            prefix, cached = self.prefixes.match(seq.prompt_ids)
            longest_if_added = max(longest, len(seq.prompt_ids) - cached)
            if admitted and longest_if_added * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            longest = longest_if_added
            seq.slot = len(self.running)
            self.running.append(seq)
            admitted.append(Admission(seq, prefix, cached))
        return admitted

    def release(self, seqs: list[Sequence]) -> list[SlotMove]:
        """Free the slots of ``seqs`` (running), moving the last running requests into the holes;
        returns the moves, to be applied in order."""
        moves = []
        for seq in sorted(seqs, key=lambda s: s.slot, reverse=True):
            last = self.running.pop()
            if last is not seq:
                moves.append(SlotMove(last.slot, seq.slot, last.position + 1))
                last.slot = seq.slot
                self.running[seq.slot] = last
            seq.slot = -1
        return moves

    def take_all(self) -> list[Sequence]:
        """Remove every request, running then waiting (after a failed step)."""
        seqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        return seqs
