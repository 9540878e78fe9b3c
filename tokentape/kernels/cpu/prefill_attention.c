/* Paged attention of prompts and prefill chunks on the CPU, float32 (tokentape/kernels/
 * cpu_native.py compiles it with paged_attention.c and calls it through ctypes, without the
 * GIL).
 *
 * Same contract as paged_attention_ref (tokentape/kernels/reference.py), its oracle in the
 * tests, for the sequences with more than one new token: the j-th new token of sequence b sits
 * at position seq_len - q_len + j and attends to every position up to its own, whose K/V are
 * already in the cache. Sequences with one new token (decodes) are skipped, their rows of
 * `out` left as they are. Caches are [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous; query head h reads kv head h / (num_heads / num_kv_heads).
 *
 * Flash attention: a tile of query rows (QT tokens x the G query heads that share a kv head)
 * goes over the keys a tile of KT at a time, with a running maximum and sum per row (online
 * softmax), so the scores never leave the core's cache and the masked half of the causal
 * square is never computed. Two register-blocked products per tile: scores = Q . K^T
 * (4 rows x 4 vectors of keys, from a transposed copy of the key tile) and O += P . V (4 rows
 * x 4 vectors of head_dim, V rows read in place from the cache).
 *
 * Key tiles start at multiples of KT from position 0, and a row skips every tile past its own
 * position, so each row's result depends only on its own query and its context: not on the
 * other sequences of the batch, nor on how its prompt was cut into chunks (batch invariance).
 * Work items (sequence, kv head, query tile) are shared out over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

enum { PF_OK = 0, PF_BAD_SEQ_LEN = 1, PF_BAD_BLOCK_COUNT = 2, PF_BAD_BLOCK_ID = 3,
       PF_NO_MEMORY = 4, PF_UNSUPPORTED = 5 };

#define KT (4 * TT_VW) /* keys per tile: four vectors */
#define ROWS 64        /* query rows per tile (tokens x heads of a group), about */

/* Keep four vectors in registers across the loop body that follows: without it, GCC folds a
 * vector's load into each of the four FMAs that use it, four loads where one does (the
 * products were bound by loads, not by FMAs). */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP_IN_REGISTERS(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))
#else
#define KEEP_IN_REGISTERS(a, b, c, d) ((void)0)
#endif

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size, tokens_per_tile;
    float scale;
} Prefill;

typedef struct { /* one thread's working memory, sized for the largest tile */
    float *q, *kt, *s, *o, *m, *l;
    int64_t *pos;
    const float **v;
} Scratch;

static inline const float *cache_row(const Prefill *p, const float *cache, const int32_t *table,
                                     int64_t t, int64_t kv_head) {
    const int64_t D = p->head_dim, row = p->num_kv_heads * D;
    const int64_t block = table[t / p->block_size], offset = t % p->block_size;
    return cache + (block * p->block_size + offset) * row + kv_head * D;
}

/* s[r][0..KT) = q[r] . kt[.][0..KT) for rows r0..r0+3 (kt: D x KT, the key tile transposed). */
static inline void scores_4x4(const float *restrict q, const float *restrict kt, float *restrict s,
                              int64_t D) {
    vf a[4][4] = {{0}};
    for (int64_t d = 0; d < D; d++) {
        vf k0 = vload(kt + d * KT), k1 = vload(kt + d * KT + TT_VW);
        vf k2 = vload(kt + d * KT + 2 * TT_VW), k3 = vload(kt + d * KT + 3 * TT_VW);
        KEEP_IN_REGISTERS(k0, k1, k2, k3);
        for (int r = 0; r < 4; r++) {
            const float x = q[r * D + d];
            a[r][0] += x * k0;
            a[r][1] += x * k1;
            a[r][2] += x * k2;
            a[r][3] += x * k3;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) vstore(s + r * KT + c * TT_VW, a[r][c]);
}

/* o[r][c0..c0+nv vectors) += sum over t < n of s[r][t] * v[t][...] for rows r0..r0+3. */
static inline void weighted_values_4(const float *restrict s, const float *const *v, int64_t n,
                                     float *restrict o, int64_t D, int64_t c0) {
    vf a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) a[r][c] = vload(o + r * D + c0 + c * TT_VW);
    for (int64_t t = 0; t < n; t++) {
        const float *vt = v[t] + c0;
        const vf v0 = vload(vt), v1 = vload(vt + TT_VW), v2 = vload(vt + 2 * TT_VW);
        const vf v3 = vload(vt + 3 * TT_VW);
        for (int r = 0; r < 4; r++) {
            const float w = s[r * KT + t];
            a[r][0] += w * v0;
            a[r][1] += w * v1;
            a[r][2] += w * v2;
            a[r][3] += w * v3;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) vstore(o + r * D + c0 + c * TT_VW, a[r][c]);
}

/* The same for one vector of head_dim (the tail when head_dim is not a multiple of 4). */
static inline void weighted_values_1(const float *restrict s, const float *const *v, int64_t n,
                                     float *restrict o, int64_t D, int64_t c0) {
    vf a[4];
    for (int r = 0; r < 4; r++) a[r] = vload(o + r * D + c0);
    for (int64_t t = 0; t < n; t++) {
        const vf vt = vload(v[t] + c0);
        for (int r = 0; r < 4; r++) a[r] += s[r * KT + t] * vt;
    }
    for (int r = 0; r < 4; r++) vstore(o + r * D + c0, a[r]);
}

/* Rows r of a tile: query token r / G of the tile, query head kv_head * G + r % G. */
static void attend_tile(const Prefill *p, int64_t seq, int64_t kv_head, int64_t tile, Scratch *w) {
    const int64_t H = p->num_heads, D = p->head_dim, G = H / p->num_kv_heads;
    const int64_t q_start = p->cu_seqlens_q[seq], q_len = p->cu_seqlens_q[seq + 1] - q_start;
    const int64_t seq_len = p->seq_lens[seq], first_pos = seq_len - q_len;
    const int64_t t0 = tile * p->tokens_per_tile;
    const int64_t tokens = q_len - t0 < p->tokens_per_tile ? q_len - t0 : p->tokens_per_tile;
    const int64_t rows = tokens * G, padded = (rows + 3) & ~(int64_t)3;
    const int32_t *table = p->block_tables + seq * p->max_blocks;
    for (int64_t r = 0; r < padded; r++) { /* padding rows repeat the last row; never written */
        const int64_t rr = r < rows ? r : rows - 1, tok = t0 + rr / G, head = kv_head * G + rr % G;
        const float *src = p->q + ((q_start + tok) * H + head) * D;
        for (int64_t d = 0; d < D; d++) w->q[r * D + d] = src[d] * p->scale;
        w->pos[r] = first_pos + tok;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, (size_t)(padded * D) * sizeof(float));
    const int64_t last = first_pos + t0 + tokens - 1; /* the tile's last position */
    for (int64_t k0 = 0; k0 <= last; k0 += KT) {
        const int64_t n = last + 1 - k0 < KT ? last + 1 - k0 : KT; /* keys read: none past last */
        for (int64_t t = 0; t < n; t++) {
            const float *k = cache_row(p, p->k_cache, table, k0 + t, kv_head);
            for (int64_t d = 0; d < D; d++) w->kt[d * KT + t] = k[d];
            w->v[t] = cache_row(p, p->v_cache, table, k0 + t, kv_head);
        }
        for (int64_t t = n; t < KT; t++)
            for (int64_t d = 0; d < D; d++) w->kt[d * KT + t] = 0.0f;
        for (int64_t r = 0; r < padded; r += 4) {
            if (w->pos[r] < k0 && w->pos[r + 3] < k0) continue; /* the tile is past all four */
            scores_4x4(w->q + r * D, w->kt, w->s, D);
            for (int i = 0; i < 4; i++) { /* mask, online softmax: scores become weights */
                float *s = w->s + i * KT;
                const int64_t valid = w->pos[r + i] - k0 + 1; /* keys this row sees here */
                if (valid <= 0) { /* none: the row is left as it is (zero weights) */
                    memset(s, 0, KT * sizeof(float));
                    continue;
                }
                const int64_t nv = valid < n ? valid : n;
                const int64_t whole = nv / TT_VW * TT_VW; /* keys in whole vectors */
                /* by vectors: a scalar loop here cost as much as the products */
                const float mx = vmax_array(s, nv, w->m[r + i]);
                const float alpha = w->m[r + i] == -INFINITY ? 0.0f : expf(w->m[r + i] - mx);
                vf acc = {0};
                for (int64_t t = 0; t < whole; t += TT_VW) {
                    const vf e = vexp(vload(s + t) - mx);
                    vstore(s + t, e);
                    acc += e;
                }
                float sum = vsum(acc);
                int64_t t = whole;
                for (; t < nv; t++) {
                    s[t] = expf(s[t] - mx);
                    sum += s[t];
                }
                for (; t < KT; t++) s[t] = 0.0f;
                w->m[r + i] = mx;
                w->l[r + i] = w->l[r + i] * alpha + sum;
                if (alpha != 1.0f) {
                    float *o = w->o + (r + i) * D;
                    for (int64_t d = 0; d < D; d++) o[d] *= alpha;
                }
            }
            int64_t c0 = 0;
            for (; c0 + 4 * TT_VW <= D; c0 += 4 * TT_VW)
                weighted_values_4(w->s, w->v, n, w->o + r * D, D, c0);
            for (; c0 < D; c0 += TT_VW) weighted_values_1(w->s, w->v, n, w->o + r * D, D, c0);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t tok = t0 + r / G, head = kv_head * G + r % G;
        float *dst = p->out + ((q_start + tok) * H + head) * D;
        const float inv = 1.0f / w->l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = w->o[r * D + d] * inv;
    }
}

static int scratch_alloc(Scratch *w, int64_t rows, int64_t D) {
    w->q = malloc((size_t)(rows * D) * sizeof(float));
    w->o = malloc((size_t)(rows * D) * sizeof(float));
    w->kt = malloc((size_t)(D * KT) * sizeof(float));
    w->s = malloc((size_t)(4 * KT) * sizeof(float));
    w->m = malloc((size_t)rows * sizeof(float));
    w->l = malloc((size_t)rows * sizeof(float));
    w->pos = malloc((size_t)rows * sizeof(int64_t));
    w->v = malloc((size_t)KT * sizeof(float *));
    return w->q && w->o && w->kt && w->s && w->m && w->l && w->pos && w->v;
}

static void scratch_free(Scratch *w) {
    free(w->q), free(w->o), free(w->kt), free(w->s), free(w->m), free(w->l), free(w->pos);
    free((void *)w->v);
}

/* Returns 0, or an error code with *bad_seq set to the offending sequence (nothing written).
 * PF_UNSUPPORTED: head_dim is not a multiple of the vector width (the caller falls back). */
int tt_paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                         const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                         const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                         int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads,
                         int64_t *bad_seq) {
    *bad_seq = -1;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return PF_UNSUPPORTED;
    const int64_t G = num_heads / num_kv_heads;
    const int64_t tokens_per_tile = ROWS / G > 0 ? ROWS / G : 1;
    int64_t num_items = 0;
    for (int64_t b = 0; b < num_seqs; b++) { /* check everything before anything is read */
        const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], seq_len = seq_lens[b];
        *bad_seq = b;
        if (q_len < 0 || q_len > seq_len) return PF_BAD_SEQ_LEN;
        if (q_len <= 1) continue;
        const int64_t blocks = (seq_len + block_size - 1) / block_size;
        if (blocks > max_blocks) return PF_BAD_BLOCK_COUNT;
        for (int64_t i = 0; i < blocks; i++) {
            const int32_t id = block_tables[b * max_blocks + i];
            if (id < 0 || id >= num_blocks) return PF_BAD_BLOCK_ID;
        }
        num_items += num_kv_heads * ((q_len + tokens_per_tile - 1) / tokens_per_tile);
    }
    *bad_seq = -1;
    if (num_items == 0) return PF_OK;
    if (head_dim % TT_VW != 0) return PF_UNSUPPORTED; /* checked, for the caller's fallback */
    /* Work items in order: (sequence, query tile, kv head); index -> item by a prefix walk. */
    int64_t *item_seq = malloc((size_t)num_items * sizeof(int64_t));
    int64_t *item_tile = malloc((size_t)num_items * sizeof(int64_t));
    if (!item_seq || !item_tile) {
        free(item_seq), free(item_tile);
        return PF_NO_MEMORY;
    }
    int64_t k = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        if (q_len <= 1) continue;
        for (int64_t t = 0; t * tokens_per_tile < q_len; t++)
            for (int64_t j = 0; j < num_kv_heads; j++, k++) item_seq[k] = b, item_tile[k] = t;
    }
    const Prefill p = {q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
                       max_blocks, num_heads, num_kv_heads, head_dim, block_size,
                       tokens_per_tile, scale};
    const int64_t rows = ((tokens_per_tile * G) + 3) & ~(int64_t)3;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) if (num_items > 1)
    {
        Scratch w;
        if (!scratch_alloc(&w, rows, head_dim)) {
#pragma omp atomic write
            failed = 1;
        }
        /* Heaviest first (later tiles see more keys): walk the items from the end. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = num_items - 1; i >= 0; i--) {
            int skip;
#pragma omp atomic read
            skip = failed;
            if (!skip) attend_tile(&p, item_seq[i], i % num_kv_heads, item_tile[i], &w);
        }
        scratch_free(&w);
    }
    free(item_seq), free(item_tile);
    return failed ? PF_NO_MEMORY : PF_OK;
}
