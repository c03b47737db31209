/* The elementwise steps of a CPU bf16 forward, each one pass over memory (AVX512 or AVX2 build):
 *
 * fx_rms_norm_bf16: y[r] = bf16(x[r] / sqrt(mean(x[r]^2) + eps) * w) for rows lo .. hi - 1 of
 *   x [rows, d] and fp32 weights w [d] (fp32 arithmetic, one rounding), as ops.rms_norm;
 * fx_silu_mul_bf16: y[i] = bf16(silu(a[i]) * b[i]) for i in lo .. hi - 1 (fp32 arithmetic, one
 *   rounding; PyTorch's two bf16 ops round twice).
 *
 * fx_add_rms_norm_bf16: h_out[r] = bf16(h[r] + delta[r]) (PyTorch's bf16 add), then y[r] its norm as
 *   fx_rms_norm_bf16's (a residual add and the next norm in one pass);
 * fx_silu_mul_rows_bf16: y[r] = bf16(silu(gu[r, :n]) * gu[r, n:]) for rows of a fused gate-up output
 *   gu [rows, 2n] (fx_silu_mul_bf16's arithmetic);
 * fx_qk_norm_rope_bf16: the queries and keys of a fused projection row qkv[r] (q: hq heads of d at
 *   column 0, k: hkv heads at column hq * d), each head normed as fx_rms_norm_bf16 (where its fp32
 *   weights are given), then rotated over its first `rot` dims with bf16 tables cos/sin [rows, rot]
 *   (rotate-half), each product and the sum rounded to bf16 as PyTorch's bf16 ops round, into
 *   q_out [rows, hq, d] and k_out [rows, hkv, d];
 * fx_kv_scatter_bf16: rows src[j] (j where src is NULL) of k and v (row strides ks, vs) copied to
 *   rows dst[j] of the caches kc and vc [., width] (the paged KV write).
 *
 * d % 16 == 0 for the norm (and an even rot <= d for the rotation); the product takes any length. No state, no allocation: threads may
 * call on disjoint ranges. Return 0, or 1 for shapes not taken.
 */
#include <math.h>
#include <string.h>

#include "cpu_simd.h"

#if defined(__AVX512BF16__)

typedef __m512 vf;
#define VW 16
#define VLOAD(p) load_bf16(p)
#define VSTORE(p, v) store_bf16((p), (v))
#define VADD _mm512_add_ps
#define VMUL _mm512_mul_ps
#define VNEG(v) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)))
/* v rounded to bf16 (nearest even) and widened back: a torch bf16 op's result */
#define VROUND(v) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16))

static inline void norm_row(const uint16_t *xr, const float *w, uint16_t *yr, int64_t d, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m512 v = load_bf16(xr + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps);
    __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < d; i += 16)
        store_bf16(yr + i, _mm512_mul_ps(_mm512_mul_ps(load_bf16(xr + i), s), _mm512_loadu_ps(w + i)));
}

/* y[i] = bf16(silu(a[i]) * b[i]) for i < n */
static inline void silu_span(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n) {
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 g = load_bf16(a + i);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16(y + i, _mm512_mul_ps(s, load_bf16(b + i)));
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        __m512 g = load_bf16_masked(a + i, k);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(s, load_bf16_masked(b + i, k)));
        _mm256_mask_storeu_epi16((void *)(y + i), k, (__m256i)o);
    }
}

#else /* AVX2 */

typedef __m256 vf;
#define VW 8
#define VLOAD(p) load8_bf16(p)
#define VSTORE(p, v) store8_bf16((p), (v))
#define VADD _mm256_add_ps
#define VMUL _mm256_mul_ps
#define VNEG(v) _mm256_xor_ps((v), _mm256_set1_ps(-0.0f))
#define VROUND(v) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(pack8_bf16(v)), 16))

static inline void norm_row(const uint16_t *xr, const float *w, uint16_t *yr, int64_t d, float eps) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m256 a = load8_bf16(xr + i), b = load8_bf16(xr + i + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    __m256 s = _mm256_set1_ps(1.0f / sqrtf(hsum256(_mm256_add_ps(s0, s1)) / (float)d + eps));
    for (int64_t i = 0; i < d; i += 8)
        store8_bf16(yr + i, _mm256_mul_ps(_mm256_mul_ps(load8_bf16(xr + i), s), _mm256_loadu_ps(w + i)));
}

static inline __m256 silu_mul8(__m256 g, __m256 b) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(s, b);
}

static inline void silu_span(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8_bf16(y + i, silu_mul8(load8_bf16(a + i), load8_bf16(b + i)));
    if (i < n) store8_bf16_part(y + i, silu_mul8(load8_bf16_part(a + i, n - i), load8_bf16_part(b + i, n - i)), n - i);
}

#endif

/* Both builds, over norm_row, silu_span and the V* lane macros above. */

int fx_rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *y, int64_t d, float eps, int64_t lo,
                     int64_t hi) {
    if (d % 16 != 0 || d <= 0) return 1;
    for (int64_t r = lo; r < hi; r++) norm_row(x + r * d, w, y + r * d, d, eps);
    return 0;
}

int fx_silu_mul_bf16(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t lo, int64_t hi) {
    if (hi > lo) silu_span(a + lo, b + lo, y + lo, hi - lo);
    return 0;
}

int fx_silu_mul_rows_bf16(const uint16_t *gu, uint16_t *y, int64_t n, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) silu_span(gu + r * 2 * n, gu + r * 2 * n + n, y + r * n, n);
    return 0;
}

int fx_add_rms_norm_bf16(const uint16_t *h, const uint16_t *delta, const float *w, uint16_t *h_out, uint16_t *y,
                         int64_t d, float eps, int64_t lo, int64_t hi) {
    if (d % 16 != 0 || d <= 0) return 1;
    for (int64_t r = lo; r < hi; r++) {
        for (int64_t i = 0; i < d; i += VW) VSTORE(h_out + r * d + i, VADD(VLOAD(h + r * d + i), VLOAD(delta + r * d + i)));
        norm_row(h_out + r * d, w, y + r * d, d, eps);
    }
    return 0;
}

/* one head x [d] (bf16) rotated over its first rot dims: x * cos + rotate_half(x) * sin, each step
   rounded to bf16; the dims past rot copied */
static inline void rope_head(const uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t rot, int64_t d,
                             uint16_t *out) {
    const int64_t half = rot / 2;
    int64_t i = 0;
    for (; i + VW <= half; i += VW) {
        vf x1 = VLOAD(x + i), x2 = VLOAD(x + half + i);
        VSTORE(out + i, VADD(VROUND(VMUL(x1, VLOAD(c + i))), VROUND(VMUL(VNEG(x2), VLOAD(s + i)))));
        VSTORE(out + half + i, VADD(VROUND(VMUL(x2, VLOAD(c + half + i))), VROUND(VMUL(x1, VLOAD(s + half + i)))));
    }
    for (; i < half; i++) { /* the same steps, one lane at a time */
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
        out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(c[i]))) +
                             bf16_to_f32(f32_to_bf16(-x2 * bf16_to_f32(s[i]))));
        out[half + i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(c[half + i]))) +
                                    bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(s[half + i]))));
    }
    if (d > rot) memcpy(out + rot, x + rot, (size_t)(d - rot) * sizeof(uint16_t));
}

#define MAX_HEAD_DIM 1024

int fx_qk_norm_rope_bf16(const uint16_t *qkv, int64_t stride, int64_t hq, int64_t hkv, int64_t d, const float *qn,
                         const float *kn, float eps, const uint16_t *cos, const uint16_t *sin, int64_t rot,
                         uint16_t *q_out, uint16_t *k_out, int64_t lo, int64_t hi) {
    if (d % 16 != 0 || d <= 0 || d > MAX_HEAD_DIM || rot % 2 != 0 || rot <= 0 || rot > d) return 1;
    uint16_t tmp[MAX_HEAD_DIM];
    for (int64_t r = lo; r < hi; r++) {
        const uint16_t *c = cos + r * rot, *s = sin + r * rot;
        for (int64_t h = 0; h < hq + hkv; h++) {
            const int is_q = h < hq;
            const uint16_t *x = qkv + r * stride + h * d;
            const float *w = is_q ? qn : kn;
            if (w != NULL) {
                norm_row(x, w, tmp, d, eps);
                x = tmp;
            }
            rope_head(x, c, s, rot, d, is_q ? q_out + (r * hq + h) * d : k_out + (r * hkv + h - hq) * d);
        }
    }
    return 0;
}

int fx_kv_scatter_bf16(const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs, uint16_t *kc, uint16_t *vc,
                       int64_t width, const int64_t *src, const int64_t *dst, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t from = src == NULL ? j : src[j];
        memcpy(kc + dst[j] * width, k + from * ks, (size_t)width * sizeof(uint16_t));
        memcpy(vc + dst[j] * width, v + from * vs, (size_t)width * sizeof(uint16_t));
    }
    return 0;
}

/* Each kernel over [0, n) on `threads` threads (FX_OMP_RANGES, cpu_simd.h): every output computed as
 * one thread computes it, whatever the threads. */
int fx_rms_norm_run(const uint16_t *x, const float *w, uint16_t *y, int64_t d, float eps, int64_t n, int64_t threads) {
    FX_OMP_RANGES(n, threads, 1, fx_rms_norm_bf16(x, w, y, d, eps, lo, hi));
}

int fx_silu_mul_run(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n, int64_t threads) {
    FX_OMP_RANGES(n, threads, 1, fx_silu_mul_bf16(a, b, y, lo, hi));
}

int fx_silu_mul_rows_run(const uint16_t *gu, uint16_t *y, int64_t width, int64_t n, int64_t threads) {
    FX_OMP_RANGES(n, threads, 1, fx_silu_mul_rows_bf16(gu, y, width, lo, hi));
}

int fx_add_rms_norm_run(const uint16_t *h, const uint16_t *delta, const float *w, uint16_t *h_out, uint16_t *y,
                        int64_t d, float eps, int64_t n, int64_t threads) {
    FX_OMP_RANGES(n, threads, 1, fx_add_rms_norm_bf16(h, delta, w, h_out, y, d, eps, lo, hi));
}

int fx_qk_norm_rope_run(const uint16_t *qkv, int64_t stride, int64_t hq, int64_t hkv, int64_t d, const float *qn,
                        const float *kn, float eps, const uint16_t *cos, const uint16_t *sin, int64_t rot,
                        uint16_t *q_out, uint16_t *k_out, int64_t n, int64_t threads) {
    FX_OMP_RANGES(n, threads, 1, fx_qk_norm_rope_bf16(qkv, stride, hq, hkv, d, qn, kn, eps, cos, sin, rot, q_out, k_out, lo, hi));
}
