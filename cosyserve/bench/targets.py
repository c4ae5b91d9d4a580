"""The performance targets of issue 7, checked per server variant and offline_inference run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Target:
    text: str
    check: Callable[[list[dict]], tuple[bool | None, str]]  # a variant's levels -> (passed, measured)


def _level(rows: list[dict], mode: str, concurrency: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["concurrency"] == concurrency and not r.get("error")),
                None)


def _smooth(row: dict) -> bool:
    """Every request served, and no stream stalled."""
    return row["failed"] == 0 and row.get("requests_with_underrun") == 0


def _first_chunk_p50_at_1(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "streaming", 1)
    if row is None or row["first_chunk_p50_ms"] is None:
        return None, "streaming at concurrency 1 not measured"
    return row["first_chunk_p50_ms"] <= 60 and row["failed"] == 0, f"p50 {row['first_chunk_p50_ms']:.1f} ms"


def _p95_at_16(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "streaming", 16)
    if row is None or row["first_chunk_p95_ms"] is None:
        return None, "streaming at concurrency 16 not measured"
    return (row["first_chunk_p95_ms"] <= 300 and _smooth(row),
            f"p95 {row['first_chunk_p95_ms']:.1f} ms, {row['requests_with_underrun']} requests with underruns, "
            f"{row['failed']} failed")


def _throughput(rows: list[dict]) -> tuple[bool | None, str]:
    streaming = [r for r in rows if r["mode"] == "streaming" and not r.get("error")]
    if not streaming:
        return None, "streaming not measured"
    smooth = [r for r in streaming if _smooth(r)]
    if not smooth:
        return False, "every streaming level had underruns or failures"
    best = max(smooth, key=lambda r: r["req_per_s"] or 0.0)
    return best["req_per_s"] >= 16, f"{best['req_per_s']:.2f} req/s at concurrency {best['concurrency']}"


def _streams_64(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "streaming", 64)
    if row is None:
        return None, "streaming at concurrency 64 not measured"
    return _smooth(row), f"{row['requests_with_underrun']} requests with underruns, {row['failed']} failed"


def _offline_rtf_at_16(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "offline", 16)
    if row is None or row["rtf"] is None:
        return None, "offline mode at concurrency 16 not measured"
    return row["rtf"] <= 0.01 and row["failed"] == 0, f"RTF {row['rtf']:.4f}, {row['failed']} failed"


SERVER_TARGETS = (
    Target("first chunk p50 <= 60 ms at concurrency 1", _first_chunk_p50_at_1),
    Target("concurrency 16: first chunk p95 <= 300 ms, zero underruns", _p95_at_16),
    Target(">= 16 req/s with zero underruns at a fixed concurrency", _throughput),
    Target("64 concurrent streams without underruns", _streams_64),
    Target("offline mode RTF <= 0.01 at concurrency 16", _offline_rtf_at_16),
)
OFFLINE_INFERENCE_TARGET = "offline_inference RTF <= 0.006 at batch 16"


def check_targets(levels: list[dict], variants: list[dict], offline_rows: list[dict]) -> list[dict]:
    results = []
    for target in SERVER_TARGETS:
        for variant in variants:
            passed, measured = target.check([r for r in levels if r["variant"] == variant["name"]])
            results.append({"target": target.text, "subject": variant["name"], "passed": passed, "measured": measured})
    batch16 = [r for r in offline_rows if not r.get("error") and r.get("batch_size") == 16]
    for row in batch16:
        results.append({"target": OFFLINE_INFERENCE_TARGET, "subject": row["name"], "passed": row["rtf"] <= 0.006,
                        "measured": f"RTF {row['rtf']:.4f}"})
    if not batch16:
        results.append({"target": OFFLINE_INFERENCE_TARGET, "subject": "-", "passed": None,
                        "measured": "no offline_inference run at batch 16"})
    return results


def verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "MISS", None: "NOT RUN"}[passed]



def targets_text(results: list[dict]) -> str:
    return "".join(f"- {verdict(t['passed'])}: {t['target']} [{t['subject']}]: {t['measured']}\n" for t in results)
