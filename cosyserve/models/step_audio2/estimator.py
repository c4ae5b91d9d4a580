"""DiT velocity estimator of the Step-Audio-2-mini flow (upstream ``decoder_dit.DiT``).

A stack of adaLN-Zero transformer blocks, each with three residual branches — attention,
causal convolution, MLP — modulated by the flow-matching time embedding. There is no
positional encoding: order information only enters through the causal convolutions.

Two entry points:

* :meth:`DiT.forward` — the whole sequence at once, with a key-padding mask.
* :meth:`DiT.forward_chunk` — one streaming chunk. Its queries attend to every cached frame
  and every frame of the chunk (no mask); per block it takes and returns a conv cache
  ``(B, 2*hidden, 2)`` = [last 2 inputs of conv 1 ‖ last 2 inputs of conv 2] and an attention
  cache ``(B, heads, T, 2*head_dim)`` = [K (after k_norm) ‖ V], with the chunk's frames placed
  **before** the old ones, as upstream does (the order matters for cache trimming only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import StepAudio2EstimatorConfig

CONV_KERNEL = 3  # both causal convolutions of a block
TIME_FREQ_DIM = 256  # width of the sinusoidal time features
TIME_SCALE = 1000.0  # t in [0, 1] is scaled to the DiT's usual timestep range


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h·(1 + scale) + shift, in one pass over h (one rounding, where the reference's two operators
    round twice: equal within the working dtype's precision)."""
    return torch.addcmul(shift, h, 1 + scale)


class TimestepEmbedder(nn.Module):
    """t -> [cos(s·f) ‖ sin(s·f)] with s = 1000·t, then Linear, SiLU, Linear."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = (TIME_SCALE * t).float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class DitAttention(nn.Module):
    """Multi-head attention with per-head LayerNorm on queries and keys (QK-norm)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int):
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.to_q = nn.Linear(hidden_size, inner)
        self.to_k = nn.Linear(hidden_size, inner)
        self.to_v = nn.Linear(hidden_size, inner)
        self.q_norm = nn.LayerNorm(head_dim, eps=1e-5)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-5)
        self.proj = nn.Linear(inner, hidden_size)

    def _heads(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        return h.view(b, t, self.num_heads, self.head_dim)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None = None, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, hidden); key_mask (B, 1, 1, T_keys) bool; cache (B, H, T_prev, 2*D).

        Returns the output and the keys/values seen, [new ‖ cache] as (B, H, T + T_prev, 2*D).
        """
        q = self.q_norm(self._heads(self.to_q(x))).transpose(1, 2)
        k = self.k_norm(self._heads(self.to_k(x))).transpose(1, 2)
        v = self._heads(self.to_v(x)).transpose(1, 2)
        kv = torch.cat([k, v], dim=-1)
        if cache is not None and cache.shape[2] > 0:
            kv = torch.cat([kv, cache], dim=2)
            k, v = kv.split(self.head_dim, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        b, _, t, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, t, -1)), kv


class CausalConvBlock(nn.Module):
    """Causal Conv1d -> LayerNorm -> Mish -> causal Conv1d, on (B, T, C) sequences."""

    def __init__(self, channels: int):
        super().__init__()
        # Keys "1", "3", "6" are the positions of these layers in upstream's nn.Sequential, so
        # the released state dict (conv.block.1.weight, ...) loads as is.
        self.block = nn.ModuleDict({
            "1": nn.Conv1d(channels, channels, CONV_KERNEL),
            "3": nn.LayerNorm(channels, eps=1e-5),
            "6": nn.Conv1d(channels, channels, CONV_KERNEL),
        })

    @staticmethod
    def _causal_conv(conv: nn.Conv1d, h: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, C, T); history = the previous (kernel-1) input frames, zeros when None."""
        if history is None:
            h = F.pad(h, (CONV_KERNEL - 1, 0))
        else:
            h = torch.cat([history, h], dim=2)
        return conv(h), h[:, :, h.shape[2] - (CONV_KERNEL - 1):]

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C); cache (B, 2C, kernel-1). Returns (B, T, C) and the new cache."""
        hist1, hist2 = (None, None) if cache is None else cache.chunk(2, dim=1)
        h, new1 = self._causal_conv(self.block["1"], x.transpose(1, 2), hist1)
        h = F.mish(self.block["3"](h.transpose(1, 2))).transpose(1, 2)
        h, new2 = self._causal_conv(self.block["6"], h, hist2)
        return h.transpose(1, 2), torch.cat([new1, new2], dim=1)


class Mlp(nn.Module):
    def __init__(self, hidden_size: int, mlp_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DitBlock(nn.Module):
    """x += gate·Attn(mod(norm1 x)); x += gate·Conv(mod(norm3 x)); x += gate·MLP(mod(norm2 x))."""

    def __init__(self, cfg: StepAudio2EstimatorConfig):
        super().__init__()
        hidden = cfg.hidden_size
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.norm3 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = DitAttention(hidden, cfg.num_heads, cfg.head_dim)
        self.mlp = Mlp(hidden, cfg.mlp_hidden)
        self.conv = CausalConvBlock(hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 9 * hidden))

    def forward(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        cnn_cache: torch.Tensor | None = None,
        att_cache: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        attn_out, new_att = self.attn(modulate(self.norm1(x), shift_msa, scale_msa), key_mask, att_cache)
        x = x + gate_msa * attn_out
        conv_out, new_cnn = self.conv(modulate(self.norm3(x), shift_conv, scale_conv), cnn_cache)
        x = x + gate_conv * conv_out
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, new_cnn, new_att


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = nn.Linear(hidden_size, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: StepAudio2EstimatorConfig):
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden_size)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(DitBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def empty_caches(self, batch: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv caches (depth, B, 2*hidden, 2) and attention caches with 0 frames
        (depth, B, heads, 0, 2*head_dim), derived from the config (upstream hard-codes them)."""
        cfg = self.cfg
        cnn = torch.zeros(cfg.depth, batch, 2 * cfg.hidden_size, CONV_KERNEL - 1, device=device, dtype=dtype)
        att = torch.zeros(cfg.depth, batch, cfg.num_heads, 0, 2 * cfg.head_dim, device=device, dtype=dtype)
        return cnn, att

    def _inputs(self, x, mu, t, spks, cond) -> tuple[torch.Tensor, torch.Tensor]:
        """Channels-first (B, 80, T) inputs -> hidden sequence (B, T, hidden) and c (B, 1, hidden)."""
        c = self.t_embedder(t).unsqueeze(1)
        packed = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)
        return self.in_proj(packed.transpose(1, 2)), c

    def forward(self, x, mask, mu, t, spks, cond) -> torch.Tensor:
        """Full sequence: x, mu, cond (B, 80, T); mask (B, 1, T) (1 = valid); t (B,); spks (B, 80).
        Returns the velocity (B, 80, T); padded frames carry no meaning."""
        h, c = self._inputs(x, mu, t, spks, cond)
        key_mask = mask.bool().unsqueeze(1)  # (B, 1, 1, T)
        for block in self.blocks:
            h, _, _ = block(h, c, key_mask=key_mask)
        return self.final_layer(h, c).transpose(1, 2)

    def forward_chunk(
        self, x, mu, t, spks, cond, cnn_cache: torch.Tensor, att_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One streaming chunk. cnn_cache (depth, B, 2*hidden, 2); att_cache (depth, B, heads,
        T_prev, 2*head_dim), T_prev may be 0. Returns (velocity (B, 80, T), new cnn cache,
        new att cache (depth, B, heads, T + T_prev, 2*head_dim), new frames first)."""
        h, c = self._inputs(x, mu, t, spks, cond)
        new_cnn, new_att = [], []
        for i, block in enumerate(self.blocks):
            h, cnn_i, att_i = block(h, c, cnn_cache=cnn_cache[i], att_cache=att_cache[i])
            new_cnn.append(cnn_i)
            new_att.append(att_i)
        return self.final_layer(h, c).transpose(1, 2), torch.stack(new_cnn), torch.stack(new_att)
