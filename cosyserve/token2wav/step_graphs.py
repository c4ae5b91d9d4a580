"""What one packed Euler step of the incremental flow reads and writes (:class:`StepBuffers`), and
its CUDA graphs, one per shape bucket (:class:`EngineGraphs`); used by :mod:`.flow_engine`'s windows
and :mod:`.full_pass`'s passes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models.flow.fused import FusedEstimator, StepRows, StepState, conv_views
from ..models.flow.lanes import work_lane
from ..runtime import LOOP_ROLE, bucket, role_stream


class StepBuffers:
    """What one packed Euler step reads and writes, for ``pairs`` streams of up to ``frames`` new
    frames and ``slots`` context frames, under one attention kind (``streaming``): the rows' layout,
    their context (:class:`StepState`), the input, the step's time bias and dt, the commit points and
    the conv context kept at them.

    Eager: allocated per run, :meth:`step` calls the fused step. Captured
    (:meth:`capture`): allocated once per shape, :meth:`step` replays a CUDA graph of the same call;
    ``kv`` then gives the context buffer, shared by every captured shape (one shape runs at a time).
    """

    def __init__(self, fused: FusedEstimator, pairs: int, frames: int, slots: int,
                 kv: torch.Tensor | None = None, streaming: bool = True) -> None:
        self.fused, self.pairs, self.frames, self.slots = fused, pairs, frames, slots
        self.streaming = streaming
        rows = 2 * pairs
        device, dtype = fused.device, fused.dtype
        if kv is None:
            self.state = fused.new_state(rows, slots, frames)
        else:
            kv_all = kv[:, :rows, :slots + frames]
            conv_all = torch.zeros(rows, fused.conv_width, device=device, dtype=dtype)
            self.state = StepState(kv_all, conv_all, list(kv_all.unbind(0)), conv_views(conv_all, fused.conv_shapes))
        # keys of row r, slot k at r * key_stride + k of kv_flat (layers, rows * key_stride, values)
        base = self.state.kv_all if kv is None else kv
        self.key_stride = base.size(2)
        self.kv_flat = base.view(base.size(0), base.size(1) * base.size(2), base.size(3))
        self.valid = torch.zeros(rows, device=device, dtype=torch.int32)
        self.context = torch.zeros(rows, device=device, dtype=torch.int32)
        # (SDPA's mask; the Triton attention computes it from the context)
        self.attn_bias = (torch.zeros(rows, 1, frames, slots + frames, device=device, dtype=dtype)
                          if fused.uses_bias(streaming) else None)
        self.rows = StepRows(frames, self.valid, (0,) * rows, slots, streaming, self.attn_bias, self.context)
        self.inp = fused.input_buffer(rows, frames)
        self.time_bias = torch.zeros(len(fused.resnets), rows, fused.width, device=device, dtype=dtype)
        self.dt = torch.zeros(pairs, device=device, dtype=dtype)
        self.commit = torch.zeros(rows, device=device, dtype=torch.long)
        self.kept = torch.zeros(rows, fused.conv_width, device=device, dtype=dtype)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.x_out: torch.Tensor | None = None

    def set_rows(self, rows: StepRows) -> None:
        """Take over a packing's valid frames and attention mask (same shape and attention kind)."""
        if rows.streaming != self.streaming:
            raise ValueError(f"rows with streaming={rows.streaming} in a step built for streaming={self.streaming}")
        self.valid.copy_(rows.valid)
        self.context.copy_(rows.device_context)
        if self.attn_bias is not None:
            if rows.attn_bias is None:
                self.attn_bias.zero_()
            else:
                self.attn_bias.copy_(rows.attn_bias)

    def _call(self) -> torch.Tensor:
        x_out, _ = self.fused.step(self.rows, self.state, self.inp, self.time_bias, self.dt,
                                   keep_context=(self.commit, self.kept))
        return x_out

    def capture(self, pool, role: str) -> None:
        """Run the step once (Triton compiles its kernels), then capture it on the stream of ``role``
        (:func:`~cosyserve.runtime.role_stream`: the work lane whose thread replays it)."""
        self._call()
        torch.cuda.synchronize(self.fused.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=role_stream(self.fused.device, role)):
            self.x_out = self._call()

    def step(self, time_bias: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One guided Euler step of every row, all at the step of ``time_bias`` (resnets, width) and
        ``dt`` (a 0-d tensor); x after it (pairs, frames, 80), a view."""
        self.time_bias.copy_(time_bias[:, None, :].expand_as(self.time_bias))
        self.dt.copy_(dt.expand_as(self.dt))
        if self.graph is None:
            return self._call()
        self.graph.replay()
        return self.x_out


@dataclass(frozen=True)
class GraphShapes:
    """Captured shapes of the step: streams per run, new frames per window, cached context frames
    (each a bucket: a run takes the smallest shape that holds it)."""

    pairs: tuple[int, ...]
    frames: tuple[int, ...]
    slots: tuple[int, ...]

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return itertools.product(self.pairs, self.frames, self.slots)

    def bucket(self, pairs: int, frames: int, context: int) -> tuple[int, int, int] | None:
        key = (bucket(pairs, self.pairs), bucket(frames, self.frames), bucket(context, self.slots))
        return None if None in key else key


# The chunks' windows: a first chunk with the prompt's open block is ~40-90 frames, later ones up to
# 2 x 100 tokens + 49; cached frames (a 10 s prompt with 20 s of speech is 1,500). Bigger runs are eager.
GRAPH_PAIRS = (1, 2, 4, 8, 16)
GRAPH_FRAMES = (64, 128, 256)
GRAPH_SLOTS = (256, 512, 768, 1024, 1536)
CHUNK_SHAPES = GraphShapes(GRAPH_PAIRS, GRAPH_FRAMES, GRAPH_SLOTS)
# New voices' prompts (flow_engine.prepare): the first piece of up to 8 prompts at once, without
# context (flow_engine.PREFIX_FIRST_PIECE_TOKENS: up to 500 frames, so that a 3-10 s prompt is one
# solve, not two). A piece computes its complete 50-frame blocks only, so the widths hug multiples of
# 50 (2-3, 4-5, 6-7 and 8-10 blocks: prompts of 3-4, 5-6, 7-8 and 9-10 s) and stay multiples of
# fused.KEY_ALIGN without context slots: past a floor of ~600 kernels a step's time grows with its
# rows' frames (~0.8 us per row-frame on an H200), attention with its keys.
PREFIX_PAIRS = (1, 2, 4, 8)
PREFIX_FRAMES = (160, 256, 352, 512)
PREFIX_SHAPES = GraphShapes(PREFIX_PAIRS, PREFIX_FRAMES, (0,))


class EngineGraphs:
    """CUDA graphs of the engine's step for every shape of ``shapes`` (:data:`CHUNK_SHAPES`: the
    chunks' windows; :data:`PREFIX_SHAPES`: new voices' prompts), captured lazily or all at once by
    :meth:`capture_all`, in the work lane ``lane`` (:func:`~cosyserve.models.flow.lanes.work_lane`:
    its workspaces and scratch are its own, so that two instances' steps may run at once on two
    CUDA streams).

    The context of every shape is a view of one buffer sized for the largest (chunks: layers x 32
    rows x 1,792 frames x 1,024 values, 6.6 GB in fp16 for the released model; prompts: 16 rows x
    768 frames, 1.4 GB): it is gathered from the page pool before every step, as in the eager path.
    ``replay`` False keeps the shapes, buffers and padding but runs each step eagerly (what tests on
    the CPU check of this path).
    """

    def __init__(self, fused: FusedEstimator, shapes: GraphShapes = CHUNK_SHAPES, *, replay: bool = True,
                 lane: str = LOOP_ROLE) -> None:
        self.fused = fused
        self.shapes = shapes
        self.replay = replay
        self.lane = lane
        rows, keys = 2 * shapes.pairs[-1], shapes.slots[-1] + shapes.frames[-1]
        self.kv = torch.zeros(len(fused.attention_layers), rows, keys, 2 * fused.inner, device=fused.device,
                              dtype=fused.dtype)
        self.pool = torch.cuda.graph_pool_handle() if replay else None
        if fused.kernels == "triton":  # the largest shape's scratch first: the captures then never grow it
            from ..models.flow.fused_triton import reserve_row_scratch
            with work_lane(lane):
                reserve_row_scratch(fused.device, rows * shapes.frames[-1], fused.width)
        self._buffers: dict[tuple[int, int, int], StepBuffers] = {}

    @property
    def captured(self) -> int:
        return len(self._buffers)

    def get(self, pairs: int, frames: int, context: int) -> StepBuffers | None:
        """The captured step for a run of this size (captured now if new), or None past the shapes."""
        key = self.shapes.bucket(pairs, frames, context)
        if key is None:
            return None
        if key not in self._buffers:
            with work_lane(self.lane):
                buffers = StepBuffers(self.fused, *key, kv=self.kv)
                if self.replay:
                    buffers.capture(self.pool, self.lane)
            self._buffers[key] = buffers
        return self._buffers[key]

    def capture_all(self) -> None:
        for key in self.shapes:
            self.get(*key)
