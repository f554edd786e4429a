"""Products with GGUF-quantized weights read in their own blocks (csrc/gguf_gemm.c), from Python.

    y = gguf_gemm(x, weight, bias)                      # x [rows, in] fp32/bf16 -> [rows, out] in x's dtype
    logits = gguf_gemm(hidden, lm_head, out_dtype=torch.float32)

The kernel dequantizes each block in registers inside the dot products (never to memory) and
splits the output columns over our thread pool; a tile of up to 4 rows of x shares each weight
block's read and decode. Types: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.

A model's Q4_0 and Q4_1 layer weights are repacked at load, eight rows at a time
(gguf_weight.pack_columns, PACK_WEIGHTS): the int8 kernel then keeps eight output columns in the
lanes of one vector and multiplies four of their weights by four bytes of x per instruction, with
no horizontal sums. Against the file's layout, 2 threads, SmolLM2's Q4_1 shapes streamed from
memory (`bench.bench_gguf --threads 2 --rows 1,16,64,256 --repeats 5 --min-mb 32`, one run):
0.79-0.99x the time at 1 row, 0.50-0.66x at 16, 0.44-0.58x at 64 and 0.45-0.54x at 256. That is
0.28-0.53x the dense fp32 panels' time at 1 row, 0.70-0.83x at 16 and 0.58-1.18x at 256, so a
packed weight's int8 prompt step stays on it (goes_dense). A Q8_0 lm_head (and the tied
embedding's lookups) is packed too: its fp32 mode's product took 0.60-0.72x the file layout's
time at 1 to 64 rows, and the int16 mode an lm_head runs (logits_mode) is packed only.

Three modes (csrc/gguf_gemm.c says how each works):
  "fp32": x in fp32 against weights widened in registers; error: fp32 rounding (~1e-6 relative).
  "int8": x quantized once per call to int8 per 32-block with an fp32 scale (llama.cpp's
          activations), integer dot products; error: x's rounding to 8 bits, a few 1e-3 of the
          output's scale (each output within sum_k |w| s_block / 2, the bound that rounding
          allows: tests/workers/test_gguf_kernels.py).
  "int16": packed Q8_0 only (an lm_head, logits_mode): x quantized to int16 per 32-block; error:
          x's rounding to 16 bits (the same bound with 32767 for 127).
DEFAULT_MODE is "int8", chosen by `bench.bench_gguf --threads 1 --repeats 15` at SmolLM2's shapes
(an AVX2 EPYC shared with other work, so absolute times are noisy; ratios from one run, each
path's weights streamed from memory, the paths alternating):

    shape (out x in, type)   int8 / fp32 mode     int8 / dense fp32 panels
                             1 row    16 rows     1 row    16 rows
    576x576 Q4_1             0.57     0.73        0.51     1.32
    192x576 Q4_1             0.67     0.80        0.69     1.46
    1536x576 Q4_1            0.50     0.82        0.49     1.75
    576x1536 Q4_1            0.55     0.61        0.63     1.28
    49152x576 Q8_0           0.55     0.63        0.60     1.46

(An earlier, quieter run of the first version gave 0.59-0.73 at 1 row and 0.77-0.86 at 16.)
Both modes are bound by arithmetic, not memory, even at one row (int8 reads Q4_1 blocks at 3-6
GB/s, where the dense panels stream fp32 at 9-14 in the same run): widening a block to fp32
costs more instructions than the FMAs it feeds, where int8 does four products per instruction.
At 16 rows the dense fp32 panels (8x the bytes of Q4_1, but one FMA per weight and row and no
decode) are still 1.3-1.75x faster than int8: a GGUF model's prefill pays for its smaller
weights there.
"""

from __future__ import annotations

import threading

import torch

from workers.gguf_weight import LAYER_PACKED_TYPES, GGMLType, GgufWeight
from workers.kernels.cpu_isa import cpu_plan
from workers.kernels.native import DTYPE_CODES, check_status, native_available, native_library

NATIVE_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
GGUF_MODES = {"fp32": 0, "int8": 1, "int16": 2}  # the mode argument of rayllm_gguf_gemm (csrc/entry_points.h)
DEFAULT_MODE = "int8"
# The lm_head never rounds its input to 8 bits: rounding the last hidden state to int8 moves every
# one of the vocabulary's logits, and where the top two are close that flips the argmax. On the
# default model (`bench.gguf_accuracy --sequences 10`, the positions llama.cpp's perplexity tool
# scores), top-1 agreement with the dequantized fp32 model is 0.964 with an int8 lm_head and 0.973
# with fp32 activations, where llama.cpp's own Q4_1 gets 0.969. A packed Q8_0 lm_head (the default
# model's) rounds it to 16 bits instead (int16 per 32-block, 1/65534 of each block's largest value:
# its logits are the fp32 mode's to about 1e-5 of their scale) and multiplies with exact integer
# pair sums: 0.73x the packed fp32 mode's time at one row and 0.56x at 16 (49152 x 576 streamed
# from memory, 2 threads: `bench.bench_gguf --threads 2 --rows 1,16`, its lm_head rows). Other
# lm_heads keep the fp32 mode (LOGITS_MODE).
LOGITS_MODE = "fp32"


def logits_mode(weight: GgufWeight) -> str:
    """The mode of a GGUF lm_head's product: int16 for a packed Q8_0 (the only kernel that has it),
    else LOGITS_MODE."""
    return "int16" if weight.packed and weight.ggml_type == GGMLType.Q8_0 else LOGITS_MODE


# A product of at least this many rows (a prompt step) dequantizes the weight to fp32 with our
# kernel, into a reused buffer, and runs the dense fp32 GEMM (F.linear). At SmolLM2's Q4_1 shapes
# and the Q8_0 lm_head, 2 threads, weights streamed from memory, that path against the int8
# kernel takes 1.4-2.5x the time at 64 rows, 1.0-1.5x at 128 and 0.73-0.87x at 256 (1.22x for
# the small 192x576, which the model fuses into qkv) (`bench.bench_gguf --threads 2 --rows
# 64,128,256 --repeats 5 --min-mb 32`). Those rows are then exact (fp32 products), like LOGITS_MODE's.
DENSE_MIN_ROWS = 256
PACK_WEIGHTS = True  # layers' Q4_0 and Q4_1 and a Q8_0 lm_head repacked at load (gguf_weight.pack_for_kernels)
GGUF_PACKED = 0x100  # the type code's flag for a packed weight (csrc/entry_points.h)


def type_code(weight: GgufWeight) -> int:
    """The kernels' ggml_type argument: the type, with GGUF_PACKED for a packed weight."""
    return int(weight.ggml_type) | (GGUF_PACKED if weight.packed else 0)


def goes_dense(weight: GgufWeight, num_rows: int, mode: str | None = None) -> bool:
    """A product of this many rows (a prompt step: DENSE_MIN_ROWS or more) runs as the dense fp32
    GEMM on the weight dequantized, not as our kernel; except a packed weight's int8 product, the
    faster at any number of rows. (A packed Q8_0 lm_head's fp32 product at 256 rows took 216 ms
    against 146 ms dequantized, 2 threads: it goes dense.)"""
    return num_rows >= DENSE_MIN_ROWS and not (weight.packed and (mode or DEFAULT_MODE) == "int8"
                                               and weight.ggml_type in LAYER_PACKED_TYPES)


def tiles_take(weight: GgufWeight, num_rows: int, mode: str | None = None) -> bool:
    """A layer's product of this many rows runs on AMX tiles (cpu_isa's table): its blocks are
    dequantized to bf16 a group of 32 columns at a time and x is rounded to bf16 (amx.c). Not a
    product with an explicit mode other than int8: an lm_head's logits keep their mode."""
    return (mode or DEFAULT_MODE) == "int8" and cpu_plan().tiles_take("gguf", num_rows)


def amx_gemm(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, library=None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias) on AMX tiles (csrc/amx.c): x and the weights rounded to bf16,
    fp32 sums. The caller has checked tiles_take."""
    return _tile_product("rayllm_amx_gguf_gemm", x, weight, bias, out_dtype, library)


def _tile_product(entry: str, x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None, library) -> torch.Tensor:
    """A tile entry point's product: rayllm_amx_gguf_gemm, _int8_gemm and _int16_gemm take the same arguments."""
    library = library or native_library()
    out_dtype = out_dtype or x.dtype
    x = x.contiguous()
    num_rows, width = x.shape
    if width != weight.in_features:
        raise ValueError(f"x has {width} features, the {weight.ggml_type.name} weight takes {weight.in_features}")
    out = torch.empty(num_rows, weight.out_features, dtype=out_dtype)
    if num_rows == 0:
        return out
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    check_status(getattr(library, entry)(
        x.data_ptr(), weight.blocks.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows,
        weight.out_features, width, type_code(weight), DTYPE_CODES[x.dtype], DTYPE_CODES[out_dtype],
        torch.get_num_threads(),
    ), entry)
    return out


def amx_gated_gemm(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None, activation: str,
                   library=None) -> torch.Tensor | None:
    """act(gate) * up of x's product with a gate_up weight ([2 width, in], width a multiple of 32) on
    AMX tiles (csrc/amx.c), in x's dtype: amx_gemm's product, then NativeOps.gated_mul, bit for bit.
    None where the activation or the width does not fit."""
    from workers.kernels.native import ACTIVATION_CODES
    from workers.layer_ops import SWIGLU_ALPHA, SWIGLU_LIMIT

    width = weight.out_features // 2
    if activation not in ACTIVATION_CODES or weight.out_features % 64:
        return None
    library = library or native_library()
    x = x.contiguous()
    out = torch.empty(x.shape[0], width, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    check_status(library.rayllm_amx_gguf_gated_gemm(
        x.data_ptr(), weight.blocks.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
        width, x.shape[1], type_code(weight), DTYPE_CODES[x.dtype], ACTIVATION_CODES[activation], SWIGLU_ALPHA,
        SWIGLU_LIMIT, torch.get_num_threads(),
    ), "rayllm_amx_gguf_gated_gemm")
    return out


INT8_TILES_MAX_ROWS = 512  # rows of an int8 tile product at most (csrc/gguf_amx.c: its sums per thread)


def amx_int8_gemm(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, library=None) -> torch.Tensor:
    """The int8 mode's product (gguf_gemm(mode="int8")) of a packed Q4_0 or Q4_1 weight, bit for bit,
    on AMX int8 tiles (csrc/gguf_amx.c). The caller has checked int8_tiles_take."""
    return _tile_product("rayllm_amx_gguf_int8_gemm", x, weight, bias, out_dtype, library)


def int8_tiles_take(weight: GgufWeight, num_rows: int, mode: str | None = None) -> bool:
    """A layer's int8 product of this many rows runs on AMX int8 tiles (cpu_isa's table, "gguf_int8"):
    packed Q4_0 and Q4_1 only, 16 columns at a time, and below the rows the bf16 tiles take."""
    return ((mode or DEFAULT_MODE) == "int8" and weight.packed and weight.ggml_type in LAYER_PACKED_TYPES
            and weight.out_features % 16 == 0 and num_rows <= INT8_TILES_MAX_ROWS
            and cpu_plan().tiles_take("gguf_int8", num_rows) and not cpu_plan().tiles_take("gguf", num_rows))


def amx_int16_gemm(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, library=None) -> torch.Tensor:
    """The int16 mode's product (gguf_gemm(mode="int16")) of a packed Q8_0 weight (an lm_head), bit
    for bit, on AMX int8 tiles (csrc/gguf_amx.c). The caller has checked int16_tiles_take."""
    return _tile_product("rayllm_amx_gguf_int16_gemm", x, weight, bias, out_dtype, library)


def int16_tiles_take(weight: GgufWeight, num_rows: int, mode: str | None = None) -> bool:
    """An lm_head's int16 product of this many rows runs on AMX int8 tiles (cpu_isa's table,
    "gguf_int16"): a packed Q8_0, 16 columns at a time."""
    return (mode == "int16" and weight.packed and weight.ggml_type == GGMLType.Q8_0
            and weight.out_features % 16 == 0 and num_rows <= INT8_TILES_MAX_ROWS
            and cpu_plan().tiles_take("gguf_int16", num_rows))


def native_has(weight: GgufWeight) -> bool:
    """Our kernels read this weight: a type they have, blocks on the CPU, a built library."""
    return weight.ggml_type in NATIVE_TYPES and weight.blocks.device.type == "cpu" and native_available()


def native_takes(x: torch.Tensor, weight: GgufWeight) -> bool:
    """Our kernel computes this product: a CPU x in fp32 or bf16, and a weight it reads (native_has)."""
    return x.device.type == "cpu" and x.dtype in DTYPE_CODES and native_has(weight)


def gguf_gemm(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, mode: str | None = None, library=None) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias) -> [rows, out] in out_dtype (default: x's dtype).
    mode: "fp32", "int8" or "int16" (None: DEFAULT_MODE, read at each call, as the C layer loop does).
    library: another build of the kernels (tests run an AVX2 build beside the native one)."""
    mode = mode or DEFAULT_MODE
    library = library or native_library()
    out_dtype = out_dtype or x.dtype
    x = x.contiguous()
    num_rows, width = x.shape
    if width != weight.in_features:
        raise ValueError(f"x has {width} features, the {weight.ggml_type.name} weight takes {weight.in_features}")
    assert weight.ggml_type in NATIVE_TYPES
    blocks = weight.blocks.contiguous()
    out = torch.empty(num_rows, weight.out_features, dtype=out_dtype)
    if num_rows == 0:
        return out
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    check_status(library.rayllm_gguf_gemm(
        x.data_ptr(), blocks.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows,
        weight.out_features, width, type_code(weight), DTYPE_CODES[x.dtype], DTYPE_CODES[out_dtype],
        GGUF_MODES[mode], torch.get_num_threads(),
    ), "rayllm_gguf_gemm")
    return out


_scratch = threading.local()  # each thread's buffer for gguf_dequantize(scratch=True)


def gguf_dequantize(weight: GgufWeight, scratch: bool = False, index: torch.Tensor | None = None,
                    library=None) -> torch.Tensor:
    """The weight's values [out, in] in fp32, dequantized by our kernel on the thread pool: the
    values the fp32 mode multiplies by. index: only these rows, [len(index), in] (an embedding
    lookup; a packed weight's rows are unpacked one by one). scratch: into this thread's reused
    buffer, valid until the thread's next such call (a fresh buffer of a few MB per product costs
    its page faults)."""
    library = library or native_library()
    assert weight.ggml_type in NATIVE_TYPES
    blocks = weight.blocks.contiguous()
    if index is not None:
        index = index.to(torch.int64).contiguous()
    num_out = weight.out_features if index is None else index.numel()
    size = num_out * weight.in_features
    if scratch:
        if getattr(_scratch, "buffer", None) is None or _scratch.buffer.numel() < size:
            _scratch.buffer = torch.empty(size, dtype=torch.float32)
        out = _scratch.buffer[:size].view(num_out, weight.in_features)
    else:
        out = torch.empty(num_out, weight.in_features, dtype=torch.float32)
    if num_out == 0:
        return out
    check_status(library.rayllm_gguf_dequantize(
        blocks.data_ptr(), None if index is None else index.data_ptr(), num_out, out.data_ptr(), weight.out_features,
        weight.in_features, type_code(weight), torch.get_num_threads(),
    ), "rayllm_gguf_dequantize")
    return out
