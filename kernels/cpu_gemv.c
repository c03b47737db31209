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
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float s) {
  uint32_t u;
  memcpy(&u, &s, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN stays NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

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
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) y[m * N + n + r] = to_bf16(_mm512_reduce_add_ps(acc[r][m]));      \
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
