"""Where the GPU's time goes while the engine serves: ``torch.profiler`` (CUDA activity only) around
a piece of load, summarised as the figures the engine's issues are judged by: kernels launched, the
share of them under 10 us, the GPU busy share (the union of kernel and copy intervals over the wall
clock) and the kernels that took the most time. And where the host waits for the GPU: torch's
sync debug mode around a piece of load, its warnings counted by source line. And a timeline of a
piece of load (:func:`trace_until`: every thread's operators and the kernels, a Chrome trace) to
read elsewhere."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

SHORT_US = 10.0
WAIT_US = 200.0  # a host call this long waited (for the device, a lock, an allocation)


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_profile(run: Callable[[], Any], top: int = 12) -> tuple[Any, dict]:
    """``run()``'s result and the summary of the device work recorded while it ran."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        result = run()
        wall_us = (time.perf_counter() - began) * 1e6
    intervals, names = [], defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        start, end = event.time_range.start, event.time_range.end
        intervals.append((start, end))
        entry = names[event.name]
        entry[0] += 1
        entry[1] += end - start
    durations = [end - start for start, end in intervals]
    busy = busy_us(intervals)
    ranked = sorted(names.items(), key=lambda item: -item[1][1])[:top]
    return result, {
        "kernels": len(intervals), "wall_s": wall_us / 1e6, "gpu_busy_share": busy / wall_us if wall_us else None,
        "short_kernel_share": sum(d < SHORT_US for d in durations) / len(durations) if durations else None,
        "median_kernel_us": sorted(durations)[len(durations) // 2] if durations else None,
        "top": [{"name": name[:90], "calls": calls, "ms": round(total / 1e3, 2),
                 "share_of_busy": round(total / busy, 4) if busy else None} for name, (calls, total) in ranked]}


def call_profile(run: Callable[[], Any], top: int = 20) -> dict:
    """One call on the calling thread, profiled (host and device): its host time (launching), the
    time until the device is done with what it queued, its kernels and their device time, and the
    host's time by operator or runtime call with its Python stack (self time: a runtime call that
    waits for the device shows here, with the line that made it)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, with_stack=True) as prof:
        began = time.perf_counter()
        run()
        launched = time.perf_counter()
        sync()
        done = time.perf_counter()
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    waits: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for event in events:  # host calls that took long: who made them (the nearest project frame)
        if event.device_type == DeviceType.CUDA or event.cpu_children or event.time_range.elapsed_us() < WAIT_US:
            continue
        frame = event.cpu_parent
        while frame is not None and "cosyserve/" not in frame.name:
            frame = frame.cpu_parent
        entry = waits[(event.name, "?" if frame is None else frame.name[frame.name.index("cosyserve/"):])]
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    return {"host_ms": 1e3 * (launched - began), "done_ms": 1e3 * (done - began), "kernels": len(kernels),
            "kernel_busy_ms": busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3,
            "long_host_calls": [{"call": name, "from": where, "count": n, "ms": round(ms, 2)}
                                for (name, where), (n, ms) in sorted(waits.items(), key=lambda kv: -kv[1][1])[:top]],
            "table": prof.key_averages(group_by_stack_n=4).table(sort_by="self_cpu_time_total", row_limit=top,
                                                                 max_name_column_width=50)}


def host_syncs(run: Callable[[], Any], top: int = 15) -> tuple[Any, dict]:
    """``run()``'s result and the host-device synchronisations torch saw while it ran (every thread:
    the LLM's waits for its sampled tokens count too), by the source line that made them."""
    import torch

    lines: Counter[str] = Counter()

    def count(message, category, filename, lineno, file=None, line=None) -> None:
        lines[f"{os.path.relpath(filename)}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, {"syncs": sum(lines.values()), "top": [{"line": line, "count": n} for line, n in lines.most_common(top)]}


def trace_until(path: str, run: Callable[[Callable[[], None]], Any], marks: int, timeout_s: float = 60.0) -> dict:
    """``run(mark)`` under ``torch.profiler`` (every thread's operators and runtime calls, CUDA kernels
    and copies) until ``mark()`` has been called ``marks`` times (a request's first chunk, say) or
    ``run`` returns; the Chrome trace, gzipped, goes to ``path`` (open it in Perfetto). Returns how
    long the trace spans and its size (raises ``run``'s error, once the trace is stopped)."""
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    lock, seen, reached, failed = threading.Lock(), [0], threading.Event(), []

    def mark() -> None:
        with lock:
            seen[0] += 1
            if seen[0] >= marks:
                reached.set()

    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    # every thread's operators (by default only the starting thread's are recorded)
    prof = profile(activities=[ProfilerActivity.CPU, *cuda], experimental_config=_ExperimentalConfig(profile_all_threads=True))

    def work() -> None:
        try:
            run(mark)
        except BaseException as exc:  # raised on the caller's thread
            failed.append(exc)
        finally:
            reached.set()

    worker = threading.Thread(target=work, daemon=True)
    prof.start()
    began = time.perf_counter()
    worker.start()
    reached.wait(timeout_s)
    traced_s = time.perf_counter() - began
    prof.stop()
    worker.join()
    if failed:
        raise failed[0]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)
    return {"path": path, "traced_s": round(traced_s, 3), "marks": seen[0], "bytes": os.path.getsize(path)}


def _trace_events(path: str) -> tuple[list[dict], float]:
    """A gzipped Chrome trace's complete events (those with a duration) and its first one's time (us)."""
    import json

    with gzip.open(path) as source:
        events = [e for e in json.load(source)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    return events, min(e["ts"] for e in events)


def trace_summary(path: str, bin_ms: float = 20.0, threads: int = 6, top: int = 10) -> str:
    """A :func:`trace_until` trace as text: each busiest thread's host time (its outermost operators
    and runtime calls) per ``bin_ms`` of the trace, then its self time by operator (a runtime call that
    took long waited: for the device, or for the driver another thread held); each CUDA stream's busy
    time per bin (kernels, copies, memsets)."""
    events, start = _trace_events(path)
    span = max(e["ts"] + e["dur"] for e in events) - start
    width = bin_ms * 1e3
    bins = int(span // width) + 1

    def per_bin(intervals: list[tuple[float, float]]) -> str:
        busy = [0.0] * bins
        for begin, end in intervals:
            begin, end = begin - start, end - start
            while begin < end:
                index = int(begin // width)
                edge = (index + 1) * width
                busy[index] += min(end, edge) - begin
                begin = edge
        return " ".join(f"{b / 1e3:4.1f}" for b in busy)

    host = defaultdict(list)
    device = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            host[e["tid"]].append(e)
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            device[e["args"].get("stream")].append((e["ts"], e["ts"] + e["dur"]))
    lines = [f"trace of {span / 1e3:.1f} ms; busy ms per {bin_ms:g} ms"]
    for tid, calls in sorted(host.items(), key=lambda item: -len(item[1]))[:threads]:
        calls.sort(key=lambda e: (e["ts"], -e["dur"]))
        outer, end, own, counts, open_calls = [], float("-inf"), Counter(), Counter(), []
        for e in calls:
            if e["ts"] >= end:
                outer.append((e["ts"], e["ts"] + e["dur"]))
                end = e["ts"] + e["dur"]
            while open_calls and open_calls[-1][0] <= e["ts"]:
                open_calls.pop()
            if open_calls:
                own[open_calls[-1][1]] -= e["dur"]  # a call's self time leaves out what it called
            own[e["name"]] += e["dur"]
            counts[e["name"]] += 1
            open_calls.append((e["ts"] + e["dur"], e["name"]))
        lines.append(f"thread {tid}: {busy_us(outer) / 1e3:.1f} ms, {len(calls)} calls | {per_bin(outer)}")
        lines += [f"    {us / 1e3:7.1f} ms {counts[name]:6d}  {name[:70]}" for name, us in own.most_common(top)]
    for stream, intervals in sorted(device.items(), key=lambda item: -len(item[1])):
        lines.append(f"stream {stream}: {busy_us(intervals) / 1e3:.1f} ms busy, {len(intervals)} kernels and copies"
                     f" | {per_bin(intervals)}")
    return "\n".join(lines)


def graph_replays(path: str, top: int = 3) -> str:
    """A :func:`trace_until` trace's CUDA graph replays, one line each in launch order: when the host
    launched it (ms into the trace) and for how long (us: a launch waits when the device's queue is
    full), when its first kernel started and how long its kernels spanned (ms), their summed time, their
    count, the launching thread, the streams they ran on and the ``top`` kernels by time (short names).
    Which graph is which shows in its kernels: a window step's attention and GEMMs, a vocoder's
    convolutions, an LLM step's decode attention."""
    events, start = _trace_events(path)
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"}
    kernels = defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["args"].get("correlation") in launches:
            kernels[e["args"]["correlation"]].append(e)
    lines = ["launch ms | launch us | GPU start ms | span ms | kernel ms | kernels | thread | streams | top kernels"]
    for correlation, launch in sorted(launches.items(), key=lambda item: item[1]["ts"]):
        ran = kernels.get(correlation)
        if not ran:
            continue
        first = min(k["ts"] for k in ran)
        span = max(k["ts"] + k["dur"] for k in ran) - first
        by_name = Counter()
        for k in ran:
            by_name[k["name"].split("<")[0].split("(")[0][:40]] += k["dur"]
        streams = ",".join(str(s) for s in sorted({k["args"].get("stream") for k in ran}, key=str)[:4])
        named = "; ".join(f"{name} {us / 1e3:.2f}" for name, us in by_name.most_common(top))
        lines.append(f"{(launch['ts'] - start) / 1e3:9.1f} | {launch['dur']:9.0f} | {(first - start) / 1e3:12.1f} | "
                     f"{span / 1e3:7.2f} | {sum(k['dur'] for k in ran) / 1e3:9.2f} | {len(ran):7d} | {launch['tid']} | "
                     f"{streams} | {named}")
    return "\n".join(lines)
