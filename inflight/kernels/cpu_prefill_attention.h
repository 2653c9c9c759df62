/* Prefill attention (float32): prompt chunks attending to their paged context, causal within
 * the chunk. Included by cpu_kernels.c (after attend_sequence); kept in its own file.
 *
 * Query token i of sequence s sits at position ctx_s - q_len_s + i and sees the first
 * position + 1 rows of its context (with a window W: the last W of them), so each query token
 * is a decode query against a shorter context, and attend_sequence (the decode kernel: a GQA
 * group's heads against a vector's width of keys at a time, online softmax, sinks) computes it,
 * reading K/V in place from the cache: the chunk's own rows must be stored before the call, as
 * the decoder does. Work items are query tokens, handed out a few at a time (dynamic schedule:
 * later tokens of long prompts see more keys), so the tokens of one sequence run next to each
 * other on a thread and its K/V rows stay in that core's cache. This replaces a Python loop of
 * one SDPA call, copies and casts per sequence and layer (~400 calls per 2048-token step of
 * bench-medium, ~16% of the step). SDPA's tiles win on long chunks (their work grows with the
 * square of the chunk, where they reach ~2x this kernel's rate): a sequence with more than
 * max_queries queries is skipped here, and its rows are left for the caller. */
#ifndef INFLIGHT_CPU_PREFILL_ATTENTION_H
#define INFLIGHT_CPU_PREFILL_ATTENTION_H

/* q rows at q_stride floats (heads then head_dim contiguous); caches [num_blocks, block_size,
 * num_kv_heads, head_dim] contiguous; block_tables [num_seqs, max_blocks] int32;
 * query_start_loc [num_seqs + 1] int32 (offsets of each sequence's queries in q);
 * context_lens [num_seqs] int32 (cached rows including this chunk, >= the chunk's length);
 * out [num_tokens, num_heads, head_dim] contiguous; rows of sequences with more than max_queries
 * queries are not written. Returns 0, or -1 when the per-thread scratch cannot be allocated. */
int inflight_paged_prefill_attention_f32(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *context_lens,
    float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, int64_t max_queries, float scale, int num_threads,
    int64_t window, const float *sinks) {
    const int64_t num_tokens = query_start_loc[num_seqs];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *acc = malloc(sizeof(float) * num_heads * head_dim);
        float *m = malloc(sizeof(float) * num_heads * 3);  /* m, l, mb */
        float *p = malloc(sizeof(float) * num_heads * (block_size + TILE));
        failed = !acc || !m || !p;
        int64_t s = 0;  /* this thread's current sequence: tokens come in increasing order */
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < num_tokens; ++t) {
            if (failed) continue;
            if (t < query_start_loc[s]) s = 0;
            while (query_start_loc[s + 1] <= t) ++s;
            if (query_start_loc[s + 1] - query_start_loc[s] > max_queries) continue;
            const int64_t position = context_lens[s] - (query_start_loc[s + 1] - query_start_loc[s])
                                     + (t - query_start_loc[s]);
            attend_sequence(q + t * q_stride, k_cache, v_cache, block_tables + s * max_blocks, position + 1,
                            window, out + t * num_heads * head_dim, num_heads, num_kv_heads, head_dim,
                            block_size, scale, sinks, acc, m, p);
        }
        free(acc);
        free(m);
        free(p);
    }
    return failed ? -1 : 0;
}

#endif
