"""Non-streaming flow passes as jobs of a step loop: offline requests and the reference's final chunk.

The reference voices an offline request, and the last chunk of a stream, with one flow pass
over prompt + all tokens under full attention (``CosyVoice2Flow.inference(streaming=False)``):
nothing of a stream's incremental state can be reused for it. Here such a pass is a
:class:`FullPassJob`; :meth:`FullPass.solve` takes the 10 guided Euler steps of a batch of them,
each step one estimator call over every pass (rows padded to the longest). Its mel
equals the reference's up to float rounding (the same fused step computes it,
:class:`~cosyserve.models.flow.fused.FusedEstimator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.flow import CosyVoice2Flow, fixed_noise
from ..models.flow.fused import FusedEstimator
from .step_graphs import GRAPH_PAIRS, EngineGraphs, StepBuffers

# Rows of an eager packed pass are padded to a multiple of this many frames (masked, never returned).
FRAME_ALIGN = 16
# Captured shapes of a packed pass: jobs as the window steps' (GRAPH_PAIRS), frames (prompt +
# speech) up to a 10 s prompt with 20 s of speech; bigger passes run eagerly.
GRAPH_FRAMES = (128, 256, 384, 512, 768, 1024, 1536)


@dataclass(frozen=True)
class PassInput:
    """What a pass voices: target ``tokens`` (1, n) after the prompt; ``skip_frames`` target frames
    were voiced before (by a stream's earlier chunks) and are not returned."""

    tokens: torch.Tensor
    prompt_tokens: torch.Tensor
    prompt_feat: torch.Tensor
    embedding: torch.Tensor
    skip_frames: int = 0


@dataclass
class FullPassJob:
    """One pass: its conditions (channel-first (1, 80, frames)) and where its Euler loop stands."""

    mu: torch.Tensor
    spks: torch.Tensor  # (1, 80)
    cond: torch.Tensor
    prompt_frames: int
    x: torch.Tensor  # the ODE state: the fixed noise, once solved the mel
    streaming: bool  # block-causal attention (the re-run of a non-final chunk) or full (offline, final)
    skip_frames: int = 0  # leading target frames already voiced (a stream's chunks before)
    solved: bool = False

    @property
    def frames(self) -> int:
        return self.x.size(2)

    @property
    def done(self) -> bool:
        return self.solved

    def target_mel(self) -> torch.Tensor:
        """The target frames not voiced before, (1, 80, f) float32."""
        return self.x[:, :, self.prompt_frames + self.skip_frames:].float()


class FullPass:
    """Solves batches of :class:`FullPassJob` s over one flow's fused estimator.

    With ``graphs`` (the window steps' :class:`~.step_graphs.EngineGraphs`), a step of up to
    ``GRAPH_PAIRS[-1]`` jobs of up to ``GRAPH_FRAMES[-1]`` frames replays a CUDA graph of its
    padded shape (captured when first used, or all at once by :meth:`capture_all`): an eager step
    costs ~300 kernel launches of host time. The graphs use the window graphs' key/value buffer
    and memory pool: the loop never runs both at once."""

    def __init__(self, flow: CosyVoice2Flow, fused: FusedEstimator, n_timesteps: int,
                 graphs: EngineGraphs | None = None) -> None:
        self.flow, self.fused = flow, fused
        self.n_timesteps = n_timesteps
        self.graphs = graphs
        _, self._dt, self._time_bias = fused.schedule(n_timesteps)
        self._captured: dict[tuple[int, int, bool], StepBuffers] = {}

    def _buffers(self, count: int, frames: int, streaming: bool) -> StepBuffers:
        pairs = next((p for p in GRAPH_PAIRS if count <= p), None)
        padded = next((f for f in GRAPH_FRAMES if frames <= f), None)
        if self.graphs is None or pairs is None or padded is None:
            return StepBuffers(self.fused, count, -(-frames // FRAME_ALIGN) * FRAME_ALIGN, 0, streaming=streaming)
        key = (pairs, padded, streaming)
        if key not in self._captured:
            buffers = StepBuffers(self.fused, pairs, padded, 0, kv=self.graphs.kv, streaming=streaming)
            if self.graphs.replay:
                buffers.capture(self.graphs.pool, self.graphs.lane)
            self._captured[key] = buffers
        return self._captured[key]

    @torch.inference_mode()
    def capture_all(self) -> None:
        for pairs in GRAPH_PAIRS:
            for frames in GRAPH_FRAMES:
                for streaming in (True, False):
                    self._buffers(pairs, frames, streaming)

    @torch.inference_mode()
    def start(self, passes: list[PassInput], streaming: bool = False) -> list[FullPassJob]:
        """Passes over prompt + tokens, their encoder run now as one batch. ``streaming``: the
        reference's re-run of non-final chunks (streaming masks, the last 3 tokens look-ahead only)
        instead of the final, full-attention pass."""
        c = self.flow.batch_conditions([p.tokens for p in passes], [p.prompt_tokens for p in passes],
                                       [p.prompt_feat for p in passes], [p.embedding for p in passes],
                                       streaming=streaming, finalize=not streaming)
        weight = self.fused.dtype
        return [FullPassJob(c.mu[b:b + 1, :, :frames].to(weight), c.spks[b:b + 1].to(weight),
                            c.cond[b:b + 1, :, :frames].to(weight), c.prompt_frames[b],
                            fixed_noise(frames, self.fused.device, weight), streaming, passes[b].skip_frames)
                for b, frames in enumerate(c.frames)]

    @torch.inference_mode()
    def warm_up(self, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor,
                rows: tuple[int, ...] = (1, 2, 16), tokens: tuple[int, ...] = (20, 250)) -> None:
        """Passes of every size class the kernels are tuned for (few and short rows,
        many and long ones) in both attention kinds, so that their compilation happens now and not
        under a request."""
        for count in rows:
            for n in tokens:
                for streaming in (True, False):
                    target = torch.zeros(1, n, dtype=torch.long)
                    self.solve(self.start([PassInput(target, prompt_tokens, prompt_feat, embedding)] * count,
                                          streaming))

    @torch.inference_mode()
    def solve(self, jobs: list[FullPassJob]) -> None:
        """Every guided Euler step of every job (none solved yet), each step one estimator call over
        all of them (the input is filled once; each step updates x in place); launched, not waited
        for. The jobs share their attention kind (:attr:`FullPassJob.streaming`)."""
        fused, count = self.fused, len(jobs)
        buffers = self._buffers(count, max(job.frames for job in jobs), jobs[0].streaming)
        pairs, frames = buffers.pairs, buffers.frames
        idle = [0] * (pairs - count)  # padding pairs of a captured shape: no frames
        buffers.set_rows(fused.rows(([job.frames for job in jobs] + idle) * 2, [0] * (2 * pairs), frames,
                                    streaming=jobs[0].streaming, slots=0))
        buffers.inp.zero_()
        for j, job in enumerate(jobs):
            fused.fill_input(buffers.inp, (j, pairs + j), job.x, job.mu, job.spks, job.cond)
        for step in range(self.n_timesteps):
            x_out = buffers.step(self._time_bias[step], self._dt[step])
        for j, job in enumerate(jobs):
            job.x = x_out[j, :job.frames].T[None].clone()
            job.solved = True
