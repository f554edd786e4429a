"""Gemma 4's text model beyond what tests/workers/test_families.py compares for every family
(greedy tokens and logprobs equal transformers' on both paths, chunked prompts beside decodes):
the layers sharing K/V have no pool of their own (bytes per token against the same model without
sharing), and each of Gemma 4's parts, broken on purpose, makes a prompt's logits differ from
transformers' (so the comparisons above would catch its loss)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_hits_forks_and_preemption_answer_as_transformers, make_runner,
                            prompts_of_lengths)
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig, ModelConfigError
from workers.model import AttentionMetadata
from workers.model_runner import kv_bytes_per_token

TORCH_PATH = dict(attention_backend="torch", layer_ops="torch", linear_backend="torch")
LOGIT_TOLERANCE = 1e-4  # fp32, ours against transformers'
BROKEN_DIFFERENCE = 1e-2  # a broken part moves some logit by at least this much


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("gemma4") / "gemma4_text", **FAMILIES["gemma4_text"])


@pytest.fixture(scope="module")
def oracle(model_dir):
    return HfOracle(model_dir)


def prompt_logits(runner, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] fp32 logits of one whole prefill into the runner's pools (blocks 1, 2, ...)."""
    positions, metadata = AttentionMetadata.one_sequence(len(prompt), runner.block_size)
    hidden = runner.model.forward(torch.tensor(prompt), positions, metadata, runner.kv_caches)
    return runner.model.compute_logits(hidden)


def test_layers_sharing_kv_read_their_sources_pool(model_dir):
    runner = make_runner(model_dir, **TORCH_PATH)
    pools = runner.kv_caches
    assert pools[3] is pools[2] and pools[4] is pools[1]  # num_kv_shared_layers=2: the last of each type before them
    assert len({id(pool) for pool in pools}) == 3
    assert pools[1][0].shape[-1] == 32 and pools[0][0].shape[-1] == 16  # global_head_dim on the full layers
    assert [layer.shares_kv for layer in runner.model.layers] == [False, False, False, True, True]


def test_kv_bytes_per_token_with_shared_layers(model_dir):
    """Layers 3 and 4 keep nothing: 2 x 2 heads x (16 + 32 + 16) values, against 2 x 2 x (16 + 32 + 16 + 16 + 32)
    for the same model without sharing: 1024 bytes per token against 1792 in fp32 (0.571)."""
    shared = ModelConfig.from_model_dir(model_dir)
    raw = dict(FAMILIES["gemma4_text"], num_kv_shared_layers=0, vocab_size=384, hidden_size=64, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2)
    raw["per_layer_config"] = {"1": {"head_dim": 32}, "4": {"head_dim": 32}}
    unshared = ModelConfig.from_dict(raw)
    assert unshared.traits.kv_sources is None
    assert kv_bytes_per_token(shared, torch.float32) == 1024
    assert kv_bytes_per_token(unshared, torch.float32) == 1792
    runner = make_runner(model_dir, **TORCH_PATH)  # the pools the runner holds are what it counted
    unique = {id(tensor): tensor for pool in runner.kv_caches for tensor in pool}.values()
    assert sum(t.numel() * t.element_size() for t in unique) == 1024 * runner.num_blocks * runner.block_size


def test_prefix_hits_forks_and_preemption_answer_as_transformers(model_dir, oracle):
    """Blocks are blocks: a prefix hit (the shared layers read their source's cached K/V), an n=3 fork and
    preemption through the real scheduler give transformers' greedy tokens."""
    runner = make_runner(model_dir, **TORCH_PATH, num_blocks=400)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, oracle)


def test_prompt_logits_equal_transformers(model_dir, oracle):
    runner = make_runner(model_dir, **TORCH_PATH)
    prompt = prompts_of_lengths([30], runner.model_info.vocab_size, seed=4)[0]  # past the window of 8
    torch.testing.assert_close(prompt_logits(runner, prompt), oracle.logits(prompt), atol=LOGIT_TOLERANCE, rtol=0)


def _own_pool(runner):  # layer 3 reads a pool of its own, which nothing writes
    k_cache, v_cache = runner.kv_caches[3]
    runner.kv_caches[3] = (torch.zeros_like(k_cache), torch.zeros_like(v_cache))


def _no_per_layer_inputs(runner):
    for layer in runner.model.layers:
        layer.per_layer = None


def _no_value_norm(runner):
    for layer in runner.model.layers:
        layer.value_norm = False


def _no_layer_scalars(runner):
    for layer in runner.model.layers:
        layer.scalar = None


def _default_rope_on_full_layers(runner):  # every frequency rotating, not a quarter of them
    from workers.config import RopeScaling
    from workers.rope import RotaryEmbedding

    config = dataclasses.replace(runner.model_config, head_dim=32, rope_scaling=RopeScaling("default"))
    runner.model.rope = RotaryEmbedding(config, 64, torch.float32, "cpu")


BREAKS = {"shared layer's own pool": _own_pool, "per-layer inputs dropped": _no_per_layer_inputs,
          "value norm dropped": _no_value_norm, "layer scalars dropped": _no_layer_scalars,
          "default RoPE on the full layers": _default_rope_on_full_layers}


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_each_part_broken_differs_from_transformers(model_dir, oracle, broken):
    runner = make_runner(model_dir, **TORCH_PATH)
    BREAKS[broken](runner)
    prompt = prompts_of_lengths([30], runner.model_info.vocab_size, seed=4)[0]
    difference = (prompt_logits(runner, prompt) - oracle.logits(prompt)).abs().max()
    assert difference > BROKEN_DIFFERENCE, f"{broken}: the logits still equal transformers' ({difference:.3g})"


@pytest.mark.parametrize("setting", [dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                          moe_intermediate_size=32),
                                     dict(use_bidirectional_attention="all")])
def test_unserved_settings_are_refused_in_one_line(setting):
    raw = dict(model_type="gemma4_text", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(ModelConfigError, match=next(iter(setting))):
        ModelConfig.from_dict(dict(raw, **setting))


def test_proportional_rope_equals_transformers():
    """Gemma 4's full-attention RoPE: the whole head of 32 rotates in halves, a quarter of its frequencies nonzero."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.rope import inverse_frequencies

    shape = {key: value for key, value in FAMILIES["gemma4_text"].items() if key != "model_type"}
    hf_config = AutoConfig.for_model("gemma4_text", vocab_size=384, **shape)
    config = ModelConfig.from_dict(hf_config.to_dict())
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](hf_config, "cpu", layer_type="full_attention")
    ours = inverse_frequencies(32, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, expected) and int((ours != 0).sum()) == 4


def test_lora_is_refused_in_one_line(model_dir, tmp_path):
    """qkv's rows differ between Gemma 4's layers (head sizes, layers projecting q alone): not ours to adapt yet."""
    from workers.lora import LoraError, load_adapter

    with pytest.raises(LoraError, match="differ in head size or share K/V"):
        load_adapter("a", tmp_path, ModelConfig.from_model_dir(model_dir), torch.float32)
