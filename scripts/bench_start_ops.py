#!/usr/bin/env python3
"""A CPU proxy of the loop's start stage: a kind's start_chunks operators per batch of N streams
(cosyserve.bench.start_ops)."""
from cosyserve.bench.start_ops import main

if __name__ == "__main__":
    main()
