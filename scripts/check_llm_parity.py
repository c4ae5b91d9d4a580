#!/usr/bin/env python3
"""Check the torch LLM engine against the transformers reference (lm_head bias kept).

    python scripts/check_llm_parity.py --model-dir models/cosyvoice2_llm
    python scripts/check_llm_parity.py --model-dir models/cosyvoice2_llm --device cuda --prompts 6

Random zero-shot / cross-lingual / instruct prompts; float32 requires identical greedy tokens
(hf, torch alone, torch batched), logits within 1e-4 and batch-invariant seeded sampling; bf16 and
fp16 compare first-step logits with a float32 hf run. Prints a table, exits 1 on any failure.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.parity.llm_engine import run_parity  # noqa: E402
from cosyserve.parity import format_table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, type=Path, help="HF-format CosyVoice2 LLM directory")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = run_parity(args.model_dir, args.device, args.dtype, args.prompts, args.max_tokens, args.seed)
    print(format_table(results))
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
