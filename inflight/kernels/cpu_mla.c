/* Native CPU paged MLA decode and prefill (absorbed), float32: inflight_mla_decode_f32,
 * inflight_mla_prefill_f32.
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
 *
 * Prefill (mla_reference.py's paged_mla_prefill): query tokens of several sequences packed back to
 * back (query_start_loc [S + 1]); the query at position p of a sequence sees its latents 0..p (a
 * decode over a context of p + 1). Work items are (up to QTILE queries of a sequence, group of
 * heads), fewer queries a tile when the tiles would leave threads idle: each latent row is read once
 * for all the tile's rows that see it (causally, the tile's later queries see a few more), scores
 * kept per row, exact softmax as the decode's (prefill_tile says how).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 16
#define QTILE 8 /* prefill queries a work item */
#define JB 16   /* prefill latent rows a score block */

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

/* Prefill: QTILE queries of one sequence x a group of up to GROUP heads; query qi sees the first
 * first_visible + qi latents, and the rows (qi, head) that see a block of JB latents are the
 * flattened rows from (first query that sees it) * nh on. The context goes by JB latent rows,
 * gathered transposed ([rank][JB], [rope][JB]), so RB rows' JB scores are RB register vectors of JB
 * multiply-adds a latent feature (the block loaded once for RB rows, no horizontal sums); then the
 * exact softmax a row; then the weighted sum of the latents block by block, a row's output held in
 * registers 16 features at a time across the block's latents. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* an unaligned load or store */
#define RB 8

static float *q_row(const float *base, int64_t stride_t, int64_t stride_h, int64_t t0, int64_t r, int64_t nh,
                    int64_t h0) {
    return (float *)base + (t0 + r / nh) * stride_t + (h0 + r % nh) * stride_h;
}

static void score_block(const float *const *q, const float *const *qp, const float *lt, const float *pt,
                        int64_t rank, int64_t rope, v16 *acc) { /* acc[RB]: RB rows x JB latents */
    v16 a[RB];
    for (int i = 0; i < RB; i++) a[i] = (v16){0};
    for (int64_t c = 0; c < rank; c++) {
        v16 l = *(const v16u *)(lt + c * JB);
        for (int i = 0; i < RB; i++) a[i] += q[i][c] * l;
    }
    for (int64_t c = 0; c < rope; c++) {
        v16 l = *(const v16u *)(pt + c * JB);
        for (int i = 0; i < RB; i++) a[i] += qp[i][c] * l;
    }
    for (int i = 0; i < RB; i++) acc[i] = a[i];
}

static void sum_block(float *o, const float *p, const float *const *latents, int64_t nj, int64_t rank) {
    int64_t c = 0;
    for (; c + 16 <= rank; c += 16) {
        v16 acc = *(v16u *)(o + c);
        for (int64_t jj = 0; jj < nj; jj++) acc += p[jj] * *(const v16u *)(latents[jj] + c);
        *(v16u *)(o + c) = acc;
    }
    for (; c < rank; c++)
        for (int64_t jj = 0; jj < nj; jj++) o[c] += p[jj] * latents[jj][c];
}

static int prefill_tile(const float *q_latent, int64_t stride_qt, int64_t stride_qh, const float *q_pe,
                        int64_t stride_pt, int64_t stride_ph, const float *latent_cache, const float *pe_cache,
                        const int32_t *table, int64_t t0, int64_t nq, int64_t first_visible, float *out, int64_t h0,
                        int64_t nh, int64_t num_heads, int64_t rank, int64_t rope, int64_t block_size, float scale) {
    int64_t span = first_visible + nq - 1, rows = nq * nh; /* what the tile's last query sees */
    int64_t padded = (span + JB - 1) / JB * JB;
    float *scores = malloc(sizeof(float) * (size_t)(rows * padded + (rank + rope) * JB));
    if (scores == NULL) return -1;
    float *lt = scores + rows * padded, *pt = lt + rank * JB; /* the block, transposed */
    float top[QTILE * GROUP], sum[QTILE * GROUP];
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, sum[r] = 0.0f;
    for (int64_t j0 = 0; j0 < span; j0 += JB) {
        int64_t nj = span - j0 < JB ? span - j0 : JB;
        memset(lt, 0, sizeof(float) * (size_t)((rank + rope) * JB)); /* past the span: zeros, never read */
        for (int64_t jj = 0; jj < nj; jj++) {
            int64_t j = j0 + jj, row = (int64_t)table[j / block_size] * block_size + j % block_size;
            for (int64_t c = 0; c < rank; c++) lt[c * JB + jj] = latent_cache[row * rank + c];
            for (int64_t c = 0; c < rope; c++) pt[c * JB + jj] = pe_cache[row * rope + c];
        }
        for (int64_t r0 = (j0 < first_visible ? 0 : j0 - first_visible + 1) * nh; r0 < rows; r0 += RB) {
            const float *q[RB], *qp[RB];
            for (int64_t i = 0; i < RB; i++) { /* past the last row: the last row again, discarded */
                int64_t r = r0 + i < rows ? r0 + i : rows - 1;
                q[i] = q_row(q_latent, stride_qt, stride_qh, t0, r, nh, h0);
                qp[i] = q_row(q_pe, stride_pt, stride_ph, t0, r, nh, h0);
            }
            v16 acc[RB];
            score_block(q, qp, lt, pt, rank, rope, acc);
            for (int64_t i = 0; i < RB && r0 + i < rows; i++) {
                int64_t r = r0 + i, seen = first_visible + r / nh - j0; /* this row sees jj < seen */
                for (int64_t jj = 0; jj < nj && jj < seen; jj++) {
                    float x = acc[i][jj] * scale;
                    scores[r * padded + j0 + jj] = x;
                    if (x > top[r]) top[r] = x;
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        memset(out + ((t0 + r / nh) * num_heads + h0 + r % nh) * rank, 0, sizeof(float) * (size_t)rank);
        for (int64_t j = 0; j < first_visible + r / nh; j++) {
            float p = expf(scores[r * padded + j] - top[r]);
            scores[r * padded + j] = p;
            sum[r] += p;
        }
    }
    for (int64_t j0 = 0; j0 < span; j0 += JB) {
        const float *latents[JB];
        int64_t nj = span - j0 < JB ? span - j0 : JB;
        for (int64_t jj = 0; jj < nj; jj++) {
            int64_t j = j0 + jj;
            latents[jj] = latent_cache + ((int64_t)table[j / block_size] * block_size + j % block_size) * rank;
        }
        for (int64_t r = (j0 < first_visible ? 0 : j0 - first_visible + 1) * nh; r < rows; r++) {
            int64_t seen = first_visible + r / nh - j0;
            sum_block(out + ((t0 + r / nh) * num_heads + h0 + r % nh) * rank, scores + r * padded + j0, latents,
                      nj < seen ? nj : seen, rank);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + ((t0 + r / nh) * num_heads + h0 + r % nh) * rank;
        float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
        for (int64_t c = 0; c < rank; c++) o[c] *= inv;
    }
    free(scores);
    return 0;
}

int inflight_mla_prefill_f32(const float *q_latent, int64_t stride_qt, int64_t stride_qh, const float *q_pe,
                             int64_t stride_pt, int64_t stride_ph, const float *latent_cache, const float *pe_cache,
                             const int32_t *block_tables, int64_t stride_bt, const int32_t *query_start_loc,
                             const int32_t *context_lens, float *out, int64_t num_tokens, int64_t num_seqs,
                             int64_t num_heads, int64_t rank, int64_t rope, int64_t block_size, float scale,
                             int num_threads) {
    int64_t groups = (num_heads + GROUP - 1) / GROUP, num_tiles = 0, qtile = QTILE;
    while (qtile > 1 && (num_tokens / qtile + num_seqs) * groups < 2 * (int64_t)num_threads)
        qtile /= 2; /* fewer queries a tile (less reuse of each latent) until every thread has work */
    int64_t *tiles = malloc(sizeof(int64_t) * (size_t)(2 * (num_tokens / qtile + num_seqs) + 2));
    if (tiles == NULL) return -1;
    for (int64_t s = 0; s < num_seqs; s++) /* (sequence, first query of the tile) */
        for (int64_t q = 0; q < query_start_loc[s + 1] - query_start_loc[s]; q += qtile)
            tiles[2 * num_tiles] = s, tiles[2 * num_tiles + 1] = q, num_tiles++;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t item = 0; item < num_tiles * groups; item++) {
        int64_t s = tiles[2 * (item / groups)], q0 = tiles[2 * (item / groups) + 1], h0 = (item % groups) * GROUP;
        int64_t nh = num_heads - h0 < GROUP ? num_heads - h0 : GROUP;
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        int64_t nq = q_len - q0 < qtile ? q_len - q0 : qtile;
        failed |= prefill_tile(q_latent, stride_qt, stride_qh, q_pe, stride_pt, stride_ph, latent_cache, pe_cache,
                               block_tables + s * stride_bt, query_start_loc[s] + q0, nq,
                               context_lens[s] - q_len + q0 + 1, out, h0, nh, num_heads, rank, rope, block_size,
                               scale) != 0;
    }
    free(tiles);
    return failed ? -1 : 0;
}
