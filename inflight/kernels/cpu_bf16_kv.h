/* bfloat16 KV caches of a float32 engine in inflight's CPU kernels (inflight/kernels/cpu_bf16_kv.py
 * is the Python side), included by cpu_kernels.c after cpu_decode_block.h (it runs that file's
 * paged_attention and decode_block on the kv8_t path; the one-call decode stack calls decode_block
 * itself); not a header to include anywhere else. A stored value is the
 * float32 value rounded to nearest-even to bfloat16 (bf16_round, cpu_kernels.c), as torch's cast
 * rounds it; a read widens it back exactly (the top half of the float's bits). */

/* inflight_paged_decode_attention_f32 over bfloat16 caches (same layout, two bytes a value):
 * each thread widens a block's rows into its scratch and runs the float code on them. */
int inflight_paged_decode_attention_bf16(
    const float *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
    const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int num_threads, int64_t window,
    const float *sinks) {
    const kv8_t wide = {NULL, NULL, NULL, NULL, NULL, NULL, k_cache, v_cache};
    return paged_attention(q, NULL, NULL, wide, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
                           head_dim, block_size, max_blocks, scale, num_threads, window, sinks);
}

/* inflight_store_kv_cache_f32 into bfloat16 caches: each value rounded by bf16_round. */
void inflight_store_kv_cache_bf16(
    const float *key, int64_t key_stride, const float *value, int64_t value_stride,
    uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping, int64_t num_tokens,
    int64_t row_size, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * row_size >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *kr = key + t * key_stride, *vr = value + t * value_stride;
        uint16_t *kd = k_cache + slot * row_size, *vd = v_cache + slot * row_size;
        for (int64_t i = 0; i < row_size; ++i) {
            kd[i] = bf16_round(kr[i]);
            vd[i] = bf16_round(vr[i]);
        }
    }
}

/* dst[i] = the block src_blocks[i] of a bfloat16 cache (block_elems values) widened to float:
 * the blocks a prefill step reads, as a float cache for its kernel. */
void inflight_widen_bf16_blocks(const uint16_t *src, const int64_t *src_blocks, int64_t num_blocks,
                                int64_t block_elems, float *dst, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_blocks * block_elems >= (1 << 16))
    for (int64_t i = 0; i < num_blocks; ++i)
        bf16_widen_rows(src + src_blocks[i] * block_elems, dst + i * block_elems, 0, block_elems);
}

/* inflight_decode_attention_block_f32 (cpu_decode_block.h) over bfloat16 caches: the rotated k
 * and the v of each row rounded into the token's slot (bf16_round), then each q attending over the
 * widened rows. Every row's K/V is stored before any row attends, as there. */
int inflight_decode_attention_block_bf16(
    const float *qkv, int64_t qkv_stride, const int64_t *positions, const float *cos_sin, int64_t rot_dim,
    const float *q_norm, const float *k_norm, float norm_eps, uint16_t *k_cache, uint16_t *v_cache,
    const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *context_lens, float *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale, int num_threads, int64_t window, const float *sinks) {
    return decode_block(qkv, qkv_stride, positions, cos_sin, rot_dim, q_norm, k_norm, norm_eps, NULL, NULL, k_cache,
                        v_cache, slot_mapping, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
                        head_dim, block_size, max_blocks, scale, num_threads, window, sinks);
}
