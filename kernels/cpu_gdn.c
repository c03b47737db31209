/* One gated-delta-rule step per (sequence, value head), updating the state cache in place.
 *
 * The decode step of a GDN layer (runtime/torch_model/gdn.py has the recurrence and its
 * conventions): with a = exp(g), S the [Dk, Dv] state of the sequence's slot and head,
 *     S' = a S,   u = beta (v - S'^T k),   S = S' + k u^T,   o = S^T q,
 * computed in fp32 from the stored state and stored back rounded to the cache's dtype (bf16 or
 * fp32), exactly as the per-row torch path followed by the commit's copy would. Reading the state
 * once from memory and writing it once is the point: in torch each of the five operations is a
 * pass over the state, plus a gather before and a scatter after.
 *
 * q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H] are fp32 and contiguous; o [B, H, Dv] fp32; state
 * [slots, H, Dk, Dv] contiguous; slots [B]. Pairs p = b * H + h in [p0, p1) only (the caller may
 * split them across threads; distinct sequences hold distinct slots).
 */
#include <math.h>

#include "cpu_simd.h"

#define MAX_DV 1024

int fx_gdn_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                void *state, int64_t state_bf16, const int64_t *slots, float *o, int64_t B, int64_t H,
                int64_t Dk, int64_t Dv, int64_t p0, int64_t p1) {
  if (Dv > MAX_DV || Dv < 1 || Dk < 1 || p0 < 0 || p1 > B * H || p0 > p1) return 1;
  /* flush subnormals to zero on this thread (FTZ | DAZ): a decayed state goes through them, and
   * x86 computes them ~100x slower; the caller's mode is restored on return */
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);
  float ks[MAX_DV], u[MAX_DV], acc[MAX_DV], row[MAX_DV];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t b = p / H, h = p % H;
    const float *qp = q + p * Dk, *kp = k + p * Dk, *vp = v + p * Dv;
    const float a = expf(g[p]), bt = beta[p];
    const int64_t base = (slots[b] * H + h) * Dk * Dv;
    uint16_t *s16 = (uint16_t *)state + base;
    float *s32 = (float *)state + base;
    for (int64_t j = 0; j < Dv; ++j) ks[j] = 0.0f;
    for (int64_t i = 0; i < Dk; ++i) {
      const float ki = kp[i];
      if (state_bf16) {
        const uint16_t *sr = s16 + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) ks[j] += ki * bf16_to_f32(sr[j]);
      } else {
        const float *sr = s32 + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) ks[j] += ki * sr[j];
      }
    }
    for (int64_t j = 0; j < Dv; ++j) {
      u[j] = bt * (vp[j] - a * ks[j]);
      acc[j] = 0.0f;
    }
    for (int64_t i = 0; i < Dk; ++i) {
      const float ki = kp[i], qi = qp[i];
      if (state_bf16) {
        uint16_t *sr = s16 + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] = a * bf16_to_f32(sr[j]) + ki * u[j];
        for (int64_t j = 0; j < Dv; ++j) {
          acc[j] += qi * row[j];
          sr[j] = f32_to_bf16(row[j]);
        }
      } else {
        float *sr = s32 + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          const float s = a * sr[j] + ki * u[j];
          acc[j] += qi * s;
          sr[j] = s;
        }
      }
    }
    memcpy(o + p * Dv, acc, (size_t)Dv * sizeof(float));
  }
  _mm_setcsr(csr);
  return 0;
}

/* fx_gdn_step over pairs [0, n) on `threads` threads (FX_OMP_RANGES, cpu_simd.h): each (sequence,
 * head) pair's update is the one a single call makes. */
int fx_gdn_step_run(const float *q, const float *k, const float *v, const float *g, const float *beta, void *state,
                    int64_t state_bf16, const int64_t *slots, float *o, int64_t B, int64_t H, int64_t Dk, int64_t Dv,
                    int64_t n, int64_t threads) {
  FX_OMP_RANGES(n, threads, 1, fx_gdn_step(q, k, v, g, beta, state, state_bf16, slots, o, B, H, Dk, Dv, lo, hi));
}
