#!/usr/bin/env python3
"""Benchmark several Triton servers at once (disaggregated Step-Audio2 serving) and merge the reports.

    python scripts/bench_disaggregated.py --servers localhost:18001 localhost:18002 \\
        --model-name cosyvoice2_dit --num-tasks 1 2 4 --manifest-path data/manifest.txt --log-dir log_disagg

For each ``--num-tasks`` value N, one ``client_grpc.py`` per server runs at the same time with N
concurrent tasks (so N x servers streams in flight), each over the whole item list. Their JSON
reports are merged: latency percentiles over every request of every server, RTF = the longest
client wall time / all audio produced. Prints one table row per N and writes
``<log-dir>/summary.json`` (plus each client's own report and wavs under
``<log-dir>/tasks_<N>/<host>_<port>/``). Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from cosyserve import clients  # noqa: E402

COLUMNS = ("tasks/server", "servers", "streams", "requests", "failed", "RTF", "first chunk avg ms", "p50", "p90",
           "p99", "latency avg ms")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", required=True, help="host:grpc_port of each Triton server")
    parser.add_argument("--model-name", default="cosyvoice2_dit")
    parser.add_argument("--mode", choices=["streaming", "offline"], default="streaming")
    parser.add_argument("--num-tasks", type=int, nargs="+", default=[1], help="concurrent tasks per server (a sweep)")
    parser.add_argument("--manifest-path", help="file of utt|prompt_text|prompt_wav|target_text lines")
    parser.add_argument("--huggingface-dataset", help="used when no --manifest-path is given")
    parser.add_argument("--split-name", default="wenetspeech4tts")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if not args.manifest_path and not args.huggingface_dataset:
        parser.error("give --manifest-path or --huggingface-dataset")
    if any(n < 1 for n in args.num_tasks):
        parser.error("--num-tasks values must be >= 1")
    return args


def client_command(args: argparse.Namespace, server: str, num_tasks: int, out: Path) -> list[str]:
    host, _, port = server.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"error: server {server!r} is not host:port")
    data = (["--manifest-path", args.manifest_path] if args.manifest_path
            else ["--huggingface-dataset", args.huggingface_dataset, "--split-name", args.split_name])
    return [sys.executable, str(REPO_ROOT / "client_grpc.py"), "--server-addr", host, "--server-port", port,
            "--model-name", args.model_name, "--mode", args.mode, "--num-tasks", str(num_tasks), *data,
            "--log-dir", str(out), "--json-report", str(out / "report.json"), "--log-interval", "0",
            "--request-timeout", str(args.request_timeout)]


def run_clients(args: argparse.Namespace, num_tasks: int) -> list[dict]:
    """One client per server, all at once; their JSON reports (a client that crashed fails the run)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    runs = []
    for server in args.servers:
        out = args.log_dir / f"tasks_{num_tasks}" / server.replace(":", "_")
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "client.log", "w")
        runs.append((server, out, log, subprocess.Popen(client_command(args, server, num_tasks, out), stdout=log,
                                                        stderr=subprocess.STDOUT, env=env)))
    reports = []
    for server, out, log, process in runs:
        process.wait()
        log.close()
        report = out / "report.json"
        if not report.is_file():
            tail = (out / "client.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"error: the client for {server} exited with {process.returncode} and no report:\n{tail}")
        reports.append(json.loads(report.read_text()))
    return reports


def merge(reports: list[dict], mode: str) -> dict:
    """One summary over the requests of every server; wall time = the slowest client's."""
    names = {f.name for f in fields(clients.RequestResult)}
    results = [clients.RequestResult(**{k: v for k, v in r.items() if k in names})
               for report in reports for r in report["per_request"]]
    summary = clients.summarize(results, max(report["wall_s"] for report in reports), mode)
    summary["servers"] = [{"server": r["server"], "requests": r["requests"], "failed": r["failed"], "rtf": r["rtf"],
                           "first_chunk_latency": r.get("first_chunk_latency")} for r in reports]
    return summary


def table_row(num_tasks: int, summary: dict) -> list[str]:
    first = summary.get("first_chunk_latency") or {"count": 0}
    latency = summary["latency"]

    def ms(stats: dict, key: str) -> str:
        return f"{stats[key]:.1f}" if stats.get("count") else "n/a"

    servers = len(summary["servers"])
    rtf = summary["rtf"]
    return [str(num_tasks), str(servers), str(num_tasks * servers), str(summary["requests"]), str(summary["failed"]),
            f"{rtf:.4f}" if rtf is not None else "n/a", ms(first, "avg_ms"), ms(first, "p50_ms"), ms(first, "p90_ms"),
            ms(first, "p99_ms"), ms(latency, "avg_ms")]


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    summaries, rows = {}, []
    for num_tasks in args.num_tasks:
        print(f"{len(args.servers)} servers x {num_tasks} tasks ...", flush=True)
        summaries[str(num_tasks)] = summary = merge(run_clients(args, num_tasks), args.mode)
        rows.append(table_row(num_tasks, summary))
    table = markdown(rows)
    print(table, end="")
    (args.log_dir / "summary.md").write_text(table)
    (args.log_dir / "summary.json").write_text(json.dumps(
        {"model_name": args.model_name, "mode": args.mode, "servers": args.servers, "by_tasks_per_server": summaries},
        indent=2, ensure_ascii=False))
    return 1 if any(s["failed"] for s in summaries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
