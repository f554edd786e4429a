"""The fused mixture-of-experts kernel (workers/kernels/triton_moe.py) in Triton's interpreter
on CPU tensors: the alignment's invariants, the grouped GEMM and fused_moe against a float64
reference (the maths of workers/moe.py's run_experts), fused_moe against run_experts itself on
the same weights, and the CUDA-only stacking of experts at load (workers/moe.py).

The interpreter is switched on exactly as in tests/workers/test_triton_kernels.py (see its
docstring): TRITON_INTERPRET=1 before triton's first import on a machine without CUDA, the
kernel module imported privately under it, and otherwise a child pytest that reruns this file
interpreted.

bf16 in the interpreter (the bf16 tests only, fixture bf16_interpreter): its tl.dot multiplies
bf16's raw bit patterns, so dots widen bf16 operands to fp32 first (exact, as in
test_triton_kernels.py); and its fp32 -> bf16 cast truncates where a GPU rounds to nearest even,
doubling the error of every bf16 store, so that cast rounds to nearest even (torch's) instead.

Tolerances: max abs error <= REL_TOL[dtype] * max |float64 result| (values reach ~20 here).

Sizes are tiny (the interpreter runs every program in numpy): hidden 40 and intermediate 24
with 16-wide tiles, so N and K both take several tiles and a masked tail.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: see the module docstring
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]'): kernel tests skipped")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton_interpreter import import_interpreted, patch_bf16_like_a_gpu, run_file_in_interpreter  # noqa: E402
import triton.language.standard  # noqa: E402

from workers.families import MoeTraits  # noqa: E402
from workers.layer_ops import TorchOps  # noqa: E402
from workers.linear import TorchLinear  # noqa: E402
from workers.moe import MoeWeights, moe_mlp, read_moe_weights, route, run_experts  # noqa: E402

IN_PROCESS = isinstance(triton.language.standard.zeros, InterpretedFunction)
NOT_IN_PROCESS_REASON = (
    "triton was imported compiled before this module (or a GPU is present), so the interpreter "
    "cannot run in this process: test_moe_kernels_in_interpreter_subprocess runs these tests instead"
)
HIDDEN, WIDTH = 40, 24  # neither a multiple of the 16-wide test tiles
TILES = (16, 16, 16)  # (BLOCK_M, BLOCK_N, BLOCK_K)
REL_TOL = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}  # of the largest |result|


@pytest.fixture(scope="module")
def moe():
    """workers.kernels.triton_moe imported under TRITON_INTERPRET=1 (sys.modules restored)."""
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    module = import_interpreted("workers.kernels.triton_moe")
    assert isinstance(module._moe_gemm_kernel, InterpretedFunction)
    return module


def test_moe_kernels_in_interpreter_subprocess():
    if IN_PROCESS:
        pytest.skip("the interpreter runs in this process: the tests below ran here")
    run_file_in_interpreter(__file__)


@pytest.fixture
def bf16_interpreter(monkeypatch):
    """For one test: bf16 tl.dot operands widened to fp32 (exact), and fp32 -> bf16 casts
    rounded to nearest even as on a GPU (module docstring)."""
    patch_bf16_like_a_gpu(monkeypatch)


def assert_near(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err, scale = (out.double() - expected.double()).abs().max().item(), expected.abs().max().item()
    assert err <= REL_TOL[dtype] * scale, f"max abs error {err:.3g} > {REL_TOL[dtype]} x {scale:.3g} ({dtype})"


def make_case(num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0, idle_expert: bool = True,
              dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """Random x, stacked experts and a softmax-top-k routing; idle_expert: the last expert is
    never chosen (its weights are NaN, so a read of them shows)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    gate_up = torch.randn(num_experts, 2 * WIDTH, HIDDEN, generator=generator) * 0.3
    down = torch.randn(num_experts, HIDDEN, WIDTH, generator=generator) * 0.3
    logits = torch.randn(num_tokens, num_experts, generator=generator) * 2
    if idle_expert:
        assert top_k < num_experts
        logits[:, -1] = float("-inf")
        gate_up[-1], down[-1] = float("nan"), float("nan")
    traits = MoeTraits(num_experts=num_experts, top_k=top_k, intermediate_size=WIDTH, layers=(True,),
                       scoring="softmax_topk", renormalize=True, router_bias=False)
    routing, expert_ids = route(logits, traits)
    if idle_expert:
        assert not (expert_ids == num_experts - 1).any()
    return SimpleNamespace(x=x.to(dtype), gate_up=gate_up.to(dtype), down=down.to(dtype), routing=routing,
                           expert_ids=expert_ids, traits=traits)


def float64_moe(case, activation: str = "silu") -> torch.Tensor:
    """run_experts' maths pair by pair in float64: sum_j routing[t, j] * down_e(act(gate_e x_t) * up_e x_t)."""
    out = torch.zeros(case.x.shape, dtype=torch.float64)
    for token, (weights, experts) in enumerate(zip(case.routing.double(), case.expert_ids)):
        for weight, expert in zip(weights, experts.tolist()):
            gate, up = (case.gate_up[expert].double() @ case.x[token].double()).chunk(2)
            act = (torch.nn.functional.silu(gate) if activation == "silu"
                   else torch.nn.functional.gelu(gate, approximate="tanh"))
            out[token] += weight * (case.down[expert].double() @ (act * up))
    return out


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"),
                         [(1, 4, 1, 16), (3, 4, 2, 16), (17, 8, 2, 16), (64, 8, 4, 16), (64, 4, 2, 64), (5, 8, 4, 4)])
def test_alignment_invariants(moe, num_tokens, num_experts, top_k, block_m):
    case = make_case(num_tokens, num_experts, top_k, seed=num_tokens)
    num_pairs = num_tokens * top_k
    sorted_pair_ids, tile_expert_ids, num_post_padded = moe.align_pairs(case.expert_ids, num_experts, block_m)
    assert sorted_pair_ids.dtype == tile_expert_ids.dtype == num_post_padded.dtype == torch.int32
    num_rows = moe.max_padded_rows(num_pairs, num_experts, block_m)
    assert sorted_pair_ids.shape == (num_rows,) and tile_expert_ids.shape == (num_rows // block_m,)

    flat = case.expert_ids.flatten()
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(num_post_padded)
    assert used == sum(-(-int(c) // block_m) * block_m for c in counts) and used % block_m == 0
    pairs = sorted_pair_ids.tolist()
    real = [p for p in pairs if p != num_pairs]
    assert sorted(real) == list(range(num_pairs)), "every pair exactly once"
    assert all(p == num_pairs for p in pairs[used:]), "rows past the padded count are padding"

    tiles = tile_expert_ids.tolist()
    assert all(e == -1 for e in tiles[used // block_m:]) and all(0 <= e < num_experts for e in tiles[:used // block_m])
    assert tiles[:used // block_m] == sorted(tiles[:used // block_m]), "experts in ascending order"
    for expert in range(num_experts):
        runs = [i for i, e in enumerate(tiles) if e == expert]
        assert len(runs) == -(-int(counts[expert]) // block_m), f"expert {expert}: tiles {runs}"
        rows = [p for i in runs for p in pairs[i * block_m:(i + 1) * block_m]]
        members = [p for p in rows if p != num_pairs]
        assert all(int(flat[p]) == expert for p in members), "a tile holds one expert's pairs"
        assert members == sorted(members) and len(members) == int(counts[expert])
        assert rows == members + [num_pairs] * (len(rows) - len(members)), "padding only at the run's end"
    assert counts[-1] == 0  # the idle expert: no tile at all
    assert -1 not in tiles[:used // block_m] and num_experts - 1 not in tiles


# ----------------------------------------------------------------------------- the grouped GEMM


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_gemm_gathers_rows_and_scales_by_routing(moe, top_k):
    """Both launches' forms against float64 per pair: x gathered by token (pairs_per_row = k),
    and one row per pair times its routing weight (pairs_per_row = 1)."""
    case = make_case(9, 4, top_k, seed=top_k)
    num_pairs = 9 * top_k
    aligned = moe.align_pairs(case.expert_ids, 4, 16)
    flat = case.expert_ids.flatten()
    by_token = moe.moe_gemm(case.x, case.gate_up, *aligned, num_pairs, top_k, block_m=16, block_n=16, block_k=16)
    expected = torch.stack([case.gate_up[flat[p]].double() @ case.x[p // top_k].double() for p in range(num_pairs)])
    assert_near(by_token, expected, torch.float32)

    rows = torch.randn(num_pairs, WIDTH, generator=torch.Generator().manual_seed(5))
    routing = case.routing.flatten().contiguous()
    per_pair = moe.moe_gemm(rows, case.down, *aligned, num_pairs, 1, routing, block_m=16, block_n=16, block_k=16)
    expected = torch.stack([routing[p].double() * (case.down[flat[p]].double() @ rows[p].double())
                            for p in range(num_pairs)])
    assert_near(per_pair, expected, torch.float32)


# ----------------------------------------------------------------------------- fused_moe vs float64


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 1), (4, 2), (8, 2), (8, 4)])
def test_fused_moe_fp32_equals_float64(moe, num_tokens, num_experts, top_k):
    case = make_case(num_tokens, num_experts, top_k, seed=num_tokens * 10 + top_k)
    out = moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids, blocks=TILES)
    assert out.shape == case.x.shape and out.dtype == torch.float32
    assert_near(out, float64_moe(case), torch.float32)


@pytest.mark.parametrize("num_tokens", [3, 70])
def test_fused_moe_default_tiles(moe, num_tokens):
    """The launcher's own tile sizes: 16 rows for few pairs per expert, 64 beyond (70 x 2 pairs over 4 experts)."""
    case = make_case(num_tokens, 4, 2, seed=7)
    assert moe._choose_blocks(num_tokens * 2, 4, torch.float32)[0] == (16 if num_tokens == 3 else 64)
    out = moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids)
    assert_near(out, float64_moe(case), torch.float32)


@pytest.mark.parametrize("num_tokens", [3, 17])
def test_fused_moe_fp16_equals_float64(moe, num_tokens):
    case = make_case(num_tokens, 8, 2, seed=num_tokens, dtype=torch.float16)
    out = moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids, blocks=TILES)
    assert out.dtype == torch.float16
    assert_near(out, float64_moe(case), torch.float16)


@pytest.mark.parametrize("num_tokens", [3, 17])
def test_fused_moe_bf16_equals_float64(moe, bf16_interpreter, num_tokens):
    case = make_case(num_tokens, 8, 4, seed=num_tokens, dtype=torch.bfloat16)
    out = moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids, blocks=TILES)
    assert out.dtype == torch.bfloat16
    assert_near(out, float64_moe(case), torch.bfloat16)


def test_fused_moe_gelu_tanh_and_no_tokens(moe):
    case = make_case(5, 4, 2, seed=3)
    out = moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids, "gelu_tanh", blocks=TILES)
    assert_near(out, float64_moe(case, "gelu_tanh"), torch.float32)
    assert (out - moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids,
                                blocks=TILES)).abs().max() > 1e-3, "the activation changed nothing: vacuous"
    empty = moe.fused_moe(case.x[:0], case.gate_up, case.down, case.routing[:0], case.expert_ids[:0])
    assert empty.shape == (0, HIDDEN)


def test_launcher_rejects_bad_inputs(moe):
    case = make_case(4, 4, 2)
    args = (case.x, case.gate_up, case.down, case.routing, case.expert_ids)
    bad = {
        "dtype mismatch": (case.x.half(),) + args[1:],
        "hidden mismatch": (case.x[:, :32],) + args[1:],
        "down shape": args[:2] + (case.down[:, :, :16],) + args[3:],
        "routing shape": args[:3] + (case.routing[:, :1],) + args[4:],
        "odd gate_up": (case.x, case.gate_up[:, 1:], case.down[:, :, :23], case.routing, case.expert_ids),
    }
    for name, call in bad.items():
        with pytest.raises(AssertionError):
            moe.fused_moe(*call)
            pytest.fail(f"accepted: {name}")
    with pytest.raises(AssertionError, match="activation"):
        moe.fused_moe(*args, "relu")


# ----------------------------------------------------------------------------- vs run_experts (workers/moe.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_equals_run_experts(moe, bf16_interpreter, dtype):
    """The same weights through run_experts (the torch backend's per-expert loop) and fused_moe."""
    case = make_case(23, 8, 2, seed=11, idle_expert=False, dtype=dtype)
    weights = MoeWeights(case.traits, None, None, tuple(case.gate_up.unbind(0)), tuple(case.down.unbind(0)))
    loop = run_experts(case.x, case.routing, case.expert_ids, weights, TorchLinear().linear,
                       lambda gate_up: TorchOps().gated_mul(gate_up, "silu"))
    fused = moe.fused_moe(case.x, case.gate_up, case.down, case.routing, case.expert_ids, blocks=TILES)
    assert fused.dtype == loop.dtype == dtype
    # bf16: both round their [gate | up] rows and expert outputs to bf16, in different places
    assert_near(fused, loop, dtype)


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe"])
def test_model_greedy_with_fused_moe_equals_torch_path(moe, family, tmp_path, monkeypatch):
    """A tiny random Mixtral (6 experts, top 2) and GLM-4.5 (grouped sigmoid routing with a
    correction bias and a scaling factor, a shared expert, a dense first layer), built with
    transformers' classes, through the real model, runner and moe_mlp, whose routed experts run
    the interpreted fused_moe (the CUDA dispatch stood in for on CPU) on the weights route() gave,
    give the torch path's greedy tokens over chunked prefills and decodes."""
    import kernel_cases as kc
    from families_catalog import MOE_FAMILIES
    from tiny_model import build_tiny_model_dir

    import workers.moe
    from workers.model_runner import ModelRunner, RunnerConfig

    settings = dict(model_type="mixtral", num_local_experts=6, num_experts_per_tok=2, num_hidden_layers=2)
    model_dir = build_tiny_model_dir(tmp_path / family, **(settings if family == "mixtral" else MOE_FAMILIES[family]))
    prompts = kc.e2e_prompts(vocab_size=300)[:4]
    config = RunnerConfig(model=str(model_dir), dtype="float32", attention_backend="torch", layer_ops="torch",
                          linear_backend="torch", block_size=16, num_blocks=64)
    expected = kc.greedy_generate(ModelRunner(config), prompts, max_tokens=6, chunk_size=16)
    calls = []

    def fused_experts(x, routing, expert_ids, weights, linear, act_mul):
        calls.append(x.shape[0])
        return moe.fused_moe(x, torch.stack(weights.gate_up), torch.stack(weights.down), routing, expert_ids, "silu")

    monkeypatch.setattr(workers.moe, "run_experts", fused_experts)
    tokens = kc.greedy_generate(ModelRunner(config), prompts, max_tokens=6, chunk_size=16)
    assert calls and max(calls) > len(prompts), "no prefill chunk ran the fused kernel"
    assert tokens == expected


# ----------------------------------------------------------------------------- loading (workers/moe.py)


class _Reader:
    """The model's weight reader (workers/model.py _WeightReader) on CPU tensors, claiming `device`."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: str) -> None:
        self.tensors, self.device, self.pack = tensors, device, TorchLinear().pack
        self.config = SimpleNamespace(residual_multiplier=1.0)

    def take(self, name, shape):
        tensor = self.tensors.pop(name)
        assert tuple(tensor.shape) == shape
        return tensor.contiguous()

    def take_fused(self, names, shapes):
        return torch.cat([self.take(name, shape) for name, shape in zip(names, shapes)])

    def take_residual_branch(self, name, shape):
        return self.take(name, shape)

    def residual_branch(self, tensor):
        return tensor


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_experts_are_stacked_at_load_for_cuda_only(layout, device):
    """A CUDA model keeps [E, N, K] stacks for the fused kernel, its per-expert weights views of
    them (one copy in memory); elsewhere nothing changes. moe_mlp on CPU tensors runs the
    per-expert loop whatever the weights hold."""
    traits = MoeTraits(num_experts=3, top_k=2, intermediate_size=WIDTH, layers=(True,), block="block_sparse_moe",
                       expert_projections=("w1", "w3", "w2"), scoring="softmax_topk", renormalize=True,
                       router_bias=False)
    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, WIDTH, HIDDEN, generator=generator), torch.randn(3, WIDTH, HIDDEN, generator=generator)
    down = torch.randn(3, HIDDEN, WIDTH, generator=generator)
    if layout == "fused":
        tensors = {"model.layers.0.mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1),
                   "model.layers.0.mlp.experts.down_proj": down,
                   "model.layers.0.mlp.gate.weight": torch.randn(3, HIDDEN)}
    else:
        tensors = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(3, HIDDEN)}
        for e in range(3):
            names = f"model.layers.0.block_sparse_moe.experts.{e}."
            tensors.update({names + "w1.weight": gate[e], names + "w3.weight": up[e], names + "w2.weight": down[e]})
    weights = read_moe_weights(_Reader(tensors, device), 0, traits, HIDDEN)
    for e in range(3):
        assert torch.equal(weights.gate_up[e], torch.cat([gate[e], up[e]])) and torch.equal(weights.down[e], down[e])
    if device == "cpu":
        assert weights.stacked is None
        return
    stacked_gate_up, stacked_down = weights.stacked
    assert stacked_gate_up.shape == (3, 2 * WIDTH, HIDDEN) and stacked_down.shape == (3, HIDDEN, WIDTH)
    for e in range(3):
        assert weights.gate_up[e].data_ptr() == stacked_gate_up[e].data_ptr()
        assert weights.down[e].data_ptr() == stacked_down[e].data_ptr()
    x = torch.randn(4, HIDDEN, generator=generator)
    plain = MoeWeights(traits, weights.router, None, weights.gate_up, weights.down)
    assert torch.equal(moe_mlp(x, weights, TorchLinear(), TorchOps()), moe_mlp(x, plain, TorchLinear(), TorchOps()))
