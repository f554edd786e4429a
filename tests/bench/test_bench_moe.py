"""bench.bench_moe runs end to end at tiny sizes (a smoke run; nothing is timed against anything):
a MoE and a dense model are built from random weights, each decode step routes every token to
top_k experts, and a row is printed per batch size."""

from __future__ import annotations

from bench import bench_moe

TINY = ["--layers", "2", "--batch-sizes", "1,5", "--experts", "8", "--top-k", "3", "--hidden", "64",
        "--moe-intermediate", "16", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--context", "20",
        "--repeats", "1"]


def test_a_tiny_run_prints_a_row_per_batch(capsys) -> None:
    rows = bench_moe.run(bench_moe.parse_args(TINY))
    assert [row["batch"] for row in rows] == [1, 5]
    for row in rows:
        assert len(row["expert_counts"]) == 2  # one per MoE layer
        for counts in row["expert_counts"]:  # every token chose top_k distinct experts
            assert len(counts) == 8 and sum(counts) == 3 * row["batch"] and max(counts) <= row["batch"]
        assert set(row) >= {"step_s", "experts_gemm_s", "all_gemm_s", "dense_s", "dense_gemm_s"}
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("layers 2 | hidden 64 | 8 experts of 16, top 3 | dense twin intermediate 48")
    assert len([line for line in out if line.strip().startswith(("1 |", "5 |"))]) == 2
