/* y = x @ w.T in bf16 on Intel AMX, with w repacked once into tile order (kernels/cpu_amx.py).
 *
 * Packed layout of w [N, K] (N % 16 == 0, K % 32 == 0): [N/16][K/32][16 k-pairs][16 columns][2], so
 * the B operand of one TDPBF16PS (32 values of k for 16 output columns, 1 KB) is contiguous, and one
 * block of 16 outputs streams its K/32 tiles in order: the product reads w as one forward stream
 * per block, which the hardware prefetcher follows.
 *
 * fx_amx_linear computes the output columns of blocks [nb0, nb1) for every row of x [M, K]:
 * - up to 16 rows (a decode or verify batch): one A tile of the rows, four C tiles for four column
 *   blocks (64 outputs), so each weight tile is loaded once and used once;
 * - more rows (a prefill): 2 x 2 tiles (32 rows by 32 columns), each A and B tile used twice; the
 *   column group's tiles (2 x K/32 KB) stay in L2 while the row blocks pass over them, and the next
 *   group's are prefetched into L2 meanwhile, spread over the passes; a last block of up to 16 rows
 *   takes one A tile (no products of zero rows). The packed A rows are as many as the call has
 *   (a fixed 1 MB buffer allocated and cleared per call cost a 24-40-row product a quarter of its time).
 * Accumulation is fp32 in the tiles, then one round-to-nearest-even to bf16 (as F.linear).
 * Returns 0, or -1 when the tile registers cannot be configured.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

#define TILE_ELEMS 512 /* bf16 values in one 1 KB weight tile */

int fx_amx_init(void) { return fx_amx_request(); }

/* Rounds rows [0, rows) of an fp32 tile dump (stride 16 floats per tile, `tiles` tiles side by side
 * in `acc` at 16-float offsets of a 64-float row) to bf16 into y (row stride n). */
static void store_rows(const float *acc, int rows, int cols, uint16_t *y, int64_t n) {
    __asm__ volatile("" ::: "memory"); /* GCC's tile-store intrinsics do not tell it acc was written */
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 16)
            _mm256_storeu_si256((__m256i *)(y + (int64_t)r * n + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * 64 + c)));
}

#define PREFETCH_TILES 3

static void small_m(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                    int64_t nb0, int64_t nb1, uint16_t *a) {
    const int64_t kbs = k / 32;
    float acc[16 * 64];
    fx_pack_rows(x, k, k, m, a);
    fx_tiles_16x64();
    for (int64_t nb = nb0; nb < nb1; nb += 4) {
        const int g = (nb1 - nb) < 4 ? (int)(nb1 - nb) : 4;
        const uint16_t *b = p + nb * kbs * TILE_ELEMS;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint16_t *next = nb + 4 < nb1 ? b + 4 * kbs * TILE_ELEMS : NULL;
        for (int64_t kb = 0; kb < kbs; kb++) {
            /* the g weight streams are read tile by tile in parallel: ask for each one's tile
               PREFETCH_TILES ahead (or the next group's first tiles), the hardware prefetchers do
               not keep four streams fed */
            int64_t ahead = kb + PREFETCH_TILES;
            for (int j = 0; j < g; j++) {
                const uint16_t *t = ahead < kbs ? b + (j * kbs + ahead) * TILE_ELEMS
                                    : next != NULL ? next + (j * kbs + ahead - kbs) * TILE_ELEMS : NULL;
                if (t != NULL)
                    for (int line = 0; line < 16; line++) _mm_prefetch((const char *)(t + line * 32), _MM_HINT_T0);
            }
            _tile_loadd(4, a + kb * TILE_ELEMS, 64);
            _tile_loadd(6, b + kb * TILE_ELEMS, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (g > 1) { _tile_loadd(7, b + (kbs + kb) * TILE_ELEMS, 64); _tile_dpbf16ps(1, 4, 7); }
            if (g > 2) { _tile_loadd(6, b + (2 * kbs + kb) * TILE_ELEMS, 64); _tile_dpbf16ps(2, 4, 6); }
            if (g > 3) { _tile_loadd(7, b + (3 * kbs + kb) * TILE_ELEMS, 64); _tile_dpbf16ps(3, 4, 7); }
        }
        _tile_stored(0, acc, 256);
        if (g > 1) _tile_stored(1, acc + 16, 256);
        if (g > 2) _tile_stored(2, acc + 32, 256);
        if (g > 3) _tile_stored(3, acc + 48, 256);
        store_rows(acc, (int)m, 16 * g, y + nb * 16, n);
    }
}

/* rows per pass over the columns: their packed A tiles (about 1 MB) stay in L2 while the weight streams */
static int64_t chunk_rows(int64_t k) {
    int64_t chunk = ((int64_t)1 << 20) / (2 * k) / 32 * 32;
    return chunk < 32 ? 32 : chunk;
}

static void large_m(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                    int64_t nb0, int64_t nb1, uint16_t *a) {
    const int64_t kbs = k / 32, chunk = chunk_rows(k);
    float acc[16 * 64];
    fx_tiles_16x64();
    for (int64_t mc = 0; mc < m; mc += chunk) {
        const int64_t mend = mc + chunk < m ? mc + chunk : m;
        for (int64_t r = mc; r < mend; r += 16) fx_pack_rows(x + r * k, k, k, mend - r < 16 ? mend - r : 16, a + (r - mc) * k);
        for (int64_t nb = nb0; nb < nb1; nb += 2) {
            const int two = nb + 1 < nb1;
            const uint16_t *b0 = p + nb * kbs * TILE_ELEMS, *b1 = b0 + kbs * TILE_ELEMS;
            /* the next pair's weight tiles (contiguous) prefetched into L2 across this pair's passes */
            const int64_t nnext = nb + 2 < nb1 ? (nb + 3 < nb1 ? 2 : 1) : 0;
            const char *pf = nnext ? (const char *)(p + (nb + 2) * kbs * TILE_ELEMS) : NULL;
            const int64_t pf_lines = nnext * kbs * 16, passes = (mend - mc + 31) / 32;
            const int64_t per_it = (pf_lines + passes * kbs - 1) / (passes * kbs);
            int64_t pf_at = 0;
            for (int64_t mb = mc; mb < mend; mb += 32) {
                const int64_t rows = mend - mb < 32 ? mend - mb : 32;
                const uint16_t *a0 = a + (mb - mc) * k, *a1 = a0 + 16 * k; /* a1: read only in a full block */
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                const int full = rows > 16; /* a last block of up to 16 rows: one A tile, no products of zero rows */
                for (int64_t kb = 0; kb < kbs; kb++) {
                    for (int64_t l = 0; l < per_it && pf_at < pf_lines; l++, pf_at++) _mm_prefetch(pf + pf_at * 64, _MM_HINT_T1);
                    _tile_loadd(4, a0 + kb * TILE_ELEMS, 64);
                    if (full) _tile_loadd(5, a1 + kb * TILE_ELEMS, 64);
                    _tile_loadd(6, b0 + kb * TILE_ELEMS, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (full) _tile_dpbf16ps(2, 5, 6);
                    if (two) {
                        _tile_loadd(7, b1 + kb * TILE_ELEMS, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        if (full) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, acc, 256);
                if (two) _tile_stored(1, acc + 16, 256);
                store_rows(acc, rows < 16 ? (int)rows : 16, two ? 32 : 16, y + mb * n + nb * 16, n);
                if (full) {
                    _tile_stored(2, acc, 256);
                    if (two) _tile_stored(3, acc + 16, 256);
                    store_rows(acc, (int)(rows - 16), two ? 32 : 16, y + (mb + 16) * n + nb * 16, n);
                }
            }
        }
    }
}

int fx_amx_linear(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n,
                  int64_t nb0, int64_t nb1) {
    if (m <= 0 || k % 32 || n % 16 || nb0 < 0 || nb1 > n / 16) return -1;
    /* packed A rows: one tile row block (decode), or the rows of a chunk rounded up to 16 (fx_pack_rows
       zeroes a tile's rows past the last; a block of up to 16 rows reads no second tile) */
    const int64_t chunk = chunk_rows(k);
    const int64_t rows = m <= 16 ? 16 : (m < chunk ? (m + 15) / 16 * 16 : chunk);
    uint16_t *a = aligned_alloc(64, (size_t)(rows * k * 2));
    if (a == NULL) return -1;
    if (m <= 16) small_m(x, p, y, m, k, n, nb0, nb1, a);
    else large_m(x, p, y, m, k, n, nb0, nb1, a);
    _tile_release();
    free(a);
    return 0;
}

/* The whole product on `threads` threads (OpenMP, the runtime torch's own CPU operators use, where
 * this file is built with -fopenmp; one thread otherwise): thread t takes a contiguous run of whole
 * groups of 4 blocks (a decode pass's 64 columns; FX_OMP_RANGES, cpu_simd.h), so each output's sum is
 * the one a single call makes, whatever the threads. Each thread configures and releases its own tiles. A team costs a few
 * microseconds, where a Python thread pool costs tens per product. */
int fx_amx_run(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t m, int64_t k, int64_t n, int64_t threads) {
    if (m <= 0 || k % 32 || n % 16 || threads < 1) return -1;
    FX_OMP_RANGES(n / 16, threads, 4, fx_amx_linear(x, p, y, m, k, n, lo, hi));
}
