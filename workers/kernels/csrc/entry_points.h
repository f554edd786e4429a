/* The library's entry points (what workers/kernels/native.py declares) and their argument
 * structs, for the sources that call each other: every one returns 0, or an error code. */
#ifndef RAYLLM_ENTRY_POINTS_H
#define RAYLLM_ENTRY_POINTS_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* paged_attention.c: one varlen call per layer and step (the layout and contract are there). */
typedef struct {
    const void *q;   /* [num_tokens, num_heads, head_dim], strides below */
    void *out;       /* [num_tokens, num_heads, head_dim], strides below */
    const void *k_cache; /* K part of block 0 (layout in paged_attention.c) */
    const void *v_cache; /* V part of block 0 */
    const int32_t *block_tables;    /* [num_seqs, max_blocks_per_seq] */
    const int32_t *query_start_loc; /* [num_seqs + 1] */
    const int32_t *seq_lens;        /* [num_seqs] */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq;
    int64_t q_stride_token, q_stride_head;     /* elements */
    int64_t out_stride_token, out_stride_head; /* elements */
    int64_t block_stride;                      /* elements from one block's K (or V) part to the next's */
    float scale;
    int32_t dtype;       /* DTYPE_F32 or DTYPE_BF16: q and out */
    int32_t kv_dtype;    /* the pool's: dtype itself, or DTYPE_F16 under fp32 queries (a half pool) */
    int32_t num_threads; /* OpenMP threads for the tasks */
    /* the layer's variants (paged_attention.c); zero / NULL: none */
    int64_t window;      /* > 0: a query at position p sees keys (p - window, p] only */
    int64_t attention_chunk; /* > 0: a query at position p sees keys [p / chunk * chunk, p] only (Llama 4) */
    float softcap;       /* > 0: scores = softcap * tanh(scores / softcap) before the softmax */
    const float *sinks;  /* [num_heads] fp32: each head's sink logit in the softmax, or NULL */
    /* sequences computing at least this many queries run on AMX tiles where the shapes allow
     * (attention_amx.c); 0: never (workers/kernels/cpu_isa.py's table) */
    int64_t tile_min_queries;
} AttentionArgs;

int rayllm_paged_attention(const AttentionArgs *a);

/* The first key a query at `position` sees: 0, or the first of its window, or of its chunk
 * (whichever is later). Never decreases as the position grows, so a task's first query's is the
 * task's first key. */
static inline int64_t rayllm_first_visible_key(const AttentionArgs *a, int64_t position) {
    int64_t first = a->window > 0 ? position - a->window + 1 : 0;
    if (a->attention_chunk > 0 && position / a->attention_chunk * a->attention_chunk > first)
        first = position / a->attention_chunk * a->attention_chunk;
    return first > 0 ? first : 0;
}
int rayllm_write_kv(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache, void *v_cache,
                    int64_t block_stride, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, int32_t dtype, int32_t kv_dtype, int32_t num_threads);

/* layer_ops.c */
int rayllm_add_rms_norm(void *residual, const void *delta, const void *weight, void *out, int64_t num_rows,
                        int64_t hidden, float eps, int32_t dtype, int32_t num_threads);
int rayllm_add_rms_norm_to(void *residual, const void *delta, const void *weight, void *out, int64_t num_rows,
                           int64_t hidden, float eps, int32_t dtype, int32_t out_dtype, int32_t num_threads);
int rayllm_rope(void *qkv, const int64_t *positions, const float *cos, const float *sin, int64_t num_tokens,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, int32_t dtype,
                int32_t num_threads);
int rayllm_head_rms_norm(void *qkv, const void *q_weight, const void *k_weight, int64_t num_rows, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int32_t whole, float eps, int32_t dtype,
                         int32_t num_threads);
enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1, ACTIVATION_SWIGLU_OAI = 2 }; /* rayllm_gated_mul's activation */
int rayllm_gated_mul(const void *gate_up, void *out, int64_t num_rows, int64_t width, int32_t activation, float alpha,
                     float limit, int32_t dtype, int32_t num_threads);
int rayllm_gemv(const void *x, const void *w, const void *bias, void *out, int64_t num_rows, int64_t N, int64_t K,
                int32_t dtype, int32_t out_dtype, int32_t num_threads);
int rayllm_panel_gemm(const float *x, const float *panels, const float *bias, float *out, int64_t num_rows, int64_t N,
                      int64_t K, int32_t num_threads);

/* panel_avx512.c: the panel GEMM of AVX-512 builds (dtype and out_dtype: DTYPE_F32 or DTYPE_BF16) */
int rayllm_panel_gemm_avx512(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows,
                             int64_t N, int64_t K, int32_t dtype, int32_t out_dtype, int32_t num_threads);
int rayllm_panel_gemm_bf16(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows, int64_t N,
                           int64_t K, int32_t out_dtype, int32_t num_threads);

/* layer_ops.c: x: [num_rows, width] fp32 -> out[r] = argmax of row r (torch.argmax's answer), as int64. */
int rayllm_argmax(const float *x, int64_t *out, int64_t num_rows, int64_t width, int32_t num_threads);
int64_t rayllm_argmax_row(const float *row, int64_t width); /* one row of it, on the calling thread */

/* gguf_gemm.c: out[m, n] = x[m, :] . w[n, :] (+ bias[n]) with w in GGUF blocks of ggml_type (ggml's
 * type code: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); x and bias in dtype, out in out_dtype. mode:
 * GGUF_FP32 (x in fp32 against weights widened in registers), GGUF_INT8 (x quantized to int8
 * blocks, integer dot products) or GGUF_INT16 (x quantized to int16 blocks; packed Q8_0 only).
 * 1: a type or mode it does not have, 2: bad sizes, 3: out of memory. */
enum { GGUF_FP32 = 0, GGUF_INT8 = 1, GGUF_INT16 = 2 };
/* ggml_type | GGUF_PACKED: Q4_0, Q4_1 or Q8_0 blocks repacked eight columns at a time (gguf_gemm.c) */
enum { GGUF_PACKED = 0x100 };
int rayllm_gguf_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows, int64_t N,
                     int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype, int32_t mode,
                     int32_t num_threads);
/* gguf_gemm.c: rows index[0..num_out) (index NULL: all N) of w [N, K] in GGUF blocks of ggml_type
 * (packed or not) -> out [num_out, K] fp32. 1: a type it does not have, 2: bad sizes or index. */
int rayllm_gguf_dequantize(const uint8_t *w, const int64_t *index, int64_t num_out, float *out, int64_t N, int64_t K,
                           int32_t ggml_type, int32_t num_threads);

/* gguf_gemm.c, for amx.c: a GGUF row's bytes (-1: a type it does not have; -2: bad sizes), and
 * columns [n0, n0 + 32) of a GGUF weight dequantized to two bf16 panels (AVX512_BF16 builds). */
int64_t rayllm_gguf_row_bytes(int32_t ggml_type, int64_t N, int64_t K);
void rayllm_gguf_bf16_panels(const uint8_t *w, int32_t ggml_type, int64_t row_bytes, int64_t N, int64_t K, int64_t n0,
                             uint16_t *out);

void rayllm_gguf_quantize_rows(const void *x, int32_t dtype, int64_t num_rows, int64_t K, int8_t *xq, float *x_scale,
                               float *x_sum, int32_t num_threads);
void rayllm_gguf_quantize_rows16(const void *x, int32_t dtype, int64_t num_rows, int64_t K, int16_t *x16,
                                 float *x_scale, int32_t num_threads);
/* gguf_amx.c: rayllm_gguf_gemm's GGUF_INT8 product of packed Q4_0 / Q4_1 weights, bit for bit, on
 * AMX int8 tiles (1 where this build or CPU has none) */
int rayllm_amx_gguf_int8_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                              int64_t N, int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype,
                              int32_t num_threads);
/* ... and the GGUF_INT16 product of a packed Q8_0 (an lm_head's), bit for bit, on the same tiles */
int rayllm_amx_gguf_int16_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                               int64_t N, int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype,
                               int32_t num_threads);

/* amx.c: what the CPU has (CPU_* bits), whether the OS grants tile data (AMX_*), and the
 * products on tiles (1 where this build has none). */
enum { CPU_AVX2 = 1, CPU_AVX512 = 2, CPU_AVX512_BF16 = 4, CPU_AVX512_VNNI = 8, CPU_AMX_BF16 = 16, CPU_AMX_INT8 = 32 };
enum { AMX_GRANTED = 0, AMX_NOT_BUILT = 1, AMX_NO_CPU = 2, AMX_REFUSED = 3 };
int rayllm_cpu_features(void);
int rayllm_amx_built(void);
int rayllm_amx_enable(void);
/* TDPBF16PS on tiles loaded once, `items` items of `rounds` rounds of 4 on the pool: the tiles' peak */
int rayllm_amx_tile_peak(int64_t items, int64_t rounds, int32_t num_threads);
int rayllm_amx_gemm_bf16(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows, int64_t N,
                         int64_t K, int32_t dtype, int32_t out_dtype, int32_t num_threads);
int rayllm_amx_gated_gemm_bf16(const void *x, const void *panels, const void *bias, void *out, int64_t num_rows,
                               int64_t width, int64_t K, int32_t activation, float alpha, float limit,
                               int32_t num_threads);
int rayllm_amx_gguf_gated_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows,
                               int64_t width, int64_t K, int32_t ggml_type, int32_t dtype, int32_t activation,
                               float alpha, float limit, int32_t num_threads);
int rayllm_amx_gguf_gemm(const void *x, const uint8_t *w, const void *bias, void *out, int64_t num_rows, int64_t N,
                         int64_t K, int32_t ggml_type, int32_t dtype, int32_t out_dtype, int32_t num_threads);
int rayllm_amx_gguf_gemm_rounded_x(const uint16_t *x, const uint8_t *w, const float *bias, void *out, int64_t num_rows,
                                   int64_t N, int64_t K, int32_t ggml_type, int32_t activation, int32_t out_dtype,
                                   int32_t num_threads);

/* attention_amx.c: whether the tile path takes a call's shapes, and the sequences of at least
 * min_queries queries on it (taken[s] set for each; 1 where this build has no tiles). */
int rayllm_tile_attention_fits(const AttentionArgs *a);
int rayllm_tile_attention(const AttentionArgs *a, int64_t min_queries, uint8_t *taken);

/* lora.c: a step's LoRA products, segmented by adapter (workers/lora.py). An adapter's parts
 * are laid out [num_layers][LORA_PRODUCTS (qkv, o, gate_up, down)][LORA_MAX_PARTS]; rank 0: none. */
enum { LORA_PRODUCTS = 4, LORA_MAX_PARTS = 3, LORA_MAX_RANK = 512 };
typedef struct {
    const void *a;  /* [rank, K] */
    const void *bt; /* [rank, len]: B transposed, its scaling folded in */
    int64_t rank, start, len; /* the part's output columns: [start, start + len) */
    int32_t dtype;  /* a's and bt's: DTYPE_F32 or DTYPE_BF16 */
} LoraPart;
typedef struct {
    const LoraPart *parts; /* the adapter's */
    const int64_t *rows;   /* [num_rows]: the step's rows of this adapter */
    int64_t num_rows;
} LoraSegment;
typedef struct {
    const LoraSegment *segments;   /* [num_segments] */
    int64_t num_segments, num_layers;
} LoraStep;
int rayllm_lora_add(const LoraStep *step, int64_t layer, int32_t product, const void *x, void *out, int64_t N,
                    int64_t K, int32_t dtype, int32_t num_threads);
int rayllm_lora_adapts(const LoraStep *step, int64_t layer, int32_t product);
int rayllm_layout_lora_part(int64_t *offsets, char *names, int64_t capacity);
int rayllm_layout_lora_segment(int64_t *offsets, char *names, int64_t capacity);
int rayllm_layout_lora_step(int64_t *offsets, char *names, int64_t capacity);

/* recurrent.c: a causal convolution's step of num_seqs sequences, on states [rows, K - 1, channels]
 * in place: x [s, channels] (rows x_stride apart), weight [channels, K], bias [channels] or NULL,
 * all in dtype -> out [s, channels] contiguous, SiLU'd if silu. Here and below, a step whose rows
 * are not all in [0, num_rows) is refused (status 1) before anything is written. */
int rayllm_conv_step(const void *x, int64_t x_stride, const void *weight, const void *bias, void *states,
                     const int64_t *rows, int64_t num_rows, void *out, int64_t num_seqs, int64_t channels,
                     int64_t kernel, int32_t silu, int32_t dtype, int32_t num_threads);
/* recurrent.c: Mamba-2's decode step of num_seqs sequences, from the conv's output to out_proj's
 * input, on states [rows, H, P, N] fp32 in place (the contract is in recurrent.c). */
enum { MAMBA2_NO_NORM = 0, MAMBA2_NORM_AFTER_GATE = 1, MAMBA2_NORM_BEFORE_GATE = 2 };
typedef struct {
    const void *xbc;  /* [s, H P + 2 G N] in dtype: u ++ B ++ C, rows xbc_stride apart */
    const void *dt;   /* [s, H] in dtype: in_proj's dt, before dt_bias and softplus, rows dt_stride apart */
    const void *gate; /* [s, H P] in dtype, rows gate_stride apart */
    const void *norm; /* [H P] in dtype: the gated RMSNorm's weight, or NULL with MAMBA2_NO_NORM */
    const float *dt_bias, *decay_rate, *skip; /* [H] each: dt_bias, A = -exp(A_log), D */
    float *states;    /* [rows, H, P, N] */
    float *scratch;   /* [s, H P]: y */
    void *out;        /* [s, H P] in dtype, contiguous */
    const int64_t *rows; /* [s] */
    int64_t num_rows;    /* the pool's */
    int64_t num_seqs, num_heads, head_dim, state_size, num_groups, xbc_stride, dt_stride, gate_stride;
    float time_step_min, time_step_max, eps;
    int32_t norm_mode, dtype, num_threads;
} Mamba2StepArgs;
int rayllm_mamba2_step(const Mamba2StepArgs *a);
int rayllm_layout_mamba2_step_args(int64_t *offsets, char *names, int64_t capacity);

/* recurrent.c: the Gated DeltaNet's decode step of num_seqs sequences, from the conv's output to
 * out_proj's input, on states [rows, Hv, dk, dv] fp32 in place (the contract is in recurrent.c). */
typedef struct {
    const void *mixed; /* [s, 2 Hk dk + Hv dv] in dtype: q ++ k ++ v, rows mixed_stride apart */
    const void *z;     /* [s, Hv dv] in dtype, rows z_stride apart */
    const void *b, *a; /* [s, Hv] each in dtype, rows ba_stride apart */
    const void *norm;  /* [dv] in dtype: the gated RMSNorm's weight */
    const float *dt_bias, *neg_decay_rate; /* [Hv] each */
    float *states;     /* [rows, Hv, dk, dv] */
    void *out;         /* [s, Hv dv] in dtype, contiguous */
    const int64_t *rows; /* [s] */
    int64_t num_rows;    /* the pool's */
    int64_t num_seqs, num_k_heads, num_v_heads, head_k_dim, head_v_dim, mixed_stride, z_stride, ba_stride;
    float eps;
    int32_t dtype, num_threads;
} GatedDeltaStepArgs;
int rayllm_gated_delta_step(const GatedDeltaStepArgs *a);
int rayllm_layout_gated_delta_step_args(int64_t *offsets, char *names, int64_t capacity);

/* recurrent.c: B = T^-1 B in place for batch unit lower-triangular T (the strict lower part of A
 * [batch, L, L]) and B [batch, L, M], fp32, contiguous. */
int rayllm_unit_lower_solve(const float *A, float *B, int64_t batch, int64_t L, int64_t M, int32_t num_threads);

/* thread_pool.c: fn(ctx, i) for i in [0, num_items) on up to num_threads threads, the caller
 * among them; returns when every item is done. */
typedef void (*ParallelBody)(void *ctx, int64_t item);
void rayllm_parallel_for(int64_t num_items, int num_threads, ParallelBody fn, void *ctx);
/* how many times a caller of rayllm_parallel_for has slept waiting for a helper's item (tests) */
int32_t rayllm_pool_caller_sleeps(void);
/* Each argument struct's layout: sizeof, then its fields' offsets in declaration order, and their
 * names space-separated in names; returns the count of numbers (workers/kernels/native.py checks
 * its ctypes mirrors against these at load). */
int rayllm_layout_attention_args(int64_t *offsets, char *names, int64_t capacity);
int rayllm_layout_layer_args(int64_t *offsets, char *names, int64_t capacity);
int rayllm_layout_forward_args(int64_t *offsets, char *names, int64_t capacity);
int rayllm_layout_sample_args(int64_t *offsets, char *names, int64_t capacity);

/* One field of a layout: its offset, and its name after the ones before (dropped past capacity,
 * which the check then reports as a mismatch). */
static inline void layout_field(int64_t *offsets, int *n, char *names, int64_t capacity, const char *name,
                                size_t offset) {
    offsets[(*n)++] = (int64_t)offset;
    const size_t used = strlen(names);
    if (used + strlen(name) + 2 > (size_t)capacity) return;
    if (used) strcat(names, " ");
    strcat(names, name);
}
#define LAYOUT_BEGIN(T)                                                                                  \
    int n = 0;                                                                                           \
    names[0] = 0;                                                                                        \
    offsets[n++] = (int64_t)sizeof(T);
#define LAYOUT_FIELD(T, f) layout_field(offsets, &n, names, capacity, #f, offsetof(T, f));

#endif
