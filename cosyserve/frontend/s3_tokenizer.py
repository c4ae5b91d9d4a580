"""The S3 speech tokenizer (CosyVoice2's v2, CosyVoice3's v3) in PyTorch, batched over clips.

Architecture of the released ONNX graphs (as the ``s3tokenizer`` package reads them; that package
is not used here because it imports torchaudio, which pins an older torch):

* two Conv1d(kernel 3, stride 2, padding 1) + GELU over the 128-bin Whisper log-mel (4x down);
* ``n_layers`` pre-norm blocks (v2: 6, v3: 12) of width D (1280), head size 64: self-attention
  with rotary position embedding (rotate-half form, base 10000) on queries and keys, q and k each
  scaled by head_size^-1/4, the key projection without bias, plus an FSMN memory (depthwise
  Conv1d kernel 31 over the values, residual) added to the attention output; a 4D GELU MLP;
* the FSQ quantiser: Linear D->8, tanh, x0.999, round to {-1, 0, 1}, +1, base-3 digits -> id.

Batching: clips are zero-padded to the longest; every convolution input and the FSMN input are
masked to each clip's length and padded keys get a -1e10 attention bias, so each clip's codes
are those of the clip alone. Module names equal the exported graph's node scopes, which is how
:func:`load_s3_tokenizer` finds the weights (``conv1``, ``blocks.N.attn.query``, ``quantizer.project_in``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from .onnx_weights import ScopedWeights, load_into

N_MELS = 128
HEAD_DIM = 64
FSMN_KERNEL = 31
FSQ_DIMS = 8  # 3^8 = 6561 codes
FSQ_SCALE = 0.9990000128746033  # keeps tanh's +-1 from rounding past the 3 levels
ROTARY_POSITIONS = 2048  # table length of the released graphs (82 s of tokens)
MASKED_SCORE = -1e10


def conv_out_length(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after one kernel-3, stride-2, padding-1 convolution."""
    return (lengths - 1) // 2 + 1


def token_lengths(mel_lengths: torch.Tensor) -> torch.Tensor:
    """Tokens of a clip of ``mel_lengths`` log-mel frames: ceil(ceil(L / 2) / 2)."""
    return conv_out_length(conv_out_length(mel_lengths))


def _frame_mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, frames) bool: frame t of clip b is inside the clip."""
    return torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]


def _rotary_table(positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(positions).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FsmnAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.heads = dim // HEAD_DIM
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.fsmn_block = nn.Conv1d(dim, dim, FSMN_KERNEL, groups=dim, bias=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, score_bias: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, frames, dim = x.shape
        q, k, v = (proj(x).view(batch, frames, self.heads, HEAD_DIM) for proj in (self.query, self.key, self.value))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        values = v.reshape(batch, frames, dim) * keep
        left = (FSMN_KERNEL - 1) // 2
        memory = self.fsmn_block(F.pad(values.transpose(1, 2), (left, FSMN_KERNEL - 1 - left))).transpose(1, 2)
        memory = (memory + values) * keep
        scale = HEAD_DIM ** -0.25
        scores = (q.permute(0, 2, 1, 3) * scale) @ (k.permute(0, 2, 3, 1) * scale) + score_bias
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        context = (weights @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).reshape(batch, frames, dim)
        return self.out(context) + memory


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attn = FsmnAttention(dim)
        self.attn_ln = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.mlp_ln = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x, keep, score_bias, cos, sin):
        x = x + self.attn(self.attn_ln(x), keep, score_bias, cos, sin)
        return x + self.mlp(self.mlp_ln(x))


class FsqQuantizer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.project_in = nn.Linear(dim, FSQ_DIMS)
        self.register_buffer("powers", 3.0 ** torch.arange(FSQ_DIMS, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        digits = (torch.tanh(self.project_in(x).float()) * FSQ_SCALE).round() + 1
        return (digits * self.powers).sum(-1).to(torch.int32)


class S3Tokenizer(nn.Module):
    """Log-mel ``(B, 128, T)`` + lengths ``(B,)`` -> codes ``(B, T')`` int32 and their lengths."""

    def __init__(self, dim: int = 1280, n_layers: int = 6):
        super().__init__()
        if dim % HEAD_DIM:
            raise ValueError(f"width {dim} is not a multiple of the head size {HEAD_DIM}")
        self.conv1 = nn.Conv1d(N_MELS, dim, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.quantizer = FsqQuantizer(dim)
        cos, sin = _rotary_table(ROTARY_POSITIONS, HEAD_DIM)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(self, mel: torch.Tensor, mel_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mel_lengths = mel_lengths.to(torch.int64)
        x = F.gelu(self.conv1(mel * _frame_mask(mel_lengths, mel.shape[2])[:, None, :].to(mel.dtype)))
        lengths = conv_out_length(mel_lengths)
        x = F.gelu(self.conv2(x * _frame_mask(lengths, x.shape[2])[:, None, :].to(x.dtype)))
        lengths = conv_out_length(lengths)
        x = x.transpose(1, 2)  # (B, T', D)
        valid = _frame_mask(lengths, x.shape[1])
        keep = valid[:, :, None].to(x.dtype)
        score_bias = torch.where(valid, 0.0, MASKED_SCORE).to(x.dtype)[:, None, None, :]
        frames = x.shape[1]
        cos, sin = self.rotary_cos[:frames, None, :], self.rotary_sin[:frames, None, :]
        for block in self.blocks:
            x = block(x, keep, score_bias, cos, sin)
        return self.quantizer(x), lengths.to(torch.int32)


def load_s3_tokenizer(path: str | Path) -> S3Tokenizer:
    """Build an :class:`S3Tokenizer` of the file's size and load its weights (CPU, eval mode)."""
    weights = ScopedWeights(path)
    conv1 = weights.conv("conv1")["weight"] if weights.node("conv1", "Conv") is not None else None
    n_layers = sum(1 for scope in weights.by_module if scope.startswith("blocks.") and scope.endswith(".attn.query"))
    if conv1 is None or conv1.ndim != 3 or conv1.shape[1] != N_MELS or n_layers == 0:
        raise ModelLoadError(f"{path} is not an S3 speech tokenizer (no 128-mel conv1 and attention blocks)")
    model = S3Tokenizer(int(conv1.shape[0]), n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            load_into(module, weights.linear(name, bias=module.bias is not None), name, weights.path)
        elif isinstance(module, nn.Conv1d):
            load_into(module, weights.conv(name), name, weights.path)
        elif isinstance(module, nn.LayerNorm):
            load_into(module, weights.layer_norm(name), name, weights.path)
    return model.eval()
