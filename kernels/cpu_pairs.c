/* y = x @ w.T in bf16 with AVX512-BF16 over w packed in tile order (kernels/cpu_pairs.py).
 *
 * The packing is cpu_amx's: w [N, K] (N % 16 == 0, K % 32 == 0) as [N/16][K/32][16 k-pairs][16
 * columns][2]. Read 64 bytes at a time, that is, for one pair of k, the pair of weights of each of
 * 16 output columns: exactly the second operand of VDPBF16PS, whose first is the pair of x values
 * broadcast to the 16 lanes. So each instruction adds x[k] w[c, k] + x[k+1] w[c, k+1] into 16
 * outputs' fp32 accumulators: an outer product with no horizontal sums (the row kernel cpu_gemv
 * reduces every output at its end, and its dot-product throughput bounds it beyond 4 rows).
 *
 * fx_pairs_linear computes the output blocks [nb0, nb1) (16 columns each) for every row of x [M, K]:
 * two blocks (32 columns) at a time against up to 12 rows (24 accumulators of the 32 registers), the
 * blocks' panel (2 x 32 K bytes) staying in L1/L2 while the row blocks pass over it, so the weight
 * is read from memory once whatever M. Accumulation is fp32, then one round-to-nearest-even to bf16
 * (as F.linear; only the order of the fp32 additions differs). Returns 0, or -1 for bad sizes.
 * fx_pairs_linear_fma is the same product in fp32 FMAs over the same packing (below); cpu_pairs.py
 * picks one per host.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

#if defined(__AVX512BF16__)

#define ROWS 12          /* rows of x per pass */
#define PAIR_BYTES 64    /* one k pair of 16 columns */
#define PREFETCH_AHEAD 8 /* k pairs (512 bytes) ahead, per block stream */

/* MB rows (1..ROWS) against NB blocks (1 or 2) of 16 columns. */
#define DEFINE_PASS(MB, NB)                                                                              \
  static void pass_##MB##_##NB(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t K, int64_t N, \
                               int64_t nb) {                                                             \
    __m512 acc[MB][NB];                                                                                  \
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m)                                               \
      _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();             \
    const int64_t pairs = K / 2;                                                                         \
    const uint16_t *panel[NB];                                                                           \
    _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) panel[b] = p + (nb + b) * K * 16;               \
    for (int64_t i = 0; i < pairs; ++i) {                                                                \
      __m512bh wv[NB];                                                                                   \
      _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) {                                             \
        _mm_prefetch((const char *)(panel[b] + (i + PREFETCH_AHEAD) * 32), _MM_HINT_T0);                 \
        wv[b] = (__m512bh)_mm512_loadu_si512((const void *)(panel[b] + i * 32));                         \
      }                                                                                                  \
      _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) {                                           \
        uint32_t xx;                                                                                     \
        memcpy(&xx, x + m * K + 2 * i, 4);                                                               \
        __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xx);                                              \
        _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xb); \
      }                                                                                                  \
    }                                                                                                    \
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m)                                               \
      _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) store_bf16(y + m * N + (nb + b) * 16, acc[m][b]); \
  }

/* The packing's k order within a block of 32 is pair-major ([16 k-pairs][16 columns][2]), and the
 * blocks of 32 follow one another: the i-th 64-byte vector of a column block is k pair i overall. */

#define DEFINE_ROWS(MB) DEFINE_PASS(MB, 1) DEFINE_PASS(MB, 2)
DEFINE_ROWS(1) DEFINE_ROWS(2) DEFINE_ROWS(3) DEFINE_ROWS(4) DEFINE_ROWS(5) DEFINE_ROWS(6)
DEFINE_ROWS(7) DEFINE_ROWS(8) DEFINE_ROWS(9) DEFINE_ROWS(10) DEFINE_ROWS(11) DEFINE_ROWS(12)

typedef void (*pass_fn)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

#define PASSES(NB)                                                                                       \
  { 0, pass_1_##NB, pass_2_##NB, pass_3_##NB, pass_4_##NB, pass_5_##NB, pass_6_##NB, pass_7_##NB,        \
    pass_8_##NB, pass_9_##NB, pass_10_##NB, pass_11_##NB, pass_12_##NB }
static const pass_fn ONE[ROWS + 1] = PASSES(1);
static const pass_fn TWO[ROWS + 1] = PASSES(2);

int fx_pairs_linear(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                    int64_t nb0, int64_t nb1) {
  if (m <= 0 || k <= 0 || k % 32 || n % 16 || nb0 < 0 || nb1 > n / 16 || nb0 > nb1) return -1;
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const int two = nb + 1 < nb1;
    for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
      const int64_t rows = m - m0 < ROWS ? m - m0 : ROWS;
      (two ? TWO : ONE)[rows](x + m0 * k, p, y + m0 * n, k, n, nb);
    }
  }
  return 0;
}


/* The fp32 variant (fx_pairs_linear_fma): on some AVX512-BF16 CPUs VDPBF16PS issues at a quarter of
 * the rate of an fp32 FMA (measured on an Intel Xeon without AMX: 84 against 169 GFLOP/s on one
 * core, registers only), so the same packed weight is better read as fp32: the 64-byte vector of a k
 * pair gives both k's 16 columns exactly as fp32 (the even member shifted up 16 bits, the odd one
 * masked), and each feeds 12 rows' FMAs against x converted once to fp32. Per output the sum runs
 * over k in order, so a row's result does not depend on the rows beside it. */

#define XBUF_FLOATS (256 * 1024) /* x rows converted at a time: 1 MB of fp32, beside a panel in L2 */
#define XPAD 16 /* floats after each converted row: rows 64 bytes apart in the cache's sets, where
                        K-long rows would all fall in one set (K = 1024: 4 KB apart; 25 % slower) */

#define DEFINE_FPASS(MB, NB)                                                                             \
  static void fpass_##MB##_##NB(const float *x, int64_t ldx, const uint16_t *p, uint16_t *y, int64_t K,  \
                                int64_t N, int64_t nb) {                                                 \
    __m512 acc[MB][NB];                                                                                  \
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m)                                               \
      _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();             \
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                                            \
    const int64_t pairs = K / 2;                                                                         \
    const uint16_t *panel[NB];                                                                           \
    _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) panel[b] = p + (nb + b) * K * 16;               \
    for (int64_t i = 0; i < pairs; ++i) {                                                                \
      __m512 even[NB], odd[NB];                                                                          \
      _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) {                                             \
        _mm_prefetch((const char *)(panel[b] + (i + PREFETCH_AHEAD) * 32), _MM_HINT_T0);                 \
        __m512i v = _mm512_loadu_si512((const void *)(panel[b] + i * 32));                               \
        even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                         \
        odd[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high));                                         \
      }                                                                                                  \
      _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) {                                           \
        __m512 x0 = _mm512_set1_ps(x[m * ldx + 2 * i]), x1 = _mm512_set1_ps(x[m * ldx + 2 * i + 1]);     \
        _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) {                                           \
          acc[m][b] = _mm512_fmadd_ps(even[b], x0, acc[m][b]);                                           \
          acc[m][b] = _mm512_fmadd_ps(odd[b], x1, acc[m][b]);                                            \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m)                                               \
      _Pragma("GCC unroll 2") for (int b = 0; b < NB; ++b) store_bf16(y + m * N + (nb + b) * 16, acc[m][b]); \
  }

#define DEFINE_FROWS(MB) DEFINE_FPASS(MB, 1) DEFINE_FPASS(MB, 2)
DEFINE_FROWS(1) DEFINE_FROWS(2) DEFINE_FROWS(3) DEFINE_FROWS(4) DEFINE_FROWS(5) DEFINE_FROWS(6)
DEFINE_FROWS(7) DEFINE_FROWS(8) DEFINE_FROWS(9) DEFINE_FROWS(10) DEFINE_FROWS(11) DEFINE_FROWS(12)

typedef void (*fpass_fn)(const float *, int64_t, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

#define FPASSES(NB)                                                                                      \
  { 0, fpass_1_##NB, fpass_2_##NB, fpass_3_##NB, fpass_4_##NB, fpass_5_##NB, fpass_6_##NB, fpass_7_##NB, \
    fpass_8_##NB, fpass_9_##NB, fpass_10_##NB, fpass_11_##NB, fpass_12_##NB }
static const fpass_fn FONE[ROWS + 1] = FPASSES(1);
static const fpass_fn FTWO[ROWS + 1] = FPASSES(2);

/* each calling thread's fp32 copy of the rows in hand (at most XBUF_FLOATS + one row block) */
static __thread float *xbuf;
static __thread int64_t xbuf_floats;

static float *rows_as_f32(const uint16_t *x, int64_t rows, int64_t k, int64_t ldx) {
  const int64_t need = rows * ldx;
  if (need > xbuf_floats) {
    free(xbuf);
    xbuf = NULL;
    xbuf_floats = 0;
    if (posix_memalign((void **)&xbuf, 64, (size_t)need * sizeof(float)) != 0) return NULL;
    xbuf_floats = need;
  }
  for (int64_t r = 0; r < rows; ++r) /* k % 32 == 0 */
    for (int64_t i = 0; i < k; i += 16) _mm512_store_ps(xbuf + r * ldx + i, load_bf16(x + r * k + i));
  return xbuf;
}

int fx_pairs_linear_fma(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                        int64_t nb0, int64_t nb1) {
  if (m <= 0 || k <= 0 || k % 32 || n % 16 || nb0 < 0 || nb1 > n / 16 || nb0 > nb1) return -1;
  const int64_t ldx = k + XPAD;
  int64_t span = XBUF_FLOATS / ldx / ROWS * ROWS; /* rows converted at a time, whole row blocks */
  if (span < ROWS) span = ROWS;
  for (int64_t s0 = 0; s0 < m; s0 += span) {
    const int64_t rows_here = m - s0 < span ? m - s0 : span;
    const float *xf = rows_as_f32(x + s0 * k, rows_here, k, ldx);
    if (xf == NULL) return -1;
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
      const int two = nb + 1 < nb1;
      for (int64_t m0 = 0; m0 < rows_here; m0 += ROWS) {
        const int64_t rows = rows_here - m0 < ROWS ? rows_here - m0 : ROWS;
        (two ? FTWO : FONE)[rows](xf + m0 * ldx, ldx, p, y + (s0 + m0) * n, k, n, nb);
      }
    }
  }
  return 0;
}

/* The whole product on `threads` threads (OpenMP, the runtime torch's own CPU operators use when
 * this file is built with -fopenmp; one thread otherwise): thread t takes a contiguous run of whole
 * block pairs (FX_OMP_RANGES, cpu_simd.h), so each output's sum is the one fx_pairs_linear(_fma) makes,
 * whatever the threads. A team costs a few microseconds, where a Python thread pool costs tens per product. */
int fx_pairs_run(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n, int64_t arith,
                 int64_t threads) {
  if (m <= 0 || k <= 0 || k % 32 || n % 16 || threads < 1) return -1;
  FX_OMP_RANGES(n / 16, threads, 2, arith ? fx_pairs_linear_fma(x, p, y, m, k, n, lo, hi)
                                          : fx_pairs_linear(x, p, y, m, k, n, lo, hi));
}

/* The core's own rate, for `fxsched bench linears`: `iters` rounds of 24 independent accumulations
 * on register operands (what a pass of 12 rows x 2 blocks issues per k), VDPBF16PS for arith 0, fp32
 * FMA for arith 1; no memory is read. Returns a value of the sums so that nothing is optimised away. */
int fx_pairs_peak(int64_t arith, int64_t iters) {
  __m512 acc[24];
  for (int j = 0; j < 24; ++j) {
    acc[j] = _mm512_set1_ps((float)j);
    __asm__ volatile("" : "+v"(acc[j]));
  }
  __m512 a = _mm512_set1_ps(1e-3f), b = _mm512_set1_ps(1e-3f);
  if (arith == 0) {
    for (int64_t i = 0; i < iters; ++i) {
      __asm__ volatile("" : "+v"(a), "+v"(b));
      _Pragma("GCC unroll 24") for (int j = 0; j < 24; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)b);
    }
  } else {
    for (int64_t i = 0; i < iters; ++i) {
      __asm__ volatile("" : "+v"(a), "+v"(b));
      _Pragma("GCC unroll 24") for (int j = 0; j < 24; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
    }
  }
  __m512 sum = acc[0];
  for (int j = 1; j < 24; ++j) sum = _mm512_add_ps(sum, acc[j]);
  return (int)_mm512_reduce_add_ps(sum);
}

#else /* the AVX2 build: no bf16 arithmetic; cpu_pairs.py never loads this level */

int fx_pairs_linear(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                    int64_t nb0, int64_t nb1) {
  (void)x, (void)p, (void)y, (void)m, (void)k, (void)n, (void)nb0, (void)nb1;
  return -1;
}

int fx_pairs_linear_fma(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                        int64_t nb0, int64_t nb1) {
  return fx_pairs_linear(x, p, y, m, k, n, nb0, nb1);
}

int fx_pairs_peak(int64_t arith, int64_t iters) {
  (void)arith, (void)iters;
  return -1;
}

int fx_pairs_run(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n, int64_t arith,
                 int64_t threads) {
  (void)x, (void)p, (void)y, (void)m, (void)k, (void)n, (void)arith, (void)threads;
  return -1;
}

#endif

/* fx_pairs_run in each arithmetic, with the packed products' common signature (kernels/cpu_layers.c
 * takes a product as a function pointer) */
int fx_pairs_run_bf16(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                      int64_t threads) {
  return fx_pairs_run(x, p, y, m, k, n, 0, threads);
}

int fx_pairs_run_fp32(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                      int64_t threads) {
  return fx_pairs_run(x, p, y, m, k, n, 1, threads);
}
