"""bench/matrix.py's plan and bench/matrix_report.py's tables, on synthetic result JSONs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import matrix, matrix_report
from bench.served_app import free_port


def fake_run(tok_s: float, ttft_p99: float, itl_p99: float, **extra) -> dict:
    run = {
        "date": "20261122-040000", "completed": 4, "failed": 0, "output_throughput": tok_s,
        "median_ttft_ms": ttft_p99 / 2, "p99_ttft_ms": ttft_p99, "median_tpot_ms": 50.0,
        "median_itl_ms": itl_p99 / 3, "p99_itl_ms": itl_p99, "median_e2el_ms": 5000.0,
        "machine": {"loadavg_start": [2.0, 2.0, 2.0], "loadavg_end": [2.5, 2.0, 2.0]},
        "errors": [None] * 4, "request_groups": ["default"] * 4, "ttfts": [0.1, 0.2, 0.3, 0.4],
        "tpots": [0.05] * 4, "e2els": [1.0] * 4, "itls": [[0.05, 0.06]] * 4, "max_concurrency": 16,
        "label": "x", "dataset": "random", "num_prompts": 4,
    }
    run.update(extra)
    return run


def write_runs(out: Path, server: str, cell: str, runs: list[dict]) -> None:
    (out / server).mkdir(parents=True, exist_ok=True)
    for r, run in enumerate(runs, 1):
        (out / server / f"{cell}-run{r}.json").write_text(json.dumps(run))


def test_report_ratios_and_markers(tmp_path) -> None:
    out = tmp_path / "results"
    write_runs(out, "ours", "c16", [fake_run(120, 1000, 100), fake_run(140, 1200, 120)])
    write_runs(out, "vllm", "c16", [fake_run(100, 4000, 300), fake_run(100, 4000, 300)])
    write_runs(out, "llama", "c16", [fake_run(80, 9000, 90), fake_run(80, 9000, 90)])
    write_runs(out, "ours-1worker", "shared-prefix", [fake_run(50, 500, 60, cached_token_ratio=0.8)])
    write_runs(out, "ours-no-prefix-cache", "shared-prefix", [fake_run(30, 900, 70, cached_token_ratio=0.0)])
    doc = tmp_path / "benchmarks.md"
    begin, end = matrix_report.markers("bfloat16")
    other_begin, other_end = matrix_report.markers("float32")
    doc.write_text("# Benchmarks\n\nhand-written intro\n\n" + begin + "\nold\n" + end + "\n\n"
                   + other_begin + "\nfp32 section\n" + other_end + "\n\nhand-written outro\n")
    matrix_report.write(out, doc, "bfloat16")
    text = doc.read_text()
    assert "hand-written intro" in text and "hand-written outro" in text and "\nold\n" not in text
    assert "\nfp32 section\n" in text  # the other dtype's section is left alone
    assert text.count(begin) == 1 and "## Results in bfloat16" in text and "a bf16 GGUF" in text
    # per-run ratios, then the ratio of the means: (120+140)/2 / 100 = 1.30 < 1.33
    assert "| ours / vllm | 1.20 / 1.40 (1.30) |" in text
    assert "Target" not in text and "Measured on " in text  # figures and the machine, no goals or dates
    assert "| prefix caching | shared-prefix | out tok/s | ours-1worker: 50.0 | ours-no-prefix-cache: 30.0 |" in text
    assert (tmp_path / "bfloat16" / "c16-latency-cdf.png").stat().st_size > 0  # beside the doc
    matrix_report.write(out, doc, "bfloat16")  # idempotent
    assert doc.read_text() == text


def test_plan_seeds_runs_caps_prompts_and_knob_cells_exist(tmp_path) -> None:
    hf, ours = matrix.SERVERS["hf"], matrix.SERVERS["ours"]
    argv = matrix.client_argv(hf, matrix.CELLS["c16"], 2, tmp_path / "x.json", tmp_path)
    assert argv[argv.index("--num-prompts") + 1] == "16" and argv[argv.index("--seed") + 1] == "202"
    # no two (cell, run) pairs share a seed, so no cell finds another's prompts in the prefix cache
    seeds = {matrix.cell_seed(cell, run) for cell in matrix.CELLS.values() for run in (1, 2, 3)}
    assert len(seeds) == 3 * len(matrix.CELLS)
    argv = matrix.client_argv(ours, matrix.CELLS["c16"], 1, tmp_path / "x.json", tmp_path)
    assert argv[argv.index("--num-prompts") + 1] == "64" and argv[argv.index("--max-concurrency") + 1] == "16"
    for server in matrix.SERVERS.values():
        assert set(server.cells) <= set(matrix.CELLS), server.name
        assert (matrix.REPO / "bench" / "peers" / server.launcher).exists()
    for cell, on, off, _ in matrix_report.KNOBS:
        assert cell in matrix.SERVERS[on].cells and cell in matrix.SERVERS[off].cells
    # like for like: our servers get the dtype as an app arg, peers as DTYPE in their environment
    assert matrix.launcher_args(ours, "bfloat16") == ["dtype=bfloat16"]
    assert matrix.launcher_args(matrix.SERVERS["vllm"], "bfloat16") == []


def test_direct_servers_send_their_clients_to_the_ingress_replicas_own_port(tmp_path, monkeypatch) -> None:
    from bench import served_app

    ours, direct = matrix.SERVERS["ours"], matrix.SERVERS["ours-direct"]
    assert not ours.direct and direct.direct and direct.launcher_args == ours.launcher_args
    assert matrix.client_port(ours, 12345) == 8000  # the proxy's port: nothing is looked up
    asked = []
    monkeypatch.setattr(served_app, "direct_ingress_port", lambda pid, ports: asked.append((pid, ports)) or 30001)
    assert matrix.client_port(direct, 12345) == 30001
    assert asked == [(12345, served_app.direct_ingress_ports({**served_app.read_env_file(), **os.environ}))]
    argv = matrix.client_argv(direct, matrix.CELLS["c16"], 1, tmp_path / "x.json", tmp_path, 30001)
    assert argv[argv.index("--base-url") + 1] == "http://127.0.0.1:30001"
    monkeypatch.setattr(served_app, "direct_ingress_port", lambda pid, ports: None)
    with pytest.raises(RuntimeError, match="a port of its own"):
        matrix.client_port(direct, 12345)


def test_stop_ends_a_setsid_server_and_its_other_process_groups(tmp_path) -> None:
    # like a Ray actor: a child that moves to its own process group inside the server's session
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
              f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
              "time.sleep(60)\n")
    server = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    child_file = tmp_path / "child"
    for _ in range(200):
        if child_file.exists() and child_file.read_text():
            break
        time.sleep(0.05)
    child = int(child_file.read_text())
    assert child in matrix._session_members(server.pid)
    matrix.stop(server.pid, port=free_port())
    server.wait(timeout=10)
    for _ in range(100):
        if child not in matrix._session_members(server.pid):
            break
        time.sleep(0.05)
    assert matrix._session_members(server.pid) == []
