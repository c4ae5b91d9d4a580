#!/usr/bin/env python3
"""The Step-Audio-2-mini DiT token2wav alone: speech tokens -> 24 kHz wav, streaming or offline, timed.

    # benchmark: random tokens of these lengths (25 tokens = 1 s), streamed in "equal" chunks
    python scripts/dit_token2wav.py --model-dir models/Step-Audio-2-mini/token2wav \\
        --reference-audio prompt.wav --num-tokens 100 250 --mode streaming --strategy equal --runs 3

    # synthesise given tokens (raw ids 0..6560, whitespace separated) with a spk2info.pt voice
    python scripts/dit_token2wav.py --model-dir models/Step-Audio-2-mini/token2wav \\
        --spk2info models/CosyVoice2-0.5B/spk2info.pt --tokens-file tokens.txt --output out.wav

Streaming sends the chunks the cosyvoice2_dit BLS would send for that many tokens (``--strategy``
exponential: 15, 25, 50, ... new tokens; equal: 15 each; +3 look-ahead), as if the LLM were
infinitely fast. The first run of each length is a warm-up (it also builds the speaker's caches).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.audio.io import TOKENIZER_SAMPLE_RATE, load_prompt_audio  # noqa: E402
from cosyserve.pipeline.tts import DEFAULT_SPEAKER  # noqa: E402
from cosyserve.token2wav.dit_service import DitToken2WavService, SpeakerRef, load_dit_service  # noqa: E402
from cosyserve.schedule import DIT_STRATEGIES, plan_stream_chunks  # noqa: E402

SAMPLE_RATE = 24000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="Step-Audio-2-mini token2wav directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens-file", type=Path, help="raw speech token ids, whitespace separated")
    src.add_argument("--num-tokens", type=int, nargs="+", help="benchmark with random tokens of these lengths")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--reference-audio", type=Path, help="prompt clip (any rate >= 16 kHz, 0.5-30 s)")
    who.add_argument("--spk2info", type=Path, help="a spk2info.pt; the voice is --speaker-id")
    p.add_argument("--speaker-id", default=DEFAULT_SPEAKER)
    p.add_argument("--mode", choices=("offline", "streaming"), default="streaming")
    p.add_argument("--strategy", choices=DIT_STRATEGIES, default="exponential", help="streaming chunk schedule")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (the flow runs in fp16 on CUDA)")
    p.add_argument("--runs", type=int, default=1, help="timed runs per length (after one warm-up)")
    p.add_argument("--output", type=Path, help="write the (last) waveform here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def synthesize(service: DitToken2WavService, tokens: list[int], speaker: SpeakerRef, mode: str,
               strategy: str) -> tuple[torch.Tensor, list[float]]:
    """The waveform and the wall time of each token2wav call."""
    sync = torch.cuda.synchronize if service.model.flow.decoder.rand_noise.is_cuda else (lambda: None)
    if mode == "offline":
        start = time.perf_counter()
        wav = service.offline(tokens, speaker)
        sync()
        return torch.from_numpy(wav), [time.perf_counter() - start]
    pieces, times = [], []
    for i, chunk in enumerate(plan_stream_chunks(len(tokens), strategy)):
        start = time.perf_counter()
        pieces.append(torch.from_numpy(service.step("dit-token2wav-cli", tokens[chunk.start:chunk.end],
                                                    speaker if i == 0 else None, chunk.last)))
        sync()
        times.append(time.perf_counter() - start)
    return torch.cat(pieces), times


def main(argv=None) -> int:
    args = parse_args(argv)
    service = load_dit_service(args.model_dir, args.device, spk2info=args.spk2info)
    if args.reference_audio:
        speaker = SpeakerRef(wav16=load_prompt_audio(args.reference_audio).wav16.numpy())
    else:
        speaker = SpeakerRef(speaker_id=args.speaker_id)
    generator = torch.Generator().manual_seed(args.seed)
    if args.tokens_file:
        fixed = [int(x) for x in args.tokens_file.read_text().split()]
        lengths = [len(fixed)]
    else:
        fixed, lengths = None, args.num_tokens
    prompt = (f"{speaker.wav16.size / TOKENIZER_SAMPLE_RATE:.2f} s clip" if speaker.wav16 is not None
              else f"speaker {speaker.speaker_id}")
    print(f"device={service.model.flow.decoder.rand_noise.device} mode={args.mode}"
          + (f" strategy={args.strategy}" if args.mode == "streaming" else "") + f" prompt={prompt}")
    print(f"{'tokens':>7} {'chunks':>6} {'audio s':>8} {'first call ms':>14} {'total ms':>10} {'RTF':>8}")
    wav = None
    for n in lengths:
        tokens = fixed if fixed is not None else torch.randint(0, 6561, (n,), generator=generator).tolist()
        synthesize(service, tokens, speaker, args.mode, args.strategy)  # warm-up (speaker caches, allocations)
        totals, firsts = [], []
        for _ in range(max(1, args.runs)):
            wav, times = synthesize(service, tokens, speaker, args.mode, args.strategy)
            totals.append(sum(times))
            firsts.append(times[0])
        audio_s = wav.numel() / SAMPLE_RATE
        total = statistics.median(totals)
        print(f"{n:>7} {len(times):>6} {audio_s:>8.2f} {1e3 * statistics.median(firsts):>14.1f} {1e3 * total:>10.1f} "
              f"{total / audio_s:>8.4f}")
    if args.output and wav is not None:
        sf.write(args.output, wav.numpy(), SAMPLE_RATE)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
