"""Where a served token's CPU goes: every process's CPU time over one run of our client.

    .venv/bin/python -m bench.served_cpu -- --base-url http://127.0.0.1:8000 \\
        --tokenizer ~/.cache/rayllm/SmolLM2-135M-Instruct --dataset random --num-prompts 8 \\
        --input-len 256 --output-len 128 --ignore-eos --max-concurrency 1 --seed 7

The arguments after `--` go to bench/serving_client.py, which runs in this process. Before
and after it, every process's user + system CPU time is read from /proc/PID/stat; the
processes that used the most are printed with their CPU seconds, their share of one core
over the run and their milliseconds per output token. The client is "client (this process)".

Why: on a machine with as few cores as the worker has threads, the worker shares its cores
with the ingress, the scheduler, Serve's proxy, Ray's background processes and the client.
Their CPU per token comes out of the worker's step, which then runs slower served than
in-process (docs/models.md, GGUF checkpoints). Use distinct --seed values for runs on the
same server: a repeated prompt is a prefix-cache hit. Linux only.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TOP = 12  # processes printed


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    name: str
    start_ticks: int  # when it started (clock ticks after boot): a reused PID is another process
    cpu_s: float  # user + system


def parse_stat(text: str, ticks_per_s: float) -> ProcessCpu:
    """One /proc/PID/stat line. The command name sits in parentheses and may hold spaces and
    parentheses itself, so the fields are counted after its last ')'."""
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
    return ProcessCpu(name, start, (utime + stime) / ticks_per_s)


def snapshot(proc: Path = PROC) -> dict[int, ProcessCpu]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            out[int(stat.parent.name)] = parse_stat(stat.read_text(), ticks)
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    return out


def cpu_used(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> list[tuple[float, int, str]]:
    """(CPU seconds, pid, name) of every process alive at the end, most first. A process that
    started during the run counts from zero; one that ended during it is not seen."""
    used = []
    for pid, now in after.items():
        then = before.get(pid)
        spent = now.cpu_s - (then.cpu_s if then is not None and then.start_ticks == now.start_ticks else 0.0)
        if spent > 0:
            used.append((spent, pid, now.name))
    return sorted(used, reverse=True)


def table(used: list[tuple[float, int, str]], wall_s: float, output_tokens: int, own_pid: int) -> str:
    lines = [f"{'CPU s':>8} {'% core':>7} {'ms/token':>9} {'pid':>8}  process",
             *(f"{spent:8.2f} {100 * spent / wall_s:6.1f}% {1e3 * spent / max(output_tokens, 1):9.2f} {pid:>8}  "
               f"{'client (this process)' if pid == own_pid else name}" for spent, pid, name in used[:TOP])]
    total = sum(spent for spent, _, _ in used)
    lines.append(f"{total:8.2f} {100 * total / wall_s:6.1f}% {1e3 * total / max(output_tokens, 1):9.2f} {'':>8}  "
                 f"every process ({output_tokens} output tokens in {wall_s:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from bench import serving_client

    client_args = argv[argv.index("--") + 1:] if "--" in argv else argv
    before, started = snapshot(), time.monotonic()
    result = serving_client.main(client_args)
    wall_s, after = time.monotonic() - started, snapshot()
    print(table(cpu_used(before, after), wall_s, result.get("total_output_tokens", 0), os.getpid()))
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
