/* A dense model's decoder layers over a few rows in one call (kernels/cpu_layers.py; specs/cpu-kernels.md
 * §15.11): the steps of runtime/torch_model/fused.py, each by the kernel that step calls, in the same
 * order on the same buffers' values, so every output has the bits the step-by-step forward gives.
 * No arithmetic of its own: the kernels come as function pointers (their libraries are built for the
 * host's instruction set; this file needs none).
 *
 * Per layer l, rows [m] of the residual h and its normed x (x: the layer's input norm of h):
 *   qkv = product(x, Wqkv); q, k = qk_norm_rope(qkv); the cache rows write_index[r] = k[r], v[r];
 *   a = attention(q over the cache); o = product(a, Wo); h, x = add_norm(h, o, post_norm);
 *   gu = product(x, Wgu); act = silu_rows(gu); dn = product(act, Wd);
 *   h, x = add_norm(h, dn, next layer's input norm)   (the last layer: h += dn, x untouched).
 * Returns 0, the first failing kernel's code, or 90 when scratch memory cannot be had.
 */
#include <stdint.h>
#include <stdlib.h>

typedef int (*product_fn)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t);
typedef int (*attention_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, const int32_t *,
                            const int32_t *, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                            int64_t, int64_t, int64_t);
typedef int (*add_norm_fn)(const uint16_t *, const uint16_t *, const float *, uint16_t *, uint16_t *, int64_t, float,
                           int64_t, int64_t);
typedef int (*qk_rope_fn)(const uint16_t *, int64_t, int64_t, int64_t, int64_t, const float *, const float *, float,
                          const uint16_t *, const uint16_t *, int64_t, uint16_t *, uint16_t *, int64_t, int64_t);
typedef int (*scatter_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *, uint16_t *, int64_t,
                          const int64_t *, const int64_t *, int64_t);
typedef int (*silu_rows_fn)(const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

/* ops[]: the kernels, in this order */
enum { OP_PRODUCT, OP_ATTENTION, OP_ADD_NORM, OP_QK_ROPE, OP_SCATTER, OP_SILU_ROWS, N_OPS };
/* layer l's pointers at ptrs[l * N_PTRS + ...] (next_norm 0 for the last layer; q_norm, k_norm 0 where none) */
enum { P_WQKV, P_WO, P_WGU, P_WD, P_Q_NORM, P_K_NORM, P_POST_NORM, P_NEXT_NORM, P_KC, P_VC, N_PTRS };
/* dims[]: the shapes and split counts */
enum { D_M, D_HIDDEN, D_INTER, D_HQ, D_HKV, D_HEAD, D_ROT, D_NB, D_BS, D_SPLITS, D_UNITS, D_ATTN_THREADS,
       D_THREADS, N_DIMS };

#define CHECK(call)              \
    do {                         \
        int rc_ = (call);        \
        if (rc_ != 0) {          \
            free(scratch);       \
            return rc_;          \
        }                        \
    } while (0)

/* the product of n outputs on the threads its size earns (cpu_amx.packed_product's rule: 16 blocks of 16
   outputs a thread at least) */
static int product(const int64_t *ops, const uint16_t *x, const void *w, uint16_t *y, int64_t m, int64_t k,
                   int64_t n, int64_t threads) {
    int64_t earned = n / 16 / 16;
    if (earned < 1) earned = 1;
    return ((product_fn)(intptr_t)ops[OP_PRODUCT])(x, (const uint16_t *)w, y, m, k, n, threads < earned ? threads : earned);
}

int fx_decode_layers(const int64_t *ops, const int64_t *ptrs, int64_t layers, const int64_t *dims, float eps,
                     float scale, uint16_t *h, uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                     const int64_t *write_index, const int32_t *q_rows, const int32_t *ctx, const int32_t *tables) {
    const int64_t m = dims[D_M], dm = dims[D_HIDDEN], inter = dims[D_INTER], hq = dims[D_HQ], hkv = dims[D_HKV];
    const int64_t d = dims[D_HEAD], threads = dims[D_THREADS], cqkv = (hq + 2 * hkv) * d;
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)(m * (cqkv + hq * d + hkv * d + hq * d + dm + 3 * inter)));
    if (scratch == NULL) return 90;
    uint16_t *qkv = scratch, *q = qkv + m * cqkv, *k = q + m * hq * d, *att = k + m * hkv * d, *o = att + m * hq * d;
    uint16_t *gu = o + m * dm, *act = gu + m * 2 * inter;
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *p = ptrs + l * N_PTRS;
        uint16_t *kc = (uint16_t *)(intptr_t)p[P_KC], *vc = (uint16_t *)(intptr_t)p[P_VC];
        CHECK(product(ops, x, (const void *)(intptr_t)p[P_WQKV], qkv, m, dm, cqkv, threads));
        CHECK(((qk_rope_fn)(intptr_t)ops[OP_QK_ROPE])(qkv, cqkv, hq, hkv, d, (const float *)(intptr_t)p[P_Q_NORM],
                                                       (const float *)(intptr_t)p[P_K_NORM], eps, cos, sin,
                                                       dims[D_ROT], q, k, 0, m));
        CHECK(((scatter_fn)(intptr_t)ops[OP_SCATTER])(k, hkv * d, qkv + (hq + hkv) * d, cqkv, kc, vc, hkv * d, NULL,
                                                       write_index, m));
        CHECK(((attention_fn)(intptr_t)ops[OP_ATTENTION])(q, kc, vc, att, q_rows, ctx, tables, dims[D_NB], dims[D_BS],
                                                           hq, hkv, d, scale, dims[D_SPLITS], dims[D_UNITS],
                                                           dims[D_ATTN_THREADS]));
        CHECK(product(ops, att, (const void *)(intptr_t)p[P_WO], o, m, hq * d, dm, threads));
        CHECK(((add_norm_fn)(intptr_t)ops[OP_ADD_NORM])(h, o, (const float *)(intptr_t)p[P_POST_NORM], h, x, dm, eps,
                                                         0, m));
        CHECK(product(ops, x, (const void *)(intptr_t)p[P_WGU], gu, m, dm, 2 * inter, threads));
        CHECK(((silu_rows_fn)(intptr_t)ops[OP_SILU_ROWS])(gu, act, inter, 0, m));
        CHECK(product(ops, act, (const void *)(intptr_t)p[P_WD], o, m, inter, dm, threads));
        if (p[P_NEXT_NORM] != 0) {
            CHECK(((add_norm_fn)(intptr_t)ops[OP_ADD_NORM])(h, o, (const float *)(intptr_t)p[P_NEXT_NORM], h, x, dm,
                                                             eps, 0, m));
        } else {
            /* the last add alone: PyTorch's bf16 add, fp32 sum rounded once (the add-norm kernel's own sum;
               its norm lands in x, which nothing reads after the last layer) */
            CHECK(((add_norm_fn)(intptr_t)ops[OP_ADD_NORM])(h, o, (const float *)(intptr_t)p[P_POST_NORM], h, x, dm,
                                                             eps, 0, m));
        }
    }
    free(scratch);
    return 0;
}
