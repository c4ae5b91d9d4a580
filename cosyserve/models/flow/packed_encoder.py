"""The flow encoder over several incremental streams' windows at once.

:class:`~.encoder.UpsampleConformerEncoder` runs one stream window per call (batch 1): each call
is ~500 small kernels, so a packed token2wav step over many streams paid them once per stream.
:func:`encode_windows` runs the windows of several streams as one batch with the same weights and
the same per-stream state (a :class:`~.cache.StreamWindow`'s ``states`` dict: keys/values of the
committed positions per attention layer, left context per causal conv), so streams move freely
between this path and the single-window one.

Row j holds window j right-padded to the longest. Attention keys are [the row's cached keys,
padded to the longest cache ‖ the window's keys]; masks hide the padding, the cached slots a
row does not have, the look-ahead positions and (streaming) later blocks. Relative positions are
read per row from one table of projected position rows spanning every query-key distance of the
batch, so the result equals each window run alone up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ...runtime import host_to_device
from .config import UP_STRIDE
from .encoder import RelAttentionState, UpsampleConformerEncoder, relative_position_rows


@dataclass
class EncoderWindow:
    """One stream's part: ``embedded`` (n, input_size) token embeddings of its tokens from position
    ``start`` on, of which the first ``commit`` become final (their state is kept) and the last
    ``lookahead`` are look-ahead only; ``states`` the stream's encoder state (updated in place)."""

    embedded: torch.Tensor
    start: int
    commit: int
    lookahead: int
    states: dict


@dataclass(frozen=True)
class _Rate:
    """Where every row's window sits at one rate (tokens, or frames after up-sampling)."""

    starts: torch.Tensor  # (J,) first window position = cached positions
    valid_end: torch.Tensor  # (J,) positions from here on are hidden as keys
    cached: int  # most cached positions of a row
    lengths: list[int]  # window positions per row
    commits: list[int]
    chunk: int


def encode_windows(encoder: UpsampleConformerEncoder, windows: list[EncoderWindow], *,
                   streaming: bool = True, width: int = 0) -> list[torch.Tensor]:
    """Each window's encoder output (2 (n - lookahead), D), as the single-window path gives it.
    ``width``: the rows are padded to this many tokens at least (more zeros after each window, as a
    window alone sees them), so that calls of windows of nearby lengths share every shape: the
    matrix products' plans and the allocator's blocks are then reused, not made anew (new voices'
    prompts come in every length)."""
    device = windows[0].embedded.device
    lengths = host_to_device([w.embedded.size(0) for w in windows], device, torch.long)
    starts = host_to_device([w.start for w in windows], device, torch.long)
    valid_end = starts + lengths - host_to_device([w.lookahead for w in windows], device, torch.long)
    packed = pad_sequence([w.embedded for w in windows], batch_first=True)
    if width > packed.size(1):
        packed = F.pad(packed, (0, 0, 0, width - packed.size(1)))
    x = encoder.embed(packed)
    real = torch.arange(x.size(1), device=device)[None, :] < lengths[:, None]
    x = x * real.unsqueeze(-1).to(x.dtype)  # zeros after each window, as a window alone sees them

    pre = encoder.pre_lookahead_layer
    h = F.leaky_relu(_conv(pre.conv1, F.pad(x.transpose(1, 2), (0, pre.lookahead))))
    x = _conv(pre.conv2, _with_left_context(h, pre.conv2, windows, 1)).transpose(1, 2) + x
    sizes = [w.embedded.size(0) for w in windows]
    tokens = _Rate(starts, valid_end, max(w.start for w in windows), sizes, [w.commit for w in windows],
                   encoder.static_chunk_size)
    x = _conformer(encoder.encoders, x, tokens, windows, streaming)

    up = encoder.up_layer
    h = x.transpose(1, 2).repeat_interleave(up.stride, dim=2)
    x = encoder.up_embed(_conv(up.conv, _with_left_context(h, up.conv, windows, up.stride)).transpose(1, 2))
    frames = _Rate(starts * UP_STRIDE, valid_end * UP_STRIDE, tokens.cached * UP_STRIDE,
                   [n * UP_STRIDE for n in sizes], [w.commit * UP_STRIDE for w in windows],
                   encoder.static_chunk_size * UP_STRIDE)
    x = encoder.after_norm(_conformer(encoder.up_encoders, x, frames, windows, streaming))
    return [x[j, :UP_STRIDE * (w.embedded.size(0) - w.lookahead)] for j, w in enumerate(windows)]


def _conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` (x (J, C, T); stride 1, no padding) as one matrix product over x's unfolded
    windows, whatever T: cuDNN plans each new input shape (~4 ms a shape on an H200, three convs a
    window), and new voices' prompts come in every length."""
    windows = x.unfold(2, conv.kernel_size[0], 1).transpose(1, 2).flatten(2)  # (J, T', C k)
    return F.linear(windows, conv.weight.flatten(1), conv.bias).transpose(1, 2)


def _with_left_context(x: torch.Tensor, conv: nn.Conv1d, windows: list[EncoderWindow], scale: int) -> torch.Tensor:
    """x (J, C, T) with each row's left context of ``conv`` prepended (zeros at a stream's start);
    keeps the frames before each row's commit point as its next context."""
    frames = conv.kernel_size[0] - 1
    left = torch.cat([w.states[conv] if conv in w.states else x.new_zeros(1, x.size(1), frames) for w in windows])
    padded = torch.cat([left, x], dim=2)
    for j, w in enumerate(windows):
        commit = w.commit * scale
        w.states[conv] = padded[j:j + 1, :, commit:commit + frames].clone()
    return padded


def _conformer(layers: nn.ModuleList, x: torch.Tensor, rate: _Rate, windows: list[EncoderWindow],
               streaming: bool) -> torch.Tensor:
    rows, length, _ = x.shape
    device = x.device
    cached = rate.cached
    position = torch.arange(length, device=device)
    slot = torch.arange(cached + length, device=device)
    # absolute position of every key slot: [cached slots 0..cached) ‖ the row's window
    key_pos = torch.where(slot[None, :] < cached, slot[None, :], rate.starts[:, None] + slot[None, :] - cached)
    key_ok = torch.where(slot[None, :] < cached, slot[None, :] < rate.starts[:, None], key_pos < rate.valid_end[:, None])
    query_pos = rate.starts[:, None] + position[None, :]
    visible = key_ok[:, None, :].expand(rows, length, -1)
    if streaming:
        visible = visible & (key_pos[:, None, :] // rate.chunk <= query_pos[:, :, None] // rate.chunk)
    hidden = ~visible.unsqueeze(1)  # (J, 1, T, K)
    lo, hi = -(length - 1), cached + length - 1
    distance = (query_pos[:, :, None] - key_pos[:, None, :]).clamp(lo, hi) - lo  # row index in the table
    # the sinusoids of every relative position, the same for each layer (each projects them its own way)
    positions = relative_position_rows(lo, hi, x.size(2), device, x.dtype)
    for layer in layers:
        attn = layer.self_attn
        h = layer.norm_mha(x)
        x = x + _attention(attn, h, rate, windows, hidden, distance, positions, cached)
        x = x + layer.feed_forward(layer.norm_ff(x))
    return x


def _attention(attn, x: torch.Tensor, rate: _Rate, windows: list[EncoderWindow], hidden: torch.Tensor,
               distance: torch.Tensor, positions: torch.Tensor, cached: int) -> torch.Tensor:
    rows, length, _ = x.shape
    heads, d_k = attn.heads, attn.d_k
    q = attn.linear_q(x).view(rows, length, heads, d_k)
    k = attn.linear_k(x).view(rows, length, heads, d_k).transpose(1, 2)
    v = attn.linear_v(x).view(rows, length, heads, d_k).transpose(1, 2)
    states = [w.states.get(attn) or w.states.setdefault(attn, RelAttentionState()) for w in windows]
    if cached == 0:
        # no row has cached keys (new voices' prompts, streams' first windows): the batch's keys are
        # every row's, and each row's state keeps a view of its own (no buffer, no copy: six
        # launches a row and layer fewer)
        keys, values = k, v
        for j, state in enumerate(states):
            state.start_with(k[j:j + 1, :, :rate.lengths[j]], v[j:j + 1, :, :rate.lengths[j]], rate.commits[j])
    elif rows == 1 and states[0].keys.committed == cached:
        # one window: its stream's own buffer is [committed ‖ window] once extended (no copy into a
        # padded one: a stream alone, or a voice's prompt piece, launches six kernels a layer fewer)
        keys, values = states[0].extend(k, v, rate.commits[0])
    else:
        keys = x.new_zeros(rows, heads, cached + length, d_k)
        values = torch.zeros_like(keys)
        keys[:, :, cached:], values[:, :, cached:] = k, v
        for j, state in enumerate(states):
            if state.keys.committed:
                keys[j:j + 1, :, :state.keys.committed] = state.keys.committed_frames()
                values[j:j + 1, :, :state.values.committed] = state.values.committed_frames()
            state.extend(k[j:j + 1, :, :rate.lengths[j]], v[j:j + 1, :, :rate.lengths[j]], rate.commits[j])
    table = attn.linear_pos(positions).view(1, positions.size(0), heads, d_k).transpose(1, 2)
    content = torch.matmul((q + attn.pos_bias_u).transpose(1, 2), keys.transpose(-2, -1))
    position = torch.matmul((q + attn.pos_bias_v).transpose(1, 2), table.transpose(-2, -1))
    position = position.gather(-1, distance[:, None].expand(rows, heads, length, -1))
    scores = (content + position) / math.sqrt(d_k)
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
    out = torch.matmul(weights, values).transpose(1, 2).reshape(rows, length, heads * d_k)
    return attn.linear_out(out)
