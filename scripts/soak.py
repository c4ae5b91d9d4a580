#!/usr/bin/env python3
"""Soak a running server (issue 16): N streaming + offline requests at a concurrency, with client
cancels, bad inputs and bursts above capacity mixed in; memory of tritonserver and its stubs (and
the GPU's) sampled; failures by class, the memory slope and refused/admitted counts reported.
Exits 1 on any unexpected failure (or a slope above --max-slope-mb). What it does:
cosyserve/bench/soak.py.

    bash run.sh 3 && python3 scripts/soak.py --requests 5000 --concurrency 16 --json outputs/soak.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cosyserve.bench.soak import SoakConfig, format_report, run_soak, write_report
from cosyserve.serving.tritonserver import read_pid_file

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=defaults.url, help="Triton's gRPC address")
    parser.add_argument("--http-port", type=int, default=defaults.http_port, help="Triton's HTTP port (readiness)")
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port)
    parser.add_argument("--server-pid", type=int, help="tritonserver's pid (default: from --pid-file)")
    parser.add_argument("--pid-file", type=Path, default=REPO_ROOT / "outputs" / "tritonserver.pid",
                        help="run.sh's SERVER_PID_FILE; memory is not sampled when neither gives a pid")
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s,
                        help="send only the requests that start within this many seconds (a soak for a time)")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--cancel-fraction", type=float, default=defaults.cancel_fraction)
    parser.add_argument("--bad-fraction", type=float, default=defaults.bad_fraction)
    parser.add_argument("--burst-every", type=int, default=defaults.burst_every, help="requests between bursts (0: none)")
    parser.add_argument("--burst-size", type=int, default=defaults.burst_size,
                        help="streams per burst, sent at once on top of --concurrency")
    parser.add_argument("--tokens", type=int, default=defaults.tokens,
                        help="speech tokens per request (default: the server's limits)")
    parser.add_argument("--cancel-tokens", type=int, default=defaults.cancel_tokens)
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="requests before memory counts")
    parser.add_argument("--sample-interval-s", type=float, default=defaults.sample_interval_s)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--offline-model", default=defaults.offline_model)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-slope-mb", type=float,
                        help="fail when the total memory slope exceeds this many MB per 1000 requests")
    parser.add_argument("--json", type=Path, help="write the whole report (samples included) here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server_pid = args.server_pid or read_pid_file(args.pid_file)
    config = SoakConfig(
        url=args.url, http_port=args.http_port, metrics_port=args.metrics_port, server_pid=server_pid,
        requests=args.requests, duration_s=args.duration_s, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction,
        bad_fraction=args.bad_fraction, burst_every=args.burst_every, burst_size=args.burst_size, tokens=args.tokens,
        cancel_tokens=args.cancel_tokens, warmup=args.warmup, sample_interval_s=args.sample_interval_s,
        request_timeout_s=args.request_timeout_s, model=args.model, offline_model=args.offline_model, seed=args.seed)
    report = run_soak(config, progress=lambda line: print(line, flush=True))
    print(format_report(report))
    if args.json:
        write_report(report, args.json)
    slope = report.memory_slope_mb_per_1000.get("total")
    too_steep = args.max_slope_mb is not None and slope is not None and slope > args.max_slope_mb
    if too_steep:
        print(f"memory slope {slope:+.1f} MB per 1000 requests is above --max-slope-mb {args.max_slope_mb:g}")
    return 1 if report.unexpected or too_steep else 0


if __name__ == "__main__":
    sys.exit(main())
