/* LoRA's product for a batch of rows, each row with its own adapter (or none), on the CPU in
 * float32: y[t] += (x[t] A_s) B_s for the adapter s of row t, with A_s stored transposed
 * [in, r] and B_s [r, out] already multiplied by the adapter's scaling. Both products are
 * sums of scaled rows of A or B (no sum crosses vector lanes), kept in vector registers where
 * the rank is a multiple of the vector width, and each row is computed on its own in a fixed
 * order: a row's result never depends on the batch. The torch
 * reference is tokentape/kernels/reference.py's lora_add_ref.
 * Compiled together with paged_attention.c (see tokentape/kernels/cpu_native.py).
 */
#include <stdint.h>

#include "vec.h"

#define TT_LORA_MAX_RANK 512

/* h[0..NV*TT_VW) = x A, for A [in, NV*TT_VW]: the sums in registers, in G groups of the
 * inputs (i % G) added at the end, so that G * NV chains of additions run side by side (one
 * chain waits out each addition's latency). */
#define TT_SHRINK(NV, G)                                                               \
    do {                                                                               \
        vf acc[G][NV];                                                                 \
        for (int g = 0; g < G; g++)                                                    \
            for (int v = 0; v < NV; v++) acc[g][v] = (vf){0};                          \
        int64_t i = 0;                                                                 \
        for (; i + G <= in_features; i += G) {                                         \
            for (int g = 0; g < G; g++) {                                              \
                const vf xi = (vf){0} + x[i + g];                                      \
                const float *Ai = A + (i + g) * (NV * TT_VW);                          \
                for (int v = 0; v < NV; v++) acc[g][v] += xi * vload(Ai + v * TT_VW);  \
            }                                                                          \
        }                                                                              \
        for (; i < in_features; i++) {                                                 \
            const vf xi = (vf){0} + x[i];                                              \
            const float *Ai = A + i * (NV * TT_VW);                                    \
            for (int v = 0; v < NV; v++) acc[0][v] += xi * vload(Ai + v * TT_VW);      \
        }                                                                              \
        for (int v = 0; v < NV; v++) {                                                 \
            vf sum = acc[0][v];                                                        \
            for (int g = 1; g < G; g++) sum += acc[g][v];                              \
            vstore(h + v * TT_VW, sum);                                                \
        }                                                                              \
    } while (0)

/* h = x A for one row: the rank in vectors where it is 1 to 4 of them, else one by one. */
static void shrink(const float *x, const float *A, int64_t in_features, int64_t r, float *h) {
    switch (r % TT_VW ? 0 : r / TT_VW) {
    case 1: TT_SHRINK(1, 4); return;
    case 2: TT_SHRINK(2, 2); return;
    case 3: TT_SHRINK(3, 1); return;
    case 4: TT_SHRINK(4, 1); return;
    default:
        for (int64_t j = 0; j < r; j++) h[j] = 0.0f;
        for (int64_t i = 0; i < in_features; i++) {
            const float xi = x[i];
            const float *Ai = A + i * r;
            for (int64_t j = 0; j < r; j++) h[j] += xi * Ai[j];
        }
    }
}

/* y[rows[k]] += h[k] B for a block of rows of one adapter, each output summed over the rank
 * in order: four vectors of the outputs at a time (four chains of additions side by side),
 * every row of the block in turn, so that the block of B they read stays in the cache (a
 * row at a time streamed the whole of B from farther away for every row); then one vector,
 * then the rest one by one. */
static void expand_block(const float (*h)[TT_LORA_MAX_RANK], const int32_t *rows, int n,
                         const float *B, int64_t r, int64_t out_features, float *y) {
    int64_t o = 0;
    for (; o + 4 * TT_VW <= out_features; o += 4 * TT_VW) {
        for (int k = 0; k < n; k++) {
            float *yr = y + rows[k] * out_features + o;
            vf a0 = vload(yr), a1 = vload(yr + TT_VW), a2 = vload(yr + 2 * TT_VW),
               a3 = vload(yr + 3 * TT_VW);
            for (int64_t j = 0; j < r; j++) {
                const float *Bj = B + j * out_features + o;
                const vf hj = (vf){0} + h[k][j];
                a0 += hj * vload(Bj);
                a1 += hj * vload(Bj + TT_VW);
                a2 += hj * vload(Bj + 2 * TT_VW);
                a3 += hj * vload(Bj + 3 * TT_VW);
            }
            vstore(yr, a0);
            vstore(yr + TT_VW, a1);
            vstore(yr + 2 * TT_VW, a2);
            vstore(yr + 3 * TT_VW, a3);
        }
    }
    for (int k = 0; k < n; k++) {
        float *yr = y + rows[k] * out_features;
        int64_t p = o;
        for (; p + TT_VW <= out_features; p += TT_VW) {
            vf acc = vload(yr + p);
            for (int64_t j = 0; j < r; j++) acc += h[k][j] * vload(B + j * out_features + p);
            vstore(yr + p, acc);
        }
        for (; p < out_features; p++) {
            float acc = yr[p];
            for (int64_t j = 0; j < r; j++) acc += h[k][j] * B[j * out_features + p];
            yr[p] = acc;
        }
    }
}

#define TT_LORA_BLOCK 16 /* rows of one adapter computed together */

/* `order` lists the rows that have an adapter, those of each adapter together (the rows'
 * slots are read from `slots`); `a[s]` NULL (an adapter that leaves this layer alone) skips
 * them. Rows not in `order` are left as they are. Returns 0, or 1 for a rank above
 * TT_LORA_MAX_RANK. */
int tt_lora_add_f32(const float *x, float *y, int64_t in_features, int64_t out_features,
                    const int32_t *slots, const int32_t *order, int64_t num_order,
                    const float *const *a, const float *const *b, const int32_t *ranks,
                    int num_threads) {
    int bad = 0;
    /* Blocks: runs of `order` with one slot, at most TT_LORA_BLOCK rows each. A block starts
     * at every k where the slot changes or a block is full: found by each thread alone. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_order > 2 * TT_LORA_BLOCK) reduction(| : bad)
    for (int64_t first = 0; first < num_order; first += TT_LORA_BLOCK) {
        int64_t k = first;
        const int64_t end = first + TT_LORA_BLOCK < num_order ? first + TT_LORA_BLOCK : num_order;
        while (k < end) {
            const int32_t s = slots[order[k]];
            int64_t stop = k + 1;
            while (stop < end && slots[order[stop]] == s) stop++;
            const int64_t r = ranks[s];
            if (r > TT_LORA_MAX_RANK) {
                bad = 1;
            } else if (a[s]) {
                float h[TT_LORA_BLOCK][TT_LORA_MAX_RANK];
                for (int64_t q = k; q < stop; q++)
                    shrink(x + order[q] * in_features, a[s], in_features, r, h[q - k]);
                expand_block((const float (*)[TT_LORA_MAX_RANK])h, order + k, (int)(stop - k),
                             b[s], r, out_features, y);
            }
            k = stop;
        }
    }
    return bad;
}
