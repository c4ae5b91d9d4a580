"""CAM++ (3D-Speaker's D-TDNN speaker encoder, ``campplus.onnx``) in PyTorch, batched over clips.

Input: mean-normalised 80-bin Kaldi fbank ``(B, T, 80)``; output: the 192-value x-vector.
Structure (module names are 3D-Speaker's, which the exported graph's node scopes carry):

* ``head`` (FCM): Conv2d 3x3 + BN + ReLU over (frequency, time), two ``layer``s of two residual
  blocks that halve the frequency axis, Conv2d 3x3 stride (2, 1) + BN + ReLU; flattened to
  channels x (80 / 8) per frame.
* ``xvector``: ``tdnn`` (Conv1d kernel 5, stride 2 in time + BN + ReLU); three dense blocks
  (12/24/16 layers, dilation 1/2/2) whose layers are BN-ReLU-Conv1x1-BN-ReLU then a CAM layer (a
  kernel-3 convolution gated by sigmoid(MLP(mean over the clip + mean over its 100-frame
  segment))), each output concatenated to the block input; after each block a ``transit``
  (BN-ReLU-Conv1x1 halving the channels); ``out_nonlinear`` BN-ReLU; ``stats`` (mean and
  unbiased standard deviation over time); ``dense`` (Conv1x1 to 192 + BN without affine).

The exporter folds a BatchNorm that follows a convolution into it (``head`` convolutions, ``tdnn``, the last ``transit``,
each dense layer's ``linear1``, ``dense``), so those convolutions take a bias here and their
BatchNorm is the identity unless the graph still holds it.

Batching: padded frames are zeroed before every convolution that looks across time, and the
clip/segment means and the statistics pooling count only each clip's frames, so each clip's
embedding is that of the clip alone (``lengths=None``: the single-clip graph of the ONNX file, in
its form: what the stand-in exporter traces). The batched form is written for few launches (a CUDA
graph of it is replayed per call): the dense blocks' layers write into one buffer, each CAM layer's
gate is computed per segment from one matrix product of means, and ReLUs zero the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from .onnx_weights import ScopedWeights, load_into

FEAT_DIM = 80
SEGMENT_FRAMES = 100
DENSE_BLOCKS = ((3, 1), (3, 2), (3, 2))  # (kernel, dilation) of block 1, 2, 3


@dataclass(frozen=True)
class CampplusSize:
    head_channels: int = 32
    init_channels: int = 128
    growth: int = 32
    bottleneck: int = 128  # bn_size 4 x growth
    layers: tuple[int, int, int] = (12, 24, 16)
    embedding: int = 192


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


def _seq(**modules: nn.Module) -> nn.Sequential:
    sequence = nn.Sequential()
    for name, module in modules.items():
        sequence.add_module(name, module)
    return sequence


class ResBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=(stride, 1)), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(_masked(x, mask))))
        out = self.bn2(self.conv2(_masked(out, mask)))
        return F.relu(out + self.shortcut(x))


class Fcm(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, stride=1, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(ResBlock(channels, channels, 2), ResBlock(channels, channels, 1))
        self.layer2 = nn.Sequential(ResBlock(channels, channels, 2), ResBlock(channels, channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_channels = channels * (FEAT_DIM // 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        mask = None if mask is None else mask[:, None, None, :]
        x = F.relu(self.bn1(self.conv1(_masked(x.unsqueeze(1), mask))))
        for block in (*self.layer1, *self.layer2):
            x = block(x, mask)
        x = F.relu(self.bn2(self.conv2(_masked(x, mask))))
        return x.reshape(x.shape[0], -1, x.shape[-1])


@dataclass(frozen=True)
class ClipFrames:
    """Which frames of a zero-padded batch belong to each clip, for every CAM layer of one call
    (computed once: each layer would otherwise rebuild it in a handful of small kernels)."""

    mask: torch.Tensor  # (B, 1, T): 1 inside the clip, 0 after it
    ceiling: torch.Tensor  # (B, 1, T): inf inside the clip, 0 after it
    floor: torch.Tensor  # 0-dim zero
    segment_means: torch.Tensor  # (B, S, T): it @ x^T = per 100-frame segment, its mean + the clip's

    @classmethod
    def of(cls, lengths: torch.Tensor, frames: int, dtype: torch.dtype) -> "ClipFrames":
        index = torch.arange(frames, device=lengths.device)
        segment = torch.arange(-(-frames // SEGMENT_FRAMES), device=lengths.device)
        # (B, S): each clip's frames in each segment, 1 past its end
        counts = (lengths[:, None] - segment[None, :] * SEGMENT_FRAMES).clamp(1, SEGMENT_FRAMES)
        inside = index[None, :] < lengths[:, None]  # (B, T)
        own_segment = (segment[:, None] == index[None, :] // SEGMENT_FRAMES).to(dtype)  # (S, T)
        segment_means = (own_segment[None] / counts[:, :, None].to(dtype)
                         + (1.0 / lengths.to(dtype))[:, None, None]) * inside[:, None, :].to(dtype)
        ceiling = torch.where(inside, float("inf"), 0.0).to(dtype)[:, None, :]
        return cls(inside.to(dtype)[:, None, :], ceiling, ceiling.new_zeros(()), segment_means)

    def relu_inside(self, x: torch.Tensor) -> torch.Tensor:
        """ReLU, and zeros after each clip, in one kernel."""
        return torch.clamp(x, min=self.floor, max=self.ceiling)


def _segment_frames(segments: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, C, S) per-segment values -> (B, C, frames): each frame gets its segment's."""
    return segments.unsqueeze(-1).expand(*segments.shape, SEGMENT_FRAMES).reshape(*segments.shape[:-1], -1)[..., :frames]


class CamLayer(nn.Module):
    def __init__(self, bottleneck: int, out_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.linear_local = nn.Conv1d(bottleneck, out_channels, kernel, padding=(kernel - 1) // 2 * dilation,
                                      dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(bottleneck, bottleneck // 2, 1)
        self.relu = nn.ReLU()
        self.linear2 = nn.Conv1d(bottleneck // 2, out_channels, 1)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor, clips: ClipFrames | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """With ``clips``, ``x`` is zero after each clip (the local convolution looks across time) and
        the result goes to ``out`` (a slice of the dense block's buffer) if given."""
        if clips is None:  # the released graph's form
            segments = F.avg_pool1d(x, SEGMENT_FRAMES, SEGMENT_FRAMES, ceil_mode=True)
            context = x.mean(-1, keepdim=True) + _segment_frames(segments, x.shape[-1])
            return self.linear_local(x) * self.sigmoid(self.linear2(self.relu(self.linear1(context))))
        # A frame's context (the clip's mean + its 100-frame segment's) is its segment's, so the gate
        # (the ReLU MLP, the sigmoid) is computed once per segment, in (segments, channels) rows: the
        # means are one matrix product, each 1x1 convolution one with its bias (and ReLU) applied in
        # it. A CUDA graph of CAM++ is ~1,000 small kernels: each one saved is time.
        batch, _, frames = x.shape
        context = torch.matmul(clips.segment_means, x.transpose(1, 2)).flatten(0, 1)  # (B S, C)
        hidden = torch._addmm_activation(self.linear1.bias, context, self.linear1.weight[:, :, 0].T)  # ReLU
        gate = torch.addmm(self.linear2.bias, hidden, self.linear2.weight[:, :, 0].T).sigmoid_()
        gate = gate.view(batch, -1, gate.size(1)).transpose(1, 2)  # (B, out, S)
        return torch.mul(self.linear_local(x), _segment_frames(gate, frames), out=out)


class DenseTdnnLayer(nn.Module):
    def __init__(self, in_channels: int, size: CampplusSize, kernel: int, dilation: int):
        super().__init__()
        self.nonlinear1 = _seq(batchnorm=nn.BatchNorm1d(in_channels), relu=nn.ReLU())
        self.linear1 = nn.Conv1d(in_channels, size.bottleneck, 1)
        self.nonlinear2 = _seq(batchnorm=nn.BatchNorm1d(size.bottleneck), relu=nn.ReLU())
        self.cam_layer = CamLayer(size.bottleneck, size.growth, kernel, dilation)

    def forward(self, x: torch.Tensor, clips: ClipFrames | None, out: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.linear1(self.nonlinear1(x))
        if clips is None:
            return self.cam_layer(self.nonlinear2(hidden), None)
        # the second ReLU zeroes the padding too
        return self.cam_layer(clips.relu_inside(self.nonlinear2.batchnorm(hidden)), clips, out)


class DenseTdnnBlock(nn.ModuleList):
    def __init__(self, n_layers: int, in_channels: int, size: CampplusSize, kernel: int, dilation: int):
        super().__init__()
        self.growth = size.growth
        for i in range(n_layers):
            self.add_module(f"tdnnd{i + 1}", DenseTdnnLayer(in_channels + i * size.growth, size, kernel, dilation))

    def forward(self, x: torch.Tensor, clips: ClipFrames | None) -> torch.Tensor:
        if clips is None:  # the released graph's form
            for layer in self:
                x = torch.cat([x, layer(x, None)], dim=1)
            return x
        # The input, then each layer's output, in one buffer: each layer reads the channels before its
        # own and writes its own (a concatenation copied the growing input once a layer); inference only.
        channels = x.shape[1]
        with torch.no_grad():
            out = x.new_empty(x.shape[0], channels + len(self) * self.growth, x.shape[2])
            out[:, :channels] = x
            for layer in self:
                layer(out[:, :channels], clips, out=out[:, channels:channels + self.growth])
                channels += self.growth
        return out


class TdnnLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 5, stride=2, padding=2)
        self.nonlinear = _seq(batchnorm=nn.BatchNorm1d(out_channels), relu=nn.ReLU())

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.nonlinear(self.linear(_masked(x, mask)))


def _stats(x: torch.Tensor, clips: ClipFrames | None, lengths: torch.Tensor | None) -> torch.Tensor:
    """Mean and unbiased standard deviation over each clip's frames."""
    if clips is None:
        return torch.cat([x.mean(-1), x.std(-1, unbiased=True)], dim=-1)
    count = lengths[:, None].to(x.dtype)
    mean = (x * clips.mask).sum(-1) / count
    variance = ((x - mean[..., None]) ** 2 * clips.mask).sum(-1) / (count - 1)
    return torch.cat([mean, variance.sqrt()], dim=-1)


class DenseLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 1)
        self.nonlinear = _seq(batchnorm=nn.BatchNorm1d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x.unsqueeze(-1)).squeeze(-1))


class Xvector(nn.Module):
    """The D-TDNN trunk after the head: frames (B, C, T) -> embedding (B, 192)."""

    def __init__(self, in_channels: int, size: CampplusSize):
        super().__init__()
        channels = size.init_channels
        self.tdnn = TdnnLayer(in_channels, channels)
        for index, (n_layers, (kernel, dilation)) in enumerate(zip(size.layers, DENSE_BLOCKS), start=1):
            self.add_module(f"block{index}", DenseTdnnBlock(n_layers, channels, size, kernel, dilation))
            channels += n_layers * size.growth
            self.add_module(f"transit{index}", _seq(nonlinear=_seq(batchnorm=nn.BatchNorm1d(channels), relu=nn.ReLU()),
                                                    linear=nn.Conv1d(channels, channels // 2, 1)))
            channels //= 2
        self.out_nonlinear = _seq(batchnorm=nn.BatchNorm1d(channels), relu=nn.ReLU())
        self.dense = DenseLayer(2 * channels, size.embedding)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, lengths: torch.Tensor | None) -> torch.Tensor:
        x = self.tdnn(x, None if mask is None else mask[:, None, :])
        clips = None
        if lengths is not None:
            lengths = (lengths - 1) // 2 + 1  # kernel 5, stride 2, padding 2
            clips = ClipFrames.of(lengths, x.shape[-1], x.dtype)
        for index in range(1, len(DENSE_BLOCKS) + 1):
            x = getattr(self, f"block{index}")(x, clips)
            x = getattr(self, f"transit{index}")(x)
        return self.dense(_stats(self.out_nonlinear(x), clips, lengths))


class Campplus(nn.Module):
    """``forward(feats (B, T, 80), lengths (B,) or None) -> (B, embedding)``."""

    def __init__(self, size: CampplusSize = CampplusSize()):
        super().__init__()
        self.size = size
        self.head = Fcm(size.head_channels)
        self.xvector = Xvector(self.head.out_channels, size)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        mask = None
        if lengths is not None:
            lengths = lengths.to(feats.device, torch.int64)
            mask = (torch.arange(feats.shape[1], device=feats.device)[None, :] < lengths[:, None]).to(feats.dtype)
        return self.xvector(self.head(feats.transpose(1, 2), mask), mask, lengths)


def _size_of(weights: ScopedWeights) -> CampplusSize:
    def out_channels(path: str) -> int:
        return int(weights.conv(path)["weight"].shape[0])

    layers = []
    for block in range(1, 4):
        prefix = f"xvector.block{block}.tdnnd"
        layers.append(sum(1 for scope in weights.by_module if scope.startswith(prefix) and scope.endswith(".cam_layer.linear_local")))
    return CampplusSize(head_channels=out_channels("head.conv1"), init_channels=out_channels("xvector.tdnn.linear"),
                        growth=out_channels("xvector.block1.tdnnd1.cam_layer.linear_local"),
                        bottleneck=out_channels("xvector.block1.tdnnd1.linear1"), layers=tuple(layers),
                        embedding=out_channels("xvector.dense.linear"))


def load_campplus(path: str | Path) -> Campplus:
    """Build a :class:`Campplus` of the file's size and load its weights (CPU, eval mode)."""
    weights = ScopedWeights(path)
    try:
        size = _size_of(weights)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path} is not a CAM++ speaker encoder: {exc}") from exc
    model = Campplus(size)
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            tensors = weights.conv(name)
            if module.bias is not None and "bias" not in tensors:
                tensors["bias"] = torch.zeros_like(module.bias).numpy()
            load_into(module, tensors, name, weights.path)
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            tensors = weights.batch_norm(name)
            if tensors is None:  # folded into the convolution before it: nothing left to do
                parent, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(parent), attribute, nn.Identity())
            else:
                load_into(module, tensors, name, weights.path)
    return model.eval()
