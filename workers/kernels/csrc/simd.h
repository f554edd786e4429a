/* Shared by the kernels: dtype codes, bf16 <-> fp32, element access and a vectorised exp
 * (AVX-512 where the CPU has it). */
#ifndef RAYLLM_SIMD_H
#define RAYLLM_SIMD_H
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 }; /* the dtype codes every entry point takes */

/* Element i of a tensor of either dtype, as fp32, and back (bf16: rounded to nearest even). */
static inline float load_element(const void *base, int64_t i, int dtype) {
    return dtype == DTYPE_F32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

static inline void store_element(void *base, int64_t i, float value, int dtype) {
    if (dtype == DTYPE_F32)
        ((float *)base)[i] = value;
    else
        ((uint16_t *)base)[i] = f32_to_bf16(value);
}

#ifdef __AVX512F__
/* e^x, relative error ~2e-7 for x in [-87, 88]: 2^(x log2 e) split into 2^n * 2^f with f in
 * [-0.5, 0.5], a degree-6 polynomial for 2^f, scalef for 2^n. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 elements at p (fp32, or bf16 widened exactly), and back (bf16: rounded to nearest even). */
static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16(__m512 x) { /* the fp32 value of x rounded to bf16 */
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store16(void *p, __m512 x, int bf16) {
    if (!bf16)
        _mm512_storeu_ps(p, x);
    else
        _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}
#endif
#endif
