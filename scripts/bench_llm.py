#!/usr/bin/env python3
"""Benchmark the torch LLM engine (and transformers) on real CosyVoice2 shapes, random bf16 weights.

    python scripts/bench_llm.py                      # writes a 'real' random bundle to /tmp first
    python scripts/bench_llm.py --model-dir models/cosyvoice2_llm --skip-hf
    python scripts/bench_llm.py --decode-paths       # only: reference vs fused decode step

Figures: decode ms/step at several batch sizes (every request: --prompt-len prompt tokens,
--gen-len generated, ignore_eos, default RAS sampling), prefill of 300 tokens, aggregate tokens/s
with 64 concurrent streams (prefill included), time to first token alone and in a 64-request
burst, with and without the prefix cache (a registered --prefix-len token prefix; also a
--long-prompt-len prompt with a --long-prefix-len prefix, where prefill compute matters), and the same
decode/prefill figures for transformers (generate, greedy). Each figure is printed beside its
memory-bandwidth floor: (weight bytes + KV bytes) / HBM bandwidth.

--decode-paths instead compares the reference and the fused decode step of the model runner
(cosyserve.bench.llm_decode): graph-replay and ModelRunner.decode ms/step, kernels per step
and the floor at each --batches size, then the greedy tokens of both paths.
"""

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.bundle.llm import ensure_llm_bundle  # noqa: E402
from cosyserve.bench.llm_decode import (compare_decode_paths, format_decode_table,  # noqa: E402
                                               greedy_agreement, logits_accuracy)
from cosyserve.llm.engine.kv_cache import KVCache  # noqa: E402
from cosyserve.llm.engine.llm_engine import LLMEngine  # noqa: E402
from cosyserve.llm.engine.model_runner import PrefillItem  # noqa: E402
from cosyserve.llm.prompt import SOS_ID, SPEECH_TOKEN_OFFSET, TASK_ID  # noqa: E402
from cosyserve.llm.sampling import SamplingParams  # noqa: E402

DECODE_TARGETS_MS = {1: 1.0, 64: 1.6}  # issue 14
TARGETS = {"decode b1": "<= 2.0", "decode b64": "<= 3.5", "prefill 300": "<= 10", "aggregate 64": ">= 15000"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompt(rng: random.Random, length: int, prefix: list[int]) -> list[int]:
    """``prefix`` + text ids + <|task_id|> + speech ids, ``length`` ids in all."""
    text = [rng.randrange(100, 150000) for _ in range(max(0, (length - len(prefix)) // 3))]
    head = prefix + text + [TASK_ID]
    return head + [SPEECH_TOKEN_OFFSET + rng.randrange(6561) for _ in range(length - len(head))]


class Floors:
    """Memory-bandwidth floors from the model shapes."""

    def __init__(self, engine: LLMEngine, bandwidth: float, peak_flops: float):
        config = engine.runner.config
        model = engine.runner.model
        self.layer_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
        self.head_bytes = sum(p.numel() * p.element_size() for p in model.head.parameters())
        self.hf_head_bytes = (config.vocab_size * config.hidden_size + config.vocab_size) * 2  # full bf16 head
        self.kv_token = KVCache.bytes_per_token(config, engine.runner.dtype)
        self.matmul_params = self.layer_bytes // engine.runner.dtype.itemsize
        self.bandwidth, self.peak_flops = bandwidth, peak_flops

    def decode_ms(self, batch: int, mean_context: float, hf: bool = False) -> float:
        weights = self.layer_bytes + (self.hf_head_bytes if hf else self.head_bytes)
        return (weights + batch * (mean_context + 1) * self.kv_token) / self.bandwidth * 1e3

    def prefill_ms(self, tokens: int, hf: bool = False) -> float:
        weights = self.layer_bytes + (self.hf_head_bytes if hf else self.head_bytes)
        return (weights + tokens * self.kv_token) / self.bandwidth * 1e3

    def prefill_compute_ms(self, tokens: int) -> float:
        return 2 * self.matmul_params * tokens / self.peak_flops * 1e3


def bench_decode(engine: LLMEngine, batch: int, args, rng: random.Random) -> tuple[float, float]:
    """Mean and median ms of decode-only engine steps with ``batch`` running requests."""
    streams = [engine.submit(make_prompt(rng, args.prompt_len, [SOS_ID]),
                             SamplingParams(ignore_eos=True, max_tokens=args.gen_len, seed=i)) for i in range(batch)]
    times = []
    while engine.num_active:
        start = time.perf_counter()
        stats = engine.step()
        elapsed = time.perf_counter() - start
        if stats.prefilled == 0 and stats.decoded == batch:
            times.append(elapsed * 1e3)
    assert all(len(list(s)) == args.gen_len for s in streams)
    return statistics.mean(times), statistics.median(times)


def bench_prefill(engine: LLMEngine, tokens: int, rng: random.Random, repeats: int = 20) -> float:
    """Median ms to prefill a lone ``tokens``-token prompt and sample its first token (what TTFT waits for)."""
    ids = make_prompt(rng, tokens, [SOS_ID])
    engine.runner.sampler.set_requests([0], [SamplingParams()], [0], [[]])
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        engine.runner.prefill([PrefillItem(0, ids, 0)])  # returns the sampled token: synchronised
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def bench_batched_prefill(engine: LLMEngine, count: int, tokens: int, rng: random.Random, repeats: int = 5) -> float:
    """Median ms to prefill ``count`` prompts admitted together (one eager padded batch) and sample them."""
    items = [PrefillItem(slot, make_prompt(rng, tokens, [SOS_ID]), 0) for slot in range(count)]
    engine.runner.sampler.set_requests(list(range(count)), [SamplingParams()] * count, list(range(count)),
                                       [[]] * count)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        engine.runner.prefill(items)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def run_burst(engine: LLMEngine, count: int, prompts: list[list[int]], gen_len: int) -> tuple[float, float]:
    """Submit ``count`` requests at once on the running engine: (wall seconds, mean TTFT ms)."""
    first: dict[int, float] = {}
    start = time.perf_counter()
    streams = []
    for i in range(count):
        submitted = time.perf_counter()
        callback = (lambda i, t0: lambda token: first.setdefault(i, time.perf_counter() - t0))(i, submitted)
        streams.append(engine.submit(prompts[i % len(prompts)], SamplingParams(ignore_eos=True, max_tokens=gen_len,
                                                                                seed=i), on_token=callback))
    for stream in streams:
        assert len(list(stream)) == gen_len
    return time.perf_counter() - start, statistics.mean(first.values()) * 1e3


def bench_hf(model_dir: Path, device: torch.device, args, rng: random.Random) -> dict[str, float]:
    from cosyserve.llm.hf_reference import load_hf_model

    model = load_hf_model(model_dir, device, torch.bfloat16)
    results = {}
    with torch.inference_mode():
        ids = torch.tensor([make_prompt(rng, 300, [SOS_ID])], device=device)
        times = []
        for _ in range(13):
            sync(device)
            start = time.perf_counter()
            model(input_ids=ids)
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        results["prefill 300"] = statistics.median(times[3:])
        for batch in args.hf_batches:
            ids = torch.tensor([make_prompt(rng, args.prompt_len, [SOS_ID]) for _ in range(batch)], device=device)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                          max_new_tokens=args.gen_len, min_new_tokens=args.gen_len)
            model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
            sync(device)
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            sync(device)
            assert out.shape[1] == ids.shape[1] + args.gen_len
            results[f"decode b{batch}"] = (time.perf_counter() - start) * 1e3 / args.gen_len
    del model
    return results


def profile_decode(engine: LLMEngine, batch: int) -> str:
    """Kernel count and GPU time of one eager decode step (what a graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    kv_len = engine.runner.length_buckets[1]
    with torch.inference_mode():
        engine.runner.decode_step(batch, kv_len)
        sync(engine.runner.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.runner.decode_step(batch, kv_len)
            sync(engine.runner.device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in events) / 1e3
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    return f"eager decode step, batch {batch}, kv_len {kv_len}: {len(events)} kernels, {total:.3f} ms GPU time\n{table}"


def mean_context_tokens(args) -> int:
    return args.prompt_len + args.gen_len // 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a random 'real' bundle in /tmp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--gen-len", type=int, default=250)
    parser.add_argument("--prefix-len", type=int, default=50, help="registered prefix (<|sos|> + prompt text)")
    parser.add_argument("--long-prompt-len", type=int, default=600, help="long prompt for the prefix-cache TTFT")
    parser.add_argument("--long-prefix-len", type=int, default=500)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--hf-batches", default="1,16")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a kernel profile of one decode step")
    parser.add_argument("--decode-paths", action="store_true",
                        help="only compare the reference and fused decode steps (floor at --bandwidth)")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="HBM bytes/s (H100 SXM: 3.35e12)")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 FLOP/s (H100 SXM: 989e12)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)

    model_dir = args.model_dir or ensure_llm_bundle("/tmp/cosyserve_llm_real", "real", seed=0)
    if args.decode_paths:
        figures, tokens, logits = compare_decode_paths(model_dir, device, args.batches, context=mean_context_tokens(args),
                                               bandwidth=args.bandwidth)
        for figure in figures:
            print(f"--- {figure.path}, batch {figure.batch}: eager step profile\n{figure.top_kernels}")
        print(greedy_agreement(tokens))
        print(logits_accuracy(logits))
        print(format_decode_table(figures, DECODE_TARGETS_MS))
        return 0
    start = time.perf_counter()
    engine = LLMEngine(model_dir, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                       max_slots=max(args.batches + [args.streams]), max_model_len=1024, max_prefill_tokens=16384)
    init_s = time.perf_counter() - start
    floors = Floors(engine, args.bandwidth, args.peak_flops)
    mean_context = mean_context_tokens(args)
    rows = []  # (figure, measured, unit, floor)

    bench_decode(engine, 4, argparse.Namespace(prompt_len=args.prompt_len, gen_len=8), rng)  # warm-up
    for batch in args.batches:
        mean_ms, median_ms = bench_decode(engine, batch, args, rng)
        rows.append((f"decode b{batch}", mean_ms, "ms/step", floors.decode_ms(batch, mean_context),
                     f"median {median_ms:.3f}"))
    rows.append(("prefill 300", bench_prefill(engine, 300, rng), "ms", floors.prefill_ms(300),
                 f"first token sampled; compute floor {floors.prefill_compute_ms(300):.3f} ms"))
    rows.append((f"prefill {args.streams} x {args.prompt_len} batched", bench_batched_prefill(
        engine, args.streams, args.prompt_len, rng), "ms", floors.prefill_ms(args.streams * args.prompt_len),
        f"eager, first tokens sampled; compute floor {floors.prefill_compute_ms(args.streams * args.prompt_len):.3f} ms"))
    if args.profile and device.type == "cuda":
        for batch in (1, max(args.batches)):
            print(profile_decode(engine, batch))

    engine.start()
    prefix = [SOS_ID] + [rng.randrange(100, 150000) for _ in range(args.prefix_len - 1)]
    prompts = [make_prompt(rng, args.prompt_len, prefix) for _ in range(args.streams)]
    run_burst(engine, 4, prompts, 4)  # warm-up of the threaded path
    wall, burst_ttft = run_burst(engine, args.streams, prompts, args.gen_len)
    tokens_per_s = args.streams * args.gen_len / wall
    rows.append((f"aggregate {args.streams}", tokens_per_s, "tokens/s",
                 args.streams / floors.decode_ms(args.streams, mean_context) * 1e3, f"wall {wall:.2f} s"))
    single = [run_burst(engine, 1, [prompts[i % len(prompts)]], 1)[1] for i in range(10)]
    rows.append(("TTFT 1 request, no prefix cache", statistics.median(single), "ms",
                 floors.prefill_ms(args.prompt_len), ""))
    rows.append((f"TTFT {args.streams} burst, no prefix cache", burst_ttft, "ms mean",
                 floors.prefill_ms(args.prompt_len * args.streams),
                 f"compute floor {floors.prefill_compute_ms(args.prompt_len * args.streams):.3f} ms"))
    engine.register_prefix("voice", prefix)
    single = [run_burst(engine, 1, [prompts[i % len(prompts)]], 1)[1] for i in range(10)]
    rows.append((f"TTFT 1 request, prefix cache ({args.prefix_len} ids)", statistics.median(single), "ms",
                 floors.prefill_ms(args.prompt_len - args.prefix_len), ""))
    wall, burst_ttft = run_burst(engine, args.streams, prompts, args.gen_len)
    rows.append((f"TTFT {args.streams} burst, prefix cache", burst_ttft, "ms mean",
                 floors.prefill_ms((args.prompt_len - args.prefix_len) * args.streams),
                 f"compute floor {floors.prefill_compute_ms((args.prompt_len - args.prefix_len) * args.streams):.3f}"
                 f" ms; aggregate {args.streams * args.gen_len / wall:.0f} tokens/s"))
    long_prefix = [SOS_ID] + [rng.randrange(100, 150000) for _ in range(args.long_prefix_len - 1)]
    long_prompt = [make_prompt(rng, args.long_prompt_len, long_prefix)]
    for label, cached in (("no prefix cache", 1), (f"prefix cache ({args.long_prefix_len} ids)", args.long_prefix_len)):
        if cached > 1:
            engine.register_prefix("long voice", long_prefix)
        single = [run_burst(engine, 1, long_prompt, 1)[1] for _ in range(10)]
        rows.append((f"TTFT 1 request of {args.long_prompt_len}, {label}", statistics.median(single), "ms",
                     floors.prefill_ms(args.long_prompt_len - cached),
                     f"compute floor {floors.prefill_compute_ms(args.long_prompt_len - cached):.3f} ms"))
    engine.close()
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if not args.skip_hf:
        hf = bench_hf(model_dir, device, args, rng)
        for batch in args.hf_batches:
            rows.append((f"hf generate decode b{batch}", hf[f"decode b{batch}"], "ms/step",
                         floors.decode_ms(batch, mean_context, hf=True), "greedy, prefill included"))
        rows.append(("hf prefill 300", hf["prefill 300"], "ms", floors.prefill_ms(300, hf=True), ""))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, {datetime.date.today()}, engine init (load + graph capture) "
          f"{init_s:.1f} s, prompt {args.prompt_len} ids, {args.gen_len} generated")
    header = f"| {'figure':<40} | {'measured':>10} | {'unit':<9} | {'bandwidth floor':>15} | {'target':<9} | note"
    print(header)
    print("|" + "|".join("-" * (len(part)) for part in header.split("|")[1:]))
    for figure, value, unit, floor, note in rows:
        target = TARGETS.get(figure, "")
        print(f"| {figure:<40} | {value:>10.3f} | {unit:<9} | {floor:>15.3f} | {target:<9} | {note}")
    if args.json:
        args.json.write_text(json.dumps([dict(zip(("figure", "measured", "unit", "floor", "note"), r)) for r in rows],
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
