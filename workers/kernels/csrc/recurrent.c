/* Recurrent-state layers' decode steps for every decoding sequence at once, on the state pools in
 * place (workers/layer_ops.py's TorchOps is the reference): the causal convolution's step,
 * Mamba-2's and the Gated DeltaNet's steps; and the triangular solves of the delta rules' prompt
 * chunks. Each entry point hands its items to rayllm_parallel_for, which keeps a single item, or
 * a call for one thread, on the caller.
 *
 * The convolution (rayllm_conv_step; workers/recurrent.py's causal_conv_step): per sequence s and
 * channel c, with the window w = state[rows[s]] [K - 1, channels] of the last K - 1 inputs,
 *     y[s, c] = x[s, c] weight[c, K - 1] + sum_j w[j, c] weight[c, j] (+ bias[c])   in fp32, in that order
 * rounded to the dtype, then SiLU'd and rounded again if asked (as F.silu over the rounded y);
 * the window moves on by one token: w = w[1:] ++ x[s]. In torch that was a gather, K multiply-adds
 * over whole rows, a concatenation and a scatter: about 1 ms a layer at batch 16, for 400 KB.
 *
 * Mamba-2 (rayllm_mamba2_step; workers/mamba2.py's gated_step is the reference), from the conv's
 * SiLU'd output xbc = u ++ B ++ C and in_proj's dt and gate to the gated, normed y that out_proj
 * takes:
 * Per sequence s, head h (group g = h / (H / G)) and channel p of the head:
 *     decay    = exp(dt[s, h] * A[h])
 *     h[p, n]  = decay * h[p, n] + dt[s, h] * u[s, h, p] * B[s, g, n]     over the state size N
 *     y[s,h,p] = sum_n h[p, n] * C[s, g, n] + D[h] * u[s, h, p]
 * with dt = softplus(dt_raw + dt_bias) clamped, and h the row rows[s] of the pool. Each state is
 * read once, updated, written back and reduced in the same pass; in torch the step was five passes
 * over the states (gather, decay, add, scatter, contraction), each through memory at batch 16. A
 * (sequence, head) pair is one item of the thread pool: P x N x 4 bytes of state (32 KiB at
 * Granite 4.0-H's 64 x 128). Then per sequence and group of inner / G values, in fp32:
 *     MAMBA2_NORM_AFTER_GATE:  out = rms_norm(y * silu(gate)) * weight      (Granite 4.0-H)
 *     MAMBA2_NORM_BEFORE_GATE: out = rms_norm(y) * weight * silu(gate)      (Falcon-H1)
 *     MAMBA2_NO_NORM:          out = y * silu(gate)
 * rounded to the dtype once. In torch these were about twenty ops a layer.
 *
 * The Gated DeltaNet (rayllm_gated_delta_step; workers/gated_delta.py's gated_step is the
 * reference), from the conv's SiLU'd output q ++ k ++ v and in_proj's z, b and a to out_proj's
 * input: per sequence and value head (key head hk = hv / (Hv / Hk)), in fp32,
 *     q = l2norm(q[hk]) / sqrt(dk), k = l2norm(k[hk]), beta = sigmoid(b) (in the dtype), decay = exp(g)
 *     with g = -exp(A_log) softplus(a + dt_bias)
 *     S = decay S;  p = k^T S;  S += k (beta (v - p))^T;  o = q^T S       S [dk, dv], two passes
 *     out = rms_norm(o) * weight * silu(z)                                  per value head
 * rounding to the dtype where transformers' Qwen3NextRMSNormGated does. */
#include <math.h>

#include "entry_points.h"
#include "simd.h"

typedef struct {
    const void *x, *weight, *bias;
    void *states, *out;
    const int64_t *rows;
    int64_t channels, kernel, x_stride, chunks_per_seq;
    int32_t silu, bf16;
} ConvStep;

#define CONV_CHANNELS_PER_ITEM 512

static inline float round_to(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

/* acc[i] = silu(acc[i]) over n values, in vectors where the CPU has them. */
static inline void silu_in_place(float *acc, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512 y = _mm512_loadu_ps(acc + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), y));
        _mm512_storeu_ps(acc + i, _mm512_div_ps(y, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
#elif defined(RAYLLM_AVX2)
    for (; i + 8 <= n; i += 8) {
        const __m256 y = _mm256_loadu_ps(acc + i);
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), y));
        _mm256_storeu_ps(acc + i, _mm256_div_ps(y, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    }
#endif
    for (; i < n; i++) acc[i] = acc[i] / (1.0f + expf(-acc[i]));
}

/* Channels [c0, c1) of sequence s; the loops run over channels (vectors), the taps outside them. */
static inline void conv_step_channels(const ConvStep *a, int64_t s, int64_t c0, int64_t c1, const int bf16) {
    const int dtype = bf16 ? DTYPE_BF16 : DTYPE_F32;
    const int64_t K = a->kernel, C = a->channels, n = c1 - c0, elem = bf16 ? 2 : 4;
    const char *x = (const char *)a->x + (s * a->x_stride + c0) * elem;
    char *window = (char *)a->states + (a->rows[s] * (K - 1) * C + c0) * elem;
    const char *weight = (const char *)a->weight + c0 * K * elem;
    float acc[CONV_CHANNELS_PER_ITEM];
    for (int64_t c = 0; c < n; c++) acc[c] = load_element(x, c, dtype) * load_element(weight, c * K + K - 1, dtype);
    for (int64_t j = 0; j < K - 1; j++)
        for (int64_t c = 0; c < n; c++)
            acc[c] += load_element(window, j * C + c, dtype) * load_element(weight, c * K + j, dtype);
    if (a->bias)
        for (int64_t c = 0; c < n; c++) acc[c] += load_element(a->bias, c0 + c, dtype);
    for (int64_t j = 0; j + 1 < K - 1; j++) memcpy(window + j * C * elem, window + (j + 1) * C * elem, n * elem);
    if (K > 1) memcpy(window + (K - 2) * C * elem, x, n * elem);
    for (int64_t c = 0; c < n; c++) acc[c] = round_to(acc[c], bf16);
    if (a->silu) silu_in_place(acc, n);
    char *out = (char *)a->out + (s * C + c0) * elem;
    for (int64_t c = 0; c < n; c++) store_element(out, c, acc[c], dtype);
}

static void conv_step_item(void *context, int64_t item) {
    const ConvStep *a = context;
    const int64_t s = item / a->chunks_per_seq, c0 = item % a->chunks_per_seq * CONV_CHANNELS_PER_ITEM;
    const int64_t c1 = c0 + CONV_CHANNELS_PER_ITEM < a->channels ? c0 + CONV_CHANNELS_PER_ITEM : a->channels;
    if (a->bf16)
        conv_step_channels(a, s, c0, c1, 1);
    else
        conv_step_channels(a, s, c0, c1, 0);
}

/* Every rows[s] within [0, num_rows): a state row out of the pool is refused, never written. */
static int rows_in_pool(const int64_t *rows, int64_t num_seqs, int64_t num_rows) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (rows[s] < 0 || rows[s] >= num_rows) return 0;
    return 1;
}

int rayllm_conv_step(const void *x, int64_t x_stride, const void *weight, const void *bias, void *states,
                     const int64_t *rows, int64_t num_rows, void *out, int64_t num_seqs, int64_t channels,
                     int64_t kernel, int32_t silu, int32_t dtype, int32_t num_threads) {
    if (num_seqs < 0 || channels <= 0 || kernel < 1 || (dtype != DTYPE_F32 && dtype != DTYPE_BF16) ||
        !rows_in_pool(rows, num_seqs, num_rows))
        return 1;
    const int64_t chunks = (channels + CONV_CHANNELS_PER_ITEM - 1) / CONV_CHANNELS_PER_ITEM;
    ConvStep step = {x, weight, bias, states, out, rows, channels, kernel, x_stride, chunks, silu != 0,
                     dtype == DTYPE_BF16};
    rayllm_parallel_for(num_seqs * chunks, num_threads, conv_step_item, &step);
    return 0;
}

#define MAMBA2_MAX_STATE 1024

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* F.softplus's threshold */

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static void mamba2_state_item(void *context, int64_t item) {
    const Mamba2StepArgs *a = context;
    const int dtype = a->dtype;
    const int64_t H = a->num_heads, P = a->head_dim, N = a->state_size, inner = H * P;
    const int64_t s = item / H, h = item % H, g = h / (H / a->num_groups);
    const float dt_raw = load_element(a->dt, s * a->dt_stride + h, dtype) + a->dt_bias[h];
    const float dt = fminf(fmaxf(softplus(dt_raw), a->time_step_min), a->time_step_max);
    const float decay = expf(dt * a->decay_rate[h]), skip = a->skip[h];
    const int64_t row = s * a->xbc_stride;
    float B[MAMBA2_MAX_STATE], C[MAMBA2_MAX_STATE];
    for (int64_t n = 0; n < N; n++) {
        B[n] = load_element(a->xbc, row + inner + g * N + n, dtype);
        C[n] = load_element(a->xbc, row + inner + (a->num_groups + g) * N + n, dtype);
    }
    float *state = a->states + (a->rows[s] * H + h) * P * N;
    float *y = a->scratch + s * inner + h * P;
    for (int64_t p = 0; p < P; p++) {
        float *values = state + p * N;
        const float u = load_element(a->xbc, row + h * P + p, dtype), input = dt * u;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t n = 0; n < N; n++) {
            const float next = decay * values[n] + input * B[n];
            values[n] = next;
            sum += next * C[n];
        }
        y[p] = sum + skip * u;
    }
}

static void mamba2_gate_item(void *context, int64_t item) {
    const Mamba2StepArgs *a = context;
    const int dtype = a->dtype;
    const int64_t inner = a->num_heads * a->head_dim, width = inner / a->num_groups;
    const int64_t s = item / a->num_groups, first = item % a->num_groups * width;
    float *y = a->scratch + s * inner + first;
    const int64_t gate = s * a->gate_stride + first;
    if (a->norm_mode == MAMBA2_NORM_AFTER_GATE)
        for (int64_t i = 0; i < width; i++) y[i] *= silu(load_element(a->gate, gate + i, dtype));
    float scale = 1.0f;
    if (a->norm_mode != MAMBA2_NO_NORM) {
        float squares = 0.0f;
        for (int64_t i = 0; i < width; i++) squares += y[i] * y[i];
        scale = 1.0f / sqrtf(squares / (float)width + a->eps);
    }
    void *out = (char *)a->out + s * inner * (dtype == DTYPE_BF16 ? 2 : 4);
    for (int64_t i = 0; i < width; i++) {
        float value = y[i];
        if (a->norm_mode != MAMBA2_NO_NORM) value = value * scale * load_element(a->norm, first + i, dtype);
        if (a->norm_mode != MAMBA2_NORM_AFTER_GATE) value *= silu(load_element(a->gate, gate + i, dtype));
        store_element(out, first + i, value, dtype);
    }
}

int rayllm_mamba2_step(const Mamba2StepArgs *a) {
    const int64_t H = a->num_heads;
    if (a->num_seqs < 0 || H <= 0 || a->head_dim <= 0 || a->state_size <= 0 || a->state_size > MAMBA2_MAX_STATE ||
        a->num_groups <= 0 || H % a->num_groups != 0 || (a->dtype != DTYPE_F32 && a->dtype != DTYPE_BF16) ||
        a->norm_mode < MAMBA2_NO_NORM || a->norm_mode > MAMBA2_NORM_BEFORE_GATE ||
        (a->norm_mode != MAMBA2_NO_NORM && a->norm == NULL) || !rows_in_pool(a->rows, a->num_seqs, a->num_rows))
        return 1;
    rayllm_parallel_for(a->num_seqs * H, a->num_threads, mamba2_state_item, (void *)a);
    rayllm_parallel_for(a->num_seqs * a->num_groups, a->num_threads, mamba2_gate_item, (void *)a);
    return 0;
}

int rayllm_layout_mamba2_step_args(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(Mamba2StepArgs)
    LAYOUT_FIELD(Mamba2StepArgs, xbc)
    LAYOUT_FIELD(Mamba2StepArgs, dt)
    LAYOUT_FIELD(Mamba2StepArgs, gate)
    LAYOUT_FIELD(Mamba2StepArgs, norm)
    LAYOUT_FIELD(Mamba2StepArgs, dt_bias)
    LAYOUT_FIELD(Mamba2StepArgs, decay_rate)
    LAYOUT_FIELD(Mamba2StepArgs, skip)
    LAYOUT_FIELD(Mamba2StepArgs, states)
    LAYOUT_FIELD(Mamba2StepArgs, scratch)
    LAYOUT_FIELD(Mamba2StepArgs, out)
    LAYOUT_FIELD(Mamba2StepArgs, rows)
    LAYOUT_FIELD(Mamba2StepArgs, num_rows)
    LAYOUT_FIELD(Mamba2StepArgs, num_seqs)
    LAYOUT_FIELD(Mamba2StepArgs, num_heads)
    LAYOUT_FIELD(Mamba2StepArgs, head_dim)
    LAYOUT_FIELD(Mamba2StepArgs, state_size)
    LAYOUT_FIELD(Mamba2StepArgs, num_groups)
    LAYOUT_FIELD(Mamba2StepArgs, xbc_stride)
    LAYOUT_FIELD(Mamba2StepArgs, dt_stride)
    LAYOUT_FIELD(Mamba2StepArgs, gate_stride)
    LAYOUT_FIELD(Mamba2StepArgs, time_step_min)
    LAYOUT_FIELD(Mamba2StepArgs, time_step_max)
    LAYOUT_FIELD(Mamba2StepArgs, eps)
    LAYOUT_FIELD(Mamba2StepArgs, norm_mode)
    LAYOUT_FIELD(Mamba2StepArgs, dtype)
    LAYOUT_FIELD(Mamba2StepArgs, num_threads)
    return n;
}

#define GATED_DELTA_MAX_DIM 1024
#define L2_NORM_EPS 1e-6f /* workers/gated_delta.py's */

/* x [d] loaded from the dtype and divided by its L2 norm (times scale). */
static inline void load_l2_normed(float *x, const void *base, int64_t first, int64_t d, int dtype, float scale) {
    float squares = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        x[i] = load_element(base, first + i, dtype);
        squares += x[i] * x[i];
    }
    const float factor = scale / sqrtf(squares + L2_NORM_EPS);
    for (int64_t i = 0; i < d; i++) x[i] *= factor;
}

static void gated_delta_item(void *context, int64_t item) {
    const GatedDeltaStepArgs *a = context;
    const int dtype = a->dtype, bf16 = dtype == DTYPE_BF16;
    const int64_t Hv = a->num_v_heads, dk = a->head_k_dim, dv = a->head_v_dim;
    const int64_t s = item / Hv, hv = item % Hv, hk = hv / (Hv / a->num_k_heads), key_dim = a->num_k_heads * dk;
    const int64_t row = s * a->mixed_stride;
    float q[GATED_DELTA_MAX_DIM], k[GATED_DELTA_MAX_DIM], v[GATED_DELTA_MAX_DIM], p[GATED_DELTA_MAX_DIM];
    load_l2_normed(q, a->mixed, row + hk * dk, dk, dtype, 1.0f / sqrtf((float)dk));
    load_l2_normed(k, a->mixed, row + key_dim + hk * dk, dk, dtype, 1.0f);
    for (int64_t j = 0; j < dv; j++) v[j] = load_element(a->mixed, row + 2 * key_dim + hv * dv + j, dtype);
    const float beta = round_to(1.0f / (1.0f + expf(-load_element(a->b, s * a->ba_stride + hv, dtype))), bf16);
    const float g = a->neg_decay_rate[hv] * softplus(load_element(a->a, s * a->ba_stride + hv, dtype) + a->dt_bias[hv]);
    const float decay = expf(g);
    float *S = a->states + (a->rows[s] * Hv + hv) * dk * dv;
    for (int64_t j = 0; j < dv; j++) p[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) { /* decay, and what the decayed state recalls at k */
        float *line = S + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            line[j] *= decay;
            p[j] += ki * line[j];
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        v[j] = (v[j] - p[j]) * beta; /* the correction */
        p[j] = 0.0f;                 /* o from here on */
    }
    for (int64_t i = 0; i < dk; i++) { /* the write at k, and the read at q */
        float *line = S + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            line[j] += ki * v[j];
            p[j] += qi * line[j];
        }
    }
    float squares = 0.0f;
    for (int64_t j = 0; j < dv; j++) {
        p[j] = round_to(p[j], bf16);
        squares += p[j] * p[j];
    }
    const float scale = 1.0f / sqrtf(squares / (float)dv + a->eps);
    void *out = (char *)a->out + (s * Hv + hv) * dv * (bf16 ? 2 : 4);
    const int64_t z = s * a->z_stride + hv * dv;
    for (int64_t j = 0; j < dv; j++) {
        const float weighted = round_to(load_element(a->norm, j, dtype) * round_to(p[j] * scale, bf16), bf16);
        store_element(out, j, weighted * silu(load_element(a->z, z + j, dtype)), dtype);
    }
}

int rayllm_gated_delta_step(const GatedDeltaStepArgs *a) {
    if (a->num_seqs < 0 || a->num_k_heads <= 0 || a->num_v_heads <= 0 || a->num_v_heads % a->num_k_heads != 0 ||
        a->head_k_dim <= 0 || a->head_k_dim > GATED_DELTA_MAX_DIM || a->head_v_dim <= 0 ||
        a->head_v_dim > GATED_DELTA_MAX_DIM || (a->dtype != DTYPE_F32 && a->dtype != DTYPE_BF16) ||
        !rows_in_pool(a->rows, a->num_seqs, a->num_rows))
        return 1;
    rayllm_parallel_for(a->num_seqs * a->num_v_heads, a->num_threads, gated_delta_item, (void *)a);
    return 0;
}

int rayllm_layout_gated_delta_step_args(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(GatedDeltaStepArgs)
    LAYOUT_FIELD(GatedDeltaStepArgs, mixed)
    LAYOUT_FIELD(GatedDeltaStepArgs, z)
    LAYOUT_FIELD(GatedDeltaStepArgs, b)
    LAYOUT_FIELD(GatedDeltaStepArgs, a)
    LAYOUT_FIELD(GatedDeltaStepArgs, norm)
    LAYOUT_FIELD(GatedDeltaStepArgs, dt_bias)
    LAYOUT_FIELD(GatedDeltaStepArgs, neg_decay_rate)
    LAYOUT_FIELD(GatedDeltaStepArgs, states)
    LAYOUT_FIELD(GatedDeltaStepArgs, out)
    LAYOUT_FIELD(GatedDeltaStepArgs, rows)
    LAYOUT_FIELD(GatedDeltaStepArgs, num_rows)
    LAYOUT_FIELD(GatedDeltaStepArgs, num_seqs)
    LAYOUT_FIELD(GatedDeltaStepArgs, num_k_heads)
    LAYOUT_FIELD(GatedDeltaStepArgs, num_v_heads)
    LAYOUT_FIELD(GatedDeltaStepArgs, head_k_dim)
    LAYOUT_FIELD(GatedDeltaStepArgs, head_v_dim)
    LAYOUT_FIELD(GatedDeltaStepArgs, mixed_stride)
    LAYOUT_FIELD(GatedDeltaStepArgs, z_stride)
    LAYOUT_FIELD(GatedDeltaStepArgs, ba_stride)
    LAYOUT_FIELD(GatedDeltaStepArgs, eps)
    LAYOUT_FIELD(GatedDeltaStepArgs, dtype)
    LAYOUT_FIELD(GatedDeltaStepArgs, num_threads)
    return n;
}

/* Triangular solves of the chunked delta rules (workers/gated_delta.py, workers/kda.py): for each of
 * batch systems, B = T^-1 B in place, T the unit lower-triangular matrix whose strictly lower part
 * is A's ([L, L]; A's diagonal and upper part are not read), B [L, M]; fp32, by forward
 * substitution, one system an item. torch's solve_triangular calls MKL, whose threads, called from
 * any thread but the process's first, took 11.6 ms for what took 1.8 ms from the first (128 systems
 * of 64 x 64, 128 columns, 2 threads); a worker runs its steps on its step channel's thread. */
typedef struct {
    const float *A;
    float *B;
    int64_t L, M;
} UnitLowerSolve;

static void unit_lower_solve_item(void *context, int64_t item) {
    const UnitLowerSolve *a = context;
    const float *T = a->A + item * a->L * a->L;
    float *X = a->B + item * a->L * a->M;
    for (int64_t i = 1; i < a->L; i++) {
        float *row = X + i * a->M;
        for (int64_t j = 0; j < i; j++) {
            const float factor = T[i * a->L + j];
            const float *done = X + j * a->M;
#pragma omp simd
            for (int64_t m = 0; m < a->M; m++) row[m] -= factor * done[m];
        }
    }
}

int rayllm_unit_lower_solve(const float *A, float *B, int64_t batch, int64_t L, int64_t M, int32_t num_threads) {
    if (batch < 0 || L < 0 || M < 0) return 1;
    UnitLowerSolve solve = {A, B, L, M};
    rayllm_parallel_for(batch, num_threads, unit_lower_solve_item, &solve);
    return 0;
}
