"""Helpers shared by the worker tests: building runners and driving them (the HF oracle: tests/hf_oracle.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_oracle import NEAR_TIE_EPSILON, HfGreedy, HfOracle, assert_greedy_matches, prompts_of_lengths  # noqa: F401

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
