#!/usr/bin/env python3
"""Open-loop load on the OpenAI-compatible speech API (cosyserve/bench/api_load.py): per arrival
rate, Poisson arrivals of streamed pcm requests; prints a table (first audio p50/p95, failures and
429 refusals, playback underruns) and the highest rate without failures or stalls.

    python scripts/bench_api.py --url http://127.0.0.1:8080 --rates 2 5 10 --requests-per-rate 40
    python scripts/bench_api.py --url http://api:8080 --api-key KEY --voice voice_... --texts texts.txt
    python scripts/bench_api.py --model cosyvoice3 --voice voice_... --rates 5 10 15 --seconds-per-rate 30
    python scripts/bench_api.py --rates 8 --requests-per-rate 200 --kill-after 10 --kill-pid-file outputs/disaggregated/tritonserver_3.pid

--kill-after S with --kill-pid-file F sends SIGKILL to the process whose pid F holds S seconds into
the last rate's run (a Triton server behind the API dying mid-run), and reports the failures of the
requests that arrived before the kill apart from those that arrived after it (which should be none).

Point it at an API with one Triton server or several (--triton-url a,b,c) to compare layouts with
the same command.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bench.api_load import HEADER, SpeechTarget, best_clean_rate, run_rate, table_row  # noqa: E402
from cosyserve.bench.prometheus import first_chunk_stage_ms, metrics_address, scrape_metrics  # noqa: E402

DEFAULT_TEXTS = ["收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
                 "Hello! Thanks for calling. How can I help you today?",
                 "今天天气很好，我们一起去公园散步吧。"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the API's base URL")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 5.0], metavar="R")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--requests-per-rate", type=int, default=20)
    count.add_argument("--seconds-per-rate", type=float, metavar="S",
                       help="instead: the arrivals of S seconds at each rate (at least 10 requests)")
    parser.add_argument("--model", default="cosyvoice2", help="the request's model: cosyvoice2 (tts-1) or cosyvoice3")
    parser.add_argument("--voice", default="001", help="a registered speaker or an uploaded voice's id (CosyVoice3 "
                        "has no registered speakers: upload one through /v1/audio/voices)")
    parser.add_argument("--api-key")
    parser.add_argument("--texts", type=Path, help="one text per line (default: three short zh/en sentences)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json-report", type=Path, help="write every rate's summary here")
    parser.add_argument("--kill-after", type=float, metavar="S", help="seconds into the last rate's run to SIGKILL "
                        "the process of --kill-pid-file")
    parser.add_argument("--kill-pid-file", type=Path)
    parser.add_argument("--metrics", metavar="HOST:PORT", help="a Triton server's metrics port: per rate, the mean "
                        "time of its streams' first chunks in each stage (front door, IPC, prefill, decodes, flow, "
                        "HiFT, send)")
    args = parser.parse_args()
    if (args.kill_after is None) != (args.kill_pid_file is None):
        parser.error("--kill-after and --kill-pid-file go together")
    texts = ([line for line in args.texts.read_text(encoding="utf-8").splitlines() if line.strip()]
             if args.texts else DEFAULT_TEXTS)
    if not texts:
        parser.error(f"{args.texts} holds no text")
    target = SpeechTarget(args.url, args.voice, args.api_key, model=args.model, timeout_s=args.timeout)
    metrics_at = metrics_address(args.metrics) if args.metrics else None
    print(HEADER, flush=True)
    summaries = []
    for n, rate in enumerate(args.rates):
        fault = None
        if args.kill_pid_file and n == len(args.rates) - 1:
            pid = int(args.kill_pid_file.read_text())
            fault = lambda: os.kill(pid, signal.SIGKILL)  # noqa: E731
        requests = max(10, round(rate * args.seconds_per_rate)) if args.seconds_per_rate else args.requests_per_rate
        before = scrape_metrics(*metrics_at) if metrics_at else None
        summary = run_rate(target, texts, rate, requests, args.seed, fault, args.kill_after or 0.0)
        if metrics_at:
            summary["first_chunk_stage_ms"] = first_chunk_stage_ms(before, scrape_metrics(*metrics_at))
        summaries.append(summary)
        print(table_row(summary), flush=True)
        if fault:
            split = summary["fault"]
            print(f"\nkilled pid {pid} at {split['at_s']:g} s: {split['failed_before']} of {split['arrived_before']} "
                  f"requests that arrived before failed {split['errors_before']}; {split['failed_after']} of "
                  f"{split['arrived_after']} that arrived after failed {split['errors_after']}", flush=True)
    if metrics_at:
        print("\nfirst chunk, mean ms per stage (the server's trace):")
        for summary in summaries:
            stages = summary["first_chunk_stage_ms"]
            print(f"  {summary['open_loop']['arrival_rate']:g} req/s: " + (", ".join(f"{k} {v:g}" for k, v in stages.items()) or "none traced"))
    best = best_clean_rate(summaries)
    print(f"\nhighest rate without failures or underruns: {'none' if best is None else f'{best:g} req/s'}")
    if args.json_report:
        args.json_report.parent.mkdir(parents=True, exist_ok=True)
        args.json_report.write_text(json.dumps(summaries, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
