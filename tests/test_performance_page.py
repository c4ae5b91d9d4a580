"""docs/performance.md is what scripts/performance_page.py writes from docs/perf/*.json (it cannot drift
from the reports), and the page takes each figure from the most recent run that measured it."""

import copy
import json
import subprocess
import sys

import pytest

from cosyserve.bench import BenchError
from cosyserve.bench.performance import load_reports, render
from conftest import REPO_ROOT

PERF_DIR = REPO_ROOT / "docs" / "perf"


def test_the_committed_page_is_generated_from_the_committed_reports():
    page = (REPO_ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert page == render(load_reports(PERF_DIR)), "docs/performance.md is stale: run python scripts/performance_page.py"


def test_the_script_writes_the_page(tmp_path):
    out = tmp_path / "performance.md"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "performance_page.py"), "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8") == render(load_reports(PERF_DIR))


def test_every_model_has_a_table_and_the_page_links_its_history():
    page = render(load_reports(PERF_DIR))
    for model in ("CosyVoice2", "CosyVoice3", "Step-Audio2 DiT"):
        assert f"## {model} · " in page
    assert "**Every figure on this page was measured on random weights" in page
    assert "[benchmarks.md](benchmarks.md)" in page
    assert "docs/performance.md" in (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def report(date: str, first_chunk_ms: float, time: str = "") -> dict:
    return {"model": "CosyVoice2", "gpu": "GPU", "gpus": 1, "layout": "one", "date": date, "time": time,
            "commit": "abc1234", "command": "bench", "workload": "w", "weights": "random", "source": "s",
            "figures": {"first_chunk_ms": {"value": first_chunk_ms, "at": "p50"}}}


def write(directory, reports: dict[str, dict]):
    for name, contents in reports.items():
        (directory / f"{name}.json").write_text(json.dumps(contents), encoding="utf-8")
    return load_reports(directory)


def test_the_most_recent_run_gives_the_figure_and_older_ones_fill_the_rest(tmp_path):
    older = report("2026-11-20", 200.0)
    older["figures"]["start_s"] = {"value": 150, "at": "load"}
    page = render(write(tmp_path, {"a_new": report("2026-11-21", 120.0), "b_old": older,
                                   "c_later_same_day": report("2026-11-21", 110.0, time="09:00")}))
    assert "| First chunk | 110.0 ms | p50 | 2026-11-21 | abc1234 | `c_later_same_day` |" in page
    assert "| Server start | 150.0 s | load | 2026-11-20 | abc1234 | `b_old` |" in page
    assert "| Offline RTF | not measured |" in page and "`a_new`" not in page


def test_two_runs_of_one_table_and_time_giving_a_figure_are_refused(tmp_path):
    with pytest.raises(BenchError, match="both give first_chunk_ms"):
        render(write(tmp_path, {"a": report("2026-11-21", 120.0), "b": report("2026-11-21", 110.0)}))


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("commit"), "missing commit"),
    (lambda r: r.update(weights="trained"), "weights"),
    (lambda r: r["figures"].update(latency_ms={"value": 1, "at": "x"}), "figure 'latency_ms'"),
    (lambda r: r["figures"]["first_chunk_ms"].pop("at"), "numeric value and what it was measured at"),
])
def test_incomplete_reports_are_refused(tmp_path, change, message):
    broken = copy.deepcopy(report("2026-11-21", 120.0))
    change(broken)
    with pytest.raises(BenchError, match=message):
        write(tmp_path, {"broken": broken})
