"""Our model's logprobs (sampled token and top-k) equal log_softmax of Hugging Face's logits,
for each supported architecture variant, through the whole paged runner path."""

from __future__ import annotations

import pytest
import torch
from runner_helpers import HfOracle, assert_logprobs_match_hf, make_runner, prompts_of_lengths, run_with_logprobs
from tiny_model import build_tiny_model_dir

from scheduler.sampling_params import SamplingParams

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
        assert_logprobs_match_hf(request, oracle, TOP_K)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_logprobs_match_hf(variant, tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / variant, **VARIANTS[variant])
    runner = make_runner(model_dir)
    oracle = HfOracle(model_dir)
    prompts = prompts_of_lengths([70, 9], runner.model_info.vocab_size, seed=4)  # 70 > llama3's original 64
    for request in run_with_logprobs(runner, prompts, mixed_params()[:2]):
        assert_logprobs_match_hf(request, oracle, TOP_K)


@pytest.mark.slow
def test_smollm2_logprobs_match_hf(smollm2_dir):
    runner = make_runner(smollm2_dir, block_size=16, num_blocks=64)
    oracle = HfOracle(smollm2_dir)
    prompts = prompts_of_lengths([40, 11, 25], runner.model_info.vocab_size, seed=5)
    for request in run_with_logprobs(runner, prompts, mixed_params()):
        assert_logprobs_match_hf(request, oracle, TOP_K)
