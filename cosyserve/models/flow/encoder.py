"""Up-sampling conformer encoder of the CosyVoice2 flow (token embeddings -> 2x frame rate).

Layout (module names follow upstream so checkpoints load strictly):
``embed`` -> ``pre_lookahead_layer`` -> ``encoders`` (conformer layers, relative-position
attention) -> ``up_layer`` (x2 in time) -> ``up_embed`` -> ``up_encoders`` -> ``after_norm``.
Only the pre-norm, no-macaron, no-convolution-module conformer variant used by CosyVoice2 exists
here. Masks are boolean ``(B or 1, T_query or 1, T_key)`` tensors (True = visible) or None (all
visible). Every layer also runs on a :class:`~.cache.StreamWindow` (incremental streaming): the
window's positions attend to the cached keys/values of the positions before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KeyValueCache, StreamWindow, with_left_context
from .config import NUM_UP_BLOCKS, UP_STRIDE, EncoderConfig
from .masks import attention_mask

# LayerNorm eps inside conformer layers (upstream passes 1e-12 there, default 1e-5 elsewhere).
CONFORMER_NORM_EPS = 1e-12


def _sinusoids(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(R,) float32 positions -> (R, dim): sin(r*w) in even columns, cos(r*w) in odd ones (float32 like upstream)."""
    freqs = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32)
                      * -(math.log(10000.0) / dim))
    angles = positions[:, None] * freqs[None, :]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).view(positions.size(0), dim).to(dtype)


def relative_position_rows(lo: int, hi: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal rows (hi-lo+1, dim) for the relative positions lo, lo+1, ..., hi."""
    return _sinusoids(torch.arange(lo, hi + 1, device=device, dtype=torch.float32), dim, dtype)


def relative_position_table(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Upstream's table (1, 2*length-1, dim) for relative positions length-1, ..., 0, ..., -(length-1)."""
    positions = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)
    return _sinusoids(positions, dim, dtype)[None]


def relative_shift(scores: torch.Tensor, query_start: int = 0) -> torch.Tensor:
    """Scores against position rows -> scores against keys.

    scores (B, H, n, R): queries at positions [query_start, query_start + n), rows for the
    relative positions -(n-1), ..., query_start + n - 1 (R = query_start + 2n - 1).
    Returns (B, H, n, query_start + n) with [i, j] = the row of relative position (query_start + i) - j.
    """
    b, h, n, _ = scores.shape
    keys = query_start + n
    query = torch.arange(n, device=scores.device)[:, None]
    key = torch.arange(keys, device=scores.device)[None, :]
    index = query_start + query - key + (n - 1)
    return scores.gather(-1, index.expand(b, h, n, keys))


@dataclass
class RelAttentionState(KeyValueCache):
    """Stream state of one attention layer: keys/values of the committed positions and the
    projected position rows computed so far (constants of the layer)."""

    positions: torch.Tensor | None = None  # (R, D) linear_pos of the rows for positions_lo, ...
    positions_lo: int = 0

    @property
    def nbytes(self) -> int:
        rows = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        return super().nbytes + rows


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, window: StreamWindow | None = None) -> torch.Tensor:
        """x (B, n, D) at positions [start, start + n); keys at [0, start + n) (start = 0 without a window)."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.heads, self.d_k)
        k = self.linear_k(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        start, state = 0, None
        if window is not None:
            start, state = window.start, window.state(self, RelAttentionState)
            k, v = state.extend(k, v, window.commit)
        p = self._position_rows(-(t - 1), start + t - 1, x, state)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = relative_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)), start)
        scores = (content + position) / math.sqrt(self.d_k)
        if mask is None:
            attn = torch.softmax(scores, dim=-1)
        else:
            hidden = ~mask.unsqueeze(1)  # (B, 1, Tq, Tk), broadcast over heads
            attn = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.heads * self.d_k)
        return self.linear_out(out)

    def _position_rows(self, lo: int, hi: int, x: torch.Tensor, state: RelAttentionState | None) -> torch.Tensor:
        """linear_pos of the rows for relative positions lo..hi, split into heads: (1, H, hi-lo+1, d_k).

        In a stream the projected rows are kept, so each call only projects positions it has not seen.
        """
        def project(first: int, last: int) -> torch.Tensor:
            return self.linear_pos(relative_position_rows(first, last, x.size(2), x.device, x.dtype))

        if state is None:
            rows = project(lo, hi)
        else:
            if state.positions is None:
                state.positions, state.positions_lo = project(lo, hi), lo
            cached_lo, cached_hi = state.positions_lo, state.positions_lo + state.positions.size(0) - 1
            below = [project(lo, cached_lo - 1)] if lo < cached_lo else []
            above = [project(cached_hi + 1, hi)] if hi > cached_hi else []
            if below or above:
                state.positions = torch.cat([*below, state.positions, *above])
                state.positions_lo = min(lo, cached_lo)
            rows = state.positions[lo - state.positions_lo:hi - state.positions_lo + 1]
        return rows.view(1, hi - lo + 1, self.heads, self.d_k).transpose(1, 2)


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, window: StreamWindow | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, window)
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

    def forward(self, x: torch.Tensor, window: StreamWindow | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D); zeros stand in for the ``lookahead`` frames after x.

        A caller with real future tokens passes them at the end of x and ignores the outputs of
        the last ``lookahead`` positions. In a stream window conv2 continues from the conv1
        outputs before the window (those only depend on real tokens, so they are final).
        """
        h = F.leaky_relu(self.conv1(F.pad(x.transpose(1, 2), (0, self.lookahead))))
        h = self.conv2(with_left_context(h, self.conv2.kernel_size[0] - 1, self.conv2, window))
        return h.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest-neighbour repeat in time, then a causal (left-padded) conv."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def forward(self, x: torch.Tensor, window: StreamWindow | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, stride*T, D); ``window`` in input positions."""
        h = x.transpose(1, 2).repeat_interleave(self.stride, dim=2)
        frame_window = None if window is None else window.scaled(self.stride)
        return self.conv(with_left_context(h, 2 * self.stride, self.conv, frame_window)).transpose(1, 2)


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

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None, *, lookahead: int = 0,
                streaming: bool, window: StreamWindow | None = None) -> torch.Tensor:
        """x (B, T, input_size) token embeddings -> (B, 2T, D).

        ``lengths`` (B,): real tokens per item (the rest is right padding; None = all T). The last
        ``lookahead`` real tokens of each item only feed the pre-lookahead conv of the tokens
        before them: they are not attended to and their output frames are meaningless, as are
        those of padding. ``streaming`` switches on block-causal chunk masks (chunks counted from
        position 0, ``static_chunk_size`` tokens, twice that in frames). ``window``: x holds the
        tokens from ``window.start`` on of an incremental stream (batch 1, no padding).
        """
        batch, length, _ = x.shape
        x = self.embed(x)
        if lengths is not None:
            # True zeros after each item, as its pre-lookahead conv sees when the item runs alone.
            real = torch.arange(length, device=x.device)[None, :] < lengths[:, None]
            x = x * real.unsqueeze(-1).to(x.dtype)
        x = self.pre_lookahead_layer(x, window)
        valid_end = None
        if lengths is not None or lookahead:
            start = 0 if window is None else window.start
            real_end = lengths if lengths is not None else torch.full((batch,), length, device=x.device)
            valid_end = start + real_end - lookahead
        x = self._conformer(self.encoders, x, self.static_chunk_size, streaming, valid_end, window)
        x = self.up_embed(self.up_layer(x, window))
        x = self._conformer(self.up_encoders, x, self.static_chunk_size * UP_STRIDE, streaming,
                            None if valid_end is None else valid_end * UP_STRIDE,
                            None if window is None else window.scaled(UP_STRIDE))
        return self.after_norm(x)

    @staticmethod
    def _conformer(layers: nn.ModuleList, x: torch.Tensor, chunk_size: int, streaming: bool,
                   valid_end: torch.Tensor | None, window: StreamWindow | None) -> torch.Tensor:
        start = 0 if window is None else window.start
        mask = attention_mask(x.size(1), start, chunk_size if streaming else None, valid_end, x.device)
        for layer in layers:
            x = layer(x, mask, window)
        return x
