/* Native CPU paged MLA decode (absorbed), float32: inflight_mla_decode_f32.
 *
 * The specification is inflight/kernels/mla_reference.py's paged_mla_decode: one query token per
 * sequence, each head's query in the latent space (q_latent [S, H, C]) beside its roped part
 * (q_pe [S, H, R]); the context's latents (latent_cache [blocks, block_size, 1, C]) and roped keys
 * (pe_cache [blocks, block_size, 1, R]) through the block table. out[s, h] = softmax_j((q_latent .
 * latent_j + q_pe . k_pe_j) * scale) weighted sum of latent_j, [S, H, C] contiguous.
 *
 * Work items are (sequence, group of up to GROUP heads), spread over OpenMP threads: a group's
 * heads share each latent row while it is in cache (all heads read the same latent), so the cache
 * is read twice per group (scores, then the weighted sum) instead of twice per head. Scores are
 * kept for the whole context (two passes, exact softmax: max, then exp and sum in float32).
 * Returns 0, or -1 when the score scratch cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 16

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static void axpy(float *y, float alpha, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

static int decode_group(const float *q_latent, int64_t stride_qs, int64_t stride_qh, const float *q_pe,
                        int64_t stride_ps, int64_t stride_ph, const float *latent_cache, const float *pe_cache,
                        const int32_t *table, int64_t context, float *out, int64_t s, int64_t h0, int64_t nh,
                        int64_t num_heads, int64_t rank, int64_t rope, int64_t block_size, float scale) {
    float *scores = malloc(sizeof(float) * (size_t)(nh * (context > 0 ? context : 1)));
    if (scores == NULL) return -1;
    float top[GROUP], sum[GROUP];
    for (int64_t g = 0; g < nh; g++) top[g] = -INFINITY, sum[g] = 0.0f;
    for (int64_t j = 0; j < context; j++) {
        int64_t row = (int64_t)table[j / block_size] * block_size + j % block_size;
        const float *latent = latent_cache + row * rank, *k_pe = pe_cache + row * rope;
        for (int64_t g = 0; g < nh; g++) {
            int64_t h = h0 + g;
            float x = (dot(q_latent + s * stride_qs + h * stride_qh, latent, rank) +
                       dot(q_pe + s * stride_ps + h * stride_ph, k_pe, rope)) * scale;
            scores[g * context + j] = x;
            if (x > top[g]) top[g] = x;
        }
    }
    float *o = out + (s * num_heads + h0) * rank;
    memset(o, 0, sizeof(float) * (size_t)(nh * rank));
    for (int64_t g = 0; g < nh; g++)
        for (int64_t j = 0; j < context; j++) {
            float p = expf(scores[g * context + j] - top[g]);
            scores[g * context + j] = p;
            sum[g] += p;
        }
    for (int64_t j = 0; j < context; j++) {
        int64_t row = (int64_t)table[j / block_size] * block_size + j % block_size;
        const float *latent = latent_cache + row * rank;
        for (int64_t g = 0; g < nh; g++) axpy(o + g * rank, scores[g * context + j], latent, rank);
    }
    for (int64_t g = 0; g < nh; g++) {
        float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
        for (int64_t c = 0; c < rank; c++) o[g * rank + c] *= inv;
    }
    free(scores);
    return 0;
}

int inflight_mla_decode_f32(const float *q_latent, int64_t stride_qs, int64_t stride_qh, const float *q_pe,
                            int64_t stride_ps, int64_t stride_ph, const float *latent_cache, const float *pe_cache,
                            const int32_t *block_tables, int64_t stride_bt, const int32_t *context_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t rank, int64_t rope, int64_t block_size,
                            float scale, int num_threads) {
    int64_t groups = (num_heads + GROUP - 1) / GROUP;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t item = 0; item < num_seqs * groups; item++) {
        int64_t s = item / groups, h0 = (item % groups) * GROUP;
        int64_t nh = num_heads - h0 < GROUP ? num_heads - h0 : GROUP;
        failed |= decode_group(q_latent, stride_qs, stride_qh, q_pe, stride_ps, stride_ph, latent_cache, pe_cache,
                               block_tables + s * stride_bt, context_lens[s], out, s, h0, nh, num_heads, rank, rope,
                               block_size, scale) != 0;
    }
    return failed ? -1 : 0;
}
