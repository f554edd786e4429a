"""Our fused C layer ops (workers/layer_ops.NativeOps) against the torch reference (TorchOps)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.config import RopeScaling
from workers.kernels.native import NativeBuildError, native_library
from workers.layer_ops import NativeOps, TorchOps, select_layer_ops
from workers.rope import RotaryEmbedding

try:
    native_library()
except NativeBuildError as error:
    pytest.skip(f"the C kernels do not build here: {error}", allow_module_level=True)

# fp32: the same arithmetic in another order; bf16: both round their results to bf16 (the
# reference after every op, ours once), so they differ by a few bf16 ulps
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    return TorchOps(), NativeOps()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(ops, dtype, with_delta):
    reference, native = ops
    residual = torch.randn(7, 96).to(dtype)
    delta = torch.randn(7, 96).to(dtype) if with_delta else None
    weight = (torch.rand(96) + 0.5).to(dtype)
    expected_residual, expected = reference.add_rms_norm(residual.clone(), delta, weight, 1e-5)
    in_place = residual.clone()
    new_residual, out = native.add_rms_norm(in_place, delta, weight, 1e-5)
    assert new_residual.data_ptr() == in_place.data_ptr()  # the add happened in place
    torch.testing.assert_close(new_residual, expected_residual, **TOLERANCE[dtype])
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_add_alone_and_a_norm_in_place(ops, dtype):
    """OLMo 2's layers: the residual add without a norm, and a branch's output normed in place."""
    reference, native = ops
    residual, delta = torch.randn(70, 96).to(dtype), torch.randn(70, 96).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    expected_sum, expected_same = reference.add_rms_norm(residual.clone(), delta, None, 1e-5)
    in_place = residual.clone()
    new_residual, same = native.add_rms_norm(in_place, delta, None, 1e-5)
    assert new_residual.data_ptr() == same.data_ptr() == in_place.data_ptr() and expected_same is expected_sum
    torch.testing.assert_close(new_residual, expected_sum, **TOLERANCE[dtype])
    expected = reference.rms_norm(delta, weight, 1e-5)
    normed = native.rms_norm(delta.clone(), weight, 1e-5)
    torch.testing.assert_close(normed, expected, **TOLERANCE[dtype])
    assert not torch.allclose(expected.float(), delta.float(), atol=1e-2)  # the norm did something


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("whole", [False, True], ids=["per-head", "whole-projection"])
def test_qk_norms(ops, dtype, whole):
    reference, native = ops
    num_heads, num_kv_heads, head_dim, num_tokens = 6, 2, 16, 70
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    widths = (num_heads * head_dim, num_kv_heads * head_dim) if whole else (head_dim, head_dim)
    q_weight, k_weight = ((torch.rand(width) + 0.5).to(dtype) for width in widths)
    expected, got = qkv.clone(), qkv.clone()
    reference.head_rms_norm(expected, q_weight, k_weight, num_heads, num_kv_heads, 1e-6, whole)
    native.head_rms_norm(got, q_weight, k_weight, num_heads, num_kv_heads, 1e-6, whole)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    q = qkv[:, : num_heads * head_dim].float()  # the reference itself, written out
    if whole:
        normed_q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * q_weight.float()
    else:
        heads = q.view(num_tokens, num_heads, head_dim)
        normed_q = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * q_weight.float()).flatten(1)
    torch.testing.assert_close(expected[:, : num_heads * head_dim].float(), normed_q, **TOLERANCE[dtype])
    assert torch.equal(got[:, -num_kv_heads * head_dim:], qkv[:, -num_kv_heads * head_dim:])  # v as is


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [32, 12], ids=["full", "partial"])
def test_rope(ops, dtype, rotary_dim):
    reference, native = ops
    num_heads, num_kv_heads, head_dim, num_tokens = 6, 2, 32, 9
    config = SimpleNamespace(head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=10000.0,
                             rope_scaling=RopeScaling("default"))
    rope = RotaryEmbedding(config, 64, dtype, "cpu")
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 5, 17, 3, 4, 63, 40])
    expected = reference.rope(qkv.clone(), positions, rope, num_heads, num_kv_heads)
    in_place = qkv.clone()
    got = native.rope(in_place, positions, rope, num_heads, num_kv_heads)
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape and ours.data_ptr() >= in_place.data_ptr()  # views into qkv
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
    assert torch.equal(got[2], qkv[:, -num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim))  # v as is
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:])  # past rotary_dim: as is
    assert not torch.allclose(got[0][1:, :, :rotary_dim].float(), q[1:, :, :rotary_dim].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_gated_mul(ops, dtype, activation):
    reference, native = ops
    gate_up = (3 * torch.randn(70, 2 * 52)).to(dtype)  # a width past the SIMD bodies' multiples, rows on two threads
    clamp = dict(alpha=1.5, limit=4.0) if activation == "swiglu_oai" else {}  # a limit the values pass
    expected = reference.gated_mul(gate_up, activation, **clamp)
    torch.testing.assert_close(native.gated_mul(gate_up, activation, **clamp), expected, **TOLERANCE[dtype])
    for other in {"silu", "gelu_tanh", "swiglu_oai"} - {activation}:  # the activation is the one asked for
        assert not torch.allclose(reference.gated_mul(gate_up, other).float(), expected.float(), atol=1e-2)
    if clamp:  # the alpha and limit asked for, not the defaults
        assert not torch.allclose(native.gated_mul(gate_up, activation).float(), expected.float(), atol=1e-2)


def test_clamped_swiglu_equals_transformers_gpt_oss_experts():
    """gpt-oss's clamped SwiGLU on [gate | up] halves equals transformers' on its interleaved
    columns (gate = [..., ::2], up = [..., 1::2]), clamps included."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(AutoConfig.for_model("gpt_oss", hidden_size=16, intermediate_size=24, swiglu_limit=3.0))
    interleaved = 4 * torch.randn(33, 2 * 24, generator=torch.Generator().manual_seed(5))
    assert bool((interleaved.abs() > 3.0).any())  # the clamps are reached
    halves = torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)
    expected = experts._apply_gate(interleaved)
    ours = TorchOps().gated_mul(halves, "swiglu_oai", alpha=experts.alpha, limit=experts.limit)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_selection():
    assert isinstance(select_layer_ops(None, "cpu", torch.float32), NativeOps)
    assert isinstance(select_layer_ops(None, "cpu", torch.float16), TorchOps)
    assert isinstance(select_layer_ops("torch", "cpu", torch.float32), TorchOps)
    with pytest.raises(ValueError, match="need a CPU device"):
        select_layer_ops("native", "cpu", torch.float16)
    with pytest.raises(ValueError, match="unknown layer ops"):
        select_layer_ops("fast", "cpu", torch.float32)


def test_loading_the_library_keeps_subnormal_floats() -> None:
    """A library built with -ffast-math would set flush-to-zero for the whole process on load."""
    import sys

    native_library()
    smallest_normal = sys.float_info.min
    assert smallest_normal / 2 > 0.0  # 0.0 under flush-to-zero
    assert torch.tensor([smallest_normal], dtype=torch.float64).div(2).item() > 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_groups,gated_norm", [(1, "after_gate"), (2, "before_gate"), (4, None), (2, "after_gate")])
def test_mamba2_step(ops, dtype, num_groups, gated_norm):
    """Mamba-2's decode step from the conv's output to out_proj's input: dt and gate as views into
    in_proj's wider rows (as the mixer splits them), sequences in pool rows out of order, clamped
    time steps, states updated in place and the other rows untouched."""
    from workers.families import Mamba2Traits
    from workers.mamba2 import Mamba2Weights

    reference, native = ops
    torch.manual_seed(num_groups)
    num_seqs, heads, head_dim, state_size = 3, 4, 16, 24
    traits = Mamba2Traits(num_heads=heads, head_dim=head_dim, num_groups=num_groups, state_size=state_size,
                          conv_kernel=4, chunk_size=8, time_step_min=0.01, time_step_max=1.5, gated_norm=gated_norm)
    weights = Mamba2Weights(in_proj=None, in_proj_bias=None, conv=torch.empty(0), conv_bias=None,
                            dt_bias=torch.randn(heads), decay_rate=-torch.rand(heads) * 2, skip=torch.randn(heads),
                            norm=None if gated_norm is None else (torch.rand(traits.inner) + 0.5).to(dtype),
                            out_proj=None, out_proj_bias=None)
    projected = (torch.randn(num_seqs, traits.inner + traits.conv_channels + heads) * 2).to(dtype)
    gate, _, dt = projected.split([traits.inner, traits.conv_channels, heads], dim=-1)
    xbc = torch.randn(num_seqs, traits.conv_channels).to(dtype)
    states, rows = torch.randn(6, heads, head_dim, state_size), torch.tensor([4, 0, 2])
    expected_states = states.clone()
    expected = reference.mamba2_step(xbc, dt, gate, weights, traits, expected_states, rows)
    out = native.mamba2_step(xbc, dt, gate, weights, traits, states, rows)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(states, expected_states, **TOLERANCE[torch.float32])  # the other rows as they were


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel,silu,with_bias", [(4, True, True), (4, False, False), (2, True, False)])
def test_conv_step(ops, dtype, kernel, silu, with_bias):
    """A recurrent layer's conv step: x a view into wider rows, windows in pool rows out of order,
    each moved on by its token in place; the other rows untouched."""
    reference, native = ops
    torch.manual_seed(kernel)
    num_seqs, channels = 3, 600  # more than one item of channels (csrc/recurrent.c)
    x = torch.randn(num_seqs, channels + 7).to(dtype)[:, 3:3 + channels]
    weight, bias = torch.randn(channels, kernel).to(dtype), torch.randn(channels).to(dtype) if with_bias else None
    states, rows = torch.randn(5, kernel - 1, channels).to(dtype), torch.tensor([3, 0, 4])
    expected_states = states.clone()
    expected = reference.conv_step(x, weight, bias, expected_states, rows, silu)
    out = native.conv_step(x, weight, bias, states, rows, silu)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(states, expected_states)  # the windows hold inputs: moved, never rounded
    assert torch.equal(states[rows, -1], x)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_k_heads,num_v_heads", [(2, 2), (2, 4)])
def test_gated_delta_step(ops, dtype, num_k_heads, num_v_heads):
    """The Gated DeltaNet's decode step from the conv's output to out_proj's input: z, b and a as
    views into in_proj's wider rows (as the mixer splits them), key heads shared by value heads,
    sequences in pool rows out of order, states updated in place and the other rows untouched."""
    from workers.families import GatedDeltaTraits
    from workers.gated_delta import GatedDeltaWeights

    reference, native = ops
    torch.manual_seed(num_v_heads)
    num_seqs, head_k_dim, head_v_dim = 3, 16, 24
    traits = GatedDeltaTraits(num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                              head_v_dim=head_v_dim, conv_kernel=4)
    weights = GatedDeltaWeights(in_proj=None, conv=torch.empty(0), dt_bias=torch.randn(num_v_heads),
                                neg_decay_rate=-torch.rand(num_v_heads) * 2,
                                norm=(torch.rand(head_v_dim) + 0.5).to(dtype), out=None)
    projected = torch.randn(num_seqs, traits.conv_channels + traits.value_dim + 2 * num_v_heads).to(dtype)
    mixed, z, b, a = projected.split([traits.conv_channels, traits.value_dim, num_v_heads, num_v_heads], dim=1)
    matrices, rows = torch.randn(6, num_v_heads, head_k_dim, head_v_dim) * 0.3, torch.tensor([4, 0, 2])
    expected_matrices = matrices.clone()
    expected = reference.gated_delta_step(mixed, z, b, a, weights, traits, 1e-6, expected_matrices, rows)
    out = native.gated_delta_step(mixed, z, b, a, weights, traits, 1e-6, matrices, rows)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(matrices, expected_matrices, **TOLERANCE[torch.float32])


def test_unit_lower_solve(ops):
    """The chunked delta rules' triangular solves: only the strict lower part is read (the diagonal
    and the upper part hold junk, as the rules leave them), over a batch of [H, C] systems."""
    reference, native = ops
    torch.manual_seed(5)
    system = torch.randn(3, 2, 20, 20) * 0.3  # diagonal and upper part: junk that must not be read
    rhs = torch.randn(3, 2, 20, 7)
    expected = reference.unit_lower_solve(system, rhs)
    solved = native.unit_lower_solve(system, rhs)
    torch.testing.assert_close(solved, expected, **TOLERANCE[torch.float32])
    unit_lower = system.tril(-1) + torch.eye(20)
    torch.testing.assert_close(unit_lower @ solved, rhs, **TOLERANCE[torch.float32])


def test_a_state_row_outside_the_pool_is_refused_before_anything_is_written(ops):
    _, native = ops
    x, weight = torch.randn(2, 8), torch.randn(8, 4)
    states = torch.randn(3, 3, 8)
    before = states.clone()
    with pytest.raises(RuntimeError, match="rayllm_conv_step failed"):
        native.conv_step(x, weight, None, states, torch.tensor([0, 3]), silu=False)
    assert torch.equal(states, before)
