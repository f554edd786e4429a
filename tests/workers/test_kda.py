"""The Kimi Delta Attention mixer (workers/kda.py) against transformers' KimiLinearDeltaAttention.

fp32, a tiny random layer built by transformers' own class (its torch fallbacks: chunk_kda over the
whole sequence, no cache). Ours must give the same outputs over a whole prompt, over the same prompt
cut into pieces of awkward sizes with the state carried in the pool, and then over batched decode
steps of three sequences in scattered pool rows; and the same comparison must fail when the carried
state is broken, so that it can fail at all. Then the catalog's kimi_linear checkpoint (KDA layers
between NoPE MLA layers, DeepSeek's MoE) through the engine: prefix hits from a state snapshot, n>1
forks and preemption give transformers' tokens (its greedy tokens and logprobs: test_families.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_hits_forks_and_preemption_answer_as_transformers,
                            engine_of, greedy, make_runner, prompts_of_lengths)
from tiny_model import build_tiny_model_dir

from workers.families import KdaTraits
from workers.kda import KdaMixer, read_kda_weights
from workers.layer_ops import TorchOps
from workers.linear import TorchLinear
from workers.model import _WeightReader
from workers.recurrent import StateStep, run_mixer

HIDDEN = 48
PREFIX = "model.layers.0.self_attn."
TOLERANCE = dict(rtol=1e-4, atol=2e-5)
# each prompt's pieces (sum: its length), then DECODE_STEPS tokens each in batched decodes
PIECES = ([1, 7, 69, 64, 3, 1, 130], [64, 64], [5, 1, 2])
DECODE_STEPS = 6
POOL_ROWS = (3, 0, 5)  # each sequence's row in a pool of 7: not 0, 1, 2


@pytest.fixture(scope="module")
def layer():
    """(transformers' module, our mixer) with the same random weights, off their initial values."""
    torch.manual_seed(0)
    from transformers import KimiLinearConfig  # here: its import loads triton
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    config = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                              linear_num_heads=3, linear_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    module = KimiLinearDeltaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
        module.forget_gate.A_log.uniform_(-1.0, 1.5)
        module.forget_gate.dt_bias.uniform_(-2.0, 1.0)
        module.o_norm.weight.uniform_(0.5, 1.5)
        module.conv1d.weight.normal_(0.0, 0.5)
    traits = KdaTraits(num_heads=3, head_dim=16, conv_kernel=4)
    tensors = {PREFIX + name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    reader = _WeightReader(None, tensors, "cpu", TorchLinear())
    weights = read_kda_weights(reader, PREFIX, traits, HIDDEN)
    assert not reader.tensors, f"unread: {sorted(reader.tensors)}"
    return module, KdaMixer(weights, traits, config.rms_norm_eps)


MODEL = SimpleNamespace(linear=TorchLinear().linear, ops=TorchOps())  # what the mixer needs of the model


def empty_pool(mixer: KdaMixer, num_rows: int = 7) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(num_rows, *shape, dtype=dtype) for shape, dtype in mixer.state_specs())


@torch.no_grad()
def reference(module, x: torch.Tensor) -> torch.Tensor:
    """transformers' outputs for one whole sequence x [n, hidden]."""
    return module(x.unsqueeze(0))[0]


@torch.no_grad()
def run_in_pieces(mixer, inputs: list[torch.Tensor], tamper=None) -> list[torch.Tensor]:
    """Each sequence's prompt through prefill piece by piece (PIECES), then DECODE_STEPS batched
    decodes of every sequence at once; tamper(pool, row), where given, runs between pieces."""
    pool, outputs = empty_pool(mixer), []
    for x, pieces, row in zip(inputs, PIECES, POOL_ROWS):
        parts, start = [], 0
        for size in pieces:
            if tamper is not None and start > 0:
                tamper(pool, row)
            parts.append(mixer.prefill(MODEL, x[start:start + size], pool, row))
            start += size
        outputs.append(parts)
    rows = torch.tensor(POOL_ROWS)
    for step in range(DECODE_STEPS):
        tokens = torch.stack([x[sum(pieces) + step] for x, pieces in zip(inputs, PIECES)])
        y = mixer.decode(MODEL, tokens, pool, rows)
        for i in range(len(inputs)):
            outputs[i].append(y[i:i + 1])
    return [torch.cat(parts) for parts in outputs]


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(sum(pieces) + DECODE_STEPS, HIDDEN, generator=generator) for pieces in PIECES]


def test_a_whole_prompt_equals_transformers(layer):
    module, mixer = layer
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(2))
    pool = empty_pool(mixer)
    with torch.no_grad():
        ours = mixer.prefill(MODEL, x, pool, 2)
    expected = reference(module, x)
    assert expected.abs().mean() > 1e-2  # the outputs are not vanishingly small
    torch.testing.assert_close(ours, expected, **TOLERANCE)
    assert pool[1][2].abs().sum() > 0 and pool[1][[0, 1, 3, 4, 5, 6]].abs().sum() == 0  # its row only


def test_pieces_then_batched_decodes_equal_transformers_over_the_whole_sequences(layer):
    module, mixer = layer
    inputs = sequences()
    for x, ours in zip(inputs, run_in_pieces(mixer, inputs)):
        torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)


def shift_conv_state(pool, row):
    """The conv state off by one token: its window moved one input back."""
    pool[0][row] = torch.roll(pool[0][row], 1, dims=0)


def drop_recurrent_state(pool, row):
    pool[1][row].zero_()


def transpose_recurrent_state(pool, row):
    """The matrices' key and value axes swapped: a decay applied to the wrong axis would not notice."""
    pool[1][row] = pool[1][row].mT.clone()


@pytest.mark.parametrize("tamper", [shift_conv_state, drop_recurrent_state, transpose_recurrent_state])
def test_a_broken_carried_state_is_detected(layer, tamper):
    module, mixer = layer
    inputs = sequences()
    outputs = run_in_pieces(mixer, inputs, tamper)
    for x, ours in zip(inputs, outputs):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)


def test_run_mixer_splits_a_mixed_step_and_takes_a_snapshot(layer):
    """A step of a prompt piece (with a snapshot after its first 10 tokens), a decode and another
    piece through run_mixer: transformers' outputs, and the snapshot row continues as the sequence would."""
    module, mixer = layer
    a, b, c = sequences()
    pool = empty_pool(mixer)
    with torch.no_grad():
        mixer.prefill(MODEL, b[:20], pool, POOL_ROWS[1])
        mixer.prefill(MODEL, c[:3], pool, POOL_ROWS[2])
        x = torch.cat([a[:30], b[20:21], c[3:8]])
        step = StateStep(query_start_loc=[0, 30, 31, 36], rows=list(POOL_ROWS), saves={0: (10, 6)})
        y = run_mixer(mixer, MODEL, x, pool, step)
        torch.testing.assert_close(y[:30], reference(module, a[:30]), **TOLERANCE)
        torch.testing.assert_close(y[30:31], reference(module, b[:21])[20:], **TOLERANCE)
        torch.testing.assert_close(y[31:], reference(module, c[:8])[3:], **TOLERANCE)
        resumed = mixer.prefill(MODEL, a[10:40], pool, 6)
    torch.testing.assert_close(resumed, reference(module, a[:40])[10:], **TOLERANCE)


@pytest.fixture(scope="module")
def kimi_linear_dir(tmp_path_factory):
    """The catalog's tiny kimi_linear checkpoint (KDA layers 0, 2, 3; a NoPE MLA layer 1; MoE), in Moonshot's
    tensor names (block_sparse_moe, q_conv1d / k_conv1d / v_conv1d, self_attn.A_log ...)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("kda") / "kimi_linear", **FAMILIES["kimi_linear"])


def test_the_model_allocates_a_latent_pool_per_mla_layer_and_state_pools_per_kda_layer(kimi_linear_dir):
    runner = make_runner(kimi_linear_dir, num_blocks=64)
    assert [type(layer.mixer).__name__ if layer.mixer else "mla" for layer in runner.model.layers] == \
        ["KdaMixer", "mla", "KdaMixer", "KdaMixer"]
    latent = runner.kv_caches[1]
    assert latent[0].shape == (64, runner.block_size, 1, 16 + 8)  # (pool, latent view): one latent + key per token
    assert [pool is None for pool in runner.states.pools] == [False, True, False, False]
    assert runner.states.pools[0][1].shape[1:] == (2, 16, 16)


def test_a_prompt_of_several_chunks_in_one_step_equals_transformers(kimi_linear_dir):
    """A 150-token prompt in one step (three chunks, the last partial) beside one whose pieces start mid-chunk."""
    runner = make_runner(kimi_linear_dir, num_blocks=400)
    oracle = HfOracle(kimi_linear_dir)
    prompts = prompts_of_lengths([150, 70], runner.model_info.vocab_size, seed=3)
    engine = engine_of(runner, max_num_batched_tokens=160, max_model_len=256)
    for prompt, result in zip(prompts, engine.generate(prompts, greedy(6))):
        assert_greedy_matches(result.sequences[0].token_ids, oracle.greedy(prompt, 6))


def test_prefix_hits_forks_and_preemption_continue_the_kda_states(kimi_linear_dir):
    """A prefix hit restores the KDA states from a snapshot (and the MLA layer's latents from the cached
    blocks); n=3 forks copy them; preemption recomputes them: transformers' tokens every time."""
    runner = make_runner(kimi_linear_dir, num_blocks=400, state_snapshots=4)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, HfOracle(kimi_linear_dir))


# Kimi-Linear-48B-A3B's config.json as Moonshot writes it (the keys read here): its layer kinds in
# linear_attn_config (1-based), its MoE under its own key names
KIMI_LINEAR_48B = dict(
    model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=163840, hidden_size=2304,
    intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27, num_attention_heads=32,
    num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, mla_use_nope=True, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
    moe_renormalize=True, moe_router_activation_func="sigmoid", routed_scaling_factor=2.446, first_k_dense_replace=1,
    num_expert_group=1, topk_group=1, rms_norm_eps=1e-5, model_max_length=1048576, hidden_act="silu",
    linear_attn_config=dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                            kda_layers=[n for n in range(1, 28) if n not in (4, 8, 12, 16, 20, 24, 27)],
                            num_heads=32, head_dim=128, short_conv_kernel_size=4),
)


def test_kimi_linear_config_as_moonshot_writes_it():
    from workers.config import ModelConfig, ModelConfigError

    config = ModelConfig.from_dict(KIMI_LINEAR_48B)
    t = config.traits
    full = {3, 7, 11, 15, 19, 23, 26}
    assert t.mixers == tuple(None if layer in full else "kda" for layer in range(27))
    assert t.kda == KdaTraits(num_heads=32, head_dim=128, conv_kernel=4)
    assert (t.mla.kv_lora_rank, t.mla.qk_rope_head_dim, t.mla.q_lora_rank, t.mla.rope) == (512, 64, None, False)
    assert t.attention_scale == pytest.approx(192**-0.5)
    assert (t.moe.num_experts, t.moe.top_k, t.moe.intermediate_size) == (256, 8, 1024)
    assert t.moe.shared_intermediate_size == 1024 and t.moe.expert_projections == ("w1", "w3", "w2")
    assert (t.moe.num_groups, t.moe.routed_scaling_factor, t.moe.renormalize) == (1, 2.446, True)
    assert t.moe.layers == (False,) + (True,) * 26 and t.moe.scoring == "sigmoid_topk"
    assert config.max_position_embeddings == 1048576
    assert [config.kv_elements_per_token(layer) for layer in (2, 3)] == [0, 512 + 64]
    with pytest.raises(ModelConfigError, match="mla_use_nope false"):
        ModelConfig.from_dict(dict(KIMI_LINEAR_48B, mla_use_nope=False))
    with pytest.raises(ModelConfigError, match="moe_router_activation_func 'softmax'"):
        ModelConfig.from_dict(dict(KIMI_LINEAR_48B, moe_router_activation_func="softmax"))
    with pytest.raises(ModelConfigError, match="layer_types of linear_attention / full_attention"):
        ModelConfig.from_dict(dict(KIMI_LINEAR_48B, layer_types=["sliding_attention"] * 27))
