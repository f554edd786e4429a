/* The elementwise work of a decoder layer, fused into one pass each, and a small-batch
 * matrix-vector product (the lm_head of a decode step).
 *
 *   rayllm_add_rms_norm   residual += delta (optional); out = rms_norm(residual) * weight
 *   rayllm_rope           rotate q and k inside the fused qkv rows (rotate_half convention)
 *   rayllm_gated_mul      out = act(gate) * up, gate and up the two halves of each row
 *   rayllm_gemv           out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for a few rows m
 *
 * Tensors are fp32 or bf16 (dtype 0 / 1), one dtype per call; arithmetic is fp32 and bf16
 * results are rounded to nearest even once, at the end. Rows are contiguous unless a stride
 * is given. Each call splits its rows (or output columns) over the OpenMP threads it is given,
 * the elementwise ones only from 64 rows on (a decode step's few rows cost less than waking a
 * sleeping thread).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "entry_points.h"
#include "simd.h"

#define MAX_WIDTH 16384 /* hidden or intermediate size, at most (one row of fp32 scratch per thread) */

/* One row of add_rms_norm; returns nothing, writes residual (the sum) and out. */
static void add_rms_norm_row(void *residual, const void *delta, const void *weight, void *out, int64_t hidden,
                             float eps, int dtype, int out_dtype) {
    const int bf16 = dtype == DTYPE_BF16, out_bf16 = out_dtype == DTYPE_BF16;
    const int64_t elem = bf16 ? 2 : 4, out_elem = out_bf16 ? 2 : 4;
    if (!weight) { /* the add alone: a layer whose branch reads the residual stream unnormed (OLMo 2) */
        if (delta)
            for (int64_t i = 0; i < hidden; i++) {
                const float sum = load_element(residual, i, dtype) + load_element(delta, i, dtype);
                store_element(residual, i, bf16 ? bf16_to_f32(f32_to_bf16(sum)) : sum, dtype);
            }
        return;
    }
    float sum_squares = 0.0f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 squares = _mm512_setzero_ps();
    for (; i + 16 <= hidden; i += 16) {
        char *r = (char *)residual + i * elem;
        __m512 x = load16(r, bf16);
        if (delta) {
            x = _mm512_add_ps(x, load16((const char *)delta + i * elem, bf16));
            if (bf16) x = round_bf16(x); /* a bf16 model's residual stream is bf16 */
            store16(r, x, bf16);
        }
        squares = _mm512_fmadd_ps(x, x, squares);
    }
    sum_squares = _mm512_reduce_add_ps(squares);
#elif defined(RAYLLM_AVX2)
    __m256 squares = _mm256_setzero_ps();
    for (; i + 8 <= hidden; i += 8) {
        char *r = (char *)residual + i * elem;
        __m256 x = load8(r, bf16);
        if (delta) {
            x = _mm256_add_ps(x, load8((const char *)delta + i * elem, bf16));
            if (bf16) x = round8_bf16(x);
            store8(r, x, bf16);
        }
        squares = _mm256_fmadd_ps(x, x, squares);
    }
    sum_squares = hsum8(squares);
#endif
    for (; i < hidden; i++) {
        float x = load_element(residual, i, dtype);
        if (delta) {
            const float sum = x + load_element(delta, i, dtype);
            x = bf16 ? bf16_to_f32(f32_to_bf16(sum)) : sum;
            store_element(residual, i, x, dtype);
        }
        sum_squares += x * x;
    }
    const float inv_rms = 1.0f / sqrtf(sum_squares / (float)hidden + eps);
    i = 0;
#ifdef __AVX512F__
    const __m512 scale = _mm512_set1_ps(inv_rms);
    for (; i + 16 <= hidden; i += 16) {
        const __m512 x = load16((const char *)residual + i * elem, bf16);
        store16((char *)out + i * out_elem, _mm512_mul_ps(_mm512_mul_ps(x, scale), load16((const char *)weight + i * elem, bf16)),
                out_bf16);
    }
#elif defined(RAYLLM_AVX2)
    const __m256 scale = _mm256_set1_ps(inv_rms);
    for (; i + 8 <= hidden; i += 8) {
        const __m256 x = load8((const char *)residual + i * elem, bf16);
        store8((char *)out + i * out_elem, _mm256_mul_ps(_mm256_mul_ps(x, scale), load8((const char *)weight + i * elem, bf16)),
               out_bf16);
    }
#endif
    for (; i < hidden; i++)
        store_element(out, i, load_element(residual, i, dtype) * inv_rms * load_element(weight, i, dtype), out_dtype);
}

/* The row-wise ops (norms, rope, silu) over many rows run on the same thread pool as the
 * products and attention (thread_pool.c), in ranges of ROWS_PER_ITEM rows claimed as threads
 * come free; a few rows run on the caller alone. They used OpenMP: in a prefill step through
 * the C forward, OpenMP's team and our pool's spinning helper then fought over the second core
 * at every op (perf: 18% of a 2048-token step in libgomp). Each row is computed the same way
 * on any thread, so results do not change. */
#define ROWS_PER_ITEM 16
#define MIN_PARALLEL_ROWS 64

typedef struct {
    void (*row)(const void *job, int64_t t);
    const void *job;
    int64_t num_rows;
} RowsJob;

static void rows_item(void *context, int64_t item) {
    const RowsJob *rows = context;
    const int64_t t1 = (item + 1) * ROWS_PER_ITEM < rows->num_rows ? (item + 1) * ROWS_PER_ITEM : rows->num_rows;
    for (int64_t t = item * ROWS_PER_ITEM; t < t1; t++) rows->row(rows->job, t);
}

static void for_each_row(void (*row)(const void *, int64_t), const void *job, int64_t num_rows, int32_t num_threads) {
    RowsJob rows = {row, job, num_rows};
    const int threads = num_rows >= MIN_PARALLEL_ROWS && num_threads > 1 ? num_threads : 1;
    rayllm_parallel_for((num_rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM, threads, rows_item, &rows);
}

/* residual[t] += delta[t] (when delta is not NULL); out[t] = residual[t] / rms(residual[t]) * weight,
 * or, when weight is NULL, the add alone (out is not written). out may be residual (a norm in place).
 * In bf16 the sum is rounded to bf16 before it is normalised, as a bf16 model computes it. */
typedef struct {
    void *residual, *out;
    const void *delta, *weight;
    int64_t hidden;
    float eps;
    int32_t dtype, out_dtype;
} NormJob;

static void norm_row(const void *context, int64_t t) {
    const NormJob *j = context;
    const int64_t bytes = j->hidden * (j->dtype == DTYPE_BF16 ? 2 : 4);
    const int64_t out_bytes = j->hidden * (j->out_dtype == DTYPE_BF16 ? 2 : 4);
    add_rms_norm_row((char *)j->residual + t * bytes, j->delta ? (const char *)j->delta + t * bytes : NULL, j->weight,
                     (char *)j->out + t * out_bytes, j->hidden, j->eps, j->dtype, j->out_dtype);
}

int rayllm_add_rms_norm(void *residual, const void *delta, const void *weight, void *out, int64_t num_rows,
                        int64_t hidden, float eps, int32_t dtype, int32_t num_threads) {
    return rayllm_add_rms_norm_to(residual, delta, weight, out, num_rows, hidden, eps, dtype, dtype, num_threads);
}

/* The same with out in out_dtype (an fp32 step's normed x in bf16 for a product that rounds its x
 * to bf16 anyway: forward.c); out_dtype is dtype where out is residual. */
int rayllm_add_rms_norm_to(void *residual, const void *delta, const void *weight, void *out, int64_t num_rows,
                           int64_t hidden, float eps, int32_t dtype, int32_t out_dtype, int32_t num_threads) {
    const NormJob job = {residual, out, delta, weight, hidden, eps, dtype, out_dtype};
    for_each_row(norm_row, &job, num_rows, num_threads);
    return 0;
}

typedef struct {
    void *qkv;
    const int64_t *positions;
    const float *cos, *sin;
    int64_t num_heads, num_kv_heads, head_dim, rotary_dim;
    int32_t dtype;
} RopeJob;

/* One rotated value: x cos + swapped sin, the product by sin rounded first and the rest one fma,
 * in the vector body and the scalar one alike (so a head's result does not depend on which ran). */
static inline float rotate(float x, float swapped, float c, float s) { return fmaf(x, c, swapped * s); }

static void rope_row(const void *context, int64_t t) {
    const RopeJob *j = context;
    const int64_t D = j->head_dim, R = j->rotary_dim, row_width = (j->num_heads + 2 * j->num_kv_heads) * D, half = R / 2;
    const float *c = j->cos + j->positions[t] * R, *s = j->sin + j->positions[t] * R;
    const int bf16 = j->dtype == DTYPE_BF16;
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t h = 0; h < j->num_heads + j->num_kv_heads; h++) { /* q heads, then k heads */
        const int64_t at = t * row_width + h * D;
#ifdef __AVX512F__
        if (half % 16 == 0) { /* 16 dims of each half at a time, read before either is written */
            char *head = (char *)j->qkv + at * elem;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 lo = load16(head + i * elem, bf16), hi = load16(head + (i + half) * elem, bf16);
                const __m512 lo_out = _mm512_fmadd_ps(lo, _mm512_loadu_ps(c + i), _mm512_mul_ps(hi, _mm512_loadu_ps(s + i)));
                const __m512 hi_out =
                    _mm512_fmadd_ps(hi, _mm512_loadu_ps(c + half + i), _mm512_mul_ps(lo, _mm512_loadu_ps(s + half + i)));
                store16(head + i * elem, lo_out, bf16);
                store16(head + (i + half) * elem, hi_out, bf16);
            }
            continue;
        }
#endif
        float x[1024];
        for (int64_t i = 0; i < R; i++) x[i] = load_element(j->qkv, at + i, j->dtype);
        for (int64_t i = 0; i < R; i++)
            store_element(j->qkv, at + i, rotate(x[i], i < half ? x[i + half] : x[i - half], c[i], s[i]), j->dtype);
    }
}

/* qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] rows (q heads, then k, then v);
 * cos, sin: [max_positions, rotary_dim] fp32 tables (cos repeated over both halves, sin signed:
 * -sin for the first half, +sin for the second), so rotated x = x * cos + swap_halves(x) * sin
 * over the first rotary_dim values of each head; the rest pass through (partial rotary: Phi-3,
 * rotary_dim < head_dim). q and k are rotated in place (v is left alone). */
int rayllm_rope(void *qkv, const int64_t *positions, const float *cos, const float *sin, int64_t num_tokens,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, int32_t dtype,
                int32_t num_threads) {
    if (head_dim > 1024 || rotary_dim % 2 || rotary_dim < 2 || rotary_dim > head_dim) return 1;
    const RopeJob job = {qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, rotary_dim, dtype};
    for_each_row(rope_row, &job, num_tokens, num_threads);
    return 0;
}

typedef struct {
    const void *gate_up;
    void *out;
    int64_t width;
    int32_t dtype, activation;
    float alpha, limit; /* ACTIVATION_SWIGLU_OAI's */
} GatedJob;

/* Every activation is g / (1 + exp(-z)): z = g for SiLU, and for GELU's tanh form
 * z = 2 sqrt(2 / pi) (g + 0.044715 g^3), since 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)).
 * gpt-oss's clamped SwiGLU first clamps g to at most limit and up to [-limit, limit], then
 * takes z = alpha g and multiplies by (up + 1) instead of up. */

static void gated_row(const void *context, int64_t t) {
    const GatedJob *j = context;
    const int bf16 = j->dtype == DTYPE_BF16, gelu = j->activation == ACTIVATION_GELU_TANH;
    const int oai = j->activation == ACTIVATION_SWIGLU_OAI;
    const float alpha = j->alpha, limit = j->limit;
    const int64_t elem = bf16 ? 2 : 4, width = j->width;
    const int32_t dtype = j->dtype;
    const char *gate = (const char *)j->gate_up + t * 2 * width * elem, *up = gate + width * elem;
    char *dst = (char *)j->out + t * width * elem;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= width; i += 16)
        store16(dst + i * elem, gated16(load16(gate + i * elem, bf16), load16(up + i * elem, bf16), j->activation,
                                        alpha, limit), bf16);
#elif defined(RAYLLM_AVX2)
    for (; i + 8 <= width; i += 8) {
        __m256 g = load8(gate + i * elem, bf16), u = load8(up + i * elem, bf16);
        __m256 z = g;
        if (gelu)
            z = _mm256_mul_ps(_mm256_set1_ps(GELU_K2),
                              _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_C), g), _mm256_mul_ps(g, g), g));
        if (oai) {
            g = _mm256_min_ps(g, _mm256_set1_ps(limit));
            u = _mm256_max_ps(_mm256_min_ps(u, _mm256_set1_ps(limit)), _mm256_set1_ps(-limit));
            u = _mm256_add_ps(u, _mm256_set1_ps(1.0f));
            z = _mm256_mul_ps(_mm256_set1_ps(alpha), g);
        }
        const __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        store8(dst + i * elem, _mm256_mul_ps(act, u), bf16);
    }
#endif
    for (; i < width; i++) {
        float g = load_element(gate, i, dtype), u = load_element(up, i, dtype), z = g;
        if (gelu) z = GELU_K2 * (g + GELU_C * g * g * g);
        if (oai) {
            g = fminf(g, limit);
            u = fmaxf(fminf(u, limit), -limit) + 1.0f;
            z = alpha * g;
        }
        store_element(dst, i, g / (1.0f + expf(-z)) * u, dtype);
    }
}

/* gate_up: [num_rows, 2 * width] (gate, then up); out: [num_rows, width] = act(gate) * up, act
 * SiLU (ACTIVATION_SILU), GELU's tanh form (ACTIVATION_GELU_TANH, Gemma), or gpt-oss's clamped
 * SwiGLU (ACTIVATION_SWIGLU_OAI, with alpha and limit; the others ignore them). */
int rayllm_gated_mul(const void *gate_up, void *out, int64_t num_rows, int64_t width, int32_t activation, float alpha,
                     float limit, int32_t dtype, int32_t num_threads) {
    if (activation != ACTIVATION_SILU && activation != ACTIVATION_GELU_TANH && activation != ACTIVATION_SWIGLU_OAI)
        return 1;
    const GatedJob job = {gate_up, out, width, dtype, activation, alpha, limit};
    for_each_row(gated_row, &job, num_rows, num_threads);
    return 0;
}


/* q_norm and k_norm: in each row of qkv [num_rows, (H + 2 KV) D], RMS-normalized in place, times
 * q_weight or k_weight; v is untouched. Per head (Qwen3, whole = 0): each of the H query heads
 * and then the KV key heads over its D values, weights [D]. Over the whole projection (OLMo 2,
 * whole = 1): the H D query values as one, weights [H D], and the KV D key values as one,
 * weights [KV D]. */
typedef struct {
    void *qkv;
    const void *q_weight, *k_weight;
    int64_t num_heads, num_kv_heads, head_dim;
    float eps;
    int32_t dtype, whole;
} HeadNormJob;

static void head_norm_row(const void *context, int64_t t) {
    const HeadNormJob *j = context;
    const int64_t elem = j->dtype == DTYPE_F32 ? 4 : 2, heads = j->num_heads + j->num_kv_heads, D = j->head_dim;
    char *row = (char *)j->qkv + t * (heads + j->num_kv_heads) * D * elem;
    if (j->whole) {
        add_rms_norm_row(row, NULL, j->q_weight, row, j->num_heads * D, j->eps, j->dtype, j->dtype);
        char *k = row + j->num_heads * D * elem;
        add_rms_norm_row(k, NULL, j->k_weight, k, j->num_kv_heads * D, j->eps, j->dtype, j->dtype);
        return;
    }
    for (int64_t h = 0; h < heads; h++) {
        char *head = row + h * D * elem;
        add_rms_norm_row(head, NULL, h < j->num_heads ? j->q_weight : j->k_weight, head, D, j->eps, j->dtype, j->dtype);
    }
}

int rayllm_head_rms_norm(void *qkv, const void *q_weight, const void *k_weight, int64_t num_rows, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int32_t whole, float eps, int32_t dtype,
                         int32_t num_threads) {
    if (head_dim < 1 || head_dim > MAX_WIDTH) return 2;
    const HeadNormJob job = {qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps, dtype, whole != 0};
    for_each_row(head_norm_row, &job, num_rows, num_threads);
    return 0;
}

/* ---------------------------------------------------------------- greedy sampling */

/* out[r] = the index of row r's largest value, the first one on ties; a row holding NaN gets its
 * first NaN (torch.argmax's answers). torch's CPU argmax reads a decode step's 16 x 49152 fp32
 * logits at about 5 GB/s a thread (0.65 ms); this reads them at memory speed, a row per item on
 * our pool. */
typedef struct {
    const float *x;
    int64_t *out, width;
} ArgmaxJob;

int64_t rayllm_argmax_row(const float *row, int64_t width) {
    int64_t best = 0, i = 0;
    float best_value = width > 0 ? row[0] : 0.0f;
    int has_nan = 0;
#ifdef __AVX512F__
    if (width >= 16) {
        __m512 values = _mm512_loadu_ps(row);
        __m512i indices = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i at = indices;
        __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
        const __m512i step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= width; i += 16) { /* per lane: the first largest value (strictly greater replaces) */
            at = _mm512_add_epi32(at, step);
            const __m512 v = _mm512_loadu_ps(row + i);
            const __mmask16 greater = _mm512_cmp_ps_mask(v, values, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            values = _mm512_mask_mov_ps(values, greater, v);
            indices = _mm512_mask_mov_epi32(indices, greater, at);
        }
        has_nan = nan != 0;
        best_value = _mm512_reduce_max_ps(values);
        const __mmask16 tied = _mm512_cmp_ps_mask(values, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(tied, indices); /* the first index among the lanes holding the max */
    }
#elif defined(RAYLLM_AVX2)
    if (width >= 8) { /* the same per lane, 8 lanes */
        __m256 values = _mm256_loadu_ps(row);
        __m256i indices = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = indices;
        __m256 nan = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
        const __m256i step = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= width; i += 8) {
            at = _mm256_add_epi32(at, step);
            const __m256 v = _mm256_loadu_ps(row + i);
            const __m256 greater = _mm256_cmp_ps(v, values, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            values = _mm256_blendv_ps(values, v, greater);
            indices = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(indices), _mm256_castsi256_ps(at), greater));
        }
        has_nan = _mm256_movemask_ps(nan) != 0;
        float lane_values[8];
        int32_t lane_indices[8];
        _mm256_storeu_ps(lane_values, values);
        _mm256_storeu_si256((__m256i *)lane_indices, indices);
        best_value = lane_values[0], best = lane_indices[0];
        for (int lane = 1; lane < 8; lane++)
            if (lane_values[lane] > best_value || (lane_values[lane] == best_value && lane_indices[lane] < best))
                best_value = lane_values[lane], best = lane_indices[lane];
    }
#endif
    for (; i < width; i++) { /* the tail (the whole row without a vector path) */
        has_nan |= row[i] != row[i];
        if (row[i] > best_value) best_value = row[i], best = i;
    }
    if (has_nan || best_value != best_value)
        for (best = 0; best < width && row[best] == row[best]; best++) {
        }
    return best;
}

static void argmax_row(void *context, int64_t r) {
    const ArgmaxJob *j = context;
    j->out[r] = rayllm_argmax_row(j->x + r * j->width, j->width);
}

/* x: [num_rows, width] fp32 (width < 2^31); out: [num_rows] int64. */
int rayllm_argmax(const float *x, int64_t *out, int64_t num_rows, int64_t width, int32_t num_threads) {
    if (width < 1 || width > INT32_MAX) return 2;
    ArgmaxJob job = {x, out, width};
    rayllm_parallel_for(num_rows, num_rows > 1 && num_threads > 1 ? num_threads : 1, argmax_row, &job);
    return 0;
}

/* ---------------------------------------------------------------- small-batch GEMV */

#define GEMV_MAX_ROWS 8
#define GEMV_M_TILE 4 /* x rows per pass over a weight row (4 accumulators) */

/* out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < num_rows <= 8. The weight streams through
 * memory once, in order (it is the bulk of the bytes: a decode step's GEMMs are bandwidth-bound
 * at a few rows), each of its rows used by every x row (x stays in L1). One weight row at a
 * time: reading 2 or 4 rows side by side (to share x loads) halved the bandwidth on a Zen 4 VM
 * (the lm_head at one row, bf16: 2.95 ms one row at a time, 7.2 two, 6.4 four), since each
 * concurrent row is a separate stream for the prefetchers. fp32 accumulation; bf16 products by
 * vdpbf16ps where the CPU has it; 8 lanes where the CPU has AVX2 but not AVX-512. */
#if defined(__AVX512F__)
/* acc[j] = the 16 lanes (still to be summed) of x row m0 + j times weight row wn, over k in
 * [0, returned k); MM is a compile-time constant in every call, so acc stays in registers. */
static inline __attribute__((always_inline)) int64_t gemv_row(const void *x, const void *wn, int64_t m0, const int MM,
                                                               int64_t K, int dtype, __m512 acc[GEMV_M_TILE]) {
    for (int j = 0; j < MM; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    if (dtype == DTYPE_F32) {
        const float *xf = (const float *)x, *wf = (const float *)wn;
        for (; k + 16 <= K; k += 16) {
            const __m512 wv = _mm512_loadu_ps(wf + k);
            for (int j = 0; j < MM; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + (m0 + j) * K + k), wv, acc[j]);
        }
        return k;
    }
    const uint16_t *xb = (const uint16_t *)x, *wb = (const uint16_t *)wn;
#if defined(__AVX512BF16__)
    for (; k + 32 <= K; k += 32) { /* 32 bf16 products summed pairwise into 16 fp32 lanes */
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + k);
        for (int j = 0; j < MM; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(xb + (m0 + j) * K + k), wv);
    }
#endif
    for (; k + 16 <= K; k += 16) {
        const __m512 wv = load16(wb + k, 1);
        for (int j = 0; j < MM; j++) acc[j] = _mm512_fmadd_ps(load16(xb + (m0 + j) * K + k, 1), wv, acc[j]);
    }
    return k;
}

typedef __m512 GemvAcc; /* gemv_columns below, in 16 lanes */
#define GEMV_ROW gemv_row
#define GEMV_REDUCE _mm512_reduce_add_ps
#elif defined(RAYLLM_AVX2)
/* The same walk in 8 lanes, two accumulators per x row (an FMA's latency needs about 8 in
 * flight; up to 4 rows x 2). */
static inline __attribute__((always_inline)) int64_t gemv_row8(const void *x, const void *wn, int64_t m0, const int MM,
                                                                int64_t K, int dtype, __m256 acc[GEMV_M_TILE]) {
    __m256 acc2[GEMV_M_TILE];
    for (int j = 0; j < MM; j++) acc[j] = acc2[j] = _mm256_setzero_ps();
    const int bf16 = dtype == DTYPE_BF16;
    const int64_t elem = bf16 ? 2 : 4;
    const char *xc = (const char *)x, *wc = (const char *)wn;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = load8(wc + k * elem, bf16), w1 = load8(wc + (k + 8) * elem, bf16);
        for (int j = 0; j < MM; j++) {
            acc[j] = _mm256_fmadd_ps(load8(xc + ((m0 + j) * K + k) * elem, bf16), w0, acc[j]);
            acc2[j] = _mm256_fmadd_ps(load8(xc + ((m0 + j) * K + k + 8) * elem, bf16), w1, acc2[j]);
        }
    }
    for (int j = 0; j < MM; j++) acc[j] = _mm256_add_ps(acc[j], acc2[j]);
    return k;
}

typedef __m256 GemvAcc; /* gemv_columns below, in 8 lanes */
#define GEMV_ROW gemv_row8
#define GEMV_REDUCE hsum8
#endif

#if defined(__AVX512F__) || defined(RAYLLM_AVX2)
static void gemv_columns(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t n0,
                         int64_t n1, int64_t N, int64_t K, int dtype, int out_dtype) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t n = n0; n < n1; n++) {
        const void *wn = (const char *)w + n * K * elem;
        for (int64_t m = 0; m < rows; m += GEMV_M_TILE) {
            const int64_t mm = rows - m < GEMV_M_TILE ? rows - m : GEMV_M_TILE;
            GemvAcc acc[GEMV_M_TILE];
            const int64_t k_done = mm == 1   ? GEMV_ROW(x, wn, m, 1, K, dtype, acc)
                                   : mm == 2 ? GEMV_ROW(x, wn, m, 2, K, dtype, acc)
                                   : mm == 3 ? GEMV_ROW(x, wn, m, 3, K, dtype, acc)
                                             : GEMV_ROW(x, wn, m, 4, K, dtype, acc);
            for (int j = 0; j < mm; j++) {
                float sum = GEMV_REDUCE(acc[j]);
                for (int64_t k = k_done; k < K; k++)
                    sum += load_element(x, (m + j) * K + k, dtype) * load_element(w, n * K + k, dtype);
                if (bias) sum += load_element(bias, n, dtype);
                store_element(out, (m + j) * N + n, sum, out_dtype);
            }
        }
    }
}
#else
static void gemv_columns(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t n0,
                         int64_t n1, int64_t N, int64_t K, int dtype, int out_dtype) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < rows; m++) {
            float sum = bias ? load_element(bias, n, dtype) : 0.0f;
            for (int64_t k = 0; k < K; k++) sum += load_element(x, m * K + k, dtype) * load_element(w, n * K + k, dtype);
            store_element(out, m * N + n, sum, out_dtype);
        }
}
#endif

/* ---------------------------------------------------------------- small-M GEMM over weight panels (AVX2) */

/* out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for a few rows (a decode step's batch), fp32, on
 * CPUs with AVX2 but no AVX-512 (where oneDNN's small-M fp32 GEMM ran at about half the FMA
 * rate). The weight is packed once into panels of 16 output columns, k-major: panels[p][k][16]
 * holds w[16p .. 16p + 15, k] (zero past N), so one k step of a panel is two vector loads, used
 * by every x row of a tile. A tile is MR rows x P adjacent panels, at most 12 accumulators:
 * up to 6 rows x 1 panel, and for 1, 2 or 3 rows 4, 3 or 2 panels side by side. Few rows read a
 * panel faster than they can use it, and P panels are P streams through memory at once: at 1
 * row, SmolLM2's products (30 layers and the lm_head, weights streamed from DRAM, AVX2 EPYC,
 * both kernels side by side in one process, best of 9) took 61.5 -> 45.2 ms on 1 thread and
 * 29.2 -> 22.9 on 2 with 4 panels instead of 1; 2 rows 60.9 -> 49.5, 3 rows 63.0 -> 56.8. Each
 * output is still one k-ordered sum, so a row's result is the same in every tile shape (a
 * sequence decodes the same tokens alone or in a batch). Threads take ranges of panels as they
 * come free; each group of panels stays in cache while all row tiles pass over it. */
#define PANEL_WIDTH 16
#define PANEL_MAX_TILE 6  /* rows */
#define PANEL_MAX_GROUP 4 /* panels */

#ifdef RAYLLM_AVX2
/* Panels side by side for a tile of `rows` rows (12 accumulators at most). */
static inline int64_t panel_group(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1; }

/* bias[n, n + width) (zeros past width, or everywhere without a bias) as two vectors. */
static inline void panel_bias(const float *bias, int64_t n, int64_t width, __m256 *b0, __m256 *b1) {
    float padded[PANEL_WIDTH] = {0};
    if (bias) memcpy(padded, bias + n, (size_t)width * sizeof(float));
    *b0 = _mm256_loadu_ps(padded);
    *b1 = _mm256_loadu_ps(padded + 8);
}

/* One row's 16 sums plus bias into dst[0, width). */
static inline void panel_store(float *dst, int64_t width, __m256 lo, __m256 hi, __m256 b0, __m256 b1) {
    if (width == PANEL_WIDTH) {
        _mm256_storeu_ps(dst, _mm256_add_ps(lo, b0));
        _mm256_storeu_ps(dst + 8, _mm256_add_ps(hi, b1));
    } else {
        float row[PANEL_WIDTH];
        _mm256_storeu_ps(row, _mm256_add_ps(lo, b0));
        _mm256_storeu_ps(row + 8, _mm256_add_ps(hi, b1));
        memcpy(dst, row, (size_t)width * sizeof(float));
    }
}

/* Rows [0, MR) of x times one panel over k in [k0, k1), continuing the sums in partial[MR][16]
 * (stored back after), each output one k-ordered chain of FMAs. With prefetch, a
 * cache line from there on for every k step. */
static inline __attribute__((always_inline)) void panel_tile_part(const float *x, int64_t K, const float *panel,
                                                                  const int MR, int64_t k0, int64_t k1, float *partial,
                                                                  const float *prefetch) {
    __m256 acc[PANEL_MAX_TILE][2];
    for (int i = 0; i < MR; i++) {
        acc[i][0] = _mm256_loadu_ps(partial + i * PANEL_WIDTH);
        acc[i][1] = _mm256_loadu_ps(partial + i * PANEL_WIDTH + 8);
    }
    for (int64_t k = k0; k < k1; k++) {
        if (prefetch) _mm_prefetch((const char *)(prefetch + (k - k0) * PANEL_WIDTH), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(panel + k * PANEL_WIDTH), w1 = _mm256_loadu_ps(panel + k * PANEL_WIDTH + 8);
        for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(partial + i * PANEL_WIDTH, acc[i][0]);
        _mm256_storeu_ps(partial + i * PANEL_WIDTH + 8, acc[i][1]);
    }
}

/* Row sums[m] (16 columns) plus bias into out row m, columns [n0, n0 + 16) clipped to N, for m < num_rows. */
static inline void panel_store_sums(float *out, int64_t N, int64_t n0, const float *bias, const float *sums,
                                    int64_t num_rows) {
    const int64_t width = N - n0 < PANEL_WIDTH ? N - n0 : PANEL_WIDTH;
    __m256 b0, b1;
    panel_bias(bias, n0, width, &b0, &b1);
    for (int64_t m = 0; m < num_rows; m++)
        panel_store(out + m * N + n0, width, _mm256_loadu_ps(sums + m * PANEL_WIDTH),
                    _mm256_loadu_ps(sums + m * PANEL_WIDTH + 8), b0, b1);
}

/* Rows [0, MR) of x times one panel, into out columns [n0, n0 + 16) clipped to N. MR is a
 * compile-time constant in every call, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t K, const float *panel, const int MR,
                                                             float *out, int64_t N, int64_t n0, const float *bias) {
    float sums[PANEL_MAX_TILE * PANEL_WIDTH] = {0};
    panel_tile_part(x, K, panel, MR, 0, K, sums, NULL);
    panel_store_sums(out, N, n0, bias, sums, MR);
}

/* The same for MR (1 to 3) rows times P = panel_group(MR) adjacent panels (K * 16 floats
 * apart), into out columns [n0, n0 + 16 P) clipped to N: each column's sum in the same k
 * order as panel_tile's. (One function for both measured 5-7% slower at 16 rows: the
 * compiler kept some of the 6-row tile's accumulators on the stack.) */
static inline __attribute__((always_inline)) void panel_tile_wide(const float *x, int64_t K, const float *panel,
                                                                  const int MR, const int P, float *out, int64_t N,
                                                                  int64_t n0, const float *bias) {
    __m256 acc[3][2 * PANEL_MAX_GROUP];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 2 * P; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 w[2 * PANEL_MAX_GROUP];
        for (int j = 0; j < P; j++) {
            w[2 * j] = _mm256_loadu_ps(panel + (j * K + k) * PANEL_WIDTH);
            w[2 * j + 1] = _mm256_loadu_ps(panel + (j * K + k) * PANEL_WIDTH + 8);
        }
        for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
            for (int j = 0; j < 2 * P; j++) acc[i][j] = _mm256_fmadd_ps(xb, w[j], acc[i][j]);
        }
    }
    /* The sums leave their registers once, here: read as acc[i][j] by the stores below (with
     * their memcpy calls), they were stored to the stack on every k step of the loop above,
     * as many stores as FMAs. */
    float sums[3][2 * PANEL_MAX_GROUP][8] __attribute__((aligned(32)));
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++) _mm256_store_ps(sums[i][j], acc[i][j]);
    for (int j = 0; j < P; j++) {
        const int64_t n = n0 + j * PANEL_WIDTH, width = N - n < PANEL_WIDTH ? N - n : PANEL_WIDTH;
        __m256 b0, b1;
        panel_bias(bias, n, width, &b0, &b1);
        for (int i = 0; i < MR; i++)
            panel_store(out + i * N + n, width, _mm256_load_ps(sums[i][2 * j]), _mm256_load_ps(sums[i][2 * j + 1]), b0,
                        b1);
    }
}

/* Rows in the next of `tiles_left` row tiles over `rows_left` rows: tiles as even as they go
 * (8 rows are 4 + 4). */
static inline int64_t tile_rows(int64_t rows_left, int64_t tiles_left) {
    return rows_left / tiles_left + (rows_left % tiles_left != 0);
}

/* f(x, K, panel, MR, ...) with MR = rows (1 to 6) as a compile-time constant. */
#define FOR_TILE_ROWS(rows, f, x, K, panel, ...)       \
    switch (rows) {                                    \
    case 6: f(x, K, panel, 6, __VA_ARGS__); break;     \
    case 5: f(x, K, panel, 5, __VA_ARGS__); break;     \
    case 4: f(x, K, panel, 4, __VA_ARGS__); break;     \
    case 3: f(x, K, panel, 3, __VA_ARGS__); break;     \
    case 2: f(x, K, panel, 2, __VA_ARGS__); break;     \
    default: f(x, K, panel, 1, __VA_ARGS__); break;    \
    }

/* Up to PANEL_BLOCKED_ROWS rows in several tiles over one panel, a block of PANEL_K_BLOCK k
 * steps (4 KB of the panel) at a time: every tile passes over a block before the next, and
 * the first tile prefetches the next block (past the last one: the next panel, which is where
 * this thread's range goes on; a prefetch past the weights' end never faults). Tile by tile
 * over the whole panel, the first tile waited on memory and the others computed from cache
 * with memory idle, so a step cost about its weight-read time plus its FMA time. The sums are
 * kept between blocks in partial (exact fp32 stores), so every output is the same k-ordered
 * chain as before, bit for bit. SmolLM2's products, weights streamed from memory, old vs new
 * kernel alternating in one process (AVX2 EPYC, median of 11): 2 threads 8 rows 44.8 -> 36.7
 * ms, 16 rows 53.3 -> 44.9, 32 rows 87.5 -> 81.8; 1 thread 16 rows 92.9 -> 79.9. */
#define PANEL_K_BLOCK 64
#define PANEL_BLOCKED_ROWS 64 /* 256 rows measured 12% slower blocked, 64 the same */
static void panel_rows_blocked(const float *x, int64_t K, const float *panel, float *out, int64_t N,
                               const float *bias, int64_t num_rows, int64_t num_tiles, int64_t n0) {
    float partial[PANEL_BLOCKED_ROWS * PANEL_WIDTH];
    memset(partial, 0, (size_t)num_rows * PANEL_WIDTH * sizeof(float));
    for (int64_t k0 = 0; k0 < K; k0 += PANEL_K_BLOCK) {
        const int64_t k1 = k0 + PANEL_K_BLOCK < K ? k0 + PANEL_K_BLOCK : K;
        for (int64_t t = 0, m = 0; t < num_tiles; t++) {
            const int64_t rows = tile_rows(num_rows - m, num_tiles - t);
            const float *xm = x + m * K;
            float *pm = partial + m * PANEL_WIDTH;
            const float *prefetch = t == 0 ? panel + (k0 + PANEL_K_BLOCK) * PANEL_WIDTH : NULL;
            FOR_TILE_ROWS(rows, panel_tile_part, xm, K, panel, k0, k1, pm, prefetch);
            m += rows;
        }
    }
    panel_store_sums(out, N, n0, bias, partial, num_rows);
}

/* Every row tile over `group` panels from panel p (group is panel_group(tile rows) or 1). */
static void panel_rows(const float *x, int64_t K, const float *panels, float *out, int64_t N, const float *bias,
                       int64_t num_rows, int64_t num_tiles, int64_t p, int64_t group) {
    const float *panel = panels + p * K * PANEL_WIDTH;
    const int64_t n0 = p * PANEL_WIDTH;
    if (num_tiles > 1 && num_rows <= PANEL_BLOCKED_ROWS) {
        panel_rows_blocked(x, K, panel, out, N, bias, num_rows, num_tiles, n0);
        return;
    }
    for (int64_t t = 0, m = 0; t < num_tiles; t++) {
        const int64_t rows = tile_rows(num_rows - m, num_tiles - t);
        const float *xm = x + m * K;
        float *om = out + m * N;
        switch (group > 1 ? rows : 0) {
        case 1: panel_tile_wide(xm, K, panel, 1, 4, om, N, n0, bias); break;
        case 2: panel_tile_wide(xm, K, panel, 2, 3, om, N, n0, bias); break;
        case 3: panel_tile_wide(xm, K, panel, 3, 2, om, N, n0, bias); break;
        default:
            FOR_TILE_ROWS(rows, panel_tile, xm, K, panel, om, N, n0, bias);
        }
        m += rows;
    }
}
#endif

#ifdef RAYLLM_AVX2
typedef struct {
    const float *x, *panels, *bias;
    float *out;
    int64_t num_rows, N, K, num_panels, num_tiles, wide, span; /* span: panels per range, a multiple of wide */
} PanelJob;

/* Range `range` of a PanelJob: panels [range * span, (range + 1) * span) clipped to the last. */
static void panel_range(void *context, int64_t range) {
    const PanelJob *j = context;
    const int64_t end = (range + 1) * j->span < j->num_panels ? (range + 1) * j->span : j->num_panels;
    for (int64_t p = range * j->span; p < end;) {
        const int64_t group = p + j->wide <= end ? j->wide : 1;
        panel_rows(j->x, j->K, j->panels, j->out, j->N, j->bias, j->num_rows, j->num_tiles, p, group);
        p += group;
    }
}
#endif

/* 1 where this build has the fp32 panel GEMM (AVX2, or AVX-512: panel_avx512.c), else 0. */
int rayllm_panel_gemm_available(void) {
#if defined(RAYLLM_AVX2) || defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* x: [num_rows, K] fp32; panels: [ceil(N / 16), K, 16] fp32 (layout above); bias: [N] or NULL;
 * out: [num_rows, N] fp32. AVX-512 builds run panel_avx512.c's kernel over the same layout (the
 * same sums, bit for bit). Returns 1 where this build has no panel kernel (no AVX2). */
int rayllm_panel_gemm(const float *x, const float *panels, const float *bias, float *out, int64_t num_rows, int64_t N,
                      int64_t K, int32_t num_threads) {
#ifdef RAYLLM_AVX2
    if (num_rows < 1) return 1;
    const int64_t num_panels = (N + PANEL_WIDTH - 1) / PANEL_WIDTH;
    const int64_t num_tiles = (num_rows + PANEL_MAX_TILE - 1) / PANEL_MAX_TILE;
    const int threads = num_threads > 0 ? num_threads : 1;
    /* One row tile (at most 3 rows) takes panels in groups; more rows take them one by one.
     * Threads claim ranges of panels (about 8 per thread, whole groups) as they come free
     * (rayllm_parallel_for), rather than a fixed half each: a thread the OS takes away for a
     * while (the ingress or the scheduler running on its core) leaves its ranges to the other
     * instead of making it wait. SmolLM2 fp32 decode steps, 2 threads, beside a busy loop
     * taking 25% of one core (a one-off benchmark, since retired), fixed halves -> ranges claimed in an
     * OpenMP dynamic loop: batch 1 36.0 -> 32.0 ms, batch 16 103.9 -> 99.3 (alone 30.1 -> 29.5
     * and 79.9 -> 74.0); the thread pool then also spares the wait at the region's end. */
    const int64_t wide = num_tiles == 1 ? panel_group(num_rows) : 1;
    const int64_t num_groups = (num_panels + wide - 1) / wide;
    const int64_t per_range = num_groups / (threads * 8) > 1 ? num_groups / (threads * 8) : 1;
    PanelJob job = {x, panels, bias, out, num_rows, N, K, num_panels, num_tiles, wide, per_range * wide};
    const int64_t num_ranges = (num_panels + job.span - 1) / job.span;
    rayllm_parallel_for(num_ranges, num_panels >= 16 ? threads : 1, panel_range, &job);
    return 0;
#elif defined(__AVX512F__)
    return rayllm_panel_gemm_avx512(x, panels, bias, out, num_rows, N, K, DTYPE_F32, DTYPE_F32, num_threads);
#else
    (void)x, (void)panels, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)num_threads;
    return 1;
#endif
}

/* x: [num_rows, K] and w: [N, K] in dtype, bias: [N] in dtype or NULL, out: [num_rows, N] in out_dtype.
 * Threads take contiguous ranges of output columns (so each reads one contiguous part of w). */
int rayllm_gemv(const void *x, const void *w, const void *bias, void *out, int64_t num_rows, int64_t N, int64_t K,
                int32_t dtype, int32_t out_dtype, int32_t num_threads) {
    if (num_rows > GEMV_MAX_ROWS || num_rows < 1) return 1;
    const int threads = num_threads > 0 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1 && N >= 256)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
        const int64_t me = 0, team = 1;
#endif
        const int64_t n0 = N * me / team, n1 = N * (me + 1) / team;
        gemv_columns(x, w, bias, out, num_rows, n0, n1, N, K, dtype, out_dtype);
    }
    return 0;
}
