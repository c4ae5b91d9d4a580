#!/usr/bin/env python3
"""Time of the token2wav flow engine's packed chunk runs, eager and from CUDA graphs, beside the
reference's full re-run of the prefix; prints a markdown table (cosyserve/bench/flow_engine.py).

    python scripts/bench_flow_engine.py --device cuda --dtype fp16 --streams 1 16
    python scripts/bench_flow_engine.py --config tiny --modes eager        # CPU smoke run
    python scripts/bench_flow_engine.py --page-moves                         # pool <-> step buffer moves

Random weights of the released shapes (timing depends on shapes only).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.bench.flow_engine import DTYPES, HEADER, markdown_row, run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("real", "tiny"), default="real")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: fp16 on a GPU, fp32 on the CPU (no fp16 LayerNorm there)")
    parser.add_argument("--prompt-tokens", type=int, default=137, help="5.5 s of prompt")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", choices=("eager", "graphs"), default=["eager", "graphs"])
    parser.add_argument("--pool-gb", type=float, default=8.0, help="the engine's state pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also one first-chunk run per streams count under torch.profiler (CUDA): GPU busy vs wall")
    parser.add_argument("--page-moves", action="store_true",
                        help="only one step's page moves (pool <-> step buffer), PyTorch ops against the Triton kernel")
    args = parser.parse_args()
    if "graphs" in args.modes and not args.device.startswith("cuda") and not args.page_moves:
        parser.error("graphs need --device cuda")
    args.dtype = args.dtype or ("fp16" if args.device.startswith("cuda") else "fp32")
    print(HEADER, flush=True)
    for row in run(args):
        print(markdown_row(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
