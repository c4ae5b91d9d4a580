"""Rotary position embedding (Qwen2 / HF "default" rope, half-split layout)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions 0..max_positions-1.

    HF applies ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. That equals
    ``x * cos + cat(x2, x1) * cat(-sin, sin)``, so the sign lives in the table and the rotation is a
    roll by half the head size: two fused ops per call instead of five.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        # Computed in float32 exactly as HF does, then cast to the activation dtype as HF does.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        self.half = head_dim // 2
        self.register_buffer("cos", torch.cat([cos, cos], -1).to(device, dtype), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], -1).to(device, dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for ``positions``, shaped (tokens, 1, head_dim); shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: (tokens, heads, head_dim) rotated by the looked-up (cos, sin)."""
        cos, sin = cos_sin
        return torch.addcmul(x * cos, x.roll(self.half, dims=-1), sin)
