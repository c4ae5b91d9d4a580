"""Harmonic-plus-noise excitation of the HiFT vocoder (upstream SineGen2 + SourceModuleHnNSF).

The harmonic phase is accumulated at frame rate and interpolated back to samples with
``F.interpolate(mode="linear")`` exactly as upstream does: the phase reaches 1e4–1e5 radians,
so any other float32 operation order changes ``sin(phase)`` by ~1e-3 (fixture README §2, §5.4).
The phase is therefore always computed in float32, whatever the module dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class SourceNoise:
    """The random parts of one source computation, for every harmonic (fundamental included)."""

    initial_phase: torch.Tensor  # (B, H) cycles added to sample 0 of harmonics 2..H; column 0 is ignored
    sine_noise: torch.Tensor  # (B, L, H) standard normal, scaled by the voicing-dependent amplitude

    @classmethod
    def zeros(cls, batch: int, length: int, harmonics: int, device: torch.device | str) -> "SourceNoise":
        return cls(torch.zeros(batch, harmonics, device=device), torch.zeros(batch, length, harmonics, device=device))


def draw_source_noise(
    batch: int, length: int, harmonics: int, device: torch.device | str, generator: torch.Generator | None = None
) -> SourceNoise:
    """Make upstream's three draws, in its order, on ``generator`` (or the default generator of ``device``).

    1. ``rand(B, H)`` initial phases; 2. standard normal (B, L, H) sine noise; 3. ``randn(B, L, 1)``,
    which upstream computes for its noise branch and never uses: it is drawn only so that a seeded
    generator ends in the same state as the reference's.

    Draw 2 is upstream's ``randn_like`` of the sines, whose memory layout is (B, H, L) (they come
    out of a transposed interpolation); torch fills such a non-contiguous tensor element by element
    instead of with its vectorised contiguous kernel, so the same layout is needed for the same values.
    """
    draw_device = generator.device if generator is not None else torch.device(device)
    initial_phase = torch.rand(batch, harmonics, generator=generator, device=draw_device)
    sine_noise = torch.empty(batch, harmonics, length, device=draw_device).transpose(1, 2).normal_(generator=generator)
    torch.randn(batch, length, 1, generator=generator, device=draw_device)
    return SourceNoise(initial_phase.to(device), sine_noise.to(device))


class HarmonicSource(nn.Module):
    """Frame-rate F0 (B, T) → excitation (B, 1, T·upsample_scale): tanh(Linear(sines·uv + noise))."""

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ):
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.num_harmonics = harmonic_num + 1  # the fundamental plus `harmonic_num` overtones
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(self.num_harmonics, 1)

    def upsample_f0(self, f0: torch.Tensor) -> torch.Tensor:
        """(B, T) frame F0 → (B, L, 1) per-sample F0 (nearest neighbour)."""
        f0_samples = F.interpolate(f0[:, None].float(), scale_factor=float(self.upsample_scale), mode="nearest")
        return f0_samples.transpose(1, 2)

    def harmonic_sines(self, f0_samples: torch.Tensor, initial_phase: torch.Tensor) -> torch.Tensor:
        """(B, L, 1) per-sample F0 → (B, L, H) unit-amplitude sines of harmonics 1..H."""
        harmonics = torch.arange(1, self.num_harmonics + 1, dtype=torch.float32, device=f0_samples.device)
        cycles_per_sample = (f0_samples * harmonics / self.sampling_rate) % 1
        cycles_per_sample[:, 0, 1:] = cycles_per_sample[:, 0, 1:] + initial_phase[:, 1:]
        # Integrate at frame rate (each frame's value is read at its centre, so sample 0 and with it
        # the initial phase never matter for upsample_scale ≥ 3) and interpolate the phase back.
        scale = self.upsample_scale
        per_frame = F.interpolate(cycles_per_sample.transpose(1, 2), scale_factor=1 / scale, mode="linear")
        phase = torch.cumsum(per_frame.transpose(1, 2), dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=scale, mode="linear")
        return torch.sin(phase.transpose(1, 2))

    def forward(self, f0: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        f0_samples = self.upsample_f0(f0)
        sines = self.harmonic_sines(f0_samples, noise.initial_phase.float()) * self.sine_amp
        voiced = (f0_samples > self.voiced_threshold).float()
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        excitation = sines * voiced + noise_amp * noise.sine_noise.float()
        merged = torch.tanh(self.l_linear(excitation.to(self.l_linear.weight.dtype)))
        return merged.transpose(1, 2)
