"""Preallocated slot KV cache: one contiguous tensor for every layer, slot and position."""

from __future__ import annotations

import torch

from ..models.config import Qwen2Config


class KVCache:
    """``data[layer, 0|1, slot, kv_head, position, head_dim]`` (0 = keys, 1 = values).

    Slot ``num_slots`` is a spare that receives the writes of prefill padding tokens and holds
    prefixes while their KV is computed; requests use slots ``0..num_slots-1``.
    """

    def __init__(self, config: Qwen2Config, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype):
        self.num_slots, self.max_len = num_slots, max_len
        self.spare_slot = num_slots
        self.data = torch.zeros(config.num_layers, 2, num_slots + 1, config.num_kv_heads, max_len,
                                config.head_dim, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_token(config: Qwen2Config, dtype: torch.dtype) -> int:
        return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    def move(self, src: int, dst: int, length: int) -> None:
        self.data[:, :, dst, :, :length] = self.data[:, :, src, :, :length]

    def read(self, slot: int, length: int) -> torch.Tensor:
        """A copy of the first ``length`` positions of ``slot``: (layers, 2, kv_heads, length, head_dim)."""
        return self.data[:, :, slot, :, :length].clone()

    def write(self, slot: int, kv: torch.Tensor, length: int) -> None:
        """Store the first ``length`` positions of ``kv`` (as returned by :meth:`read`) in ``slot``."""
        self.data[:, :, slot, :, :length] = kv[:, :, :, :length]
