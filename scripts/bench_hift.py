#!/usr/bin/env python3
"""HiFT per call, eager vs replayed from CUDA graphs, at the streaming chunk shapes.

    python scripts/bench_hift.py --model-dir /tmp/models/CosyVoice2-0.5B

The shapes are those the token2wav model captures at load (`streaming_vocoder_frames`: mel
frames of the non-final chunks of the exponential schedule, cached frames included); each is
timed at several batch sizes (median of ``--runs`` calls after two untimed ones, the whole
`HiftRunner` call: source, network, inverse STFT) with the rel-L2 of the two outputs.
Needs a CUDA device (graphs). Random weights serve: the cost does not depend on them.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.models.hift import load_hift  # noqa: E402
from cosyserve.token2wav.cosyvoice2 import streaming_vocoder_frames  # noqa: E402
from cosyserve.token2wav.graphs import HiftRunner  # noqa: E402


def median_ms(call, runs: int) -> float:
    times = []
    for _ in range(runs + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times = sorted(times[2:])
    return 1000 * times[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="a CosyVoice2 directory with hift.pt")
    parser.add_argument("--rows", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=750, help="longest stream the shapes cover")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device")
    torch.set_num_threads(1)
    hift = load_hift(args.model_dir, "cuda", torch.float32).eval()
    shapes = streaming_vocoder_frames(args.max_tokens)
    rows_list = [int(r) for r in args.rows.split(",")]
    eager, graphs = HiftRunner(hift), HiftRunner(hift, cuda_graphs=True)
    started = time.perf_counter()
    count = graphs.precapture(max(rows_list), shapes)
    print(f"captured {count} HiFT graphs for mel frames {shapes} in {time.perf_counter() - started:.1f} s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print("| rows | mel frames | eager ms | graphs ms | rel-L2 |\n|---:|---:|---:|---:|---:|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in rows_list:
        for frames in shapes:
            mel = torch.randn(rows, 80, frames, device="cuda", generator=g)
            cache = None if frames == shapes[0] else torch.randn(rows, 1, 3840, device="cuda", generator=g).tanh()
            noise = 0.003 * torch.randn(rows, frames * hift.hop_length, hift.m_source.num_harmonics, device="cuda",
                                        generator=g)
            want, got = eager(mel, cache, noise)[0], graphs(mel, cache, noise)[0]
            rel = float((got - want).norm() / want.norm())
            print(f"| {rows} | {frames} | {median_ms(lambda: eager(mel, cache, noise), args.runs):.2f} | "
                  f"{median_ms(lambda: graphs(mel, cache, noise), args.runs):.2f} | {rel:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
