#!/usr/bin/env python3
"""Text fed into the API's text-in WebSocket as an LLM writes it (cosyserve/bench/text_socket.py):
per level, N sockets at once, each sending the text word by word at --chars-per-s; prints a table
(first audio after the first piece's last character p50/p95, sockets with gaps between pieces,
total time) and writes the JSON.

    python scripts/bench_text_socket.py --url http://127.0.0.1:8080 --sockets 1 4 16 --chars-per-s 20
    python scripts/bench_text_socket.py --voice voice_... --model cosyvoice3 --api-key KEY --text "..."
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bench.text_socket import DEFAULT_TEXT, HEADER, run_level, socket_url, summary, table_row  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the API")
    parser.add_argument("--voice", default="001")
    parser.add_argument("--model", default="cosyvoice2")
    parser.add_argument("--api-key")
    parser.add_argument("--sockets", type=int, nargs="+", default=[1, 4, 16], help="levels: sockets at once")
    parser.add_argument("--chars-per-s", type=float, default=20.0, help="how fast each socket's text is sent")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--json", help="write the levels here")
    args = parser.parse_args()
    url = socket_url(args.url, args.voice, args.model)
    levels = []
    print(HEADER, flush=True)
    for sockets in args.sockets:
        level = summary(sockets, asyncio.run(run_level(url, sockets, args.text, args.chars_per_s, args.api_key)))
        levels.append(level)
        print(table_row(level), flush=True)
        for error in level["errors"]:
            print(f"  error: {error}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"url": url, "chars_per_s": args.chars_per_s, "text": args.text,
                                               "levels": levels}, indent=2))
    return 0 if all(level["failed"] == 0 for level in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
