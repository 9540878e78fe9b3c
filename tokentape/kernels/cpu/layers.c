/* The decoder's small per-row operations on the CPU, float32, fused so that a layer makes a
 * few calls instead of a few dozen torch ops (each with its allocation, its dispatch and, in
 * a multi-threaded engine, a trip through the GIL). The torch modules in
 * tokentape/engine/model/layers.py are their oracle in the tests; these compute the same
 * formulas (Hugging Face's), with sums in another order, so results agree to float32
 * rounding. Every row is computed on its own: the results never depend on the batch.
 * Compiled together with paged_attention.c (see tokentape/kernels/cpu_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

/* out = w * (x / sqrt(mean(x^2) + eps)), one row of n. */
static inline void rms_norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(vdot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* RMSNorm of `rows` rows of `dim`; with `residual`, x is first added into it (in place) and the
 * sum is normalised, as the decoder's residual stream does between sublayers. */
void tt_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows,
                         int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        if (residual) {
            float *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) res[i] += xr[i];
            xr = res;
        }
        rms_norm_row(xr, w, out + r * dim, dim, eps);
    }
}

/* Rotary embedding (NeoX layout, Hugging Face's x * cos + rotate_half(x) * sin) of `heads`
 * vectors of `dim` at one position, in place; `norm_w` (optional) first applies the per-head
 * RMSNorm of Qwen3's q_norm / k_norm. */
static void norm_rope_heads(float *x, int64_t heads, int64_t dim, const float *norm_w, float eps,
                            const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    float tmp[512];
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * dim;
        if (norm_w) rms_norm_row(v, norm_w, v, dim, eps);
        memcpy(tmp, v, (size_t)dim * sizeof(float));
        for (int64_t i = 0; i < half; i++) {
            v[i] = tmp[i] * cos[i] + (-tmp[i + half]) * sin[i];
            v[i + half] = tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half];
        }
    }
}

/* q [tokens, q_heads, dim] and k [tokens, kv_heads, dim], in place: the optional per-head
 * RMSNorms, then RoPE at each token's position from the cos/sin tables [positions, dim].
 * Returns 0, or 1 for a head size the kernel does not take (over 512). */
int tt_qk_norm_rope_f32(float *q, float *k, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                        int64_t dim, const float *q_norm_w, const float *k_norm_w, float eps,
                        const float *cos_table, const float *sin_table, const int64_t *positions) {
    if (dim > 512 || dim % 2) return 1;
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos = cos_table + positions[t] * dim, *sin = sin_table + positions[t] * dim;
        norm_rope_heads(q + t * q_heads * dim, q_heads, dim, q_norm_w, eps, cos, sin);
        norm_rope_heads(k + t * kv_heads * dim, kv_heads, dim, k_norm_w, eps, cos, sin);
    }
    return 0;
}

/* out = silu(gate) * up over n floats (SwiGLU's middle). */
void tt_silu_mul_f32(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + TT_VW <= n; i += TT_VW) {
        const vf g = vload(gate + i);
        vstore(out + i, g / (1.0f + vexp((vf){0} - g)) * vload(up + i));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}
