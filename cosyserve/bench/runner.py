"""One benchmark of Triton server variants: per variant, ``run.sh 2 2`` builds the model repository,
tritonserver serves it (under CUDA MPS if asked), and ``client_grpc.py`` measures every mode at
closed-loop concurrency levels and open-loop arrival rates; then ``offline_inference.py`` runs.

Functions take ``args``, the parsed command line of ``scripts/bench_triton.py`` (models_dir,
out_dir, modes, concurrency, rates, requests_per_level, requests_per_rate, seconds_per_rate,
fixed_output_seconds, tokens_per_second, seed, ports, timeouts, warmup_passes, variants,
offline_runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .. import data
from ..schedule import TOKEN_RATE
from ..serving.tritonserver import TritonServer, TritonServerError, log_report, mps_daemon, start_server
from . import BenchError
from .breakdown import compute_by_group, server_breakdown
from .openloop import poisson_arrivals
from .prometheus import counter_deltas, scrape_metrics
from .report import fmt, git_commit, gpu_name, load_label
from .targets import check_targets
from .workload import write_long_text_manifest, write_synthetic_manifest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ("streaming", "offline")
WARMUP_CONCURRENCY = 16
MIN_REQUESTS_PER_LEVEL = 26  # the size of the reference's wenetspeech4tts benchmark split
SECONDS_PER_RATE = 10.0  # default open-loop length: the arrivals of 10 s (at least MIN_REQUESTS_PER_LEVEL)
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # variant/run names become directory names


# --- variants and offline runs ----------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """A server configuration: run.sh environment overrides, and whether it runs under CUDA MPS."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    mps: bool = False


@dataclass(frozen=True)
class OfflineRun:
    name: str
    args: list[str]


def parse_variant(text: str) -> Variant:
    """``NAME`` or ``NAME:KEY=VAL,KEY=VAL``; the key ``MPS`` (1/0) is the driver's, not run.sh's."""
    name, _, spec = text.partition(":")
    if not NAME.match(name):
        raise argparse.ArgumentTypeError(f"variant name {name!r} must be letters, digits, '_', '.', '-' ({text!r})")
    env = {}
    for pair in filter(None, spec.split(",")):
        key, sep, value = pair.partition("=")
        if not sep or not ENV_KEY.match(key):
            raise argparse.ArgumentTypeError(f"variant {name}: {pair!r} is not KEY=VALUE")
        env[key] = value
    mps = env.pop("MPS", "0")
    if mps not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"variant {name}: MPS must be 1 or 0, got {mps!r}")
    return Variant(name, env, mps == "1")


def parse_offline_run(text: str) -> OfflineRun:
    """``NAME:ARGS``: ARGS are offline_inference.py options (shell-quoted)."""
    name, _, args = text.partition(":")
    if not NAME.match(name):
        raise argparse.ArgumentTypeError(f"offline run name {name!r} must be letters, digits, '_', '.', '-'")
    return OfflineRun(name, shlex.split(args))


def requests_per_level(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests_per_level or max(MIN_REQUESTS_PER_LEVEL, 2 * concurrency)


def arrivals_per_rate(args: argparse.Namespace, rate: float) -> list[float]:
    """The open-loop arrival times at ``rate`` req/s: ``--requests-per-rate`` of them, or those of
    ``--seconds-per-rate``, or by default those of SECONDS_PER_RATE but at least MIN_REQUESTS_PER_LEVEL."""
    if args.requests_per_rate:
        return poisson_arrivals(rate, args.seed, count=args.requests_per_rate)
    if args.seconds_per_rate:
        return poisson_arrivals(rate, args.seed, duration_s=args.seconds_per_rate)
    count = len(poisson_arrivals(rate, args.seed, duration_s=SECONDS_PER_RATE))
    return poisson_arrivals(rate, args.seed, count=max(MIN_REQUESTS_PER_LEVEL, count))


def rate_length(args: argparse.Namespace) -> str:
    """How long each rate runs, in words (without ``--requests-per-rate``)."""
    if args.seconds_per_rate:
        return f"the arrivals of {args.seconds_per_rate:g} s"
    return f"the arrivals of {SECONDS_PER_RATE:g} s, at least {MIN_REQUESTS_PER_LEVEL}"


# --- model repository, server -------------------------------------------------------------------


@dataclass(frozen=True)
class Repository:
    """What a built model repository serves: the model per mode (None: not served) and BLS instances."""

    path: Path
    models: dict[str, str | None]
    bls_instances: dict[str, int]


def interpreter_venv(out_dir: Path) -> Path:
    """A directory whose ``bin/python`` runs this interpreter: run.sh's VENV, so its stages use it."""
    venv = out_dir / ".interpreter"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    shim = venv / "bin" / "python"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    shim.chmod(0o755)
    return venv


def build_repository(args: argparse.Namespace, variant: Variant, variant_dir: Path) -> Repository:
    """``bash run.sh 2 2`` with the variant's overrides; output in ``variant_dir/run_sh.log``.

    cosyvoice2_offline's queue is unbounded unless the variant bounds it: a closed-loop level measures
    how requests past its instances wait, and refusals (docs/operations.md) would count as failures."""
    repo = variant_dir / "model_repo"
    env = {**os.environ, "MODELS_DIR": str(args.models_dir), "MODEL_REPO": str(repo), "OUT_DIR": str(variant_dir),
           "VENV": str(interpreter_venv(args.out_dir)), "PYTHON_BIN": sys.executable,
           "OFFLINE_BLS_MAX_QUEUE_SIZE": "0", **variant.env}
    log = variant_dir / "run_sh.log"
    with open(log, "w") as out:
        done = subprocess.run(["bash", str(REPO_ROOT / "run.sh"), "2", "2"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if done.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise BenchError(f"run.sh stage 2 failed for variant {variant.name} (exit {done.returncode}):\n{tail}")
    return read_repository(repo)


def read_repository(repo: Path) -> Repository:
    """Which model serves which mode, from the filled configs."""
    def config(name: str) -> str | None:
        path = repo / name / "config.pbtxt"
        return path.read_text() if path.is_file() else None

    main = config("cosyvoice2")
    if main is None:
        raise BenchError(f"{repo} has no cosyvoice2 model")
    decoupled = re.search(r"decoupled:\s*(\w+)", main)
    streaming = decoupled is not None and decoupled.group(1).lower() == "true"
    offline = "cosyvoice2_offline" if config("cosyvoice2_offline") else None if streaming else "cosyvoice2"
    instances = {}
    for name in ("cosyvoice2", "cosyvoice2_offline"):
        text = config(name)
        count = re.search(r"instance_group\s*\[\s*\{[^}]*count:\s*(\d+)", text or "")
        if count:
            instances[name] = int(count.group(1))
    return Repository(repo, {"streaming": "cosyvoice2" if streaming else None, "offline": offline}, instances)


# --- levels and rates -------------------------------------------------------------------------


def client_command(args: argparse.Namespace, model: str, mode: str, concurrency: int, requests: int,
                   manifest: Path, level_dir: Path, arrival_rate: float | None = None,
                   fixed_output_seconds: list[float] | None = None) -> list[str]:
    """client_grpc.py: ``concurrency`` closed-loop tasks, or open loop at ``arrival_rate`` req/s."""
    load = ["--arrival-rate", str(arrival_rate)] if arrival_rate else ["--num-tasks", str(concurrency)]
    seconds = fixed_output_seconds or args.fixed_output_seconds
    return [sys.executable, str(REPO_ROOT / "client_grpc.py"), "--server-addr", "localhost",
            "--server-port", str(args.grpc_port), "--model-name", model, "--mode", mode,
            *load, "--num-requests", str(requests), "--manifest-path", str(manifest),
            "--fixed-output-seconds", *map(str, seconds),
            "--tokens-per-second", str(args.tokens_per_second), "--seed", str(args.seed),
            "--log-dir", str(level_dir), "--json-report", str(level_dir / "report.json"),
            "--log-interval", "0", "--request-timeout", str(args.request_timeout)]


def run_client(command: list[str], level_dir: Path) -> dict:
    """Run client_grpc.py (output in ``level_dir/client.log``); its JSON report."""
    level_dir.mkdir(parents=True, exist_ok=True)
    report = level_dir / "report.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    with open(level_dir / "client.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    if not report.is_file():
        tail = (level_dir / "client.log").read_text(errors="replace")[-2000:]
        raise BenchError(f"client_grpc.py exited with {done.returncode} and wrote no report:\n{tail}")
    return json.loads(report.read_text(encoding="utf-8"))



def report_numbers(report: dict) -> dict:
    """The numbers of one client_grpc.py report, flat (JSON and tables)."""
    def ms(section: str, key: str) -> float | None:
        return report.get(section, {}).get(key)

    completed = report["requests"] - report["failed"]
    requested = report.get("requested_speech_tokens") or {}
    ok_ids = {r["id"] for r in report["per_request"] if r["error"] is None}
    underruns = report.get("underruns", {})
    return {
        "model": report["model_name"],
        "requests": report["requests"], "failed": report["failed"], "wall_s": report["wall_s"],
        "req_per_s": completed / report["wall_s"] if report["wall_s"] > 0 else None,
        "audio_s": report["audio_s"],
        # what the fixed lengths ask for (a token is 1/25 s of audio: 960 samples at 24 kHz)
        "requested_audio_s": sum(n for i, n in requested.items() if i in ok_ids) / TOKEN_RATE,
        "rtf": report["rtf"],
        "first_chunk_p50_ms": ms("first_chunk_latency", "p50_ms"),
        "first_chunk_p95_ms": ms("first_chunk_latency", "p95_ms"),
        "first_chunk_p99_ms": ms("first_chunk_latency", "p99_ms"),
        "latency_p50_ms": ms("latency", "p50_ms"), "latency_p95_ms": ms("latency", "p95_ms"),
        "requests_with_underrun": underruns.get("requests_with_underrun"),
        "underrun_stall_s": underruns.get("stall_s"),
        "triton_compute": compute_by_group(report.get("triton_stats", {}), report["wall_s"]),
        "errors": sorted({r["error"] for r in report["per_request"] if r["error"]})[:5],
    }


def level_row(variant: str, mode: str, load: dict, report: dict) -> dict:
    """The numbers of one closed-loop level (``load`` {"concurrency": N}) or open-loop rate
    ({"rate": R}, with what the sender offered, kept in flight and how late it was)."""
    row = {"variant": variant, "mode": mode, **load, **report_numbers(report)}
    if report.get("open_loop"):
        row.update({key: report["open_loop"][key] for key in ("offered_req_per_s", "peak_in_flight",
                                                              "start_lag_max_ms")})
    return row


def run_variant(args: argparse.Namespace, variant: Variant, manifest: Path,
                items_used: int) -> tuple[list[dict], list[dict], dict]:
    """Build, serve and measure one variant; (level rows, rate rows, variant facts)."""
    variant_dir = args.out_dir / variant.name
    variant_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{variant.name}] building the model repository (run.sh stage 2) ...", flush=True)
    repo = build_repository(args, variant, variant_dir)
    facts = {"name": variant.name, "overrides": variant.env, "mps": variant.mps, "models": repo.models,
             "bls_instances": repo.bls_instances, "server_log": str(variant_dir / "tritonserver.log")}
    missing = [mode for mode in args.modes if repo.models[mode] is None]
    if missing:
        raise BenchError(f"variant {variant.name} serves no model for mode(s) {', '.join(missing)} "
                         "(streaming needs a decoupled cosyvoice2: DECOUPLED_MODE=True)")
    for mode in args.modes:
        # cosyvoice2 (the engine) takes every request at once; cosyvoice2_offline forwards one per instance
        instances = repo.bls_instances.get(repo.models[mode], 0) if repo.models[mode] == "cosyvoice2_offline" else 0
        if instances and max(args.concurrency) > instances:
            print(f"[{variant.name}] note: {repo.models[mode]} has {instances} BLS instances (each serves one request "
                  f"at a time): levels above {instances} queue at the BLS", flush=True)
    try:
        with mps_daemon(variant_dir / "mps") if variant.mps else _no_mps() as mps_env:
            env = {**os.environ, **variant.env, **mps_env}
            print(f"[{variant.name}] starting tritonserver ...", flush=True)
            started = time.perf_counter()
            server = start_server(repo.path, http_port=args.http_port, grpc_port=args.grpc_port,
                                  metrics_port=args.metrics_port, log_file=variant_dir / "tritonserver.log",
                                  timeout=args.server_start_timeout, env=env, die_with_parent=True)
            facts["server_start_s"] = time.perf_counter() - started
            try:
                levels = measure_levels(args, variant, repo, server, manifest, items_used, variant_dir)
                rates = measure_rates(args, variant, repo, server, manifest, variant_dir)
                facts["long_text"] = measure_long_text(args, variant, repo, server, manifest, variant_dir)
            finally:
                server.stop()
    except TritonServerError as e:  # the MPS daemon or the server did not start
        raise BenchError(f"variant {variant.name}: {e}") from None
    return levels, rates, facts


@contextmanager
def _no_mps() -> Iterator[dict[str, str]]:
    yield {}


def measure_levels(args: argparse.Namespace, variant: Variant, repo: Repository, server: TritonServer,
                   manifest: Path, items_used: int, variant_dir: Path) -> list[dict]:
    """Per mode: the warm-up, then every level. A level that cannot be measured (client crashed,
    server gone) becomes an error row; the others are kept."""
    rows = []
    for mode in args.modes:
        model = repo.models[mode]
        print(f"[{variant.name}] {mode}: warm-up, {args.warmup_passes} x {items_used} requests at concurrency "
              f"{WARMUP_CONCURRENCY} ...", flush=True)
        for warmup_pass in range(args.warmup_passes):
            warmup_dir = variant_dir / f"warmup_{mode}_{warmup_pass}"
            try:
                check_alive(server)
                warmup = run_client(client_command(args, model, mode, WARMUP_CONCURRENCY, items_used, manifest,
                                                   warmup_dir), warmup_dir)
                if warmup["failed"]:
                    print(f"[{variant.name}] warning: {warmup['failed']} warm-up requests failed (see {warmup_dir})",
                          flush=True)
            except BenchError as e:
                print(f"[{variant.name}] warning: the {mode} warm-up failed: {e}", flush=True)
        for concurrency in args.concurrency:
            level_dir, requests = variant_dir / f"{mode}_c{concurrency}", requests_per_level(args, concurrency)
            command = client_command(args, model, mode, concurrency, requests, manifest, level_dir)
            rows.append(measured_row(args, variant, server, mode, model, {"concurrency": concurrency}, requests,
                                     command, level_dir))
    return rows


def measure_rates(args: argparse.Namespace, variant: Variant, repo: Repository, server: TritonServer,
                  manifest: Path, variant_dir: Path) -> list[dict]:
    """Per mode, every open-loop rate (after :func:`measure_levels`, which warmed the server up)."""
    rows = []
    for mode in args.modes:
        model = repo.models[mode]
        for rate in args.rates:
            level_dir, requests = variant_dir / f"{mode}_r{rate:g}", len(arrivals_per_rate(args, rate))
            command = client_command(args, model, mode, 0, requests, manifest, level_dir, arrival_rate=rate)
            rows.append(measured_row(args, variant, server, mode, model, {"rate": rate}, requests, command,
                                     level_dir))
    return rows


def measure_long_text(args: argparse.Namespace, variant: Variant, repo: Repository, server: TritonServer,
                      manifest: Path, variant_dir: Path) -> list[dict]:
    """With ``--long-text-chars N``: one streaming request of an N-character mixed Chinese/English
    text (the first voice of the manifest; each of its segments is ``--long-text-seconds`` long), alone."""
    if not args.long_text_chars or "streaming" not in args.modes:
        return []
    level_dir = variant_dir / f"streaming_long_text_{args.long_text_chars}"
    text_manifest = write_long_text_manifest(level_dir, manifest, args.long_text_chars, args.seed)
    command = client_command(args, repo.models["streaming"], "streaming", 1, 1, text_manifest, level_dir,
                             fixed_output_seconds=[args.long_text_seconds])
    row = measured_row(args, variant, server, "streaming", repo.models["streaming"], {"concurrency": 1}, 1, command,
                       level_dir)
    row["text_chars"] = args.long_text_chars
    return [row]


def measured_row(args: argparse.Namespace, variant: Variant, server: TritonServer, mode: str, model: str,
                 load: dict, requests: int, command: list[str], level_dir: Path) -> dict:
    """One level or rate (``load``, see :func:`level_row`): client_grpc.py's report with the server's
    counters read before and after; an error row when it cannot be measured (client crashed, server
    gone)."""
    try:
        check_alive(server)
        before = scrape_metrics(args.metrics_port)
        report = run_client(command, level_dir)
        after = scrape_metrics(args.metrics_port)
        row = level_row(variant.name, mode, load, report)
        row["server_counters"] = counter_deltas(before, after)
        row["server_breakdown"] = server_breakdown(row)
    except BenchError as e:
        row = {"variant": variant.name, "mode": mode, **load, "model": model, "requests": requests,
               "failed": requests, "error": str(e)}
    row["report"] = str(level_dir / "report.json")
    print(f"[{variant.name}] {summary_line(row)}", flush=True)
    return row


def check_alive(server: TritonServer) -> None:
    if server.process.poll() is not None:
        raise BenchError(f"tritonserver exited with code {server.process.returncode}\n{log_report(server.log_file)}")



def summary_line(row: dict) -> str:
    load = load_label(row)
    if row.get("error"):
        return f"{row['mode']} {load}: ERROR {row['error'].splitlines()[0]}"
    text = (f"{row['mode']} {load}: {row['requests']} requests, {row['failed']} failed, "
            f"{fmt(row['req_per_s'], 2)} req/s, RTF {fmt(row['rtf'], 4)}")
    if row["mode"] == "streaming":
        text += (f", first chunk p50/p95 {fmt(row['first_chunk_p50_ms'], 1)}/{fmt(row['first_chunk_p95_ms'], 1)} ms"
                 f", {row['requests_with_underrun']} with underruns")
    return text


# --- offline_inference.py --------------------------------------------------------------------


def run_offline_inference(args: argparse.Namespace, run: OfflineRun, manifest: Path) -> dict:
    out = args.out_dir / "offline_inference" / run.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").unlink(missing_ok=True)
    command = [sys.executable, str(REPO_ROOT / "offline_inference.py"), "--model-dir", str(args.models_dir),
               "--manifest-path", str(manifest), "--output-dir", str(out),
               "--fixed-output-seconds", *map(str, args.fixed_output_seconds),
               "--fixed-tokens-per-second", str(args.tokens_per_second), "--seed", str(args.seed), "--no-progress",
               *run.args]
    print(f"[offline_inference {run.name}] {shlex.join(command[1:])}", flush=True)
    with open(out / "offline_inference.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    row = {"name": run.name, "args": run.args, "report": str(out / "report.json")}
    if done.returncode or not (out / "report.json").is_file():
        tail = (out / "offline_inference.log").read_text(errors="replace")[-2000:]
        print(f"[offline_inference {run.name}] ERROR: exit {done.returncode}, see {out / 'offline_inference.log'}",
              flush=True)
        return {**row, "error": f"offline_inference.py exited with {done.returncode}:\n{tail}"}
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    keys = ("backend", "device", "gpu", "batch_size", "token2wav_batch_size", "items", "audio_s", "rtf",
            "frontend_time_s", "engine_time_s", "total_time_s")
    row.update({k: report.get(k) for k in keys})
    print(f"[offline_inference {run.name}] RTF {fmt(row['rtf'], 4)} ({row['items']} items, {fmt(row['audio_s'], 2)} s "
          f"of audio)", flush=True)
    return row


# --- the whole run ----------------------------------------------------------------------------


def run_benchmark(args: argparse.Namespace, command: str) -> dict:
    """Every variant, then every offline_inference run, and the targets: what bench.json holds."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = args.manifest or write_synthetic_manifest(args.out_dir / "manifest", args.num_prompts, args.seed)
    items = data.load_manifest(manifest)
    # the items the levels and rates send: warmed up once each
    most = max([requests_per_level(args, c) for c in args.concurrency]
               + [len(arrivals_per_rate(args, r)) for r in args.rates])
    items_used = min(len(items), most)
    header = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "gpu": gpu_name(),
        "command": command, "git_commit": git_commit(REPO_ROOT), "manifest": str(manifest), "items": len(items),
        "fixed_output_seconds": args.fixed_output_seconds, "tokens_per_second": args.tokens_per_second,
        "seed": args.seed, "warmup_passes": args.warmup_passes, "warmup_concurrency": WARMUP_CONCURRENCY,
        "requests_per_level": args.requests_per_level or
        f"max({MIN_REQUESTS_PER_LEVEL}, 2 x concurrency)", "rates": args.rates,
        "requests_per_rate": args.requests_per_rate or rate_length(args),
    }
    levels, rates, variants = [], [], []
    for variant in args.variants:
        try:
            variant_levels, variant_rates, facts = run_variant(args, variant, manifest, items_used)
        except BenchError as e:
            print(f"[{variant.name}] ERROR: {e}", file=sys.stderr, flush=True)
            variant_levels, variant_rates = [], []
            facts = {"name": variant.name, "overrides": variant.env, "mps": variant.mps, "error": str(e)}
        levels += variant_levels
        rates += variant_rates
        variants.append(facts)
    offline_rows = [run_offline_inference(args, run, manifest) for run in args.offline_runs]
    long_text = [row for facts in variants for row in facts.get("long_text", [])]
    for row in levels + rates:
        if not row.get("error") and abs(row["audio_s"] - row["requested_audio_s"]) > 1e-6:
            print(f"warning: {row['variant']} {row['mode']} {load_label(row)}: {row['audio_s']:.3f} s of audio "
                  f"for {row['requested_audio_s']:.3f} s requested", file=sys.stderr)
    return {"header": header, "variants": variants, "levels": levels, "open_loop": rates, "long_text": long_text,
            "offline_inference": offline_rows, "targets": check_targets(levels, variants, offline_rows)}


def failed(bench: dict) -> bool:
    """A variant, level, rate or offline run failed, or any request did."""
    return (any(v.get("error") for v in bench["variants"])
            or any(r.get("error") or r["failed"] for r in bench["levels"] + bench["open_loop"]
                   + bench.get("long_text", []))
            or any(r.get("error") for r in bench["offline_inference"]))
