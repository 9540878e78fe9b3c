/* The kernels one C file calls in another (decoder.c runs a layer stack through them); each
 * defining file includes this too, so the compiler holds both sides to one signature. */
#ifndef TT_KERNELS_H
#define TT_KERNELS_H

#include <stdint.h>

#include "helper.h"

/* MKL's cblas_sgemm_compute (torch links MKL in; engine/model/cpu_matmul.py finds it). */
typedef void (*tt_sgemm_compute)(int layout, int transa, int transb, int m, int n, int k,
                                 const float *a, int lda, const float *b, int ldb, float beta,
                                 float *c, int ldc);

void tt_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows,
                         int64_t dim, float eps);
int tt_qk_norm_rope_f32(float *q, float *k, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                        int64_t dim, const float *q_norm_w, const float *k_norm_w, float eps,
                        const float *cos_table, const float *sin_table, const int64_t *positions);
void tt_silu_mul_f32(const float *gate, const float *up, float *out, int64_t n);
int tt_write_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache,
                    const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots,
                    int64_t *bad_token);
int tt_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                        const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                        const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                        int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads,
                        tt_helper *helper, int64_t *bad_seq);
int tt_paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                         const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                         const int32_t *block_tables, int64_t num_seqs, int64_t max_blocks,
                         int64_t num_blocks, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads,
                         int64_t *bad_seq);
void tt_helper_sgemm_f32(tt_helper *h, tt_sgemm_compute compute, const float *x, int64_t rows,
                         int64_t k, const void *const *parts, const int64_t *first_column,
                         int64_t num_parts, float *out);

#endif
