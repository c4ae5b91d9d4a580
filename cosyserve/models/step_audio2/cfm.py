"""Conditional flow matching around the DiT (upstream ``CausalConditionalCFM``).

10 explicit Euler steps on a cosine time grid with classifier-free guidance: every step runs
the estimator on [conditional rows ‖ unconditional rows] (mu, spks and cond zeroed) and uses
v = (1 + r)·v_cond − r·v_uncond with r = ``inference_cfg_rate`` (0.7).

Streaming noise comes from a fixed buffer ``rand_noise`` (1, 80, 30000): a chunk producing F
frames uses frames [offset, offset + F) with offset = the current attention-cache length. Upstream
draws the buffer from the process-global RNG (different in every process); we seed it, so a
given input always produces the same audio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cosyserve.errors import InvalidInputError

from ..flow.cfm import cosine_time_grid
from .config import StepAudio2FlowConfig
from .estimator import DiT

NOISE_SEED = 0


@dataclass
class EstimatorCache:
    """Per-ODE-step DiT caches of one streaming request (B conditional + B unconditional rows).

    cnn: (steps, depth, 2B, 2*hidden, 2); att: (steps, depth, 2B, heads, T_att, 2*head_dim),
    ordered newest chunk first.
    """

    cnn: torch.Tensor
    att: torch.Tensor

    @property
    def frames(self) -> int:
        return self.att.shape[4]

    def trimmed(self, keep_front: int, keep_back: int) -> "EstimatorCache":
        """Upstream's rule: past ``keep_front + keep_back`` frames keep the first ``keep_front``
        entries (the newest chunks) and the last ``keep_back`` (the oldest prompt frames)."""
        if self.frames <= keep_front + keep_back:
            return self
        att = torch.cat([self.att[:, :, :, :, :keep_front], self.att[:, :, :, :, self.frames - keep_back:]], dim=4)
        return EstimatorCache(self.cnn, att)


class StepAudio2CFM(nn.Module):
    def __init__(self, cfg: StepAudio2FlowConfig):
        super().__init__()
        self.estimator = DiT(cfg.estimator)
        self.cfg_rate = cfg.inference_cfg_rate
        self.n_timesteps = cfg.n_timesteps
        generator = torch.Generator().manual_seed(NOISE_SEED)
        noise = torch.randn(1, cfg.output_size, cfg.noise_frames, generator=generator)
        self.register_buffer("rand_noise", noise, persistent=False)

    def noise_slice(self, offset: int, frames: int) -> torch.Tensor:
        """Frames [offset, offset + frames) of the fixed buffer, (1, 80, frames)."""
        if offset + frames > self.rand_noise.shape[2]:
            raise InvalidInputError(
                f"{offset + frames} mel frames of initial noise needed; the fixed buffer holds "
                f"{self.rand_noise.shape[2]} (split the request)")
        return self.rand_noise[:, :, offset:offset + frames]

    def _euler(self, x: torch.Tensor, velocity) -> torch.Tensor:
        """Euler integration; time advances as t += dt, dt = t_{k+1} − t (upstream's bookkeeping)."""
        t_span = cosine_time_grid(self.n_timesteps, x.device, x.dtype)
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v_cond, v_uncond = velocity(step - 1, x, t).chunk(2, dim=0)
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x

    @staticmethod
    def _with_uncond(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([v, torch.zeros_like(v)], dim=0) for v in tensors]

    def solve(self, noise, mu, mask, spks, cond) -> torch.Tensor:
        """Full-sequence solve. noise, mu, cond (B, 80, T); mask (B, 1, T); spks (B, 80)."""
        mu2, spks2, cond2 = self._with_uncond(mu, spks, cond)
        mask2 = torch.cat([mask, mask], dim=0)

        def velocity(_step: int, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            x2 = torch.cat([x, x], dim=0)
            return self.estimator(x2, mask2, mu2, t.expand(x2.shape[0]), spks2, cond2)

        return self._euler(noise, velocity)

    def empty_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> EstimatorCache:
        cnn, att = self.estimator.empty_caches(2 * batch, device, dtype)
        steps = self.n_timesteps
        return EstimatorCache(cnn.unsqueeze(0).repeat(steps, 1, 1, 1, 1), att.unsqueeze(0).repeat(steps, 1, 1, 1, 1, 1))

    def solve_chunk(self, mu, spks, cond, cache: EstimatorCache) -> tuple[torch.Tensor, EstimatorCache]:
        """One streaming chunk: noise = rand_noise[offset : offset + F], offset = cache.frames.
        Step k reads and replaces the step-k caches. Returns the mel (B, 80, F) and the new cache."""
        batch, _, frames = mu.shape
        noise = self.noise_slice(cache.frames, frames).expand(batch, -1, -1).to(mu.dtype)
        mu2, spks2, cond2 = self._with_uncond(mu, spks, cond)
        new_cnn, new_att = [], []

        def velocity(step: int, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            x2 = torch.cat([x, x], dim=0)
            v, cnn, att = self.estimator.forward_chunk(
                x2, mu2, t.expand(x2.shape[0]), spks2, cond2, cache.cnn[step], cache.att[step])
            new_cnn.append(cnn)
            new_att.append(att)
            return v

        mel = self._euler(noise, velocity)
        return mel, EstimatorCache(torch.stack(new_cnn), torch.stack(new_att))
