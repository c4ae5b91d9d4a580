#!/usr/bin/env python3
"""Benchmark the cosyvoice2 Triton model over gRPC with concurrent tasks.

    python3 client_grpc.py --server-addr localhost --model-name cosyvoice2 --num-tasks 4 \\
        --mode streaming --manifest-path data/manifest.txt --log-dir ./log_streaming_4

Items come from ``--reference-audio`` (one request), else ``--manifest-path`` (lines
``utt|prompt_text|prompt_wav|target_text``), else ``--huggingface-dataset``/``--split-name``.
Each of the ``--num-tasks`` tasks (threads, one client each) sends its share of the items one
after another (``--num-requests N`` cycles the items to N requests); with ``--arrival-rate R``
the requests instead arrive open loop, at seeded Poisson times (``--seed``) at R per second,
each on a thread of its own however many are still in flight. ``--mode streaming`` needs
the model to be decoupled: audio arrives in chunks on a gRPC stream and the chunk arrival times
give first/second-chunk latencies and playback underruns. On random-weight bundles, which never
end speech by themselves, ``--fixed-output-seconds 4 10`` fixes every request's length (sent as
``max_tokens = min_tokens``; the same seeded draws per item as ``offline_inference.py``).
Writes ``<id>.wav`` per request, ``rtf-<name>.txt``, ``stats_summary-<name>.txt`` (Triton
per-model statistics of this run) and ``model_config-<name>.json`` into ``--log-dir``, and with
``--json-report`` every number as JSON (with the speech tokens requested per request).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import soundfile as sf
import tritonclient.grpc as grpcclient
from tqdm import tqdm
from tritonclient.utils import InferenceServerException

from cosyserve import clients, data
from cosyserve.bench.openloop import poisson_arrivals, run_open_loop
from cosyserve.errors import InvalidInputError
from cosyserve.data import FixedLength


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-addr", default="localhost")
    parser.add_argument("--server-port", type=int, default=8001, help="Triton gRPC port")
    parser.add_argument("--model-name", default="cosyvoice2")
    parser.add_argument("--mode", choices=["offline", "streaming"], default="offline",
                        help="streaming needs a decoupled model (decoupled_mode:True)")
    parser.add_argument("--num-tasks", type=int, default=1, help="concurrent requests")
    parser.add_argument("--arrival-rate", type=float, metavar="R",
                        help="open loop instead of --num-tasks: Poisson arrivals at R requests per second")
    parser.add_argument("--reference-audio", help="a single request: prompt wav (overrides the item sources)")
    parser.add_argument("--reference-text", default="", help="with --reference-audio: its transcript")
    parser.add_argument("--target-text", default="", help="with --reference-audio: the text to synthesise")
    parser.add_argument("--manifest-path", help="file of utt|prompt_text|prompt_wav|target_text lines")
    parser.add_argument("--huggingface-dataset", default="yuekai/seed_tts",
                        help="used when neither --reference-audio nor --manifest-path is given")
    parser.add_argument("--split-name", default="wenetspeech4tts")
    parser.add_argument("--log-dir", type=Path, default=Path("./tmp"))
    parser.add_argument("--log-interval", type=int, default=5, help="print every N-th finished request (0: never)")
    parser.add_argument("--speaker-id", help="send this speaker_id with every request")
    parser.add_argument("--use-spk2info-cache", default="False",
                        help="True: send only target_text (and --speaker-id): the server uses a cached speaker")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json-report", type=Path, help="write every number of the run to this JSON file")
    parser.add_argument("--num-requests", type=int,
                        help="send this many requests, cycling through the items (ids get _r<pass>); default: "
                             "each item once")
    parser.add_argument("--fixed-output-seconds", type=float, nargs="+", metavar="S",
                        help="random-weight bundles: every request makes exactly round(RATE x S) speech tokens "
                             "(max_tokens = min_tokens); S is one value, or LO HI for a seeded uniform draw per "
                             "item in item order (as offline_inference.py draws them)")
    parser.add_argument("--tokens-per-second", type=float, default=25.0,
                        help="RATE of --fixed-output-seconds (speech tokens per second of audio)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --fixed-output-seconds draws and arrivals")
    parser.add_argument("--compute-wer", action="store_true", help="not supported here (accepted for compatibility)")
    return parser.parse_args(argv)


def load_items(args: argparse.Namespace) -> tuple[str, list[data.Utterance]]:
    """(run name, the requests to send). The manifest wins over the dataset default."""
    if args.reference_audio:
        name, items = Path(args.reference_audio).stem, [
            data.Utterance("test", args.reference_text, args.reference_audio, args.target_text)]
    elif args.manifest_path:
        name, items = Path(args.manifest_path).stem, data.load_manifest(args.manifest_path)
    else:
        name, items = args.split_name, data.load_hf_dataset(args.huggingface_dataset, args.split_name)
    fixed = fixed_length(args)
    if fixed:  # drawn per item before repeating: a repeat has its item's length
        items = data.with_fixed_lengths(items, fixed)
    if args.num_requests is not None:
        items = data.repeat_items(items, args.num_requests)
    return name, items


def fixed_length(args: argparse.Namespace) -> FixedLength | None:
    if not args.fixed_output_seconds:
        return None
    return FixedLength(args.tokens_per_second, tuple(args.fixed_output_seconds), args.seed)


class Task:
    """One concurrent sender: its own client, its share of the items, sequentially (``one`` sends
    one item on a given client)."""

    def __init__(self, args: argparse.Namespace, progress: tqdm, lock: threading.Lock):
        self.args, self.progress, self.lock = args, progress, lock
        self.send_reference = args.use_spk2info_cache.lower() != "true"
        self.run_request = clients.run_streaming if args.mode == "streaming" else clients.run_offline

    def __call__(self, items: list[data.Utterance]) -> list[clients.RequestResult]:
        args = self.args
        client = grpcclient.InferenceServerClient(f"{args.server_addr}:{args.server_port}")
        results = []
        try:
            for item in items:
                results.append(self.one(client, item))
        finally:
            client.close()
        return results

    def one(self, client, item: data.Utterance) -> clients.RequestResult:
        args = self.args
        try:
            waveform = data.load_reference_audio(item.reference_audio) if self.send_reference else None
            inputs = clients.build_inputs(grpcclient, waveform, item.reference_text, item.target_text,
                                          args.speaker_id, max_tokens=item.speech_tokens,
                                          min_tokens=item.speech_tokens)
            audio, result = self.run_request(client, args.model_name, inputs, clients.requested_outputs(grpcclient),
                                             item.id, timeout_s=args.request_timeout)
            sf.write(args.log_dir / f"{item.id}.wav", audio, clients.OUTPUT_SAMPLE_RATE, "PCM_16")
        except Exception as e:  # one failed request must not stop the benchmark
            result = clients.RequestResult(item.id, error=f"{type(e).__name__}: {e}")
            tqdm.write(f"{item.id}: FAILED {result.error}")
        with self.lock:
            self.progress.update(1)
            done = self.progress.n
        if result.error is None and args.log_interval and done % args.log_interval == 0:
            first = result.first_chunk_latency_s
            tqdm.write(f"{item.id}: latency {result.latency_s:.3f} s, audio {result.audio_s:.2f} s"
                       + (f", first chunk {first:.3f} s" if args.mode == "streaming" and first is not None else ""))
        return result


class ClientPool:
    """gRPC clients for open-loop requests: a client carries one stream at a time, so a request takes
    an idle one, or a new one when all are busy."""

    def __init__(self, url: str):
        self.url, self.idle, self.clients = url, queue.SimpleQueue(), []

    def send(self, task: Task, item: data.Utterance) -> clients.RequestResult:
        try:
            client = self.idle.get_nowait()
        except queue.Empty:
            client = grpcclient.InferenceServerClient(self.url)
            self.clients.append(client)
        try:
            return task.one(client, item)
        finally:
            self.idle.put(client)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def main() -> int:
    args = parse_args()
    if args.compute_wer:
        print("warning: --compute-wer is not supported by this client; ignoring it", file=sys.stderr)
    try:
        name, items = load_items(args)
    except (InvalidInputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.log_dir.mkdir(parents=True, exist_ok=True)
    url = f"{args.server_addr}:{args.server_port}"
    admin = grpcclient.InferenceServerClient(url)
    try:
        if not admin.is_model_ready(args.model_name):
            print(f"error: model {args.model_name!r} is not ready on {url}", file=sys.stderr)
            return 2
    except InferenceServerException as e:
        print(f"error: cannot reach Triton at {url}: {e}", file=sys.stderr)
        return 2
    stats_before = admin.get_inference_statistics(model_name="", as_json=True)

    open_loop = None
    if args.arrival_rate:
        arrivals = poisson_arrivals(args.arrival_rate, args.seed, count=len(items))
        with tqdm(total=len(items), desc=f"{args.mode} at {args.arrival_rate:g}/s", unit="req") as progress:
            task, pool = Task(args, progress, threading.Lock()), ClientPool(url)
            try:
                run = run_open_loop(arrivals, lambda i: pool.send(task, items[i]))
            finally:
                pool.close()
        results, wall_s, num_tasks = run.results, run.wall_s, None
        open_loop = run.summary(arrivals, args.arrival_rate)
    else:
        shares = data.split_round_robin(items, args.num_tasks)
        with tqdm(total=len(items), desc=f"{args.mode} x{len(shares)}", unit="req") as progress:
            task = Task(args, progress, threading.Lock())
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(shares)) as pool:
                results = [r for share in pool.map(task, shares) for r in share]
            wall_s = time.perf_counter() - start
        num_tasks = len(shares)

    summary = clients.summarize(results, wall_s, args.mode)
    triton_stats = clients.stats_delta(stats_before, admin.get_inference_statistics(model_name="", as_json=True))
    model_config = admin.get_model_config(args.model_name, as_json=True)
    admin.close()

    text = clients.format_summary(summary)
    print(text, end="")
    stats_text = clients.format_triton_stats(triton_stats)
    print(stats_text, end="")
    (args.log_dir / f"rtf-{name}.txt").write_text(text)
    (args.log_dir / f"stats_summary-{name}.txt").write_text(stats_text)
    (args.log_dir / f"model_config-{name}.json").write_text(json.dumps(model_config, indent=2))
    if args.json_report:
        fixed = fixed_length(args)
        report = {**summary, "model_name": args.model_name, "num_tasks": num_tasks, "open_loop": open_loop,
                  "server": url,
                  "fixed_length": dataclasses.asdict(fixed) if fixed else None,
                  "requested_speech_tokens": {item.id: item.speech_tokens for item in items} if fixed else None,
                  "per_request": [r.to_dict() for r in results], "triton_stats": triton_stats}
        args.json_report.parent.mkdir(parents=True, exist_ok=True)
        args.json_report.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
