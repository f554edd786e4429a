"""The families beyond Llama (workers/families.py), each a tiny random checkpoint built with
transformers' own config and model classes and loaded by our loader: greedy tokens and
logprobs equal transformers' on the torch reference path (the Python layer loop over torch ops
and products, as on a GPU) and on our C layer loop; and the C loop equals the Python loop over
our kernels bit for bit, step by step."""

from __future__ import annotations

import math

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_logprobs_match_hf, greedy, make_runner,
                            prompts_of_lengths, run_requests, run_with_logprobs)
from test_native_forward import compare_every_step
from tiny_model import build_tiny_model_dir

from scheduler.sampling_params import SamplingParams
from workers.config import ModelConfig, RopeScaling
from workers.families import GatedDeltaTraits
from workers.kernels.native import native_available

PATHS = {
    "torch": dict(attention_backend="torch", layer_ops="torch", linear_backend="torch"),
    "c-loop": dict(attention_backend="cpu"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    """The checkpoint directory, named as its FAMILIES key."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("families") / request.param, **FAMILIES[request.param])


def family_runner(model_dir, path: str, **overrides):
    if path == "c-loop" and not native_available():
        pytest.skip("the C kernels do not build here")
    runner = make_runner(model_dir, **PATHS[path], **overrides)
    # a family the C loop refuses (latent attention) runs the Python loop over our kernels on that path
    takes_c_loop = runner.model_config.paths.c_layer_loop is None
    assert (runner.model.native_forward is not None) == (path == "c-loop" and takes_c_loop)
    return runner


@pytest.mark.parametrize("path", sorted(PATHS))
def test_greedy_tokens_equal_transformers(family_dir, path):
    runner = family_runner(family_dir, path)
    oracle = HfOracle(family_dir)
    prompts = prompts_of_lengths([3, 17, 40], runner.model_info.vocab_size, seed=1)
    outputs = run_requests(runner, prompts, greedy(12), token_budget=16)  # chunked prompts beside decodes
    for prompt, output in zip(prompts, outputs):
        assert_greedy_matches(output, oracle.greedy(prompt, 12))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_logprobs_equal_transformers(family_dir, path):
    runner = family_runner(family_dir, path)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)]
    oracle = HfOracle(family_dir)
    for request in run_with_logprobs(runner, prompts_of_lengths([21, 5], runner.model_info.vocab_size, seed=2), params):
        assert_logprobs_match_hf(request, oracle, 4)


def test_c_loop_equals_the_python_loop(family_dir):
    runner = family_runner(family_dir, "c-loop")
    if runner.model.native_forward is None:
        pytest.skip(f"the C loop refuses {family_dir.name}: {runner.model_config.paths.c_layer_loop}")
    compared = compare_every_step(runner)
    run_requests(runner, prompts_of_lengths([2, 9, 30], runner.model_info.vocab_size), greedy(8), token_budget=16)
    assert len(compared) >= 8


def test_traits_read_from_the_config(family_dir):
    config = ModelConfig.from_model_dir(family_dir)
    traits = FAMILIES[family_dir.name]
    assert (config.text_model_of or config.model_type) == traits["model_type"]
    assert config.traits.qk_norm == {"qwen3": "head", "olmo2": "projection", "olmo3": "projection",
                                     "gemma3_text": "head", "gemma4_text": "head", "exaone4": "head",
                                     "lfm2": "head", "qwen3_next": "head", "qwen3_5_text": "head",
                                     "qwen3_5_moe_text": "head"}.get(config.model_type)
    assert config.traits.norms == {"olmo2": "post", "olmo3": "post", "exaone4": "post", "gemma2": "sandwich",
                                   "gemma3_text": "sandwich", "gemma4_text": "sandwich"}.get(config.model_type, "pre")
    if config.model_type in ("gemma2", "gemma3_text"):
        assert config.text_model_of == ("gemma3" if family_dir.name == "gemma3" else None)
        assert config.traits.layer_windows == (8, None, 8) and config.activation == "gelu_tanh"
        assert config.traits.norm_weight_offset == 1.0 and config.traits.attention_scale == 24 ** -0.5
        assert config.traits.embedding_multiplier == 64 ** 0.5 and config.traits.sliding_window is None  # the context is not capped
    if config.model_type == "gemma2":
        assert (config.traits.attention_softcap, config.traits.logits_softcap) == (5.0, 8.0)
    if family_dir.name == "gemma3_text":
        assert config.traits.local_rope_layers == (True, False, True) and config.local_rope_theta == 1e4
        assert config.rope_theta == 1e6 and config.rope_scaling.rope_type == "linear"
    if config.model_type == "gemma4_text":  # more in tests/workers/test_gemma4.py
        assert config.text_model_of == ("gemma4" if family_dir.name == "gemma4" else None)
        assert config.traits.layer_windows == (8, None, 8, 8, None)
        assert config.traits.kv_sources == (None, None, None, 2, 1)
        assert config.traits.layer_head_dims == (16, 32, 16, 16, 32) and config.traits.per_layer_input_size == 8
        traits = config.traits
        assert (traits.norm_weight_offset, traits.attention_scale, config.partial_rotary_factor) == (0, 1, 1)
        assert (config.rope_scaling.rope_type, config.rope_scaling.proportion, config.rope_theta) == ("proportional",
                                                                                                   0.25, 1e6)
        assert config.paths.c_layer_loop is not None and "per-layer inputs" in config.paths.c_layer_loop
    if config.model_type == "phi3":
        assert config.traits.fused_projections and config.rotary_dim == config.head_dim // 2
        assert config.rope_scaling.rope_type == "longrope" and config.rope_scaling.attention_factor > 1.0
    if config.model_type == "olmo3":
        assert config.traits.layer_windows == (8, 8, None) and config.traits.local_rope_layers == (True, True, False)
        assert (config.rope_theta, config.rope_scaling.rope_type, config.local_rope_theta) == (5e5, "linear", 1e4)
    if config.model_type == "exaone4":
        assert config.traits.layer_windows == (8, 8, None) and config.traits.rope_layers == (True, True, False)
    if config.model_type == "seed_oss":
        assert (config.traits.qkv_bias, config.traits.o_bias, config.mlp_bias) == (True, True, True)
    if config.model_type == "deepseek_v3":
        mla = config.traits.mla
        assert (mla.kv_lora_rank, mla.qk_rope_head_dim, config.head_dim, config.traits.moe) == (16, 8, 8, None)
        assert (mla.q_lora_rank, mla.rope_interleave) == ((24, True) if family_dir.name == "deepseek_v3" else (None, False))
        mscale = 0.1 * 0.7 * math.log(4.0) + 1.0 if family_dir.name == "deepseek_v3" else 1.0
        assert config.traits.attention_scale == pytest.approx(20 ** -0.5 * mscale ** 2)
        assert config.paths.c_layer_loop == "multi-head latent attention layers"
    if config.model_type == "lfm2":
        assert config.traits.mixers == ("short_conv", "short_conv", None, "short_conv")
        assert (config.traits.short_conv_width, config.traits.short_conv_bias, config.intermediate_size) == (3, True, 96)
        assert [config.kv_elements_per_token(layer) for layer in range(4)] == [0, 0, 2 * 2 * 16, 0]
        assert config.paths.c_layer_loop is None  # the C loop calls the mixers back
    if config.model_type == "qwen3_next":
        assert config.traits.mixers == ("gated_delta", "gated_delta", None, "gated_delta")
        assert config.traits.gated_delta == GatedDeltaTraits(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8,
                                                             conv_kernel=4)
        assert [config.kv_elements_per_token(layer) for layer in range(4)] == [0, 0, 2 * 2 * 16, 0]
        assert config.traits.attention_output_gate and config.traits.norm_weight_offset == 1.0
        assert config.rotary_dim == 4 and config.traits.moe.layers == (False, True, True, True)
        assert config.paths.c_layer_loop == "mixture-of-experts layers, an attention output gate"
    if config.model_type in ("qwen3_5_text", "qwen3_5_moe_text"):  # multimodal checkpoints, the text model served
        assert config.text_model_of == family_dir.name and config.traits.gated_delta.projections == "qkv_z_b_a"
        assert config.traits.attention_output_gate and config.traits.norm_weight_offset == 1.0
        assert config.traits.skipped_prefixes == ("mtp.", "model.visual.")
    if config.model_type == "qwen3_5_text":
        assert config.traits.mixers == ("gated_delta", "gated_delta", None, "gated_delta") and config.traits.moe is None
        assert config.rotary_dim == 8 and config.intermediate_size == 128  # half of each head, mrope_section moot
        assert config.paths.c_layer_loop == "an attention output gate"
    if config.model_type == "qwen3_5_moe_text":
        moe = config.traits.moe
        assert config.traits.mixers == ("gated_delta", None, "gated_delta", "gated_delta") and config.rotary_dim == 4
        assert (moe.layers, moe.top_k, moe.renormalize, moe.shared_intermediate_size) == ((True,) * 4, 2, True, 48)
        assert config.paths.c_layer_loop == "mixture-of-experts layers, an attention output gate"
    if config.model_type == "smollm3":
        assert config.traits.rope_layers == (True, False, True, False)
    if config.model_type in ("granite", "granitemoehybrid"):
        assert (config.traits.embedding_multiplier, config.traits.residual_multiplier, config.traits.attention_scale) == (4.0, 0.4, 0.09)
        assert config.traits.logits_scale == pytest.approx(1 / 3)
    if config.model_type == "granitemoehybrid":
        mamba = config.traits.mamba2
        assert config.traits.mixers == ("mamba2", "mamba2", None, "mamba2") and config.traits.moe is None
        assert (mamba.num_heads, mamba.head_dim, mamba.num_groups, mamba.state_size, mamba.chunk_size) == (4, 32, 2, 8, 8)
        assert config.traits.rope_layers == (False,) * 4 and config.intermediate_size == 96  # the shared_mlp's
        assert [config.kv_elements_per_token(layer) for layer in range(4)] == [0, 0, 2 * 2 * 16, 0]
        assert config.paths.c_layer_loop is None  # the C loop calls the mixers back
    if family_dir.name == "falcon_h1":
        t, mamba = config.traits, config.traits.mamba2
        assert t.mixers == ("mamba2",) * 3 and t.mixers_beside_attention and config.intermediate_size == 128
        assert (mamba.inner, mamba.head_dim, mamba.num_groups, mamba.chunk_size, mamba.gated_norm) == (96, 16, 2, 8,
                                                                                                     "before_gate")
        assert (t.embedding_multiplier, t.logits_scale, mamba.input_multiplier, mamba.output_multiplier) == (2.0, 0.5,
                                                                                                          1.2, 0.6)
        assert mamba.in_proj_multipliers == (0.9, 1.1, 0.8, 1.25, 1.5)
        assert (t.multipliers.attention_in, t.multipliers.key, t.multipliers.gate, t.multipliers.down) == (0.7, 1.3,
                                                                                                          1.2, 0.7)
        assert [config.kv_elements_per_token(layer) for layer in range(3)] == [2 * 2 * 16] * 3  # KV and a state
        assert config.paths.c_layer_loop == "attention and Mamba-2 in parallel"
    if family_dir.name == "falcon_h1-biases":
        mamba = config.traits.mamba2
        assert (mamba.gated_norm, mamba.proj_bias, mamba.out_proj_bias, mamba.inner) == (None, True, True, 64)


def test_model_info_names_the_family_and_the_layer_loop(family_dir):
    info = family_runner(family_dir, "torch").model_info
    assert info.model_type == FAMILIES[family_dir.name]["model_type"]
    assert (info.layer_loop, info.layer_ops, info.linear_backend) == ("python", "torch", "torch")
    kinds = {"deepseek_v3": "MLA latent: 16 + 8 values per token and layer; its attention runs on the torch path "
                            "(prompts expanded, decodes absorbed), not on our C loop or kernels",
             # 3 layers x 64 channels x 2 inputs x 4 bytes
             "lfm2": "keys and values per head in 1 of 4 layers; a fixed-size state per sequence in the other 3 "
                     "(short_conv: workers/recurrent.py, 1536 bytes per sequence, in torch ops; 64 prefix-cache snapshots)",
             # 3 layers x (160 conv channels x 3 inputs + 4 heads x 32 x 8 of SSM state) x 4 bytes
             "granitemoehybrid": "keys and values per head in 1 of 4 layers; a fixed-size state per sequence in the "
                                 "other 3 (mamba2: workers/recurrent.py, 18048 bytes per sequence, in torch ops; "
                                 "64 prefix-cache snapshots)",
             # 3 layers x (conv: (2 x 2 x 16 + 4 x 8) channels x 3 inputs + 4 heads x 16 x 8) x 4 bytes
             "qwen3_next": "keys and values per head in 1 of 4 layers; a fixed-size state per sequence in the other 3 "
                           "(gated_delta: workers/recurrent.py, 9600 bytes per sequence, in torch ops; 64 prefix-cache "
                           "snapshots)",
             # 3 layers x ((3 x 2 x 16) conv channels x 3 inputs + 2 heads x 16 x 16) x 4 bytes
             "kimi_linear": "an MLA latent of 16 + 8 values in 1 of 4 layers; a fixed-size state per sequence in the "
                            "other 3 (kda: workers/recurrent.py, 9600 bytes per sequence, in torch ops; 64 "
                            "prefix-cache snapshots)",
             "qwen3_5": "keys and values per head in 1 of 4 layers; a fixed-size state per sequence in the other 3 "
                        "(gated_delta: workers/recurrent.py, 9600 bytes per sequence, in torch ops; 64 prefix-cache "
                        "snapshots)",
             # 3 layers x (conv: (2 x 4 x 8 + 8 x 8) channels x 3 inputs + 8 heads x 8 x 8) x 4 bytes
             "qwen3_5_moe": "keys and values per head in 1 of 4 layers; a fixed-size state per sequence in the other "
                            "3 (gated_delta: workers/recurrent.py, 10752 bytes per sequence, in torch ops; 64 "
                            "prefix-cache snapshots)",
             # 3 layers x (128 conv channels x 3 inputs + 6 heads x 16 x 8 of SSM state) x 4 bytes
             "falcon_h1": "keys and values per head in every layer, and beside them a fixed-size state per sequence "
                          "in 3 of 3 (mamba2: workers/recurrent.py, 13824 bytes per sequence, in torch ops; 64 "
                          "prefix-cache snapshots)",
             # 3 layers x (80 conv channels x 3 inputs + 4 heads x 16 x 8) x 4 bytes
             "falcon_h1-biases": "keys and values per head in every layer, and beside them a fixed-size state per "
                                 "sequence in 3 of 3 (mamba2: workers/recurrent.py, 9024 bytes per sequence, in torch "
                                 "ops; 64 prefix-cache snapshots)"}
    for name in ("gemma4_text", "gemma4"):  # layers 3 and 4 read layers 2's and 1's pools
        kinds[name] = "keys and values per head in 3 of 5 layers; the other 2 read an earlier layer's (3 <- 2, 4 <- 1)"
    assert info.kv_cache_kind == kinds.get(family_dir.name, kinds.get(info.model_type, "keys and values per head"))


def test_longrope_past_the_original_context_uses_long_factor():
    """Rows of the RoPE table from original_max_position_embeddings on are long_factor's, as
    transformers computes them for a sequence past the original context; rows before are
    short_factor's (what the greedy tests above compare)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.rope import RotaryEmbedding

    overrides = {key: value for key, value in FAMILIES["phi3"].items() if key != "model_type"}
    hf_config = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=1024, **overrides)
    config = ModelConfig.from_dict(hf_config.to_dict())
    rope = RotaryEmbedding(config, 1024, torch.float32, "cpu")
    positions = torch.arange(1024, dtype=torch.float32)[:, None]
    for seq_len, rows in ((None, slice(0, 512)), (513, slice(512, 1024))):
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=seq_len)
        expected = (positions[rows] * inv_freq[None, :]).cos() * attention_factor
        torch.testing.assert_close(rope.cos_f32[rows, : config.rotary_dim // 2], expected)


YARN_CASES = {
    # gpt-oss-20b/120b's own numbers (head_dim 64, theta 150000, 4096 tokens original, not truncated)
    "gpt-oss": dict(head_dim=64, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                        beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                        original_max_position_embeddings=4096)),
    # the correction range rounded outward (transformers' default), a small head and other betas
    "truncated": dict(head_dim=16, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                          beta_fast=16.0, beta_slow=2.0,
                                                          original_max_position_embeddings=256)),
    # the attention factor from mscale / mscale_all_dim
    "mscale": dict(head_dim=32, max_position_embeddings=8192,
                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, mscale=1.0,
                                        mscale_all_dim=0.5, original_max_position_embeddings=1024)),
    # an explicit attention factor
    "attention_factor": dict(head_dim=16, rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=8.0,
                                                                 attention_factor=0.7, truncate=False,
                                                                 original_max_position_embeddings=128)),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_equals_transformers(case):
    """yarn's inverse frequencies, attention factor and cos/sin tables, exactly as transformers'
    _compute_yarn_parameters and its rotary embedding compute them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.rope import RotaryEmbedding, inverse_frequencies

    settings = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    hf_config = AutoConfig.for_model("gpt_oss", **dict(settings, **YARN_CASES[case]))
    config = ModelConfig.from_dict(hf_config.to_dict())
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    scaling = config.rope_scaling
    assert scaling.rope_type == "yarn" and scaling.attention_factor == attention_factor
    ours = inverse_frequencies(config.rotary_dim, config.rope_theta, scaling)
    assert torch.equal(ours, inv_freq)
    assert not torch.equal(ours, inverse_frequencies(config.rotary_dim, config.rope_theta, RopeScaling("default")))
    rope = RotaryEmbedding(config, 4096, torch.float32, "cpu")
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    half = config.rotary_dim // 2
    torch.testing.assert_close(rope.cos_f32[:, :half], freqs.cos() * attention_factor, rtol=0, atol=0)
    torch.testing.assert_close(rope.signed_sin_f32[:, half:], freqs.sin() * attention_factor, rtol=0, atol=0)


def test_yarn_stays_longrope_for_phi3_only():
    raw = dict(model_type="phi3", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, original_max_position_embeddings=512,
               rope_scaling=dict(type="yarn", short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    assert ModelConfig.from_dict(raw).rope_scaling.rope_type == "longrope"
    llama = dict(raw, model_type="llama", rope_scaling=dict(rope_type="yarn", factor=2.0))
    scaling = ModelConfig.from_dict(llama).rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 2.0, 512)
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(2.0) + 1.0) and scaling.truncate
    # no factor: max_position_embeddings over the original context (transformers' default)
    no_factor = dict(llama, max_position_embeddings=4096, rope_scaling=dict(rope_type="yarn"))
    scaling = ModelConfig.from_dict(no_factor).rope_scaling
    assert (scaling.factor, scaling.beta_fast, scaling.beta_slow) == (8.0, 32.0, 1.0)
