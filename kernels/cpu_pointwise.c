/* The elementwise steps of a CPU bf16 forward, each one pass over memory (AVX512):
 *
 * fx_rms_norm_bf16: y[r] = bf16(x[r] / sqrt(mean(x[r]^2) + eps) * w) for rows lo .. hi - 1 of
 *   x [rows, d] and fp32 weights w [d] (fp32 arithmetic, one rounding), as ops.rms_norm;
 * fx_silu_mul_bf16: y[i] = bf16(silu(a[i]) * b[i]) for i in lo .. hi - 1 (fp32 arithmetic, one
 *   rounding; PyTorch's two bf16 ops round twice).
 *
 * d % 16 == 0 for the norm; the product takes any length. No state, no allocation: threads may
 * call on disjoint ranges. Return 0, or 1 for shapes not taken.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load_bf16_masked(const uint16_t *p, __mmask16 k) {
    __m256i h = _mm256_maskz_loadu_epi16(k, (const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 exp512(__m512 x) {
    /* e^x = 2^n 2^f, |f| <= 1/2, 2^f by a degree-6 polynomial (relative error about 2e-7) */
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
