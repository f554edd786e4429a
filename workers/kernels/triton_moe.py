"""The mixture-of-experts MLP in Triton: one grouped GEMM launch per projection over every
expert a step's tokens chose (the GPU path of workers/moe.py; the same maths as run_experts).

    out = fused_moe(x, gate_up, down, routing, expert_ids, "silu")
    # x [T, H]; gate_up [E, 2I, H] and down [E, H, I] (our [out, in] layout, stacked over experts);
    # routing fp32 [T, k] and expert_ids int64 [T, k] from workers/moe.py's route() -> [T, H] in x's dtype

Pairs. Token t's slot j is pair p = t * k + j (routing.flatten() order). Each pair gets its own
row in the intermediate and output buffers, so no two programs ever write the same row.

Alignment (align_pairs, torch ops, no host sync: every size depends only on shapes). The pairs
are sorted by expert (stably, tokens ascending) and each expert's run is padded to a multiple of
BLOCK_M, so that every M-tile of BLOCK_M sorted rows belongs to one expert:

    sorted_pair_ids  [ e0 e0 e0 PAD | e2 e2 e2 e2 | e2 PAD PAD PAD | e3 PAD PAD PAD | PAD ... ]   BLOCK_M = 4
    tile_expert_ids  [ 0            | 2           | 2              | 3              | -1  ... ]
    num_post_padded  12 (a one-element tensor: tiles at or past it do nothing)

PAD is num_pairs (a pair id that does not exist: its row is masked out). The buffers are sized
for the worst case, num_pairs + min(E, num_pairs) * (BLOCK_M - 1) rows, since at most that many
experts have a pair; an expert with no pair gets no tile.

The kernel (_moe_gemm_kernel), program (M-tile, N-tile), grid (tiles for the worst case, cdiv(N, BLOCK_N)):

    rows   = A[sorted_pair_ids[tile] // A_ROWS_PER_PAIR_DIVISOR]    gathered, masked for PAD rows
    acc    = rows @ W[tile_expert_ids[tile]][n-tile].T              fp32 accumulation over K in BLOCK_K steps
    acc   *= routing[pair]                                          down projection only (MUL_ROUTING_WEIGHT)
    C[pair, n-tile] = acc                                           in C's dtype, one row per pair

    gate_up launch: A = x (row of pair p is token p // k), C = [num_pairs, 2I]
    activation:     act(gate) * up over the [gate | up] halves of each row (torch, as TorchOps.gated_mul)
    down launch:    A = the activated rows (row of pair p is p), C = [num_pairs, H], times routing
    out = C.view(T, k, H).sum(1)                                    fp32 sum of each token's k rows

Program ids run M-tiles fastest, so the programs of one expert's M-tiles read the same weight
tile close together in time (for L2 to serve the repeats). There is no further tile swizzle
and no autotuning: the tile sizes are fixed by _choose_blocks, untuned on a GPU so far.

CUDA graphs: nothing here reads a tensor on the host (no .item(), .tolist(), bincount or
nonzero), the grid and every buffer depend only on T, k, E and the weights' shapes, and tiles
past the padded count return at once: fused_moe can be captured.

Dtypes: fp32, fp16, bf16 (x and the weights alike); fp32 dots are IEEE (no TF32), so fp32
results match the torch path closely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["align_pairs", "fused_moe", "moe_gemm"]

_MOE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _moe_gemm_kernel(
    c_ptr,  # [num_pairs, N]: one output row per (token, slot) pair
    a_ptr,  # [num_a_rows, K]: the rows pairs gather (tokens, or one row per pair)
    w_ptr,  # [E, N, K]: each expert's weight, [out, in]
    routing_ptr,  # [num_pairs] fp32: each pair's routing weight (MUL_ROUTING_WEIGHT; any pointer otherwise)
    sorted_pair_ids_ptr,  # [num_padded_rows] int32: pair ids grouped by expert, num_pairs = padding
    tile_expert_ids_ptr,  # [num_padded_rows // BLOCK_M] int32: the expert of each M-tile (-1: unused tile)
    num_post_padded_ptr,  # [1] int32: rows in use (a multiple of BLOCK_M)
    num_pairs,  # int: T * k
    N,  # int: output columns
    K,  # int: reduction length
    stride_a_row,  # a.stride(0), elements
    stride_w_e,  # w.stride(0)
    stride_w_n,  # w.stride(1)
    stride_c_row,  # c.stride(0)
    A_ROWS_PER_PAIR_DIVISOR: tl.constexpr,  # row of pair p in A = p // this (top_k for x, 1 for per-pair rows)
    MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; ignored for fp16/bf16
):
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    if tile_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(tile_expert_ids_ptr + tile_m).to(tl.int64)

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)  # [BLOCK_M] int32
    row_valid = pair < num_pairs
    a_row = (pair // A_ROWS_PER_PAIR_DIVISOR).to(tl.int64)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_a_row + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_rows = expert * stride_w_e + offs_n.to(tl.int64) * stride_w_n  # [BLOCK_N]
    w_ptrs = w_ptr + w_rows[None, :] + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: the tile transposed
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if MUL_ROUTING_WEIGHT:
        weight = tl.load(routing_ptr + pair, mask=row_valid, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_c_row + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the aligned buffers: every pair, plus at most BLOCK_M - 1 padding rows for each
    expert that can have a pair, rounded up to whole tiles."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_pairs(expert_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids [T, k] int -> (sorted_pair_ids int32 [R], tile_expert_ids int32 [R // block_m],
    num_post_padded int32 [1]) with R = max_padded_rows(T * k, E, block_m): the layout of the
    module docstring. Torch ops only, no host sync."""
    device = expert_ids.device
    flat = expert_ids.flatten().long()
    num_pairs = flat.numel()
    num_rows = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount reads its size on the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts  # of each expert's run among the sorted pairs
    order = torch.argsort(flat, stable=True)  # pair ids by expert, pairs ascending within one
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - starts[sorted_experts]
    destination = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    sorted_pair_ids = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destination, order.to(torch.int32))
    tile_starts = torch.arange(0, num_rows, block_m, device=device)
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)  # experts ending at or before
    tile_expert_ids = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_pair_ids, tile_expert_ids, padded_ends[-1:].to(torch.int32)


def _choose_blocks(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16-row tiles (the smallest tl.dot takes) when an expert
    averages few rows (decodes), else 64. Only speed depends on it, never results."""
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    return block_m, 64, 32 if dtype == torch.float32 else 64


def moe_gemm(a: torch.Tensor, weight: torch.Tensor, sorted_pair_ids: torch.Tensor, tile_expert_ids: torch.Tensor,
             num_post_padded: torch.Tensor, num_pairs: int, pairs_per_row: int,
             routing: torch.Tensor | None = None, *, block_m: int, block_n: int = 64,
             block_k: int = 64) -> torch.Tensor:
    """One grouped GEMM: out[p] = routing[p] * (a[p // pairs_per_row] @ weight[expert of p].T) for
    every pair p; pairs_per_row is top_k when a holds tokens, 1 when it holds one row per pair;
    routing None: no scaling. a [num_pairs // pairs_per_row, K]; weight [E, N, K] -> [num_pairs, N]
    in a's dtype. The alignment tensors come from align_pairs(..., block_m)."""
    assert a.dim() == 2 and weight.dim() == 3, (
        f"a must be [rows, K], weight [E, N, K]: {tuple(a.shape)}, {tuple(weight.shape)}")
    num_experts, n, k = weight.shape
    assert a.shape[1] == k, f"a has {a.shape[1]} columns, the weight takes {k}"
    assert a.dtype in _MOE_DTYPES and a.dtype == weight.dtype, f"dtypes: a {a.dtype}, weight {weight.dtype}"
    assert a.stride(1) == 1 and weight.stride(2) == 1, "a and weight must be contiguous in their last dim"
    assert pairs_per_row >= 1 and a.shape[0] * pairs_per_row == num_pairs, (
        f"a has {a.shape[0]} rows; {num_pairs} pairs at {pairs_per_row} per row need {num_pairs // pairs_per_row}")
    assert sorted_pair_ids.dtype == tile_expert_ids.dtype == num_post_padded.dtype == torch.int32
    assert sorted_pair_ids.numel() == tile_expert_ids.numel() * block_m and num_post_padded.numel() == 1
    if routing is not None:
        assert routing.dtype == torch.float32 and routing.is_contiguous() and routing.numel() == num_pairs
    for t in (weight, sorted_pair_ids, tile_expert_ids, num_post_padded) + (() if routing is None else (routing,)):
        assert t.device == a.device, f"all inputs must be on {a.device}, found one on {t.device}"
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (tile_expert_ids.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        out, a, weight, a if routing is None else routing,
        sorted_pair_ids, tile_expert_ids, num_post_padded,
        num_pairs, n, k,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        A_ROWS_PER_PAIR_DIVISOR=pairs_per_row,
        MUL_ROUTING_WEIGHT=routing is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: torch.Tensor,
              expert_ids: torch.Tensor, activation: str = "silu", *,
              blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """sum over k of routing[t, k] * expert_{expert_ids[t, k]}(x[t]), each expert the gated MLP
    down_e(act(gate_e(x)) * up_e(x)). x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows);
    down [E, H, I]; routing fp32 [T, k]; expert_ids int [T, k] in [0, E) -> [T, H] in x's dtype.
    blocks: (BLOCK_M, BLOCK_N, BLOCK_K), None picks them from the shapes."""
    assert x.dim() == 2 and gate_up.dim() == 3 and down.dim() == 3
    num_tokens, hidden = x.shape
    num_experts, width2, _ = gate_up.shape
    assert gate_up.shape == (num_experts, width2, hidden) and width2 % 2 == 0, (
        f"gate_up must be [E, 2I, {hidden}], got {tuple(gate_up.shape)}")
    assert down.shape == (num_experts, hidden, width2 // 2), (
        f"down must be [{num_experts}, {hidden}, {width2 // 2}], got {tuple(down.shape)}")
    assert routing.shape == expert_ids.shape and routing.shape[0] == num_tokens, (
        f"routing {tuple(routing.shape)} and expert_ids {tuple(expert_ids.shape)} must be [{num_tokens}, k]")
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = blocks or _choose_blocks(num_pairs, num_experts, x.dtype)
    aligned = align_pairs(expert_ids, num_experts, block_m)
    sizes = dict(block_m=block_m, block_n=block_n, block_k=block_k)
    gate_up_rows = moe_gemm(x, gate_up, *aligned, num_pairs, top_k, **sizes)  # x: a row per token -> [num_pairs, 2I]
    gate, up = gate_up_rows.chunk(2, dim=-1)
    rows = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up  # [num_pairs, I]
    weighted = moe_gemm(rows, down, *aligned, num_pairs, 1,
                        routing.float().contiguous().view(-1), **sizes)  # [num_pairs, H]
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
