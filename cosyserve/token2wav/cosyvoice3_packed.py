"""Packed window sampling of the CosyVoice3 flow: one Euler step of many windows per estimator call.

A :class:`WindowJob` is one stream's window (the frames after its committed state, as
:meth:`~cosyserve.models.cosyvoice3.flow.Cv3FlowStream.push` samples them) or a full-attention pass
(the reference's re-run, offline requests). :meth:`PackedWindowSampler.step` advances every job
given by ONE Euler step in one :meth:`~cosyserve.models.cosyvoice3.dit.Cv3DiT.forward_window` call:
two CFG rows per job, each row at its own Euler step (its own t and dt), with its own rotary
positions (its start frame) and attention mask (block mask over its committed frames and window,
or full attention), its committed keys/values *of its step* gathered into a staging buffer. A
window's per-step keys/values and position-convolution inputs are kept so that, after its last
step, :meth:`WindowJob.state_after` commits it exactly as
:func:`~cosyserve.models.cosyvoice3.dit.commit_window` does.

Padding (``padded``, implied by ``cuda_graphs``): jobs are padded to a bucket (1, 2, 4, 8, 16), the
committed frames to a past bucket (padded keys masked) and windows to a width bucket (padded frames
are on the right: the position convolutions are causal and padded keys masked, so they change no
real frame, and are dropped). Every shape reads and writes leading views of one set of buffers;
the keys/values, staged past then the window's, live in one flat buffer (attention reads them in
place, each block writing its window's after the past), so a shape is allowed while jobs x past frames
stays within ``past_budget`` (and jobs x width within ``width_budget``): a step's jobs are cut
into the groups of shapes whose estimated time is least (jobs of alike shapes together, a job whose
padding would cost more than a call of its own apart), and jobs beyond every shape run eagerly, unpadded. On
CUDA each shape replays a CUDA graph (all graphs share one memory pool); :meth:`capture_all`
captures the whole grid at load so no capture happens under load. Nothing in :meth:`step`
synchronises with the device: per-row metadata (step, start, width, attention kind) goes over in
one pinned copy and everything else is derived on the device.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from itertools import product

import torch

from ..models.cosyvoice3.dit import POS_CONV_KERNEL, Cv3DiT, WindowState, commit_window
from ..models.cosyvoice3.flow import Cv3CFM, CosyVoice3Flow
from ..models.flow.cfm import N_TIMESTEPS, cosine_time_grid
from ..lru import LruCache
from ..runtime import LOOP_ROLE, bucket, host_to_device
from .graphs import capture_graph

log = logging.getLogger(__name__)

CONTEXT = POS_CONV_KERNEL - 1  # inputs a position convolution carries from before a window
# Graphed shapes. Coarse on purpose: every (jobs, past, width) within the budgets is one graph.
JOB_BUCKETS = (1, 2, 4, 8, 16)
PAST_BUCKETS = (0, 256, 512, 1024, 1536, 2048)  # committed frames, prompt included (50 per second)
WIDTH_BUCKETS = (64, 128, 192, 256, 384, 512)  # window frames
DEFAULT_PAST_BUDGET = 8192  # jobs x past frames of staged keys/values (~176 KiB each, bfloat16, real size)
DEFAULT_WIDTH_BUDGET = 4096  # jobs x window frames (the window keys/values out: the same per frame)
# A padded call's fixed device time in window frames of one job (_groups' cost): a replay's ~500
# kernels take a few microseconds each however small, about what 500 frames of one job take (one
# H100, 2026-12-07: a step of 8 jobs x 512 frames, 4,096 job-frames, took 26 ms).
GROUP_OVERHEAD_FRAMES = 500
RUN_PLANS_KEPT = 64  # _groups' cuts kept (the batches of a loop repeat their jobs' shapes at every step)
EMPTY_STATE = WindowState(0, None, None)


def euler_schedule(n_steps: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, dt) of every Euler step, computed as :meth:`Cv3CFM._integrate` accumulates them (t += dt
    in the working dtype), so a row at step k gets bit for bit the t and dt of a lone run."""
    t_span = cosine_time_grid(n_steps, device, dtype)
    t, dt, ts, dts = t_span[0], t_span[1] - t_span[0], [], []
    for step in range(1, n_steps + 1):
        ts.append(t)
        dts.append(dt)
        t = t + dt
        if step < n_steps:
            dt = t_span[step + 1] - t
    return torch.stack(ts), torch.stack(dts)


def row_geometry(dit: Cv3DiT, start: torch.Tensor, width: torch.Tensor, full: torch.Tensor, past: int,
                 padded_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Cv3DiT.window_geometry` per row, on the device: ``start``, ``width`` (R,) int64 and
    ``full`` (R,) bool (full attention over the window, no past) -> rotary angles (R, W', dim_head)
    and the mask (R, W', P' + W') over [past keys ‖ window keys] (past key j valid below the row's
    start, window key k below its width)."""
    window = torch.arange(padded_width, device=start.device)
    frames = start[:, None] + window[None]  # stream frame of every window position
    inv_freq = dit.rotary_embed.inv_freq
    freqs = frames.type_as(inv_freq)[..., None] * inv_freq
    angles = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    chunk = dit.cfg.static_chunk_size
    block_end = (frames // chunk + 1) * chunk - start[:, None]  # window keys before the query's block end
    sees = (window[None, None, :] < block_end[:, :, None]) | full[:, None, None]
    sees = sees & (window[None, :] < width[:, None])[:, None, :]
    past_keys = (torch.arange(past, device=start.device)[None] < start[:, None])[:, None, :]
    return angles, torch.cat([past_keys.expand(-1, padded_width, -1), sees], dim=2)


@dataclass(frozen=True)
class ConditionRow:
    """What :func:`token_conditions` needs of one window: the host ids (n,) of prompt + target tokens
    (raw, validated), the window's first frame (a whole token's: a multiple of ``token_mel_ratio``),
    whether the tokens are final (else their last ``pre_lookahead_len`` are look-ahead only) and the
    prompt mel (1, 2P, 80) on the device."""

    ids: torch.Tensor
    start: int
    finalize: bool
    prompt_feat: torch.Tensor


# The conditions' call pads its rows to these counts and its tokens to a multiple of CONDITION_TOKENS:
# cuDNN builds its plans per input shape (~4 ms of host time each on an H100, with the GIL held), and a
# new clip's prompt length, or a stream's growing token count, would otherwise be a new shape every time.
CONDITION_ROWS = (1, 2, 4, 8, 16)
CONDITION_TOKENS = 64
CONDITION_WARM_TOKENS = 1024  # token widths up to this are built at warm-up (a 30 s prompt and its first chunk)


def token_conditions(flow: CosyVoice3Flow, rows: list[ConditionRow], device: torch.device
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """mu and cond (1, 80, end − start) of each row's window, frames [start, end) of prompt + target
    tokens: :meth:`CosyVoice3Flow.prepare`'s arithmetic without its checks (its ``int(max)`` waits for
    the device), for every row in one call. A window's frames depend only on its tokens, the
    ``pre_lookahead_len`` after them (the look-ahead convolution) and the two before them (the causal
    one): each row embeds just those, not the whole sequence again at every chunk. The rows go over in
    one pinned copy, padded (-1, embedded as zeros: what the reference's padding and the final call's
    zero look-ahead are); padding changes no frame of a row, only the call's shape."""
    cfg, layer = flow.cfg, flow.pre_lookahead_layer
    ratio, lookahead, behind = cfg.token_mel_ratio, cfg.pre_lookahead_len, layer.conv2.kernel_size[0] - 1
    spans = []  # (first embedded token, tokens dropped before the window, the window's tokens)
    for row in rows:
        first_token = row.start // ratio
        begin = max(0, first_token - behind)
        spans.append((begin, first_token - begin, row.ids.shape[0] - (0 if row.finalize else lookahead) - first_token))
    longest = max(row.ids.shape[0] - begin for row, (begin, _, _) in zip(rows, spans))
    width = -(-(longest + lookahead) // CONDITION_TOKENS) * CONDITION_TOKENS  # room for a zero look-ahead
    ids = torch.full((bucket(len(rows), CONDITION_ROWS) or len(rows), width), -1, dtype=torch.long)
    for index, (row, (begin, _, _)) in enumerate(zip(rows, spans)):
        ids[index, :row.ids.shape[0] - begin] = row.ids[begin:]
    ids = host_to_device(ids, device)
    emb = flow.input_embedding(ids.clamp(min=0)) * (ids >= 0).unsqueeze(-1)
    # every row's frames as the final call's: past a row's tokens its look-ahead reads zeros, as
    # F.pad's; a non-final row's last pre_lookahead_len tokens are only look-ahead (dropped below)
    h = layer(emb[:, :-lookahead], context=emb[:, -lookahead:]) if lookahead else layer(emb)
    mu = h.repeat_interleave(ratio, dim=1).transpose(1, 2)
    cond = torch.zeros_like(mu)
    out = []
    for index, (row, (_, skip, tokens)) in enumerate(zip(rows, spans)):
        frames, prompt = ratio * tokens, row.prompt_feat.shape[1] - row.start
        if prompt > 0:
            cond[index, :, ratio * skip:ratio * skip + min(prompt, frames)] = \
                row.prompt_feat[0, row.start:row.start + min(prompt, frames)].T
        window = slice(ratio * skip, ratio * skip + frames)
        out.append((mu[index:index + 1, :, window], cond[index:index + 1, :, window]))
    return out


def warm_up_conditions(flow: CosyVoice3Flow, prompt_feat: torch.Tensor, device: torch.device) -> None:
    """One :func:`token_conditions` call of every padded shape up to :data:`CONDITION_WARM_TOKENS`
    tokens, so that cuDNN's plans exist before the first streams (on the thread that calls it later:
    cuDNN keeps them per thread)."""
    for rows in CONDITION_ROWS:
        for width in range(CONDITION_TOKENS, CONDITION_WARM_TOKENS + 1, CONDITION_TOKENS):
            ids = torch.zeros(width - flow.cfg.pre_lookahead_len, dtype=torch.long)
            token_conditions(flow, [ConditionRow(ids, 0, True, prompt_feat)] * rows, device)


@dataclass(eq=False)
class WindowJob:
    """One window (or full pass) under way; :attr:`x` is its ODE state before Euler step ``step``."""

    state: WindowState  # committed frames the window follows (its start); EMPTY_STATE for a full pass
    planes: torch.Tensor  # (3, 80, W): x ‖ mu ‖ cond, one tensor so that a step loads it in one copy
    spks: torch.Tensor  # (1, 80)
    keep: int  # leading window frames whose per-step keys/values and conv inputs are kept (state_after)
    full: bool = False  # full attention over the window (no past, no block mask)
    step: int = 0
    kv: torch.Tensor | None = None  # (steps, blocks, 2, 2, heads, keep, dim_head)
    inputs1: torch.Tensor | None = None  # (steps, 2, D, 30 + keep): the position convolutions' inputs
    inputs2: torch.Tensor | None = None

    @property
    def start(self) -> int:
        return self.state.frames

    @property
    def x(self) -> torch.Tensor:
        """(1, 80, W): the noise before the first step, the sampled window after the last."""
        return self.planes[:1]

    @property
    def width(self) -> int:
        return self.planes.shape[2]

    @property
    def done(self) -> bool:
        return self.step == N_TIMESTEPS

    def state_after(self, frames: int) -> WindowState:
        """The stream's state with the window's first ``frames`` (≤ keep) frames committed (after the last step)."""
        if not frames:
            return self.state
        if not self.done or frames > self.keep:
            raise ValueError(f"cannot commit {frames} frames of a window at step {self.step} keeping {self.keep}")
        return commit_window(self.state, self.kv, self.inputs1, self.inputs2, frames)

    def release(self) -> None:
        """Drop what only a commit needs (keys/values of every step)."""
        self.kv = self.inputs1 = self.inputs2 = None
        self.keep = 0


@dataclass
class _StepBuffers:
    """One packed call's inputs: R jobs (2R CFG rows), P staged past frames, W window frames."""

    meta: torch.Tensor  # (R, 4) int64: step, start, width, full
    planes: torch.Tensor  # (R, 3, 80, W): x ‖ mu ‖ cond
    spks: torch.Tensor  # (R, 80)
    kv: torch.Tensor  # (blocks, 2, 2R, heads, P + W, dim_head): staged past, then the window's (out)
    conv: torch.Tensor  # (2, 2R, D, 30)

    @property
    def shape(self) -> tuple[int, int, int]:
        width = self.planes.shape[3]
        return self.planes.shape[0], self.kv.shape[4] - width, width


class PackedWindowSampler:
    """Steps :class:`WindowJob` s of one flow decoder (see the module docstring). ``padded``: run the
    bucketed shapes (eagerly unless ``cuda_graphs``); ``cuda_graphs`` implies ``padded``. A shape is
    captured the first time it is seen after ``capture_after`` eager runs (None: only shapes of
    :meth:`capture_all`; a capture that fails leaves that shape eager). Its graphs are captured on the
    CUDA stream of ``role`` (:func:`~cosyserve.runtime.role_stream`: a sampler whose steps may run beside
    another's has a role of its own). Thread-safe (steps are serialised)."""

    def __init__(self, decoder: Cv3CFM, *, padded: bool = False, cuda_graphs: bool = False, role: str = LOOP_ROLE,
                 job_buckets: tuple[int, ...] = JOB_BUCKETS, past_buckets: tuple[int, ...] = PAST_BUCKETS,
                 width_buckets: tuple[int, ...] = WIDTH_BUCKETS, past_budget: int = DEFAULT_PAST_BUDGET,
                 width_budget: int = DEFAULT_WIDTH_BUDGET, capture_after: int | None = 0):
        self.decoder = decoder
        param = next(decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda_graphs = cuda_graphs
        self.role = role
        self.padded = padded or cuda_graphs
        self.job_buckets, self.past_buckets, self.width_buckets = job_buckets, past_buckets, width_buckets
        self.past_budget, self.width_budget = past_budget, width_budget
        self.capture_after = capture_after
        self._t, self._dt = euler_schedule(N_TIMESTEPS, self.device, self.dtype)
        cfg = decoder.estimator.cfg
        if cfg.mu_dim != cfg.mel_dim:
            raise ValueError("packed windows keep x, mu and cond in one tensor: mu_dim must be mel_dim")
        self._frame_kv = cfg.depth * 2 * 2 * cfg.heads * cfg.dim_head  # staged elements per job-frame
        self._staging: dict[str, torch.Tensor] | None = None
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._seen: Counter = Counter()
        self._failed: set[tuple[int, int, int]] = set()
        self._runs: LruCache[tuple, list] = LruCache(RUN_PLANS_KEPT)  # _groups' cuts by the jobs' (width, start)
        # Keys over which a frame's attention costs as much as its projections and feed-forward
        # (2·keys·inner against 4·dim·inner + 2·dim·ff MACs a frame): 4,096 at the released size.
        self._attention_keys = 2 * cfg.dim + cfg.dim * cfg.dim * cfg.ff_mult / cfg.inner_dim
        self._pool = None
        self._lock = threading.Lock()
        self.calls = self.eager_calls = self.replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ----- jobs -----

    def new_job(self, state: WindowState, z: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor,
                spks: torch.Tensor, keep: int = 0, full: bool = False) -> WindowJob:
        """A window of ``z`` (the fixed noise of its frames), ``mu``, ``cond`` (1, 80, W), ``spks``
        (1, 80) after ``state``; ``full``: a full-attention pass (``state`` must be empty)."""
        if full and state.frames:
            raise ValueError("a full-attention pass has no committed frames")
        if not 0 <= keep <= z.shape[2]:
            raise ValueError(f"cannot keep {keep} frames of a {z.shape[2]}-frame window")
        job = WindowJob(state, torch.cat([z, mu, cond]), spks, keep, full)
        if keep:
            cfg = self.decoder.estimator.cfg
            job.kv = z.new_empty(N_TIMESTEPS, cfg.depth, 2, 2, cfg.heads, keep, cfg.dim_head)
            job.inputs1 = z.new_empty(N_TIMESTEPS, 2, cfg.dim, CONTEXT + keep)
            job.inputs2 = torch.empty_like(job.inputs1)
        return job

    @torch.inference_mode()
    def step(self, jobs: list[WindowJob]) -> None:
        """One Euler step of every job (none done), packed (see the module docstring)."""
        if any(job.done for job in jobs):
            raise ValueError("a done window job cannot step")
        with self._lock:
            for group, shape in self._groups(jobs):
                self._run(group, shape)

    def _shape(self, jobs: int, past: int, width: int) -> tuple[int, int, int] | None:
        """The padded shape of ``jobs`` jobs whose longest past and window are ``past`` and ``width``
        frames, None when it is outside the grid."""
        rows = bucket(jobs, self.job_buckets)
        past = bucket(past, self.past_buckets)
        width = bucket(width, self.width_buckets)
        if rows is None or past is None or width is None or rows * past > self.past_budget \
                or rows * width > self.width_budget:
            return None
        return rows, past, width

    def _cost(self, shape: tuple[int, int, int]) -> float:
        """A padded call's estimated device time, in frames of one job's projections and feed-forward:
        its rows' frames, their attention over past + window keys, and a replay's fixed cost."""
        rows, past, width = shape
        return rows * width * (1.0 + (past + width) / self._attention_keys) + GROUP_OVERHEAD_FRAMES

    def _groups(self, jobs: list[WindowJob]) -> list[tuple[list[WindowJob], tuple[int, int, int] | None]]:
        """The padded calls of a step: the jobs sorted by width (then start) and cut into runs, each
        the shape of its most demanding job, where the runs' estimated time (:meth:`_cost`) is least
        (one call for jobs of alike shapes; apart, jobs whose padding to one shape would cost more
        than another call: 5 jobs as 4 + 1 rather than 8, short windows apart from a prompt's);
        the jobs that fit no shape together, eagerly. The cuts depend only on the jobs' widths and
        starts, the same at every step of a batch: they are worked out once per batch."""
        if not self.padded:
            return [(jobs, None)]
        fits, misfits = [], []
        for job in sorted(jobs, key=lambda j: (j.width, j.start)):
            (misfits if self._shape(1, job.start, job.width) is None else fits).append(job)
        key = tuple((job.width, job.start) for job in fits)
        runs = self._runs.get(key)
        if runs is None:
            runs = self._cheapest_runs(key)
            self._runs.put(key, runs)
        groups = [(fits[begin:end], shape) for begin, end, shape in runs]
        return groups + ([(misfits, None)] if misfits else [])

    def _cheapest_runs(self, jobs: tuple[tuple[int, int], ...]) -> list[tuple[int, int, tuple[int, int, int]]]:
        """(begin, end, shape) of the runs of ``jobs`` ((width, start), sorted, each fitting a shape)
        whose summed :meth:`_cost` is least (dynamic programming over the cut points)."""
        best, cut = [0.0] + [float("inf")] * len(jobs), [(0, (0, 0, 0))] * (len(jobs) + 1)
        for end in range(1, len(jobs) + 1):
            past = 0
            for begin in range(end - 1, -1, -1):
                past = max(past, jobs[begin][1])
                shape = self._shape(end - begin, past, jobs[end - 1][0])
                if shape is None:  # more jobs or a longer past never fit again
                    break
                cost = best[begin] + self._cost(shape)
                if cost < best[end]:
                    best[end], cut[end] = cost, (begin, shape)
        runs, end = [], len(jobs)
        while end:
            begin, shape = cut[end]
            runs.append((begin, end, shape))
            end = begin
        return runs[::-1]

    # ----- one packed call -----

    def _run(self, jobs: list[WindowJob], shape: tuple[int, int, int] | None) -> None:
        self.calls += 1
        if shape is None:  # unpadded: exactly the jobs, the longest past and window
            self.eager_calls += 1
            buffers = self._fresh(len(jobs), max(job.start for job in jobs), max(job.width for job in jobs))
        else:
            buffers = self._views(*shape)
        self._load(jobs, buffers)
        graph = self._graph(shape, buffers) if shape is not None and self.cuda_graphs else None
        if graph is None:
            outputs = self._forward(buffers)
        else:
            graph.replay()
            self.replays += 1
            outputs = self._outputs(*shape)
        self._store(jobs, outputs)

    def _forward(self, b: _StepBuffers) -> tuple[torch.Tensor, ...]:
        """The packed Euler step: (x after the step (R, 80, W), window keys/values (blocks, 2, 2R,
        heads, W, dim_head: a view of ``b.kv``), convolution inputs (2R, D, 30 + W) x 2). Pure device work."""
        estimator, rows = self.decoder.estimator, b.planes.shape[0]
        x, mu, cond = b.planes.unbind(1)
        step, start, width, full = b.meta.unbind(1)
        angles, mask = row_geometry(estimator, start, width, full.bool(), b.shape[1], b.shape[2])

        def pairs(v: torch.Tensor) -> torch.Tensor:  # one job's value on both of its CFG rows
            return v.unsqueeze(1).expand(-1, 2, *v.shape[1:]).flatten(0, 1)

        def guided(v: torch.Tensor) -> torch.Tensor:  # [value, zeros] per job: the unconditional row
            return torch.stack([v, torch.zeros_like(v)], dim=1).flatten(0, 1)

        out, kv, inputs1, inputs2 = estimator.forward_window(
            pairs(x), guided(mu), pairs(self._t[step]), guided(b.spks), guided(cond), b.kv, b.conv,
            pairs(angles), pairs(mask).unsqueeze(1))
        v = out.unflatten(0, (rows, 2))
        rate = self.decoder.cfg_rate
        x = x + self._dt[step][:, None, None] * ((1.0 + rate) * v[:, 0] - rate * v[:, 1])
        return x, kv, inputs1, inputs2

    def _load(self, jobs: list[WindowJob], b: _StepBuffers) -> None:
        """Each job's window and its committed keys/values at its step into its rows; the rows of
        padding jobs get a harmless geometry (full attention over the whole width)."""
        rows, _, padded_width = b.shape
        meta = [[job.step, job.start, job.width, int(job.full)] for job in jobs]
        meta += [[0, 0, padded_width, 1]] * (rows - len(jobs))
        host = torch.tensor(meta, dtype=torch.long)
        b.meta.copy_(host.pin_memory() if b.meta.is_cuda else host, non_blocking=True)
        dsts, srcs = [], []
        for i, job in enumerate(jobs):
            w, pair = job.width, slice(2 * i, 2 * i + 2)
            dsts += [b.planes[i, :, :, :w], b.spks[i]]
            srcs += [job.planes, job.spks[0]]
            if job.state.kv is None:
                b.conv[:, pair].zero_()
            else:
                dsts += [b.kv[:, :, pair, :, :job.start], b.conv[:, pair]]
                srcs += [job.state.kv[job.step], job.state.conv_context[job.step]]
        torch._foreach_copy_(dsts, srcs)

    def _store(self, jobs: list[WindowJob], outputs: tuple[torch.Tensor, ...]) -> None:
        x, kv, inputs1, inputs2 = outputs
        dsts, srcs = [], []
        for i, job in enumerate(jobs):
            dsts.append(job.planes[0])
            srcs.append(x[i, :, :job.width])
            if job.keep:
                pair, keep = slice(2 * i, 2 * i + 2), job.keep
                dsts += [job.kv[job.step], job.inputs1[job.step], job.inputs2[job.step]]
                srcs += [kv[:, :, pair, :, :keep], inputs1[pair, :, :CONTEXT + keep], inputs2[pair, :, :CONTEXT + keep]]
        torch._foreach_copy_(dsts, srcs)
        for job in jobs:
            job.step += 1

    # ----- buffers and graphs -----

    def _fresh(self, rows: int, past: int, width: int) -> _StepBuffers:
        cfg = self.decoder.estimator.cfg

        def zeros(*shape: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        return _StepBuffers(zeros(rows, 4, dtype=torch.long), zeros(rows, 3, cfg.mel_dim, width),
                            zeros(rows, cfg.spk_dim), zeros(cfg.depth, 2, 2 * rows, cfg.heads, past + width, cfg.dim_head),
                            zeros(2, 2 * rows, cfg.dim, CONTEXT))

    def _staging_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The buffers every padded shape views, sized for the largest; the staged keys/values flat."""
        cfg, rows = self.decoder.estimator.cfg, max(self.job_buckets)
        width = min(max(self.width_buckets), self.width_budget)
        past_frames = min(self.past_budget, rows * max(self.past_buckets))
        width_frames = min(self.width_budget, rows * width)
        d = self.dtype
        return {"meta": ((rows, 4), torch.long), "planes": ((rows, 3, cfg.mel_dim, width), d),
                "spks": ((rows, cfg.spk_dim), d), "kv": (((past_frames + width_frames) * self._frame_kv,), d),
                "conv": ((2, 2 * rows, cfg.dim, CONTEXT), d), "x_out": ((rows, cfg.mel_dim, width), d),
                "inputs1_out": ((2 * rows, cfg.dim, CONTEXT + width), d),
                "inputs2_out": ((2 * rows, cfg.dim, CONTEXT + width), d)}

    def staging_bytes(self) -> int:
        """Device memory of the padded buffers (allocated at the first padded step; 0 unpadded)."""
        if not self.padded:
            return 0
        return sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
                   for shape, dtype in self._staging_shapes().values())

    def _allocate(self) -> dict[str, torch.Tensor]:
        if self._staging is None:  # zeros: what padding reads stays finite
            self._staging = {name: torch.zeros(shape, dtype=dtype, device=self.device)
                             for name, (shape, dtype) in self._staging_shapes().items()}
        return self._staging

    def _kv_view(self, flat: torch.Tensor, rows: int, frames: int) -> torch.Tensor:
        cfg = self.decoder.estimator.cfg
        return flat[:rows * frames * self._frame_kv].view(cfg.depth, 2, 2 * rows, cfg.heads, frames, cfg.dim_head)

    def _views(self, rows: int, past: int, width: int) -> _StepBuffers:
        s = self._allocate()
        return _StepBuffers(s["meta"][:rows], s["planes"][:rows, :, :, :width], s["spks"][:rows],
                            self._kv_view(s["kv"], rows, past + width), s["conv"][:, :2 * rows])

    def _outputs(self, rows: int, past: int, width: int) -> tuple[torch.Tensor, ...]:
        s = self._allocate()
        return (s["x_out"][:rows, :, :width], self._kv_view(s["kv"], rows, past + width)[..., past:, :],
                s["inputs1_out"][:2 * rows, :, :CONTEXT + width], s["inputs2_out"][:2 * rows, :, :CONTEXT + width])

    def _graph(self, shape: tuple[int, int, int], buffers: _StepBuffers) -> torch.cuda.CUDAGraph | None:
        graph = self._graphs.get(shape)
        if graph is not None or shape in self._failed:
            return graph
        self._seen[shape] += 1
        if self.capture_after is None or self._seen[shape] <= self.capture_after:
            return None
        return self._capture(shape, buffers)

    def _capture(self, shape: tuple[int, int, int], buffers: _StepBuffers) -> torch.cuda.CUDAGraph | None:
        outputs = self._outputs(*shape)

        def run() -> None:  # the window's keys/values are written in place, in the staged buffer
            x, _, inputs1, inputs2 = self._forward(buffers)
            for out, value in zip((outputs[0], outputs[2], outputs[3]), (x, inputs1, inputs2)):
                out.copy_(value)

        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph, _ = capture_graph(run, self.device, self._pool, role=self.role)
        except Exception:  # a failed capture (CUDA's error, or no CUDA device) costs speed, never the request
            log.exception("capturing the packed CosyVoice3 window graph %s failed; that shape runs eagerly", shape)
            self._failed.add(shape)
            return None
        self._graphs[shape] = graph
        return graph

    def grid(self) -> list[tuple[int, int, int]]:
        """Every padded shape (jobs, past, width) within the buckets and budgets."""
        return [(r, p, w) for r, p, w in product(self.job_buckets, self.past_buckets, self.width_buckets)
                if r * p <= self.past_budget and r * w <= self.width_budget]

    @torch.inference_mode()
    def capture_all(self, shapes: list[tuple[int, int, int]] | None = None) -> int:
        """Capture every shape of :meth:`grid` (or ``shapes``) now; later, other shapes run eagerly
        (no capture under load). Returns the number of graphs. Needs ``cuda_graphs``."""
        if not self.cuda_graphs:
            raise ValueError("capture_all needs cuda_graphs")
        with self._lock:
            for shape in shapes or self.grid():
                if shape in self._graphs or shape in self._failed:
                    continue
                buffers = self._views(*shape)  # the capture's warm-up runs on padding rows: finite
                buffers.meta.copy_(torch.tensor([[0, 0, shape[2], 1]] * shape[0], device=self.device))
                self._capture(shape, buffers)
            self.capture_after = None
        return self.num_graphs
