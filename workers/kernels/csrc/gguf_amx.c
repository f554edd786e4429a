/* GGUF products of packed Q4_0 and Q4_1 weights on AMX int8 tiles (TDPBSUD), with x quantized to
 * int8 blocks as gguf_gemm.c's GGUF_INT8 mode quantizes it, and that mode's arithmetic exactly:
 *
 *     per 32-weight block b:  s[m, n] = sum_k xq[m, k] q[n, k]                   (exact int32)
 *                             acc = fma(float(s), d[n] * x_scale[m, b], acc)
 *                             acc = fma(offset[n], x_sum[m, b], acc)            (Q4_1: min; Q4_0: -8 d)
 *     out[m, n] = acc + bias[n]
 *
 * so each output has the bits of the vector kernels' (gguf_gemm.c: packed_int8, packed_int8_pair):
 * a row's result is the same on tiles or vectors, alone or in a batch. What the tiles replace is
 * the integer dot products, 16 x 16 outputs of a block in one instruction; the fp32 part per
 * block and output stays, in 16-lane vectors.
 *
 * The weight tile of a block (32 k x 16 columns) wants, in row r, each column's weights 4r..4r+3:
 * a packed group's piece t (gguf_gemm.c: bytes 4t..4t+3 of each of its 8 columns) holds exactly
 * that for r = t in its low nibbles and r = 4 + t in its high ones, so two groups' pieces widen to
 * a tile's 8 rows of 64 bytes with an and and a shift. The x tile is 16 rows of the block's 32
 * int8 values, read in place from the quantized rows.
 *
 * A packed Q8_0 lm_head's GGUF_INT16 product (gguf_gemm.c: packed_q8_int16_pair) runs here too, on
 * the same items. Its x is int16 per 32-block, and a tile multiplies bytes, so each x value is cut
 * in two, x = 256 hi + lo (hi signed, lo unsigned), and a block takes two tile products, hi by the
 * weights (TDPBSSD) and lo by them (TDPBUSD): 256 s_hi + s_lo is the block's exact int32 sum, the
 * one the vectors' vpdpwssd make, and its fp32 scaling is theirs, so the logits have their bits.
 * The weight tile's row r is each column's weights 4r..4r+3, where a packed Q8_0 block holds weight
 * k of its 8 columns in turn: a two-source byte permutation (VBMI) of the two groups' 64 bytes makes
 * two rows. They take the head from 12 rows (cpu_isa's table, "gguf_int16").
 *
 * Threads claim items of column groups (16 columns each, about 8 items a thread); an item walks
 * its groups, and for each group the blocks in order and the row tiles of each block, the sums
 * of every row's 16 columns kept in the thread's buffer (int8_group says how the tiles overlap
 * the vector work).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "entry_points.h"
#include "simd.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <immintrin.h>

#define GROUP 16        /* output columns of an item's group: two packed groups of 8 */
#define BLOCK_K 32      /* weights of a block: one tile product */
#define MAX_ROWS 512    /* rows of a call on these tiles (more: the bf16 tiles, amx.c) */

/* TMM0-1: sums (16 x 16 int32); TMM2-3: x (16 rows x 32 int8); TMM4-5: weights (8 rows x 64). */
static void configure_tiles(void) {
    static const uint8_t rows[6] = {16, 16, 16, 16, 8, 8};
    static const uint16_t colsb[6] = {64, 64, 32, 32, 64, 64};
    load_tile_config(6, rows, colsb);
}

typedef struct {
    const int8_t *xq;              /* [num_rows padded to 16, K]; Q8_0: x's int16 high bytes */
    const uint8_t *x_low;          /* Q8_0: x's int16 low bytes [num_rows padded to 16, K] */
    const float *x_scale, *x_sum;  /* [num_rows, K / 32] (Q8_0: no sums) */
    const uint8_t *w;              /* packed groups of 8 columns: [N / 8][K / 32][8 x block bytes] */
    const void *bias;
    void *out;
    int64_t num_rows, N, K, row_bytes, groups_per_item;
    int type, dtype, out_dtype;
    volatile int failed; /* a thread could not get its scratch: the call returns 3 */
} Int8Job;

/* Block b of 16 columns (two packed groups' blocks, first and second) as a weight tile. */
static inline void weight_tile(const Int8Job *job, const uint8_t *first, const uint8_t *second, uint8_t tile[8][64]) {
    const int values = job->type == Q4_1 ? 32 : 16; /* after the 8 scales (and Q4_1's 8 minimums) */
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(first + values + 32 * t));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(second + values + 32 * t));
        _mm256_storeu_si256((__m256i *)tile[t], _mm256_and_si256(a, low4));
        _mm256_storeu_si256((__m256i *)(tile[t] + 32), _mm256_and_si256(b, low4));
        _mm256_storeu_si256((__m256i *)tile[4 + t], _mm256_and_si256(_mm256_srli_epi16(a, 4), low4));
        _mm256_storeu_si256((__m256i *)(tile[4 + t] + 32), _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
    }
}

/* A block's scales and offsets of the 16 columns (the first group's 8, then the second's). */
static inline void scales(const Int8Job *job, const uint8_t *first, const uint8_t *second, __m512 *d, __m512 *offset) {
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)first));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)second));
    *d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
    if (job->type == Q4_1) {
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(first + 16)));
        const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(second + 16)));
        *offset = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
    } else { /* as packed_offset: d * -8, lane by lane */
        *offset = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_mul_ps(d0, _mm256_set1_ps(-8.0f))),
                                     _mm256_mul_ps(d1, _mm256_set1_ps(-8.0f)), 1);
    }
}

/* A block's sums (int32 [16][16]) into the row tile's 16 sums held in registers, as the vector
 * kernels scale them: the block's scale, then its offset against x's block sum. x_scale and
 * x_sum: the tile's first row's values of the block (rows past the last are zero). */
static inline __attribute__((always_inline)) void scale_rows(const int32_t *sums, const float *x_scale,
                                                             const float *x_sum, int64_t blocks, __m512 d,
                                                             __m512 offset, __m512 *acc) {
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(sums + m * 16));
        acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x_scale[m * blocks])), acc[m]);
        acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sum[m * blocks]), acc[m]);
    }
}

#define MAX_BLOCKS 256 /* K / 32 at most (K <= 8192) */

/* The next group's blocks (bytes [b bb, (b + 1) bb) of each of its two packed groups) asked for
 * while this group's tiles run: a decode step streams its weights from memory, and widening the
 * next group's tiles would otherwise wait on them. */
static inline void prefetch_block(const uint8_t *next, int64_t group_bytes, int64_t b, int64_t bb) {
    if (!next) return;
    for (int64_t line = 0; line < bb; line += 64) {
        _mm_prefetch((const char *)(next + b * bb + line), _MM_HINT_T0);
        _mm_prefetch((const char *)(next + group_bytes + b * bb + line), _MM_HINT_T0);
    }
}

/* Block b of the two packed groups at first and second: its weight tile, scales and offsets. */
static inline void widen_block(const Int8Job *job, const uint8_t *first, const uint8_t *second, int64_t bb, int64_t b,
                               uint8_t (*tiles)[8][64], __m512 *d, __m512 *offset) {
    weight_tile(job, first + b * bb, second + b * bb, tiles[b]);
    scales(job, first + b * bb, second + b * bb, d + b, offset + b);
}

/* Columns [16 g, 16 g + 16) for every row. Each row tile walks the blocks with its 16 rows' sums
 * in registers, a block's sums leaving their tile one block later and scaled in one block after
 * that, so no load waits on a store just made. The first row tile widens the group's weight
 * tiles, scales and offsets two blocks ahead of their products, so that this vector work runs
 * beside the tile instructions (widened all first, a decode step of 16 took 24.94 ms on the tiles
 * against 23.43 on the vectors; two ahead, 22.31 and 22.08 against 23.07 and 22.91), and asks
 * for the next group's blocks. */
static void int8_group(const Int8Job *job, int64_t g, float *acc_out, uint8_t (*tiles)[8][64], __m512 *d,
                       __m512 *offset) {
    const int64_t blocks = job->K / BLOCK_K, bb = 8 * (job->type == Q4_1 ? 20 : 18), K = job->K;
    const uint8_t *first = job->w + (2 * g) * 8 * job->row_bytes, *second = first + 8 * job->row_bytes;
    widen_block(job, first, second, bb, 0, tiles, d, offset); /* the rest two blocks ahead of their products */
    if (blocks > 1) widen_block(job, first, second, bb, 1, tiles, d, offset);
    const uint8_t *next = g + 1 < job->N / GROUP ? first + 16 * job->row_bytes : NULL;
    int32_t sums[3][16 * 16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < job->num_rows; m0 += 16, next = NULL) {
        const float *x_scale = job->x_scale + m0 * blocks, *x_sum = job->x_sum + m0 * blocks;
        __m512 acc[16];
        for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            if (m0 == 0 && b + 2 < blocks) widen_block(job, first, second, bb, b + 2, tiles, d, offset);
            prefetch_block(next, 8 * job->row_bytes, b, bb);
            const int8_t *x = job->xq + m0 * K + b * BLOCK_K;
            if (b & 1) { /* the tile numbers are the instructions' operands */
                _tile_zero(1);
                _tile_loadd(3, x, K);
                _tile_loadd(5, tiles[b], 64);
                _tile_dpbsud(1, 3, 5);
                _tile_stored(0, sums[(b + 2) % 3], 64);
            } else {
                _tile_zero(0);
                _tile_loadd(2, x, K);
                _tile_loadd(4, tiles[b], 64);
                _tile_dpbsud(0, 2, 4);
                if (b >= 1) _tile_stored(1, sums[(b + 2) % 3], 64);
            }
            if (b >= 2)
                scale_rows(sums[(b - 2) % 3], x_scale + b - 2, x_sum + b - 2, blocks, d[b - 2], offset[b - 2], acc);
        }
        if (blocks & 1) _tile_stored(0, sums[(blocks - 1) % 3], 64); /* the last block's tile */
        else _tile_stored(1, sums[(blocks - 1) % 3], 64);
        if (blocks >= 2)
            scale_rows(sums[(blocks - 2) % 3], x_scale + blocks - 2, x_sum + blocks - 2, blocks, d[blocks - 2],
                       offset[blocks - 2], acc);
        scale_rows(sums[(blocks - 1) % 3], x_scale + blocks - 1, x_sum + blocks - 1, blocks, d[blocks - 1],
                   offset[blocks - 1], acc);
        for (int m = 0; m < 16; m++) _mm512_store_ps(acc_out + (m0 + m) * GROUP, acc[m]);
    }
}

#if defined(__AVX512VBMI__)
#define HAS_INT16_TILES 1
/* TMM0-1: a pair's high and low sums, TMM2-3 the next pair's; TMM4-5: x's high and low bytes
 * (16 rows x 32); TMM6: the weights (8 rows x 64). */
static void configure_int16_tiles(void) {
    static const uint8_t rows[7] = {16, 16, 16, 16, 16, 16, 8};
    static const uint16_t colsb[7] = {64, 64, 64, 64, 32, 32, 64};
    load_tile_config(7, rows, colsb);
}

/* Block b of 16 columns of a packed Q8_0 (first and second: two groups' blocks) as a weight tile:
 * row r, byte 4c + j = column c's weight 4r + j, where a group's block holds byte 8k + c. Rows r
 * and r + 1 come from 64 bytes of each group, one two-source byte permutation each. */
static inline void q8_weight_tile(const uint8_t *first, const uint8_t *second, uint8_t tile[8][64]) {
    static const uint8_t order[2][64] = {
#define COLUMN(c) 8 * 0 + (c), 8 * 1 + (c), 8 * 2 + (c), 8 * 3 + (c)
        {COLUMN(0), COLUMN(1), COLUMN(2), COLUMN(3), COLUMN(4), COLUMN(5), COLUMN(6), COLUMN(7),
         COLUMN(64), COLUMN(65), COLUMN(66), COLUMN(67), COLUMN(68), COLUMN(69), COLUMN(70), COLUMN(71)},
        {COLUMN(32), COLUMN(33), COLUMN(34), COLUMN(35), COLUMN(36), COLUMN(37), COLUMN(38), COLUMN(39),
         COLUMN(96), COLUMN(97), COLUMN(98), COLUMN(99), COLUMN(100), COLUMN(101), COLUMN(102), COLUMN(103)},
#undef COLUMN
    };
    const __m512i even = _mm512_loadu_si512(order[0]), odd = _mm512_loadu_si512(order[1]);
    for (int r = 0; r < 8; r += 2) {
        const __m512i a = _mm512_loadu_si512(first + 16 + 32 * r), b = _mm512_loadu_si512(second + 16 + 32 * r);
        _mm512_storeu_si512(tile[r], _mm512_permutex2var_epi8(a, even, b));
        _mm512_storeu_si512(tile[r + 1], _mm512_permutex2var_epi8(a, odd, b));
    }
}

/* A block's high and low sums (int32 [16][16] each) into the row tile's 16 sums held in registers:
 * packed_q8_int16_pair's fma of the block's exact int32 sum. x_scale: the tile's first row's
 * scale of the block (rows past the last are zero). */
static inline __attribute__((always_inline)) void scale_rows16(const int32_t *high, const int32_t *low,
                                                                 const float *x_scale, int64_t blocks, __m512 d,
                                                                 __m512 *acc) {
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) {
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high + m * 16), 8),
                                             _mm512_load_si512(low + m * 16));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x_scale[m * blocks]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[m]);
    }
}

/* Block b's two products (x's high and low bytes at `at`, its weight tile) into TMM0-1 (b even) or
 * TMM2-3 (b odd), and block b - 1's sums out of the other two into `previous`. */
static inline __attribute__((always_inline)) void block_products(const Int8Job *job, int64_t b, int64_t at,
                                                                   const uint8_t (*tile)[64], int32_t (*previous)[256]) {
    _tile_loadd(4, job->xq + at, job->K);
    _tile_loadd(5, job->x_low + at, job->K);
    _tile_loadd(6, tile, 64);
    if (b & 1) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_dpbssd(2, 4, 6);
        _tile_dpbusd(3, 5, 6);
        _tile_stored(0, previous[0], 64);
        _tile_stored(1, previous[1], 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbusd(1, 5, 6);
        if (b >= 1) {
            _tile_stored(2, previous[0], 64);
            _tile_stored(3, previous[1], 64);
        }
    }
}

/* Block b of the two packed groups at first and second: its weight tile and its 16 scales. */
static inline void widen_q8_block(const uint8_t *first, const uint8_t *second, int64_t bb, int64_t b,
                                  uint8_t (*tiles)[8][64], __m512 *d) {
    q8_weight_tile(first + b * bb, second + b * bb, tiles[b]);
    d[b] = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(first + b * bb))),
        _mm_loadu_si128((const __m128i *)(second + b * bb)), 1));
}

/* Columns [16 g, 16 g + 16) of a packed Q8_0's int16 product for every row. Each row tile walks
 * the blocks with its 16 rows' sums in registers, a block's sums leaving their tiles one block
 * later and scaled in one after that (int8_group's overlap). The first row tile widens the weight
 * tiles and scales two blocks ahead of its products, so that the vector work runs beside the tile
 * instructions (widened all first, the head at 16 rows took 0.95-0.99x the vectors' time inside
 * decode steps; two ahead, 0.82-0.86x, alternating builds), and asks for the next group's blocks:
 * a decode step streams the head from memory, and the widening would otherwise wait on it. */
static void int16_group(const Int8Job *job, int64_t g, float *acc_out, uint8_t (*tiles)[8][64], __m512 *d) {
    const int64_t blocks = job->K / BLOCK_K, bb = 8 * 34, K = job->K;
    const uint8_t *first = job->w + (2 * g) * 8 * job->row_bytes, *second = first + 8 * job->row_bytes;
    widen_q8_block(first, second, bb, 0, tiles, d);
    if (blocks > 1) widen_q8_block(first, second, bb, 1, tiles, d);
    const uint8_t *next = g + 1 < job->N / GROUP ? first + 16 * job->row_bytes : NULL;
    int32_t sums[3][2][16 * 16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < job->num_rows; m0 += 16, next = NULL) {
        const float *x_scale = job->x_scale + m0 * blocks;
        __m512 acc[16];
        for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            if (m0 == 0 && b + 2 < blocks) widen_q8_block(first, second, bb, b + 2, tiles, d);
            prefetch_block(next, 8 * job->row_bytes, b, bb);
            block_products(job, b, m0 * K + b * BLOCK_K, (const uint8_t (*)[64])tiles[b], sums[(b + 2) % 3]);
            if (b >= 2) scale_rows16(sums[(b - 2) % 3][0], sums[(b - 2) % 3][1], x_scale + b - 2, blocks, d[b - 2], acc);
        }
        if (blocks & 1) { /* the last block's sums, still in their tiles */
            _tile_stored(0, sums[(blocks - 1) % 3][0], 64);
            _tile_stored(1, sums[(blocks - 1) % 3][1], 64);
        } else {
            _tile_stored(2, sums[(blocks - 1) % 3][0], 64);
            _tile_stored(3, sums[(blocks - 1) % 3][1], 64);
        }
        if (blocks >= 2)
            scale_rows16(sums[(blocks - 2) % 3][0], sums[(blocks - 2) % 3][1], x_scale + blocks - 2, blocks,
                         d[blocks - 2], acc);
        scale_rows16(sums[(blocks - 1) % 3][0], sums[(blocks - 1) % 3][1], x_scale + blocks - 1, blocks, d[blocks - 1],
                     acc);
        for (int m = 0; m < 16; m++) _mm512_store_ps(acc_out + (m0 + m) * GROUP, acc[m]);
    }
}
#endif

/* acc (+ bias) into out columns [16 g, 16 g + 16), as gguf_gemm.c's store_sums rounds them. */
static void store_group(const Int8Job *job, int64_t g, const float *acc) {
    __m512 bias = _mm512_setzero_ps();
    if (job->bias) bias = load16((const char *)job->bias + 16 * g * (job->dtype == DTYPE_BF16 ? 2 : 4),
                                 job->dtype == DTYPE_BF16);
    const int out_bf16 = job->out_dtype == DTYPE_BF16;
    for (int64_t m = 0; m < job->num_rows; m++) {
        __m512 v = _mm512_load_ps(acc + m * GROUP);
        if (job->bias) v = _mm512_add_ps(v, bias);
        store16((char *)job->out + (m * job->N + 16 * g) * (out_bf16 ? 2 : 4), v, out_bf16);
    }
}

/* Each thread's sums of every row (MAX_ROWS x 16 fp32) and a group's widened blocks. */
typedef struct {
    float acc[MAX_ROWS * GROUP];
    uint8_t tiles[MAX_BLOCKS][8][64];
    __m512 d[MAX_BLOCKS], offset[MAX_BLOCKS];
} GroupScratch;

static __thread GroupScratch *group_scratch;

static void int8_item(void *context, int64_t item) {
    Int8Job *job = context;
    if (!group_scratch && !(group_scratch = aligned_alloc(64, sizeof(GroupScratch)))) {
        job->failed = 1;
        return;
    }
    const int64_t groups = job->N / GROUP, g0 = item * job->groups_per_item;
    const int64_t g1 = g0 + job->groups_per_item < groups ? g0 + job->groups_per_item : groups;
    GroupScratch *w = group_scratch;
#ifdef HAS_INT16_TILES
    if (job->type == Q8_0) {
        configure_int16_tiles();
        for (int64_t g = g0; g < g1; g++) {
            int16_group(job, g, w->acc, w->tiles, w->d);
            store_group(job, g, w->acc);
        }
        _tile_release();
        return;
    }
#endif
    configure_tiles();
    for (int64_t g = g0; g < g1; g++) {
        int8_group(job, g, w->acc, w->tiles, w->d, w->offset);
        store_group(job, g, w->acc);
    }
    _tile_release();
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
/* The sizes these tiles take (2 otherwise): num_rows at most MAX_ROWS, N whole 16-column groups, K
 * whole blocks, at most MAX_BLOCKS. */
static int sizes_fit(int64_t num_rows, int64_t N, int64_t K) {
    return num_rows >= 1 && num_rows <= MAX_ROWS && N >= GROUP && N % GROUP == 0 && K >= BLOCK_K && K % BLOCK_K == 0 &&
           K / BLOCK_K <= MAX_BLOCKS;
}

/* The job's groups on the pool, about 8 items a thread: 0, or 3 where a thread had no scratch. */
static int run_groups(Int8Job *job, int32_t num_threads) {
    const int threads = num_threads > 0 ? num_threads : 1;
    const int64_t groups = job->N / GROUP;
    job->groups_per_item = groups / (threads * 8) > 1 ? groups / (threads * 8) : 1;
    rayllm_parallel_for((groups + job->groups_per_item - 1) / job->groups_per_item, threads, int8_item, job);
    return job->failed ? 3 : 0;
}
#endif

/* x: [num_rows, K] in dtype; w: [N, row bytes] packed Q4_0 or Q4_1 (ggml_type | GGUF_PACKED), N a
 * multiple of 16, num_rows at most 512; bias [N] in dtype or NULL; out [num_rows, N] in out_dtype:
 * rayllm_gguf_gemm's GGUF_INT8 product, bit for bit, on int8 tiles. 1 where this build or CPU has
 * none (or another type), 2 on bad sizes, 3 out of memory. */
int rayllm_amx_gguf_int8_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                              int64_t N, int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype,
                              int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
    const int type = ggml_type & ~GGUF_PACKED;
    if (!(ggml_type & GGUF_PACKED) || (type != Q4_0 && type != Q4_1)) return 1;
    if (rayllm_amx_enable() != AMX_GRANTED) return 1;
    if (!sizes_fit(num_rows, N, K)) return 2;
    const int64_t padded = (num_rows + 15) / 16 * 16, blocks = K / BLOCK_K;
    /* x quantized (its rows past num_rows zero: the last row tile reads 16) */
    char *scratch = malloc((size_t)(padded * K + 2 * padded * blocks * (int64_t)sizeof(float)));
    if (!scratch) return 3;
    float *x_scale = (float *)scratch, *x_sum = x_scale + padded * blocks;
    int8_t *xq = (int8_t *)(x_sum + padded * blocks);
    memset(xq + num_rows * K, 0, (size_t)((padded - num_rows) * K));
    memset(x_scale + num_rows * blocks, 0, (size_t)((padded - num_rows) * blocks * (int64_t)sizeof(float)));
    memset(x_sum + num_rows * blocks, 0, (size_t)((padded - num_rows) * blocks * (int64_t)sizeof(float)));
    rayllm_gguf_quantize_rows(x, dtype, num_rows, K, xq, x_scale, x_sum, num_threads);
    Int8Job job = {xq, NULL, x_scale, x_sum, w, bias, out, num_rows, N, K, rayllm_gguf_row_bytes(ggml_type, N, K), 1,
                   type, dtype, out_dtype, 0};
    const int status = run_groups(&job, num_threads);
    free(scratch);
    return status;
#else
    (void)x, (void)w, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)ggml_type, (void)dtype;
    (void)out_dtype, (void)num_threads;
    return 1;
#endif
}

/* x: [num_rows, K] in dtype; w: [N, row bytes] a packed Q8_0 (GGML_Q8_0 | GGUF_PACKED), N a multiple
 * of 16, num_rows at most 512; bias [N] in dtype or NULL; out [num_rows, N] in out_dtype:
 * rayllm_gguf_gemm's GGUF_INT16 product (an lm_head's), bit for bit, on int8 tiles. 1 where this
 * build or CPU has none (or another type), 2 on bad sizes, 3 out of memory. */
int rayllm_amx_gguf_int16_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                               int64_t N, int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype,
                               int32_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(HAS_INT16_TILES)
    if (ggml_type != (Q8_0 | GGUF_PACKED)) return 1;
    if (rayllm_amx_enable() != AMX_GRANTED) return 1;
    if (!sizes_fit(num_rows, N, K)) return 2;
    const int64_t padded = (num_rows + 15) / 16 * 16, blocks = K / BLOCK_K;
    /* x quantized to int16, then cut into its high and low bytes (rows past num_rows zero) */
    char *scratch = malloc((size_t)(num_rows * K * 2 + 2 * padded * K + padded * blocks * (int64_t)sizeof(float)));
    if (!scratch) return 3;
    float *x_scale = (float *)scratch; /* padded rows' scales zero: int16_group scales whole row tiles */
    memset(x_scale + num_rows * blocks, 0, (size_t)((padded - num_rows) * blocks * (int64_t)sizeof(float)));
    int16_t *x16 = (int16_t *)(x_scale + padded * blocks);
    int8_t *high = (int8_t *)(x16 + num_rows * K);
    uint8_t *low = (uint8_t *)(high + padded * K);
    rayllm_gguf_quantize_rows16(x, dtype, num_rows, K, x16, x_scale, num_threads);
    for (int64_t i = 0; i < num_rows * K; i += 32) {
        const __m512i v = _mm512_loadu_si512(x16 + i);
        _mm256_storeu_si256((__m256i *)(high + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        _mm256_storeu_si256((__m256i *)(low + i), _mm512_cvtepi16_epi8(v)); /* truncation: the low byte */
    }
    memset(high + num_rows * K, 0, (size_t)((padded - num_rows) * K));
    memset(low + num_rows * K, 0, (size_t)((padded - num_rows) * K));
    Int8Job job = {high, low, x_scale, NULL, w, bias, out, num_rows, N, K, rayllm_gguf_row_bytes(ggml_type, N, K), 1,
                   Q8_0, dtype, out_dtype, 0};
    const int status = run_groups(&job, num_threads);
    free(scratch);
    return status;
#else
    (void)x, (void)w, (void)bias, (void)out, (void)num_rows, (void)N, (void)K, (void)ggml_type, (void)dtype;
    (void)out_dtype, (void)num_threads;
    return 1;
#endif
}
