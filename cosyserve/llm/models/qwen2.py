"""Qwen2 decoder with the CosyVoice2 speech head, written for the slot KV cache.

Tokens are flattened: every call takes ``(tokens,)`` ids and positions and returns
``(tokens, hidden)`` states, whether the batch is a padded prefill or one token per request.
Projections are fused (q/k/v, gate/up) and residual adds are folded into the output matrix
products, to keep the kernel count of a decode step low. The head keeps only the rows of
``lm_head`` that can have a finite logit (speech tokens and eos), in float32.

With ``fused_decode`` set (the GPU default in bf16/fp16, see :mod:`..layers.fused`), a decode step
runs nine kernels a layer: qkv projection, rotary + cache write + split attention, the
combination of the splits, o_proj, residual add + RMSNorm, gate/up projection, SiLU * up, down
projection, residual add + the next RMSNorm. Prefill always runs the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import fused
from ..layers.attention import DecodeMetadata, PrefillMetadata, attention
from ..layers.rotary import RotaryEmbedding
from ..prompt import OUTPUT_WINDOW_SIZE
from .config import Qwen2Config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: Qwen2Config, rope: RotaryEmbedding, **factory):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True, **factory)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, **factory)
        self.rope = rope

    def forward(self, x, residual, cos_sin, k_cache, v_cache, meta) -> torch.Tensor:
        """Returns ``residual + o_proj(attention(x))``."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are rotated together: one rope call for both.
        qk = self.rope(qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim), cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        out = attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return torch.addmm(residual, out, self.o_proj.weight.t())

    def decode_fused(self, x, k_cache, v_cache, meta: DecodeMetadata) -> torch.Tensor:
        """``o_proj(attention(x))`` for one decode token per row (no residual)."""
        out = fused.decode_attention(self.qkv_proj(x), self.rope, k_cache, v_cache, meta, self.num_heads, self.scale)
        return torch.mm(out, self.o_proj.weight.t())


class MLP(nn.Module):
    def __init__(self, config: Qwen2Config, **factory):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Returns ``residual + mlp(x)``."""
        gate_up = self.gate_up_proj(x)
        act = F.silu(gate_up[:, : self.intermediate_size]) * gate_up[:, self.intermediate_size:]
        return torch.addmm(residual, act, self.down_proj.weight.t())

    def decode_fused(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(x)`` (no residual) with one kernel for SiLU * up."""
        return torch.mm(fused.silu_mul(torch.mm(x, self.gate_up_proj.weight.t())), self.down_proj.weight.t())


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config, rope: RotaryEmbedding, **factory):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, rope, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, **factory)

    def forward(self, hidden, cos_sin, k_cache, v_cache, meta) -> torch.Tensor:
        hidden = self.self_attn(self.input_layernorm(hidden), hidden, cos_sin, k_cache, v_cache, meta)
        return self.mlp(self.post_attention_layernorm(hidden), hidden)

    def decode_fused(self, x, residual, k_cache, v_cache, meta: DecodeMetadata, next_norm: RMSNorm | None):
        """``x`` is this layer's normed input; adds the layer's output to ``residual`` in place and
        returns ``next_norm(residual)`` (None after the last layer)."""
        post_norm = self.post_attention_layernorm
        x = fused.add_rms_norm(self.self_attn.decode_fused(x, k_cache, v_cache, meta), residual,
                               post_norm.weight, post_norm.eps)
        out = self.mlp.decode_fused(x)
        if next_norm is None:
            residual.add_(out)
            return None
        return fused.add_rms_norm(out, residual, next_norm.weight, next_norm.eps)


class SpeechHead(nn.Module):
    """The ``lm_head`` rows of the layout's output window in float32 (CosyVoice2: 151663..158226,
    speech tokens then eos1..eos3; CosyVoice3: 151924..158684, speech tokens then its 200 stop
    classes). Logits outside the window are never computed: sampling is restricted to it."""

    def __init__(self, hidden_size: int, device: torch.device, window_size: int = OUTPUT_WINDOW_SIZE):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(window_size, hidden_size, device=device))
        self.bias = nn.Parameter(torch.zeros(window_size, device=device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight, self.bias)


class Qwen2SpeechLM(nn.Module):
    def __init__(self, config: Qwen2Config, max_positions: int, device: torch.device, dtype: torch.dtype,
                 window_size: int = OUTPUT_WINDOW_SIZE):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.config = config
        self.rope = rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, dtype, device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, rope, **factory) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.head = SpeechHead(config.hidden_size, device, window_size)
        self.fused_decode = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta: PrefillMetadata | DecodeMetadata) -> torch.Tensor:
        """Hidden states before the final norm, (tokens, hidden); writes this batch's keys/values."""
        if self.fused_decode and isinstance(meta, DecodeMetadata):
            return self._decode_fused(input_ids, kv_cache, meta)
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rope.lookup(positions)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos_sin, *kv_cache.layer(index), meta)
        return hidden

    def _decode_fused(self, input_ids: torch.Tensor, kv_cache, meta: DecodeMetadata) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        first_norm = self.layers[0].input_layernorm
        x = fused.rms_norm(residual, first_norm.weight, first_norm.eps)
        for index, layer in enumerate(self.layers):
            next_norm = self.layers[index + 1].input_layernorm if index + 1 < len(self.layers) else None
            x = layer.decode_fused(x, residual, *kv_cache.layer(index), meta, next_norm)
        return residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the output window for the given rows of hidden states."""
        return self.head(self.norm(hidden))
