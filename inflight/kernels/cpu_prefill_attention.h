/* Prefill attention (float32): prompt chunks attending to their paged context, causal within
 * the chunk. Included by cpu_kernels.c (it uses cpu_vecf.h and softmax_normalizer); kept in its
 * own file.
 *
 * Query token i of sequence s sits at position ctx_s - q_len_s + i and sees the rows of its
 * context up to that position (with a window W: the last W of them), read in place from the
 * cache: the chunk's own K/V must be stored before the call, as the decoder does. A work item
 * is one KV head of a group of a sequence's consecutive query tokens: its rows are the group's
 * query heads of that KV head (token-major), up to PF_ROWS of them, and it walks the keys the
 * group sees a tile of PF_TILE keys at a time (flash attention's loop order, keys outside):
 *  - the tile's K rows (gathered from its blocks) are transposed once into [head_dim,
 *    PF_TILE], so a block of rows scores against it with broadcast FMAs, each row's scores in
 *    PF_TV registers (no horizontal sums), the tile's K read once for all the rows;
 *  - each row masks the keys past its position (and before its window), then the online
 *    softmax (running max m, sum l; the rows' outputs rescaled when the max moves; exp is
 *    vecf_exp_nonpositive);
 *  - the outputs accumulate the tile's weighted V rows, PF_ROW_BLOCK rows at a time sharing each
 *    V load, in registers over the tile's keys.
 * Rows see tiles from the first key any of them sees (a window's start) to the group's last
 * position; a block of rows scores only the vectors of keys its last row sees, and a row whose
 * keys all lie outside a tile skips it. Head sizes 32/64/128 get copies with the size a
 * constant. Work items are handed out one at a time (dynamic schedule: later groups of long
 * prompts see more keys). This replaces a Python loop of one SDPA call, copies and casts per
 * sequence and layer (~400 calls per 2048-token step of bench-medium). A sequence with more than
 * max_queries queries is skipped and its rows are left to the caller. */
#ifndef INFLIGHT_CPU_PREFILL_ATTENTION_H
#define INFLIGHT_CPU_PREFILL_ATTENTION_H

#define PF_ROWS 256  /* query rows of a work item (tokens x the KV head's query heads): a 93-token prompt with
                      * GQA 2 is one item a KV head, its K tiles transposed once (~6% faster than 128) */
#define PF_TV 4      /* vectors of keys in a tile: PF_TILE keys */
#define PF_TILE (PF_TV * VECF_W)
#define PF_ROW_BLOCK (VECF_W == 16 ? 4 : 2)  /* rows scored and accumulated at once (registers) */
#define PF_PV_CHUNKS 4                       /* vectors of features each of them holds at once */

/* Scores of rows [r0, r0 + rb) against the first nv vectors of keys of the transposed tile kt
 * [head_dim, PF_TILE], scaled, into p (row stride PF_TILE). */
static inline __attribute__((always_inline)) void pf_scores(const float *qs, int64_t r0, const int rb, const int nv,
                                                            const float *kt, int64_t head_dim, float scale,
                                                            float *p) {
    vecf acc[PF_ROW_BLOCK][PF_TV];
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < nv; ++v) acc[r][v] = vecf_splat(0.0f);
    const float *qr = qs + r0 * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
        vecf k[PF_TV];
        for (int v = 0; v < nv; ++v) k[v] = vecf_load(kt + d * PF_TILE + v * VECF_W);
        for (int r = 0; r < rb; ++r) {
            const vecf b = vecf_splat(qr[r * head_dim + d]);
            for (int v = 0; v < nv; ++v) acc[r][v] += b * k[v];
        }
    }
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < nv; ++v) vecf_store(p + (r0 + r) * PF_TILE + v * VECF_W, acc[r][v] * vecf_splat(scale));
}

/* pf_scores with nv (1 to PF_TV) a constant in each copy. */
static inline __attribute__((always_inline)) void pf_scores_n(const float *qs, int64_t r0, const int rb, int64_t nv,
                                                              const float *kt, int64_t head_dim, float scale,
                                                              float *p) {
    switch (nv) {
        case 1: pf_scores(qs, r0, rb, 1, kt, head_dim, scale, p); break;
        case 2: pf_scores(qs, r0, rb, 2, kt, head_dim, scale, p); break;
        case 3: pf_scores(qs, r0, rb, 3, kt, head_dim, scale, p); break;
        default: pf_scores(qs, r0, rb, PF_TV, kt, head_dim, scale, p);
    }
}

/* o[r] = o[r] * corr[r] + sum over keys j < n of p[r, j] * v_rows[j], rows [r0, r0 + rb). */
static inline __attribute__((always_inline)) void pf_values(float *o, int64_t r0, const int rb, const float *p,
                                                            const float *corr, const float *const *v_rows,
                                                            int64_t n, int64_t head_dim) {
    const int64_t full = head_dim / VECF_W * VECF_W;
    for (int64_t d0 = 0; d0 < full; d0 += PF_PV_CHUNKS * VECF_W) {
        const int64_t chunks = full - d0 < PF_PV_CHUNKS * VECF_W ? (full - d0) / VECF_W : PF_PV_CHUNKS;
        vecf acc[PF_ROW_BLOCK][PF_PV_CHUNKS];
        for (int r = 0; r < rb; ++r) {
            const vecf c = vecf_splat(corr[r0 + r]);
            for (int64_t c4 = 0; c4 < chunks; ++c4) acc[r][c4] = vecf_load(o + (r0 + r) * head_dim + d0 + c4 * VECF_W) * c;
        }
        for (int64_t j = 0; j < n; ++j) {
            const float *v = v_rows[j] + d0;
            vecf vj[PF_PV_CHUNKS];
            for (int64_t c4 = 0; c4 < chunks; ++c4) vj[c4] = vecf_load(v + c4 * VECF_W);
            for (int r = 0; r < rb; ++r) {
                const vecf w = vecf_splat(p[(r0 + r) * PF_TILE + j]);
                for (int64_t c4 = 0; c4 < chunks; ++c4) acc[r][c4] += w * vj[c4];
            }
        }
        for (int r = 0; r < rb; ++r)
            for (int64_t c4 = 0; c4 < chunks; ++c4) vecf_store(o + (r0 + r) * head_dim + d0 + c4 * VECF_W, acc[r][c4]);
    }
    for (int r = 0; r < rb; ++r)  /* features past the last whole vector */
        for (int64_t d = full; d < head_dim; ++d) {
            float a = o[(r0 + r) * head_dim + d] * corr[r0 + r];
            for (int64_t j = 0; j < n; ++j) a += p[(r0 + r) * PF_TILE + j] * v_rows[j][d];
            o[(r0 + r) * head_dim + d] = a;
        }
}

/* One work item: query tokens [i0, i0 + nq) of a sequence whose context has ctx rows (block
 * table `table`), the last q_len of them this chunk; KV head kvh. Scratch: laid out below, sized by the
 * caller for its largest item. */
static inline __attribute__((always_inline)) void pf_group(const float *q, int64_t q_stride, const float *k_cache,
                                                           const float *v_cache, const int32_t *table, int64_t ctx,
                                                           int64_t q_len, int64_t i0, int64_t nq, int64_t kvh,
                                                           float *out, int64_t num_heads, int64_t num_kv_heads,
                                                           int64_t head_dim, int64_t block_size, float scale,
                                                           int64_t window, const float *sinks, float *scratch) {
    const int64_t group = num_heads / num_kv_heads, rows = nq * group;
    const int64_t tok_stride = num_kv_heads * head_dim;
    const int64_t pos0 = ctx - q_len + i0, last = pos0 + nq - 1;  /* the group's first and last positions */
    float *qs = scratch;                /* [rows, head_dim]: the rows' queries */
    float *o = qs + rows * head_dim;    /* [rows, head_dim]: their outputs, not yet divided by l */
    float *kt = o + rows * head_dim;    /* [head_dim, PF_TILE]: the tile's keys, transposed */
    float *p = kt + head_dim * PF_TILE; /* [rows, PF_TILE]: the tile's scores, then weights */
    float *m = p + rows * PF_TILE, *l = m + rows, *corr = l + rows;
    const float *v_rows[PF_TILE];
    for (int64_t i = 0; i < nq; ++i)
        memcpy(qs + i * group * head_dim, q + (i0 + i) * q_stride + kvh * group * head_dim,
               sizeof(float) * group * head_dim);
    memset(o, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    ivecf lane;
    for (int j = 0; j < VECF_W; ++j) lane[j] = j;
    const int64_t first = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    for (int64_t k0 = first; k0 <= last; k0 += PF_TILE) {
        const int64_t n = last + 1 - k0 < PF_TILE ? last + 1 - k0 : PF_TILE;  /* keys past `last`: no row sees them */
        for (int64_t j = 0; j < n; ++j) {  /* K transposed, V rows found, block by block */
            const int64_t slot = (int64_t)table[(k0 + j) / block_size] * block_size + (k0 + j) % block_size;
            const float *kr = k_cache + slot * tok_stride + kvh * head_dim;
            v_rows[j] = v_cache + slot * tok_stride + kvh * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) kt[d * PF_TILE + j] = kr[d];
        }
        for (int64_t d = 0; d < head_dim; ++d)
            for (int64_t j = n; j < PF_TILE; ++j) kt[d * PF_TILE + j] = 0.0f;
        /* the rows that see a key of this tile: tokens [t_lo, t_hi] */
        const int64_t t_lo = k0 > pos0 ? k0 - pos0 : 0;
        int64_t t_hi = nq - 1;
        if (window > 0 && k0 + n - 1 + window - 1 - pos0 < t_hi) t_hi = k0 + n - 1 + window - 1 - pos0;
        if (t_lo > t_hi) continue;
        const int64_t r_lo = t_lo * group, r_hi = (t_hi + 1) * group;
        int rb;  /* rows in the block: PF_ROW_BLOCK, then one at a time */
        for (int64_t r = r_lo; r < r_hi; r += rb) {
            rb = r_hi - r < PF_ROW_BLOCK ? 1 : PF_ROW_BLOCK;
            const int64_t seen = pos0 + (r + rb - 1) / group + 1 - k0;  /* keys the block's last row sees */
            const int64_t kmax = seen < n ? seen : n;
            const int64_t nv = (kmax + VECF_W - 1) / VECF_W;
            if (rb == PF_ROW_BLOCK) pf_scores_n(qs, r, PF_ROW_BLOCK, nv, kt, head_dim, scale, p);
            else pf_scores_n(qs, r, 1, nv, kt, head_dim, scale, p);
            for (int64_t rr = r; rr < r + rb; ++rr) {  /* mask, then the online softmax */
                const int64_t qp = pos0 + rr / group;
                const int64_t lo = window > 0 && qp - window + 1 > k0 ? qp - window + 1 - k0 : 0;
                const int64_t hi = qp + 1 - k0 < n ? qp + 1 - k0 : n;
                float *pr = p + rr * PF_TILE;
                /* only the nv vectors scored: the keys past them are masked for every row of
                 * the block, their weights (never read: pf_values stops at kmax) would be 0 */
                vecf s[PF_TV], top_v = vecf_splat(-INFINITY);
                for (int v = 0; v < nv; ++v) {
                    const ivecf idx = lane + v * VECF_W;
                    const ivecf keep = (idx >= (int32_t)lo) & (idx < (int32_t)hi);
                    s[v] = vecf_load(pr + v * VECF_W);
                    s[v] = (vecf)(((ivecf)s[v] & keep) | ((ivecf)vecf_splat(-INFINITY) & ~keep));
                    top_v = vecf_max(top_v, s[v]);
                }
                const float top = vecf_reduce_max(top_v);  /* one horizontal max a row, not one a vector */
                if (top == -INFINITY) {  /* nothing of this tile for this row */
                    corr[rr] = 1.0f;
                    memset(pr, 0, sizeof(float) * PF_TILE);
                    continue;
                }
                const float new_max = top > m[rr] ? top : m[rr];
                vecf sum = vecf_splat(0.0f);
                for (int v = 0; v < nv; ++v) {
                    const ivecf idx = lane + v * VECF_W;
                    const ivecf keep = (idx >= (int32_t)lo) & (idx < (int32_t)hi);
                    const vecf e = (vecf)((ivecf)vecf_exp_nonpositive(s[v] - new_max) & keep);
                    vecf_store(pr + v * VECF_W, e);
                    sum += e;
                }
                corr[rr] = expf(m[rr] - new_max);  /* exp(-inf) = 0 at the start */
                l[rr] = l[rr] * corr[rr] + vecf_reduce_add(sum);
                m[rr] = new_max;
            }
            if (rb == PF_ROW_BLOCK) pf_values(o, r, PF_ROW_BLOCK, p, corr, v_rows, kmax, head_dim);
            else pf_values(o, r, 1, p, corr, v_rows, kmax, head_dim);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = kvh * group + r % group;
        const float inv = softmax_normalizer(m[r], l[r], sinks, h);
        float *dst = out + (i0 + r / group) * num_heads * head_dim + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = o[r * head_dim + d] * inv;
    }
}

/* Query tokens per work item: PF_ROWS rows of the KV head's `group` query heads (at least one token). */
static inline int64_t pf_tokens(int64_t group) { return group >= PF_ROWS ? 1 : PF_ROWS / group; }

/* q rows at q_stride floats (heads then head_dim contiguous); caches [num_blocks, block_size,
 * num_kv_heads, head_dim] contiguous; block_tables [num_seqs, max_blocks] int32;
 * query_start_loc [num_seqs + 1] int32 (offsets of each sequence's queries in q);
 * context_lens [num_seqs] int32 (cached rows including this chunk, >= the chunk's length);
 * out [num_tokens, num_heads, head_dim] contiguous; rows of sequences with more than max_queries
 * queries are not written. Returns 0, or -1 when memory for the per-thread scratch or the work
 * list cannot be allocated. */
int inflight_paged_prefill_attention_f32(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *context_lens,
    float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, int64_t max_queries, float scale, int num_threads,
    int64_t window, const float *sinks) {
    const int64_t group = num_heads / num_kv_heads, per_item = pf_tokens(group);
    const int64_t rows = per_item * group;
    int64_t *first_item = malloc(sizeof(int64_t) * (num_seqs + 1));  /* work items before sequence s */
    if (first_item == NULL) return -1;
    first_item[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int64_t groups = q_len > max_queries ? 0 : (q_len + per_item - 1) / per_item;
        first_item[s + 1] = first_item[s] + groups * num_kv_heads;
    }
    const int64_t num_items = first_item[num_seqs];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed) if (num_items > 1)
    {
        float *scratch = malloc(sizeof(float) * (2 * rows * head_dim + head_dim * PF_TILE + rows * PF_TILE + 3 * rows));
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            if (failed) continue;
            int64_t lo = 0, hi = num_seqs - 1;  /* the sequence: first_item[s] <= item < first_item[s + 1] */
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (first_item[mid] <= item) lo = mid;
                else hi = mid - 1;
            }
            const int64_t s = lo, local = item - first_item[s];
            const int64_t kvh = local % num_kv_heads, i0 = local / num_kv_heads * per_item;
            const int64_t q_begin = query_start_loc[s], q_len = query_start_loc[s + 1] - q_begin;
            const int64_t nq = q_len - i0 < per_item ? q_len - i0 : per_item;
#define PF_GROUP(D)                                                                                      \
    pf_group(q + q_begin * q_stride, q_stride, k_cache, v_cache, block_tables + s * max_blocks, context_lens[s], \
             q_len, i0, nq, kvh, out + q_begin * num_heads * head_dim, num_heads, num_kv_heads, D, block_size,   \
             scale, window, sinks, scratch)
            switch (head_dim) {  /* the common sizes as constants: feature loops unrolled */
                case 64: PF_GROUP(64); break;
                case 128: PF_GROUP(128); break;
                case 32: PF_GROUP(32); break;
                default: PF_GROUP(head_dim);
            }
#undef PF_GROUP
        }
        free(scratch);
    }
    free(first_item);
    return failed ? -1 : 0;
}

#endif
