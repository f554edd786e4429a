"""What sampling adds to a decode step: greedy steps against sampled ones, side by side.

    .venv/bin/python -m bench.bench_runner --sampling                       # auto dtype, 2 threads, batch 1 and 16
    .venv/bin/python -m bench.bench_runner --sampling --dtypes float32,bfloat16 --batch-sizes 1,16

For each dtype and batch size, in one process: rounds of decode steps (ModelRunner.execute,
everything included), greedy and then sampled (temperature 1.0, top_p 0.95, what chat clients
send), alternating so both see the same machine. Reported: the median step of each, their
ratio (the target is <= 1.1 at batch 1 and 16), and the sampler's own median time
inside the greedy steps (an argmax) and the sampled ones. The sequences decode from random prompts of --prompt-len tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from bench.step_breakdown import add_random_prompts
from scheduler.sampling_params import SamplingParams
from workers.model_runner import ModelRunner, RunnerConfig
from workers.simple_driver import SimpleDriver

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95)


@dataclass
class SamplingCost:
    dtype: str
    threads: int
    batch: int
    greedy_s: float  # median greedy decode step
    sampled_s: float  # median sampled decode step
    greedy_sampler_s: float  # median time in the sampler (argmax), greedy steps
    sampler_s: float  # median time in the sampler, sampled steps

    def row(self) -> str:
        return (f"{self.dtype:>8} | {self.threads:>7} | {self.batch:>5} | {self.greedy_s * 1e3:9.2f} | "
                f"{self.sampled_s * 1e3:10.2f} | {self.sampled_s / self.greedy_s:7.3f} | "
                f"{self.greedy_sampler_s * 1e3:8.3f} / {self.sampler_s * 1e3:6.3f}")


HEADER = (f"{'dtype':>8} | {'threads':>7} | {'batch':>5} | {'greedy ms':>9} | {'sampled ms':>10} | "
          f"{'ratio':>7} | sampler ms, greedy / sampled")


def decode_timings(runner: ModelRunner, batch: int, prompt_len: int, num_steps: int, params: SamplingParams,
                   seed: int) -> list:
    """The runner's StepTiming of num_steps decode steps of batch sequences (after a warm one)."""
    params = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            max_tokens=num_steps + 2, ignore_eos=True)
    driver = SimpleDriver(runner, token_budget=max(2048, batch * prompt_len))
    add_random_prompts(driver, batch, prompt_len, params, seed=seed, prefix=f"s{seed}-")
    driver.step()  # the prompts
    driver.step()  # a first decode (warm)
    timings = []
    for _ in range(num_steps):
        driver.step()
        timings.append(runner.last_timing)
    while driver.has_unfinished:
        driver.step()
    return timings


def run(model_dir: str, dtypes: list[str], threads: int, batches: list[int], prompt_len: int, num_steps: int = 16,
        rounds: int = 3) -> list[SamplingCost]:
    torch.set_num_threads(threads)
    results = []
    for dtype in dtypes:
        blocks = max(batches) * (-(-(prompt_len + num_steps + 8) // 16)) + 1
        runner = ModelRunner(RunnerConfig(model=model_dir, dtype=dtype, num_blocks=blocks))
        for batch in batches:
            greedy, sampled = [], []
            for round_index in range(rounds):
                greedy += decode_timings(runner, batch, prompt_len, num_steps, GREEDY, seed=round_index)
                sampled += decode_timings(runner, batch, prompt_len, num_steps, SAMPLED, seed=round_index)
            results.append(SamplingCost(runner.dtype_name, threads, batch,
                                        statistics.median(t.total_s for t in greedy),
                                        statistics.median(t.total_s for t in sampled),
                                        statistics.median(t.sample_s for t in greedy),
                                        statistics.median(t.sample_s for t in sampled)))
            print(results[-1].row(), flush=True)
        del runner
    return results
