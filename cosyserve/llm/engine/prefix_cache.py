"""Registered prompt prefixes (a voice's ``<|sos|>{prompt_text}``) and their precomputed KV."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedPrefix:
    key: str
    ids: tuple[int, ...]
    kv: torch.Tensor  # KVCache.read() layout: (layers, 2, kv_heads, len(ids), head_dim)


def common_prefix_length(a: tuple[int, ...], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


class PrefixCache:
    """At most ``capacity`` prefixes, least recently used evicted first.

    A request reuses the registered prefix sharing the most leading tokens with its prompt, so a
    tokenizer merge across the prompt-text / target-text boundary costs a token, not the match.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[str, CachedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, ids: list[int], kv: torch.Tensor) -> None:
        self._entries.pop(key, None)
        self._entries[key] = CachedPrefix(key, tuple(ids), kv)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def match(self, prompt_ids: list[int]) -> tuple[CachedPrefix | None, int]:
        """Best prefix and the number of its tokens to reuse (< len(prompt_ids): one must be computed)."""
        best, best_len = None, 0
        for entry in self._entries.values():
            length = min(common_prefix_length(entry.ids, prompt_ids), len(prompt_ids) - 1)
            if length > best_len:
                best, best_len = entry, length
        if best is not None:
            self._entries.move_to_end(best.key)
        return best, best_len
