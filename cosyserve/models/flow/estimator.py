"""Causal U-Net style vector-field estimator of the flow (upstream ``CausalConditionalDecoder``).

Input (B, 320, T) = [x, mu, speaker vector over time, cond]; output the velocity (B, 80, T).
With the single ``channels`` entry of the released model there is no real down/up-sampling:
down stage (ResNet + transformers, skip, causal conv) -> mid stages -> up stage on [x, skip]
-> final causal block -> 1x1 projection. Convolutions are causal (left padding only) and
transformer attention is full or block-causal (chunks of ``static_chunk_size`` frames from frame 0).
Module names/indices mirror upstream (``block.0``/``block.2``, ``ff.net.0.proj``, ``to_out.0``)
so released checkpoints load strictly. Padded batches: frames where ``mask`` is 0 are zeroed
before every convolution and hidden as attention keys, so they never reach real frames.
Every layer also runs on a :class:`~.cache.StreamWindow` (incremental streaming): attention
then sees the cached keys/values of the frames before the window, causal convolutions their
cached left context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KeyValueCache, StreamWindow, with_left_context
from .config import EstimatorConfig
from .masks import chunk_mask

# Upstream evaluates the sinusoidal time embedding at 1000 * t.
TIME_SCALE = 1000.0


def sinusoidal_time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t (B,) in [0, 1] -> (B, dim): sin half then cos half, frequencies exp(-j ln(1e4) / (dim/2 - 1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


class CausalConv1d(nn.Conv1d):
    """Conv1d with (kernel-1) zeros on the left and none on the right."""

    def forward(self, x: torch.Tensor, window: StreamWindow | None = None) -> torch.Tensor:
        return super().forward(with_left_context(x, self.kernel_size[0] - 1, self, window))


class Transpose(nn.Module):
    """Swap channel and time axes (a parameter-free slot in upstream's Sequential)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """(x*mask) -> causal conv k3 -> LayerNorm over channels -> Mish -> *mask."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), Transpose(), nn.LayerNorm(dim_out), Transpose(), nn.Mish()
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor, window: StreamWindow | None = None) -> torch.Tensor:
        conv, *rest = self.block
        h = conv(x * mask, window)
        for layer in rest:
            h = layer(h)
        return h * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time_emb: torch.Tensor,
                window: StreamWindow | None = None) -> torch.Tensor:
        h = self.block1(x, mask, window) + self.mlp(time_emb).unsqueeze(-1)
        h = self.block2(h, mask, window)
        return h + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """Bias-free q/k/v of width heads*head_dim (independent of the block width), output Linear with bias."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, window: StreamWindow | None = None) -> torch.Tensor:
        """x (B, n, C); mask bool (B or 1, n or 1, keys), True = visible, or None.

        In a stream window the keys are the cached frames before the window, then the window's.
        """
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.to_q, self.to_k, self.to_v))
        if window is not None:
            k, v = window.state(self, KeyValueCache).extend(k, v, window.commit)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.unsqueeze(1))
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class GELUProjection(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(GELUProjection(dim, 4 * dim), nn.Dropout(dropout), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """diffusers ``BasicTransformerBlock`` restricted to self-attention: pre-norm attention + FF."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, window: StreamWindow | None = None) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), mask, window)
        return x + self.ff(self.norm3(x))


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalConditionalDecoder(nn.Module):
    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        (width,) = cfg.channels
        self.in_channels = cfg.in_channels
        self.static_chunk_size = cfg.static_chunk_size
        self.num_decoding_left_chunks = cfg.num_decoding_left_chunks
        time_dim = 4 * width
        self.time_mlp = TimestepEmbedding(cfg.in_channels, time_dim)

        def stage(dim_in: int) -> list[nn.Module]:
            blocks = nn.ModuleList(
                TransformerBlock(width, cfg.num_heads, cfg.attention_head_dim, cfg.dropout) for _ in range(cfg.n_blocks)
            )
            return [CausalResnetBlock1D(dim_in, width, time_dim), blocks]

        self.down_blocks = nn.ModuleList([nn.ModuleList(stage(cfg.in_channels) + [CausalConv1d(width, width, 3)])])
        self.mid_blocks = nn.ModuleList(nn.ModuleList(stage(width)) for _ in range(cfg.num_mid_blocks))
        self.up_blocks = nn.ModuleList([nn.ModuleList(stage(2 * width) + [CausalConv1d(width, width, 3)])])
        self.final_block = CausalBlock1D(width, width)
        self.final_proj = nn.Conv1d(width, cfg.out_channels, 1)
        self._init_weights()

    def _init_weights(self) -> None:
        # Upstream's initialiser: Kaiming-normal (ReLU gain) convs and linears, zero biases.
        for module in self.modules():
            if isinstance(module, (nn.Conv1d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def attention_mask(self, mask: torch.Tensor, streaming: bool,
                       window: StreamWindow | None = None) -> torch.Tensor:
        """(B, 1, n) frame mask -> bool (B, n or 1, keys) attention mask.

        Padding frames are hidden as keys; streaming adds the block-causal chunk mask. In a
        stream window the keys are the (all real) cached frames followed by the window's.
        """
        keys = mask.bool()
        start = 0 if window is None else window.start
        if start:
            keys = torch.cat([keys.new_ones(keys.size(0), 1, start), keys], dim=2)
        if not streaming:
            return keys
        return keys & chunk_mask(mask.size(-1), self.static_chunk_size, self.num_decoding_left_chunks,
                                 mask.device, query_start=start)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, *, streaming: bool,
                window: StreamWindow | None = None) -> torch.Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80) -> velocity (B, 80, T)."""
        time_emb = self.time_mlp(sinusoidal_time_embedding(t, self.in_channels).to(t.dtype))
        x = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)
        attn_mask = self.attention_mask(mask, streaming, window)

        resnet, blocks, downsample = self.down_blocks[0]
        skip = self._transformers(blocks, resnet(x, mask, time_emb, window), attn_mask, window)
        x = downsample(skip * mask, window)
        for resnet, blocks in self.mid_blocks:
            x = self._transformers(blocks, resnet(x, mask, time_emb, window), attn_mask, window)
        resnet, blocks, upsample = self.up_blocks[0]
        x = self._transformers(blocks, resnet(torch.cat([x, skip], dim=1), mask, time_emb, window), attn_mask, window)
        x = upsample(x * mask, window)
        x = self.final_block(x, mask, window)
        return self.final_proj(x * mask) * mask

    @staticmethod
    def _transformers(blocks: nn.ModuleList, x: torch.Tensor, attn_mask: torch.Tensor,
                      window: StreamWindow | None) -> torch.Tensor:
        """Run transformer blocks on channel-first x (B, C, T)."""
        x = x.transpose(1, 2).contiguous()
        for block in blocks:
            x = block(x, attn_mask, window)
        return x.transpose(1, 2).contiguous()
