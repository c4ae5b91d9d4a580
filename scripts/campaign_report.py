#!/usr/bin/env python3
"""The JSON files of scripts/gpu_campaign.sh: merged per stage, and one markdown report of the key numbers.

    python scripts/campaign_report.py engine OUT.json -- <scripts/bench_engine.py arguments, without --json>
    python scripts/campaign_report.py merge OUT.json LABEL=FILE... [--extra KEY_VALUE_FILE]
    python scripts/campaign_report.py report --out-dir DIR [--stages STAGES_TSV] [--env ENV_TXT] [--write report.md]

``engine`` runs bench_engine.py in this process and rewrites OUT.json after every level (with
``"partial": true`` until the run ends), so a run stopped by its timeout still leaves the levels
it measured.
``merge`` writes ``{"levels": [{"label": LABEL, **json(FILE)}, ...], **extra}`` (``--extra``: lines
``key=value`` added at the top level). ``report`` reads ``engine.json`` (scripts/bench_engine.py),
``triton_grpc.json`` (client_grpc.py levels) and ``api.json`` (bench_api.py, per language) from
``--out-dir``, whichever are there, and prints tables; missing fields print as ``-``. Standard
library only (``engine`` imports cosyserve), so it runs in any Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cell(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"warning: {path}: {exc}", file=sys.stderr)
        return None


def engine(args: argparse.Namespace) -> int:
    import cosyserve.bench.engine as bench

    out = Path(args.out)
    measure = getattr(bench, "_measure", None)
    if callable(measure):
        def measure_and_save(report, *rest, **kwargs):
            result = measure(report, *rest, **kwargs)
            try:
                out.write_text(json.dumps({**report, "partial": True}, indent=1))
            except (OSError, TypeError, ValueError) as exc:
                print(f"warning: could not save the levels so far: {exc}", file=sys.stderr)
            return result
        bench._measure = measure_and_save
    else:
        print("warning: cosyserve.bench.engine has no _measure: the JSON is written at the end only", file=sys.stderr)
    rest = [a for a in args.bench_args if a != "--"]
    bench.main([*rest, "--json", str(out)])
    return 0


def merge(args: argparse.Namespace) -> int:
    merged: dict = {"levels": []}
    for extra in args.extra or []:
        for line in Path(extra).read_text().splitlines() if Path(extra).is_file() else []:
            key, _, value = line.partition("=")
            if key.strip():
                try:
                    merged[key.strip()] = json.loads(value)
                except ValueError:
                    merged[key.strip()] = value.strip()
    for item in args.items:
        label, _, file = item.rpartition("=")
        data = load(Path(file))
        if data is None:
            continue
        merged["levels"].append({"label": label, **data} if isinstance(data, dict) else {"label": label, "rates": data})
    Path(args.out).write_text(json.dumps(merged, indent=1, ensure_ascii=False))
    print(f"wrote {args.out}: {', '.join(level['label'] for level in merged['levels'])}")
    return 0


def engine_section(data: dict) -> list[str]:
    partial = " **(partial: the run was stopped)**" if data.get("partial") else ""
    lines = [f"### Engine in-process (bench_engine.py){partial}: {data.get('model')} on {data.get('device')}, "
             f"{data.get('tokens')} tokens a reply, switch interval {cell(data.get('switch_interval_ms'), 2)} ms, "
             f"load {cell(data.get('load_s'))} s, "
             f"first request after load {cell(data.get('first_request_ms'))} ms", ""]
    rows = [[lv.get("level"), lv.get("requests"), lv.get("failed"), lv.get("first_p50_ms"), lv.get("first_p95_ms"),
             lv.get("underrun_requests"), lv.get("stall_s"), lv.get("peak_in_flight"), lv.get("busy_ms_per_iteration"),
             lv.get("flow_ms_per_iteration"), lv.get("vocoder_ms_per_iteration"), lv.get("jobs_per_flow_batch"),
             lv.get("prefill_ms"), lv.get("chunk_tokens_ms"), lv.get("chunk_start_ms"), lv.get("launch_ms"), lv.get("gpu_ms"), lv.get("wall_s")]
            for lv in data.get("levels", [])]
    lines += table(["level", "requests", "failed", "first p50 ms", "first p95 ms", "underrun req", "stall s",
                    "peak in flight", "busy ms/it", "flow ms/it", "vocoder ms/it", "jobs/flow batch",
                    "1st: prefill ms", "1st: chunk tokens ms", "1st: chunk start ms", "1st: launch ms", "1st: gpu ms", "wall s"], rows)
    if data.get("kernel_profile"):
        from cosyserve.bench.engine import kernel_table
        lines += ["", kernel_table(data["kernel_profile"])]
    if data.get("host_syncs"):
        syncs = data["host_syncs"]
        lines += ["", f"host syncs at {syncs['rate']:g} req/s (torch's sync debug mode): {syncs['syncs']}", ""]
        lines += table(["source line", "syncs"], [[entry["line"], entry["count"]] for entry in syncs["top"]])
    return lines


def latency(summary: dict, key: str, q: str):
    return (summary.get(key) or {}).get(q)


def triton_section(data: dict) -> list[str]:
    lines = [f"### Triton + client_grpc.py (streaming, registered voice): ready after "
             f"{cell(data.get('triton_ready_s'))} s (run.sh 2 3)", ""]
    rows = []
    for lv in data.get("levels", []):
        under = lv.get("underruns") or {}
        rows.append([lv.get("label"), lv.get("requests"), lv.get("failed"),
                     latency(lv, "first_chunk_latency", "p50_ms"), latency(lv, "first_chunk_latency", "p95_ms"),
                     latency(lv, "second_chunk_latency", "p50_ms"), latency(lv, "latency", "p50_ms"),
                     under.get("requests_with_underrun"), under.get("stall_s"),
                     None if lv.get("rtf") is None else f"{lv['rtf']:.4f}", lv.get("wall_s")])
    return lines + table(["load", "requests", "failed", "first chunk p50 ms", "p95 ms", "second chunk p50 ms",
                          "total p50 ms", "underrun req", "stall s", "RTF", "wall s"], rows)


def api_section(data: dict) -> list[str]:
    lines = ["### API + bench_api.py (open loop, pcm stream)", ""]
    rows = []
    for lv in data.get("levels", []):
        for s in lv.get("rates", []):
            under = s.get("underruns") or {}
            loop = s.get("open_loop") or {}
            rows.append([lv.get("label"), loop.get("arrival_rate"), s.get("requests"), s.get("failed"), s.get("refused"),
                         latency(s, "first_chunk_latency", "p50_ms"), latency(s, "first_chunk_latency", "p95_ms"),
                         under.get("requests_with_underrun"), under.get("stall_s"), loop.get("peak_in_flight"),
                         ", ".join(f"{k} {v:g}" for k, v in (s.get("first_chunk_stage_ms") or {}).items()) or None,
                         ", ".join(s.get("errors") or []) or None])
    order = {label: i for i, label in enumerate(dict.fromkeys(row[0] for row in rows))}
    rows.sort(key=lambda row: (order[row[0]], row[1] or 0))
    return lines + table(["texts", "rate req/s", "requests", "failed", "429", "first audio p50 ms", "p95 ms",
                          "underrun req", "stall s", "peak in flight", "first chunk stages (mean ms)", "errors"], rows)


def report(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    lines = ["## GPU campaign (scripts/gpu_campaign.sh)", ""]
    if args.env and Path(args.env).is_file():
        lines += ["```", Path(args.env).read_text().strip(), "```", ""]
    if args.stages and Path(args.stages).is_file():
        steps = [line.split("\t") for line in Path(args.stages).read_text().splitlines() if line.strip()]
        lines += table(["step", "state", "exit", "seconds"], steps) + [""]
    for name, section in (("engine.json", engine_section), ("triton_grpc.json", triton_section),
                          ("api.json", api_section)):
        path = out / name
        if not path.is_file():
            lines += [f"### {name}: not written", ""]
            continue
        data = load(path)
        if isinstance(data, dict):
            try:
                lines += section(data) + [""]
            except Exception as exc:  # a changed format must not hide the rest
                lines += [f"### {name}: could not be read ({type(exc).__name__}: {exc})", ""]
    text = "\n".join(lines)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    e = commands.add_parser("engine", help="bench_engine.py, its JSON rewritten after every level")
    e.add_argument("out")
    e.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_engine.py arguments")
    m = commands.add_parser("merge", help="merge labelled JSON files into one")
    m.add_argument("out")
    m.add_argument("items", nargs="+", metavar="LABEL=FILE")
    m.add_argument("--extra", action="append", help="a file of key=value lines added at the top level")
    r = commands.add_parser("report", help="markdown tables of the campaign's JSON files")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--stages", help="the campaign's stages.tsv (step, state, exit, seconds)")
    r.add_argument("--env", help="a text file (the environment stage's output) shown at the top")
    r.add_argument("--write", help="also write the report here")
    args = parser.parse_args()
    return {"engine": engine, "merge": merge, "report": report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
