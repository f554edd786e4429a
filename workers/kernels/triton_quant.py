"""Linear layers over quantized weights in Triton: the weight stays packed in memory and each
tile is dequantized inside the GEMM (the kernel-ready weights of workers/quant_formats.py).

    y = quant_linear(x, weight)     # x [..., K] fp16/bf16/fp32; weight Int4Weight | Fp8Weight |
                                    # Mxfp4Weight | a dense [N, K] tensor -> [..., N] in x's dtype

Kernels, each program one (BLOCK_M, BLOCK_N) tile of y, fp32 accumulation over K in BLOCK_K steps:

  _int4_gemm_kernel (AWQ, GPTQ)   w[k, n] = (q[k, n] - z[g, n] - ZERO_OFFSET) * s[g, n], read per tile
      from the packed int32 words (AWQ: 8 output columns a word, nibble (j % 2) * 4 + j // 2 for
      column j of 8; GPTQ: 8 input rows a word, nibble k % 8; zeros: AWQ's order / sequential).
      g = k // GROUP_SIZE, or g_idx[k] for act-order GPTQ. With PACKED_LOADS each word is loaded
      once and its 8 nibbles unpacked in registers (a [.., 8, ..] tile reshaped); otherwise each
      weight loads its word (8 loads of one word, which Triton stages through shared memory).
      BLOCK_M 1 (the 4-bit and MXFP4 GEMMs): a program per row, its products accumulated in fp32
      registers [BLOCK_K, BLOCK_N] and summed over K once at the end, without tl.dot (whose
      operands a 16-row tile must pass through shared memory). When a K tile lies inside one group
      (GROUP_SIZE % BLOCK_K == 0, no g_idx) the tile's dot runs on the integers q - z (exact in
      fp16/bf16) and the group's scale multiplies the partial sum in fp32; otherwise each weight
      is scaled in fp32 before the dot.
  _mxfp4_gemm_kernel   w[k, n] = e2m1(nibble k % 2 of byte k // 2 of row n) * 2 ** (e8m0[n, k // 32] - 127),
      decoded with integer ops (exact), then one dot in x's dtype.
  _moe_mxfp4_gemm_kernel   triton_moe's grouped GEMM (pairs sorted by expert, align_pairs) with
      stacked MXFP4 experts [E, N, K / 2] decoded the same way, plus an expert bias (gpt-oss).
  _quantize_fp8_kernel (w8a8)   per token: scale = max(min(amax, UB), eps) / 448,
      q = clamp(x / scale, +-448) as float8_e4m3fn.
  _fp8_gemm_kernel   y = (a @ w.T) * a_scale[m] * w_scale[n]: fp8 operands read as bytes and
      decoded to fp16 exactly (bits << 7, times 2 ** 8), so it runs on any GPU; a may also be
      x itself (weight-only fp8: a_scale = 1).

FP8 dispatch (uses_scaled_mm): on sm_89/sm_90 with bf16 x and K, N multiples of 16, tokens are
quantized by _quantize_fp8_kernel and multiplied by torch._scaled_mm (row-wise scales); otherwise
_fp8_gemm_kernel multiplies, after _quantize_fp8_kernel on sm_89+ or torch's quantizer below it
(Triton has no fp32 -> e4m3 cast before sm_89).

Tile sizes: _choose_blocks, measured on an H200 (bench/tune_quant_gpu.py).
Split-K (the 4-bit and MXFP4 GEMMs): a decode's few output tiles (1024 / 64 = 16 for a k/v
projection) would leave most SMs idle, so up to 16 rows several programs share one tile, each
taking every SPLIT_K-th K tile, and add into an fp32 output atomically (then cast to x's
dtype); _choose_split_k aims at twice the SM count. On an H200 it makes a Llama-3.1-8B layer
at batch 1 2.9x (AWQ) and 2.4x (MXFP4) faster than split-K 1 (bench/bench_quant_gpu.py's
"-nosplit" formats).
Nothing reads a tensor on the host, so every entry can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from workers.quant_formats import FP8_MAX, Fp8Weight, Int4Weight, Mxfp4Weight

__all__ = ["fp8_gemm", "int4_gemm", "moe_mxfp4_gemm", "mxfp4_gemm", "quant_linear", "quantize_fp8_per_token",
           "quantize_fp8_reference"]

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # the smallest per-token scale (an all-zero row still divides)


@triton.jit
def _write_tile(c_ptr, acc, bias_ptr, offs_m, offs_n, m_valid, n_valid, stride_cm, pid_k,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc (+ bias, once) into c: stored, or atomically added into fp32 c when SPLIT_K > 1."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]  # one share of a split tile adds it
    ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
    else:
        tl.atomic_add(ptrs, acc, mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _int4_gemm_kernel(
    c_ptr,  # [M, N] in a's dtype
    a_ptr,  # [M, K]
    qweight_ptr,  # int32: AWQ [K, N / 8]; GPTQ [K / 8, N]
    qzeros_ptr,  # int32 [num_groups, N / 8]
    scales_ptr,  # [num_groups, N]
    g_idx_ptr,  # int32 [K] (HAS_G_IDX; any pointer otherwise)
    bias_ptr,  # [N] (HAS_BIAS; any pointer otherwise)
    M, N, K,  # ints
    stride_am,  # a.stride(0), elements
    stride_cm,  # c.stride(0)
    GROUP_SIZE: tl.constexpr,  # inputs per group
    ZERO_OFFSET: tl.constexpr,  # added to every stored zero (GPTQ v1: 1)
    AWQ: tl.constexpr,  # AWQ's layout, else GPTQ's
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs sharing one output tile (> 1: c is fp32, added into atomically)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_LOADS: tl.constexpr,  # load each packed word once and unpack its 8 nibbles in registers
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # this program's share of K: tiles pid_k, pid_k + SPLIT_K, ...
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    packed_n = N // 8
    nibbles = tl.arange(0, 8)
    word_cols = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # PACKED_LOADS, AWQ: words along N
    word_rows = tl.arange(0, BLOCK_K // 8)  # PACKED_LOADS, GPTQ: words along K
    awq_shift = ((nibbles % 2) * 4 + nibbles // 2) * 4  # AWQ packs columns 0 2 4 6 1 3 5 7 into nibbles 0..7
    j = offs_n % 8
    if AWQ:
        zero_shift = ((j % 2) * 4 + j // 2) * 4  # awq_shift of column j
    else:
        zero_shift = j * 4
    ONE_GROUP: tl.constexpr = (GROUP_SIZE % BLOCK_K == 0) and (not HAS_G_IDX)
    GEMV: tl.constexpr = BLOCK_M == 1  # one row: products in fp32 registers, summed over K at the end (no tl.dot)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partial = tl.zeros([BLOCK_K if GEMV else 1, BLOCK_N], dtype=tl.float32)  # GEMV's running products
    for k_start in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k_start + offs_k
        k_valid = ks < K
        w_mask = k_valid[:, None] & n_valid[None, :]
        if GEMV:
            x = tl.load(a_ptr + pid_m * stride_am + ks, mask=k_valid, other=0.0).to(tl.float32)  # pid_m < M
        else:
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :],
                        mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        if PACKED_LOADS and AWQ:  # [BLOCK_K, BLOCK_N / 8] words -> [BLOCK_K, BLOCK_N / 8, 8] -> [BLOCK_K, BLOCK_N]
            words = tl.load(qweight_ptr + ks[:, None] * packed_n + word_cols[None, :],
                            mask=k_valid[:, None] & (word_cols < packed_n)[None, :], other=0)
            q = tl.reshape((words[:, :, None] >> awq_shift[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        elif PACKED_LOADS:  # [BLOCK_K / 8, BLOCK_N] words -> [BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]
            rows = k_start // 8 + word_rows
            words = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :],
                            mask=(rows < K // 8)[:, None] & n_valid[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> (nibbles * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        elif AWQ:
            words = tl.load(qweight_ptr + ks[:, None] * packed_n + (offs_n // 8)[None, :], mask=w_mask, other=0)
            q = (words >> zero_shift[None, :]) & 0xF
        else:
            words = tl.load(qweight_ptr + (ks // 8)[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
            q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
        if ONE_GROUP:
            g = k_start // GROUP_SIZE
            zeros = (tl.load(qzeros_ptr + g * packed_n + offs_n // 8, mask=n_valid, other=0) >> zero_shift) & 0xF
            scales = tl.load(scales_ptr + g * N + offs_n, mask=n_valid, other=0.0).to(tl.float32)
            if GEMV:
                partial += x[:, None] * ((q - zeros[None, :] - ZERO_OFFSET).to(tl.float32) * scales[None, :])
            else:
                w = (q - zeros[None, :] - ZERO_OFFSET).to(tl.float32).to(a.dtype)  # integers in [-16, 15]: exact
                acc += tl.dot(a, w, input_precision=DOT_PRECISION) * scales[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + ks, mask=k_valid, other=0)
            else:
                g = ks // GROUP_SIZE
            zeros = (tl.load(qzeros_ptr + g[:, None] * packed_n + (offs_n // 8)[None, :], mask=w_mask, other=0)
                     >> zero_shift[None, :]) & 0xF
            scales = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=w_mask, other=0.0).to(tl.float32)
            w = (q - zeros - ZERO_OFFSET).to(tl.float32) * scales
            if GEMV:
                partial += x[:, None] * w
            else:
                acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    if GEMV:
        acc = tl.sum(partial, axis=0)[None, :]
    _write_tile(c_ptr, acc, bias_ptr, offs_m, offs_n, m_valid, n_valid, stride_cm, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def _e2m1_values(nibble):
    """e2m1 nibbles (int32) -> their fp32 values, with integer ops (exact)."""
    exponent = (nibble >> 1) & 3
    mantissa = nibble & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)  # 2 ** (e - 1) * (1 + m / 2) as fp32 bits
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
    return tl.where((nibble & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e8m0_values(scale_byte):
    """e8m0 bytes (int32) -> 2 ** (byte - 127) in fp32."""
    return tl.where(scale_byte == 0, 5.877471754111438e-39,  # 2 ** -127 (a subnormal: no exponent field)
                    (scale_byte << 23).to(tl.float32, bitcast=True))


@triton.jit
def _mxfp4_tile(blocks_ptr, scales_ptr, rows, ks, K, mask):
    """The [BLOCK_K, BLOCK_N] fp32 tile W[rows, ks].T of an MXFP4 weight (blocks [.., K / 2], scales
    [.., K / 32] uint8, rows the output rows counted from the pointers), decoded with integer ops."""
    byte = tl.load(blocks_ptr + rows[None, :] * (K // 2) + (ks // 2)[:, None], mask=mask, other=0)
    nibble = (byte.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
    scale_byte = tl.load(scales_ptr + rows[None, :] * (K // 32) + (ks // 32)[:, None], mask=mask,
                         other=127).to(tl.int32)
    return _e2m1_values(nibble) * _e8m0_values(scale_byte)


@triton.jit
def _mxfp4_tile_packed(blocks_ptr, scales_ptr, rows, k_start, K, n_valid, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """_mxfp4_tile with each byte and scale loaded once: [BLOCK_K / 2, BLOCK_N] bytes unpacked to
    [BLOCK_K / 2, 2, BLOCK_N] nibbles, one scale per 32 of them broadcast the same way."""
    pairs = k_start // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(blocks_ptr + rows[None, :] * (K // 2) + pairs[:, None],
                   mask=(pairs < K // 2)[:, None] & n_valid[None, :], other=0).to(tl.int32)
    nibble = (byte[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF
    values = tl.reshape(_e2m1_values(nibble), (BLOCK_K, BLOCK_N))
    if BLOCK_K <= 32:  # one scale per row of the tile
        scale_byte = tl.load(scales_ptr + rows * (K // 32) + k_start // 32, mask=n_valid, other=127).to(tl.int32)
        return values * _e8m0_values(scale_byte)[None, :]
    groups = k_start // 32 + tl.arange(0, BLOCK_K // 32)
    scale_byte = tl.load(scales_ptr + rows[None, :] * (K // 32) + groups[:, None],
                         mask=(groups < K // 32)[:, None] & n_valid[None, :], other=127).to(tl.int32)
    scales = tl.broadcast_to(_e8m0_values(scale_byte)[:, None, :], (BLOCK_K // 32, 32, BLOCK_N))
    return values * tl.reshape(scales, (BLOCK_K, BLOCK_N))


@triton.jit
def _mxfp4_gemm_kernel(
    c_ptr,  # [M, N] in a's dtype
    a_ptr,  # [M, K]
    blocks_ptr,  # uint8 [N, K / 2]: value 2i in the low nibble of byte i, 2i + 1 in the high one
    scales_ptr,  # uint8 [N, K / 32]: e8m0, bias 127
    bias_ptr,  # [N] (HAS_BIAS)
    M, N, K,
    stride_am,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs sharing one output tile (> 1: c is fp32, added into atomically)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED_LOADS: tl.constexpr,  # _mxfp4_tile_packed (each byte loaded once), else _mxfp4_tile
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # this program's share of K: tiles pid_k, pid_k + SPLIT_K, ...
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    GEMV: tl.constexpr = BLOCK_M == 1  # one row: products in fp32 registers, summed over K at the end (no tl.dot)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partial = tl.zeros([BLOCK_K if GEMV else 1, BLOCK_N], dtype=tl.float32)  # GEMV's running products
    for k_start in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k_start + offs_k
        k_valid = ks < K
        w_mask = k_valid[:, None] & n_valid[None, :]
        if PACKED_LOADS:
            w = _mxfp4_tile_packed(blocks_ptr, scales_ptr, offs_n.to(tl.int64), k_start, K, n_valid, BLOCK_K,
                                   BLOCK_N)
        else:
            w = _mxfp4_tile(blocks_ptr, scales_ptr, offs_n.to(tl.int64), ks, K, w_mask)
        if GEMV:
            x = tl.load(a_ptr + pid_m * stride_am + ks, mask=k_valid, other=0.0).to(tl.float32)  # pid_m < M
            partial += x[:, None] * w
        else:
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :],
                        mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    if GEMV:
        acc = tl.sum(partial, axis=0)[None, :]
    _write_tile(c_ptr, acc, bias_ptr, offs_m, offs_n, m_valid, n_valid, stride_cm, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def _moe_mxfp4_gemm_kernel(
    c_ptr,  # [num_pairs, N]: one output row per (token, slot) pair
    a_ptr,  # [num_a_rows, K]: the rows pairs gather (tokens, or one row per pair)
    blocks_ptr,  # uint8 [E, N, K / 2]
    scales_ptr,  # uint8 [E, N, K / 32]
    bias_ptr,  # [E, N] (HAS_BIAS)
    routing_ptr,  # fp32 [num_pairs] (MUL_ROUTING_WEIGHT)
    sorted_pair_ids_ptr,  # int32 [num_padded_rows]: triton_moe.align_pairs
    tile_expert_ids_ptr,  # int32 [num_padded_rows // BLOCK_M]
    num_post_padded_ptr,  # int32 [1]
    num_pairs, N, K,
    stride_a_row,
    stride_c_row,
    A_ROWS_PER_PAIR_DIVISOR: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """triton_moe._moe_gemm_kernel with MXFP4 expert weights (and an expert bias before the routing weight)."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    if tile_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(tile_expert_ids_ptr + tile_m).to(tl.int64)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    a_row = (pair // A_ROWS_PER_PAIR_DIVISOR).to(tl.int64)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = expert * N + offs_n.to(tl.int64)  # the expert's output rows in the [E * N, ..] stacks
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + offs_k
        k_valid = ks < K
        a = tl.load(a_ptr + a_row[:, None] * stride_a_row + ks[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = _mxfp4_tile(blocks_ptr, scales_ptr, rows, ks, K, k_valid[:, None] & n_valid[None, :])
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTING_WEIGHT:
        acc = acc * tl.load(routing_ptr + pair, mask=row_valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_c_row + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


@triton.jit
def _quantize_fp8_kernel(
    q_ptr,  # float8_e4m3fn [M, K]
    scale_ptr,  # fp32 [M]: each row's scale
    x_ptr,  # [M, K]
    K,
    stride_xm,
    stride_qm,
    scale_ub,  # fp32: cap on a row's amax (HAS_UB)
    HAS_UB: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k_start + offs, mask=k_start + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    row_max = tl.max(amax, axis=0)
    if HAS_UB:
        row_max = tl.minimum(row_max, scale_ub)
    scale = tl.maximum(row_max / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k_start in range(0, K, BLOCK_K):
        mask = k_start + offs < K
        x = tl.load(x_ptr + row * stride_xm + k_start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k_start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_bytes_to_fp16(byte):
    """float8_e4m3fn bit patterns (uint8) -> fp16, exactly: the 7 magnitude bits shifted into
    fp16's exponent and mantissa read 2 ** -8 times the value (subnormals too)."""
    magnitude = ((byte.to(tl.int16) & 0x7F) << 7).to(tl.float16, bitcast=True) * 256.0
    return tl.where((byte & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _fp8_gemm_kernel(
    c_ptr,  # [M, N] out
    a_ptr,  # [M, K]: uint8 (e4m3 bit patterns; A_FP8) or fp16/bf16/fp32
    w_ptr,  # uint8 [N, K]: e4m3 bit patterns
    a_scale_ptr,  # fp32 [M] (A_FP8; any pointer otherwise)
    w_scale_ptr,  # fp32 [N]
    bias_ptr,  # [N] (HAS_BIAS)
    M, N, K,
    stride_am,
    stride_wn,
    stride_cm,
    A_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + offs_k
        k_valid = ks < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :], mask=m_valid[:, None] & k_valid[None, :],
                    other=0)
        w_bytes = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None],
                          mask=k_valid[:, None] & n_valid[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        w = _e4m3_bytes_to_fp16(w_bytes)
        if A_FP8:
            a = _e4m3_bytes_to_fp16(a)
        else:
            w = w.to(a.dtype)  # e4m3 values are exact in bf16 and fp32 too
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc *= tl.load(w_scale_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
    if A_FP8:
        acc *= tl.load(a_scale_ptr + offs_m, mask=m_valid, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_valid[:, None] & n_valid[None, :])


# ----------------------------------------------------------------------------- launchers


class Tiles(NamedTuple):
    """A launch's tile sizes and Triton options; a plain (BLOCK_M, BLOCK_N, BLOCK_K) tuple takes the
    defaults for the rest. Speed only: every choice computes the same products up to rounding (one-row
    tiles scale each weight in fp32, the others round it to x's dtype first; bench/tune_quant_gpu.py
    times them)."""
    block_m: int  # 1: the 4-bit and MXFP4 GEMMs multiply without tl.dot (one row a program)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    packed_loads: bool = False  # the 4-bit and MXFP4 GEMMs: each packed word or byte loaded once


def _tiles(blocks: Tiles | tuple | None, kind: str, m: int, n: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    return Tiles(*blocks) if blocks is not None else _choose_blocks(kind, m, n, dtype, device)


def _choose_blocks(kind: str, m: int, n: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """Tiles for kind "int4" (AWQ, GPTQ), "mxfp4" or "fp8", measured on an H200 with Llama-3.1-8B's
    projections at 1 and 64 rows (bench/tune_quant_gpu.py; docs/models.md has the numbers):
    - up to 16 rows (split-K covers the SMs): the 4-bit and MXFP4 GEMMs take wide tiles (128 x
      128, packed loads) on wide layers, 64 x 64 on narrow ones (a k/v projection's 1024 columns);
      one row of MXFP4 takes a one-row tile (256 x 32, products without tl.dot: 286 against 340 us
      a layer); for the 4-bit GEMM the best one-row tile gained nothing with AWQ (186 against 187
      us) and lost 10% with GPTQ, so it keeps the 16-row ones; FP8 takes 32 columns a tile (the
      most programs: it has no split-K);
    - beyond 16 rows: 64 columns a tile where those tiles alone fill the SMs (gate/up), else 32.
    fp32 x keeps the first, untuned choice (16 or 64 rows, 64 x 32): fp32 dots are not what a
    GPU deployment runs, and bigger fp32 tiles were not measured."""
    rows = 16 if m <= 16 else 64
    if dtype == torch.float32:
        return Tiles(rows, 64, 32)
    wide = triton.cdiv(m, rows) * triton.cdiv(n, 64) >= _num_sms(device)
    if kind == "fp8":
        return Tiles(rows, 64, 64) if wide else Tiles(rows, 32, 128)
    if m == 1 and kind == "mxfp4":  # one-row tiles (no tl.dot) beat the 16-row ones by 1.2x a layer
        return Tiles(1, 256, 32, num_warps=8, packed_loads=True)
    if m <= 16:
        if n < 4096:
            return Tiles(16, 64, 64, packed_loads=True)
        return Tiles(16, 128, 128, num_warps=8 if kind == "mxfp4" else 4, packed_loads=True)
    if wide:
        return Tiles(64, 64, 128, packed_loads=True)
    return Tiles(64, 32, 128, num_warps=8, packed_loads=kind == "int4")


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """The device's SM count (132 off CUDA: the interpreter's tests take an H100's choices)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _choose_split_k(m: int, n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Programs per output tile: decode-sized batches (<= 16 rows) on CUDA get enough programs to
    cover the SMs about twice (k/v projections have few N tiles), each keeping >= 4 K tiles,
    rounded down to a power of two; elsewhere 1. Results differ only in fp32 summation order."""
    if m > 16 or device.type != "cuda":
        return 1
    wanted = -(-2 * _num_sms(device) // triton.cdiv(n, block_n))
    split = max(1, min(wanted, triton.cdiv(k, block_k) // 4))
    return 1 << (split.bit_length() - 1)  # a power of two: few compiled variants


def _output(m: int, n: int, x: torch.Tensor, split_k: int) -> torch.Tensor:
    if split_k == 1:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    return torch.zeros(m, n, dtype=torch.float32, device=x.device)  # the programs add into it


def _check_x(x: torch.Tensor, k: int, *others: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.shape[1] == k, f"x must be [M, {k}], got {tuple(x.shape)}"
    assert x.dtype in _X_DTYPES, f"x dtype {x.dtype} is not one of {_X_DTYPES}"
    assert x.stride(1) == 1, "x must be contiguous in its last dim"
    for t in others:
        assert t is None or t.device == x.device, f"all inputs must be on {x.device}, found one on {t.device}"


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def int4_gemm(x: torch.Tensor, weight: Int4Weight, *, blocks: Tiles | tuple | None = None,
              split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T (+ bias) -> [M, N] in x's dtype (AWQ or GPTQ weights).
    split_k: programs per output tile (None: _choose_split_k)."""
    n, k = weight.shape
    _check_x(x, k, weight.qweight, weight.qzeros, weight.scales, weight.g_idx, weight.bias)
    assert weight.layout in ("awq", "gptq") and n % 8 == 0 and k % 8 == 0, f"{weight.layout} [{n}, {k}]"
    assert weight.qweight.dtype == weight.qzeros.dtype == torch.int32
    assert weight.qweight.is_contiguous() and weight.qzeros.is_contiguous() and weight.scales.is_contiguous()
    num_groups = weight.scales.shape[0]
    assert weight.qzeros.shape == (num_groups, n // 8) and num_groups == -(-k // weight.group_size)
    if weight.g_idx is not None:
        assert weight.g_idx.dtype == torch.int32 and weight.g_idx.shape == (k,)
    tiles = _tiles(blocks, "int4", x.shape[0], n, x.dtype, x.device)
    group = weight.group_size
    if blocks is None and weight.g_idx is None and group % tiles.block_k and group >= 32 and not group & (group - 1):
        tiles = tiles._replace(block_k=group)  # groups of 32 or 64: K tiles inside one group (the integer dot)
    assert tiles.block_n % 8 == 0 and tiles.block_k % 8 == 0, "tiles hold whole packed words"
    split_k = split_k or _choose_split_k(x.shape[0], n, k, tiles.block_n, tiles.block_k, x.device)
    out = _output(x.shape[0], n, x, split_k)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(x.shape[0], tiles.block_m), triton.cdiv(n, tiles.block_n), split_k)
    _int4_gemm_kernel[grid](
        out, x, weight.qweight, weight.qzeros, weight.scales,
        weight.qweight if weight.g_idx is None else weight.g_idx,
        weight.scales if weight.bias is None else weight.bias,
        x.shape[0], n, k, x.stride(0), out.stride(0),
        GROUP_SIZE=weight.group_size, ZERO_OFFSET=weight.zero_offset, AWQ=weight.layout == "awq",
        HAS_G_IDX=weight.g_idx is not None, HAS_BIAS=weight.bias is not None, SPLIT_K=split_k,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=_precision(x.dtype),
        PACKED_LOADS=tiles.packed_loads, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out.to(x.dtype)


def mxfp4_gemm(x: torch.Tensor, weight: Mxfp4Weight, *, blocks: Tiles | tuple | None = None,
               split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T (+ bias) -> [M, N] in x's dtype (one [N, K] MXFP4 weight).
    split_k: programs per output tile (None: _choose_split_k)."""
    n, k = weight.shape
    _check_x(x, k, weight.blocks, weight.scales, weight.bias)
    assert weight.blocks.dim() == 2, "a stack of experts: multiply by weight.expert(e)"
    assert weight.blocks.dtype == weight.scales.dtype == torch.uint8 and k % 32 == 0
    assert weight.scales.shape == (n, k // 32) and weight.blocks.is_contiguous() and weight.scales.is_contiguous()
    tiles = _tiles(blocks, "mxfp4", x.shape[0], n, x.dtype, x.device)
    split_k = split_k or _choose_split_k(x.shape[0], n, k, tiles.block_n, tiles.block_k, x.device)
    out = _output(x.shape[0], n, x, split_k)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(x.shape[0], tiles.block_m), triton.cdiv(n, tiles.block_n), split_k)
    _mxfp4_gemm_kernel[grid](
        out, x, weight.blocks, weight.scales, weight.scales if weight.bias is None else weight.bias,
        x.shape[0], n, k, x.stride(0), out.stride(0),
        HAS_BIAS=weight.bias is not None, SPLIT_K=split_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, DOT_PRECISION=_precision(x.dtype), PACKED_LOADS=tiles.packed_loads,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out.to(x.dtype)


def moe_mxfp4_gemm(a: torch.Tensor, weight: Mxfp4Weight, sorted_pair_ids: torch.Tensor,
                   tile_expert_ids: torch.Tensor, num_post_padded: torch.Tensor, num_pairs: int,
                   pairs_per_row: int, routing: torch.Tensor | None = None, *, block_m: int,
                   block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """triton_moe.moe_gemm over a stack of MXFP4 experts: out[p] = routing[p] * (a[p // pairs_per_row]
    @ W_e.T + bias_e) for pair p of expert e. weight: blocks [E, N, K / 2], scales [E, N, K / 32],
    bias [E, N] or None; the alignment tensors from triton_moe.align_pairs(..., block_m)."""
    assert weight.blocks.dim() == 3, "a stack of experts [E, N, K / 2]"
    num_experts, n, half_k = weight.blocks.shape
    k = 2 * half_k
    assert a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1 and a.dtype in _X_DTYPES, (
        f"a must be [rows, {k}] in {_X_DTYPES}, got {tuple(a.shape)} {a.dtype}")
    assert weight.scales.shape == (num_experts, n, k // 32) and weight.blocks.is_contiguous()
    assert weight.scales.is_contiguous() and weight.blocks.dtype == weight.scales.dtype == torch.uint8
    assert weight.bias is None or (weight.bias.shape == (num_experts, n) and weight.bias.is_contiguous())
    assert pairs_per_row >= 1 and a.shape[0] * pairs_per_row == num_pairs
    assert sorted_pair_ids.dtype == tile_expert_ids.dtype == num_post_padded.dtype == torch.int32
    assert sorted_pair_ids.numel() == tile_expert_ids.numel() * block_m
    if routing is not None:
        assert routing.dtype == torch.float32 and routing.is_contiguous() and routing.numel() == num_pairs
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (tile_expert_ids.numel(), triton.cdiv(n, block_n))
    _moe_mxfp4_gemm_kernel[grid](
        out, a, weight.blocks, weight.scales, weight.scales if weight.bias is None else weight.bias,
        weight.scales if routing is None else routing, sorted_pair_ids, tile_expert_ids, num_post_padded,
        num_pairs, n, k, a.stride(0), out.stride(0),
        A_ROWS_PER_PAIR_DIVISOR=pairs_per_row, MUL_ROUTING_WEIGHT=routing is not None,
        HAS_BIAS=weight.bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_precision(a.dtype),
    )
    return out


def quantize_fp8_reference(x: torch.Tensor, scale_ub: float | None = None,
                           static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M]) in torch: per row (dynamic) or with
    one static scale. The oracle of _quantize_fp8_kernel, and the quantizer before sm_89."""
    x32 = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1).expand(x.shape[0]).contiguous()
    else:
        amax = x32.abs().amax(dim=1)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor, scale_ub: float | None = None,
                           *, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M]) by _quantize_fp8_kernel (needs sm_89+ on CUDA)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in _X_DTYPES
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_fp8_kernel[(m,)](
        q, scale, x, k, x.stride(0), q.stride(0), 0.0 if scale_ub is None else float(scale_ub),
        HAS_UB=scale_ub is not None, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
    )
    return q, scale


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, weight: Fp8Weight, out_dtype: torch.dtype,
             *, blocks: Tiles | tuple | None = None) -> torch.Tensor:
    """(a * a_scale[:, None]) @ (weight.weight * weight_scale[:, None]).T (+ bias) -> [M, N] in out_dtype.
    a: float8_e4m3fn [M, K] with a_scale fp32 [M], or fp16/bf16/fp32 with a_scale None."""
    n, k = weight.shape
    a_fp8 = a.dtype == torch.float8_e4m3fn
    assert a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1, f"a must be [M, {k}], got {tuple(a.shape)}"
    assert a_fp8 == (a_scale is not None) and (a_fp8 or a.dtype in _X_DTYPES), f"a {a.dtype} with a_scale"
    if a_fp8:
        assert a_scale.dtype == torch.float32 and a_scale.shape == (a.shape[0],)
    assert weight.weight.dtype == torch.float8_e4m3fn and weight.weight.stride(1) == 1
    assert weight.weight_scale.dtype == torch.float32 and weight.weight_scale.shape == (n,)
    tiles = _tiles(blocks, "fp8", a.shape[0], n, torch.float16 if a_fp8 else a.dtype, a.device)
    out = torch.empty(a.shape[0], n, dtype=out_dtype, device=a.device)
    if a.shape[0] == 0:
        return out
    grid = (triton.cdiv(a.shape[0], tiles.block_m), triton.cdiv(n, tiles.block_n))
    _fp8_gemm_kernel[grid](
        out, a.view(torch.uint8) if a_fp8 else a, weight.weight.view(torch.uint8),
        weight.weight_scale if a_scale is None else a_scale, weight.weight_scale,
        weight.weight_scale if weight.bias is None else weight.bias,
        a.shape[0], n, k, a.stride(0), weight.weight.stride(0), out.stride(0),
        A_FP8=a_fp8, HAS_BIAS=weight.bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, DOT_PRECISION=_precision(torch.float16 if a_fp8 else a.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def uses_scaled_mm(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether fp8_linear multiplies by torch._scaled_mm: fp8 activations on sm_89 or sm_90 (its
    row-wise scaled kernels; sm_100+ and sm_120 lack or fail them in the torch releases we know
    of, so they take the Triton GEMM), a bf16 output (row-wise fp16 output came only in late-2025
    torch) and K and N multiples of 16 (its layout rules)."""
    n, k = weight.shape
    return (x.is_cuda and weight.activations is not None and x.dtype == torch.bfloat16 and n % 16 == 0
            and k % 16 == 0 and torch.cuda.get_device_capability(x.device) in ((8, 9), (9, 0)))


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, *, use_scaled_mm: bool | None = None,
               blocks: Tiles | tuple | None = None) -> torch.Tensor:
    """x [M, K] through an fp8 linear (module docstring's dispatch) -> [M, N] in x's dtype."""
    n, k = weight.shape
    _check_x(x, k, weight.weight, weight.weight_scale, weight.input_scale, weight.bias)
    if weight.activations is None:
        return fp8_gemm(x, None, weight, x.dtype, blocks=blocks)
    scaled_mm = uses_scaled_mm(x, weight) if use_scaled_mm is None else use_scaled_mm
    if weight.activations == "static_tensor":
        q, scale = quantize_fp8_reference(x, static_scale=weight.input_scale)
    elif not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 9):  # Triton's e4m3 cast
        q, scale = quantize_fp8_per_token(x, weight.activation_scale_ub)
    else:
        q, scale = quantize_fp8_reference(x, weight.activation_scale_ub)
    if not scaled_mm:
        return fp8_gemm(q, scale, weight, x.dtype, blocks=blocks)
    return torch._scaled_mm(q, weight.weight.t(), scale_a=scale[:, None], scale_b=weight.weight_scale[None, :],
                            bias=weight.bias, out_dtype=x.dtype)


def quant_linear(x: torch.Tensor, weight: Int4Weight | Fp8Weight | Mxfp4Weight | torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, the kernel picked by the weight's format."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = F.linear(rows, weight) if isinstance(weight, torch.Tensor) else KERNELS[type(weight)](rows, weight)
    return out.view(*x.shape[:-1], out.shape[-1])


KERNELS = {Int4Weight: int4_gemm, Mxfp4Weight: mxfp4_gemm, Fp8Weight: fp8_linear}  # each format's product
