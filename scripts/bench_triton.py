#!/usr/bin/env python3
"""The Triton benchmark of issue 7: server variants x modes x concurrency levels (closed loop) and
arrival rates (open loop), offline_inference runs, one table, the targets checked.

    python3 scripts/bench_triton.py --models-dir models --out-dir outputs/bench --rates 5 10 20 \\
        --variant ours:OFFLINE_BLS_INSTANCE_NUM=16 \\
        --variant final:OFFLINE_BLS_INSTANCE_NUM=16,TOKEN2WAV_FINAL=streaming \\
        --offline-inference "torch:--backend torch --batch-size 16 --token2wav-batch-size 16 --cuda-graphs"

For each ``--variant NAME:KEY=VAL,...`` (default: ``ours``, no overrides):

1. ``bash run.sh 2 2`` builds its model repository under ``<out-dir>/<NAME>/`` with the overrides
   in the environment (any run.sh setting: TOKEN2WAV_FINAL, TOKEN2WAV_CUDA_GRAPHS, DEVICE...). The
   server gets the same environment, so settings that models read at run time apply too. ``MPS=1``
   runs the server under a CUDA MPS control daemon started for it (pipes and logs in
   ``<out-dir>/<NAME>/mps``) and quit afterwards.
2. The server starts on ``--http-port/--grpc-port/--metrics-port`` (log ``<out-dir>/<NAME>/tritonserver.log``).
3. Per mode, an untimed warm-up sends every item used once at concurrency 16 (CUDA graphs are
   captured the first time a shape is seen), then ``client_grpc.py --json-report`` runs once per
   ``--concurrency`` level with ``--requests-per-level`` requests (default max(26, 2 x level)),
   every request exactly ``round(rate x s)`` speech tokens long (``--fixed-output-seconds``: the
   same seeded per-item draws as offline_inference.py; 960 samples a token at 24 kHz). Streaming
   uses the decoupled ``cosyvoice2``; offline uses ``cosyvoice2_offline``, the non-decoupled twin
   run.sh serves next to it (or ``cosyvoice2`` itself when a variant sets DECOUPLED_MODE=False).
   Then, per ``--rates`` value R, ``client_grpc.py --arrival-rate R`` runs open loop: requests
   arrive at seeded Poisson times (``--seed``) at R per second, however many are in flight
   (``--requests-per-rate N`` of them, or the arrivals of ``--seconds-per-rate S``; default those
   of 10 s, at least 26); first chunk, underruns (playback stalls, as in the levels) and failures
   per rate. The server's ``cosyserve_*`` Prometheus counters are read before and after each
   level's or rate's run.
4. The server is stopped.

All variants run one after another in one call, so one GPU run compares them. The reference
algorithm (every streaming chunk re-runs the flow over prompt + all tokens so far) runs beside the
incremental one as two variants: ``--variant reference:TOKEN2WAV_INCREMENTAL_STREAM=false --variant
incremental:TOKEN2WAV_INCREMENTAL_STREAM=true``; a token2wav engine's switch is one more run.sh
setting in the same way.

With ``--long-text-chars N`` each variant also streams one request of an N-character mixed Chinese
and English text alone (the text front-end splits it into segments, each ``--long-text-seconds``
of speech): its first chunk, underruns and stall, in its own table.

Then each ``--offline-inference NAME:ARGS`` runs offline_inference.py on the same manifest, fixed
seconds and seed (ARGS are appended, so they can override). Without ``--manifest`` a synthetic
benchmark set like seed-tts' wenetspeech4tts split is written first: 26 prompts of 3-8 s of seeded
speech-like 16 kHz audio with Chinese prompt and target texts of plausible lengths.

Writes ``<out-dir>/bench.json``, ``bench.md`` (header: date, GPU, command line, git commit; the
level table; the open-loop table; the offline_inference table; Triton's per-model compute time per
level; the server-side breakdown from the cosyserve_* counters per level; the targets) and
``bench.png`` (needs matplotlib; ``--no-plot`` skips it). Exit status 1 when a level, rate, variant
or offline run failed, or any request failed; missed targets alone do not fail. The work is done by
:mod:`cosyserve.bench`.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.bench.report import write_outputs  # noqa: E402
from cosyserve.bench.runner import (MIN_REQUESTS_PER_LEVEL, MODES, Variant, failed, parse_offline_run,  # noqa: E402
                                    parse_variant, run_benchmark)
from cosyserve.data import FixedLength  # noqa: E402
from cosyserve.schedule import TOKEN_RATE  # noqa: E402
from cosyserve.serving.tritonserver import MPS_CONTROL  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, required=True,
                   help="bundle root (run.sh's MODELS_DIR): CosyVoice2-0.5B/ and cosyvoice2_llm/")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--fixed-output-seconds", type=float, nargs="+", default=[4.0, 10.0], metavar="S",
                   help="one value, or LO HI for a seeded uniform draw per item")
    p.add_argument("--tokens-per-second", type=float, default=float(TOKEN_RATE))
    p.add_argument("--seed", type=int, default=0, help="fixed-length draws, arrivals and the synthetic manifest")
    p.add_argument("--requests-per-level", type=int,
                   help=f"requests per concurrency level (default: max({MIN_REQUESTS_PER_LEVEL}, 2 x concurrency))")
    p.add_argument("--rates", type=float, nargs="+", default=[], metavar="R",
                   help="open-loop arrival rates, requests per second (default: none)")
    per_rate = p.add_mutually_exclusive_group()
    per_rate.add_argument("--requests-per-rate", type=int, help="arrivals per rate")
    per_rate.add_argument("--seconds-per-rate", type=float,
                          help="per rate, the arrivals of this many seconds (default: 10, at least 26 arrivals)")
    p.add_argument("--long-text-chars", type=int, default=0, metavar="N",
                   help="also stream one N-character mixed zh/en text alone per variant (0: not)")
    p.add_argument("--long-text-seconds", type=float, default=2.0, help="speech per segment of that text")
    p.add_argument("--manifest", type=Path, help="utt|prompt_text|prompt_wav|target_text lines (default: synthetic)")
    p.add_argument("--num-prompts", type=int, default=26, help="items of the synthetic manifest")
    p.add_argument("--variant", dest="variants", type=parse_variant, action="append",
                   help="NAME:KEY=VAL,... (repeatable; default: ours), e.g. "
                        "reference:TOKEN2WAV_INCREMENTAL_STREAM=false")
    p.add_argument("--offline-inference", dest="offline_runs", type=parse_offline_run, action="append", default=[],
                   help='NAME:ARGS, e.g. "torch:--backend torch --batch-size 16 --cuda-graphs" (repeatable)')
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--server-start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup-passes", type=int, default=2,
                   help="untimed passes over the items per mode (CUDA graphs capture a shape the second time it is seen)")
    p.add_argument("--no-plot", action="store_true", help="do not draw bench.png (matplotlib not needed)")
    args = p.parse_args(argv)
    args.variants = args.variants or [Variant("ours")]
    # absolute: run.sh, the clients and offline_inference.py run from the repository root
    args.models_dir, args.out_dir = args.models_dir.resolve(), args.out_dir.resolve()
    args.manifest = args.manifest.resolve() if args.manifest else None
    if not (args.models_dir / "CosyVoice2-0.5B").is_dir() or not (args.models_dir / "cosyvoice2_llm").is_dir():
        p.error(f"--models-dir {args.models_dir} must hold CosyVoice2-0.5B/ and cosyvoice2_llm/ (run.sh stage 0)")
    if len({v.name for v in args.variants}) < len(args.variants):
        p.error("variant names must be unique")
    if len({r.name for r in args.offline_runs}) < len(args.offline_runs):
        p.error("offline run names must be unique")
    if min(args.concurrency) < 1 or (args.requests_per_level is not None and args.requests_per_level < 1):
        p.error("concurrency levels and --requests-per-level must be >= 1")
    if any(r <= 0 for r in args.rates) or (args.requests_per_rate or 1) < 1 or (args.seconds_per_rate or 1) <= 0:
        p.error("--rates, --requests-per-rate and --seconds-per-rate must be > 0")
    try:
        FixedLength(args.tokens_per_second, tuple(args.fixed_output_seconds), args.seed)
    except ValueError as e:
        p.error(str(e))
    if any(v.mps for v in args.variants) and shutil.which(MPS_CONTROL) is None:
        p.error(f"a variant sets MPS=1 but {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's "
                "utilities); install it or drop MPS=1")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:  # now, not after hours of measuring
        p.error("bench.png needs matplotlib (pip install matplotlib, or the package's dev extra); or pass --no-plot")
    return args




def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv])
    bench = run_benchmark(args, command)
    print(write_outputs(bench, args.out_dir, draw=not args.no_plot))
    if args.no_plot:
        print("note: --no-plot: bench.png not drawn")
    print(f"wrote bench.json, bench.md{'' if args.no_plot else ', bench.png'} to {args.out_dir}")
    return 1 if failed(bench) else 0


if __name__ == "__main__":
    sys.exit(main())
