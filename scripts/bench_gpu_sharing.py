#!/usr/bin/env python3
"""How the LLM and the flow slow each other down on one GPU, by the way they share it.

    python scripts/bench_gpu_sharing.py --models-dir /tmp/models            # real-size bundle (run.sh 0 0)
    python scripts/bench_gpu_sharing.py --models-dir /tmp/models --flow-rows 8 --llm-rows 16

The Triton server runs the LLM and token2wav as two processes, under CUDA MPS when it can. This
measures one flow call (the Euler loop replayed from a CUDA graph, ``--flow-rows`` requests of
``--frames`` frames, streaming attention) and one LLM decode step (``--llm-rows`` requests, CUDA
graphs) in these set-ups, each in fresh processes:

* ``alone``: the flow, then the LLM, each with the GPU to itself;
* ``one process``: both in one process, the LLM stepping on its own thread and CUDA stream; with
  equal stream priorities, and with the flow's stream at the highest priority (the LLM at the
  lowest): the block scheduler then prefers the flow's pending blocks;
* ``two processes``: the LLM in one process, the flow in another, time-sliced (no MPS) and under
  an MPS control daemon started for the run (``--no-mps`` skips it).

Random weights serve: the cost does not depend on them. Prints a markdown table (median and p90
of the flow call and of the decode steps taken while the flow ran).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.serving.tritonserver import MPS_CONTROL, mps_daemon  # noqa: E402


# ----- the two workloads -----------------------------------------------------------------------

class FlowCall:
    """One streaming flow call of ``rows`` requests of ``frames`` frames, replayed from a CUDA graph."""

    def __init__(self, model_dir: Path, rows: int, frames: int):
        from cosyserve.models.flow import load_flow
        from cosyserve.token2wav.graphs import FlowSampler

        flow = load_flow(model_dir, "cuda", torch.float16).eval()
        lookahead = flow.cfg.pre_lookahead_len
        prompt_tokens = frames // (2 * flow.cfg.token_mel_ratio)
        target_tokens = frames // flow.cfg.token_mel_ratio - prompt_tokens + lookahead
        g = torch.Generator().manual_seed(0)
        self.conditions = flow.batch_conditions(
            [torch.randint(0, flow.cfg.vocab_size, (1, target_tokens), generator=g) for _ in range(rows)],
            [torch.randint(0, flow.cfg.vocab_size, (1, prompt_tokens), generator=g) for _ in range(rows)],
            [torch.randn(1, flow.cfg.token_mel_ratio * prompt_tokens, 80, generator=g).half() for _ in range(rows)],
            [torch.randn(1, flow.cfg.spk_embed_dim, generator=g).half() for _ in range(rows)],
            streaming=True, finalize=False)
        self.sampler = FlowSampler(flow.decoder, cuda_graphs=True)
        for _ in range(3):  # eager once, then captured, then replayed
            self()

    def __call__(self) -> None:
        self.sampler(self.conditions, True)


class DecodeLoop:
    """``rows`` LLM requests decoding (engine steps on the calling thread) until :meth:`stop`."""

    def __init__(self, llm_dir: Path, rows: int):
        from cosyserve.llm.engine.llm_engine import LLMEngine
        from cosyserve.llm.prompt import SOS_ID, TASK_ID
        from cosyserve.llm.sampling import SamplingParams

        self.engine = LLMEngine(llm_dir, "cuda", max_slots=max(rows, 1), max_model_len=2048)
        params = SamplingParams(max_tokens=1900, min_tokens=1900)
        for i in range(rows):
            self.engine.submit([SOS_ID, *range(1000 + i, 1040 + i), TASK_ID], params)
        self.steps: list[tuple[float, float]] = []  # (end time, seconds)
        self._stop = threading.Event()
        for _ in range(20):  # prefill and warm decode steps
            self.engine.step()

    def run(self, seconds: float) -> None:
        deadline = time.time() + seconds
        while not self._stop.is_set() and time.time() < deadline and self.engine.num_active:
            started = time.perf_counter()
            self.engine.step()
            self.steps.append((time.time(), time.perf_counter() - started))

    def stop(self) -> None:
        self._stop.set()


def timed_calls(call, count: int) -> tuple[list[float], float, float]:
    """``count`` synchronised calls: their seconds, and the wall-clock window they ran in."""
    times, start = [], time.time()
    for _ in range(count):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times, start, time.time()


# ----- roles (each runs in its own process) ----------------------------------------------------

def role_flow(args) -> dict:
    flow = FlowCall(args.models_dir / "CosyVoice2-0.5B", args.flow_rows, args.frames)
    if args.wait_file:  # two processes: start once the LLM is stepping
        while not Path(args.wait_file).exists():
            time.sleep(0.05)
        time.sleep(1.0)
    times, start, end = timed_calls(flow, args.calls)
    return {"flow_s": times, "window": [start, end]}


def role_llm(args) -> dict:
    loop = DecodeLoop(args.models_dir / "cosyvoice2_llm", args.llm_rows)
    if args.ready_file:
        Path(args.ready_file).touch()
    loop.run(args.seconds)
    return {"steps": loop.steps}


def role_together(args) -> dict:
    low, high = torch.cuda.Stream.priority_range()  # numerically: low priority is the larger number
    flow_priority = high if args.flow_first else 0
    llm_priority = low if args.flow_first else 0
    flow_stream, llm_stream = torch.cuda.Stream(priority=flow_priority), torch.cuda.Stream(priority=llm_priority)
    with torch.cuda.stream(flow_stream):
        flow = FlowCall(args.models_dir / "CosyVoice2-0.5B", args.flow_rows, args.frames)
    with torch.cuda.stream(llm_stream):
        loop = DecodeLoop(args.models_dir / "cosyvoice2_llm", args.llm_rows)

    def llm_thread() -> None:
        with torch.cuda.stream(llm_stream):
            loop.run(args.seconds)

    thread = threading.Thread(target=llm_thread, daemon=True)
    thread.start()
    time.sleep(1.0)
    with torch.cuda.stream(flow_stream):
        times, start, end = timed_calls(flow, args.calls)
    loop.stop()
    thread.join()
    return {"flow_s": times, "window": [start, end], "steps": loop.steps,
            "priorities": {"flow": flow_priority, "llm": llm_priority}}


ROLES = {"flow": role_flow, "llm": role_llm, "together": role_together}


# ----- orchestration -----------------------------------------------------------------------------

def child(args, role: str, out: Path, env: dict | None = None, **extra) -> subprocess.Popen:
    command = [sys.executable, __file__, "--role", role, "--out", str(out), "--models-dir", str(args.models_dir),
               "--flow-rows", str(args.flow_rows), "--llm-rows", str(args.llm_rows), "--frames", str(args.frames),
               "--calls", str(args.calls), "--seconds", str(args.seconds)]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return subprocess.Popen(command, env=env)


def finish(process: subprocess.Popen, out: Path, timeout: float) -> dict:
    if process.wait(timeout=timeout):
        raise RuntimeError(f"{process.args[3]} role failed (exit {process.returncode})")
    return json.loads(out.read_text())


def two_processes(args, work: Path, env: dict | None) -> dict:
    ready = work / "llm_ready"
    ready.unlink(missing_ok=True)
    llm = child(args, "llm", work / "llm.json", env, ready_file=ready)
    flow = child(args, "flow", work / "flow.json", env, wait_file=ready)
    result = finish(flow, work / "flow.json", 600)
    result["steps"] = finish(llm, work / "llm.json", 600)["steps"]
    return result


def summary(name: str, result: dict) -> dict:
    row = {"setup": name}
    if "flow_s" in result:
        flow = sorted(result["flow_s"])
        row["flow_ms"] = (1000 * statistics.median(flow), 1000 * flow[int(0.9 * (len(flow) - 1))])
    steps = result.get("steps") or []
    if "window" in result:  # the decode steps that ran while the flow did
        start, end = result["window"]
        steps = [s for s in steps if start <= s[0] <= end]
    if steps:
        step = sorted(s for _, s in steps)
        row["step_ms"] = (1000 * statistics.median(step), 1000 * step[int(0.9 * (len(step) - 1))])
        row["steps"] = len(step)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, required=True, help="holds CosyVoice2-0.5B/ and cosyvoice2_llm/")
    p.add_argument("--flow-rows", type=int, default=1)
    p.add_argument("--frames", type=int, default=400, help="flow frames per request (prompt + target)")
    p.add_argument("--llm-rows", type=int, default=1)
    p.add_argument("--calls", type=int, default=30, help="flow calls timed per set-up")
    p.add_argument("--seconds", type=float, default=60.0, help="longest an LLM loop runs")
    p.add_argument("--no-mps", action="store_true")
    p.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--wait-file", help=argparse.SUPPRESS)
    p.add_argument("--flow-first", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA device")
    torch.set_num_threads(1)
    if args.role:
        args.out.write_text(json.dumps(ROLES[args.role](args)))
        return 0

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append(summary("flow alone", finish(child(args, "flow", work / "a.json"), work / "a.json", 600)))
        llm_alone = finish(child(args, "llm", work / "b.json", seconds=10), work / "b.json", 600)
        rows.append(summary("LLM alone", llm_alone))
        for name, extra in (("one process, equal stream priorities", {}),
                            ("one process, flow stream at high priority", {"flow_first": True})):
            rows.append(summary(name, finish(child(args, "together", work / "t.json", **extra), work / "t.json", 600)))
        rows.append(summary("two processes, time-sliced", two_processes(args, work, None)))
        if not args.no_mps and shutil.which(MPS_CONTROL):
            with mps_daemon(work / "mps") as mps_env:
                rows.append(summary("two processes, MPS", two_processes(args, work, {**os.environ, **mps_env})))

    def pair(value) -> str:
        return "" if value is None else f"{value[0]:.2f} / {value[1]:.2f}"

    print(f"GPU {torch.cuda.get_device_name(0)}; flow: {args.flow_rows} request(s) x {args.frames} frames, "
          f"streaming, CUDA graph; LLM: {args.llm_rows} request(s) decoding, CUDA graphs")
    print("| set-up | flow call p50 / p90 ms | decode step p50 / p90 ms | decode steps timed |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['setup']} | {pair(row.get('flow_ms'))} | {pair(row.get('step_ms'))} | {row.get('steps', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
