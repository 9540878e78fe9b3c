/* LoRA's product for a batch of rows, each row with its own adapter (or none), on the CPU in
 * float32: y[t] += (x[t] A_s) B_s for the adapter s of row t, with A_s stored transposed
 * [in, r] and B_s [r, out] already multiplied by the adapter's scaling. Both loops are
 * axpys (a row of A or B scaled and added), so they vectorise without reordering any sum,
 * and each row is computed on its own: a row's result never depends on the batch. The torch
 * reference is tokentape/kernels/reference.py's lora_add_ref.
 * Compiled together with paged_attention.c (see tokentape/kernels/cpu_native.py).
 */
#include <stdint.h>

#define TT_LORA_MAX_RANK 512

/* Rows with a slot < 0, or a slot whose `a` is NULL (an adapter that leaves this layer
 * alone), are left as they are. Returns 0, or 1 for a rank above TT_LORA_MAX_RANK. */
int tt_lora_add_f32(const float *x, float *y, int64_t rows, int64_t in_features,
                    int64_t out_features, const int32_t *slots, const float *const *a,
                    const float *const *b, const int32_t *ranks, int num_threads) {
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows > 16) reduction(| : bad)
    for (int64_t t = 0; t < rows; t++) {
        const int32_t s = slots[t];
        if (s < 0 || !a[s]) continue;
        const int64_t r = ranks[s];
        if (r > TT_LORA_MAX_RANK) {
            bad = 1;
            continue;
        }
        const float *A = a[s], *B = b[s], *xr = x + t * in_features;
        float h[TT_LORA_MAX_RANK];
        for (int64_t j = 0; j < r; j++) h[j] = 0.0f;
        for (int64_t i = 0; i < in_features; i++) {
            const float xi = xr[i];
            const float *Ai = A + i * r;
            for (int64_t j = 0; j < r; j++) h[j] += xi * Ai[j];
        }
        float *yr = y + t * out_features;
        for (int64_t j = 0; j < r; j++) {
            const float hj = h[j];
            const float *Bj = B + j * out_features;
            for (int64_t o = 0; o < out_features; o++) yr[o] += hj * Bj[o];
        }
    }
    return bad;
}
