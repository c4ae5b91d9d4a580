#!/usr/bin/env python3
"""Summarise a trace written by ``bench_engine.py --trace-new-clips PATH`` or ``--trace-while-playing PATH``
(a gzipped Chrome trace): each busy thread's host time per time bin and by operator, each CUDA stream's
busy time per bin.

    python scripts/trace_summary.py trace8.json.gz [--bin-ms 20] [--threads 6] [--top 10]
    python scripts/trace_summary.py trace8.json.gz --replays    # every CUDA graph replay, one line each
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bench.kernels import graph_replays, trace_summary  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--bin-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=6, help="the threads with the most calls")
    parser.add_argument("--top", type=int, default=10, help="operators per thread")
    parser.add_argument("--replays", action="store_true",
                        help="instead, every CUDA graph replay: its launch, span, kernels and thread")
    args = parser.parse_args()
    print(graph_replays(args.trace) if args.replays else trace_summary(args.trace, args.bin_ms, args.threads, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
