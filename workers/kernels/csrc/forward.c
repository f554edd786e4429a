/* Every decoder layer of a step in one call: the same entry points as workers/model.py's
 * Python loop, in the same order, with the same arguments, so the hidden states are the same
 * bit for bit; only the ~10 Python-to-C crossings per layer (argument checks, ctypes
 * conversions, a fresh output tensor per op) are gone. Per layer:
 *
 *     residual, x = add_rms_norm(residual, delta, input_norm)     (no delta before layer 0)
 *     qkv = linear(x, qkv_weight);  [q/k norms(qkv)];  [rope(qkv)];  write_kv(k, v);  attended = attention(q)
 *                                                  (with the layer's window, soft-cap and sinks, where it has them)
 *     delta = linear(attended, o_weight);  [delta = rms_norm(delta, attn_out_norm)]
 *     residual, x = add_rms_norm(residual, delta, post_norm)
 *     delta = linear(act_mul(linear(x, gate_up_weight)), down_weight);  [delta = rms_norm(delta, mlp_out_norm)]
 *                                                  (act_mul(linear(...)) in one tile product on AMX: gated())
 *
 * (the q/k norms where the layer has them, RoPE unless the layer has none, the norms of a
 * branch's output where the family has them; a NULL input_norm or post_norm means the branch
 * reads the residual stream unnormed: OLMo 2) and after the last layer
 * out = rms_norm(residual + delta) * final_norm. The products are
 * ours only: a GGUF weight's own product (gguf_gemm.c, each product of a layer in its own type),
 * the panel GEMM (fp32 on AVX2 or AVX-512 CPUs, bf16 on AVX512_BF16 CPUs, each up
 * to its row limit in workers/linear.py) or the GEMV (a few rows); the Python side
 * (workers/native_forward.py) calls this only for steps whose every product one of them
 * takes, and runs its own loop otherwise (oneDNN's products).
 */
#include <stddef.h>
#include <stdint.h>

#include "entry_points.h"
#include "simd.h"

enum { LINEAR_PANELS = 0, LINEAR_GEMV = 1 };

/* A layer that keeps a state per sequence in attention's place (workers/recurrent.py): Python's
 * function for layer l of a step of num_tokens rows reads the branch's input (the normed x, or the
 * residual stream) and writes its output to delta; nonzero: it failed (Python holds the error). */
typedef int32_t (*MixerFn)(int64_t layer, int64_t num_tokens);

typedef struct {
    const void *input_norm, *post_norm;         /* [hidden], or NULL: the branch reads the residual unnormed */
    const void *qkv, *o, *gate_up, *down;       /* panels of the dtype (LINEAR_PANELS) or row-major [out, in] (LINEAR_GEMV) */
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* [out] or NULL */
    const void *q_norm, *k_norm;                /* [head_dim] each (per head), [H head_dim] and [KV head_dim] (whole), or NULL */
    const void *attn_out_norm, *mlp_out_norm;   /* [hidden]: norms of each branch's output (OLMo 2), or NULL */
    void *k_cache, *v_cache;                    /* this layer's pool (cpu_attention.allocate_kv_cache) */
    int32_t use_rope;                           /* 0: the layer has no RoPE (SmolLM3's NoPE layers) */
    int32_t qk_norm_whole;                      /* 1: q_norm and k_norm span the whole projection (OLMo 2) */
    float softcap;                              /* the layer's attention variants (AttentionArgs): 0: none */
    int64_t window;                             /* 0: none */
    const float *sinks;                         /* [num_heads] fp32, or NULL: none */
    const float *cos, *sin;                     /* this layer's RoPE tables (Gemma 3's local base), or NULL: the step's */
    /* each product's weight type: 0: the step's dense kind (ForwardArgs.linear); else a ggml type
     * code (gguf_gemm.c), the weight being its GGUF blocks [out, row bytes] */
    int32_t qkv_type, o_type, gate_up_type, down_type;
    MixerFn mixer;                              /* NULL: attention; else the layer's mixer, in attention's place */
} LayerArgs;

typedef struct {
    const LayerArgs *layers; /* [num_layers] */
    const void *final_norm;  /* [hidden] */
    void *residual;          /* [num_tokens, hidden]: the embeddings in, the residual stream after */
    void *out;               /* [num_tokens, hidden]: the final-normed hidden states */
    void *x;                 /* [num_tokens, hidden] scratch: normed input of a projection */
    void *qkv;               /* [num_tokens, (num_heads + 2 num_kv_heads) head_dim] scratch */
    void *attended;          /* [num_tokens, num_heads head_dim] scratch */
    void *delta;             /* [num_tokens, hidden] scratch: o_proj, then down_proj output */
    void *gate_up;           /* [num_tokens, 2 intermediate] scratch */
    void *act;               /* [num_tokens, intermediate] scratch */
    const int64_t *positions, *slot_mapping; /* [num_tokens] */
    const float *cos, *sin;  /* rope tables (rayllm_rope) */
    AttentionArgs attention; /* the step's metadata, scale, heads, block geometry and threads; q, out and pools set here */
    int64_t num_tokens, num_layers, hidden, intermediate, rotary_dim; /* rotary_dim: the rotated part of a head */
    float eps;
    int32_t dtype, linear, num_threads;
    int32_t activation;      /* the MLP's: ACTIVATION_SILU or ACTIVATION_GELU_TANH (rayllm_gated_mul) */
    int32_t gguf_mode;       /* GGUF_FP32 or GGUF_INT8: the mode of the GGUF weights' products (gguf_gemm.c) */
    /* steps of at least this many tokens run their products on AMX tiles (amx.c), 0: never
     * (workers/kernels/cpu_isa.py's table): bf16 panels, and GGUF weights in the int8 mode */
    int64_t tile_min_rows_bf16, tile_min_rows_gguf;
    int64_t tile_min_rows_gguf_int8; /* ... and packed Q4_0 / Q4_1 on int8 tiles (gguf_amx.c), below gguf's rows */
    const LoraStep *lora;    /* the step's LoRA adapters (lora.c), added after each product they adapt; NULL: none */
} ForwardArgs;

enum { LORA_QKV = 0, LORA_O = 1, LORA_GATE_UP = 2, LORA_DOWN = 3 }; /* LoraStep's products */

/* linear(), then the step's LoRA adapters' part of the layer's product. */
static int adapted(const ForwardArgs *a, int64_t l, int32_t product, const void *x, const void *w, int32_t type,
                   const void *bias, void *out, int64_t N, int64_t K);

static int takes_tiles(int64_t min_rows, int64_t num_tokens) { return min_rows > 0 && num_tokens >= min_rows; }

/* Whether a GGUF weight of `type` (0: not GGUF) takes this step's products on bf16 tiles. */
static int gguf_on_bf16_tiles(const ForwardArgs *a, int32_t type) {
    return type && a->gguf_mode == GGUF_INT8 && takes_tiles(a->tile_min_rows_gguf, a->num_tokens);
}

/* Whether such a product rounds an fp32 step's x to bf16 before any tile sees it. Its producer (a
 * norm, the gated product) then writes x in bf16 itself: the same bits, half the bytes, and no
 * rounding pass over a copy (amx.c: rayllm_amx_gguf_gemm_rounded_x). Not under LoRA adapters,
 * which read the step's x. */
static int rounds_x_to_bf16(const ForwardArgs *a, int32_t type) {
    return a->dtype == DTYPE_F32 && !a->lora && gguf_on_bf16_tiles(a, type);
}

static int linear(const ForwardArgs *a, const void *x, const void *w, int32_t type, const void *bias, void *out,
                  int64_t N, int64_t K) {
    if (gguf_on_bf16_tiles(a, type))
        return rayllm_amx_gguf_gemm(x, w, bias, out, a->num_tokens, N, K, type, a->dtype, a->dtype, a->num_threads);
    const int q4 = (type & GGUF_PACKED) && ((type & 0xff) == 2 || (type & 0xff) == 3); /* packed Q4_0, Q4_1 */
    if (q4 && a->gguf_mode == GGUF_INT8 && N % 16 == 0 && a->num_tokens <= 512 &&
        takes_tiles(a->tile_min_rows_gguf_int8, a->num_tokens))
        return rayllm_amx_gguf_int8_gemm(x, w, bias, out, a->num_tokens, N, K, type, a->dtype, a->dtype,
                                         a->num_threads);
    if (type)
        return rayllm_gguf_gemm(x, w, bias, out, a->num_tokens, N, K, type, a->dtype, a->dtype, a->gguf_mode,
                                a->num_threads);
    if (a->linear == LINEAR_PANELS && a->dtype == DTYPE_BF16 && K % 32 == 0 &&
        takes_tiles(a->tile_min_rows_bf16, a->num_tokens))
        return rayllm_amx_gemm_bf16(x, w, bias, out, a->num_tokens, N, K, DTYPE_BF16, DTYPE_BF16, a->num_threads);
    if (a->linear == LINEAR_PANELS)
        return a->dtype == DTYPE_F32
                   ? rayllm_panel_gemm(x, w, bias, out, a->num_tokens, N, K, a->num_threads)
                   : rayllm_panel_gemm_bf16(x, w, bias, out, a->num_tokens, N, K, DTYPE_BF16, a->num_threads);
    return rayllm_gemv(x, w, bias, out, a->num_tokens, N, K, a->dtype, a->dtype, a->num_threads);
}

/* act = act(gate) * up of x's gate_up product: in one AMX tile product where the tiles take the
 * step's bf16 panels (amx.c: the same bits as the two steps, the product never written, as
 * workers/model.py's Python loop does it too), else the product into the gate_up scratch, then
 * rayllm_gated_mul. */
static int gated(const ForwardArgs *a, const void *x, const LayerArgs *layer, int64_t l, int64_t inter,
                 int64_t hidden) {
    if (a->lora && rayllm_lora_adapts(a->lora, l, LORA_GATE_UP)) { /* the product itself, then its LoRA */
        int status = adapted(a, l, LORA_GATE_UP, x, layer->gate_up, layer->gate_up_type, layer->gate_up_bias,
                             a->gate_up, 2 * inter, hidden);
        return status ? status
                      : rayllm_gated_mul(a->gate_up, a->act, a->num_tokens, inter, a->activation, 0.0f, 0.0f, a->dtype,
                                         a->num_threads);
    }
    if (gguf_on_bf16_tiles(a, layer->gate_up_type) && inter % 32 == 0)
        return rayllm_amx_gguf_gated_gemm(x, layer->gate_up, layer->gate_up_bias, a->act, a->num_tokens, inter, hidden,
                                          layer->gate_up_type, a->dtype, a->activation, 0.0f, 0.0f, a->num_threads);
    if (!layer->gate_up_type && a->linear == LINEAR_PANELS && a->dtype == DTYPE_BF16 && hidden % 32 == 0 &&
        inter % 16 == 0 && takes_tiles(a->tile_min_rows_bf16, a->num_tokens))
        return rayllm_amx_gated_gemm_bf16(x, layer->gate_up, layer->gate_up_bias, a->act, a->num_tokens, inter, hidden,
                                          a->activation, 0.0f, 0.0f, a->num_threads);
    int status = linear(a, x, layer->gate_up, layer->gate_up_type, layer->gate_up_bias, a->gate_up, 2 * inter, hidden);
    if (!status)
        status = rayllm_gated_mul(a->gate_up, a->act, a->num_tokens, inter, a->activation, 0.0f, 0.0f, a->dtype,
                                  a->num_threads);
    return status;
}

static int adapted(const ForwardArgs *a, int64_t l, int32_t product, const void *x, const void *w, int32_t type,
                   const void *bias, void *out, int64_t N, int64_t K) {
    int status = linear(a, x, w, type, bias, out, N, K);
    if (!status && a->lora) status = rayllm_lora_add(a->lora, l, product, x, out, N, K, a->dtype, a->num_threads);
    return status;
}

/* 0 on success; otherwise 1000 * (layer + 1) + the failing entry point's status (the final norm's
 * status alone). */
int rayllm_decoder_forward(const ForwardArgs *a) {
    const AttentionArgs *meta = &a->attention;
    const int64_t T = a->num_tokens, H = meta->num_heads, KV = meta->num_kv_heads, D = meta->head_dim;
    const int64_t hidden = a->hidden, inter = a->intermediate, qkv_width = (H + 2 * KV) * D;
    const int64_t elem = a->dtype == DTYPE_F32 ? 4 : 2;
    const char *k = (const char *)a->qkv + H * D * elem, *v = (const char *)a->qkv + (H + KV) * D * elem;
    AttentionArgs attention = *meta;
    attention.q = a->qkv;
    attention.q_stride_token = qkv_width;
    attention.q_stride_head = D;
    attention.out = a->attended;
    attention.out_stride_token = H * D;
    attention.out_stride_head = D;
    for (int64_t l = 0; l < a->num_layers; l++) {
        const LayerArgs *layer = a->layers + l;
        attention.k_cache = layer->k_cache;
        attention.v_cache = layer->v_cache;
        attention.window = layer->window;
        attention.softcap = layer->softcap;
        attention.sinks = layer->sinks;
        /* the x that the layer's products read in bf16, written so by their producers (rounds_x_to_bf16) */
        const int qkv_x_bf16 = !layer->mixer && layer->input_norm && rounds_x_to_bf16(a, layer->qkv_type);
        const int mlp_x_bf16 = layer->post_norm && inter % 32 == 0 && rounds_x_to_bf16(a, layer->gate_up_type);
        const int act_bf16 = mlp_x_bf16 && rounds_x_to_bf16(a, layer->down_type);
        const void *x = layer->input_norm ? a->x : a->residual; /* no norm: the branch reads the stream */
        int status = rayllm_add_rms_norm_to(a->residual, l ? a->delta : NULL, layer->input_norm, a->x, T, hidden,
                                            a->eps, a->dtype, qkv_x_bf16 ? DTYPE_BF16 : a->dtype, a->num_threads);
        if (!status && layer->mixer) {
            if (layer->mixer(l, T)) status = 90;
        } else {
            if (!status && qkv_x_bf16)
                status = rayllm_amx_gguf_gemm_rounded_x(a->x, layer->qkv, layer->qkv_bias, a->qkv, T, qkv_width, hidden,
                                                        layer->qkv_type, -1, DTYPE_F32, a->num_threads);
            else if (!status)
                status = adapted(a, l, LORA_QKV, x, layer->qkv, layer->qkv_type, layer->qkv_bias, a->qkv, qkv_width,
                                 hidden);
            if (!status && layer->q_norm)
                status = rayllm_head_rms_norm(a->qkv, layer->q_norm, layer->k_norm, T, H, KV, D, layer->qk_norm_whole,
                                              a->eps, a->dtype, a->num_threads);
            if (!status && layer->use_rope)
                status = rayllm_rope(a->qkv, a->positions, layer->cos ? layer->cos : a->cos,
                                     layer->sin ? layer->sin : a->sin, T, H, KV, D, a->rotary_dim, a->dtype,
                                     a->num_threads);
            if (!status)
                status = rayllm_write_kv(k, v, qkv_width, qkv_width, layer->k_cache, layer->v_cache, meta->block_stride,
                                         a->slot_mapping, T, KV, D, meta->block_size, a->dtype, meta->kv_dtype,
                                         a->num_threads);
            if (!status) status = rayllm_paged_attention(&attention);
            if (!status)
                status = adapted(a, l, LORA_O, a->attended, layer->o, layer->o_type, layer->o_bias, a->delta, hidden,
                                 H * D);
        }
        if (!status && layer->attn_out_norm)
            status = rayllm_add_rms_norm(a->delta, NULL, layer->attn_out_norm, a->delta, T, hidden, a->eps, a->dtype,
                                         a->num_threads);
        x = layer->post_norm ? a->x : a->residual;
        if (!status)
            status = rayllm_add_rms_norm_to(a->residual, a->delta, layer->post_norm, a->x, T, hidden, a->eps, a->dtype,
                                            mlp_x_bf16 ? DTYPE_BF16 : a->dtype, a->num_threads);
        if (!status && mlp_x_bf16)
            status = rayllm_amx_gguf_gemm_rounded_x(a->x, layer->gate_up, layer->gate_up_bias, a->act, T, inter, hidden,
                                                    layer->gate_up_type, a->activation,
                                                    act_bf16 ? DTYPE_BF16 : DTYPE_F32, a->num_threads);
        else if (!status)
            status = gated(a, x, layer, l, inter, hidden);
        if (!status && act_bf16)
            status = rayllm_amx_gguf_gemm_rounded_x(a->act, layer->down, layer->down_bias, a->delta, T, hidden, inter,
                                                    layer->down_type, -1, DTYPE_F32, a->num_threads);
        else if (!status)
            status = adapted(a, l, LORA_DOWN, a->act, layer->down, layer->down_type, layer->down_bias, a->delta, hidden,
                             inter);
        if (!status && layer->mlp_out_norm)
            status = rayllm_add_rms_norm(a->delta, NULL, layer->mlp_out_norm, a->delta, T, hidden, a->eps, a->dtype,
                                         a->num_threads);
        if (status) return (int)(1000 * (l + 1)) + status;
    }
    return rayllm_add_rms_norm(a->residual, a->num_layers ? a->delta : NULL, a->final_norm, a->out, T, hidden, a->eps,
                               a->dtype, a->num_threads);
}

/* LayerArgs' and ForwardArgs' layouts, as rayllm_layout_attention_args gives AttentionArgs'. */
int rayllm_layout_layer_args(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(LayerArgs)
#define FIELD(f) LAYOUT_FIELD(LayerArgs, f)
    FIELD(input_norm) FIELD(post_norm) FIELD(qkv) FIELD(o) FIELD(gate_up) FIELD(down) FIELD(qkv_bias) FIELD(o_bias)
    FIELD(gate_up_bias) FIELD(down_bias) FIELD(q_norm) FIELD(k_norm) FIELD(attn_out_norm) FIELD(mlp_out_norm)
    FIELD(k_cache) FIELD(v_cache) FIELD(use_rope) FIELD(qk_norm_whole) FIELD(softcap) FIELD(window) FIELD(sinks)
    FIELD(cos) FIELD(sin) FIELD(qkv_type) FIELD(o_type) FIELD(gate_up_type) FIELD(down_type) FIELD(mixer)
#undef FIELD
    return n;
}

int rayllm_layout_forward_args(int64_t *offsets, char *names, int64_t capacity) {
    LAYOUT_BEGIN(ForwardArgs)
#define FIELD(f) LAYOUT_FIELD(ForwardArgs, f)
    FIELD(layers) FIELD(final_norm) FIELD(residual) FIELD(out) FIELD(x) FIELD(qkv) FIELD(attended) FIELD(delta)
    FIELD(gate_up) FIELD(act) FIELD(positions) FIELD(slot_mapping) FIELD(cos) FIELD(sin) FIELD(attention)
    FIELD(num_tokens) FIELD(num_layers) FIELD(hidden) FIELD(intermediate) FIELD(rotary_dim) FIELD(eps) FIELD(dtype)
    FIELD(linear) FIELD(num_threads) FIELD(activation) FIELD(gguf_mode) FIELD(tile_min_rows_bf16)
    FIELD(tile_min_rows_gguf) FIELD(tile_min_rows_gguf_int8) FIELD(lora)
#undef FIELD
    return n;
}
