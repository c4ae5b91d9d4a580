"""Up-sampling conformer encoder of the CosyVoice2 flow (token embeddings -> 2x frame rate).

Layout (module names follow upstream so checkpoints load strictly):
``embed`` -> ``pre_lookahead_layer`` -> ``encoders`` (conformer layers, relative-position
attention) -> ``up_layer`` (x2 in time) -> ``up_embed`` -> ``up_encoders`` -> ``after_norm``.
Only the pre-norm, no-macaron, no-convolution-module conformer variant used by CosyVoice2 exists
here. Masks are boolean ``(B or 1, T_query, T_key)`` tensors (True = visible) or None (all visible).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import NUM_UP_BLOCKS, UP_STRIDE, EncoderConfig
from .masks import chunk_mask

# LayerNorm eps inside conformer layers (upstream passes 1e-12 there, default 1e-5 elsewhere).
CONFORMER_NORM_EPS = 1e-12


def relative_position_table(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal table (1, 2*length-1, dim) for relative positions length-1, ..., 0, ..., -(length-1).

    Computed in float32 like upstream (sin(r*w) in even columns, cos(r*w) in odd ones).
    """
    positions = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)
    freqs = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / dim))
    angles = positions[:, None] * freqs[None, :]
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).view(1, 2 * length - 1, dim)
    return table.to(dtype)


def relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """(B, H, T, 2T-1) scores indexed by table row -> (B, H, T, T) with [i, j] = row of position i-j."""
    b, h, t, _ = scores.shape
    rows = torch.arange(t, device=scores.device)
    index = (t - 1) - rows[:, None] + rows[None, :]
    return scores.gather(-1, index.expand(b, h, t, t))


class RelPositionMultiHeadedAttention(nn.Module):
    """Transformer-XL style attention with learned content (u) and position (v) biases."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.d_k = heads, dim // heads
        # Registered before the linears so the state-dict order matches upstream's.
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.d_k))
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.heads, self.d_k)
        k = self.linear_k(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_table).view(pos_table.size(0), -1, self.heads, self.d_k).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = relative_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (content + position) / math.sqrt(self.d_k)
        if mask is None:
            attn = torch.softmax(scores, dim=-1)
        else:
            hidden = ~mask.unsqueeze(1)  # (B, 1, Tq, Tk), broadcast over heads
            attn = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.heads * self.d_k)
        return self.linear_out(out)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm layer: x += MHA(LN(x)); x += FFN(LN(x))."""

    def __init__(self, dim: int, heads: int, linear_units: int) -> None:
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(dim, heads)
        self.feed_forward = PositionwiseFeedForward(dim, linear_units)
        self.norm_ff = nn.LayerNorm(dim, eps=CONFORMER_NORM_EPS)
        self.norm_mha = nn.LayerNorm(dim, eps=CONFORMER_NORM_EPS)

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos_table, mask)
        return x + self.feed_forward(self.norm_ff(x))


class LinearInput(nn.Module):
    """Linear -> LayerNorm -> scale by sqrt(dim) (upstream ``LinearNoSubsampling`` + positional scale)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(in_dim, dim), nn.LayerNorm(dim, eps=1e-5))
        self.xscale = math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class PreLookaheadLayer(nn.Module):
    """Residual conv that lets each frame peek ``lookahead`` frames ahead (zeros or given context)."""

    def __init__(self, dim: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        """x (B, T, D); context (B, lookahead, D) embedded future frames, or None for zeros."""
        h = x.transpose(1, 2)
        if context is None:
            h = F.pad(h, (0, self.lookahead))
        else:
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest-neighbour repeat in time, then a causal (left-padded) conv."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, stride*T, D)."""
        h = x.transpose(1, 2).repeat_interleave(self.stride, dim=2)
        return self.conv(F.pad(h, (2 * self.stride, 0))).transpose(1, 2)


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig, pre_lookahead_len: int) -> None:
        super().__init__()
        dim = cfg.output_size
        self.static_chunk_size = cfg.static_chunk_size
        self.embed = LinearInput(cfg.input_size, dim)
        self.after_norm = nn.LayerNorm(dim, eps=1e-5)
        # Upstream hard-codes width 512 here; building from output_size is identical at real size.
        self.pre_lookahead_layer = PreLookaheadLayer(dim, pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerEncoderLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )
        self.up_layer = Upsample1D(dim, UP_STRIDE)
        self.up_embed = LinearInput(dim, dim)
        self.up_encoders = nn.ModuleList(
            ConformerEncoderLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(NUM_UP_BLOCKS)
        )

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, streaming: bool) -> torch.Tensor:
        """x (B, T, input_size) token embeddings -> (B, 2T, D).

        ``context`` (B, lookahead, input_size): embeddings of the tokens after x, used only as
        look-ahead of the pre-lookahead conv. ``streaming`` switches on block-causal chunk masks
        (chunks counted from position 0, ``static_chunk_size`` tokens, twice that in frames).
        """
        x = self.embed(x)
        x = self.pre_lookahead_layer(x, None if context is None else self.embed(context))
        x = self._conformer(self.encoders, x, self.static_chunk_size, streaming)
        x = self.up_embed(self.up_layer(x))
        x = self._conformer(self.up_encoders, x, self.static_chunk_size * UP_STRIDE, streaming)
        return self.after_norm(x)

    @staticmethod
    def _conformer(layers: nn.ModuleList, x: torch.Tensor, chunk_size: int, streaming: bool) -> torch.Tensor:
        length = x.size(1)
        pos_table = relative_position_table(length, x.size(2), x.device, x.dtype)
        mask = chunk_mask(length, chunk_size, device=x.device)[None] if streaming else None
        for layer in layers:
            x = layer(x, pos_table, mask)
        return x
