/* LoRA products of a step, segmented by adapter (workers/lora.py): after one of a layer's
 * products, for each adapter in the step and each of its rows r,
 *
 *     shrunk = x[r] @ A.T                      (the part's rank values, fp32)
 *     out[r, start:start + len] += shrunk @ Bt (Bt = B transposed, the scaling folded in)
 *
 * for every part of that product the adapter targets (q, k and v are parts of one qkv product,
 * gate and up of gate_up; o and down have one part). A and Bt are fp32 (the exact fp32 model's)
 * or bf16 (half the bytes to read, beside bf16 or quantized weights); x and out are the step's
 * dtype (fp32 or bf16), the sums in fp32, out rounded once per element. An adapter's rows go in
 * blocks of up to LORA_ROWS, so each of its weights is read once per block. A task is one block
 * and one part: its shrink into scratch of its own, then its expand, all tasks in one parallel
 * dispatch (with tiny work per task, two dispatches and their item claims cost as much as the
 * arithmetic). No gather or scatter of rows, and no copy of a weight.
 *
 * The weights come in zero-padded panels (workers/lora.py, LoraPart.of), in the order the loops
 * below read them, so each is one stream front to back that the prefetchers follow:
 *     A   [ceil(rank / 4)][ceil(K / 16)][4][16]: 4 ranks' next 16 inputs together
 *     Bt  [ceil(len / 32)][rank4][32]:           32 columns of every rank together (rank4: rank
 *                                                rounded up to 4; padded ranks are zero)
 * Read as plain [rank, K] and [rank, len] rows, Bt's 16 rows were 16 short strided streams, and
 * the expand waited on their loads most of its time. With AVX-512 the sums stay in registers: a
 * shrink computes 4 rows x 4 ranks at once, an expand 8 rows x 32 columns over the whole rank.
 */
#include <stddef.h>
#include <stdint.h>

#include "entry_points.h"
#include "simd.h"

#include <stdlib.h>

#define LORA_ROWS 16    /* rows of one adapter computed together: each weight read once per block of them */
#define PANEL_RANKS 4   /* A's panels: 4 ranks ... */
#define PANEL_INPUTS 16 /* ... by 16 inputs */
#define PANEL_COLUMNS 32 /* Bt's panels: 32 columns by the whole (padded) rank */
#define PREFETCH_AHEAD 1024 /* bytes of a weight's stream asked for ahead of its loads */

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

typedef struct {         /* one task: rows [row0, row0 + num_rows) of a segment, one part, columns [col0, col0 + num_cols) */
    const LoraPart *part;
    const int64_t *rows; /* the segment's rows, from row0 */
    float *shrunk;       /* [num_rows, rank4]: x @ A.T of these rows (the padded ranks 0), the task's own */
    int64_t num_rows, col0, num_cols;
} LoraItem;

typedef struct {
    const LoraItem *items;
    const void *x;
    void *out;
    int64_t N, K;
    int32_t dtype;
} LoraJob;

static inline int64_t elem_size(int32_t dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

#ifdef __AVX512F__
/* 16 values from p + k elements (fewer under the mask) as fp32 */
static inline __m512 load_x16(const void *x, int32_t dtype, int64_t k, __mmask16 mask) {
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)x + k);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* shrunk[r, 0..3] = x[rows[r]] . A's 4 ranks of one panel row, for R rows at once (a constant, so
 * the R x 4 chains stay in registers): each load of x serves 4 products and each load of A, R.
 * The dtypes are the body's constants (DOT_BODY is specialized per pair below), and the loops over
 * rows and ranks are unrolled by pragma, before GCC decides what stays in registers: without both
 * it kept every chain in a stack array (an __m512 array may alias any load), a store per
 * multiply-add. */
#define DOT_BODY(R, XT, WT)                                                                                     \
    static void dot_body##R##_##XT##_##WT(const void *x, const int64_t *rows, const void *panel, int64_t K,    \
                                          float *out, int64_t out_stride) {                                     \
        __m512 acc[R][PANEL_RANKS];                                                                              \
        const char *row[R];                                                                                      \
        const int64_t step = PANEL_RANKS * PANEL_INPUTS * elem_size(WT);                                         \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                                            \
            row[r] = (const char *)x + rows[r] * K * elem_size(XT);                                              \
            _Pragma("GCC unroll 16") for (int j = 0; j < PANEL_RANKS; j++) acc[r][j] = _mm512_setzero_ps();                               \
        }                                                                                                        \
        const char *a = (const char *)panel;                                                                     \
        int64_t k = 0;                                                                                           \
        for (; k + PANEL_INPUTS <= K; k += PANEL_INPUTS, a += step) {                                            \
            _mm_prefetch(a + PREFETCH_AHEAD, _MM_HINT_T0);                                                      \
            _mm_prefetch(a + PREFETCH_AHEAD + 64, _MM_HINT_T0);                                                 \
            __m512 av[PANEL_RANKS];                                                                              \
            _Pragma("GCC unroll 16") for (int j = 0; j < PANEL_RANKS; j++) av[j] = load_x16(a, WT, j * PANEL_INPUTS, 0xffff);            \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                                        \
                const __m512 xv = load_x16(row[r], XT, k, 0xffff);                                               \
                _Pragma("GCC unroll 16") for (int j = 0; j < PANEL_RANKS; j++) acc[r][j] = _mm512_fmadd_ps(xv, av[j], acc[r][j]);         \
            }                                                                                                    \
        }                                                                                                        \
        if (k < K) { /* the last inputs: x masked, A zero-padded */                                              \
            const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);                                             \
            __m512 av[PANEL_RANKS];                                                                              \
            _Pragma("GCC unroll 16") for (int j = 0; j < PANEL_RANKS; j++) av[j] = load_x16(a, WT, j * PANEL_INPUTS, 0xffff);            \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                                        \
                const __m512 xv = load_x16(row[r], XT, k, mask);                                                 \
                _Pragma("GCC unroll 16") for (int j = 0; j < PANEL_RANKS; j++) acc[r][j] = _mm512_fmadd_ps(xv, av[j], acc[r][j]);         \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                                              \
            _Pragma("GCC unroll 16") for (int j = 0; j < PANEL_RANKS; j++) out[r * out_stride + j] = _mm512_reduce_add_ps(acc[r][j]);     \
    }
#define F32 DTYPE_F32
#define BF16 DTYPE_BF16
#define DOT_BLOCK(R)                                                                                             \
    DOT_BODY(R, F32, F32)                                                                                        \
    DOT_BODY(R, F32, BF16)                                                                                       \
    DOT_BODY(R, BF16, F32)                                                                                       \
    DOT_BODY(R, BF16, BF16)                                                                                      \
    static void dot_block##R(const void *x, int32_t dtype, const int64_t *rows, const void *panel,             \
                             int32_t wdtype, int64_t K, float *out, int64_t out_stride) {                       \
        if (dtype == DTYPE_F32)                                                                                  \
            (wdtype == DTYPE_F32 ? dot_body##R##_F32_F32 : dot_body##R##_F32_BF16)(x, rows, panel, K, out, out_stride); \
        else                                                                                                     \
            (wdtype == DTYPE_F32 ? dot_body##R##_BF16_F32 : dot_body##R##_BF16_BF16)(x, rows, panel, K, out, out_stride); \
    }
DOT_BLOCK(4)
DOT_BLOCK(1)

/* out[first .. first + 16) += sum (under the mask), fp32 or bf16 (rounded once, to nearest even as f32_to_bf16) */
static inline void add_to_out(void *out, int32_t dtype, int64_t first, __m512 sum, __mmask16 mask) {
    if (dtype == DTYPE_F32) {
        float *o = (float *)out + first;
        _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), sum));
    } else {
        uint16_t *o = (uint16_t *)out + first;
        const __m512i bits = _mm512_castps_si512(_mm512_add_ps(load_x16(o, DTYPE_BF16, 0, mask), sum));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded =
            _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
        _mm256_mask_storeu_epi16(o, mask, _mm512_cvtepi32_epi16(rounded));
    }
}

/* out[rows r0.., one panel's 32 columns] += shrunk @ that panel, for R rows at once, the sums in
 * registers over the whole rank (WT, the weights' dtype, a constant: see DOT_BODY); m0 and m1:
 * which of the 32 columns exist. */
#define EXPAND_BODY(R, WT)                                                                                       \
    static void expand_body##R##_##WT(const float *coefficients, int64_t rank4, const void *panel,             \
                                      __m512 *low, __m512 *high) {                                               \
        __m512 l[R], h[R];                                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) l[r] = h[r] = _mm512_setzero_ps();                                           \
        const char *b = (const char *)panel;                                                                     \
        for (int64_t j = 0; j < rank4; j++, b += PANEL_COLUMNS * elem_size(WT)) {                                \
            _mm_prefetch(b + PREFETCH_AHEAD, _MM_HINT_T0);                                                      \
            const __m512 b0 = load_x16(b, WT, 0, 0xffff), b1 = load_x16(b, WT, 16, 0xffff);                      \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                                        \
                const __m512 coefficient = _mm512_set1_ps(coefficients[r * rank4 + j]);                          \
                l[r] = _mm512_fmadd_ps(coefficient, b0, l[r]);                                                   \
                h[r] = _mm512_fmadd_ps(coefficient, b1, h[r]);                                                   \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) low[r] = l[r], high[r] = h[r];                                               \
    }
#define EXPAND_ROWS(R)                                                                                           \
    EXPAND_BODY(R, F32)                                                                                          \
    EXPAND_BODY(R, BF16)                                                                                         \
    static void expand_rows##R(const LoraJob *job, const LoraItem *item, int64_t r0, const void *panel,         \
                               int64_t first_column, __mmask16 m0, __mmask16 m1) {                              \
        const LoraPart *part = item->part;                                                                       \
        const int64_t rank4 = round_up(part->rank, PANEL_RANKS);                                                 \
        __m512 low[R], high[R];                                                                                  \
        (part->dtype == DTYPE_F32 ? expand_body##R##_F32 : expand_body##R##_BF16)(                               \
            item->shrunk + r0 * rank4, rank4, panel, low, high);                                                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                                            \
            const int64_t first = item->rows[r0 + r] * job->N + part->start + first_column;                      \
            add_to_out(job->out, job->dtype, first, low[r], m0);                                                 \
            add_to_out(job->out, job->dtype, first + 16, high[r], m1);                                           \
        }                                                                                                        \
    }
EXPAND_ROWS(8)
EXPAND_ROWS(4)
EXPAND_ROWS(1)
#endif

/* shrink: the item's rows times the part's A, 4 ranks (one panel row) at a time */
static void shrink_item(const LoraJob *job, const LoraItem *item) {
    const LoraPart *part = item->part;
    const int64_t rank4 = round_up(part->rank, PANEL_RANKS), K16 = round_up(job->K, PANEL_INPUTS);
    for (int64_t j0 = 0; j0 < rank4; j0 += PANEL_RANKS) {
        const char *panel = (const char *)part->a + j0 * K16 * elem_size(part->dtype); /* ranks j0 .. j0 + 3 */
        float *out = item->shrunk + j0;
        int64_t r0 = 0;
#ifdef __AVX512F__
        for (; r0 + 4 <= item->num_rows; r0 += 4)
            dot_block4(job->x, job->dtype, item->rows + r0, panel, part->dtype, job->K, out + r0 * rank4, rank4);
        for (; r0 < item->num_rows; r0++)
            dot_block1(job->x, job->dtype, item->rows + r0, panel, part->dtype, job->K, out + r0 * rank4, rank4);
#else
        for (; r0 < item->num_rows; r0++) {
            const void *x = (const char *)job->x + item->rows[r0] * job->K * elem_size(job->dtype);
            float acc[PANEL_RANKS][PANEL_INPUTS] = {{0}};
            for (int64_t k0 = 0; k0 < job->K; k0 += PANEL_INPUTS) {
                const int64_t width = job->K - k0 < PANEL_INPUTS ? job->K - k0 : PANEL_INPUTS;
                const int64_t first = k0 * PANEL_RANKS; /* this chunk's 4 x 16 panel */
                for (int j = 0; j < PANEL_RANKS; j++)
                    for (int64_t c = 0; c < width; c++)
                        acc[j][c] += load_element(x, k0 + c, job->dtype) *
                                     load_element(panel, first + j * PANEL_INPUTS + c, part->dtype);
            }
            for (int j = 0; j < PANEL_RANKS; j++) {
                float sum = 0.0f;
                for (int c = 0; c < PANEL_INPUTS; c++) sum += acc[j][c];
                out[r0 * rank4 + j] = sum;
            }
        }
#endif
    }
}

/* expand: out[rows, start + col0 ...] += shrunk @ Bt over the item's columns, one panel at a time */
static void expand_item(const LoraJob *job, const LoraItem *item) {
    const LoraPart *part = item->part;
    const int64_t rank4 = round_up(part->rank, PANEL_RANKS);
    for (int64_t c = 0; c < item->num_cols; c += PANEL_COLUMNS) {
        const int64_t column = item->col0 + c, left = item->num_cols - c;
        const char *panel = (const char *)part->bt + (column / PANEL_COLUMNS) * rank4 * PANEL_COLUMNS * elem_size(part->dtype);
#ifdef __AVX512F__
        const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        int64_t r0 = 0;
        for (; r0 + 8 <= item->num_rows; r0 += 8) expand_rows8(job, item, r0, panel, column, m0, m1);
        for (; r0 + 4 <= item->num_rows; r0 += 4) expand_rows4(job, item, r0, panel, column, m0, m1);
        for (; r0 < item->num_rows; r0++) expand_rows1(job, item, r0, panel, column, m0, m1);
#else
        const int64_t width = left < PANEL_COLUMNS ? left : PANEL_COLUMNS;
        for (int64_t r = 0; r < item->num_rows; r++) {
            float acc[PANEL_COLUMNS] = {0};
            for (int64_t j = 0; j < rank4; j++) {
                const float coefficient = item->shrunk[r * rank4 + j];
                for (int c2 = 0; c2 < PANEL_COLUMNS; c2++)
                    acc[c2] += coefficient * load_element(panel, j * PANEL_COLUMNS + c2, part->dtype);
            }
            const int64_t first = item->rows[r] * job->N + part->start + column;
            for (int64_t c2 = 0; c2 < width; c2++)
                store_element(job->out, first + c2, load_element(job->out, first + c2, job->dtype) + acc[c2], job->dtype);
        }
#endif
    }
}

/* One task: its rows' shrink, into its own scratch, then its columns' expand. The expand needs only
 * the shrink of its own rows and part, so one dispatch runs them all with no barrier between. */
static void run_task(void *ctx, int64_t index) {
    const LoraJob *job = (const LoraJob *)ctx;
    LoraItem item = job->items[index];
    float shrunk[LORA_ROWS * LORA_MAX_RANK]; /* rank4 <= LORA_MAX_RANK (a multiple of 4) */
    item.shrunk = shrunk;
    shrink_item(job, &item);
    expand_item(job, &item);
}

/* Column ranges per (row block, part): one, unless the step has fewer of those than threads (one
 * adapter: o and down would run on one thread); then each is cut in column ranges that whole
 * panels fill, one per thread, and each range's task repeats the shrink. */
static int64_t column_splits(int64_t num_pairs, int64_t len, int32_t num_threads) {
    if (num_pairs >= num_threads) return 1;
    int64_t splits = (num_threads + num_pairs - 1) / num_pairs, panels = (len + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    return splits < panels ? splits : panels;
}

int rayllm_lora_add(const LoraStep *step, int64_t layer, int32_t product, const void *x, void *out, int64_t N,
                    int64_t K, int32_t dtype, int32_t num_threads) {
    if (step == NULL || step->num_segments == 0) return 0;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (product < 0 || product >= LORA_PRODUCTS || layer < 0 || layer >= step->num_layers) return 2;
    int64_t num_pairs = 0; /* (block of up to LORA_ROWS rows, part) */
    for (int64_t s = 0; s < step->num_segments; s++) {
        const LoraPart *parts = step->segments[s].parts + (layer * LORA_PRODUCTS + product) * LORA_MAX_PARTS;
        const int64_t blocks = (step->segments[s].num_rows + LORA_ROWS - 1) / LORA_ROWS;
        for (int p = 0; p < LORA_MAX_PARTS; p++) {
            if (parts[p].rank <= 0) continue;
            if (parts[p].rank > LORA_MAX_RANK || parts[p].start < 0 || parts[p].start + parts[p].len > N) return 3;
            num_pairs += blocks;
        }
    }
    if (num_pairs == 0) return 0; /* no adapter of the step targets this product */
    /* tasks: a pair each, or (fewer pairs than threads) at most ceil(threads / pairs) each */
    const int64_t max_tasks = num_pairs + num_threads;
    LoraItem stack_items[64];
    LoraItem *items = max_tasks <= 64 ? stack_items : malloc((size_t)max_tasks * sizeof(LoraItem));
    if (items == NULL) return 4;
    LoraItem *task = items;
    for (int64_t s = 0; s < step->num_segments; s++) {
        const LoraPart *parts = step->segments[s].parts + (layer * LORA_PRODUCTS + product) * LORA_MAX_PARTS;
        const int64_t rows = step->segments[s].num_rows;
        for (int p = 0; p < LORA_MAX_PARTS; p++) {
            if (parts[p].rank <= 0) continue;
            const int64_t panels = (parts[p].len + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
            const int64_t splits = column_splits(num_pairs, parts[p].len, num_threads);
            for (int64_t r0 = 0; r0 < rows; r0 += LORA_ROWS) {
                const int64_t num_rows = rows - r0 < LORA_ROWS ? rows - r0 : LORA_ROWS;
                for (int64_t k = 0; k < splits; k++) { /* panels [k * panels / splits, (k + 1) * panels / splits) */
                    const int64_t col0 = k * panels / splits * PANEL_COLUMNS;
                    const int64_t col1 = (k + 1) * panels / splits * PANEL_COLUMNS;
                    const int64_t end = col1 < parts[p].len ? col1 : parts[p].len;
                    *task++ = (LoraItem){parts + p, step->segments[s].rows + r0, NULL, num_rows, col0, end - col0};
                }
            }
        }
    }
    LoraJob job = {items, x, out, N, K, dtype};
    rayllm_parallel_for(task - items, num_threads, run_task, &job);
    if (items != stack_items) free(items);
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
