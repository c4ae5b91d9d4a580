#!/usr/bin/env python3
"""Check this implementation against reference test vectors.

    python scripts/check_parity.py --fixtures ../shared/parity/cosyvoice2
    python scripts/check_parity.py --fixtures ../shared/parity/dit
    python scripts/check_parity.py --fixtures ../shared/parity/cosyvoice3

Prints one row per case (max abs error, rel-L2, tolerance, verdict) and exits 1 if any fails.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.parity import SUITES, format_table, run_fixture_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", required=True, type=Path, help="fixture directory")
    parser.add_argument("--suite", action="append", choices=SUITES, help="run only these suites (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the reference used 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        results = run_fixture_dir(args.fixtures, tuple(args.suite) if args.suite else SUITES)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
