#!/usr/bin/env python3
"""Per-chunk cost of the incremental streaming flow vs. the full re-run, as the utterance grows.

    python scripts/bench_flow_stream.py                                  # real size, CPU, 2 Euler steps
    python scripts/bench_flow_stream.py --device cuda --dtype fp16 --steps 10 --chunks 12
    python scripts/bench_flow_stream.py --config tiny --hops 15,25,50,100 --chunks 6

Random weights (the cost does not depend on them). Each row is one non-final chunk: the
incremental FlowStream.step and the upstream-style full re-run of the whole prefix
(CosyVoice2Flow.inference(streaming=True, finalize=False)), their wall times, and the rel-L2
between the new frames of both. Hops: the token counts added per chunk; the last one repeats
(the first chunk also carries the 3 look-ahead tokens, like the Triton scheduler).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, FlowStream  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("real", "tiny"), default="real")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--steps", type=int, default=2, help="Euler steps (10 in production; cost is linear in it)")
    parser.add_argument("--prompt-tokens", type=int, default=50)
    parser.add_argument("--hops", default="25", help="comma-separated tokens per chunk; the last repeats")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--no-full", action="store_true", help="skip the full re-run (incremental timings only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    cfg = FlowConfig.real() if args.config == "real" else FlowConfig.tiny()
    torch.manual_seed(args.seed)
    flow = CosyVoice2Flow(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    hops = [int(h) for h in args.hops.split(",")]
    hops += [hops[-1]] * (args.chunks - len(hops))
    lookahead = cfg.pre_lookahead_len
    total = sum(hops[:args.chunks]) + lookahead
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens), generator=g)
    feat = torch.randn(1, cfg.token_mel_ratio * args.prompt_tokens, cfg.output_size, generator=g)
    embedding = torch.randn(1, cfg.spk_embed_dim, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (1, total), generator=g)
    inputs = [t.to(device) for t in (prompt, feat.to(dtype), embedding.to(dtype))]

    # Warm-up (allocator, kernels) on a short request.
    flow.inference(tokens[:, :2 * lookahead].to(device), *inputs, streaming=True, finalize=False, n_timesteps=1)
    stream = FlowStream(flow, *inputs, n_timesteps=args.steps)
    print(f"flow {args.config} on {device} {args.dtype}, {args.steps} Euler steps, prompt {args.prompt_tokens} tokens, "
          f"{torch.get_num_threads()} CPU threads")
    print(f"{'chunk':>5} {'tokens':>6} {'frames':>6} {'new':>4} {'window':>6} {'incr ms':>9} {'full ms':>9} "
          f"{'speedup':>7} {'rel-L2':>9} {'state MB':>9}")
    count = lookahead
    for chunk, hop in enumerate(hops[:args.chunks]):
        count += hop
        window = cfg.token_mel_ratio * (args.prompt_tokens + count - lookahead) - stream.committed_frames
        done = stream.frames_returned
        mel, incremental = timed(lambda: stream.step(tokens[:, :count].to(device), finalize=False), device)
        row = (f"{chunk:>5} {count:>6} {cfg.token_mel_ratio * (args.prompt_tokens + count - lookahead):>6} "
               f"{mel.size(2):>4} {window:>6} {1e3 * incremental:>9.1f}")
        if args.no_full:
            row += f" {'-':>9} {'-':>7} {'-':>9}"
        else:
            full_mel, full = timed(lambda: flow.inference(tokens[:, :count].to(device), *inputs, streaming=True,
                                                          finalize=False, n_timesteps=args.steps), device)
            ref = full_mel[:, :, done:].float()
            rel = float((mel - ref).norm() / ref.norm())
            row += f" {1e3 * full:>9.1f} {full / incremental:>7.2f} {rel:>9.2e}"
        print(row + f" {stream.state_bytes / 2**20:>9.1f}", flush=True)
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
