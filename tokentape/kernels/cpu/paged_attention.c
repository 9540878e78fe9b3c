/* Paged attention of decodes on the CPU, float32: the hot loop of a decode step
 * (tokentape/kernels/cpu_native.py compiles it at first use and calls it through ctypes,
 * without the GIL).
 *
 * Same contract as paged_attention_ref (tokentape/kernels/reference.py), its oracle in the
 * tests, for the sequences with exactly one new token: that token sits at position
 * seq_len - 1 and attends to every position of the sequence, whose K/V (its own included)
 * are already in the cache. Sequences with more new tokens (prompts, prefill chunks) are
 * skipped, their rows of `out` left as they are: the caller computes them with a few large
 * matmuls, which beat per-row dot products there. Caches are
 * [num_blocks, block_size, num_kv_heads, head_dim], contiguous; query head h reads kv head
 * h / (num_heads / num_kv_heads).
 *
 * It reads K/V in place from the cache blocks (the reference gathers a copy of every
 * sequence's blocks first). A decode step is memory-bound: each K/V row is read once, for
 * every head that reads it. Sequences are shared out over OpenMP threads, or with a helper
 * thread (helper.c); each is computed the same way whatever else is in the batch and
 * whichever thread runs it, so a sequence's result never depends on its batch (batch
 * invariance). Two passes per sequence: scores (q . k, then an exact softmax), then the
 * probability-weighted sum of V rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

enum { TT_OK = 0, TT_BAD_SEQ_LEN = 1, TT_BAD_BLOCK_COUNT = 2, TT_BAD_BLOCK_ID = 3, TT_NO_MEMORY = 4 };

/* exp(x) for x <= 0 (scores minus their maximum), Cephes' expf polynomial: within 2 ulp of
 * expf, written so that the loops calling it vectorise (no libm call per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    float z = x * x;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

static void softmax_in_place(float *restrict s, int64_t n) {
    const float m = vmax_array(s, n, -INFINITY);
    float sum = 0.0f;
    int64_t t = 0;
    if (n >= TT_VW) {
        vf sv = {0};
        for (; t + TT_VW <= n; t += TT_VW) {
            vf e = vexp(vload(s + t) - m); /* every input <= 0: vexp's upper clamp never acts */
            vstore(s + t, e);
            sv += e;
        }
        sum = vsum(sv);
    }
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* The cache blocks of a sequence lie anywhere in memory, so the hardware prefetcher starts
 * cold on each one: where a block is short (rows of a few hundred bytes, 8 KB a block of 16),
 * its cold start is much of the block. Reading token t, the walk asks for the row
 * PREFETCH_BYTES of rows further on, wherever its block is. A walk's first rows up to there
 * are asked for before it starts: K's at once, V's by K's last rows. Rows longer than
 * PREFETCH_BYTES (4 KB for Qwen3-0.6B's 8 kv heads of 128) are left to the hardware: their
 * 64 KB blocks stream well, and asking for every line of them made the decodes' reads from
 * memory 20% slower (18.3 against 22.6 GB/s on two threads); rows of 512 bytes read from L3
 * 5% faster four rows further on than sixteen (18.8 against 17.9 GB/s), 10% slower without. */
#define PREFETCH_BYTES 2048

static inline void prefetch_row(const float *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 0, 3);
}

/* A position in a sequence's rows of one cache (K or V): block b of its table, `in_block`
 * floats into it (NULL block: past the sequence's last block). */
typedef struct {
    const float *block;
    int64_t b, in_block;
} Cursor;

/* A sequence's rows of one cache, token by token in block order: next_row() gives the next
 * token's row (every kv head of it) and prefetches the row PREFETCH_BYTES further on. Past
 * its last rows it prefetches the first rows of `then`, the walk read next (a sequence's V
 * after its K), which no walk would otherwise ask for before reading them. */
typedef struct RowWalk {
    const float *cache;
    const int32_t *table;
    int64_t num_blocks, block_floats, row_stride, row_bytes;
    Cursor read, ahead, lead;      /* lead: the first rows, asked for before they are read */
    int64_t ahead_rows, lead_rows; /* rows `ahead` and `lead` have still to ask for */
    struct RowWalk *then;
} RowWalk;

static inline const float *block_at(const RowWalk *w, int64_t b) {
    return b < w->num_blocks ? w->cache + (int64_t)w->table[b] * w->block_floats : NULL;
}

static inline Cursor cursor_at(const RowWalk *w, int64_t token, int64_t block_size) {
    const int64_t b = token / block_size;
    return (Cursor){block_at(w, b), b, (token % block_size) * w->row_stride};
}

static inline void advance(const RowWalk *w, Cursor *c) {
    c->in_block += w->row_stride;
    if (c->in_block == w->block_floats) {
        c->block = block_at(w, ++c->b);
        c->in_block = 0;
    }
}

static inline RowWalk row_walk(const float *cache, const int32_t *table, int64_t seq_len,
                               int64_t block_size, int64_t row_stride) {
    RowWalk w = {cache, table, (seq_len + block_size - 1) / block_size, block_size * row_stride,
                 row_stride, row_stride * (int64_t)sizeof(float)};
    w.read = w.lead = cursor_at(&w, 0, block_size);
    const int64_t ahead = PREFETCH_BYTES / w.row_bytes; /* 0: none asked for */
    w.ahead = cursor_at(&w, ahead, block_size);
    w.ahead_rows = ahead && seq_len > ahead ? seq_len - ahead : 0;
    w.lead_rows = seq_len < ahead ? seq_len : ahead;
    return w;
}

/* Ask for the next of the walk's first rows. */
static inline void prefetch_lead_row(RowWalk *w) {
    prefetch_row(w->lead.block + w->lead.in_block, w->row_bytes);
    advance(w, &w->lead);
    w->lead_rows--;
}

static inline const float *next_row(RowWalk *w) {
    const float *row = w->read.block + w->read.in_block;
    advance(w, &w->read);
    if (w->ahead_rows) {
        prefetch_row(w->ahead.block + w->ahead.in_block, w->row_bytes);
        advance(w, &w->ahead);
        w->ahead_rows--;
    } else if (w->then && w->then->lead_rows) {
        prefetch_lead_row(w->then);
    }
    return row;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Problem;

/* The walks over a sequence's K rows and then its V rows: K's first rows asked for at once,
 * V's by K's last rows (RowWalk.then). */
static inline void start_walks(const Problem *p, const int32_t *table, int64_t seq_len,
                               int64_t row_stride, RowWalk *keys, RowWalk *values) {
    *keys = row_walk(p->k_cache, table, seq_len, p->block_size, row_stride);
    *values = row_walk(p->v_cache, table, seq_len, p->block_size, row_stride);
    while (keys->lead_rows) prefetch_lead_row(keys);
    keys->then = values;
}

/* One decode with head_dim = TT_VW * DV: the sequence's K rows, then its V rows, read once
 * each, token by token in cache-block order (each token's row holds every kv head, so a block
 * is one contiguous stream; see RowWalk). Bound by memory when the rows come from it, by the
 * arithmetic when they are in the caches (a step's K/V often is, for a small model), so the
 * arithmetic works on TT_VW tokens at a time:
 * - scores: a head's TT_VW dot products are summed across lanes by one vsum_each (a vsum
 *   each would take three times the shuffles) and stored as one vector;
 * - outputs: a head's accumulators stay in registers over the TT_VW rows (kept in memory,
 *   each would take a store and a reload on every row's critical path).
 * Every score and output is the same sum, in the same order, as one token at a time (vsum's
 * pairs; V rows added in token order), which the tail still does. Inlined with DV a
 * constant, so the loops over a head's vectors unroll. */
static inline __attribute__((always_inline)) void attend_decode_vec(
    const Problem *p, int64_t seq, float *scores, float *qbuf, float *acc, const int64_t DV) {
    const int64_t H = p->num_heads, D = TT_VW * DV, Hkv = p->num_kv_heads;
    const int64_t G = H / Hkv, row_stride = Hkv * D;
    const int64_t row = p->cu_seqlens_q[seq], seq_len = p->seq_lens[seq];
    const int32_t *table = p->block_tables + seq * p->max_blocks;
    const float *q = p->q + row * H * D;
    for (int64_t i = 0; i < H * D; i++) qbuf[i] = q[i] * p->scale;
    RowWalk keys, values;
    start_walks(p, table, seq_len, row_stride, &keys, &values);
    const float *rows[TT_VW];
    int64_t t = 0;
    for (; t + TT_VW <= seq_len; t += TT_VW) { /* scores[h][t .. t + TT_VW) */
        for (int i = 0; i < TT_VW; i++) rows[i] = next_row(&keys);
        for (int64_t h = 0; h < H; h++) {
            const float *qh = qbuf + h * D;
            const int64_t kv_at = (h / G) * D;
            vf dots[TT_VW];
            for (int i = 0; i < TT_VW; i++) {
                const float *k = rows[i] + kv_at;
                vf a = vload(qh) * vload(k);
                for (int64_t c = 1; c < DV; c++) a += vload(qh + TT_VW * c) * vload(k + TT_VW * c);
                dots[i] = a;
            }
            vstore(scores + h * seq_len + t, vsum_each(dots));
        }
    }
    for (; t < seq_len; t++) { /* the last rows, one at a time */
        const float *krow = next_row(&keys);
        for (int64_t j = 0; j < Hkv; j++) {
            vf kv[DV];
            for (int64_t c = 0; c < DV; c++) kv[c] = vload(krow + j * D + TT_VW * c);
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                const float *qh = qbuf + h * D;
                vf a = vload(qh) * kv[0];
                for (int64_t c = 1; c < DV; c++) a += vload(qh + TT_VW * c) * kv[c];
                scores[h * seq_len + t] = vsum(a);
            }
        }
    }
    for (int64_t h = 0; h < H; h++) softmax_in_place(scores + h * seq_len, seq_len);
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (t = 0; t + TT_VW <= seq_len; t += TT_VW) { /* acc[h] += p[h][t] * v[t], in t's order */
        for (int i = 0; i < TT_VW; i++) rows[i] = next_row(&values);
        for (int64_t h = 0; h < H; h++) {
            const float *w = scores + h * seq_len + t;
            const int64_t kv_at = (h / G) * D;
            float *o = acc + h * D;
            vf sum[DV];
            for (int64_t c = 0; c < DV; c++) sum[c] = vload(o + TT_VW * c);
            for (int i = 0; i < TT_VW; i++) {
                const float *v = rows[i] + kv_at;
                for (int64_t c = 0; c < DV; c++) sum[c] += w[i] * vload(v + TT_VW * c);
            }
            for (int64_t c = 0; c < DV; c++) vstore(o + TT_VW * c, sum[c]);
        }
    }
    for (; t < seq_len; t++) {
        const float *vrow = next_row(&values);
        for (int64_t j = 0; j < Hkv; j++) {
            vf vv[DV];
            for (int64_t c = 0; c < DV; c++) vv[c] = vload(vrow + j * D + TT_VW * c);
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                const float w = scores[h * seq_len + t];
                float *o = acc + h * D;
                for (int64_t c = 0; c < DV; c++) vstore(o + TT_VW * c, vload(o + TT_VW * c) + w * vv[c]);
            }
        }
    }
    memcpy(p->out + row * H * D, acc, (size_t)(H * D) * sizeof(float));
}

/* One decode, every head, any head_dim. `scores` holds num_heads x seq_len floats, `qbuf` and
 * `acc` num_heads x head_dim. */
static void attend_decode_any(const Problem *p, int64_t seq, float *scores, float *qbuf, float *acc) {
    const int64_t H = p->num_heads, D = p->head_dim;
    const int64_t G = H / p->num_kv_heads, row_stride = p->num_kv_heads * D;
    const int64_t row = p->cu_seqlens_q[seq], seq_len = p->seq_lens[seq];
    const int32_t *table = p->block_tables + seq * p->max_blocks;

    const float *q = p->q + row * H * D;
    for (int64_t i = 0; i < H * D; i++) qbuf[i] = q[i] * p->scale;
    RowWalk keys, values;
    start_walks(p, table, seq_len, row_stride, &keys, &values);
    for (int64_t t = 0; t < seq_len; t++) { /* scores[h][t] */
        const float *krow = next_row(&keys);
        for (int64_t h = 0; h < H; h++) scores[h * seq_len + t] = vdot(qbuf + h * D, krow + (h / G) * D, D);
    }
    for (int64_t h = 0; h < H; h++) softmax_in_place(scores + h * seq_len, seq_len);
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t t = 0; t < seq_len; t++) { /* acc[h] = sum over t of p[h][t] * v[t] */
        const float *vrow = next_row(&values);
        for (int64_t h = 0; h < H; h++) {
            const float w = scores[h * seq_len + t];
            float *restrict o = acc + h * D;
            const float *restrict v = vrow + (h / G) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
        }
    }
    memcpy(p->out + row * H * D, acc, (size_t)(H * D) * sizeof(float));
}

/* A decode job's sequences in items of `per_item`, for tt_helper_run; each worker's score and
 * accumulator buffers its own. */
typedef struct {
    const Problem *p;
    int64_t num_seqs, per_item;
    float *scores[2], *qbuf[2], *acc[2];
} DecodeItems;

static void attend_decode(const Problem *p, int64_t b, float *scores, float *qbuf, float *acc) {
    if (p->cu_seqlens_q[b + 1] - p->cu_seqlens_q[b] != 1) return;
    switch (p->head_dim) { /* the usual head sizes, specialised (each a multiple of TT_VW) */
    case 64: attend_decode_vec(p, b, scores, qbuf, acc, 64 / TT_VW); break;
    case 128: attend_decode_vec(p, b, scores, qbuf, acc, 128 / TT_VW); break;
    case 32: attend_decode_vec(p, b, scores, qbuf, acc, 32 / TT_VW); break;
    case 16: attend_decode_vec(p, b, scores, qbuf, acc, 16 / TT_VW); break;
    default: attend_decode_any(p, b, scores, qbuf, acc);
    }
}

static void decode_item(void *ctx, int64_t item, int worker) {
    const DecodeItems *d = ctx;
    const int64_t end = (item + 1) * d->per_item < d->num_seqs ? (item + 1) * d->per_item : d->num_seqs;
    for (int64_t b = item * d->per_item; b < end; b++)
        attend_decode(d->p, b, d->scores[worker], d->qbuf[worker], d->acc[worker]);
}

/* The decodes shared with a helper thread (helper.c), in items of a few sequences: enough
 * items that a helper joining late still finds some, few enough that claiming them is cheap. */
static int decode_with_helper(const Problem *p, int64_t num_seqs, int64_t max_seq_len,
                              tt_helper *helper) {
    DecodeItems d = {p, num_seqs, num_seqs > 64 ? (num_seqs + 63) / 64 : 1, {0}, {0}, {0}};
    int failed = 0;
    for (int w = 0; w < 2; w++) {
        d.scores[w] = malloc((size_t)(p->num_heads * max_seq_len) * sizeof(float));
        d.qbuf[w] = malloc((size_t)(p->num_heads * p->head_dim) * sizeof(float));
        d.acc[w] = malloc((size_t)(p->num_heads * p->head_dim) * sizeof(float));
        failed |= !d.scores[w] || !d.qbuf[w] || !d.acc[w];
    }
    if (!failed) tt_helper_run(helper, decode_item, &d, (num_seqs + d.per_item - 1) / d.per_item);
    for (int w = 0; w < 2; w++) {
        free(d.scores[w]);
        free(d.qbuf[w]);
        free(d.acc[w]);
    }
    return failed ? TT_NO_MEMORY : TT_OK;
}

/* Returns 0, or an error code with *bad_seq set to the offending sequence (nothing written).
 * The decodes run on `num_threads` OpenMP threads, or with `helper` (not NULL) on the calling
 * thread and the helper's. */
int tt_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                        const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                        const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                        int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads,
                        tt_helper *helper, int64_t *bad_seq) {
    int64_t num_decodes = 0, max_seq_len = 1;
    for (int64_t b = 0; b < num_seqs; b++) { /* check everything before anything is read */
        const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], seq_len = seq_lens[b];
        *bad_seq = b;
        if (q_len < 0 || q_len > seq_len) return TT_BAD_SEQ_LEN;
        if (q_len != 1) continue;
        const int64_t blocks = (seq_len + block_size - 1) / block_size;
        if (blocks > max_blocks) return TT_BAD_BLOCK_COUNT;
        for (int64_t i = 0; i < blocks; i++) {
            const int32_t id = block_tables[b * max_blocks + i];
            if (id < 0 || id >= num_blocks) return TT_BAD_BLOCK_ID;
        }
        num_decodes++;
        max_seq_len = seq_len > max_seq_len ? seq_len : max_seq_len;
    }
    *bad_seq = -1;
    const Problem p = {q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
                       max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale};
    if (helper && num_decodes > 1) return decode_with_helper(&p, num_seqs, max_seq_len, helper);
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) if (num_decodes > 1)
    {
        float *scores = malloc((size_t)(num_heads * max_seq_len) * sizeof(float));
        float *qbuf = malloc((size_t)(num_heads * head_dim) * sizeof(float));
        float *acc = malloc((size_t)(num_heads * head_dim) * sizeof(float));
        if (!scores || !qbuf || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t b = 0; b < num_seqs; b++) {
            int skip;
#pragma omp atomic read
            skip = failed;
            if (!skip) attend_decode(&p, b, scores, qbuf, acc);
        }
        free(scores);
        free(qbuf);
        free(acc);
    }
    return failed ? TT_NO_MEMORY : TT_OK;
}

/* The KV-cache write: key/value rows [num_tokens, row] (row = num_kv_heads * head_dim) into
 * their slots of the caches (slot = block_id * block_size + offset); a slot of -1 is skipped.
 * Returns 0, or TT_BAD_BLOCK_ID with *bad_token set if a slot is outside the cache (nothing
 * written). */
int tt_write_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache,
                    const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots,
                    int64_t *bad_token) {
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < -1 || slots[i] >= num_slots) {
            *bad_token = i;
            return TT_BAD_BLOCK_ID;
        }
    }
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        memcpy(k_cache + slots[i] * row, key + i * row, (size_t)row * sizeof(float));
        memcpy(v_cache + slots[i] * row, value + i * row, (size_t)row * sizeof(float));
    }
    return TT_OK;
}
