"""bench/served_app.py and bench/bench_http.py helpers: env files, /proc addresses, the CPU
table, variants (no server started here)."""

from __future__ import annotations

import os
import socket

from bench.bench_http import parse_variant
from bench.served_app import (
    CLIENT,
    WORKER_PROCESS,
    ProcessTimes,
    _address,
    cpu_rows,
    cpu_with_client,
    format_cpu_table,
    is_loopback,
    listening_ports,
    process_cpu_s,
    process_wait_s,
    read_env_file,
    serving_share,
)


def test_env_files_parse_and_skip_comments(tmp_path) -> None:
    path = tmp_path / "x.env"
    path.write_text("# comment\n\nA=1\nB_C=x=y\n")
    assert read_env_file(path) == {"A": "1", "B_C": "x=y"}
    shipped = read_env_file()
    assert shipped["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


def test_proc_addresses_and_loopback() -> None:
    assert _address("0100007F") == "127.0.0.1" and _address("00000000") == "0.0.0.0"
    assert _address("00000000000000000000000001000000") == "::1"
    assert [is_loopback(a) for a in ("127.0.0.1", "0.0.0.0", "::", "::1", "::ffff:7f00:1")] == [
        True, False, False, True, True]


def test_listening_ports_of_this_process() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert port in listening_ports(os.getpid())
    assert port not in listening_ports(os.getpid())


def test_cpu_rows_share_and_table() -> None:
    before = {1: ProcessTimes(WORKER_PROCESS, 10.0, 1.0), 2: ProcessTimes("ray::SchedulerActor", 1.0, 0.5)}
    after = {1: ProcessTimes(WORKER_PROCESS, 100.0, 4.0), 2: ProcessTimes("ray::SchedulerActor", 6.0, 0.2),
             3: ProcessTimes("gcs_server", 5.0, 0.3)}
    rows = cpu_rows(before, after)
    assert [(r.name, r.cpu_s) for r in rows] == [(WORKER_PROCESS, 90.0), ("ray::SchedulerActor", 5.0),
                                                 ("gcs_server", 5.0)]
    # the scheduler's reading fell (a thread ended, taking its wait with it): 0, never below
    assert [r.wait_s for r in rows] == [3.0, 0.0, 0.3]
    assert abs(serving_share(rows) - 0.1) < 1e-9
    table = format_cpu_table(rows)
    assert "| ray::WorkerActor | 1 | 90.0 | 90.0% | 3.0 |" in table
    assert "| ray::SchedulerActor | 2 | 5.0 | 5.0% | 0.0 |" in table and "**10.0%**" in table
    assert table.splitlines()[-2].endswith("| **100.0** | 100% | **3.3** |")
    assert table.splitlines()[-1].endswith("| **10.0** | **10.0%** | **0.3** |")


def test_this_process_is_counted_as_the_client() -> None:
    now = cpu_with_client(session_id=os.getpid())  # no server: whatever the session holds, and us
    name, cpu_s, wait_s = now[os.getpid()]
    assert name == CLIENT and 0 < cpu_s <= process_cpu_s(os.getpid())
    assert 0 <= wait_s <= process_wait_s(os.getpid())


def test_core_wait_sums_the_threads_of_a_process() -> None:
    """process_wait_s is every live thread's runqueue wait: at least the main thread's, never
    less than an earlier reading while the threads live (Linux keeps these counts per thread)."""
    first = process_wait_s(os.getpid())
    main_thread = int(open(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").read().split()[1]) / 1e9
    assert first >= main_thread >= 0
    sum(range(200_000))  # some work, so that the counts can move on
    assert process_wait_s(os.getpid()) >= first
    assert process_wait_s(2 ** 22 + 12345) == 0.0  # no such process: nothing waited


def test_the_table_gives_cpu_per_output_token() -> None:
    before = {1: ProcessTimes(WORKER_PROCESS, 10.0), 2: ProcessTimes("ray::SchedulerActor", 1.0),
              3: ProcessTimes(CLIENT, 2.0)}
    after = {1: ProcessTimes(WORKER_PROCESS, 38.0), 2: ProcessTimes("ray::SchedulerActor", 2.2),
             3: ProcessTimes(CLIENT, 2.8)}
    table = format_cpu_table(cpu_rows(before, after), output_tokens=1000)
    lines = table.splitlines()
    assert lines[0].endswith("| waited for a core, s | CPU ms per output token |")
    assert lines[1] == "|---|---|---|---|---|---|"
    assert "| ray::SchedulerActor | 2 | 1.2 | 4.0% | 0.0 | 1.20 |" in lines
    assert "| client (this process) | 3 | 0.8 | 2.7% | 0.0 | 0.80 |" in lines
    assert lines[-2].endswith("| **30.0** | 100% | **0.0** | **30.00** |") and lines[-1].endswith("| **2.00** |")
    assert "per output token" not in format_cpu_table(cpu_rows(before, after))


def test_variants() -> None:
    shipped = parse_variant("shipped")
    assert shipped.use_env_file and shipped.target == "proxy" and not shipped.env
    variant = parse_variant("x:env-file=none,A=1,target=direct,arg.num_workers=1")
    assert (variant.name, variant.env, variant.use_env_file, variant.target, variant.app_args) == (
        "x", {"A": "1"}, False, "direct", {"num_workers": 1})
