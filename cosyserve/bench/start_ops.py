"""A CPU proxy of the engine loop's start stage: the top-level operators a kind's ``start_chunks``
runs (and its host time) for a batch of N streams' first chunks and for their second chunks, under
``torch.profiler``. The loop's host time per batch grows with these operators, each one a Python call
into the dispatcher with the GIL held (on a GPU: each also launches its kernels), so their count per
stream is what a change to the start stage must bring down (docs/benchmarks.md, twenty-fourth session:
CosyVoice2's chunk encoder adds ~30 operators per stream and encoder layer).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

FIRST_TOKENS = 18  # a first chunk: 15 tokens + 3 of look-ahead (the reference's schedule)
SECOND_TOKENS = 25  # then 25 more


def start_stage_ops(kind, features, counts: list[int], top: int = 8) -> list[dict]:
    """For each count of streams of the voice ``features``: the operators and host ms of one
    ``start_chunks`` call over their first chunks, then over their second ones (each measured on a
    second batch of streams, the first having built whatever a shape builds once)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for count in counts:
        for measured in (False, True):
            voicings = [kind.open(features) for _ in range(count)]
            try:
                row = {"streams": count}
                ids, voiced = list(range(1, FIRST_TOKENS + 1)), 0
                for name in ("first", "second"):
                    chunks = [(voicing, ids, voiced, False) for voicing in voicings]
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        began = time.perf_counter()
                        jobs = kind.start_chunks(chunks)
                        row[f"{name}_ms"] = (time.perf_counter() - began) * 1e3
                    operators = [e.name for e in prof.events() if e.cpu_parent is None]
                    row[f"{name}_ops"] = len(operators)
                    row[f"{name}_top"] = collections.Counter(operators).most_common(top)
                    kind.solve(jobs)
                    for job in jobs:
                        kind.mel(job)
                    voiced, ids = len(ids), list(range(1, len(ids) + SECOND_TOKENS + 1))
            finally:
                for voicing in voicings:
                    voicing.close()
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| streams | first chunks: operators | host ms | second chunks: operators | host ms |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['streams']} | {r['first_ops']} | {r['first_ms']:.1f} | {r['second_ops']} | {r['second_ms']:.1f} |"
              for r in rows]
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        per = (b["second_ops"] - a["second_ops"]) / max(b["streams"] - a["streams"], 1)
        lines.append(f"\neach stream more adds {per:.0f} operators to a batch's second chunks")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", default="models", help="the bundles (as scripts/bench_engine.py takes them)")
    p.add_argument("--model", default="cosyvoice2", choices=("cosyvoice2", "cosyvoice3"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--voice", default="001", help="registered voice of spk2info.pt")
    p.add_argument("--reference-text", default="希望你以后能够做的比我还好呦。",
                   help="a model without registered voices: the synthetic clip's transcript")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 24])
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)

    from ..engine.service import BUNDLE_DIRS, load_engine
    from ..runtime import resolve_device
    from .engine import registered_voice

    models = Path(args.models_dir)
    model_dir, llm_dir, spk2info = BUNDLE_DIRS[args.model]
    engine = load_engine(args.model, models / model_dir, models / llm_dir, resolve_device(args.device),
                         spk2info=models / spk2info if spk2info else None)
    try:
        args.reference_audio = None  # registered_voice's synthetic clip, for a model without registered voices
        voice, _ = registered_voice(engine, args)
        rows = start_stage_ops(engine.core.kind, voice.features, args.streams)
    finally:
        engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{args.model} on {args.device}: start_chunks of N streams' first and second chunks")
    print(table(rows))
