"""Where a served token's CPU goes: every process of a running server, and the client, over one
run of our client.

    .venv/bin/python -m bench.served_cpu --server-pid "$(cat ~/.cache/rayllm-peers/ours.pid)" -- \\
        --base-url http://127.0.0.1:8000 --tokenizer ~/.cache/rayllm/SmolLM2-135M-Instruct \\
        --dataset random --num-prompts 8 --input-len 256 --output-len 128 --ignore-eos \\
        --max-concurrency 1 --seed 7

--server-pid: the `serve run` process of a server started in its own session (bench/peers/ours.sh
and bench.matrix write it to ~/.cache/rayllm-peers/ours.pid; the default); every process of that
session is the server (bench/served_app.py). The arguments after `--` go to
bench/serving_client.py, which runs in this process, counted as "client (this process)". Prints
bench.served_app's CPU table with a column of CPU ms per output token.

Why: on a machine with as few cores as the worker has threads, the worker shares its cores
with the ingress, the scheduler, Serve's proxy, Ray's background processes and the client.
Their CPU per token comes out of the worker's step, which then runs slower served than
in-process (docs/models.md, GGUF checkpoints). Use distinct --seed values for runs on the
same server: a repeated prompt is a prefix-cache hit. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.matrix import PEERS_DIR
from bench.served_app import cpu_by_process, cpu_rows, format_cpu_table, process_cpu_s

CLIENT = "client (this process)"


def cpu_now(server_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) for the server's processes and this one."""
    return {**cpu_by_process(server_pid), os.getpid(): (CLIENT, process_cpu_s(os.getpid()))}


def main(argv: list[str]) -> int:
    from bench import serving_client

    own, client_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's `serve run` PID (default: ~/.cache/rayllm-peers/ours.pid)")
    args = p.parse_args(own)
    server_pid = args.server_pid or int((PEERS_DIR / "ours.pid").read_text())
    before, started = cpu_now(server_pid), time.monotonic()
    result = serving_client.main(client_args)
    wall_s, rows = time.monotonic() - started, cpu_rows(before, cpu_now(server_pid))
    tokens = result.get("total_output_tokens", 0)
    print(format_cpu_table(rows, output_tokens=tokens))
    print(f"{tokens} output tokens in {wall_s:.1f} s; these processes used "
          f"{sum(row.cpu_s for row in rows) / wall_s:.0%} of one core")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
