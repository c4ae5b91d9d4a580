"""hf (reference) vs torch engine on random prompts; backs ``scripts/check_llm_parity.py``.

Float32 (CPU or GPU): logits along the greedy path agree to 1e-4 (max abs), greedy tokens are
identical for hf, torch alone, torch batched and torch with half the prompt in the prefix cache,
and seeded sampling gives the same tokens alone, inside a batch, and in hf (same sampler). Lower precision: the engine's first-step logits must be
as close to a float32 hf run as hf's own low-precision logits are (within a factor of 2); token
agreement is reported but not required, since rounding differs between the kernels.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..llm.backends import create_backend
from ..llm.prompt import OUTPUT_WINDOW_SIZE, OUTPUT_WINDOW_START, build_prompt_ids
from ..llm.sampling import SamplingParams
from ..runtime import resolve_device_dtype
from . import CaseResult, check, compare

SUITE = "llm"
WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)
_WORDS = ("hello", "world", "speech", "voice", "today", "walk", "weather", "number", "question", "read",
          "你好", "今天", "天气", "公园", "散步", "语音", "合成", "声音", "模型", "礼物")


def random_prompts(tokenizer, count: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """Zero-shot, cross-lingual and instruct prompts of varied lengths."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))

    prompts = []
    for index in range(count):
        mode = ("zero-shot", "cross-lingual", "instruct")[index % 3]
        if mode == "zero-shot":
            speech = [rng.randrange(6561) for _ in range(rng.randint(5, 60))]
            ids = build_prompt_ids(tokenizer, text(2, 12), prompt_text=text(2, 10), prompt_speech_tokens=speech)
        elif mode == "cross-lingual":
            ids = build_prompt_ids(tokenizer, text(2, 16))
        else:
            ids = build_prompt_ids(tokenizer, text(2, 10), instruction=text(1, 5))
        prompts.append((f"{mode}#{index} ({len(ids)} ids)", ids))
    return prompts


def _first_mismatch(a: list[int], b: list[int]) -> str:
    for step, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first differs at step {step} of {min(len(a), len(b))}"
    return "identical" if len(a) == len(b) else f"lengths {len(a)} vs {len(b)}"


def run_parity(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None,
               num_prompts: int = 4, max_tokens: int = 24, seed: int = 0) -> list[CaseResult]:
    from transformers import AutoTokenizer

    device, dtype = resolve_device_dtype(device, dtype)
    exact = dtype == torch.float32
    prompts = random_prompts(AutoTokenizer.from_pretrained(model_dir), num_prompts, seed)
    results: list[CaseResult] = []
    hf = create_backend("hf", model_dir, device, dtype)
    engine_backend = create_backend("torch", model_dir, device, dtype, max_slots=max(4, num_prompts + 1),
                                    max_model_len=1024)
    engine = engine_backend.engine
    try:
        greedy = SamplingParams.greedy(max_tokens=max_tokens)
        reference = [hf.generate(ids, greedy) for _, ids in prompts]
        alone = [engine_backend.generate(ids, greedy) for _, ids in prompts]
        streams = [engine_backend.generate_stream(ids, greedy) for _, ids in prompts]
        batched = [list(stream) for stream in streams]

        reference_fp32 = None if exact else create_backend("hf", model_dir, device, torch.float32)
        for (name, ids), ref_tokens, tokens, batch_tokens in zip(prompts, reference, alone, batched):
            forced = ref_tokens[:-1]
            ours = engine.teacher_forced_logits(ids, forced)
            theirs = hf.logits(ids + [t + OUTPUT_WINDOW_START for t in forced])[len(ids) - 1:, WINDOW]
            if exact:
                results.append(compare(SUITE, f"logits {name}", ours, theirs, max_abs=1e-4,
                                       note=f"{len(ours)} steps"))
                results.append(check(SUITE, f"greedy hf == torch {name}", ref_tokens == tokens,
                                     _first_mismatch(ref_tokens, tokens)))
                results.append(check(SUITE, f"greedy torch alone == batched {name}", tokens == batch_tokens,
                                     _first_mismatch(tokens, batch_tokens)))
            else:
                truth = reference_fp32.logits(ids)[-1, WINDOW]
                hf_error = compare(SUITE, "", theirs[0], truth).rel_l2
                results.append(compare(SUITE, f"first logits vs hf fp32 {name}", ours[0], truth,
                                       rel_l2=2 * hf_error + 1e-3,
                                       note=f"hf {str(dtype)[6:]} itself: rel-L2 {hf_error:.2e}"))
                results.append(check(SUITE, f"greedy hf vs torch {name}", True,
                                     "informational: " + _first_mismatch(ref_tokens, tokens)))
        if reference_fp32 is not None:
            reference_fp32.close()

        for index, ((name, ids), tokens) in enumerate(zip(prompts, alone)):
            engine.register_prefix(f"prefix{index}", ids[: len(ids) // 2])
            cached = engine_backend.generate(ids, greedy)
            results.append(check(SUITE, f"greedy with prefix cache {name}", cached == tokens or not exact,
                                 ("" if exact else "informational: ") + _first_mismatch(tokens, cached)))

        sampled = [SamplingParams(seed=seed * 1000 + i, max_tokens=max_tokens) for i in range(len(prompts))]
        alone = [engine_backend.generate(ids, params) for (_, ids), params in zip(prompts, sampled)]
        streams = [engine_backend.generate_stream(ids, params) for (_, ids), params in zip(prompts, sampled)]
        batched = [list(stream) for stream in streams]
        for (name, ids), params, tokens, batch_tokens in zip(prompts, sampled, alone, batched):
            same = tokens == batch_tokens
            results.append(check(SUITE, f"seeded torch alone == batched {name}", same or not exact,
                                 ("" if exact else "informational: ") + _first_mismatch(tokens, batch_tokens)))
            if exact:
                ref_tokens = hf.generate(ids, params)
                results.append(check(SUITE, f"seeded hf == torch {name}", ref_tokens == tokens,
                                     _first_mismatch(ref_tokens, tokens)))
    finally:
        engine_backend.close()
        hf.close()
    return results
