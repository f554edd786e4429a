"""LoRA adapters served over real HTTP on the session's Ray cluster, called with the official
`openai` client: /v1/models lists each adapter with the base as its parent; requests for the
base and for three adapters, sent at once (so they share steps), give peft's own greedy tokens
in fp32; a repeated prompt hits the prefix cache under its own adapter and never under
another's; an unknown adapter is a 404 in OpenAI's shape, and the next request goes on.

The app is this module's own (route prefix /lora), deleted at the end."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from hf_oracle import HfOracle, prompts_of_lengths, token_ids_of_texts
from lora_adapters import ADAPTERS, build_adapters

from workers.config import ModelConfig

pytestmark = pytest.mark.slow

APP, PREFIX = "lora", "rayllm-lora"
MAX_TOKENS = 12
PROMPT_LENGTHS = [6, 21, 35, 18]  # the base, then each adapter in ADAPTERS' order


@pytest.fixture(scope="module")
def lora_app(server, tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, dict[str, Path]]]:
    from ray import serve

    from serve_app.app import build_app

    adapters = build_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    app = build_app({
        "model": str(tiny_model_dir), "served_model_name": "tiny", "name": PREFIX, "num_workers": 1,
        "worker_num_cpus": 0.5, "worker_placement": "none", "ingress_num_cpus": 0.1, "scheduler_num_cpus": 0.1,
        "num_kv_blocks": 128, "block_size": 16, "dtype": "float32",
        "lora_adapters": {name: str(path) for name, path in adapters.items()},
    })
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    client = openai.OpenAI(base_url=f"{server.direct_url_of(APP)}/{APP}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    try:
        yield client, adapters
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)


def test_models_lists_each_adapter_with_the_base_as_its_parent(lora_app) -> None:
    client, adapters = lora_app
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {"tiny", *ADAPTERS}
    assert models["tiny"].parent is None
    for name, path in adapters.items():
        assert (models[name].parent, models[name].root) == ("tiny", str(path))


def test_base_and_three_adapters_at_once_give_pefts_greedy_tokens(lora_app, tiny_model_dir: Path) -> None:
    client, adapters = lora_app
    names = ["tiny", *adapters]
    prompts = prompts_of_lengths(PROMPT_LENGTHS, ModelConfig.from_model_dir(tiny_model_dir).vocab_size, seed=11)

    def complete(name_and_prompt):
        name, prompt = name_and_prompt
        return client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                         logprobs=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(names)) as pool:
        completions = list(pool.map(complete, zip(names, prompts)))
    ids_of = token_ids_of_texts(tiny_model_dir)
    for name, prompt, completion in zip(names, prompts, completions):
        assert completion.model == name
        tokens = [ids_of[text] for text in completion.choices[0].logprobs.tokens]
        oracle = HfOracle(tiny_model_dir, None if name == "tiny" else adapters[name])
        assert tokens == oracle.greedy(prompt, MAX_TOKENS).token_ids, name


def test_a_prefix_is_cached_under_its_own_adapter_only(lora_app, tiny_model_dir: Path) -> None:
    client, _ = lora_app
    [prompt] = prompts_of_lengths([40], ModelConfig.from_model_dir(tiny_model_dir).vocab_size, seed=12)

    def cached(model: str) -> int:
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0)
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached("qv") == 0
    assert cached("all") == 0 and cached("tiny") == 0  # the same tokens under another adapter: nothing shared
    assert cached("qv") == 32  # its own two full blocks of 16


def test_an_unknown_adapter_is_a_404_and_the_next_request_goes_on(lora_app) -> None:
    client, _ = lora_app
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-adapter", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert caught.value.body["code"] == "model_not_found" and "'qv'" in caught.value.body["message"]
    reply = client.chat.completions.create(model="mlp", max_tokens=4, temperature=0.0,
                                           messages=[{"role": "user", "content": "Hello"}])
    assert reply.model == "mlp" and reply.choices[0].finish_reason in ("length", "stop")
