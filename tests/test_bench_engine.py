"""scripts/bench_engine.py on the tiny bundle (CPU): every level is measured and reported with the
loop's per-stage profile."""

from __future__ import annotations

import json

from cosyserve.bench.engine import FIRST_CHUNK_STAGES, main


def test_levels_report_latency_underruns_and_the_loops_profile(tiny_bundle, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    main(["--models-dir", str(tiny_bundle), "--device", "cpu", "--cold", "--tokens", "20", "--concurrency", "2",
          "--requests-per-sender", "1", "--new-clips", "1", "--new-clips-while-playing", "2", "--rates", "4",
          "--seconds-per-rate", "1", "--trace-new-clips", str(tmp_path / "new.json.gz"),
          "--trace-registered", str(tmp_path / "registered.json.gz"),
          "--trace-while-playing", str(tmp_path / "playing.json.gz"), "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert [level["level"] for level in report["levels"]] == [
        "2 concurrent", "1 registered together", "1 uploaded clips together", "1 new clips together",
        "0 new clips while 2 play", "1 new clips while 2 play", "4 req/s"]
    assert report["first_request_ms"] > 0 and report["device"] == "cpu"
    alone = report["levels"][4]  # the playing streams' control: no new clip, their underruns reported
    assert alone["requests"] == 0 and alone["playing"] == 2 and alone["playing_failed"] == 0
    for level in report["levels"][:4] + report["levels"][5:]:
        assert level["failed"] == 0 and level["requests"] >= 1 and level["first_p50_ms"] > 0, level
        assert level["iterations"] > 0 and level["busy_ms_per_iteration"] > 0
        assert level["flow_ms_per_iteration"] > 0 and level["llm_busy_s"] > 0
    assert report["levels"][-1]["peak_in_flight"] >= 1
    assert len(report["levels"][3]["first_chunks_ms"]) == 1 and report["levels"][3]["first_chunks_ms"][0] > 0
    # the new clip's first chunk by stage: its front end, then each engine stage, within its first chunk
    (stages,) = report["levels"][3]["first_chunk_stages_ms"]
    assert len(stages) == len(FIRST_CHUNK_STAGES) and all(ms is not None and ms >= 0 for ms in stages)
    assert stages[0] > 0 and sum(stages) <= report["levels"][3]["first_chunks_ms"][0] + 1
    assert report["registered_trace"]["marks"] == 1 and (tmp_path / "registered.json.gz").stat().st_size > 0
    # both traces end at the new clip's first chunk; the playing streams' outcomes come with the second
    assert report["new_clip_trace"]["marks"] == 1 and (tmp_path / "new.json.gz").stat().st_size > 0
    beside = report["while_playing_trace"]
    assert beside["marks"] == 1 and beside["playing"] == 2 and beside["playing_failed"] == 0
    assert (tmp_path / "playing.json.gz").stat().st_size > 0
    assert "| 4 req/s |" in capsys.readouterr().out


def test_busy_time_is_the_union_of_kernel_intervals():
    from cosyserve.bench.kernels import busy_us

    assert busy_us([]) == 0.0
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20.0  # overlaps count once, gaps not at all


def test_a_trace_holds_the_operators_of_every_thread_until_the_marks(tmp_path):
    import gzip
    import threading

    import torch

    from cosyserve.bench.kernels import trace_summary, trace_until

    x = torch.randn(8, 8)
    started = threading.Event()

    def beside() -> None:  # a thread that runs before the trace starts, as the engine's loop does
        started.wait()
        for _ in range(5):
            torch.mm(x, x)
    thread = threading.Thread(target=beside)
    thread.start()

    def run(mark) -> None:
        started.set()
        thread.join()
        torch.add(x, x)
        mark()
        torch.sub(x, x)  # after the last mark: may or may not be traced

    summary = trace_until(str(tmp_path / "trace.json.gz"), run, marks=1)
    trace = json.loads(gzip.open(summary["path"]).read())
    threads = {e["tid"] for e in trace["traceEvents"] if e.get("name") in ("aten::mm", "aten::add")}
    assert summary["marks"] == 1 and len(threads) == 2
    text = trace_summary(summary["path"], bin_ms=1.0)
    assert sum(line.startswith("thread ") for line in text.splitlines()) >= 2
    assert "aten::mm" in text and "aten::add" in text


def test_a_traced_runs_error_reaches_the_caller(tmp_path):
    import pytest

    from cosyserve.bench.kernels import trace_until

    def run(mark) -> None:
        raise ValueError("the load failed")

    with pytest.raises(ValueError, match="the load failed"):
        trace_until(str(tmp_path / "trace.json.gz"), run, marks=1, timeout_s=5)


def test_graph_replays_lists_each_replay_with_its_kernels(tmp_path):
    """Each cudaGraphLaunch of a trace, with the kernels of its correlation id (on the streams they ran
    on); kernels of other launches and a replay without kernels stay out."""
    import gzip
    import json

    from cosyserve.bench.kernels import graph_replays

    def launch(ts, correlation, name="cudaGraphLaunch"):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 50, "tid": 7,
                "args": {"correlation": correlation}}

    def kernel(ts, dur, correlation, stream, name):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 0,
                "args": {"correlation": correlation, "stream": stream}}

    events = [launch(1000, 1), kernel(1100, 300, 1, 7, "gemm<a>"), kernel(1500, 100, 1, 9, "attention(b)"),
              launch(3000, 2), kernel(3200, 50, 2, 7, "norm"), launch(4000, 3, "cudaLaunchKernel"),
              kernel(4100, 999, 3, 7, "eager"), launch(5000, 4)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as out:
        json.dump({"traceEvents": events}, out)
    header, first, second = graph_replays(str(path)).splitlines()
    cells = [c.strip() for c in first.split("|")]
    assert cells[:8] == ["0.0", "50", "0.1", "0.50", "0.40", "2", "7", "7,9"] and "gemm 0.30" in cells[8]
    assert [c.strip() for c in second.split("|")][5] == "1" and "eager" not in first + second
