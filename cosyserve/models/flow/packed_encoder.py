"""The flow encoder over several incremental streams' windows at once.

:class:`~.encoder.UpsampleConformerEncoder` runs one stream window per call (batch 1): each call
is ~500 small kernels, so a packed token2wav step over many streams paid them once per stream.
:func:`encode_windows` runs the windows of several streams as one batch with the same weights and
the same per-stream state (a :class:`~.cache.StreamWindow`'s ``states`` dict: keys/values of the
committed positions per attention layer, left context per causal conv), so streams move freely
between this path and the single-window one.

Row j holds window j right-padded to the longest. A row's attention keys are its stream's own
[committed keys ‖ the window's] (the view its state's buffers return once the window is appended),
key slot s holding position s, right-padded to the longest row; masks hide the padding, the
look-ahead positions and (streaming) later blocks. Relative positions are read per row from one table
of projected position rows spanning every query-key distance of the batch, so the result equals each
window run alone up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ...runtime import host_to_device
from .cache import FrameBuffer
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
    chunk: int  # attention block
    scale: int  # positions per token

    def up(self) -> _Rate:
        return _Rate(self.starts * UP_STRIDE, self.valid_end * UP_STRIDE, self.cached * UP_STRIDE,
                     self.chunk * UP_STRIDE, self.scale * UP_STRIDE)


def encode_windows(encoder: UpsampleConformerEncoder, windows: list[EncoderWindow], *,
                   streaming: bool = True) -> list[torch.Tensor]:
    """Each window's encoder output (2 (n - lookahead), D), as the single-window path gives it."""
    device = windows[0].embedded.device
    packed = pad_sequence([w.embedded for w in windows], batch_first=True)
    lengths = host_to_device([w.embedded.size(0) for w in windows], device, torch.long)
    valid = lengths - host_to_device([w.lookahead for w in windows], device, torch.long)
    cached = max(w.start for w in windows)
    if cached == 0:
        x, kept = encode_first_windows(encoder, packed, lengths, valid, streaming=streaming)
        keep_first_states(encoder, [w.states for w in windows], [w.embedded.size(0) for w in windows],
                          [w.commit for w in windows], kept)
    else:
        starts = host_to_device([w.start for w in windows], device, torch.long)
        rate = _Rate(starts, starts + valid, cached, encoder.static_chunk_size, 1)
        x = _encode(encoder, packed, lengths, rate, streaming, _StreamStates(windows))
    return [x[j, :UP_STRIDE * (w.embedded.size(0) - w.lookahead)] for j, w in enumerate(windows)]


def encode_first_windows(encoder: UpsampleConformerEncoder, packed: torch.Tensor, lengths: torch.Tensor,
                         valid: torch.Tensor, *, streaming: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Windows at the start of their streams (nothing cached): ``packed`` (J, T, input_size) token
    embeddings, right-padded; ``lengths`` (J,) tokens per row, of which the first ``valid`` (J,) are
    not look-ahead. Returns the output (J, 2T, D) and what the rows' states take from this pass
    (:func:`keep_first_states`), in :func:`_state_owners` order: a convolution's padded input, an
    attention layer's keys and values. Device work only, no host synchronisation (a CUDA graph may
    capture it: new voices' prompts)."""
    zeros = torch.zeros_like(lengths)
    recorder = _FirstStates()
    x = _encode(encoder, packed, lengths, _Rate(zeros, valid, 0, encoder.static_chunk_size, 1), streaming, recorder)
    return x, recorder.kept


def keep_first_states(encoder: UpsampleConformerEncoder, states: list[dict], lengths: list[int], commits: list[int],
                      kept: list[torch.Tensor]) -> None:
    """Row j's stream state (``states[j]``, of a window of ``lengths[j]`` tokens of which ``commits[j]``
    are committed) from :func:`encode_first_windows`' ``kept`` tensors: views of its row, no copies."""
    tensors = iter(kept)
    for owner, scale in _state_owners(encoder):
        if isinstance(owner, nn.Conv1d):
            padded, frames = next(tensors), owner.kernel_size[0] - 1
            for j, (state, commit) in enumerate(zip(states, commits)):
                state[owner] = padded[j:j + 1, :, commit * scale:commit * scale + frames]
        else:
            k, v = next(tensors), next(tensors)
            for j, (state, length, commit) in enumerate(zip(states, lengths, commits)):
                cache = state.setdefault(owner, RelAttentionState())
                cache.start_with(k[j:j + 1, :, :length * scale], v[j:j + 1, :, :length * scale], commit * scale)


def _state_owners(encoder: UpsampleConformerEncoder) -> list[tuple[nn.Module, int]]:
    """The layers that keep stream state, in the order a pass meets them, with their positions per token."""
    return [(encoder.pre_lookahead_layer.conv2, 1), *((layer.self_attn, 1) for layer in encoder.encoders),
            (encoder.up_layer.conv, UP_STRIDE), *((layer.self_attn, UP_STRIDE) for layer in encoder.up_encoders)]


class _FirstStates:
    """A pass over first windows: convolutions see zeros on their left; attention the batch's keys.
    What the rows' states take is recorded (``kept``), to be handed out by :func:`keep_first_states`."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def with_left_context(self, x: torch.Tensor, conv: nn.Conv1d, rate: _Rate) -> torch.Tensor:
        padded = F.pad(x, (conv.kernel_size[0] - 1, 0))
        self.kept.append(padded)
        return padded

    def keys(self, attn, k: torch.Tensor, v: torch.Tensor, rate: _Rate) -> tuple[torch.Tensor, torch.Tensor]:
        self.kept += [k, v]
        return k, v


class _StreamStates:
    """A pass over windows of which some continue cached state: each row's left context and cached
    keys are read from its stream's state, which takes the window's committed positions."""

    def __init__(self, windows: list[EncoderWindow]) -> None:
        self.windows = windows

    def with_left_context(self, x: torch.Tensor, conv: nn.Conv1d, rate: _Rate) -> torch.Tensor:
        """x (J, C, T) with each row's left context of ``conv`` prepended (zeros at a stream's start);
        keeps the frames before each row's commit point as its next context."""
        frames = conv.kernel_size[0] - 1
        left = torch.cat([w.states[conv] if conv in w.states else x.new_zeros(1, x.size(1), frames)
                          for w in self.windows])
        padded = torch.cat([left, x], dim=2)
        for j, w in enumerate(self.windows):  # views of this pass's tensor, never written (as first windows')
            commit = w.commit * rate.scale
            w.states[conv] = padded[j:j + 1, :, commit:commit + frames]
        return padded

    def keys(self, attn, k: torch.Tensor, v: torch.Tensor, rate: _Rate) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's [committed keys ‖ window's] (and values), right-padded to the most cached plus the
        window; each row's state takes its committed ones. A row's committed keys are its window's
        start (its stream's committed tokens), so key slot s holds position s."""
        rows, _, length, _ = k.shape
        states = [w.states.get(attn) or w.states.setdefault(attn, RelAttentionState()) for w in self.windows]
        if rows == 1:  # its stream's own buffer is the row, no padding (six kernels a layer fewer alone)
            return states[0].extend(k, v, self.windows[0].commit * rate.scale)
        lengths = [w.embedded.size(0) * rate.scale for w in self.windows]
        commits = [w.commit * rate.scale for w in self.windows]
        # every row's window appended to its own buffers in one copy; the rows then padded into the batch
        rows_kv = FrameBuffer.extend_all([s.keys for s in states] + [s.values for s in states],
                                         [k[j:j + 1, :, :n] for j, n in enumerate(lengths)]
                                         + [v[j:j + 1, :, :n] for j, n in enumerate(lengths)], commits * 2)
        keys = k.new_zeros(rows, k.size(1), rate.cached + length, k.size(3))  # zeros after each row's positions
        values = torch.zeros_like(keys)
        torch._foreach_copy_([keys[j:j + 1, :, :row.size(2)] for j, row in enumerate(rows_kv[:rows])]
                             + [values[j:j + 1, :, :row.size(2)] for j, row in enumerate(rows_kv[rows:])], rows_kv)
        return keys, values


def _encode(encoder: UpsampleConformerEncoder, packed: torch.Tensor, lengths: torch.Tensor, tokens: _Rate,
            streaming: bool, states: _FirstStates | _StreamStates) -> torch.Tensor:
    x = encoder.embed(packed)
    real = torch.arange(x.size(1), device=x.device)[None, :] < lengths[:, None]
    x = x * real.unsqueeze(-1).to(x.dtype)  # zeros after each window, as a window alone sees them

    pre = encoder.pre_lookahead_layer
    h = F.leaky_relu(_conv(pre.conv1, F.pad(x.transpose(1, 2), (0, pre.lookahead))))
    x = _conv(pre.conv2, states.with_left_context(h, pre.conv2, tokens)).transpose(1, 2) + x
    x = _conformer(encoder.encoders, x, tokens, streaming, states)

    up = encoder.up_layer
    frames = tokens.up()
    h = x.transpose(1, 2).repeat_interleave(up.stride, dim=2)
    x = encoder.up_embed(_conv(up.conv, states.with_left_context(h, up.conv, frames)).transpose(1, 2))
    return encoder.after_norm(_conformer(encoder.up_encoders, x, frames, streaming, states))


def _conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` (x (J, C, T); stride 1, no padding) as one matrix product over x's unfolded
    windows, whatever T: cuDNN plans each new input shape (~4 ms a shape on an H200, three convs a
    window), and new voices' prompts come in every length."""
    windows = x.unfold(2, conv.kernel_size[0], 1).transpose(1, 2).flatten(2)  # (J, T', C k)
    return F.linear(windows, conv.weight.flatten(1), conv.bias).transpose(1, 2)


def _conformer(layers: nn.ModuleList, x: torch.Tensor, rate: _Rate, streaming: bool,
               states: _FirstStates | _StreamStates) -> torch.Tensor:
    rows, length, _ = x.shape
    device = x.device
    cached = rate.cached
    position = torch.arange(length, device=device)
    key_pos = torch.arange(cached + length, device=device)[None, :]  # key slot s holds position s in every row
    key_ok = key_pos < rate.valid_end[:, None]  # committed, or the window's and not look-ahead
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
        h = layer.norm_mha(x)
        x = x + _attention(layer.self_attn, h, rate, hidden, distance, positions, states)
        x = x + layer.feed_forward(layer.norm_ff(x))
    return x


def _attention(attn, x: torch.Tensor, rate: _Rate, hidden: torch.Tensor, distance: torch.Tensor,
               positions: torch.Tensor, states: _FirstStates | _StreamStates) -> torch.Tensor:
    rows, length, _ = x.shape
    heads, d_k = attn.heads, attn.d_k
    q = attn.linear_q(x).view(rows, length, heads, d_k)
    k = attn.linear_k(x).view(rows, length, heads, d_k).transpose(1, 2)
    v = attn.linear_v(x).view(rows, length, heads, d_k).transpose(1, 2)
    keys, values = states.keys(attn, k, v, rate)
    table = attn.linear_pos(positions).view(1, positions.size(0), heads, d_k).transpose(1, 2)
    content = torch.matmul((q + attn.pos_bias_u).transpose(1, 2), keys.transpose(-2, -1))
    position = torch.matmul((q + attn.pos_bias_v).transpose(1, 2), table.transpose(-2, -1))
    position = position.gather(-1, distance[:, None].expand(rows, heads, length, -1))
    scores = (content + position) / math.sqrt(d_k)
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
    out = torch.matmul(weights, values).transpose(1, 2).reshape(rows, length, heads * d_k)
    return attn.linear_out(out)
