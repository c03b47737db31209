/* SIMD helpers shared by the CPU kernels (AVX512F/BW/VL, AVX512-BF16): bf16 <-> fp32 lanes and
 * a vector exp. Header-only; _cpu.py hashes it with each kernel's source, so an edit recompiles. */
#ifndef FXSCHED_CPU_SIMD_H
#define FXSCHED_CPU_SIMD_H
#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 values as fp32 lanes (exact: a bf16 is the top half of an fp32) */
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load_bf16_masked(const uint16_t *p, __mmask16 k) {
    __m256i h = _mm256_maskz_loadu_epi16(k, (const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 fp32 lanes rounded to bf16 (nearest even) */
static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 exp512(__m512 x) {
    /* e^x = 2^n 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by a degree-6 polynomial (relative error
       about 2e-7); x clamped to [-87, 88] */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180573e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503393e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
