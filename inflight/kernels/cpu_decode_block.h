/* The decode attention block of inflight's CPU kernels, included at the end of cpu_kernels.c
 * (it composes that file's decode attention and needs its static helpers); not a header to
 * include anywhere else. */

/* The decode attention block (inflight/kernels/decode_block.py) in one call. Each row of qkv
 * (stride qkv_stride) is one sequence's token: num_heads q heads, then num_kv_heads k heads, then
 * the v heads, head_dim each. q and k are normed per head when q_norm/k_norm are given (Qwen3),
 * rotated (neox style, the first rot_dim features; cos_sin rows: rot_dim / 2 cosines, then the
 * sines), k and v written to the token's cache slot (slot -1: not stored), and then each q
 * attends to its context as inflight_paged_decode_attention_f32 does. Every row's K/V is stored
 * before any row attends (an OpenMP barrier between the two loops), as the per-op path does:
 * a speculating sequence's rows read each other's K/V. The rotated q goes to out and is read
 * back from there (decode_sequence writes a head's output after its last read of q). out:
 * [num_seqs, num_heads * head_dim]. Returns 0, or -1 when the per-thread scratch cannot be
 * allocated. */
__attribute__((optimize("fp-contract=off"), noinline))
static void norm_rotate_heads(const float *x, int64_t num_heads, int64_t head_dim, const float *norm_w,
                              float eps, const float *cos_sin, int64_t rot_dim, float *out, float *tmp) {
    const int64_t half = rot_dim / 2;
    const float *c = cos_sin, *sn = cos_sin + half;
    for (int64_t h = 0; h < num_heads; ++h) {
        const float *xi = x + h * head_dim;
        float *o = out + h * head_dim;
        if (norm_w != NULL) {  /* as inflight_rms_norm_f32 computes a row */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < head_dim; ++i) sum += xi[i] * xi[i];
            const float inv = 1.0f / sqrtf(sum / (float)head_dim + eps);
            for (int64_t i = 0; i < head_dim; ++i) tmp[i] = norm_w[i] * (xi[i] * inv);
            xi = tmp;
        }
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = xi[i], x2 = xi[i + half];
            o[i] = x1 * c[i] - x2 * sn[i];
            o[i + half] = x2 * c[i] + x1 * sn[i];
        }
        for (int64_t i = rot_dim; i < head_dim; ++i) o[i] = xi[i];
    }
}

/* The block over float caches (k_cache/v_cache) or a float32 engine's bfloat16 ones (h16k/h16v
 * set, k_cache/v_cache NULL: k and v rounded into the slot, rows widened to attend; cpu_bf16_kv.h). */
static int decode_block(
    const float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_sin, int64_t rot_dim,
    const float *q_norm, const float *k_norm, float norm_eps, float *k_cache, float *v_cache, uint16_t *h16k,
    uint16_t *h16v, const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *context_lens,
    float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale, int num_threads, int64_t window, const float *sinks) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t blk = block_size * kv_size;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *acc = malloc(sizeof(float) * num_heads * head_dim);
        float *m = malloc(sizeof(float) * num_heads * 3);  /* m, l, mb */
        float *p = malloc(sizeof(float) * num_heads * (block_size + TILE));
        float *tmp = malloc(sizeof(float) * head_dim);
        float *krow = h16k != NULL ? malloc(sizeof(float) * (kv_size + 2 * blk)) : NULL;  /* + the scratch */
        failed = !acc || !m || !p || !tmp || (h16k != NULL && !krow);
        const kv8_t kv = {NULL, NULL, NULL, NULL, krow == NULL ? NULL : krow + kv_size,
                          krow == NULL ? NULL : krow + kv_size + blk, h16k, h16v};
#pragma omp for schedule(static)
        for (int64_t s = 0; s < num_seqs; ++s) {
            if (failed) continue;
            const float *row = qkv + s * qkv_stride;
            const float *cs = cos_sin + positions[s] * rot_dim;
            norm_rotate_heads(row, num_heads, head_dim, q_norm, norm_eps, cs, rot_dim, out + s * q_size, tmp);
            const int64_t slot = slot_mapping[s];
            if (slot < 0) continue;
            const float *vrow = row + q_size + kv_size;
            if (h16k == NULL) {
                norm_rotate_heads(row + q_size, num_kv_heads, head_dim, k_norm, norm_eps, cs, rot_dim,
                                  k_cache + slot * kv_size, tmp);
                memcpy(v_cache + slot * kv_size, vrow, sizeof(float) * kv_size);
                continue;
            }
            norm_rotate_heads(row + q_size, num_kv_heads, head_dim, k_norm, norm_eps, cs, rot_dim, krow, tmp);
            uint16_t *kd = h16k + slot * kv_size, *vd = h16v + slot * kv_size;
            for (int64_t i = 0; i < kv_size; ++i) {
                kd[i] = bf16_round(krow[i]);
                vd[i] = bf16_round(vrow[i]);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; ++s) {
            if (failed) continue;
            attend_sequence(out + s * q_size, k_cache, v_cache, block_tables + s * max_blocks, context_lens[s],
                            window, out + s * q_size, num_heads, num_kv_heads, head_dim, block_size, scale, sinks,
                            acc, m, p, kv);
        }
        free(acc);
        free(m);
        free(p);
        free(tmp);
        free(krow);
    }
    return failed ? -1 : 0;
}

int inflight_decode_attention_block_f32(
    const float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_sin, int64_t rot_dim,
    const float *q_norm, const float *k_norm, float norm_eps, float *k_cache, float *v_cache,
    const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *context_lens, float *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale, int num_threads, int64_t window, const float *sinks) {
    return decode_block(qkv, qkv_stride, positions, cos_sin, rot_dim, q_norm, k_norm, norm_eps, k_cache, v_cache,
                        NULL, NULL, slot_mapping, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
                        head_dim, block_size, max_blocks, scale, num_threads, window, sinks);
}
