/* The prompt part of paged attention on AMX tiles: sequences that compute many queries in a
 * step (a prompt, or a chunk of one), over a bf16 pool under bf16 queries. paged_attention.c
 * sends them here (AttentionArgs.tile_min_queries) and keeps the rest (decodes, short chunks,
 * other dtypes) on its vector bodies. The contract is the same: query i of a sequence sits at
 * position seq_len - query_len + i and sees the keys up to it (within the layer's window or chunk), with
 * the layer's soft-cap and sinks.
 *
 * A task is (sequence, kv head, up to QUERY_BLOCKS_PER_TASK blocks of 16 queries). It copies
 * the values of the keys its queries see into a contiguous buffer (pairs of keys, as a tile
 * wants them), zero past the last key, then for each block of 16 queries and each query head
 * of the kv head, in two passes with an exact softmax between them:
 *
 *     S = Q K^T      [16 x keys] fp32: per 16 keys, head_dim / 32 TDPBF16PS of a q tile (16
 *                    queries x 32 dims, read in place) by a key tile (32 dims x 16 keys: 16 lines
 *                    of the pool's K part, read in place: its [dim pair][key][2] is the tile layout)
 *     P = softmax(S * scale)   per row, in fp32 vectors: the row's visible keys only, the soft-cap,
 *                    the sink; P rounded to bf16 (as the vector body rounds p for a bf16 pool)
 *     O = P V        [16 x head_dim] fp32: per 32 keys, one tile of P by head_dim / 16 value tiles,
 *                    the sums in 4 tiles (head_dim 128: two passes of 64 dims)
 *     out = O / sum(P)   in bf16
 *
 * Keys a row may not see get p = 0; the pool's slots past a sequence's keys may hold anything
 * (NaN) and are never multiplied: scores of such keys are not read, their values are not copied.
 * Against the vector body the result differs only in rounding (an exact row max instead of a
 * lazily raised one, another summation order); tests/workers/test_cpu_attention.py compares
 * both with torch_ref.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "amx_tiles.h"
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define QUERIES 16               /* queries of a block: a q tile's rows */
#define QUERY_BLOCKS_PER_TASK 4  /* blocks of a task (its values are copied once for all) */
#define MAX_TILE_HEAD_DIM 128
#define NEG_INF (-INFINITY)

/* Whether the tile path takes this call's shapes (the caller checked the dtypes). */
int rayllm_tile_attention_fits(const AttentionArgs *a) {
    const int pools = (a->dtype == DTYPE_BF16 && a->kv_dtype == DTYPE_BF16) ||
                      (a->dtype == DTYPE_F32 && a->kv_dtype == DTYPE_F16);
    return pools && (a->head_dim == 64 || a->head_dim == 128) && a->block_size % 16 == 0 &&
           rayllm_amx_enable() == AMX_GRANTED;
}

typedef struct {
    float *scores;      /* [16][key_capacity] fp32 */
    uint16_t *probs;    /* [16][key_capacity] bf16 */
    uint16_t *values;   /* [key_capacity / 2][head_dim][2] bf16 */
    uint16_t *keys;     /* [key_capacity / 16][head_dim / 2][16][2] bf16: an fp16 pool's keys as tiles */
    uint16_t *q_pad;    /* [16][head_dim] bf16: queries in bf16 (a last block's, or fp32 ones), zero rows after */
    int64_t key_capacity;
} TileScratch;

static __thread TileScratch scratch;

/* The thread's buffers for `keys` keys (a multiple of 32) of head_dim; 0 when out of memory. */
static int reserve(int64_t keys, int64_t head_dim) {
    if (scratch.key_capacity >= keys && scratch.q_pad) return 1;
    free(scratch.scores);
    free(scratch.probs);
    free(scratch.values);
    free(scratch.keys);
    free(scratch.q_pad);
    scratch.scores = aligned_alloc(64, (size_t)(QUERIES * keys * 4));
    scratch.probs = aligned_alloc(64, (size_t)(QUERIES * keys * 2));
    scratch.values = aligned_alloc(64, (size_t)(keys * MAX_TILE_HEAD_DIM * 2));
    scratch.keys = aligned_alloc(64, (size_t)(keys * MAX_TILE_HEAD_DIM * 2));
    scratch.q_pad = aligned_alloc(64, (size_t)(QUERIES * MAX_TILE_HEAD_DIM * 2));
    scratch.key_capacity = scratch.scores && scratch.probs && scratch.values && scratch.keys && scratch.q_pad ? keys : 0;
    (void)head_dim;
    return scratch.key_capacity > 0;
}

typedef struct {
    const AttentionArgs *a;
    const int64_t (*tasks)[4]; /* seq, first query, queries, kv head */
    volatile int failed;
} TileJob;

static inline int64_t part_bytes(const AttentionArgs *a) { return a->block_size * a->head_dim * 2; } /* bf16 or fp16 */

static inline const char *part(const AttentionArgs *a, const void *cache, const int32_t *table, int64_t key, int64_t g) {
    return (const char *)cache + table[key / a->block_size] * a->block_stride * 2 + g * part_bytes(a);
}

/* The values of keys [k0, k1) of kv head g as [pairs][head_dim][2], zeros up to `padded` keys. */
static void copy_values(const AttentionArgs *a, const int32_t *table, int64_t g, int64_t k0, int64_t k1,
                        int64_t padded, uint16_t *values) {
    const int64_t D = a->head_dim, BS = a->block_size;
    for (int64_t key = k0; key < k1;) { /* whole runs of a block's pairs: k0 and BS are even */
        const int64_t slot = key % BS, run = (k1 - key < BS - slot ? k1 - key : BS - slot);
        const char *from = part(a, a->v_cache, table, key, g) + slot * D * 2;
        memcpy(values + (key - k0) * D, from, (size_t)((run + 1) / 2 * 2 * D * 2));
        key += run;
    }
    if (k1 % 2) /* the odd last key's partner slot: past the sequence, may hold anything */
        for (int64_t d = 0; d < D; d++) values[((k1 - k0) / 2) * 2 * D + 2 * d + 1] = 0;
    const int64_t written = (k1 - k0 + 1) / 2 * 2;
    memset(values + written * D, 0, (size_t)((padded - written) * D * 2));
}

/* [a0..a15] and [b0..b15] (fp32) as bf16 pairs (a0, b0), (a1, b1), ... (nearest even). */
static inline __m512i pairs16(__m512 a, __m512 b) {
    static const uint16_t order[32] __attribute__((aligned(64))) = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                                                     22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12,
                                                                     28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_load_si512(order), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

static inline __m512 half16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* An fp16 pool's values of keys [k0, k1) of kv head g (part [key][dim]) as bf16 key pairs, as
 * copy_values lays a bf16 pool's out; zeros up to `padded` keys (and for an odd last key's partner). */
static void convert_values(const AttentionArgs *a, const int32_t *table, int64_t g, int64_t k0, int64_t k1,
                           int64_t padded, uint16_t *values) {
    const int64_t D = a->head_dim, BS = a->block_size;
    for (int64_t key = k0; key < k1; key += 2) {
        const uint16_t *v0 = (const uint16_t *)part(a, a->v_cache, table, key, g) + (key % BS) * D;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 first = half16(v0 + d), second = key + 1 < k1 ? half16(v0 + D + d) : _mm512_setzero_ps();
            _mm512_storeu_si512(values + (key - k0) * D + 2 * d, pairs16(first, second));
        }
    }
    const int64_t written = (k1 - k0 + 1) / 2 * 2;
    memset(values + written * D, 0, (size_t)((padded - written) * D * 2));
}

/* An fp16 pool's keys [k0, k1) (k1 rounded up to 16) of kv head g (part [dim][key]) as key tiles:
 * tile t (keys k0 + 16 t ..) holds [dim pair][16 keys][2], the layout a bf16 pool's part has. */
static void convert_keys(const AttentionArgs *a, const int32_t *table, int64_t g, int64_t k0, int64_t k1,
                         uint16_t *keys) {
    const int64_t D = a->head_dim, BS = a->block_size;
    for (int64_t key = k0; key < k1; key += 16) {
        const uint16_t *k = (const uint16_t *)part(a, a->k_cache, table, key, g) + key % BS; /* dim 0 */
        uint16_t *tile = keys + (key - k0) * D;
        for (int64_t pair = 0; pair < D / 2; pair++)
            _mm512_storeu_si512(tile + pair * 32, pairs16(half16(k + 2 * pair * BS), half16(k + (2 * pair + 1) * BS)));
    }
}

/* Scores of one head's 16 query rows (q tile rows q_stride elements apart) against keys
 * [k0, k1) of kv head g, into scratch.scores (column j: key k0 + j), 16 keys a tile. */
static void tile_scores(const AttentionArgs *a, const int32_t *table, int64_t g, const uint16_t *q, int64_t q_stride,
                        int64_t k0, int64_t k1, int64_t stride, const uint16_t *keys) {
    const int64_t D = a->head_dim, BS = keys ? 16 : a->block_size; /* keys: converted tiles, 16 keys a "block" */
    _tile_loadd(4, q, q_stride * 2);
    _tile_loadd(5, q + 32, q_stride * 2);
    if (D == 128) {
        _tile_loadd(6, q + 64, q_stride * 2);
        _tile_loadd(7, q + 96, q_stride * 2);
    }
    for (int64_t key = k0; key < k1; key += 16) {
        /* 16 keys from `key` (a multiple of 16): lines of dim pairs, BS keys x 2 dims apart */
        const char *k = keys ? (const char *)(keys + (key - k0) * D) : part(a, a->k_cache, table, key, g) + (key % BS) * 4;
        _tile_zero(0);
        _tile_loadd(1, k, BS * 4);
        _tile_dpbf16ps(0, 4, 1);
        _tile_loadd(2, k + 16 * BS * 4, BS * 4);
        _tile_dpbf16ps(0, 5, 2);
        if (D == 128) {
            _tile_loadd(1, k + 32 * BS * 4, BS * 4);
            _tile_dpbf16ps(0, 6, 1);
            _tile_loadd(2, k + 48 * BS * 4, BS * 4);
            _tile_dpbf16ps(0, 7, 2);
        }
        _tile_stored(0, scratch.scores + (key - k0), stride * 4);
    }
}

/* Row i's softmax over its visible keys [first, last] (absolute), scores from key k0 in
 * scratch: p in bf16 into scratch.probs (zeros elsewhere, up to `padded` keys); returns the sum
 * of p (fp32, before rounding), the sink's e^(sink - max) included. */
static float softmax_row(const AttentionArgs *a, int64_t i, int64_t k0, int64_t first, int64_t last, int64_t padded,
                         int64_t stride, float sink) {
    float *s = scratch.scores + i * stride;
    uint16_t *p = scratch.probs + i * stride;
    const int64_t lo = first - k0, hi = last - k0 + 1; /* visible columns [lo, hi) */
    const __m512 scale = _mm512_set1_ps(a->scale);
    __m512 max = _mm512_set1_ps(sink);
    for (int64_t j = lo; j < hi; j += 16) {
        const __mmask16 m = hi - j >= 16 ? 0xFFFF : (__mmask16)((1u << (hi - j)) - 1u);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), scale);
        if (a->softcap > 0.0f)
            x = _mm512_mul_ps(_mm512_set1_ps(a->softcap), tanh_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.0f / a->softcap))));
        _mm512_mask_storeu_ps(s + j, m, x);
        max = _mm512_mask_max_ps(max, m, max, x);
    }
    const float row_max = _mm512_reduce_max_ps(max);
    __m512 sum = _mm512_setzero_ps();
    memset(p, 0, (size_t)(lo > 0 ? lo : 0) * 2);
    for (int64_t j = lo; j < hi; j += 16) {
        const __mmask16 m = hi - j >= 16 ? 0xFFFF : (__mmask16)((1u << (hi - j)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j),
                                                                        _mm512_set1_ps(row_max))));
        sum = _mm512_add_ps(sum, e);
        _mm256_mask_storeu_epi16(p + j, m, (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (padded > hi) memset(p + hi, 0, (size_t)(padded - hi) * 2);
    return _mm512_reduce_add_ps(sum) + (isinf(sink) ? 0.0f : expf(sink - row_max));
}

/* O = P V for 16 rows over `padded` keys (a multiple of 32), dims [d0, d0 + 64), into o [16][64]. */
static void tile_values(int64_t D, int64_t padded, int64_t stride, int64_t d0, float *o) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t key = 0; key < padded; key += 32) {
        const uint16_t *v = scratch.values + key * D + d0 * 2; /* key pair key / 2, dim d0 */
        _tile_loadd(4, scratch.probs + key, stride * 2);
        _tile_loadd(5, v, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 32, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, v + 64, D * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, v + 96, D * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, o, 64 * 4);
    _tile_stored(1, o + 16, 64 * 4);
    _tile_stored(2, o + 32, 64 * 4);
    _tile_stored(3, o + 48, 64 * 4);
}

static inline int64_t first_key_of(const AttentionArgs *a, int64_t position) {
    return rayllm_first_visible_key(a, position); /* the window's or the chunk's first */
}

static void tile_task(void *context, int64_t index) {
    TileJob *job = context;
    const AttentionArgs *a = job->a;
    const int64_t *task = job->tasks[index];
    const int64_t seq = task[0], first_query = task[1], num_queries = task[2], g = task[3];
    const int64_t D = a->head_dim, H = a->num_heads, group = H / a->num_kv_heads;
    const int64_t query_len = a->query_start_loc[seq + 1] - a->query_start_loc[seq];
    const int64_t position0 = a->seq_lens[seq] - query_len + first_query; /* of the task's first query */
    const int64_t token0 = a->query_start_loc[seq] + first_query;
    const int32_t *table = a->block_tables + seq * a->max_blocks_per_seq;
    /* the task's keys: from its first query's first visible key (down to 16) to its last query */
    const int64_t k0 = first_key_of(a, position0) / 16 * 16, k1 = position0 + num_queries;
    const int64_t padded = (k1 - k0 + 31) / 32 * 32;
    if (!reserve(padded, D)) {
        job->failed = 1;
        return;
    }
    const int half = a->kv_dtype == DTYPE_F16; /* fp32 queries over an fp16 pool: both rounded to bf16 */
    if (half) {
        convert_values(a, table, g, k0, k1, padded, scratch.values);
        convert_keys(a, table, g, k0, (k1 + 15) / 16 * 16, scratch.keys);
    } else {
        copy_values(a, table, g, k0, k1, padded, scratch.values);
    }
    float o[QUERIES * 64] __attribute__((aligned(64)));
    float sums[QUERIES];
    load_full_tiles();
    for (int64_t b = 0; b < num_queries; b += QUERIES) {
        const int64_t rows = num_queries - b < QUERIES ? num_queries - b : QUERIES;
        const int64_t last_key = position0 + b + rows - 1; /* the block's last query sees up to it */
        const int64_t block_k1 = (last_key + 1 + 15) / 16 * 16 < k1 ? (last_key + 1 + 15) / 16 * 16 : k1;
        const int64_t block_keys = block_k1 - k0, block_padded = (block_keys + 31) / 32 * 32;
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            const int64_t at = (token0 + b) * a->q_stride_token + h * a->q_stride_head;
            const uint16_t *q = (const uint16_t *)a->q + at;
            int64_t q_stride = a->q_stride_token;
            if (half) { /* fp32 queries rounded to bf16, zero rows after the last */
                const float *qf = (const float *)a->q + at;
                for (int64_t r = 0; r < QUERIES; r++)
                    for (int64_t d = 0; d < D; d += 32)
                        _mm512_storeu_si512(scratch.q_pad + r * D + d, r < rows ? (__m512i)_mm512_cvtne2ps_pbh(
                            _mm512_loadu_ps(qf + r * q_stride + d + 16), _mm512_loadu_ps(qf + r * q_stride + d))
                                                                               : _mm512_setzero_si512());
                q = scratch.q_pad;
                q_stride = D;
            } else if (rows < QUERIES) { /* the last block: its rows, then zeros */
                memset(scratch.q_pad, 0, (size_t)(QUERIES * D * 2));
                for (int64_t r = 0; r < rows; r++) memcpy(scratch.q_pad + r * D, q + r * a->q_stride_token, (size_t)D * 2);
                q = scratch.q_pad;
                q_stride = D;
            }
            /* scores of whole tiles of 16 keys; keys past block_k1 (or the sequence) are never read */
            tile_scores(a, table, g, q, q_stride, k0, (block_keys + 15) / 16 * 16 + k0, padded, half ? scratch.keys : NULL);
            const float sink = a->sinks ? a->sinks[h] : NEG_INF;
            for (int64_t r = 0; r < rows; r++)
                sums[r] = softmax_row(a, r, k0, first_key_of(a, position0 + b + r), position0 + b + r, block_padded,
                                      padded, sink);
            for (int64_t r = rows; r < QUERIES; r++) memset(scratch.probs + r * padded, 0, (size_t)block_padded * 2);
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                tile_values(D, block_padded, padded, d0, o);
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t at_out = (token0 + b + r) * a->out_stride_token + h * a->out_stride_head + d0;
                    const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
                    for (int64_t d = 0; d < 64; d += 16) {
                        const __m512 value = _mm512_mul_ps(_mm512_load_ps(o + r * 64 + d), inv);
                        if (half)
                            _mm512_storeu_ps((float *)a->out + at_out + d, value);
                        else
                            _mm256_storeu_si256((__m256i *)((uint16_t *)a->out + at_out + d),
                                                (__m256i)_mm512_cvtneps_pbh(value));
                    }
                }
            }
        }
    }
    _tile_release();
}

/* Sequences [0, num_seqs) of a whose query_len is at least min_queries, on tiles; their flags
 * set in taken[s]. Returns 0, or 2 when out of memory. */
int rayllm_tile_attention(const AttentionArgs *a, int64_t min_queries, uint8_t *taken) {
    int64_t num_tasks = 0;
    const int64_t per_task = QUERIES * QUERY_BLOCKS_PER_TASK;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t len = a->query_start_loc[s + 1] - a->query_start_loc[s];
        taken[s] = len >= min_queries;
        if (taken[s]) num_tasks += (len + per_task - 1) / per_task * a->num_kv_heads;
    }
    if (num_tasks == 0) return 0;
    int64_t(*tasks)[4] = malloc((size_t)num_tasks * sizeof *tasks);
    if (tasks == NULL) return 2;
    int64_t n = 0;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        if (!taken[s]) continue;
        /* the last queries first: they see the most keys, so the long tasks start early */
        for (int64_t first = a->query_start_loc[s + 1] - a->query_start_loc[s]; first > 0;) {
            const int64_t count = (first - 1) % per_task + 1;
            first -= count;
            for (int64_t g = 0; g < a->num_kv_heads; g++, n++) {
                tasks[n][0] = s;
                tasks[n][1] = first;
                tasks[n][2] = count;
                tasks[n][3] = g;
            }
        }
    }
    TileJob job = {a, (const int64_t(*)[4])tasks, 0};
    rayllm_parallel_for(num_tasks, a->num_threads > 0 ? a->num_threads : 1, tile_task, &job);
    free(tasks);
    return job.failed ? 2 : 0;
}
#else
int rayllm_tile_attention_fits(const AttentionArgs *a) {
    (void)a;
    return 0;
}

int rayllm_tile_attention(const AttentionArgs *a, int64_t min_queries, uint8_t *taken) {
    (void)a, (void)min_queries, (void)taken;
    return 1;
}
#endif
