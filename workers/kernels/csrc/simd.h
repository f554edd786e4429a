/* Shared by the kernels: dtype codes, bf16 <-> fp32, element access and a vectorised exp
 * (AVX-512 where the CPU has it, else AVX2 + FMA: 8 lanes, e.g. Zen 2/3 and Intel before Ice Lake). */
#ifndef RAYLLM_SIMD_H
#define RAYLLM_SIMD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define RAYLLM_HAS_AVX2 1 /* the 8-lane helpers below: on AVX-512 CPUs too (the sampler runs 8 lanes on both) */
#if !defined(__AVX512F__)
#define RAYLLM_AVX2 1 /* the 8-lane paths of the other kernels: compiled only where AVX-512 is not */
#endif
#endif

/* p = 2^f for f in [-0.5, 0.5] (degree 6), in either vector width: W is _mm512 or _mm256. */
#define EXP2_POLYNOMIAL(W, p, f)                                    \
    do {                                                            \
        p = W##_set1_ps(1.535336188319500e-4f);                     \
        p = W##_fmadd_ps(p, f, W##_set1_ps(1.339887440266574e-3f)); \
        p = W##_fmadd_ps(p, f, W##_set1_ps(9.618437357674640e-3f)); \
        p = W##_fmadd_ps(p, f, W##_set1_ps(5.550332471162809e-2f)); \
        p = W##_fmadd_ps(p, f, W##_set1_ps(2.402264791363012e-1f)); \
        p = W##_fmadd_ps(p, f, W##_set1_ps(6.931472028550421e-1f)); \
        p = W##_fmadd_ps(p, f, W##_set1_ps(1.0f));                  \
    } while (0)

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* IEEE half -> fp32, exact (F16C's vcvtph2ps where the CPU has it). */
static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        const float f = (float)mantissa * (1.0f / 16777216.0f); /* subnormal: mantissa * 2^-24 */
        return sign ? -f : f;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* fp32 -> IEEE half, rounded to nearest even; past 65504 it is inf, as F16C's vcvtps2ph gives. */
static inline uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u; /* rounds past 65504: inf */
    if (magnitude < 0x38800000u) {                        /* below 2^-14: a subnormal half (or 0) */
        float scaled;
        memcpy(&scaled, &magnitude, sizeof scaled);
        return sign | (uint16_t)__builtin_lrintf(scaled * 16777216.0f); /* units of 2^-24, ties to even */
    }
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u); /* nearest even at bit 13 */
    return sign | (uint16_t)((rounded - 0x38000000u) >> 13);
#endif
}

#define GELU_K2 1.5957691216057308f /* 2 sqrt(2 / pi): GELU's tanh form as a sigmoid (layer_ops.c) */
#define GELU_C 0.044715f

/* The dtype codes every entry point takes. DTYPE_F16 is a KV pool's only (fp32 queries over a
 * half pool, paged_attention.c); no other entry point takes it. */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

/* Element i of a tensor of any of those dtypes, as fp32, and back (bf16: rounded to nearest even). */
static inline float load_element(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F16) return f16_to_f32(((const uint16_t *)base)[i]);
    return dtype == DTYPE_F32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

static inline void store_element(void *base, int64_t i, float value, int dtype) {
    if (dtype == DTYPE_F32)
        ((float *)base)[i] = value;
    else
        ((uint16_t *)base)[i] = dtype == DTYPE_F16 ? f32_to_f16(value) : f32_to_bf16(value);
}

#ifdef __AVX512F__
/* e^x, relative error ~2e-7 for x in [-87, 88]: 2^(x log2 e) split into 2^n * 2^f with f in
 * [-0.5, 0.5], a degree-6 polynomial for 2^f, scalef for 2^n. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p;
    EXP2_POLYNOMIAL(_mm512, p, f);
    return _mm512_scalef_ps(p, n);
}

/* tanh x = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)), in [-1, 1] for every x (no overflow);
 * absolute error ~3e-7 (exp_ps's, near x = 0, where tanh x is x). */
static inline __m512 tanh_ps(__m512 x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_andnot_si512(sign, bits));
    const __m512 e = exp_ps(_mm512_mul_ps(magnitude, _mm512_set1_ps(-2.0f)));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(sign, bits)));
}

/* 16 elements at p (fp32, or bf16 widened exactly), and back (bf16: rounded to nearest even). */
static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 fp32 -> 16 bf16, rounded to nearest even: vcvtneps2bf16 where the CPU has AVX512_BF16, else
 * the same rounding in integer arithmetic (Skylake-SP, Cascade Lake, Ice Lake: AVX-512 without it). */
static inline __m256i cvt16_bf16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
#endif
}

static inline __m512 round_bf16(__m512 x) { /* the fp32 value of x rounded to bf16 */
    const __m256i h = cvt16_bf16(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store16(void *p, __m512 x, int bf16) {
    if (!bf16)
        _mm512_storeu_ps(p, x);
    else
        _mm256_storeu_si256((__m256i *)p, cvt16_bf16(x));
}

/* act(g) * u of 16 gates and ups (rayllm_gated_mul's activation codes: SiLU, GELU's tanh form as
 * g sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), or gpt-oss's clamped SwiGLU with alpha and limit).
 * One body for layer_ops.c's rayllm_gated_mul and amx.c's gated products: the same bits. */
static inline __m512 gated16(__m512 g, __m512 u, int activation, float alpha, float limit) {
    __m512 z = g;
    if (activation == 1) /* ACTIVATION_GELU_TANH */
        z = _mm512_mul_ps(_mm512_set1_ps(GELU_K2),
                          _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(GELU_C), g), _mm512_mul_ps(g, g), g));
    if (activation == 2) { /* ACTIVATION_SWIGLU_OAI */
        g = _mm512_min_ps(g, _mm512_set1_ps(limit));
        u = _mm512_max_ps(_mm512_min_ps(u, _mm512_set1_ps(limit)), _mm512_set1_ps(-limit));
        u = _mm512_add_ps(u, _mm512_set1_ps(1.0f));
        z = _mm512_mul_ps(_mm512_set1_ps(alpha), g);
    }
    const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), z))));
    return _mm512_mul_ps(act, u);
}
#endif
#ifdef RAYLLM_HAS_AVX2
/* exp_ps in 8 lanes: the same polynomial; 2^n built in the exponent bits (n in [-126, 127]). */
static inline __m256 exp8_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p;
    EXP2_POLYNOMIAL(_mm256, p, f);
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* tanh_ps in 8 lanes. */
static inline __m256 tanh8_ps(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 magnitude = _mm256_andnot_ps(sign, x);
    const __m256 e = exp8_ps(_mm256_mul_ps(magnitude, _mm256_set1_ps(-2.0f)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_or_ps(t, _mm256_and_ps(sign, x));
}

/* 8 elements at p (fp32, or bf16 widened exactly), and back (bf16: rounded to nearest even,
 * as f32_to_bf16 does). */
static inline __m256 load8(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps(p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 round8_bf16(__m256 x) { /* the fp32 value of x rounded to bf16 */
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void store8(void *p, __m256 x, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps(p, x);
        return;
    }
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round8_bf16(x)), 16); /* 8 x 16 bits, in 32 */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A lane mask for _mm256_maskload_ps: lanes [0, count) on (count clamped to [0, 8]). */
static inline __m256i first_lanes8(int64_t count) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count < 0 ? 0 : count > 8 ? 8 : count)), index);
}
#endif
#endif
