#!/usr/bin/env python3
"""Standalone token2wav: speech tokens -> 24 kHz wav through the engine's kind of a model, offline or
streaming, with timing per variant (cosyserve/bench/token2wav.py; every kind driven the same way).

    # synthesise given tokens (raw ids 0..6560, whitespace separated) with CosyVoice2's default speaker
    python token2wav.py --model-dir models/CosyVoice2-0.5B --tokens-file tokens.txt --output out.wav

    # benchmark 4 random utterances (25 tokens = 1 s), 4 voiced together, in two variants
    python token2wav.py --model-dir models/CosyVoice2-0.5B --num-tokens 100 150 200 250 --runs 3 \\
        --variants fp32+batch4,fp16+graphs+batch4

    # CosyVoice3 (no registered voices: a reference clip), streamed in its chunks, incremental and re-run flows
    python token2wav.py --model cosyvoice3 --model-dir models/Fun-CosyVoice3-0.5B-2512 \\
        --reference-audio prompt.wav --num-tokens 100 250 --mode streaming --variants fp32,fp32+rerun

    # Step-Audio2: Step-Audio-2-mini/token2wav/ with a voice of CosyVoice2's spk2info.pt
    python token2wav.py --model step_audio2 --model-dir models/Step-Audio-2-mini/token2wav \\
        --spk2info models/CosyVoice2-0.5B/spk2info.pt --speaker-id 001 --mode streaming --strategy equal \\
        --num-tokens 100 250

``--model-dir`` is the kind's directory (CosyVoice2-0.5B/, Fun-CosyVoice3-0.5B-2512/,
Step-Audio-2-mini/token2wav/) or the bundle root holding it. The voice is a registered speaker
(``--speaker-id`` of ``--spk2info``, default the model directory's spk2info.pt) or a reference clip
(``--reference-audio``, through the kind's own speech tokenizer and CAM++). ``--mode streaming``
voices each utterance in the chunks the engine sends (``--strategy``: the kind's schedule, e.g.
exponential: 15 + 3 look-ahead tokens, then 25, 50, ...; CosyVoice2/3 also time_based, Step-Audio2
equal), all tokens there from the start; both modes give 960 samples per token. A variant is
``dtype[+graphs][+rerun][+batchN]`` (see the module above: flow dtype, the kind's CUDA graphs,
CosyVoice3's re-run flow, N utterances voiced together, packed per Euler step). ``--profile`` runs
each variant's last utterance once more under torch.profiler (host time of the flow steps and
vocoder calls, GPU activities and busy time). A bad token id, directory, variant or voice is an
error (exit status 2) before any variant runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cosyserve.bench.token2wav import (HEADER, MODES, PROFILE_HEADER, markdown_table, run_token2wav,
                                       utterance_tokens)
from cosyserve.engine.service import MODEL_KINDS
from cosyserve.errors import CosyServeError
from cosyserve.schedule import DIT_STRATEGIES, OUTPUT_SAMPLE_RATE, STRATEGIES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODEL_KINDS), default="cosyvoice2", help="the model kind")
    p.add_argument("--model-dir", type=Path, required=True,
                   help="the kind's directory (CosyVoice2-0.5B/, Fun-CosyVoice3-0.5B-2512/, "
                        "Step-Audio-2-mini/token2wav/) or a bundle root holding it")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens-file", type=Path,
                        help="raw speech token ids (0..6560), whitespace separated; one utterance per line")
    source.add_argument("--num-tokens", type=int, nargs="+",
                        help="random utterances of these lengths (25 tokens = 1 s of audio)")
    p.add_argument("--speaker-id", default="001", help="registered speaker of --spk2info used as the prompt")
    p.add_argument("--spk2info", type=Path,
                   help="the registered voices (default: --model-dir's spk2info.pt; step_audio2: CosyVoice2's)")
    p.add_argument("--reference-audio", type=Path, help="prompt wav instead of a registered speaker")
    p.add_argument("--reference-text", help="the transcript of --reference-audio (optional: token2wav does not read it)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default="fp32",
                   help="comma-separated dtype[+graphs][+rerun][+batchN], e.g. fp32,fp16+graphs+batch8")
    p.add_argument("--mode", choices=MODES, default="offline", help="offline, or streaming in the kind's chunks")
    p.add_argument("--strategy", choices=sorted({*STRATEGIES, *DIT_STRATEGIES}), default="exponential",
                   help="--mode streaming: the kind's chunk schedule (cosyvoice2, cosyvoice3: exponential, "
                        "time_based; step_audio2: exponential, equal)")
    p.add_argument("--runs", type=int, default=1, help="timed runs per variant (after one warm-up run)")
    p.add_argument("--seed", type=int, default=0, help="seed of --num-tokens and of HiFT's noise")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--profile", action="store_true",
                   help="after each variant's timed runs, its last utterance once more under torch.profiler")
    p.add_argument("--output", type=Path, help="write the last utterance of the last run here")
    p.add_argument("--output-json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    if not MODEL_KINDS[args.model].registered_voices and args.reference_audio is None:
        p.error(f"--model {args.model} needs --reference-audio (it has no registered speakers)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        tokens = utterance_tokens(args)
        result = run_token2wav(
            args.model, args.model_dir, tokens, reference_audio=args.reference_audio, speaker_id=args.speaker_id,
            spk2info=args.spk2info, device=args.device, variants=args.variants, mode=args.mode,
            strategy=args.strategy, runs=args.runs, profile=args.profile, seed=args.seed,
            on_start=lambda prompt: print(f"device={args.device} model={args.model} mode={args.mode} prompt={prompt} "
                                          f"tokens, utterances={[t.numel() for t in tokens]} tokens"),
            on_row=lambda row: print(markdown_table(HEADER, [row]).splitlines()[-1], flush=True))
    except (CosyServeError, ValueError) as exc:  # bad directory, tokens, variants, voice or strategy
        print(f"token2wav.py: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(markdown_table(HEADER, result.rows))
    if result.profile_rows:
        print("\nunder torch.profiler (one more run of the last utterance):\n")
        print(markdown_table(PROFILE_HEADER, result.profile_rows))
    if args.output_json:
        args.output_json.write_text(json.dumps(result.to_json(args.mode, args.strategy), indent=2))
    if args.output and result.last is not None:
        import soundfile as sf

        sf.write(args.output, result.last, OUTPUT_SAMPLE_RATE)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
