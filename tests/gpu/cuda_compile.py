"""Compile the Triton kernels for real NVIDIA targets on a machine without a GPU.

    python tests/gpu/cuda_compile.py        # prints one line per compiled case, exits 1 on failure

Each case calls the real Python launcher (workers.kernels.triton_attention.paged_attention /
write_kv_cache, workers.kernels.triton_moe.fused_moe: its two grouped-GEMM launches) on CPU
tensors with the kernel swapped for a recorder, then specializes the recorded arguments
exactly as triton's JITFunction.run does at a launch on a CUDA device
(ints equal to 1 become constexprs, 16-byte alignment and divisibility attributes) and compiles
through every stage down to a cubin for the target (sm_80 = A100, sm_90 = H100/H200), with the
ptxas that ships in the triton wheel. This catches what the interpreter cannot: Triton typing
and lowering errors, illegal tl.dot shapes and dtypes, register or shared-memory overflow at
compile time. It does not run anything: numerics are the interpreter's job
(tests/workers/test_triton_kernels.py), and running on a GPU is tests/gpu/test_gpu.py's.

Must run in a process where TRITON_INTERPRET is unset (the interpreter replaces the compiler).
Uses triton internals (create_function_from_signature, JITFunction._pack_args): pinned to the
triton version the project installs; on another version it exits 2 with the reason.
"""

from __future__ import annotations

import os
import sys
import time

import torch

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "unset TRITON_INTERPRET: this compiles for CUDA"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402

try:
    from triton.runtime.jit import create_function_from_signature
except ImportError as exc:  # pragma: no cover - depends on the triton version
    print(f"SKIP: triton {triton.__version__} lacks the internals this check uses ({exc})")
    sys.exit(2)

try:
    _PTXAS = triton.knobs.nvidia.ptxas.path
except Exception as exc:  # pragma: no cover - no ptxas in this triton install
    print(f"SKIP: no ptxas found for triton {triton.__version__} ({exc})")
    sys.exit(2)

from workers.kernels import triton_attention, triton_cache, triton_moe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: kernel_cases
import kernel_cases as kc  # noqa: E402


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def compile_recorded(kernel, args, kwargs, target: GPUTarget):
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound_args, specialization, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _record(module, name: str, launch, num_launches: int = 1) -> tuple | list[tuple]:
    """(kernel, args, kwargs) of the launch (a list of them where num_launches > 1)."""
    real, recorder = getattr(module, name), _Recorder()
    setattr(module, name, recorder)
    try:
        launch()
    finally:
        setattr(module, name, real)
    assert len(recorder.calls) == num_launches, f"expected {num_launches} launches, got {len(recorder.calls)}"
    calls = [(real, args, kwargs) for _, args, kwargs in recorder.calls]
    return calls[0] if num_launches == 1 else calls


# (name, arch, dtype, specs, block_size, head_dim, gqa, num_kv_heads, attention variant: kc.VARIANTS or None)
CASES = [
    ("mixed fp16 gqa3", 90, torch.float16, kc.MIXED_SPECS, 16, 64, 3, 3, None),  # SmolLM2-like heads
    ("decode bf16 gqa4", 90, torch.bfloat16, kc.DECODE_SPECS, 32, 128, 4, 2, None),
    ("one seq fp32 hd80", 80, torch.float32, [(40, 9)], 16, 80, 1, 4, None),  # num_seqs == 1: a constexpr
    ("mixed bf16 gqa8", 80, torch.bfloat16, kc.MIXED_SPECS, 16, 128, 8, 1, None),
    # Gemma 2 (window + soft-cap, head_dim 256 in the 9B/27B models) and gpt-oss (window + sinks)
    ("window softcap bf16", 90, torch.bfloat16, kc.WINDOW_SPECS, 16, 256, 2, 4, "window-softcap"),
    ("window sinks bf16", 90, torch.bfloat16, kc.WINDOW_SPECS, 16, 64, 8, 8, "window-sinks"),
    ("all variants fp32", 80, torch.float32, kc.WINDOW_SPECS, 16, 64, 3, 2, "all"),
    ("chunked bf16", 90, torch.bfloat16, kc.WINDOW_SPECS, 16, 128, 5, 8, "chunk7"),  # Llama 4's chunked layers
]


# fused MoE: (name, arch, dtype, tokens, experts, top_k, hidden, intermediate); few tokens per expert
# take 16-row tiles, many take 64 (triton_moe._choose_blocks); odd sizes lose the divisibility hints
MOE_CASES = [
    ("moe decode bf16", 90, torch.bfloat16, 4, 8, 2, 512, 256),
    ("moe prefill bf16", 90, torch.bfloat16, 300, 8, 2, 512, 256),
    ("moe prefill fp16", 80, torch.float16, 300, 16, 4, 256, 192),
    ("moe odd fp32", 80, torch.float32, 5, 4, 2, 72, 40),
]


def _moe_launches(dtype, num_tokens, num_experts, top_k, hidden, width) -> dict[str, tuple]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    gate_up = torch.randn(num_experts, 2 * width, hidden, generator=generator).to(dtype)
    down = torch.randn(num_experts, hidden, width, generator=generator).to(dtype)
    routing, expert_ids = torch.topk(torch.rand(num_tokens, num_experts, generator=generator), top_k)
    gate_up_launch, down_launch = _record(
        triton_moe, "_moe_gemm_kernel",
        lambda: triton_moe.fused_moe(x, gate_up, down, routing, expert_ids, "silu"), num_launches=2)
    return {"moe gate_up": gate_up_launch, "moe down": down_launch}


def _compile_and_report(kernel_name: str, name: str, arch: int, kernel, args, kwargs) -> bool:
    started = time.perf_counter()
    try:
        compiled = compile_recorded(kernel, args, kwargs, GPUTarget("cuda", arch, 32))
        assert "cubin" in compiled.asm, sorted(compiled.asm)
        print(f"ok   sm_{arch} {kernel_name:16s} {name:18s} "
              f"shared={compiled.metadata.shared}B {time.perf_counter() - started:.1f}s")
        return True
    except Exception as exc:  # report every case, then fail
        print(f"FAIL sm_{arch} {kernel_name:16s} {name:18s} {type(exc).__name__}: {exc}")
        return False


def main() -> int:
    failures = 0
    for name, arch, dtype, *shape in MOE_CASES:
        for kernel_name, (kernel, args, kwargs) in _moe_launches(dtype, *shape).items():
            failures += not _compile_and_report(kernel_name, name, arch, kernel, args, kwargs)
    for name, arch, dtype, specs, block_size, head_dim, gqa, num_kv_heads, variant in CASES:
        batch = kc.make_batch(specs, block_size=block_size, num_kv_heads=num_kv_heads, num_queries_per_kv=gqa,
                              head_dim=head_dim, dtype=dtype)
        variants = {} if variant is None else kc.variant_kwargs(variant, num_kv_heads * gqa)
        launches = {
            "paged_attention": _record(triton_attention, "_paged_attention_kernel",
                                       lambda: triton_attention.paged_attention(*batch.attention_args(), **variants)),
        }
        if arch == 90 or dtype == torch.float32:
            launches["write_kv_cache"] = _record(
                triton_cache, "_write_kv_cache_kernel",
                lambda: triton_cache.write_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache,
                                                    batch.slot_mapping),
            )
        for kernel_name, (kernel, args, kwargs) in launches.items():
            failures += not _compile_and_report(kernel_name, name, arch, kernel, args, kwargs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
