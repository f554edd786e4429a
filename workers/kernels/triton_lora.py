"""LoRA products of a mixed-adapter step in Triton: one shrink launch and one expand launch per
product (qkv, o, gate_up, down) cover every adapter of the step and every part of the product
(q, k and v; gate and up), segmented by adapter, as Punica and S-LoRA do. The GPU path of
workers/lora.py's StepLora.add; its torch products are the oracle.

    table = LoraStepTable.build([(rows or None, adapter.stacks()), ...], num_rows)   # once per step
    lora_add(y, x, table, layer, product)       # y [rows, out] += each segment's LoRA of x [rows, in]

Weights. Each adapter keeps, per product, a LoraStack (workers/lora.py) on the device, built once
at load and freed with the adapter: A [layers, parts, rank, in], Bt [layers, parts, rank, width]
(B transposed, times the scaling, zero-padded to its widest part) and spans int32 [layers, parts, 2]
(each part's first output column and its columns; 0 columns: no such part in that layer). Nothing
is copied per step: the step's weight table holds their addresses.

The step's tables (LoraStepTable.build, once per step, not per product: two small host-to-device copies):

    row_ids   int32 [num_adapter_rows]      the rows of every segment, segment after segment:
              [ 3 4 9 | 0 1 2 7 8 | 5 6 ]     (rows need not be contiguous; base rows appear nowhere)
    segments  int32 [segments, 2]           (first index into row_ids, rows): (0, 3), (3, 5), (8, 2)
    weights   int64 [segments, 4, 6]        per segment and product: addresses of A, Bt and spans,
                                            rank, parts, width (all 0: the adapter lacks the product)

A row is in at most one segment, and a product's parts own disjoint columns, so every element of
y is read and written by exactly one expand program: no atomics.

Shrink, program (segment, M-tile, part), grid (segments, cdiv(max rows, BLOCK_M), max parts):

    shrunk[i, part, :rank] = x[row_ids[i]] @ A[layer, part].T     fp32, for the tile's i of the segment

Expand, program (segment, M-tile, part * N-tiles + N-tile), grid (..., max parts * cdiv(max width, BLOCK_N)):

    y[row_ids[i], start + n] += shrunk[i, part] @ Bt[layer, part][:, n]     fp32 accumulation, y's dtype

Programs past a segment's rows, an adapter's parts or a part's columns return at once (segments
of unequal lengths share one grid). shrunk stays fp32 between the launches; with 16-bit weights
it is rounded to their dtype before the expand's dot, as the torch products round x @ A.T.
fp32 dots are IEEE (no TF32). The step's tables are read with pointers loaded from memory, so
the compiler cannot prove the weights' alignment; no tile sizes are tuned on a GPU so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["LoraStepTable", "lora_add", "lora_expand", "lora_shrink", "takes"]

NUM_PRODUCTS = 4  # qkv, o, gate_up, down: workers/lora.py's PRODUCTS
WEIGHT_COLUMNS = 6  # per (segment, product): A's address, Bt's, spans', rank, parts, width
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["layer", "product"])
def _lora_shrink_kernel(
    shrunk_ptr,  # [num_adapter_rows, num_part_slots, BLOCK_R] fp32: x @ A.T per row of row_ids and part
    x_ptr,  # [num_rows, K]: the product's input rows
    row_ids_ptr,  # [num_adapter_rows] int32: the rows of each segment, segment after segment
    segments_ptr,  # [num_segments, 2] int32: (first index into row_ids, rows)
    weights_ptr,  # [num_segments, NUM_PRODUCTS, WEIGHT_COLUMNS] int64: the module docstring's weight table
    layer,  # int: the layer whose weights the step runs
    product,  # int: index of the product in PRODUCTS
    K,  # int: the product's input columns (A's last dim)
    num_part_slots,  # int: shrunk.shape[1]
    stride_x_row,  # x.stride(0), elements
    NUM_PRODUCTS_: tl.constexpr,
    WEIGHT_COLUMNS_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= every rank in the step, >= 16
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; ignored for fp16/bf16
):
    segment = tl.program_id(0)
    tile = tl.program_id(1)
    part = tl.program_id(2)
    first = tl.load(segments_ptr + segment * 2)
    count = tl.load(segments_ptr + segment * 2 + 1)
    if tile * BLOCK_M >= count:
        return
    weights = weights_ptr + (segment * NUM_PRODUCTS_ + product) * WEIGHT_COLUMNS_
    num_parts = tl.load(weights + 4)
    if part >= num_parts:  # also: the adapter lacks the product (0 parts)
        return
    spans = tl.load(weights + 2).to(tl.pointer_type(tl.int32))
    slot = layer * num_parts + part  # of [layers, parts]
    if tl.load(spans + slot * 2 + 1) == 0:  # no such part in this layer
        return
    rank = tl.load(weights + 3)
    a_ptr = tl.load(weights).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot * rank * K

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < count
    rows = tl.load(row_ids_ptr + first + offs_m, mask=m_valid, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x_row + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = a_ptr + offs_r[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_R]: A's tile transposed
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k_start
        x = tl.load(x_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_valid[:, None] & (offs_r < rank)[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_rows = (first + offs_m).to(tl.int64) * num_part_slots + part
    tl.store(shrunk_ptr + out_rows[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_valid[:, None])


@triton.jit(do_not_specialize=["layer", "product"])
def _lora_expand_kernel(
    y_ptr,  # [num_rows, N]: the product's output, added to in place
    shrunk_ptr,  # [num_adapter_rows, num_part_slots, BLOCK_R] fp32: the shrink's output
    row_ids_ptr,  # [num_adapter_rows] int32
    segments_ptr,  # [num_segments, 2] int32
    weights_ptr,  # [num_segments, NUM_PRODUCTS, WEIGHT_COLUMNS] int64
    layer,  # int
    product,  # int
    num_part_slots,  # int: shrunk.shape[1]
    num_n_tiles,  # int: cdiv(the widest part in the step, BLOCK_N)
    stride_y_row,  # y.stride(0), elements
    NUM_PRODUCTS_: tl.constexpr,
    WEIGHT_COLUMNS_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    tile = tl.program_id(1)
    part = tl.program_id(2) // num_n_tiles
    tile_n = tl.program_id(2) % num_n_tiles
    first = tl.load(segments_ptr + segment * 2)
    count = tl.load(segments_ptr + segment * 2 + 1)
    if tile * BLOCK_M >= count:
        return
    weights = weights_ptr + (segment * NUM_PRODUCTS_ + product) * WEIGHT_COLUMNS_
    num_parts = tl.load(weights + 4)
    if part >= num_parts:
        return
    spans = tl.load(weights + 2).to(tl.pointer_type(tl.int32))
    slot = layer * num_parts + part
    start = tl.load(spans + slot * 2)
    columns = tl.load(spans + slot * 2 + 1)
    if tile_n * BLOCK_N >= columns:  # also: no such part in this layer (0 columns)
        return
    rank = tl.load(weights + 3)
    width = tl.load(weights + 5)
    bt_ptr = tl.load(weights + 1).to(tl.pointer_type(y_ptr.dtype.element_ty)) + slot * rank * width

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < count
    rows = tl.load(row_ids_ptr + first + offs_m, mask=m_valid, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < columns
    in_rows = (first + offs_m).to(tl.int64) * num_part_slots + part
    shrunk = tl.load(shrunk_ptr + in_rows[:, None] * BLOCK_R + offs_r[None, :], mask=m_valid[:, None], other=0.0)
    bt = tl.load(bt_ptr + offs_r[:, None] * width + offs_n[None, :],
                 mask=(offs_r < rank)[:, None] & n_valid[None, :], other=0.0)
    delta = tl.dot(shrunk.to(bt.dtype), bt, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32

    y_ptrs = y_ptr + rows[:, None] * stride_y_row + (start + offs_n)[None, :]
    mask = m_valid[:, None] & n_valid[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class ProductShape:
    """The widest of a product's stacks among a step's segments (host ints: grid and tile sizes)."""

    num_parts: int  # most parts of one adapter (0: no segment's adapter has the product)
    max_rank: int
    max_width: int  # widest part
    in_features: int  # x's columns (every stack's A has them)
    out_columns: int  # y needs at least this many columns
    dtype: torch.dtype | None


@dataclass(frozen=True, slots=True)
class LoraStepTable:
    """A step's segments and their adapters' weights as the kernels read them (module docstring)."""

    row_ids: torch.Tensor  # int32 [num_adapter_rows]
    segments: torch.Tensor  # int32 [num_segments, 2]: (first index into row_ids, rows)
    weights: torch.Tensor  # int64 [num_segments, NUM_PRODUCTS, WEIGHT_COLUMNS]
    num_rows: int  # the step's rows (x's and y's)
    max_segment_rows: int
    shapes: tuple[ProductShape, ...]  # per product
    stacks: tuple  # every stack the weight table points into, kept alive with it

    @classmethod
    def build(cls, segments: list[tuple[torch.Tensor | None, tuple]], num_rows: int) -> LoraStepTable:
        """From each segment's (rows: int tensor, None for every row of the step; its adapter's
        stacks per product, None where it lacks one): workers/lora.py's StepLora segments."""
        stacks = [stack for _, per_product in segments for stack in per_product if stack is not None]
        assert stacks, "a step's LoRA table needs at least one adapter with a product"
        device = stacks[0].a.device
        rows = [torch.arange(num_rows, device=device) if r is None else r for r, _ in segments]
        firsts, total = [], 0
        for r in rows:
            firsts.append([total, r.numel()])
            total += r.numel()
        weights = [[[0] * WEIGHT_COLUMNS if s is None else _weight_row(s) for s in per_product]
                   for _, per_product in segments]
        shapes = tuple(_product_shape([per_product[p] for _, per_product in segments]) for p in range(NUM_PRODUCTS))
        return cls(
            row_ids=torch.cat(rows).to(device=device, dtype=torch.int32),
            segments=torch.tensor(firsts, dtype=torch.int32).to(device),
            weights=torch.tensor(weights, dtype=torch.int64).to(device),
            num_rows=num_rows,
            max_segment_rows=max(r.numel() for r in rows),
            shapes=shapes,
            stacks=tuple(stacks),
        )


def _weight_row(stack) -> list[int]:
    layers, parts, rank, _ = stack.a.shape
    width = stack.bt.shape[3]
    assert stack.bt.shape == (layers, parts, rank, width) and stack.spans.shape == (layers, parts, 2), (
        f"a stack's A {tuple(stack.a.shape)}, Bt {tuple(stack.bt.shape)}, spans {tuple(stack.spans.shape)} disagree")
    assert stack.a.is_contiguous() and stack.bt.is_contiguous() and stack.spans.is_contiguous()
    assert stack.spans.dtype == torch.int32 and stack.a.dtype == stack.bt.dtype
    return [stack.a.data_ptr(), stack.bt.data_ptr(), stack.spans.data_ptr(), rank, parts, width]


def _product_shape(stacks: list) -> ProductShape:
    present = [stack for stack in stacks if stack is not None]
    if not present:
        return ProductShape(0, 0, 0, 0, 0, None)
    in_features = {stack.a.shape[3] for stack in present}
    dtypes = {stack.a.dtype for stack in present}
    assert len(in_features) == 1 and len(dtypes) == 1, f"stacks of one product disagree: {in_features}, {dtypes}"
    return ProductShape(num_parts=max(stack.a.shape[1] for stack in present),
                        max_rank=max(stack.a.shape[2] for stack in present),
                        max_width=max(stack.bt.shape[3] for stack in present),
                        in_features=in_features.pop(), out_columns=max(stack.num_columns for stack in present),
                        dtype=dtypes.pop())


def takes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether lora_add runs on these tensors (else the caller's torch products do)."""
    return (x.dim() == 2 and y.dim() == 2 and x.dtype in _DTYPES and y.dtype == x.dtype
            and x.stride(1) == 1 and y.stride(1) == 1)


def _choose_blocks(max_rows: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_N): 16-row tiles (the smallest tl.dot takes) for decode-sized
    segments, else 64. Only speed depends on it, never results."""
    return 16 if max_rows <= 16 else 64, 32 if dtype == torch.float32 else 64, 64


def _block_r(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def lora_shrink(x: torch.Tensor, table: LoraStepTable, layer: int, product: int, *, block_m: int,
                block_k: int) -> torch.Tensor:
    """fp32 [num_adapter_rows, parts, BLOCK_R]: x[row_ids[i]] @ A[layer, part].T in [i, part, :rank]
    for every row i of row_ids (the slots of parts an adapter lacks are left unwritten)."""
    shape = table.shapes[product]
    assert x.shape[1] == shape.in_features, (
        f"x has {x.shape[1]} columns, product {product}'s A takes {shape.in_features}")
    assert x.shape[0] == table.num_rows and x.stride(1) == 1 and x.dtype == shape.dtype, (
        f"x must be [{table.num_rows}, {shape.in_features}] {shape.dtype}, contiguous in its last dim")
    assert x.device == table.weights.device, f"x is on {x.device}, the table on {table.weights.device}"
    block_r = _block_r(shape.max_rank)
    num_adapter_rows = table.row_ids.numel()
    shrunk = torch.empty(num_adapter_rows, shape.num_parts, block_r, dtype=torch.float32, device=x.device)
    grid = (table.segments.shape[0], triton.cdiv(table.max_segment_rows, block_m), shape.num_parts)
    _lora_shrink_kernel[grid](
        shrunk, x, table.row_ids, table.segments, table.weights,
        layer, product, x.shape[1], shape.num_parts, x.stride(0),
        NUM_PRODUCTS_=NUM_PRODUCTS,
        WEIGHT_COLUMNS_=WEIGHT_COLUMNS,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return shrunk


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, table: LoraStepTable, layer: int, product: int, *,
                block_m: int, block_n: int) -> torch.Tensor:
    """y[row_ids[i], start + n] += shrunk[i, part] @ Bt[layer, part][:, n] for every part; in place, returns y."""
    shape = table.shapes[product]
    assert y.shape[0] == table.num_rows and y.shape[1] >= shape.out_columns and y.stride(1) == 1, (
        f"y must be [{table.num_rows}, >= {shape.out_columns}] contiguous in its last dim, got {tuple(y.shape)}")
    assert y.dtype == shape.dtype, f"y is {y.dtype}, product {product}'s weights {shape.dtype}"
    block_r = _block_r(shape.max_rank)
    assert shrunk.shape == (table.row_ids.numel(), shape.num_parts, block_r) and shrunk.dtype == torch.float32
    num_n_tiles = triton.cdiv(shape.max_width, block_n)
    grid = (table.segments.shape[0], triton.cdiv(table.max_segment_rows, block_m), shape.num_parts * num_n_tiles)
    _lora_expand_kernel[grid](
        y, shrunk, table.row_ids, table.segments, table.weights,
        layer, product, shape.num_parts, num_n_tiles, y.stride(0),
        NUM_PRODUCTS_=NUM_PRODUCTS,
        WEIGHT_COLUMNS_=WEIGHT_COLUMNS,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
    )
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, table: LoraStepTable, layer: int, product: int, *,
             blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y [rows, out] += each segment's LoRA of product `product` in layer `layer` of x [rows, in] over
    its rows; in place, returns y. blocks: (BLOCK_M, BLOCK_K, BLOCK_N), None picks them."""
    if table.shapes[product].num_parts == 0:
        return y
    block_m, block_k, block_n = blocks or _choose_blocks(table.max_segment_rows, x.dtype)
    shrunk = lora_shrink(x, table, layer, product, block_m=block_m, block_k=block_k)
    return lora_expand(y, shrunk, table, layer, product, block_m=block_m, block_n=block_n)
