"""The families beyond Llama (workers/families.py), each a tiny random checkpoint built with
transformers' own config and model classes and loaded by our loader: greedy tokens and
logprobs equal transformers' on the torch reference path (the Python layer loop over torch ops
and products, as on a GPU) and on our C layer loop; and the C loop equals the Python loop over
our kernels bit for bit, step by step."""

from __future__ import annotations

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_logprobs_match_hf, greedy, make_runner,
                            prompts_of_lengths, run_requests, run_with_logprobs)
from test_native_forward import compare_every_step
from tiny_model import build_tiny_model_dir

from scheduler.sampling_params import SamplingParams
from workers.config import ModelConfig
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
    assert (runner.model.native_forward is not None) == (path == "c-loop")
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
    compared = compare_every_step(runner)
    run_requests(runner, prompts_of_lengths([2, 9, 30], runner.model_info.vocab_size), greedy(8), token_budget=16)
    assert len(compared) >= 8


def test_traits_read_from_the_config(family_dir):
    config = ModelConfig.from_model_dir(family_dir)
    traits = FAMILIES[family_dir.name]
    assert config.model_type == traits["model_type"]
    assert config.qk_norm == {"qwen3": "head", "olmo2": "projection", "gemma3_text": "head"}.get(config.model_type)
    assert config.norms == {"olmo2": "post", "gemma2": "sandwich", "gemma3_text": "sandwich"}.get(config.model_type, "pre")
    if config.model_type.startswith("gemma"):
        assert config.layer_windows == (8, None, 8) and config.activation == "gelu_tanh"
        assert config.norm_weight_offset == 1.0 and config.attention_scale == 24 ** -0.5
        assert config.embedding_multiplier == 64 ** 0.5 and config.sliding_window is None  # the context is not capped
    if config.model_type == "gemma2":
        assert (config.attention_softcap, config.logits_softcap) == (5.0, 8.0)
    if config.model_type == "gemma3_text":
        assert config.local_rope_layers == (True, False, True) and config.local_rope_theta == 1e4
        assert config.rope_theta == 1e6 and config.rope_scaling.rope_type == "linear"
    if config.model_type == "phi3":
        assert config.fused_projections and config.rotary_dim == config.head_dim // 2
        assert config.rope_scaling.rope_type == "longrope" and config.rope_scaling.attention_factor > 1.0
    if config.model_type == "smollm3":
        assert config.rope_layers == (True, False, True, False)
    if config.model_type == "granite":
        assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale) == (4.0, 0.4, 0.09)
        assert config.logits_scale == pytest.approx(1 / 3)


def test_model_info_names_the_family_and_the_layer_loop(family_dir):
    info = family_runner(family_dir, "torch").model_info
    assert info.model_type == FAMILIES[family_dir.name]["model_type"]
    assert (info.layer_loop, info.layer_ops, info.linear_backend) == ("python", "torch", "torch")


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
