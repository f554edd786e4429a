"""Qwen3.5 (workers/families.py: qwen3_5_text, qwen3_5_moe_text, and the multimodal qwen3_5 / qwen3_5_moe
checkpoints they are published as) against transformers' own classes.

Qwen3.5 runs Qwen3-Next's layers; what differs is data: the Gated DeltaNet's input products are
four plain tensors (GatedDeltaTraits.projections "qkv_z_b_a"), every layer has a dense MLP (or,
for the MoE, the same renormalised MoE with a gated shared expert in every layer), and the
checkpoint is a multimodal one whose vision tower is skipped. So: the mixer read from
transformers' Qwen3_5GatedDeltaNet gives its outputs over a whole prompt and over pieces and
batched decodes; the same layer read with b and a swapped must fail that comparison (so it can
fail); the catalog's checkpoints through the engine (a prompt of several delta-rule chunks in one
step, a prefix hit from a state snapshot, n=3 forks, preemption) give transformers' tokens; a
text-only checkpoint (Qwen3_5MoeForCausalLM) loads as the multimodal one does; and configs as
published parse, with what we refuse refused in one line. Greedy tokens and logprobs beside
chunked prompts on both paths: tests/workers/test_families.py -k qwen3_5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_hits_forks_and_preemption_answer_as_transformers,
                            engine_of, greedy, make_runner, prompts_of_lengths)
from test_gated_delta import HIDDEN, MODEL, PREFIX, TOLERANCE, empty_pool, reference, run_in_pieces, sequences
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig, ModelConfigError
from workers.families import GatedDeltaTraits
from workers.gated_delta import GatedDeltaMixer, read_gated_delta_weights
from workers.linear import TorchLinear
from workers.model import _WeightReader

TRAITS = GatedDeltaTraits(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_kernel=4,
                          projections="qkv_z_b_a")


def qwen3_5_layer(swap_b_and_a: bool = False):
    """(transformers' Qwen3_5GatedDeltaNet, our mixer read from its tensors), random weights off their
    initial values; swap_b_and_a: in_proj_b read as in_proj_a and the other way round (a broken reader)."""
    torch.manual_seed(0)
    from transformers import Qwen3_5TextConfig  # here: its import loads triton
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    config = Qwen3_5TextConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        module.dt_bias.uniform_(-1.0, 1.0)
        module.norm.weight.uniform_(0.5, 1.5)
        module.conv1d.weight.mul_(2.0)
    tensors = {PREFIX + name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    if swap_b_and_a:
        b, a = PREFIX + "in_proj_b.weight", PREFIX + "in_proj_a.weight"
        tensors[b], tensors[a] = tensors[a], tensors[b]
    reader = _WeightReader(None, tensors, "cpu", TorchLinear())
    weights = read_gated_delta_weights(reader, PREFIX, TRAITS, HIDDEN)
    assert not reader.tensors, f"unread: {sorted(reader.tensors)}"
    return module, GatedDeltaMixer(weights, TRAITS, config.rms_norm_eps)


@pytest.fixture(scope="module")
def layer():
    return qwen3_5_layer()


def test_the_mixer_equals_transformers_qwen3_5_gated_delta_net(layer):
    """A whole 150-token prompt (three delta-rule chunks), then prompts in pieces and batched decodes."""
    module, mixer = layer
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = mixer.prefill(MODEL, x, empty_pool(mixer), 2)
    torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)
    inputs = sequences()
    for x, ours in zip(inputs, run_in_pieces(mixer, inputs)):
        torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)


def test_b_and_a_read_swapped_fail_the_comparison():
    """Broken on purpose: the beta and decay projections exchanged. The comparison above must fail."""
    module, mixer = qwen3_5_layer(swap_b_and_a=True)
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = mixer.prefill(MODEL, x, empty_pool(mixer), 2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def model_dir(request, tmp_path_factory):
    """The catalog's multimodal Qwen3.5 checkpoints (dense, MoE)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("qwen3_5") / request.param, **FAMILIES[request.param])


def test_a_prompt_of_several_chunks_in_one_step_equals_transformers(model_dir):
    runner = make_runner(model_dir, num_blocks=400)
    oracle = HfOracle(model_dir)
    prompts = prompts_of_lengths([150, 70], runner.model_info.vocab_size, seed=3)
    engine = engine_of(runner, max_num_batched_tokens=160, max_model_len=256)
    for prompt, result in zip(prompts, engine.generate(prompts, greedy(6))):
        assert_greedy_matches(result.sequences[0].token_ids, oracle.greedy(prompt, 6))


def test_prefix_hits_forks_and_preemption_give_transformers_tokens(model_dir):
    """A prefix hit restores the Gated DeltaNet states from a snapshot; n=3 forks copy them; preemption
    recomputes them: transformers' tokens every time."""
    runner = make_runner(model_dir, num_blocks=400, state_snapshots=4)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, HfOracle(model_dir))


def test_a_text_only_checkpoint_loads_as_the_multimodal_one(tmp_path):
    """Qwen3_5MoeForCausalLM's own checkpoint (model_type qwen3_5_moe_text: no vision tower, no
    model.language_model. prefix) gives transformers' tokens too."""
    settings = dict(FAMILIES["qwen3_5_moe"], model_type="qwen3_5_moe_text")
    model_dir = build_tiny_model_dir(tmp_path / "qwen3_5_moe_text", **settings)
    runner = make_runner(model_dir)
    assert (runner.model_config.model_type, runner.model_config.text_model_of) == ("qwen3_5_moe_text", None)
    oracle = HfOracle(model_dir)
    prompts = prompts_of_lengths([9, 33], runner.model_info.vocab_size, seed=4)
    for prompt, result in zip(prompts, engine_of(runner).generate(prompts, greedy(8))):
        assert_greedy_matches(result.sequences[0].token_ids, oracle.greedy(prompt, 8))


# Qwen3.5's published configs (the keys that matter here): the multimodal wrapper around each text model
QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, hidden_act="silu", rms_norm_eps=1e-6,
    full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)
QWEN3_5_MOE_TEXT = dict(
    {key: value for key, value in QWEN3_5_TEXT.items() if key != "intermediate_size"}, model_type="qwen3_5_moe_text",
    hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512,
)


def multimodal(model_type: str, text: dict) -> dict:
    return dict(model_type=model_type, text_config=text, vision_config=dict(depth=27), tie_word_embeddings=False,
                eos_token_id=248046)


def test_configs_as_published_parse():
    dense = ModelConfig.from_dict(multimodal("qwen3_5", QWEN3_5_TEXT))
    t = dense.traits
    assert (dense.model_type, dense.text_model_of, dense.eos_token_ids) == ("qwen3_5_text", "qwen3_5", (248046,))
    assert t.mixers == ("gated_delta", "gated_delta", "gated_delta", None) * 8 and t.moe is None
    assert t.gated_delta == GatedDeltaTraits(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                                             conv_kernel=4, projections="qkv_z_b_a")
    assert (dense.rotary_dim, dense.rope_theta, dense.rope_scaling.rope_type) == (64, 1e7, "default")
    assert (dense.intermediate_size, t.attention_output_gate, t.qk_norm) == (12288, True, "head")
    assert t.norm_weight_offset == 1.0
    assert t.skipped_prefixes == ("mtp.", "model.visual.")
    moe = ModelConfig.from_dict(multimodal("qwen3_5_moe", QWEN3_5_MOE_TEXT))  # no intermediate_size: none is dense
    m = moe.traits.moe
    assert (moe.model_type, moe.text_model_of, moe.intermediate_size) == ("qwen3_5_moe_text", "qwen3_5_moe", 512)
    assert (m.num_experts, m.top_k, m.intermediate_size, m.renormalize) == (256, 8, 512, True)
    assert m.scoring == "softmax_topk"
    assert (m.shared_intermediate_size, m.shared_expert_gate, m.layers) == (512, True, (True,) * 40)
    # Qwen3.5's MoE has no dense layers and always renormalises: Qwen3-Next's keys, if present, are not read
    stale = ModelConfig.from_dict(dict(QWEN3_5_MOE_TEXT, norm_topk_prob=False, mlp_only_layers=[0]))
    assert stale.traits.moe == m
    defaults = ModelConfig.from_dict({key: value for key, value in QWEN3_5_TEXT.items()
                                      if key not in ("rope_parameters", "full_attention_interval")})
    assert defaults.rotary_dim == 64 and defaults.traits.mixers[:4] == ("gated_delta",) * 3 + (None,)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu_pytorch_tanh"), "qwen3_5_text with hidden_act 'gelu_pytorch_tanh' is not supported"),
    (dict(layer_types=["sliding_attention"] * 32), "qwen3_5_text needs layer_types of linear_attention"),
    (dict(linear_num_key_heads=3), "do not share 3 key heads evenly"),
    (dict(rope_parameters=dict(rope_type="mrope_unknown", rope_theta=1e7)), "rope scaling 'mrope_unknown'"),
])
def test_what_we_cannot_make_exact_is_refused_in_one_line(change, message):
    with pytest.raises(ModelConfigError, match=message) as raised:
        ModelConfig.from_dict(multimodal("qwen3_5", dict(QWEN3_5_TEXT, **change)))
    assert "\n" not in str(raised.value)


def test_a_text_config_of_another_family_is_refused():
    with pytest.raises(ModelConfigError, match="qwen3_5's text_config has model_type 'qwen3_next'"):
        ModelConfig.from_dict(multimodal("qwen3_5", dict(QWEN3_5_TEXT, model_type="qwen3_next")))


def test_gated_delta_traits_refuse_an_unknown_projection_layout():
    from workers.families import FamilyError

    with pytest.raises(FamilyError, match="projections 'qkvzba' are not one of"):
        dataclasses.replace(TRAITS, projections="qkvzba")
