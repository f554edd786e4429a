"""bench.served_cpu's accounting, on bench.served_app's: this process is counted as the client,
and the table gains a CPU-per-output-token column (the table without it is unchanged)."""

from __future__ import annotations

import os

from bench import served_cpu
from bench.served_app import WORKER_PROCESS, cpu_rows, format_cpu_table, process_cpu_s


def test_this_process_is_counted_as_the_client() -> None:
    now = served_cpu.cpu_now(server_pid=os.getpid())  # no server: whatever the session holds, and us
    name, cpu_s = now[os.getpid()]
    assert name == served_cpu.CLIENT and 0 < cpu_s <= process_cpu_s(os.getpid())


def test_the_table_gives_cpu_per_output_token() -> None:
    before = {1: (WORKER_PROCESS, 10.0), 2: ("ray::SchedulerActor", 1.0), 3: (served_cpu.CLIENT, 2.0)}
    after = {1: (WORKER_PROCESS, 38.0), 2: ("ray::SchedulerActor", 2.2), 3: (served_cpu.CLIENT, 2.8)}
    table = format_cpu_table(cpu_rows(before, after), output_tokens=1000)
    lines = table.splitlines()
    assert lines[0].endswith("| CPU ms per output token |") and lines[1] == "|---|---|---|---|---|"
    assert "| ray::SchedulerActor | 2 | 1.2 | 4.0% | 1.20 |" in lines
    assert "| client (this process) | 3 | 0.8 | 2.7% | 0.80 |" in lines
    assert lines[-2].endswith("| **30.0** | 100% | **30.00** |") and lines[-1].endswith("| **2.00** |")
    assert "per output token" not in format_cpu_table(cpu_rows(before, after))
