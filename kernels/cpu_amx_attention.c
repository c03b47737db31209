/* Causal attention of a prompt's rows over their keys on Intel AMX (kernels/cpu_amx_attention.py;
 * the rules: cpu-kernels.md §15.9).
 *
 * q [n, hq, d] (row stride q_stride), k and v [ctx, hkv, d] (row strides k_stride, v_stride), out
 * [n, hq, d] (row stride o_stride), all bf16 with the last two dimensions contiguous; query row i sits
 * at position ctx - n + i and sees keys 0 .. ctx - n + i (the bottom-right causal rule of a chunk
 * after its sequence's earlier positions; ctx == n for a fresh prompt). Query head h reads kv head
 * h / (hq / hkv).
 *
 * Once per call each kv head's keys are repacked into the B-tile order of S = Q K^T (1 KB tiles of 16
 * keys by 32 dimensions, the layout cpu_amx.c's weights have) and its values into the B-tile order of
 * O = P V (16 key pairs by 16 dimensions, the pair members side by side). Then for each query head
 * and block of 16 query rows, over the keys its last row sees (rounded up to 32):
 * - S [16, keys] in fp32 by TDPBF16PS (exact bf16 products, fp32 sums), two key tiles at a time;
 * - per row, the max over the keys it sees, p = exp(scale (s - max)) in fp32 (2^x by a degree-4
 *   polynomial: the weight is rounded to bf16 next), its sum, and p rounded to bf16 (0 past the row's
 *   last key): P [16, keys], the A operand of the next product as stored (S and P rows are padded by a
 *   cache line: at a power-of-two stride a tile's 16 rows fall into a few cache sets);
 * - O = P V by TDPBF16PS, 64 output dimensions at a time, divided by the row's sum and rounded once
 *   to bf16.
 * A row's result depends on its own keys only, summed in key order from key 0: the same whichever
 * block, chunk or thread computes it. Blocks run on an OpenMP team (dynamic schedule: a block's work
 * grows with its position), one thread where the file is built without -fopenmp.
 * Returns 0; -1 for shapes it does not take (d % 64, d > 256, hq % hkv, n > ctx) or when memory or
 * the tile registers cannot be had.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

#define TILE 512 /* bf16 values in one 1 KB tile */

int fx_amx_attention_init(void) { return fx_amx_request(); }

/* Keys of one kv head into S's B tiles: [keys/16][d/32][16 dim pairs][16 keys][2]; keys past ctx are 0.
 * Row i of a tile is dim pair i of its 16 keys: one gather of 32-bit pairs. */
static void pack_keys(const uint16_t *k, int64_t k_stride, int64_t ctx, int64_t keys, int64_t d, uint16_t *kt) {
    const int64_t dbs = d / 32;
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(k_stride / 2)));
    for (int64_t kb = 0; kb < keys / 16; kb++) {
        const int64_t left = ctx - kb * 16;
        const __mmask16 live = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
        const int *base = (const int *)(k + kb * 16 * k_stride);
        for (int64_t t = 0; t < dbs; t++) {
            int *tile = (int *)(kt + (kb * dbs + t) * TILE);
            for (int64_t i = 0; i < 16; i++)
                _mm512_storeu_si512(tile + i * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows,
                                                                                base + t * 16 + i, 4));
        }
    }
}

/* Values of one kv head into O's B tiles: [keys/32][d/16][16 key pairs][16 dims][2]; keys past ctx are 0. */
static void pack_values(const uint16_t *v, int64_t v_stride, int64_t ctx, int64_t keys, int64_t d, uint16_t *vp) {
    const int64_t dts = d / 16;
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t kc = 0; kc < keys / 32; kc++)
        for (int64_t i = 0; i < 16; i++) {
            const int64_t k0 = kc * 32 + 2 * i, k1 = k0 + 1;
            for (int64_t dt = 0; dt < dts; dt++) {
                __m512i a = k0 < ctx ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v + k0 * v_stride + dt * 16)))
                                     : _mm512_setzero_si512();
                __m512i b = k1 < ctx ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v + k1 * v_stride + dt * 16)))
                                     : _mm512_setzero_si512();
                _mm512_storeu_si512(vp + ((kc * dts + dt) * 16 + i) * 32, _mm512_permutex2var_epi16(a, interleave, b));
            }
        }
}

/* 2^t for t <= 0 (a softmax weight before its bf16 rounding): 2^n 2^f, n = round(t), 2^f by a degree-4
 * polynomial on |f| <= 1/2 (relative error 3e-6); below -150 it is 0 */
static inline __m512 exp2_weight(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00956051984f), f, _mm512_set1_ps(0.0559171229f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240249817f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693121958f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999919f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    const uint16_t *q;
    uint16_t *o;
    const uint16_t *kt, *vp; /* every kv head's packed keys and values, `keys` keys each */
    int64_t n, ctx, keys, hq, hkv, d, q_stride, o_stride;
    float scale;
} job;

/* One block of up to 16 query rows [i0, i0 + rows) of query head h. Scratch: qa (16 x d bf16), s (16 x
 * keys fp32), p (16 x keys bf16), acc (16 x 64 fp32). */
static void block(const job *jb, int64_t h, int64_t i0, uint16_t *qa, float *s, uint16_t *p, float *acc) {
    const int64_t d = jb->d, dbs = d / 32, start = jb->ctx - jb->n;
    const int64_t rows = jb->n - i0 < 16 ? jb->n - i0 : 16;
    const int64_t g = h / (jb->hq / jb->hkv);
    const int64_t seen = start + i0 + rows, cols = (seen + 31) / 32 * 32; /* keys the last row sees, rounded */
    const int64_t ss = cols + 16, ps = cols + 32;
    const uint16_t *kt = jb->kt + g * jb->keys * d, *vp = jb->vp + g * jb->keys * d;
    fx_pack_rows(jb->q + i0 * jb->q_stride + h * d, jb->q_stride, d, rows, qa);
    /* S = Q K^T over [0, cols) */
    for (int64_t kb = 0; kb < cols / 16; kb += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t t = 0; t < dbs; t++) {
            _tile_loadd(4, qa + t * TILE, 64);
            _tile_loadd(6, kt + (kb * dbs + t) * TILE, 64);
            _tile_loadd(7, kt + ((kb + 1) * dbs + t) * TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, s + kb * 16, ss * 4);
        _tile_stored(1, s + kb * 16 + 16, ss * 4);
    }
    __asm__ volatile("" ::: "memory"); /* GCC's tile-store intrinsics do not tell it s was written */
    /* P = exp(scale (S - rowmax)) over each row's own keys, 0 past them */
    float inv[16];
    const float scale2 = jb->scale * 1.44269504088896341f; /* exp(x) = 2^(x log2 e) */
    const __m512 scale = _mm512_set1_ps(scale2);
    for (int64_t r = 0; r < 16; r++) {
        float *sr = s + r * ss;
        uint16_t *pr = p + r * ps;
        const int64_t own = r < rows ? start + i0 + r + 1 : 0;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t c = 0;
        for (; c + 16 <= own; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c));
        const __mmask16 tail = (__mmask16)((1u << (own - c)) - 1u);
        if (own > c) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, sr + c));
        const __m512 m = _mm512_set1_ps(-_mm512_reduce_max_ps(mx) * scale2);
        __m512 sum = _mm512_setzero_ps();
        for (c = 0; c + 16 <= own; c += 16) {
            __m512 e = exp2_weight(_mm512_fmadd_ps(_mm512_loadu_ps(sr + c), scale, m));
            sum = _mm512_add_ps(sum, e);
            store_bf16(pr + c, e);
        }
        if (own > c) {
            __m512 e = _mm512_maskz_mov_ps(tail, exp2_weight(_mm512_fmadd_ps(_mm512_loadu_ps(sr + c), scale, m)));
            sum = _mm512_add_ps(sum, e);
            store_bf16(pr + c, e);
            c += 16;
        }
        for (; c < cols; c += 16) _mm256_storeu_si256((__m256i *)(pr + c), _mm256_setzero_si256());
        inv[r] = own ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
    }
    /* O = P V, 64 dimensions at a time */
    for (int64_t dg = 0; dg < d / 64; dg++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < cols / 32; kc++) {
            const uint16_t *b = vp + (kc * (d / 16) + dg * 4) * TILE;
            _tile_loadd(4, p + kc * 32, ps * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, b + 2 * TILE, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, b + 3 * TILE, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, acc, 256);
        _tile_stored(1, acc + 16, 256);
        _tile_stored(2, acc + 32, 256);
        _tile_stored(3, acc + 48, 256);
        __asm__ volatile("" ::: "memory");
        for (int64_t r = 0; r < rows; r++) {
            const __m512 w = _mm512_set1_ps(inv[r]);
            uint16_t *orow = jb->o + (i0 + r) * jb->o_stride + h * d + dg * 64;
            for (int c = 0; c < 64; c += 16) store_bf16(orow + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * 64 + c), w));
        }
    }
}

int fx_amx_prefill_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *o, int64_t n,
                             int64_t ctx, int64_t hq, int64_t hkv, int64_t d, int64_t q_stride, int64_t k_stride,
                             int64_t v_stride, int64_t o_stride, float scale, int64_t threads) {
    if (n <= 0 || n > ctx || d % 64 || d > 256 || hkv <= 0 || hq % hkv || threads < 1) return -1;
    const int64_t keys = (ctx + 31) / 32 * 32, blocks = (n + 15) / 16, units = hq * blocks;
    uint16_t *kt = aligned_alloc(64, (size_t)(hkv * keys * d * 2));
    uint16_t *vp = aligned_alloc(64, (size_t)(hkv * keys * d * 2));
    if (kt == NULL || vp == NULL) {
        free(kt);
        free(vp);
        return -1;
    }
    job jb = {q, o, kt, vp, n, ctx, keys, hq, hkv, d, q_stride, o_stride, scale};
    int rc = 0;
    (void)threads;
#pragma omp parallel num_threads((int)threads) reduction(| : rc)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < hkv; g++) {
            pack_keys(k + g * d, k_stride, ctx, keys, d, kt + g * keys * d);
            pack_values(v + g * d, v_stride, ctx, keys, d, vp + g * keys * d);
        }
        uint16_t *qa = aligned_alloc(64, (size_t)(16 * d * 2));
        float *s = aligned_alloc(64, (size_t)(16 * (keys + 16) * 4));
        uint16_t *p = aligned_alloc(64, (size_t)(16 * (keys + 32) * 2));
        float *acc = aligned_alloc(64, 16 * 64 * 4);
        const int ok = qa != NULL && s != NULL && p != NULL && acc != NULL;
        if (!ok) rc |= 1;
        if (ok) fx_tiles_16x64();
        /* the last blocks (most keys) first, so the dynamic schedule ends with small ones */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            const int64_t b = blocks - 1 - u / hq, h = u % hq;
            block(&jb, h, b * 16, qa, s, p, acc);
        }
        if (ok) _tile_release();
        free(qa);
        free(s);
        free(p);
        free(acc);
    }
    free(kt);
    free(vp);
    return rc ? -1 : 0;
}
