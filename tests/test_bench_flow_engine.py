"""scripts/bench_flow_engine.py's page moves on the CPU (the tiny flow): every case, both moves, timed."""

from __future__ import annotations

import argparse

from cosyserve.bench.flow_engine import PAGE_MOVES, markdown_row, run


def test_page_moves_time_each_case_both_ways():
    args = argparse.Namespace(device="cpu", dtype="fp32", config="tiny", seed=0, prompt_tokens=20, pool_gb=0.5,
                              page_moves=True, modes=["eager"], streams=[1])
    rows = list(run(args))
    assert [(r.mode, r.streams, r.what.split(":")[0]) for r in rows] == [
        ("page moves (torch)", windows, move) for _, windows, _ in PAGE_MOVES for move in ("read", "write")]
    assert all(r.ms > 0 for r in rows)
    assert markdown_row(rows[0]).startswith("| page moves (torch) | 8 | read: 8 prompts of 5.5 s")
