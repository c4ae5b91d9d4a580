"""The token2wav flow engine alone: time per packed chunk run, eager and from CUDA graphs, beside
the reference's full re-run of the prefix (``scripts/bench_flow_engine.py``).

Random weights of the real (or tiny) shapes; every stream speaks one voice, whose prompt state is
computed once (timed as "voice prefix") and shared. Per streams count S, the S streams run their
chunks of the reference BLS schedule (18, 43, 93 tokens: hops 15, 25, 50 with 3 look-ahead)
together: one ``FlowEngine.run`` per chunk index, timed after a warm-up round. The rel-L2 compares
stream 0's mel with ``CosyVoice2Flow.inference`` over the whole prefix in the same dtype.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models.flow import CosyVoice2Flow, FlowConfig
from ..token2wav.flow_engine import FlowEngine, page_key_starts
from ..token2wav.page_pool import PageCopy

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CHUNKS = (18, 43, 93)  # tokens so far at each non-final chunk of the reference schedule
FINAL = 150  # tokens of the utterance: the final chunk voices tokens 90..150
NEW_VOICES = (1, 8)  # new voices prepared together
# Page moves timed (--page-moves): (what, windows, pages of each): 8 new voices' 5.5 s prompts' blocks
# (or 8 first windows' context), 16 streams' context a second into their replies (within an 8 GB pool).
PAGE_MOVES = (("8 prompts of 5.5 s", 8, 5), ("16 streams at 5.5 s + 1 s", 16, 4))


@dataclass
class Row:
    mode: str
    streams: int
    what: str
    ms: float
    rel_l2: float | None = None


def _timed(fn, device: torch.device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - start) * 1000


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(args: argparse.Namespace) -> Iterator[Row]:
    """The rows, as they are measured."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = FlowConfig.real() if args.config == "real" else FlowConfig.tiny()
    torch.manual_seed(args.seed)
    flow = CosyVoice2Flow(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(args.seed)
    voice = (torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens), generator=g),
             torch.randn(1, 2 * args.prompt_tokens, cfg.output_size, generator=g).to(device, dtype),
             torch.randn(1, cfg.spk_embed_dim, generator=g).to(device, dtype))
    tokens = torch.randint(0, cfg.vocab_size, (1, FINAL), generator=g)
    if getattr(args, "page_moves", False):
        with torch.inference_mode():
            yield from _page_moves(FlowEngine(flow, pool_bytes=int(args.pool_gb * (1 << 30))), device)
        return
    with torch.inference_mode():
        full = []  # the re-run's frames that each chunk voices
        for i, count in enumerate(CHUNKS):
            def rerun():
                return flow.inference(tokens[:, :count], *voice, streaming=True, finalize=False)
            _timed(rerun, device)  # warm-up
            mel, ms = _timed(rerun, device)
            full.append(mel[:, :, 0 if i == 0 else 2 * (CHUNKS[i - 1] - 3):])
            yield Row("re-run (reference)", 1, f"chunk at {count} tokens", ms)
        for mode in args.modes:
            engine = FlowEngine(flow, pool_bytes=int(args.pool_gb * (1 << 30)), cuda_graphs=mode == "graphs")
            if mode == "graphs":
                for name, (count, seconds) in engine.capture_graphs().items():
                    yield Row(mode, 0, f"capture of {count} graphs: {name}", seconds * 1000)
            _, ms = _timed(lambda: engine.open(*voice).close(), device)
            yield Row(mode, 1, "voice prefix (prompt state, once per voice)", ms)
            yield from _new_voices(engine, cfg, args.prompt_tokens, g, mode)
            for streams in args.streams:
                for repeat in range(2):  # the first round warms up (Triton compiles, eager shapes)
                    opened = [engine.open(*voice) for _ in range(streams)]
                    for i, count in enumerate(CHUNKS):
                        mels, ms = _timed(lambda: engine.run([(s, tokens[:, :count], False) for s in opened]),
                                          device)
                        if repeat:
                            yield Row(mode, streams, f"chunk at {count} tokens", ms, _rel(mels[0], full[i]))
                    if repeat and streams == 1:
                        yield from _final_chunk(flow, engine, opened[0], voice, tokens, mode, device)
                    for stream in opened:
                        stream.close()
                if getattr(args, "profile", False):
                    opened = [engine.open(*voice) for _ in range(streams)]
                    yield _profiled_run(engine, [(s, tokens[:, :CHUNKS[0]], False) for s in opened], mode, streams)
                    for stream in opened:
                        stream.close()
            engine = None  # its pool and graphs go before the next mode's
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _page_moves(engine: FlowEngine, device: torch.device, repeats: int = 20) -> Iterator[Row]:
    """One step's page moves (:class:`PageCopy`) with PyTorch ops and with the Triton kernel (CUDA),
    median of ``repeats``: each case's pages read into a step's key/value buffer, then written back."""
    pool = engine.pool
    layers, frames, width = pool.data.size(2), pool.page_frames, pool.data.size(-1)
    kernels = ("torch", "triton") if device.type == "cuda" else ("torch",)
    for what, windows, each in PAGE_MOVES:
        pages = pool.allocate(windows * each)
        if pages is None:
            raise SystemExit(f"--pool-gb holds {pool.pages} pages, fewer than the {windows * each} of {what}")
        stride = each * frames  # each window's row holds its pages' frames
        kv = torch.zeros(layers, 2 * windows * stride, width, device=device, dtype=pool.data.dtype)
        megabytes = 2 * windows * each * layers * frames * width * kv.element_size() / 1e6
        for name in kernels:
            pool.kernels = name
            copy = PageCopy(pool, pages, page_key_starts([each] * windows, windows, stride, 0, frames), kv)
            for move in ("read", "write"):
                run = getattr(copy, move)
                times = sorted(_timed(lambda: run(3), device)[1] for _ in range(repeats))
                yield Row(f"page moves ({name})", windows, f"{move}: {what}, {megabytes:.0f} MB", times[repeats // 2])
        pool.release(pages)


def _new_voices(engine: FlowEngine, cfg: FlowConfig, prompt_tokens: int, g: torch.Generator, mode: str) -> Iterator[Row]:
    """New voices' preparation (1 voice, then 8 together; the second of two rounds): how long the
    host takes to launch it (what a new voice's first chunk waits for on the loop) and until the
    device is done (what it waits for there)."""
    device, dtype = engine.device, engine.dtype
    for count in NEW_VOICES:
        for repeat in range(2):  # the first round meets one-off costs
            voices = [(torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=g),
                       torch.randn(1, 2 * prompt_tokens, cfg.output_size, generator=g).to(device, dtype),
                       torch.randn(1, cfg.spk_embed_dim, generator=g).to(device, dtype), f"{mode} {count} {repeat} {k}")
                      for k in range(count)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            engine.prepare(voices)
            launched = (time.perf_counter() - started) * 1000
            if device.type == "cuda":  # every stream, the prefix stream's solves too
                torch.cuda.synchronize(device)
            if repeat:
                yield Row(mode, count, f"new voices prepared together: host launch {launched:.1f} ms, then done",
                          (time.perf_counter() - started) * 1000)


def _final_chunk(flow: CosyVoice2Flow, engine: FlowEngine, stream, voice, tokens: torch.Tensor, mode: str,
                 device: torch.device) -> list[Row]:
    """The last chunk both ways: the reference's non-streaming pass over everything, and the engine's
    streaming final (TOKEN2WAV_FINAL=streaming); the rel-L2 between their frames."""
    done = 2 * (CHUNKS[-1] - 3)
    reference, ms_ref = _timed(lambda: flow.inference(tokens, *voice, streaming=False, finalize=True), device)
    streamed, ms = _timed(lambda: engine.run([(stream, tokens, True)])[0], device)
    return [Row("re-run (reference)", 1, f"final chunk at {FINAL} tokens (non-streaming pass)", ms_ref),
            Row(mode, 1, f"final chunk at {FINAL} tokens (streaming final; rel-L2 vs the reference's final)", ms,
                _rel(streamed, reference[:, :, done:]))]


def _profiled_run(engine: FlowEngine, chunks, mode: str, streams: int) -> Row:
    """One first-chunk run under torch.profiler: its wall time beside the summed time of its GPU
    activities (kernels, copies, memsets), which tells a host-bound run from a device-bound one,
    and the count of aten ops the host dispatched."""
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        _, wall = _timed(lambda: engine.run(chunks), engine.device)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in gpu) / 1e3
    cpu_ops = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"))
    return Row(mode, streams, f"first chunk profiled: {len(gpu)} GPU activities busy {busy:.1f} ms, "
                              f"{cpu_ops} aten ops (wall under the profiler)", wall)


HEADER = "| path | streams | what | ms | rel-L2 vs re-run |\n|---|---:|---|---:|---:|"


def markdown_row(r: Row) -> str:
    rel = "" if r.rel_l2 is None else f"{r.rel_l2:.1e}"
    return f"| {r.mode} | {r.streams or ''} | {r.what} | {r.ms:.2f} | {rel} |"
