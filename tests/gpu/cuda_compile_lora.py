"""Compile the segmented LoRA kernels (workers/kernels/triton_lora.py) for real NVIDIA targets on a
machine without a GPU, as tests/gpu/cuda_compile.py does for the other kernels (its recorder and
compile helpers; see its docstring for what this does and does not catch).

    python tests/gpu/cuda_compile_lora.py      # one line per compiled case, exits 1 on failure

Cases: the shrink and the expand of the qkv product (three parts) for decode-sized segments
(16-row tiles) and a prefill (64-row tiles), ranks up to 16 and up to 64 (BLOCK_R 16 and 64), in
bf16 and fp16, and fp32 on odd sizes (no divisibility hints), for sm_80 (A100) and sm_90 (H100/H200).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/gpu: cuda_compile

import cuda_compile as cc  # noqa: E402  (asserts TRITON_INTERPRET is unset; exits 2 without ptxas)
import torch  # noqa: E402

from workers.kernels import triton_lora as tl_lora  # noqa: E402
from workers.lora import LoraStack  # noqa: E402

# (name, arch, dtype, rows of each segment, rank of each segment's adapter, hidden, kv columns)
CASES = [
    ("decode bf16 r<=16", 90, torch.bfloat16, (1, 1, 2, 1), (16, 8, 16, 4), 2048, 512),
    ("prefill bf16 r64", 90, torch.bfloat16, (300, 40), (64, 16), 2048, 512),
    ("decode fp16 r8", 80, torch.float16, (1, 3), (8, 8), 4096, 1024),
    ("odd fp32", 80, torch.float32, (5, 17), (4, 12), 72, 24),
]


def _stack(rank: int, hidden: int, kv: int, dtype: torch.dtype, num_layers: int = 2) -> LoraStack:
    """A qkv stack with all three parts (q, k, v) in every layer."""
    columns = [(0, hidden), (hidden, kv), (hidden + kv, kv)]
    spans = torch.tensor([columns] * num_layers, dtype=torch.int32)
    a, bt = torch.randn(num_layers, 3, rank, hidden).to(dtype), torch.randn(num_layers, 3, rank, hidden).to(dtype)
    return LoraStack(a, bt, spans, hidden + 2 * kv)


def _launches(dtype, segment_rows, ranks, hidden, kv) -> dict[str, tuple]:
    num_rows = sum(segment_rows) + 3  # three base rows
    order = torch.randperm(num_rows)
    segments, first = [], 0
    for rows, rank in zip(segment_rows, ranks):
        segments.append((order[first:first + rows], (_stack(rank, hidden, kv, dtype), None, None, None)))
        first += rows
    table = tl_lora.LoraStepTable.build(segments, num_rows)
    x = torch.randn(num_rows, hidden).to(dtype)
    y = torch.randn(num_rows, hidden + 2 * kv).to(dtype)
    block_m, block_k, block_n = tl_lora._choose_blocks(table.max_segment_rows, dtype)
    shape = table.shapes[0]
    shrunk = torch.empty(table.row_ids.numel(), shape.num_parts, tl_lora._block_r(shape.max_rank))
    return {
        "lora shrink": cc._record(tl_lora, "_lora_shrink_kernel",
                                  lambda: tl_lora.lora_shrink(x, table, 1, 0, block_m=block_m, block_k=block_k)),
        "lora expand": cc._record(tl_lora, "_lora_expand_kernel",
                                  lambda: tl_lora.lora_expand(y, shrunk, table, 1, 0, block_m=block_m,
                                                              block_n=block_n)),
    }


def main() -> int:
    failures = 0
    for name, arch, dtype, *shape in CASES:
        for kernel_name, (kernel, args, kwargs) in _launches(dtype, *shape).items():
            failures += not cc._compile_and_report(kernel_name, name, arch, kernel, args, kwargs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
