#!/usr/bin/env python3
"""Regenerate docs/performance.md from the benchmark reports in docs/perf/*.json.

    python scripts/performance_page.py                 # after adding a report (one measured run)

The figures, and which run is current for each, are chosen in cosyserve/bench/performance.py;
tests/test_performance_page.py checks that the committed page is what this writes.
"""

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from cosyserve.bench.performance import write_page  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", type=Path, default=REPO_ROOT / "docs" / "perf", help="the reports (*.json)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "performance.md")
    args = parser.parse_args()
    write_page(args.reports, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
