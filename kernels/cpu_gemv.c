/* y[M, N] = x[M, K] . w[N, K]^T for bf16 x and w, fp32 accumulation, bf16 y (round to nearest even).
 *
 * The decode-time matrix-vector product of a CPU engine: M (the rows of the batch) is small and
 * each weight byte is read once per forward, so the product is bound by how fast w streams from
 * memory. AVX512-BF16's dot-product instruction consumes 32 weight values per instruction without
 * converting them to fp32 first, which keeps one core at memory speed where the general GEMM
 * (oneDNN through F.linear) runs at about half of it for M <= 8.
 *
 * Rows n0..n1-1 of w only (the caller splits N across threads); M <= 8. x and w are row-major and
 * contiguous, y is row-major with row stride N. No state, no allocation: safe to call from several
 * threads on disjoint n ranges.
 *
 * The AVX2 build (no bf16 arithmetic) widens the M input rows to fp32 once per call and each weight
 * vector as it is loaded (a shift), then multiplies in fp32 with FMA: the same products and sums
 * as the AVX512 build up to the order of the fp32 additions (see product() for the blocking).
 */
#include <stdlib.h>

#include "cpu_simd.h"

#if defined(__AVX512BF16__)

/* How far ahead (in bf16 elements) each weight row is prefetched: the rows of a block are short
 * (K elements) and interleaved, which the hardware prefetcher alone follows poorly (+10-25 % at M = 1..8). */
#define PREFETCH 512

/* R weight rows at a time against M input rows: R * M accumulators (<= 16 of the 32 registers; the
 * loops are unrolled so they stay in registers). */
#define DEFINE_BLOCK(R, M)                                                                          \
  static void block_##R##_##M(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t K,          \
                              int64_t N, int64_t n) {                                                \
    __m512 acc[R][M];                                                                                \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                                                      \
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();                                  \
    const int64_t k32 = K / 32 * 32;                                                                 \
    for (int64_t k = 0; k < K; k += 32) {                                                            \
      __mmask32 mask = k < k32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k32)) - 1);      \
      __m512bh wv[R];                                                                                \
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                            \
        _mm_prefetch((const char *)(w + (n + r) * K + k + PREFETCH), _MM_HINT_T0);                 \
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                                                    \
        wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)(w + (n + r) * K + k));       \
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {                                                                  \
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)(x + m * K + k));       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);             \
      }                                                                                              \
    }                                                                                                \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m)                                                                      \
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) y[m * N + n + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][m]));      \
  }

DEFINE_BLOCK(4, 1)
DEFINE_BLOCK(4, 2)
DEFINE_BLOCK(4, 3)
DEFINE_BLOCK(4, 4)
DEFINE_BLOCK(2, 5)
DEFINE_BLOCK(2, 6)
DEFINE_BLOCK(2, 7)
DEFINE_BLOCK(2, 8)
DEFINE_BLOCK(1, 1)
DEFINE_BLOCK(1, 2)
DEFINE_BLOCK(1, 3)
DEFINE_BLOCK(1, 4)
DEFINE_BLOCK(1, 5)
DEFINE_BLOCK(1, 6)
DEFINE_BLOCK(1, 7)
DEFINE_BLOCK(1, 8)

typedef void (*block_fn)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

static const block_fn WIDE[9] = {0, block_4_1, block_4_2, block_4_3, block_4_4,
                                 block_2_5, block_2_6, block_2_7, block_2_8};
static const int WIDE_ROWS[9] = {0, 4, 4, 4, 4, 2, 2, 2, 2};
static const block_fn ONE[9] = {0, block_1_1, block_1_2, block_1_3, block_1_4,
                                block_1_5, block_1_6, block_1_7, block_1_8};

int fx_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  if (M < 1 || M > 8 || K < 1 || n0 < 0 || n1 > N || n0 > n1) return 1;
  const int rows = WIDE_ROWS[M];
  int64_t n = n0;
  for (; n + rows <= n1; n += rows) WIDE[M](x, w, y, K, N, n);
  for (; n < n1; ++n) ONE[M](x, w, y, K, N, n);
  return 0;
}

/* Mixture-of-experts form: y[a, :] = x[a, :] . w[ids[a]]^T for A rows, each against its own expert
 * of the stacked w[E, N, K] (rows n0..n1-1 of every expert). A row whose id lies outside [0, E) is
 * an expert another shard holds: its output is zero. The ids are read here, in memory, so the
 * caller needs no host copy of them. */
int fx_moe_gemv_bf16(const uint16_t *x, const uint16_t *w, const int64_t *ids, uint16_t *y, int64_t A,
                     int64_t K, int64_t N, int64_t E, int64_t n0, int64_t n1) {
  if (A < 0 || K < 1 || E < 1 || n0 < 0 || n1 > N || n0 > n1) return 1;
  for (int64_t a = 0; a < A; ++a) {
    const int64_t e = ids[a];
    uint16_t *ya = y + a * N;
    if (e < 0 || e >= E) {
      memset(ya + n0, 0, (size_t)(n1 - n0) * sizeof(uint16_t));
      continue;
    }
    const uint16_t *we = w + e * N * K, *xa = x + a * K;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) block_4_1(xa, we, ya, K, N, n);
    for (; n < n1; ++n) block_1_1(xa, we, ya, K, N, n);
  }
  return 0;
}

#else /* AVX2 */

/* K is taken in chunks of KC elements when M > 2, so the chunk of the fp32 input rows being read
   (M x KC x 4 bytes <= 32 KB) stays near L1 while every weight row's chunk streams past it; partial
   sums go to an fp32 [M, n1 - n0] buffer. The next row block's chunk is prefetched. Each input
   vector is loaded once per k step and held in a register for all R weight rows (0.75 loads per
   FMA at M = 4 instead of 1.25: 45 -> 60-69 GFLOP/s on a Zen 3 core with the weights in L3). */
#define KC 1024

/* R weight rows (n .. n + R - 1) against input rows m0 .. m0 + M - 1 (M <= 4), k in [k0, k1):
   adds the sums to part[m * P + n - n0] */
#define DEFINE_BLOCK(R, M)                                                                          \
  static void block_##R##_##M(const float *xf, const uint16_t *w, float *part, int64_t K, int64_t P, \
                              int64_t n, int64_t pn, int64_t m0, int64_t k0, int64_t k1) {           \
    __m256 acc[R][M];                                                                                \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                              \
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();          \
    const int64_t k8 = k0 + (k1 - k0) / 8 * 8;                                                       \
    for (int64_t k = k0; k < k8; k += 8) {                                                           \
      __m256 wv[R];                                                                                  \
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                                          \
        if ((k & 31) == 0) _mm_prefetch((const char *)(w + (n + R + r) * K + k), _MM_HINT_T0);      \
        wv[r] = load8_bf16(w + (n + r) * K + k);                                                     \
      }                                                                                              \
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {                                          \
        __m256 xv = _mm256_loadu_ps(xf + (m0 + m) * K + k);                                          \
        __asm__("" : "+x"(xv)); /* held in a register: GCC would fold the load into each FMA */     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]); \
      }                                                                                              \
    }                                                                                                \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m)                                              \
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                                          \
        float t = hsum256(acc[r][m]);                                                                \
        for (int64_t k = k8; k < k1; ++k) t += bf16_to_f32(w[(n + r) * K + k]) * xf[(m0 + m) * K + k]; \
        part[(m0 + m) * P + pn + r] += t;                                                            \
      }                                                                                              \
  }

DEFINE_BLOCK(4, 1)
DEFINE_BLOCK(4, 2)
DEFINE_BLOCK(2, 1)
DEFINE_BLOCK(2, 2)
DEFINE_BLOCK(2, 3)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(1, 1)
DEFINE_BLOCK(1, 2)
DEFINE_BLOCK(1, 3)
DEFINE_BLOCK(1, 4)

typedef void (*block_fn)(const float *, const uint16_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t);

static const block_fn FOUR[3] = {0, block_4_1, block_4_2};
static const block_fn TWO[5] = {0, block_2_1, block_2_2, block_2_3, block_2_4};
static const block_fn ONE[5] = {0, block_1_1, block_1_2, block_1_3, block_1_4};

static void widen(const uint16_t *x, float *xf, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(xf + i, load8_bf16(x + i));
  for (; i < n; ++i) xf[i] = bf16_to_f32(x[i]);
}

/* y[m, n0 .. n1-1] for all M input rows: R = 4 weight rows at a time for M <= 2, else 2, against the
   input rows in groups of at most 4 (the weight rows stay in L1 between groups) */
static int product(const float *xf, const uint16_t *w, uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t n0,
                   int64_t n1) {
  const int64_t P = n1 - n0;
  float *part = (float *)calloc((size_t)(M * P), sizeof(float));
  if (part == NULL) return 2;
  const int R = M <= 2 ? 4 : 2;
  const int64_t kc = M <= 2 ? K : KC;
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t k1 = K - k0 < kc ? K : k0 + kc;
    for (int64_t n = n0; n < n1;) {
      const int r = n + R <= n1 ? R : 1;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t g = M - m0 < 4 ? M - m0 : 4;
        (r == 4 ? FOUR[g] : r == 2 ? TWO[g] : ONE[g])(xf, w, part, K, P, n, n - n0, m0, k0, k1);
      }
      n += r;
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < P; ++j) y[m * N + n0 + j] = f32_to_bf16(part[m * P + j]);
  free(part);
  return 0;
}

int fx_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  if (M < 1 || M > 8 || K < 1 || n0 < 0 || n1 > N || n0 > n1) return 1;
  float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
  if (xf == NULL) return 2;
  widen(x, xf, M * K);
  const int rc = product(xf, w, y, M, K, N, n0, n1);
  free(xf);
  return rc;
}

int fx_moe_gemv_bf16(const uint16_t *x, const uint16_t *w, const int64_t *ids, uint16_t *y, int64_t A,
                     int64_t K, int64_t N, int64_t E, int64_t n0, int64_t n1) {
  if (A < 0 || K < 1 || E < 1 || n0 < 0 || n1 > N || n0 > n1) return 1;
  float *xf = (float *)malloc(sizeof(float) * (size_t)K);
  if (xf == NULL) return 2;
  int rc = 0;
  for (int64_t a = 0; a < A && rc == 0; ++a) {
    const int64_t e = ids[a];
    if (e < 0 || e >= E) {
      memset(y + a * N + n0, 0, (size_t)(n1 - n0) * sizeof(uint16_t));
      continue;
    }
    widen(x + a * K, xf, K);
    rc = product(xf, w + e * N * K, y + a * N, 1, K, N, n0, n1);
  }
  free(xf);
  return rc;
}

#endif

/* The two products over output rows [0, n) on `threads` threads (FX_OMP_RANGES, cpu_simd.h), in runs
 * of whole 4-row blocks: each output is the one a single call makes. */
int fx_gemv_run(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t n,
                int64_t threads) {
  FX_OMP_RANGES(n, threads, 4, fx_gemv_bf16(x, w, y, M, K, N, lo, hi));
}

int fx_moe_gemv_run(const uint16_t *x, const uint16_t *w, const int64_t *ids, uint16_t *y, int64_t A, int64_t K,
                    int64_t N, int64_t E, int64_t n, int64_t threads) {
  FX_OMP_RANGES(n, threads, 4, fx_moe_gemv_bf16(x, w, ids, y, A, K, N, E, lo, hi));
}
