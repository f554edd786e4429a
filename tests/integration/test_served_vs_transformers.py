"""Served text against an independent reference: greedy fp32 completions of the default model
(SmolLM2-135M-Instruct) over real HTTP, through the ingress's chat template and tokenizer, the
scheduler and the worker's kernels, equal transformers' `generate` on the same prompts.

The app is a second one in the session's cluster, deployed for this module and deleted after.
Two fp32 computations in different orders can flip a near-tie: a differing text is accepted
only where transformers' own top-2 logit gap at the first differing token is below
NEAR_TIE_EPSILON (the runner tests' rule and value, tests/workers/runner_helpers.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

pytestmark = pytest.mark.slow

NEAR_TIE_EPSILON = 1e-3
APP = "hfcheck"
MAX_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
PROMPTS = ["The three laws of thermodynamics are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def client(server, smollm2_dir) -> Iterator[openai.OpenAI]:
    with server.second_app(APP, {"model": str(smollm2_dir), "served_model_name": "smollm2", "name": "rayllm-hfcheck",
                                 "dtype": "float32", "num_workers": 1, "worker_num_cpus": 1, "ingress_num_cpus": 0.1,
                                 "scheduler_num_cpus": 0.1, "num_kv_blocks": 256, "block_size": 16,
                                 "max_model_len": 1024}) as client:
        yield client


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tokenizer, model


def generate(reference, input_ids: list[int]) -> tuple[str, list[int], list[float]]:
    """transformers' greedy text, its token ids, and the top-2 logit gap at each step."""
    tokenizer, model = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([input_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
    new = out.sequences[0, len(input_ids):].tolist()
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.scores]
    return tokenizer.decode(new, skip_special_tokens=True), new, gaps


def assert_same_or_near_tie(served: str, reference, input_ids: list[int]) -> None:
    expected, tokens, gaps = generate(reference, input_ids)
    if served == expected:
        return
    tokenizer = reference[0]
    for step in range(len(tokens)):  # the first step whose text no longer prefixes the served text
        if not served.startswith(tokenizer.decode(tokens[: step + 1], skip_special_tokens=True)):
            assert gaps[step] < NEAR_TIE_EPSILON, (
                f"served {served!r} differs from transformers' {expected!r} at token {step}, "
                f"where its top-2 gap is {gaps[step]:.4f}")
            return
    raise AssertionError(f"served {served!r} is longer than transformers' {expected!r}")


def test_chat_completions_equal_transformers_generate(client: openai.OpenAI, reference) -> None:
    for messages in CHATS:
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0.0)
        input_ids = reference[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        input_ids = list(input_ids["input_ids"] if hasattr(input_ids, "keys") else input_ids)
        assert reply.usage.prompt_tokens == len(input_ids)  # the server's template and tokenizer, the same ids
        assert_same_or_near_tie(reply.choices[0].message.content, reference, input_ids)


def test_completions_equal_transformers_generate(client: openai.OpenAI, reference) -> None:
    for prompt in PROMPTS:
        reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        input_ids = reference[0](prompt)["input_ids"]
        assert reply.usage.prompt_tokens == len(input_ids)
        assert_same_or_near_tie(reply.choices[0].text, reference, input_ids)


def test_a_request_leaving_sampling_out_samples_as_the_model_card_says(client: openai.OpenAI) -> None:
    """The default model's generation_config.json carries its card's sampling (workers/loader.py), and a
    request without temperature or top_p gets those, not OpenAI's 1.0 (serve_app/sampling_defaults.py)."""
    model = client.models.list().data[0].to_dict()
    assert model["backend"]["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    request = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 24, "seed": 11}
    left_out = client.completions.create(**request).choices[0].text
    assert left_out == client.completions.create(**request, temperature=0.2, top_p=0.9).choices[0].text
