"""Granite 4 (granitemoehybrid): Mamba-2 layers (workers/mamba2.py) beside attention layers.

The catalog's tiny checkpoints equal transformers in tests/workers/test_families.py (dense) and
tests/workers/test_moe.py (with experts), chunked prompts beside decodes. Here: a config as
Granite 4 checkpoints write it (legacy layer names, no RoPE, infinity as JSON writes it) is read
as such; the experts in transformers' own tensor layout load as the checkpoint's do; the
scheduler's prefix-cache hits (the Mamba-2 state restored from a snapshot cut mid-chunk), n>1
forks and preemption give transformers' tokens; and a config we cannot serve is refused in one
line."""

from __future__ import annotations

import pytest
from families_catalog import FAMILIES, MOE_FAMILIES
from runner_helpers import (HfOracle, assert_hits_forks_and_preemption_answer_as_transformers, assert_greedy_matches,
                            greedy, make_runner, prompts_of_lengths, run_requests)
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig, ModelConfigError

# shaped as Granite 4.0-H checkpoints write config.json (smaller): legacy layer names, NoPE, experts
GRANITE_4 = dict(model_type="granitemoehybrid", vocab_size=1000, hidden_size=256, intermediate_size=64,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, shared_intermediate_size=128,
                 num_local_experts=8, num_experts_per_tok=3, layer_types=["mamba", "mamba", "attention", "mamba"],
                 position_embedding_type="nope", mamba_n_heads=16, mamba_d_head=32, mamba_d_state=64,
                 mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True,
                 mamba_proj_bias=False, embedding_multiplier=12.0, residual_multiplier=0.22,
                 attention_multiplier=0.0078125, logits_scaling=6.0, rms_norm_eps=1e-5,
                 time_step_limit=[0.0, {"__float__": "Infinity"}])


def test_a_granite_4_config_is_read_as_written():
    config = ModelConfig.from_dict(GRANITE_4)
    t, mamba = config.traits, config.traits.mamba2
    assert t.mixers == ("mamba2", "mamba2", None, "mamba2") and t.rope_layers == (False,) * 4
    assert (mamba.num_heads, mamba.head_dim, mamba.state_size, mamba.num_groups) == (16, 32, 64, 1)
    assert (mamba.inner, mamba.conv_channels, mamba.in_proj_rows, mamba.conv_kernel) == (512, 640, 512 + 640 + 16, 4)
    assert (mamba.chunk_size, mamba.norm_eps, mamba.time_step_min, mamba.time_step_max) == (256, 1e-5, 0, float("inf"))
    assert (t.moe.num_experts, t.moe.top_k, t.moe.intermediate_size, t.moe.scoring) == (8, 3, 64, "topk_softmax")
    assert (t.moe.shared_intermediate_size, t.moe.shared_expert) == (128, "shared_expert")
    assert (t.embedding_multiplier, t.residual_multiplier, t.attention_scale, t.logits_scale) == (12.0, 0.22, 0.0078125,
                                                                                                   1 / 6.0)
    assert [config.kv_elements_per_token(layer) for layer in range(4)] == [0, 0, 2 * 2 * 32, 0]


def test_transformers_layer_names_and_rope_are_read_too():
    config = ModelConfig.from_dict(dict(GRANITE_4, layer_types=["linear_attention", "full_attention"] * 2,
                                        position_embedding_type="rope", num_local_experts=0, mamba_d_head="auto"))
    assert config.traits.mixers == ("mamba2", None, "mamba2", None) and config.traits.rope_layers is None
    assert config.traits.moe is None and config.intermediate_size == 128  # the shared_mlp is the MLP
    assert config.traits.mamba2.head_dim == 512 // 16


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["mamba", "mamba", "sliding_attention", "mamba"]), "layer_types must name mamba or attention"),
    (dict(layer_types=["mamba"] * 3), "layer_types must name mamba or attention for each of 4 layers"),
    (dict(mamba_d_head=30), "mamba_n_heads 16 x mamba_d_head 30 is not mamba_expand x hidden_size 512"),
    (dict(mamba_n_groups=3), "mamba_n_groups 3 does not divide mamba_n_heads 16"),
])
def test_a_config_we_cannot_serve_is_refused_in_one_line(change, message):
    with pytest.raises(ModelConfigError, match=message) as error:
        ModelConfig.from_dict(dict(GRANITE_4, **change))
    assert "\n" not in str(error.value)


def test_experts_in_transformers_layout_equal_transformers(tmp_path):
    """save_original_format=False: block_sparse_moe.experts.gate_up_proj / down_proj and router.weight."""
    model_dir = build_tiny_model_dir(tmp_path / "granitemoehybrid-fused", **MOE_FAMILIES["granitemoehybrid-moe"],
                                     save_original_format=False)
    runner = make_runner(model_dir)
    assert all(layer.moe is not None and layer.moe.shared_gate_up is not None for layer in runner.model.layers)
    prompts = prompts_of_lengths([3, 29], runner.model_info.vocab_size, seed=3)
    oracle = HfOracle(model_dir)
    for prompt, output in zip(prompts, run_requests(runner, prompts, greedy(8), token_budget=16)):
        assert_greedy_matches(output, oracle.greedy(prompt, 8))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("granite4") / "granitemoehybrid",
                                **FAMILIES["granitemoehybrid"])


def test_prefix_hits_forks_and_preemption_continue_the_states(model_dir):
    """Snapshots at block ends (every 4 tokens) cut the Mamba-2 scan inside its chunks of 8."""
    runner = make_runner(model_dir, num_blocks=400, state_snapshots=4)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, HfOracle(model_dir))


def test_an_ssm_state_not_carried_between_chunks_of_a_prompt_fails(model_dir, monkeypatch):
    """Each piece of a chunked prompt starting from a zero SSM state: transformers' tokens are lost."""
    from workers import mamba2

    scan = mamba2.ssd_scan
    monkeypatch.setattr(mamba2, "ssd_scan", lambda u, dt, rate, B, C, initial, chunk_size:
                        scan(u, dt, rate, B, C, initial * 0, chunk_size))
    prompts = prompts_of_lengths([33, 40], 384, seed=1)  # each cut into pieces of several tokens
    oracle = HfOracle(model_dir)
    outputs = run_requests(make_runner(model_dir), prompts, greedy(8), token_budget=16)
    assert all(output != oracle.greedy(prompt, 8).token_ids for output, prompt in zip(outputs, prompts))
