/* Paged attention on the CPU, float32: the engine's CPU kernel (tokentape/kernels/cpu_native.py
 * compiles it at first use and calls it through ctypes, without the GIL).
 *
 * Same contract as paged_attention_ref (tokentape/kernels/reference.py), its oracle in the
 * tests: B sequences, each with q_len new tokens (a decode: 1) whose K/V are already in the
 * cache; the j-th new token of sequence b sits at position seq_len - q_len + j and attends to
 * the positions up to its own. Caches are [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous; query head h reads kv head h / (num_heads / num_kv_heads).
 *
 * It reads K/V in place from the cache blocks (the reference gathers a copy of every
 * sequence's blocks first, which is what made it memory-bound). One work item is a sequence
 * and a tile of its new tokens, all heads: every K/V row read serves each query of the tile.
 * Work items are shared out over OpenMP threads; each is computed the same way whatever else
 * is in the batch and whichever thread runs it, so a sequence's result never depends on its
 * batch (batch invariance). Two passes per item: scores (q . k, exact softmax over them), then
 * the probability-weighted sum of V rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Queries per work item in a prefill tile (rows x heads), bounding the score buffer. */
#define TILE_QUERIES 32

enum { TT_OK = 0, TT_BAD_SEQ_LEN = 1, TT_BAD_BLOCK_COUNT = 2, TT_BAD_BLOCK_ID = 3, TT_NO_MEMORY = 4 };

typedef struct {
    int32_t seq;
    int32_t row_begin; /* first new token of the tile, 0-based within the sequence's new tokens */
    int32_t row_end;
} Item;

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

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
    float m = -INFINITY;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Problem;

/* One item: queries of rows [row_begin, row_end) of sequence `seq`, every head. `scores` holds
 * TILE_QUERIES x seq_len floats, `qbuf` and `acc` TILE_QUERIES x head_dim. */
static void attend_item(const Problem *p, Item it, float *scores, float *qbuf, float *acc) {
    const int64_t H = p->num_heads, D = p->head_dim, BS = p->block_size;
    const int64_t G = H / p->num_kv_heads, row_stride = p->num_kv_heads * D;
    const int64_t q_start = p->cu_seqlens_q[it.seq];
    const int64_t q_len = p->cu_seqlens_q[it.seq + 1] - q_start;
    const int64_t base = p->seq_lens[it.seq] - q_len; /* position of the first new token */
    const int64_t rows = it.row_end - it.row_begin, nq = rows * H;
    const int64_t key_end = base + it.row_end; /* one past the tile's last position */
    const int32_t *table = p->block_tables + (int64_t)it.seq * p->max_blocks;

    for (int64_t r = 0; r < rows; r++) { /* scaled queries, [rows * H, D] */
        const float *src = p->q + (q_start + it.row_begin + r) * H * D;
        for (int64_t i = 0; i < H * D; i++) qbuf[r * H * D + i] = src[i] * p->scale;
    }
    /* Pass 1: scores[query][t] for the keys each query may see (t <= its position). */
    for (int64_t t = 0; t < key_end; t++) {
        const float *krow = p->k_cache + ((int64_t)table[t / BS] * BS + t % BS) * row_stride;
        int64_t first = t - base - it.row_begin; /* first row whose position reaches t */
        for (int64_t r = first < 0 ? 0 : first; r < rows; r++)
            for (int64_t h = 0; h < H; h++)
                scores[(r * H + h) * key_end + t] = dot(qbuf + (r * H + h) * D, krow + (h / G) * D, D);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < H; h++) softmax_in_place(scores + (r * H + h) * key_end, base + it.row_begin + r + 1);
    /* Pass 2: acc[query] = sum over its keys of p[t] * v[t]. */
    memset(acc, 0, (size_t)(nq * D) * sizeof(float));
    for (int64_t t = 0; t < key_end; t++) {
        const float *vrow = p->v_cache + ((int64_t)table[t / BS] * BS + t % BS) * row_stride;
        int64_t first = t - base - it.row_begin;
        for (int64_t r = first < 0 ? 0 : first; r < rows; r++)
            for (int64_t h = 0; h < H; h++) {
                const float w = scores[(r * H + h) * key_end + t];
                float *restrict o = acc + (r * H + h) * D;
                const float *restrict v = vrow + (h / G) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
            }
    }
    float *dst = p->out + (q_start + it.row_begin) * H * D;
    memcpy(dst, acc, (size_t)(nq * D) * sizeof(float));
}

/* Returns 0, or an error code with *bad_seq set to the offending sequence (nothing written). */
int tt_paged_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                           const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                           const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                           int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int num_threads,
                           int64_t *bad_seq) {
    const int64_t rows_per_tile = num_heads >= TILE_QUERIES ? 1 : TILE_QUERIES / num_heads;
    int64_t num_items = 0, max_seq_len = 1;
    for (int64_t b = 0; b < num_seqs; b++) { /* check everything before anything is read */
        const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], seq_len = seq_lens[b];
        *bad_seq = b;
        if (q_len < 0 || q_len > seq_len) return TT_BAD_SEQ_LEN;
        if (q_len == 0) continue;
        const int64_t blocks = (seq_len + block_size - 1) / block_size;
        if (blocks > max_blocks) return TT_BAD_BLOCK_COUNT;
        for (int64_t i = 0; i < blocks; i++) {
            const int32_t id = block_tables[b * max_blocks + i];
            if (id < 0 || id >= num_blocks) return TT_BAD_BLOCK_ID;
        }
        num_items += (q_len + rows_per_tile - 1) / rows_per_tile;
        max_seq_len = seq_len > max_seq_len ? seq_len : max_seq_len;
    }
    *bad_seq = -1;
    Item *items = malloc((size_t)(num_items ? num_items : 1) * sizeof(Item));
    if (!items) return TT_NO_MEMORY;
    int64_t n = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int32_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        for (int32_t r = 0; r < q_len; r += (int32_t)rows_per_tile) {
            items[n++] = (Item){(int32_t)b, r, r + (int32_t)rows_per_tile < q_len ? r + (int32_t)rows_per_tile : q_len};
        }
    }
    const Problem p = {q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
                       max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale};
    const int64_t nq_max = rows_per_tile * num_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) if (num_items > 1)
    {
        float *scores = malloc((size_t)(nq_max * max_seq_len) * sizeof(float));
        float *qbuf = malloc((size_t)(nq_max * head_dim) * sizeof(float));
        float *acc = malloc((size_t)(nq_max * head_dim) * sizeof(float));
        if (!scores || !qbuf || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++)
            if (!failed) attend_item(&p, items[i], scores, qbuf, acc);
        free(scores);
        free(qbuf);
        free(acc);
    }
    free(items);
    return failed ? TT_NO_MEMORY : TT_OK;
}
