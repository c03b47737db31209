/* Attention of single query rows over a paged bf16 KV cache (CPU decode and verify), AVX512-BF16.
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
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define MAX_HEADS 128
#define MAX_DIM 512

/* One unit: query row qrow, kv heads g0 .. g1 - 1 and their query heads. Keys and values are read
   row by row (a cache row holds every kv head of a position contiguously), so the reads stream. */
static void unit(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, uint16_t *out, int64_t qrow,
                 int64_t ctx, const int32_t *table, int64_t bs, int64_t hq, int64_t hkv, int64_t d,
                 float scale, int64_t g0, int64_t g1, float *sc, float *accf) {
    const int64_t group = hq / hkv, chunks = d / 32, lanes = d / 16, heads = (g1 - g0) * group;
    const uint16_t *qbase = q + (qrow * hq + g0 * group) * d;
    float mx[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) mx[h] = -3.0e38f;
    /* scores, block by block */
    for (int64_t s0 = 0, blk = 0; s0 < ctx; s0 += bs, blk++) {
        const uint16_t *kb = kc + (int64_t)table[blk] * bs * hkv * d;
        int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
        for (int64_t o = 0; o < n; o++) {
            const uint16_t *kp = kb + o * hkv * d;
            for (int64_t g = g0; g < g1; g++) {
                __m512bh kv[MAX_DIM / 32];
                for (int64_t c = 0; c < chunks; c++)
                    kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(kp + g * d + c * 32));
                for (int64_t j = 0; j < group; j++) {
                    int64_t h = (g - g0) * group + j;
                    const uint16_t *qp = qbase + h * d;
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t c = 0; c < chunks; c++)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(qp + c * 32)), kv[c]);
                    float v = _mm512_reduce_add_ps(acc) * scale;
                    sc[h * ctx + s0 + o] = v;
                    if (v > mx[h]) mx[h] = v;
                }
            }
        }
    }
    /* softmax numerators and sums */
    float sum[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) {
        float *row = sc + h * ctx;
        __m512 m = _mm512_set1_ps(mx[h]), tot = _mm512_setzero_ps();
        int64_t s = 0;
        for (; s + 16 <= ctx; s += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + s), m));
            _mm512_storeu_ps(row + s, e);
            tot = _mm512_add_ps(tot, e);
        }
        if (s < ctx) {
            __mmask16 k = (__mmask16)((1u << (ctx - s)) - 1u);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + s), m));
            e = _mm512_maskz_mov_ps(k, e);
            _mm512_mask_storeu_ps(row + s, k, e);
            tot = _mm512_add_ps(tot, e);
        }
        sum[h] = _mm512_reduce_add_ps(tot);
    }
    /* weighted values, accumulated in fp32 (L1-resident) */
    memset(accf, 0, sizeof(float) * (size_t)(heads * d));
    for (int64_t s0 = 0, blk = 0; s0 < ctx; s0 += bs, blk++) {
        const uint16_t *vb = vc + (int64_t)table[blk] * bs * hkv * d;
        int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
        for (int64_t o = 0; o < n; o++) {
            const uint16_t *vp = vb + o * hkv * d;
            for (int64_t g = g0; g < g1; g++) {
                for (int64_t l = 0; l < lanes; l++) {
                    __m512 v = load_bf16(vp + g * d + l * 16);
                    for (int64_t j = 0; j < group; j++) {
                        int64_t h = (g - g0) * group + j;
                        float *a = accf + h * d + l * 16;
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(sc[h * ctx + s0 + o]), v, _mm512_loadu_ps(a)));
                    }
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        __m512 inv = _mm512_set1_ps(1.0f / sum[h]);
        uint16_t *op = out + (qrow * hq + g0 * group + h) * d;
        for (int64_t l = 0; l < lanes; l++) {
            store_bf16(op + l * 16, _mm512_mul_ps(_mm512_loadu_ps(accf + h * d + l * 16), inv));
        }
    }
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
    float *sc = (float *)malloc(sizeof(float) * (size_t)(hq * longest + hq * d));
    if (sc == NULL) return 2;
    float *accf = sc + hq * longest;
    for (int64_t u = lo; u < hi; u++) {
        int64_t r = u / splits, part = u % splits;
        int64_t g0 = hkv * part / splits, g1 = hkv * (part + 1) / splits;
        unit(q, kc, vc, out, q_rows[r], ctx[r], tables + r * nb, bs, hq, hkv, d, scale, g0, g1, sc, accf);
    }
    free(sc);
    return 0;
}
