/* What the AMX kernels share (cpu_amx.c, cpu_amx_attention.c, and cpu_attention.c's AMX build): the
 * request for the tile state, the one tile configuration they all use, and rows packed as A tiles. Header-only; _cpu.py hashes
 * it with each kernel's source. Include only in code built with -mamx-tile -mamx-bf16. */
#ifndef FXSCHED_CPU_AMX_H
#define FXSCHED_CPU_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FX_ARCH_REQ_XCOMP_PERM 0x1023
#define FX_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fx_tile_config;

/* Asks the kernel for the AMX tile state (once per process; Linux >= 5.16). 0 on success. */
static inline int fx_amx_request(void) {
    return (int)syscall(SYS_arch_prctl, FX_ARCH_REQ_XCOMP_PERM, FX_XFEATURE_XTILEDATA);
}

/* Every tile register: 16 rows of 64 bytes (a 1 KB bf16 operand tile, or 16 x 16 fp32 sums). */
static inline void fx_tiles_16x64(void) {
    fx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Rows [0, rows) of x (row stride `stride`, k values each) into A-tile order: for each block of 32
 * values, a 16-row tile (64 bytes per row, stride 64); rows past `rows` are zero. A power-of-two row
 * stride would map a tile's 16 rows onto a few cache sets; contiguous tiles do not. */
static inline void fx_pack_rows(const uint16_t *x, int64_t stride, int64_t k, int64_t rows, uint16_t *a) {
    for (int64_t kb = 0; kb < k / 32; kb++)
        for (int64_t r = 0; r < 16; r++) {
            __m512i v = r < rows ? _mm512_loadu_si512(x + r * stride + kb * 32) : _mm512_setzero_si512();
            _mm512_storeu_si512(a + (kb * 16 + r) * 32, v);
        }
}

#endif
