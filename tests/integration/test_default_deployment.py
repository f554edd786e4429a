"""What ships, served: the default model as deploy/serve.yaml deploys it (the Q4_1 GGUF kept in its
blocks, fp32 activations rounded to int8 per block in decode steps and to bf16 in prompt steps
where there are AMX tiles, an fp16 KV pool, this CPU's kernels), asked the README's question over
real HTTP with the official client.

The other served-model tests force dtype float32, which serves the dequantized weights; this one
keeps the shipped path. It asserts the README's answer, greedy (a request computed whole, then
the same one from the prefix cache, which runs other kernels) and as a request that leaves the
sampling out gets it (the model card's temperature 0.2, top_p 0.9). And it measures the shipped
path's rounding against transformers' fp32 run of the same weights dequantized: at every token of
greedy answers (decode steps, as most served tokens are), transformers, fed the same tokens, names
the same most likely one at least AGREEMENT of the time.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.slow

APP = "shipped"
QUESTION = [{"role": "user", "content": "What is the capital of Germany?"}]  # the README's
# llama.cpp's own "same top" on this file (bench/gguf_accuracy.py) is about 0.975; a margin below
AGREEMENT = 0.96
ASKS = ["Explain how a hash table works.", "Write a short poem about the sea.", "What causes the seasons on Earth?",
        "Give three tips for learning a new language.", "Describe the water cycle.",
        "Why is the sky blue?", "How do vaccines work?", "Summarize the plot of Romeo and Juliet."]


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    # deploy/serve.yaml's model, quantization and dtype; resources sized for the test cluster
    with server.second_app(APP, {"model": "default", "quantization": "auto", "dtype": "auto", "name": "rayllm-shipped",
                                 "num_workers": 1, "worker_num_cpus": 1, "ingress_num_cpus": 0.1, "scheduler_num_cpus": 0.1,
                                 "num_kv_blocks": 128, "block_size": 16, "max_model_len": 1024}) as client:
        yield client


def test_the_shipped_deployment_serves_the_gguf_weights(client: openai.OpenAI) -> None:
    backend = client.models.list().data[0].to_dict()["backend"]
    assert backend["quantization"] == "gguf:Q4_1" and backend["device"] == "cpu"
    assert backend["kv_cache_dtype"] == "float16"
    assert backend["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}


def test_the_readme_question_gets_the_readme_answer(client: openai.OpenAI) -> None:
    for attempt in ("computed whole", "from the prefix cache"):
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                                               temperature=0)
        assert "Berlin" in reply.choices[0].message.content, (attempt, reply.choices[0].message.content)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the second one did come from the cache
    # sampled as the card says: the first token's runner-up ("Der", 0.54 nats behind "The" on an AMX
    # Xeon) is drawn about 1 time in 15 at temperature 0.2, and need not lead to Berlin
    answers = [client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                                              seed=seed).choices[0].message.content for seed in range(3)]
    assert sum("Berlin" in answer for answer in answers) >= 2, answers


def test_greedy_tokens_agree_with_transformers_fp32_of_the_same_weights(client: openai.OpenAI, smollm2_dir) -> None:
    """Each served token is what the reference finds most likely after the same tokens, at least
    AGREEMENT of the time over a few hundred decode positions. The served tokens are read back
    exactly from their logprobs' bytes. On an AMX Xeon (2026-11-29) 379 of 384 agree (0.987);
    broken on purpose it fails: 0.839 with the GGUF kernels' activations rounded to 4 bits
    instead of 8, 0.854 with a KV pool that keeps 2 of fp16's 10 mantissa bits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve_app.tokenizer import _byte_level_decoder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    byte_decoder = _byte_level_decoder(tokenizer)
    assert byte_decoder is not None
    id_of_bytes = {bytes(byte_decoder[char] for char in piece): token_id
                   for piece, token_id in tokenizer.get_vocab().items() if all(char in byte_decoder for char in piece)}
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    agreed = positions = 0
    for ask in ASKS:
        messages = [{"role": "user", "content": ask}]
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=48,
                                               temperature=0, logprobs=True)
        served = [id_of_bytes[bytes(entry.bytes)] for entry in reply.choices[0].logprobs.content]
        prompt = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + served])).logits[0]
        expected = logits[len(prompt) - 1:len(prompt) - 1 + len(served)].argmax(-1).tolist()
        agreed += sum(a == b for a, b in zip(served, expected))
        positions += len(served)
    assert positions >= 200
    assert agreed / positions >= AGREEMENT, f"{agreed} of {positions} positions agree"
