#!/usr/bin/env python3
"""New voices through the front end: speech tokenizer, CAM++ and the whole voice per back end,
device and batch size, for 3-8 s clips never seen before (cosyserve/bench/frontend.py).

    python scripts/make_model_bundle.py --size real --out /tmp/models
    python scripts/bench_frontend.py --model-dir /tmp/models/CosyVoice2-0.5B                    # CUDA if present
    python scripts/bench_frontend.py --model-dir /tmp/models/Fun-CosyVoice3-0.5B-2512 --tokenizer speech_tokenizer_v3.onnx
    python scripts/bench_frontend.py --model-dir /tmp/models/CosyVoice2-0.5B --devices cpu --rounds 3

Prints one line per row as it goes, then a markdown table (``--out`` also writes it to a file).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.bench import frontend  # noqa: E402
from cosyserve.frontend.torch_models import FRONTEND_BACKENDS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="holds campplus.onnx and the tokenizer")
    parser.add_argument("--tokenizer", default="speech_tokenizer_v2.onnx", help="the tokenizer's file name")
    parser.add_argument("--devices", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="comma-separated torch devices (default: cuda when present, else cpu)")
    parser.add_argument("--backends", default=",".join(FRONTEND_BACKENDS), help="comma-separated, of " + ",".join(FRONTEND_BACKENDS))
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (clips arriving together)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per row (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    backends = args.backends.split(",")
    if any(b not in FRONTEND_BACKENDS for b in backends):
        parser.error(f"--backends must name only {FRONTEND_BACKENDS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = frontend.run(args.model_dir, args.tokenizer, args.devices.split(","), backends,
                        [int(b) for b in args.batches.split(",")], args.rounds, args.warmup)
    text = frontend.report(rows, args.model_dir, args.tokenizer)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
