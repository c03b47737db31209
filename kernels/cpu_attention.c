/* Attention of single query rows over a paged bf16 KV cache (CPU decode and verify): an AVX512-BF16
 * build (bf16 dot products) and an AVX2 build (the query widened to fp32 once, keys and values
 * widened as they are loaded, FMA), sharing the structure below.
 *
 * Semantics (cpu_attention.py, the torch reference there): query row r (q + q_rows[r] * hq * d)
 * attends the keys at positions 0 .. ctx[r] - 1 of its sequence, whose block table is
 * tables[r * nb ..]; position s lies at cache row tables[r * nb + s / bs] * bs + s % bs, and
 * the cache is [rows, hkv, d]. Query head h reads kv head h / (hq / hkv). Scores q.k * scale and
 * the softmax are fp32 (the products of bf16 are exact in fp32), the output is rounded once to
 * bf16 (round to nearest even), as PyTorch's fused SDPA does.
 *
 * Work is split into units: query row r's kv heads in `splits` parts (unit u is row u / splits,
 * part u % splits); a unit reads its keys and values once, row by row, for every query head that
 * shares them. fx_paged_attention_bf16 computes units lo .. hi - 1, so threads can split one call.
 * Returns 0, or 1 when the shapes do not fit (d % 32, d > MAX_DIM, more than MAX_HEADS query
 * heads), 2 when scratch memory cannot be had.
 *
 * Built with AMX (-mamx-tile -mamx-bf16, on AMX hosts), the AVX512 build takes its scores as tile
 * products where a block is whole tiles of 16 positions and a kv head has at most 16 query heads: the
 * block's keys of one kv head, as stored, are the A operand (16 positions by 32 dims, row stride hkv *
 * d), the unit's query heads the B operand (repacked once per unit), one C tile holds 16 positions'
 * scores for every query head of the kv head. VDPBF16PS's 16 dot products a pass and their transposed
 * sums cost more than reading the keys: at 32 rows over 540 positions a layer took 6.4 ms, 5.1 with
 * the tiles, the speed the cache streams at.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define MAX_HEADS 128
#define MAX_DIM 512

#if defined(__AVX512BF16__)

/* lanes i of the result: the sum of the 16 lanes of a[i] (a transpose-and-add tree: 30 shuffles for
   16 sums, against about 64 for 16 separate horizontal sums) */
static inline __m512 sum16(const __m512 *a) {
    __m512 t[8], u[4], v0, v1;
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

typedef uint16_t qelem_t; /* the query as the score loop reads it: bf16, as stored */
#define SCORE_ROWS 16

static inline void widen_q(const uint16_t *q, qelem_t *dst, int64_t n) { memcpy(dst, q, (size_t)n * sizeof(uint16_t)); }

/* scores of query head qp against up to 16 key rows (rows[i], i < m; the others repeat a valid row
   and are masked off), times scale, stored at dst[0 .. m-1]; returns their maximum */
static inline float scores(const qelem_t *qp, const uint16_t *const *rows, int64_t m, int64_t chunks, float scale,
                             float *dst) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512bh qc = (__m512bh)_mm512_loadu_si512((const void *)(qp + c * 32));
        for (int i = 0; i < 16; i++)
            a[i] = _mm512_dpbf16_ps(a[i], qc, (__m512bh)_mm512_loadu_si512((const void *)(rows[i] + c * 32)));
    }
    __m512 r = _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale));
    __mmask16 k = (__mmask16)(m >= 16 ? 0xFFFFu : ((1u << m) - 1u));
    _mm512_mask_storeu_ps(dst, k, r);
    return _mm512_mask_reduce_max_ps(k, r);
}

/* acc[j][l] += p[j][o] * v[o][l] for o < n rows of values (row o at v + o * stride), JH query heads
   (their weights at p + j * pstride) and NL lanes of 16: the accumulators stay in registers and each
   value lane is widened to fp32 once for all JH heads */
#define PV_KERNEL(JH, NL)                                                                                      \
    static inline void pv_##JH##_##NL(float *acc, int64_t astride, const uint16_t *v, int64_t stride,        \
                                      const float *p, int64_t pstride, int64_t n) {                             \
        __m512 a[JH][NL];                                                                                       \
        for (int j = 0; j < JH; j++)                                                                            \
            for (int l = 0; l < NL; l++) a[j][l] = _mm512_loadu_ps(acc + j * astride + l * 16);                \
        for (int64_t o = 0; o < n; o++) {                                                                       \
            const uint16_t *vr = v + o * stride;                                                                \
            __m512 s[JH];                                                                                       \
            for (int j = 0; j < JH; j++) s[j] = _mm512_set1_ps(p[j * pstride + o]);                             \
            for (int l = 0; l < NL; l++) {                                                                      \
                __m512 x = load_bf16(vr + l * 16);                                                              \
                for (int j = 0; j < JH; j++) a[j][l] = _mm512_fmadd_ps(s[j], x, a[j][l]);                      \
            }                                                                                                   \
        }                                                                                                       \
        for (int j = 0; j < JH; j++)                                                                            \
            for (int l = 0; l < NL; l++) _mm512_storeu_ps(acc + j * astride + l * 16, a[j][l]);                \
    }
PV_KERNEL(2, 8)
PV_KERNEL(1, 8)
PV_KERNEL(2, 2)
PV_KERNEL(1, 2)

/* r[0 .. n-1] = exp(r - mx); returns their sum */
static inline float softmax_row(float *r, int64_t n, float mx) {
    __m512 m = _mm512_set1_ps(mx), tot = _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + 16 <= n; s += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(r + s), m));
        _mm512_storeu_ps(r + s, e);
        tot = _mm512_add_ps(tot, e);
    }
    if (s < n) {
        __mmask16 k = (__mmask16)((1u << (n - s)) - 1u);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + s), m));
        e = _mm512_maskz_mov_ps(k, e);
        _mm512_mask_storeu_ps(r + s, k, e);
        tot = _mm512_add_ps(tot, e);
    }
    return _mm512_reduce_add_ps(tot);
}

/* the weighted values of jh (1 or 2) query heads over n value rows, all d lanes */
static inline void pv_rows(float *a, int64_t d, const uint16_t *v, int64_t stride, const float *p, int64_t pstride,
                           int64_t n, int64_t jh) {
    for (int64_t l = 0, lanes = d / 16; l < lanes;) {
        if (lanes - l >= 8) {
            if (jh == 2) pv_2_8(a + l * 16, d, v + l * 16, stride, p, pstride, n);
            else pv_1_8(a + l * 16, d, v + l * 16, stride, p, pstride, n);
            l += 8;
        } else {
            if (jh == 2) pv_2_2(a + l * 16, d, v + l * 16, stride, p, pstride, n);
            else pv_1_2(a + l * 16, d, v + l * 16, stride, p, pstride, n);
            l += 2;
        }
    }
}

/* out[0 .. d-1] = bf16(acc * inv) */
static inline void store_row(uint16_t *out, const float *acc, int64_t d, float inv) {
    __m512 s = _mm512_set1_ps(inv);
    for (int64_t l = 0; l < d; l += 16) store_bf16(out + l, _mm512_mul_ps(_mm512_loadu_ps(acc + l), s));
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) /* the AMX build: the scores as tile products */
#define FX_AMX_SCORES 1
#include "cpu_amx.h"

int fx_attention_amx_init(void) { return fx_amx_request(); }

/* The B tiles of S^T = K Q^T for `group` query heads (q: their rows of d, one after another):
   [d / 32][16 dim pairs][16 heads][2], heads past `group` zero. */
static void query_tiles(const uint16_t *q, int64_t group, int64_t d, uint16_t *qt) {
    memset(qt, 0, (size_t)(d / 32) * 1024);
    const uint32_t *pairs = (const uint32_t *)q;
    uint32_t *t = (uint32_t *)qt;
    for (int64_t j = 0; j < group; j++)
        for (int64_t i = 0; i < d / 2; i++) t[i * 16 + j] = pairs[j * (d / 2) + i];
}

/* Scores of the `group` query heads of qt against the key rows k[0 .. m - 1] (m <= 16, row stride
   `row`; the tile reads 16 rows, the block's own, and the rows past m are left out), times scale,
   into sc[j * ctx + i]; mx[j] raised to their maximum. One C tile: 16 positions by 16 heads. */
static inline void amx_scores(const uint16_t *k, int64_t row, const uint16_t *qt, int64_t d, int64_t group,
                              int64_t m, float scale, float *sc, int64_t ctx, float *mx, float *tmp) {
    _tile_zero(0);
    for (int64_t c = 0; c < d / 32; c++) {
        _tile_loadd(4, k + c * 32, row * 2);
        _tile_loadd(6, qt + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, tmp, 64);
    __asm__ volatile("" ::: "memory"); /* GCC's tile-store intrinsics do not tell it tmp was written */
    const __mmask16 live = (__mmask16)(m >= 16 ? 0xFFFFu : ((1u << m) - 1u));
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < group; j++) {
        __m512 r = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, column, tmp + j, 4), sv);
        _mm512_mask_storeu_ps(sc + j * ctx, live, r);
        const float v = _mm512_mask_reduce_max_ps(live, r);
        if (v > mx[j]) mx[j] = v;
    }
}
#endif

#else /* AVX2 */

typedef float qelem_t; /* the query widened to fp32 once per unit */
#define SCORE_ROWS 8

static inline void widen_q(const uint16_t *q, qelem_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, load8_bf16(q + i));
}

/* lane i: the sum of the 8 lanes of a[i] */
static inline __m256 sum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves), likewise u1 for 4..7 */
    __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* scores of query head qp (fp32) against up to 8 key rows (rows[i], i < m; the others repeat a
   valid row and are dropped), times scale, stored at dst[0 .. m-1]; returns their maximum */
static inline float scores(const qelem_t *qp, const uint16_t *const *rows, int64_t m, int64_t chunks, float scale,
                           float *dst) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks * 4; c++) {
        __m256 qc = _mm256_loadu_ps(qp + c * 8);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qc, load8_bf16(rows[i] + c * 8), a[i]);
    }
    float r[8];
    _mm256_storeu_ps(r, _mm256_mul_ps(sum8(a), _mm256_set1_ps(scale)));
    float mx = r[0];
    for (int64_t i = 0; i < m; i++) {
        dst[i] = r[i];
        if (r[i] > mx) mx = r[i];
    }
    return mx;
}

/* acc[j][l] += p[j][o] * v[o][l]: JH query heads, NL lanes of 8 (see the AVX512 build) */
#define PV_KERNEL(JH, NL)                                                                                      \
    static inline void pv_##JH##_##NL(float *acc, int64_t astride, const uint16_t *v, int64_t stride,        \
                                      const float *p, int64_t pstride, int64_t n) {                             \
        __m256 a[JH][NL];                                                                                       \
        for (int j = 0; j < JH; j++)                                                                            \
            for (int l = 0; l < NL; l++) a[j][l] = _mm256_loadu_ps(acc + j * astride + l * 8);                 \
        for (int64_t o = 0; o < n; o++) {                                                                       \
            const uint16_t *vr = v + o * stride;                                                                \
            __m256 s[JH];                                                                                       \
            for (int j = 0; j < JH; j++) s[j] = _mm256_set1_ps(p[j * pstride + o]);                             \
            for (int l = 0; l < NL; l++) {                                                                      \
                __m256 x = load8_bf16(vr + l * 8);                                                              \
                for (int j = 0; j < JH; j++) a[j][l] = _mm256_fmadd_ps(s[j], x, a[j][l]);                      \
            }                                                                                                   \
        }                                                                                                       \
        for (int j = 0; j < JH; j++)                                                                            \
            for (int l = 0; l < NL; l++) _mm256_storeu_ps(acc + j * astride + l * 8, a[j][l]);                 \
    }
PV_KERNEL(2, 4)
PV_KERNEL(1, 4)

static inline float softmax_row(float *r, int64_t n, float mx) {
    __m256 m = _mm256_set1_ps(mx), tot = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(r + s), m));
        _mm256_storeu_ps(r + s, e);
        tot = _mm256_add_ps(tot, e);
    }
    float sum = hsum256(tot);
    if (s < n) {
        float t[8];
        for (int i = 0; i < 8; i++) t[i] = s + i < n ? r[s + i] : mx;
        _mm256_storeu_ps(t, exp256(_mm256_sub_ps(_mm256_loadu_ps(t), m)));
        for (int64_t i = 0; s + i < n; i++) {
            r[s + i] = t[i];
            sum += t[i];
        }
    }
    return sum;
}

static inline void pv_rows(float *a, int64_t d, const uint16_t *v, int64_t stride, const float *p, int64_t pstride,
                           int64_t n, int64_t jh) {
    for (int64_t l = 0; l < d; l += 32) {
        if (jh == 2) pv_2_4(a + l, d, v + l, stride, p, pstride, n);
        else pv_1_4(a + l, d, v + l, stride, p, pstride, n);
    }
}

static inline void store_row(uint16_t *out, const float *acc, int64_t d, float inv) {
    __m256 s = _mm256_set1_ps(inv);
    for (int64_t l = 0; l < d; l += 8) store8_bf16(out + l, _mm256_mul_ps(_mm256_loadu_ps(acc + l), s));
}

#endif

/* the n rows (stride `stride`) of d bf16 values at p, asked into L1 ahead of their use: a block's
   rows are read one kv head at a time, a strided pattern the hardware prefetchers do not follow */
static inline void prefetch_rows(const uint16_t *p, int64_t n, int64_t stride, int64_t d) {
    for (int64_t o = 0; o < n; o++)
        for (int64_t e = 0; e < d; e += 32) _mm_prefetch((const char *)(p + o * stride + e), _MM_HINT_T0);
}

/* One unit: query row qrow, kv heads g0 .. g1 - 1 and their query heads. A block's keys (values)
   are read for one kv head at a time, SCORE_ROWS rows per pass; a block of a few tens of KB stays in
   L1 while its kv heads are taken in turn. */
static void unit(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, uint16_t *out, int64_t qrow,
                 int64_t ctx, const int32_t *table, int64_t bs, int64_t hq, int64_t hkv, int64_t d,
                 float scale, int64_t g0, int64_t g1, float *sc, float *accf, qelem_t *qw, uint16_t *qt) {
    const int64_t group = hq / hkv, chunks = d / 32, heads = (g1 - g0) * group;
    const int64_t row = hkv * d;
    if (qt == NULL) widen_q(q + (qrow * hq + g0 * group) * d, qw, heads * d); /* (the tiles read q itself) */
    float mx[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) mx[h] = -3.0e38f;
#ifdef FX_AMX_SCORES
    float tmp[256];
    if (qt != NULL) /* the query heads of each kv head as B tiles, once per unit */
        for (int64_t g = g0; g < g1; g++)
            query_tiles(q + (qrow * hq + g * group) * d, group, d, qt + (g - g0) * chunks * 512);
#else
    (void)qt;
#endif
    /* scores, block by block, SCORE_ROWS positions at a time */
    for (int64_t s0 = 0, blk = 0; s0 < ctx; s0 += bs, blk++) {
        const uint16_t *kb = kc + (int64_t)table[blk] * bs * row;
        int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
        const uint16_t *kn = s0 + bs < ctx ? kc + (int64_t)table[blk + 1] * bs * row : NULL;
        int64_t nn = ctx - s0 - bs < bs ? ctx - s0 - bs : bs;
        for (int64_t g = g0; g < g1; g++) {
            if (kn != NULL) prefetch_rows(kn + g * d, nn, row, d);
#ifdef FX_AMX_SCORES
            if (qt != NULL) { /* bs % 16 == 0: each tile's 16 rows are the block's own */
                const int64_t h0 = (g - g0) * group;
                for (int64_t o0 = 0; o0 < n; o0 += 16)
                    amx_scores(kb + o0 * row + g * d, row, qt + (g - g0) * chunks * 512, d, group,
                               n - o0 < 16 ? n - o0 : 16, scale, sc + h0 * ctx + s0 + o0, ctx, mx + h0, tmp);
                continue;
            }
#endif
            for (int64_t o0 = 0; o0 < n; o0 += SCORE_ROWS) {
                int64_t m = n - o0 < SCORE_ROWS ? n - o0 : SCORE_ROWS;
                const uint16_t *rows[SCORE_ROWS];
                for (int i = 0; i < SCORE_ROWS; i++) rows[i] = kb + (o0 + (i < m ? i : 0)) * row + g * d;
                for (int64_t j = 0; j < group; j++) {
                    int64_t h = (g - g0) * group + j;
                    float v = scores(qw + h * d, rows, m, chunks, scale, sc + h * ctx + s0 + o0);
                    if (v > mx[h]) mx[h] = v;
                }
            }
        }
    }
    /* softmax numerators and sums */
    float sum[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) sum[h] = softmax_row(sc + h * ctx, ctx, mx[h]);
    /* weighted values, accumulated in fp32 */
    memset(accf, 0, sizeof(float) * (size_t)(heads * d));
    for (int64_t s0 = 0, blk = 0; s0 < ctx; s0 += bs, blk++) {
        const uint16_t *vb = vc + (int64_t)table[blk] * bs * row;
        int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
        const uint16_t *vn = s0 + bs < ctx ? vc + (int64_t)table[blk + 1] * bs * row : NULL;
        int64_t nn = ctx - s0 - bs < bs ? ctx - s0 - bs : bs;
        for (int64_t g = g0; g < g1; g++) {
            if (vn != NULL) prefetch_rows(vn + g * d, nn, row, d);
            for (int64_t j = 0; j < group;) {
                int64_t h = (g - g0) * group + j, jh = group - j >= 2 ? 2 : 1;
                pv_rows(accf + h * d, d, vb + g * d, row, sc + h * ctx + s0, ctx, n, jh);
                j += jh;
            }
        }
    }
    for (int64_t h = 0; h < heads; h++)
        store_row(out + (qrow * hq + g0 * group + h) * d, accf + h * d, d, 1.0f / sum[h]);
}

int fx_paged_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, uint16_t *out,
                            const int32_t *q_rows, const int32_t *ctx, const int32_t *tables, int64_t nb,
                            int64_t bs, int64_t hq, int64_t hkv, int64_t d, float scale, int64_t splits,
                            int64_t lo, int64_t hi) {
    if (d % 32 != 0 || d > MAX_DIM || hkv <= 0 || hq % hkv != 0 || hq > MAX_HEADS || splits < 1 || splits > hkv)
        return 1;
    int64_t longest = 1;
    for (int64_t u = lo; u < hi; u++) {
        int64_t c = ctx[u / splits];
        if (c > longest) longest = c;
    }
    float *sc = (float *)malloc(sizeof(float) * (size_t)(hq * longest + hq * d) + sizeof(qelem_t) * (size_t)(hq * d));
    if (sc == NULL) return 2;
    float *accf = sc + hq * longest;
    qelem_t *qw = (qelem_t *)(accf + hq * d);
    uint16_t *qt = NULL;
#ifdef FX_AMX_SCORES
    /* the scores on AMX where a block is whole tiles of 16 positions and a kv head's query heads fit
       one tile's 16 columns */
    if (bs % 16 == 0 && hq / hkv <= 16) {
        qt = (uint16_t *)aligned_alloc(64, (size_t)hkv * (size_t)(d / 32) * 1024);
        if (qt == NULL) {
            free(sc);
            return 2;
        }
        fx_tiles_16x64();
    }
#endif
    for (int64_t u = lo; u < hi; u++) {
        int64_t r = u / splits, part = u % splits;
        int64_t g0 = hkv * part / splits, g1 = hkv * (part + 1) / splits;
        unit(q, kc, vc, out, q_rows[r], ctx[r], tables + r * nb, bs, hq, hkv, d, scale, g0, g1, sc, accf, qw, qt);
    }
#ifdef FX_AMX_SCORES
    if (qt != NULL) {
        _tile_release();
        free(qt);
    }
#endif
    free(sc);
    return 0;
}

/* Units [0, units) on `threads` threads (OpenMP, the runtime the packed products' teams use, where
 * this file is built with -fopenmp; one thread otherwise), each a contiguous run of units: a row's
 * result does not depend on the threads. One team per call: a Python pool beside OpenMP's spinning
 * workers would wait for a core they hold. */
int fx_paged_attention_run(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, uint16_t *out,
                           const int32_t *q_rows, const int32_t *ctx, const int32_t *tables, int64_t nb, int64_t bs,
                           int64_t hq, int64_t hkv, int64_t d, float scale, int64_t splits, int64_t units,
                           int64_t threads) {
    if (threads < 1) return 1;
    if (threads > units) threads = units;
    int rc = 0;
#pragma omp parallel for num_threads((int)threads) schedule(static, 1) reduction(| : rc)
    for (int64_t t = 0; t < threads; ++t) {
        const int64_t lo = units * t / threads, hi = units * (t + 1) / threads;
        if (lo < hi) rc |= fx_paged_attention_bf16(q, kc, vc, out, q_rows, ctx, tables, nb, bs, hq, hkv, d, scale, splits, lo, hi);
    }
    return rc;
}
