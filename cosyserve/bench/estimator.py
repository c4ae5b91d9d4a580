"""Microbenchmark of the estimator's Euler step: the eager module (old path) vs :class:`.fused.FusedEstimator`.

Used by ``scripts/bench_estimator.py``. Real-size random weights; every figure is printed next to
its floor, measured on the same device in the same run:

* arithmetic floor: the step's FLOPs (dense GEMMs and attention) over the measured fp16 matmul rate;
* bandwidth floor: the bytes it must move (weights, cached K/V read, new K/V written, input and
  output once) over the measured device-to-device copy bandwidth;
* launch floor: its kernel count times the measured time per kernel of a CUDA graph of tiny
  kernels (what a graph costs per node when the kernels do no work).

Times are CUDA-graph replays (median of individually event-timed replays); kernel counts come
from ``torch.profiler`` over one eager run of the same work.
"""

from __future__ import annotations

import copy
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.flow.cache import StreamWindow
from ..models.flow.cfm import CausalConditionalCFM
from ..models.flow.config import FlowConfig
from ..models.flow.fused import FusedEstimator, StepRows

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str
    requests: int
    frames: int  # new frames per row
    context: int  # cached frames per row
    streaming: bool
    steps: int  # Euler steps in one timed call (1: one step; 10: a whole offline call)
    valid: tuple[int, ...] | None = None  # real new frames per request (None: all); the old path ignores it


CASES = (
    Case("stream 1 req x 64 new / 300 ctx", 1, 64, 300, True, 1),
    Case("stream 16 req x 64 new / 300 ctx", 16, 64, 300, True, 1),
    Case("offline 16 x 400, whole 10-step call", 16, 400, 0, False, 10),
)
# One Euler step of eight new voices' 3-8 s prompts solved together (FlowEngine.prepare: their
# complete 50-frame blocks, streaming masks, no context, padded to the captured width of the longest):
# the solve that eight new clips arriving together wait for.
PROMPT_CASE = Case("prompts 8 x 150-350 new (352) / 0 ctx", 8, 352, 0, True, 1,
                   (150, 200, 200, 250, 250, 300, 300, 350))
CASES_BY_NAME = {"stream1": CASES[0], "stream16": CASES[1], "offline": CASES[2], "prompts8": PROMPT_CASE}


@dataclass(frozen=True)
class Ceilings:
    matmul_tflops: float
    copy_gbps: float
    us_per_kernel: float


@dataclass
class Row:
    case: str
    path: str
    ms: float
    kernels: int
    busy_ms: float  # summed kernel time of an eager run: the time without launch gaps
    flops: float
    bytes: float

    def floors(self, ceilings: Ceilings) -> tuple[float, float, float]:
        """(arithmetic, bandwidth, launch) floors in ms."""
        return (self.flops / ceilings.matmul_tflops / 1e9, self.bytes / ceilings.copy_gbps / 1e6,
                self.kernels * ceilings.us_per_kernel / 1e3)


def _events_median(fn: Callable[[], None], iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], None], iters: int = 30, warmup: int = 2) -> float:
    """Median ms of one replay of ``fn`` captured as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return _events_median(graph.replay, iters)


def count_kernels(fn: Callable[[], None]) -> tuple[int, float, list[tuple[str, int, float]]]:
    """One eager run of ``fn``: its GPU activities (kernels, memsets, copies), their summed time in ms
    (the launch-free time) and the top ones by time (name, count, us)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    top = sorted(((n[:60], c, round(t, 1)) for n, (c, t) in by_name.items()), key=lambda x: -x[2])[:12]
    return len(events), sum(t for _, t in by_name.values()) / 1e3, top


def measure_ceilings(device: torch.device) -> Ceilings:
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    mm = _events_median(lambda: torch.mm(a, b), 20)
    src = torch.randn(2**28, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _events_median(lambda: dst.copy_(src), 20)
    tiny = torch.zeros(1, device=device)
    kernels = 2000
    per = graph_ms(lambda: [tiny.add_(1.0) for _ in range(kernels)], iters=10) / kernels
    return Ceilings(2 * 8192**3 / mm / 1e9, 2 * src.numel() * 4 / copy_ms / 1e6, per * 1e3)


def step_flops(fused: FusedEstimator, rows: StepRows) -> float:
    """Dense GEMM FLOPs (every packed weight element is one multiply-add per row-frame) plus attention
    (QK^T and PV: 4 x inner per visible query-key pair per layer)."""
    weights = sum(p.numel() for p in fused.packed_weights() if p.dim() == 2)
    dense = 2.0 * weights * rows.rows * rows.frames
    pairs = int(fused.visible(rows).sum())
    return dense + 4.0 * fused.inner * pairs * len(fused.attention_layers)


def step_bytes(fused: FusedEstimator, rows: StepRows, element: int) -> float:
    weights = sum(p.numel() for p in fused.packed_weights()) * element
    layers = len(fused.attention_layers)
    kv_read = sum(rows.context) * 2 * fused.inner * layers * element
    kv_write = rows.rows * rows.frames * 2 * fused.inner * layers * element
    io = rows.rows * rows.frames * (fused.decoder.in_channels + 2 * fused.out_channels) * element
    return weights + kv_read + kv_write + io


def real_cfm(device: torch.device, seed: int = 0) -> CausalConditionalCFM:
    """The released-size CFM with random weights, biases and LayerNorm affines, in fp32."""
    cfg = FlowConfig.real()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfm = CausalConditionalCFM(cfg.cfm, cfg.estimator)
        with torch.no_grad():
            for name, p in cfm.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    return cfm.to(device).eval().requires_grad_(False)


def _random_window(cfm: CausalConditionalCFM, requests: int, frames: int, device, dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return randn(requests, 80, frames), randn(requests, 80, frames), randn(requests, 80), randn(requests, 80, frames)


class _EagerCase:
    """The old path: the eager estimator through the CFM's guided velocity and an Euler update,
    a stream window over ``context`` cached frames (streaming cases) or the full offline call."""

    def __init__(self, cfm: CausalConditionalCFM, case: Case, seed: int) -> None:
        self.cfm, self.case = cfm, case
        device, dtype = next(cfm.parameters()).device, next(cfm.parameters()).dtype
        total = case.context + case.frames
        self.x, self.mu, self.spks, self.cond = _random_window(cfm, case.requests, total, device, dtype, seed)
        self.mask = torch.ones(case.requests, 1, case.frames, device=device, dtype=dtype)
        self.states: dict = {}
        self.t = torch.tensor(0.3, device=device, dtype=dtype)
        self.dt = torch.tensor(0.1, device=device, dtype=dtype)
        if case.context:
            ctx = slice(0, case.context)
            with torch.inference_mode():
                cfm.velocity(self.x[:, :, ctx], torch.ones(case.requests, 1, case.context, device=device, dtype=dtype),
                             self.mu[:, :, ctx], self.t, self.spks, self.cond[:, :, ctx], streaming=True,
                             window=StreamWindow(0, case.context, self.states))

    def velocity(self) -> torch.Tensor:
        new = slice(self.case.context, None)
        window = StreamWindow(self.case.context, 0, self.states) if self.case.context else None
        return self.cfm.velocity(self.x[:, :, new], self.mask, self.mu[:, :, new], self.t, self.spks,
                                 self.cond[:, :, new], streaming=self.case.streaming, window=window)

    def run(self) -> None:
        with torch.inference_mode():
            if self.case.steps == 1:
                self.x[:, :, self.case.context:] + self.dt * self.velocity()
            else:
                for _ in self.cfm.euler_steps(self.x, self.mask, self.mu, self.spks, self.cond,
                                              streaming=self.case.streaming, n_timesteps=self.case.steps):
                    pass


class _FusedCase:
    """The fused path on the same shapes; context K/V and conv frames are random data."""

    def __init__(self, fused: FusedEstimator, case: Case, seed: int) -> None:
        self.fused, self.case = fused, case
        rows = 2 * case.requests
        valid = list(case.valid or [case.frames] * case.requests) * 2
        self.rows = fused.rows(valid, [case.context] * rows, case.frames, streaming=case.streaming)
        self.state = fused.new_state(rows, self.rows.slots, case.frames)
        g = torch.Generator(device=fused.device).manual_seed(seed)
        for t in self.state.kv + self.state.conv:
            t.normal_(generator=g)
        self.inp = fused.input_buffer(rows, case.frames)
        self.inp.normal_(generator=g)
        self.inp[case.requests:, :, 80:] = 0
        self.x0 = self.inp[:, :, :80].clone()
        _, self.dts, self.time_biases = fused.schedule(10)
        self.time_bias = self.time_biases[3][:, None, :].expand(-1, rows, -1)
        self.dt = self.dts[3].expand(case.requests)

    def run(self) -> None:
        with torch.inference_mode():
            if self.case.steps == 1:
                self.fused.step(self.rows, self.state, self.inp, self.time_bias, self.dt, update_input=False)
            else:
                self.inp[:, :, :80].copy_(self.x0)
                self.fused.euler(self.rows, self.state, self.inp, self.dts[:self.case.steps],
                                 self.time_biases[:self.case.steps])


def old_path_accuracy(cfm32: CausalConditionalCFM, seed: int) -> tuple[float, float]:
    """The same two figures as :func:`accuracy` for the eager estimator in fp16 (the rounding it already has)."""
    cfm16 = copy.deepcopy(cfm32).half()
    case = Case("acc", 1, 64, 300, True, 1)
    with torch.inference_mode():
        ref = _EagerCase(cfm32, case, seed).velocity()
        got = _EagerCase(cfm16, case, seed).velocity()
        step_rel = float((got.float() - ref).norm() / ref.norm())
        x, mu, spks, cond = _random_window(cfm32, 2, 200, ref.device, torch.float32, seed + 1)
        mask = torch.ones(2, 1, 200, device=ref.device)
        for _, ref_x in cfm32.euler_steps(x, mask, mu, spks, cond, streaming=False, n_timesteps=10):
            pass
        for _, got_x in cfm16.euler_steps(x.half(), mask.half(), mu.half(), spks.half(), cond.half(),
                                          streaming=False, n_timesteps=10):
            pass
        call_rel = float((got_x.float() - ref_x).norm() / ref_x.norm())
    return step_rel, call_rel


def accuracy(cfm32: CausalConditionalCFM, dtype: torch.dtype, seed: int) -> tuple[float, float]:
    """rel-L2 vs eager fp32 on fresh random inputs: (guided velocity of one streaming step of 1
    request x 64 new frames over 300 cached frames, x after a whole offline 10-step call of 2 x 200 frames)."""
    fused = FusedEstimator(cfm32, dtype=dtype)
    case = Case("acc", 1, 64, 300, True, 1)
    eager = _EagerCase(cfm32, case, seed)
    with torch.inference_mode():
        ref = eager.velocity()
        rows = fused.rows([64, 64], [300, 300], 64, streaming=True)
        state = fused.new_state(2, rows.slots, 64)
        state.load_stream_states((0, 1), eager.states, fused.attention_layers, fused.conv_layers)
        inp = fused.input_buffer(2, 64)
        new = slice(300, None)
        fused.fill_input(inp, (0, 1), eager.x[:, :, new], eager.mu[:, :, new], eager.spks, eager.cond[:, :, new])
        t = eager.t.reshape(1)
        time_bias = fused.time_bias(t)[0][:, None, :].expand(-1, 2, -1)
        _, v = fused.step(rows, state, inp, time_bias, eager.dt.reshape(1).float(), update_input=False)
        step_rel = float((v[0].T.float() - ref[0]).norm() / ref[0].norm())

        offline = Case("acc-offline", 2, 200, 0, False, 10)
        x, mu, spks, cond = _random_window(cfm32, 2, 200, fused.device, torch.float32, seed + 1)
        mask = torch.ones(2, 1, 200, device=fused.device)
        for _, ref_x in cfm32.euler_steps(x, mask, mu, spks, cond, streaming=False, n_timesteps=offline.steps):
            pass
        rows = fused.rows([200] * 4, [0] * 4, 200, streaming=False)
        state = fused.new_state(4, rows.slots, 200)
        inp = fused.input_buffer(4, 200)
        for q in range(2):
            fused.fill_input(inp, (q, 2 + q), x[q:q + 1], mu[q:q + 1], spks[q:q + 1], cond[q:q + 1])
        _, dts, time_biases = fused.schedule(offline.steps)
        got = fused.euler(rows, state, inp, dts, time_biases)
        call_rel = float((got.transpose(1, 2).float() - ref_x).norm() / ref_x.norm())
    return step_rel, call_rel


def run(dtypes: list[str], cases: tuple[Case, ...] = CASES, old_path: bool = True, attention_variant: bool = False,
        seed: int = 0, log: Callable[[str], None] = print) -> tuple[Ceilings, list[Row], dict]:
    """Measure every case on the old path (fp16) and the fused path (each dtype); returns the rows."""
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ceilings = measure_ceilings(device)
    log(f"ceilings: fp16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s, copy {ceilings.copy_gbps:.0f} GB/s, "
        f"graph node {ceilings.us_per_kernel:.2f} us/kernel")
    cfm32 = real_cfm(device, seed)
    cfm16 = copy.deepcopy(cfm32).half() if old_path else None
    rows_out, accuracies = [], {}
    fused_by_dtype = {name: FusedEstimator(cfm32, dtype=DTYPES[name]) for name in dtypes}
    if "fp16" in dtypes and attention_variant:  # attention through SDPA over a bias (PyTorch's choice: cuDNN)
        fused_by_dtype["fp16 SDPA attn"] = FusedEstimator(cfm32, dtype=torch.float16, attention="sdpa")
    for case in cases:
        reference = next(iter(fused_by_dtype.values()))
        shape = _FusedCase(reference, case, seed)
        flops = step_flops(reference, shape.rows) * case.steps
        nbytes = step_bytes(reference, shape.rows, 2) * case.steps
        del shape
        paths = ([("old fp16 (eager, graph)", lambda: _EagerCase(cfm16, case, seed))] if old_path else []) + \
            [(f"fused {name}", lambda fused=fused: _FusedCase(fused, case, seed))
             for name, fused in fused_by_dtype.items()]
        for path, make in paths:
            try:
                work = make()
                kernels, busy, top = count_kernels(work.run)
                rows_out.append(Row(case.name, path, graph_ms(work.run), kernels, busy, flops, nbytes))
                log(f"{case.name} / {path}: top kernels (name, count, us) {top}")
            except Exception:  # one failing path must not hide the others' numbers
                log(f"{case.name} / {path} FAILED:\n{traceback.format_exc()}")
            work = None
            torch.cuda.empty_cache()
    for name in dtypes:
        try:
            accuracies[f"fused {name}"] = accuracy(cfm32, DTYPES[name], seed + 100)
        except Exception:
            log(f"accuracy {name} FAILED:\n{traceback.format_exc()}")
    if old_path:
        accuracies["old eager fp16"] = old_path_accuracy(cfm32, seed + 100)
    return ceilings, rows_out, accuracies


def table(ceilings: Ceilings, rows: list[Row], accuracies: dict, cases: tuple[Case, ...] = CASES) -> str:
    steps = {c.name: c.steps for c in cases}
    lines = ["| case | path | ms per call | ms per step | kernels per step | launch-free ms (kernel busy) | "
             "TFLOP/s | floor ms: arith / bw / launch | floor | x floor |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        arith, bw, launch = r.floors(ceilings)
        floor = max(arith, bw, launch)
        s = steps[r.case]
        lines.append(f"| {r.case} | {r.path} | {r.ms:.3f} | {r.ms / s:.3f} | {r.kernels / s:.0f} | {r.busy_ms:.3f} | "
                     f"{r.flops / r.ms / 1e9:.0f} | {arith:.3f} / {bw:.3f} / {launch:.3f} | {floor:.3f} | "
                     f"{r.ms / floor:.1f} |")
    for name, (step_rel, call_rel) in accuracies.items():
        lines.append(f"\nrel-L2 {name} vs eager fp32: one streaming step (velocity) {step_rel:.2e}, "
                     f"whole offline call (x) {call_rel:.2e}")
    return "\n".join(lines)


SWEEP_TILES = {
    "small": {"row": [(16, 256, 64, 4, 3), (16, 256, 256, 4, 2), (16, 256, 128, 8, 3), (16, 32, 256, 4, 2),
                      (16, 64, 256, 4, 2), (16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 32, 64, 4, 3)],
              "plain": [(32, 64, 64, 4, 3), (32, 64, 256, 4, 2), (16, 64, 256, 4, 2), (32, 128, 256, 4, 2),
                        (64, 64, 256, 4, 2), (16, 32, 256, 4, 2), (16, 64, 64, 4, 3)]},
    "mid": {"row": [(64, 64, 128, 4, 3), (64, 64, 64, 4, 3), (32, 64, 128, 4, 3), (64, 256, 64, 8, 3),
                    (32, 256, 64, 8, 3), (32, 128, 128, 4, 3), (16, 256, 64, 4, 3)],
            "plain": [(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (64, 64, 128, 4, 3), (128, 64, 64, 4, 3),
                      (64, 64, 64, 4, 3)]},
    # eight prompts' solve (M ~ 4,500-9,000 row-frames); a block_n of 128 on a LayerNorm kernel splits its rows
    "large": {"row": [(64, 256, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 32, 8, 4), (64, 256, 128, 8, 2),
                      (64, 256, 64, 4, 3), (64, 256, 32, 4, 4), (32, 256, 64, 4, 3), (64, 128, 64, 4, 3),
                      (128, 128, 64, 8, 3)],
              "plain": [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 32, 8, 4),
                        (256, 128, 64, 8, 3), (128, 128, 128, 8, 2), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4)]},
}
SWEEP_TILES["prompts"] = SWEEP_TILES["large"]  # eight prompts of 3-8 s padded to 352 frames (a served solve)
SWEEP_SIZES = {"small": (2, 64), "mid": (32, 64), "prompts": (16, 352), "large": (16, 512)}  # rows, frames


def _launch_us(call: Callable[[], None]) -> float:
    """us per launch of ``call`` in a CUDA graph of 20 launches."""
    return graph_ms(lambda: [call() for _ in range(20)], iters=10) * 1e3 / 20


def _tile_sweep(call: Callable, tiles: list[tuple]) -> tuple[float, str]:
    """``call(tile)`` timed under the built-in tile (None) and each of ``tiles``: the built-in's us per
    launch, and every tile's, fastest first (a tile the compiler rejects for resources: its error)."""
    results = []
    for tile in tiles:
        try:
            results.append((round(_launch_us(lambda: call(tile)), 2), tile))
        except Exception as error:
            results.append((float("inf"), f"{tile}: {type(error).__name__}"))
    return _launch_us(lambda: call(None)), ", ".join(f"{us} {tile}" for us, tile in sorted(results, key=lambda x: x[0]))


ATTENTION_SWEEP_TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2),
                         (128, 32, 4, 2), (64, 128, 4, 2), (32, 32, 4, 2)]


def sweep_attention(log: Callable[[str], None] = print) -> None:
    """Time one attention layer of a real-size step (fp16, 8 heads x 64) under several tiles of the Triton
    kernel, against SDPA over the dense bias (PyTorch's choice of kernel), us per launch in a CUDA graph
    of 20 launches: eight prompts' solve (padded to 352 frames, no context) and 16 streams' chunks
    (64 new frames over 300 cached)."""
    from ..models.flow import attention_triton
    device, dtype = torch.device("cuda"), torch.float16
    fused = FusedEstimator(real_cfm(device), dtype=dtype, attention="sdpa")
    shapes = {PROMPT_CASE.name: (list(PROMPT_CASE.valid) * 2, [0] * 16, 352),
              CASES[1].name: ([64] * 32, [300] * 32, 64)}
    for name, (valid, context, frames) in shapes.items():
        rows = fused.rows(valid, context, frames, streaming=True)
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(rows.rows, frames, fused.inner, device=device, dtype=dtype, generator=g)
        kv = torch.randn(rows.rows, rows.slots + frames, 2 * fused.inner, device=device, dtype=dtype, generator=g)
        out = torch.empty_like(q)
        sdpa = _launch_us(lambda: fused._attention(q, kv, rows, out))
        default, results = _tile_sweep(lambda tile: attention_triton.block_attention(
            q, kv, rows.valid, rows.device_context, rows.slots, fused.heads, fused.chunk, fused.left_chunks, out,
            tile=tile), ATTENTION_SWEEP_TILES)
        log(f"sweep attention {name}: SDPA {sdpa:.2f} us, Triton default {default:.2f} us; {results}")


def _linear_calls(rows: int, frames: int, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """Each kind of fused_linear call of a real-size step over rows x frames: name -> (tile kind, the
    call given a tile, (input (M, K), weight (N, K), output (M, N)) of its plain matrix product)."""
    from ..models.flow import fused_triton
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt, generator=g) * 0.1
    ln = (rnd(256) + 1, rnd(256))
    stream, h = rnd(rows, frames, 256, dt=torch.float32), rnd(rows, frames, 256)
    q, kv = rnd(rows, frames, 512), rnd(rows, frames, 1024)
    ff, attn = rnd(rows, frames, 1024), rnd(rows, frames, 512)
    valid = torch.full((rows,), frames, device=device, dtype=torch.int32)
    ctx = rnd(rows, 2, 256)
    w = {"qkv": rnd(1536, 256), "out": rnd(256, 512), "ff1": rnd(1024, 256), "b1024": rnd(1024),
         "ff2": rnd(256, 1024), "conv": rnd(256, 768), "res": rnd(256, 256)}
    fused_triton.reserve_row_scratch(device, rows * frames, 256)

    def product(a, weight):
        return a.reshape(-1, a.size(-1)), weight, torch.empty(a.numel() // a.size(-1), weight.size(0), device=device,
                                                               dtype=dtype)
    return {
        "qkv 256->1536": ("plain", lambda t: fused_triton.fused_linear(h, w["qkv"], out=q, split=(512, kv), tile=t),
                          product(h, w["qkv"])),
        "out 512->256 +res +LN": ("row", lambda t: fused_triton.fused_linear(
            attn, w["out"], out=stream, bias=ln[1], residual=stream, ln_out=(*ln, h), tile=t), product(attn, w["out"])),
        "ff1 256->1024 gelu": ("plain", lambda t: fused_triton.fused_linear(
            h, w["ff1"], out=ff, bias=w["b1024"], act=fused_triton.ACT_GELU, tile=t), product(h, w["ff1"])),
        "ff2 1024->256 +res +LN": ("row", lambda t: fused_triton.fused_linear(
            ff, w["ff2"], out=stream, bias=ln[1], residual=stream, ln_out=(*ln, h), tile=t), product(ff, w["ff2"])),
        "resnet conv3 256 +LN mish +1x1 +LN": ("row", lambda t: fused_triton.fused_linear(
            h, w["conv"], out=stream, taps=3, context=ctx, bias=ln[1], ln=ln, act=fused_triton.ACT_MISH,
            valid=valid, gemm2=(h, w["res"], ln[1]), ln_out=(*ln, q[:, :, :256]), tile=t),
            product(torch.cat([h, h, h], dim=-1), w["conv"])),
    }


def sweep_linear(rows_frames: dict[str, tuple[int, int]] | None = None, log: Callable[[str], None] = print) -> None:
    """Time each kind of fused_linear call of a real-size step (fp16) under several tiles: us per launch
    in a CUDA graph of 20 launches. For choosing the built-in tiles."""
    device = torch.device("cuda")
    rows_frames = rows_frames or {size: SWEEP_SIZES[size] for size in ("small", "mid")}
    for size, (rows, frames) in rows_frames.items():
        for name, (kind, call, _) in _linear_calls(rows, frames, device, torch.float16).items():
            default, results = _tile_sweep(call, SWEEP_TILES[size][kind])
            log(f"sweep {size} M={rows * frames} {name}: default {default:.2f} us; {results}")


def gemm_floor(rows_frames: dict[str, tuple[int, int]], log: Callable[[str], None] = print) -> None:
    """Each kind of fused_linear call (fp16, built-in tile) against its plain matrix product alone in cuBLAS
    (``torch.mm`` into a preallocated output, no epilogue): us per launch in a CUDA graph of 20 launches,
    and the product's TFLOP/s. How far the fused kernels are from the GEMM library on the same shapes."""
    device = torch.device("cuda")
    for size, (rows, frames) in rows_frames.items():
        for name, (_, call, (a, w, out)) in _linear_calls(rows, frames, device, torch.float16).items():
            fused = _launch_us(lambda: call(None))
            cublas = _launch_us(lambda: torch.mm(a, w.t(), out=out))
            tflops = 2 * a.size(0) * a.size(1) * w.size(0) / cublas / 1e6
            log(f"gemm floor {size} M={rows * frames} {name}: fused {fused:.2f} us, cuBLAS product alone "
                f"{cublas:.2f} us ({tflops:.0f} TFLOP/s)")
