"""Compile the quantized-linear Triton kernels (workers/kernels/triton_quant.py) for real NVIDIA
targets on a machine without a GPU, as tests/gpu/cuda_compile.py does for the other kernels
(its recorder and compile helpers; see its docstring for what this does and does not catch).

    python tests/gpu/cuda_compile_quant.py     # one line per compiled case, exits 1 on failure

Cases: the AWQ/GPTQ GEMM on both of its paths (one group per K tile; groups smaller than a tile,
act-order g_idx) in fp16 and bf16, each word loaded per weight or once (packed_loads), one-row tiles without tl.dot, the MXFP4 GEMM and its grouped MoE form, the FP8 GEMM with fp8 and with 16-bit
activations, for sm_80 (A100) and sm_90 (H100/H200); the per-token FP8 quantizer for sm_89 and
sm_90 only (Triton's fp32 -> e4m3 cast needs sm_89; quant_linear quantizes with torch below it).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/gpu: cuda_compile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: quant_cases

import cuda_compile as cc  # noqa: E402  (asserts TRITON_INTERPRET is unset; exits 2 without ptxas)
import torch  # noqa: E402

import quant_cases as qc  # noqa: E402
from workers import quant_formats as qf  # noqa: E402
from workers.kernels import triton_quant as tq  # noqa: E402
from workers.kernels.triton_moe import align_pairs  # noqa: E402


def _weight(config: dict, tensors: dict, dtype: torch.dtype):
    spec = qf.parse_quantization(config)
    raw = {role.rstrip("?"): tensors.get(name) for role, name in spec.tensor_names("layer").items()}
    raw["bias"] = tensors.get("layer.bias")
    return qf.to_kernel_form(spec, raw, "cpu", dtype)


def _launches(dtype: torch.dtype, m: int) -> dict[str, tuple]:
    n, k = 256, 512
    x = torch.randn(m, k).to(dtype)
    awq = _weight(qc.AWQ_CONFIG | {"group_size": 128}, qc.make_awq(n, k, 128)[0], dtype)
    gptq_tensors = qc.make_gptq(n, k, 32, act_order=True)[0]
    gptq_tensors["layer.bias"] = torch.randn(n)
    gptq = _weight(qc.GPTQ_CONFIG | {"desc_act": True}, gptq_tensors, dtype)
    mx = _weight(qc.MXFP4_CONFIG, qc.make_mxfp4(n, k)[0], dtype)
    fp8 = _weight(qc.FBGEMM_CONFIG, qc.make_fp8(n, k)[0], dtype)
    q, scale = tq.quantize_fp8_reference(x)
    stack = qc.make_mxfp4(n, k, experts=4)[0]
    experts = qf.Mxfp4Weight(stack["layer_blocks"].flatten(-2).contiguous(), stack["layer_scales"],
                             torch.randn(4, n).to(dtype))
    expert_ids = torch.randint(0, 4, (m, 2))
    aligned = align_pairs(expert_ids, 4, 16 if m <= 16 else 64)
    routing = torch.rand(2 * m)
    packed = tq.Tiles(16 if m <= 16 else 64, 64, 64, 8, 4, packed_loads=True)
    one_row = tq.Tiles(1, 128, 64, 4, 3, packed_loads=True)  # BLOCK_M 1: no tl.dot
    chosen_wide = (16, 128, 128, 4, 3, True) if m <= 16 else (64, 64, 128, 4, 3, True)
    return {
        "moe mxfp4": cc._record(tq, "_moe_mxfp4_gemm_kernel", lambda: tq.moe_mxfp4_gemm(
            x, experts, *aligned, 2 * m, 2, None, block_m=16 if m <= 16 else 64)),
        "moe mxfp4 routed": cc._record(tq, "_moe_mxfp4_gemm_kernel", lambda: tq.moe_mxfp4_gemm(
            x.repeat_interleave(2, 0), experts, *aligned, 2 * m, 1, routing, block_m=16 if m <= 16 else 64)),
        "awq one-group": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, awq)),
        "gptq g_idx": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, gptq)),
        "awq split-k 4": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, awq, split_k=4)),
        "awq packed": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, awq, blocks=packed)),
        "gptq packed g_idx": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, gptq, blocks=packed)),
        "mxfp4 packed": cc._record(tq, "_mxfp4_gemm_kernel", lambda: tq.mxfp4_gemm(x, mx, blocks=packed)),
        "awq one-row": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, awq, blocks=one_row)),
        "gptq one-row g_idx": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, gptq, blocks=one_row)),
        "mxfp4 one-row": cc._record(tq, "_mxfp4_gemm_kernel", lambda: tq.mxfp4_gemm(x, mx, blocks=one_row)),
        # _choose_blocks' tiles for wide layers (its sizes do not depend on N): 16 x 128 x 128 and
        # 64 x 64 x 128 packed, and MXFP4's one-row 256 x 32
        "awq chosen wide": cc._record(tq, "_int4_gemm_kernel", lambda: tq.int4_gemm(x, awq, blocks=chosen_wide)),
        "mxfp4 chosen one-row": cc._record(tq, "_mxfp4_gemm_kernel", lambda: tq.mxfp4_gemm(
            x, mx, blocks=(1, 256, 32, 8, 3, True))),
        "mxfp4 split-k 4": cc._record(tq, "_mxfp4_gemm_kernel", lambda: tq.mxfp4_gemm(x, mx, split_k=4)),
        "mxfp4": cc._record(tq, "_mxfp4_gemm_kernel", lambda: tq.mxfp4_gemm(x, mx)),
        "fp8 w8a8": cc._record(tq, "_fp8_gemm_kernel", lambda: tq.fp8_gemm(q, scale, fp8, dtype)),
        "fp8 w8a16": cc._record(tq, "_fp8_gemm_kernel", lambda: tq.fp8_gemm(x, None, fp8, dtype)),
        "fp8 quantize": cc._record(tq, "_quantize_fp8_kernel", lambda: tq.quantize_fp8_per_token(x, 1200.0)),
    }


def main() -> int:
    failures = 0
    for arch in (80, 89, 90):
        for dtype, m in ((torch.float16, 1), (torch.bfloat16, 64)):
            for name, (kernel, args, kwargs) in _launches(dtype, m).items():
                quantizer = name == "fp8 quantize"
                if (arch < 89 and quantizer) or (arch == 89 and not quantizer):
                    continue  # sm_80: all but the quantizer; sm_89: only it (the arch its cast needs)
                label = f"{str(dtype)[6:]} M={m}"
                failures += not cc._compile_and_report(name, label, arch, kernel, args, kwargs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
