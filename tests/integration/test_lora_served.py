"""LoRA adapters served over real HTTP on the session's Ray cluster, called with the official
`openai` client: /v1/models lists each adapter with the base as its parent; requests for the
base and for three adapters, sent at once (so they share steps), give peft's own greedy tokens
in fp32; a repeated prompt hits the prefix cache under its own adapter and never under
another's; an unknown adapter is a 404 in OpenAI's shape, and the next request goes on.

The same holds for Qwen3 and Gemma 3 checkpoints, each served as its own app with an adapter
on all seven projections. A further app has 2 workers, 8 adapters and room for 4 on each worker: requests go where their
adapter is loaded, so each adapter is loaded once; an adapter loaded at run time
(/v1/load_lora_adapter) serves peft's tokens, and once unloaded it is a 404.

The apps are this module's own (route prefixes /lora...), deleted at the end."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from families_catalog import FAMILIES
from hf_oracle import HfOracle, prompts_of_lengths, token_ids_of_texts
from lora_adapters import ADAPTERS, ALL_TARGETS, build_adapter, build_adapters
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig

pytestmark = pytest.mark.slow

APP, PREFIX = "lora", "rayllm-lora"
ROUTED_APP, ROUTED_PREFIX = "lora2", "rayllm-lora2"
SMALL_APP = {"served_model_name": "tiny", "worker_placement": "none", "ingress_num_cpus": 0.1,
             "scheduler_num_cpus": 0.1, "num_kv_blocks": 128, "block_size": 16, "dtype": "float32"}
MAX_TOKENS = 12
PROMPT_LENGTHS = [6, 21, 35, 18]  # the base, then each adapter in ADAPTERS' order


@pytest.fixture(scope="module")
def lora_app(server, tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, dict[str, Path]]]:
    from ray import serve

    from serve_app.app import build_app

    adapters = build_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    app = build_app({"model": str(tiny_model_dir), "name": PREFIX, "num_workers": 1, "worker_num_cpus": 0.5,
                     "lora_adapters": {name: str(path) for name, path in adapters.items()}, **SMALL_APP})
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    client = openai.OpenAI(base_url=f"{server.direct_url_of(APP)}/{APP}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    try:
        yield client, adapters
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)


def greedy(client: openai.OpenAI, model: str, prompt: list[int]):
    """One greedy completion of a token prompt, with the sampled tokens' texts."""
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                     extra_body={"ignore_eos": True})


def assert_pefts_tokens(completion, model: str, prompt: list[int], base: Path, adapter: Path | None) -> None:
    """The completion's greedy tokens of prompt under model equal peft's with the adapter (None:
    transformers' base model)."""
    assert completion.model == model
    ids_of = token_ids_of_texts(base)
    tokens = [ids_of[text] for text in completion.choices[0].logprobs.tokens]
    assert tokens == HfOracle(base, adapter).greedy(prompt, MAX_TOKENS).token_ids, model


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

    with ThreadPoolExecutor(len(names)) as pool:
        completions = list(pool.map(lambda pair: greedy(client, *pair), zip(names, prompts)))
    for name, prompt, completion in zip(names, prompts, completions):
        assert_pefts_tokens(completion, name, prompt, tiny_model_dir, adapters.get(name))


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_other_families_serve_pefts_tokens(server, family: str, tmp_path: Path) -> None:
    from ray import serve

    from serve_app.app import build_app

    base = build_tiny_model_dir(tmp_path / family, **FAMILIES[family])
    adapter = build_adapter(base, tmp_path / "adapter", ALL_TARGETS, 8, 16, seed=3)
    app_name = f"lora-{family.replace('_', '-')}"
    serve.run(build_app({"model": str(base), "name": f"rayllm-{app_name}", "num_workers": 1, "worker_num_cpus": 0.25,
                         "lora_adapters": {"ft": str(adapter)}, **SMALL_APP}), name=app_name, route_prefix=f"/{app_name}")
    try:
        client = openai.OpenAI(base_url=f"{server.direct_url_of(app_name)}/{app_name}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        [prompt] = prompts_of_lengths([23], ModelConfig.from_model_dir(base).vocab_size, seed=17)
        assert_pefts_tokens(greedy(client, "ft", prompt), "ft", prompt, base, adapter)
    finally:
        serve.delete(app_name)


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


@pytest.fixture(scope="module")
def routed_app(server, tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[str, dict[str, Path], Path]]:
    """(base url, 8 adapters served from the start, one more to load at run time)"""
    from ray import serve

    from serve_app.app import build_app

    root = tmp_path_factory.mktemp("adapters8")
    adapters = {f"l{i}": build_adapter(tiny_model_dir, root / f"l{i}", ("q_proj", "v_proj"), 4, 8, seed=i)
                for i in range(8)}
    late = build_adapter(tiny_model_dir, root / "late", ("o_proj", "down_proj"), 8, 16, seed=99)
    app = build_app({"model": str(tiny_model_dir), "name": ROUTED_PREFIX, "num_workers": 2, "worker_num_cpus": 0.25,
                     "max_cpu_loras": 4, "max_loras": 4, "allow_runtime_lora_updates": True,
                     "lora_adapters": {name: str(path) for name, path in adapters.items()}, **SMALL_APP})
    serve.run(app, name=ROUTED_APP, route_prefix=f"/{ROUTED_APP}")
    try:
        yield f"{server.direct_url_of(ROUTED_APP)}/{ROUTED_APP}", adapters, late
    finally:
        if ROUTED_APP in serve.status().applications:
            serve.delete(ROUTED_APP)


def routing_stats() -> dict:
    import ray

    from scheduler.actor import ACTOR_NAMESPACE, scheduler_actor_name

    scheduler = ray.get_actor(scheduler_actor_name(ROUTED_PREFIX, 0), namespace=ACTOR_NAMESPACE)
    return ray.get(scheduler.routing_stats.remote(), timeout=60)


def test_requests_go_where_their_adapter_is_loaded_and_load_only_on_misses(routed_app) -> None:
    url, adapters, _ = routed_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    order = [name for _ in range(3) for name in random.Random(5).sample(sorted(adapters), len(adapters))]
    for name in order:  # one at a time: each adapter's first request is its only miss
        completion = client.completions.create(model=name, prompt=f"Adapter {name} says", max_tokens=2,
                                               temperature=0.0)
        assert completion.model == name
    stats = routing_stats()
    held = stats["lora_adapters_per_worker"]
    assert sorted(len(names) for names in held) == [4, 4] and set(held[0]) | set(held[1]) == set(adapters), held
    assert stats["lora_route_counts"] == {"load": 8, "hit": 16}, stats["lora_route_counts"]
    assert sum(stats["lora_loads_per_worker"]) == 8, stats["lora_loads_per_worker"]
    print(f"adapter hit rate {16 / len(order):.2f} over {len(order)} requests (8 adapters, 2 workers x 4 slots)")


def test_an_adapter_loaded_at_run_time_serves_pefts_tokens_until_unloaded(routed_app, tiny_model_dir: Path) -> None:
    url, _, late = routed_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    with httpx.Client(base_url=url, timeout=120) as http:
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": str(late.parent / "none")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late)})
        assert loaded.status_code == 200, loaded.text
        assert "late" in {model.id for model in client.models.list().data}
        [prompt] = prompts_of_lengths([19], ModelConfig.from_model_dir(tiny_model_dir).vocab_size, seed=13)
        assert_pefts_tokens(greedy(client, "late", prompt), "late", prompt, tiny_model_dir, late)
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert unloaded.status_code == 200, unloaded.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    assert "late" not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="Hello", max_tokens=2)
