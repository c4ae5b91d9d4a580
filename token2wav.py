#!/usr/bin/env python3
"""Standalone token2wav: speech tokens -> 24 kHz wav, with timing per variant. CosyVoice2 (the default),
offline; CosyVoice3 (``--model cosyvoice3``) and Step-Audio2 (``--model step_audio2``), below, offline or
streaming.

    # synthesise given tokens (raw ids 0..6560, whitespace separated) with the default speaker
    python token2wav.py --model-dir models/CosyVoice2-0.5B --tokens-file tokens.txt --output out.wav

    # benchmark 4 random utterances (25 tokens = 1 s) in several variants
    python token2wav.py --model-dir models/CosyVoice2-0.5B --num-tokens 100 150 200 250 --runs 3 \\
        --variants fp32,fp16,fp16+graphs,fp16+graphs+batch4

A variant is dtype[+graphs|+flowgraphs][+incremental][+batchN]: the flow dtype (HiFT: fp16 on CUDA, fp32 on CPU),
CUDA graphs of flow and HiFT or of the flow only (Token2WavOptions), and how many utterances
share one offline_batch call. Each variant's first warm-up run uses zero HiFT noise and its output
is compared with the first variant's (rel-L2 of all waveforms); graph variants get a second
warm-up run (shapes are captured when seen again). Streaming: see streaming_inference.py.

The prompt is a speaker of spk2info.pt (``--speaker-id``, default "001") or a reference wav
(``--reference-audio``, needs speech_tokenizer_v2.onnx and campplus.onnx in the model dir).

CosyVoice3 (``--model cosyvoice3``, as in offline_inference.py; cosyserve/pipeline/cosyvoice3_token2wav.py):

    # --model-dir is Fun-CosyVoice3-0.5B-2512/ (or the bundle root holding it); a reference clip is needed
    python token2wav.py --model cosyvoice3 --model-dir models/Fun-CosyVoice3-0.5B-2512 \\
        --reference-audio prompt.wav --reference-text "its transcript" --num-tokens 100 250 --mode streaming

The DiT flow + causal HiFT; the voice from the clip through speech_tokenizer_v3.onnx and CAM++ (CosyVoice3 has
no registered speakers; the transcript is optional, token2wav does not read it). Variants are flow dtypes
(fp32, fp16, bf16), each optionally ``+rerun``: the reference runtime's streaming flow (full attention over the
whole prefix every chunk) instead of the incremental block-masked one, or ``+graphs``: the incremental flow's
windows replayed from CUDA graphs (GPU only; the warm-up run captures them); ``--variants fp32,fp32+rerun --mode
streaming`` times both and gives their rel-L2. ``--mode streaming`` sends the chunks of the cosyvoice3 BLS (``--strategy`` exponential:
15 + 3 look-ahead tokens, then 25, 50, 100, ...; or time_based), each step all tokens so far; both modes give
960 samples per token. ``--profile`` runs each variant's last utterance once more under torch.profiler: the host
time of the steps' flow and vocoder, the GPU's activities and busy time (where a step's time goes). A bad token id
or directory is an error (exit status 2) before any variant runs.

Step-Audio2 (``--model step_audio2``: Step-Audio-2-mini's DiT flow + HiFT, the engine's kind that
``cosyvoice2_dit`` serves; cosyserve/bench/step_audio2.py):

    # --model-dir is Step-Audio-2-mini/token2wav/; the voice is a clip, or a voice of CosyVoice2's spk2info.pt
    python token2wav.py --model step_audio2 --model-dir models/Step-Audio-2-mini/token2wav \\
        --reference-audio prompt.wav --num-tokens 100 250 --mode streaming --strategy equal --runs 3
    python token2wav.py --model step_audio2 --model-dir models/Step-Audio-2-mini/token2wav \\
        --spk2info models/CosyVoice2-0.5B/spk2info.pt --speaker-id 001 --tokens-file tokens.txt --output out.wav

``--mode streaming`` voices the chunks cosyvoice2_dit sends (``--strategy`` exponential: 15, 25, 50, ...
new tokens; equal: 15 each; +3 look-ahead), one stream at a time; both modes give 960 samples per
token. Variants are flow dtypes (fp32, fp16, bf16); the first run of each is an untimed warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from pathlib import Path

import torch

from cosyserve.bench.token2wav import (add_common_args, markdown_table, median, parse_variants, prompt_features,
                                      rel_l2, run_offline, utterance_tokens)
from cosyserve.errors import CosyServeError
from cosyserve.pipeline import cosyvoice3_token2wav as cv3
from cosyserve.pipeline.offline import MODELS
from cosyserve.schedule import DIT_STRATEGIES, OUTPUT_SAMPLE_RATE, STRATEGIES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="cosyvoice2",
                   help="the model kind (cosyvoice3: --model-dir is Fun-CosyVoice3-0.5B-2512/, --reference-audio; "
                        "step_audio2: --model-dir is Step-Audio-2-mini/token2wav/)")
    add_common_args(p)
    p.add_argument("--output", type=Path, help="write the last utterance of the last run here")
    p.add_argument("--reference-text", help="cosyvoice3: the transcript of --reference-audio (optional)")
    p.add_argument("--spk2info", type=Path,
                   help="step_audio2: CosyVoice2's spk2info.pt, whose --speaker-id is the voice "
                        "(without --reference-audio)")
    p.add_argument("--mode", choices=cv3.MODES, default="offline",
                   help="cosyvoice3, step_audio2: offline, or streaming in the model's chunks "
                        "(CosyVoice2 streams in streaming_inference.py)")
    p.add_argument("--strategy", choices=sorted({*STRATEGIES, *DIT_STRATEGIES}), default="exponential",
                   help="--mode streaming: the model's streaming_strategy (cosyvoice3: exponential, time_based; "
                        "step_audio2: exponential, equal)")
    p.add_argument("--profile", action="store_true",
                   help="cosyvoice3: after each variant's timed runs, its last utterance once more under torch.profiler "
                        "(host time of the flow and vocoder, GPU activities and busy time)")
    args = p.parse_args(argv)
    if args.model == "cosyvoice2" and (args.mode != "offline" or args.strategy != "exponential"):
        p.error("--mode/--strategy are for --model cosyvoice3 and step_audio2; CosyVoice2 streams in "
                "streaming_inference.py")
    if args.model != "cosyvoice3" and (args.reference_text is not None or args.profile):
        p.error("--reference-text and --profile are for --model cosyvoice3")
    if args.model != "step_audio2" and args.spk2info is not None:
        p.error("--spk2info is for --model step_audio2 (CosyVoice2's voices are its --model-dir's)")
    if args.model == "cosyvoice3" and args.reference_audio is None:
        p.error("--model cosyvoice3 needs --reference-audio (CosyVoice3 has no registered speakers)")
    if args.model == "step_audio2" and args.reference_audio is None and args.spk2info is None:
        p.error("--model step_audio2 needs --reference-audio, or --spk2info (and --speaker-id)")
    return args


HEADER = ["variant", "utterances", "audio s", "wall ms", "RTF", "batch latency ms (median)", "rel-L2 vs first"]


def bench_variant(variant, args, tokens, prompt, reference):
    """Warm-up (the first with zero noise: its audio is the check), then ``--runs`` timed runs."""
    t2w = variant.load(args.model_dir, args.device)
    try:
        check = torch.cat(run_offline(t2w, tokens, prompt, variant.batch, zero_noise=True).waves)
        for _ in range(variant.warmups - 1):
            run_offline(t2w, tokens, prompt, variant.batch)
        runs = [run_offline(t2w, tokens, prompt, variant.batch) for _ in range(max(1, args.runs))]
    finally:
        del t2w
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    wall = median([r.wall_s for r in runs])
    rel = rel_l2(check, reference if reference is not None else check)
    row = [variant.name, len(tokens), runs[0].audio_s, 1e3 * wall, wall / runs[0].audio_s,
           1e3 * median([x for r in runs for x in r.batch_latencies_s]), rel]
    report = {"walls_s": [r.wall_s for r in runs], "audio_s": runs[0].audio_s,
              "batch_latencies_s": [r.batch_latencies_s for r in runs], "rel_l2_vs_first": rel}
    return row, report, check, runs[-1].waves[-1]


def main_cosyvoice3(args) -> int:
    try:
        tokens = utterance_tokens(args)
        result = cv3.run_cosyvoice3(
            args.model_dir, tokens, args.reference_audio, args.reference_text, device=args.device,
            variants=args.variants, mode=args.mode, strategy=args.strategy, runs=args.runs, profile=args.profile,
            on_start=lambda prompt: print(f"device={args.device} model=cosyvoice3 mode={args.mode} prompt={prompt} "
                                          f"tokens, utterances={[t.numel() for t in tokens]} tokens"),
            on_row=lambda row: print(markdown_table(cv3.HEADER, [row]).splitlines()[-1], flush=True))
    except (CosyServeError, ValueError) as exc:  # bad directory, tokens, variants or clip
        print(f"token2wav.py: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(markdown_table(cv3.HEADER, result.rows))
    if result.profile_rows:
        print("\nunder torch.profiler (one more run of the last utterance):\n")
        print(markdown_table(cv3.PROFILE_HEADER, result.profile_rows))
    if args.output_json:
        args.output_json.write_text(json.dumps(result.to_json(args.mode, args.strategy), indent=2))
    if args.output and result.last is not None:
        import soundfile as sf

        sf.write(args.output, result.last, OUTPUT_SAMPLE_RATE)
        print(f"wrote {args.output}")
    return 0


def main_step_audio2(args) -> int:
    from cosyserve.bench import step_audio2 as sa2

    try:
        tokens = utterance_tokens(args)
        voice = sa2.step_audio2_voice(args.model_dir, args.device, args.reference_audio, args.spk2info,
                                      args.speaker_id)
        print(f"device={args.device} model=step_audio2 mode={args.mode} prompt={voice.speech_tokens.numel()} tokens, "
              f"utterances={[t.numel() for t in tokens]} tokens")
        print("| " + " | ".join(sa2.HEADER) + " |")
        rows, last = sa2.run_step_audio2(
            args.model_dir, tokens, voice, device=args.device, variants=args.variants.split(","), mode=args.mode,
            strategy=args.strategy, runs=args.runs,
            on_row=lambda row: print(markdown_table(sa2.HEADER, [row]).splitlines()[-1], flush=True))
    except (CosyServeError, ValueError) as exc:  # bad directory, tokens, variants, voice or clip
        print(f"token2wav.py: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(markdown_table(sa2.HEADER, rows))
    if args.output_json:
        args.output_json.write_text(json.dumps({"device": args.device, "mode": args.mode, "strategy": args.strategy,
                                                "header": sa2.HEADER, "rows": rows}, indent=2))
    if args.output and last is not None:
        import soundfile as sf

        sf.write(args.output, last, OUTPUT_SAMPLE_RATE)
        print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "cosyvoice3":
        return main_cosyvoice3(args)
    if args.model == "step_audio2":
        return main_step_audio2(args)
    prompt = prompt_features(args.model_dir, args.speaker_id, args.reference_audio)
    tokens = utterance_tokens(args)
    rows, report, reference, last = [], {}, None, None
    print(f"device={args.device} prompt={prompt.speech_tokens.numel()} tokens, "
          f"utterances={[t.numel() for t in tokens]} tokens")
    for variant in parse_variants(args.variants):
        try:
            row, report[variant.name], check, last = bench_variant(variant, args, tokens, prompt, reference)
        except Exception as exc:  # report it and go on with the other variants
            traceback.print_exc()
            summary = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            row, report[variant.name] = [variant.name, summary], {"error": repr(exc)}
        else:
            reference = check if reference is None else reference
        rows.append(row)
        print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADER, rows))
    if args.output_json:
        args.output_json.write_text(json.dumps({"device": args.device, "results": report}, indent=2))
    if args.output and last is not None:
        import soundfile as sf

        sf.write(args.output, last.numpy(), 24000)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
