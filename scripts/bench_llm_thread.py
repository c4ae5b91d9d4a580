#!/usr/bin/env python3
"""How fast our LLM engine decodes on its own thread, set up as the engine core runs it: one request
of N tokens at a time, time per token after the first, for each set-up in turn (the engine started
on the current stream or on a high-priority stream; with or without a second thread that polls every
millisecond, as the engine loop does while it waits for tokens; the interpreter's switch interval).

    python scripts/bench_llm_thread.py --llm-dir /tmp/models/cosyvoice2_llm --tokens 100
"""

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses  # noqa: E402

import torch  # noqa: E402

from cosyserve.llm.engine.llm_engine import LLMEngine  # noqa: E402
from cosyserve.llm.sampling import REFERENCE_SAMPLING  # noqa: E402


def per_token_ms(engine: LLMEngine, tokens: int, requests: int, prompt: list[int]) -> float:
    params = dataclasses.replace(REFERENCE_SAMPLING, max_tokens=tokens, min_tokens=tokens)
    times = []
    for k in range(requests):
        stream = engine.submit(prompt, params, f"r{time.monotonic_ns()}-{k}")
        first = None
        count = 0
        for _ in stream:
            count += 1
            if first is None:
                first = time.perf_counter()
        times.append(1e3 * (time.perf_counter() - first) / max(count - 1, 1))
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm-dir", required=True)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    from transformers import AutoTokenizer

    from cosyserve.llm.prompt import build_prompt_ids
    prompt = build_prompt_ids(AutoTokenizer.from_pretrained(args.llm_dir), "收到好友从远方寄来的生日礼物。",
                              "希望你以后能够做的比我还好呦。", list(range(75)))
    rows = []
    for priority in (None, -1):
        engine = LLMEngine(args.llm_dir, device, max_slots=64)
        engine.start(torch.cuda.Stream(device, priority=priority) if priority is not None and device.type == "cuda"
                     else None)
        try:
            for poller in (False, True):
                for interval_ms in (5.0, 0.5):
                    sys.setswitchinterval(interval_ms / 1e3)
                    stop = threading.Event()
                    thread = None
                    if poller:
                        cond = threading.Condition()

                        def poll():
                            while not stop.is_set():
                                with cond:
                                    cond.wait(0.001)
                                sum(range(200))  # a little Python, as a loop iteration with nothing to do
                        thread = threading.Thread(target=poll, daemon=True)
                        thread.start()
                    ms = per_token_ms(engine, args.tokens, args.requests, prompt)
                    stop.set()
                    if thread:
                        thread.join()
                    rows.append((priority, poller, interval_ms, ms))
                    print(f"| {'high' if priority else 'current'} | {poller} | {interval_ms:g} | {ms:.2f} |", flush=True)
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    print("| stream | 1 ms poller | switch interval ms | ms per token |\n|---|---|---:|---:|")
    sys.exit(main())
