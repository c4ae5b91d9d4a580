#!/usr/bin/env python3
"""The engine core in-process: open and closed loops, first chunk, underruns, per-stage profile (cosyserve.bench.engine)."""
from cosyserve.bench.engine import main

if __name__ == "__main__":
    main()
