"""Helpers shared by the worker tests: building runners and driving them (the HF oracle: tests/hf_oracle.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_oracle import NEAR_TIE_EPSILON, HfGreedy, HfOracle, assert_greedy_matches, prompts_of_lengths  # noqa: F401

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.sampling_params import SamplingParams
from workers.model_runner import ModelRunner, RunnerConfig
from workers.simple_driver import SimpleDriver

LOGPROB_TOLERANCE = 1e-3  # our logprobs against log_softmax of HF's logits


def make_runner(model_dir: Path, **overrides) -> ModelRunner:
    settings = dict(model=str(model_dir), dtype="float32", block_size=4, num_blocks=512, attention_backend="torch")
    settings.update(overrides)
    return ModelRunner(RunnerConfig(**settings))


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_requests(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 **driver_kwargs) -> list[list[int]]:
    """Drive all prompts together to completion; the output token ids, in prompt order."""
    driver = SimpleDriver(runner, **driver_kwargs)
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for index, (prompt, request_params) in enumerate(zip(prompts, params_list)):
        driver.add_request(f"r{index}", prompt, request_params)
    finished = driver.run()
    return [finished[f"r{index}"].output_token_ids for index in range(len(prompts))]


def assert_logprobs_match_hf(request, oracle: HfOracle, top_k: int) -> None:
    """A finished request's logprobs (sampled token and its top_k) equal log_softmax of HF's logits."""
    full = request.prompt_token_ids + request.output_token_ids
    hf_logprobs = torch.log_softmax(oracle.logits(full).float(), dim=-1)
    start = len(request.prompt_token_ids) - 1
    assert len(request.logprobs) == len(request.output_token_ids)
    for step, token_logprobs in enumerate(request.logprobs):
        expected = hf_logprobs[start + step]
        assert token_logprobs.token_id == request.output_token_ids[step]
        assert abs(token_logprobs.logprob - float(expected[token_logprobs.token_id])) < LOGPROB_TOLERANCE
        top_ids = [token_id for token_id, _ in token_logprobs.top]
        top_values = torch.tensor([value for _, value in token_logprobs.top])
        assert len(top_ids) == top_k
        torch.testing.assert_close(top_values, expected[top_ids], atol=LOGPROB_TOLERANCE, rtol=0)
        torch.testing.assert_close(top_values, expected.topk(top_k).values, atol=LOGPROB_TOLERANCE, rtol=0)


def run_with_logprobs(runner, prompts, params_list) -> list:
    """The finished requests of prompts run together with small steps (chunked prompts beside decodes)."""
    driver = SimpleDriver(runner, token_budget=24)  # forces chunked prefills next to decodes
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        driver.add_request(f"r{index}", prompt, params)
    return list(driver.run().values())


def engine_of(runner, on_runner_error=None, **overrides) -> Engine:
    """The real scheduler over the runner, as its ModelInfo describes it (recurrent states included), with
    a small step budget so that prompts are chunked."""
    info = runner.model_info
    settings = dict(max_num_batched_tokens=16, max_num_seqs=16, block_size=info.block_size,
                    num_blocks=info.num_blocks, max_model_len=256, recurrent_state=info.has_recurrent_state,
                    num_state_snapshots=info.num_state_snapshots)
    return Engine(SchedulerConfig(**dict(settings, **overrides)), runner, eos_token_ids=info.eos_token_ids,
                  on_runner_error=on_runner_error)


class DiesAfter:
    """A worker whose execute raises after `steps` steps, as a dead worker's call does."""

    def __init__(self, runner: ModelRunner, steps: int):
        self.runner, self.steps_left = runner, steps

    @property
    def model_info(self):
        return self.runner.model_info

    def execute(self, scheduler_output):
        self.steps_left -= 1
        if self.steps_left < 0:
            raise RuntimeError("the worker died")
        return self.runner.execute(scheduler_output)


def assert_a_dead_workers_requests_answer_as_transformers(runner: ModelRunner, oracle: HfOracle) -> None:
    """A worker dies mid-generation, chunked prompts beside decodes: its requests move to another
    worker (a second runner of the same model, whose pools hold nothing of them: recurrent states
    restart from zero there), and every answer is still transformers' greedy tokens."""
    prompts = prompts_of_lengths([30, 21, 17], runner.model_info.vocab_size, seed=7)
    live, migrations = engine_of(ModelRunner(runner.config)), []

    def migrate(engine: Engine, error: Exception) -> None:
        migrations.append(error)
        live.adopt(engine.take_for_migration())

    # 68 prompt tokens, 16 a step: the death comes after the first prompt's decodes began
    dying = engine_of(DiesAfter(runner, steps=4), on_runner_error=migrate)
    try:
        results = dying.generate(prompts, greedy(8))
    finally:
        dying.close()
        live.close()
    assert len(migrations) == 1
    for prompt, result in zip(prompts, results):
        assert_greedy_matches(result.sequences[0].token_ids, oracle.greedy(prompt, 8))


def assert_hits_forks_and_preemption_answer_as_transformers(runner: ModelRunner, oracle: HfOracle) -> None:
    """Through the real scheduler, every answer transformers' greedy tokens: a 30-token prompt sent twice
    and then extended, both times a prefix hit of 28 tokens (7 blocks of 4; a recurrent model restores
    its states' snapshot there); an n=3 fork; three prompts in a pool too small for them (preemption);
    a worker's death mid-generation (migration).
    The runner: blocks of 4, 400 blocks."""
    prefix, tail, *others = prompts_of_lengths([30, 5, 21, 17, 26], runner.model_info.vocab_size, seed=5)
    engine = engine_of(runner)
    assert engine.generate([prefix], greedy(8))[0].num_cached_tokens == 0
    for prompt in (prefix, prefix + tail):
        hit = engine.generate([prompt], greedy(8))[0]
        assert hit.num_cached_tokens == 28
        assert_greedy_matches(hit.sequences[0].token_ids, oracle.greedy(prompt, 8))
    forked = engine_of(runner).generate([others[0]], greedy(8, n=3))[0].sequences
    assert len(forked) == 3
    for sequence in forked:
        assert_greedy_matches(sequence.token_ids, oracle.greedy(others[0], 8))
    small = engine_of(runner, num_blocks=24, max_model_len=64)  # 23 usable blocks: the three cannot all fit
    tight = small.generate(others, greedy(16))
    assert small.stats.num_preemptions > 0
    for prompt, result in zip(others, tight):
        assert_greedy_matches(result.sequences[0].token_ids, oracle.greedy(prompt, 16))
    assert_a_dead_workers_requests_answer_as_transformers(runner, oracle)
