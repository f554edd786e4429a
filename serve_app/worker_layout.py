"""`num_workers: auto`: how many CPU workers, with how many threads each, for this machine.

One worker with a thread per core, on every CPU: one batch reads the weights once per step
where two batches read them twice, and a lone stream gets every core. Measured served, side by
side, on 2-core VMs (bench/bench_http.py, deploy/serve.yaml otherwise as shipped):

- Zen 4 (AVX512_BF16, bf16), after the AVX-512 panel GEMM put both threads of a worker to
  use (before it, oneDNN's bf16 GEMM ran slower on two threads than on one, and one worker
  per core won): 1 x 2 served 65.6 output tok/s at one stream against 55.0 for 2 x 1, with
  time to first token 218 against 382 ms (p50); at 16 streams 208.9 / 193.2 against
  213.5 / 211.8 (two alternating runs each), ITL p99 103 / 279 ms against 395 / 209;
- an AVX2-only Zen 3 (fp32): 1 x 2 served 107.4 / 85.5 tok/s at 16 streams against 82.6 /
  83.2 for 2 x 1, 23.4 / 18.6 against 18.2 / 21.4 at one stream.

The worker gets what the ingress replicas and scheduler actors leave of the node's CPUs (Ray's
accounting; the threads are what computes). The rule is what was measured on 2-core machines;
on larger ones, or with GPUs, set num_workers (and worker_num_cpus, worker_num_threads)
yourself. The app builder resolves it once, on the node it runs on, and hands concrete
numbers to every deployment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLayout:
    num_workers: int
    worker_num_cpus: float  # per worker, Ray's accounting
    worker_num_threads: int  # torch threads per worker


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_worker_layout(num_cpus: int, reserved_cpus: float) -> WorkerLayout:
    """The layout `num_workers: auto` stands for (see the module doc). reserved_cpus: what the
    ingress replicas and scheduler actors take of the node."""
    spare = num_cpus - reserved_cpus
    if spare <= 0:
        raise ValueError(
            f"num_workers: auto found {num_cpus} CPUs, and the ingress and scheduler take {reserved_cpus:g} of "
            "them: nothing is left for a worker; lower ingress_num_cpus / scheduler_num_cpus or set num_workers"
        )
    return WorkerLayout(num_workers=1, worker_num_cpus=spare, worker_num_threads=num_cpus)
