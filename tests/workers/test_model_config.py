"""ModelConfig parsing (Llama, Qwen2, Mistral; old and new RoPE spellings) and RoPE frequencies."""

from __future__ import annotations

import json

import pytest
import torch

from workers.config import ModelConfig, ModelConfigError
from workers.rope import inverse_frequencies

LLAMA = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096)


def test_llama_with_old_style_rope_keys_and_eos_list():
    config = ModelConfig.from_dict(dict(LLAMA, rope_theta=500000.0, eos_token_id=[128001, 128009],
                                        rope_scaling={"type": "linear", "factor": 2.0}),
                                   {"eos_token_id": [128009, 128008]})
    assert config.head_dim == 32 and config.num_queries_per_kv == 4
    assert config.rope_theta == 500000.0
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0
    assert config.eos_token_ids == (128001, 128009, 128008)
    assert not config.traits.qkv_bias and not config.tie_word_embeddings
    assert config.max_model_len == 4096


def test_transformers5_rope_parameters_and_llama3():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = ModelConfig.from_dict(dict(LLAMA, rope_parameters=rope, attention_bias=True, eos_token_id=2))
    assert config.rope_theta == 500000.0 and config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.original_max_position_embeddings == 8192
    assert config.traits.qkv_bias and config.traits.o_bias and config.eos_token_ids == (2,)


def test_qwen2_has_qkv_bias_only_and_mistral_window_caps_length():
    qwen = ModelConfig.from_dict(dict(LLAMA, model_type="qwen2", use_sliding_window=False, sliding_window=4096))
    assert qwen.traits.qkv_bias and not qwen.traits.o_bias and qwen.traits.sliding_window is None
    mistral = ModelConfig.from_dict(dict(LLAMA, model_type="mistral", head_dim=64, sliding_window=1024))
    assert mistral.head_dim == 64 and not mistral.traits.qkv_bias
    assert mistral.max_model_len == 1024


@pytest.mark.parametrize("raw,message", [
    (dict(LLAMA, model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(LLAMA, rope_scaling={"rope_type": "su", "factor": 4.0}), "rope scaling 'su'"),  # phi3's name only
    ({"model_type": "llama"}, "missing keys"),
    (dict(LLAMA, num_key_value_heads=3), "not a multiple"),
    (dict(LLAMA, hidden_act="gelu"), "activation 'gelu' is not supported"),
])
def test_unsupported_configs_fail_clearly(raw, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_from_model_dir_errors_name_the_file(tmp_path):
    with pytest.raises(ModelConfigError, match=str(tmp_path / "config.json")):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not readable JSON"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, model_type="bert")))
    with pytest.raises(ModelConfigError, match="config.json: model_type 'bert'"):
        ModelConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
])
def test_inverse_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"}, rope_parameters=dict(rope))
    ours = ModelConfig.from_dict(dict(LLAMA, rope_parameters=dict(rope)))
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)[0]
    else:
        expected = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")[0]
    actual = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)


def test_families_and_refusals_say_what_they_are():
    qwen3 = ModelConfig.from_dict(dict(LLAMA, model_type="qwen3", head_dim=128))
    assert qwen3.traits.qk_norm == "head" and qwen3.head_dim == 128 and qwen3.traits.rope_layers is None
    smol = ModelConfig.from_dict(dict(LLAMA, model_type="smollm3", num_hidden_layers=4, no_rope_layers=[1, 1, 0, 1]))
    assert [smol.uses_rope(layer) for layer in range(4)] == [True, True, False, True]
    with pytest.raises(ModelConfigError, match="no_rope_layers has 2 entries for 4 layers"):
        ModelConfig.from_dict(dict(LLAMA, model_type="smollm3", num_hidden_layers=4, no_rope_layers=[1, 0]))
    with pytest.raises(ModelConfigError, match="qwen3 with use_sliding_window"):
        ModelConfig.from_dict(dict(LLAMA, model_type="qwen3", use_sliding_window=True, sliding_window=128))
    with pytest.raises(ModelConfigError, match="model_type 'rwkv' is not supported"):  # qwen3_next is served now
        ModelConfig.from_dict(dict(LLAMA, model_type="rwkv"))
    with pytest.raises(ModelConfigError, match="12 experts do not split into n_group 8 groups"):
        ModelConfig.from_dict(dict(LLAMA, model_type="deepseek_v3", num_hidden_layers=4, first_k_dense_replace=1,
                                   n_routed_experts=12))
    with pytest.raises(ModelConfigError, match="gemma2 needs layer_types"):
        ModelConfig.from_dict(dict(LLAMA, model_type="gemma2"))
    with pytest.raises(ModelConfigError, match="sliding_attention layers need sliding_window"):
        ModelConfig.from_dict(dict(LLAMA, model_type="gemma2", layer_types=["sliding_attention"] * 2))
    with pytest.raises(ModelConfigError, match="quantization 'gptq': 8-bit weights are not supported .*; supported: "):
        ModelConfig.from_dict(dict(LLAMA, quantization_config={"quant_method": "gptq", "bits": 8}))
    with pytest.raises(ModelConfigError, match="quantization 'bitsandbytes': not supported; supported: .*awq"):
        ModelConfig.from_dict(dict(LLAMA, quantization_config={"quant_method": "bitsandbytes"}))
    with pytest.raises(ModelConfigError, match="'mxfp4' is served for gpt_oss's experts only"):
        ModelConfig.from_dict(dict(LLAMA, quantization_config={"quant_method": "mxfp4"}))


def test_quantized_checkpoints_are_parsed():
    assert ModelConfig.from_dict(LLAMA).quant_spec is None
    awq = ModelConfig.from_dict(dict(LLAMA, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128}))
    assert (awq.quantization, awq.quant_spec.label) == ("awq", "awq:4bit-g128")
    fp8 = ModelConfig.from_dict(dict(LLAMA, quantization_config={"quant_method": "fbgemm_fp8"}))
    assert (fp8.quantization, fp8.quant_spec.label) == ("fp8", "fbgemm_fp8:fp8-channel")
