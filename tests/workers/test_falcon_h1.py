"""Falcon-H1 (falcon_h1): in every layer attention and a Mamba-2 mixer side by side on the same normed input.

The catalog's tiny checkpoints equal transformers in tests/workers/test_families.py (greedy tokens and
logprobs, both paths, chunked prompts beside decodes). Here: a config as Falcon-H1 checkpoints write it
is read as such, and one we cannot serve is refused in one line; each layer keeps both its paged KV
and its mixer's state (a ParallelCache); the scheduler's prefix-cache hits (KV blocks and the state
snapshot cut mid-chunk), n>1 forks and preemption give transformers' tokens; and a model that drops the
mixer beside attention, or forgets a folded multiplier, does not."""

from __future__ import annotations

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_hits_forks_and_preemption_answer_as_transformers, greedy, make_runner,
                            prompts_of_lengths, run_requests)
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig, ModelConfigError
from workers.model import ParallelCache

# shaped as Falcon-H1-0.5B's config.json (smaller): mamba_d_ssm apart from the hidden size, no mixer norm, µP
FALCON_H1 = dict(model_type="falcon_h1", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, mamba_d_ssm=384, mamba_n_heads=6,
                 mamba_d_head=64, mamba_d_state=32, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
                 mamba_chunk_size=128, mamba_conv_bias=True, mamba_proj_bias=False, mamba_rms_norm=False,
                 mamba_norm_before_gate=False, projectors_bias=False, attention_bias=False, mlp_bias=False,
                 embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625, attention_in_multiplier=1.0,
                 attention_out_multiplier=0.9375, key_multiplier=0.390625, ssm_in_multiplier=1.25,
                 ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
                 ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                 rms_norm_eps=1e-5, rope_theta=100000000000.0, time_step_limit=[0.0, float("inf")])


def test_a_falcon_h1_config_is_read_as_written():
    config = ModelConfig.from_dict(FALCON_H1)
    t, mamba = config.traits, config.traits.mamba2
    assert t.mixers == ("mamba2",) * 4 and t.mixers_beside_attention and t.mlp_block == "feed_forward"
    assert (mamba.inner, mamba.head_dim, mamba.num_heads, mamba.state_size, mamba.chunk_size) == (384, 64, 6, 32, 128)
    assert (mamba.gated_norm, mamba.proj_bias, mamba.out_proj_bias, mamba.norm_eps) == (None, False, False, 1e-5)
    assert (mamba.input_multiplier, mamba.output_multiplier) == (1.25, 0.23570226039551587)
    assert mamba.in_proj_parts == (384, 384, 32, 32, 6) and sum(mamba.in_proj_parts) == mamba.in_proj_rows
    assert (t.embedding_multiplier, t.logits_scale) == (5.656854249492381, 0.0390625)
    assert (t.multipliers.key, t.multipliers.attention_out, t.multipliers.down) == (0.390625, 0.9375, 0.5859375)
    assert [config.kv_elements_per_token(layer) for layer in range(4)] == [2 * 2 * 32] * 4
    assert config.paths.c_layer_loop == "attention and Mamba-2 in parallel"
    assert config.rope_theta == 1e11 and config.rms_norm_eps == 1e-5


def test_transformers_defaults_fill_what_a_config_leaves_out():
    """No mamba_d_ssm: transformers' 1024 (not mamba_expand x hidden); no multipliers: 1; the norm's
    place from mamba_norm_before_gate only with mamba_rms_norm."""
    raw = {key: value for key, value in FALCON_H1.items()
           if key not in ("mamba_d_ssm", "mamba_d_head", "mlp_multipliers", "ssm_multipliers", "key_multiplier")}
    config = ModelConfig.from_dict(dict(raw, mamba_n_heads=16, mamba_rms_norm=True, mamba_norm_before_gate=True))
    mamba, multipliers = config.traits.mamba2, config.traits.multipliers
    assert (mamba.inner, mamba.head_dim, mamba.gated_norm, mamba.in_proj_multipliers) == (1024, 64, "before_gate",
                                                                                          (1.0,) * 5)
    assert (multipliers.key, multipliers.gate, multipliers.down) == (1.0, 1.0, 1.0)
    after = ModelConfig.from_dict(dict(raw, mamba_n_heads=16, mamba_rms_norm=True, mamba_norm_before_gate=False))
    assert after.traits.mamba2.gated_norm == "after_gate"


@pytest.mark.parametrize("change, message", [
    (dict(mamba_d_head=60), "mamba_n_heads 6 x mamba_d_head 60 is not mamba_d_ssm 384"),
    (dict(mamba_n_groups=4), "mamba_n_groups 4 does not divide mamba_n_heads 6"),
    (dict(ssm_multipliers=[1.0, 1.0]), r"ssm_multipliers needs 5 values \(gate, x, B, C, dt\)"),
])
def test_a_config_we_cannot_serve_is_refused_in_one_line(change, message):
    with pytest.raises(ModelConfigError, match=message) as error:
        ModelConfig.from_dict(dict(FALCON_H1, **change))
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("falcon_h1") / "falcon_h1", **FAMILIES["falcon_h1"])


def test_every_layer_keeps_its_keys_and_values_and_its_state(model_dir):
    runner = make_runner(model_dir, num_blocks=64)
    assert all(layer.mixer is not None and layer.qkv is not None for layer in runner.model.layers)
    assert all(isinstance(cache, ParallelCache) for cache in runner.kv_caches)
    for layer, cache in enumerate(runner.kv_caches):
        assert cache.states is runner.states.pools[layer] and cache.kv[0].shape[0] == 64
    assert runner.model.native_forward is None  # the C loop runs a mixer in attention's place only


def test_prefix_hits_forks_and_preemption_continue_the_states(model_dir):
    """Snapshots at block ends (every 4 tokens) cut the Mamba-2 scan inside its chunks of 8; the prefix's
    KV blocks and its state snapshot are restored together."""
    runner = make_runner(model_dir, num_blocks=400, state_snapshots=4, max_num_seqs=2)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, HfOracle(model_dir))
    assert runner.states.num_grows > 0  # 3 fork rows of 2 planned: the layer caches rebuilt around the grown pools
    assert all(cache.states is runner.states.pools[layer] for layer, cache in enumerate(runner.kv_caches))


def _outputs_differ_from_transformers(model_dir) -> bool:
    prompts = prompts_of_lengths([19, 33], 384, seed=1)
    oracle = HfOracle(model_dir)
    outputs = run_requests(make_runner(model_dir), prompts, greedy(8), token_budget=16)
    return all(output != oracle.greedy(prompt, 8).token_ids for output, prompt in zip(outputs, prompts))


def test_a_layer_without_its_mixer_beside_attention_fails(model_dir, monkeypatch):
    """The mixer's output dropped from each layer's sum (attention alone): transformers' tokens are lost."""
    from workers import model

    monkeypatch.setattr(model, "run_mixer", lambda mixer, m, x, pool, step: torch.zeros_like(x))
    assert _outputs_differ_from_transformers(model_dir)


def test_multipliers_not_folded_fail(model_dir, monkeypatch):
    """Every product read as the checkpoint holds it (only the embedding's and the logits' multipliers kept)."""
    from workers import model

    monkeypatch.setattr(model._WeightReader, "scaled", lambda reader, name, tensor, multiplier: tensor)
    assert _outputs_differ_from_transformers(model_dir)
