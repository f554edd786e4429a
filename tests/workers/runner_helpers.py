"""Helpers shared by the worker tests: building runners, driving them, and the HF oracle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scheduler.sampling_params import SamplingParams
from workers.model_runner import ModelRunner, RunnerConfig
from workers.simple_driver import SimpleDriver

# fp32 batching can flip a near-tie: a differing greedy token is accepted only where
# the reference's top-2 logit gap was below this
NEAR_TIE_EPSILON = 1e-3
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


@dataclass
class HfGreedy:
    token_ids: list[int]
    logits: list[torch.Tensor]  # [vocab] raw logits at each generated position


class HfOracle:
    """transformers' LlamaForCausalLM (or Qwen2/Mistral) on the same weights."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> HfGreedy:
        """HF generate greedy, one prompt at a time (no padding), with the logits of each step."""
        generated = self.model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
        return HfGreedy(generated.sequences[0, len(prompt):].tolist(), [step[0] for step in generated.logits])

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] raw logits of one full forward."""
        return self.model(torch.tensor([token_ids])).logits[0]


def assert_greedy_matches(ours: list[int], reference: HfGreedy, epsilon: float = NEAR_TIE_EPSILON) -> int:
    """Equal tokens, or a first difference at a near-tie (after which the sequences may diverge).
    Returns how many leading tokens matched."""
    for position, (our_token, hf_token) in enumerate(zip(ours, reference.token_ids)):
        if our_token != hf_token:
            top2 = reference.logits[position].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < epsilon, (
                f"greedy token {position} differs (ours {our_token}, HF {hf_token}) and HF's top-2 "
                f"logit gap there is {gap:.3g} >= {epsilon}: not a near-tie"
            )
            return position
    assert len(ours) == len(reference.token_ids), (len(ours), len(reference.token_ids))
    return len(ours)


def prompts_of_lengths(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (special ids 0-2 excluded) of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


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
