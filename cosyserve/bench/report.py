"""The benchmark's output: tables, ``bench.md``, ``bench.png`` and ``bench.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .targets import targets_text


def fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f} %"


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


LEVEL_COLUMNS = ["variant", "mode", "concurrency", "requests", "failed", "req/s", "first chunk p50 ms", "p95 ms",
                 "p99 ms", "latency p50 ms", "p95 ms", "RTF", "requests with underruns", "underrun stall s"]
RATE_COLUMNS = ["variant", "mode", "rate req/s", "requests", "failed", "offered req/s", "req/s", "peak in flight",
                "first chunk p50 ms", "p95 ms", "p99 ms", "latency p50 ms", "p95 ms", "RTF", "requests with underruns",
                "underrun stall s", "sender late max ms"]


def load_cell(row: dict) -> str:
    """A row's load: its concurrency (closed loop) or its arrival rate in req/s (open loop)."""
    return f"{row['concurrency'] if 'concurrency' in row else row['rate']:g}"


def load_label(row: dict) -> str:
    """The load in words, for progress lines: "x16" or "at 5 req/s"."""
    return f"x{row['concurrency']}" if "concurrency" in row else f"at {row['rate']:g} req/s"


def _latency_cells(r: dict) -> list[str]:
    """first chunk p50/p95/p99, latency p50/p95, RTF, underruns, stall: the cells levels and rates share."""
    streaming = r["mode"] == "streaming"
    return [fmt(r["first_chunk_p50_ms"]), fmt(r["first_chunk_p95_ms"]), fmt(r["first_chunk_p99_ms"]),
            fmt(r["latency_p50_ms"]), fmt(r["latency_p95_ms"]), fmt(r["rtf"], 4),
            str(r["requests_with_underrun"]) if streaming else "n/a",
            fmt(r["underrun_stall_s"], 2) if streaming else "n/a"]


def _error_cells(r: dict, columns: list[str]) -> list[str]:
    return [r["variant"], r["mode"], load_cell(r), str(r["requests"]), "ERROR"] + ["n/a"] * (len(columns) - 5)


def level_table(levels: list[dict]) -> str:
    rows = [_error_cells(r, LEVEL_COLUMNS) if r.get("error") else
            [r["variant"], r["mode"], load_cell(r), str(r["requests"]), str(r["failed"]), fmt(r["req_per_s"], 2),
             *_latency_cells(r)] for r in levels]
    return table(LEVEL_COLUMNS, rows)


def rate_table(rates: list[dict]) -> str:
    rows = [_error_cells(r, RATE_COLUMNS) if r.get("error") else
            [r["variant"], r["mode"], load_cell(r), str(r["requests"]), str(r["failed"]), fmt(r["offered_req_per_s"], 2),
             fmt(r["req_per_s"], 2), str(r["peak_in_flight"]), *_latency_cells(r), fmt(r["start_lag_max_ms"])]
            for r in rates]
    return table(RATE_COLUMNS, rows)


def offline_table(offline_rows: list[dict]) -> str:
    rows = [[r["name"], "ERROR", "", "", "", "", "", ""] if r.get("error") else
            [r["name"], fmt(r["rtf"], 4), fmt(r["frontend_time_s"], 3), fmt(r["engine_time_s"], 3),
             fmt(r["total_time_s"], 3), fmt(r["audio_s"], 2), str(r["batch_size"]), f"{r['backend']} on {r['device']}"]
            for r in offline_rows]
    return table(["offline_inference", "RTF", "front-end s", "engine s", "total_time s", "audio s", "batch",
                  "backend"], rows)


GROUP_ORDER = ("bls", "llm", "token2wav", "frontends")


def compute_table(levels: list[dict], load_column: str = "concurrency") -> str:
    rows = []
    for r in levels:
        groups = r.get("triton_compute") or {}
        for name in sorted(groups, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g)):
            g = groups[name]
            rows.append([r["variant"], r["mode"], load_cell(r), f"{name} ({', '.join(g['models'])})",
                         str(g["executions"]), fmt(g["inferences"] / g["executions"] if g["executions"] else None, 2),
                         fmt(g["queue_avg_ms"]), fmt(g["compute_s"], 3), fmt(g["busy"], 2),
                         percent(g["share"])])
    return table(["variant", "mode", load_column, "model", "executions", "avg batch", "queue avg ms", "compute s",
                  "busy", "share"], rows)


def breakdown_table(levels: list[dict], load_column: str = "concurrency") -> str:
    """The levels' ``server_breakdown`` figures; "" when no level has one (no metrics were read)."""
    rows = []
    for r in levels:
        b = r.get("server_breakdown")
        if b:
            rows.append([r["variant"], r["mode"], load_cell(r), percent(b["flow_busy"]),
                         percent(b["hift_busy"]), percent(b["token2wav_other_busy"]), fmt(b["flow_ms_per_call"]),
                         fmt(b["flow_rows_per_call"], 2), percent(b["flow_padding"]), percent(b["llm_busy"]),
                         fmt(b["llm_step_ms"], 2), fmt(b["llm_rows_per_step"], 2), fmt(b["llm_tokens_per_s"], 0)])
    if not rows:
        return ""
    return table(["variant", "mode", load_column, "flow busy", "HiFT busy", "token2wav other busy", "flow ms/call",
                  "flow rows/call", "flow padding", "LLM busy", "LLM step ms", "LLM rows/step", "LLM tokens/s"], rows)


def git_commit(checkout: Path) -> str:
    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(checkout), *argv], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode:
        return "unknown (not a git checkout)"
    dirty = git("diff", "--quiet", "HEAD", "--").returncode != 0
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def gpu_name() -> str:
    """torch's name for GPU 0, or "cpu"; asked in a child process so that this one holds no CUDA context."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"unknown ({done.stderr.strip()[-200:]})"


def markdown(bench: dict) -> str:
    h = bench["header"]
    lines = [
        "# Triton benchmark (issue 7)", "",
        f"* date: {h['date']}", f"* GPU: {h['gpu']}", f"* command: `{h['command']}`",
        f"* git commit: {h['git_commit']}",
        f"* workload: {h['manifest']} ({h['items']} items), fixed output seconds {h['fixed_output_seconds']} at "
        f"{h['tokens_per_second']:g} tokens/s (seed {h['seed']}), requests per level {h['requests_per_level']}, "
        f"warm-up: every item used {h['warmup_passes']} time(s) at concurrency {h['warmup_concurrency']} per mode "
        "(untimed)",
    ]
    if h["rates"]:
        lines.append(f"* open loop: Poisson arrivals (seed {h['seed']}) at {', '.join(f'{r:g}' for r in h['rates'])} "
                     f"req/s, requests per rate: {h['requests_per_rate']}")
    for v in bench["variants"]:
        overrides = ", ".join(f"{k}={val}" for k, val in v["overrides"].items()) or "none"
        state = f"ERROR: {v['error'].splitlines()[0]}" if v.get("error") else (
            "BLS instances " + ", ".join(f"{m} {n}" for m, n in v["bls_instances"].items())
            + f"; server start {fmt(v.get('server_start_s'))} s")
        lines.append(f"* variant `{v['name']}`: overrides {overrides}{', under CUDA MPS' if v['mps'] else ''}; {state}")
    rates = bench["open_loop"]
    lines += ["", "## Concurrency levels", "", level_table(bench["levels"]).rstrip()]
    if rates:
        lines += ["", "## Open-loop rates", "",
                  "Requests arrive at seeded Poisson times whatever is in flight; req/s = completed requests / time "
                  "from the first arrival to the last reply; sender late = how far behind its arrival time the "
                  "client started a request (large values mean the client, not the server, limited the load).", "",
                  rate_table(rates).rstrip()]
    if bench.get("long_text"):
        lines += ["", "## Long text", "",
                  f"One streaming request of a {bench['long_text'][0]['text_chars']}-character mixed Chinese/English "
                  "text, alone; every text segment gets the fixed output length.", "",
                  level_table(bench["long_text"]).rstrip()]
    if bench["offline_inference"]:
        lines += ["", "## offline_inference.py", "", offline_table(bench["offline_inference"]).rstrip()]
    lines += ["", "## Triton compute time per level", "",
              "busy = compute time / wall time of the level (instances busy on average); share = compute time / "
              "compute time of all models but the BLS, whose compute time includes its waits for the others. The "
              "llm model hands each request to its engine thread, so its compute time is the submission only.", "",
              compute_table(bench["levels"]).rstrip()]
    if rates:
        lines += ["", compute_table(rates, "rate req/s").rstrip()]
    breakdowns = [t.rstrip() for t in (breakdown_table(bench["levels"]), breakdown_table(rates, "rate req/s")) if t]
    if breakdowns:
        lines += ["", "## Server-side breakdown (Prometheus counters, per level)", "",
                  "busy = seconds of that work / wall time of the level; flow and HiFT are GPU time measured with "
                  "CUDA events, token2wav other = token2wav's execute wall time minus both (host work and waits); "
                  "LLM busy is the wall time of the engine's steps. Under MPS the LLM and token2wav overlap, so the "
                  "busy figures may sum past 100 %.", "", "\n\n".join(breakdowns)]
    lines += ["", "## Targets", "", targets_text(bench["targets"]).rstrip()]
    return "\n".join(lines) + "\n"


PANELS = (("first chunk latency (streaming)", "ms"), ("requests with underruns (streaming)", "requests"),
          ("throughput", "requests / s"))


def plot(levels: list[dict], path: Path, rates: list[dict] = ()) -> None:
    """Three panels over concurrency (first chunk p50/p95, requests with underruns, req/s), and the
    same three over the arrival rate below them when there are open-loop rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [("concurrency", [r for r in levels if not r.get("error")])]
    if rates:
        rows.append(("rate", [r for r in rates if not r.get("error")]))
    fig, axes = plt.subplots(len(rows), 3, figsize=(17, 4.8 * len(rows)), squeeze=False)
    for (key, ok), (first_ax, underrun_ax, rate_ax) in zip(rows, axes):
        for variant in dict.fromkeys(r["variant"] for r in ok):
            streaming = sorted((r for r in ok if r["variant"] == variant and r["mode"] == "streaming"),
                               key=lambda r: r[key])
            x = [r[key] for r in streaming]
            if streaming:
                line, = first_ax.plot(x, [r["first_chunk_p50_ms"] for r in streaming], "o-", label=f"{variant} p50")
                first_ax.plot(x, [r["first_chunk_p95_ms"] for r in streaming], "s--", color=line.get_color(),
                              label=f"{variant} p95")
                underrun_ax.plot(x, [r["requests_with_underrun"] for r in streaming], "o-", label=variant)
            for mode, style in (("streaming", "o-"), ("offline", "s--")):
                mode_rows = sorted((r for r in ok if r["variant"] == variant and r["mode"] == mode),
                                   key=lambda r: r[key])
                if mode_rows:
                    rate_ax.plot([r[key] for r in mode_rows], [r["req_per_s"] for r in mode_rows], style,
                                 label=f"{variant} {mode}")
        loads = sorted({r[key] for r in ok})
        if key == "rate" and loads:  # what the server would reach by keeping up
            rate_ax.plot(loads, loads, ":", color="gray", label="arrival rate")
        for ax, (title, unit) in zip((first_ax, underrun_ax, rate_ax), PANELS):
            ax.set_xscale("log", base=2)
            if loads:
                ax.set_xticks(loads, [f"{x:g}" for x in loads])
            ax.set_title(title if key == "concurrency" else f"{title}, open loop")
            ax.set_xlabel("concurrency" if key == "concurrency" else "arrival rate (requests / s)")
            ax.set_ylabel(unit)
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize="small")
        underrun_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(bench: dict, out_dir: Path, draw: bool) -> str:
    """bench.json, bench.md and (when ``draw``) bench.png in ``out_dir``; the markdown text."""
    (out_dir / "bench.json").write_text(json.dumps(bench, indent=2, ensure_ascii=False), encoding="utf-8")
    text = markdown(bench)
    (out_dir / "bench.md").write_text(text, encoding="utf-8")
    if draw:
        plot(bench["levels"], out_dir / "bench.png", bench["open_loop"])
    return text
