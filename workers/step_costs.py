"""A worker's step costs, timed on its own model before it serves (scheduler/step_costs.py says
what the scheduler makes of them).

    costs = measure_step_costs(runner)     # StepCosts, about a second for the default model

Five kinds of step, each timed twice (the faster counts), through the runner's real execute
and a SimpleDriver's blocks (the pool is empty before the first request: nothing cached is
touched, and every request ends, its blocks returned, before the worker serves):

    a prompt of SHORT_PROMPT tokens, and PROMPTS prompts of TYPICAL_PROMPT_TOKENS together
        -> prompt_token_ms: the second step's extra time over the first, per extra token
    a decode step of 1 sequence and one of DECODE_ROWS sequences
        -> decode_row_ms: the extra time per extra sequence; decode_step_ms: the rest

A pool too small for these steps, or a model too short for the prompts, measures with what
fits. The log shows the costs, and /v1/server_info reports them.
"""

from __future__ import annotations

import logging
import time

import torch

from scheduler.sampling_params import SamplingParams
from scheduler.step_costs import TYPICAL_PROMPT_TOKENS, StepCosts
from workers.simple_driver import SimpleDriver

logger = logging.getLogger(__name__)

SHORT_PROMPT = 32
PROMPTS = 2
DECODE_ROWS = 16
CONTEXT = 64  # tokens before the timed decode steps


def measure_step_costs(runner) -> StepCosts | None:
    """The runner's step costs; None where its pool or model length cannot hold the steps."""
    long_prompt = min(TYPICAL_PROMPT_TOKENS, runner.max_model_len - 4)
    blocks_needed = (PROMPTS * (long_prompt + 4) + DECODE_ROWS * (CONTEXT + 8)) // runner.block_size + DECODE_ROWS + 4
    if long_prompt <= SHORT_PROMPT or runner.num_blocks - 1 < blocks_needed:
        return None
    started = time.perf_counter()
    vocab = runner.model_info.vocab_size
    tokens = torch.randint(10, vocab - 10, (PROMPTS + DECODE_ROWS + 2, long_prompt),
                           generator=torch.Generator().manual_seed(0)).tolist()
    timed = {}
    for attempt in range(2):
        for name, prompts in (("short", [tokens[0][:SHORT_PROMPT]]),
                              ("long", [row[:long_prompt] for row in tokens[1:1 + PROMPTS]])):
            step_s = _prompt_step_s(runner, prompts)
            timed[name] = min(timed.get(name, step_s), step_s)
        for rows in (1, DECODE_ROWS):
            step_s = _decode_step_s(runner, [row[:CONTEXT] for row in tokens[2:2 + rows]])
            timed[rows] = min(timed.get(rows, step_s), step_s)
    extra_tokens = PROMPTS * long_prompt - SHORT_PROMPT
    row_ms = max(timed[DECODE_ROWS] - timed[1], 0.0) * 1e3 / (DECODE_ROWS - 1)
    costs = StepCosts(
        decode_step_ms=max(timed[1] * 1e3 - row_ms, 0.0),
        decode_row_ms=row_ms,
        prompt_token_ms=max(timed["long"] - timed["short"], 0.0) * 1e3 / extra_tokens,
        decode_rows=DECODE_ROWS,
    )
    logger.info("step costs (%.1f s to measure): %.2f ms a step + %.3f ms a decoding sequence + %.4f ms a prompt "
                "token; a %d-token prompt stalls %d streams for %.1f of their steps", time.perf_counter() - started,
                costs.decode_step_ms, costs.decode_row_ms, costs.prompt_token_ms, TYPICAL_PROMPT_TOKENS, DECODE_ROWS,
                costs.stall_steps())
    return costs


def _prompt_step_s(runner, prompts: list[list[int]]) -> float:
    """Seconds of the step that computes these prompts whole (then their one token is sampled)."""
    driver = SimpleDriver(runner, token_budget=sum(len(p) for p in prompts))
    for index, prompt in enumerate(prompts):
        driver.add_request(f"costs-prompt-{index}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    driver.step()
    spent = runner.last_timing.total_s
    driver.run()
    return spent


def _decode_step_s(runner, prompts: list[list[int]]) -> float:
    """Seconds of a decode step of len(prompts) sequences (after their prompts and a first decode)."""
    driver = SimpleDriver(runner, token_budget=sum(len(p) for p in prompts))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        driver.add_request(f"costs-decode-{index}", prompt, params)
    driver.step()  # the prompts
    driver.step()  # a first decode
    driver.step()
    spent = runner.last_timing.total_s
    driver.run()
    return spent
