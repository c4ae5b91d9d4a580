"""DiT velocity estimator of the CosyVoice3 flow (upstream ``cosyvoice.flow.DiT.dit.DiT``).

An F5-TTS-style transformer: input projection of [x ‖ cond ‖ mu ‖ speaker] plus a causal
convolutional position embedding, adaLN-Zero blocks (attention + GELU-tanh feed-forward) and an
adaptive final norm. Sequences are time-major (B, T, D) inside. Parameter names follow
upstream so released ``flow.pt`` files load strictly. Differences from the Step-Audio-2 DiT
(:mod:`cosyserve.models.step_audio2`) that make it a different network: rotary positions (on the first
head only), no per-block convolution, no QK-norm, a learned position convolution at the input,
and sin-before-cos time features.

Attention masks (fixture README §4.3): full attention, or block-causal with blocks of
``static_chunk_size`` frames counted from frame 0 of prompt + target (query i sees key j iff
j < (⌊i/chunk⌋ + 1)·chunk).

:meth:`Cv3DiT.forward_window` runs the block-masked estimator on a window of frames that follows
frames already *committed* (complete blocks, whose values never change under block masks): it
attends to their cached keys/values and continues the causal position convolutions from their
cached inputs (:class:`WindowState`), so a stream recomputes only its incomplete block and new frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..step_audio2.estimator import modulate
from .config import Cv3EstimatorConfig

TIME_FREQ_DIM = 256  # width of the sinusoidal time features
TIME_SCALE = 1000.0
POS_CONV_KERNEL = 31
POS_CONV_GROUPS = 16
ROPE_BASE = 10000.0
NORM_EPS = 1e-6


def block_causal_mask(frames: int, chunk: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool: query i may attend key j iff j < (⌊i/chunk⌋ + 1)·chunk."""
    idx = torch.arange(frames, device=device)
    return idx[None, :] < ((idx // chunk + 1) * chunk)[:, None]


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x₂ₘ, x₂ₘ₊₁) -> (−x₂ₘ₊₁, x₂ₘ) for every interleaved pair of the last dim."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


class TimestepEmbedding(nn.Module):
    """t -> [sin(1000·t·f) ‖ cos(1000·t·f)], f_j = exp(−j·ln(10000)/(127)), then Linear, SiLU, Linear."""

    def __init__(self, dim: int):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQ_DIM // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        args = TIME_SCALE * t.float().unsqueeze(1) * freqs.unsqueeze(0)
        return self.time_mlp(torch.cat((args.sin(), args.cos()), dim=-1).to(self.time_mlp[0].weight.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two causal grouped convolutions (kernel 31, 16 groups), each followed by Mish."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D)."""
        return self.with_context(x, None)[0]

    def with_context(self, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) after ``context`` = the last kernel−1 inputs of each convolution (B, D, 30), zeros
        at the start. Returns the output (B, T, D) and the two convolutions' inputs (context included)."""
        if context is None:
            zeros = x.new_zeros(x.shape[0], x.shape[2], POS_CONV_KERNEL - 1)
            context = (zeros, zeros)
        inputs1 = torch.cat([context[0], x.transpose(1, 2)], dim=2)
        inputs2 = torch.cat([context[1], _conv_mish(self.conv1, inputs1)], dim=2)
        return _conv_mish(self.conv2, inputs2).transpose(1, 2), inputs1, inputs2


def _conv_mish(layer: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A position convolution and its Mish (``layer``: Conv1d, Mish). On a GPU, the convolution as one
    Triton kernel (:mod:`.conv_triton`: cuDNN runs its 16 groups as 16 kernels of ~35 us whatever the frames)."""
    conv, mish = layer
    if x.is_cuda and x.numel():
        from . import conv_triton
        if conv_triton.fits(x, conv):
            return mish(conv_triton.grouped_conv1d(x, conv))
    return layer(x)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: Cv3EstimatorConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim + cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim)

    def project(self, x, cond, mu, spks) -> torch.Tensor:
        """(B, T, 80) each, spks (B, 80) -> Linear([x ‖ cond ‖ mu ‖ spks]) (B, T, D) (upstream's order)."""
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        return self.proj(torch.cat((x, cond, mu, spks), dim=-1))

    def forward(self, x, cond, mu, spks) -> torch.Tensor:
        h = self.project(x, cond, mu, spks)
        return h + self.conv_pos_embed(h)  # h first: the sum takes its layout (see Cv3DiT.forward_window)


class RotaryEmbedding(nn.Module):
    """x-transformers' rotary embedding: angle(t, 2m) = angle(t, 2m+1) = t·base^(−2m/dim)."""

    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)  # in upstream's state dict, so persistent

    def angles(self, frames: int) -> torch.Tensor:
        """(T, dim) rotation angle of every position and channel."""
        positions = torch.arange(frames, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = positions[:, None] * self.inv_freq[None]
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)


def rotary(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of rotary ``angles``, computed once for every block."""
    return angles.cos(), angles.sin()


def rotate_leading_(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x (B, T, C) in place — upstream rotates the
    projection before splitting heads, so only head 0 gets positions; the rest pass through. The
    rotation is computed in the angles' dtype and rounded to x's, as upstream's concatenation and cast
    do; writing it in place spares copying (and upcasting) the other channels."""
    cos, sin = rotation
    head = x[..., :cos.shape[-1]]
    head.copy_(head * cos + rotate_pairs(head) * sin)
    return x


def rotate_queries_keys_(q: torch.Tensor, k: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> None:
    """:func:`rotate_leading_` of both q and k (B, T, C); on a GPU, in float32 or bfloat16, one Triton
    kernel rotates both (:mod:`.rotary_triton`: twelve small kernels a block otherwise)."""
    cos = rotation[0]
    pairs = cos.shape[-1] // 2
    if (q.is_cuda and q.stride(2) == 1 and k.stride(2) == 1 and pairs & (pairs - 1) == 0
            and torch.promote_types(q.dtype, cos.dtype) in (torch.float32, torch.bfloat16)):
        from .rotary_triton import rotate_queries_keys_ as rotate_on_gpu
        rotate_on_gpu(q, k, *rotation)
        return
    rotate_leading_(q, rotation)
    rotate_leading_(k, rotation)


def modulated_layer_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor | None = None,
                         y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', modulate(layer_norm(x'), shift, scale)) of x' = x + gate·y (``addcmul``; x itself without
    ``gate``): x, y (B, T, D), the modulation vectors (B, 1, D). On a GPU, x and y contiguous in float32 or
    bfloat16, one Triton kernel (:mod:`.norm_triton`: three or four broadcast elementwise kernels
    otherwise)."""
    if x.is_cuda and x.numel():
        from . import norm_triton
        if norm_triton.fits(x, shift, scale, gate, y):
            return norm_triton.modulated_norm(x, shift, scale, NORM_EPS, gate, y)
    if gate is not None:
        x = torch.addcmul(x, gate, y)  # x + gate·y in one pass over x (as modulate)
    return x, modulate(F.layer_norm(x, x.shape[-1:], eps=NORM_EPS), shift, scale)


class Attention(nn.Module):
    def __init__(self, cfg: Cv3EstimatorConfig):
        super().__init__()
        self.heads, self.dim_head = cfg.heads, cfg.dim_head
        self.to_q = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_k = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_v = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_out = nn.ModuleList([nn.Linear(cfg.inner_dim, cfg.dim)])  # key "to_out.0" (upstream: + Dropout)

    def forward(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor | None,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (B, T, D); rotation (:func:`rotary`, (T, dim_head) each) of x's positions; attn_mask
        broadcastable to (B, heads, T, T_past + T) (bool, or additive in x's dtype: :func:`additive_mask`)
        or None; cache: keys and values buffers (B, heads, T_past + T, dim_head) whose first T_past
        positions hold earlier positions' (x's are written after them, and attention reads the whole:
        no concatenation; the caller keeps x's keys, rotated, and values there)."""
        batch, frames, _ = x.shape
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        rotate_queries_keys_(q, k, rotation)
        q, k, v = (h.view(batch, frames, self.heads, self.dim_head).transpose(1, 2) for h in (q, k, v))
        if cache is not None:
            cache[0][:, :, -frames:].copy_(k)
            cache[1][:, :, -frames:].copy_(v)
            k, v = cache
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, frames, -1))


class AdaLayerNormZero(nn.Module):
    """SiLU(t_emb) -> Linear(D -> 6D) = shift, scale, gate (attention), shift, scale, gate (feed-forward)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(m.unsqueeze(1) for m in self.linear(F.silu(t_emb)).chunk(6, dim=-1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        # Keys ff.0.0 / ff.2 as upstream's Sequential(Sequential(Linear, GELU), Dropout, Linear).
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: Cv3EstimatorConfig):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim)
        self.attn = Attention(cfg)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x, t_emb, rotation, attn_mask, cache=None) -> torch.Tensor:
        """The block on x (B, T, D), attending also to the earlier keys/values of ``cache`` and
        writing x's there (:meth:`Attention.forward`)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t_emb)
        attn = self.attn(modulated_layer_norm(x, shift_msa, scale_msa)[1], rotation, attn_mask, cache)
        x, norm = modulated_layer_norm(x, shift_mlp, scale_mlp, gate_msa, attn)
        return torch.addcmul(x, gate_mlp, self.ff(norm))


class AdaLayerNormFinal(nn.Module):
    """SiLU(t_emb) -> Linear(D -> 2D) split into scale first, then shift."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        scale, shift = (m.unsqueeze(1) for m in self.linear(F.silu(t_emb)).chunk(2, dim=-1))
        return modulated_layer_norm(x, shift, scale)[1]


@dataclass(frozen=True)
class WindowState:
    """What the estimator keeps of one stream's committed frames [0, ``frames``), for every Euler step.
    Never changed in place (a commit makes new tensors), so streams may share one."""

    frames: int
    kv: torch.Tensor | None  # (steps, blocks, 2 (keys, values), B, heads, frames, dim_head), keys rotated
    conv_context: torch.Tensor | None  # (steps, 2 (convolutions), B, D, kernel − 1): their last inputs


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool attention mask as SDPA adds it (0 where attended, −inf elsewhere), made once for every
    block instead of by each attention call."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def window_mask(start: int, width: int, chunk: int, device: torch.device, past_frames: int | None = None,
                padded_width: int | None = None) -> torch.Tensor:
    """(W', P' + W') bool block mask of a window's queries (frames start.. of the stream) over
    [past keys ‖ window keys]. Past key j is frame j, valid below ``start``; window key k is frame
    start + k, valid below ``width``. ``past_frames`` P' ≥ start and ``padded_width`` W' ≥ width pad
    both to fixed shapes (CUDA graphs); the padding is never attended by a real query."""
    past_frames = start if past_frames is None else past_frames
    padded_width = width if padded_width is None else padded_width
    past, window = torch.arange(past_frames, device=device), torch.arange(padded_width, device=device)
    key_frame = torch.cat([past, start + window])
    valid = torch.cat([past < start, window < width])
    limit = ((start + window) // chunk + 1) * chunk  # a query sees the frames before the end of its block
    return (key_frame[None, :] < limit[:, None]) & valid[None, :]


class Cv3DiT(nn.Module):
    def __init__(self, cfg: Cv3EstimatorConfig):
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.out_channels)

    def attention_mask(self, mask: torch.Tensor, streaming: bool) -> torch.Tensor | None:
        """mask (B, 1, T) frame validity -> bool (B, 1, T, T) for SDPA, or None (all valid, full attention)."""
        frames = mask.shape[-1]
        keys = mask.bool()  # (B, 1, T): padded keys are never attended
        if not streaming:
            return None if bool(keys.all()) else keys.unsqueeze(1)
        blocks = block_causal_mask(frames, self.cfg.static_chunk_size, mask.device)
        return (blocks[None] & keys).unsqueeze(1)

    def forward(self, x, mask, mu, t, spks, cond, streaming: bool = False) -> torch.Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80) -> velocity (B, 80, T)."""
        t_emb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        rotation = rotary(self.rotary_embed.angles(h.shape[1]))
        attn_mask = additive_mask(self.attention_mask(mask, streaming), h.dtype)
        for block in self.transformer_blocks:
            h = block(h, t_emb, rotation, attn_mask)
        return self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)

    def window_geometry(self, start: int, width: int, past_frames: int | None = None,
                        padded_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary angles (W', dim_head) and attention mask (:func:`window_mask`) of a window of
        ``width`` frames at frame ``start``, optionally padded (past to P' frames, window to W')."""
        padded_width = width if padded_width is None else padded_width
        device = self.rotary_embed.inv_freq.device
        angles = self.rotary_embed.angles(start + padded_width)[start:]
        return angles, window_mask(start, width, self.cfg.static_chunk_size, device, past_frames, padded_width)

    def forward_window(self, x, mu, t, spks, cond, kv: torch.Tensor | None, conv_context: torch.Tensor | None,
                       angles: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block-masked velocity of a window of W frames that follows committed ones: x, mu, cond
        (B, 80, W), t (B,), spks (B, 80); ``kv`` (blocks, 2, B, heads, P + W, dim_head) the committed
        frames' keys/values at this Euler step in its first P frames (:func:`window_kv`), the
        window's written into its last W (None: no committed frames); ``conv_context`` (2, B, D, 30) the
        last inputs of the two position convolutions before the window (None: zeros); ``angles``,
        ``mask`` from :meth:`window_geometry`. Returns the velocity (B, 80, W), the window's keys/values
        (blocks, 2, B, heads, W, dim_head: a view of ``kv``) and the two convolutions' inputs (B, D,
        30 + W), context first. Pure tensor work without host synchronisation (capturable in a CUDA graph)."""
        t_emb = self.time_embed(t)
        proj = self.input_embed.project(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        context = None if conv_context is None else (conv_context[0], conv_context[1])
        pos, inputs1, inputs2 = self.input_embed.conv_pos_embed.with_context(proj, context)
        # proj first: an elementwise result takes its first operand's layout, and pos is the convolution's
        # output transposed (channels-first in memory). A channels-first h made every block's two layer
        # norms copy it and its residual adds run strided: ~50 us of copies a block at 4 jobs x 512 frames.
        h = proj + pos
        rotation, mask = rotary(angles), additive_mask(mask, h.dtype)
        if kv is None:
            kv = window_kv(None, h.shape[1], self.cfg, h)
        for index, block in enumerate(self.transformer_blocks):
            h = block(h, t_emb, rotation, mask, (kv[index, 0], kv[index, 1]))
        velocity = self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)
        return velocity, kv[..., -h.shape[1]:, :], inputs1, inputs2


def window_kv(past: torch.Tensor | None, width: int, cfg: Cv3EstimatorConfig, like: torch.Tensor) -> torch.Tensor:
    """The keys/values buffer of :meth:`Cv3DiT.forward_window`: ``past`` (blocks, 2, B, heads, P,
    dim_head; None: P = 0, B from ``like``) followed by room for a window of ``width`` frames."""
    rows = like.shape[0] if past is None else past.shape[2]
    frames = 0 if past is None else past.shape[4]
    kv = like.new_empty(cfg.depth, 2, rows, cfg.heads, frames + width, cfg.dim_head)
    if past is not None:
        kv[..., :frames, :].copy_(past)
    return kv


def commit_window(state: WindowState, kv: torch.Tensor, inputs1: torch.Tensor, inputs2: torch.Tensor,
                  commit: int) -> WindowState:
    """The state after a window's first ``commit`` frames: ``kv`` (steps, blocks, 2, B, heads, W', dim_head)
    and the convolution inputs (steps, B, D, 30 + W') of every Euler step (W' ≥ commit: padding ignored)."""
    new = kv[..., :commit, :]
    kv = new.clone() if state.kv is None else torch.cat([state.kv, new], dim=-2)
    end = POS_CONV_KERNEL - 1 + commit  # the convolution inputs end with the committed frames
    context = torch.stack([inputs1[..., end - (POS_CONV_KERNEL - 1):end],
                           inputs2[..., end - (POS_CONV_KERNEL - 1):end]], dim=1)
    return WindowState(state.frames + commit, kv, context)
