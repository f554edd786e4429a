/* Paged attention on CPU over a KV pool laid out for it, read in place through the block table.
 *
 * The same contract as workers/kernels/torch_ref.py (the oracle): one varlen call per layer
 * and step, sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]) and has
 * seq_lens[s] keys in the pool (this step's keys included):
 *
 *     keys:  [ cached prefix ............ | this step's tokens ]
 *            0             seq_len - query_len              seq_len
 *     query i sits at position seq_len - query_len + i and sees keys [0, that position].
 *
 * Per-layer variants (AttentionArgs; zero / NULL: none, and nothing of them runs):
 *   window W > 0  the query at position p sees keys (p - W, p] only (Gemma 2/3, gpt-oss sliding
 *                 layers). A task starts at the block holding its first query's first visible key:
 *                 blocks wholly before every window of the task are never read.
 *   attention_chunk C > 0  the query at position p sees keys [p / C * C, p] only, its own chunk of
 *                 C positions (Llama 4's RoPE layers); blocks before the task's first query's chunk
 *                 are never read, as with a window (both: the later first key of the two).
 *   softcap c > 0 scores = c * tanh(scores / c) after the scale, before the softmax (Gemma 2).
 *   sinks         [num_heads] fp32: one more logit per head in the softmax's denominator, with no
 *                 value (gpt-oss). A row's running max starts at its head's sink and its sum at 1
 *                 (e^(sink - sink)), so the online softmax below takes it in with no other change.
 *
 * Pool dtypes: the queries' own (fp32 or bf16), or a half (IEEE fp16) pool under fp32 queries,
 * which holds the same keys in half the bytes: decode attention is bound by reading the pool,
 * and an AVX2 CPU has no bf16 arithmetic. Its values are widened to fp32 as they are loaded
 * (vcvtph2ps) and everything else runs as for an fp32 pool; rayllm_write_kv rounds this step's
 * fp32 keys and values to half (nearest even; past 65504, inf, as llama.cpp's f16 cache does).
 *
 * Pool layout (workers/kernels/cpu_attention.py allocates it; P = 2 for bf16, 1 for fp32 and fp16):
 *
 *     block b:  [ K part: [kv_head][head_dim / P][block_size][P] | V part: [kv_head][block_size / P][head_dim][P] ]
 *
 * K is stored transposed, so 16 keys' scores are one vector with no horizontal sums: for
 * bf16, pairs of head dims sit together and one vdpbf16ps multiplies a pair of q values
 * (broadcast) with that pair of dims for 16 keys; V keeps keys in pairs, so one vdpbf16ps adds
 * two keys' p * v into 16 output dims. A block's K and V parts are adjacent. The SIMD bodies
 * prefetch the next block's part of a kv head while this one computes (prefetch_slice, prefetch_span);
 * the portable body reads each block whole, in order, once per task (stream_block).
 *
 * Work split: one task per (sequence, tile of consecutive queries) with all heads, so a task
 * reads each block of its sequence once; rows are (query, head) pairs, row = query_in_tile *
 * num_heads + head, tiles hold about ROWS_PER_TASK rows. Threads (the caller passes torch's
 * thread count) claim tasks as they come free (thread_pool.c: rayllm_parallel_for). A step
 * with fewer tiles than threads (a lone decoding sequence) makes one task per tile and kv
 * head instead, each reading only its head's part of every block, so the second thread is
 * not idle while the first computes all of a sequence's heads (a row is computed the same
 * way either way, so its result does not depend on the split).
 *
 * Per task, keys are walked in chunks of up to 16 (never crossing a block), per kv head,
 * with an online softmax in fp32 (running max m, running sum l, accumulator acc):
 *
 *     1. for every row:  s_j = q . k_j * scale  for the keys the row may see,
 *                        m' = max(m, max_j s_j),  p_j = e^(s_j - m'),  c = e^(m - m'),
 *                        l = l * c + sum_j p_j,   m = m'
 *     2. for every row:  acc = acc * c + sum_j p_j v_j   (p_j rounded to bf16 for a bf16 pool)
 *
 * and a row's output is acc / l, in the queries' dtype (bf16: nearest even). The SIMD bodies
 * keep m' = m unless some s_j > m + MAX_SLACK (then c = 1 and no rescaling), which changes only
 * the rounding (softmax_row_fast says why it is safe). Three implementations of a chunk: AVX-512
 * (AVX512_BF16 for bf16) for head_dim 64 and 128; AVX2 + FMA (8 lanes; fp32 pools, and fp16
 * pools with F16C and blocks of a multiple of 16 keys) for the same head dims where the CPU has
 * no AVX-512; portable C for everything else.
 */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "simd.h"

#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64
#define MAX_ROWS 256     /* rows per task, at most (one query of up to 256 heads) */
#define ROWS_PER_TASK 64 /* a prefill tile takes max(1, ROWS_PER_TASK / num_heads) queries */
#define CHUNK 16         /* keys scored together */
#define NEG_BIG (-1.0e30f) /* a finite "minus infinity": e^(NEG_BIG - m) is 0, with no inf - inf */
#define MAX_SLACK 8.0f /* the SIMD bodies raise a row's running max only past max + this (softmax_row_fast) */



/* One task's rows are (query first_query + r / num_heads, head r % num_heads). */
typedef struct {
    const AttentionArgs *a;
    int64_t num_rows, num_queries, first_position, num_keys;
    const int32_t *table; /* the sequence's block table */
    int64_t group;        /* query heads per kv head */
    int64_t g0, g1;       /* the kv heads [g0, g1) this task computes (all but where a step has few tasks) */
} Task;

/* Whether row r's head belongs to one of the task's kv heads. */
static inline int row_in_task(const Task *t, int64_t r) {
    const int64_t g = (r % t->a->num_heads) / t->group;
    return g >= t->g0 && g < t->g1;
}

typedef struct {
    float qf[MAX_ROWS][MAX_HEAD_DIM];                          /* fp32 queries: the queries times the scale */
    uint16_t qb[MAX_ROWS][MAX_HEAD_DIM];                       /* bf16 queries: as they are (bf16) */
    float acc[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64))); /* running sum of p_j v_j */
    float p[MAX_ROWS][CHUNK] __attribute__((aligned(64))); /* this chunk's e^(s_j - m) per row */
    uint16_t pb[MAX_ROWS][CHUNK];                          /* the same, rounded to bf16 */
    float l[MAX_ROWS][16] __attribute__((aligned(64))); /* running sum of p_j, per lane (portable: lane 0) */
    float m[MAX_ROWS], correction[MAX_ROWS];
    int64_t keys_seen[MAX_ROWS]; /* keys row r may see: its position (first_position + r / num_heads) + 1 */
    int64_t first_key[MAX_ROWS]; /* the first key row r may see: 0, or its window's or chunk's first */
} Scratch;

/* The keys row r may see in the chunk [start, start + n), as the chunk's lanes [lo, hi) (none
 * when hi <= lo). keys_seen and first_key are set once per task, so there is no division by
 * num_heads per row and chunk. */
typedef struct {
    int64_t lo, hi;
} Lanes;

static inline Lanes visible_lanes(const Scratch *w, int64_t r, int64_t start, int64_t n) {
    const int64_t begin = w->first_key[r] - start, end = w->keys_seen[r] - start;
    return (Lanes){begin > 0 ? begin : 0, end < n ? end : n};
}

static inline int row_sees_some(const Scratch *w, int64_t r, int64_t start, int64_t n) {
    const Lanes visible = visible_lanes(w, r, start, n);
    return visible.hi > visible.lo;
}

/* The first key a query at `position` sees: 0, or the first of its window or chunk. */
static inline int64_t first_visible_key(const AttentionArgs *a, int64_t position) {
    return rayllm_first_visible_key(a, position);
}

/* The soft-cap c * tanh(s / c) (c > 0). */
static inline float softcap_score(float s, float c) { return c * tanhf(s / c); }

static inline int64_t pack_of(int dtype) { return dtype == DTYPE_BF16 ? 2 : 1; }

/* Whether the kernel reads a pool of kv_dtype under queries of dtype: the same dtype (fp32 or
 * bf16), or a half pool under fp32 queries (cpu_attention.pool_dtype_fits says the same). */
static inline int pool_dtype_fits(int dtype, int kv_dtype) {
    return (dtype == DTYPE_F32 || dtype == DTYPE_BF16) &&
           (kv_dtype == dtype || (dtype == DTYPE_F32 && kv_dtype == DTYPE_F16));
}

/* Element offsets, within a block's K or V part, of (kv head g, key j, dim d). */
static inline int64_t k_offset(const AttentionArgs *a, int64_t g, int64_t j, int64_t d) {
    const int64_t P = pack_of(a->kv_dtype);
    return ((g * (a->head_dim / P) + d / P) * a->block_size + j) * P + d % P;
}

static inline int64_t v_offset(const AttentionArgs *a, int64_t g, int64_t j, int64_t d) {
    const int64_t P = pack_of(a->kv_dtype);
    return ((g * (a->block_size / P) + j / P) * a->head_dim + d) * P + j % P;
}

static inline int64_t element_size(const AttentionArgs *a) { return a->kv_dtype == DTYPE_F32 ? 4 : 2; } /* the pool's */

/* Bytes of one kv head's K (or V) part of a block. */
static inline int64_t part_bytes(const AttentionArgs *a) { return a->block_size * a->head_dim * element_size(a); }

/* Kv head g's part of block `index` of the task's sequence in `cache` (the K or the V pool). */
static inline const char *block_part(const Task *t, const void *cache, int64_t index, int64_t g) {
    return (const char *)cache + t->table[index] * t->a->block_stride * element_size(t->a) + g * part_bytes(t->a);
}

/* Reads block `index` of the task's sequence whole, with plain vector loads, and with
 * prefetch_next prefetches the next one into L2 (measured 1.4x faster than demand loads alone
 * on a pool in DRAM on the Zen 4 VM; with AVX2 on an EPYC, bench.bench_attention: 30 layers
 * of 16 decodes at 272 keys, 39.2 -> 26.0 ms). The SIMD bodies read only a task's first block
 * this way, without prefetch_next: they prefetch the rest themselves (prefetch_slice, prefetch_span). */
static void stream_block(const Task *t, int64_t index, int prefetch_next) {
    const AttentionArgs *a = t->a;
    const int64_t bytes = (t->g1 - t->g0) * part_bytes(a);
    const char *k = block_part(t, a->k_cache, index, t->g0), *v = block_part(t, a->v_cache, index, t->g0);
    if (prefetch_next && (index + 1) * a->block_size < t->num_keys) {
        const char *next_k = block_part(t, a->k_cache, index + 1, t->g0);
        const char *next_v = block_part(t, a->v_cache, index + 1, t->g0);
        for (int64_t offset = 0; offset < bytes; offset += 64) {
            __builtin_prefetch(next_k + offset, 0, 1);
            __builtin_prefetch(next_v + offset, 0, 1);
        }
    }
#ifdef __AVX512F__
    __m512i x0 = _mm512_setzero_si512(), x1 = x0;
    for (int64_t offset = 0; offset + 64 <= bytes; offset += 64) {
        x0 = _mm512_or_si512(x0, _mm512_loadu_si512(k + offset));
        x1 = _mm512_or_si512(x1, _mm512_loadu_si512(v + offset));
    }
    volatile int sink = _mm512_reduce_or_epi32(_mm512_or_si512(x0, x1));
    (void)sink;
#elif defined(RAYLLM_AVX2)
    __m256i x0 = _mm256_setzero_si256(), x1 = x0;
    for (int64_t offset = 0; offset + 32 <= bytes; offset += 32) {
        x0 = _mm256_or_si256(x0, _mm256_loadu_si256((const __m256i *)(k + offset)));
        x1 = _mm256_or_si256(x1, _mm256_loadu_si256((const __m256i *)(v + offset)));
    }
    volatile int sink = _mm256_testz_si256(x0, x1);
    (void)sink;
#else
    (void)k;
    (void)v;
#endif
}

/* Kv head g's part of the task's next block in `cache` (the K or the V pool) when the chunk at
 * key `start` opens its block and the task has a next block; else NULL. */
static inline const char *next_part(const Task *t, const void *cache, int64_t start, int64_t g) {
    const AttentionArgs *a = t->a;
    const int64_t next = start / a->block_size + 1;
    if (start % a->block_size != 0 || next * a->block_size >= t->num_keys) return NULL;
    return block_part(t, cache, next, g);
}

/* The next block's part of a kv head is prefetched while this block's part computes: the SIMD
 * bodies spread its lines over the steps of their loops, a slice per step (prefetch_slice: into
 * L2 for AVX-512, over the dims of the scores for K and the keys of the values for V; AVX2:
 * prefetch_span, into L1), so the next block arrives while this one computes and the core never
 * waits for a burst of prefetches to leave. A core has few line-fill buffers (16 on Golden
 * Cove), and a prefetch waits for a free one: on a 2-core AMX Xeon, one burst of 32 prefetches
 * per part before its arithmetic put 30% of the kernel's samples on the prefetch loop, even on a
 * warm pool. Spread: bench.bench_attention --threads 2 --context 320 (16 decodes, 30 layers,
 * blocks scattered over a 1 GB pool), bf16 7.3-7.8 -> 5.5-6.4 ms, fp32 queries over a half pool
 * 7.1-7.7 -> 5.5-6.1 ms; prefetching two blocks ahead, or a different block size, changed
 * nothing there. On a 2-core Zen 3 EPYC (AVX2) the burst's 32 prefetches stalled the core the
 * same way: a 16-sequence decode step of SmolLM2 at 256-384 keys spent 9.6-9.7 ms in attention
 * with the burst and 7.6-8.1 ms spread. On the Zen 4 VM a burst into L2 before each head's
 * scores measured 6.0 / 3.6 ms (1 / 2 threads, bf16, 272 keys) against 10.4 / 5.6-6.0 with the
 * whole next block read ahead of its arithmetic (stream_block); two blocks ahead, no better.
 * A part no loop step follows (the V part of a chunk no row sees) is prefetched whole, as one
 * slice. */

/* Bytes of a next part each of `steps` loop steps prefetches (rounded up: all of it is covered). */
static inline int64_t slice_bytes(const AttentionArgs *a, int64_t steps) { return (part_bytes(a) + steps - 1) / steps; }

/* Step `step`'s slice of the next part into L2 (nothing when next is NULL). */
static inline __attribute__((always_inline)) void prefetch_slice(const char *next, int64_t step, int64_t slice) {
    if (next == NULL) return;
    for (int64_t offset = 0; offset < slice; offset += 64) __builtin_prefetch(next + step * slice + offset, 0, 1);
}

/* Prefetches the lines of [p, p + bytes) into L1 (at least p's line). */
static inline __attribute__((always_inline)) void prefetch_span(const char *p, const int64_t bytes) {
    __builtin_prefetch(p, 0, 3);
    for (int64_t offset = 64; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

/* The softmax update of row r from its chunk scores s[lo, hi): p (fp32 and bf16), correction, m, l. */
static void softmax_row(Scratch *w, int64_t r, const float *s, Lanes v) {
    float chunk_max = NEG_BIG;
    for (int64_t j = v.lo; j < v.hi; j++) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
    const float new_max = chunk_max > w->m[r] ? chunk_max : w->m[r];
    w->correction[r] = expf(w->m[r] - new_max);
    float sum = 0.0f;
    for (int64_t j = 0; j < CHUNK; j++) {
        const float p = j >= v.lo && j < v.hi ? expf(s[j] - new_max) : 0.0f;
        w->p[r][j] = p;
        w->pb[r][j] = f32_to_bf16(p);
        sum += p;
    }
    w->m[r] = new_max;
    w->l[r][0] = w->l[r][0] * w->correction[r] + sum;
}

/* ---------------------------------------------------------------- portable C */

static void chunk_portable(const Task *t, Scratch *w, int64_t start, int64_t n) {
    const AttentionArgs *a = t->a;
    const int64_t D = a->head_dim, H = a->num_heads, slot0 = start % a->block_size;
    const void *kb = block_part(t, a->k_cache, start / a->block_size, 0);
    const void *vb = block_part(t, a->v_cache, start / a->block_size, 0);
    for (int64_t r = 0; r < t->num_rows; r++) {
        if (!row_in_task(t, r)) continue;
        const Lanes visible = visible_lanes(w, r, start, n);
        const int64_t g = (r % H) / t->group;
        if (visible.hi <= visible.lo) { /* the whole chunk is in this row's future, or before its window */
            w->correction[r] = 1.0f;
            continue;
        }
        float s[CHUNK];
        for (int64_t j = visible.lo; j < visible.hi; j++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) {
                const float q = a->dtype == DTYPE_F32 ? w->qf[r][d] : bf16_to_f32(w->qb[r][d]) * a->scale;
                dot += q * load_element(kb, k_offset(a, g, slot0 + j, d), a->kv_dtype);
            }
            s[j] = a->softcap > 0.0f ? softcap_score(dot, a->softcap) : dot;
        }
        softmax_row(w, r, s, visible);
        for (int64_t d = 0; d < D; d++) {
            float sum = w->acc[r][d] * w->correction[r];
            for (int64_t j = visible.lo; j < visible.hi; j++) {
                const float p = a->kv_dtype == DTYPE_BF16 ? bf16_to_f32(w->pb[r][j]) : w->p[r][j];
                sum += p * load_element(vb, v_offset(a, g, slot0 + j, d), a->kv_dtype);
            }
            w->acc[r][d] = sum;
        }
    }
}

/* rows[0, count) in batches of at most `most` rows, each batch through f with a constant row count. */
#define FOR_ROW_BATCHES(rows, count, most, f, ...)                                              \
    for (int64_t i_ = 0; i_ < (count);) {                                                     \
        const int64_t left_ = (count) - i_, rb_ = left_ < (most) ? left_ : (most);           \
        switch (rb_) {                                                                       \
        case 4: f((rows) + i_, 4, __VA_ARGS__); break;                                       \
        case 3: f((rows) + i_, 3, __VA_ARGS__); break;                                       \
        case 2: f((rows) + i_, 2, __VA_ARGS__); break;                                       \
        default: f((rows) + i_, 1, __VA_ARGS__); break;                                      \
        }                                                                                    \
        i_ += rb_;                                                                           \
    }

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_FAST_PATH 1
#define ROW_BATCH 4 /* rows that share each K or V load */

/* The soft-cap c * tanh(s / c) of 16 scores (c > 0). */
static inline __m512 softcap_ps(__m512 s, float c) {
    return _mm512_mul_ps(_mm512_set1_ps(c), tanh_ps(_mm512_mul_ps(s, _mm512_set1_ps(1.0f / c))));
}

/* softmax_row for 16 scores in a vector, with the running max raised lazily: m moves only when
 * a visible score exceeds it by more than MAX_SLACK, so most chunks need no horizontal max, no
 * correction (c = 1) and no rescaling of acc and l. Every p_j = e^(s_j - m) is then at most
 * e^MAX_SLACK (about 3000): exact enough in fp32 and, rounded to bf16 for a bf16 pool, with the
 * same relative error as any p. The row's sum is kept per lane (l) and added up once, at
 * the end. The result, acc / l, is the same softmax; only the rounding differs from the
 * exact-max update of the portable body (the tests compare every body with torch_ref).
 * prefill of 8 x 256 tokens, 30 layers, bf16, 1 thread (bench.bench_attention --prefill):
 * with the exact-max update the softmax was 117 of 264 ms. */
static inline void softmax_row_fast(Scratch *w, int64_t r, __m512 scores, Lanes visible) {
    __mmask16 live = 0; /* lanes [lo, hi); 0 <= lo < hi <= 16 where any */
    if (visible.hi > visible.lo) live = (__mmask16)(((1u << visible.hi) - 1u) & ~((1u << visible.lo) - 1u));
    const float old_max = w->m[r];
    float max = old_max, correction = 1.0f;
    if (_mm512_mask_cmp_ps_mask(live, scores, _mm512_set1_ps(old_max + MAX_SLACK), _CMP_GT_OQ)) {
        max = _mm512_mask_reduce_max_ps(live, scores); /* > old_max + MAX_SLACK */
        correction = expf(old_max - max); /* 0 at a row's first visible chunk, but with a sink */
        w->m[r] = max;
    }
    const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(scores, _mm512_set1_ps(max))));
    _mm512_store_ps(w->p[r], p);
    _mm256_storeu_si256((__m256i *)w->pb[r], (__m256i)_mm512_cvtneps_pbh(p));
    w->correction[r] = correction;
    _mm512_store_ps(w->l[r], _mm512_fmadd_ps(_mm512_load_ps(w->l[r]), _mm512_set1_ps(correction), p));
}

/* Phase 1 for rows[0, RB) of kv head g over the chunk [start, start + n): scores for up to
 * 16 keys (one lane each), then each row's softmax update. D = 16 * DV. RB and DV are
 * compile-time constants in every call (see chunk_fast), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void chunk_scores(const Task *t, Scratch *w, const int64_t *rows,
                                                               const int RB, const char *kb, int64_t g, int64_t start,
                                                               int64_t n, const int DV, const char *next) {
    const AttentionArgs *a = t->a;
    const int64_t D = 16 * DV, BS = a->block_size, slot0 = start % BS;
    const int64_t slice = next == NULL ? 0 : slice_bytes(a, a->kv_dtype == DTYPE_BF16 ? D / 4 : D / 2);
    const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
    __m512 even[ROW_BATCH], odd[ROW_BATCH]; /* two chains per row (alternate dims) for latency */
    for (int i = 0; i < RB; i++) even[i] = odd[i] = _mm512_setzero_ps();
    if (a->kv_dtype == DTYPE_BF16) {
        const uint16_t *kt = (const uint16_t *)kb + (g * (D / 2) * BS + slot0) * 2; /* dim pair 0, key slot0 */
        for (int64_t pair = 0; pair < D / 2; pair += 2) {
            prefetch_slice(next, pair / 2, slice);
            const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi32(lanes, kt + pair * BS * 2);
            const __m512bh k1 = (__m512bh)_mm512_maskz_loadu_epi32(lanes, kt + (pair + 1) * BS * 2);
            for (int i = 0; i < RB; i++) {
                const uint32_t *q = (const uint32_t *)w->qb[rows[i]];
                even[i] = _mm512_dpbf16_ps(even[i], (__m512bh)_mm512_set1_epi32((int)q[pair]), k0);
                odd[i] = _mm512_dpbf16_ps(odd[i], (__m512bh)_mm512_set1_epi32((int)q[pair + 1]), k1);
            }
        }
    } else if (a->kv_dtype == DTYPE_F16) {
        const uint16_t *kt = (const uint16_t *)kb + g * D * BS + slot0; /* dim 0, key slot0 */
        for (int64_t d = 0; d < D; d += 2) {
            prefetch_slice(next, d / 2, slice);
            const __m512 k0 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, kt + d * BS));
            const __m512 k1 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, kt + (d + 1) * BS));
            for (int i = 0; i < RB; i++) {
                even[i] = _mm512_fmadd_ps(_mm512_set1_ps(w->qf[rows[i]][d]), k0, even[i]);
                odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(w->qf[rows[i]][d + 1]), k1, odd[i]);
            }
        }
    } else {
        const float *kt = (const float *)kb + g * D * BS + slot0; /* dim 0, key slot0 */
        for (int64_t d = 0; d < D; d += 2) {
            prefetch_slice(next, d / 2, slice);
            const __m512 k0 = _mm512_maskz_loadu_ps(lanes, kt + d * BS);
            const __m512 k1 = _mm512_maskz_loadu_ps(lanes, kt + (d + 1) * BS);
            for (int i = 0; i < RB; i++) {
                even[i] = _mm512_fmadd_ps(_mm512_set1_ps(w->qf[rows[i]][d]), k0, even[i]);
                odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(w->qf[rows[i]][d + 1]), k1, odd[i]);
            }
        }
    }
    /* The sums leave their registers once, here: read as even[i] and odd[i] in the row loop
     * below (whose expf call clobbers every vector register), GCC kept the arrays in memory and
     * stored the accumulators to the stack on every step of the loops above. */
    float sums[ROW_BATCH][CHUNK] __attribute__((aligned(64)));
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) _mm512_store_ps(sums[i], _mm512_add_ps(even[i], odd[i]));
    const __m512 scale = _mm512_set1_ps(a->dtype == DTYPE_BF16 ? a->scale : 1.0f); /* fp32 q is prescaled */
    for (int i = 0; i < RB; i++) {
        __m512 scores = _mm512_mul_ps(_mm512_load_ps(sums[i]), scale);
        if (a->softcap > 0.0f) scores = softcap_ps(scores, a->softcap);
        softmax_row_fast(w, rows[i], scores, visible_lanes(w, rows[i], start, n));
    }
}

/* Phase 2 for rows[0, count) of kv head g: acc = acc * correction + sum_j p_j v_j over the
 * chunk's n keys. RB rows at a time share every V load (RB * DV accumulators in registers). */
static inline __attribute__((always_inline)) void chunk_values(const Task *t, Scratch *w, const int64_t *rows,
                                                               const int RB, const char *vb, int64_t g, int64_t start,
                                                               int64_t n, const int DV, const char *next) {
    const AttentionArgs *a = t->a;
    const int64_t D = 16 * DV, BS = a->block_size, slot0 = start % BS;
    const int64_t slice = next == NULL ? 0 : slice_bytes(a, a->kv_dtype == DTYPE_BF16 ? (n + 1) / 2 : n);
    __m512 out[ROW_BATCH][MAX_HEAD_DIM / 16];
    for (int i = 0; i < RB; i++) {
        const __m512 c = _mm512_set1_ps(w->correction[rows[i]]);
        for (int d = 0; d < DV; d++) out[i][d] = _mm512_mul_ps(_mm512_load_ps(w->acc[rows[i]] + 16 * d), c);
    }
    if (a->kv_dtype == DTYPE_BF16) {
        const uint16_t *v = (const uint16_t *)vb + (g * (BS / 2) + slot0 / 2) * D * 2; /* key pair slot0 / 2 */
        for (int64_t pair = 0; pair < (n + 1) / 2; pair++) {
            /* a last key past n (odd n) may hold anything, even NaN: keep it out of the product */
            const __mmask32 keys = 2 * pair + 1 < n ? 0xFFFFFFFFu : 0x55555555u;
            prefetch_slice(next, pair, slice);
            __m512bh p[ROW_BATCH];
            for (int i = 0; i < RB; i++) p[i] = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)w->pb[rows[i]])[pair]);
            for (int d = 0; d < DV; d++) {
                const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(keys, v + (pair * D + 16 * d) * 2);
                for (int i = 0; i < RB; i++) out[i][d] = _mm512_dpbf16_ps(out[i][d], p[i], x);
            }
        }
    } else if (a->kv_dtype == DTYPE_F16) {
        const uint16_t *v = (const uint16_t *)vb + (g * BS + slot0) * D; /* key slot0 */
        for (int64_t j = 0; j < n; j++) {
            prefetch_slice(next, j, slice);
            for (int d = 0; d < DV; d++) {
                const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + j * D + 16 * d)));
                for (int i = 0; i < RB; i++)
                    out[i][d] = _mm512_fmadd_ps(_mm512_set1_ps(w->p[rows[i]][j]), x, out[i][d]);
            }
        }
    } else {
        const float *v = (const float *)vb + (g * BS + slot0) * D; /* key slot0 */
        for (int64_t j = 0; j < n; j++) {
            prefetch_slice(next, j, slice);
            for (int d = 0; d < DV; d++) {
                const __m512 x = _mm512_loadu_ps(v + j * D + 16 * d);
                for (int i = 0; i < RB; i++) out[i][d] = _mm512_fmadd_ps(_mm512_set1_ps(w->p[rows[i]][j]), x, out[i][d]);
            }
        }
    }
    for (int i = 0; i < RB; i++)
        for (int d = 0; d < DV; d++) _mm512_store_ps(w->acc[rows[i]] + 16 * d, out[i][d]);
}

#define SCORES(rows, rb, ...) chunk_scores(t, w, rows, rb, __VA_ARGS__)
#define VALUES(rows, rb, ...) chunk_values(t, w, rows, rb, __VA_ARGS__)

static inline __attribute__((always_inline)) void chunk_fast(const Task *t, Scratch *w, int64_t start, int64_t n,
                                                             const int DV) {
    const AttentionArgs *a = t->a;
    const int64_t H = a->num_heads, G = t->group;
    const char *kb = block_part(t, a->k_cache, start / a->block_size, 0);
    const char *vb = block_part(t, a->v_cache, start / a->block_size, 0);
    const int64_t most_values = DV <= 4 ? ROW_BATCH : 2; /* head_dim 128: 2 rows x 8 accumulators */
    for (int64_t g = t->g0; g < t->g1; g++) {
        int64_t rows[MAX_ROWS], live[MAX_ROWS], num_rows = 0, num_live = 0;
        for (int64_t q = 0; q < t->num_queries; q++)
            for (int64_t h = g * G; h < (g + 1) * G; h++) rows[num_rows++] = q * H + h;
        const char *next_k = next_part(t, a->k_cache, start, g), *next_v = next_part(t, a->v_cache, start, g);
        FOR_ROW_BATCHES(rows, num_rows, ROW_BATCH, SCORES, kb, g, start, n, DV, i_ == 0 ? next_k : NULL)
        for (int64_t i = 0; i < num_rows; i++) /* rows that see none of the chunk add nothing */
            if (row_sees_some(w, rows[i], start, n)) live[num_live++] = rows[i];
        if (num_live == 0) prefetch_slice(next_v, 0, part_bytes(a)); /* no values pass to spread it over */
        FOR_ROW_BATCHES(live, num_live, most_values, VALUES, vb, g, start, n, DV, i_ == 0 ? next_v : NULL)
    }
}

static void chunk_d64(const Task *t, Scratch *w, int64_t start, int64_t n) { chunk_fast(t, w, start, n, 4); }
static void chunk_d128(const Task *t, Scratch *w, int64_t start, int64_t n) { chunk_fast(t, w, start, n, 8); }
#define FAST_PATH_DTYPE(a) 1 /* every pool dtype */

/* ---------------------------------------------------------------- AVX2 (fp32 and fp16 pools) */
#elif defined(RAYLLM_AVX2)
#define HAVE_FAST_PATH 1
#define ROW_BATCH 4 /* rows that share each K load */

/* The soft-cap c * tanh(s / c) of 8 scores (c > 0). */
static inline __m256 softcap8_ps(__m256 s, float c) {
    return _mm256_mul_ps(_mm256_set1_ps(c), tanh8_ps(_mm256_mul_ps(s, _mm256_set1_ps(1.0f / c))));
}

/* 8 of a half pool's values from p, widened to fp32 (F16C: HALF is 1 only where the CPU has it). */
#ifdef __F16C__
static inline __m256 load_half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline __m256 load_half8(const uint16_t *p) {
    (void)p;
    return _mm256_setzero_ps(); /* never called: FAST_PATH_DTYPE sends half pools to the portable body */
}
#endif

/* Phase 1, as chunk_scores above, in 8 lanes: a chunk's 16 keys are two vectors per row. A half
 * pool (HALF) reads all 16 key slots of each dim: the block holds them (FAST_PATH_DTYPE: block
 * sizes of a multiple of 16, chunks starting at a multiple of 16 in their block), and the lanes
 * past n are blended away below like the keys a row may not see. */
static inline __attribute__((always_inline)) void chunk_scores8(const Task *t, Scratch *w, const int64_t *rows,
                                                                const int RB, const char *kb, int64_t g,
                                                                int64_t start, int64_t n, const int D, const int HALF,
                                                                const char *next) {
    const int64_t BS = t->a->block_size, slot0 = start % BS;
    const __m256i low = first_lanes8(n), high = first_lanes8(n - 8);
    __m256 lo[ROW_BATCH], hi[ROW_BATCH];
    for (int i = 0; i < RB; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    const float *kt = (const float *)kb + g * D * BS + slot0; /* dim 0, key slot0 */
    const uint16_t *kh = (const uint16_t *)kb + g * D * BS + slot0;
    for (int d = 0; d < D; d++) {
        if (next != NULL) prefetch_span(next + d * BS * (HALF ? 2 : 4), BS * (HALF ? 2 : 4));
        const __m256 k0 = HALF ? load_half8(kh + d * BS) : _mm256_maskload_ps(kt + d * BS, low);
        const __m256 k1 = HALF ? load_half8(kh + d * BS + 8) : _mm256_maskload_ps(kt + d * BS + 8, high);
        for (int i = 0; i < RB; i++) {
            const __m256 q = _mm256_broadcast_ss(&w->qf[rows[i]][d]); /* prescaled */
            lo[i] = _mm256_fmadd_ps(q, k0, lo[i]);
            hi[i] = _mm256_fmadd_ps(q, k1, hi[i]);
        }
    }
    /* The sums leave their registers once, here (as in chunk_scores): read as lo[i] and hi[i]
     * in the row loop below, they were stored to the stack on every dim of the loop above.
     * Prefill of 8 x 256 tokens over a half pool, 2 threads (bench.bench_attention --prefill):
     * 0.6-0.7x the time; 16 decodes at 272 keys: 0.85x. */
    float scores[ROW_BATCH][CHUNK] __attribute__((aligned(32)));
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) {
        _mm256_store_ps(scores[i], lo[i]);
        _mm256_store_ps(scores[i] + 8, hi[i]);
    }
    for (int i = 0; i < RB; i++) {
        const int64_t r = rows[i];
        __m256 score_lo = _mm256_load_ps(scores[i]), score_hi = _mm256_load_ps(scores[i] + 8);
        const Lanes visible = visible_lanes(w, r, start, n); /* lanes [lo, hi): below hi and not below lo */
        const __m256 live_lo = _mm256_castsi256_ps(
            _mm256_andnot_si256(first_lanes8(visible.lo), first_lanes8(visible.hi)));
        const __m256 live_hi = _mm256_castsi256_ps(
            _mm256_andnot_si256(first_lanes8(visible.lo - 8), first_lanes8(visible.hi - 8)));
        if (t->a->softcap > 0.0f) {
            score_lo = softcap8_ps(score_lo, t->a->softcap);
            score_hi = softcap8_ps(score_hi, t->a->softcap);
        }
        const __m256 s0 = _mm256_blendv_ps(_mm256_set1_ps(NEG_BIG), score_lo, live_lo);
        const __m256 s1 = _mm256_blendv_ps(_mm256_set1_ps(NEG_BIG), score_hi, live_hi);
        /* the lazy max of softmax_row_fast; the sum in the first 8 of the row's lanes of l */
        const float old_max = w->m[r];
        float max = old_max, correction = 1.0f;
        const __m256 limit = _mm256_set1_ps(old_max + MAX_SLACK);
        if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(s0, limit, _CMP_GT_OQ), _mm256_cmp_ps(s1, limit, _CMP_GT_OQ)))) {
            max = hmax8(_mm256_max_ps(s0, s1));
            correction = expf(old_max - max);
            w->m[r] = max;
        }
        const __m256 m = _mm256_set1_ps(max);
        const __m256 p0 = _mm256_and_ps(live_lo, exp8_ps(_mm256_sub_ps(s0, m)));
        const __m256 p1 = _mm256_and_ps(live_hi, exp8_ps(_mm256_sub_ps(s1, m)));
        _mm256_store_ps(w->p[r], p0);
        _mm256_store_ps(w->p[r] + 8, p1);
        w->correction[r] = correction;
        const __m256 sum = _mm256_load_ps(w->l[r]);
        _mm256_store_ps(w->l[r], _mm256_fmadd_ps(sum, _mm256_set1_ps(correction), _mm256_add_ps(p0, p1)));
    }
}

/* Phase 2 for rows[0, RB) of kv head g, dims [d0, d0 + 32): acc = acc * correction + sum_j p_j v_j.
 * Up to 3 rows x 4 vectors of accumulators share every V load. */
static inline __attribute__((always_inline)) void chunk_values8(const Task *t, Scratch *w, const int64_t *rows,
                                                                const int RB, const char *vb, int64_t g,
                                                                int64_t start, int64_t n, const int D, const int HALF,
                                                                const char *next) {
    const int64_t BS = t->a->block_size, slot0 = start % BS;
    const float *v = (const float *)vb + (g * BS + slot0) * D; /* key slot0 */
    const uint16_t *vh = (const uint16_t *)vb + (g * BS + slot0) * D;
    for (int d0 = 0; d0 < D; d0 += 32) {
        __m256 out[3][4];
        for (int i = 0; i < RB; i++) {
            const __m256 c = _mm256_set1_ps(w->correction[rows[i]]);
            for (int d = 0; d < 4; d++) out[i][d] = _mm256_mul_ps(_mm256_load_ps(w->acc[rows[i]] + d0 + 8 * d), c);
        }
        for (int64_t j = 0; j < n; j++) {
            __m256 p[3];
            for (int i = 0; i < RB; i++) p[i] = _mm256_broadcast_ss(&w->p[rows[i]][j]);
            if (next != NULL) { /* this pass's dims of key j of the next block (and j + 16, ...) */
                prefetch_span(next + (j * D + d0) * (HALF ? 2 : 4), 32 * (HALF ? 2 : 4));
                for (int64_t key = j + CHUNK; key < BS; key += CHUNK)
                    prefetch_span(next + (key * D + d0) * (HALF ? 2 : 4), 32 * (HALF ? 2 : 4));
            }
            for (int d = 0; d < 4; d++) {
                const __m256 x = HALF ? load_half8(vh + j * D + d0 + 8 * d) : _mm256_loadu_ps(v + j * D + d0 + 8 * d);
                for (int i = 0; i < RB; i++) out[i][d] = _mm256_fmadd_ps(p[i], x, out[i][d]);
            }
        }
        for (int i = 0; i < RB; i++)
            for (int d = 0; d < 4; d++) _mm256_store_ps(w->acc[rows[i]] + d0 + 8 * d, out[i][d]);
    }
}

#define SCORES8(rows, rb, ...) chunk_scores8(t, w, rows, rb, __VA_ARGS__)

static inline __attribute__((always_inline)) void chunk_fast8(const Task *t, Scratch *w, int64_t start, int64_t n,
                                                              const int D, const int HALF) {
    const AttentionArgs *a = t->a;
    const int64_t H = a->num_heads, G = t->group;
    const char *kb = block_part(t, a->k_cache, start / a->block_size, 0);
    const char *vb = block_part(t, a->v_cache, start / a->block_size, 0);
    for (int64_t g = t->g0; g < t->g1; g++) {
        int64_t rows[MAX_ROWS], live[MAX_ROWS], num_rows = 0, num_live = 0;
        for (int64_t q = 0; q < t->num_queries; q++)
            for (int64_t h = g * G; h < (g + 1) * G; h++) rows[num_rows++] = q * H + h;
        const char *next_k = next_part(t, a->k_cache, start, g), *next_v = next_part(t, a->v_cache, start, g);
        FOR_ROW_BATCHES(rows, num_rows, ROW_BATCH, SCORES8, kb, g, start, n, D, HALF, i_ == 0 ? next_k : NULL)
        for (int64_t i = 0; i < num_rows; i++) /* rows that see none of the chunk add nothing */
            if (row_sees_some(w, rows[i], start, n)) live[num_live++] = rows[i];
        /* rows 3 at a time (2 when 4 or 2 are left, then 1): 12 accumulators share each V
         * load and its widening */
        for (int64_t i = 0, left; (left = num_live - i) > 0;) {
            const int rb = left == 3 || left >= 5 ? 3 : left >= 2 ? 2 : 1;
            const char *next = i == 0 ? next_v : NULL;
            if (rb == 3) chunk_values8(t, w, live + i, 3, vb, g, start, n, D, HALF, next);
            else if (rb == 2) chunk_values8(t, w, live + i, 2, vb, g, start, n, D, HALF, next);
            else chunk_values8(t, w, live + i, 1, vb, g, start, n, D, HALF, next);
            i += rb;
        }
    }
}

static void chunk_d64(const Task *t, Scratch *w, int64_t start, int64_t n) {
    if (t->a->kv_dtype == DTYPE_F16) chunk_fast8(t, w, start, n, 64, 1);
    else chunk_fast8(t, w, start, n, 64, 0);
}
static void chunk_d128(const Task *t, Scratch *w, int64_t start, int64_t n) {
    if (t->a->kv_dtype == DTYPE_F16) chunk_fast8(t, w, start, n, 128, 1);
    else chunk_fast8(t, w, start, n, 128, 0);
}
#ifdef __F16C__
#define HALF_POOL_FAST(a) ((a)->kv_dtype == DTYPE_F16 && (a)->block_size % CHUNK == 0)
#else
#define HALF_POOL_FAST(a) 0
#endif
/* bf16 pools (and half pools without F16C or with blocks of another size) take the portable path */
#define FAST_PATH_DTYPE(a) ((a)->kv_dtype == DTYPE_F32 || HALF_POOL_FAST(a))
#endif

typedef void (*ChunkBody)(const Task *, Scratch *, int64_t, int64_t);

#ifdef HAVE_FAST_PATH
#define BODY_PREFETCHES(body) ((body) == chunk_d64 || (body) == chunk_d128) /* prefetch_slice, prefetch_span */
#else
#define BODY_PREFETCHES(body) 0
#endif

static ChunkBody pick_body(const AttentionArgs *a) {
#ifdef HAVE_FAST_PATH
    if (FAST_PATH_DTYPE(a) && a->head_dim == 64) return chunk_d64;
    if (FAST_PATH_DTYPE(a) && a->head_dim == 128) return chunk_d128;
#endif
    (void)a;
    return chunk_portable;
}

static void run_task(const AttentionArgs *a, ChunkBody body, Scratch *w, int64_t seq, int64_t first_query,
                     int64_t num_queries, int64_t g0, int64_t g1) {
    const int64_t H = a->num_heads, D = a->head_dim, BS = a->block_size;
    const int64_t query_len = a->query_start_loc[seq + 1] - a->query_start_loc[seq];
    const int64_t token0 = a->query_start_loc[seq] + first_query;
    Task t = {
        .a = a,
        .num_rows = num_queries * H,
        .num_queries = num_queries,
        .first_position = a->seq_lens[seq] - query_len + first_query,
        .table = a->block_tables + seq * a->max_blocks_per_seq,
        .group = H / a->num_kv_heads,
        .g0 = g0,
        .g1 = g1,
    };
    t.num_keys = t.first_position + num_queries;
    for (int64_t r = 0; r < t.num_rows; r++) {
        if (!row_in_task(&t, r)) continue;
        const int64_t at = (token0 + r / H) * a->q_stride_token + (r % H) * a->q_stride_head;
        if (a->dtype == DTYPE_F32)
            for (int64_t d = 0; d < D; d++) w->qf[r][d] = ((const float *)a->q)[at + d] * a->scale;
        else
            memcpy(w->qb[r], (const uint16_t *)a->q + at, (size_t)D * sizeof(uint16_t));
        memset(w->acc[r], 0, (size_t)D * sizeof(float));
        w->keys_seen[r] = t.first_position + r / H + 1;
        w->first_key[r] = first_visible_key(a, t.first_position + r / H);
        memset(w->l[r], 0, sizeof w->l[r]);
        /* a sink is one more logit with no value: the running max starts there, and the sum at e^0 */
        w->m[r] = a->sinks != NULL ? a->sinks[r % H] : NEG_BIG;
        if (a->sinks != NULL) w->l[r][0] = 1.0f;
    }
    /* the block of the first key the task's first query sees: earlier blocks are never read */
    const int64_t first_start = first_visible_key(a, t.first_position) / BS * BS;
    const int body_prefetches = BODY_PREFETCHES(body); /* then only the first block is read ahead */
    for (int64_t start = first_start; start < t.num_keys;) {
        if (start % BS == 0 && (start == first_start || !body_prefetches))
            stream_block(&t, start / BS, !body_prefetches);
        const int64_t left_in_block = BS - start % BS;
        int64_t n = t.num_keys - start < CHUNK ? t.num_keys - start : CHUNK;
        n = n < left_in_block ? n : left_in_block;
        body(&t, w, start, n);
        start += n;
    }
    for (int64_t r = 0; r < t.num_rows; r++) {
        if (!row_in_task(&t, r)) continue;
        const int64_t offset = (token0 + r / H) * a->out_stride_token + (r % H) * a->out_stride_head;
        float sum = 0.0f;
        for (int lane = 0; lane < 16; lane++) sum += w->l[r][lane];
        const float inv = 1.0f / sum;
        if (a->dtype == DTYPE_F32) {
            float *dst = (float *)a->out + offset;
            for (int64_t d = 0; d < D; d++) dst[d] = w->acc[r][d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)a->out + offset;
            for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(w->acc[r][d] * inv);
        }
    }
}

/* Each thread's scratch, allocated on its first task and kept (OpenMP and torch keep their
 * threads alive, so this is a few allocations per process, not one per call). */
static Scratch *thread_scratch(void) {
    static __thread Scratch *scratch = NULL;
    if (scratch == NULL) scratch = aligned_alloc(64, sizeof(Scratch));
    return scratch;
}

typedef struct {
    const AttentionArgs *a;
    ChunkBody body;
    const int64_t (*tasks)[4]; /* seq, first query, count, first kv head */
    int64_t heads_per_task;
    _Atomic int failed; /* a thread could not allocate its scratch */
} AttentionJob;

static void attention_task(void *context, int64_t index) {
    AttentionJob *job = context;
    Scratch *w = thread_scratch();
    if (w == NULL) {
        atomic_store(&job->failed, 1);
        return;
    }
    const int64_t *task = job->tasks[index];
    run_task(job->a, job->body, w, task[0], task[1], task[2], task[3], task[3] + job->heads_per_task);
}

/* 0 on success; 1 when the shapes are outside what the kernel supports (the Python side
 * checks them first), 2 when out of memory. */
int rayllm_paged_attention(const AttentionArgs *a) {
    if (a->head_dim > MAX_HEAD_DIM || a->block_size > MAX_BLOCK_SIZE || a->num_kv_heads <= 0 ||
        a->num_heads > MAX_ROWS || a->num_heads % a->num_kv_heads != 0 || a->head_dim % pack_of(a->kv_dtype) != 0 ||
        a->block_size % pack_of(a->kv_dtype) != 0 || !pool_dtype_fits(a->dtype, a->kv_dtype))
        return 1;
    const int64_t tile = a->num_heads >= ROWS_PER_TASK ? 1 : ROWS_PER_TASK / a->num_heads;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
    /* the sequences with many queries on AMX tiles where the shapes allow (attention_amx.c) */
    uint8_t *on_tiles = NULL;
    if (a->tile_min_queries > 0 && rayllm_tile_attention_fits(a)) {
        if ((on_tiles = calloc((size_t)a->num_seqs + 1, 1)) == NULL) return 2;
        if (rayllm_tile_attention(a, a->tile_min_queries, on_tiles) != 0) {
            free(on_tiles);
            return 2;
        }
    }
    /* One task per (sequence, query tile); each sequence lists its last tile (the one with
     * the most keys) first, so the dynamic schedule starts the long tasks early. A step with
     * fewer such tasks than threads (one decoding sequence) splits each by kv head, so every
     * thread has work; a row's arithmetic is the same either way. */
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < a->num_seqs; s++)
        if (!on_tiles || !on_tiles[s]) num_tiles += (a->query_start_loc[s + 1] - a->query_start_loc[s] + tile - 1) / tile;
    const int64_t heads_per_task = num_tiles < threads ? 1 : a->num_kv_heads;
    const int64_t parts = a->num_kv_heads / heads_per_task, num_tasks = num_tiles * parts;
    int64_t(*tasks)[4] = malloc((size_t)(num_tasks > 0 ? num_tasks : 1) * sizeof *tasks); /* seq, first query, count, first kv head */
    if (tasks == NULL) {
        free(on_tiles);
        return 2;
    }
    int64_t n = 0;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        if (on_tiles && on_tiles[s]) continue;
        for (int64_t first = a->query_start_loc[s + 1] - a->query_start_loc[s]; first > 0;) {
            const int64_t count = (first - 1) % tile + 1;
            first -= count;
            for (int64_t part = 0; part < parts; part++, n++) {
                tasks[n][0] = s;
                tasks[n][1] = first;
                tasks[n][2] = count;
                tasks[n][3] = part * heads_per_task;
            }
        }
    }
    AttentionJob job = {a, pick_body(a), tasks, heads_per_task, 0};
    rayllm_parallel_for(num_tasks, threads, attention_task, &job); /* tasks claimed as threads come free */
    const int failed = atomic_load(&job.failed);
    free(tasks);
    free(on_tiles);
    return failed ? 2 : 0;
}

/* Writes this step's keys and values into the pool (layout above) at their slots, in the pool's
 * dtype (kv_dtype: dtype itself, or DTYPE_F16 for fp32 k and v):
 * k, v: [num_tokens, num_kv_heads, head_dim], token rows k_stride / v_stride elements apart
 * (views into the fused qkv rows), heads contiguous; slot_mapping[t] = block * block_size + offset.
 * Per token and kv head: K goes down a column of the transposed block (a stride of block_size
 * * P elements between dim groups), V into its key pair's rows (a stride of P elements).
 * Every token has its own slot, so a prompt step's tokens are split over the threads in ranges
 * of WRITE_TOKENS_PER_ITEM (one thread wrote 2048 tokens x 30 layers of SmolLM2 in 24 ms, 5% of
 * a prompt step on AMX tiles); a decode step's few tokens stay on the caller. */
#define WRITE_KV(S, T, STORE)                                                                            \
    for (int64_t t = t0; t < t1; t++) {                                                                   \
        const int64_t block = w->slot_mapping[t] / block_size, j = w->slot_mapping[t] % block_size;       \
        T *kb = (T *)w->k_cache + block * w->block_stride, *vb = (T *)w->v_cache + block * w->block_stride; \
        const S *kt = (const S *)w->k + t * w->k_stride, *vt = (const S *)w->v + t * w->v_stride;         \
        for (int64_t g = 0; g < w->num_kv_heads; g++) {                                                  \
            T *kd = kb + g * head_dim * block_size + j * P;     /* (g, dim group 0, key j) */              \
            T *vd = vb + (g * block_size + (j - j % P)) * head_dim + j % P; /* (g, key pair of j, dim 0) */ \
            const S *ks = kt + g * head_dim, *vs = vt + g * head_dim;                                     \
            for (int64_t d = 0; d < head_dim; d += P)                                                     \
                for (int64_t e = 0; e < P; e++) kd[d * block_size + e] = STORE(ks[d + e]);                \
            for (int64_t d = 0; d < head_dim; d++) vd[d * P] = STORE(vs[d]);                              \
        }                                                                                                \
    }
#define AS_IS(x) (x)
#define WRITE_TOKENS_PER_ITEM 64

typedef struct {
    const void *k, *v;
    int64_t k_stride, v_stride;
    void *k_cache, *v_cache;
    int64_t block_stride;
    const int64_t *slot_mapping;
    int64_t num_tokens, num_kv_heads, head_dim, block_size;
    int32_t dtype, kv_dtype;
} WriteJob;

static void write_tokens(void *context, int64_t item) {
    const WriteJob *w = context;
    const int64_t t0 = item * WRITE_TOKENS_PER_ITEM;
    const int64_t t1 = t0 + WRITE_TOKENS_PER_ITEM < w->num_tokens ? t0 + WRITE_TOKENS_PER_ITEM : w->num_tokens;
    const int64_t P = pack_of(w->kv_dtype), head_dim = w->head_dim, block_size = w->block_size;
    if (w->dtype == DTYPE_F32 && w->kv_dtype == DTYPE_F32) {
        WRITE_KV(float, float, AS_IS)
    } else if (w->dtype == DTYPE_BF16 && w->kv_dtype == DTYPE_BF16) {
        WRITE_KV(uint16_t, uint16_t, AS_IS)
    } else {
        WRITE_KV(float, uint16_t, f32_to_f16) /* rounded to nearest even */
    }
}

int rayllm_write_kv(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache, void *v_cache,
                    int64_t block_stride, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, int32_t dtype, int32_t kv_dtype, int32_t num_threads) {
    const int64_t P = pack_of(kv_dtype);
    if (head_dim % P != 0 || block_size % P != 0) return 1;
    if (!((dtype == DTYPE_F32 && kv_dtype == DTYPE_F32) || (dtype == DTYPE_BF16 && kv_dtype == DTYPE_BF16) ||
          (dtype == DTYPE_F32 && kv_dtype == DTYPE_F16)))
        return 1;
    WriteJob job = {k, v, k_stride, v_stride, k_cache, v_cache, block_stride, slot_mapping, num_tokens, num_kv_heads,
                    head_dim, block_size, dtype, kv_dtype};
    const int64_t items = (num_tokens + WRITE_TOKENS_PER_ITEM - 1) / WRITE_TOKENS_PER_ITEM;
    rayllm_parallel_for(items, items > 1 ? num_threads : 1, write_tokens, &job);
    return 0;
}

/* AttentionArgs' layout: sizeof, then each field's offset in declaration order, and the
 * fields' names (workers/kernels/native.py checks its ctypes mirror against these when it loads
 * the library). Returns the count of numbers written. */
int rayllm_layout_attention_args(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(AttentionArgs)
#define FIELD(f) LAYOUT_FIELD(AttentionArgs, f)
    FIELD(q) FIELD(out) FIELD(k_cache) FIELD(v_cache) FIELD(block_tables) FIELD(query_start_loc) FIELD(seq_lens)
    FIELD(num_seqs) FIELD(num_heads) FIELD(num_kv_heads) FIELD(head_dim) FIELD(block_size) FIELD(max_blocks_per_seq)
    FIELD(q_stride_token) FIELD(q_stride_head) FIELD(out_stride_token) FIELD(out_stride_head) FIELD(block_stride)
    FIELD(scale) FIELD(dtype) FIELD(kv_dtype) FIELD(num_threads) FIELD(window) FIELD(attention_chunk) FIELD(softcap)
    FIELD(sinks) FIELD(tile_min_queries)
#undef FIELD
    return n;
}
