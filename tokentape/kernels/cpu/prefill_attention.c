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
 * square is never computed. The tile's rows are the lanes of its vectors: its queries are
 * transposed once (head_dim x rows), so the scores S^T = K . Q^T take each key in place from
 * the cache as a broadcast (4 keys x 4 vectors of rows per register block), the softmax runs
 * down the key axis a vector of rows at a time, and O += P . V goes 4 rows x 4 vectors of
 * head_dim (V rows read in place). No key tile is copied or transposed.
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

#include "kernels.h"
#include "vec.h"

enum { PF_OK = 0, PF_BAD_SEQ_LEN = 1, PF_BAD_BLOCK_COUNT = 2, PF_BAD_BLOCK_ID = 3,
       PF_NO_MEMORY = 4, PF_UNSUPPORTED = 5 };

#define KT (4 * TT_VW) /* keys per tile: four vectors */
#define ROWS 64        /* query rows per tile (tokens x heads of a group), about */
#define KG 4           /* keys per register block of the scores */
#if TT_VW == 16
#define RV 4 /* row vectors per register block: KG x RV accumulators (of 32 registers) */
#else
#define RV 2 /* (of 16 registers) */
#endif

/* Keep vectors in registers across the loop body that follows: without it, GCC folds a
 * vector's load into each of the four FMAs that use it, four loads where one does (the
 * products were bound by loads, not by FMAs). */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP_IN_REGISTERS(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))
#define KEEP_IN_REGISTER(a) __asm__("" : "+v"(a))
#else
#define KEEP_IN_REGISTERS(a, b, c, d) ((void)0)
#define KEEP_IN_REGISTER(a) ((void)0)
#endif

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size, tokens_per_tile;
    float scale;
} Prefill;

/* One thread's working memory, sized for the largest tile (R rows: `rows` rounded up to whole
 * vectors). The tile's rows are the lanes of its vectors: qt holds the queries transposed
 * (D x R), s the scores and then the weights of a key tile (KT x R), m, l and alpha a row's
 * running maximum, sum and rescaling; o is row-major (R x D). */
typedef struct {
    float *qt, *s, *o, *m, *l, *alpha, *zero;
    int32_t *pos;
    const float **k, **v; /* the key tile's K and V rows in the cache */
} Scratch;

static inline const float *cache_row(const Prefill *p, const float *cache, const int32_t *table,
                                     int64_t t, int64_t kv_head) {
    const int64_t D = p->head_dim, row = p->num_kv_heads * D;
    const int64_t block = table[t / p->block_size], offset = t % p->block_size;
    return cache + (block * p->block_size + offset) * row + kv_head * D;
}

/* s[t + j][rows of NRV vectors from r0] = k[t + j] . q[row] for the KG keys from t: each key
 * is read in place from the cache, its element d broadcast to every lane, against whole
 * vectors of rows from the queries' transposed copy, so nothing is transposed per key tile.
 * Each score sums over d in order, one FMA per step. Inlined with NRV a constant, so the
 * loops unroll. */
static inline __attribute__((always_inline)) void scores_block(
    const float *restrict qt, const float *const *k, float *restrict s, int64_t R, int64_t D,
    int64_t t, int64_t r0, const int NRV) {
    vf a[KG][RV] = {{{0}}};
    const float *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
    for (int64_t d = 0; d < D; d++) {
        vf qv[RV];
        for (int i = 0; i < NRV; i++) {
            qv[i] = vload(qt + d * R + r0 + i * TT_VW);
            KEEP_IN_REGISTER(qv[i]);
        }
        const float x0 = k0[d], x1 = k1[d], x2 = k2[d], x3 = k3[d];
        for (int i = 0; i < NRV; i++) {
            a[0][i] += x0 * qv[i];
            a[1][i] += x1 * qv[i];
            a[2][i] += x2 * qv[i];
            a[3][i] += x3 * qv[i];
        }
    }
    for (int j = 0; j < KG; j++)
        for (int i = 0; i < NRV; i++) vstore(s + (t + j) * R + r0 + i * TT_VW, a[j][i]);
}

/* Scores of the rows from r0 (nrv vectors, at most RV) against the key tile's n keys. */
static void scores(const float *qt, const float *const *k, float *s, int64_t R, int64_t D,
                   int64_t n, int64_t r0, int64_t nrv) {
    for (int64_t t = 0; t < n; t += KG) {
        switch (nrv) {
        case 1: scores_block(qt, k, s, R, D, t, r0, 1); break;
        case 2: scores_block(qt, k, s, R, D, t, r0, 2); break;
#if RV > 2
        case 3: scores_block(qt, k, s, R, D, t, r0, 3); break;
        case 4: scores_block(qt, k, s, R, D, t, r0, 4); break;
#endif
        }
    }
}

/* Score t of the rows at r: as computed, or -inf where key k0 + t is past the row's position
 * (only in the tiles that hold some row's position: `masked`). */
static inline __attribute__((always_inline)) vf score_at(const Scratch *w, int64_t R, int64_t r,
                                                        vi pos, int64_t k0, int64_t t,
                                                        const int masked) {
    const vf x = vload(w->s + t * R + r);
    return masked ? vselect(pos >= (int32_t)(k0 + t), x, (vf){0} - INFINITY) : x;
}

/* The online softmax of one vector of rows over the key tile (keys k0..k0+n): keys past a
 * row's position get weight exactly 0, the running maximum and sum move on, and alpha gets
 * the factor that rescales what the row has summed so far. Row by lane, so a row's numbers
 * never depend on the other rows of its vector. Four running maxima and sums (keys t, t + 1,
 * t + 2, t + 3), so the loop is not one long chain of dependent additions. */
static inline __attribute__((always_inline)) void softmax_rows_as(Scratch *w, int64_t R, int64_t r,
                                                                 int64_t k0, int64_t n,
                                                                 const int masked) {
    const vf neg_inf = (vf){0} - INFINITY, zero = {0};
    vi pos;
    memcpy(&pos, w->pos + r, sizeof pos);
    const vf m_old = vload(w->m + r);
    vf mx[4] = {m_old, m_old, m_old, m_old};
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
        for (int j = 0; j < 4; j++) mx[j] = vmax(score_at(w, R, r, pos, k0, t + j, masked), mx[j]);
    for (; t < n; t++) mx[0] = vmax(score_at(w, R, r, pos, k0, t, masked), mx[0]);
    const vf m = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
    vf sum[4] = {zero, zero, zero, zero};
    for (t = 0; t < n; t++) {
        const vf x = vload(w->s + t * R + r) - m;
        /* (a masked lane's exp, of anything, is dropped by the select) */
        const vf e = masked ? vselect(pos >= (int32_t)(k0 + t), vexp(x), zero) : vexp(x);
        vstore(w->s + t * R + r, e);
        sum[t & 3] += e;
    }
    /* alpha: 0 for a row with nothing summed yet (its o and l are 0), else exp(old - new). */
    const vf alpha = vselect(m_old > neg_inf, vexp(m_old - m), zero);
    vstore(w->l + r, vload(w->l + r) * alpha + ((sum[0] + sum[1]) + (sum[2] + sum[3])));
    vstore(w->m + r, m);
    vstore(w->alpha + r, alpha);
}

static void softmax_rows(Scratch *w, int64_t R, int64_t r, int64_t k0, int64_t n) {
    if (w->pos[r] < k0 + n - 1) /* the tile holds the position of some row of the vector */
        softmax_rows_as(w, R, r, k0, n, 1);
    else
        softmax_rows_as(w, R, r, k0, n, 0);
}

/* o[r][c0..c0+4 vectors) += sum over t < n of s[t][r] * v[t][...] for rows r..r+3. */
static inline void weighted_values_4(const float *restrict s, const float *const *v, int64_t n,
                                     float *restrict o, int64_t R, int64_t D, int64_t c0) {
    vf a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) a[r][c] = vload(o + r * D + c0 + c * TT_VW);
    for (int64_t t = 0; t < n; t++) {
        const float *vt = v[t] + c0;
        vf v0 = vload(vt), v1 = vload(vt + TT_VW), v2 = vload(vt + 2 * TT_VW);
        vf v3 = vload(vt + 3 * TT_VW);
        KEEP_IN_REGISTERS(v0, v1, v2, v3);
        for (int r = 0; r < 4; r++) {
            const float x = s[t * R + r];
            a[r][0] += x * v0;
            a[r][1] += x * v1;
            a[r][2] += x * v2;
            a[r][3] += x * v3;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) vstore(o + r * D + c0 + c * TT_VW, a[r][c]);
}

/* The same for one vector of head_dim (the tail when head_dim is not a multiple of 4). */
static inline void weighted_values_1(const float *restrict s, const float *const *v, int64_t n,
                                     float *restrict o, int64_t R, int64_t D, int64_t c0) {
    vf a[4];
    for (int r = 0; r < 4; r++) a[r] = vload(o + r * D + c0);
    for (int64_t t = 0; t < n; t++) {
        const vf vt = vload(v[t] + c0);
        for (int r = 0; r < 4; r++) a[r] += s[t * R + r] * vt;
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
    const int64_t rows = tokens * G, R = (rows + TT_VW - 1) / TT_VW * TT_VW;
    const int32_t *table = p->block_tables + seq * p->max_blocks;
    for (int64_t r = 0; r < R; r++) { /* padding rows repeat the last row; never written */
        const int64_t rr = r < rows ? r : rows - 1, tok = t0 + rr / G, head = kv_head * G + rr % G;
        const float *src = p->q + ((q_start + tok) * H + head) * D;
        for (int64_t d = 0; d < D; d++) w->qt[d * R + r] = src[d] * p->scale;
        w->pos[r] = (int32_t)(first_pos + tok);
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, (size_t)(R * D) * sizeof(float));
    const int64_t last = first_pos + t0 + tokens - 1; /* the tile's last position */
    for (int64_t k0 = 0; k0 <= last; k0 += KT) {
        const int64_t n = last + 1 - k0 < KT ? last + 1 - k0 : KT; /* keys read: none past last */
        for (int64_t t = 0; t < n; t++) {
            w->k[t] = cache_row(p, p->k_cache, table, k0 + t, kv_head);
            w->v[t] = cache_row(p, p->v_cache, table, k0 + t, kv_head);
        }
        for (int64_t t = n; t < (n + KG - 1) / KG * KG; t++) w->k[t] = w->zero; /* masked */
        /* Vectors of rows that the tile is wholly past (positions ascend with r) are skipped. */
        int64_t first = 0;
        while (first < R && w->pos[first + TT_VW - 1] < k0) first += TT_VW;
        for (int64_t r0 = first; r0 < R; r0 += RV * TT_VW) {
            const int64_t nrv = (R - r0) / TT_VW < RV ? (R - r0) / TT_VW : RV;
            scores(w->qt, w->k, w->s, R, D, n, r0, nrv);
        }
        for (int64_t r = first; r < R; r += TT_VW) softmax_rows(w, R, r, k0, n);
        for (int64_t r = first; r < R; r++) {
            const float alpha = w->alpha[r];
            if (alpha != 1.0f)
                for (int64_t d = 0; d < D; d++) w->o[r * D + d] *= alpha;
        }
        for (int64_t r = first; r < R; r += 4) {
            int64_t c0 = 0;
            for (; c0 + 4 * TT_VW <= D; c0 += 4 * TT_VW)
                weighted_values_4(w->s + r, w->v, n, w->o + r * D, R, D, c0);
            for (; c0 < D; c0 += TT_VW)
                weighted_values_1(w->s + r, w->v, n, w->o + r * D, R, D, c0);
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
    w->qt = malloc((size_t)(D * rows) * sizeof(float));
    w->s = malloc((size_t)(KT * rows) * sizeof(float));
    w->o = malloc((size_t)(rows * D) * sizeof(float));
    w->m = malloc((size_t)rows * sizeof(float));
    w->l = malloc((size_t)rows * sizeof(float));
    w->alpha = malloc((size_t)rows * sizeof(float));
    w->zero = calloc((size_t)D, sizeof(float));
    w->pos = malloc((size_t)rows * sizeof(int32_t));
    w->k = malloc((size_t)KT * sizeof(float *));
    w->v = malloc((size_t)KT * sizeof(float *));
    return w->qt && w->s && w->o && w->m && w->l && w->alpha && w->zero && w->pos && w->k &&
           w->v;
}

static void scratch_free(Scratch *w) {
    free(w->qt), free(w->s), free(w->o), free(w->m), free(w->l), free(w->alpha), free(w->zero);
    free(w->pos), free((void *)w->k), free((void *)w->v);
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
    const int64_t rows = (tokens_per_tile * G + TT_VW - 1) / TT_VW * TT_VW;
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
