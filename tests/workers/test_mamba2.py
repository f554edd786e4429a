"""The Mamba-2 mixer (workers/mamba2.py) against transformers' GraniteMoeHybridMambaLayer.

transformers' layer, built from a tiny random GraniteMoeHybridConfig (its torch path: no
mamba_ssm or causal_conv1d kernels), runs each whole sequence with no cache; ours runs a prompt
whole, or cut into pieces of awkward sizes with the state carried in the pool, then batched
decode steps of several sequences at once. Every output equals transformers'. A state that is
not carried, or a conv state off by one token, is caught."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.families import FamilyTraits, mamba2_traits
from workers.kernels.native import NativeBuildError
from workers.layer_ops import NativeOps, TorchOps
from workers.linear import TorchLinear
from workers.mamba2 import Mamba2Mixer, read_mamba2_weights, segment_sums, ssd_scan, ssm_step
from workers.model import _WeightReader

HIDDEN, CHUNK = 24, 8
ATOL = 2e-5
CONFIGS = {
    "two-groups": dict(mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_proj_bias=False),
    "one-group-biases": dict(mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=5, mamba_d_conv=3,
                             mamba_proj_bias=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def layers(request):
    """(transformers' layer, our mixer, the state pool factory) over the same random weights."""
    torch.manual_seed(0)
    from transformers import GraniteMoeHybridConfig  # here: its import loads triton
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
    config = GraniteMoeHybridConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["mamba"],
                                    mamba_chunk_size=CHUNK, mamba_expand=2, rms_norm_eps=1e-5,
                                    **CONFIGS[request.param])
    reference = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():  # the defaults (A_log = log(1..H), D = dt_bias = 1, norm = 1) would hide misuse
        reference.A_log.uniform_(-1.0, 1.5)
        reference.D.normal_()
        reference.dt_bias.normal_()
        reference.norm.weight.normal_(1.0, 0.5)
    tensors = {"mamba." + name: p.detach().clone() for name, p in reference.state_dict().items()}
    config_stub = SimpleNamespace(hidden_size=HIDDEN, traits=FamilyTraits(qkv_bias=False, o_bias=False))
    reader = _WeightReader(config_stub, tensors, "cpu", TorchLinear())
    traits = mamba2_traits(config.to_dict())
    mixer = Mamba2Mixer(read_mamba2_weights(reader, "mamba.", traits, HIDDEN), traits)
    assert not reader.tensors, f"unread: {sorted(reader.tensors)}"
    return reference, mixer


@pytest.fixture(params=["torch", "native"])
def model(request):
    """What the mixer needs of the model: its products, and its layer ops (the recurrent step's
    torch reference, or our C kernel)."""
    if request.param == "torch":
        return SimpleNamespace(linear=TorchLinear().linear, ops=TorchOps())
    try:
        return SimpleNamespace(linear=TorchLinear().linear, ops=NativeOps())
    except NativeBuildError as error:
        pytest.skip(f"the C kernels do not build here: {error}")


def new_pool(mixer: Mamba2Mixer, num_rows: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(num_rows, *shape, dtype=dtype) for shape, dtype in mixer.state_specs())


@torch.no_grad()
def transformers_outputs(reference, x: torch.Tensor) -> torch.Tensor:
    """transformers' layer over one whole sequence x [n, hidden] (no cache) -> [n, hidden]."""
    return reference(x.unsqueeze(0))[0]


def run_in_pieces(model, mixer, x: torch.Tensor, pool, row: int, pieces: list[int], between=None) -> torch.Tensor:
    """The mixer's prefill over x cut into pieces (lengths), the state carried in pool's row;
    between(pool, row) runs after every piece but the last (a deliberate break)."""
    outputs, start = [], 0
    for i, length in enumerate(pieces):
        outputs.append(mixer.prefill(model, x[start:start + length], pool, row))
        start += length
        if between is not None and i < len(pieces) - 1:
            between(pool, row)
    assert start == x.shape[0]
    return torch.cat(outputs)


def test_the_state_is_a_conv_window_and_an_fp32_ssm_state_per_head(layers):
    _, mixer = layers
    t = mixer.traits
    assert mixer.state_specs() == (((t.conv_kernel - 1, t.inner + 2 * t.num_groups * t.state_size), torch.float32),
                                   ((t.num_heads, t.head_dim, t.state_size), torch.float32))


@pytest.mark.parametrize("length", [1, 5, CHUNK, 3 * CHUNK + 5])
def test_a_whole_prompt_equals_transformers(layers, model, length):
    reference, mixer = layers
    torch.manual_seed(length)
    x = torch.randn(length, HIDDEN)
    pool = new_pool(mixer, 3)
    ours = mixer.prefill(model, x, pool, 1)
    torch.testing.assert_close(ours, transformers_outputs(reference, x), atol=ATOL, rtol=1e-4)
    assert all(float(state[1].abs().sum()) > 0 for state in pool)  # its row holds the state now
    assert all(float(state[[0, 2]].abs().sum()) == 0 for state in pool)  # and no other row changed


# three sequences: (prompt pieces, the pool row each keeps its state in)
SEQUENCES = [([5, 1, 9, 6], 3), ([CHUNK, 3], 0), ([2, 2, 2 * CHUNK + 3, 1, 7], 2)]
NUM_DECODES = 4


def test_pieces_then_batched_decodes_equal_transformers(layers, model):
    reference, mixer = layers
    torch.manual_seed(7)
    inputs = [torch.randn(sum(pieces) + NUM_DECODES, HIDDEN) for pieces, _ in SEQUENCES]
    pool = new_pool(mixer, 5)
    outputs = [[run_in_pieces(model, mixer, x[:sum(pieces)], pool, row, pieces)]
               for x, (pieces, row) in zip(inputs, SEQUENCES)]
    rows = torch.tensor([row for _, row in SEQUENCES])
    for step in range(NUM_DECODES):
        tokens = torch.stack([x[sum(pieces) + step] for x, (pieces, _) in zip(inputs, SEQUENCES)])
        decoded = mixer.decode(model, tokens, pool, rows)
        for i, output in enumerate(outputs):
            output.append(decoded[i:i + 1])
    for x, output in zip(inputs, outputs):
        torch.testing.assert_close(torch.cat(output), transformers_outputs(reference, x), atol=ATOL, rtol=1e-4)


def break_ssm_state(pool, row):
    pool[1][row].zero_()


def shift_conv_state(pool, row):
    """The conv window one token late: its oldest input repeated, its newest dropped."""
    window = pool[0][row]  # [taps, channels]
    window[1:] = window[:-1].clone()


@pytest.mark.parametrize("between", [break_ssm_state, shift_conv_state])
def test_a_broken_state_between_pieces_is_caught(layers, model, between):
    reference, mixer = layers
    torch.manual_seed(11)
    x = torch.randn(20, HIDDEN)
    expected = transformers_outputs(reference, x)
    pieces = [7, 6, 7]
    intact = run_in_pieces(model, mixer, x, new_pool(mixer, 2), 1, pieces)
    torch.testing.assert_close(intact, expected, atol=ATOL, rtol=1e-4)
    broken = run_in_pieces(model, mixer, x, new_pool(mixer, 2), 1, pieces, between)
    assert torch.allclose(broken[:7], expected[:7], atol=ATOL, rtol=1e-4)  # the first piece is untouched
    assert not torch.allclose(broken[7:], expected[7:], atol=1e-3)


@pytest.mark.parametrize("between", [break_ssm_state, shift_conv_state])
def test_a_broken_state_before_a_decode_is_caught(layers, model, between):
    reference, mixer = layers
    torch.manual_seed(13)
    x = torch.randn(10, HIDDEN)
    expected = transformers_outputs(reference, x)
    pool = new_pool(mixer, 2)
    mixer.prefill(model, x[:9], pool, 1)
    between(pool, 1)
    decoded = mixer.decode(model, x[9:], pool, torch.tensor([1]))
    assert not torch.allclose(decoded, expected[9:], atol=1e-3)


def test_the_chunked_scan_equals_the_recurrence_from_a_carried_state():
    """ssd_scan over 2.5 chunks from a nonzero state = ssm_step token by token (the final state too)."""
    torch.manual_seed(3)
    n, heads, head_dim, state_size = 21, 3, 4, 5
    u, B, C = torch.randn(n, heads, head_dim), torch.randn(n, heads, state_size), torch.randn(n, heads, state_size)
    dt, decay_rate = torch.rand(n, heads) + 0.1, -torch.rand(heads) - 0.2
    initial = torch.randn(heads, head_dim, state_size)
    y, final = ssd_scan(u, dt, decay_rate, B, C, initial, chunk_size=CHUNK)
    states, row = initial.clone().unsqueeze(0), torch.tensor([0])
    steps = [ssm_step(u[i:i + 1], dt[i:i + 1], decay_rate, B[i:i + 1], C[i:i + 1], states, row) for i in range(n)]
    torch.testing.assert_close(y, torch.cat(steps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, states[0], atol=1e-5, rtol=1e-5)


def test_segment_sums():
    a = torch.tensor([1.0, 2.0, 4.0])
    inf = torch.inf
    assert torch.equal(segment_sums(a), torch.tensor([[0.0, -inf, -inf], [2.0, 0.0, -inf], [6.0, 4.0, 0.0]]))
