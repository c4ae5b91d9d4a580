#!/usr/bin/env python3
"""A voice uploaded through the API and spoken at once: POST /v1/audio/voices with a never-seen WAV,
its first request right after, against the registered voice (cosyserve/bench/voice_upload.py).

    python scripts/bench_voice_upload.py --url http://127.0.0.1:8080 --rounds 5 --seconds 10 \
        --metrics 127.0.0.1:8002 --json out.json

Prints each round, then a markdown table of the medians (and, with --metrics, of each request's
first-chunk stages as the server traced them).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bench import voice_upload  # noqa: E402
from cosyserve.bench.api_load import SpeechTarget  # noqa: E402
from cosyserve.bench.prometheus import metrics_address  # noqa: E402

TEXT = "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the API's base URL")
    parser.add_argument("--model", default="cosyvoice2")
    parser.add_argument("--voice", default="001", help="the registered voice to compare with")
    parser.add_argument("--api-key")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each uploaded clip")
    parser.add_argument("--metrics", metavar="HOST:PORT", help="a Triton server's metrics port: each request's "
                        "first chunk split into the server's stages (medians per request kind)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    report = voice_upload.run(SpeechTarget(args.url, args.voice, args.api_key, args.model), args.text, args.rounds,
                              args.seconds, metrics_at=metrics_address(args.metrics) if args.metrics else None)
    print(voice_upload.table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
