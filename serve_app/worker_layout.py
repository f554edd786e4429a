"""`num_workers: auto`: how many CPU workers, with how many threads each, for this machine.

Two layouts share a small CPU node, and each wins on one kind of CPU (docs/benchmarks.md,
both measured served, side by side, on 2-core VMs):

- one worker per core, one thread each, on CPUs with native bf16 (AVX512_BF16 or AMX, where
  `dtype: auto` is bf16): on a Zen 4 VM, bf16, 2 x 1 served 239.3 output tok/s at 16
  concurrent streams against 176.7 for 1 x 2, and 52.4 against 32.7 at one stream (one
  process with two threads ran slower there than one with one);
- one worker with a thread per core elsewhere (fp32): on an AVX2-only Zen 3 VM, 1 x 2 served
  107.4 / 85.5 tok/s at 16 streams against 82.6 / 83.2 for 2 x 1 (two paired runs), 23.4 /
  18.6 against 18.2 / 21.4 at one stream, with a lower time to first token: one batch
  reads the fp32 weights (538 MB for SmolLM2) once per step where two batches read them
  twice, and a lone stream gets both cores.

Either way the workers get what the ingress replicas and scheduler actors leave of the
node's CPUs (Ray's accounting; the threads are what computes). The rule is what was measured
on 2-core machines; on larger ones, or with GPUs, set num_workers (and worker_num_cpus,
worker_num_threads) yourself. The app builder resolves it once, on the node it runs on, and
hands concrete numbers to every deployment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # what torch's bf16 probes look for (workers/model_runner.py)


@dataclass(frozen=True, slots=True)
class WorkerLayout:
    num_workers: int
    worker_num_cpus: float  # per worker, Ray's accounting
    worker_num_threads: int  # torch threads per worker


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_worker_layout(num_cpus: int, native_bf16: bool, reserved_cpus: float) -> WorkerLayout:
    """The layout `num_workers: auto` stands for (see the module doc). reserved_cpus: what the
    ingress replicas and scheduler actors take of the node."""
    spare = num_cpus - reserved_cpus
    if spare <= 0:
        raise ValueError(
            f"num_workers: auto found {num_cpus} CPUs, and the ingress and scheduler take {reserved_cpus:g} of "
            "them: nothing is left for a worker; lower ingress_num_cpus / scheduler_num_cpus or set num_workers"
        )
    if native_bf16:
        return WorkerLayout(num_workers=num_cpus, worker_num_cpus=spare / num_cpus, worker_num_threads=1)
    return WorkerLayout(num_workers=1, worker_num_cpus=spare, worker_num_threads=num_cpus)
