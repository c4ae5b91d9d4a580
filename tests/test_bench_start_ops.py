"""scripts/bench_start_ops.py on the tiny bundle (CPU): a batch's start stage is counted in operators,
and more streams cost more of them."""

from __future__ import annotations

import json

from cosyserve.bench.start_ops import main


def test_a_batch_start_is_counted_per_stream(tiny_bundle, tmp_path, capsys):
    report = tmp_path / "rows.json"
    main(["--models-dir", str(tiny_bundle), "--streams", "1", "3", "--json", str(report)])
    one, three = json.loads(report.read_text())
    assert one["streams"] == 1 and three["streams"] == 3
    for row in (one, three):
        assert row["first_ops"] > 0 and row["second_ops"] > 0 and row["first_ms"] > 0 and row["first_top"]
    assert three["second_ops"] > one["second_ops"]
    assert "each stream more adds" in capsys.readouterr().out
