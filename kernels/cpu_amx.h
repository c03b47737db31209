/* What the AMX kernels share (cpu_amx.c, cpu_amx_attention.c, and cpu_attention.c's AMX build): the
 * request for the tile state and the one tile configuration they all use. Header-only; _cpu.py hashes
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

#endif
