/* Sampling: one token per row of fp32 logits, drawn with one uniform number per row.
 *
 * Per row, on one thread (a row per item on our pool, so a row's answer never depends on the
 * rest of the batch or on the thread count):
 *
 *   0. A row under a grammar or with penalties first copies its logits into the workspace, with
 *      the tokens its bitmask forbids at -inf, then applies its penalties over the tokens it
 *      has seen (not the vocabulary); the rest runs on that copy, in place.
 *   1. m = the row's largest logit. A row holding NaN, or no finite largest logit, gets
 *      argmax's answer.
 *   2. e_i = exp((x_i - m) / T) into the workspace, and Z = the sum of e_i (in double). The top
 *      token's e is 1; logits more than 87 T below m (and -inf) get e = 0 and are never drawn.
 *   3. Only for top-k or top-p: the tokens are ranked (e descending, ties by index) and walked
 *      as a sort-then-mask sampler walks them: the first k are the top-k set, and top-p keeps a
 *      token while the tokens before it hold less than top_p of the top-k set's mass. Only a
 *      band of e around each boundary is sorted: its bounds are powers of 2^(-1/4), searched
 *      by counting passes (find_band), and the tokens above it are only summed. The outcome
 *      is a cut: kept are the tokens with e > cut, and the ones with e == cut up to index
 *      tie_last (a stable descending sort keeps the lower indices).
 *   4. min-p keeps e >= min_p (p_i >= min_p p_max, since the top token's e is 1).
 *   5. The draw: target = u * (sum of the kept e); the token is the first, in index order, at
 *      which the running sum of the kept e exceeds target. Token i is drawn with probability
 *      e_i / (sum of the kept e): softmax over the kept set, with one random number per row.
 *
 * 8-lane AVX2 code on every x86 CPU that has it (AVX-512 ones too: this is a few passes over
 * a row that sits in L2, and one code path means one set of sums), plain C elsewhere. Sums
 * run in an order fixed by the vocabulary size and the build, so a seeded row gives the same
 * token on every worker of a build.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "simd.h"

#define EXP_FLOOR (-87.0f)     /* exp below this is 0 here: the fp32 exp underflows near there */
#define FLOOR_STEPS 504        /* floors 2^(-j/4), j in [0, 504): down to 2^-126; j = 504 is 0 */
#define SORT_INSERTION_MAX 48  /* candidates at most this many are sorted by insertion */
#define BAND_SORT_MAX 512      /* the band search stops at this many tokens to sort */
#define BLOCK 64               /* the draw's granularity: block sums, then a walk inside one block */

typedef struct {
    float e;
    int32_t index;
} Entry;

typedef struct {
    float cut;        /* kept: e > cut, or e == cut and index <= tie_last */
    int64_t tie_last; /* -1: no token at e == cut is kept */
} Cut;

static inline uint32_t bits_of(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* ---------------------------------------------------------------- vector passes over a row */

/* The largest value of x; *has_nan set if x holds NaN. */
static float row_max(const float *x, int64_t vocab, int *has_nan) {
    float best = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef RAYLLM_HAS_AVX2
    __m256 acc = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= vocab; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        acc = _mm256_max_ps(acc, v);
    }
    best = hmax8(acc);
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < vocab; i++) {
        nan |= x[i] != x[i];
        if (x[i] > best) best = x[i];
    }
    *has_nan = nan;
    return best;
}

/* w[i] = exp((x[i] - m) * inv_t), 0 below EXP_FLOOR; returns the sum of w. */
static double exp_pass(const float *x, float *w, int64_t vocab, float m, float inv_t) {
    double sum = 0.0;
    int64_t i = 0;
#ifdef RAYLLM_HAS_AVX2
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(EXP_FLOOR);
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    for (; i < vocab; i += 8) { /* masked loads and stores only in the tail: AMD's masked stores are slow */
        const int full = i + 8 <= vocab;
        const __m256i lanes = first_lanes8(vocab - i);
        const __m256 v = full ? _mm256_loadu_ps(x + i)
                              : _mm256_blendv_ps(minus_inf, _mm256_maskload_ps(x + i, lanes), _mm256_castsi256_ps(lanes));
        const __m256 a = _mm256_mul_ps(_mm256_sub_ps(v, vm), vt);
        const __m256 e = _mm256_and_ps(_mm256_cmp_ps(a, floor, _CMP_GE_OQ), exp8_ps(a));
        if (full)
            _mm256_storeu_ps(w + i, e);
        else
            _mm256_maskstore_ps(w + i, lanes, e);
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double lanes_sum[4];
    _mm256_storeu_pd(lanes_sum, _mm256_add_pd(low, high));
    sum = (lanes_sum[0] + lanes_sum[1]) + (lanes_sum[2] + lanes_sum[3]);
#else
    for (; i < vocab; i++) {
        const float a = (x[i] - m) * inv_t;
        w[i] = a >= EXP_FLOOR ? expf(a) : 0.0f;
        sum += w[i];
    }
#endif
    return sum;
}

/* How many e are >= floor, and their sum (float lanes: for choosing a floor, not for the draw). */
static int64_t count_above(const float *w, int64_t vocab, float floor, double *mass) {
    int64_t count = 0, i = 0;
    double sum = 0.0;
#ifdef RAYLLM_HAS_AVX2
    const __m256 f = _mm256_set1_ps(floor);
    __m256i counts0 = _mm256_setzero_si256(), counts1 = _mm256_setzero_si256();
    __m256 sums0 = _mm256_setzero_ps(), sums1 = _mm256_setzero_ps(); /* two chains: an add's latency */
    for (; i + 16 <= vocab; i += 16) {
        const __m256 e0 = _mm256_loadu_ps(w + i), e1 = _mm256_loadu_ps(w + i + 8);
        const __m256 above0 = _mm256_cmp_ps(e0, f, _CMP_GE_OQ), above1 = _mm256_cmp_ps(e1, f, _CMP_GE_OQ);
        counts0 = _mm256_sub_epi32(counts0, _mm256_castps_si256(above0)); /* a true lane is -1 */
        counts1 = _mm256_sub_epi32(counts1, _mm256_castps_si256(above1));
        sums0 = _mm256_add_ps(sums0, _mm256_and_ps(above0, e0));
        sums1 = _mm256_add_ps(sums1, _mm256_and_ps(above1, e1));
    }
    int32_t lane_counts[8];
    _mm256_storeu_si256((__m256i *)lane_counts, _mm256_add_epi32(counts0, counts1));
    for (int lane = 0; lane < 8; lane++) count += lane_counts[lane];
    sum = hsum8(_mm256_add_ps(sums0, sums1));
#endif
    for (; i < vocab; i++)
        if (w[i] >= floor) count++, sum += w[i];
    *mass = sum;
    return count;
}

/* The sum of the kept e in w[i, min(i + BLOCK, vocab)), in a fixed order (kept_sum and
 * draw_pass both add these, so their totals agree to the last bit). */
static float block_sum(const float *w, int64_t i, int64_t vocab, Cut cut, float min_e) {
    const int64_t end = i + BLOCK < vocab ? i + BLOCK : vocab;
#ifdef RAYLLM_HAS_AVX2
    const __m256 vcut = _mm256_set1_ps(cut.cut), vmin = _mm256_set1_ps(min_e);
    const __m256i tie_last = _mm256_set1_epi32((int32_t)(cut.tie_last < INT32_MAX ? cut.tie_last : INT32_MAX));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = i; j < end; j += 8) {
        const __m256 e = j + 8 <= end ? _mm256_loadu_ps(w + j)
                                      : _mm256_maskload_ps(w + j, first_lanes8(end - j)); /* 0 past the end: never kept */
        __m256 kept = _mm256_cmp_ps(e, vcut, _CMP_GT_OQ);
        if (cut.tie_last >= j) {
            const __m256i at = _mm256_add_epi32(_mm256_set1_epi32((int32_t)j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256 in_ties = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_add_epi32(tie_last, _mm256_set1_epi32(1)), at));
            kept = _mm256_or_ps(kept, _mm256_and_ps(_mm256_cmp_ps(e, vcut, _CMP_EQ_OQ), in_ties));
        }
        kept = _mm256_and_ps(kept, _mm256_cmp_ps(e, vmin, _CMP_GE_OQ));
        sum = _mm256_add_ps(sum, _mm256_and_ps(kept, e));
    }
    return hsum8(sum);
#else
    float sum = 0.0f;
    for (int64_t j = i; j < end; j++)
        if ((w[j] > cut.cut || (w[j] == cut.cut && j <= cut.tie_last)) && w[j] >= min_e) sum += w[j];
    return sum;
#endif
}

static inline int is_kept(float e, int64_t i, Cut cut, float min_e) {
    return (e > cut.cut || (e == cut.cut && i <= cut.tie_last)) && e >= min_e && e > 0.0f;
}

static double kept_sum(const float *w, int64_t vocab, Cut cut, float min_e) {
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; i += BLOCK) sum += (double)block_sum(w, i, vocab, cut, min_e);
    return sum;
}

/* The first kept token, in index order, at which the running sum of the kept e exceeds
 * target; where rounding leaves target unreached, the last kept token. */
static int64_t draw_pass(const float *w, int64_t vocab, Cut cut, float min_e, double target) {
    double acc = 0.0;
    for (int64_t i = 0; i < vocab; i += BLOCK) {
        const double block = (double)block_sum(w, i, vocab, cut, min_e);
        if (!(block > 0.0 && acc + block > target)) {
            acc += block;
            continue;
        }
        const int64_t end = i + BLOCK < vocab ? i + BLOCK : vocab; /* the target lies in this block: walk it */
        int64_t last = -1;
        for (int64_t j = i; j < end; j++) {
            if (!is_kept(w[j], j, cut, min_e)) continue;
            last = j;
            acc += w[j];
            if (acc > target) return j;
        }
        return last; /* the block's own sum, lane by lane, fell short of its vector sum */
    }
    for (int64_t j = vocab - 1; j >= 0; j--)
        if (is_kept(w[j], j, cut, min_e)) return j;
    return 0; /* unreachable: the top token is always kept */
}

/* ---------------------------------------------------------------- the cut of top-k and top-p */

static inline float floor_at(int step) { return step >= FLOOR_STEPS ? 0.0f : step < 0 ? INFINITY : exp2f(-0.25f * (float)step); }

/* A band [lower, upper) of e holding the boundary: at least need_count tokens and need_mass of
 * e lie at or above lower, and fewer (or less) at or above upper. The bounds are floors
 * 2^(-j/4), one counting pass a probe: doubling j from 32 (e of 2^-8) until a floor holds, then
 * bisection until the band holds at most BAND_SORT_MAX tokens or one step of j. *band_size set
 * to the tokens inside the band. */
static void find_band(const float *w, int64_t vocab, int64_t need_count, double need_mass, float *lower, float *upper,
                      int64_t *band_size) {
    int lo = -1, hi = FLOOR_STEPS; /* lo fails (no e reaches +inf), hi holds (0: every token) */
    int64_t lo_count = 0, hi_count = vocab;
    int next = 32;
    while (hi - lo > 1 && hi_count - lo_count > BAND_SORT_MAX) {
        const int mid = next > 0 ? next : (lo + hi) / 2;
        double mass;
        const int64_t n = count_above(w, vocab, floor_at(mid), &mass);
        const int holds = n >= need_count && mass >= need_mass;
        if (holds)
            hi = mid, hi_count = n;
        else
            lo = mid, lo_count = n;
        next = !holds && next > 0 && 2 * next < FLOOR_STEPS ? 2 * next : 0; /* doubling until one holds */
    }
    *lower = floor_at(hi);
    *upper = floor_at(lo);
    *band_size = hi_count - lo_count;
}

/* Entries of the band, in index order, into entries (band_size of them); returns the exact
 * (double) mass of the tokens above the band and sets *count_above_band. */
static double gather_band(const float *w, int64_t vocab, float lower, float upper, Entry *entries,
                          int64_t *count_above_band) {
    int64_t n = 0, count = 0, i = 0;
    double mass = 0.0;
#ifdef RAYLLM_HAS_AVX2
    const __m256 vlower = _mm256_set1_ps(lower), vupper = _mm256_set1_ps(upper);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    for (; i + 8 <= vocab; i += 8) {
        const __m256 e = _mm256_loadu_ps(w + i);
        const __m256 above = _mm256_cmp_ps(e, vupper, _CMP_GE_OQ);
        const __m256 kept = _mm256_and_ps(above, e);
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
        count += __builtin_popcount((unsigned)_mm256_movemask_ps(above));
        unsigned band = (unsigned)_mm256_movemask_ps(_mm256_andnot_ps(above, _mm256_cmp_ps(e, vlower, _CMP_GE_OQ)));
        for (; band; band &= band - 1) {
            const int lane = __builtin_ctz(band);
            entries[n++] = (Entry){w[i + lane], (int32_t)(i + lane)};
        }
    }
    double lanes_sum[4];
    _mm256_storeu_pd(lanes_sum, _mm256_add_pd(low, high));
    mass = (lanes_sum[0] + lanes_sum[1]) + (lanes_sum[2] + lanes_sum[3]);
#endif
    for (; i < vocab; i++) {
        if (w[i] >= upper)
            count++, mass += w[i];
        else if (w[i] >= lower)
            entries[n++] = (Entry){w[i], (int32_t)i};
    }
    *count_above_band = count;
    return mass;
}

/* Sorts entries[0, n) by e descending, ties by index ascending (stable: they come in index
 * order); scratch holds n more. Returns where the sorted entries are (entries or scratch). */
static Entry *sort_entries(Entry *entries, Entry *scratch, int64_t n) {
    if (n <= SORT_INSERTION_MAX) {
        for (int64_t a = 1; a < n; a++) {
            const Entry moving = entries[a];
            int64_t b = a;
            for (; b > 0 && entries[b - 1].e < moving.e; b--) entries[b] = entries[b - 1];
            entries[b] = moving;
        }
        return entries;
    }
    Entry *from = entries, *to = scratch; /* LSD radix, descending, on the 30 low bits of e (e <= 1) */
    for (int shift = 0; shift < 30; shift += 10) {
        int64_t offsets[1025] = {0};
        for (int64_t a = 0; a < n; a++) offsets[1 + (1023 - ((bits_of(from[a].e) >> shift) & 1023))]++;
        for (int d = 0; d < 1024; d++) offsets[d + 1] += offsets[d];
        for (int64_t a = 0; a < n; a++) to[offsets[1023 - ((bits_of(from[a].e) >> shift) & 1023)]++] = from[a];
        Entry *swap = from;
        from = to;
        to = swap;
    }
    return from;
}

/* The token, in rank order (e descending, ties by index), at which the top ranks first hold
 * need_count tokens and need_mass of e: as a cut, with the mass up to it in *mass_to_cut.
 * Returns 0, or -1 if out of memory. */
static int rank_cut(const float *w, int64_t vocab, int64_t need_count, double need_mass, Cut *cut,
                    double *mass_to_cut) {
    float lower, upper;
    int64_t size;
    find_band(w, vocab, need_count, need_mass, &lower, &upper, &size);
    for (;;) {
        Entry *entries = malloc((size_t)(size > 0 ? size : 1) * 2 * sizeof(Entry));
        if (entries == NULL) return -1;
        int64_t count;
        double mass = gather_band(w, vocab, lower, upper, entries, &count);
        const int above_holds = count >= need_count && mass >= need_mass; /* only by rounding */
        const Entry *sorted = above_holds ? entries : sort_entries(entries, entries + size, size);
        int reached = 0;
        for (int64_t a = 0; a < size && !above_holds && !reached; a++) {
            count++;
            mass += sorted[a].e;
            *cut = (Cut){sorted[a].e, sorted[a].index};
            reached = count >= need_count && mass >= need_mass;
        }
        free(entries);
        if (reached || (lower == 0.0f && upper == INFINITY)) { /* the whole row fell short by rounding: keep it */
            *mass_to_cut = mass;
            return 0;
        }
        lower = 0.0f, upper = INFINITY, size = vocab; /* the float sums misplaced the band: take every token */
    }
}

/* Where top-k and then top-p (within the top-k set) cut a row whose e sum to total.
 * Returns 0, or -1 if out of memory. */
static int find_cut(const float *w, int64_t vocab, double total, int64_t top_k, float top_p, Cut *cut) {
    *cut = (Cut){0.0f, -1}; /* every token of e > 0 */
    double top_mass = total;
    if (top_k > 0 && rank_cut(w, vocab, top_k, 0.0, cut, &top_mass) != 0) return -1;
    if (top_p < 1.0f) {
        Cut nucleus;
        double nucleus_mass;
        if (rank_cut(w, vocab, 1, (double)top_p * top_mass, &nucleus, &nucleus_mass) != 0) return -1;
        /* top-p within the top-k set: whichever cut comes first in rank order */
        if (top_k == 0 || nucleus.cut > cut->cut || (nucleus.cut == cut->cut && nucleus.tie_last < cut->tie_last))
            *cut = nucleus;
    }
    return 0;
}

/* ---------------------------------------------------------------- rows */

#define NUM_PARAMS 8 /* columns of SampleArgs.params */

typedef struct {
    const float *logits;       /* [num_rows, vocab], rows logits_stride elements apart */
    float *workspace;          /* [num_rows, vocab] fp32 scratch (the e values) */
    const double *params;      /* [num_rows, NUM_PARAMS]: temperature (0: greedy, argmax), top_k (0 or >= vocab:
                                  all), top_p (in (0, 1]; 1: all), min_p (in [0, 1]; 0: none), uniform (in [0, 1)),
                                  repetition (1: none), presence (0: none), frequency (0: none) penalties */
    const int32_t *bitmask;    /* [num_rows, bitmask_words] or NULL: token t allowed iff bit t % 32 of word
                                  t / 32 is set (a grammar's mask; all bits set for a free row) */
    const int32_t *history;    /* the penalized rows' prompt and output token ids, or NULL: no penalties */
    const int64_t *history_spans; /* [num_rows, 3]: row r's prompt is history[s0, s1), its output history[s1, s2) */
    int64_t *out;              /* [num_rows] sampled token ids */
    int64_t num_rows, vocab, logits_stride, bitmask_words;
    int32_t num_threads;
    int32_t status; /* set to 3 by a row that ran out of memory */
} SampleArgs;

/* out[i] = x[i] where token i is allowed, else -inf (out may be x). */
static void masked_copy(const float *x, const int32_t *bits, float *out, int64_t vocab) {
    const uint32_t *words = (const uint32_t *)bits;
    int64_t i = 0;
#ifdef RAYLLM_HAS_AVX2
    const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= vocab; i += 8) { /* i is a multiple of 8: its 8 bits are one byte of a word */
        const __m256i byte = _mm256_set1_epi32((int32_t)((words[i >> 5] >> (i & 31)) & 0xFFu));
        const __m256i allowed = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bits), lane_bits);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(x + i), _mm256_castsi256_ps(allowed)));
    }
#endif
    for (; i < vocab; i++) out[i] = (words[i >> 5] >> (i & 31)) & 1u ? x[i] : -INFINITY;
}

#define REPEATED (1 << 30) /* in token_counts: the repetition penalty is applied to this token */

static __thread int32_t *token_counts; /* a thread's [vocab] scratch, all 0 between rows */
static __thread int64_t token_counts_size;

/* Penalties on w (the row's logits, in the workspace), in O(tokens): HF/vLLM's repetition
 * penalty once per distinct prompt or output token (a positive logit divided by it, a negative
 * one multiplied), then OpenAI's frequency and presence over the output tokens: logit -
 * frequency * count - presence. Returns -1 if out of memory. */
static int apply_penalties(float *w, int64_t vocab, const int32_t *tokens, int64_t num_prompt, int64_t num_tokens,
                           float repetition, float presence, float frequency) {
    if (token_counts_size < vocab) {
        free(token_counts);
        token_counts = calloc((size_t)vocab, sizeof *token_counts);
        token_counts_size = token_counts == NULL ? 0 : vocab;
        if (token_counts == NULL) return -1;
    }
    int32_t *counts = token_counts;
    for (int64_t i = num_prompt; i < num_tokens; i++)
        if (tokens[i] >= 0 && tokens[i] < vocab) counts[tokens[i]]++;
    if (repetition != 1.0f)
        for (int64_t i = 0; i < num_tokens; i++) {
            const int32_t t = tokens[i];
            if (t < 0 || t >= vocab || (counts[t] & REPEATED)) continue;
            counts[t] |= REPEATED;
            w[t] = w[t] > 0.0f ? w[t] / repetition : w[t] * repetition;
        }
    if (presence != 0.0f || frequency != 0.0f)
        for (int64_t i = num_prompt; i < num_tokens; i++) {
            const int32_t t = tokens[i];
            if (t < 0 || t >= vocab || (counts[t] & ~REPEATED) == 0) continue; /* done: once per distinct token */
            w[t] = w[t] - frequency * (float)(counts[t] & ~REPEATED) - presence;
            counts[t] &= REPEATED;
        }
    for (int64_t i = 0; i < num_tokens; i++)
        if (tokens[i] >= 0 && tokens[i] < vocab) counts[tokens[i]] = 0;
    return 0;
}

static void sample_row(void *context, int64_t r) {
    SampleArgs *a = context;
    const float *x = a->logits + r * a->logits_stride;
    float *w = a->workspace + r * a->vocab;
    const int64_t vocab = a->vocab;
    const double *params = a->params + NUM_PARAMS * r;
    const float temperature = (float)params[0], top_p = (float)params[2], min_e = (float)params[3];
    const int penalized = a->history != NULL && (params[5] != 1.0 || params[6] != 0.0 || params[7] != 0.0);
    if (a->bitmask != NULL || penalized) { /* the row's own logits, in the workspace (exp_pass then runs in place) */
        if (a->bitmask != NULL)
            masked_copy(x, a->bitmask + r * a->bitmask_words, w, vocab); /* forbidden tokens at -inf */
        else
            memcpy(w, x, (size_t)vocab * sizeof *w);
        x = w;
    }
    if (penalized) {
        const int64_t *span = a->history_spans + 3 * r;
        if (apply_penalties(w, vocab, a->history + span[0], span[1] - span[0], span[2] - span[0], (float)params[5],
                            (float)params[6], (float)params[7]) != 0) {
            a->status = 3;
            a->out[r] = 0;
            return;
        }
    }
    int has_nan = 0;
    const float m = temperature > 0.0f ? row_max(x, vocab, &has_nan) : 0.0f;
    if (!(temperature > 0.0f) || has_nan || !(m > -INFINITY && m < INFINITY)) {
        a->out[r] = rayllm_argmax_row(x, vocab);
        return;
    }
    const double total = exp_pass(x, w, vocab, m, 1.0f / temperature);
    const int64_t top_k = params[1] >= 1.0 && params[1] < (double)vocab ? (int64_t)params[1] : 0;
    Cut cut = {0.0f, -1};
    if ((top_k > 0 || top_p < 1.0f) && find_cut(w, vocab, total, top_k, top_p, &cut) != 0) {
        a->status = 3;
        a->out[r] = 0;
        return;
    }
    const double kept = kept_sum(w, vocab, cut, min_e);
    a->out[r] = draw_pass(w, vocab, cut, min_e, params[4] * kept);
}

int rayllm_sample(SampleArgs *a) {
    if (a->vocab < 1 || a->vocab > INT32_MAX || a->logits_stride < a->vocab) return 2;
    if (a->bitmask != NULL && a->bitmask_words * 32 < a->vocab) return 2;
    a->status = 0;
    rayllm_parallel_for(a->num_rows, a->num_rows > 1 && a->num_threads > 1 ? a->num_threads : 1, sample_row, a);
    return a->status;
}

/* SampleArgs' layout, as rayllm_layout_attention_args gives AttentionArgs'. */
int rayllm_layout_sample_args(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(SampleArgs)
#define FIELD(f) LAYOUT_FIELD(SampleArgs, f)
    FIELD(logits) FIELD(workspace) FIELD(params) FIELD(bitmask) FIELD(history) FIELD(history_spans) FIELD(out)
    FIELD(num_rows) FIELD(vocab) FIELD(logits_stride) FIELD(bitmask_words) FIELD(num_threads) FIELD(status)
#undef FIELD
    return n;
}
