#!/usr/bin/env python3
"""The Triton benchmark of issue 7: server variants x modes x concurrency levels, offline_inference
runs, one table, the targets checked.

    python3 scripts/bench_triton.py --models-dir models --out-dir outputs/bench \\
        --variant ours:BLS_INSTANCE_NUM=64,OFFLINE_BLS_INSTANCE_NUM=16 \\
        --variant mps:BLS_INSTANCE_NUM=64,OFFLINE_BLS_INSTANCE_NUM=16,MPS=1 \\
        --offline-inference "torch:--backend torch --batch-size 16 --token2wav-batch-size 16 --cuda-graphs"

For each ``--variant NAME:KEY=VAL,...`` (default: ``ours``, no overrides):

1. ``bash run.sh 2 2`` builds its model repository under ``<out-dir>/<NAME>/`` with the overrides
   in the environment (any run.sh setting: BLS_INSTANCE_NUM, TOKEN2WAV_CUDA_GRAPHS, DEVICE...). The
   server gets the same environment, so settings that models read at run time apply too. ``MPS=1``
   runs the server under a CUDA MPS control daemon started for it (pipes and logs in
   ``<out-dir>/<NAME>/mps``) and quit afterwards.
2. The server starts on ``--http-port/--grpc-port/--metrics-port`` (log ``<out-dir>/<NAME>/tritonserver.log``).
3. Per mode, an untimed warm-up sends every item used once at concurrency 16 (CUDA graphs are
   captured the first time a shape is seen), then ``client_grpc.py --json-report`` runs once per
   ``--concurrency`` level with ``--requests-per-level`` requests (default max(26, 2 x level)),
   every request exactly ``round(rate x s)`` speech tokens long (``--fixed-output-seconds``: the
   same seeded per-item draws as offline_inference.py; 960 samples a token at 24 kHz). Streaming
   uses the decoupled ``cosyvoice2``; offline uses ``cosyvoice2_offline``, the non-decoupled twin
   run.sh serves next to it (or ``cosyvoice2`` itself when a variant sets DECOUPLED_MODE=False).
   The server's ``cosyserve_*`` Prometheus counters are read before and after each level's run.
4. The server is stopped.

Then each ``--offline-inference NAME:ARGS`` runs offline_inference.py on the same manifest, fixed
seconds and seed (ARGS are appended, so they can override). Without ``--manifest`` a synthetic
benchmark set like seed-tts' wenetspeech4tts split is written first: 26 prompts of 3-8 s of seeded
speech-like 16 kHz audio with Chinese prompt and target texts of plausible lengths.

Writes ``<out-dir>/bench.json``, ``bench.md`` (header: date, GPU, command line, git commit; the
level table; the offline_inference table; Triton's per-model compute time per level; the server-side
breakdown from the cosyserve_* counters per level; the targets)
and ``bench.png`` (needs matplotlib; ``--no-plot`` skips it). Exit status 1 when a level, a
variant or an offline run failed, or any request failed; missed targets alone do not fail.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import http.client
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from cosyserve import data  # noqa: E402
from cosyserve.data import FixedLength  # noqa: E402
from cosyserve.schedule import TOKEN_RATE  # noqa: E402
from cosyserve.serving.tritonserver import (MPS_CONTROL, TritonServer, TritonServerError, log_report,  # noqa: E402
                                            mps_daemon, start_server)

MODES = ("streaming", "offline")
WARMUP_CONCURRENCY = 16
MIN_REQUESTS_PER_LEVEL = 26  # the size of the reference's wenetspeech4tts benchmark split
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # variant/run names become directory names


class BenchError(RuntimeError):
    """A variant, level or offline run could not be measured (the message says why)."""


# --- command line ----------------------------------------------------------------------------


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, required=True,
                   help="bundle root (run.sh's MODELS_DIR): CosyVoice2-0.5B/ and cosyvoice2_llm/")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--fixed-output-seconds", type=float, nargs="+", default=[4.0, 10.0], metavar="S",
                   help="one value, or LO HI for a seeded uniform draw per item")
    p.add_argument("--tokens-per-second", type=float, default=float(TOKEN_RATE))
    p.add_argument("--seed", type=int, default=0, help="fixed-length draws and the synthetic manifest")
    p.add_argument("--requests-per-level", type=int,
                   help=f"requests per concurrency level (default: max({MIN_REQUESTS_PER_LEVEL}, 2 x concurrency))")
    p.add_argument("--manifest", type=Path, help="utt|prompt_text|prompt_wav|target_text lines (default: synthetic)")
    p.add_argument("--num-prompts", type=int, default=26, help="items of the synthetic manifest")
    p.add_argument("--variant", dest="variants", type=parse_variant, action="append",
                   help="NAME:KEY=VAL,... (repeatable; default: ours)")
    p.add_argument("--offline-inference", dest="offline_runs", type=parse_offline_run, action="append", default=[],
                   help='NAME:ARGS, e.g. "torch:--backend torch --batch-size 16 --cuda-graphs" (repeatable)')
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--server-start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup-passes", type=int, default=2,
                   help="untimed passes over the items per mode (CUDA graphs capture a shape the second time it is seen)")
    p.add_argument("--no-plot", action="store_true", help="do not draw bench.png (matplotlib not needed)")
    args = p.parse_args(argv)
    args.variants = args.variants or [Variant("ours")]
    # absolute: run.sh, the clients and offline_inference.py run from the repository root
    args.models_dir, args.out_dir = args.models_dir.resolve(), args.out_dir.resolve()
    args.manifest = args.manifest.resolve() if args.manifest else None
    if not (args.models_dir / "CosyVoice2-0.5B").is_dir() or not (args.models_dir / "cosyvoice2_llm").is_dir():
        p.error(f"--models-dir {args.models_dir} must hold CosyVoice2-0.5B/ and cosyvoice2_llm/ (run.sh stage 0)")
    if len({v.name for v in args.variants}) < len(args.variants):
        p.error("variant names must be unique")
    if len({r.name for r in args.offline_runs}) < len(args.offline_runs):
        p.error("offline run names must be unique")
    if min(args.concurrency) < 1 or (args.requests_per_level is not None and args.requests_per_level < 1):
        p.error("concurrency levels and --requests-per-level must be >= 1")
    try:
        FixedLength(args.tokens_per_second, tuple(args.fixed_output_seconds), args.seed)
    except ValueError as e:
        p.error(str(e))
    if any(v.mps for v in args.variants) and shutil.which(MPS_CONTROL) is None:
        p.error(f"a variant sets MPS=1 but {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's "
                "utilities); install it or drop MPS=1")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:  # now, not after hours of measuring
        p.error("bench.png needs matplotlib (pip install matplotlib, or the package's dev extra); or pass --no-plot")
    return args


def requests_per_level(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests_per_level or max(MIN_REQUESTS_PER_LEVEL, 2 * concurrency)


# --- synthetic benchmark set -------------------------------------------------------------------

# Common Chinese characters: the texts are random strings of them (meaningless, tokenizable).
CHARACTERS = ("的一是在不了有和人这中大为上个国我以要他时来用们生到"
              "作地于出就分对成会可也你能而子那得着下自之年过发后里"
              "如家多经么去法学都同现当没动面起看定天还进好小部其些"
              "主样理心她本前开但因只从想实日者意无力它与长把机十民"
              "第公此已工使情明性知全三又关点正业外将两高间由问很最"
              "重并物手应向头文")
PROMPT_SECONDS = (3.0, 8.0)
CHARACTERS_PER_SECOND = 4.5  # Mandarin read speech, about
TARGET_CHARACTERS = (18, 45)  # about 4-10 s of speech


def chinese_sentence(rng: random.Random, length: int) -> str:
    """``length`` characters with a comma every 5-12 and a full stop at the end."""
    text, clause = [], rng.randint(5, 12)
    for i in range(length):
        text.append(rng.choice(CHARACTERS))
        clause -= 1
        if clause == 0 and i < length - 1:
            text.append("，")
            clause = rng.randint(5, 12)
    return "".join(text) + "。"


def write_synthetic_manifest(out_dir: Path, count: int = 26, seed: int = 0) -> Path:
    """``count`` items like the wenetspeech4tts benchmark split, in ``out_dir/manifest.txt``.

    Prompts: 3-8 s of the bundle's speech-like test signal (voiced, not silent) as 16-bit wavs at
    16 kHz; prompt text about 4.5 characters a second of prompt; target texts of 18-45 characters.
    """
    import soundfile as sf

    from cosyserve.bundle import synthetic_prompt_wave

    if count < 1:
        raise BenchError(f"the synthetic manifest needs at least one prompt, got {count}")
    rng = random.Random(seed)
    (out_dir / "wavs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        seconds = round(rng.uniform(*PROMPT_SECONDS), 2)
        wav = f"wavs/prompt_{i:03d}.wav"
        sf.write(out_dir / wav, synthetic_prompt_wave(seconds, 16000, seed=seed * 1000 + i), 16000, subtype="PCM_16")
        prompt_text = chinese_sentence(rng, max(2, round(seconds * CHARACTERS_PER_SECOND)))
        target_text = chinese_sentence(rng, rng.randint(*TARGET_CHARACTERS))
        lines.append(f"bench_{i:03d}|{prompt_text}|{wav}|{target_text}\n")
    manifest = out_dir / "manifest.txt"
    manifest.write_text("".join(lines), encoding="utf-8")
    return manifest


# --- model repository, MPS, server --------------------------------------------------------------


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
    """``bash run.sh 2 2`` with the variant's overrides; output in ``variant_dir/run_sh.log``."""
    repo = variant_dir / "model_repo"
    env = {**os.environ, "MODELS_DIR": str(args.models_dir), "MODEL_REPO": str(repo), "OUT_DIR": str(variant_dir),
           "VENV": str(interpreter_venv(args.out_dir)), "PYTHON_BIN": sys.executable, **variant.env}
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


# --- levels -----------------------------------------------------------------------------------


def client_command(args: argparse.Namespace, model: str, mode: str, concurrency: int, requests: int,
                   manifest: Path, level_dir: Path) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "client_grpc.py"), "--server-addr", "localhost",
            "--server-port", str(args.grpc_port), "--model-name", model, "--mode", mode,
            "--num-tasks", str(concurrency), "--num-requests", str(requests), "--manifest-path", str(manifest),
            "--fixed-output-seconds", *map(str, args.fixed_output_seconds),
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


def model_group(name: str) -> str:
    """Triton model -> the part of the pipeline it is (BLS, LLM, token2wav, front-ends)."""
    if name.startswith("cosyvoice2"):
        return "bls"
    if name in ("llm", "tensorrt_llm"):
        return "llm"
    if name.startswith("token2wav"):
        return "token2wav"
    if name in ("audio_tokenizer", "speaker_embedding"):
        return "frontends"
    return name


def compute_by_group(triton_stats: dict, wall_s: float) -> dict[str, dict]:
    """Per pipeline part, from a level's Triton statistics: executions, inferences, mean queue
    time, compute time (input + infer + output), busy = compute / wall (instances busy on
    average), share = compute / compute of all parts but the BLS (the BLS's compute time includes
    the time it waits for the other models, so it has no share)."""
    groups: dict[str, dict] = {}
    for model in triton_stats.get("model_stats", []):
        stats = model.get("inference_stats", {})
        group = groups.setdefault(model_group(model["name"]), {"models": [], "executions": 0, "inferences": 0,
                                                                "queue_count": 0, "queue_ns": 0, "compute_ns": 0})
        group["models"].append(model["name"])
        group["executions"] += int(model.get("execution_count", 0))
        group["inferences"] += int(model.get("inference_count", 0))
        group["queue_count"] += int(stats.get("queue", {}).get("count", 0))
        group["queue_ns"] += int(stats.get("queue", {}).get("ns", 0))
        group["compute_ns"] += sum(int(stats.get(part, {}).get("ns", 0))
                                   for part in ("compute_input", "compute_infer", "compute_output"))
    pipeline_ns = sum(g["compute_ns"] for name, g in groups.items() if name != "bls")
    return {name: {"models": g["models"], "executions": g["executions"], "inferences": g["inferences"],
                   "queue_avg_ms": g["queue_ns"] / g["queue_count"] / 1e6 if g["queue_count"] else None,
                   "compute_s": g["compute_ns"] / 1e9,
                   "busy": g["compute_ns"] / 1e9 / wall_s if wall_s > 0 else None,
                   "share": g["compute_ns"] / pipeline_ns if name != "bls" and pipeline_ns else None}
            for name, g in groups.items()}


METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _labels_end(text: str) -> int | None:
    """The index just past the ``{...}`` label set ``text`` starts with (quoted label values may hold
    ``}``, commas, spaces and escaped quotes); None when it is not closed."""
    quoted = escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i + 1
    return None


def parse_prometheus(text: str) -> dict[str, float]:
    """The ``cosyserve_*`` samples of a Prometheus text page, each name's value summed over its label
    sets (a model's instances, models sharing a metric); other metrics, malformed lines and non-finite
    values are skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        name = METRIC_NAME.match(line)  # None for "# HELP/TYPE" and blank lines
        if name is None or not name.group().startswith("cosyserve_"):
            continue
        rest = line[name.end():]
        if rest.startswith("{"):
            end = _labels_end(rest)
            if end is None:
                continue
            rest = rest[end:]
        fields = rest.split()  # value [timestamp]
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            totals[name.group()] = totals.get(name.group(), 0.0) + value
    return totals


def scrape_metrics(port: int, host: str = "localhost", timeout: float = 5.0) -> dict[str, float]:
    """The server's ``cosyserve_*`` metrics (``parse_prometheus``); {} and a warning when the page
    cannot be read, so that a metrics hiccup costs the breakdown, not the benchmark."""
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
        print(f"warning: could not read {url}: {e}", file=sys.stderr, flush=True)
        return {}
    return parse_prometheus(text)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter (``*_total``) in both scrapes grew by; {} when either scrape is empty."""
    return {name: after[name] - before[name] for name in after if name.endswith("_total") and name in before}


def server_breakdown(row: dict) -> dict | None:
    """Where a level's server time went, from its counter deltas: busy = seconds of that work / the
    level's wall time; flow per call (rows, padding, ms); LLM decode steps (ms, rows). A figure is
    None when its counters are missing or a denominator is 0; the whole is None without counters."""
    counters = row.get("server_counters")
    if not counters:
        return None

    def counter(name: str) -> float | None:
        return counters.get(f"cosyserve_{name}_total")

    def ratio(numerator: float | None, denominator: float | None, scale: float = 1.0) -> float | None:
        return None if numerator is None or not denominator else scale * numerator / denominator

    def difference(minuend: float | None, *subtrahends: float | None) -> float | None:
        return None if minuend is None or None in subtrahends else minuend - sum(subtrahends)

    wall_s = row.get("wall_s")
    flow_busy = ratio(counter("token2wav_flow_seconds"), wall_s)
    hift_busy = ratio(counter("token2wav_hift_seconds"), wall_s)
    execute_busy = ratio(counter("token2wav_execute_seconds"), wall_s)
    decode_s = difference(counter("llm_engine_busy_seconds"), counter("llm_prefill_seconds"))
    return {
        "flow_busy": flow_busy, "hift_busy": hift_busy, "token2wav_execute_busy": execute_busy,
        "token2wav_other_busy": difference(execute_busy, flow_busy, hift_busy),
        "flow_rows_per_call": ratio(counter("token2wav_flow_rows"), counter("token2wav_flow_calls")),
        "flow_padding": difference(1.0, ratio(counter("token2wav_flow_frames"),
                                              counter("token2wav_flow_padded_frames"))),
        "flow_ms_per_call": ratio(counter("token2wav_flow_seconds"), counter("token2wav_flow_calls"), 1000.0),
        "llm_busy": ratio(counter("llm_engine_busy_seconds"), wall_s),
        "llm_step_ms": ratio(decode_s, counter("llm_decode_steps"), 1000.0),
        "llm_rows_per_step": ratio(counter("llm_decode_rows"), counter("llm_decode_steps")),
        "llm_tokens_per_s": ratio(counter("llm_generated_tokens"), wall_s),
    }


def level_row(variant: str, mode: str, concurrency: int, report: dict) -> dict:
    """The numbers of one level, flat (JSON and table)."""
    def ms(section: str, key: str) -> float | None:
        return report.get(section, {}).get(key)

    completed = report["requests"] - report["failed"]
    requested = report.get("requested_speech_tokens") or {}
    ok_ids = {r["id"] for r in report["per_request"] if r["error"] is None}
    underruns = report.get("underruns", {})
    return {
        "variant": variant, "mode": mode, "concurrency": concurrency, "model": report["model_name"],
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


def run_variant(args: argparse.Namespace, variant: Variant, manifest: Path, items_used: int) -> tuple[list[dict], dict]:
    """Build, serve and measure one variant; (level rows, variant facts)."""
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
        instances = repo.bls_instances.get(repo.models[mode], 0)
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
                rows = measure_levels(args, variant, repo, server, manifest, items_used, variant_dir)
            finally:
                server.stop()
    except TritonServerError as e:  # the MPS daemon or the server did not start
        raise BenchError(f"variant {variant.name}: {e}") from None
    return rows, facts


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
            level_dir = variant_dir / f"{mode}_c{concurrency}"
            requests = requests_per_level(args, concurrency)
            command = client_command(args, model, mode, concurrency, requests, manifest, level_dir)
            try:
                check_alive(server)
                before = scrape_metrics(args.metrics_port)
                report = run_client(command, level_dir)
                after = scrape_metrics(args.metrics_port)
                row = level_row(variant.name, mode, concurrency, report)
                row["server_counters"] = counter_deltas(before, after)
                row["server_breakdown"] = server_breakdown(row)
            except BenchError as e:
                row = {"variant": variant.name, "mode": mode, "concurrency": concurrency, "model": model,
                       "requests": requests, "failed": requests, "error": str(e)}
            row["report"] = str(level_dir / "report.json")
            rows.append(row)
            print(f"[{variant.name}] {summary_line(row)}", flush=True)
    return rows


def check_alive(server: TritonServer) -> None:
    if server.process.poll() is not None:
        raise BenchError(f"tritonserver exited with code {server.process.returncode}\n{log_report(server.log_file)}")


def summary_line(row: dict) -> str:
    if row.get("error"):
        return f"{row['mode']} x{row['concurrency']}: ERROR {row['error'].splitlines()[0]}"
    text = (f"{row['mode']} x{row['concurrency']}: {row['requests']} requests, {row['failed']} failed, "
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
            "frontend_time_s", "llm_time_s", "token2wav_time_s", "total_time_s")
    row.update({k: report.get(k) for k in keys})
    print(f"[offline_inference {run.name}] RTF {fmt(row['rtf'], 4)} ({row['items']} items, {fmt(row['audio_s'], 2)} s "
          f"of audio)", flush=True)
    return row


# --- targets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    text: str
    check: Callable[[list[dict]], tuple[bool | None, str]]  # a variant's levels -> (passed, measured)


def _level(rows: list[dict], mode: str, concurrency: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["concurrency"] == concurrency and not r.get("error")),
                None)


def _smooth(row: dict) -> bool:
    """Every request served, and no stream stalled."""
    return row["failed"] == 0 and row.get("requests_with_underrun") == 0


def _first_chunk_p50_at_1(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "streaming", 1)
    if row is None or row["first_chunk_p50_ms"] is None:
        return None, "streaming at concurrency 1 not measured"
    return row["first_chunk_p50_ms"] <= 60 and row["failed"] == 0, f"p50 {row['first_chunk_p50_ms']:.1f} ms"


def _p95_at_16(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "streaming", 16)
    if row is None or row["first_chunk_p95_ms"] is None:
        return None, "streaming at concurrency 16 not measured"
    return (row["first_chunk_p95_ms"] <= 300 and _smooth(row),
            f"p95 {row['first_chunk_p95_ms']:.1f} ms, {row['requests_with_underrun']} requests with underruns, "
            f"{row['failed']} failed")


def _throughput(rows: list[dict]) -> tuple[bool | None, str]:
    streaming = [r for r in rows if r["mode"] == "streaming" and not r.get("error")]
    if not streaming:
        return None, "streaming not measured"
    smooth = [r for r in streaming if _smooth(r)]
    if not smooth:
        return False, "every streaming level had underruns or failures"
    best = max(smooth, key=lambda r: r["req_per_s"] or 0.0)
    return best["req_per_s"] >= 16, f"{best['req_per_s']:.2f} req/s at concurrency {best['concurrency']}"


def _streams_64(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "streaming", 64)
    if row is None:
        return None, "streaming at concurrency 64 not measured"
    return _smooth(row), f"{row['requests_with_underrun']} requests with underruns, {row['failed']} failed"


def _offline_rtf_at_16(rows: list[dict]) -> tuple[bool | None, str]:
    row = _level(rows, "offline", 16)
    if row is None or row["rtf"] is None:
        return None, "offline mode at concurrency 16 not measured"
    return row["rtf"] <= 0.01 and row["failed"] == 0, f"RTF {row['rtf']:.4f}, {row['failed']} failed"


SERVER_TARGETS = (
    Target("first chunk p50 <= 60 ms at concurrency 1", _first_chunk_p50_at_1),
    Target("concurrency 16: first chunk p95 <= 300 ms, zero underruns", _p95_at_16),
    Target(">= 16 req/s with zero underruns at a fixed concurrency", _throughput),
    Target("64 concurrent streams without underruns", _streams_64),
    Target("offline mode RTF <= 0.01 at concurrency 16", _offline_rtf_at_16),
)
OFFLINE_INFERENCE_TARGET = "offline_inference RTF <= 0.006 at batch 16"


def check_targets(levels: list[dict], variants: list[dict], offline_rows: list[dict]) -> list[dict]:
    results = []
    for target in SERVER_TARGETS:
        for variant in variants:
            passed, measured = target.check([r for r in levels if r["variant"] == variant["name"]])
            results.append({"target": target.text, "subject": variant["name"], "passed": passed, "measured": measured})
    batch16 = [r for r in offline_rows if not r.get("error") and r.get("batch_size") == 16]
    for row in batch16:
        results.append({"target": OFFLINE_INFERENCE_TARGET, "subject": row["name"], "passed": row["rtf"] <= 0.006,
                        "measured": f"RTF {row['rtf']:.4f}"})
    if not batch16:
        results.append({"target": OFFLINE_INFERENCE_TARGET, "subject": "-", "passed": None,
                        "measured": "no offline_inference run at batch 16"})
    return results


def verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "MISS", None: "NOT RUN"}[passed]


# --- output -----------------------------------------------------------------------------------


def fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f} %"


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


LEVEL_COLUMNS = ["variant", "mode", "concurrency", "requests", "failed", "req/s", "first chunk p50 ms", "p95 ms",
                 "p99 ms", "latency p50 ms", "p95 ms", "RTF", "requests with underruns", "underrun stall s"]


def level_table(levels: list[dict]) -> str:
    rows = []
    for r in levels:
        if r.get("error"):
            rows.append([r["variant"], r["mode"], str(r["concurrency"]), str(r["requests"]), "ERROR"]
                        + ["n/a"] * (len(LEVEL_COLUMNS) - 5))
            continue
        streaming = r["mode"] == "streaming"
        rows.append([r["variant"], r["mode"], str(r["concurrency"]), str(r["requests"]), str(r["failed"]),
                     fmt(r["req_per_s"], 2), fmt(r["first_chunk_p50_ms"]), fmt(r["first_chunk_p95_ms"]),
                     fmt(r["first_chunk_p99_ms"]), fmt(r["latency_p50_ms"]), fmt(r["latency_p95_ms"]),
                     fmt(r["rtf"], 4), str(r["requests_with_underrun"]) if streaming else "n/a",
                     fmt(r["underrun_stall_s"], 2) if streaming else "n/a"])
    return table(LEVEL_COLUMNS, rows)


def offline_table(offline_rows: list[dict]) -> str:
    rows = [[r["name"], "ERROR", "", "", "", "", "", ""] if r.get("error") else
            [r["name"], fmt(r["rtf"], 4), fmt(r["llm_time_s"], 3), fmt(r["token2wav_time_s"], 3),
             fmt(r["total_time_s"], 3), fmt(r["audio_s"], 2), str(r["batch_size"]), f"{r['backend']} on {r['device']}"]
            for r in offline_rows]
    return table(["offline_inference", "RTF", "llm_time s", "token2wav_time s", "total_time s", "audio s", "batch",
                  "backend"], rows)


GROUP_ORDER = ("bls", "llm", "token2wav", "frontends")


def compute_table(levels: list[dict]) -> str:
    rows = []
    for r in levels:
        groups = r.get("triton_compute") or {}
        for name in sorted(groups, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g)):
            g = groups[name]
            rows.append([r["variant"], r["mode"], str(r["concurrency"]), f"{name} ({', '.join(g['models'])})",
                         str(g["executions"]), fmt(g["inferences"] / g["executions"] if g["executions"] else None, 2),
                         fmt(g["queue_avg_ms"]), fmt(g["compute_s"], 3), fmt(g["busy"], 2),
                         percent(g["share"])])
    return table(["variant", "mode", "concurrency", "model", "executions", "avg batch", "queue avg ms", "compute s",
                  "busy", "share"], rows)


def breakdown_table(levels: list[dict]) -> str:
    """The levels' ``server_breakdown`` figures; "" when no level has one (no metrics were read)."""
    rows = []
    for r in levels:
        b = r.get("server_breakdown")
        if b:
            rows.append([r["variant"], r["mode"], str(r["concurrency"]), percent(b["flow_busy"]),
                         percent(b["hift_busy"]), percent(b["token2wav_other_busy"]), fmt(b["flow_ms_per_call"]),
                         fmt(b["flow_rows_per_call"], 2), percent(b["flow_padding"]), percent(b["llm_busy"]),
                         fmt(b["llm_step_ms"], 2), fmt(b["llm_rows_per_step"], 2), fmt(b["llm_tokens_per_s"], 0)])
    if not rows:
        return ""
    return table(["variant", "mode", "concurrency", "flow busy", "HiFT busy", "token2wav other busy", "flow ms/call",
                  "flow rows/call", "flow padding", "LLM busy", "LLM step ms", "LLM rows/step", "LLM tokens/s"], rows)


def targets_text(results: list[dict]) -> str:
    return "".join(f"- {verdict(t['passed'])}: {t['target']} [{t['subject']}]: {t['measured']}\n" for t in results)


def git_commit() -> str:
    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *argv], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode:
        return "unknown (not a git checkout)"
    dirty = git("diff", "--quiet", "HEAD", "--").returncode != 0
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def gpu_name() -> str:
    """torch's name for GPU 0, or "cpu"; asked in a child process so that this one holds no CUDA context."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"unknown ({done.stderr.strip()[-200:]})"


def markdown(bench: dict) -> str:
    h = bench["header"]
    lines = [
        "# Triton benchmark (issue 7)", "",
        f"* date: {h['date']}", f"* GPU: {h['gpu']}", f"* command: `{h['command']}`",
        f"* git commit: {h['git_commit']}",
        f"* workload: {h['manifest']} ({h['items']} items), fixed output seconds {h['fixed_output_seconds']} at "
        f"{h['tokens_per_second']:g} tokens/s (seed {h['seed']}), requests per level {h['requests_per_level']}, "
        f"warm-up: every item used {h.get('warmup_passes', 1)} time(s) at concurrency {WARMUP_CONCURRENCY} per mode "
        "(untimed)",
    ]
    for v in bench["variants"]:
        overrides = ", ".join(f"{k}={val}" for k, val in v["overrides"].items()) or "none"
        state = f"ERROR: {v['error'].splitlines()[0]}" if v.get("error") else (
            "BLS instances " + ", ".join(f"{m} {n}" for m, n in v["bls_instances"].items())
            + f"; server start {fmt(v.get('server_start_s'))} s")
        lines.append(f"* variant `{v['name']}`: overrides {overrides}{', under CUDA MPS' if v['mps'] else ''}; {state}")
    lines += ["", "## Concurrency levels", "", level_table(bench["levels"]).rstrip()]
    if bench["offline_inference"]:
        lines += ["", "## offline_inference.py", "", offline_table(bench["offline_inference"]).rstrip()]
    lines += ["", "## Triton compute time per level", "",
              "busy = compute time / wall time of the level (instances busy on average); share = compute time / "
              "compute time of all models but the BLS, whose compute time includes its waits for the others. The "
              "llm model hands each request to its engine thread, so its compute time is the submission only.", "",
              compute_table(bench["levels"]).rstrip()]
    breakdown = breakdown_table(bench["levels"])
    if breakdown:
        lines += ["", "## Server-side breakdown (Prometheus counters, per level)", "",
                  "busy = seconds of that work / wall time of the level; flow and HiFT are GPU time measured with "
                  "CUDA events, token2wav other = token2wav's execute wall time minus both (host work and waits); "
                  "LLM busy is the wall time of the engine's steps. Under MPS the LLM and token2wav overlap, so the "
                  "busy figures may sum past 100 %.", "", breakdown.rstrip()]
    lines += ["", "## Targets", "", targets_text(bench["targets"]).rstrip()]
    return "\n".join(lines) + "\n"


def plot(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ok = [r for r in levels if not r.get("error")]
    fig, (first_ax, underrun_ax, rate_ax) = plt.subplots(1, 3, figsize=(17, 4.8))
    for variant in dict.fromkeys(r["variant"] for r in ok):
        streaming = sorted((r for r in ok if r["variant"] == variant and r["mode"] == "streaming"),
                           key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in streaming]
        if streaming:
            line, = first_ax.plot(x, [r["first_chunk_p50_ms"] for r in streaming], "o-", label=f"{variant} p50")
            first_ax.plot(x, [r["first_chunk_p95_ms"] for r in streaming], "s--", color=line.get_color(),
                          label=f"{variant} p95")
            underrun_ax.plot(x, [r["requests_with_underrun"] for r in streaming], "o-", label=variant)
        for mode, style in (("streaming", "o-"), ("offline", "s--")):
            rows = sorted((r for r in ok if r["variant"] == variant and r["mode"] == mode),
                          key=lambda r: r["concurrency"])
            if rows:
                rate_ax.plot([r["concurrency"] for r in rows], [r["req_per_s"] for r in rows], style,
                             label=f"{variant} {mode}")
    titles = (("first chunk latency (streaming)", "ms"), ("requests with underruns (streaming)", "requests"),
              ("throughput", "requests / s"))
    concurrencies = sorted({r["concurrency"] for r in ok})
    for ax, (title, unit) in zip((first_ax, underrun_ax, rate_ax), titles):
        ax.set_xscale("log", base=2)
        if concurrencies:
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_title(title)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    underrun_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = args.manifest or write_synthetic_manifest(args.out_dir / "manifest", args.num_prompts, args.seed)
    items = data.load_manifest(manifest)
    # the items the levels send: warmed up once each
    items_used = min(len(items), max(requests_per_level(args, c) for c in args.concurrency))
    header = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": gpu_name(), "command": shlex.join([sys.executable, *sys.argv] if argv is None else
                                                 [sys.executable, __file__, *argv]),
        "git_commit": git_commit(), "manifest": str(manifest), "items": len(items),
        "fixed_output_seconds": args.fixed_output_seconds, "tokens_per_second": args.tokens_per_second,
        "seed": args.seed, "warmup_passes": args.warmup_passes, "requests_per_level": args.requests_per_level or
        f"max({MIN_REQUESTS_PER_LEVEL}, 2 x concurrency)",
    }
    levels, variants = [], []
    for variant in args.variants:
        try:
            rows, facts = run_variant(args, variant, manifest, items_used)
        except BenchError as e:
            print(f"[{variant.name}] ERROR: {e}", file=sys.stderr, flush=True)
            rows, facts = [], {"name": variant.name, "overrides": variant.env, "mps": variant.mps, "error": str(e)}
        levels += rows
        variants.append(facts)
    offline_rows = [run_offline_inference(args, run, manifest) for run in args.offline_runs]
    bench = {"header": header, "variants": variants, "levels": levels, "offline_inference": offline_rows,
             "targets": check_targets(levels, variants, offline_rows)}
    for row in levels:
        if not row.get("error") and abs(row["audio_s"] - row["requested_audio_s"]) > 1e-6:
            print(f"warning: {row['variant']} {row['mode']} x{row['concurrency']}: {row['audio_s']:.3f} s of audio "
                  f"for {row['requested_audio_s']:.3f} s requested", file=sys.stderr)
    (args.out_dir / "bench.json").write_text(json.dumps(bench, indent=2, ensure_ascii=False), encoding="utf-8")
    text = markdown(bench)
    (args.out_dir / "bench.md").write_text(text, encoding="utf-8")
    print(text)
    if args.no_plot:
        print("note: --no-plot: bench.png not drawn")
    else:
        plot(levels, args.out_dir / "bench.png")
    print(f"wrote bench.json, bench.md{'' if args.no_plot else ', bench.png'} to {args.out_dir}")
    failed = (any(v.get("error") for v in variants) or any(r.get("error") or r["failed"] for r in levels)
              or any(r.get("error") for r in offline_rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
