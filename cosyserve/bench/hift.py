"""Microbenchmark of HiFT's streaming chunk calls per network dtype (``scripts/bench_hift.py``).

For each dtype and shape (rows x mel frames): the median time of a whole :class:`HiftRunner` call
from CUDA graphs (excitation, network, inverse STFT; float32 eager for reference), the rel-L2 of
its waveform against float32 with TF32 off, and the floors measured on the same device:

* launch floor: the call's GPU activities (``torch.profiler`` over one eager run of the same
  decomposition) times the measured cost per node of a CUDA graph of empty kernels;
* arithmetic floor: the convolutions' FLOPs over the measured matmul rate of that dtype (float32
  convolutions run as TF32 under PyTorch's default ``cudnn.allow_tf32``, so its TF32 rate).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .estimator import count_kernels, graph_ms, measure_ceilings
from .token2wav import rel_l2
from ..models.hift import HiFTGenerator, HiftConfig, load_hift
from ..token2wav.graphs import HiftRunner
from ..token2wav.vocoder_stream import MEL_CACHE_FRAMES

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Row:
    dtype: str
    rows: int
    frames: int
    eager_ms: float
    graph_ms: float
    kernels: int
    gflop: float
    rel_l2: float


def real_hift(model_dir: str | Path | None, seed: int = 0) -> HiFTGenerator:
    """The released HiFT from ``model_dir``, or the real architecture with upstream's random init."""
    if model_dir is not None:
        return load_hift(model_dir, "cuda")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HiFTGenerator(HiftConfig.real()).fold_weight_norm().to("cuda").eval().requires_grad_(False)


def conv_gflop(hift: HiFTGenerator, call: Callable[[], object]) -> float:
    """GFLOP of the convolutions and linear layers of one ``call`` (2 per multiply-add)."""
    total = 0.0

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.ConvTranspose1d):  # each input element meets C_out x k weights
            total += 2 * inputs[0].numel() * module.out_channels * module.kernel_size[0] / module.groups
        elif isinstance(module, nn.Conv1d):
            total += 2 * output.numel() * module.in_channels * module.kernel_size[0] / module.groups
        else:
            total += 2 * output.numel() * module.in_features
    handles = [m.register_forward_hook(hook) for m in hift.modules() if isinstance(m, (nn.Conv1d, nn.Linear))]
    try:
        call()
    finally:
        for h in handles:
            h.remove()
    return total / 1e9


def matmul_tflops(dtype: torch.dtype, size: int = 8192) -> float:
    """Measured dense matmul rate of ``dtype`` (float32: TF32, as cuDNN runs float32 convolutions by default)."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        ms = graph_ms(lambda: torch.mm(a, b), iters=10)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * size**3 / ms / 1e9


def median_call_ms(call: Callable[[], object], runs: int) -> float:
    """Median wall time of whole calls (host work included), after two untimed ones."""
    times = []
    for _ in range(runs + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def strict_float32(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call()`` with TF32 off: the float32 reference."""
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return call()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous


def run(hift32: HiFTGenerator, dtypes: Sequence[str], rows_list: Sequence[int], frame_counts: Sequence[int],
        runs: int = 20, compile: bool = False, log: Callable[[str], None] = print) -> list[Row]:
    """Time every (dtype, rows, frames); the first of ``frame_counts`` is a first chunk (no cached
    excitation). ``compile``: each dtype also with the network through torch.compile ("+compile")."""
    runners = {}
    for name in dtypes:
        model = copy.deepcopy(hift32).set_network_dtype(DTYPES[name])
        runners[name] = (HiftRunner(model, pad=True), HiftRunner(model, cuda_graphs=True))
        if compile:
            runners[f"{name}+compile"] = (HiftRunner(model, compile=True),
                                          HiftRunner(model, cuda_graphs=True, compile=True))
    for name, (_, graphs) in runners.items():
        started = time.perf_counter()
        count = graphs.precapture(max(rows_list), frame_counts)
        log(f"{name}: captured {count} graphs in {time.perf_counter() - started:.1f} s")
    reference_runner = HiftRunner(hift32, pad=True)
    overlap = MEL_CACHE_FRAMES * hift32.hop_length
    harmonics = hift32.m_source.num_harmonics
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for rows in rows_list:
        for frames in frame_counts:
            mel = torch.randn(rows, hift32.cfg.in_channels, frames, device="cuda", generator=gen)
            cache = (None if frames == frame_counts[0]
                     else torch.randn(rows, 1, overlap, device="cuda", generator=gen).tanh())
            noise = 0.003 * torch.randn(rows, frames * hift32.hop_length, harmonics, device="cuda", generator=gen)
            reference = strict_float32(lambda: reference_runner(mel, cache, noise)[0])
            gflop = conv_gflop(hift32, lambda: reference_runner(mel, cache, noise))
            for name, (eager, graphs) in runners.items():
                kernels, busy_ms, top = count_kernels(lambda: eager(mel, cache, noise))
                if rows == rows_list[0] and frames == frame_counts[min(1, len(frame_counts) - 1)]:
                    log(f"  {name} rows {rows} frames {frames}: {kernels} GPU activities, {busy_ms:.2f} ms busy; "
                        f"top by time (name, count, us): {top}")
                row = Row(name, rows, frames, median_call_ms(lambda: eager(mel, cache, noise), runs),
                          median_call_ms(lambda: graphs(mel, cache, noise), runs), kernels, gflop,
                          rel_l2(graphs(mel, cache, noise)[0], reference))
                out.append(row)
                log(f"  {name} rows {rows} frames {frames}: eager {row.eager_ms:.2f} ms, graphs {row.graph_ms:.2f} ms, "
                    f"{kernels} kernels, rel-L2 {row.rel_l2:.1e}")
    return out


def table(rows: list[Row], rates: dict[str, float], us_per_kernel: float) -> str:
    lines = [f"launch floor: kernels x {us_per_kernel:.2f} us (measured graph node); arithmetic floor: GFLOP / "
             + ", ".join(f"{n} {r:.0f} TFLOP/s" for n, r in rates.items()) + " (measured matmul)",
             "| dtype | rows | mel frames | eager ms | graphs ms | kernels | launch floor ms | GFLOP "
             "| arithmetic floor ms | rel-L2 vs fp32 (TF32 off) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.dtype} | {r.rows} | {r.frames} | {r.eager_ms:.2f} | {r.graph_ms:.2f} | {r.kernels} | "
                     f"{r.kernels * us_per_kernel / 1e3:.2f} | {r.gflop:.1f} | {r.gflop / rates[r.dtype]:.3f} | "
                     f"{r.rel_l2:.1e} |")
    return "\n".join(lines)


def fixture_rel_l2(fixture_dir: Path, dtypes: Sequence[str]) -> dict[str, float]:
    """Worst rel-L2 over the tiny fixture's zero-noise end-to-end cases of each dtype against the
    stored upstream waveform (README §2 tolerance 1e-2; PyTorch's default TF32 settings); the tiny
    model has realistic F0 and levels."""
    import json

    from safetensors.torch import load_file

    cfg = HiftConfig.from_fixture_json(json.loads((fixture_dir / "hift_tiny_config.json").read_text()))
    base = load_hift(fixture_dir / "hift_tiny.pt", "cuda", config=cfg)
    io = load_file(str(fixture_dir / "hift_tiny_io.safetensors"))
    cases = sorted(k.split("/")[0] for k in io if k.endswith("_zero/speech"))
    worst = {}
    for name in dtypes:
        model = copy.deepcopy(base).set_network_dtype(DTYPES[name])
        errors = []
        for case in cases:
            mel = io[f"{case[:-len('_zero')]}/mel"].cuda()
            cache = io.get(f"{case}/cache_source")
            noise = torch.zeros(1, mel.shape[2] * model.hop_length, model.m_source.num_harmonics, device="cuda")
            speech = model.inference(mel, None if cache is None else cache.cuda(), sine_noise=noise)[0]
            errors.append(rel_l2(speech.cpu(), io[f"{case}/speech"]))
        worst[name] = max(errors)
    return worst


def main(model_dir: str | None, dtypes: Sequence[str], rows_list: Sequence[int], frame_counts: Sequence[int],
         runs: int, fixture_dir: Path | None, compile: bool = False) -> None:
    torch.set_num_threads(1)
    hift32 = real_hift(model_dir)
    ceilings = measure_ceilings(torch.device("cuda"))
    rates = {name: matmul_tflops(DTYPES[name]) for name in dtypes}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn.allow_tf32="
          f"{torch.backends.cudnn.allow_tf32}, weights: {model_dir or 'random init, real size'}", flush=True)
    rows = run(hift32, dtypes, rows_list, frame_counts, runs, compile)
    print(table(rows, rates | {f"{n}+compile": r for n, r in rates.items()}, ceilings.us_per_kernel))
    if fixture_dir is not None:
        for name, value in fixture_rel_l2(fixture_dir, dtypes).items():
            print(f"fixture (tiny, zero noise, end to end) worst rel-L2 vs upstream, {name}: {value:.1e}")
