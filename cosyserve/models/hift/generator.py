"""HiFT vocoder of CosyVoice2 (upstream ``cosyvoice.hifigan.generator.HiFTGenerator``, 24 kHz).

mel (B, 80, T) → F0 → harmonic excitation → [HiFi-GAN up-sampling fused with the excitation's
STFT at every stage] → log-magnitude and phase of a 16-point STFT → inverse STFT → 480·T samples.
Module and parameter names follow upstream so released ``hift.pt`` files load strictly.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from ...errors import InvalidInputError
from .config import HiftConfig
from .f0 import ConvF0Predictor
from .snake import Snake
from .source import HarmonicSource, SourceNoise, draw_source_noise

# exp(log-magnitude) is clipped here before the inverse STFT (upstream constant).
MAX_MAGNITUDE = 100.0
# Slope of the leaky ReLU before conv_post: upstream calls F.leaky_relu with its default.
POST_LRELU_SLOPE = 0.01
# Dtypes the up-sampling network may run in (set_network_dtype).
NETWORK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Children that stay float32 whatever the network's dtype: the F0 sets the voicing decision and the
# harmonic phase, which accumulates to 1e4–1e5 radians (fixture README §2), so a half-precision F0
# would change the waveform's phase, not just round it.
FLOAT32_CHILDREN = ("m_source", "f0_predictor")


@functools.lru_cache(maxsize=16)
def _dft_bases(n_fft: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (analysis (n_fft, 2·bins), synthesis (2·bins, n_fft)) of the one-sided DFT of n_fft
    points: a frame times the analysis is [real parts ‖ imaginary parts] of its rfft; [real ‖ imag]
    times the synthesis is irfft's frame (the imaginary parts of the first and last bin ignored)."""
    bins = n_fft // 2 + 1
    points = torch.arange(n_fft, dtype=torch.float64, device=device)  # built on the device: no copy, no sync
    angle = 2 * math.pi * torch.outer(points, points[:bins]) / n_fft
    analysis = torch.cat([torch.cos(angle), -torch.sin(angle)], dim=1)
    # irfft: every bin but the first (and the last, n_fft even) stands for itself and its mirror
    weight = torch.where((points[:bins] == 0) | (2 * points[:bins] == n_fft), 1.0, 2.0)
    synthesis = torch.cat([torch.cos(angle) * weight, -torch.sin(angle) * weight], dim=1).T / n_fft
    return analysis, synthesis.contiguous()


def stft_spectrum(x: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """``torch.stft(x, n_fft, hop, n_fft, window, center=True)`` (reflect padding) of x (B, L) as
    [real parts ‖ imaginary parts] (B, n_fft + 2, 1 + L // hop) float32, for both vocoders.

    The DFT of each windowed frame is a float64 matrix product, not an FFT. Why: cuFFT builds a plan
    for every new (rows, length) it meets, ~70 ms on the loop's thread with the GIL held (seen twice in
    one H100 trace of 16 CosyVoice3 streams with 8 new clips); a vocoder call's rows and lengths vary
    with the batch and every reply's last chunk, so plans kept being built under load. A product has
    no plan, whatever the shape, and in float64 no TF32 setting touches it."""
    padded = F.pad(x.float()[:, None], (n_fft // 2, n_fft // 2), mode="reflect")[:, 0]
    frames = padded.unfold(-1, n_fft, hop).double() * window.double()  # (B, frames, n_fft)
    return (frames @ _dft_bases(n_fft, x.device)[0]).float().transpose(1, 2)


def spectrum_to_wave(spectrum: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor,
                     audio_limit: float) -> torch.Tensor:
    """conv_post output (B, n_fft + 2, frames), log-magnitudes then raw phases -> waveform
    (B, hop·(frames − 1)) clamped to ±audio_limit, for both vocoders.

    The inverse STFT is ``torch.istft``'s (centred, window-normalised) computed as an inverse DFT
    (a float64 product, as :func:`stft_spectrum`'s: no cuFFT plan per shape), windowing and
    overlap-add, without its check of the window envelope on the host: that check is a device sync
    per call, which makes the loop's host wait for everything queued on the device (the flow's steps,
    a new voice's prompt) before it can plan the next chunks. The Hann envelope at these hops never
    vanishes inside the output."""
    bins = n_fft // 2 + 1
    spectrum = spectrum.float()
    magnitude = torch.exp(spectrum[:, :bins]).clamp(max=MAX_MAGNITUDE)
    phase = torch.sin(spectrum[:, bins:])  # upstream: a sine of the raw output, used as the angle
    parts = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)  # (B, 2·bins, frames)
    frames = (parts.transpose(1, 2).double() @ _dft_bases(n_fft, spectrum.device)[1]).float()
    frames = frames.transpose(1, 2) * window[:, None]  # (B, n_fft, frames)
    count = frames.size(2)
    length = n_fft + hop * (count - 1)
    fold = dict(output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop))
    wave = F.fold(frames, **fold)[:, 0, 0]
    envelope = F.fold(window.square()[None, :, None].expand(1, -1, count), **fold)[:, 0, 0]
    trim = slice(n_fft // 2, length - n_fft // 2)
    return (wave[:, trim] / envelope[:, trim]).clamp(-audio_limit, audio_limit)


class ResBlock(nn.Module):
    """For each dilation d: x ← x + conv_k(Snake(conv_k,d(Snake(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiftConfig):
        super().__init__()
        self.cfg = cfg
        self.hop_length = cfg.hop_length
        n_fft = cfg.istft_n_fft
        spectrum_channels = n_fft + 2  # real and imaginary parts of n_fft/2 + 1 bins
        stages = len(cfg.upsample_rates)

        # Registration order = upstream's, so state_dict() lists keys in the same order.
        self.m_source = HarmonicSource(
            cfg.sampling_rate, self.hop_length, cfg.nb_harmonics, cfg.nsf_alpha, cfg.nsf_sigma, cfg.nsf_voiced_threshold
        )
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, cfg.base_channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(
                cfg.base_channels // 2**i, cfg.base_channels // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        # The excitation's STFT enters stage i at that stage's frame rate: stride = product of the
        # up-sampling rates still to come (15, 3, 1 for 8·5·3).
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        source_blocks = zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)
        for i, (kernel, dilations) in enumerate(source_blocks):
            channels = cfg.base_channels // 2 ** (i + 1)
            stride = math.prod(cfg.upsample_rates[i + 1:])
            if stride == 1:
                self.source_downs.append(nn.Conv1d(spectrum_channels, channels, 1))
            else:
                down = nn.Conv1d(spectrum_channels, channels, 2 * stride, stride, padding=stride // 2)
                self.source_downs.append(down)
            self.source_resblocks.append(ResBlock(channels, kernel, dilations))
        self.resblocks = nn.ModuleList(
            ResBlock(cfg.base_channels // 2 ** (i + 1), k, d)
            for i in range(stages)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.conv_post = weight_norm(nn.Conv1d(cfg.base_channels // 2**stages, spectrum_channels, 7, padding=3))
        self.f0_predictor = ConvF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        # Periodic Hann computed in float64 like upstream's scipy window, then rounded.
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)

    # ----- weight norm -----

    def fold_weight_norm(self) -> "HiFTGenerator":
        """Replace every weight-normalised weight by its value g·v/‖v‖ (same outputs, no per-call
        recomputation). Afterwards state_dict() uses plain ``.weight`` keys."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self

    # ----- precision -----

    def set_network_dtype(self, dtype: torch.dtype) -> "HiFTGenerator":
        """Run the up-sampling network (conv_pre … conv_post) in ``dtype``; the F0 predictor, the
        excitation, the STFTs and the final clamp stay float32. float32 is the reference computation."""
        if dtype not in NETWORK_DTYPES:
            raise InvalidInputError(f"HiFT network dtype must be one of {NETWORK_DTYPES}, got {dtype}")
        for name, child in self.named_children():
            child.to(dtype=torch.float32 if name in FLOAT32_CHILDREN else dtype)
        return self

    @property
    def network_dtype(self) -> torch.dtype:
        return self.conv_pre.weight.dtype

    @property
    def source_dtype(self) -> torch.dtype:
        return self.m_source.l_linear.weight.dtype

    # ----- pieces (public for parity checks) -----

    def predict_f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) → F0 in Hz (B, T), in the F0 predictor's dtype.

        cuDNN's TF32 is off here (PyTorch enables it for convolutions by default): a TF32 F0 is
        off by ~1e-3 relative, which the accumulated sine phase turns into a different waveform
        (rel-L2 ~0.6 against the fixture instead of ~4e-3)."""
        cudnn = torch.backends.cudnn
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                         allow_tf32=False):
            return self.f0_predictor(mel.to(self.f0_predictor.classifier.weight.dtype))

    def compute_source(self, f0: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        """F0 (B, T) → excitation (B, 1, hop·T)."""
        return self.m_source(f0, noise)

    def predict_spectrum(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) + excitation (B, 1, L) → conv_post output (B, n_fft+2, L/istft_hop + 1):
        log-magnitudes then raw phases, in the network's dtype."""
        mel = mel.to(self.network_dtype)
        source_spec = self._stft(source.squeeze(1)).to(mel.dtype)
        x = self.conv_pre(mel)
        n_kernels = len(self.cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame: the STFT is centred
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            blocks = self.resblocks[i * n_kernels:(i + 1) * n_kernels]
            x = sum(block(x) for block in blocks) / n_kernels
        return self.conv_post(F.leaky_relu(x, POST_LRELU_SLOPE))

    def spectrum_to_wave(self, spectrum: torch.Tensor) -> torch.Tensor:
        """conv_post output → waveform (B, istft_hop·(frames−1)), clamped to ±audio_limit."""
        return spectrum_to_wave(spectrum, self.cfg.istft_n_fft, self.cfg.istft_hop_len, self.stft_window.float(),
                                self.cfg.audio_limit)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) + excitation (B, 1, hop·T) → speech (B, hop·T) float32."""
        return self.spectrum_to_wave(self.predict_spectrum(mel, source))

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        return stft_spectrum(x, self.cfg.istft_n_fft, self.cfg.istft_hop_len, self.stft_window)

    # ----- inference -----

    @torch.inference_mode()
    def inference(
        self,
        mel: torch.Tensor,
        cache_source: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        sine_noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (B, 80, T) → (speech (B, hop·T) float32, excitation (B, 1, hop·T)).

        ``cache_source`` (B, 1, C): its samples replace the first C excitation samples (streaming).
        Randomness: ``sine_noise`` (B, hop·T, H) injects the harmonic-source noise (no draws are
        made then); otherwise upstream's three draws are made on ``generator`` (or on the default
        generator of the model's device).
        """
        if mel.dim() != 3 or mel.shape[1] != self.cfg.in_channels or mel.shape[2] == 0:
            raise InvalidInputError(
                f"HiFT expects a mel of shape (B, {self.cfg.in_channels}, T>0), got {tuple(mel.shape)}")
        mel = mel.to(self.conv_pre.weight.device)
        batch, length = mel.shape[0], mel.shape[2] * self.hop_length
        harmonics = self.m_source.num_harmonics
        if sine_noise is not None:
            if tuple(sine_noise.shape) != (batch, length, harmonics):
                raise InvalidInputError(
                    f"sine_noise must have shape {(batch, length, harmonics)}, got {tuple(sine_noise.shape)}")
            no_phase = torch.zeros(batch, harmonics, device=mel.device)
            noise = SourceNoise(no_phase, sine_noise.to(mel.device, torch.float32))
        else:
            noise = draw_source_noise(batch, length, harmonics, mel.device, generator)

        source = self.compute_source(self.predict_f0(mel), noise)
        if cache_source is not None and cache_source.shape[-1] > 0:
            cached = cache_source.shape[-1]
            if cache_source.dim() != 3 or cache_source.shape[:2] != (batch, 1) or cached > length:
                raise InvalidInputError(
                    f"cache_source must have shape ({batch}, 1, C) with C <= {length}, got {tuple(cache_source.shape)}"
                )
            source[:, :, :cached] = cache_source.to(source.device, source.dtype)
        return self.decode(mel, source), source
