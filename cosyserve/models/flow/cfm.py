"""Conditional flow matching sampler of the CosyVoice2 flow (upstream ``CausalConditionalCFM``).

Inference is deterministic: the initial noise is a fixed buffer (torch CPU generator seeded
with 0, shape (1, 80, 15000) = 300 s of mel) sliced from frame 0 on every call, so frame k
always gets the same noise whatever the chunking. Sampling = Euler steps on a cosine time grid
with classifier-free guidance (estimator batch: conditional rows, then rows with mu, speaker
and cond zeroed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ...errors import InvalidInputError
from .cache import StreamWindow
from .config import CFMConfig, EstimatorConfig
from .estimator import CausalConditionalDecoder

NOISE_SEED = 0
NOISE_CHANNELS = 80
NOISE_FRAMES = 15000
N_TIMESTEPS = 10  # upstream's flow always samples with 10 steps

def cosine_time_grid(n_steps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t_k = 1 − cos(k/n · π/2), k = 0..n, in the working dtype: upstream's cosine scheduler, the time
    grid of every flow here (CosyVoice2, CosyVoice3, Step-Audio2)."""
    u = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(u * 0.5 * torch.pi)


_noise_lock = threading.Lock()
_noise_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def fixed_noise(frames: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first ``frames`` frames (1, 80, frames) of the fixed CFM noise buffer.

    Drawn once per process from a private generator (global RNG state is left alone), then
    cached per device/dtype.
    """
    if frames > NOISE_FRAMES:
        raise InvalidInputError(
            f"flow input of {frames} mel frames exceeds the {NOISE_FRAMES}-frame noise buffer "
            f"({NOISE_FRAMES // 50} s of audio); split the request"
        )
    key = (torch.device(device), dtype)
    with _noise_lock:
        if key not in _noise_cache:
            base_key = (torch.device("cpu"), torch.float32)
            if base_key not in _noise_cache:
                generator = torch.Generator().manual_seed(NOISE_SEED)
                _noise_cache[base_key] = torch.randn([1, NOISE_CHANNELS, NOISE_FRAMES], generator=generator)
            _noise_cache[key] = _noise_cache[base_key].to(device=key[0], dtype=dtype)
        buffer = _noise_cache[key]
    return buffer[:, :, :frames]


class CausalConditionalCFM(nn.Module):
    def __init__(self, cfg: CFMConfig, estimator_cfg: EstimatorConfig) -> None:
        super().__init__()
        self.cfg_rate = cfg.inference_cfg_rate
        self.t_scheduler = cfg.t_scheduler
        self.estimator = CausalConditionalDecoder(estimator_cfg)

    def time_span(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The (n_timesteps + 1,) time grid from 0 to 1 (cosine: 1 - cos(t * pi / 2))."""
        if self.t_scheduler == "cosine":
            return cosine_time_grid(n_timesteps, device, dtype)
        return torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)

    @staticmethod
    def guidance_batch(x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                       spks: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Estimator inputs for classifier-free guidance: B conditional rows, then B with mu/spks/cond zeroed."""
        def with_zeros(v: torch.Tensor) -> torch.Tensor:
            return torch.cat([v, torch.zeros_like(v)])
        return (torch.cat([x, x]), torch.cat([mask, mask]), with_zeros(mu), t.reshape(-1).expand(2 * x.size(0)),
                with_zeros(spks), with_zeros(cond))

    def velocity(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                 spks: torch.Tensor, cond: torch.Tensor, *, streaming: bool,
                 window: StreamWindow | None = None, estimator: Callable | None = None) -> torch.Tensor:
        """Guided velocity (1 + r) * v_cond - r * v_uncond at time t.

        ``estimator``: a drop-in for ``self.estimator`` (a compiled version of it).
        """
        estimator = self.estimator if estimator is None else estimator
        out = estimator(*self.guidance_batch(x, mask, mu, t, spks, cond), streaming=streaming, window=window)
        conditional, unconditional = out.chunk(2)
        return (1.0 + self.cfg_rate) * conditional - self.cfg_rate * unconditional

    def euler_steps(self, z: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                    cond: torch.Tensor, *, streaming: bool, n_timesteps: int = N_TIMESTEPS,
                    windows: Sequence[StreamWindow] | None = None,
                    estimator: Callable | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (t passed to the estimator, state after the step) for each Euler step from z
        (:meth:`euler_schedule`). ``windows``: one stream window per step (each
        step's estimator pass has its own cached state), for an incremental stream. ``estimator``
        as in :meth:`velocity`.
        """
        x = z
        for step, (t, dt) in enumerate(self.euler_schedule(n_timesteps, mu.device, mu.dtype)):
            window = None if windows is None else windows[step]
            x = x + dt * self.velocity(x, mask, mu, t, spks, cond, streaming=streaming, window=window,
                                       estimator=estimator)
            yield t, x

    def euler_schedule(self, n_timesteps: int, device: torch.device,
                       dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(t, dt) of each Euler step. t accumulates dt (rather than reading the grid) exactly like
        upstream, so the t values differ from the grid in the last bits."""
        t_span = self.time_span(n_timesteps, device, dtype)
        t, dt, schedule = t_span[0], t_span[1] - t_span[0], []
        for step in range(1, n_timesteps + 1):
            schedule.append((t, dt))
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return schedule

    def forward(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, *,
                streaming: bool, n_timesteps: int = N_TIMESTEPS, temperature: float = 1.0) -> torch.Tensor:
        """mu, cond (B, 80, T); mask (B, 1, T); spks (B, 80) -> sampled mel (B, 80, T)."""
        z = fixed_noise(mu.size(2), mu.device, mu.dtype).expand(mu.size(0), -1, -1) * temperature
        for _, x in self.euler_steps(z, mask, mu, spks, cond, streaming=streaming, n_timesteps=n_timesteps):
            pass
        return x
