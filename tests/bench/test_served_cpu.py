"""bench.served_cpu's accounting: /proc stat lines parsed past odd command names, CPU counted
per process across a run (a reused PID is a new process), and the table's totals."""

from __future__ import annotations

import os

from bench import served_cpu
from bench.served_cpu import ProcessCpu


def stat_line(pid: int, name: str, utime: int, stime: int, start: int) -> str:
    # fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime ...
    return f"{pid} ({name}) S 1 {pid} {pid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 4 0 {start} 0 0\n"


def test_a_stat_line_parses_past_a_name_with_spaces_and_parentheses() -> None:
    cpu = served_cpu.parse_stat(stat_line(42, "ray::Worker (x) y", 250, 50, 7777), ticks_per_s=100)
    assert cpu == ProcessCpu("ray::Worker (x) y", 7777, 3.0)


def test_cpu_is_counted_per_process_and_a_reused_pid_starts_from_zero() -> None:
    before = {1: ProcessCpu("worker", 10, 5.0), 2: ProcessCpu("old", 20, 9.0), 3: ProcessCpu("gone", 30, 1.0)}
    after = {1: ProcessCpu("worker", 10, 7.5), 2: ProcessCpu("new", 99, 0.5), 4: ProcessCpu("idle", 40, 0.0)}
    assert served_cpu.cpu_used(before, after) == [(2.5, 1, "worker"), (0.5, 2, "new")]


def test_the_table_names_the_client_and_sums_every_process() -> None:
    used = [(2.0, 11, "ray::WorkerActor"), (0.5, os.getpid(), "python")]
    text = served_cpu.table(used, wall_s=4.0, output_tokens=500, own_pid=os.getpid())
    lines = text.splitlines()
    assert "50.0%" in lines[1] and "4.00" in lines[1] and "ray::WorkerActor" in lines[1]
    assert lines[2].endswith("client (this process)")
    assert "2.50" in lines[-1] and "62.5%" in lines[-1] and "5.00" in lines[-1] and "500 output tokens" in lines[-1]


def test_a_snapshot_of_this_machine_holds_this_process() -> None:
    mine = served_cpu.snapshot()[os.getpid()]
    assert mine.cpu_s > 0 and mine.start_ticks > 0
