"""The open-loop benchmark without a server: Poisson arrival times, a sender that keeps to them
whatever is in flight, and the per-rate accounting of scripts/bench_triton.py."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import pytest

from cosyserve.bench import openloop, report, runner
from cosyserve.errors import InvalidInputError


# --- arrival times ----------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_start_at_zero():
    arrivals = openloop.poisson_arrivals(5.0, seed=3, count=50)
    assert len(arrivals) == 50 and arrivals[0] == 0.0
    assert all(b > a for a, b in zip(arrivals, arrivals[1:]))
    assert openloop.poisson_arrivals(5.0, seed=3, count=50) == arrivals
    assert openloop.poisson_arrivals(5.0, seed=4, count=50) != arrivals
    # one seed: the same pattern at every rate, compressed
    assert openloop.poisson_arrivals(20.0, seed=3, count=50) == pytest.approx([t / 4 for t in arrivals])
    # a longer run starts with the shorter one
    assert openloop.poisson_arrivals(5.0, seed=3, count=80)[:50] == arrivals


def test_poisson_gaps_are_exponential_at_the_rate():
    arrivals = openloop.poisson_arrivals(10.0, seed=0, count=20001)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: std = mean
    assert sum(g < 0.1 for g in gaps) / len(gaps) == pytest.approx(1 - 2.718281828 ** -1, abs=0.015)


def test_poisson_arrivals_of_a_duration():
    arrivals = openloop.poisson_arrivals(8.0, seed=1, duration_s=5.0)
    assert arrivals == openloop.poisson_arrivals(8.0, seed=1, count=len(arrivals))
    assert arrivals[-1] < 5.0 <= openloop.poisson_arrivals(8.0, seed=1, count=len(arrivals) + 1)[-1]
    assert 20 < len(arrivals) < 65  # 40 expected


@pytest.mark.parametrize("rate, kwargs", [(0.0, {"count": 3}), (-1.0, {"count": 3}), (1.0, {}),
                                          (1.0, {"count": 3, "duration_s": 1.0}), (1.0, {"count": 0}),
                                          (1.0, {"duration_s": 0.0})])
def test_poisson_arrivals_reject_bad_bounds(rate, kwargs):
    with pytest.raises(InvalidInputError):
        openloop.poisson_arrivals(rate, seed=0, **kwargs)


# --- the sender -------------------------------------------------------------------------------

ARRIVALS = [0.0, 0.1, 0.2, 1.2]
BUSY_S = 0.6  # each request: the first three overlap, the last is alone


def test_requests_start_at_their_arrival_whatever_is_in_flight():
    started, lock = {}, threading.Lock()
    begin = time.perf_counter()

    def send(i: int) -> str:
        with lock:
            started[i] = time.perf_counter() - begin
        time.sleep(BUSY_S)
        return f"result {i}"

    run = openloop.run_open_loop(ARRIVALS, send)
    assert run.results == [f"result {i}" for i in range(4)]  # in arrival order
    for i, arrival in enumerate(ARRIVALS):  # a closed loop of one sender would start #1 at 0.6 s
        assert arrival <= started[i] < arrival + 0.09, (i, started)
        assert 0 <= run.start_lags_s[i] < 0.09
    assert run.peak_in_flight == 3
    assert ARRIVALS[-1] + BUSY_S <= run.wall_s < ARRIVALS[-1] + BUSY_S + 0.3

    summary = run.summary(ARRIVALS, 2.5)
    assert summary["offered_req_per_s"] == pytest.approx(3 / 1.2) and summary["requests"] == 4
    assert summary["arrival_rate"] == 2.5 and summary["peak_in_flight"] == 3
    assert summary["arrivals_s"] == ARRIVALS and summary["start_lag_max_ms"] == pytest.approx(
        1e3 * max(run.start_lags_s))


def test_an_error_of_one_send_is_raised_after_every_call_ended():
    ended = []

    def send(i: int) -> int:
        if i == 1:
            raise RuntimeError("send 1 broke")
        time.sleep(0.2)
        ended.append(i)
        return i

    with pytest.raises(RuntimeError, match="send 1 broke"):
        openloop.run_open_loop([0.0, 0.01, 0.02], send)
    assert sorted(ended) == [0, 2]


def test_one_arrival_and_unsorted_arrivals():
    run = openloop.run_open_loop([0.0], lambda i: i)
    assert run.results == [0] and run.peak_in_flight == 1
    assert run.summary([0.0], 1.0)["offered_req_per_s"] is None
    with pytest.raises(InvalidInputError):
        openloop.run_open_loop([0.0, 0.2, 0.1], lambda i: i)


# --- per-rate accounting in the driver --------------------------------------------------------


def _args(**overrides) -> argparse.Namespace:
    args = {"modes": ["streaming"], "rates": [2.0, 4.0], "requests_per_rate": None, "seconds_per_rate": None,
            "seed": 0, "metrics_port": 9102, "grpc_port": 9101, "fixed_output_seconds": [1.0],
            "tokens_per_second": 25.0, "request_timeout": 10.0}
    return argparse.Namespace(**{**args, **overrides})


def test_arrivals_per_rate():
    default_low = runner.arrivals_per_rate(_args(), 1.0)  # 10 s at 1 req/s: ~10 arrivals, raised to 26
    assert len(default_low) == runner.MIN_REQUESTS_PER_LEVEL
    default_high = runner.arrivals_per_rate(_args(), 20.0)  # every arrival of 10 s
    assert default_high == openloop.poisson_arrivals(20.0, 0, duration_s=runner.SECONDS_PER_RATE)
    assert len(default_high) > runner.MIN_REQUESTS_PER_LEVEL
    assert len(runner.arrivals_per_rate(_args(requests_per_rate=7), 20.0)) == 7
    assert runner.arrivals_per_rate(_args(seconds_per_rate=2.0), 5.0) == openloop.poisson_arrivals(
        5.0, 0, duration_s=2.0)


def _client_report(requests: int, rate: float) -> dict:
    arrivals = openloop.poisson_arrivals(rate, 0, count=requests)
    per_request = [{"id": f"bench_{i:03d}", "error": None if i else "InferenceServerException: boom"}
                   for i in range(requests)]
    return {"model_name": "cosyvoice2", "requests": requests, "failed": 1, "wall_s": 2.0, "audio_s": 3.0,
            "rtf": 2.0 / 3.0, "requested_speech_tokens": {r["id"]: 25 for r in per_request},
            "first_chunk_latency": {"p50_ms": 120.0, "p95_ms": 300.0, "p99_ms": 310.0},
            "latency": {"p50_ms": 900.0, "p95_ms": 1500.0},
            "underruns": {"total": 3, "requests_with_underrun": 2, "stall_s": 0.75},
            "per_request": per_request, "triton_stats": {},
            "open_loop": openloop.OpenLoopRun([None] * requests, [0.001] * requests, 3, 2.0).summary(arrivals, rate)}


def test_measure_rates_runs_the_open_loop_client_per_rate(monkeypatch, tmp_path):
    commands, scrapes = [], iter([{"cosyserve_llm_generated_tokens_total": 10.0},
                                  {"cosyserve_llm_generated_tokens_total": 110.0}, {}, {}])

    def client(command, level_dir):
        commands.append((level_dir.name, command))
        rate = float(command[command.index("--arrival-rate") + 1])
        return _client_report(int(command[command.index("--num-requests") + 1]), rate)

    monkeypatch.setattr(runner, "scrape_metrics", lambda port: next(scrapes))
    monkeypatch.setattr(runner, "run_client", client)
    monkeypatch.setattr(runner, "check_alive", lambda server: None)
    args = _args(requests_per_rate=4)
    repo = runner.Repository(tmp_path, {"streaming": "cosyvoice2", "offline": None}, {})
    rows = runner.measure_rates(args, runner.Variant("v"), repo, None, tmp_path / "m.txt", tmp_path)

    assert [name for name, _ in commands] == ["streaming_r2", "streaming_r4"]
    for _, command in commands:
        assert "--num-tasks" not in command and command[command.index("--num-requests") + 1] == "4"
        assert command[command.index("--seed") + 1] == "0"  # the client draws the same arrivals
    first = rows[0]
    assert (first["variant"], first["mode"], first["rate"], "concurrency" in first) == ("v", "streaming", 2.0, False)
    assert first["requests"] == 4 and first["failed"] == 1 and first["req_per_s"] == pytest.approx(1.5)
    assert first["first_chunk_p95_ms"] == 300.0 and first["requests_with_underrun"] == 2
    assert first["underrun_stall_s"] == 0.75 and first["peak_in_flight"] == 3
    assert first["requested_audio_s"] == pytest.approx(3.0)  # the three requests that did not fail
    arrivals = openloop.poisson_arrivals(2.0, 0, count=4)
    assert first["offered_req_per_s"] == pytest.approx(3 / arrivals[-1])
    assert first["start_lag_max_ms"] == pytest.approx(1.0)
    assert first["errors"] == ["InferenceServerException: boom"]
    assert first["server_counters"] == {"cosyserve_llm_generated_tokens_total": 100.0}
    assert first["server_breakdown"]["llm_tokens_per_s"] == pytest.approx(50.0)
    assert rows[1]["rate"] == 4.0 and rows[1]["server_breakdown"] is None

    table = report.rate_table(rows + [{"variant": "v", "mode": "offline", "rate": 0.5, "requests": 26,
                                       "failed": 26, "error": "client crashed"}]).splitlines()
    assert table[0] == ("| variant | mode | rate req/s | requests | failed | offered req/s | req/s | peak in flight "
                        "| first chunk p50 ms | p95 ms | p99 ms | latency p50 ms | p95 ms | RTF | requests with "
                        "underruns | underrun stall s | sender late max ms |")
    assert table[2] == (f"| v | streaming | 2 | 4 | 1 | {3 / arrivals[-1]:.2f} | 1.50 | 3 | 120.0 | 300.0 | 310.0 "
                        "| 900.0 | 1500.0 | 0.6667 | 2 | 0.75 | 1.0 |")
    assert table[4] == "| v | offline | 0.5 | 26 | ERROR |" + " n/a |" * 12
    assert runner.summary_line(first).startswith("streaming at 2 req/s: 4 requests, 1 failed, 1.50 req/s")
    assert runner.failed({"variants": [], "levels": [], "open_loop": rows, "offline_inference": []})


# --- the voice-upload benchmark's first-chunk stages ----------------------------------------------


def test_upload_report_gives_each_request_kinds_median_stages_and_says_when_none_was_traced():
    from cosyserve.bench import voice_upload

    medians = {"upload_ms": 40.0, "upload_max_ms": 70.0, "first_ms": 130.0, "second_ms": 110.0,
               "registered_ms": 96.0, "first_over_registered": 130.0 / 96.0}
    traced = [{"registered": {"prefill": 5.0, "gpu": 20.0}, "first": {"prefill": 9.0, "gpu": 40.0}, "second": {}},
              {"registered": {"prefill": 7.0, "gpu": 22.0}, "first": {"prefill": 11.0, "gpu": 44.0},
               "second": {"prefill": 6.0}}]
    stage_medians = {request: voice_upload._median_stages([row[request] for row in traced])
                     for request in voice_upload.REQUESTS}
    assert stage_medians == {"registered": {"prefill": 6.0, "gpu": 21.0}, "first": {"prefill": 10.0, "gpu": 42.0},
                             "second": {"prefill": 6.0}}  # an untraced request does not count
    report = {"seconds": 10.0, "rounds": 2, "model": "cosyvoice2", "median": medians, "median_stage_ms": stage_medians}
    lines = voice_upload.table(report).splitlines()
    assert lines[-5:] == ["| request | prefill | gpu |", "|---|---:|---:|", "| registered | 6.0 | 21.0 |",
                          "| first | 10.0 | 42.0 |", "| second | 6.0 | - |"]
    assert lines[3].endswith("| 96.0 | 1.35 |")
    untraced = dict(report, median_stage_ms={request: {} for request in voice_upload.REQUESTS})
    assert voice_upload.table(untraced).splitlines()[-1] == "first-chunk stages: none traced"
    assert "stages" not in voice_upload.table(dict(report, median_stage_ms=None))
