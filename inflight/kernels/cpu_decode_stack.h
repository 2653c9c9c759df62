/* The decoder-layer stack of a pure-decode step in one call, included at the end of cpu_kernels.c
 * after cpu_decode_block.h (it composes that file's norm, SiLU-and-mul and attention block); not
 * a header to include anywhere else. */

/* MKL's cblas_sgemm_compute, as libtorch_cpu exports it (LP64: MKL_INT and the CBLAS enums are
 * ints); the pointer comes from Python (inflight/kernels/cpu_stack.py), so this file links
 * nothing. */
typedef void (*inflight_sgemm_compute_fn)(int layout, int transa, int transb, int m, int n, int k,
                                          const float *a, int lda, const float *b, int ldb, float beta,
                                          float *c, int ldc);
enum { INFLIGHT_ROW_MAJOR = 101, INFLIGHT_NO_TRANS = 111, INFLIGHT_PACKED = 151 };

/* One decoder layer's weights and shape. Linear weights are MKL-packed B matrices in column
 * blocks (torch's _mkl_reorder_linear_weight: cblas_sgemm_pack of each block of the [out, in]
 * weight, transposed), each given by its int64 table (cpu_packed.mkl_table: the number of blocks,
 * their addresses, their first columns), each with
 * its float weight where it kept one, row-major [out, in] (*_f) or in column panels (*_p, the
 * layout of cpu_panel_linear.h), else NULL; biases, q_norm/k_norm and sinks may be NULL. Field
 * order matches cpu_stack.StackLayerC. */
typedef struct {
    const float *input_norm, *post_norm;
    const int64_t *qkv_w; const float *qkv_b;
    const int64_t *o_w; const float *o_b;
    const int64_t *gate_up_w; const float *gate_up_b;
    const int64_t *down_w; const float *down_b;
    const float *qkv_f, *o_f, *gate_up_f, *down_f;
    const float *qkv_p, *o_p, *gate_up_p, *down_p;
    const float *q_norm, *k_norm, *sinks, *cos_sin;
    float *k_cache, *v_cache;
    int64_t num_heads, num_kv_heads, head_dim, rot_dim, block_size, window, intermediate;
    float input_eps, post_eps, qk_eps, scale;
    int64_t kv_bf16;  /* 1: k_cache/v_cache hold bfloat16 (cpu_bf16_kv.h), else float32 */
} inflight_stack_layer;

/* out[m, n] = a[m, k] . W^T (+ bias) on a W packed in column blocks (table: cpu_packed.mkl_table),
 * each block exactly as torch's _mkl_linear computes it: the bias copied into every row, then the
 * packed product added (beta 1), else beta 0; a block writes its columns of out (ldc n). With
 * more than one thread and block, the blocks are spread over an OpenMP team and MKL runs inside it
 * on one thread each (a nested region): one fork and join a product, each thread streaming its own
 * columns of the weight once. MKL's own threading of a few-row product, with the passive waits the
 * server needs, kept ~1.4 of 2 cores busy (bench-medium's linears at 48 rows: 33.7 ms against
 * 23.4 split in two blocks, the same bits). A product of 2 x INFLIGHT_GEMM_CHUNK_ROWS rows or
 * more is handed out as row chunks of each block instead (see there). With one thread or one
 * block, one block after the other, each on MKL's own threads. */
#define INFLIGHT_GEMM_CHUNK_ROWS 256  /* rows of a prompt-sized product's work item */

/* Rows [r0, r1) of block b of the table's packed weight: the bias copied into them, then the
 * packed product added (beta 1), else beta 0, written to the block's columns of out (ldc n). */
static void packed_block_rows(inflight_sgemm_compute_fn gemm, const float *a, const int64_t *table, int64_t b,
                              const float *bias, float *out, int64_t r0, int64_t r1, int64_t n, int64_t k) {
    const int64_t num_blocks = table[0];
    const float *packed = (const float *)(intptr_t)table[1 + b];
    const int64_t start = table[1 + num_blocks + b];
    const int64_t end = b + 1 < num_blocks ? table[2 + num_blocks + b] : n;
    if (bias != NULL)
        for (int64_t r = r0; r < r1; ++r) memcpy(out + r * n + start, bias + start, sizeof(float) * (end - start));
    gemm(INFLIGHT_ROW_MAJOR, INFLIGHT_NO_TRANS, INFLIGHT_PACKED, (int)(r1 - r0), (int)(end - start), (int)k,
         a + r0 * k, (int)k, packed, (int)k, bias != NULL ? 1.0f : 0.0f, out + r0 * n + start, (int)n);
}

void inflight_packed_gemm_f32(inflight_sgemm_compute_fn gemm, const float *a, const int64_t *table,
                              const float *bias, float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t num_blocks = table[0];
    if (num_threads > 1 && m >= 2 * INFLIGHT_GEMM_CHUNK_ROWS) {
        /* A prompt-sized product: row chunks x blocks handed out one at a time, so a thread the
         * OS takes away for a while (the server's front end) leaves its chunks to the others. */
        const int64_t chunks = (m + INFLIGHT_GEMM_CHUNK_ROWS - 1) / INFLIGHT_GEMM_CHUNK_ROWS;
        #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int64_t item = 0; item < chunks * num_blocks; ++item) {
            const int64_t r0 = item / num_blocks * INFLIGHT_GEMM_CHUNK_ROWS;
            const int64_t r1 = r0 + INFLIGHT_GEMM_CHUNK_ROWS < m ? r0 + INFLIGHT_GEMM_CHUNK_ROWS : m;
            packed_block_rows(gemm, a, table, item % num_blocks, bias, out, r0, r1, n, k);
        }
        return;
    }
    const int team = num_threads < num_blocks ? num_threads : (int)num_blocks;
    #pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (int64_t b = 0; b < num_blocks; ++b)
        packed_block_rows(gemm, a, table, b, bias, out, 0, m, n, k);
}

/* A layer's product as the per-op path runs it (cpu_native.linear): the panel kernel on the
 * panel weight when there is one and m <= panel_rows, the few-row kernel on the row-major
 * weight when there is one and m <= few_rows, else the packed GEMM. packed is NULL for a
 * oneDNN-packed weight, which has a float weight: cpu_stack.py calls such stacks only with m
 * within its limit. */
static void stack_linear(inflight_sgemm_compute_fn gemm, const float *a, const int64_t *packed, const float *rows,
                         const float *panels, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                         int64_t few_rows, int64_t panel_rows, int num_threads) {
    if (panels != NULL && m <= panel_rows)
        inflight_panel_linear_f32(a, panels, bias, out, m, n, k, num_threads);
    else if (rows != NULL && m <= few_rows)
        inflight_small_m_linear_f32(a, rows, bias, out, m, n, k, num_threads);
    else
        inflight_packed_gemm_f32(gemm, a, packed, bias, out, m, n, k, num_threads);
}

/* Every layer of a pure-decode step, then the final norm, as the decoder's per-op path runs them
 * (inflight/kernels/decode_stack.py is the specification): per layer, RMSNorm with the residual,
 * the q/k/v product, the attention block (inflight_decode_attention_block_f32), the output
 * product, RMSNorm with the residual, the gate/up product, SiLU-and-mul and the down product.
 * hidden_in: [num_seqs, hidden] (the embeddings, not written); out: [num_seqs, hidden], the
 * final-normed hidden states. One scratch allocation per call. Returns 0, -1 when scratch cannot
 * be allocated, or the attention block's failure. few_rows: cpu_packed.FLOAT_COPY_MAX_ROWS;
 * panel_rows: cpu_packed.PANEL_MAX_ROWS. */
int inflight_decode_stack_f32(
    const inflight_stack_layer *layers, int64_t num_layers, inflight_sgemm_compute_fn gemm,
    const float *hidden_in, float *out, const float *final_norm, float final_eps, const int64_t *positions,
    const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *context_lens, int64_t num_seqs,
    int64_t hidden, int64_t max_blocks, int num_threads, int64_t few_rows, int64_t panel_rows) {
    const int64_t m = num_seqs;
    int64_t wide = 0, narrow = 0;  /* the widest qkv / gate_up row, the widest attention / act row */
    for (int64_t i = 0; i < num_layers; ++i) {
        const inflight_stack_layer *L = layers + i;
        const int64_t q = L->num_heads * L->head_dim, qkv = q + 2 * L->num_kv_heads * L->head_dim;
        wide = qkv > wide ? qkv : wide;
        wide = 2 * L->intermediate > wide ? 2 * L->intermediate : wide;
        narrow = q > narrow ? q : narrow;
        narrow = L->intermediate > narrow ? L->intermediate : narrow;
    }
    float *scratch = malloc(sizeof(float) * num_seqs * (3 * hidden + wide + narrow));
    if (scratch == NULL) return -1;
    float *res = scratch, *x = res + num_seqs * hidden, *h = x + num_seqs * hidden;
    float *w = h + num_seqs * hidden, *nw = w + num_seqs * wide;
    memcpy(res, hidden_in, sizeof(float) * num_seqs * hidden);
    int status = 0;
    for (int64_t i = 0; i < num_layers && status == 0; ++i) {
        const inflight_stack_layer *L = layers + i;
        const int64_t q = L->num_heads * L->head_dim, qkv = q + 2 * L->num_kv_heads * L->head_dim;
        if (i == 0)
            inflight_rms_norm_f32(res, hidden, NULL, 0, L->input_norm, x, NULL, num_seqs, hidden, L->input_eps,
                                  num_threads);
        else  /* res += h; x = norm(res) */
            inflight_rms_norm_f32(h, hidden, res, hidden, L->input_norm, x, res, num_seqs, hidden, L->input_eps,
                                  num_threads);
        stack_linear(gemm, x, L->qkv_w, L->qkv_f, L->qkv_p, L->qkv_b, w, m, qkv, hidden, few_rows, panel_rows,
                     num_threads);
        status = decode_block(  /* cpu_decode_block.h: float caches, or bfloat16 ones (kv_bf16) */
            w, qkv, positions, L->cos_sin, L->rot_dim, L->q_norm, L->k_norm, L->qk_eps, L->kv_bf16 ? NULL : L->k_cache,
            L->kv_bf16 ? NULL : L->v_cache, L->kv_bf16 ? (uint16_t *)L->k_cache : NULL,
            L->kv_bf16 ? (uint16_t *)L->v_cache : NULL, slot_mapping, block_tables, context_lens, nw, num_seqs,
            L->num_heads, L->num_kv_heads, L->head_dim, L->block_size, max_blocks, L->scale, num_threads, L->window,
            L->sinks);
        stack_linear(gemm, nw, L->o_w, L->o_f, L->o_p, L->o_b, h, m, hidden, q, few_rows, panel_rows, num_threads);
        inflight_rms_norm_f32(h, hidden, res, hidden, L->post_norm, x, res, num_seqs, hidden, L->post_eps,
                              num_threads);
        stack_linear(gemm, x, L->gate_up_w, L->gate_up_f, L->gate_up_p, L->gate_up_b, w, m, 2 * L->intermediate,
                     hidden, few_rows, panel_rows, num_threads);
        inflight_silu_and_mul_f32(w, 2 * L->intermediate, nw, num_seqs, L->intermediate, num_threads);
        stack_linear(gemm, nw, L->down_w, L->down_f, L->down_p, L->down_b, h, m, hidden, L->intermediate, few_rows,
                     panel_rows, num_threads);
    }
    if (status == 0)
        inflight_rms_norm_f32(h, hidden, res, hidden, final_norm, out, res, num_seqs, hidden, final_eps,
                              num_threads);
    free(scratch);
    return status;
}
