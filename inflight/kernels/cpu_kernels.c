/* Native CPU kernels (float32) with the semantics of inflight/kernels/reference.py.
 *
 * Built on first use by inflight/kernels/cpu_native.py with the system C compiler and
 * loaded through ctypes; plain C with OpenMP (the process's one OpenMP runtime, the one
 * torch loaded), no torch headers, so it builds in about a second. Every function takes raw
 * pointers plus the strides it needs; the Python wrappers check dtypes and layouts and use
 * the torch reference for anything else.
 *
 * Why: the reference's decode attention gathers every sequence's K/V blocks into a padded
 * copy and then runs SDPA over it (three passes over the context); this one reads each
 * cached row once, in place, with an online softmax. The norm, rotary and KV-store kernels
 * replace 5-10 small torch ops each with one call; the few-row linear streams weights that
 * library GEMMs read slowly when only a few rows multiply them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their running max), within ~2 ulp of expf; written so the
 * compiler vectorizes it (libm's expf is a scalar call: it was most of a decode step). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  /* exp(-87) ~ 1.6e-38: 0 next to the max's 1, no denormals */
    const float k = __builtin_floorf(x * 1.44269504f + 0.5f);  /* x = k ln2 + r, |r| <= ln2/2 */
    const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
    float poly = 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)k + 127) << 23};  /* 2^k */
    return poly * scale.f;
}

/* One sequence: each cache block (block_size rows of every KV head, contiguous) is read
 * front to back once for all heads while it sits in L1, with an online softmax. Rows before
 * position `first` (outside a sliding window) are skipped: blocks wholly before it are never
 * read, and in the block that holds it the scores start at row t0. `sinks` (NULL: none) holds
 * one logit per head that joins the softmax denominator with no value (gpt-oss). */
static inline __attribute__((always_inline)) void decode_sequence(
    const float *qs, const float *k_cache, const float *v_cache, const int32_t *table,
    int64_t ctx, int64_t first, float *o, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, const float *sinks, float *acc, float *m,
    float *l, float *p) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tok_stride = num_kv_heads * head_dim;
    const int64_t blk_stride = block_size * tok_stride;
    for (int64_t h = 0; h < num_heads; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t b = first / block_size; b * block_size < ctx; ++b) {
        const int64_t n = ctx - b * block_size < block_size ? ctx - b * block_size : block_size;
        const int64_t t0 = first > b * block_size ? first - b * block_size : 0;
        const float *kb = k_cache + (int64_t)table[b] * blk_stride;
        const float *vb = v_cache + (int64_t)table[b] * blk_stride;
        for (int64_t t = t0; t < n; ++t) {  /* scores, K rows in memory order */
            for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
                const float *kh = kb + t * tok_stride + kvh * head_dim;
                for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
                    const float *qh = qs + h * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kh[i];
                    p[h * block_size + t] = dot * scale;
                }
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {  /* online softmax: rescale, exp */
            float *ph = p + h * block_size;
            float block_max = ph[t0];
            for (int64_t t = t0 + 1; t < n; ++t) block_max = ph[t] > block_max ? ph[t] : block_max;
            const float new_max = block_max > m[h] ? block_max : m[h];
            const float correction = expf(m[h] - new_max);  /* exp(-inf) = 0 at the start */
            float *ah = acc + h * head_dim;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = t0; t < n; ++t) {
                ph[t] = exp_nonpositive(ph[t] - new_max);
                sum += ph[t];
            }
            l[h] = l[h] * correction + sum;
            m[h] = new_max;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) ah[i] *= correction;
        }
        for (int64_t t = t0; t < n; ++t) {  /* weighted V rows, in memory order */
            for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
                const float *vh = vb + t * tok_stride + kvh * head_dim;
                for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
                    const float w = p[h * block_size + t];
                    float *ah = acc + h * head_dim;
#pragma omp simd
                    for (int64_t i = 0; i < head_dim; ++i) ah[i] += w * vh[i];
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        float lh = l[h], keep = 1.0f;  /* the sink adds exp(sink) to the denominator only */
        if (sinks != NULL) {
            const float top = sinks[h] > m[h] ? sinks[h] : m[h];
            keep = expf(m[h] - top);
            lh = lh * keep + expf(sinks[h] - top);
        }
        const float inv = lh > 0.0f ? keep / lh : 0.0f;
        for (int64_t i = 0; i < head_dim; ++i) o[h * head_dim + i] = acc[h * head_dim + i] * inv;
    }
}

/* q [num_seqs, num_heads, head_dim] contiguous; caches [num_blocks, block_size,
 * num_kv_heads, head_dim] contiguous; block_tables [num_seqs, max_blocks] int32;
 * context_lens [num_seqs] int32; out like q; window > 0: each query sees only the last
 * `window` rows of its context (0: all of them); sinks [num_heads] or NULL. One sequence per work item. The common head
 * sizes get a copy with the size a constant (unrolled feature loops: ~20% faster at 32).
 * Returns 0, or -1 when the per-thread scratch cannot be allocated. */
int inflight_paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
    const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    int num_threads, int64_t window, const float *sinks) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *acc = malloc(sizeof(float) * num_heads * head_dim);
        float *m = malloc(sizeof(float) * num_heads);
        float *l = malloc(sizeof(float) * num_heads);
        float *p = malloc(sizeof(float) * num_heads * block_size);  /* [num_heads, block_size] */
        failed = !acc || !m || !l || !p;
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; ++s) {
            if (failed) continue;
#define SEQ(D)                                                                                    \
    decode_sequence(q + s * num_heads * head_dim, k_cache, v_cache, block_tables + s * max_blocks, \
                    context_lens[s],                                                              \
                    window > 0 && context_lens[s] > window ? context_lens[s] - window : 0,        \
                    out + s * num_heads * head_dim, num_heads, num_kv_heads, D, block_size, scale, \
                    sinks, acc, m, l, p)
            switch (head_dim) {
                case 32: SEQ(32); break;
                case 64: SEQ(64); break;
                case 128: SEQ(128); break;
                default: SEQ(head_dim);
            }
#undef SEQ
        }
        free(acc);
        free(m);
        free(l);
        free(p);
    }
    return failed ? -1 : 0;
}

/* Rows of key/value (token stride *_stride, heads then head_dim contiguous) into their
 * cache slots; slot -1 skips the token. */
void inflight_store_kv_cache_f32(
    const float *key, int64_t key_stride, const float *value, int64_t value_stride,
    float *k_cache, float *v_cache, const int64_t *slot_mapping, int64_t num_tokens,
    int64_t row_size) {
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_size, key + t * key_stride, sizeof(float) * row_size);
        memcpy(v_cache + slot * row_size, value + t * value_stride, sizeof(float) * row_size);
    }
}

/* out = weight * ((x + residual) * rsqrt(mean((x + residual)^2) + eps)); new_residual =
 * x + residual when residual is given. x and residual rows have their own strides; out and
 * new_residual are contiguous [num_tokens, hidden]. */
__attribute__((optimize("fp-contract=off")))
void inflight_rms_norm_f32(
    const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
    const float *weight, float *out, float *new_residual, int64_t num_tokens, int64_t hidden,
    float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *xr = x + t * x_stride;
        float *o = out + t * hidden;
        const float *row = xr;
        if (residual != NULL) {
            const float *rr = residual + t * residual_stride;
            float *nr = new_residual + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) nr[i] = xr[i] + rr[i];
            row = nr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += row[i] * row[i];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (row[i] * inv);
    }
}

/* Neox-style rotary embedding of the first rot_dim features of every head; the rest are
 * copied. x rows have token stride x_stride, heads head_dim apart; out is contiguous
 * [num_tokens, num_heads, head_dim]. cos_sin rows: rot_dim / 2 cosines, then the sines. */
__attribute__((optimize("fp-contract=off")))
void inflight_rotary_embedding_f32(
    const int64_t *positions, const float *x, int64_t x_stride, int64_t num_heads,
    int64_t head_dim, const float *cos_sin, int64_t rot_dim, float *out, int64_t num_tokens) {
    const int64_t half = rot_dim / 2;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *c = cos_sin + positions[t] * rot_dim;
        const float *sn = c + half;
        for (int64_t h = 0; h < num_heads; ++h) {
            const float *xi = x + t * x_stride + h * head_dim;
            float *o = out + (t * num_heads + h) * head_dim;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = xi[i], x2 = xi[i + half];
                o[i] = x1 * c[i] - x2 * sn[i];
                o[i + half] = x2 * c[i] + x1 * sn[i];
            }
            for (int64_t i = rot_dim; i < head_dim; ++i) o[i] = xi[i];
        }
    }
}

/* out[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for a few rows (decode steps of a few
 * sequences, the LM head of a decode batch): each weight row is streamed once and dotted with
 * every input row, four at a time, split across threads by output column. Library GEMMs pack
 * the weight for a large m and reach ~15 GB/s of weight at m = 1-2 here; this streams it at
 * 2-5x that. x, w and out are contiguous; bias may be NULL. */
void inflight_small_m_linear_f32(
    const float *x, const float *w, const float *bias, float *out, int64_t m, int64_t n,
    int64_t k, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
        const float *wr = w + j * k;
        const float b = bias != NULL ? bias[j] : 0.0f;
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) {
            const float *x0 = x + r * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t i = 0; i < k; ++i) {
                const float wi = wr[i];
                a0 += x0[i] * wi;
                a1 += x1[i] * wi;
                a2 += x2[i] * wi;
                a3 += x3[i] * wi;
            }
            out[r * n + j] = a0 + b;
            out[(r + 1) * n + j] = a1 + b;
            out[(r + 2) * n + j] = a2 + b;
            out[(r + 3) * n + j] = a3 + b;
        }
        for (; r < m; ++r) {
            const float *xr = x + r * k;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < k; ++i) acc += xr[i] * wr[i];
            out[r * n + j] = acc + b;
        }
    }
}
