"""The quantized-linear kernels (workers/kernels/triton_quant.py) compiled and run on CUDA: the
checks of tests/workers/test_triton_quant.py (which runs them in Triton's interpreter) at the
same small shapes and at one Llama-sized shape, the FP8 dispatch both ways (torch._scaled_mm on
sm_89+, the Triton FP8 GEMM everywhere), loading onto CUDA, and capture in a CUDA graph.

Also the loader's CUDA path on tiny checkpoints of every format: linears kept packed, greedy
tokens (Triton attention, decode graphs) equal to the same packed weights on CPU times
reference_quant_linear. Passed on an H200 (docs/gpu.md). Skips as a whole without a
CUDA device. Run it in its own process (nothing may have flipped triton to the interpreter):

    pytest tests/gpu/test_gpu_quant.py -m gpu -ra
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests need torch.cuda.is_available()", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: these tests must run the compiled kernels", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from workers import quant_formats as qf  # noqa: E402
from workers.kernels import triton_quant as tq  # noqa: E402

if isinstance(tq._int4_gemm_kernel, InterpretedFunction):
    pytest.skip("triton was set up for the interpreter in this process; run tests/gpu in its own pytest process",
                allow_module_level=True)

import quant_cases as qc  # noqa: E402  (tests/quant_cases.py; tests/ is on sys.path via tests/conftest.py)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # fp32: TF32 is not used (ieee dots)
# (M, N, K); the last two take _choose_blocks' tiles for wide layers (added after the H200 run of
# 2026-11-27, where bench.tune_quant_gpu checked those tiles at Llama-3.1-8B's shapes instead)
SHAPES = [(1, 40, 96), (16, 40, 96), (33, 40, 96), (64, 1024, 4096), (1, 4096, 4096), (16, 14336, 4096)]
SM89 = torch.cuda.get_device_capability() >= (8, 9)  # Triton's e4m3 cast
SCALED_MM = torch.cuda.get_device_capability() in ((8, 9), (9, 0))  # triton_quant.uses_scaled_mm


def assert_near(out, expected, dtype, tol=None):
    err, scale = (out.double() - expected.double()).abs().max().item(), expected.abs().max().item()
    tol = REL_TOL[dtype] if tol is None else tol
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} x {scale:.3g} ({dtype})"


def load(config: dict, tensors: dict, dtype: torch.dtype):
    weight = qf.load_quantized_linear(qf.parse_quantization(config), tensors, "layer", DEVICE, dtype)
    assert not isinstance(weight, torch.Tensor), "CUDA loads keep the packed weight"
    return weight


def x_for(m, k, dtype, seed=0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _case(name: str, n: int, k: int, seed: int):
    group = 128 if k % 128 == 0 else 32
    return {
        "awq": lambda: (qc.AWQ_CONFIG | {"group_size": group}, qc.make_awq(n, k, group, seed=seed)),
        "gptq": lambda: (qc.GPTQ_CONFIG | {"group_size": group}, qc.make_gptq(n, k, group, seed=seed)),
        "gptq-act-order": lambda: (qc.GPTQ_CONFIG | {"group_size": group, "desc_act": True},
                                   qc.make_gptq(n, k, group, act_order=True, seed=seed)),
        "mxfp4": lambda: (qc.MXFP4_CONFIG, qc.make_mxfp4(n, k, seed=seed)),
        "fp8-weight-only": lambda: (qc.compressed_tensors_config("channel", None), qc.make_fp8(n, k, seed=seed)),
    }[name]()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("name", ["awq", "gptq", "gptq-act-order", "mxfp4", "fp8-weight-only"])
def test_weight_only_kernels_match_dequantized_matmul(name, m, n, k, dtype):
    config, (tensors, expected) = _case(name, n, k, seed=m)
    weight = load(config, tensors, dtype)
    x = x_for(m, k, dtype, seed=m)
    out = tq.quant_linear(x, weight)
    torch.cuda.synchronize()
    assert out.shape == (m, n) and out.dtype == dtype and out.is_cuda
    assert_near(out, x.double() @ expected.double().to(DEVICE).t(), dtype)


@pytest.mark.parametrize("m", [1, 16, 33, 64])
@pytest.mark.parametrize("ub", [None, 0.5])
def test_quantize_fp8_per_token_on_gpu(m, ub):
    if not SM89:
        pytest.skip("Triton's fp32 -> e4m3 cast needs sm_89+")
    x = x_for(m, 4096, torch.bfloat16, seed=m)
    q, scale = tq.quantize_fp8_per_token(x, ub)
    expected_q, expected_scale = tq.quantize_fp8_reference(x, ub)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("scaled_mm", [False, True])
@pytest.mark.parametrize("config", ["fbgemm", "ct-tensor-static"])
def test_fp8_w8a8_both_paths(config, scaled_mm, m, n, k, dtype):
    if scaled_mm and not SCALED_MM:
        pytest.skip("torch._scaled_mm's row-wise path is used on sm_89 and sm_90 only")
    if scaled_mm and (n % 16 or k % 16 or dtype != torch.bfloat16):
        pytest.skip("quant_linear gives torch._scaled_mm bf16 outputs and K, N multiples of 16 only")
    static = config == "ct-tensor-static"
    tensors, expected = qc.make_fp8(n, k, per_channel=not static, seed=m, input_scale=0.02 if static else None)
    tensors["layer.bias"] = torch.randn(n)
    spec_config = qc.compressed_tensors_config("tensor", "static") if static else qc.FBGEMM_CONFIG
    weight = load(spec_config, tensors, dtype)
    x = x_for(m, k, dtype, seed=m)
    out = tq.fp8_linear(x, weight, use_scaled_mm=scaled_mm)
    torch.cuda.synchronize()
    q, scale = tq.quantize_fp8_reference(x, weight.activation_scale_ub,
                                         static_scale=weight.input_scale if static else None)
    reference = (q.double() * scale.double()[:, None]) @ expected.double().to(DEVICE).t()
    assert_near(out, reference + weight.bias.double(), dtype)


def test_fp8_dispatch_picks_scaled_mm_on_sm89_and_sm90():
    tensors, _ = qc.make_fp8(64, 128)
    weight = load(qc.FBGEMM_CONFIG, tensors, torch.bfloat16)
    assert tq.uses_scaled_mm(x_for(4, 128, torch.bfloat16), weight) == SCALED_MM
    assert not tq.uses_scaled_mm(x_for(4, 128, torch.float16), weight)


@pytest.mark.parametrize("name", ["awq", "mxfp4", "fbgemm"])
def test_quant_linear_replays_from_a_cuda_graph(name):
    """quant_linear reads nothing on the host: captured once, replayed on new inputs, it gives the eager result."""
    n, k = 256, 512
    if name == "fbgemm":
        config, (tensors, _) = qc.FBGEMM_CONFIG, qc.make_fp8(n, k)
    else:
        config, (tensors, _) = _case(name, n, k, seed=0)
    weight = load(config, tensors, torch.bfloat16)
    static_x = x_for(8, k, torch.bfloat16)
    tq.quant_linear(static_x, weight)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tq.quant_linear(static_x, weight)
    new_x = x_for(8, k, torch.bfloat16, seed=1)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, tq.quant_linear(new_x, weight))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 4), (9, 2), (300, 4)])
def test_moe_mxfp4_gemm(num_tokens, top_k, dtype):
    """The grouped MXFP4 expert GEMM (gpt-oss-like: 8 experts, an expert bias, routing weights)."""
    from workers.kernels.triton_moe import align_pairs

    num_experts, n, k = 8, 256, 512
    tensors, expected = qc.make_mxfp4(n, k, experts=num_experts, seed=num_tokens)
    bias = torch.randn(num_experts, n)
    weight = qf.Mxfp4Weight(tensors["layer_blocks"].flatten(-2).contiguous().to(DEVICE),
                            tensors["layer_scales"].to(DEVICE), bias.to(dtype).to(DEVICE))
    generator = torch.Generator().manual_seed(num_tokens)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    routing = torch.rand(num_tokens * top_k, generator=generator)
    block_m = 16 if num_tokens * top_k <= 16 * num_experts else 64
    aligned = align_pairs(expert_ids.to(DEVICE), num_experts, block_m)
    rows = x_for(num_tokens * top_k, k, dtype, seed=num_tokens)
    out = tq.moe_mxfp4_gemm(rows, weight, *aligned, num_tokens * top_k, 1, routing.to(DEVICE), block_m=block_m)
    torch.cuda.synchronize()
    flat = expert_ids.flatten()
    dense = expected.double().to(DEVICE)[flat.to(DEVICE)]  # [pairs, n, k]
    reference = routing.double().to(DEVICE)[:, None] * (
        torch.einsum("pnk,pk->pn", dense, rows.double()) + bias.to(dtype).double().to(DEVICE)[flat.to(DEVICE)])
    assert_near(out, reference, dtype)


def reference_quant_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """quant_linear's arithmetic in torch on CPU: activations quantized to e4m3 as the fp8 path
    does (per token, or by the static scale), times the dequantized weight, plus the bias."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if isinstance(weight, qf.Fp8Weight) and weight.activations is not None:
        static = weight.input_scale if weight.activations == "static_tensor" else None
        q, scale = tq.quantize_fp8_reference(rows, weight.activation_scale_ub, static_scale=static)
        rows = q.float() * scale[:, None]
    out = rows @ qf.dequantize(weight).t()
    if getattr(weight, "bias", None) is not None:
        out = out + weight.bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


@pytest.mark.parametrize("format_name", sorted(qc.CHECKPOINT_FORMATS) + ["compressed-tensors-fp8-weights-only"])
def test_quantized_checkpoint_loads_packed_on_cuda_and_decodes_as_the_reference(tmp_path, format_name):
    """A tiny quantized llama checkpoint through the real loader on CUDA (fp32): its linears stay
    packed (/v1/models says "Triton kernels"), and greedy tokens with Triton attention, the quant
    kernels and decode steps replayed from CUDA graphs equal those of the same packed weights on
    CPU multiplied by reference_quant_linear (w8a8 formats quantize activations in both)."""
    from kernel_cases import greedy_generate
    from tiny_model import build_tiny_model_dir

    from workers.model_runner import ModelRunner, RunnerConfig

    formats = qc.CHECKPOINT_FORMATS | qc.KERNEL_CHECKPOINT_FORMATS
    config, quantize, label = formats[format_name]
    plain_dir = build_tiny_model_dir(tmp_path / "plain", "llama", seed=3)
    quantized_dir, _, _ = qc.write_checkpoints(plain_dir, tmp_path, config, quantize)
    settings = dict(model=str(quantized_dir), dtype="float32", block_size=16, num_blocks=256)
    cuda_runner = ModelRunner(RunnerConfig(**settings, device=DEVICE, attention_backend="triton",
                                           cuda_graph_batch_sizes=(1, 2, 4)))
    assert cuda_runner.model_info.quantization == f"{label} (Triton kernels)"
    assert cuda_runner.model_info.cuda_graph_batch_sizes == (1, 2, 4)
    assert isinstance(cuda_runner.model.layers[0].o, (qf.Int4Weight, qf.Fp8Weight))

    cpu_runner = ModelRunner(RunnerConfig(**settings, attention_backend="torch", linear_backend="torch",
                                          layer_ops="torch"))
    qc.use_packed_model_on_cpu(cpu_runner, quantized_dir, reference_quant_linear)

    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(length)] for i, length in enumerate((5, 18, 40))]
    expected = greedy_generate(cpu_runner, prompts, max_tokens=12, chunk_size=16)
    assert greedy_generate(cuda_runner, prompts, max_tokens=12, chunk_size=16) == expected
