#!/usr/bin/env python3
"""Write a random-weight model bundle with the released layout and file formats.

    python scripts/make_model_bundle.py --size tiny --out models            # seconds, CPU
    python scripts/make_model_bundle.py --size real --out models_real       # real shapes, for GPU benchmarks
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bundle import PARTS, SIZES, make_bundle  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="cosyvoice2,llm",
                        help=f"comma-separated subset of {','.join(PARTS)} (default: cosyvoice2,llm)")
    args = parser.parse_args()
    start = time.perf_counter()
    out = make_bundle(args.out, args.size, args.seed, tuple(p for p in args.parts.split(",") if p))
    print(f"wrote {args.size} bundle ({args.parts}) to {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
