#!/usr/bin/env python3
"""Do two CUDA graphs of cuBLAS GEMMs, replayed at once on two streams, corrupt each other's output
when captured on one stream (sharing torch's cuBLAS workspace of that stream) and not when each is
captured on a stream of its own? (cosyserve/bench/graph_workspaces.py). Needs a CUDA device.

    python scripts/check_graph_workspaces.py --rounds 2000
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.bench import graph_workspaces  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000, help="times both graphs are replayed together")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(f"| captured on | rounds | replays corrupted (rel-L2 > {graph_workspaces.CORRUPTED_REL_L2:g}, "
          "of 2 x rounds) | largest rel-L2 |\n|---|---:|---:|---:|")
    for row in graph_workspaces.measure(args.rounds, torch.device("cuda")):
        print(f"| {row.capture} | {row.rounds} | {row.corrupted} | {row.worst_rel_l2:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
