"""DiT velocity estimator of the CosyVoice3 flow (upstream ``cosyvoice.flow.DiT.dit.DiT``).

An F5-TTS-style transformer: input projection of [x ‖ cond ‖ mu ‖ speaker] plus a causal
convolutional position embedding, adaLN-Zero blocks (attention + GELU-tanh feed-forward) and an
adaptive final norm. Sequences are time-major (B, T, D) inside. Parameter names follow
upstream so released ``flow.pt`` files load strictly. Differences from the Step-Audio-2 DiT
(:mod:`cosyserve.models.dit`) that make it a different network: rotary positions (on the first
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

from ..dit.estimator import modulate
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
        inputs2 = torch.cat([context[1], self.conv1(inputs1)], dim=2)
        return self.conv2(inputs2).transpose(1, 2), inputs1, inputs2


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
        return self.conv_pos_embed(h) + h


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


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``angles.shape[-1]`` channels of x (B, T, C) — upstream rotates the
    projection before splitting heads, so only head 0 gets positions; the rest pass through."""
    width = angles.shape[-1]
    rotated, rest = x[..., :width], x[..., width:]
    rotated = rotated * angles.cos() + rotate_pairs(rotated) * angles.sin()
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Cv3EstimatorConfig):
        super().__init__()
        self.heads, self.dim_head = cfg.heads, cfg.dim_head
        self.to_q = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_k = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_v = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_out = nn.ModuleList([nn.Linear(cfg.inner_dim, cfg.dim)])  # key "to_out.0" (upstream: + Dropout)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, attn_mask: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, D); angles (T, dim_head) of x's positions; attn_mask bool broadcastable to
        (B, heads, T, T_past + T) or None; past: keys and values (B, heads, T_past, dim_head) of earlier
        positions. Returns the output and x's own keys (rotated) and values."""
        batch, frames, _ = x.shape
        q = apply_rotary(self.to_q(x), angles)
        k = apply_rotary(self.to_k(x), angles)
        v = self.to_v(x)
        q, k, v = (h.view(batch, frames, self.heads, self.dim_head).transpose(1, 2) for h in (q, k, v))
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, frames, -1)), (k, v)


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

    def forward(self, x, t_emb, angles, attn_mask, past=None) -> torch.Tensor:
        return self.forward_with_kv(x, t_emb, angles, attn_mask, past)[0]

    def forward_with_kv(self, x, t_emb, angles, attn_mask, past=None):
        """The block on x (B, T, D), attending also to ``past`` keys/values; returns x and x's keys/values."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t_emb)
        norm = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)
        attn, kv = self.attn(modulate(norm, shift_msa, scale_msa), angles, attn_mask, past)
        x = x + gate_msa * attn
        norm = F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)
        return x + gate_mlp * self.ff(modulate(norm, shift_mlp, scale_mlp)), kv


class AdaLayerNormFinal(nn.Module):
    """SiLU(t_emb) -> Linear(D -> 2D) split into scale first, then shift."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        scale, shift = (m.unsqueeze(1) for m in self.linear(F.silu(t_emb)).chunk(2, dim=-1))
        return modulate(F.layer_norm(x, x.shape[-1:], eps=NORM_EPS), shift, scale)


@dataclass
class WindowState:
    """What the estimator keeps of the committed frames [0, frames) of one stream, for one Euler step."""

    frames: int
    keys: list[torch.Tensor]  # per block: (B, heads, frames, dim_head), rotated
    values: list[torch.Tensor]
    conv_context: tuple[torch.Tensor, torch.Tensor] | None  # last 30 inputs of each position conv (B, D, 30)


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
        angles = self.rotary_embed.angles(h.shape[1])
        attn_mask = self.attention_mask(mask, streaming)
        for block in self.transformer_blocks:
            h = block(h, t_emb, angles, attn_mask)
        return self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)

    def empty_window_state(self) -> WindowState:
        return WindowState(0, [None] * len(self.transformer_blocks), [None] * len(self.transformer_blocks), None)

    def forward_window(self, x, mu, t, spks, cond, state: WindowState, commit: int
                       ) -> tuple[torch.Tensor, WindowState]:
        """Block-masked velocity of frames [state.frames, state.frames + W): x, mu, cond (B, 80, W), t (B,),
        spks (B, 80). ``state.frames`` must be a multiple of the block size. Returns the velocity (B, 80, W)
        and the state with the window's first ``commit`` frames committed."""
        start, width, chunk = state.frames, x.shape[2], self.cfg.static_chunk_size
        if start % chunk or not 0 <= commit <= width:
            raise ValueError(f"window at frame {start} (block {chunk}) cannot commit {commit} of {width} frames")
        t_emb = self.time_embed(t)
        proj = self.input_embed.project(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        pos, inputs1, inputs2 = self.input_embed.conv_pos_embed.with_context(proj, state.conv_context)
        h = pos + proj
        angles = self.rotary_embed.angles(start + width)[start:]
        mask = block_causal_mask(start + width, chunk, x.device)[start:]
        keys, values = [], []
        for block, past_k, past_v in zip(self.transformer_blocks, state.keys, state.values):
            h, (k, v) = block.forward_with_kv(h, t_emb, angles, mask, None if past_k is None else (past_k, past_v))
            keys.append(k[:, :, :commit] if past_k is None else torch.cat([past_k, k[:, :, :commit]], dim=2))
            values.append(v[:, :, :commit] if past_v is None else torch.cat([past_v, v[:, :, :commit]], dim=2))
        context_end = POS_CONV_KERNEL - 1 + commit  # the convolution inputs end with the window's frames
        context = (inputs1[:, :, context_end - (POS_CONV_KERNEL - 1):context_end],
                   inputs2[:, :, context_end - (POS_CONV_KERNEL - 1):context_end])
        velocity = self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)
        return velocity, WindowState(start + commit, keys, values, context)
