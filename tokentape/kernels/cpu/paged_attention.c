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
 * every head that reads it. Sequences are shared out over OpenMP threads; each is computed
 * the same way whatever else is in the batch and whichever thread runs it, so a sequence's
 * result never depends on its batch (batch invariance). Two passes per sequence: scores
 * (q . k, then an exact softmax), then the probability-weighted sum of V rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { TT_OK = 0, TT_BAD_SEQ_LEN = 1, TT_BAD_BLOCK_COUNT = 2, TT_BAD_BLOCK_ID = 3, TT_NO_MEMORY = 4 };

/* 16 floats as one vector (GCC/Clang vector extensions: AVX-512 registers where there are
 * some, pairs or quads of narrower ones elsewhere); loaded and stored unaligned. */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

static inline vf16 load16(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(vf16 v) {
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    int64_t i = 0;
    float tail = 0.0f;
    if (n >= 16) {
        vf16 acc = load16(a) * load16(b);
        for (i = 16; i + 16 <= n; i += 16) acc += load16(a + i) * load16(b + i);
        tail = hsum16(acc);
    }
    for (; i < n; i++) tail += a[i] * b[i];
    return tail;
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

typedef int32_t vi16 __attribute__((vector_size(64)));

/* exp_nonpositive on 16 lanes: the same polynomial, rounding x * log2(e) to nearest with the
 * 1.5 * 2^23 trick (no floor in vector extensions). */
static inline vf16 exp16_nonpositive(vf16 x) {
    const vf16 lowest = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f,
                         -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const vi16 below = x < lowest;
    x = (vf16)(((vi16)x & ~below) | ((vi16)lowest & below));
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    vf16 n = (x * 1.44269504088896341f + magic) - magic;
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf16 z = x * x;
    vf16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return y * (vf16)bits;
}

static void softmax_in_place(float *restrict s, int64_t n) {
    int64_t t = 0;
    float m = -INFINITY;
    if (n >= 16) {
        vf16 mv = load16(s);
        for (t = 16; t + 16 <= n; t += 16) {
            vf16 v = load16(s + t);
            vi16 gt = v > mv;
            mv = (vf16)(((vi16)v & gt) | ((vi16)mv & ~gt));
        }
        for (int i = 0; i < 16; i++) m = mv[i] > m ? mv[i] : m;
    }
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
    t = 0;
    if (n >= 16) {
        vf16 sv = {0};
        for (; t + 16 <= n; t += 16) {
            vf16 e = exp16_nonpositive(load16(s + t) - m);
            memcpy(s + t, &e, sizeof e);
            sv += e;
        }
        sum = hsum16(sv);
    }
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* The cache blocks of a sequence lie anywhere in memory, so the hardware prefetcher starts
 * cold on each: reading token t of a block, ask for the same token of the next block. */
static inline void prefetch_row(const float *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 0, 3);
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Problem;

/* One decode with head_dim = 16 * D16. Memory-bound: the sequence's K rows, then its V rows,
 * are read once each, token by token in cache-block order (each token's row holds every kv
 * head, so a block is one contiguous stream), with the next block prefetched: blocks lie
 * anywhere, and the hardware prefetcher starts cold on each. Scores and outputs stay in
 * `scores` and `acc` (L1-sized). Inlined with D16 a constant, so the row loops unroll. */
static inline __attribute__((always_inline)) void attend_decode_v16(
    const Problem *p, int64_t seq, float *scores, float *qbuf, float *acc, const int64_t D16) {
    const int64_t H = p->num_heads, D = 16 * D16, BS = p->block_size, Hkv = p->num_kv_heads;
    const int64_t G = H / Hkv, row_stride = Hkv * D, block_floats = BS * row_stride;
    const int64_t row = p->cu_seqlens_q[seq], seq_len = p->seq_lens[seq];
    const int64_t row_bytes = row_stride * (int64_t)sizeof(float);
    const int32_t *table = p->block_tables + seq * p->max_blocks;
    const float *q = p->q + row * H * D;
    for (int64_t i = 0; i < H * D; i++) qbuf[i] = q[i] * p->scale;
    for (int64_t t = 0; t < seq_len; t++) { /* scores[h][t] */
        const int64_t in_block = (t % BS) * row_stride;
        const float *krow = p->k_cache + (int64_t)table[t / BS] * block_floats + in_block;
        if (t + BS < seq_len) prefetch_row(p->k_cache + (int64_t)table[t / BS + 1] * block_floats + in_block, row_bytes);
        for (int64_t j = 0; j < Hkv; j++) {
            vf16 kv[D16];
            for (int64_t c = 0; c < D16; c++) kv[c] = load16(krow + j * D + 16 * c);
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                const float *qh = qbuf + h * D;
                vf16 a = load16(qh) * kv[0];
                for (int64_t c = 1; c < D16; c++) a += load16(qh + 16 * c) * kv[c];
                scores[h * seq_len + t] = hsum16(a);
            }
        }
    }
    for (int64_t h = 0; h < H; h++) softmax_in_place(scores + h * seq_len, seq_len);
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t t = 0; t < seq_len; t++) { /* acc[h] = sum over t of p[h][t] * v[t] */
        const int64_t in_block = (t % BS) * row_stride;
        const float *vrow = p->v_cache + (int64_t)table[t / BS] * block_floats + in_block;
        if (t + BS < seq_len) prefetch_row(p->v_cache + (int64_t)table[t / BS + 1] * block_floats + in_block, row_bytes);
        for (int64_t j = 0; j < Hkv; j++) {
            vf16 vv[D16];
            for (int64_t c = 0; c < D16; c++) vv[c] = load16(vrow + j * D + 16 * c);
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                const float w = scores[h * seq_len + t];
                float *o = acc + h * D;
                for (int64_t c = 0; c < D16; c++) {
                    vf16 oc = load16(o + 16 * c) + w * vv[c];
                    memcpy(o + 16 * c, &oc, sizeof oc);
                }
            }
        }
    }
    memcpy(p->out + row * H * D, acc, (size_t)(H * D) * sizeof(float));
}

/* One decode, every head, any head_dim. `scores` holds num_heads x seq_len floats, `qbuf` and
 * `acc` num_heads x head_dim. */
static void attend_decode_any(const Problem *p, int64_t seq, float *scores, float *qbuf, float *acc) {
    const int64_t H = p->num_heads, D = p->head_dim, BS = p->block_size;
    const int64_t G = H / p->num_kv_heads, row_stride = p->num_kv_heads * D;
    const int64_t row = p->cu_seqlens_q[seq], seq_len = p->seq_lens[seq];
    const int32_t *table = p->block_tables + seq * p->max_blocks;

    const float *q = p->q + row * H * D;
    for (int64_t i = 0; i < H * D; i++) qbuf[i] = q[i] * p->scale;
    const int64_t block_floats = BS * row_stride, row_bytes = row_stride * (int64_t)sizeof(float);
    for (int64_t t = 0; t < seq_len; t++) { /* scores[h][t] */
        const float *krow = p->k_cache + (int64_t)table[t / BS] * block_floats + (t % BS) * row_stride;
        if (t + BS < seq_len) prefetch_row(p->k_cache + (int64_t)table[t / BS + 1] * block_floats + (t % BS) * row_stride, row_bytes);
        for (int64_t h = 0; h < H; h++) scores[h * seq_len + t] = dot(qbuf + h * D, krow + (h / G) * D, D);
    }
    for (int64_t h = 0; h < H; h++) softmax_in_place(scores + h * seq_len, seq_len);
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t t = 0; t < seq_len; t++) { /* acc[h] = sum over t of p[h][t] * v[t] */
        const float *vrow = p->v_cache + (int64_t)table[t / BS] * block_floats + (t % BS) * row_stride;
        if (t + BS < seq_len) prefetch_row(p->v_cache + (int64_t)table[t / BS + 1] * block_floats + (t % BS) * row_stride, row_bytes);
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

/* Returns 0, or an error code with *bad_seq set to the offending sequence (nothing written). */
int tt_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                        const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                        const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                        int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads,
                        int64_t *bad_seq) {
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
            if (skip || cu_seqlens_q[b + 1] - cu_seqlens_q[b] != 1) continue;
            switch (head_dim) { /* the usual head sizes, specialised */
            case 64: attend_decode_v16(&p, b, scores, qbuf, acc, 4); break;
            case 128: attend_decode_v16(&p, b, scores, qbuf, acc, 8); break;
            case 32: attend_decode_v16(&p, b, scores, qbuf, acc, 2); break;
            case 16: attend_decode_v16(&p, b, scores, qbuf, acc, 1); break;
            default: attend_decode_any(&p, b, scores, qbuf, acc);
            }
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
