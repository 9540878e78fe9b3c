/* A decoder's whole layer stack in one call on the CPU, float32: the same kernels, in the
 * same order, on the same buffers' values as the decoder's fused pass in Python
 * (CausalLM._forward_fused in tokentape/engine/model/decoder.py, its oracle in the tests),
 * so its results are the same bits; without a Python step between two kernels. That step
 * (the ops' dispatch, the views, a trip through the GIL) cost about as much as the kernels
 * themselves at a decode step of a small model.
 *
 * Its matmuls are MKL's packed GEMM (cblas_sgemm_compute, whose address the caller passes),
 * shared with the helper thread where one is lent and the weight is split (helper.c), as
 * engine/model/cpu_matmul.py decides it for one matmul.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

/* One linear layer: out [rows, n] = x [rows, k] @ W.T + bias. */
typedef struct {
    const void *whole;        /* W packed by MKL */
    const void *parts[2];     /* W's two column parts packed apart, or NULL */
    int64_t first_column[3];  /* part i: columns [first_column[i], first_column[i + 1]) */
    int64_t n, k;
    const float *bias;        /* NULL: none */
} tt_linear;

typedef struct {
    tt_linear q, k, v, o, gate, up, down;
    const float *post_norm;   /* post_attention_layernorm's weight */
    const float *next_norm;   /* the next layer's input_layernorm, or the final norm */
    const float *q_norm, *k_norm; /* per-head norms (Qwen3), or NULL */
    float *k_cache, *v_cache;
} tt_layer;

/* The pass: its shapes, its batch as the attention kernels take it, and how it runs. */
typedef struct {
    int64_t rows, tokens;     /* rows of the residual stream (row padding included), tokens */
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, mlp_row_chunk;
    float rms_eps, scale;
    const float *cos_table, *sin_table;
    const int64_t *positions; /* [rows] */
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    const int64_t *slots;     /* [tokens] */
    int64_t num_seqs, max_blocks, num_blocks, block_size;
    int num_threads;
    tt_helper *helper;
    tt_sgemm_compute compute;
    int64_t split_min_rows;   /* a split weight's parts are used from this many rows */
} tt_pass;

/* Return codes: the attention kernels' (1-4), and these. */
enum { TT_LAYERS_UNSUPPORTED = 5, TT_LAYERS_BAD_SLOT = 6 };

static void linear(const tt_pass *p, const tt_linear *w, const float *x, int64_t rows,
                   float *out) {
    if (p->helper && w->parts[0] && rows >= p->split_min_rows) {
        tt_helper_sgemm_f32(p->helper, p->compute, x, rows, w->k, w->parts, w->first_column, 2,
                            out);
    } else {
        enum { ROW_MAJOR = 101, NO_TRANS = 111, PACKED = 151 };
        p->compute(ROW_MAJOR, NO_TRANS, PACKED, (int)rows, (int)w->n, (int)w->k, x, (int)w->k,
                   w->whole, (int)w->k, 0.0f, out, (int)w->n);
    }
    if (w->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < w->n; j++) out[r * w->n + j] += w->bias[j];
}

/* The per-row kernels between the matmuls run on the pass's threads where a step holds
 * enough of their work (a prompt's: a single thread spent 2 s of Qwen3-0.6B's 24 s prefill of
 * 64 x 128 tokens on them while the other waited). Not a decode step's: sharing its few rows
 * costs about what it saves, each share waking the other thread from its sleep (Qwen3's
 * decode with 16K floats a thread: 960-970 context switches a second, against 668 without).
 * Each row, and each vector of SwiGLU's middle, is computed as in one call, so the split
 * changes no bit. */
enum { MIN_FLOATS_PER_THREAD = 1 << 18 };

static int threads_for(const tt_pass *p, int64_t floats) {
    const int64_t most = floats / MIN_FLOATS_PER_THREAD;
    if (most < 2 || p->num_threads < 2) return 1;
    return (int)(most < p->num_threads ? most : p->num_threads);
}

/* tt_add_rms_norm_f32 over `rows` rows of the hidden size, the rows shared out. */
static void add_rms_norm(const tt_pass *p, const float *x, float *residual, const float *w,
                         float *out, int64_t rows) {
    const int64_t dim = p->hidden;
    const int threads = threads_for(p, rows * dim);
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t r0 = rows * t / threads, r1 = rows * (t + 1) / threads;
        tt_add_rms_norm_f32(x + r0 * dim, residual ? residual + r0 * dim : NULL, w,
                            out + r0 * dim, r1 - r0, dim, p->rms_eps);
    }
}

/* tt_qk_norm_rope_f32 over the rows' tokens, shared out. */
static void qk_norm_rope(const tt_pass *p, const tt_layer *l, float *q, float *k, int64_t rows) {
    const int64_t D = p->head_dim, qw = p->num_heads * D, kvw = p->num_kv_heads * D;
    const int threads = threads_for(p, rows * (qw + kvw));
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t r0 = rows * t / threads, r1 = rows * (t + 1) / threads;
        tt_qk_norm_rope_f32(q + r0 * qw, k + r0 * kvw, r1 - r0, p->num_heads, p->num_kv_heads, D,
                            l->q_norm, l->k_norm, p->rms_eps, p->cos_table, p->sin_table,
                            p->positions + r0);
    }
}

/* tt_silu_mul_f32 over n floats, cut at whole vectors: every float takes the path (vector,
 * or the scalar tail) it takes in one call. */
static void silu_mul(const tt_pass *p, const float *gate, const float *up, float *out,
                     int64_t n) {
    const int threads = threads_for(p, n);
    const int64_t vectors = n / TT_VW;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t i0 = vectors * t / threads * TT_VW;
        const int64_t i1 = t + 1 == threads ? n : vectors * (t + 1) / threads * TT_VW;
        tt_silu_mul_f32(gate + i0, up + i0, out + i0, i1 - i0);
    }
}

/* The rows the MLP takes at a time (as layers.py chunks them). */
static int64_t mlp_chunk(const tt_pass *p) {
    return p->rows < p->mlp_row_chunk ? p->rows : p->mlp_row_chunk;
}

/* The floats of scratch tt_decoder_layers_f32 needs for the pass `p`: q, k, v, the
 * attention's output and a sublayer's for every row, and the MLP's gate, up and middle for a
 * chunk of rows. */
int64_t tt_decoder_work_floats(const tt_pass *p) {
    const int64_t R = p->rows, qw = p->num_heads * p->head_dim;
    const int64_t kvw = p->num_kv_heads * p->head_dim;
    return R * (2 * qw + 2 * kvw + p->hidden) + 3 * mlp_chunk(p) * p->intermediate;
}

/* The residual stream `residual` [rows, hidden] through every layer, in place; `out` gets
 * the final norm of it. `first_norm`: layer 0's input_layernorm. `work`: the caller's
 * scratch of tt_decoder_work_floats(p) floats (kept from pass to pass by the caller: fresh
 * memory costs a page fault a page at every pass). Returns 0, or an error code with *bad set
 * (the sequence or token at fault); TT_LAYERS_UNSUPPORTED before anything is written, for
 * shapes the kernels leave to the caller's fallbacks. */
int tt_decoder_layers_f32(const tt_pass *p, const tt_layer *layers, int64_t num_layers,
                          const float *first_norm, float *residual, float *out, float *work,
                          int64_t *bad) {
    const int64_t R = p->rows, T = p->tokens, D = p->head_dim;
    const int64_t qw = p->num_heads * D, kvw = p->num_kv_heads * D;
    *bad = -1;
    if (p->head_dim > 512 || p->head_dim % 2) return TT_LAYERS_UNSUPPORTED; /* RoPE's limits */
    if (T > p->num_seqs && (D % TT_VW || p->num_heads % p->num_kv_heads))
        return TT_LAYERS_UNSUPPORTED; /* prompts the flash kernel does not take */
    const int64_t chunk = mlp_chunk(p);
    float *q = work, *k = q + R * qw, *v = k + R * kvw, *attn = v + R * kvw;
    float *sub = attn + R * qw; /* a sublayer's output, before its add to the residual */
    float *gate = sub + R * p->hidden, *up = gate + chunk * p->intermediate;
    float *mid = up + chunk * p->intermediate;
    int code = 0;
    memset(attn + T * qw, 0, (size_t)((R - T) * qw) * sizeof(float)); /* padding rows */
    add_rms_norm(p, residual, NULL, first_norm, out, R);
    for (int64_t i = 0; i < num_layers && !code; i++) {
        const tt_layer *l = &layers[i];
        linear(p, &l->q, out, R, q);
        linear(p, &l->k, out, R, k);
        linear(p, &l->v, out, R, v);
        qk_norm_rope(p, l, q, k, R);
        if (tt_write_kv_f32(k, v, l->k_cache, l->v_cache, p->slots, T, kvw,
                            p->num_blocks * p->block_size, bad)) {
            code = TT_LAYERS_BAD_SLOT;
            break;
        }
        code = tt_paged_decode_f32(q, l->k_cache, l->v_cache, attn, p->cu_seqlens_q, p->seq_lens,
                                   p->block_tables, p->num_seqs, p->max_blocks, p->num_blocks,
                                   p->num_heads, p->num_kv_heads, D, p->block_size, p->scale,
                                   p->num_threads, p->helper, bad);
        if (!code && T > p->num_seqs)
            code = tt_paged_prefill_f32(q, l->k_cache, l->v_cache, attn, p->cu_seqlens_q,
                                        p->seq_lens, p->block_tables, p->num_seqs, p->max_blocks,
                                        p->num_blocks, p->num_heads, p->num_kv_heads, D,
                                        p->block_size, p->scale, p->num_threads, bad);
        if (code) break;
        linear(p, &l->o, attn, R, sub);
        add_rms_norm(p, sub, residual, l->post_norm, out, R);
        for (int64_t r = 0; r < R; r += chunk) { /* the MLP in chunks of rows, as layers.py */
            const int64_t n = R - r < chunk ? R - r : chunk;
            linear(p, &l->gate, out + r * p->hidden, n, gate);
            linear(p, &l->up, out + r * p->hidden, n, up);
            silu_mul(p, gate, up, mid, n * p->intermediate);
            linear(p, &l->down, mid, n, sub + r * p->hidden);
        }
        add_rms_norm(p, sub, residual, l->next_norm, out, R);
    }
    return code;
}
