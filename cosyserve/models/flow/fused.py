"""The estimator's Euler step over packed rows, restructured for few kernels (issue 14).

:class:`FusedEstimator` runs the weights of a :class:`~.estimator.CausalConditionalDecoder` (packed
once from the module: concatenated Q/K/V, convolutions as tap-major GEMM weights, the time MLPs
evaluated for the fixed t grid) as one guided Euler step over a batch of *rows*: the conditional
row of each request, then its unconditional row (mu, speaker and cond zeroed), as in
:meth:`~.cfm.CausalConditionalCFM.guidance_batch`. Each row holds ``frames`` new frames (the
first ``valid[r]`` real, the rest padding) and attends to its own cached context of
``context[r]`` earlier frames: the per-step keys/values of every attention layer and the left
input frames of every causal convolution (:class:`StepState`). Attention is block-causal over
absolute positions (streaming) or full (offline / the final pass, no context).

Per transformer block the step runs five kernels: Q/K/V GEMM (K/V written straight into the
cache slots after the context), attention (block-causal rows: the Triton kernel of
:mod:`.attention_triton`, which computes the mask from positions and skips masked tiles; full
attention and the PyTorch path: SDPA), ``to_out`` + bias + residual + LayerNorm,
FF1 + bias + GELU, FF2 + bias + residual + the next block's LayerNorm. A ResNet block is two
kernels: causal conv + bias + LayerNorm + Mish + mask + time bias, then the second causal conv
with the same epilogue plus the 1x1 residual conv. The final projection of both rows of a
request, the guidance combine and the Euler update are one kernel that also writes the next
step's x into the input buffer. All buffers are preallocated per (rows, frames), so a step or a
whole 10-step call can be captured as one CUDA graph with the context as data.

fp16/bf16 on CUDA run the Triton kernels of :mod:`.fused_triton` (fp32 accumulation, LayerNorm
statistics, activations and the residual streams in fp32); everything else (CPU, fp32) runs the plain PyTorch reference
ops below, which compute the same function layer for layer as the eager estimator.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...runtime import host_to_device
from .cache import KeyValueCache
from .cfm import CausalConditionalCFM
from .lanes import current_lane
from .estimator import CausalBlock1D, CausalConditionalDecoder, CausalResnetBlock1D, TransformerBlock, \
    sinusoidal_time_embedding

ACT_NONE, ACT_GELU, ACT_MISH = 0, 1, 2
# Attention key slots per row are padded so that context slots + new frames is a multiple of this
# (SDPA's memory-efficient kernel pads its mask to it otherwise, one extra kernel per layer).
KEY_ALIGN = 16
_ACTIVATIONS = {ACT_NONE: lambda y: y, ACT_GELU: F.gelu, ACT_MISH: F.mish}


def fused_linear_reference(a: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor, taps: int = 1,
                           context: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                           ln: tuple[torch.Tensor, torch.Tensor] | None = None, act: int = ACT_NONE,
                           valid: torch.Tensor | None = None, live: torch.Tensor | None = None,
                           row_vector: torch.Tensor | None = None,
                           gemm2: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           residual: torch.Tensor | None = None,
                           ln_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           split: tuple[int, torch.Tensor] | None = None, eps: float = 1e-5) -> None:
    """One GEMM over rows of frames with the estimator's epilogues, in this order.

    a (R, n, K) -> y (R, n, N) = a @ w.T, or with ``taps`` > 1 a causal convolution: frame i reads
    frames i-taps+1..i, those before the window from ``context`` (R, taps-1, K) (zeros if None),
    with w (N, taps*K) tap-major. Then: + ``bias``; LayerNorm ``ln`` (weight, bias) over N;
    activation ``act``; zero the padding frames (i >= ``valid``[r]); + ``row_vector`` (R, N);
    + ``gemm2`` = (a2 (R, n, K2), w2 (N, K2), b2): a2 @ w2.T + b2; + ``residual`` (R, n, N).
    y goes to ``out`` (R, n, N), or columns [0, s) to ``out`` and [s, N) to t for ``split`` = (s, t);
    ``ln_out`` = (weight, bias, out2) also writes LayerNorm(y) to out2. Outputs may alias inputs
    row for row (``residual`` is ``out``: the residual stream updated in place).

    ``live`` (R,) int32: frames i >= live[r] are padding whose outputs nothing reads; a kernel may
    skip their products (the Triton one does, per block of rows), leaving other finite values there.
    Here they are computed.
    """
    a = a.to(w.dtype)
    if taps > 1:
        left = context.to(w.dtype) if context is not None else a.new_zeros(a.size(0), taps - 1, a.size(2))
        padded = torch.cat([left, a], dim=1)
        a = torch.cat([padded[:, tap:tap + a.size(1)] for tap in range(taps)], dim=2)
    y = F.linear(a, w, bias)
    if ln is not None:
        y = F.layer_norm(y, (y.size(-1),), ln[0], ln[1], eps)
    y = _ACTIVATIONS[act](y)
    if valid is not None:
        y = y * frame_mask(valid, y.size(1)).to(y.dtype)
    if row_vector is not None:
        y = y + row_vector[:, None, :]
    if gemm2 is not None:
        y = y + F.linear(gemm2[0].to(w.dtype), gemm2[1], gemm2[2])
    if residual is not None:
        y = y + residual
    if split is not None:
        out.copy_(y[..., :split[0]])
        split[1].copy_(y[..., split[0]:])
    else:
        out.copy_(y)
    if ln_out is not None:
        ln_out[2].copy_(F.layer_norm(y, (y.size(-1),), ln_out[0], ln_out[1], eps))


def cfg_euler_reference(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, valid: torch.Tensor, dt: torch.Tensor,
                        x: torch.Tensor, x_out: torch.Tensor, velocity: torch.Tensor, cfg_rate: float,
                        update_input: bool) -> None:
    """Final 1x1 projection of a (R, n, C) -> guided velocity and Euler update of each request.

    Rows [0, R/2) are the conditional rows, [R/2, R) the unconditional ones in the same order.
    velocity (R/2, n, N) = (1 + r) v_cond - r v_uncond (padding frames 0); x_out = x + dt v with
    x (R, n, N) the step's input x (both rows of a pair share it) and dt (R/2,); ``update_input``
    also writes x_out into x for both rows (the next step's input).
    """
    pairs = a.size(0) // 2
    y = F.linear(a, w, bias) * frame_mask(valid, a.size(1)).to(a.dtype)
    cond, uncond = y[:pairs], y[pairs:]
    v = (1.0 + cfg_rate) * cond - cfg_rate * uncond
    x_next = x[:pairs] + dt.to(x.dtype)[:, None, None] * v
    velocity.copy_(v)
    x_out.copy_(x_next)
    if update_input:
        x[:pairs].copy_(x_next)
        x[pairs:].copy_(x_next)


def frame_mask(valid: torch.Tensor, frames: int) -> torch.Tensor:
    """(R,) valid frame counts -> bool (R, frames, 1): True for real frames."""
    return (torch.arange(frames, device=valid.device)[None, :] < valid[:, None]).unsqueeze(-1)


def context_slots(max_context: int, frames: int) -> int:
    """Cached-key slots per row: at least ``max_context``, with slots + frames a multiple of KEY_ALIGN."""
    keys = -(-(max_context + frames) // KEY_ALIGN) * KEY_ALIGN
    return keys - frames


@dataclass(frozen=True)
class StepRows:
    """Where the rows of one packed step sit: new frames per row and the cached context before them.

    ``device_context`` (R,) int32: ``context`` on the device, from which the Triton attention
    computes its mask (:mod:`.attention_triton`).
    ``attn_bias`` (R, 1, frames, slots + frames) additive (0 / -inf) over the keys [context slots ‖
    new frames] for SDPA, or None when every key is visible (offline rows of equal length: flash
    attention) or the Triton attention runs.
    """

    frames: int
    valid: torch.Tensor  # (R,) int32: real new frames per row
    context: tuple[int, ...]  # cached frames per row (absolute position of its first new frame)
    slots: int  # cached-key slots per row (>= max context)
    streaming: bool
    attn_bias: torch.Tensor | None
    device_context: torch.Tensor

    @property
    def rows(self) -> int:
        return self.valid.numel()


@dataclass
class StepState:
    """One Euler step's cached context for every row: K/V per attention layer, left input frames per causal conv.

    ``kv_all`` (layers, R, slots + frames, 2 * heads * head_dim): per layer ``kv[l]``, [keys ‖ values]
    of the context frames in slots [0, context[r]), then this step's new frames from slot ``slots``
    on, which the Q/K/V kernel writes in place. ``conv_all`` (R, sum over convs of (kernel - 1) *
    C_in): per conv ``conv[c]`` (R, kernel - 1, C_in), the input frames just before the window.
    One tensor each, so that a row's whole context moves in one copy.
    """

    kv_all: torch.Tensor
    conv_all: torch.Tensor
    kv: list[torch.Tensor]
    conv: list[torch.Tensor]

    def load_stream_states(self, rows: Sequence[int], states: dict, attention: Sequence, convs: Sequence) -> None:
        """Copy one request's eager stream state (a :class:`~.cache.StreamWindow`'s ``states`` of its
        CFG batch of 2) into ``rows`` = (conditional row, unconditional row)."""
        index = host_to_device(list(rows), self.kv[0].device, torch.long)
        for layer, kv in zip(attention, self.kv):
            if layer not in states:  # no context yet
                continue
            cache: KeyValueCache = states[layer]
            length = cache.keys.committed
            for half, buffer in enumerate((cache.keys, cache.values)):
                frames = buffer.committed_frames()  # (2, H, L, d)
                width = frames.size(1) * frames.size(3)
                kv[index, :length, half * width:(half + 1) * width] = \
                    frames.transpose(1, 2).reshape(len(rows), length, width).to(kv.dtype)
        for conv, left in zip(convs, self.conv):
            if conv in states:
                left[index] = states[conv].transpose(1, 2).to(left.dtype)


def conv_views(flat: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Views (R, frames, channels) per conv of ``flat`` (R, sum of frames * channels)."""
    views, offset = [], 0
    for frames, channels in shapes:
        views.append(flat[:, offset:offset + frames * channels].view(flat.size(0), frames, channels))
        offset += frames * channels
    return views


@dataclass(frozen=True)
class _Transformer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    qkv: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor
    ln3: tuple[torch.Tensor, torch.Tensor]
    ff1: torch.Tensor
    ff1_bias: torch.Tensor
    ff2: torch.Tensor
    ff2_bias: torch.Tensor


@dataclass(frozen=True)
class _Conv:
    weight: torch.Tensor  # (C_out, taps * C_in), tap-major
    bias: torch.Tensor
    taps: int
    ln: tuple[torch.Tensor, torch.Tensor] | None = None  # CausalBlock1D's LayerNorm (then Mish, mask)


@dataclass(frozen=True)
class _Resnet:
    block1: _Conv
    block2: _Conv
    res: torch.Tensor  # (C_out, C_in)
    res_bias: torch.Tensor


class _Workspace:
    """Preallocated activations of one (rows, frames) shape."""

    def __init__(self, rows: int, frames: int, width: int, inner: int, ff: int, out_channels: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        def empty(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=dtype)
        self.h = empty(rows, frames, width)  # normalised input of the next GEMM
        self.h1 = empty(rows, frames, width)  # ResNet block1 output / final block output
        # The residual streams stay fp32: 56 residual additions rounded to bf16 (8 bits) would
        # dominate the error; GEMMs read them rounded to the weights' dtype.
        self.stream = (empty(rows, frames, width, dtype=torch.float32),
                       empty(rows, frames, width, dtype=torch.float32))  # ping-pong
        self.up_in = empty(rows, frames, 2 * width, dtype=torch.float32)  # [mid output ‖ skip]: the up stage's input
        self.q = empty(rows, frames, inner)
        self.attended = empty(rows, frames, inner)  # the Triton attention's output
        self.ff = empty(rows, frames, ff)
        self.x_out = empty(rows // 2, frames, out_channels)
        self.velocity = empty(rows // 2, frames, out_channels)


class FusedEstimator:
    """The guided Euler step of ``cfm``'s estimator over packed rows (see the module docstring).

    ``dtype``: compute dtype (default: the estimator's). ``kernels``: "auto" (Triton for fp16/bf16
    on CUDA, the PyTorch reference otherwise), "triton" or "torch". ``attention_backends``: the
    SDPA backends allowed (None: PyTorch's choice). ``attention``: "triton" (block-causal rows through
    the attention of :mod:`.attention_triton`: no mask tensor, masked tiles skipped; full attention
    through SDPA), "sdpa" (SDPA over a bias) or "auto" (Triton with the Triton kernels and no
    ``attention_backends``, else SDPA).
    """

    def __init__(self, cfm: CausalConditionalCFM, dtype: torch.dtype | None = None, kernels: str = "auto",
                 attention_backends: Sequence[SDPBackend] | None = None, attention: str = "auto") -> None:
        decoder: CausalConditionalDecoder = cfm.estimator
        first = next(decoder.parameters())
        self.decoder = decoder
        self.cfm = cfm
        self.device = first.device
        self.dtype = dtype or first.dtype
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16) \
                else "torch"
        if kernels == "triton":
            from . import fused_triton
            self._linear, self._cfg_euler = fused_triton.fused_linear, fused_triton.cfg_euler
        elif kernels == "torch":
            self._linear, self._cfg_euler = fused_linear_reference, cfg_euler_reference
        else:
            raise ValueError(f"kernels must be auto, triton or torch, got {kernels!r}")
        self.kernels = kernels
        self.attention_backends = None if attention_backends is None else list(attention_backends)
        if attention == "auto":
            attention = "triton" if kernels == "triton" and attention_backends is None else "sdpa"
        if attention not in ("triton", "sdpa"):
            raise ValueError(f"attention must be auto, triton or sdpa, got {attention!r}")
        self.attention = attention
        attn = decoder.down_blocks[0][1][0].attn1
        self.heads = attn.heads
        self.inner = attn.to_q.out_features
        self.width = decoder.final_proj.in_channels
        self.out_channels = decoder.final_proj.out_channels
        self.chunk = decoder.static_chunk_size
        self.left_chunks = decoder.num_decoding_left_chunks
        self.cfg_rate = cfm.cfg_rate

        # Program order: (resnet, transformer blocks, conv after the stage or None) per stage.
        down_res, down_blocks, down_conv = decoder.down_blocks[0]
        up_res, up_blocks, up_conv = decoder.up_blocks[0]
        stages = [(down_res, down_blocks, down_conv)] + [(r, b, None) for r, b in decoder.mid_blocks] \
            + [(up_res, up_blocks, up_conv)]
        self.resnets = [stage[0] for stage in stages]
        #: The eager modules whose stream state a StepState holds, in its order.
        self.attention_layers = [block.attn1 for stage in stages for block in stage[1]]
        self.conv_layers = []
        for res, _, conv in stages:
            self.conv_layers += [res.block1.block[0], res.block2.block[0]] + ([conv] if conv is not None else [])
        self.conv_layers.append(decoder.final_block.block[0])

        with torch.no_grad():
            self._stages = [(self._resnet(res), [self._transformer(b) for b in blocks],
                             None if conv is None else self._conv(conv)) for res, blocks, conv in stages]
            self._final = self._block(decoder.final_block)
            self._proj = (self._cast(decoder.final_proj.weight[:, :, 0]), self._cast(decoder.final_proj.bias))
        self._workspaces: dict[tuple[str, int, int], _Workspace] = {}  # by lane, rows, frames

    # -- packing the module's weights ------------------------------------------------------------
    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.dtype).contiguous()

    def _ln(self, norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cast(norm.weight), self._cast(norm.bias)

    def _conv(self, conv: torch.nn.Conv1d, ln: torch.nn.LayerNorm | None = None) -> _Conv:
        weight = conv.weight.permute(0, 2, 1).reshape(conv.out_channels, -1)
        return _Conv(self._cast(weight), self._cast(conv.bias), conv.kernel_size[0], None if ln is None else self._ln(ln))

    def _block(self, block: CausalBlock1D) -> _Conv:
        conv, _, norm, _, _ = block.block
        return self._conv(conv, norm)

    def _resnet(self, res: CausalResnetBlock1D) -> _Resnet:
        return _Resnet(self._block(res.block1), self._block(res.block2), self._cast(res.res_conv.weight[:, :, 0]),
                       self._cast(res.res_conv.bias))

    def _transformer(self, block: TransformerBlock) -> _Transformer:
        attn, ff = block.attn1, block.ff.net
        qkv = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight])
        return _Transformer(self._ln(block.norm1), self._cast(qkv), self._cast(attn.to_out[0].weight),
                            self._cast(attn.to_out[0].bias), self._ln(block.norm3), self._cast(ff[0].proj.weight),
                            self._cast(ff[0].proj.bias), self._cast(ff[2].weight), self._cast(ff[2].bias))

    def packed_weights(self) -> list[torch.Tensor]:
        """Every tensor the step reads as weights (GEMM matrices, biases, LayerNorm affines)."""
        tensors = []
        for res, blocks, conv in self._stages:
            for c in (res.block1, res.block2) + (() if conv is None else (conv,)):
                tensors += [c.weight, c.bias, *(c.ln or ())]
            tensors += [res.res, res.res_bias]
            for b in blocks:
                tensors += [*b.ln1, b.qkv, b.out, b.out_bias, *b.ln3, b.ff1, b.ff1_bias, b.ff2, b.ff2_bias]
        return tensors + [self._final.weight, self._final.bias, *self._final.ln, *self._proj]

    # -- per-step inputs ----------------------------------------------------------------------
    @torch.no_grad()
    def time_bias(self, t: torch.Tensor) -> torch.Tensor:
        """t (S,) -> (S, resnets, width): each ResNet's ``mlp(time_mlp(embedding(t)))``, for a fixed t grid."""
        decoder = self.decoder
        dtype = next(decoder.parameters()).dtype
        emb = decoder.time_mlp(sinusoidal_time_embedding(t.to(dtype), decoder.in_channels).to(dtype))
        return torch.stack([res.mlp(emb) for res in self.resnets], dim=1).to(self.dtype)

    def schedule(self, n_timesteps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t (S,), dt (S,), time bias (S, resnets, width)) of the sampler's Euler steps."""
        dtype = next(self.decoder.parameters()).dtype
        steps = self.cfm.euler_schedule(n_timesteps, self.device, dtype)
        t = torch.stack([t for t, _ in steps])
        dt = torch.stack([dt for _, dt in steps])
        return t, dt, self.time_bias(t)

    def rows(self, valid: Sequence[int], context: Sequence[int], frames: int, *, streaming: bool,
             slots: int | None = None) -> StepRows:
        """Describe a packed step: ``valid`` real new frames and ``context`` cached frames per row."""
        if len(valid) != len(context) or len(valid) % 2:
            raise ValueError("rows come in CFG pairs: valid and context need the same even length")
        if any(v < 0 or v > frames for v in valid) or any(c < 0 for c in context):
            raise ValueError(f"valid frames must lie in [0, {frames}] and context lengths be >= 0")
        if not streaming and any(context):
            raise ValueError("full attention has no cached context: earlier frames attend to the new ones")
        slots = context_slots(max(context), frames) if slots is None else slots
        if slots < max(context):
            raise ValueError(f"{slots} context slots cannot hold {max(context)} cached frames")
        # one copy to the device: valid frames and cached frames per row
        packed = host_to_device([list(valid), list(context)], self.device, torch.int32)
        rows = StepRows(frames, packed[0], tuple(context), slots, streaming, None, packed[1])
        # decided on the host (reading the mask would wait for the device): keys are hidden by
        # blocks, by empty context slots or by padding frames
        if self.uses_bias(streaming) and (streaming or slots > 0 or any(v < frames for v in valid)):
            bias = torch.zeros(rows.rows, frames, slots + frames, device=self.device, dtype=self.dtype)
            rows = replace(rows, attn_bias=bias.masked_fill_(~self.visible(rows), float("-inf")).unsqueeze(1))
        return rows

    def uses_bias(self, streaming: bool) -> bool:
        """Whether rows of this attention kind run SDPA over a mask: full attention always does (no
        tile to skip; cuDNN's kernel is faster on dense rows), block-causal rows unless the Triton
        attention runs."""
        return self.attention == "sdpa" or not streaming

    def visible(self, rows: StepRows) -> torch.Tensor:
        """bool (R, frames, slots + frames): the keys [context slots ‖ new frames] each query sees (the
        module docstring of :mod:`.attention_triton`), padding queries their own frame too (so that
        SDPA never takes an empty softmax)."""
        device, frames, slots = self.device, rows.frames, rows.slots
        ctx = rows.device_context.long()[:, None]
        new = torch.arange(frames, device=device)[None, :]
        slot = torch.arange(slots, device=device)[None, :]
        query_pos = ctx + new
        key_pos = torch.cat([slot.expand(rows.rows, -1), query_pos], dim=1)
        key_ok = torch.cat([slot < ctx, new < rows.valid[:, None]], dim=1)
        visible = key_ok[:, None, :].expand(-1, frames, -1).clone()
        if rows.streaming:
            query_block, key_block = query_pos[:, :, None] // self.chunk, key_pos[:, None, :] // self.chunk
            visible &= key_block <= query_block
            if self.left_chunks >= 0:
                visible &= key_block >= query_block - self.left_chunks
        # (an OR with a mask made on the device: assigning a Python True copies it there, blocking)
        visible[:, :, slots:] |= torch.eye(frames, dtype=torch.bool, device=device)
        return visible

    @property
    def conv_shapes(self) -> list[tuple[int, int]]:
        """(left frames, input channels) of each causal conv's context, in :class:`StepState` order."""
        return [(c.kernel_size[0] - 1, c.in_channels) for c in self.conv_layers]

    @property
    def conv_width(self) -> int:
        """Values per row of :attr:`StepState.conv_all`."""
        return sum(frames * channels for frames, channels in self.conv_shapes)

    def new_state(self, rows: int, slots: int, frames: int) -> StepState:
        """Zeroed context of ``rows`` rows (fill it with :meth:`StepState.load_stream_states` or by earlier steps)."""
        kv_all = torch.zeros(len(self.attention_layers), rows, slots + frames, 2 * self.inner, device=self.device,
                             dtype=self.dtype)
        conv_all = torch.zeros(rows, self.conv_width, device=self.device, dtype=self.dtype)
        return StepState(kv_all, conv_all, list(kv_all.unbind(0)), conv_views(conv_all, self.conv_shapes))

    def input_buffer(self, rows: int, frames: int) -> torch.Tensor:
        """(rows, frames, in_channels) channels-last estimator input [x, mu, speaker, cond] (zeroed)."""
        return torch.zeros(rows, frames, self.decoder.in_channels, device=self.device, dtype=self.dtype)

    def _workspace(self, rows: int, frames: int) -> _Workspace:
        key = (current_lane(), rows, frames)
        if key not in self._workspaces:
            ff = self._stages[0][1][0].ff1.size(0)
            self._workspaces[key] = _Workspace(rows, frames, self.width, self.inner, ff, self.out_channels,
                                               self.device, self.dtype)
            if self.kernels == "triton":  # before any graph capture
                from . import fused_triton
                fused_triton.reserve_row_scratch(self.device, rows * frames, self.width)
        return self._workspaces[key]

    # -- the step -----------------------------------------------------------------------------
    def step(self, rows: StepRows, state: StepState, inp: torch.Tensor, time_bias: torch.Tensor,
             dt: torch.Tensor, update_input: bool = True,
             keep_context: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One guided Euler step of every row pair.

        inp (R, frames, in_channels): [x, mu, speaker, cond] channels-last (zeros after x in the
        unconditional rows); time_bias (resnets, R, width) per row (rows may sit at different
        steps); dt (R/2,). Writes the new frames' K/V into ``state`` and, with ``update_input``,
        x + dt v into ``inp``'s x channels. ``keep_context`` = (commit (R,) long, out (R, conv_width)):
        also write, per row, each causal conv's input frames just before new frame ``commit[r]``
        (the context of a next window that starts there) into ``out`` (:attr:`StepState.conv_all`
        layout). Returns views (valid until the next step of this shape) of x + dt v and the guided
        velocity v, both (R/2, frames, out_channels).
        """
        # padding frames of a captured shape skip their products (on the device: graphs replay it)
        linear, ws = functools.partial(self._linear, live=rows.valid), self._workspace(rows.rows, rows.frames)
        if keep_context is not None:
            linear = self._keeping_context(linear, *keep_context)
        convs, kvs = iter(state.conv), iter(state.kv)
        skip, mid_out = ws.up_in[:, :, self.width:], ws.up_in[:, :, :self.width]
        (down, down_blocks, down_conv), *mids, (up, up_blocks, up_conv) = self._stages
        resnets = iter(time_bias)

        def stage(res: _Resnet, blocks: list[_Transformer], stage_in: torch.Tensor, stream: torch.Tensor,
                  stage_out: torch.Tensor) -> None:
            linear(stage_in, res.block1.weight, out=ws.h1, taps=res.block1.taps, context=next(convs),
                   bias=res.block1.bias, ln=res.block1.ln, act=ACT_MISH, valid=rows.valid, row_vector=next(resnets))
            linear(ws.h1, res.block2.weight, out=stream, taps=res.block2.taps, context=next(convs),
                   bias=res.block2.bias, ln=res.block2.ln, act=ACT_MISH, valid=rows.valid,
                   gemm2=(stage_in, res.res, res.res_bias), ln_out=(*blocks[0].ln1, ws.h))
            self._transformers(linear, rows, blocks, kvs, ws, stream, stage_out)

        stage(down, down_blocks, inp, ws.stream[0], skip)
        stage_in = ws.stream[1] if mids else mid_out
        linear(skip, down_conv.weight, out=stage_in, taps=down_conv.taps, context=next(convs), bias=down_conv.bias)
        for j, (res, blocks, _) in enumerate(mids):
            stream = ws.stream[j % 2]  # the other one holds this stage's input
            stage(res, blocks, stage_in, stream, mid_out if j == len(mids) - 1 else stream)
            stage_in = stream
        stage(up, up_blocks, ws.up_in, ws.stream[0], ws.stream[0])
        linear(ws.stream[0], up_conv.weight, out=ws.h, taps=up_conv.taps, context=next(convs), bias=up_conv.bias)
        final = self._final
        linear(ws.h, final.weight, out=ws.h1, taps=final.taps, context=next(convs), bias=final.bias, ln=final.ln,
               act=ACT_MISH, valid=rows.valid)
        x = inp[:, :, :self.out_channels]
        self._cfg_euler(ws.h1, *self._proj, rows.valid, dt, x, ws.x_out, ws.velocity, self.cfg_rate, update_input)
        return ws.x_out, ws.velocity

    def _keeping_context(self, linear, commit: torch.Tensor, out: torch.Tensor):
        """``linear`` that also keeps each causal conv's input frames before ``commit`` (see :meth:`step`)."""
        kept = iter(conv_views(out, self.conv_shapes))

        def keeping(a: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor, taps: int = 1,
                    context: torch.Tensor | None = None, **epilogue) -> None:
            if taps > 1:
                # before the call: its output may be the next conv's input, never its own
                padded = torch.cat([context.to(a.dtype), a], dim=1)  # frame i of a sits at taps - 1 + i
                index = commit[:, None] + torch.arange(taps - 1, device=a.device)[None, :]
                next(kept).copy_(padded.gather(1, index[:, :, None].expand(-1, -1, a.size(2))))
            linear(a, w, out=out, taps=taps, context=context, **epilogue)
        return keeping

    def _transformers(self, linear, rows: StepRows, blocks: list[_Transformer], kvs, ws: _Workspace,
                      stream: torch.Tensor, stage_out: torch.Tensor) -> None:
        inner = self.inner
        for j, block in enumerate(blocks):
            kv = next(kvs)
            linear(ws.h, block.qkv, out=ws.q, split=(inner, kv[:, rows.slots:]))
            attended = self._attention(ws.q, kv, rows, ws.attended)
            linear(attended, block.out, out=stream, bias=block.out_bias, residual=stream, ln_out=(*block.ln3, ws.h))
            linear(ws.h, block.ff1, out=ws.ff, bias=block.ff1_bias, act=ACT_GELU)
            last = j == len(blocks) - 1
            linear(ws.ff, block.ff2, out=stage_out if last else stream, bias=block.ff2_bias, residual=stream,
                   ln_out=None if last else (*blocks[j + 1].ln1, ws.h))

    def _attention(self, q: torch.Tensor, kv: torch.Tensor, step_rows: StepRows, out: torch.Tensor) -> torch.Tensor:
        """q (R, n, inner), kv (R, keys, 2 inner) -> (R, n, inner) (``out`` on the Triton path)."""
        rows, frames, inner = q.shape
        heads, bias = self.heads, step_rows.attn_bias
        if not self.uses_bias(step_rows.streaming):
            from .attention_triton import block_attention
            return block_attention(q, kv, step_rows.valid, step_rows.device_context, step_rows.slots, heads,
                                   self.chunk, self.left_chunks, out)

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (heads, inner // heads)).transpose(1, 2)
        args = split_heads(q), split_heads(kv[:, :, :inner]), split_heads(kv[:, :, inner:])
        if self.attention_backends is None:
            out = F.scaled_dot_product_attention(*args, attn_mask=bias)
        else:
            with sdpa_kernel(self.attention_backends):
                out = F.scaled_dot_product_attention(*args, attn_mask=bias)
        return out.transpose(1, 2).reshape(rows, frames, inner)

    def euler(self, rows: StepRows, state: StepState, inp: torch.Tensor, dt: torch.Tensor,
              time_bias: torch.Tensor) -> torch.Tensor:
        """All Euler steps of rows without cached context (offline, or a final pass): dt (S,),
        time_bias (S, resnets, width) as from :meth:`schedule`. Returns x after the last step (a view)."""
        pairs = rows.rows // 2
        for step in range(dt.size(0)):
            x_out, _ = self.step(rows, state, inp, time_bias[step][:, None, :].expand(-1, rows.rows, -1),
                                 dt[step].expand(pairs))
        return x_out

    # -- helpers for callers and tests ----------------------------------------------------------
    def fill_input(self, inp: torch.Tensor, pairs: Sequence[int], x: torch.Tensor, mu: torch.Tensor,
                   spks: torch.Tensor, cond: torch.Tensor) -> None:
        """Write one request's window (channel-first x, mu, cond (1, 80, f); spks (1, 80)) into its row
        pair (conditional row, unconditional row), frames [0, f)."""
        frames = x.size(2)
        cond_row, uncond_row = pairs
        channels = [x, mu, spks[:, :, None].expand(-1, -1, frames), cond]
        inp[cond_row, :frames] = torch.cat(channels, dim=1)[0].T.to(inp.dtype)
        inp[uncond_row, :frames] = 0
        inp[uncond_row, :frames, :x.size(1)] = x[0].T.to(inp.dtype)
