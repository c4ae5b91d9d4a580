#!/usr/bin/env python3
"""Smoke test of a CosyVoice2 TensorRT-LLM engine: generate speech tokens for a few texts.

    python3 scripts/test_llm.py --engine_dir trt_engines_bfloat16 --tokenizer_dir models/cosyvoice2_llm \\
        --input_text "你好，请问你叫什么？" --top_k 50 --top_p 0.95 --temperature 0.8

Runs the engine through the ``trtllm`` backend (TensorRT-LLM's executor via ``ModelRunnerCpp``,
the head bias applied per request from ``--tokenizer_dir``, which is the HuggingFace LLM
directory) with the prompt ``<|sos|>{text}<|task_id|>`` and prints, per text, how many speech
tokens came out, why generation ended and the first tokens. Exit status: 0 when every text
produced speech tokens and ended normally, 1 otherwise, 2 when TensorRT-LLM is not installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyserve.errors import CosyServeError  # noqa: E402
from cosyserve.llm.base import BackendUnavailableError  # noqa: E402
from cosyserve.llm.prompt import build_prompt_ids  # noqa: E402
from cosyserve.llm.sampling import SamplingParams  # noqa: E402

SHOWN_TOKENS = 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine_dir", type=Path, required=True, help="trtllm-build --output_dir")
    parser.add_argument("--tokenizer_dir", type=Path, required=True, help="the HuggingFace CosyVoice2 LLM directory")
    parser.add_argument("--input_text", nargs="+", default=["你好，请问你叫什么？"])
    parser.add_argument("--max_new_tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--repetition_penalty", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=0.6)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from cosyserve.llm.trtllm_backend import TrtllmBackend

        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed, ras=False,
                                max_tokens=args.max_new_tokens)
        backend = TrtllmBackend(args.tokenizer_dir, "cuda", engine_dir=args.engine_dir,
                                kv_cache_free_gpu_memory_fraction=args.kv_cache_free_gpu_memory_fraction)
    except BackendUnavailableError as exc:
        print(f"test_llm: {exc}", file=sys.stderr)
        return 2
    except (CosyServeError, ValueError, OSError) as exc:
        print(f"test_llm: {exc}", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    failures = 0
    with backend:
        for index, text in enumerate(args.input_text):
            started = time.perf_counter()
            stream = backend.generate_stream(build_prompt_ids(tokenizer, text), params, f"test_llm-{index}")
            try:
                tokens = list(stream)
            except CosyServeError as exc:
                tokens, reason = [], f"error: {exc}"
            else:
                reason = stream.finish_reason
            seconds = time.perf_counter() - started
            ok = bool(tokens) and reason in ("stop", "length")
            failures += not ok
            print(f"[{index}] {text!r}: {len(tokens)} speech tokens in {seconds:.2f} s, finished: {reason}"
                  f"{'' if ok else '  <-- FAILED'}")
            print(f"    first tokens: {tokens[:SHOWN_TOKENS]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
