"""A projection weight kept in a GGUF quantization type, row by row as the file holds it.

A GGUF tensor of type Q4_1 (for example) stores each output row as blocks: 32 weights in 20
bytes (an fp16 scale, an fp16 minimum, 16 bytes of 4-bit values). GgufWeight keeps exactly those
bytes, [out_features, bytes_per_row] uint8, so a product reads the file's 4.5 bits per weight
instead of a dequantized copy's 16 or 32.

    weight = GgufWeight(GGMLType.Q4_1, out_features=576, in_features=576, blocks=row_bytes)
    y = gguf_linear(x, weight, bias)         # x [rows, in] -> [rows, out], in x's dtype
    full = dequantize(weight)                # fp32 [out, in]: the reference, and dtype float32's path

gguf_linear runs our C kernels where they are built for this type (workers/kernels/gguf.py),
else this file's reference (dequantize, then F.linear), which is exact and slow.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from workers.huge_pages import HugeArena
    from workers.kernels.native import NativeOperand


class GGMLType(enum.IntEnum):
    """ggml's type codes (the numbers in a GGUF file) of the types we serve."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# (weights per block, bytes per block) of each quantized type, as ggml defines them
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}
QUANTIZED_TYPES = tuple(BLOCK_LAYOUT)


def row_bytes(ggml_type: GGMLType, in_features: int) -> int:
    per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
    if in_features % per_block:
        raise ValueError(f"a {ggml_type.name} row of {in_features} weights is not a whole number of "
                         f"{per_block}-weight blocks")
    return in_features // per_block * block_bytes


@dataclass(frozen=True, slots=True)
class GgufWeight:
    ggml_type: GGMLType
    out_features: int
    in_features: int
    blocks: torch.Tensor  # uint8 [out_features, row_bytes(ggml_type, in_features)], contiguous
    packed: bool = False  # the bytes permuted eight rows at a time (pack_columns), else the file's layout

    def __post_init__(self) -> None:
        expected = (self.out_features, row_bytes(self.ggml_type, self.in_features))
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(f"{self.ggml_type.name} weight [{self.out_features}, {self.in_features}] needs uint8 "
                             f"blocks of shape {expected}, got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def label(self) -> str:
        return f"GGUF {self.ggml_type.name}"

    # The linear-weight interface (workers/linear.py, LinearWeight), the same on every backend.

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return gguf_linear(x, self, bias, out_dtype=out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_logits(x, self)

    def gated_product(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor | None:
        return gguf_gated_product(x, self, bias, activation)

    def native_operand(self) -> NativeOperand | None:
        """The C layer loop's view of this weight (workers/kernels/native.py, NativeOperand): its
        blocks in its own type, any dense kind beside it; None where our kernels lack the type. A
        prompt step whose product goes dense (gguf.goes_dense) is the Python loop's, unless such
        steps run on tiles."""
        from workers.kernels import gguf
        from workers.kernels.native import NativeOperand

        if not gguf.native_has(self):
            return None
        dense_prompts = gguf.goes_dense(self, gguf.DENSE_MIN_ROWS) and not gguf.tiles_take(self, gguf.DENSE_MIN_ROWS)
        max_rows = gguf.DENSE_MIN_ROWS - 1 if dense_prompts else None
        return NativeOperand(self.blocks, gguf.type_code(self), None, max_rows)

    # What the model's loading asks of a checkpoint's weight (workers/model.py).

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """An embedding lookup: the rows' values in fp32 (dequantize_rows)."""
        return dequantize_rows(self, index)

    def for_kernels(self, logits: bool = False) -> GgufWeight:
        return pack_for_kernels(self, logits)

    def placed_in(self, arena: HugeArena) -> GgufWeight:
        """The weight with its blocks copied into arena (a HugeArena: 2 MB pages, which the kernels stream)."""
        return dataclasses.replace(self, blocks=arena.copy(self.blocks))

    def stacked(self, parts: list) -> GgufWeight | None:
        """parts' rows one after another (q, k, v -> qkv) in their one GGUF type; None where they
        are not all GGUF weights of one type."""
        if not all(isinstance(p, GgufWeight) and p.ggml_type == self.ggml_type for p in parts):
            return None
        return concat_rows(parts)

    def rows(self, index: torch.Tensor | slice) -> GgufWeight:
        """The weight of the chosen output rows (a permutation, a slice) in the same type, in the
        file's layout (of a packed weight, only the groups of 8 holding them are unpacked: an
        embedding lookup's few rows of a packed tied lm_head)."""
        if not self.packed:
            blocks = self.blocks[index].contiguous()
            return GgufWeight(self.ggml_type, blocks.shape[0], self.in_features, blocks)
        index = torch.arange(self.out_features)[index]
        groups, inverse = torch.unique(index // PACKED_ROWS, return_inverse=True)
        picked = self.blocks.view(self.out_features // PACKED_ROWS, -1)[groups].view(len(groups) * PACKED_ROWS, -1)
        file_rows = unpack_columns(GgufWeight(self.ggml_type, picked.shape[0], self.in_features, picked, packed=True))
        blocks = file_rows.blocks[inverse * PACKED_ROWS + index % PACKED_ROWS].contiguous()
        return GgufWeight(self.ggml_type, blocks.shape[0], self.in_features, blocks)


def concat_rows(weights: list[GgufWeight]) -> GgufWeight:
    """One weight whose rows are each weight's rows in turn (q, k, v -> qkv); one type and width."""
    first = weights[0]
    if any(w.ggml_type != first.ggml_type or w.in_features != first.in_features for w in weights):
        raise ValueError("fused GGUF weights must share one type and input width, got "
                         + ", ".join(f"{w.ggml_type.name}[{w.out_features}, {w.in_features}]" for w in weights))
    blocks = torch.cat([unpack_columns(w).blocks for w in weights]).contiguous()
    return GgufWeight(first.ggml_type, blocks.shape[0], first.in_features, blocks)


# Types our kernels read faster repacked eight output rows at a time (csrc/gguf_gemm.c says how):
# Q4_0 and Q4_1 layers, whose int8 product then keeps eight rows' sums in the lanes of one vector,
# and a Q8_0 lm_head (or tied embedding), whose int16 product (gguf.logits_mode) does the same.
# Timings against the file's layout: workers/kernels/gguf.py.
PACKABLE_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0)
LAYER_PACKED_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1)
LOGITS_PACKED_TYPES = (GGMLType.Q8_0,)
PACKED_ROWS = 8


def _packed_parts(ggml_type: GGMLType) -> list[tuple[int, int, int]]:
    """A block's parts as (start, size, piece) in the file's layout: each part is permuted so
    that `piece` bytes of each of the 8 rows follow one another (see pack_columns)."""
    if ggml_type == GGMLType.Q8_0:
        return [(0, 2, 2), (2, 32, 1)]
    if ggml_type == GGMLType.Q4_1:
        return [(0, 2, 2), (2, 2, 2), (4, 16, 4)]
    return [(0, 2, 2), (2, 16, 4)]


def pack_columns(weight: GgufWeight) -> GgufWeight:
    """The same bytes permuted for the packed kernels: for each group of 8 rows and each block,
    the 8 rows' fp16 scales, then (Q4_1) their minimums, then their values: Q4_0 and Q4_1 in
    four 4-byte pieces (piece t: bytes 4t..4t+3 of each row in turn), Q8_0 byte by byte (weight k
    of each row in turn). Exact: unpack_columns undoes it."""
    if weight.packed:
        return weight
    if weight.ggml_type not in PACKABLE_TYPES or weight.out_features % PACKED_ROWS:
        raise ValueError(f"only Q4_0, Q4_1 and Q8_0 weights of a multiple of {PACKED_ROWS} rows are packed, "
                         f"not {weight.ggml_type.name} [{weight.out_features}, {weight.in_features}]")
    groups, num_blocks = weight.out_features // PACKED_ROWS, weight.in_features // 32
    blocks = weight.blocks.view(groups, PACKED_ROWS, num_blocks, -1)  # [group, row, block, bytes]
    parts = []
    for start, size, piece in _packed_parts(weight.ggml_type):
        part = blocks[..., start:start + size].reshape(groups, PACKED_ROWS, num_blocks, size // piece, piece)
        parts.append(part.permute(0, 2, 3, 1, 4).reshape(groups, num_blocks, PACKED_ROWS * size))
    packed = torch.cat(parts, dim=-1)
    return GgufWeight(weight.ggml_type, weight.out_features, weight.in_features,
                      packed.reshape(weight.out_features, -1).contiguous(), packed=True)


def unpack_columns(weight: GgufWeight) -> GgufWeight:
    """The weight in the file's layout (itself where it is)."""
    if not weight.packed:
        return weight
    groups, num_blocks = weight.out_features // PACKED_ROWS, weight.in_features // 32
    packed = weight.blocks.view(groups, num_blocks, -1)  # [group, block, 8 rows' blocks]
    parts = []
    for start, size, piece in _packed_parts(weight.ggml_type):
        part = packed[..., PACKED_ROWS * start:PACKED_ROWS * (start + size)]
        part = part.reshape(groups, num_blocks, size // piece, PACKED_ROWS, piece).permute(0, 3, 1, 2, 4)
        parts.append(part.reshape(groups, PACKED_ROWS, num_blocks, size))
    rows = torch.cat(parts, dim=-1)
    return GgufWeight(weight.ggml_type, weight.out_features, weight.in_features,
                      rows.reshape(weight.out_features, -1).contiguous())


def pack_for_kernels(weight: GgufWeight, logits: bool = False) -> GgufWeight:
    """The weight as our kernels read it fastest: a layer's projection (or, logits=True, the
    lm_head) packed where its type and rows allow and the kernels are ours (not a GPU's, not the
    reference's), else as it is."""
    from workers.kernels import gguf

    types = LOGITS_PACKED_TYPES if logits else LAYER_PACKED_TYPES
    if (weight.ggml_type in types and weight.out_features % PACKED_ROWS == 0 and gguf.native_has(weight)
            and gguf.PACK_WEIGHTS):
        return pack_columns(weight)
    return weight


def dequantize(weight: GgufWeight) -> torch.Tensor:
    """fp32 [out, in]: the gguf package's own dequantization of the blocks (the reference)."""
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(unpack_columns(weight).blocks.numpy(), GGMLQuantizationType(int(weight.ggml_type)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(weight.shape)


def dequantize_rows(weight: GgufWeight, index: torch.Tensor) -> torch.Tensor:
    """The chosen rows' values [len(index), in] in fp32 (an embedding lookup): our kernel where it
    takes the type, else the gguf package. Both give the same values: every scale times a
    quantized integer is exact in fp32 (an fp16 scale's 11 bits times at most 8), so the one
    rounding left, of the sum with the offset, is the same in both."""
    from workers.kernels import gguf

    if gguf.native_has(weight):
        return gguf.gguf_dequantize(weight, index=index)
    return dequantize(weight.rows(index))


def reference_linear(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(weight).T (+ bias) in fp32, returned in x's dtype."""
    out = F.linear(x.float(), dequantize(weight), None if bias is None else bias.float())
    return out.to(x.dtype)


def gguf_linear(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, mode: str | None = None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias) -> [rows, out] in out_dtype (default: x's dtype; logits: fp32).
    mode: the kernel's activation mode (workers/kernels/gguf.py; None: its DEFAULT_MODE)."""
    from workers.kernels import gguf  # imported here: it imports this module's types

    if gguf.native_takes(x, weight):
        if gguf.tiles_take(weight, x.shape[0], mode):
            return gguf.amx_gemm(x, weight, bias, out_dtype=out_dtype)
        if gguf.int8_tiles_take(weight, x.shape[0], mode):
            return gguf.amx_int8_gemm(x, weight, bias, out_dtype=out_dtype)
        if gguf.int16_tiles_take(weight, x.shape[0], mode):
            return gguf.amx_int16_gemm(x, weight, bias, out_dtype=out_dtype)
        if gguf.goes_dense(weight, x.shape[0], mode):  # a prompt step: dense fp32 on the weight dequantized
            out = F.linear(x.float(), gguf.gguf_dequantize(weight, scratch=True), None if bias is None else bias.float())
            return out.to(out_dtype or x.dtype)
        return gguf.gguf_gemm(x, weight, bias, out_dtype=out_dtype, mode=mode)
    out = reference_linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def gguf_gated_product(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None,
                       activation: str) -> torch.Tensor | None:
    """act(gate) * up of a GGUF gate_up product in one pass on AMX tiles where they take it (the
    product's bits, then NativeOps.gated_mul's), else None."""
    from workers.kernels import gguf

    if not (gguf.native_takes(x, weight) and gguf.tiles_take(weight, x.shape[0])):
        return None
    return gguf.amx_gated_gemm(x, weight, bias, activation)


def gguf_logits(x: torch.Tensor, weight: GgufWeight) -> torch.Tensor:
    """fp32 logits of x through a GGUF lm_head, with x never rounded to 8 bits (workers/kernels/gguf.py's
    logits_mode says why)."""
    from workers.kernels import gguf

    return gguf_linear(x, weight, out_dtype=torch.float32, mode=gguf.logits_mode(weight))
