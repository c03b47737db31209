/* The elementwise steps of a CPU bf16 forward, each one pass over memory (AVX512 or AVX2 build):
 *
 * fx_rms_norm_bf16: y[r] = bf16(x[r] / sqrt(mean(x[r]^2) + eps) * w) for rows lo .. hi - 1 of
 *   x [rows, d] and fp32 weights w [d] (fp32 arithmetic, one rounding), as ops.rms_norm;
 * fx_silu_mul_bf16: y[i] = bf16(silu(a[i]) * b[i]) for i in lo .. hi - 1 (fp32 arithmetic, one
 *   rounding; PyTorch's two bf16 ops round twice).
 *
 * d % 16 == 0 for the norm; the product takes any length. No state, no allocation: threads may
 * call on disjoint ranges. Return 0, or 1 for shapes not taken.
 */
#include <math.h>

#include "cpu_simd.h"

#if defined(__AVX512BF16__)

int fx_rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *y, int64_t d, float eps, int64_t lo,
                     int64_t hi) {
    if (d % 16 != 0 || d <= 0) return 1;
    for (int64_t r = lo; r < hi; r++) {
        const uint16_t *xr = x + r * d;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = load_bf16(xr + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps);
        __m512 s = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < d; i += 16)
            store_bf16(y + r * d + i, _mm512_mul_ps(_mm512_mul_ps(load_bf16(xr + i), s), _mm512_loadu_ps(w + i)));
    }
    return 0;
}

int fx_silu_mul_bf16(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t lo, int64_t hi) {
    int64_t i = lo;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= hi; i += 16) {
        __m512 g = load_bf16(a + i);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16(y + i, _mm512_mul_ps(s, load_bf16(b + i)));
    }
    if (i < hi) {
        __mmask16 k = (__mmask16)((1u << (hi - i)) - 1u);
        __m512 g = load_bf16_masked(a + i, k);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(s, load_bf16_masked(b + i, k)));
        _mm256_mask_storeu_epi16((void *)(y + i), k, (__m256i)o);
    }
    return 0;
}

#else /* AVX2 */

int fx_rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *y, int64_t d, float eps, int64_t lo,
                     int64_t hi) {
    if (d % 16 != 0 || d <= 0) return 1;
    for (int64_t r = lo; r < hi; r++) {
        const uint16_t *xr = x + r * d;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m256 a = load8_bf16(xr + i), b = load8_bf16(xr + i + 8);
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        __m256 s = _mm256_set1_ps(1.0f / sqrtf(hsum256(_mm256_add_ps(s0, s1)) / (float)d + eps));
        for (int64_t i = 0; i < d; i += 8)
            store8_bf16(y + r * d + i, _mm256_mul_ps(_mm256_mul_ps(load8_bf16(xr + i), s), _mm256_loadu_ps(w + i)));
    }
    return 0;
}

static inline __m256 silu_mul8(__m256 g, __m256 b) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(s, b);
}

int fx_silu_mul_bf16(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) store8_bf16(y + i, silu_mul8(load8_bf16(a + i), load8_bf16(b + i)));
    if (i < hi) store8_bf16_part(y + i, silu_mul8(load8_bf16_part(a + i, hi - i), load8_bf16_part(b + i, hi - i)), hi - i);
    return 0;
}

#endif
