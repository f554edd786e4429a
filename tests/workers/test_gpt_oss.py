"""gpt-oss beyond what tests/workers/test_moe.py runs for every MoE checkpoint (greedy tokens and
logprobs equal transformers' GptOss on the torch path and our CPU kernels, "gpt_oss" there):

- MXFP4 (workers/mxfp4.py): hand-built blocks and scales give the values written out by hand,
  and random ones equal transformers' own dequantization (integrations/mxfp4.py);
- a tiny checkpoint whose experts we quantize to MXFP4 ourselves (blocks and scales in the
  safetensors, quant_method "mxfp4" in config.json) gives the greedy tokens and logprobs of
  transformers' model holding the dequantized experts, on both paths;
- the config: per-layer windows, sinks, the router and experts' layout; mxfp4 is accepted for
  gpt_oss only (reported as "mxfp4 (dequantized at load)"), and unsupported ones refused;
- a missing sinks tensor, or missing MXFP4 blocks, fail with one line naming them.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from runner_helpers import (HfOracle, assert_greedy_matches, assert_logprobs_match_hf, greedy, make_runner,
                            prompts_of_lengths, run_requests, run_with_logprobs)
from safetensors.torch import load_file, save_file
from test_moe import CHECKPOINTS, PATHS, moe_runner
from tiny_model import build_tiny_model_dir

from scheduler.sampling_params import SamplingParams
from workers.config import ModelConfig, ModelConfigError
from workers.kernels import get_attention_backend
from workers.loader import ModelPathError
from workers.model import PagedLlamaModel, WeightError
from workers.mxfp4 import FP4_E2M1, dequantize_mxfp4

GPT_OSS = CHECKPOINTS["gpt_oss"]
RAW = dict(model_type="gpt_oss", vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
           sliding_window=128)


def test_dequantize_hand_built_blocks():
    """Two groups of one row: the first scaled by 2 ** (128 - 127), the second by 2 ** (125 - 127)."""
    first = [0x21, 0xF7, 0x80, 0x3C] + [0x00] * 12  # low nibble first: 0.5, 1 | 6, -6 | 0, -0 | -2, 1.5
    second = [0x9A] + [0x44] * 15  # -1, -0.5 | then 2, 2 (fifteen times)
    blocks = torch.tensor([[first, second]], dtype=torch.uint8)  # [rows 1, groups 2, 16]
    scales = torch.tensor([[128, 125]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 64) and out.dtype == torch.float32
    assert out[0, :8].tolist() == [1.0, 2.0, 12.0, -12.0, 0.0, -0.0, -4.0, 3.0]
    assert out[0, 8:32].tolist() == [0.0] * 24
    assert out[0, 32:].tolist() == [-0.25, -0.125] + [0.5] * 30
    assert torch.signbit(out[0, 5])  # -0 stays negative zero
    assert dequantize_mxfp4(blocks, scales, torch.bfloat16).float().equal(out)  # exact in bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantize_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    assert tuple(FP4_VALUES) == FP4_E2M1
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)  # [E, out, groups, 16]
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=generator)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]: transformers' layout
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]: ours
    assert ours.dtype == dtype and ours.shape == (3, 10, 128)
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_dequantize_refuses_misshapen_input():
    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)
    with pytest.raises(ValueError, match=r"blocks \(2, 3, 8\) do not fit scales \(2, 3\)"):
        dequantize_mxfp4(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[:, :2])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., in] -> (blocks [..., in / 32, 16], scales [..., in / 32]): each group of 32 scaled by the
    power of two that brings its largest magnitude to at most 6, each value rounded to the nearest E2M1."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1).clamp_min(2.0 ** -100)
    exponents = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.pow(2.0, exponents).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_E2M1[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory):
    """(our MXFP4 checkpoint, the same model with the dequantized experts in transformers' layout)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    plain_dir = build_tiny_model_dir(root / "plain", **GPT_OSS)
    quantized_dir, dequantized_dir = root / "mxfp4", root / "dequantized"
    shutil.copytree(plain_dir, quantized_dir)
    shutil.copytree(plain_dir, dequantized_dir)
    tensors = load_file(plain_dir / "model.safetensors")
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))  # transformers' [E, in, out] -> [E, out, in]
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        assert not torch.equal(dequantized[name], tensors[name])  # 4 bits changed the weights
        torch.testing.assert_close(dequantized[name], tensors[name], atol=0.5, rtol=0.25)  # but not beyond FP4
    save_file(quantized, quantized_dir / "model.safetensors")
    save_file(dequantized, dequantized_dir / "model.safetensors")
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized_dir / "config.json").write_text(json.dumps(config))
    return quantized_dir, dequantized_dir


@pytest.mark.parametrize("path", sorted(PATHS))
def test_mxfp4_checkpoint_equals_transformers_on_the_dequantized_experts(mxfp4_dirs, path):
    quantized_dir, dequantized_dir = mxfp4_dirs
    assert ModelConfig.from_model_dir(quantized_dir).quantization == "mxfp4"
    runner = moe_runner(quantized_dir, path)
    assert runner.model_info.quantization == "mxfp4 (dequantized at load)"
    oracle = HfOracle(dequantized_dir)
    prompts = prompts_of_lengths([3, 17, 40], runner.model_info.vocab_size, seed=4)
    for prompt, output in zip(prompts, run_requests(runner, prompts, greedy(10), token_budget=16)):
        assert_greedy_matches(output, oracle.greedy(prompt, 10))
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=4)]
    for request in run_with_logprobs(runner, prompts_of_lengths([21], runner.model_info.vocab_size, seed=5), params):
        assert_logprobs_match_hf(request, oracle, 4)


def test_config_traits():
    config = ModelConfig.from_dict(dict(RAW, layer_types=["sliding_attention", "full_attention"] * 2,
                                        swiglu_limit=5.0))
    assert config.traits.layer_windows == (128, None, 128, None) and config.traits.sliding_window is None
    assert config.traits.attention_sinks and config.traits.qkv_bias and config.traits.o_bias and config.quantization is None
    moe = config.traits.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.layers) == (8, 2, 64, (True,) * 4)
    assert (moe.scoring, moe.router_bias, moe.router, moe.expert_layout) == ("topk_softmax", True, "router", "gpt_oss")
    assert (moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == ("swiglu_oai", 1.702, 5.0)
    # no layer_types: every other layer slides, from the first (transformers' default)
    assert ModelConfig.from_dict(RAW).traits.layer_windows == (128, None, 128, None)
    assert ModelConfig.from_dict(dict(RAW, experts_per_token=4, num_experts_per_tok=None)).traits.moe.top_k == 4


def test_mxfp4_is_accepted_for_gpt_oss_only():
    mxfp4 = {"quant_method": "mxfp4"}
    assert ModelConfig.from_dict(dict(RAW, quantization_config=mxfp4)).quantization == "mxfp4"
    with pytest.raises(ModelConfigError, match=r"quantization 'mxfp4' is served for gpt_oss's experts only"):
        ModelConfig.from_dict(dict(RAW, model_type="llama", quantization_config=mxfp4))
    with pytest.raises(ModelConfigError, match=r"quantization 'bitsandbytes': not supported; supported: "):
        ModelConfig.from_dict(dict(RAW, quantization_config={"quant_method": "bitsandbytes"}))


def load_tensors(model_dir, tensors: dict) -> PagedLlamaModel:
    return PagedLlamaModel.from_hf_weights(ModelConfig.from_model_dir(model_dir), tensors, "cpu",
                                           get_attention_backend("torch"), 64)


def test_a_missing_sinks_tensor_is_named_on_one_line(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "gpt_oss", **GPT_OSS)
    tensors = load_file(model_dir / "model.safetensors")
    missing = "model.layers.1.self_attn.sinks"
    del tensors[missing]
    with pytest.raises(WeightError) as error:
        load_tensors(model_dir, dict(tensors))
    assert str(error.value) == f"missing tensor {missing}"
    save_file(tensors, model_dir / "model.safetensors")  # and through the loader, naming the directory
    with pytest.raises(ModelPathError, match=f"{model_dir}.*missing tensor {missing}") as error:
        make_runner(model_dir)
    assert "\n" not in str(error.value)


def test_missing_mxfp4_blocks_are_named(mxfp4_dirs):
    quantized_dir, _ = mxfp4_dirs
    tensors = load_file(quantized_dir / "model.safetensors")
    missing = "model.layers.2.mlp.experts.down_proj_blocks"
    with pytest.raises(WeightError, match=f"^missing tensor {missing}$"):
        load_tensors(quantized_dir, {name: tensor for name, tensor in tensors.items() if name != missing})
    scales = "model.layers.0.mlp.experts.gate_up_proj_scales"
    with pytest.raises(WeightError, match=f"^{scales} is torch.float32, expected uint8"):
        load_tensors(quantized_dir, dict(tensors, **{scales: tensors[scales].float()}))


def test_gpt_oss_20b_config_json():
    """gpt-oss-20b's config.json as published (older rope_theta + rope_scaling spelling, MXFP4)."""
    raw = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }
    config = ModelConfig.from_dict(raw)
    scaling = config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 32.0, 4096)
    assert not scaling.truncate and scaling.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
    assert config.rope_theta == 150000.0 and config.head_dim == 64 and config.max_model_len == 131072
    assert config.traits.layer_windows == (128, None) * 12 and config.traits.attention_sinks and config.quantization == "mxfp4"
    assert (config.traits.moe.num_experts, config.traits.moe.top_k, config.traits.moe.intermediate_size) == (32, 4, 2880)
    assert config.traits.moe.swiglu_limit == 7.0 and config.traits.moe.swiglu_alpha == 1.702
