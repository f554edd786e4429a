"""Multi-head latent attention (workers/mla.py, the deepseek_v3 family) over its paged latent cache.

The catalog's tiny deepseek_v3 checkpoints (tests/families_catalog.py) equal transformers in
tests/workers/test_families.py; here: the pool holds one latent and one RoPE key per token and
layer, and so admits more tokens for the same memory; decodes absorbed into latent space equal
the expanded form; the scheduler's prefix-cache hits, n>1 forks and preemption give
transformers' tokens over latent blocks; a latent written to the wrong block fails them; and a
config with MoE layers is refused in one line."""

from __future__ import annotations

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_hits_forks_and_preemption_answer_as_transformers, greedy, make_runner,
                            prompts_of_lengths, run_requests)
from tiny_model import build_tiny_model_dir

from workers import mla
from workers.config import ModelConfig
from workers.model_runner import kv_bytes_per_token, num_blocks_for_memory

CHECKPOINTS = ("deepseek_v3", "deepseek_v3-q-proj")
# DeepSeek V3's published shapes, every layer dense so that the config is served
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, first_k_dense_replace=61,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                                     beta_slow=1, original_max_position_embeddings=4096),
                   max_position_embeddings=163840, rope_theta=10000)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def model_dir(request, tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("mla") / request.param, **FAMILIES[request.param])


def plain_bytes_per_token(config: ModelConfig, element_size: int) -> int:
    """The same model with per-head keys and values in its pool: heads x (qk_head_dim + v_head_dim)."""
    t = config.traits.mla
    return config.num_layers * config.num_heads * (t.qk_head_dim + t.v_head_dim) * element_size


@pytest.mark.parametrize("dtype,element_size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_pool_holds_one_latent_and_one_rope_key_per_token_and_layer(dtype, element_size):
    config = ModelConfig.from_dict(DEEPSEEK_V3)
    per_token = kv_bytes_per_token(config, dtype)
    assert per_token == (512 + 64) * 61 * element_size  # 70,272 bytes in bf16
    ratio = plain_bytes_per_token(config, element_size) / per_token
    assert ratio == pytest.approx(128 * (192 + 128) / (512 + 64))  # 71.1x fewer bytes than per-head K and V
    memory = 1 << 30
    assert num_blocks_for_memory(config, 16, memory, dtype) == memory // (16 * per_token)


def test_the_runner_sizes_its_pool_by_the_latent(model_dir):
    config = ModelConfig.from_model_dir(model_dir)
    t, memory = config.traits.mla, 1 << 20
    runner = make_runner(model_dir, num_blocks=None, kv_cache_memory_bytes=memory)
    per_token = (t.kv_lora_rank + t.qk_rope_head_dim) * config.num_layers * 4
    assert kv_bytes_per_token(config, torch.float32) == per_token == 24 * 3 * 4
    assert runner.num_blocks == memory // (4 * per_token)  # make_runner's blocks of 4 tokens
    plain_blocks = memory // (4 * plain_bytes_per_token(config, 4))
    assert runner.num_blocks / plain_blocks == pytest.approx(4 * (20 + 10) / 24, rel=0.01)  # 5x the tokens
    pool, latents = runner.kv_caches[0]
    assert pool.shape == (runner.num_blocks, 4, 1, 24) and latents.data_ptr() == pool.data_ptr()
    assert sum(p.numel() * p.element_size() for p, _ in runner.kv_caches) == runner.num_blocks * 4 * per_token
    info = runner.model_info
    assert (info.attention_backend, info.layer_loop) == ("torch", "python")
    assert info.kv_cache_kind.startswith("MLA latent: 16 + 8 values per token and layer") and "torch path" in info.kv_cache_kind


def test_copying_a_block_copies_its_latents_and_rope_keys(model_dir):
    """The runner copies blocks (a fork's partial last block) as it does any pool's."""
    runner = make_runner(model_dir)
    for pool, _ in runner.kv_caches:
        pool[3].normal_()
    runner._copy_blocks([(3, 7)])
    assert all(torch.equal(pool[7], pool[3]) and pool[7].abs().sum() > 0 for pool, _ in runner.kv_caches)


def test_absorbed_decodes_equal_the_expanded_form(model_dir, monkeypatch):
    prompts = prompts_of_lengths([3, 17, 40], ModelConfig.from_model_dir(model_dir).vocab_size, seed=4)
    absorbed = run_requests(make_runner(model_dir), prompts, greedy(10), token_budget=16)
    expanded_steps = []
    original = mla.MlaStep.__init__

    def expanded_only(self, metadata, scale, absorb_decodes=True):
        original(self, metadata, scale, absorb_decodes=False)
        expanded_steps.append(self.absorbed is None)

    monkeypatch.setattr(mla.MlaStep, "__init__", expanded_only)
    expanded = run_requests(make_runner(model_dir), prompts, greedy(10), token_budget=16)
    assert expanded_steps and all(expanded_steps)
    assert absorbed == expanded


def test_a_step_splits_decodes_from_prompt_rows():
    from workers.model import AttentionMetadata

    metadata = AttentionMetadata(slot_mapping=torch.zeros(7, dtype=torch.long),
                                 block_tables=torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 1, 6, 7], dtype=torch.int32),
                                 seq_lens=torch.tensor([6, 5, 7], dtype=torch.int32))
    step = mla.MlaStep(metadata, 1.0)
    assert step.absorbed.rows.tolist() == [0, 6] and step.absorbed.seq_lens.tolist() == [6, 7]
    assert step.absorbed.query_start_loc.tolist() == [0, 1, 2]
    assert step.expanded.rows.tolist() == [1, 2, 3, 4, 5] and step.expanded.query_start_loc.tolist() == [0, 5]
    assert step.blocks.tolist() == [0, 3] and step.compact_tables.tolist() == [[1, 0]]


def test_prefix_hits_forks_and_preemption_over_latent_blocks(model_dir):
    assert_hits_forks_and_preemption_answer_as_transformers(make_runner(model_dir, num_blocks=400), HfOracle(model_dir))


def test_a_latent_written_to_the_wrong_block_fails(model_dir, monkeypatch):
    """The same run with each token's latent written one block further on: its greedy tokens
    leave transformers' (what the tests above would catch)."""
    runner = make_runner(model_dir)
    prompts = prompts_of_lengths([17, 40], runner.model_info.vocab_size, seed=1)
    oracle = HfOracle(model_dir)
    assert [run_requests(runner, prompts, greedy(8), token_budget=16)[i] == oracle.greedy(prompts[i], 8).token_ids
            for i in range(2)] == [True, True]

    def misplaced(self, entry, pool):
        slots = self.metadata.slot_mapping + pool.shape[1]  # the next block's slot
        pool.view(-1, pool.shape[-1]).index_copy_(0, slots % (pool.shape[0] * pool.shape[1]), entry)

    monkeypatch.setattr(mla.MlaStep, "write", misplaced)
    broken = run_requests(make_runner(model_dir), prompts, greedy(8), token_budget=16)
    assert all(tokens != oracle.greedy(prompt, 8).token_ids for tokens, prompt in zip(broken, prompts))


def test_moe_layers_are_read_as_grouped_sigmoid_routing():
    """V3's MoE layers after first_k_dense_replace: workers/moe.py's grouped sigmoid routing with a
    correction bias and shared experts (served: tests/workers/test_moe.py's deepseek_v3-moe)."""
    moe = ModelConfig.from_dict(dict(DEEPSEEK_V3, first_k_dense_replace=1)).traits.moe
    assert moe.layers == (False,) + (True,) * (DEEPSEEK_V3["num_hidden_layers"] - 1)
    assert (moe.scoring, moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == ("sigmoid_topk", 8, 4, 2.5)
    assert moe.correction_bias == ("gate.e_score_correction_bias",) and moe.shared_expert == "shared_experts"
    dense = ModelConfig.from_dict(dict(DEEPSEEK_V3, n_routed_experts=0, first_k_dense_replace=0))
    assert dense.traits.moe is None and dense.traits.mla.kv_lora_rank == 512


def test_multi_token_prediction_layers_are_skipped_at_load(model_dir, tmp_path):
    """Published DeepSeek V3 checkpoints hold a multi-token prediction layer after the last
    (model.layers.61.*): not served, dropped at load."""
    import shutil

    from safetensors.torch import load_file, save_file

    with_mtp = tmp_path / "with_mtp"
    shutil.copytree(model_dir, with_mtp)
    tensors = load_file(with_mtp / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 22, 16)
    save_file(tensors, with_mtp / "model.safetensors", metadata={"format": "pt"})
    prompts = prompts_of_lengths([9], ModelConfig.from_model_dir(model_dir).vocab_size, seed=6)
    assert run_requests(make_runner(with_mtp), prompts, greedy(6)) == run_requests(make_runner(model_dir), prompts,
                                                                                  greedy(6))


def test_lora_adapters_are_refused_in_one_line(model_dir):
    from workers.lora import LoraError

    with pytest.raises(LoraError, match=r"latent attention \(deepseek_v3\) are not supported yet"):
        make_runner(model_dir, lora_adapters=(("adapter", str(model_dir / "adapter")),))
