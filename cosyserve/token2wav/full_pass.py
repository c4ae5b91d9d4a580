"""Non-streaming flow passes as jobs of a step loop: offline requests and the reference's final chunk.

The reference voices an offline request, and the last chunk of a stream, with one flow pass
over prompt + all tokens under full attention (``CosyVoice2Flow.inference(streaming=False)``):
nothing of a stream's incremental state can be reused for it. Here such a pass is a
:class:`FullPassJob` whose 10 guided Euler steps are taken one per :meth:`FullPass.step` call,
packed with the other passes under way (each at its own step, rows padded to the longest), so
that a long pass never holds up the windows of playing streams for more than one step. Its mel
equals the reference's up to float rounding (the same fused step computes it,
:class:`~cosyserve.models.flow.fused.FusedEstimator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.flow import CosyVoice2Flow, fixed_noise
from ..models.flow.fused import FusedEstimator
from .flow_engine import StepBuffers

# Rows of a packed pass are padded to a multiple of this many frames (masked, never returned).
FRAME_ALIGN = 16


@dataclass
class FullPassJob:
    """One pass: its conditions (channel-first (1, 80, frames)) and where its Euler loop stands."""

    mu: torch.Tensor
    spks: torch.Tensor  # (1, 80)
    cond: torch.Tensor
    prompt_frames: int
    x: torch.Tensor  # the ODE state before step ``step`` (the fixed noise at 0)
    steps: int
    streaming: bool  # block-causal attention (the re-run of a non-final chunk) or full (offline, final)
    skip_frames: int = 0  # leading target frames already voiced (a stream's chunks before)
    step: int = 0

    @property
    def frames(self) -> int:
        return self.x.size(2)

    @property
    def done(self) -> bool:
        return self.step == self.steps

    def target_mel(self) -> torch.Tensor:
        """The target frames not voiced before, (1, 80, f) float32."""
        return self.x[:, :, self.prompt_frames + self.skip_frames:].float()


class FullPass:
    """Packs the Euler steps of :class:`FullPassJob` s over one flow's fused estimator."""

    def __init__(self, flow: CosyVoice2Flow, fused: FusedEstimator, n_timesteps: int) -> None:
        self.flow, self.fused = flow, fused
        self.n_timesteps = n_timesteps
        _, self._dt, self._time_bias = fused.schedule(n_timesteps)

    @torch.inference_mode()
    def start(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
              embedding: torch.Tensor, skip_frames: int = 0, streaming: bool = False) -> FullPassJob:
        """A pass over prompt + ``tokens`` (1, n) (encoder run now); ``skip_frames`` target frames
        are not returned. ``streaming``: the reference's re-run of a non-final chunk (streaming
        masks, the last 3 tokens look-ahead only) instead of the final, full-attention pass."""
        c = self.flow.batch_conditions([tokens], [prompt_tokens], [prompt_feat], [embedding], streaming=streaming,
                                       finalize=not streaming)
        frames = c.frames[0]
        weight = self.fused.dtype
        return FullPassJob(c.mu[:, :, :frames].to(weight), c.spks.to(weight), c.cond[:, :, :frames].to(weight),
                           c.prompt_frames[0], fixed_noise(frames, self.fused.device, weight), self.n_timesteps,
                           streaming, skip_frames)

    @torch.inference_mode()
    def warm_up(self, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor,
                rows: tuple[int, ...] = (1, 2, 16), tokens: tuple[int, ...] = (20, 250)) -> None:
        """One step of passes of every size class the kernels are tuned for (few and short rows,
        many and long ones) in both attention kinds, so that their compilation happens now and not
        under a request."""
        for count in rows:
            for n in tokens:
                for streaming in (True, False):
                    job = self.start(torch.zeros(1, n, dtype=torch.long), prompt_tokens, prompt_feat, embedding,
                                     streaming=streaming)
                    self.step([job] + [FullPassJob(job.mu, job.spks, job.cond, job.prompt_frames, job.x, job.steps,
                                                   streaming) for _ in range(count - 1)])

    @torch.inference_mode()
    def step(self, jobs: list[FullPassJob]) -> None:
        """One guided Euler step of every job (each at its own step), in one estimator call; the
        jobs share their attention kind (:attr:`FullPassJob.streaming`)."""
        fused, count = self.fused, len(jobs)
        # padded to a multiple of FRAME_ALIGN: the kernels then see a few shapes, each compiled once
        frames = -(-max(job.frames for job in jobs) // FRAME_ALIGN) * FRAME_ALIGN
        buffers = StepBuffers(fused, count, frames, 0)
        buffers.set_rows(fused.rows([job.frames for job in jobs] * 2, [0] * (2 * count), frames, streaming=jobs[0].streaming,
                                    slots=0))
        for j, job in enumerate(jobs):
            fused.fill_input(buffers.inp, (j, count + j), job.x, job.mu, job.spks, job.cond)
        row_steps = torch.tensor([job.step for job in jobs] * 2, device=fused.device)
        buffers.time_bias.copy_(self._time_bias[row_steps].transpose(0, 1))
        buffers.dt.copy_(self._dt[row_steps[:count]])
        x_out, _ = fused.step(buffers.rows, buffers.state, buffers.inp, buffers.time_bias, buffers.dt)
        for j, job in enumerate(jobs):
            job.x = x_out[j, :job.frames].T[None].clone()
            job.step += 1
