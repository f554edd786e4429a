"""bench.bench_mla runs end to end at tiny sizes (a smoke run; nothing is timed against anything):
a row per (batch, context), and the absorbed and expanded steps agree."""

from __future__ import annotations

import sys

from bench import bench_mla


def test_a_tiny_run_prints_a_row_per_batch_and_context(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_mla", "--heads", "2", "--batch-sizes", "1,3", "--contexts", "5,20",
                                      "--repeats", "1"])
    bench_mla.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("pool bytes per token (fp32): 2304 against 2560 with per-head K and V")
    rows = [line.split("|")[1:-1] for line in out[3:]]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(1, 5), (1, 20), (3, 5), (3, 20)]
    assert all(float(row[5]) < 1e-4 for row in rows)  # absorbed and expanded hidden states agree
