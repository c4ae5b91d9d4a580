#!/usr/bin/env python3
"""Offline batch TTS without a server: a dataset in, one wav per utterance plus report.json/report.md out.

    # a manifest (utt|prompt_text|prompt_wav|target_text per line) with our PyTorch LLM engine
    python offline_inference.py --model-dir models --backend torch --manifest-path data.txt \\
        --output-dir outputs/offline_inference

    # a HuggingFace dataset (columns id, prompt_text, prompt_audio, target_text; needs `datasets`)
    python offline_inference.py --model-dir models --huggingface-dataset yuekai/seed_tts_cosy2 \\
        --split-name wenetspeech4tts --batch-size 16 --token2wav-batch-size 8 --output-dir out

    # benchmark on random weights: every utterance exactly 4-10 s long (25 tokens/s)
    python offline_inference.py --model-dir models --manifest-path data.txt --output-dir out \\
        --fixed-tokens-per-second 25 --fixed-output-seconds 4 10 --warmup 2

    # CosyVoice3 (Fun-CosyVoice3-0.5B-2512/ and cosyvoice3_llm/ in --model-dir)
    python offline_inference.py --model cosyvoice3 --model-dir models --manifest-path data.txt --output-dir out

    # Step-Audio2: CosyVoice2's LLM (here at an OpenAI-compatible server) + Step-Audio-2-mini's DiT token2wav
    python offline_inference.py --model step_audio2 --model-dir models --backend openai \\
        --openai-base-url http://127.0.0.1:8100/v1 --manifest-path data.txt --output-dir out

``--model-dir`` is the bundle root holding CosyVoice2-0.5B/ and cosyvoice2_llm/ (``--model cosyvoice3``:
Fun-CosyVoice3-0.5B-2512/ and cosyvoice3_llm/, no registered voices; ``--model step_audio2``:
Step-Audio-2-mini/token2wav/ with CosyVoice2's LLM and voices). Every kind runs through the engine
(``cosyserve.engine``: ``load_engine(--model)``), each text segment an offline request, a batch's
requests submitted together so that the engine packs their flow passes. LLM back ends: torch (this
package's engine, stepped in the engine's loop), hf (transformers reference), trtllm (needs
tensorrt_llm and ``--trtllm-engine-dir``), openai (an OpenAI-compatible server at
``--openai-base-url``); vllm is not supported yet (the message says why). Report: front-end time
(voices, text), engine time (submit to the last waveform), total, seconds of audio, RTF = total
time / audio (model loading and file writing not counted), and the engine loop's counters (LLM,
flow, vocoder, host, idle seconds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from cosyserve import data
from cosyserve.errors import CosyServeError, InvalidInputError
from cosyserve.data import FixedLength
from cosyserve.frontend.torch_models import FRONTEND_BACKENDS
from cosyserve.offline import (BACKENDS, DTYPES, MODELS, OfflineConfig, OfflineTTS, Timers, build_report,
                                        format_report_md, synthesize_items, write_reports)
from cosyserve.token2wav.cosyvoice2 import DEFAULT_PRECAPTURE_FRAMES, Token2WavOptions


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="cosyvoice2", help="the model kind")
    p.add_argument("--model-dir", type=Path, required=True,
                   help="bundle root: CosyVoice2-0.5B/ and cosyvoice2_llm/ (or CosyVoice3's two directories; "
                        "step_audio2: also Step-Audio-2-mini/token2wav/)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest-path", type=Path, help="lines utt|prompt_text|prompt_wav|target_text")
    source.add_argument("--huggingface-dataset", help="e.g. yuekai/seed_tts_cosy2 (needs the `datasets` package)")
    p.add_argument("--split-name", default="wenetspeech4tts", help="dataset split")
    p.add_argument("--max-items", type=int, help="only the first N utterances")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--backend", choices=BACKENDS, default="torch", help="LLM back end")
    p.add_argument("--trtllm-engine-dir", type=Path, help="trtllm: the trtllm-build output directory")
    p.add_argument("--openai-base-url", help="openai: http://HOST:PORT/v1 of the completions server")
    p.add_argument("--batch-size", type=int, default=16, help="utterances submitted to the engine together")
    p.add_argument("--token2wav-batch-size", type=int, default=8,
                   help="flow jobs (text segments) per packed Euler step of the engine")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--frontend-backend", choices=FRONTEND_BACKENDS,
                   help="speech tokenizer + CAM++ (default: torch on CUDA, batched; onnxruntime on the CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="flow dtype (default: the kind's; float32 on the CPU)")
    p.add_argument("--llm-dtype", choices=sorted(DTYPES), help="LLM dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="token2wav: replay CUDA graphs of the flow's Euler steps (cosyvoice2, cosyvoice3)")
    p.add_argument("--precapture-frames", type=int, default=DEFAULT_PRECAPTURE_FRAMES,
                   help="cosyvoice2 with --cuda-graphs: capture the flow graphs of inputs up to this many mel frames "
                        "(prompt + target, 50 per second) for up to --token2wav-batch-size passes before "
                        "synthesising; 0: capture shapes the second time they are seen")
    p.add_argument("--compile-flow", action="store_true",
                   help="cosyvoice2: torch.compile the flow estimator (needs a C compiler; Triton on CUDA)")
    p.add_argument("--speaker-id", help="use this registered voice (spk2info.pt) for every utterance instead of "
                                        "its prompt audio/text (no prompt audio is read)")
    p.add_argument("--fixed-tokens-per-second", type=float,
                   help="force every utterance to round(RATE x seconds) speech tokens (min = max tokens); seconds "
                        "from --fixed-output-seconds, else estimated from the prompt's speaking rate")
    p.add_argument("--fixed-output-seconds", type=float, nargs="+", metavar="S",
                   help="one value for all utterances, or LO HI for a seeded uniform draw per utterance "
                        "(implies --fixed-tokens-per-second 25 when that is not given)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --fixed-output-seconds draws and the HiFT noise")
    p.add_argument("--warmup", type=int, default=0,
                   help="first synthesise the first N utterances twice, untimed (kernels, allocations; CUDA graphs "
                        "capture a shape the second time it is seen)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def config_from_args(args) -> OfflineConfig:
    fixed = None
    if args.fixed_tokens_per_second is not None or args.fixed_output_seconds:
        seconds = tuple(args.fixed_output_seconds) if args.fixed_output_seconds else None
        fixed = FixedLength(args.fixed_tokens_per_second or 25.0, seconds, args.seed)
    llm_options = {}
    if args.backend == "trtllm":
        llm_options["engine_dir"] = args.trtllm_engine_dir
    if args.backend == "openai" and args.openai_base_url:
        llm_options["base_url"] = args.openai_base_url
    return OfflineConfig(model=args.model, backend=args.backend, device=args.device, dtype=args.dtype, llm_dtype=args.llm_dtype,
                         batch_size=args.batch_size, token2wav_batch_size=args.token2wav_batch_size,
                         token2wav_options=Token2WavOptions(
                             cuda_graphs=args.cuda_graphs, compile=args.compile_flow,
                             precapture_frames=args.precapture_frames if args.cuda_graphs else 0,
                             precapture_batch=args.token2wav_batch_size, precapture_streaming=False),
                         fixed_length=fixed, frontend_backend=args.frontend_backend,
                         speaker_id=args.speaker_id, seed=args.seed, llm_options=llm_options)


def load_items(args) -> list[data.Utterance]:
    if args.manifest_path:
        items = data.load_manifest(args.manifest_path)
    else:
        items = data.load_hf_dataset(args.huggingface_dataset, args.split_name)
    if args.max_items is not None:
        if args.max_items < 1:
            raise InvalidInputError(f"--max-items must be >= 1, got {args.max_items}")
        items = items[:args.max_items]
    return items


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = config_from_args(args)
        items = load_items(args)
        tts = OfflineTTS(args.model_dir, config)
    except (CosyServeError, ValueError) as exc:  # bad arguments/data, a back end that cannot run here
        print(f"offline_inference.py: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.warmup:
            with tempfile.TemporaryDirectory() as scratch:
                for _ in range(2):
                    synthesize_items(tts, items[:args.warmup], Path(scratch))
        timers = Timers()
        with _progress(len(items), args.no_progress) as bar:
            results = synthesize_items(tts, items, args.output_dir, progress=bar.update, timers=timers)
    finally:
        tts.close()
    report = build_report(results, timers, config, tts.device,
                          {"data": str(args.manifest_path or f"{args.huggingface_dataset}[{args.split_name}]"),
                           "warmup_items": args.warmup})
    write_reports(report, args.output_dir)
    print(format_report_md(report, per_item=False))
    print(f"wrote {len(results)} wavs, report.json and report.md to {args.output_dir}")
    return 0


def _progress(total: int, disabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="utt", desc="offline TTS", disable=disabled)


if __name__ == "__main__":
    sys.exit(main())
