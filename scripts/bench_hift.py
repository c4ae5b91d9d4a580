#!/usr/bin/env python3
"""HiFT per streaming chunk call: float32 vs float16 / bfloat16 network, eager vs CUDA graphs.

    python scripts/bench_hift.py                                   # real size, random init
    python scripts/bench_hift.py --model-dir /tmp/models/CosyVoice2-0.5B --fixtures ../shared/parity/cosyvoice2

The shapes are those the token2wav model captures at load (`streaming_vocoder_frames`: mel frames
of the non-final chunks, cached frames included). Each row: median of ``--runs`` whole
`HiftRunner` calls, kernel count, launch and arithmetic floors, rel-L2 against float32 with TF32
off (cosyserve/bench/hift.py). Needs a CUDA device.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.bench import hift  # noqa: E402
from cosyserve.token2wav.cosyvoice2 import streaming_vocoder_frames  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="a CosyVoice2 directory with hift.pt (default: random real-size weights)")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16", help=f"comma-separated, of {list(hift.DTYPES)}")
    parser.add_argument("--rows", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=750, help="longest stream the shapes cover")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--compile", action="store_true",
                        help="also each dtype with the network through torch.compile (one compilation per shape)")
    parser.add_argument("--fixtures", type=Path, help="../shared/parity/cosyvoice2: also check each dtype there")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device")
    dtypes = args.dtypes.split(",")
    if any(d not in hift.DTYPES for d in dtypes):
        parser.error(f"--dtypes must name only {list(hift.DTYPES)}")
    hift.main(args.model_dir, dtypes, [int(r) for r in args.rows.split(",")],
                    streaming_vocoder_frames(args.max_tokens), args.runs, args.fixtures,
                    args.compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
