/* Matrix products over weight panels on AVX-512 CPUs: bf16 with vdpbf16ps where the CPU has
 * AVX512_BF16 (Zen 4, Sapphire Rapids and later), every row count (decode steps and prefill
 * steps alike), and fp32 with FMAs on any AVX-512 CPU, every row count too (workers/linear.py).
 *
 *     out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n])      x, w, bias one dtype; out that or fp32
 *
 * Why: on these CPUs a decode step's products of more than two rows went to oneDNN, which
 * ran them at about 115 GFLOP/s on one core in bf16 and scaled badly to two (each call woke
 * OpenMP's sleeping thread: a batch-16 bf16 step took 57 ms on 2 threads, 49 on 1), and 1-2
 * rows went to the GEMV, another kernel with another summation order. Here one kernel takes
 * every row count up to a limit (workers/linear.py), on our own thread pool (thread_pool.c),
 * and the C forward (forward.c) runs those steps whole.
 *
 * The weight is packed once into panels of 16 output columns, k-major, one 64-byte line per
 * k step of a panel: fp32 panels[p][k][16] holds w[16p + c, k] in lane c (the AVX2 kernel's
 * layout, layer_ops.c); bf16 panels[p][k/2][16][2] holds w[16p + c, k] and w[16p + c, k + 1]
 * in lane c, one vdpbf16ps operand, x's pair broadcast against it. Zeros past N. A tile is MR
 * rows (1 to 6) x P adjacent panels (1 to 4): up to 24 accumulators, each one output column
 * of one row, summed over k in order (fp32: one FMA chain, bit for bit the AVX2 kernel's
 * sums). The tile shape never changes a sum, so a row's result is the same alone or in any
 * batch (a sequence decodes the same tokens either way; a test says so).
 *
 * A group of P panels is walked a block of PANEL_K_BLOCK k steps at a time, every row tile
 * in turn over the block (the first from memory, the others from L1); the sums are kept
 * between blocks in exact fp32 stores (the same chain, bit for bit). Threads claim ranges of
 * groups (and, past PANEL_ROW_SPAN rows, of rows too) as they come free.
 *
 * Prefetch: while the tiles after the first read a block from L1, they prefetch the next
 * block (past the group's last: the next group's first) into L2, the panels split among
 * them, so the first tile of the next block finds it there instead of waiting on DRAM. A
 * decode step's products, bench.bench_linear --threads 2, alternating: bf16 16 rows 16.2-17.2
 * -> 13.4-13.5 ms, 8 rows 11.7 -> 9.8-10.5; fp32 16 rows 30.0 -> 24.1-24.4; 512-2048 rows
 * no worse. A single tile (up to 6 rows) has no L1 pass to hide prefetches behind, and the
 * hardware's streams do as well alone there (bf16 1-4 rows: 8.3-9.3 ms either way; an
 * earlier try that prefetched from the first tile was slower: 17.6 vs 14.5 ms at 1 row,
 * 1 thread).
 */
#include <stdint.h>
#include <string.h>

#include "entry_points.h"
#include "simd.h"

#ifdef __AVX512F__
#define PANEL_COLUMNS 16   /* output columns per panel: one zmm of fp32 sums */
#define PANEL_MAX_GROUP 4  /* panels per tile */
#define PANEL_MAX_TILE 6   /* rows per tile */
#define PANEL_K_BLOCK 64   /* k steps per block: 4 KB of each panel */
#define PANEL_ROW_CHUNK 48 /* rows whose sums are kept across a group's blocks (more rows: chunks) */
#define PANEL_ROW_SPAN (4 * PANEL_ROW_CHUNK) /* rows per claimed range, past which rows are split too */
#define SUMS_ROW (PANEL_MAX_GROUP * PANEL_COLUMNS) /* floats per row of kept sums */

/* Rows [0, MR) of x (row stride K elements) times P panels (panel_stride bytes apart) over k
 * steps [k0, k1), continuing the sums in sums[MR][SUMS_ROW]. A k step is one k (fp32) or one
 * pair of k (bf16); every panel line is 64 bytes. At each k step it also prefetches into L2
 * the line k - k0 of panels [pf_first, pf_end) from `prefetch` (none when they are equal). */
static inline __attribute__((always_inline)) void panel_tile(const void *x, int64_t K, const char *panel,
                                                             int64_t panel_stride, const int MR, const int P,
                                                             const int bf16, int64_t k0, int64_t k1, float *sums,
                                                             const char *prefetch, int pf_first, int pf_end) {
    __m512 acc[PANEL_MAX_TILE][PANEL_MAX_GROUP];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < P; j++) acc[i][j] = _mm512_loadu_ps(sums + i * SUMS_ROW + j * PANEL_COLUMNS);
    for (int64_t k = k0; k < k1; k++) {
        __m512 w[PANEL_MAX_GROUP];
        for (int j = 0; j < P; j++) w[j] = _mm512_loadu_ps((const float *)(panel + j * panel_stride + k * 64));
        for (int j = pf_first; j < pf_end; j++) _mm_prefetch(prefetch + j * panel_stride + (k - k0) * 64, _MM_HINT_T1);
        for (int i = 0; i < MR; i++) {
#ifdef __AVX512BF16__
            if (bf16) {
                int32_t pair;
                memcpy(&pair, (const uint16_t *)x + i * K + 2 * k, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < P; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, (__m512bh)w[j]);
                continue;
            }
#endif
            const __m512 xb = _mm512_set1_ps(((const float *)x)[i * K + k]);
            for (int j = 0; j < P; j++) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < P; j++) _mm512_storeu_ps(sums + i * SUMS_ROW + j * PANEL_COLUMNS, acc[i][j]);
}

/* panel_tile with MR = rows (1-6), P = panels (1-4) and the dtype as compile-time constants. */
#define TILE_CASE(MR_, P_)                                                                         \
    case (MR_) * 8 + (P_):                                                                         \
        if (bf16)                                                                                  \
            panel_tile(x, K, panel, panel_stride, MR_, P_, 1, k0, k1, sums, pf, pf_first, pf_end); \
        else                                                                                       \
            panel_tile(x, K, panel, panel_stride, MR_, P_, 0, k0, k1, sums, pf, pf_first, pf_end); \
        break;
#define TILE_CASES(P_) TILE_CASE(1, P_) TILE_CASE(2, P_) TILE_CASE(3, P_) TILE_CASE(4, P_) TILE_CASE(5, P_) TILE_CASE(6, P_)
static void panel_tile_dispatch(const void *x, int64_t K, const char *panel, int64_t panel_stride, int rows,
                                int panels, int bf16, int64_t k0, int64_t k1, float *sums, const char *pf,
                                int pf_first, int pf_end) {
    switch (rows * 8 + panels) {
        TILE_CASES(1)
        TILE_CASES(2)
        TILE_CASES(3)
        TILE_CASES(4)
    }
}

/* Rows in the next of `tiles_left` row tiles over `rows_left` rows: as even as they go. */
static inline int64_t even_tile_rows(int64_t rows_left, int64_t tiles_left) {
    return rows_left / tiles_left + (rows_left % tiles_left != 0);
}

/* 16 elements of a dtype's vector at p, the first `width` of them (zeros after), as fp32. */
static inline __m512 load_first(const void *p, int64_t width, int dtype) {
    const __mmask16 mask = (__mmask16)((1u << width) - 1u);
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

/* sums[m][j * 16 + c] (+ bias) into out row m, columns n0 + 16 j + c below N. */
static void store_sums(const float *sums, int64_t num_rows, int panels, const void *bias, int dtype, void *out,
                       int out_dtype, int64_t N, int64_t n0) {
    const int64_t bias_elem = dtype == DTYPE_F32 ? 4 : 2;
    for (int j = 0; j < panels; j++) {
        const int64_t n = n0 + j * PANEL_COLUMNS, width = N - n < PANEL_COLUMNS ? N - n : PANEL_COLUMNS;
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        const __m512 b = bias ? load_first((const char *)bias + n * bias_elem, width, dtype) : _mm512_setzero_ps();
        for (int64_t m = 0; m < num_rows; m++) {
            const __m512 value = _mm512_add_ps(_mm512_loadu_ps(sums + m * SUMS_ROW + j * PANEL_COLUMNS), b);
            if (out_dtype == DTYPE_F32)
                _mm512_mask_storeu_ps((float *)out + m * N + n, mask, value);
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + m * N + n, mask, cvt16_bf16(value));
        }
    }
}

typedef struct {
    const void *x, *panels, *bias;
    void *out;
    int64_t num_rows, N, K, num_panels, span; /* span: panels per claimed range */
    int64_t row_span, num_row_spans;          /* rows per claimed range, and how many such row ranges */
    int dtype, out_dtype;
} PanelJob;

/* Rows [row_begin, row_end) of the job times `panels` panels from panel p. */
static void panel_group(const PanelJob *job, int64_t p, int panels, int64_t row_begin, int64_t row_end) {
    const int bf16 = job->dtype == DTYPE_BF16;
    const int64_t steps = bf16 ? job->K / 2 : job->K, panel_stride = steps * 64, elem = bf16 ? 2 : 4;
    const char *panel = (const char *)job->panels + p * panel_stride;
    const int64_t out_row_bytes = job->N * (job->out_dtype == DTYPE_F32 ? 4 : 2);
    float sums[PANEL_ROW_CHUNK * SUMS_ROW];
    for (int64_t m0 = row_begin; m0 < row_end; m0 += PANEL_ROW_CHUNK) {
        const int64_t rows = row_end - m0 < PANEL_ROW_CHUNK ? row_end - m0 : PANEL_ROW_CHUNK;
        const int64_t num_tiles = (rows + PANEL_MAX_TILE - 1) / PANEL_MAX_TILE;
        memset(sums, 0, (size_t)rows * SUMS_ROW * sizeof(float));
        for (int64_t k0 = 0; k0 < steps; k0 += PANEL_K_BLOCK) {
            const int64_t k1 = k0 + PANEL_K_BLOCK < steps ? k0 + PANEL_K_BLOCK : steps;
            /* the next block (past the last: the next group's first), prefetched by the tiles
             * after the first, which read this block from L1: panels split among them */
            const char *pf = k1 < steps ? panel + k1 * 64 : panel + panels * panel_stride;
            for (int64_t t = 0, m = 0; t < num_tiles; t++) {
                const int64_t tile = even_tile_rows(rows - m, num_tiles - t);
                int pf_first = 0, pf_end = 0;
                if (t > 0) {
                    pf_first = (int)((t - 1) * panels / (num_tiles - 1));
                    pf_end = (int)(t * panels / (num_tiles - 1));
                }
                panel_tile_dispatch((const char *)job->x + (m0 + m) * job->K * elem, job->K, panel, panel_stride,
                                    (int)tile, panels, bf16, k0, k1, sums + m * SUMS_ROW, pf, pf_first, pf_end);
                m += tile;
            }
        }
        store_sums(sums, rows, panels, job->bias, job->dtype, (char *)job->out + m0 * out_row_bytes, job->out_dtype,
                   job->N, p * PANEL_COLUMNS);
    }
}

/* Item `item` is panel range item / num_row_spans times row range item % num_row_spans: one
 * thread walks a range's row ranges in turn while its panels stay in L2. */
static void panel_range(void *context, int64_t item) {
    const PanelJob *job = context;
    const int64_t start = item / job->num_row_spans * job->span;
    const int64_t end = start + job->span < job->num_panels ? start + job->span : job->num_panels;
    const int64_t row_begin = item % job->num_row_spans * job->row_span;
    const int64_t row_end = row_begin + job->row_span < job->num_rows ? row_begin + job->row_span : job->num_rows;
    for (int64_t p = start; p < end; p += PANEL_MAX_GROUP)
        panel_group(job, p, (int)(end - p < PANEL_MAX_GROUP ? end - p : PANEL_MAX_GROUP), row_begin, row_end);
}

int rayllm_panel_gemm_avx512(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows,
                             int64_t N, int64_t K, int32_t dtype, int32_t out_dtype, int32_t num_threads) {
    if (num_rows < 1 || N < 1 || K < 1 || (dtype == DTYPE_BF16 && K % 2)) return 2;
#ifndef __AVX512BF16__
    if (dtype == DTYPE_BF16) return 1;
#endif
    const int64_t num_panels = (N + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    const int threads = num_threads > 0 ? num_threads : 1;
    /* ranges of whole groups, about 8 per thread, claimed as threads come free */
    const int64_t num_groups = (num_panels + PANEL_MAX_GROUP - 1) / PANEL_MAX_GROUP;
    const int64_t groups_per_range = num_groups / (threads * 8) > 1 ? num_groups / (threads * 8) : 1;
    /* many rows (a prefill step): also split into ranges of PANEL_ROW_SPAN rows, so a product
     * with few panel ranges (N = 576: 9) still spreads evenly over the threads */
    const int64_t row_span = num_rows > PANEL_ROW_SPAN ? PANEL_ROW_SPAN : num_rows;
    const int64_t num_row_spans = (num_rows + row_span - 1) / row_span;
    PanelJob job = {x, panels, bias, out, num_rows, N, K, num_panels, groups_per_range * PANEL_MAX_GROUP,
                    row_span, num_row_spans, dtype, out_dtype};
    const int64_t num_ranges = (num_panels + job.span - 1) / job.span;
    rayllm_parallel_for(num_ranges * num_row_spans, num_panels >= 8 ? threads : 1, panel_range, &job);
    return 0;
}
#endif

/* fp32 lanes of this build's vectors: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (portable C). */
int rayllm_vector_width(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(RAYLLM_AVX2)
    return 8;
#else
    return 1;
#endif
}

/* 1 where this build has the bf16 panel GEMM (AVX512_BF16), else 0. */
int rayllm_panel_gemm_bf16_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* x: [num_rows, K] bf16; panels: [ceil(N / 16), K / 2, 16, 2] bf16 (layout above); bias: [N]
 * bf16 or NULL; out: [num_rows, N] in out_dtype (DTYPE_BF16, rounded to nearest even, or
 * DTYPE_F32). K must be even. Returns 1 where this build has no such kernel, 2 on bad sizes. */
int rayllm_panel_gemm_bf16(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows, int64_t N,
                           int64_t K, int32_t out_dtype, int32_t num_threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return rayllm_panel_gemm_avx512(x, panels, bias, out, num_rows, N, K, DTYPE_BF16, out_dtype, num_threads);
#else
    (void)x, (void)panels, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)out_dtype, (void)num_threads;
    return 1;
#endif
}
