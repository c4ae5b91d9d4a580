"""scripts/bench_triton.py and cosyserve.bench: the synthetic manifest, arguments, repository reading, Triton compute
shares, the Prometheus breakdown and target checks without a server; then the whole driver on a
real CPU server (tiny bundle)."""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyserve import data
from cosyserve.audio.io import MAX_PROMPT_SECONDS, MIN_PROMPT_SECONDS
from cosyserve.bench import breakdown, openloop, prometheus, report, runner, targets, workload
from cosyserve.data import FixedLength

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest_triton import free_ports  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_driver():
    spec = importlib.util.spec_from_file_location("bench_triton", REPO_ROOT / "scripts" / "bench_triton.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_driver()


# --- without a server -------------------------------------------------------------------------


def test_synthetic_manifest_is_a_valid_seeded_benchmark_set(tmp_path):
    manifest = workload.write_synthetic_manifest(tmp_path / "a", count=26, seed=0)
    items = data.load_manifest(manifest)
    assert len(items) == 26 and len({i.reference_audio for i in items}) == 26
    for item in items:
        info = sf.info(item.reference_audio)
        assert info.samplerate == 16000 and info.channels == 1
        assert 3.0 <= info.duration <= 8.0
        assert MIN_PROMPT_SECONDS <= info.duration <= MAX_PROMPT_SECONDS
        wav = data.load_reference_audio(item.reference_audio)  # the server's checks: rate, length, not silent
        assert wav.size == info.frames
        # about 4.5 characters a second of prompt; targets of 18-45 characters (+ punctuation)
        prompt_chars = sum(ch in workload.CHARACTERS for ch in item.reference_text)
        assert abs(prompt_chars - 4.5 * info.duration) <= 1
        target_chars = sum(ch in workload.CHARACTERS for ch in item.target_text)
        assert 18 <= target_chars <= 45 and item.target_text.endswith("。")
    durations = [sf.info(i.reference_audio).duration for i in items]
    assert max(durations) - min(durations) > 2.0  # drawn, not constant
    again = workload.write_synthetic_manifest(tmp_path / "b", count=26, seed=0)
    assert again.read_text(encoding="utf-8") == manifest.read_text(encoding="utf-8")
    np.testing.assert_array_equal(sf.read(tmp_path / "a" / "wavs" / "prompt_005.wav")[0],
                                  sf.read(tmp_path / "b" / "wavs" / "prompt_005.wav")[0])
    other = workload.write_synthetic_manifest(tmp_path / "c", count=26, seed=1)
    assert other.read_text(encoding="utf-8") != manifest.read_text(encoding="utf-8")


def test_variant_and_offline_run_parsing():
    assert runner.parse_variant("ours") == runner.Variant("ours", {}, False)
    variant = runner.parse_variant("mps16:BLS_INSTANCE_NUM=16,TOKEN2WAV_CUDA_GRAPHS=false,MPS=1")
    assert variant == runner.Variant("mps16", {"BLS_INSTANCE_NUM": "16", "TOKEN2WAV_CUDA_GRAPHS": "false"}, True)
    for bad in ("a b:X=1", "v:X", "v:1X=2", "v:MPS=yes", ":X=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            runner.parse_variant(bad)
    run = runner.parse_offline_run("torch:--backend torch --batch-size 16 --cuda-graphs")
    assert run == runner.OfflineRun("torch", ["--backend", "torch", "--batch-size", "16", "--cuda-graphs"])


@pytest.mark.parametrize("extra, message", [
    (["--variant", "a", "--variant", "a"], "variant names must be unique"),
    (["--concurrency", "0"], "must be >= 1"),
    (["--fixed-output-seconds", "5", "4"], "lo <= hi"),
    (["--variant", "m:MPS=1"], "nvidia-cuda-mps-control is not on PATH"),
])
def test_argument_errors(extra, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        bench.parse_args(["--models-dir", str(_models_dir(tmp_path)), "--out-dir", str(tmp_path), "--no-plot", *extra])
    assert message in capsys.readouterr().err


def _models_dir(tmp_path: Path) -> Path:
    for part in ("CosyVoice2-0.5B", "cosyvoice2_llm"):
        (tmp_path / "models" / part).mkdir(parents=True, exist_ok=True)
    return tmp_path / "models"


def test_models_dir_is_checked(capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--models-dir", str(tmp_path), "--out-dir", str(tmp_path), "--no-plot"])
    assert "must hold CosyVoice2-0.5B/ and cosyvoice2_llm/" in capsys.readouterr().err


def test_missing_matplotlib_fails_before_benchmarking(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    models = str(_models_dir(tmp_path))
    with pytest.raises(SystemExit):
        bench.parse_args(["--models-dir", models, "--out-dir", str(tmp_path)])
    assert "bench.png needs matplotlib" in capsys.readouterr().err
    assert bench.parse_args(["--models-dir", models, "--out-dir", str(tmp_path), "--no-plot"]).no_plot


def test_requests_per_level_default():
    args = argparse.Namespace(requests_per_level=None)
    assert [runner.requests_per_level(args, c) for c in (1, 16, 32, 64)] == [26, 32, 64, 128]
    assert runner.requests_per_level(argparse.Namespace(requests_per_level=5), 64) == 5


def _config(repo: Path, name: str, decoupled: str, count: int) -> None:
    (repo / name).mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nmodel_transaction_policy {{\n  decoupled: {decoupled}\n}}\n'
        f"instance_group [\n  {{ count: {count}, kind: KIND_CPU }}\n]\n")


def test_read_repository_finds_the_model_of_each_mode(tmp_path):
    _config(tmp_path / "twin", "cosyvoice2", "True", 4)
    _config(tmp_path / "twin", "cosyvoice2_offline", "False", 16)
    twin = runner.read_repository(tmp_path / "twin")
    assert twin.models == {"streaming": "cosyvoice2", "offline": "cosyvoice2_offline"}
    assert twin.bls_instances == {"cosyvoice2": 4, "cosyvoice2_offline": 16}
    _config(tmp_path / "offline", "cosyvoice2", "False", 2)
    assert runner.read_repository(tmp_path / "offline").models == {"streaming": None, "offline": "cosyvoice2"}
    with pytest.raises(runner.BenchError, match="no cosyvoice2 model"):
        runner.read_repository(tmp_path / "empty")


def test_compute_by_group():
    def model(name, ns, queue_ns, executions):
        return {"name": name, "inference_count": executions * 2, "execution_count": executions,
                "inference_stats": {"queue": {"count": executions, "ns": queue_ns},
                                    "compute_input": {"count": executions, "ns": ns // 4},
                                    "compute_infer": {"count": executions, "ns": ns // 2},
                                    "compute_output": {"count": executions, "ns": ns // 4}}}

    stats = {"model_stats": [model("cosyvoice2", 8_000_000_000, 4_000_000, 4), model("llm", 1_000_000_000, 0, 4),
                             model("token2wav", 2_000_000_000, 2_000_000, 2),
                             model("audio_tokenizer", 500_000_000, 0, 1),
                             model("speaker_embedding", 500_000_000, 0, 1)]}
    groups = breakdown.compute_by_group(stats, wall_s=4.0)
    assert set(groups) == {"bls", "llm", "token2wav", "frontends"}
    assert groups["bls"]["share"] is None and groups["bls"]["busy"] == pytest.approx(2.0)
    assert groups["bls"]["queue_avg_ms"] == pytest.approx(1.0)
    assert groups["token2wav"]["share"] == pytest.approx(0.5) and groups["token2wav"]["compute_s"] == pytest.approx(2.0)
    assert groups["frontends"]["models"] == ["audio_tokenizer", "speaker_embedding"]
    assert groups["frontends"]["share"] == pytest.approx(0.25) and groups["frontends"]["executions"] == 2
    assert groups["llm"]["inferences"] == 8


METRICS_PAGE = """\
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="token2wav",version="1"} 42
# HELP cosyserve_token2wav_flow_seconds_total flow GPU seconds
# TYPE cosyserve_token2wav_flow_seconds_total counter
cosyserve_token2wav_flow_seconds_total{model="token2wav",version="1"} 1.5
cosyserve_token2wav_flow_seconds_total{model="token2wav_b",note="a, b } c",version="1"} 0.25

cosyserve_llm_generated_tokens_total 1e+06
cosyserve_llm_decode_steps_total{model="llm",q="say \\"hi\\", }"} 7 1712345678000
cosyserve_llm_prefill_seconds_total{model="llm"} NaN
cosyserve_llm_engine_busy_seconds_total{model="llm"} +Inf
cosyserve_token2wav_open_streams{model="token2wav"} -2
"""


def test_parse_prometheus_sums_cosyserve_samples_over_label_sets():
    assert prometheus.parse_prometheus(METRICS_PAGE) == {
        "cosyserve_token2wav_flow_seconds_total": 1.75,  # two label sets, one with a quoted comma and brace
        "cosyserve_llm_generated_tokens_total": 1e6,  # no labels
        "cosyserve_llm_decode_steps_total": 7.0,  # escaped quotes, and a timestamp after the value
        "cosyserve_token2wav_open_streams": -2.0,
    }  # nv_* ignored, NaN and +Inf skipped
    assert prometheus.parse_prometheus("") == {}
    assert prometheus.parse_prometheus('cosyserve_x_total{model="unclosed 3\ncosyserve_y_total\n') == {}


def test_counter_deltas():
    before = {"cosyserve_a_total": 1.0, "cosyserve_b_total": 2.0, "cosyserve_open_streams": 3.0}
    after = {"cosyserve_a_total": 4.5, "cosyserve_b_total": 2.0, "cosyserve_open_streams": 1.0,
             "cosyserve_new_total": 9.0}
    assert prometheus.counter_deltas(before, after) == {"cosyserve_a_total": 3.5, "cosyserve_b_total": 0.0}
    assert prometheus.counter_deltas({}, after) == {} and prometheus.counter_deltas(before, {}) == {}


COUNTERS = {
    "cosyserve_token2wav_flow_seconds_total": 2.0, "cosyserve_token2wav_hift_seconds_total": 0.5,
    "cosyserve_token2wav_execute_seconds_total": 3.0, "cosyserve_token2wav_flow_calls_total": 40.0,
    "cosyserve_token2wav_flow_rows_total": 160.0, "cosyserve_token2wav_flow_frames_total": 750.0,
    "cosyserve_token2wav_flow_padded_frames_total": 1000.0, "cosyserve_llm_engine_busy_seconds_total": 3.2,
    "cosyserve_llm_prefill_seconds_total": 0.2, "cosyserve_llm_decode_steps_total": 200.0,
    "cosyserve_llm_decode_rows_total": 1200.0, "cosyserve_llm_generated_tokens_total": 1250.0,
}


def test_server_breakdown():
    b = breakdown.server_breakdown({"wall_s": 4.0, "server_counters": COUNTERS})
    assert b == pytest.approx({
        "flow_busy": 0.5, "hift_busy": 0.125, "token2wav_execute_busy": 0.75, "token2wav_other_busy": 0.125,
        "flow_rows_per_call": 4.0, "flow_padding": 0.25, "flow_ms_per_call": 50.0, "llm_busy": 0.8,
        "llm_step_ms": 15.0, "llm_rows_per_step": 6.0, "llm_tokens_per_s": 312.5})
    # an LLM-only server (no token2wav counters), and no flow calls in the level
    llm_only = {k: v for k, v in COUNTERS.items() if "token2wav" not in k}
    b = breakdown.server_breakdown({"wall_s": 4.0, "server_counters": {**llm_only,
                                                                   "cosyserve_token2wav_flow_calls_total": 0.0}})
    assert b["llm_step_ms"] == pytest.approx(15.0) and b["llm_busy"] == pytest.approx(0.8)
    for key in ("flow_busy", "hift_busy", "token2wav_execute_busy", "token2wav_other_busy", "flow_rows_per_call",
                "flow_padding", "flow_ms_per_call"):
        assert b[key] is None, key
    no_prefill = {k: v for k, v in COUNTERS.items() if k != "cosyserve_llm_prefill_seconds_total"}
    assert breakdown.server_breakdown({"wall_s": 4.0, "server_counters": no_prefill})["llm_step_ms"] is None
    zero_wall = breakdown.server_breakdown({"wall_s": 0.0, "server_counters": COUNTERS})
    assert all(zero_wall[k] is None for k in ("flow_busy", "hift_busy", "token2wav_execute_busy",
                                               "token2wav_other_busy", "llm_busy", "llm_tokens_per_s"))
    assert zero_wall["flow_rows_per_call"] == pytest.approx(4.0)  # not a share of the wall time
    assert breakdown.server_breakdown({"wall_s": 4.0, "server_counters": {}}) is None
    assert breakdown.server_breakdown({"error": "client crashed"}) is None


def test_breakdown_table():
    row = {"variant": "v", "mode": "streaming", "concurrency": 16, "wall_s": 4.0, "server_counters": COUNTERS}
    row["server_breakdown"] = breakdown.server_breakdown(row)
    text = report.breakdown_table([row, {"variant": "v", "mode": "offline", "concurrency": 1, "error": "boom"}])
    lines = text.splitlines()
    assert lines[0] == ("| variant | mode | concurrency | flow busy | HiFT busy | token2wav other busy | flow ms/call "
                        "| flow rows/call | flow padding | LLM busy | LLM step ms | LLM rows/step | LLM tokens/s |")
    assert lines[2:] == ["| v | streaming | 16 | 50 % | 12 % | 12 % | 50.0 | 4.00 | 25 % | 80 % | 15.00 | 6.00 | 312 |"]
    assert report.breakdown_table([{**row, "server_breakdown": None}]) == ""
    assert report.breakdown_table([]) == ""


def _serve(page: bytes, status: int = 200):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status", [200, 500])
def test_scrape_metrics(status, capsys):
    server = _serve(METRICS_PAGE.encode(), status)
    try:
        values = prometheus.scrape_metrics(server.server_address[1], host="127.0.0.1")
    finally:
        server.shutdown()
        server.server_close()
    if status == 200:
        assert values == prometheus.parse_prometheus(METRICS_PAGE) and values["cosyserve_llm_decode_steps_total"] == 7.0
        assert capsys.readouterr().err == ""
    else:
        assert values == {}
        assert capsys.readouterr().err.count("warning: could not read") == 1


def test_scrape_metrics_of_a_closed_port(capsys):
    port, = free_ports(1)
    assert prometheus.scrape_metrics(port, host="127.0.0.1", timeout=2.0) == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"warning: could not read http://127.0.0.1:{port}/metrics" in err


def test_measure_levels_scrapes_around_measured_levels_only(monkeypatch, tmp_path):
    events = []
    scrapes = iter([{"cosyserve_token2wav_flow_seconds_total": 1.0, "cosyserve_llm_generated_tokens_total": 10.0},
                    {"cosyserve_token2wav_flow_seconds_total": 3.0, "cosyserve_llm_generated_tokens_total": 510.0,
                     "cosyserve_llm_active_requests": 2.0},
                    {}, {"cosyserve_token2wav_flow_seconds_total": 5.0}])  # level 2: the first scrape failed

    def scrape(port):
        events.append(("scrape", port))
        return next(scrapes)

    def client(command, level_dir):
        events.append(("client", level_dir.name))
        return {"model_name": "cosyvoice2", "requests": 2, "failed": 0, "wall_s": 4.0, "audio_s": 8.0, "rtf": 0.5,
                "per_request": [{"id": "a", "error": None}, {"id": "b", "error": None}]}

    monkeypatch.setattr(runner, "scrape_metrics", scrape)
    monkeypatch.setattr(runner, "run_client", client)
    monkeypatch.setattr(runner, "check_alive", lambda server: None)
    args = argparse.Namespace(modes=["streaming"], warmup_passes=1, concurrency=[1, 2], requests_per_level=2,
                              metrics_port=9102, grpc_port=9101, fixed_output_seconds=[1.0], tokens_per_second=25.0,
                              seed=0, request_timeout=10.0)
    repo = runner.Repository(tmp_path, {"streaming": "cosyvoice2", "offline": None}, {})
    rows = runner.measure_levels(args, runner.Variant("v"), repo, None, tmp_path / "m.txt", 2, tmp_path)
    assert events == [("client", "warmup_streaming_0"), ("scrape", 9102), ("client", "streaming_c1"),
                      ("scrape", 9102), ("scrape", 9102), ("client", "streaming_c2"), ("scrape", 9102)]
    assert rows[0]["server_counters"] == {"cosyserve_token2wav_flow_seconds_total": 2.0,
                                          "cosyserve_llm_generated_tokens_total": 500.0}
    assert rows[0]["server_breakdown"]["flow_busy"] == pytest.approx(0.5)
    assert rows[0]["server_breakdown"]["llm_tokens_per_s"] == pytest.approx(125.0)
    assert rows[0]["server_breakdown"]["hift_busy"] is None
    assert rows[1]["server_counters"] == {} and rows[1]["server_breakdown"] is None


def _row(mode, concurrency, **numbers):
    row = {"variant": "v", "mode": mode, "concurrency": concurrency, "failed": 0, "rtf": 0.5, "req_per_s": 1.0,
           "first_chunk_p50_ms": 50.0, "first_chunk_p95_ms": 250.0, "requests_with_underrun": 0}
    return {**row, **numbers}


def test_targets():
    levels = [_row("streaming", 1, first_chunk_p50_ms=59.0), _row("streaming", 16, req_per_s=17.0),
              _row("streaming", 32, req_per_s=20.0, requests_with_underrun=1),
              _row("streaming", 64, failed=1), _row("offline", 16, rtf=0.012, requests_with_underrun=None)]
    offline_runs = [{"name": "torch", "batch_size": 16, "rtf": 0.005}, {"name": "hf", "batch_size": 16, "rtf": 0.7},
                    {"name": "b8", "batch_size": 8, "rtf": 0.001}, {"name": "bad", "error": "boom"}]
    results = targets.check_targets(levels, [{"name": "v"}], offline_runs)
    verdicts = [(targets.verdict(r["passed"]), r["subject"]) for r in results]
    assert verdicts == [("PASS", "v"), ("PASS", "v"), ("PASS", "v"), ("MISS", "v"), ("MISS", "v"),
                        ("PASS", "torch"), ("MISS", "hf")]
    assert results[2]["measured"] == "17.00 req/s at concurrency 16"  # 32 is faster but had an underrun
    slow = targets.check_targets([_row("streaming", 1, first_chunk_p50_ms=61.0)], [{"name": "v"}], [])
    assert [targets.verdict(r["passed"]) for r in slow] == ["MISS", "NOT RUN", "MISS", "NOT RUN", "NOT RUN", "NOT RUN"]
    assert "PASS: first chunk p50 <= 60 ms at concurrency 1 [v]: p50 59.0 ms" in targets.targets_text(results)


# --- the driver end to end on a CPU server -----------------------------------------------------

SECONDS = (0.8, 1.2)  # 20-30 speech tokens per item
PROMPTS, REQUESTS = 3, 4  # the 4th request repeats the first item
RATE_REQUESTS = 3  # open loop at 4 req/s, in both modes


@pytest.mark.e2e  # runs run.sh's stages and a real server
def test_driver_end_to_end(tiny_bundle, tmp_path, monkeypatch, capsys):
    pytest.importorskip("pytriton")  # the bundled tritonserver
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server's model processes: 2-core machine
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    http, grpc, metrics = free_ports(3)
    out = tmp_path / "bench"
    argv = ["--models-dir", str(tiny_bundle), "--out-dir", str(out), "--concurrency", "1", "2",
            "--modes", "streaming", "offline", "--fixed-output-seconds", *map(str, SECONDS), "--seed", "3",
            "--requests-per-level", str(REQUESTS), "--num-prompts", str(PROMPTS), "--variant", "ours:DEVICE=cpu,TEXT_WARM_UP=false",
            "--offline-inference", "cpu:--device cpu --batch-size 2 --threads 1",
            "--rates", "4", "--requests-per-rate", str(RATE_REQUESTS),
            "--long-text-chars", "400", "--long-text-seconds", "0.2",
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out

    tokens = [round(25 * s) for s in FixedLength(25, SECONDS, 3).draws(PROMPTS)]
    per_level_s = sum(tokens[i % PROMPTS] for i in range(REQUESTS)) / 25  # 960 samples a token at 24 kHz
    result = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    levels = result["levels"]
    assert [(r["mode"], r["concurrency"], r["model"]) for r in levels] == [
        ("streaming", 1, "cosyvoice2"), ("streaming", 2, "cosyvoice2"),
        ("offline", 1, "cosyvoice2_offline"), ("offline", 2, "cosyvoice2_offline")]
    for row in levels:
        assert row["requests"] == REQUESTS and row["failed"] == 0 and not row["errors"]
        assert row["audio_s"] == pytest.approx(per_level_s, abs=1e-9)
        assert row["requested_audio_s"] == pytest.approx(per_level_s, abs=1e-9)
        assert row["req_per_s"] > 0 and row["rtf"] == pytest.approx(row["wall_s"] / per_level_s)
        # every stage runs inside cosyvoice2's engine (and cosyvoice2_offline forwards there): Triton
        # times those two models only; where the time goes is the engine's counters (cosyserve_engine_*)
        assert set(row["triton_compute"]) == {"bls"}
        assert row["server_counters"]["cosyserve_engine_flow_seconds_total"] > 0
        assert row["server_counters"]["cosyserve_llm_generated_tokens_total"] > 0  # scraped around the level
        assert row["server_breakdown"]["llm_tokens_per_s"] > 0
        streaming = row["mode"] == "streaming"
        assert (row["first_chunk_p50_ms"] is not None) == streaming
        assert (row["requests_with_underrun"] is not None) == streaming
        report = json.loads(Path(row["report"]).read_text(encoding="utf-8"))
        assert sorted(r["id"] for r in report["per_request"]) == ["bench_000_r0", "bench_000_r1", "bench_001_r0",
                                                                  "bench_002_r0"]
        by_id = {r["id"]: r["audio_s"] for r in report["per_request"]}
        assert by_id["bench_000_r1"] == by_id["bench_000_r0"] == pytest.approx(tokens[0] / 25)
        assert report["num_tasks"] == row["concurrency"]
        if streaming:
            assert all(r["first_chunk_latency_s"] < r["latency_s"] for r in report["per_request"])

    assert (out / "ours" / "model_repo" / "cosyvoice2_offline" / "config.pbtxt").is_file()  # built by run.sh
    variant = result["variants"][0]
    assert variant["overrides"] == {"DEVICE": "cpu", "TEXT_WARM_UP": "false"} and variant["bls_instances"]["cosyvoice2"] >= 1
    assert result["header"]["gpu"] == "cpu" and "--variant ours:DEVICE=cpu" in result["header"]["command"]

    offline = result["offline_inference"][0]
    assert offline["name"] == "cpu" and offline["batch_size"] == 2 and offline["device"] == "cpu"
    assert offline["audio_s"] == pytest.approx(sum(tokens) / 25) and offline["rtf"] > 0
    assert offline["total_time_s"] == pytest.approx(offline["frontend_time_s"] + offline["engine_time_s"])

    assert len(result["targets"]) == 6 and result["targets"][-1]["passed"] is None  # no batch-16 offline run
    md = (out / "bench.md").read_text(encoding="utf-8")
    assert "| ours | streaming | 1 | 4 | 0 |" in md and "| ours | offline | 2 | 4 | 0 |" in md
    assert "| cpu | " in md and "bls (cosyvoice2)" in md and "* GPU: cpu" in md
    assert "## Server-side breakdown (Prometheus counters, per level)" in md and "| LLM tokens/s |" in md
    assert "## Targets" in md and "first chunk p50 <= 60 ms at concurrency 1 [ours]" in md
    assert md in printed
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    # the long text: one request, every segment 0.2 s (5 tokens) of speech, in its own table
    (long_text,) = result["long_text"]
    assert long_text["text_chars"] == 400 and long_text["requests"] == 1 and long_text["failed"] == 0
    segments = round(long_text["audio_s"] / 0.2)
    assert segments >= 3 and long_text["audio_s"] == pytest.approx(0.2 * segments, abs=1e-9)
    assert long_text["requests_with_underrun"] is not None and "## Long text" in md

    # the open loop: the same accounting per rate, the client's seeded arrivals
    rates = result["open_loop"]
    assert [(r["mode"], r["rate"], r["model"]) for r in rates] == [("streaming", 4.0, "cosyvoice2"),
                                                                    ("offline", 4.0, "cosyvoice2_offline")]
    rate_s = sum(tokens[i] for i in range(RATE_REQUESTS)) / 25
    for row in rates:
        assert row["requests"] == RATE_REQUESTS and row["failed"] == 0 and not row["errors"]
        assert row["audio_s"] == pytest.approx(rate_s, abs=1e-9) and row["req_per_s"] > 0
        assert 1 <= row["peak_in_flight"] <= RATE_REQUESTS
        assert row["server_counters"]["cosyserve_llm_generated_tokens_total"] > 0
        assert (row["requests_with_underrun"] is not None) == (row["mode"] == "streaming")
        report = json.loads(Path(row["report"]).read_text(encoding="utf-8"))
        assert report["open_loop"]["arrivals_s"] == openloop.poisson_arrivals(4.0, 3, count=RATE_REQUESTS)
    assert "## Open-loop rates" in md and "| ours | streaming | 4 | 3 | 0 |" in md
    assert result["header"]["rates"] == [4.0] and "at 4 req/s" in printed
