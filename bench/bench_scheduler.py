"""Scheduler step overhead with a runner that returns instantly (no model), pure Python.

    .venv/bin/python bench/bench_scheduler.py [--requests 256] [--steps 2000] [--repeats 5]

Fills the running batch with N requests (prompt `--prompt-len` tokens, never finishing within
the run), then times steady-state decode steps: schedule() + runner + update_from_output().
Each step every request gets one token; every block_size steps every request also allocates
a block and hashes the block it filled. Reports ms per step (median and mean over the timed
steps, best of `--repeats` runs) for prefix caching on and off, and the load average, since
the machine is shared. Target: under 2 ms per step at 256 running requests.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import InstantRunner


def build(num_requests: int, prompt_len: int, num_steps: int, prefix_caching: bool) -> tuple[Scheduler, InstantRunner]:
    block_size = 16
    max_len = prompt_len + num_steps + 64
    blocks_per_seq = -(-max_len // block_size)
    config = SchedulerConfig(
        max_num_batched_tokens=8192,
        max_num_seqs=num_requests,
        block_size=block_size,
        num_blocks=num_requests * blocks_per_seq + 1,
        max_model_len=max_len,
        enable_prefix_caching=prefix_caching,
    )
    scheduler = Scheduler(config)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 32)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 50000 for j in range(prompt_len)]
        scheduler.add_request(EngineRequest(f"req-{i}", prompt, params))
    runner = InstantRunner()
    while scheduler.num_running_seqs < num_requests or any(
        r.num_output_tokens == 0 for r in scheduler.running
    ):  # admit everyone and finish every prefill
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
    return scheduler, runner


def time_steps(scheduler: Scheduler, runner: InstantRunner, num_steps: int) -> tuple[list[float], float, float]:
    """Per-step wall times (s), and the total time spent in schedule() and update (s)."""
    step_times = []
    t_schedule = t_update = 0.0
    gc.collect()
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner_out = runner.execute(out)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, runner_out)
        t3 = time.perf_counter()
        assert len(out.num_scheduled_tokens) == scheduler.num_running_seqs
        step_times.append(t3 - t0)
        t_schedule += t1 - t0
        t_update += t3 - t2
    return step_times, t_schedule, t_update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    print(f"{args.requests} running requests, prompt {args.prompt_len}, {args.steps} decode steps, best of {args.repeats}")
    for prefix_caching in (True, False):
        runs = []
        for _ in range(args.repeats):
            scheduler, runner = build(args.requests, args.prompt_len, args.steps, prefix_caching)
            times, t_sched, t_upd = time_steps(scheduler, runner, args.steps)
            runs.append((statistics.median(times), statistics.fmean(times), t_sched / args.steps, t_upd / args.steps))
        median_ms, mean_ms, sched_ms, upd_ms = (min(r[i] for r in runs) * 1e3 for i in range(4))
        print(
            f"prefix_caching={prefix_caching!s:5}: ms/step median {median_ms:.3f}, mean {mean_ms:.3f} "
            f"(schedule {sched_ms:.3f} + update {upd_ms:.3f}); each the best of {args.repeats} runs"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
