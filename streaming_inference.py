#!/usr/bin/env python3
"""Streaming token2wav benchmark over precomputed speech tokens: per-chunk latency and underruns.

    # 16 concurrent listeners, 4-10 s utterances, Triton's exponential chunk schedule
    python streaming_inference.py --model-dir models/CosyVoice2-0.5B --num-tokens 100 150 200 250 \\
        --repeat 4 --concurrency 16 --variants fp32,fp16,fp16+graphs,fp16+graphs+batch16

    # equal chunks of 25 tokens, tokens arriving at 50 tokens/s (an LLM twice as fast as real time)
    python streaming_inference.py --model-dir models/CosyVoice2-0.5B --tokens-file tokens.txt \\
        --strategy equal --hop 25 --token-rate 50

Every utterance is a stream whose listener starts playback when its first piece arrives; the
next chunk is computed as soon as its tokens are there and the previous piece is back. Reported:
first-chunk latency, per-chunk latency (tokens there -> piece back) and its median per chunk
index, playback underruns (a piece arriving after the audio before it finished playing) and
RTF (wall time / audio). Variants as in token2wav.py; ``+batchN`` runs the streams through the
deadline-aware Token2WavBatcher, ``+incremental`` the incremental streaming flow.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback

import torch

from cosyserve.bench.token2wav import (STRATEGIES, add_common_args, markdown_table, parse_variants, prompt_features,
                                      rel_l2, run_streams, utterance_tokens)
from cosyserve.schedule import TOKEN_RATE


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--repeat", type=int, default=1, help="stream every utterance this many times")
    p.add_argument("--concurrency", type=int, default=1, help="listeners at once")
    p.add_argument("--strategy", choices=STRATEGIES, default="exponential",
                   help="exponential: the Triton BLS schedule (15 tokens, then 25, 50, 100...); equal: --hop each")
    p.add_argument("--hop", type=int, default=TOKEN_RATE, help="new tokens per chunk for --strategy equal")
    p.add_argument("--token-rate", type=float, help="tokens arrive at this rate per stream (default: all at once)")
    return p.parse_args(argv)


HEADER = ["variant", "streams", "audio s", "wall s", "RTF", "first chunk p50 ms", "first chunk p90 ms",
          "chunk p50 ms", "chunk p90 ms", "chunk max ms", "underruns", "stall s", "rel-L2 vs first"]


def bench_variant(variant, args, tokens, prompt, reference):
    """Warm-up (the first with zero noise: its audio is the check), then ``--runs`` timed runs."""
    options = dict(concurrency=args.concurrency, strategy=args.strategy, hop=args.hop, token_rate=args.token_rate,
                   batch=variant.batch)
    t2w = variant.load(args.model_dir, args.device)
    try:
        check = run_streams(t2w, tokens, prompt, zero_noise=True, **options)
        for _ in range(variant.warmups - 1):
            run_streams(t2w, tokens, prompt, **options)
        runs = [run_streams(t2w, tokens, prompt, **options) for _ in range(max(1, args.runs))]
    finally:
        del t2w
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    audio = torch.cat([p for s in check.streams for p in s.pieces])
    rel = rel_l2(audio, reference if reference is not None else audio)
    summary = sorted((r.summary() for r in runs), key=lambda s: s["wall_s"])[len(runs) // 2]  # median run
    first, chunk = summary["first_chunk"], summary["chunk"]
    row = [variant.name, summary["streams"], summary["audio_s"], summary["wall_s"], summary["rtf"],
           first["p50_ms"], first["p90_ms"], chunk["p50_ms"], chunk["p90_ms"], chunk["max_ms"],
           summary["underruns"], summary["stall_s"], rel]
    return row, {"median_run": summary, "walls_s": [r.wall_s for r in runs], "rel_l2_vs_first": rel}, audio


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompt = prompt_features(args.model_dir, args.speaker_id, args.reference_audio)
    tokens = utterance_tokens(args) * max(1, args.repeat)
    print(f"device={args.device} streams={len(tokens)} concurrency={args.concurrency} strategy={args.strategy} "
          f"token_rate={args.token_rate or 'all at once'}")
    rows, report, reference = [], {}, None
    for variant in parse_variants(args.variants):
        try:
            row, report[variant.name], audio = bench_variant(variant, args, tokens, prompt, reference)
        except Exception as exc:  # report it and go on with the other variants
            traceback.print_exc()
            summary = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            row, report[variant.name] = [variant.name, summary], {"error": repr(exc)}
        else:
            reference = audio if reference is None else reference
            by_index = ", ".join(f"{x:.1f}" for x in report[variant.name]["median_run"]["chunk_index_median_ms"])
            print(f"  {variant.name}: median chunk latency by chunk index (ms): {by_index}", flush=True)
        rows.append(row)
        print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADER, rows))
    if args.output_json:
        args.output_json.write_text(json.dumps({"device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
                                                "results": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
