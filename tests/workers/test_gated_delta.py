"""The Gated DeltaNet mixer (workers/gated_delta.py) against transformers' Qwen3NextGatedDeltaNet.

fp32, a tiny random layer built by transformers' own class (its torch fallbacks: chunked delta
rule over the whole sequence, no cache). Ours must give the same outputs over a whole prompt,
over the same prompt cut into pieces of awkward sizes with the state carried in the pool, and
then over batched decode steps of three sequences of different lengths in scattered pool rows;
and the same comparison must fail when the carried state is broken (conv state off by a token,
recurrent state dropped), so that it can fail at all. Then the catalog's qwen3_next checkpoint
through the engine: a prompt of several chunks in one step, prefix hits from a state snapshot, n>1
forks and preemption give transformers' tokens (its greedy tokens and logprobs beside chunked
prompts: tests/workers/test_families.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from families_catalog import FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_hits_forks_and_preemption_answer_as_transformers,
                            engine_of, greedy, make_runner, prompts_of_lengths)
from tiny_model import build_tiny_model_dir

from workers.families import GatedDeltaTraits
from workers.gated_delta import GatedDeltaMixer, read_gated_delta_weights
from workers.layer_ops import TorchOps
from workers.linear import TorchLinear
from workers.model import _WeightReader
from workers.recurrent import StateStep, run_mixer

HIDDEN = 48
PREFIX = "model.layers.0.linear_attn."
TOLERANCE = dict(rtol=1e-4, atol=2e-5)
# each prompt's pieces (sum: its length), then DECODE_STEPS tokens each in batched decodes
PIECES = ([1, 7, 69, 64, 3, 1, 130], [64, 64], [5, 1, 2])
DECODE_STEPS = 6
POOL_ROWS = (3, 0, 5)  # each sequence's row in a pool of 7: not 0, 1, 2


@pytest.fixture(scope="module")
def layer():
    """(transformers' module, our mixer) with the same random weights: 2 key heads each shared by 2
    value heads, so that the checkpoint's per-key-head grouping of in_proj_qkvz / in_proj_ba matters."""
    torch.manual_seed(0)
    from transformers import Qwen3NextConfig  # here: its import loads triton
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    config = Qwen3NextConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    module = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # off their initial values, so that a misplaced one shows
        module.dt_bias.uniform_(-1.0, 1.0)
        module.norm.weight.uniform_(0.5, 1.5)
        module.conv1d.weight.mul_(2.0)
    traits = GatedDeltaTraits(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_kernel=4)
    tensors = {PREFIX + name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    reader = _WeightReader(None, tensors, "cpu", TorchLinear())
    weights = read_gated_delta_weights(reader, PREFIX, traits, HIDDEN)
    assert not reader.tensors, f"unread: {sorted(reader.tensors)}"
    return module, GatedDeltaMixer(weights, traits, config.rms_norm_eps)


MODEL = SimpleNamespace(linear=TorchLinear().linear, ops=TorchOps())  # what the mixer needs of the model


def empty_pool(mixer: GatedDeltaMixer, num_rows: int = 7) -> tuple[torch.Tensor, ...]:
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
    torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)
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


@pytest.mark.parametrize("tamper", [shift_conv_state, drop_recurrent_state])
def test_a_broken_carried_state_is_detected(layer, tamper):
    module, mixer = layer
    inputs = sequences()
    outputs = run_in_pieces(mixer, inputs, tamper)
    for x, ours in zip(inputs, outputs):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(ours, reference(module, x), **TOLERANCE)


def test_run_mixer_splits_a_mixed_step_and_takes_a_snapshot(layer):
    """A step of a prompt piece (with a snapshot after its first 10 tokens), a decode and another
    piece through workers/recurrent.py's run_mixer: transformers' outputs, and the snapshot row
    continues as the sequence itself would."""
    module, mixer = layer
    a, b, c = sequences()
    pool = empty_pool(mixer)
    with torch.no_grad():
        mixer.prefill(MODEL, b[:20], pool, POOL_ROWS[1])  # b has 20 tokens already: it decodes its 21st
        mixer.prefill(MODEL, c[:3], pool, POOL_ROWS[2])
        x = torch.cat([a[:30], b[20:21], c[3:8]])
        step = StateStep(query_start_loc=[0, 30, 31, 36], rows=list(POOL_ROWS), saves={0: (10, 6)})
        y = run_mixer(mixer, MODEL, x, pool, step)
        torch.testing.assert_close(y[:30], reference(module, a[:30]), **TOLERANCE)
        torch.testing.assert_close(y[30:31], reference(module, b[:21])[20:], **TOLERANCE)
        torch.testing.assert_close(y[31:], reference(module, c[:8])[3:], **TOLERANCE)
        resumed = mixer.prefill(MODEL, a[10:40], pool, 6)  # from the snapshot: tokens 10 .. 39
    torch.testing.assert_close(resumed, reference(module, a[:40])[10:], **TOLERANCE)


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    """The catalog's tiny qwen3_next checkpoint (Gated DeltaNet layers 0, 1, 3; gated attention on 2; MoE)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("gated_delta") / "qwen3_next", **FAMILIES["qwen3_next"])


def test_a_prompt_of_several_chunks_in_one_step_equals_transformers(qwen3_next_dir):
    """A 150-token prompt computed in one step (three chunks of the delta rule, the last partial), then
    one beside another whose pieces start mid-chunk: transformers' greedy tokens."""
    runner = make_runner(qwen3_next_dir, num_blocks=400)
    mixers = [layer.mixer for layer in runner.model.layers if layer.mixer is not None]
    assert len(mixers) == 3 and len({id(mixer.scratch) for mixer in mixers}) == 1  # one decode buffer for all
    oracle = HfOracle(qwen3_next_dir)
    prompts = prompts_of_lengths([150, 70], runner.model_info.vocab_size, seed=3)
    engine = engine_of(runner, max_num_batched_tokens=160, max_model_len=256)
    for prompt, result in zip(prompts, engine.generate(prompts, greedy(6))):
        assert_greedy_matches(result.sequences[0].token_ids, oracle.greedy(prompt, 6))


def test_prefix_hits_forks_and_preemption_continue_the_gated_delta_states(qwen3_next_dir):
    """A prefix hit restores both states (conv and delta-rule matrices) from a snapshot; n=3 forks copy
    them; preemption recomputes them: transformers' tokens every time."""
    runner = make_runner(qwen3_next_dir, num_blocks=400, state_snapshots=4)
    assert_hits_forks_and_preemption_answer_as_transformers(runner, HfOracle(qwen3_next_dir))


# Qwen3-Next-80B-A3B's config.json as published (the keys that matter here)
QWEN3_NEXT_80B = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000000, partial_rotary_factor=0.25,
    max_position_embeddings=262144, full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
    mlp_only_layers=[], num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, tie_word_embeddings=False,
)


def test_qwen3_next_config_as_published_checkpoints_write_it():
    from workers.config import ModelConfig, ModelConfigError

    config = ModelConfig.from_dict(QWEN3_NEXT_80B)
    t = config.traits
    assert t.mixers == ("gated_delta", "gated_delta", "gated_delta", None) * 12  # full_attention_interval 4
    assert t.gated_delta == GatedDeltaTraits(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                                             conv_kernel=4)
    assert t.gated_delta.conv_channels == 8192 and config.rotary_dim == 64 and config.rope_theta == 1e7
    assert (t.moe.num_experts, t.moe.top_k, t.moe.intermediate_size, t.moe.renormalize) == (512, 10, 512, True)
    assert (t.moe.shared_intermediate_size, t.moe.shared_expert_gate, all(t.moe.layers)) == (512, True, True)
    assert t.attention_output_gate and t.qk_norm == "head" and t.norm_weight_offset == 1.0
    assert t.skipped_prefixes == ("mtp.",)
    assert [config.kv_elements_per_token(layer) for layer in range(4)] == [0, 0, 0, 2 * 2 * 256]
    explicit = dict(QWEN3_NEXT_80B, layer_types=["linear_attention", "full_attention"] * 24)
    assert ModelConfig.from_dict(explicit).traits.mixers == ("gated_delta", None) * 24
    with pytest.raises(ModelConfigError, match="layer_types of linear_attention / full_attention"):
        ModelConfig.from_dict(dict(QWEN3_NEXT_80B, layer_types=["sliding_attention"] * 48))
    with pytest.raises(ModelConfigError, match="do not share 3 key heads evenly"):
        ModelConfig.from_dict(dict(QWEN3_NEXT_80B, linear_num_key_heads=3))
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu_pytorch_tanh'"):
        ModelConfig.from_dict(dict(QWEN3_NEXT_80B, hidden_act="gelu_pytorch_tanh"))
