#!/usr/bin/env python3
"""Offline synthesis in one process: CosyVoice2 LLM + the Step-Audio-2-mini DiT token2wav.

    python scripts/dit_offline.py --models-dir models --manifest-path data/manifest.txt --output-dir out
    python scripts/dit_offline.py --models-dir models --huggingface-dataset yuekai/seed_tts_cosy2 \\
        --llm-backend openai --llm-url http://127.0.0.1:8100/v1 --output-dir out

Each item (``utt|prompt_text|prompt_wav|target_text``): the LLM generates every speech token,
then the DiT token2wav voices them in one offline pass (the prompt clip conditions both). The
LLM is our engine in this process (``--llm-backend torch``) or any OpenAI-compatible server
(``openai``). ``--concurrency`` items run at once (the LLM batches them). Writes ``<id>.wav``
(24 kHz) per item and prints the real-time factor.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve import data  # noqa: E402
from cosyserve.errors import CosyServeError  # noqa: E402
from cosyserve.frontend import SpeakerRegistry  # noqa: E402
from cosyserve.llm.backends import create_backend  # noqa: E402
from cosyserve.llm.sampling import REFERENCE_SAMPLING  # noqa: E402
from cosyserve.pipeline.local import LocalSpeechTokens  # noqa: E402
from cosyserve.pipeline.tts import TokenLimits, VoiceResolver  # noqa: E402
from cosyserve.pipeline.dit import SkipSpeakerEmbedding, dit_pipeline, dit_request  # noqa: E402
from cosyserve.runtime import COSYVOICE2_DIR, LLM_DIR, SPK2INFO, resolve_device  # noqa: E402
from cosyserve.token2wav.dit_service import load_dit_service  # noqa: E402

SAMPLE_RATE = 24000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, required=True,
                   help="holds cosyvoice2_llm/, CosyVoice2-0.5B/spk2info.pt, Step-Audio-2-mini/token2wav/")
    p.add_argument("--dit-model-dir", type=Path, help="default: <models-dir>/Step-Audio-2-mini/token2wav")
    p.add_argument("--manifest-path", help="file of utt|prompt_text|prompt_wav|target_text lines")
    p.add_argument("--huggingface-dataset", help="used when no --manifest-path is given")
    p.add_argument("--split-name", default="wenetspeech4tts")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--llm-backend", choices=("torch", "openai"), default="torch")
    p.add_argument("--llm-url", help="with --llm-backend openai: http://HOST:PORT/v1")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (LLM in this process and token2wav)")
    p.add_argument("--max-tokens", type=int, default=750, help="speech tokens per item at most")
    p.add_argument("--min-tokens", type=int, default=0, help="speech tokens per item at least")
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args(argv)
    if not args.manifest_path and not args.huggingface_dataset:
        p.error("give --manifest-path or --huggingface-dataset")
    if args.llm_backend == "openai" and not args.llm_url:
        p.error("--llm-backend openai needs --llm-url")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, args.concurrency)))
    from transformers import AutoTokenizer

    items = (data.load_manifest(args.manifest_path) if args.manifest_path
             else data.load_hf_dataset(args.huggingface_dataset, args.split_name))
    device = resolve_device(args.device)
    llm_dir = args.models_dir / LLM_DIR
    service = load_dit_service(args.dit_model_dir or args.models_dir / "Step-Audio-2-mini" / "token2wav", device)
    registry = SpeakerRegistry.load(args.models_dir / COSYVOICE2_DIR / SPK2INFO)
    voices = VoiceResolver(registry, service.tokenizer, SkipSpeakerEmbedding())
    options = {"base_url": args.llm_url} if args.llm_backend == "openai" else {}
    backend = create_backend(args.llm_backend, llm_dir, device, None, **options)
    pipeline = dit_pipeline(AutoTokenizer.from_pretrained(llm_dir), LocalSpeechTokens(backend, REFERENCE_SAMPLING),
                            service)
    limits = TokenLimits(args.max_tokens, min(args.min_tokens, args.max_tokens))
    args.output_dir.mkdir(parents=True, exist_ok=True)

    def synthesize(item: data.Utterance) -> float:
        request = dit_request(voices, uuid.uuid4().hex, item.target_text, limits=limits,
                              reference_wav16=data.load_reference_audio(item.reference_audio),
                              reference_text=item.reference_text)
        audio = pipeline.synthesize(request)
        sf.write(args.output_dir / f"{item.id}.wav", audio, SAMPLE_RATE)
        return audio.size / SAMPLE_RATE

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
            durations = list(pool.map(synthesize, items))
    except CosyServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.close()
    wall = time.perf_counter() - start
    audio_s = sum(durations)
    print(f"{len(items)} items, {audio_s:.2f} s of audio in {wall:.2f} s: RTF {wall / max(audio_s, 1e-9):.4f}; "
          f"wavs in {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
