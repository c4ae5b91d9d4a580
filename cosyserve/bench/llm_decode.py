"""Decode-step microbenchmark of the model runner: reference vs fused path, same weights, same run.

For each path and batch size: the time of a decode step replayed as a CUDA graph (device events
around back-to-back replays), the time of ``ModelRunner.decode`` as the engine calls it (replay +
reading back the tokens), the kernels one step launches (torch.profiler on the eager step body,
which is what the graph replays) and their summed GPU time, next to the bandwidth floor
(weight bytes + KV bytes read and written) / bandwidth. Also two accuracy checks: the greedy
tokens of both paths from the same prompts, and the logits of one decode step on the same inputs
against a float32 run of the reference path.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..llm.prompt import NUM_SPEECH_TOKENS, OUTPUT_WINDOW_START, SOS_ID, SPEECH_TOKEN_OFFSET, TASK_ID
from ..llm.sampling import SamplingParams
from ..llm.engine.kv_cache import KVCache
from ..llm.engine.model_runner import ModelRunner, PrefillItem

PATHS = {"reference": False, "fused": True}


@dataclass
class DecodeFigures:
    path: str
    batch: int
    replay_ms: float  # median over repeats of (events around `steps` replays) / steps
    replay_spread_ms: float  # max - min of those repeats
    call_ms: float  # median host time of ModelRunner.decode (replay + token read-back)
    kernels: int
    kernel_ms: float  # summed GPU time of the eager step's kernels
    floor_ms: float
    top_kernels: str  # torch.profiler table of the eager step


def floor_ms(runner: ModelRunner, batch: int, context: int, bandwidth: float) -> float:
    model = runner.model
    weights = sum(p.numel() * p.element_size() for module in (model.layers, model.head, model.norm)
                  for p in module.parameters())
    kv = batch * (context + 1) * KVCache.bytes_per_token(runner.config, runner.dtype)
    return (weights + kv) / bandwidth * 1e3


def _start_rows(runner: ModelRunner, batch: int, context: int, generator: torch.Generator) -> None:
    """Rows 0..batch-1 at position ``context`` with random speech-token inputs."""
    tokens = torch.randint(NUM_SPEECH_TOKENS, (batch,), generator=generator) + OUTPUT_WINDOW_START
    runner.input_ids[:batch] = tokens.to(runner.device)
    runner.positions[:batch] = context


def time_replays(runner: ModelRunner, batch: int, context: int, steps: int, repeats: int,
                 generator: torch.Generator) -> tuple[float, float, float]:
    """(median replay ms, spread ms, median ModelRunner.decode ms) at positions context..context+steps."""
    shape = runner.graph_shape(batch, context + steps)
    graph = runner.decode_graphs[shape]
    per_step = []
    for _ in range(repeats):
        _start_rows(runner, batch, context, generator)
        graph.replay()  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        end.synchronize()
        per_step.append(start.elapsed_time(end) / steps)
    _start_rows(runner, batch, context, generator)
    calls = []
    for _ in range(steps):
        begin = time.perf_counter()
        runner.decode(batch, context + steps)
        calls.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(per_step), max(per_step) - min(per_step), statistics.median(calls)


def profile_step(runner: ModelRunner, batch: int, context: int, generator: torch.Generator) -> tuple[int, float, str]:
    """(kernels, summed kernel ms, top-kernel table) of one eager decode step."""
    from torch.profiler import ProfilerActivity, profile

    kv_len = runner.graph_shape(batch, context)[1]
    with torch.inference_mode():
        _start_rows(runner, batch, context, generator)
        runner.decode_step(batch, kv_len)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.decode_step(batch, kv_len)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith(("Memcpy", "Memset"))]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=10)
    return len(events), sum(e.device_time for e in events) / 1e3, table


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Per row: the first token and ``steps`` decoded tokens, greedy (window indices)."""
    rows = list(range(len(prompts)))
    runner.sampler.set_requests(rows, [SamplingParams.greedy()] * len(rows), rows, [[]] * len(rows))
    tokens = [runner.prefill([PrefillItem(row, ids, 0) for row, ids in enumerate(prompts)])]
    longest = max(len(ids) for ids in prompts)
    while len(tokens) <= steps:  # each replay decodes runner.steps_per_replay steps
        tokens += runner.decode(len(rows), longest + steps)
    return [list(row) for row in zip(*tokens[:steps + 1])]


def forced_step_logits(runner: ModelRunner, prompts: list[list[int]], inputs: list[int]) -> torch.Tensor:
    """float32 logits (rows, window) of one eager decode step after the prompts, with ``inputs`` as
    each row's decode input: the same inputs for every path, whatever each path sampled."""
    rows = list(range(len(prompts)))
    runner.sampler.set_requests(rows, [SamplingParams.greedy()] * len(rows), rows, [[]] * len(rows))
    runner.prefill([PrefillItem(row, ids, 0) for row, ids in enumerate(prompts)])
    for row, (ids, token) in enumerate(zip(prompts, inputs)):
        runner.set_decode_input(row, token, len(ids))
    return runner.decode_logits(len(rows), max(len(ids) for ids in prompts)).float().cpu()


def logits_accuracy(logits: dict[str, torch.Tensor]) -> str:
    """rel-L2 and argmax agreement of each bf16 path against the float32 reference."""
    exact = logits["float32"]
    parts = []
    for path in PATHS:
        error = float((logits[path] - exact).norm() / exact.norm())
        agree = int((logits[path].argmax(-1) == exact.argmax(-1)).sum())
        parts.append(f"{path} rel-L2 {error:.2e}, argmax = float32's in {agree}/{len(exact)} rows")
    return "one decode step on the same inputs vs float32 reference: " + "; ".join(parts)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    text = length // 3
    return [[SOS_ID] + [rng.randrange(100, 150000) for _ in range(text)] + [TASK_ID]
            + [SPEECH_TOKEN_OFFSET + rng.randrange(NUM_SPEECH_TOKENS) for _ in range(length - text - 2)]
            for _ in range(count)]


def compare_decode_paths(model_dir: str | Path, device: torch.device, batches: list[int], context: int = 275,
                         steps: int = 100, repeats: int = 5, greedy_rows: int = 64, greedy_steps: int = 32,
                         max_model_len: int = 1024, bandwidth: float = 3.0e12
                         ) -> tuple[list[DecodeFigures], dict[str, list[list[int]]], dict[str, torch.Tensor]]:
    """Both paths, one after the other (each runner is freed before the next is built); bf16, graphs.
    Returns the figures, each path's greedy tokens and each path's (and float32's) forced-step logits."""
    figures, tokens, logits = [], {}, {}
    prompts = random_prompts(greedy_rows, 150, seed=1)
    inputs = [random.Random(row).randrange(NUM_SPEECH_TOKENS) for row in range(greedy_rows)]
    for path, fused_decode in PATHS.items():
        runner = ModelRunner(model_dir, device, torch.bfloat16, max(batches + [greedy_rows]), max_model_len,
                             use_cuda_graphs=True, fused_decode=fused_decode)
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        with torch.inference_mode():
            runner.kv.data.normal_()  # never time on zeros
        rows = list(range(runner.kv.num_slots))
        runner.sampler.set_requests(rows, [SamplingParams()] * len(rows), rows, [[]] * len(rows))
        for batch in batches:
            replay, spread, call = time_replays(runner, batch, context, steps, repeats, generator)
            kernels, kernel_ms, table = profile_step(runner, batch, context, generator)
            figures.append(DecodeFigures(path, batch, replay, spread, call, kernels, kernel_ms,
                                         floor_ms(runner, batch, context, bandwidth), table))
        tokens[path] = greedy_tokens(runner, prompts, greedy_steps)
        logits[path] = forced_step_logits(runner, prompts, inputs)
        del runner
        torch.cuda.empty_cache()
    exact = ModelRunner(model_dir, device, torch.float32, greedy_rows, max_model_len, use_cuda_graphs=False,
                        fused_decode=False)
    logits["float32"] = forced_step_logits(exact, prompts, inputs)
    return figures, tokens, logits


def format_decode_table(figures: list[DecodeFigures], targets: dict[int, float]) -> str:
    lines = ["| path | batch | graph replay ms/step (spread) | ModelRunner.decode ms | kernels/step | "
             "kernel GPU ms | bandwidth floor ms | target ms |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for f in figures:
        target = f"<= {targets[f.batch]}" if f.batch in targets else ""
        lines.append(f"| {f.path} | {f.batch} | {f.replay_ms:.3f} ({f.replay_spread_ms:.3f}) | {f.call_ms:.3f} | "
                     f"{f.kernels} | {f.kernel_ms:.3f} | {f.floor_ms:.3f} | {target} |")
    return "\n".join(lines)


def greedy_agreement(tokens: dict[str, list[list[int]]]) -> str:
    reference, fused = tokens["reference"], tokens["fused"]
    same = sum(a == b for a, b in zip(reference, fused))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(reference, fused)]
    diverged = sorted(i for i in first if i is not None)
    return (f"greedy tokens, fused vs reference: {same}/{len(reference)} rows identical over "
            f"{len(reference[0])} tokens; first differing token index of the others: {diverged}")
