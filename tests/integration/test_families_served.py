"""Every model family served over real HTTP: greedy fp32 tokens equal transformers' own model.

Each entry of tests/families_catalog.py's SERVED_FAMILIES, a tiny random checkpoint built with
transformers' own classes, is served as its own app in the session's cluster (an app serves one
model), on the default CPU path (our C kernels and C layer loop). The apps start together, a
wave at a time, each on a sliver of a CPU, and are deleted after the wave's requests. Per family:

- /v1/models reports the family's model_type, the C layer loop, the cpu attention backend and
  float32 (a family with latent attention: the Python loop, torch attention, its cache kind);
- one /v1/completions request with two token-id prompts (no tokenizer or template in between),
  one of them longer than every sliding window in the catalog and than a KV block, gives
  transformers' `generate` tokens position by position, with the sampled tokens' logprobs
  equal to log_softmax of transformers' logits. A first differing token is accepted only at a
  near-tie of transformers' own logits (hf_oracle.NEAR_TIE_EPSILON), as in the worker tests;
- the long prompt sent again reads its full block from the prefix cache (a family with recurrent
  layers: and their states' snapshot at that block's end) and answers the same way.

And a checkpoint of a family we do not serve fails at once, in one line that names its
model_type, and leaves no app behind (nothing DEPLOYING).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from families_catalog import SERVED_FAMILIES, SERVED_MOE
from hf_oracle import (
    HfOracle,
    assert_greedy_matches,
    prompts_of_lengths,
    token_ids_of_texts,
)
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig

# The module fixture starts every family's app (about 40 s per wave of WAVE_SIZE on 2 cores) inside the first
# test's timeout: the whole catalog needs more than the suite's 600 s per test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 27)
MLA_TYPES = ("deepseek_v3",)  # families with latent attention
GATED_DELTA_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # Gated DeltaNet layers and gated full attention
RECURRENT_TYPES = ("lfm2", "granitemoehybrid", *GATED_DELTA_TYPES)  # families with layers keeping a state per sequence
MLA_RECURRENT_TYPES = ("kimi_linear",)  # families with latent attention layers between layers keeping a state
SHARED_KV_TYPES = ("gemma4", "gemma4_text")  # families whose last layers read earlier layers' K/V (the Python loop)
PARALLEL_TYPES = ("falcon_h1",)  # families whose layers run a mixer beside attention (both a KV and a state)
LOGPROB_TOLERANCE = 1e-3  # served logprobs against log_softmax of transformers' logits
# Small on purpose: a wave of apps starts beside the session's app on the cluster's 4 logical CPUs.
APP_ARGS = {"dtype": "float32", "num_workers": 1, "worker_num_cpus": 0.1, "ingress_num_cpus": 0.05,
            "scheduler_num_cpus": 0.05, "num_kv_blocks": 16, "block_size": 16, "max_model_len": 128, "startup_timeout_s": 300.0}
WAVE_SIZE = 6  # apps that start together (memory: four processes each)
START_TIMEOUT_S = 400.0


@dataclass
class Served:
    """What one family's app answered (or why it did not start)."""

    model_dir: Path
    prompts: list[list[int]]
    models: list[dict[str, Any]] | None = None  # GET /v1/models "data"
    completion: openai.types.Completion | None = None
    repeat: openai.types.Completion | None = None  # the long prompt again, after the first answer
    failure: str | None = None  # the app's status message when it did not start


def app_name(family: str) -> str:
    return f"fam-{family}"


def family_app(family: str, model_dir: Path):
    from serve_app.app import build_app

    return build_app({"model": str(model_dir), "served_model_name": family, "name": f"rayllm-{app_name(family)}",
                      **APP_ARGS})


def wait_for_apps(apps: list[str]) -> dict[str, str | None]:
    """app -> None once RUNNING, or its status message once it failed; waits for every app."""
    from ray import serve

    deadline = time.monotonic() + START_TIMEOUT_S
    outcome: dict[str, str | None] = {}
    while len(outcome) < len(apps):
        statuses = serve.status().applications
        for app in apps:
            status = statuses.get(app)
            if app in outcome or status is None or status.status in ("DEPLOYING", "NOT_STARTED"):
                continue
            outcome[app] = None if status.status == "RUNNING" else f"{status.status}: {status.message}"
        if time.monotonic() > deadline:
            for app in set(apps) - set(outcome):
                status = statuses.get(app)
                outcome[app] = f"still {status.status if status else 'absent'} after {START_TIMEOUT_S:g}s"
        time.sleep(0.5)
    return outcome


def delete_apps(apps: list[str]) -> None:
    """Deletes the apps together and waits until they are gone."""
    from ray import serve

    for app in apps:
        if app in serve.status().applications:
            serve.delete(app, _blocking=False)
    deadline = time.monotonic() + 120.0
    while set(apps) & set(serve.status().applications) and time.monotonic() < deadline:
        time.sleep(0.5)


def ask(server, family: str, served: Served) -> None:
    url = f"{server.direct_url_of(app_name(family))}/{app_name(family)}"
    served.models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    served.completion = client.completions.create(model=family, prompt=served.prompts, max_tokens=MAX_TOKENS,
                                                  temperature=0.0, logprobs=0, extra_body={"ignore_eos": True})
    served.repeat = client.completions.create(model=family, prompt=[served.prompts[-1]], max_tokens=MAX_TOKENS,
                                              temperature=0.0, logprobs=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(server, tmp_path_factory) -> dict[str, Served]:
    """family -> what its app answered; the apps start a wave at a time and are deleted after."""
    from ray import serve

    results = {}
    for family, overrides in SERVED_FAMILIES.items():
        model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("served") / family, **overrides)
        vocab_size = ModelConfig.from_model_dir(model_dir).vocab_size  # a multimodal config nests it
        results[family] = Served(model_dir, prompts_of_lengths(list(PROMPT_LENGTHS), vocab_size, seed=7))
    families = sorted(results)
    for start in range(0, len(families), WAVE_SIZE):
        wave = families[start:start + WAVE_SIZE]
        apps = [app_name(family) for family in wave]
        try:
            serve.run_many([serve.RunTarget(family_app(family, results[family].model_dir), name=app_name(family),
                                            route_prefix=f"/{app_name(family)}") for family in wave],
                           wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
            outcome = wait_for_apps(apps)
            for family in wave:
                results[family].failure = outcome[app_name(family)]
                if results[family].failure is None:
                    ask(server, family, results[family])
        finally:
            delete_apps(apps)
    return results


@pytest.fixture(params=sorted(SERVED_FAMILIES))
def family(request, served) -> str:
    assert served[request.param].failure is None, f"{request.param} did not start: {served[request.param].failure}"
    return request.param


def test_the_long_prompt_runs_past_every_sliding_window_and_a_block() -> None:
    windows = [traits["sliding_window"] for traits in SERVED_FAMILIES.values() if "sliding_window" in traits]
    assert windows and max(PROMPT_LENGTHS) > max(windows)
    assert max(PROMPT_LENGTHS) > APP_ARGS["block_size"]


def test_models_report_the_family_and_the_layer_loop(served, family) -> None:
    models = served[family].models
    assert [model["id"] for model in models] == [family]
    backend = models[0]["backend"]
    assert backend["model_type"] == SERVED_FAMILIES[family]["model_type"]
    if SERVED_FAMILIES[family]["model_type"] in MLA_TYPES:  # latent attention: the Python loop, torch attention
        assert (backend["layer_loop"], backend["attention_backend"]) == ("python", "torch")
        assert backend["kv_cache_kind"].startswith("MLA latent") and "torch path" in backend["kv_cache_kind"]
        return
    if SERVED_FAMILIES[family]["model_type"] in MLA_RECURRENT_TYPES:  # the same, a state in the other layers
        assert (backend["layer_loop"], backend["attention_backend"]) == ("python", "torch")
        kind = backend["kv_cache_kind"]
        assert kind.startswith("an MLA latent of 16 + 8 values in 1 of 4 layers; a fixed-size state"), kind
        return
    if SERVED_FAMILIES[family]["model_type"] in PARALLEL_TYPES:  # the C loop refuses these: the Python loop
        assert (backend["layer_loop"], backend["attention_backend"]) == ("python", "cpu")
        assert backend["kv_cache_kind"].startswith("keys and values per head in every layer, and beside them")
        return
    recurrent = SERVED_FAMILIES[family]["model_type"] in RECURRENT_TYPES
    shared_kv = SERVED_FAMILIES[family]["model_type"] in SHARED_KV_TYPES
    # the C loop has no MoE MLP, no attention output gate (the Gated DeltaNet families have one) and none of Gemma 4's
    # parts: the Python loop over our kernels runs those (recurrent layers it calls back)
    layer_loop = ("python" if family in SERVED_MOE or SERVED_FAMILIES[family]["model_type"] in GATED_DELTA_TYPES
                  or shared_kv else "c")
    assert (backend["layer_loop"], backend["attention_backend"], backend["dtype"]) == (layer_loop, "cpu", "float32")
    if recurrent:
        assert backend["kv_cache_kind"].startswith("keys and values per head in 1 of 4 layers; a fixed-size state")
    elif shared_kv:
        assert backend["kv_cache_kind"] == ("keys and values per head in 3 of 5 layers; the other 2 read an earlier "
                                            "layer's (3 <- 2, 4 <- 1)")
    else:
        assert backend["kv_cache_kind"] == "keys and values per head"


def test_greedy_tokens_equal_transformers(served, family) -> None:
    result = served[family]
    completion = result.completion
    assert completion.usage.prompt_tokens == sum(PROMPT_LENGTHS)
    assert completion.usage.completion_tokens == MAX_TOKENS * len(result.prompts)
    choices = sorted(completion.choices, key=lambda choice: choice.index)
    assert len(choices) == len(result.prompts)
    for choice, prompt in zip(choices, result.prompts):
        assert_transformers_answer(result, choice, prompt)


def assert_transformers_answer(result: Served, choice, prompt: list[int]) -> None:
    """choice's greedy tokens are transformers' (up to a near-tie), its logprobs log_softmax of its logits."""
    assert choice.finish_reason == "length"
    tokens = [token_ids_of_texts(result.model_dir)[text] for text in choice.logprobs.tokens]
    reference = HfOracle(result.model_dir).greedy(prompt, MAX_TOKENS)
    matched = assert_greedy_matches(tokens, reference)
    for step in range(matched):
        expected = float(torch.log_softmax(reference.logits[step].float(), dim=-1)[tokens[step]])
        assert abs(choice.logprobs.token_logprobs[step] - expected) < LOGPROB_TOLERANCE, (result.model_dir.name, step)


def test_a_repeated_prompt_hits_the_prefix_cache_and_answers_the_same(served, family) -> None:
    """The long prompt sent again starts from its cached full blocks (per-head K/V, or MLA's latents)
    and still gives transformers' greedy tokens and logprobs."""
    result = served[family]
    cached = result.repeat.usage.prompt_tokens_details.cached_tokens
    assert cached == max(PROMPT_LENGTHS) // APP_ARGS["block_size"] * APP_ARGS["block_size"], cached
    assert_transformers_answer(result, result.repeat.choices[0], result.prompts[-1])


def test_an_unknown_model_type_fails_at_once_in_one_line(server, tmp_path) -> None:
    from ray import serve

    from workers.config import ModelConfigError

    model_dir = build_tiny_model_dir(tmp_path / "unknown")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    app = app_name("unknown")
    try:
        with pytest.raises(ModelConfigError) as failure:
            serve.run(family_app("unknown", model_dir), name=app, route_prefix=f"/{app}")
        message = str(failure.value)
        assert "\n" not in message and "model_type 'gpt2' is not supported" in message
        assert str(model_dir / "config.json") in message
        assert app not in serve.status().applications  # nothing was deployed, so nothing stays DEPLOYING
    finally:
        delete_apps([app])
