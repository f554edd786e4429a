/* Products with weights kept in their GGUF quantization type, dequantized in registers inside
 * the dot products and never to memory:
 *
 *     out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n])       w: GGUF blocks, [N, row_bytes] uint8
 *
 * Weight types (ggml's block layouts, as the gguf package's quants.py dequantizes them): Q8_0,
 * Q4_0, Q4_1 (32 weights a block) and Q4_K, Q5_K, Q6_K (256 weights a super-block of eight
 * 32-weight sub-blocks). Every type is read as sub-blocks of 32 weights, each a vector of 32
 * small integers q and a scale and offset: w = scale * q + offset (Q6_K: one scale for each
 * half of 16; the signed types Q8_0, Q4_0 and Q6_K carry their zero point inside q, offset 0).
 *
 * Two modes, one entry point (the mode argument):
 *   GGUF_FP32: x in fp32 (bf16 x widened once per call), each sub-block's q widened to fp32,
 *              scaled, and FMA'd against x. Error: fp32 rounding only.
 *   GGUF_INT8: x quantized once per call to int8 per 32-block with an fp32 scale (llama.cpp's
 *              Q8_0/Q8_K activations), integer dot products (maddubs + madd on AVX2, vpdpbusd
 *              with VNNI), one fp32 FMA per sub-block. The offset terms use each x block's sum.
 *              Error: x's rounding to 8 bits, about 0.4% of each block's largest value (a few
 *              1e-3 of the output's scale).
 *   GGUF_INT16: packed Q8_0 only (an lm_head): x quantized once per call to int16 per 32-block,
 *              pairs of products summed exactly into int32 (madd), one fp32 FMA per block.
 *              Error: x's rounding to 16 bits, 1/65534 of each block's largest value: the
 *              logits of the fp32 mode to about 1e-5 of their scale, at about half its time.
 * The mode is chosen by measurement in workers/kernels/gguf.py (bench/bench_gguf.py).
 *
 * Threads claim items of one or more groups of COLUMNS_PER_ITEM output columns (about 8 items a
 * thread, rayllm_parallel_for); inside a group the rows go TILE_ROWS at a time, each weight row
 * read once per tile (its decode shared by the tile's rows) and the group's weights staying in
 * cache from one tile to the next. Each output
 * is one sum in block order whatever the tile or thread, so a row's result is the same alone or
 * in any batch. Vector paths: AVX2 + FMA (AVX-512 builds run the same 256-bit kernels, with
 * VNNI's vpdpbusd where the CPU has it, and packed tiles of 5 or more rows on 512-bit kernels of
 * their own: packed_int8_pair, packed_q8_int16_pair), else portable C.
 *
 * Weights repacked eight columns at a time (ggml_type | GGUF_PACKED) have kernels of their own,
 * below: eight columns' sums in one vector's lanes (Q4_0 and Q4_1 int8, Q8_0 fp32).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "simd.h"

/* The library's -fassociative-math let GCC regroup a tile's sums differently for each tile
 * height (the 1-row and the 4-row kernel then disagreed in the last bit): not in this file. */
#pragma GCC optimize("no-associative-math")

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
#define TILE_ROWS 4
#define COLUMNS_PER_ITEM 16
#define ROWS_PER_QUANT_ITEM 16

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_f32(h);
}

static inline int block_bytes(const int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    }
    return 0;
}

static inline int block_subs(const int type) { return type >= GGML_Q4_K ? 8 : 1; } /* 32-weight sub-blocks */

static inline int signed_q(const int type) { return type == GGML_Q4_0 || type == GGML_Q8_0 || type == GGML_Q6_K; }

typedef struct {
    float lo, hi, off; /* w = scale * q + off; scale lo for weights 0-15 of the sub-block, hi for 16-31 */
} SubScale;

/* Q4_K and Q5_K: sub-block j's 6-bit scale and minimum from the 12 packed bytes s. */
static inline void scale_min_k4(const uint8_t *s, int j, int *scale, int *minimum) {
    if (j < 4) {
        *scale = s[j] & 63;
        *minimum = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *minimum = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline SubScale sub_scale(const int type, const uint8_t *block, const int j) {
    SubScale s = {0.0f, 0.0f, 0.0f};
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q8_0: s.lo = s.hi = fp16_to_f32(block); break;
    case GGML_Q4_1:
        s.lo = s.hi = fp16_to_f32(block);
        s.off = fp16_to_f32(block + 2);
        break;
    case GGML_Q4_K:
    case GGML_Q5_K: {
        int scale, minimum;
        scale_min_k4(block + 4, j, &scale, &minimum);
        s.lo = s.hi = fp16_to_f32(block) * (float)scale;
        s.off = -(fp16_to_f32(block + 2) * (float)minimum);
        break;
    }
    case GGML_Q6_K: {
        const float d = fp16_to_f32(block + 208);
        s.lo = d * (float)(int8_t)block[192 + 2 * j];
        s.hi = d * (float)(int8_t)block[193 + 2 * j];
        break;
    }
    }
    return s;
}

/* Sub-block j's 32 integers q (in [-128, 127]; the signed types' zero point already taken off). */
static inline void sub_q_scalar(const int type, const uint8_t *block, const int j, int8_t *q) {
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *qs = block + (type == GGML_Q4_0 ? 2 : 4);
        const int zero = type == GGML_Q4_0 ? 8 : 0;
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)((qs[l] & 0x0F) - zero);
            q[l + 16] = (int8_t)((qs[l] >> 4) - zero);
        }
        break;
    }
    case GGML_Q8_0: memcpy(q, block + 2, 32); break;
    case GGML_Q4_K: {
        const uint8_t *qs = block + 16 + 32 * (j / 2);
        for (int l = 0; l < 32; l++) q[l] = (int8_t)((qs[l] >> (4 * (j & 1))) & 0x0F);
        break;
    }
    case GGML_Q5_K: {
        const uint8_t *qh = block + 16, *qs = block + 48 + 32 * (j / 2);
        for (int l = 0; l < 32; l++) q[l] = (int8_t)(((qs[l] >> (4 * (j & 1))) & 0x0F) | (((qh[l] >> j) & 1) << 4));
        break;
    }
    case GGML_Q6_K: {
        const int c = j / 4, t = j % 4;
        const uint8_t *ql = block + 64 * c + 32 * (t & 1), *qh = block + 128 + 32 * c;
        for (int l = 0; l < 32; l++)
            q[l] = (int8_t)((((ql[l] >> (4 * (t >> 1))) & 0x0F) | (((qh[l] >> (2 * t)) & 3) << 4)) - 32);
        break;
    }
    }
}

typedef struct {
    const float *x;                 /* [num_rows, K] fp32 (GGUF_FP32) */
    const int8_t *xq;               /* [num_rows, K] int8 (GGUF_INT8) */
    const int16_t *x16;             /* [num_rows, K] int16 (GGUF_INT16); its scales in x_scale */
    const float *x_scale, *x_sum;   /* [num_rows, K / 32]: each x block's scale, and scale * sum of its q */
    const uint8_t *w;               /* [N, row_bytes] */
    const void *bias;               /* [N] in dtype, or NULL */
    void *out;                      /* [num_rows, N] in out_dtype */
    int64_t num_rows, N, K, row_bytes;
    int type, dtype, out_dtype, mode;
    int64_t span; /* column groups (of COLUMNS_PER_ITEM, or packed: PACKED_COLUMNS) per parallel item */
    uint8_t *unpacked; /* packed, no packed kernel: [items, PACKED_COLUMNS, row_bytes], a group's rows */
} GgufJob;

#ifdef RAYLLM_HAS_AVX2
static inline __m256i sub_q(const int type, const uint8_t *block, const int j) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(block + (type == GGML_Q4_0 ? 2 : 4)));
        const __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
        const __m256i q = _mm256_and_si256(both, low4);
        return type == GGML_Q4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
    }
    case GGML_Q8_0: return _mm256_loadu_si256((const __m256i *)(block + 2));
    case GGML_Q4_K: {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * (j / 2)));
        return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (j & 1))), low4);
    }
    case GGML_Q5_K: {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 48 + 32 * (j / 2)));
        const __m256i low = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (j & 1))), low4);
        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 16));
        const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(low, high);
    }
    default: { /* GGML_Q6_K */
        const int c = j / 4, t = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(block + 64 * c + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * c));
        const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (t >> 1))), low4);
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    }
    }
}

/* Sums of u[4i..4i+3] * s[4i..4i+3] (u unsigned, s signed bytes) in 8 int32 lanes: lanes 0-3 from bytes 0-15. */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    /* each pair of products fits int16: u <= 128 (|q|), |s| <= 127 (x's q) */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256 widen_q(__m128i q8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)); }

/* Sub-block j's 32 weights in fp32 (scale * q + offset), four vectors of 8: what the fp32 mode
 * multiplies by and rayllm_gguf_dequantize writes. */
static inline __attribute__((always_inline)) void sub_weights(const int type, const uint8_t *block, const int j,
                                                              __m256 w[4]) {
    const SubScale s = sub_scale(type, block, j);
    const __m256i q = sub_q(type, block, j);
    const __m128i q_lo = _mm256_castsi256_si128(q), q_hi = _mm256_extracti128_si256(q, 1);
    const __m256 lo = _mm256_set1_ps(s.lo), hi = _mm256_set1_ps(s.hi), off = _mm256_set1_ps(s.off);
    w[0] = _mm256_fmadd_ps(widen_q(q_lo), lo, off);
    w[1] = _mm256_fmadd_ps(widen_q(_mm_srli_si128(q_lo, 8)), lo, off);
    w[2] = _mm256_fmadd_ps(widen_q(q_hi), hi, off);
    w[3] = _mm256_fmadd_ps(widen_q(_mm_srli_si128(q_hi, 8)), hi, off);
}

/* GGUF_FP32: rows [m0, m0 + MR) of x times weight row w, into sums[0, MR). */
static inline __attribute__((always_inline)) void dot_f32(const int type, const GgufJob *job, const uint8_t *w,
                                                          int64_t m0, const int MR, float *sums, const int stride) {
    const int64_t K = job->K, num_blocks = K / (32 * block_subs(type));
    const float *x = job->x + m0 * K;
    __m256 acc[TILE_ROWS][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = w + b * block_bytes(type);
        for (int j = 0; j < block_subs(type); j++) {
            __m256 wv[4];
            sub_weights(type, block, j, wv);
            const __m256 w0 = wv[0], w1 = wv[1], w2 = wv[2], w3 = wv[3];
            const float *xk = x + (b * block_subs(type) + j) * 32;
            const int parity = j & 1; /* two sums per row, alternating sub-blocks: half the latency chain */
            for (int i = 0; i < MR; i++) {
                const float *xr = xk + i * K;
                __m256 part = _mm256_mul_ps(_mm256_loadu_ps(xr), w0);
                part = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, part);
                part = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, part);
                part = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, part);
                acc[i][parity] = _mm256_add_ps(acc[i][parity], part);
            }
        }
    }
    for (int i = 0; i < MR; i++) sums[i * stride] = hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
}

/* GGUF_INT8: sub-block j of `block` (sub-block sb of the row) into the sums acc and offsets. */
static inline __attribute__((always_inline)) void int8_sub(const int type, const uint8_t *block, const int j,
                                                           int64_t sb, const int8_t *xq, const float *x_scale,
                                                           const float *x_sum, int64_t K, int64_t x_blocks,
                                                           const int MR, __m256 *acc, float *offsets) {
    const SubScale s = sub_scale(type, block, j);
    const __m256i q = sub_q(type, block, j);
    const __m256i u = signed_q(type) ? _mm256_sign_epi8(q, q) : q; /* |q|, x takes q's sign */
    const __m256 scale = type == GGML_Q6_K ? _mm256_insertf128_ps(_mm256_set1_ps(s.lo), _mm_set1_ps(s.hi), 1)
                                           : _mm256_set1_ps(s.lo);
    for (int i = 0; i < MR; i++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + sb * 32));
        if (signed_q(type)) xv = _mm256_sign_epi8(xv, q);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8_i8(u, xv));
        acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(x_scale[i * x_blocks + sb])), acc[i]);
        if (!signed_q(type)) offsets[i] += s.off * x_sum[i * x_blocks + sb];
    }
}

/* GGUF_INT8: rows [m0, m0 + MR) of x's int8 blocks times weight row w, into sums[i * stride].
 * Two sums per row, even and odd sub-blocks, to halve the FMA latency chain of a single row. */
static inline __attribute__((always_inline)) void dot_int8(const int type, const GgufJob *job, const uint8_t *w,
                                                           int64_t m0, const int MR, float *sums, const int stride) {
    const int64_t K = job->K, num_blocks = K / (32 * block_subs(type)), x_blocks = K / 32;
    const int8_t *xq = job->xq + m0 * K;
    const float *x_scale = job->x_scale + m0 * x_blocks, *x_sum = job->x_sum + m0 * x_blocks;
    __m256 even[TILE_ROWS], odd[TILE_ROWS];
    float even_offsets[TILE_ROWS] = {0}, odd_offsets[TILE_ROWS] = {0};
    for (int i = 0; i < MR; i++) even[i] = odd[i] = _mm256_setzero_ps();
    const int bb = block_bytes(type);
    if (block_subs(type) == 1) {
        int64_t b = 0;
        for (; b + 1 < num_blocks; b += 2) {
            int8_sub(type, w + b * bb, 0, b, xq, x_scale, x_sum, K, x_blocks, MR, even, even_offsets);
            int8_sub(type, w + (b + 1) * bb, 0, b + 1, xq, x_scale, x_sum, K, x_blocks, MR, odd, odd_offsets);
        }
        if (b < num_blocks) int8_sub(type, w + b * bb, 0, b, xq, x_scale, x_sum, K, x_blocks, MR, even, even_offsets);
    } else {
        for (int64_t b = 0; b < num_blocks; b++)
            for (int j = 0; j < 8; j += 2) {
                int8_sub(type, w + b * bb, j, 8 * b + j, xq, x_scale, x_sum, K, x_blocks, MR, even, even_offsets);
                int8_sub(type, w + b * bb, j + 1, 8 * b + j + 1, xq, x_scale, x_sum, K, x_blocks, MR, odd, odd_offsets);
            }
    }
    for (int i = 0; i < MR; i++)
        sums[i * stride] = hsum8(_mm256_add_ps(even[i], odd[i])) + (even_offsets[i] + odd_offsets[i]);
}

/* Block b of x's row (32 values, fp32 or bf16) into v, fp32; returns its largest |value|. */
static inline float load_block(const void *x, int bf16, int64_t b, __m256 v[4]) {
    const char *xb = (const char *)x + b * 32 * (bf16 ? 2 : 4);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int t = 0; t < 4; t++) {
        v[t] = load8(xb + t * 8 * (bf16 ? 2 : 4), bf16);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
    }
    return hmax8(amax);
}

/* x row -> int8 blocks of 32: scale = max |x| / 127, q = round(x / scale), and scale * sum(q). */
static void quantize_row(const void *x, int dtype, int64_t K, int8_t *q, float *scale, float *sum) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        const float max = load_block(x, dtype == DTYPE_BF16, b, v);
        const float inverse = max > 0.0f ? 127.0f / max : 0.0f;
        __m256i n[4];
        for (int t = 0; t < 4; t++) n[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], _mm256_set1_ps(inverse)));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * 32), ordered);
        scale[b] = max / 127.0f;
        sum[b] = scale[b] * (float)_mm_cvtsi128_si32(t4);
    }
}

/* x row -> int16 blocks of 32: scale = max |x| / 32767, q = round(x / scale) (|q| <= 32767). */
static void quantize_row16(const void *x, int dtype, int64_t K, int16_t *q, float *scale) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        const float max = load_block(x, dtype == DTYPE_BF16, b, v);
        const __m256 inverse = _mm256_set1_ps(max > 0.0f ? 32767.0f / max : 0.0f);
        for (int t = 0; t < 4; t += 2) { /* packs interleaves 128-bit halves: permute them back */
            const __m256i n = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[t], inverse)),
                                                 _mm256_cvtps_epi32(_mm256_mul_ps(v[t + 1], inverse)));
            _mm256_storeu_si256((__m256i *)(q + b * 32 + 8 * t), _mm256_permute4x64_epi64(n, 0xD8));
        }
        scale[b] = max / 32767.0f;
    }
}
#else /* portable C */
/* Sub-block j's 32 weights in fp32 (scale * q + offset). */
static inline void sub_weights(const int type, const uint8_t *block, const int j, float w[32]) {
    const SubScale s = sub_scale(type, block, j);
    int8_t q[32];
    sub_q_scalar(type, block, j, q);
    for (int l = 0; l < 32; l++) w[l] = (l < 16 ? s.lo : s.hi) * (float)q[l] + s.off;
}

static inline __attribute__((always_inline)) void dot_f32(const int type, const GgufJob *job, const uint8_t *w,
                                                          int64_t m0, const int MR, float *sums, const int stride) {
    const int64_t K = job->K, num_subs = K / 32;
    float acc[TILE_ROWS] = {0};
    for (int64_t sb = 0; sb < num_subs; sb++) {
        const uint8_t *block = w + sb / block_subs(type) * block_bytes(type);
        const int j = (int)(sb % block_subs(type));
        float wf[32];
        sub_weights(type, block, j, wf);
        for (int i = 0; i < MR; i++) {
            const float *x = job->x + (m0 + i) * K + sb * 32;
            for (int l = 0; l < 32; l++) acc[i] += x[l] * wf[l];
        }
    }
    for (int i = 0; i < MR; i++) sums[i * stride] = acc[i];
}

static inline __attribute__((always_inline)) void dot_int8(const int type, const GgufJob *job, const uint8_t *w,
                                                           int64_t m0, const int MR, float *sums, const int stride) {
    const int64_t K = job->K, num_subs = K / 32;
    float acc[TILE_ROWS] = {0};
    int8_t q[32];
    for (int64_t sb = 0; sb < num_subs; sb++) {
        const uint8_t *block = w + sb / block_subs(type) * block_bytes(type);
        const int j = (int)(sb % block_subs(type));
        const SubScale s = sub_scale(type, block, j);
        sub_q_scalar(type, block, j, q);
        for (int i = 0; i < MR; i++) {
            const int8_t *xq = job->xq + (m0 + i) * K + sb * 32;
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) lo += (int32_t)q[l] * xq[l];
            for (int l = 16; l < 32; l++) hi += (int32_t)q[l] * xq[l];
            const float x_scale = job->x_scale[(m0 + i) * num_subs + sb];
            acc[i] += (s.lo * (float)lo + s.hi * (float)hi) * x_scale + s.off * job->x_sum[(m0 + i) * num_subs + sb];
        }
    }
    for (int i = 0; i < MR; i++) sums[i * stride] = acc[i];
}

static void quantize_row(const void *x, int dtype, int64_t K, int8_t *q, float *scale, float *sum) {
    for (int64_t b = 0; b < K / 32; b++) {
        float max = 0.0f;
        for (int l = 0; l < 32; l++) max = fmaxf(max, fabsf(load_element(x, b * 32 + l, dtype)));
        const float inverse = max > 0.0f ? 127.0f / max : 0.0f;
        int32_t total = 0;
        for (int l = 0; l < 32; l++) {
            const int32_t n = (int32_t)nearbyintf(load_element(x, b * 32 + l, dtype) * inverse);
            q[b * 32 + l] = (int8_t)n;
            total += n;
        }
        scale[b] = max / 127.0f;
        sum[b] = scale[b] * (float)total;
    }
}

static void quantize_row16(const void *x, int dtype, int64_t K, int16_t *q, float *scale) {
    for (int64_t b = 0; b < K / 32; b++) {
        float max = 0.0f;
        for (int l = 0; l < 32; l++) max = fmaxf(max, fabsf(load_element(x, b * 32 + l, dtype)));
        const float inverse = max > 0.0f ? 32767.0f / max : 0.0f;
        for (int l = 0; l < 32; l++) q[b * 32 + l] = (int16_t)nearbyintf(load_element(x, b * 32 + l, dtype) * inverse);
        scale[b] = max / 32767.0f;
    }
}
#endif

/* Weight rows [n0, n1) (at most COLUMNS_PER_ITEM) times a tile of MR (1 to TILE_ROWS) rows from
 * m0, into sums[i * COLUMNS_PER_ITEM + n - n0]; the type, the mode and MR are compile-time
 * constants, and the column loop sits inside them (a call per column cost as much as a short
 * row's sums at one row). */
#define COLUMNS_CASE(KERNEL, T, R)                                                                       \
    case R:                                                                                              \
        for (int64_t n = n0; n < n1; n++)                                                                \
            KERNEL(T, job, job->w + n * job->row_bytes, m0, R, sums + (n - n0), COLUMNS_PER_ITEM);       \
        break;
#define COLUMNS_FUNCTION(T)                                                                              \
    static void columns_##T(const GgufJob *job, int64_t n0, int64_t n1, int64_t m0, int MR, float *sums) { \
        if (job->mode == GGUF_INT8) {                                                                    \
            switch (MR) {                                                                                \
                COLUMNS_CASE(dot_int8, T, 4)                                                             \
                COLUMNS_CASE(dot_int8, T, 3)                                                             \
                COLUMNS_CASE(dot_int8, T, 2)                                                             \
                COLUMNS_CASE(dot_int8, T, 1)                                                             \
            }                                                                                            \
        } else {                                                                                         \
            switch (MR) {                                                                                \
                COLUMNS_CASE(dot_f32, T, 4)                                                              \
                COLUMNS_CASE(dot_f32, T, 3)                                                              \
                COLUMNS_CASE(dot_f32, T, 2)                                                              \
                COLUMNS_CASE(dot_f32, T, 1)                                                              \
            }                                                                                            \
        }                                                                                                \
    }
COLUMNS_FUNCTION(GGML_Q4_0)
COLUMNS_FUNCTION(GGML_Q4_1)
COLUMNS_FUNCTION(GGML_Q8_0)
COLUMNS_FUNCTION(GGML_Q4_K)
COLUMNS_FUNCTION(GGML_Q5_K)
COLUMNS_FUNCTION(GGML_Q6_K)

typedef void (*ColumnsFunction)(const GgufJob *, int64_t, int64_t, int64_t, int, float *);

static ColumnsFunction columns_function(int type) {
    switch (type) {
    case GGML_Q4_0: return columns_GGML_Q4_0;
    case GGML_Q4_1: return columns_GGML_Q4_1;
    case GGML_Q8_0: return columns_GGML_Q8_0;
    case GGML_Q4_K: return columns_GGML_Q4_K;
    case GGML_Q5_K: return columns_GGML_Q5_K;
    case GGML_Q6_K: return columns_GGML_Q6_K;
    }
    return NULL;
}

/* out[m0 + i, n] = sums[i * stride + n - n0] + bias[n] for the tile's rows and columns [n0, n1):
 * eight columns to a vector where the CPU has AVX2 (the same sums and roundings as the scalar
 * loop). Element by element, this took about a fifth of a 16-row packed Q4_1 tile's time. */
static void store_sums(const GgufJob *job, int64_t n0, int64_t n1, int64_t m0, int rows, const float *sums,
                       int stride) {
    int64_t scalar_from = n0;
#ifdef RAYLLM_HAS_AVX2
    scalar_from = n0 + (n1 - n0) / 8 * 8;
    const int bias_bf16 = job->dtype == DTYPE_BF16, out_bf16 = job->out_dtype == DTYPE_BF16;
    const char *bias = job->bias;
    char *out = job->out;
    for (int i = 0; i < rows; i++)
        for (int64_t n = n0; n < scalar_from; n += 8) {
            __m256 v = _mm256_loadu_ps(sums + i * stride + n - n0);
            if (bias) v = _mm256_add_ps(v, load8(bias + n * (bias_bf16 ? 2 : 4), bias_bf16));
            store8(out + ((m0 + i) * job->N + n) * (out_bf16 ? 2 : 4), v, out_bf16);
        }
#endif
    for (int i = 0; i < rows; i++)
        for (int64_t n = scalar_from; n < n1; n++) {
            const float bias = job->bias ? load_element(job->bias, n, job->dtype) : 0.0f;
            store_element(job->out, (m0 + i) * job->N + n, sums[i * stride + n - n0] + bias, job->out_dtype);
        }
}

/* Column group g: output columns [g * COLUMNS_PER_ITEM, ...) for every row, TILE_ROWS rows at a time. */
static void gguf_group(const GgufJob *job, int64_t g) {
    const ColumnsFunction columns = columns_function(job->type);
    const int64_t n0 = g * COLUMNS_PER_ITEM, n1 = n0 + COLUMNS_PER_ITEM < job->N ? n0 + COLUMNS_PER_ITEM : job->N;
    for (int64_t m0 = 0; m0 < job->num_rows; m0 += TILE_ROWS) {
        const int rows = job->num_rows - m0 < TILE_ROWS ? (int)(job->num_rows - m0) : TILE_ROWS;
        float sums[TILE_ROWS * COLUMNS_PER_ITEM];
        columns(job, n0, n1, m0, rows, sums);
        store_sums(job, n0, n1, m0, rows, sums, COLUMNS_PER_ITEM);
    }
}

/* Item `item`: column groups [item * span, (item + 1) * span), one after the other. */
static void gguf_columns(void *context, int64_t item) {
    const GgufJob *job = context;
    const int64_t groups = (job->N + COLUMNS_PER_ITEM - 1) / COLUMNS_PER_ITEM;
    const int64_t end = (item + 1) * job->span < groups ? (item + 1) * job->span : groups;
    for (int64_t g = item * job->span; g < end; g++) gguf_group(job, g);
}

/* ------------------------------------------------------- weights repacked eight columns at a time
 *
 * ggml_type | GGUF_PACKED: the weight's bytes are permuted (workers/gguf_weight.py, pack_columns)
 * so that a group of PACKED_COLUMNS output columns holds, for each 32-weight block in turn, the
 * 8 columns' fp16 scales (16 bytes), then:
 *   Q4_1: their fp16 minimums (16 bytes); then, as Q4_0,
 *   Q4_0: their 16 bytes of 4-bit values as four 32-byte pieces, piece t holding bytes 4t..4t+3
 *         of column 0, then of column 1, ... A piece's low nibbles are weights 4t..4t+3 of each
 *         column and its high nibbles weights 16+4t..16+4t+3: one load gives eight columns' four
 *         consecutive weights, which the int8 product multiplies by the same four bytes of x,
 *         broadcast;
 *   Q8_0: their int8 weights k by k, weight k of column c at byte 8k + c: one 8-byte load widens
 *         to eight columns' weight k, which the fp32 product (the lm_head's LOGITS_MODE)
 *         multiplies by x[k], broadcast.
 * Each column's sum stays in its own lane from the first block to the last: no horizontal sums,
 * no sign tricks (the 4-bit values are unsigned; Q4_0's zero point goes in with x's block sum,
 * like Q4_1's minimum), and a block's decode is shared by every row of the tile. The same bytes
 * as the file's layout, so the memory is unchanged.
 *
 * Arithmetic, the same for every tile height and build (a row's result does not depend on its
 * batch): int8 (Q4_0, Q4_1): per block, the exact int32 sum of q * xq for each column, then
 *     acc = fma(float(sum), d * x_scale, acc); acc = fma(offset, x_sum, acc)
 * with offset Q4_1's minimum or Q4_0's -8 d. fp32 (Q8_0): even and odd k's sums of
 * fma(x[k], q[k] * d, acc) over the blocks in turn, added at the end. Other pairs of type and
 * mode, and the dequantization, read a group through a copy in the file's layout. */
#define PACKED_COLUMNS 8
#define PACKED_TILE 4       /* rows whose sums stay in registers through all the blocks */
#define PACKED_PREFETCH_BLOCKS 16 /* packed_prefetch's distance, in blocks of a group */
#define PACKED_PREFETCH_ROWS 2    /* tiles of up to this many rows prefetch */
#define PACKED_INT8_TILE 16 /* rows of a packed int8 tile past PACKED_TILE: their sums in L1 (packed_int8_groups) */
_Static_assert(PACKED_TILE <= TILE_ROWS && PACKED_COLUMNS <= COLUMNS_PER_ITEM, "the fp32 mode's tiles hold a packed one");
_Static_assert(TILE_ROWS * COLUMNS_PER_ITEM <= PACKED_INT8_TILE * PACKED_COLUMNS, "a packed tile's sums hold a file-layout tile's");

static inline int packable(const int type) { return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0; }

/* Where a packed Q4_0/Q4_1 block's values start: after the 8 scales (and Q4_1's 8 minimums). */
static inline int packed_values(const int type) { return type == GGML_Q4_1 ? 32 : 16; }

/* The (type, mode) pairs with a packed kernel of their own; the others unpack each group. */
static inline int packed_kernel(const int type, const int mode) {
    return mode == GGUF_INT8 ? type == GGML_Q4_0 || type == GGML_Q4_1 : type == GGML_Q8_0;
}

#ifdef RAYLLM_HAS_AVX2
/* sums += the products of u's unsigned and s's signed bytes, four to a lane: int32 lanes with
 * VNNI; else int16 lanes (maddubs), which 8 products of 4-bit q and int8 x cannot overflow
 * (8 * 2 * 15 * 127 = 30480), widened once per block by packed_sums. */
static inline __m256i packed_dot(__m256i sums, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(sums, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(sums, u, s);
#else
    return _mm256_add_epi16(sums, _mm256_maddubs_epi16(u, s));
#endif
}

static inline __m256i packed_sums(__m256i sums) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return sums;
#else
    return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
#endif
}

/* Asks for the packed block PACKED_PREFETCH_BLOCKS after `block` (bb bytes: 8 columns' blocks) in
 * L1 ahead of use. At one or two rows the int8 kernel reads its blocks faster than the hardware
 * prefetcher brings them: a one-row product of SmolLM2's Q4_1 shapes streamed from memory took
 * 0.80-0.92x the time with blocks 16 ahead (2 threads, builds alternating in one process; 8, 24,
 * 32 and 48 ahead were no better). The int16 lm_head at one or two rows took 1.03-1.22x the time
 * without it; 8 and 16 blocks ahead were within noise of each other (16: 0.89-1.03x). The
 * address is formed as an integer: past a weight's last blocks it points beyond the buffer,
 * which a prefetch may do (it never faults) but C pointer arithmetic may not. At 4 rows it
 * gained nothing, and the Q8_0 head's fp32 kernel, which has more work per byte, gained nothing
 * either. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *block, const int bb, const int blocks) {
    const uintptr_t ahead = (uintptr_t)block + (uintptr_t)(blocks * bb);
    for (int line = 0; line < bb; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
}
static inline __attribute__((always_inline)) void packed_prefetch(const uint8_t *block, const int bb) {
    prefetch_ahead(block, bb, PACKED_PREFETCH_BLOCKS);
}

static inline __m256i broadcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(v);
}

/* A packed Q4 block's eight columns' offsets: Q4_1's minimums, or Q4_0's zero point -8 d. */
static inline __m256 packed_offset(const int type, const uint8_t *block, const __m256 d) {
    return type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)))
                             : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
}

/* acc plus one block's products for x's block xb (row and block), from their int sums: the
 * arithmetic every packed int8 tile shares. */
static inline __m256 packed_block_sum(__m256 acc, const __m256i sums, const __m256 d, const __m256 offset,
                                      const GgufJob *job, const int64_t xb) {
    const __m256 dot = _mm256_cvtepi32_ps(packed_sums(sums));
    acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(job->x_scale[xb])), acc);
    return _mm256_fmadd_ps(offset, _mm256_set1_ps(job->x_sum[xb]), acc);
}

/* Rows [m0, m0 + MR) of x's int8 blocks times the 8 columns of `group`, into out[i * 8 + c]. */
static inline __attribute__((always_inline)) void packed_int8(const int type, const GgufJob *job,
                                                              const uint8_t *group, int64_t m0, const int MR,
                                                              float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type), qs = packed_values(type);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[PACKED_TILE];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = group + b * bb;
        if (MR <= PACKED_PREFETCH_ROWS) packed_prefetch(block, bb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const __m256 offset = packed_offset(type, block, d);
        const int8_t *x = job->xq + m0 * K + b * 32;
        __m256i sums[PACKED_TILE];
        for (int i = 0; i < MR; i++) sums[i] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            const __m256i piece = _mm256_loadu_si256((const __m256i *)(block + qs + 32 * t));
            const __m256i lo = _mm256_and_si256(piece, low4), hi = _mm256_and_si256(_mm256_srli_epi16(piece, 4), low4);
            for (int i = 0; i < MR; i++) {
                sums[i] = packed_dot(sums[i], lo, broadcast4(x + i * K + 4 * t));
                sums[i] = packed_dot(sums[i], hi, broadcast4(x + i * K + 16 + 4 * t));
            }
        }
        for (int i = 0; i < MR; i++) acc[i] = packed_block_sum(acc[i], sums[i], d, offset, job, (m0 + i) * num_blocks + b);
    }
    for (int i = 0; i < MR; i++) _mm256_storeu_ps(out + i * PACKED_COLUMNS, acc[i]);
}
/* Groups at a time that packed_int8_groups takes through each block: their sums (8 KB at 16
 * rows) stay in L1 beside the block's widened x. */
#define PACKED_GROUPS_AT_ONCE 16
/* A decode step's tile (5-16 rows) asks for each group's block this many blocks ahead: the
 * weights stream from memory once, 16 groups side by side, which the hardware prefetcher alone
 * did not keep up with (rows 5, 8, 16: 0.86-0.95x the time with 2 ahead; 1 and 4 were no better
 * than none, 3 in between), weights on 4 KB pages. On 2 MB pages, as the worker holds them,
 * decode tiles measure within noise of packed_int8_rows before (0.92-1.05x at 5-16 rows). Prompt
 * steps read the weights from L2 after their first tile and skip it (at 256 rows it took 1.07x). */
#define PACKED_GROUPS_PREFETCH_BLOCKS 2

/* The sums of rows [0, MR) of groups [g0, g1) (packed_int8_groups, packed_q8_int16_groups): zeroed,
 * and at the end stored to the output. */
typedef float GroupSums[PACKED_GROUPS_AT_ONCE][PACKED_INT8_TILE * PACKED_COLUMNS];

static inline void zero_group_sums(GroupSums sums, const int64_t g0, const int64_t g1, const int MR) {
    for (int64_t g = g0; g < g1; g++)
        for (int i = 0; i < MR; i++) _mm256_storeu_ps(sums[g - g0] + i * PACKED_COLUMNS, _mm256_setzero_ps());
}

static inline void store_group_sums(const GgufJob *job, GroupSums sums, const int64_t g0, const int64_t g1,
                                    const int64_t m0, const int MR) {
    for (int64_t g = g0; g < g1; g++)
        store_sums(job, g * PACKED_COLUMNS, (g + 1) * PACKED_COLUMNS, m0, MR, sums[g - g0], PACKED_COLUMNS);
}

/* Group g's block b (bb bytes a block), asking for the group's block PACKED_GROUPS_PREFETCH_BLOCKS
 * ahead when the weights stream from memory (past the last blocks that address may lie beyond the
 * weight: a prefetch never faults). */
static inline __attribute__((always_inline)) const uint8_t *group_block(const GgufJob *job, const int64_t g,
                                                                        const int64_t b, const int bb,
                                                                        const int from_memory) {
    const uint8_t *block = job->w + g * PACKED_COLUMNS * job->row_bytes + b * bb;
    if (from_memory) prefetch_ahead(block, bb, PACKED_GROUPS_PREFETCH_BLOCKS);
    return block;
}

/* Rows [m0, m0 + MR) of x's int8 block b, each 4-byte piece repeated across a vector, in the
 * order the packed int8 kernels take them: (lo t, hi t) for t = 0..3, a row's 8 after another's. */
static inline void widen_block(const GgufJob *job, const int64_t m0, const int MR, const int64_t b,
                               __m256i *wide) {
    for (int i = 0; i < MR; i++) {
        const int8_t *x = job->xq + (m0 + i) * job->K + b * 32;
        for (int t = 0; t < 4; t++) {
            wide[8 * i + 2 * t] = broadcast4(x + 4 * t);
            wide[8 * i + 2 * t + 1] = broadcast4(x + 16 + 4 * t);
        }
    }
}

/* Rows [m0, m0 + MR) of x (5 to PACKED_INT8_TILE) times groups [g0, g1) (at most
 * PACKED_GROUPS_AT_ONCE), with packed_int8's arithmetic (each output's sums in block order:
 * bit-equal), into the output. Block by block: x's block for the tile's rows is widened once
 * (widen_block); then each group's block is decoded once into eight registers and each row takes
 * its eight products from them and from the widened x in L1, its running sums in L1 too.
 *
 * Measured on SmolLM2's Q4_1 products (bench.bench_kernels_ab --product gguf, 2 threads, the
 * builds alternating in one process):
 * - Decoding each block once for the tile, not once for every 4 rows, with the rows' sums in L1
 *   rather than spilled registers: 0.73-0.91x the time at 256 rows.
 * - Widening x once for 16 groups: the kernel before broadcast each 4-byte piece of x again for
 *   every group, an instruction per multiply in a loop that runs at about three vector
 *   instructions a cycle. 0.84x the time at 2048 rows, 0.91x at 256, 0.89x at 64.
 * - One running sum for the eight products: summed as a tree (GCC's choice), they took eight
 *   registers and pushed d, the offset and madd's ones out to the stack.
 * At 4 rows packed_int8, its sums in registers through all the blocks, is the faster. */
static inline __attribute__((always_inline)) void packed_int8_groups(const int type, const GgufJob *job,
                                                                     const int64_t g0, const int64_t g1,
                                                                     const int64_t m0, const int MR) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type), qs = packed_values(type);
    const int from_memory = job->num_rows <= PACKED_INT8_TILE; /* one tile: no other reads these weights */
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i wide[PACKED_INT8_TILE * 8];
    GroupSums sums;
    zero_group_sums(sums, g0, g1, MR);
    for (int64_t b = 0; b < num_blocks; b++) {
        widen_block(job, m0, MR, b, wide);
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *block = group_block(job, g, b, bb, from_memory);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
            const __m256 offset = packed_offset(type, block, d);
            __m256i lo[4], hi[4];
            for (int t = 0; t < 4; t++) {
                const __m256i piece = _mm256_loadu_si256((const __m256i *)(block + qs + 32 * t));
                lo[t] = _mm256_and_si256(piece, low4);
                hi[t] = _mm256_and_si256(_mm256_srli_epi16(piece, 4), low4);
            }
            float *out = sums[g - g0];
            for (int i = 0; i < MR; i++) {
                const __m256i *x = wide + 8 * i;
                __m256i dot = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) { /* the empty asm: one running sum, not a tree (above) */
                    dot = packed_dot(dot, lo[t], x[2 * t]);
                    __asm__("" : "+x"(dot));
                    dot = packed_dot(dot, hi[t], x[2 * t + 1]);
                    __asm__("" : "+x"(dot));
                }
                const __m256 acc = _mm256_loadu_ps(out + i * PACKED_COLUMNS);
                _mm256_storeu_ps(out + i * PACKED_COLUMNS,
                                 packed_block_sum(acc, dot, d, offset, job, (m0 + i) * num_blocks + b));
            }
        }
    }
    store_group_sums(job, sums, g0, g1, m0, MR);
}

static void packed_int8_groups_q4_0(const GgufJob *job, int64_t g0, int64_t g1, int64_t m0, int MR) {
    packed_int8_groups(GGML_Q4_0, job, g0, g1, m0, MR);
}
static void packed_int8_groups_q4_1(const GgufJob *job, int64_t g0, int64_t g1, int64_t m0, int MR) {
    packed_int8_groups(GGML_Q4_1, job, g0, g1, m0, MR);
}
/* GGUF_FP32, Q8_0 packed: rows [m0, m0 + MR) of x (fp32) times the 8 columns of `group`, into
 * out[i * 8 + c]. Each k's eight weights are widened and scaled once for the tile, exactly (an
 * int8 times an fp16 scale fits fp32's mantissa), then one FMA per row; two sums per row, even
 * and odd k, to halve the latency chain. */
static inline __attribute__((always_inline)) void packed_q8_f32(const int type, const GgufJob *job,
                                                                const uint8_t *group, int64_t m0, const int MR,
                                                                float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type); /* type: Q8_0 */
    __m256 even[PACKED_TILE], odd[PACKED_TILE];
    for (int i = 0; i < MR; i++) even[i] = odd[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = group + b * bb, *q = block + 16;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const float *x = job->x + m0 * K + b * 32;
        for (int k = 0; k < 32; k += 2) {
            const __m256 w0 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k)))), d);
            const __m256 w1 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k + 8)))), d);
            for (int i = 0; i < MR; i++) {
                even[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * K + k), w0, even[i]);
                odd[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * K + k + 1), w1, odd[i]);
            }
        }
    }
    for (int i = 0; i < MR; i++) _mm256_storeu_ps(out + i * PACKED_COLUMNS, _mm256_add_ps(even[i], odd[i]));
}
/* GGUF_INT16: the 16 bytes of a packed Q8_0 block's weights k and k + 1 (8 columns each, k even)
 * reordered to column pairs (c, k), (c, k + 1): madd's operand order. */
static const int8_t Q8_PAIRS[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

/* GGUF_INT16, Q8_0 packed: rows [m0, m0 + MR) of x's int16 blocks times the 8 columns of `group`,
 * into out[i * 8 + c]. Each pair of k's eight columns is widened to int16 once for the tile;
 * madd sums a pair's two products per column, exactly, into the block's int32 sums (at most
 * 16 * 2 * 128 * 32767 < 2^31). Per block: acc = fma(float(sum), d * x_scale, acc). Against the
 * fp32 mode's kernel (49152x576, one thread, in a harness): 0.57x the time at one row from
 * memory, 0.42-0.53x at 4 to 16 rows. Tiles of one or two rows prefetch (packed_prefetch). */
static inline __attribute__((always_inline)) void packed_q8_int16(const int type, const GgufJob *job,
                                                                  const uint8_t *group, int64_t m0, const int MR,
                                                                  float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type); /* type: Q8_0 */
    const __m128i pairs = _mm_loadu_si128((const __m128i *)Q8_PAIRS);
    __m256 acc[PACKED_TILE];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = group + b * bb, *q = block + 16;
        if (MR <= PACKED_PREFETCH_ROWS) packed_prefetch(block, bb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const int16_t *x = job->x16 + m0 * K + b * 32;
        __m256i sums[PACKED_TILE];
        for (int i = 0; i < MR; i++) sums[i] = _mm256_setzero_si256();
#pragma GCC unroll 2 /* unrolled whole, GCC spilled the products to the stack to sum them later */
        for (int k = 0; k < 32; k += 2) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + 8 * k)), pairs));
            for (int i = 0; i < MR; i++) {
                int32_t two;
                memcpy(&two, x + i * K + k, sizeof two);
                sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(w, _mm256_set1_epi32(two)));
            }
        }
        for (int i = 0; i < MR; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]),
                                     _mm256_mul_ps(d, _mm256_set1_ps(job->x_scale[(m0 + i) * num_blocks + b])), acc[i]);
    }
    for (int i = 0; i < MR; i++) _mm256_storeu_ps(out + i * PACKED_COLUMNS, acc[i]);
}
/* Rows of x's int16 block b, each pair of values repeated across a vector (wide[16 * i + k / 2]
 * for k = 0, 2, ..., 30), for packed_q8_int16_groups. */
static inline void widen_block16(const GgufJob *job, const int64_t m0, const int MR, const int64_t b,
                                 __m256i *wide) {
    for (int i = 0; i < MR; i++) {
        const int16_t *x = job->x16 + (m0 + i) * job->K + b * 32;
        for (int k = 0; k < 32; k += 2) {
            int32_t two;
            memcpy(&two, x + k, sizeof two);
            wide[16 * i + k / 2] = _mm256_set1_epi32(two);
        }
    }
}

/* Rows whose sums one pass over a block keeps in registers: 8 took 0.83x the time of 4 at 16 rows
 * (bench.bench_kernels_ab --product gguf-head), 6 in between. */
#define Q8_INT16_ROWS 8

/* R rows (R <= Q8_INT16_ROWS, a constant) of packed_q8_int16_groups: one Q8_0 block of a group
 * times the rows' widened x, added to their sums out[i * 8 + c]. */
static inline __attribute__((always_inline)) void q8_int16_block_rows(const uint8_t *q, const __m256 d,
                                                                      const __m256i *wide, const float *x_scale,
                                                                      const int64_t scale_stride, const int R,
                                                                      float *out) {
    const __m128i pairs = _mm_loadu_si128((const __m128i *)Q8_PAIRS);
    __m256i dot[Q8_INT16_ROWS];
    for (int i = 0; i < R; i++) dot[i] = _mm256_setzero_si256();
    /* The empty asm keeps each row's sum in its register: without it GCC moved the sums, and the
     * products, through the stack (1.17x the time at 16 rows). */
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + 16 * k)), pairs));
        for (int i = 0; i < R; i++) {
            dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(w, wide[16 * i + k]));
            __asm__("" : "+x"(dot[i]));
        }
    }
    for (int i = 0; i < R; i++)
        _mm256_storeu_ps(out + i * PACKED_COLUMNS,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(d, _mm256_set1_ps(x_scale[i * scale_stride])),
                                         _mm256_loadu_ps(out + i * PACKED_COLUMNS)));
}

/* packed_q8_int16 (a Q8_0 lm_head) for 5 to PACKED_INT8_TILE rows times groups [g0, g1), the way
 * packed_int8_groups takes them: x's block widened once for all the groups, then for each group's
 * block up to Q8_INT16_ROWS rows at a time, each of its 16 int16 pieces widened once for them:
 * one madd (x from L1) and one add per row and pair of products, where packed_q8_int16 also
 * broadcasts x for each, and widens each piece again for every 4 rows. Same arithmetic
 * (bit-equal). SmolLM2's lm_head (49152 x 576), 2 threads (bench.bench_kernels_ab --product
 * gguf-head): 0.81-0.83x the time at 16 rows, 0.93-0.96x at 5 and 8, 0.94x at 64. */
static inline __attribute__((always_inline)) void packed_q8_int16_groups(const GgufJob *job, const int64_t g0,
                                                                         const int64_t g1, const int64_t m0,
                                                                         const int MR) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(GGML_Q8_0);
    const int from_memory = job->num_rows <= PACKED_INT8_TILE;
    __m256i wide[PACKED_INT8_TILE * 16];
    GroupSums sums;
    zero_group_sums(sums, g0, g1, MR);
    for (int64_t b = 0; b < num_blocks; b++) {
        widen_block16(job, m0, MR, b, wide);
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *block = group_block(job, g, b, bb, from_memory);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
            for (int i0 = 0; i0 < MR; i0 += Q8_INT16_ROWS) {
                const float *x_scale = job->x_scale + (m0 + i0) * num_blocks + b;
                float *out = sums[g - g0] + i0 * PACKED_COLUMNS;
                const __m256i *rows_wide = wide + 16 * i0;
                switch (MR - i0 < Q8_INT16_ROWS ? MR - i0 : Q8_INT16_ROWS) {
#define Q8_INT16_CASE(R) case R: q8_int16_block_rows(block + 16, d, rows_wide, x_scale, num_blocks, R, out); break;
                    Q8_INT16_CASE(8) Q8_INT16_CASE(7) Q8_INT16_CASE(6) Q8_INT16_CASE(5)
                    Q8_INT16_CASE(4) Q8_INT16_CASE(3) Q8_INT16_CASE(2) Q8_INT16_CASE(1)
#undef Q8_INT16_CASE
                }
            }
        }
    }
    store_group_sums(job, sums, g0, g1, m0, MR);
}
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_PAIR_KERNEL 1
/* AVX-512 with VNNI: two packed groups side by side (adjacent in memory), 16 columns to a 512-bit
 * vector, for tiles of 5 to PAIR_ROWS rows. The Q4 kernel keeps the tile's sums in registers
 * through all the blocks (16 accumulators beside 8 decoded pieces, d and the offset: about the 32
 * registers; two register tiles of 8 rows took 1.08x the time at 12 and 16 rows) and takes each row's x straight from its int8 blocks as 4-byte broadcasts: per
 * block a row costs 8 vpdpbusd and 4 float operations for 16 columns, where packed_int8_groups
 * spends 8 vpdpbusd, 4 float operations and a load and store of its sums on 8. The arithmetic is
 * packed_int8's and packed_q8_int16's, lane for lane (bit-equal: the integer sums are exact in any
 * order, so each row's sum runs as two chains). Tiles of a decode step (the weights streamed once)
 * prefetch as packed_int8 does.
 *
 * Measured on a Zen 4 (AVX-512 VNNI, 2 threads; bench.bench_kernels_ab, builds alternating in one
 * process, against the 256-bit kernels): SmolLM2's Q4_1 products 0.94x the time at 5 rows, 0.92x
 * at 8, 0.85x at 16, 0.86-0.88x at 256; its Q8_0 lm_head 0.86x at 5 rows, 0.82x at 8, 0.77x at 16,
 * 0.75x at 256. Without the prefetch, 8 rows took 1.07x; with x broadcast through a general
 * register (a memcpy to an int), the head at 16 rows 0.95x. At 2 to 4 rows the pair was slower
 * (1.2-1.6x), so packed_int8 keeps those. Zen 4 runs a 512-bit vpdpbusd or vpdpwssd at half the
 * rate of a 256-bit one (a 12-chain loop here: 0.27 against 0.14 ns), so the gain is the fewer
 * instructions around the dot products, not wider arithmetic. */
#define PAIR_ROWS 16
_Static_assert(PACKED_TILE < 5, "packed_int8 keeps tiles of 2-4 rows, faster there (above); the pair takes 5 or more");

static inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* Eight fp16 values at a and eight at b, as 16 floats. */
static inline __m512 load_pair_halves(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

/* The 4 bytes at p in every 32-bit lane, loaded straight into the vector (vpbroadcastd from
 * memory, a load): a memcpy to an int made GCC load 8 bytes into a general register and
 * broadcast from there, two transfers per load. */
static inline __m512i broadcast4_512(const void *p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

/* Block b of packed group g (bb bytes a block); the same block of group g + 1 lies one group's
 * bytes further. A decode step's tile (the weights streamed once) asks for both
 * PACKED_PREFETCH_BLOCKS ahead. */
static inline __attribute__((always_inline)) const uint8_t *pair_block(const GgufJob *job, const int64_t g,
                                                                       const int64_t b, const int bb) {
    const uint8_t *block = job->w + g * PACKED_COLUMNS * job->row_bytes + b * bb;
    if (job->num_rows <= PAIR_ROWS) {
        packed_prefetch(block, bb);
        packed_prefetch(block + PACKED_COLUMNS * job->row_bytes, bb);
    }
    return block;
}

/* Rows [m0, m0 + MR) of x's int8 blocks times groups g and g + 1, into out[i * 16 + c]. */
static inline __attribute__((always_inline)) void packed_int8_pair(const int type, const GgufJob *job,
                                                                   const int64_t g, const int64_t m0,
                                                                   const int MR, float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type), qs = packed_values(type);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[PAIR_ROWS];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *b0 = pair_block(job, g, b, bb), *b1 = b0 + PACKED_COLUMNS * job->row_bytes;
        const __m512 d = load_pair_halves(b0, b1);
        const __m512 offset = type == GGML_Q4_1 ? load_pair_halves(b0 + 16, b1 + 16)
                                                : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        __m512i lo[4], hi[4];
        for (int t = 0; t < 4; t++) {
            const __m512i piece = load_pair(b0 + qs + 32 * t, b1 + qs + 32 * t);
            lo[t] = _mm512_and_si512(piece, low4);
            hi[t] = _mm512_and_si512(_mm512_srli_epi16(piece, 4), low4);
        }
        for (int i = 0; i < MR; i++) {
            const int8_t *x = job->xq + (m0 + i) * K + b * 32;
            __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512(); /* two chains: exact ints */
            for (int t = 0; t < 4; t++) {
                low = _mm512_dpbusd_epi32(low, lo[t], broadcast4_512(x + 4 * t));
                high = _mm512_dpbusd_epi32(high, hi[t], broadcast4_512(x + 16 + 4 * t));
            }
            const __m512i dot = _mm512_add_epi32(low, high);
            const int64_t xb = (m0 + i) * num_blocks + b;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(job->x_scale[xb])), acc[i]);
            acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(job->x_sum[xb]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(out + i * 2 * PACKED_COLUMNS, acc[i]);
}

/* GGUF_INT16, Q8_0 packed: rows [m0, m0 + MR) of x's int16 blocks times groups g and g + 1, into
 * out[i * 16 + c]. Per block, each pair of k's 16 columns is widened to int16 once (one vector:
 * the Q8_PAIRS order in each group's half), then each row's block sum is 16 vpdpwssd with x's
 * pairs broadcast from memory: the exact int32 sums of packed_q8_int16's madd and add. */
static inline __attribute__((always_inline)) void packed_q8_int16_pair(const GgufJob *job, const int64_t g,
                                                                       const int64_t m0, const int MR,
                                                                       float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(GGML_Q8_0);
    const __m256i pairs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)Q8_PAIRS));
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(out + i * 2 * PACKED_COLUMNS, _mm512_setzero_ps());
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *b0 = pair_block(job, g, b, bb), *b1 = b0 + PACKED_COLUMNS * job->row_bytes;
        const __m512 d = load_pair_halves(b0, b1);
        __m512i w[16];
        for (int k = 0; k < 16; k++) {
            const __m256i both = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 16 + 16 * k))),
                _mm_loadu_si128((const __m128i *)(b1 + 16 + 16 * k)), 1);
            w[k] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(both, pairs));
        }
        for (int i = 0; i < MR; i++) {
            const int16_t *x = job->x16 + (m0 + i) * K + b * 32;
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512(); /* two chains: exact ints */
            for (int k = 0; k < 16; k += 2) {
                even = _mm512_dpwssd_epi32(even, w[k], broadcast4_512(x + 2 * k));
                odd = _mm512_dpwssd_epi32(odd, w[k + 1], broadcast4_512(x + 2 * k + 2));
            }
            const __m512i dot = _mm512_add_epi32(even, odd);
            float *row = out + i * 2 * PACKED_COLUMNS;
            _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                                  _mm512_mul_ps(d, _mm512_set1_ps(job->x_scale[(m0 + i) * num_blocks + b])),
                                                  _mm512_loadu_ps(row)));
        }
    }
}

/* Rows from which a Q8_0 lm_head's int16 product takes packed_q8_int16_pair. A Zen 4 runs a 512-bit
 * vpdpwssd at half rate, and there the 256-bit tiles of 2-4 rows stay (PACKED_TILE). A CPU with AMX
 * runs it at full rate: on a 2-core Sapphire Rapids-class Xeon (bench.bench_gguf --threads 2
 * --rows 2,3,4,5, SmolLM2's 49152 x 576 lm_head) the pair took 1.98 / 2.02 / 2.25 ms at 2 / 3 / 4
 * rows against 2.14 / 3.47 / 4.17 ms, and served GGUF c4 gave 179 / 164 tok/s against 155 / 142
 * (alternating). Same bits either way (test_gguf_kernels.py compares 4-row pieces with whole batches). */
static int64_t int16_pair_from_rows(void) {
    static _Atomic int64_t cached; /* 0 until a first call asks the CPU; every thread gets the same answer */
    int64_t rows = atomic_load_explicit(&cached, memory_order_relaxed);
    if (!rows) {
        rows = (rayllm_cpu_features() & CPU_AMX_INT8) ? 2 : PACKED_TILE + 1;
        atomic_store_explicit(&cached, rows, memory_order_relaxed);
    }
    return rows;
}

#define PAIR_CASE(T, R) case R: packed_int8_pair(T, job, g, m0, R, out); break;
#define PAIR_FUNCTION(T)                                                                                 \
    static void pair_##T(const GgufJob *job, int64_t g, int64_t m0, int MR, float *out) {               \
        switch (MR) {                                                                                    \
            PAIR_CASE(T, 16) PAIR_CASE(T, 15) PAIR_CASE(T, 14) PAIR_CASE(T, 13) PAIR_CASE(T, 12)         \
            PAIR_CASE(T, 11) PAIR_CASE(T, 10) PAIR_CASE(T, 9) PAIR_CASE(T, 8) PAIR_CASE(T, 7)            \
            PAIR_CASE(T, 6) PAIR_CASE(T, 5) PAIR_CASE(T, 4) PAIR_CASE(T, 3) PAIR_CASE(T, 2)              \
            PAIR_CASE(T, 1)                                                                              \
        }                                                                                                \
    }
PAIR_FUNCTION(GGML_Q4_0)
PAIR_FUNCTION(GGML_Q4_1)
#endif

#else /* portable C: the same sums and the same fmaf as the vector kernels */
static inline void packed_int8(const int type, const GgufJob *job, const uint8_t *group, int64_t m0, const int MR,
                               float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type), qs = packed_values(type);
    for (int i = 0; i < MR * PACKED_COLUMNS; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = group + b * bb;
        for (int c = 0; c < PACKED_COLUMNS; c++) {
            const float d = fp16_to_f32(block + 2 * c);
            const float offset = type == GGML_Q4_1 ? fp16_to_f32(block + 16 + 2 * c) : d * -8.0f;
            for (int i = 0; i < MR; i++) {
                const int8_t *x = job->xq + (m0 + i) * K + b * 32;
                int32_t sum = 0;
                for (int t = 0; t < 4; t++)
                    for (int l = 0; l < 4; l++) {
                        const uint8_t byte = block[qs + 32 * t + 4 * c + l];
                        sum += (byte & 0x0F) * x[4 * t + l] + (byte >> 4) * x[16 + 4 * t + l];
                    }
                const int64_t xb = (m0 + i) * num_blocks + b;
                float *acc = out + i * PACKED_COLUMNS + c;
                *acc = fmaf((float)sum, d * job->x_scale[xb], *acc);
                *acc = fmaf(offset, job->x_sum[xb], *acc);
            }
        }
    }
}

static inline void packed_q8_f32(const int type, const GgufJob *job, const uint8_t *group, int64_t m0, const int MR,
                                 float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type); /* type: Q8_0 */
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < PACKED_COLUMNS; c++) {
            float even = 0.0f, odd = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                const uint8_t *block = group + b * bb;
                const float d = fp16_to_f32(block + 2 * c), *x = job->x + (m0 + i) * K + b * 32;
                for (int k = 0; k < 32; k += 2) {
                    even = fmaf(x[k], (float)(int8_t)block[16 + 8 * k + c] * d, even);
                    odd = fmaf(x[k + 1], (float)(int8_t)block[16 + 8 * k + 8 + c] * d, odd);
                }
            }
            out[i * PACKED_COLUMNS + c] = even + odd;
        }
}

static inline void packed_q8_int16(const int type, const GgufJob *job, const uint8_t *group, int64_t m0,
                                   const int MR, float *out) {
    const int64_t K = job->K, num_blocks = K / 32;
    const int bb = PACKED_COLUMNS * block_bytes(type); /* type: Q8_0 */
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < PACKED_COLUMNS; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                const uint8_t *block = group + b * bb;
                const int16_t *x = job->x16 + (m0 + i) * K + b * 32;
                int32_t sum = 0;
                for (int k = 0; k < 32; k++) sum += (int32_t)(int8_t)block[16 + 8 * k + c] * x[k];
                acc = fmaf((float)sum, fp16_to_f32(block + 2 * c) * job->x_scale[(m0 + i) * num_blocks + b], acc);
            }
            out[i * PACKED_COLUMNS + c] = acc;
        }
}
#endif

/* NAME(job, group, m0, MR, sums): KERNEL(T, ...) with the tile height MR a compile-time constant. */
#define PACKED_CASE(KERNEL, T, R)                                                                        \
    case R: KERNEL(T, job, group, m0, R, sums); break;
#define PACKED_FUNCTION(NAME, KERNEL, T)                                                                 \
    static void NAME(const GgufJob *job, const uint8_t *group, int64_t m0, int MR, float *sums) {       \
        switch (MR) {                                                                                    \
            PACKED_CASE(KERNEL, T, 4)                                                                    \
            PACKED_CASE(KERNEL, T, 3)                                                                    \
            PACKED_CASE(KERNEL, T, 2)                                                                    \
            PACKED_CASE(KERNEL, T, 1)                                                                    \
        }                                                                                                \
    }
PACKED_FUNCTION(packed_GGML_Q4_0, packed_int8, GGML_Q4_0)
PACKED_FUNCTION(packed_GGML_Q4_1, packed_int8, GGML_Q4_1)
PACKED_FUNCTION(packed_GGML_Q8_0, packed_q8_f32, GGML_Q8_0)
PACKED_FUNCTION(packed_GGML_Q8_0_int16, packed_q8_int16, GGML_Q8_0)

/* Column c of a packed group back in the file's layout: its row_bytes into row (the inverse of
 * gguf_weight.pack_columns for one row). */
static void unpack_row(const uint8_t *group, int c, uint8_t *row, int type, int64_t row_bytes) {
    const int block = block_bytes(type), qs = packed_values(type), head = qs / PACKED_COLUMNS;
    for (int64_t b = 0; b < row_bytes / block; b++) {
        const uint8_t *packed = group + b * PACKED_COLUMNS * block;
        uint8_t *out = row + b * block;
        memcpy(out, packed + 2 * c, 2);                              /* d */
        if (type == GGML_Q8_0)                                       /* weight k of column c at 8k + c */
            for (int k = 0; k < 32; k++) out[2 + k] = packed[16 + 8 * k + c];
        else {
            if (head == 4) memcpy(out + 2, packed + 16 + 2 * c, 2);  /* Q4_1's m */
            for (int t = 0; t < 4; t++) memcpy(out + head + 4 * t, packed + qs + 32 * t + 4 * c, 4);
        }
    }
}

/* Rows [m0, m1) of packed group g (output columns from g * PACKED_COLUMNS), a tile at a time.
 * local: the job with the group unpacked into local->w, for a type and mode without a packed
 * kernel (packed_kernel), or NULL. */
static void packed_group(const GgufJob *job, const GgufJob *local, int64_t g, int64_t m0, int64_t m1, int tile) {
    const uint8_t *group = job->w + g * PACKED_COLUMNS * job->row_bytes;
    const int64_t n0 = g * PACKED_COLUMNS;
    for (; m0 < m1; m0 += tile) {
        const int rows = m1 - m0 < tile ? (int)(m1 - m0) : tile;
        float sums[PACKED_INT8_TILE * PACKED_COLUMNS];
        if (local)
            columns_function(job->type)(local, 0, PACKED_COLUMNS, m0, rows, sums);
        else if (job->type == GGML_Q8_0 && job->mode == GGUF_INT16)
            packed_GGML_Q8_0_int16(job, group, m0, rows, sums);
        else if (job->type == GGML_Q8_0)
            packed_GGML_Q8_0(job, group, m0, rows, sums);
#ifndef RAYLLM_HAS_AVX2 /* the portable packed_int8 takes any rows; the AVX2 one at most PACKED_TILE (packed_columns) */
        else if (rows > PACKED_TILE)
            packed_int8(job->type, job, group, m0, rows, sums);
#endif
        else if (job->type == GGML_Q4_1)
            packed_GGML_Q4_1(job, group, m0, rows, sums);
        else
            packed_GGML_Q4_0(job, group, m0, rows, sums);
        store_sums(job, n0, n0 + PACKED_COLUMNS, m0, rows, sums, local ? COLUMNS_PER_ITEM : PACKED_COLUMNS);
    }
}

#ifdef RAYLLM_HAS_AVX2
/* Rows [m0, m0 + rows) of a packed Q4 int8 or Q8_0 int16 product through groups [g0, g1) (at
 * most PACKED_GROUPS_AT_ONCE): past PACKED_TILE rows the groups' kernels, else each group's
 * register tile. */
static void tile_through_groups(const GgufJob *job, const int64_t g0, const int64_t g1, const int64_t m0,
                                const int rows, const int tile) {
    if (rows <= PACKED_TILE)
        for (int64_t g = g0; g < g1; g++) packed_group(job, NULL, g, m0, m0 + rows, tile);
    else if (job->type == GGML_Q8_0)
        packed_q8_int16_groups(job, g0, g1, m0, rows);
    else if (job->type == GGML_Q4_1)
        packed_int8_groups_q4_1(job, g0, g1, m0, rows);
    else
        packed_int8_groups_q4_0(job, g0, g1, m0, rows);
}
#endif

/* Rows of x that an item takes through all its groups before the next rows: about
 * PACKED_CHUNK_BYTES of x (whole tiles), which stay in L2 from one group to the next beside the
 * item's weights. Each group over every row instead read all of x again for each group: at 2048
 * rows (a prompt step of 8 x 256 tokens) a megabyte or more a group, from L3. */
#define PACKED_CHUNK_BYTES (128 * 1024)

/* Item `item`: groups [item * span, (item + 1) * span) of PACKED_COLUMNS columns, every row, in
 * chunks of rows. A type and mode without a packed kernel runs the file layout's kernel on each
 * group unpacked into a buffer of the item's. */
static void packed_columns(void *context, int64_t item) {
    const GgufJob *job = context;
    const int64_t groups = job->N / PACKED_COLUMNS;
    const int64_t end = (item + 1) * job->span < groups ? (item + 1) * job->span : groups;
    uint8_t *unpacked = job->unpacked ? job->unpacked + item * PACKED_COLUMNS * job->row_bytes : NULL;
    GgufJob local = *job; /* for the file layout's kernel: its weight the unpacked group */
    local.w = unpacked;
    const int tile = unpacked || job->type == GGML_Q8_0 ? PACKED_TILE : PACKED_INT8_TILE;
#ifdef RAYLLM_HAS_AVX2
    /* Q4_0/Q4_1 int8 and Q8_0 int16 past PACKED_TILE rows: x's tile (16 rows) and the item's
     * weights stay in cache from one group to the next. */
    const int int16 = job->type == GGML_Q8_0 && job->mode == GGUF_INT16;
#ifdef HAVE_PAIR_KERNEL
    const int64_t first_pair_rows = int16 ? int16_pair_from_rows() : PACKED_TILE + 1;
#else
    const int64_t first_pair_rows = PACKED_TILE + 1;
#endif
    if (!unpacked && (job->type != GGML_Q8_0 || int16) && job->num_rows >= first_pair_rows) {
#ifdef HAVE_PAIR_KERNEL
        /* two groups at a time through all the blocks; an odd last group through the 256-bit kernels */
        for (int64_t m0 = 0; m0 < job->num_rows; m0 += PAIR_ROWS) {
            const int rows = job->num_rows - m0 < PAIR_ROWS ? (int)(job->num_rows - m0) : PAIR_ROWS;
            int64_t g = item * job->span;
            for (; g + 1 < end; g += 2) {
                float sums[PAIR_ROWS * 2 * PACKED_COLUMNS];
                if (int16)
                    packed_q8_int16_pair(job, g, m0, rows, sums);
                else if (job->type == GGML_Q4_1)
                    pair_GGML_Q4_1(job, g, m0, rows, sums);
                else
                    pair_GGML_Q4_0(job, g, m0, rows, sums);
                store_sums(job, g * PACKED_COLUMNS, (g + 2) * PACKED_COLUMNS, m0, rows, sums, 2 * PACKED_COLUMNS);
            }
            if (g < end) tile_through_groups(job, g, g + 1, m0, rows, tile);
        }
#else /* a tile of rows through PACKED_GROUPS_AT_ONCE groups at a time */
        for (int64_t m0 = 0; m0 < job->num_rows; m0 += PACKED_INT8_TILE) {
            const int rows = job->num_rows - m0 < PACKED_INT8_TILE ? (int)(job->num_rows - m0) : PACKED_INT8_TILE;
            for (int64_t g0 = item * job->span; g0 < end; g0 += PACKED_GROUPS_AT_ONCE)
                tile_through_groups(job, g0, g0 + PACKED_GROUPS_AT_ONCE < end ? g0 + PACKED_GROUPS_AT_ONCE : end, m0,
                                    rows, tile);
        }
#endif
        return;
    }
#endif
    const int64_t x_row_bytes = job->K * (job->mode == GGUF_INT8 ? 1 : job->mode == GGUF_INT16 ? 2 : 4);
    const int64_t chunk_tiles = PACKED_CHUNK_BYTES / (x_row_bytes * tile);
    const int64_t chunk = (chunk_tiles > 1 ? chunk_tiles : 1) * tile;
    for (int64_t m0 = 0; m0 < job->num_rows; m0 += chunk) {
        const int64_t m1 = m0 + chunk < job->num_rows ? m0 + chunk : job->num_rows;
        for (int64_t g = item * job->span; g < end; g++) {
            for (int c = 0; unpacked && c < PACKED_COLUMNS; c++)
                unpack_row(job->w + g * PACKED_COLUMNS * job->row_bytes, c, unpacked + c * job->row_bytes, job->type,
                           job->row_bytes);
            packed_group(job, unpacked ? &local : NULL, g, m0, m1, tile);
        }
    }
}

typedef struct {
    const void *x;
    int8_t *xq;
    int16_t *x16;
    float *x_scale, *x_sum, *x_f32;
    int64_t num_rows, K;
    int dtype;
} PrepareJob;

/* Rows of x made ready for the mode: quantized to int8 or int16 blocks, or (bf16 x, GGUF_FP32) widened to fp32. */
static void prepare_rows(void *context, int64_t item) {
    const PrepareJob *p = context;
    const int64_t elem = p->dtype == DTYPE_BF16 ? 2 : 4, end = (item + 1) * ROWS_PER_QUANT_ITEM;
    for (int64_t m = item * ROWS_PER_QUANT_ITEM; m < p->num_rows && m < end; m++) {
        const void *row = (const char *)p->x + m * p->K * elem;
        if (p->x16)
            quantize_row16(row, p->dtype, p->K, p->x16 + m * p->K, p->x_scale + m * (p->K / 32));
        else if (p->xq)
            quantize_row(row, p->dtype, p->K, p->xq + m * p->K, p->x_scale + m * (p->K / 32), p->x_sum + m * (p->K / 32));
        else
            for (int64_t k = 0; k < p->K; k++) p->x_f32[m * p->K + k] = load_element(row, k, p->dtype);
    }
}

/* Every row of the job prepared: on the pool from 64 rows, on the caller's thread below. */
static void prepare_all(PrepareJob *prepare, int32_t num_threads) {
    rayllm_parallel_for((prepare->num_rows + ROWS_PER_QUANT_ITEM - 1) / ROWS_PER_QUANT_ITEM,
                        prepare->num_rows >= 64 ? num_threads : 1, prepare_rows, prepare);
}

/* For gguf_amx.c: x's rows quantized as GGUF_INT8 quantizes them (xq [num_rows, K], x_scale and
 * x_sum [num_rows, K / 32]). */
void rayllm_gguf_quantize_rows(const void *x, int32_t dtype, int64_t num_rows, int64_t K, int8_t *xq, float *x_scale,
                               float *x_sum, int32_t num_threads) {
    PrepareJob prepare = {x, xq, NULL, x_scale, x_sum, NULL, num_rows, K, dtype};
    prepare_all(&prepare, num_threads);
}

/* For gguf_amx.c: x's rows quantized as GGUF_INT16 quantizes them (x16 [num_rows, K], x_scale
 * [num_rows, K / 32]). */
void rayllm_gguf_quantize_rows16(const void *x, int32_t dtype, int64_t num_rows, int64_t K, int16_t *x16,
                                 float *x_scale, int32_t num_threads) {
    PrepareJob prepare = {x, NULL, x16, x_scale, NULL, NULL, num_rows, K, dtype};
    prepare_all(&prepare, num_threads);
}

/* x: [num_rows, K] in dtype; w: [N, K / weights-per-block * block bytes] GGUF blocks of ggml_type
 * (with GGUF_PACKED: Q4_0, Q4_1 or Q8_0 repacked, N a multiple of PACKED_COLUMNS); bias: [N] in dtype
 * or NULL; out: [num_rows, N] in out_dtype. Returns 1 for a type or mode this file does not have,
 * 2 for bad sizes (K must be a whole number of the type's blocks), 3 when scratch cannot be
 * allocated. */
int rayllm_gguf_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows, int64_t N,
                     int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype, int32_t mode,
                     int32_t num_threads) {
    const int packed = (ggml_type & GGUF_PACKED) != 0;
    ggml_type &= ~GGUF_PACKED;
    if (!columns_function(ggml_type) || (mode != GGUF_FP32 && mode != GGUF_INT8 && mode != GGUF_INT16)) return 1;
    if (mode == GGUF_INT16 && !(packed && ggml_type == GGML_Q8_0)) return 1;
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || (out_dtype != DTYPE_F32 && out_dtype != DTYPE_BF16)) return 1;
    if (packed && !packable(ggml_type)) return 1;
    const int64_t block_weights = 32 * block_subs(ggml_type);
    if (num_rows < 1 || N < 1 || K < block_weights || K % block_weights) return 2;
    if (packed && N % PACKED_COLUMNS) return 2;
    const int threads = num_threads > 1 && (N >= 64 || num_rows >= 64) ? num_threads : 1;
    GgufJob job = {NULL, NULL, NULL, NULL, NULL, w, bias, out, num_rows, N, K, K / block_weights * block_bytes(ggml_type),
                   ggml_type, dtype, out_dtype, mode};
    PrepareJob prepare = {x, NULL, NULL, NULL, NULL, NULL, num_rows, K, dtype};
    void *scratch = NULL;
    if (mode == GGUF_INT8) {
        scratch = malloc((size_t)(num_rows * K + 2 * num_rows * (K / 32) * (int64_t)sizeof(float)));
        if (!scratch) return 3;
        prepare.x_scale = scratch;
        prepare.x_sum = prepare.x_scale + num_rows * (K / 32);
        prepare.xq = (int8_t *)(prepare.x_sum + num_rows * (K / 32));
        job.xq = prepare.xq, job.x_scale = prepare.x_scale, job.x_sum = prepare.x_sum;
    } else if (mode == GGUF_INT16) {
        scratch = malloc((size_t)(num_rows * K * (int64_t)sizeof(int16_t) + num_rows * (K / 32) * (int64_t)sizeof(float)));
        if (!scratch) return 3;
        prepare.x_scale = scratch;
        prepare.x16 = (int16_t *)(prepare.x_scale + num_rows * (K / 32));
        job.x16 = prepare.x16, job.x_scale = prepare.x_scale;
    } else if (dtype == DTYPE_BF16) {
        scratch = malloc((size_t)(num_rows * K) * sizeof(float));
        if (!scratch) return 3;
        prepare.x_f32 = scratch;
        job.x = prepare.x_f32;
    } else {
        job.x = x;
    }
    if (scratch)
        prepare_all(&prepare, threads);
    if (packed) {
        /* Items of several 8-column groups, about 4 a thread at any number of rows: longer runs of
         * contiguous blocks for each thread to stream than 8 a thread (one row, 2 threads, SmolLM2's
         * Q4_1 shapes streamed from memory: 5-12% less time), and still spare items for a thread
         * whose partner the OS has descheduled. */
        const int64_t groups = N / PACKED_COLUMNS;
        job.span = groups / (threads * 4) > 1 ? groups / (threads * 4) : 1;
        const int64_t items = (groups + job.span - 1) / job.span;
        if (!packed_kernel(ggml_type, mode) &&
            !(job.unpacked = malloc((size_t)(items * PACKED_COLUMNS * job.row_bytes)))) {
            free(scratch);
            return 3;
        }
        rayllm_parallel_for(items, threads, packed_columns, &job);
        free(job.unpacked);
        free(scratch);
        return 0;
    }
    /* One row tile: about 8 items per thread. An item of one 16-column group is then about a
     * microsecond, and claiming it (two atomics on the pool's shared line) cost a fair part of
     * that: a one-row decode step of the default model, 2 threads, 13.0 -> 10.8 and 13.3 -> 10.3 ms
     * (runs alternating). More rows keep one group per item (16 rows measured 4% slower coarser). */
    const int64_t groups = (N + COLUMNS_PER_ITEM - 1) / COLUMNS_PER_ITEM;
    job.span = num_rows <= TILE_ROWS && groups / (threads * 8) > 1 ? groups / (threads * 8) : 1;
    rayllm_parallel_for((groups + job.span - 1) / job.span, threads, gguf_columns, &job);
    free(scratch);
    return 0;
}

/* ------------------------------------------------------------ whole weights, dequantized to fp32 */

typedef struct {
    const uint8_t *w;
    const int64_t *index; /* the rows to dequantize, or NULL: all N */
    float *out;
    int64_t N, K, row_bytes, num_out;
    int type, packed;
} DequantizeJob;

#define ROWS_PER_DEQUANTIZE_ITEM 16

/* Out rows of one item, each sub-block widened by sub_weights, as the fp32 mode widens it; a
 * packed weight's row first unpacked from its group into the file's layout. */
static void dequantize_rows(void *context, int64_t item) {
    const DequantizeJob *d = context;
    const int type = d->type, subs = block_subs(type);
    uint8_t unpacked[d->packed ? d->row_bytes : 1];
    const int64_t end = (item + 1) * ROWS_PER_DEQUANTIZE_ITEM < d->num_out ? (item + 1) * ROWS_PER_DEQUANTIZE_ITEM
                                                                          : d->num_out;
    for (int64_t i = item * ROWS_PER_DEQUANTIZE_ITEM; i < end; i++) {
        const int64_t n = d->index ? d->index[i] : i;
        const uint8_t *row = d->w + n * d->row_bytes;
        if (d->packed) {
            unpack_row(d->w + (n - n % PACKED_COLUMNS) * d->row_bytes, (int)(n % PACKED_COLUMNS), unpacked, type,
                       d->row_bytes);
            row = unpacked;
        }
        float *out = d->out + i * d->K;
        for (int64_t sb = 0; sb < d->K / 32; sb++) {
            const uint8_t *block = row + sb / subs * block_bytes(type);
            const int j = (int)(sb % subs);
            float *o = out + sb * 32;
#ifdef RAYLLM_HAS_AVX2
            __m256 w[4];
            sub_weights(type, block, j, w);
            for (int t = 0; t < 4; t++) _mm256_storeu_ps(o + 8 * t, w[t]);
#else
            sub_weights(type, block, j, o);
#endif
        }
    }
}

/* w: [N, row bytes] GGUF blocks of ggml_type (packed or not) -> out: [num_out, K] fp32, rows
 * index[0..num_out) of the weight (index NULL: every row, num_out = N), the values the fp32 mode
 * multiplies by (the gguf package's dequantization, up to fp32 rounding of scale * q + offset).
 * Returns 1 for a type this file does not have, 2 for bad sizes or an index outside [0, N). */
int rayllm_gguf_dequantize(const uint8_t *w, const int64_t *index, int64_t num_out, float *out, int64_t N, int64_t K,
                           int32_t ggml_type, int32_t num_threads) {
    const int packed = (ggml_type & GGUF_PACKED) != 0;
    ggml_type &= ~GGUF_PACKED;
    if (!columns_function(ggml_type) || (packed && !packable(ggml_type))) return 1;
    const int64_t block_weights = 32 * block_subs(ggml_type);
    if (N < 1 || K < block_weights || K % block_weights || (packed && N % PACKED_COLUMNS)) return 2;
    if (!index) num_out = N;
    for (int64_t i = 0; index && i < num_out; i++)
        if (index[i] < 0 || index[i] >= N) return 2;
    if (num_out < 1) return 0;
    DequantizeJob job = {w, index, out, N, K, K / block_weights * block_bytes(ggml_type), num_out, ggml_type, packed};
    rayllm_parallel_for((num_out + ROWS_PER_DEQUANTIZE_ITEM - 1) / ROWS_PER_DEQUANTIZE_ITEM, num_threads,
                        dequantize_rows, &job);
    return 0;
}

/* ------------------------------------------------ a group of columns as bf16 panels (amx.c's) */

/* ggml_type's (with GGUF_PACKED) bytes per row of K weights; -1 for a type this file does not
 * have, -2 for K not a whole number of its blocks or N not of its packed groups. */
int64_t rayllm_gguf_row_bytes(int32_t ggml_type, int64_t N, int64_t K) {
    const int packed = (ggml_type & GGUF_PACKED) != 0;
    const int type = ggml_type & ~GGUF_PACKED;
    if (!columns_function(type) || (packed && !packable(type))) return -1;
    const int64_t block_weights = 32 * block_subs(type);
    if (N < 1 || K < block_weights || K % block_weights || (packed && N % PACKED_COLUMNS)) return -2;
    return K / block_weights * block_bytes(type);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* Block b of column c of a packed group, back in the file's layout (unpack_row's, one block). */
static inline const uint8_t *file_block(const uint8_t *group, int c, int64_t b, int type, uint8_t *out) {
    const int block = block_bytes(type), qs = packed_values(type), head = qs / PACKED_COLUMNS;
    const uint8_t *packed = group + b * PACKED_COLUMNS * block;
    memcpy(out, packed + 2 * c, 2);
    if (type == GGML_Q8_0)
        for (int k = 0; k < 32; k++) out[2 + k] = packed[16 + 8 * k + c];
    else {
        if (head == 4) memcpy(out + 2, packed + 16 + 2 * c, 2);
        for (int t = 0; t < 4; t++) memcpy(out + head + 4 * t, packed + qs + 32 * t + 4 * c, 4);
    }
    return out;
}

/* r[i] lane j <- r[j] lane i, for 16 x 16 dwords. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + s] now holds, in each 128-bit lane L, dwords s of rows 4q..4q+3 of lane L's columns 4L.. */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);      /* lanes 0, 2 of r[i], then of r[4 + i] */
        t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);  /* lanes 1, 3 */
        t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

/* A packed Q4_0/Q4_1 group's 8 columns into half `half` (columns 8 half ..) of a bf16 panel
 * [K / 2][16][2]: per block, each 32-byte piece t of 4-bit values widens to weights 4t..4t+3 (low
 * nibbles) and 16+4t..16+4t+3 (high) of the 8 columns, scaled by fma(q, d, offset) (sub_weights'
 * values: q d is exact), rounded to bf16 in pairs of k, each pair of lines stored in two halves. */
static void packed_q4_bf16_panel(const uint8_t *group, int type, int64_t K, int half, uint16_t *panel) {
    const int bb = PACKED_COLUMNS * block_bytes(type), qs = packed_values(type);
    const __m512i low_columns = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i high_columns = _mm512_add_epi32(low_columns, _mm512_set1_epi32(4));
    const __m512i even_then_odd = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t *block = group + b * bb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const __m512 d8 = _mm512_castps256_ps512(d), offset8 = _mm512_castps256_ps512(packed_offset(type, block, d));
        const __m512 d_lo = _mm512_permutexvar_ps(low_columns, d8), d_hi = _mm512_permutexvar_ps(high_columns, d8);
        const __m512 o_lo = _mm512_permutexvar_ps(low_columns, offset8);
        const __m512 o_hi = _mm512_permutexvar_ps(high_columns, offset8);
        uint16_t *lines = panel + b * 16 * 32 + half * 16; /* line j of the block at lines + 32 j */
        for (int t = 0; t < 4; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + qs + 32 * t));
            const __m256i nibbles[2] = {_mm256_and_si256(raw, low4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4)};
            for (int h = 0; h < 2; h++) { /* low nibbles: pairs 2t, 2t + 1; high: 8 + 2t, 9 + 2t */
                const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(nibbles[h])));
                const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(nibbles[h], 1)));
                const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q1, d_hi, o_hi),
                                                                   _mm512_fmadd_ps(q0, d_lo, o_lo));
                const __m512i by_line = _mm512_permutexvar_epi32(even_then_odd, pairs); /* column c's pair */
                uint16_t *line = lines + (8 * h + 2 * t) * 32;
                _mm256_storeu_si256((__m256i *)line, _mm512_castsi512_si256(by_line));
                _mm256_storeu_si256((__m256i *)(line + 32), _mm512_extracti64x4_epi64(by_line, 1));
            }
        }
    }
}

/* Columns [n0, n0 + 32) of w ([N, row_bytes] blocks of ggml_type, GGUF_PACKED or not) as two bf16
 * panels [2][K / 2][16][2] (panel_avx512.c's layout), zeros past N: each weight the fp32 value
 * the fp32 mode multiplies by (sub_weights), rounded to bf16 (nearest even). */
void rayllm_gguf_bf16_panels(const uint8_t *w, int32_t ggml_type, int64_t row_bytes, int64_t N, int64_t K, int64_t n0,
                             uint16_t *out) {
    const int packed = (ggml_type & GGUF_PACKED) != 0, type = ggml_type & ~GGUF_PACKED, subs = block_subs(type);
    const int64_t lines = K / 2; /* a panel's 64-byte lines */
    if (packed && (type == GGML_Q4_0 || type == GGML_Q4_1) && n0 + 32 <= N) {
        for (int g = 0; g < 4; g++)
            packed_q4_bf16_panel(w + (n0 + 8 * g) * row_bytes, type, K, g & 1, out + (g / 2) * lines * 32);
        return;
    }
    uint8_t unpacked[256];
    for (int p = 0; p < 2; p++) {
        uint16_t *panel = out + p * lines * 32;
        for (int64_t sb = 0; sb < K / 32; sb++) {
            __m512i r[16];
            for (int c = 0; c < 16; c++) {
                const int64_t n = n0 + 16 * p + c;
                if (n >= N) {
                    r[c] = _mm512_setzero_si512();
                    continue;
                }
                const int64_t b = sb / subs;
                const uint8_t *block = packed ? file_block(w + (n - n % PACKED_COLUMNS) * row_bytes,
                                                           (int)(n % PACKED_COLUMNS), b, type, unpacked)
                                              : w + n * row_bytes + b * block_bytes(type);
                __m256 v[4];
                sub_weights(type, block, (int)(sb % subs), v);
                const __m512 lo = _mm512_insertf32x8(_mm512_castps256_ps512(v[0]), v[1], 1);
                const __m512 hi = _mm512_insertf32x8(_mm512_castps256_ps512(v[2]), v[3], 1);
                r[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* dword j: weights 2j, 2j + 1 */
            }
            transpose16_epi32(r); /* r[j]: pair j of the 16 columns */
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(panel + (sb * 16 + j) * 32, r[j]);
        }
    }
}
#endif
