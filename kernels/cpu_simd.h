/* SIMD helpers shared by the CPU kernels: bf16 <-> fp32 lanes and a vector exp, in 16 lanes for
 * the AVX512 build (AVX512F/BW/VL, AVX512-BF16) and in 8 lanes for the AVX2 build (AVX2, FMA);
 * the scalar bf16 conversions for both. Header-only; _cpu.py hashes it with each kernel's source,
 * so an edit recompiles. */
#ifndef FXSCHED_CPU_SIMD_H
#define FXSCHED_CPU_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* `call` (an int expression of lo and hi, 0 on success) over [0, n) in at most `threads` contiguous
 * ranges, each a multiple of `align` long but the last, on one OpenMP team (one thread where the file
 * is built without -fopenmp); returns the ranges' codes or-ed. The kernels' threads are all OpenMP
 * teams: a Python pool beside them would wait on cores their workers spin on after their work. */
#define FX_OMP_RANGES(n, threads, align, call)                                                         \
    do {                                                                                               \
        const int64_t units_ = ((n) + (align) - 1) / (align);                                          \
        const int64_t team_ = (threads) < units_ ? (threads) : units_;                                 \
        int rc_ = 0;                                                                                   \
        _Pragma("omp parallel for num_threads((int)team_) schedule(static, 1) reduction(| : rc_)")      \
        for (int64_t t_ = 0; t_ < team_; ++t_) {                                                       \
            const int64_t lo = units_ * t_ / team_ * (align);                                          \
            const int64_t hi_ = units_ * (t_ + 1) / team_ * (align), hi = hi_ < (n) ? hi_ : (n);       \
            if (lo < hi) rc_ |= (call);                                                                \
        }                                                                                              \
        return rc_;                                                                                    \
    } while (0)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 rounded to bf16, nearest even (a NaN stays a quiet NaN) */
static inline uint16_t f32_to_bf16(float s) {
    uint32_t u;
    memcpy(&u, &s, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* the 2^n e^f polynomial of exp512 / exp256: coefficients of 2^f for |f| <= 1/2 */
#define EXP_C6 1.5353362e-4f
#define EXP_C5 1.3398874e-3f
#define EXP_C4 9.6180573e-3f
#define EXP_C3 5.5503393e-2f
#define EXP_C2 2.4022652e-1f
#define EXP_C1 6.9314718e-1f

#if defined(__AVX512BF16__)

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
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#else /* AVX2 + FMA: 8 lanes */

/* 8 bf16 values as fp32 lanes (exact) */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the first n (< 8) of 8 bf16 values, the other lanes zero */
static inline __m256 load8_bf16_part(const uint16_t *p, int64_t n) {
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(uint16_t));
    return load8_bf16(tmp);
}

/* 8 fp32 lanes rounded to bf16 (nearest even; a NaN stays a quiet NaN) as 8 16-bit values */
static inline __m128i pack8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, q, nan);
    /* 32-bit lanes hold values < 2^16: pack within each 128-bit half, then join the halves */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

static inline void store8_bf16(uint16_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, pack8_bf16(v)); }

/* the first n (< 8) lanes of v, rounded to bf16, stored at p[0 .. n-1] */
static inline void store8_bf16_part(uint16_t *p, __m256 v, int64_t n) {
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i *)tmp, pack8_bf16(v));
    memcpy(p, tmp, (size_t)n * sizeof(uint16_t));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 exp256(__m256 x) {
    /* exp512's method; 2^n is built in the exponent field (n in [-126, 127] after the clamp) */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
#endif
