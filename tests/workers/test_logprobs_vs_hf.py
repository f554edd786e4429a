"""Our model's logprobs (sampled token and top-k) equal log_softmax of Hugging Face's logits,
for each supported architecture variant, through the whole paged runner path."""

from __future__ import annotations

import pytest
import torch
from runner_helpers import HfOracle, make_runner, prompts_of_lengths
from tiny_model import build_tiny_model_dir

from scheduler.sampling_params import SamplingParams
from workers.simple_driver import SimpleDriver

LOGPROB_TOLERANCE = 1e-3
TOP_K = 5

VARIANTS = {
    "llama-tied-llama3-rope-biases": dict(
        model_type="llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "llama-linear-rope": dict(model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 2.0}),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1),
    "mistral-head-dim-32": dict(model_type="mistral", head_dim=32, sliding_window=None),
}


def assert_logprobs_match_hf(request, oracle: HfOracle):
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
        assert len(top_ids) == TOP_K
        torch.testing.assert_close(top_values, expected[top_ids], atol=LOGPROB_TOLERANCE, rtol=0)
        torch.testing.assert_close(top_values, expected.topk(TOP_K).values, atol=LOGPROB_TOLERANCE, rtol=0)


def run_with_logprobs(runner, prompts, params_list):
    driver = SimpleDriver(runner, token_budget=24)  # forces chunked prefills next to decodes
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        driver.add_request(f"r{index}", prompt, params)
    return list(driver.run().values())


def mixed_params():
    return [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=TOP_K),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True, logprobs=TOP_K),
    ]


@pytest.mark.parametrize("linear_backend", ["torch", "onednn"])
def test_tiny_llama_logprobs_match_hf(tiny_model_dir, linear_backend):
    runner = make_runner(tiny_model_dir, linear_backend=linear_backend)
    oracle = HfOracle(tiny_model_dir)
    prompts = prompts_of_lengths([5, 30, 13], runner.model_info.vocab_size, seed=3)
    for request in run_with_logprobs(runner, prompts, mixed_params()):
        assert_logprobs_match_hf(request, oracle)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_logprobs_match_hf(variant, tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / variant, **VARIANTS[variant])
    runner = make_runner(model_dir)
    oracle = HfOracle(model_dir)
    prompts = prompts_of_lengths([70, 9], runner.model_info.vocab_size, seed=4)  # 70 > llama3's original 64
    for request in run_with_logprobs(runner, prompts, mixed_params()[:2]):
        assert_logprobs_match_hf(request, oracle)


@pytest.mark.slow
def test_smollm2_logprobs_match_hf(smollm2_dir):
    runner = make_runner(smollm2_dir, block_size=16, num_blocks=64)
    oracle = HfOracle(smollm2_dir)
    prompts = prompts_of_lengths([40, 11, 25], runner.model_info.vocab_size, seed=5)
    for request in run_with_logprobs(runner, prompts, mixed_params()):
        assert_logprobs_match_hf(request, oracle)
