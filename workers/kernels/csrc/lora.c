/* LoRA products of a step, segmented by adapter (workers/lora.py): after one of a layer's
 * products, for each adapter in the step and each of its rows r,
 *
 *     shrunk = x[r] @ A.T                      (the part's rank values, fp32)
 *     out[r, start:start + len] += shrunk @ Bt (Bt = B transposed, the scaling folded in)
 *
 * for every part of that product the adapter targets (q, k and v are parts of one qkv product,
 * gate and up of gate_up; o and down have one part). A and Bt are fp32 (the exact fp32 model's)
 * or bf16 (half the bytes to read, beside bf16 or quantized weights); x and out are the step's
 * dtype (fp32 or bf16), the sums in fp32, out rounded once per element. An adapter's rows go in blocks of up to
 * LORA_ROWS, so each of its weights is read once per block: first every block's shrink, then the
 * expands, by chunks of output columns. No gather or scatter of rows, and no copy of a weight.
 * With AVX-512 the sums stay in registers: a shrink computes 4 rows x 4 ranks at once, an expand
 * 8 rows x 32 columns over the whole rank, so out is read and written once per element.
 */
#include <stddef.h>
#include <stdint.h>

#include "entry_points.h"
#include "simd.h"

#include <stdlib.h>

#define LORA_ROWS 16    /* rows of one adapter computed together: each weight read once per block of them */
#define LORA_CHUNK 256  /* output columns of one expand item */

typedef struct {         /* one item: rows [row0, row0 + num_rows) of a segment, one part, columns [col0, col0 + num_cols) */
    const LoraPart *part;
    const int64_t *rows; /* the segment's rows, from row0 */
    float *shrunk;       /* [num_rows, part rank]: x @ A.T of these rows */
    int64_t num_rows, col0, num_cols;
} LoraItem;

typedef struct {
    const LoraItem *items;
    const void *x;
    void *out;
    int64_t N, K;
    int32_t dtype;
} LoraJob;

/* x . a without AVX-512 (the compiler vectorizes the fp32 case) */
static float dot_row(const void *x, int32_t dtype, const void *a, int32_t wdtype, int64_t K) {
    float acc = 0.0f;
    if (dtype == DTYPE_F32 && wdtype == DTYPE_F32) {
        const float *xf = (const float *)x, *af = (const float *)a;
        for (int64_t k = 0; k < K; k++) acc += xf[k] * af[k];
    } else {
        for (int64_t k = 0; k < K; k++) acc += load_element(x, k, dtype) * load_element(a, k, wdtype);
    }
    return acc;
}

#ifdef __AVX512F__
/* 16 values of x from k (fewer under the mask) as fp32 */
static inline __m512 load_x16(const void *x, int32_t dtype, int64_t k, __mmask16 mask) {
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)x + k);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* shrunk[r, j0 + j] = x[rows[r]] . a_(j0 + j) for R rows and J of the part's ranks at once (constants,
 * so the R x J chains stay in registers): each load of x serves J products and each load of a, R. */
#define DOT_BLOCK(R, J)                                                                                          \
    static void dot_block##R##x##J(const void *x, int32_t dtype, int64_t elem, const int64_t *rows,            \
                                   const void *a, int32_t wdtype, int64_t K, float *out, int64_t out_stride) {   \
        __m512 acc[R][J];                                                                                        \
        const char *row[R], *arow[J];                                                                            \
        const int64_t welem = wdtype == DTYPE_F32 ? 4 : 2;                                                       \
        for (int r = 0; r < R; r++) {                                                                            \
            row[r] = (const char *)x + rows[r] * K * elem;                                                       \
            for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                                         \
        }                                                                                                        \
        for (int j = 0; j < J; j++) arow[j] = (const char *)a + j * K * welem;                                   \
        int64_t k = 0;                                                                                           \
        for (; k + 16 <= K; k += 16) {                                                                           \
            __m512 av[J];                                                                                        \
            for (int j = 0; j < J; j++) av[j] = load_x16(arow[j], wdtype, k, 0xffff);                            \
            for (int r = 0; r < R; r++) {                                                                        \
                const __m512 xv = load_x16(row[r], dtype, k, 0xffff);                                            \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_fmadd_ps(xv, av[j], acc[r][j]);                   \
            }                                                                                                    \
        }                                                                                                        \
        if (k < K) {                                                                                             \
            const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);                                             \
            __m512 av[J];                                                                                        \
            for (int j = 0; j < J; j++) av[j] = load_x16(arow[j], wdtype, k, mask);                              \
            for (int r = 0; r < R; r++) {                                                                        \
                const __m512 xv = load_x16(row[r], dtype, k, mask);                                              \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_fmadd_ps(xv, av[j], acc[r][j]);                   \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; r++)                                                                              \
            for (int j = 0; j < J; j++) out[r * out_stride + j] = _mm512_reduce_add_ps(acc[r][j]);               \
    }
DOT_BLOCK(4, 4)
DOT_BLOCK(1, 4)
DOT_BLOCK(4, 1)
DOT_BLOCK(1, 1)

/* out[r, 32 columns from c] += shrunk[r] @ Bt[:, those columns] for R rows at once (m0, m1: the
 * columns that exist), the sums in registers over the rank; then one read-add-write of out. */
static inline void add_to_out(void *out, int32_t dtype, int64_t first, __m512 sum, __mmask16 mask) {
    if (dtype == DTYPE_F32) {
        float *o = (float *)out + first;
        _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), sum));
    } else { /* bf16: the sum rounded once, to nearest even as f32_to_bf16 does */
        uint16_t *o = (uint16_t *)out + first;
        const __m512i bits = _mm512_castps_si512(_mm512_add_ps(load_x16(o, DTYPE_BF16, 0, mask), sum));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
        _mm256_mask_storeu_epi16(o, mask, _mm512_cvtepi32_epi16(rounded));
    }
}

#define EXPAND_ROWS(R)                                                                                           \
    static void expand_rows##R(const LoraJob *job, const LoraItem *item, int64_t r0, int64_t c, __mmask16 m0,   \
                               __mmask16 m1) {                                                                   \
        const LoraPart *part = item->part;                                                                       \
        const int64_t rank = part->rank, welem = part->dtype == DTYPE_F32 ? 4 : 2;                               \
        const float *coefficients = item->shrunk + r0 * rank;                                                    \
        __m512 low[R], high[R];                                                                                  \
        for (int r = 0; r < R; r++) low[r] = high[r] = _mm512_setzero_ps();                                      \
        for (int64_t j = 0; j < rank; j++) {                                                                     \
            const char *bt = (const char *)part->bt + (j * part->len + item->col0 + c) * welem;                  \
            const __m512 b0 = load_x16(bt, part->dtype, 0, m0), b1 = load_x16(bt, part->dtype, 16, m1);          \
            for (int r = 0; r < R; r++) {                                                                        \
                const __m512 coefficient = _mm512_set1_ps(coefficients[r * rank + j]);                           \
                low[r] = _mm512_fmadd_ps(coefficient, b0, low[r]);                                               \
                high[r] = _mm512_fmadd_ps(coefficient, b1, high[r]);                                             \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; r++) {                                                                            \
            const int64_t first = item->rows[r0 + r] * job->N + part->start + item->col0 + c;                    \
            add_to_out(job->out, job->dtype, first, low[r], m0);                                                 \
            add_to_out(job->out, job->dtype, first + 16, high[r], m1);                                           \
        }                                                                                                        \
    }
EXPAND_ROWS(8)
EXPAND_ROWS(4)
EXPAND_ROWS(1)
#endif

/* shrink: the item's rows times the part's A (each row of A read once per block of 4 rows) */
static void shrink_item(void *ctx, int64_t index) {
    const LoraJob *job = (const LoraJob *)ctx;
    const LoraItem *item = job->items + index;
    const int64_t elem = job->dtype == DTYPE_F32 ? 4 : 2, rank = item->part->rank;
    const int32_t wdtype = item->part->dtype;
    const int64_t a_row = job->K * (wdtype == DTYPE_F32 ? 4 : 2);
#ifdef __AVX512F__
    for (int64_t j = 0; j < rank;) {
        const void *a = (const char *)item->part->a + j * a_row;
        const void *x = job->x;
        float *out = item->shrunk + j;
        int64_t r0 = 0;
        if (j + 4 <= rank) {
            for (; r0 + 4 <= item->num_rows; r0 += 4)
                dot_block4x4(x, job->dtype, elem, item->rows + r0, a, wdtype, job->K, out + r0 * rank, rank);
            for (; r0 < item->num_rows; r0++)
                dot_block1x4(x, job->dtype, elem, item->rows + r0, a, wdtype, job->K, out + r0 * rank, rank);
            j += 4;
        } else {
            for (; r0 + 4 <= item->num_rows; r0 += 4)
                dot_block4x1(x, job->dtype, elem, item->rows + r0, a, wdtype, job->K, out + r0 * rank, rank);
            for (; r0 < item->num_rows; r0++)
                dot_block1x1(x, job->dtype, elem, item->rows + r0, a, wdtype, job->K, out + r0 * rank, rank);
            j += 1;
        }
    }
#else
    for (int64_t j = 0; j < rank; j++) {
        const void *a = (const char *)item->part->a + j * a_row;
        for (int64_t r = 0; r < item->num_rows; r++)
            item->shrunk[r * rank + j] = dot_row((const char *)job->x + item->rows[r] * job->K * elem, job->dtype, a,
                                                 wdtype, job->K);
    }
#endif
}

/* expand: out[rows, start + col0 ...] += shrunk @ Bt over the item's columns (each row of Bt read once) */
static void expand_item(void *ctx, int64_t index) {
    const LoraJob *job = (const LoraJob *)ctx;
    const LoraItem *item = job->items + index;
#ifdef __AVX512F__
    for (int64_t c = 0; c < item->num_cols; c += 32) {
        const int64_t left = item->num_cols - c;
        const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        int64_t r0 = 0;
        for (; r0 + 8 <= item->num_rows; r0 += 8) expand_rows8(job, item, r0, c, m0, m1);
        for (; r0 + 4 <= item->num_rows; r0 += 4) expand_rows4(job, item, r0, c, m0, m1);
        for (; r0 < item->num_rows; r0++) expand_rows1(job, item, r0, c, m0, m1);
    }
#else
    const LoraPart *part = item->part;
    const int64_t rank = part->rank, width = item->num_cols;
    float acc[LORA_ROWS][LORA_CHUNK];
    for (int64_t r = 0; r < item->num_rows; r++)
        for (int64_t c = 0; c < width; c++) acc[r][c] = 0.0f;
    for (int64_t j = 0; j < rank; j++) {
        if (part->dtype == DTYPE_F32) {
            const float *bt = (const float *)part->bt + j * part->len + item->col0;
            for (int64_t r = 0; r < item->num_rows; r++) {
                const float coefficient = item->shrunk[r * rank + j];
                for (int64_t c = 0; c < width; c++) acc[r][c] += coefficient * bt[c];
            }
        } else {
            const uint16_t *bt = (const uint16_t *)part->bt + j * part->len + item->col0;
            float row[LORA_CHUNK];
            for (int64_t c = 0; c < width; c++) row[c] = bf16_to_f32(bt[c]);
            for (int64_t r = 0; r < item->num_rows; r++) {
                const float coefficient = item->shrunk[r * rank + j];
                for (int64_t c = 0; c < width; c++) acc[r][c] += coefficient * row[c];
            }
        }
    }
    for (int64_t r = 0; r < item->num_rows; r++) {
        const int64_t first = item->rows[r] * job->N + part->start + item->col0;
        if (job->dtype == DTYPE_F32) {
            float *o = (float *)job->out + first;
            for (int64_t c = 0; c < width; c++) o[c] += acc[r][c];
        } else {
            uint16_t *o = (uint16_t *)job->out + first;
            for (int64_t c = 0; c < width; c++) o[c] = f32_to_bf16(bf16_to_f32(o[c]) + acc[r][c]);
        }
    }
#endif
}

int rayllm_lora_add(const LoraStep *step, int64_t layer, int32_t product, const void *x, void *out, int64_t N,
                    int64_t K, int32_t dtype, int32_t num_threads) {
    if (step == NULL || step->num_segments == 0) return 0;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (product < 0 || product >= LORA_PRODUCTS || layer < 0 || layer >= step->num_layers) return 2;
    int64_t num_blocks = 0, num_expands = 0, shrunk_floats = 0; /* shrink items (row blocks x parts), expand items */
    for (int64_t s = 0; s < step->num_segments; s++) {
        const LoraPart *parts = step->segments[s].parts + (layer * LORA_PRODUCTS + product) * LORA_MAX_PARTS;
        const int64_t rows = step->segments[s].num_rows, blocks = (rows + LORA_ROWS - 1) / LORA_ROWS;
        for (int p = 0; p < LORA_MAX_PARTS; p++) {
            if (parts[p].rank <= 0) continue;
            if (parts[p].rank > LORA_MAX_RANK || parts[p].start < 0 || parts[p].start + parts[p].len > N) return 3;
            num_blocks += blocks;
            num_expands += blocks * ((parts[p].len + LORA_CHUNK - 1) / LORA_CHUNK);
            shrunk_floats += rows * parts[p].rank;
        }
    }
    if (num_blocks == 0) return 0; /* no adapter of the step targets this product */
    LoraItem *items = malloc((size_t)(num_blocks + num_expands) * sizeof(LoraItem));
    float *shrunk = malloc((size_t)shrunk_floats * sizeof(float));
    if (items == NULL || shrunk == NULL) {
        free(items);
        free(shrunk);
        return 4;
    }
    LoraItem *block = items, *expand = items + num_blocks;
    float *next = shrunk;
    for (int64_t s = 0; s < step->num_segments; s++) {
        const LoraPart *parts = step->segments[s].parts + (layer * LORA_PRODUCTS + product) * LORA_MAX_PARTS;
        const int64_t rows = step->segments[s].num_rows;
        for (int p = 0; p < LORA_MAX_PARTS; p++) {
            if (parts[p].rank <= 0) continue;
            for (int64_t r0 = 0; r0 < rows; r0 += LORA_ROWS) {
                const int64_t num_rows = rows - r0 < LORA_ROWS ? rows - r0 : LORA_ROWS;
                *block = (LoraItem){parts + p, step->segments[s].rows + r0, next, num_rows, 0, parts[p].len};
                for (int64_t c0 = 0; c0 < parts[p].len; c0 += LORA_CHUNK) {
                    *expand = *block;
                    expand->col0 = c0;
                    expand->num_cols = parts[p].len - c0 < LORA_CHUNK ? parts[p].len - c0 : LORA_CHUNK;
                    expand++;
                }
                block++;
                next += num_rows * parts[p].rank;
            }
        }
    }
    LoraJob job = {items, x, out, N, K, dtype};
    rayllm_parallel_for(num_blocks, num_threads, shrink_item, &job);
    job.items = items + num_blocks;
    rayllm_parallel_for(num_expands, num_threads, expand_item, &job);
    free(items);
    free(shrunk);
    return 0;
}

/* Whether any adapter of the step has a part on this layer's product (the fused gate_up paths
 * skip the product's output, so a step that adapts it takes the plain product then the LoRA). */
int rayllm_lora_adapts(const LoraStep *step, int64_t layer, int32_t product) {
    if (step == NULL) return 0;
    for (int64_t s = 0; s < step->num_segments; s++) {
        const LoraPart *parts = step->segments[s].parts + (layer * LORA_PRODUCTS + product) * LORA_MAX_PARTS;
        for (int p = 0; p < LORA_MAX_PARTS; p++)
            if (parts[p].rank > 0) return 1;
    }
    return 0;
}

int rayllm_layout_lora_part(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(LoraPart)
#define FIELD(f) LAYOUT_FIELD(LoraPart, f)
    FIELD(a) FIELD(bt) FIELD(rank) FIELD(start) FIELD(len) FIELD(dtype)
#undef FIELD
    return n;
}

int rayllm_layout_lora_segment(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(LoraSegment)
#define FIELD(f) LAYOUT_FIELD(LoraSegment, f)
    FIELD(parts) FIELD(rows) FIELD(num_rows)
#undef FIELD
    return n;
}

int rayllm_layout_lora_step(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(LoraStep)
#define FIELD(f) LAYOUT_FIELD(LoraStep, f)
    FIELD(segments) FIELD(num_segments) FIELD(num_layers)
#undef FIELD
    return n;
}
