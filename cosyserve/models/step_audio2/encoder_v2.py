"""Up-sampling Conformer encoder of the Step-Audio2 flow (upstream ``UpsampleConformerEncoderV2``).

Same layers as the CosyVoice2 encoder (reused from :mod:`cosyserve.models.flow.encoder`):
``embed`` -> ``pre_lookahead_layer`` -> ``encoders`` -> ``up_layer`` (x2) -> ``up_embed`` ->
``up_encoders`` -> ``after_norm``. What V2 adds is a cached chunk mode for streaming:

* the pre-lookahead conv keeps its last 2 activations, the up-sampling conv its last 4
  interpolated frames (:class:`EncoderCache`);
* attention keeps raw keys/values of every position seen so far (never trimmed); a chunk's
  queries are the last positions of [cache ‖ chunk], attend to all of it without a mask, and
  the relative-position term is indexed from the queries' absolute positions.

The full-sequence mode takes a key-padding mask. Unlike upstream, padded token positions are
zeroed *after* the input layer, so the pre-lookahead conv of a shorter item sees the same zeros
as when that item runs alone: batching never changes an item's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.errors import InvalidInputError
from cosyserve.models.flow.encoder import (
    ConformerEncoderLayer,
    LinearInput,
    PreLookaheadLayer,
    RelPositionMultiHeadedAttention,
    Upsample1D,
    relative_position_table,
)

from .config import StepAudio2EncoderConfig


def relative_shift_for_last_queries(scores: torch.Tensor, key_len: int) -> torch.Tensor:
    """(B, H, Tq, 2Tk-1) scores against the table rows r = Tk-1 … -(Tk-1) -> (B, H, Tq, Tk),
    for queries at the last Tq of Tk positions: [i, j] = row of relative position pos(i) − j."""
    b, h, tq, _ = scores.shape
    rows = torch.arange(tq, device=scores.device)[:, None]
    cols = torch.arange(key_len, device=scores.device)[None, :]
    # row index = (Tk-1) - ((Tk-Tq+i) - j) = (Tq-1) - i + j
    return scores.gather(-1, ((tq - 1) - rows + cols).expand(b, h, tq, key_len))


class CachedRelPositionAttention(RelPositionMultiHeadedAttention):
    """Relative-position attention whose keys/values may start with cached earlier positions."""

    def forward_cached(
        self, x: torch.Tensor, pos_table: torch.Tensor, mask: torch.Tensor | None, cache: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, Tq, D); cache (B, H, Tc, 2*d_k) = [K ‖ V] of the Tc preceding positions;
        pos_table for Tk = Tc + Tq keys; mask (B, 1 or Tq, Tk) bool or None.
        Returns the output and [cache ‖ new] keys/values (B, H, Tk, 2*d_k)."""
        b, tq, _ = x.shape
        q = self.linear_q(x).view(b, tq, self.heads, self.d_k)
        k = self.linear_k(x).view(b, tq, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, tq, self.heads, self.d_k).transpose(1, 2)
        kv = torch.cat([k, v], dim=-1)
        if cache is not None and cache.shape[2] > 0:
            kv = torch.cat([cache, kv], dim=2)
            k, v = kv.split(self.d_k, dim=-1)
        key_len = kv.shape[2]
        p = self.linear_pos(pos_table).view(pos_table.size(0), -1, self.heads, self.d_k).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        scores = (content + relative_shift_for_last_queries(position, key_len)) / math.sqrt(self.d_k)
        if mask is None:
            attn = torch.softmax(scores, dim=-1)
        else:
            hidden = ~mask.unsqueeze(1)
            attn = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, tq, self.heads * self.d_k)
        return self.linear_out(out), kv


class CachedConformerLayer(ConformerEncoderLayer):
    def __init__(self, dim: int, heads: int, linear_units: int) -> None:
        super().__init__(dim, heads, linear_units)
        self.self_attn = CachedRelPositionAttention(dim, heads)

    def forward_cached(self, x, pos_table, mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        attn_out, kv = self.self_attn.forward_cached(self.norm_mha(x), pos_table, mask, cache)
        x = x + attn_out
        return x + self.feed_forward(self.norm_ff(x)), kv


@dataclass
class EncoderCache:
    """Streaming state of the encoder for one request (batch 1).

    lookahead (1, D, 2): last 2 outputs of the pre-lookahead conv1 (after leaky ReLU);
    upsample (1, D, 2*up_rate): last interpolated frames entering the up-sampling conv;
    token_att (num_blocks, 1, H, K, 2*d_k), frame_att (num_up_blocks, 1, H, up_rate*K, 2*d_k):
    raw keys ‖ values of every position so far, oldest first.
    """

    lookahead: torch.Tensor
    upsample: torch.Tensor
    token_att: torch.Tensor
    frame_att: torch.Tensor

    @property
    def frames(self) -> int:
        return self.frame_att.shape[3]

    def to_reference(self, up_rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream layout: cnn (1, D, 6) = [lookahead ‖ upsample]; att (L1+L2, 1, H, r*K, 2*d_k)
        with the token-level layers tiled r times along time to the frame length."""
        cnn = torch.cat([self.lookahead, self.upsample], dim=2)
        return cnn, torch.cat([torch.cat([self.token_att] * up_rate, dim=3), self.frame_att], dim=0)


class UpsampleConformerEncoderV2(nn.Module):
    def __init__(self, cfg: StepAudio2EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.output_size
        # Construction order = upstream's, so state-dict key order matches the released flow.pt.
        self.embed = LinearInput(cfg.input_size, dim)
        self.after_norm = nn.LayerNorm(dim, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(dim, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            CachedConformerLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks))
        self.up_layer = Upsample1D(dim, cfg.up_rate)
        self.up_embed = LinearInput(dim, dim)
        self.up_encoders = nn.ModuleList(
            CachedConformerLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_up_blocks))

    # ------------------------------------------------------------------ full sequence
    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xs (B, T, input_size) token embeddings, xs_lens (B,) -> (B, r*T, D), frame mask (B, 1, r*T)."""
        r = self.cfg.up_rate
        token_mask = (torch.arange(xs.shape[1], device=xs.device)[None] < xs_lens[:, None]).unsqueeze(1)
        x = self.embed(xs) * token_mask.transpose(1, 2)  # true zeros after each item, as when alone
        x = self.pre_lookahead_layer(x, None)
        x = self._stack(self.encoders, x, token_mask)
        x = self.up_embed(self.up_layer(x))
        frame_mask = token_mask.repeat_interleave(r, dim=2)
        x = self._stack(self.up_encoders, x, frame_mask)
        return self.after_norm(x), frame_mask

    @staticmethod
    def _stack(layers: nn.ModuleList, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        pos_table = relative_position_table(x.shape[1], x.shape[2], x.device, x.dtype)
        for layer in layers:
            x, _ = layer.forward_cached(x, pos_table, key_mask, None)
        return x

    # ------------------------------------------------------------------ streaming
    def empty_cache(self, device: torch.device, dtype: torch.dtype) -> EncoderCache:
        cfg = self.cfg
        d, h, dk = cfg.output_size, cfg.attention_heads, cfg.head_dim
        zeros = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        return EncoderCache(zeros(1, d, 2), zeros(1, d, 2 * cfg.up_rate),
                            zeros(cfg.num_blocks, 1, h, 0, 2 * dk), zeros(cfg.num_up_blocks, 1, h, 0, 2 * dk))

    def forward_chunk(self, xs: torch.Tensor, last_chunk: bool, cache: EncoderCache) -> tuple[torch.Tensor, EncoderCache]:
        """xs (1, m, input_size): the chunk's token embeddings, ending with ``pre_lookahead_len``
        look-ahead tokens unless ``last_chunk`` (then zeros stand in for them).
        Returns (1, r*m', D) with m' = m − lookahead (or m when last) and the new cache."""
        cfg = self.cfg
        lookahead, r = cfg.pre_lookahead_len, cfg.up_rate
        x = self.embed(xs)
        if last_chunk:
            x = F.pad(x, (0, 0, 0, lookahead))
        new_tokens = x.shape[1] - lookahead
        if new_tokens <= 0:
            raise InvalidInputError(
                f"a chunk that is not the last needs more than {lookahead} tokens (its last {lookahead} are "
                f"look-ahead); got {xs.shape[1]}")
        total_frames = cache.frames + r * new_tokens
        if total_frames > cfg.max_positions:
            raise InvalidInputError(
                f"stream too long: {total_frames} mel frames (prompt included) exceed the encoder's "
                f"{cfg.max_positions}-position limit")

        # Pre-lookahead: conv1 sees real look-ahead, conv2 continues from the cached activations.
        layer = self.pre_lookahead_layer
        act = torch.cat([cache.lookahead, F.leaky_relu(layer.conv1(x.transpose(1, 2)))], dim=2)
        x = layer.conv2(act).transpose(1, 2) + x[:, :new_tokens]

        x, token_att = self._stack_cached(self.encoders, x, cache.token_att)

        # Up-sampling: nearest x r, then the causal conv continues from the cached frames.
        up = torch.cat([cache.upsample, x.transpose(1, 2).repeat_interleave(r, dim=2)], dim=2)
        x = self.up_embed(self.up_layer.conv(up).transpose(1, 2))

        x, frame_att = self._stack_cached(self.up_encoders, x, cache.frame_att)
        new_cache = EncoderCache(act[:, :, -2:], up[:, :, -2 * r:], token_att, frame_att)
        return self.after_norm(x), new_cache

    @staticmethod
    def _stack_cached(layers: nn.ModuleList, x: torch.Tensor, caches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_len = caches.shape[3] + x.shape[1]
        pos_table = relative_position_table(key_len, x.shape[2], x.device, x.dtype)
        new_caches = []
        for layer, cache in zip(layers, caches):
            x, kv = layer.forward_cached(x, pos_table, None, cache)
            new_caches.append(kv)
        return x, torch.stack(new_caches)
