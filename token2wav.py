#!/usr/bin/env python3
"""Standalone CosyVoice2 token2wav: speech tokens -> 24 kHz wav, offline or streaming, with timing.

    # synthesise given tokens (raw ids 0..6560, whitespace separated) with the default speaker
    python token2wav.py --model-dir models/CosyVoice2-0.5B --tokens-file tokens.txt --output out.wav

    # benchmark: random tokens of fixed lengths (25 tokens = 1 s of audio)
    python token2wav.py --model-dir models/CosyVoice2-0.5B --num-tokens 100 250 --mode streaming --runs 3

The prompt is a speaker of spk2info.pt (``--speaker-id``, default "001") or a reference wav
(``--reference-audio``, needs speech_tokenizer_v2.onnx and campplus.onnx in the model dir).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import soundfile as sf
import torch

from cosyserve.audio.io import load_prompt_audio
from cosyserve.frontend import SpeakerEncoder, SpeechTokenizer, build_prompt_features
from cosyserve.frontend.speakers import SpeakerRegistry
from cosyserve.pipeline.schedule import plan_chunks
from cosyserve.token2wav import load_token2wav

SAMPLE_RATE = 24000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="CosyVoice2-0.5B directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens-file", type=Path, help="raw speech token ids, whitespace separated")
    src.add_argument("--num-tokens", type=int, nargs="+", help="benchmark with random tokens of these lengths")
    p.add_argument("--speaker-id", default="001")
    p.add_argument("--reference-audio", type=Path, help="prompt wav instead of a cached speaker")
    p.add_argument("--mode", choices=("offline", "streaming"), default="offline")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--runs", type=int, default=1, help="timed runs per length (after one warm-up)")
    p.add_argument("--output", type=Path, help="write the (last) waveform here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def prompt_features(args):
    if args.reference_audio:
        audio = load_prompt_audio(args.reference_audio)
        return build_prompt_features(audio, SpeechTokenizer(args.model_dir / "speech_tokenizer_v2.onnx"),
                                     SpeakerEncoder(args.model_dir / "campplus.onnx"))
    return SpeakerRegistry.load(args.model_dir / "spk2info.pt").get(args.speaker_id).features


def synthesize(t2w, tokens: torch.Tensor, prompt, mode: str, generator: torch.Generator) -> tuple[torch.Tensor, list[float]]:
    """Returns the waveform and the wall time of each token2wav call."""
    args = (prompt.speech_tokens.reshape(1, -1), prompt.speech_feat.reshape(1, -1, 80), prompt.embedding.reshape(1, -1))
    sync = torch.cuda.synchronize if t2w.device.type == "cuda" else (lambda: None)
    if mode == "offline":
        start = time.perf_counter()
        wav = t2w.offline(tokens, *args, generator=generator)
        sync()
        return wav, [time.perf_counter() - start]
    pieces, times = [], []
    with t2w.open_stream("token2wav-cli", *args, generator=generator) as stream:
        for chunk in plan_chunks(tokens.shape[1]):
            start = time.perf_counter()
            pieces.append(stream.step(tokens[:, :chunk.num_tokens], chunk.token_offset, chunk.finalize))
            sync()
            times.append(time.perf_counter() - start)
    return torch.cat(pieces), times


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    t2w = load_token2wav(args.model_dir, args.device, dtype)
    prompt = prompt_features(args)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    if args.tokens_file:
        ids = [int(x) for x in args.tokens_file.read_text().split()]
        lengths, fixed = [len(ids)], torch.tensor([ids], dtype=torch.long)
    else:
        lengths, fixed = args.num_tokens, None
    print(f"device={args.device} dtype={args.dtype} mode={args.mode}")
    print(f"{'tokens':>7} {'audio s':>8} {'first call ms':>14} {'total ms':>10} {'RTF':>8}")
    wav = None
    for n in lengths:
        tokens = fixed if fixed is not None else torch.randint(0, 6561, (1, n), generator=generator)
        synthesize(t2w, tokens, prompt, args.mode, generator)  # warm-up (allocations, kernels)
        totals, firsts = [], []
        for _ in range(max(1, args.runs)):
            wav, times = synthesize(t2w, tokens, prompt, args.mode, generator)
            totals.append(sum(times))
            firsts.append(times[0])
        audio_s = wav.numel() / SAMPLE_RATE
        total = statistics.median(totals)
        print(f"{n:>7} {audio_s:>8.2f} {1e3 * statistics.median(firsts):>14.1f} {1e3 * total:>10.1f} {total / audio_s:>8.4f}")
    if args.output and wav is not None:
        sf.write(args.output, wav.numpy(), SAMPLE_RATE)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
