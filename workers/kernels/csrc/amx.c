/* Matrix products on AMX tiles (Intel Xeon since Sapphire Rapids), and the CPU's features.
 *
 *     out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n])      x bf16 or fp32 (rounded to bf16 once),
 *                                                         w bf16 panels or GGUF blocks, out bf16 or fp32
 *
 * An AMX core multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums in one
 * instruction (TDPBF16PS): 16 K multiply-adds, about 16 cycles, where an AVX-512 core does 32
 * bf16 multiply-adds a cycle at best. The weight operand (tile "B") wants each of its 16 rows
 * to hold 16 output columns' pairs of k: exactly one 64-byte line of panel_avx512.c's bf16
 * panels ([N / 16][K / 2][16][2]), so a dense bf16 weight is read in place, 16 lines of a panel
 * (32 k) per tile, and no second copy is kept. A GGUF weight's blocks are dequantized (by
 * gguf_gemm.c's own decode; packed Q4_0/Q4_1 straight from their groups) into such panels once
 * per call, a chunk of at most CHUNK_BYTES at a time so that it stays in the caches while every
 * row passes it.
 *
 * A tile block is 32 rows x 32 columns: 2 x tiles ("A", 16 rows each, read in place from x
 * with x's row stride) and 2 weight tiles, 4 sums tiles (TMM0-3), the 8 tile registers. The
 * sums leave the tiles once, after the k loop, through a 4 KB buffer; the epilogue that adds
 * the bias and rounds to out's dtype runs for the block before while the tiles compute the next.
 * Rows past the last whole 16 come from a zero-padded copy (fp32 x: all of x, rounded to bf16).
 *
 * Threads claim items of (a span of rows) x (a range of column groups), about 8 a thread, a
 * span's items one after another: the span's rows of x (up to SPAN_BYTES) stay in L2 while the
 * groups pass, and each group's weights (32 columns x K) in L1/L2 while the span's blocks pass.
 * Measured on a 2-core Sapphire Rapids-class Xeon whose tiles peak at 3.4 TFLOP/s a core (a
 * loop of TDPBF16PS on registers): SmolLM2's shapes at 1024-4096 rows run at 1.0-1.4 TFLOP/s on
 * one thread and 1.7-2.6 on two, oneDNN's brg_matmul 1.2-1.6 and 1.2-2.8. The loop alone, over
 * L1- and L2-resident operands, reaches 2.2 (65%): both operands come from L2 when K is large,
 * and a 2 x 2 block needs 64 bytes a cycle from wherever they are.
 *
 * Summation: TDPBF16PS accumulates in fp32 in an order of its own (not vdpbf16ps's: on a
 * Sapphire Rapids, 70% of 16 x 16 outputs over K = 576 differed from panel_avx512.c's in the
 * last bits, by at most 4e-5 relative), so a row's result depends on whether its step ran on
 * tiles or on the panels; on tiles alone it is the same in any batch (each output is one tile
 * chain over k in order, whatever the row block or thread). The tests bound the difference.
 *
 * Tile data needs the OS's permission once per process (Linux 5.16 on: arch_prctl
 * ARCH_REQ_XCOMP_PERM); rayllm_amx_enable asks for it (once: a tile instruction without it is
 * SIGILL), every product here checks its answer, and workers/kernels/cpu_isa.py sends no
 * product here unless it said yes. Each item loads the tile configuration and releases the
 * tiles after: the thread may run oneDNN's tiles in between.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "amx_tiles.h"
#include "simd.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ------------------------------------------------------------------------- the CPU's features */

static int xgetbv_has(int bit) {
#if defined(__x86_64__)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return 0; /* OSXSAVE */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (uint64_t)hi << 32 | lo;
    return (int)((xcr0 >> bit) & 1u);
#else
    (void)bit;
    return 0;
#endif
}

/* CPU_* bits (entry_points.h) of what this CPU has, read from CPUID (and XCR0: the OS saves the
 * AVX-512 and tile state), whatever this build was compiled for. */
int rayllm_cpu_features(void) {
    int features = 0;
#if defined(__x86_64__)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    const unsigned b7 = ebx, c7 = ecx, d7 = edx;
    const int avx_state = xgetbv_has(1) && xgetbv_has(2), zmm_state = avx_state && xgetbv_has(5) && xgetbv_has(6) && xgetbv_has(7);
    if (avx_state && (b7 & (1u << 5))) features |= CPU_AVX2;
    if (zmm_state && (b7 & (1u << 16))) {
        features |= CPU_AVX512;
        if (c7 & (1u << 11)) features |= CPU_AVX512_VNNI;
        if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5))) features |= CPU_AVX512_BF16;
    }
    if (xgetbv_has(17) && xgetbv_has(18) && (d7 & (1u << 24))) {
        if (d7 & (1u << 22)) features |= CPU_AMX_BF16;
        if (d7 & (1u << 25)) features |= CPU_AMX_INT8;
    }
#endif
    return features;
}

/* 1 where this build has the tile kernels (compiled for a CPU with AMX-BF16), else 0. */
int rayllm_amx_built(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks the OS for tile data in this process (once; later calls give the first answer). AMX_GRANTED,
 * or why not: AMX_NOT_BUILT, AMX_NO_CPU (no AMX-BF16, or XCR0 leaves the tiles out), AMX_REFUSED
 * (the kernel said no: Linux before 5.16, or a sandbox). */
static int amx_request(void) {
    if (!rayllm_amx_built()) return AMX_NOT_BUILT;
    if (!(rayllm_cpu_features() & CPU_AMX_BF16)) return AMX_NO_CPU;
#if defined(__linux__) && defined(__x86_64__)
    unsigned long permitted = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return AMX_REFUSED;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &permitted) != 0) return AMX_REFUSED;
    return permitted & (1ul << XFEATURE_XTILEDATA) ? AMX_GRANTED : AMX_REFUSED;
#else
    return AMX_REFUSED;
#endif
}

static int amx_answer;
static void ask_once(void) { amx_answer = amx_request(); }

int rayllm_amx_enable(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, ask_once);
    return amx_answer;
}

/* ------------------------------------------------------------------------- the tile products */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define TILE_ROWS_AMX 16 /* rows of an x tile and of a sums tile */
#define TILE_K 32        /* bf16 k of an x tile: 64 bytes a row */
#define GROUP_COLUMNS 32 /* output columns of a group: two panels, two weight tiles */
#define SPAN_BYTES (768 << 10) /* an item's rows of x at most (L2 holds 1-2 MB a core) */
#define MAX_SPAN_ROWS 1024
#define CHUNK_BYTES (4 << 20) /* a GGUF weight's bf16 panels dequantized at a time, at most */

/* Every tile 16 rows of 64 bytes: TMM0-3 the sums (fp32), TMM4-5 x, TMM6-7 the weights. */
static void configure_tiles(void) { load_full_tiles(); }

typedef struct {
    const uint16_t *x;       /* [x_rows, K] bf16: the caller's x, or its bf16 copy */
    int64_t x_rows;          /* rows of x read in place (a multiple of 16); later rows from tail */
    const uint16_t *tail;    /* [16, K] bf16: rows x_rows.. of x, zeros past num_rows */
    const uint16_t *panels;  /* [.., K / 2, 16, 2] bf16 panels: a dense weight's, or a GGUF chunk's */
    const uint8_t *w;        /* GGUF: [N, row_bytes] blocks of `type` (with GGUF_PACKED) */
    int32_t type;
    int64_t row_bytes;
    const void *bias;        /* [N] in bias_dtype, or NULL */
    void *out;               /* [num_rows, N] in out_dtype */
    int64_t num_rows, N, K;
    int64_t span_rows, num_spans;          /* rows of an item (a multiple of 32), and how many spans */
    int64_t groups_per_item, num_group_items; /* an item's groups, and items per span */
    int64_t group_begin, group_end; /* the groups (of 32 columns) of this pass */
    int64_t panels_group;    /* the group whose panels start at `panels` */
    int32_t bias_dtype, out_dtype;
    /* a gated product (rayllm_amx_gated_gemm_bf16): group g is gate panel g beside up panel g +
     * up_panels, and out column 16 g + c is act(gate) * up; activation -1: a plain product */
    int32_t activation;
    int64_t up_panels;
    float alpha, limit;
} AmxJob;

/* The x tile of rows [m, m + 16). */
static inline const uint16_t *x_tile(const AmxJob *job, int64_t m) {
    return m < job->x_rows ? job->x + m * job->K : job->tail + (m - job->x_rows) * job->K;
}

/* 16 bias values from column n (the first `width`, zeros after; zeros without a bias), as fp32. */
static inline __m512 load_bias(const AmxJob *job, int64_t n, int width) {
    const __mmask16 mask = (__mmask16)((1u << width) - 1u);
    if (!job->bias) return _mm512_setzero_ps();
    if (job->bias_dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)job->bias + n);
    const __m256i half = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)job->bias + n);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* Rows [r0, r1) of sums [32][32], the block of rows from m and columns [n, n + columns) (+ bias),
 * into out. A block of 32 columns stores a row's 32 outputs in one 64-byte write (bf16) or two (fp32). */
static void store_block(const AmxJob *job, const float *sums, int64_t m, int r0, int r1, int64_t n, int columns) {
    const int64_t out_elem = job->out_dtype == DTYPE_F32 ? 4 : 2;
    if (columns == GROUP_COLUMNS) {
        const __m512 bias0 = load_bias(job, n, 16), bias1 = load_bias(job, n + 16, 16);
        const int64_t row_bytes = job->N * out_elem;
        char *o = (char *)job->out + ((m + r0) * job->N + n) * out_elem;
        for (int r = r0; r < r1; r++, o += row_bytes) {
            const __m512 lo = _mm512_add_ps(_mm512_load_ps(sums + r * GROUP_COLUMNS), bias0);
            const __m512 hi = _mm512_add_ps(_mm512_load_ps(sums + r * GROUP_COLUMNS + 16), bias1);
            if (job->out_dtype == DTYPE_F32) {
                _mm512_storeu_ps(o, lo);
                _mm512_storeu_ps(o + 64, hi);
            } else {
                _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
        return;
    }
    const int64_t bias_elem = job->bias_dtype == DTYPE_F32 ? 4 : 2;
    for (int half = 0; half * 16 < columns; half++) {
        const int width = columns - half * 16 < 16 ? columns - half * 16 : 16;
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        const int64_t column = n + half * 16;
        __m512 bias = _mm512_setzero_ps();
        if (job->bias) {
            const char *b = (const char *)job->bias + column * bias_elem;
            bias = job->bias_dtype == DTYPE_F32 ? _mm512_maskz_loadu_ps(mask, b)
                                                : _mm512_castsi512_ps(_mm512_slli_epi32(
                                                      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, b)), 16));
        }
        for (int r = r0; r < r1; r++) {
            const __m512 value = _mm512_add_ps(_mm512_loadu_ps(sums + r * GROUP_COLUMNS + half * 16), bias);
            char *o = (char *)job->out + ((m + r) * job->N + column) * out_elem;
            if (job->out_dtype == DTYPE_F32)
                _mm512_mask_storeu_ps(o, mask, value);
            else
                _mm256_mask_storeu_epi16(o, mask, (__m256i)_mm512_cvtneps_pbh(value));
        }
    }
}

/* Rows [m, m + 16 or 32) times one or two weight tiles' panels (b0, b1: K / 2 lines of 64
 * bytes each), left in the sums tiles: TMM0 (x0 b0), TMM1 (x0 b1), TMM2 (x1 b0), TMM3 (x1 b1).
 * The tile numbers are the instructions' operands, so each shape is its own function. */
#define TILE_PRODUCT(NAME, TWO_X, TWO_W)                                                             \
    static inline void NAME(const uint16_t *x0, const uint16_t *x1, int64_t x_stride, const uint16_t *b0, \
                            const uint16_t *b1, int64_t k_tiles) {                                   \
        _tile_zero(0);                                                                               \
        if (TWO_W) _tile_zero(1);                                                                    \
        if (TWO_X) _tile_zero(2);                                                                    \
        if (TWO_X && TWO_W) _tile_zero(3);                                                           \
        for (int64_t t = 0; t < k_tiles; t++) {                                                      \
            _tile_loadd(4, x0 + t * TILE_K, x_stride);                                               \
            _tile_loadd(6, b0 + t * TILE_K * 16, 64);                                                \
            _tile_dpbf16ps(0, 4, 6);                                                                 \
            if (TWO_W) {                                                                             \
                _tile_loadd(7, b1 + t * TILE_K * 16, 64);                                            \
                _tile_dpbf16ps(1, 4, 7);                                                             \
            }                                                                                        \
            if (TWO_X) {                                                                             \
                _tile_loadd(5, x1 + t * TILE_K, x_stride);                                           \
                _tile_dpbf16ps(2, 5, 6);                                                             \
                if (TWO_W) _tile_dpbf16ps(3, 5, 7);                                                  \
            }                                                                                        \
        }                                                                                            \
    }
TILE_PRODUCT(tile_product_1x1, 0, 0)
TILE_PRODUCT(tile_product_1x2, 0, 1)
TILE_PRODUCT(tile_product_2x1, 1, 0)

/* The sums tiles of a block of rows x columns into sums [32][32]. */
static inline void store_tiles(int rows, int columns, float *sums) {
    _tile_stored(0, sums, GROUP_COLUMNS * 4);
    if (columns > 16) _tile_stored(1, sums + 16, GROUP_COLUMNS * 4);
    if (rows > 16) _tile_stored(2, sums + 16 * GROUP_COLUMNS, GROUP_COLUMNS * 4);
    if (rows > 16 && columns > 16) _tile_stored(3, sums + 16 * GROUP_COLUMNS + 16, GROUP_COLUMNS * 4);
}

typedef struct {
    int64_t m, n;
    int rows, columns; /* 0 rows: none */
} Block;

static uint16_t *thread_buffer(uint16_t **buffer, int64_t *elems, int64_t needed) {
    if (*elems < needed) {
        free(*buffer);
        *buffer = aligned_alloc(64, (size_t)((needed * 2 + 63) / 64 * 64));
        *elems = *buffer ? needed : 0;
    }
    return *buffer;
}

/* A gated block's sums [32][32] (16 gates, then 16 ups, a row) into out columns [n, n + 16):
 * gate and up (+ bias) rounded to bf16 as a gate_up product's output is, then act(gate) * up,
 * with rayllm_gated_mul's own arithmetic (simd.h's gated16): the unfused path's bits. */
static void store_gated_block(const AmxJob *job, const float *sums, int64_t m, int r0, int r1, int64_t n) {
    const __m512 gate_bias = load_bias(job, n, 16), up_bias = load_bias(job, n + job->N, 16); /* ups after N gates */
    const int bf16 = job->out_dtype == DTYPE_BF16;
    /* a bf16 step's gates and ups are bf16 values (its bias's dtype is the step's); an fp32
     * step's stay as the product leaves them, whatever out's dtype */
    const int bf16_gates = job->bias_dtype == DTYPE_BF16;
    const int64_t elem = bf16 ? 2 : 4;
    for (int r = r0; r < r1; r++) {
        __m512 g = _mm512_add_ps(_mm512_load_ps(sums + r * GROUP_COLUMNS), gate_bias);
        __m512 u = _mm512_add_ps(_mm512_load_ps(sums + r * GROUP_COLUMNS + 16), up_bias);
        if (bf16_gates) g = round_bf16(g), u = round_bf16(u);
        store16((char *)job->out + ((m + r) * job->N + n) * elem, gated16(g, u, job->activation, job->alpha, job->limit),
                bf16);
    }
}

/* Rows [r0, r1) of a block's sums into out: the epilogue, a few rows at a time or whole. */
static inline void finish_rows(const AmxJob *job, const float *sums, Block block, int r0, int r1) {
    if (job->activation >= 0) store_gated_block(job, sums, block.m, r0, r1, block.n);
    else store_block(job, sums, block.m, r0, r1, block.n, block.columns);
}

static inline void finish_block(const AmxJob *job, const float *sums, Block block) {
    finish_rows(job, sums, block, 0, block.rows);
}

/* The 2 x 2 block (TILE_PRODUCT's shape with both x tiles and both weight tiles), with the
 * epilogue of the block before (done, its sums in `before`; none when done.rows is 0) spread over
 * the k steps, a row or two after each step's four products: the vector work then waits in the
 * core's window beside tile instructions that take 16 cycles each, where after the k loop (its
 * 1000+ instructions for a gated block) most of it would wait for the tiles to finish. */
static inline void tile_product_2x2_finishing(const AmxJob *job, const uint16_t *x0, const uint16_t *x1,
                                              int64_t x_stride, const uint16_t *b0, const uint16_t *b1,
                                              int64_t k_tiles, const float *before, Block done) {
    const int per_step = (int)((done.rows + k_tiles - 1) / k_tiles);
    int r = 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < k_tiles; t++) {
        _tile_loadd(4, x0 + t * TILE_K, x_stride);
        _tile_loadd(6, b0 + t * TILE_K * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + t * TILE_K * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x1 + t * TILE_K, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (r < done.rows) {
            const int r1 = r + per_step < done.rows ? r + per_step : done.rows;
            finish_rows(job, before, done, r, r1);
            r = r1;
        }
    }
    if (r < done.rows) finish_rows(job, before, done, r, done.rows);
}

/* One item: rows [span * span_rows, ...) times groups [g0, g1) of the job's group range. Each
 * block's sums leave their tiles after its products are issued, and the vector epilogue of the
 * block before (bias, rounding, the stores to out) runs while the tiles compute. */
static void amx_item(void *context, int64_t item) {
    const AmxJob *job = context;
    const int64_t span = item / job->num_group_items;
    const int64_t g0 = job->group_begin + item % job->num_group_items * job->groups_per_item;
    const int64_t g1 = g0 + job->groups_per_item < job->group_end ? g0 + job->groups_per_item : job->group_end;
    const int64_t m0 = span * job->span_rows, m1 = m0 + job->span_rows < job->num_rows ? m0 + job->span_rows : job->num_rows;
    const int64_t K = job->K, k_tiles = K / TILE_K, panel_elems = K * 16, x_stride = K * 2;
    float sums[2][32 * GROUP_COLUMNS] __attribute__((aligned(64)));
    Block done = {0, 0, 0, 0};
    int buffer = 0;
    configure_tiles();
    for (int64_t g = g0; g < g1; g++) {
        const int gated = job->activation >= 0;
        const int64_t n = g * (gated ? 16 : GROUP_COLUMNS);
        /* the tiles' columns: a gated group's 16 gates and 16 ups, else up to 32 outputs */
        const int columns = gated ? GROUP_COLUMNS : job->N - n < GROUP_COLUMNS ? (int)(job->N - n) : GROUP_COLUMNS;
        const uint16_t *b0 = job->panels + (g - job->panels_group) * (gated ? 1 : 2) * panel_elems;
        const uint16_t *b1 = b0 + (gated ? job->up_panels : 1) * panel_elems;
        for (int64_t m = m0; m < m1; m += 32) {
            const int rows = m1 - m < 32 ? (int)(m1 - m) : 32;
            const uint16_t *x0 = x_tile(job, m), *x1 = rows > 16 ? x_tile(job, m + 16) : NULL;
            if (x1 && columns > 16) {
                tile_product_2x2_finishing(job, x0, x1, x_stride, b0, b1, k_tiles, sums[buffer ^ 1], done);
            } else {
                if (x1) tile_product_2x1(x0, x1, x_stride, b0, b1, k_tiles);
                else if (columns > 16) tile_product_1x2(x0, x1, x_stride, b0, b1, k_tiles);
                else tile_product_1x1(x0, x1, x_stride, b0, b1, k_tiles);
                if (done.rows) finish_block(job, sums[buffer ^ 1], done);
            }
            store_tiles(rows, columns, sums[buffer]);
            done = (Block){m, n, rows, columns};
            buffer ^= 1;
        }
    }
    if (done.rows) finish_block(job, sums[buffer ^ 1], done);
    _tile_release();
}

/* Tile items over the job's group range [group_begin, group_end): about 8 a thread, a row span's
 * items one after another (its x rows stay in L2 while the groups pass). */
static void run_items(AmxJob *job, int threads) {
    const int64_t num_groups = job->group_end - job->group_begin, wanted = threads * 8 / job->num_spans;
    job->groups_per_item = wanted > 0 && num_groups / wanted > 1 ? num_groups / wanted : 1;
    job->num_group_items = (num_groups + job->groups_per_item - 1) / job->groups_per_item;
    rayllm_parallel_for(job->num_spans * job->num_group_items, threads, amx_item, job);
}

/* Dequantization item: one group of the chunk into its two panels. A gated chunk of act groups
 * [group_begin, group_end) (16 columns each, an even count) holds their gates' panels, then their
 * ups' (each 32 columns of the gate_up weight, N gates then N ups, in two panels). */
static void dequantize_group(void *context, int64_t item) {
    const AmxJob *job = context;
    const int64_t group_elems = 2 * job->K * 16;
    uint16_t *to = (uint16_t *)job->panels + item * group_elems;
    if (job->activation >= 0) {
        const int64_t half = (job->group_end - job->group_begin) / 2, slice = item % half;
        const int64_t n0 = job->group_begin * 16 + 32 * slice + (item >= half ? job->N : 0);
        rayllm_gguf_bf16_panels(job->w, job->type, job->row_bytes, 2 * job->N, job->K, n0, to);
        return;
    }
    rayllm_gguf_bf16_panels(job->w, job->type, job->row_bytes, job->N, job->K, (job->group_begin + item) * GROUP_COLUMNS,
                            to);
}

/* The caller's buffer for a GGUF weight's chunk of bf16 panels. */
static __thread uint16_t *chunk_buffer;
static __thread int64_t chunk_buffer_elems;

/* A GGUF weight a chunk of groups at a time: the chunk's blocks dequantized to bf16 panels once
 * (CHUNK_BYTES at most, so they stay in the caches), then every row through it on tiles. */
static int gguf_chunks(AmxJob *job, int threads) {
    const int gated = job->activation >= 0;
    /* a chunk's groups: 32 columns of the weight each, or (gated) 16 act columns, 32 of the weight */
    const int64_t group_elems = 2 * job->K * 16, num_groups = gated ? job->N / 16 : (job->N + GROUP_COLUMNS - 1) / GROUP_COLUMNS;
    int64_t chunk = CHUNK_BYTES / (group_elems * 2);
    chunk = chunk < 2 ? 2 : chunk > num_groups ? num_groups : chunk / 2 * 2; /* gated: whole 32-column slices */
    uint16_t *panels = thread_buffer(&chunk_buffer, &chunk_buffer_elems, chunk * group_elems);
    if (!panels) return 3;
    for (int64_t g = 0; g < num_groups; g += chunk) {
        job->group_begin = job->panels_group = g;
        job->group_end = g + chunk < num_groups ? g + chunk : num_groups;
        job->panels = panels;
        job->up_panels = job->group_end - g; /* gated: the ups' panels follow the chunk's gates' */
        rayllm_parallel_for(job->group_end - g, threads, dequantize_group, job);
        run_items(job, threads);
    }
    return 0;
}

typedef struct {
    const float *x;
    uint16_t *to;
    int64_t num_rows, padded_rows, K;
} ToBf16Job;

#define ROWS_PER_CONVERT_ITEM 16

/* Rows of fp32 x rounded to bf16 (nearest even), zero rows past num_rows. */
static void convert_rows(void *context, int64_t item) {
    const ToBf16Job *c = context;
    for (int64_t m = item * ROWS_PER_CONVERT_ITEM; m < (item + 1) * ROWS_PER_CONVERT_ITEM && m < c->padded_rows; m++) {
        uint16_t *to = c->to + m * c->K;
        if (m >= c->num_rows) {
            memset(to, 0, (size_t)c->K * 2);
            continue;
        }
        const float *from = c->x + m * c->K;
        int64_t k = 0;
        for (; k + 32 <= c->K; k += 32)
            _mm512_storeu_si512(to + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + k + 16), _mm512_loadu_ps(from + k)));
        for (; k < c->K; k++) to[k] = f32_to_bf16(from[k]);
    }
}

/* The caller's buffers: x in bf16 (fp32 x), and the tail rows (bf16 x). */
static __thread uint16_t *x_buffer, *tail_buffer;
static __thread int64_t x_buffer_elems, tail_buffer_elems;

static int amx_gemm(const void *x, int32_t dtype, AmxJob *job, int32_t num_threads) {
    const int64_t M = job->num_rows, K = job->K;
    if (rayllm_amx_enable() != AMX_GRANTED) return 1; /* a tile instruction without the OS's grant is SIGILL */
    if (M < 1 || job->N < 1 || K < TILE_K || K % TILE_K) return 2;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (job->out_dtype != DTYPE_F32 && job->out_dtype != DTYPE_BF16) return 1;
    const int threads = num_threads > 0 ? num_threads : 1;
    if (dtype == DTYPE_F32) { /* rounded to bf16 once, padded to whole tiles with zero rows */
        const int64_t padded = (M + 15) / 16 * 16;
        uint16_t *copy = thread_buffer(&x_buffer, &x_buffer_elems, padded * K);
        if (!copy) return 3;
        ToBf16Job convert = {x, copy, M, padded, K};
        const int64_t items = (padded + ROWS_PER_CONVERT_ITEM - 1) / ROWS_PER_CONVERT_ITEM;
        rayllm_parallel_for(items, M >= 64 ? threads : 1, convert_rows, &convert);
        job->x = copy, job->x_rows = padded, job->tail = NULL;
    } else {
        job->x = x, job->x_rows = M / 16 * 16;
        if (M % 16) {
            uint16_t *tail = thread_buffer(&tail_buffer, &tail_buffer_elems, 16 * K);
            if (!tail) return 3;
            memset(tail, 0, (size_t)(16 * K * 2));
            memcpy(tail, (const uint16_t *)x + job->x_rows * K, (size_t)((M - job->x_rows) * K * 2));
            job->tail = tail;
        }
    }
    /* an item's x rows in L2 beside what else the thread keeps there */
    const int64_t span = SPAN_BYTES / (K * 2) / 32 * 32;
    job->span_rows = span < 32 ? 32 : span > MAX_SPAN_ROWS ? MAX_SPAN_ROWS : span;
    job->num_spans = (M + job->span_rows - 1) / job->span_rows;
    if (job->w) return gguf_chunks(job, threads);
    job->group_begin = job->panels_group = 0;
    job->group_end = job->activation >= 0 ? job->N / 16 : (job->N + GROUP_COLUMNS - 1) / GROUP_COLUMNS;
    run_items(job, threads);
    return 0;
}

/* A product over GGUF blocks w of ggml_type: plain (activation -1, w [N, K]) or gated (w [2 N, K]). */
static int gguf_product(const void *x, int32_t x_dtype, const uint8_t *w, int32_t ggml_type, const void *bias,
                        int32_t bias_dtype, void *out, int32_t out_dtype, int64_t num_rows, int64_t N, int64_t K,
                        int32_t activation, float alpha, float limit, int32_t num_threads) {
    const int64_t row_bytes = rayllm_gguf_row_bytes(ggml_type, activation >= 0 ? 2 * N : N, K);
    if (row_bytes < 0) return row_bytes == -1 ? 1 : 2;
    AmxJob job = {.w = w, .type = ggml_type, .row_bytes = row_bytes, .bias = bias, .out = out, .num_rows = num_rows,
                  .N = N, .K = K, .bias_dtype = bias_dtype, .out_dtype = out_dtype, .activation = activation,
                  .alpha = alpha, .limit = limit};
    return amx_gemm(x, x_dtype, &job, num_threads);
}
#endif

/* x: [num_rows, K] bf16 or fp32 (dtype); panels: [ceil(N / 16), K / 2, 16, 2] bf16 (panel_avx512.c's
 * layout); bias: [N] in dtype, or NULL; out: [num_rows, N] in out_dtype. K a multiple of 32.
 * Returns 1 where this build has no tiles (or a dtype it does not take), 2 on bad sizes, 3 out of
 * memory. The caller has had rayllm_amx_enable say AMX_GRANTED. */
int rayllm_amx_gemm_bf16(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows, int64_t N,
                         int64_t K, int32_t dtype, int32_t out_dtype, int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    AmxJob job = {.panels = panels, .bias = bias, .out = out, .num_rows = num_rows, .N = N, .K = K,
                  .bias_dtype = dtype, .out_dtype = out_dtype, .activation = -1};
    return amx_gemm(x, dtype, &job, num_threads);
#else
    (void)x, (void)panels, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)dtype, (void)out_dtype;
    (void)num_threads;
    return 1;
#endif
}

/* The same over GGUF blocks (w: [N, row bytes] of ggml_type, GGUF_PACKED or not), each group of
 * 32 columns dequantized to bf16 panels as it is reached. */
int rayllm_amx_gguf_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows, int64_t N,
                         int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype, int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return gguf_product(x, dtype, w, ggml_type, bias, dtype, out, out_dtype, num_rows, N, K, -1, 0.0f, 0.0f,
                        num_threads);
#else
    (void)x, (void)w, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)ggml_type, (void)dtype;
    (void)out_dtype, (void)num_threads;
    return 1;
#endif
}

/* A GGUF product of an fp32 step whose x its producer already rounded to bf16 (forward.c: a norm,
 * or the gated product before a down projection): x [num_rows, K] bf16, bias fp32 or NULL. With
 * activation -1 out is [num_rows, N] fp32, the bits rayllm_amx_gguf_gemm gives for the fp32 x,
 * which it rounds to bf16 the same way (nearest even) before any tile sees it. Otherwise the
 * gated product of a gate_up weight ([2 N, K], N = width, a multiple of 32), the gates and ups
 * in fp32 as rayllm_amx_gguf_gated_gemm's, out in out_dtype: bf16 for a reader that rounds its x
 * to bf16 anyway, so that no fp32 copy is written and rounded again. */
int rayllm_amx_gguf_gemm_rounded_x(const uint16_t *x, const uint8_t *w, const float *bias, void *out, int64_t num_rows,
                                   int64_t N, int64_t K, int32_t ggml_type, int32_t activation, int32_t out_dtype,
                                   int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    const int gated = activation >= 0;
    if (activation > 2 || (gated && (N < 32 || N % 32)) || (!gated && out_dtype != DTYPE_F32)) return 2;
    return gguf_product(x, DTYPE_BF16, w, ggml_type, bias, DTYPE_F32, out, out_dtype, num_rows, N, K,
                        gated ? activation : -1, 0.0f, 0.0f, num_threads);
#else
    (void)x, (void)w, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)ggml_type, (void)activation;
    (void)out_dtype, (void)num_threads;
    return 1;
#endif
}

/* act(x gate^T) * (x up^T) for a gate_up weight in bf16 panels (its first `width` rows the gates,
 * the next `width` the ups; width a multiple of 16): x [num_rows, K] bf16, bias [2 width] bf16 or
 * NULL, out [num_rows, width] bf16, each output rayllm_gated_mul's of the gate_up product's
 * bf16 outputs, bit for bit, without writing them. activation: rayllm_gated_mul's code (alpha and
 * limit: ACTIVATION_SWIGLU_OAI's). 1 where this build has no tiles, 2 on bad sizes. */
int rayllm_amx_gated_gemm_bf16(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows,
                               int64_t width, int64_t K, int32_t activation, float alpha, float limit,
                               int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (width < 16 || width % 16 || activation < 0 || activation > 2) return 2;
    AmxJob job = {.panels = panels, .bias = bias, .out = out, .num_rows = num_rows, .N = width, .K = K,
                  .bias_dtype = DTYPE_BF16, .out_dtype = DTYPE_BF16, .activation = activation,
                  .up_panels = width / 16, .alpha = alpha, .limit = limit};
    return amx_gemm(x, DTYPE_BF16, &job, num_threads);
#else
    (void)x, (void)panels, (void)bias, (void)out, (void)num_rows, (void)width, (void)K, (void)activation, (void)alpha;
    (void)limit, (void)num_threads;
    return 1;
#endif
}

/* rayllm_amx_gated_gemm_bf16's product over a GGUF gate_up weight (w: [2 width, row bytes] of
 * ggml_type, GGUF_PACKED or not; width a multiple of 32): x [num_rows, K] and out [num_rows,
 * width] in dtype (fp32: the gates and ups in fp32, unrounded, as the fp32 product leaves them),
 * bias [2 width] in dtype or NULL; each chunk's gates and ups dequantized to bf16 panels, as
 * rayllm_amx_gguf_gemm does. */
int rayllm_amx_gguf_gated_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                               int64_t width, int64_t K, int32_t ggml_type, int32_t dtype, int32_t activation,
                               float alpha, float limit, int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (width < 32 || width % 32 || activation < 0 || activation > 2) return 2;
    return gguf_product(x, dtype, w, ggml_type, bias, dtype, out, dtype, num_rows, width, K, activation, alpha, limit,
                        num_threads);
#else
    (void)x, (void)w, (void)bias, (void)out, (void)num_rows, (void)width, (void)K, (void)ggml_type, (void)dtype;
    (void)activation, (void)alpha, (void)limit, (void)num_threads;
    return 1;
#endif
}

/* ------------------------------------------------------------------------- the tiles' peak */
/* The rate the tiles reach with nothing to wait for: 4 TDPBF16PS a round on tiles loaded once (a
 * 2 x 2 block's four sums), no memory in the loop. `items` items of `rounds` rounds each run on the
 * pool, so every thread that takes part runs its own loop at once; each item is 4 x 16 x 16 x 32
 * multiply-adds a round. The caller times the call (bench/tile_peak.py): the products of a step
 * are measured against it. 1 where this build or CPU has no tiles, or the OS refuses them. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
static void peak_item(void *context, int64_t item) {
    (void)item;
    const int64_t rounds = *(const int64_t *)context;
    uint16_t operand[16 * 32] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) operand[i] = 0x3b80; /* bf16 2^-8: the sums stay small */
    configure_tiles();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, operand, 64);
    _tile_loadd(5, operand, 64);
    _tile_loadd(6, operand, 64);
    _tile_loadd(7, operand, 64);
    for (int64_t r = 0; r < rounds; r++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
}
#endif

int rayllm_amx_tile_peak(int64_t items, int64_t rounds, int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (rayllm_amx_enable() != AMX_GRANTED) return 1;
    rayllm_parallel_for(items, num_threads, peak_item, &rounds);
    return 0;
#else
    (void)items, (void)rounds, (void)num_threads;
    return 1;
#endif
}
