"""A worker's decode step alone and beside a busy process, as it runs when served.

    .venv/bin/python -m bench.bench_interference                         # SmolLM2 fp32, 1 and 2 threads, batch 1 and 16
    .venv/bin/python -m bench.bench_interference --threads-list 2 --busy-ms 8 --period-ms 32

Served, the worker shares the machine with the ingress, the scheduler and Serve's proxy,
which wake for every step (about a quarter of one core at one stream on a 2-core machine).
A 1-thread worker loses little to them: they run on the other core. A worker with a thread
per core loses more than their share: when the OS takes one of its threads away, the other
one waits for it at the end of every parallel region. This runs decode steps of our runner
(batch --batch-sizes at --prompt-len tokens of context) in rounds, each round once alone and
once beside a process that busy-loops --busy-ms out of every --period-ms, and prints the
median step of each, so the two are measured side by side under the same machine state.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker actor sets them (workers/actor.py)
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from scheduler.sampling_params import SamplingParams  # noqa: E402
from workers.loader import resolve_model_path  # noqa: E402
from workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from workers.simple_driver import SimpleDriver  # noqa: E402

BUSY_LOOP = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < busy:
        pass
    time.sleep(max(0.0, period - busy))
"""


def median_step_ms(driver: SimpleDriver, runner: ModelRunner, seconds: float) -> float:
    steps = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        driver.step()
        steps.append(runner.last_timing.total_s)
    return statistics.median(steps) * 1e3


def measure(runner: ModelRunner, batch: int, prompt_len: int, rounds: int, seconds: float,
            busy_ms: float, period_ms: float) -> tuple[float, float]:
    """(median step ms alone, beside the busy loop), medians over rounds."""
    driver = SimpleDriver(runner, token_budget=max(2048, batch * prompt_len))
    max_tokens = int(2 * rounds * seconds * 1000 / 10) + 16  # more than the steps can take (>= 10 ms each)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for index in range(batch):
        prompt = torch.randint(3, runner.model_info.vocab_size, (prompt_len,), generator=generator).tolist()
        driver.add_request(f"b{batch}-{index}", prompt, params)
    driver.step()  # prefill
    alone, beside = [], []
    for _ in range(rounds):
        alone.append(median_step_ms(driver, runner, seconds))
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(busy_ms), str(period_ms)])
        try:
            time.sleep(0.05)
            beside.append(median_step_ms(driver, runner, seconds))
        finally:
            busy.kill()
            busy.wait()
    runner.reset()  # the next batch size starts from an empty pool
    return statistics.median(alone), statistics.median(beside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads-list", default="1,2")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--busy-ms", type=float, default=8.0)
    parser.add_argument("--period-ms", type=float, default=32.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    args = parser.parse_args()
    model = str(resolve_model_path(args.model))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"model {model} | {args.dtype} | beside: a busy loop {args.busy_ms:g} ms of every {args.period_ms:g} ms "
          f"({args.busy_ms / args.period_ms:.0%} of one core) | load average {os.getloadavg()[0]:.2f}", flush=True)
    for threads in (int(t) for t in args.threads_list.split(",")):
        blocks = max(batches) * -(-(args.prompt_len + 2 * args.rounds * int(args.seconds * 100) + 32) // 16) + 1
        runner = ModelRunner(RunnerConfig(model=model, dtype=args.dtype, num_blocks=blocks, num_threads=threads))
        for batch in batches:
            alone, beside = measure(runner, batch, args.prompt_len, args.rounds, args.seconds, args.busy_ms,
                                    args.period_ms)
            print(f"threads {threads} batch {batch:3d}: {alone:7.1f} ms alone, {beside:7.1f} ms beside "
                  f"({beside / alone - 1:+.0%})", flush=True)
        del runner


if __name__ == "__main__":
    main()
