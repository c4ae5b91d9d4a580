#!/usr/bin/env python3
"""Estimator Euler step, old (eager) path vs the fused step, with the floor next to each figure (issue 14).

    python scripts/bench_estimator.py                       # fp16 and bf16, all cases, old path too
    python scripts/bench_estimator.py --dtypes fp16 --no-old

Needs a CUDA device. Real-size random weights (cosyserve.bench.estimator has the
cases, the floors and how each figure is measured).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bench import estimator  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated fused dtypes (fp16, bf16)")
    parser.add_argument("--no-old", action="store_true", help="skip the old eager path")
    parser.add_argument("--attention-variant", action="store_true",
                        help="also the fp16 fused step with SDPA over a mask (PyTorch's choice) "
                             "instead of the Triton attention")
    parser.add_argument("--sweep", action="store_true",
                        help="first time the attention and each kind of GEMM kernel under several tiles")
    parser.add_argument("--sweep-sizes", default="small,mid",
                        help=f"comma-separated sizes the sweep times ({', '.join(estimator.SWEEP_SIZES)})")
    parser.add_argument("--gemm-floor", action="store_true",
                        help="each kind of GEMM kernel (built-in tile) against cuBLAS's plain product alone, at the "
                             "--sweep-sizes")
    parser.add_argument("--cases", default="stream1,stream16,offline",
                        help=f"comma-separated cases ({', '.join(estimator.CASES_BY_NAME)}; empty: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if unknown := set(dtypes) - set(estimator.DTYPES):
        parser.error(f"unknown dtypes {sorted(unknown)}")
    sizes = [s for s in args.sweep_sizes.split(",") if s]
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(sizes) - set(estimator.SWEEP_SIZES):
        parser.error(f"unknown sweep sizes {sorted(unknown)}")
    if unknown := set(cases) - set(estimator.CASES_BY_NAME):
        parser.error(f"unknown cases {sorted(unknown)}")
    if args.sweep:
        estimator.sweep_attention()
        estimator.sweep_linear({size: estimator.SWEEP_SIZES[size] for size in sizes})
    if args.gemm_floor:
        estimator.gemm_floor({size: estimator.SWEEP_SIZES[size] for size in sizes})
    if not cases:
        return 0
    chosen = tuple(estimator.CASES_BY_NAME[c] for c in cases)
    ceilings, rows, accuracies = estimator.run(dtypes, chosen, old_path=not args.no_old,
                                               attention_variant=args.attention_variant, seed=args.seed)
    print(estimator.table(ceilings, rows, accuracies, chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
