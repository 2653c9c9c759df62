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
 * cached row once, in place, with an online softmax, in memory order, every head against a
 * vector's width of tokens at a time (vectorized over tokens, cpu_vecf.h). The norm, rotary and KV-store kernels
 * replace 5-10 small torch ops each with one call, silu_and_mul two ops and their temporaries;
 * the decode attention block (qk-norm, rotary, KV store and attention of a pure-decode step,
 * reading q/k/v from the fused projection's rows) replaces ~20 Python-level calls per layer with
 * one, which matters most in the CPU decode lanes, where each call may wait for the GIL;
 * the few-row linear streams weights that library GEMMs read slowly when only a few rows
 * multiply them. fp8 KV caches (inflight/kernels/fp8_kv.py): the store encodes bytes
 * (fp8_encode, bit-exact with torch's cast of the clamped value), decode attention decodes each
 * block's rows through a 256-entry table into a float scratch and runs the float code on them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vecf.h"

/* Decode attention, the cache read in memory order. A cache block is block_size rows, each
 * row every KV head's head_dim features, contiguous; a step's K/V is far larger than the caches
 * (bench-medium at 64 decodes: ~340 MB), so what bounds the kernel is how fast it pulls the
 * blocks in. Each row is read whole, front to back (all query heads scored against its KV
 * heads), never a KV head's slice of every row and then the next slice: on a 2-core AMD EPYC
 * that strided order read randomly placed 16 KiB blocks at ~5 GB/s a thread where a front-to-back
 * read of K and V at once reaches ~12. While a K row is scored, the same V row is prefetched;
 * while V rows are weighted, the next block's K rows are. The scores of a tile of tokens (a
 * vector's width: 16 with AVX-512, else 8) are one dot-product partial vector per (head, token),
 * vectorized over head_dim, folded into one vector of the tile's scores per head (vecf_hsum,
 * cpu_vecf.h), so the scores, their max and the softmax are vectorized over tokens and no
 * (token, head) pays a horizontal reduction of its own. Then the online softmax per block
 * (running max m, sum l, the accumulators rescaled when the max moves; exp is
 * vecf_exp_nonpositive, a polynomial, not libm's scalar expf) and the weighted V rows, four rows
 * at a time into each head's accumulator. Rows before `t0` (outside a sliding window) are
 * skipped; rows past the context are never read into a sum; `sinks` (NULL: none) holds one
 * logit per head that joins the softmax denominator with no value (gpt-oss). */
#define TILE VECF_W  /* tokens scored at once: one vector of scores */

/* Ask for the `len` floats at `row` in L2 (a cache line, 16 floats, at a time). */
static inline __attribute__((always_inline)) void prefetch_row(const float *row, int64_t len) {
    for (int64_t i = 0; i < len; i += 16) __builtin_prefetch(row + i, 0, 2);
}

/* Scores of every query head (q: [num_heads, head_dim]) against rows [base, base + valid)
 * of a block (row t at kb + t * tok_stride, all KV heads, valid <= TILE), the row's KV heads
 * read in memory order: part[h * TILE + j] is head h's dot-product partial vector for row
 * base + j (zero past valid), folded into one vector of the tile's scores per head (vecf_hsum),
 * scaled, lanes past valid -inf, into p[h * p_stride + base]; each head's largest score raises
 * block_max[h]. While a K row is read, the same row of V (vb) is prefetched, so the values
 * pass finds it in cache and both streams are in flight at once. */
static inline __attribute__((always_inline)) void tile_scores(
    const float *q, const float *kb, const float *vb, int64_t tok_stride, int64_t base, int64_t valid,
    int64_t num_heads, const int64_t *h_kv, int64_t head_dim, float scale, vecf *part, float *p, int64_t p_stride,
    float *block_max) {
    const int64_t full = head_dim / VECF_W * VECF_W;
    for (int64_t j = 0; j < TILE; ++j) {
        if (j >= valid) {
            for (int64_t h = 0; h < num_heads; ++h) part[h * TILE + j] = vecf_splat(0.0f);
            continue;
        }
        const float *row = kb + (base + j) * tok_stride;
        prefetch_row(vb + (base + j) * tok_stride, tok_stride);
        for (int64_t h = 0; h < num_heads; ++h) {
            const float *qh = q + h * head_dim, *kh = row + h_kv[h];
            vecf dot = vecf_splat(0.0f);
            for (int64_t d = 0; d < full; d += VECF_W) dot += vecf_load(qh + d) * vecf_load(kh + d);
            part[h * TILE + j] = dot;
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        vecf s = vecf_hsum(part + h * TILE);
        if (full < head_dim) {  /* features past the last whole vector */
            const float *qh = q + h * head_dim;
            float tail[TILE] = {0};
            for (int64_t j = 0; j < valid; ++j) {
                const float *kh = kb + (base + j) * tok_stride + h_kv[h];
                for (int64_t d = full; d < head_dim; ++d) tail[j] += qh[d] * kh[d];
            }
            s += vecf_load(tail);
        }
        s = vecf_keep_first(s * vecf_splat(scale), valid, -INFINITY);
        vecf_store(p + h * p_stride + base, s);
        const float top = vecf_reduce_max(s);
        block_max[h] = top > block_max[h] ? top : block_max[h];
    }
}

/* acc[h] += sum over rows t in [t0, n) of p[h, t] * v[t] for every head, the rows read in
 * memory order, four at a time (each accumulator vector loaded and stored once per four
 * rows). While a V row is read, the same row of the next block's K (nk, NULL: none) is
 * prefetched. acc was scaled by each head's correction before. */
static inline __attribute__((always_inline)) void block_values(
    const float *vb, const float *nk, int64_t tok_stride, int64_t t0, int64_t n, int64_t num_heads,
    const int64_t *h_kv, int64_t head_dim, const float *p, int64_t p_stride, float *acc) {
    const int64_t full = head_dim / VECF_W * VECF_W;
    for (int64_t t = t0; t < n; t += 4) {
        const int64_t rows = n - t < 4 ? n - t : 4;
        if (nk != NULL) prefetch_row(nk + t * tok_stride, rows * tok_stride);
        const float *v0 = vb + t * tok_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
            const float *ph = p + h * p_stride + t;
            const float *vh = v0 + h_kv[h];
            float *ah = acc + h * head_dim;
            if (rows == 4) {
                const vecf w0 = vecf_splat(ph[0]), w1 = vecf_splat(ph[1]), w2 = vecf_splat(ph[2]),
                           w3 = vecf_splat(ph[3]);
                for (int64_t d = 0; d < full; d += VECF_W) {
                    const vecf a = w0 * vecf_load(vh + d) + w1 * vecf_load(vh + tok_stride + d);
                    const vecf b = w2 * vecf_load(vh + 2 * tok_stride + d) + w3 * vecf_load(vh + 3 * tok_stride + d);
                    vecf_store(ah + d, vecf_load(ah + d) + (a + b));
                }
                for (int64_t d = full; d < head_dim; ++d)
                    ah[d] += (ph[0] * vh[d] + ph[1] * vh[tok_stride + d])
                           + (ph[2] * vh[2 * tok_stride + d] + ph[3] * vh[3 * tok_stride + d]);
            } else {
                for (int64_t r = 0; r < rows; ++r) {
                    const vecf w = vecf_splat(ph[r]);
                    for (int64_t d = 0; d < full; d += VECF_W)
                        vecf_store(ah + d, vecf_load(ah + d) + w * vecf_load(vh + r * tok_stride + d));
                    for (int64_t d = full; d < head_dim; ++d) ah[d] += ph[r] * vh[r * tok_stride + d];
                }
            }
        }
    }
}

/* What a head's accumulated outputs are multiplied by at the end of an online softmax with
 * running max m and sum l: 1 / l, or with a sink logit (sinks[h], NULL: none) that joins the
 * denominator with no value, exp(m - top) / (l exp(m - top) + exp(sink - top)). */
static inline __attribute__((always_inline)) float softmax_normalizer(float m, float l, const float *sinks,
                                                                      int64_t h) {
    float keep = 1.0f;
    if (sinks != NULL) {
        const float top = sinks[h] > m ? sinks[h] : m;
        keep = expf(m - top);
        l = l * keep + expf(sinks[h] - top);
    }
    return l > 0.0f ? keep / l : 0.0f;
}

/* An fp8 cache (kv8.k NULL: float caches): bytes in the layout of the float caches, decoded
 * through 256-entry tables that already hold byte value * the layer's scale; each block's
 * rows are decoded into the float scratch kf/vf [block_size, num_kv_heads, head_dim] and read
 * from there by the float code, so both paths share every line of the softmax. A bfloat16
 * cache (h16k/h16v set, k NULL; cpu_bf16_kv.h) is widened into the same scratch: a bfloat16
 * value is the top half of the float's bits. */
typedef struct {
    const uint8_t *k, *v;
    const float *k_lut, *v_lut;
    float *kf, *vf;
    const uint16_t *h16k, *h16v;
} kv8_t;

static inline __attribute__((always_inline)) void kv8_decode_rows(const uint8_t *src, const float *lut, float *dst,
                                                                  int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = lut[src[i]];
}

static inline __attribute__((always_inline)) void bf16_widen_rows(const uint16_t *src, float *dst, int64_t begin,
                                                                  int64_t end) {
    uint32_t *bits = (uint32_t *)dst;
    for (int64_t i = begin; i < end; ++i) bits[i] = (uint32_t)src[i] << 16;
}

/* float -> bfloat16 bits, rounded to nearest-even as torch's cast rounds (a carry into the
 * exponent is the next binade; the largest finite values round to infinity); NaN stays a quiet
 * NaN with its sign. */
static inline uint16_t bf16_round(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Whether kv reads a narrow cache (fp8 or bfloat16) through the per-thread scratch. */
static inline int kv_is_narrow(kv8_t kv) { return kv.k != NULL || kv.h16k != NULL; }

/* One sequence (see above). Scratch: acc [num_heads, head_dim], m, l and mb [num_heads],
 * p [num_heads, block_size + TILE]. */
static inline __attribute__((always_inline)) void decode_sequence(
    const float *qs, const float *k_cache, const float *v_cache, const int32_t *table,
    int64_t ctx, int64_t first, float *o, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, const float *sinks, float *acc, float *m,
    float *l, float *mb, float *p, kv8_t kv8) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tok_stride = num_kv_heads * head_dim;
    const int64_t blk_stride = block_size * tok_stride;
    const int64_t p_stride = block_size + TILE;
    vecf part[num_heads * TILE];  /* a tile's dot-product partials, one vector per (head, row) */
    int64_t h_kv[num_heads];  /* where head h's KV head starts in a row */
    for (int64_t h = 0; h < num_heads; ++h) h_kv[h] = h / group * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t b = first / block_size; b * block_size < ctx; ++b) {
        const int64_t n = ctx - b * block_size < block_size ? ctx - b * block_size : block_size;
        const int64_t t0 = first > b * block_size ? first - b * block_size : 0;
        const float *kb, *vb, *nk;
        if (kv8.k != NULL) {  /* fp8: this block's rows decoded into the scratch */
            const int64_t off = (int64_t)table[b] * blk_stride;
            kv8_decode_rows(kv8.k + off, kv8.k_lut, kv8.kf, t0 * tok_stride, n * tok_stride);
            kv8_decode_rows(kv8.v + off, kv8.v_lut, kv8.vf, t0 * tok_stride, n * tok_stride);
            kb = kv8.kf, vb = kv8.vf, nk = NULL;
        } else if (kv8.h16k != NULL) {  /* bfloat16: this block's rows widened into the scratch */
            const int64_t off = (int64_t)table[b] * blk_stride;
            if ((b + 1) * block_size < ctx) {  /* the next block's K and V on their way while this one runs */
                const int64_t next = (int64_t)table[b + 1] * blk_stride;
                prefetch_row((const float *)(kv8.h16k + next), blk_stride / 2);
                prefetch_row((const float *)(kv8.h16v + next), blk_stride / 2);
            }
            bf16_widen_rows(kv8.h16k + off, kv8.kf, t0 * tok_stride, n * tok_stride);
            bf16_widen_rows(kv8.h16v + off, kv8.vf, t0 * tok_stride, n * tok_stride);
            kb = kv8.kf, vb = kv8.vf, nk = NULL;
        } else {
            kb = k_cache + (int64_t)table[b] * blk_stride;
            vb = v_cache + (int64_t)table[b] * blk_stride;
            nk = (b + 1) * block_size < ctx ? k_cache + (int64_t)table[b + 1] * blk_stride : NULL;
        }
        for (int64_t h = 0; h < num_heads; ++h) mb[h] = -INFINITY;
        for (int64_t base = t0; base < n; base += TILE)
            tile_scores(qs, kb, vb, tok_stride, base, n - base < TILE ? n - base : TILE, num_heads, h_kv, head_dim,
                        scale, part, p, p_stride, mb);
        for (int64_t h = 0; h < num_heads; ++h) {  /* online softmax: mb holds the block's max; the accumulators are rescaled here */
            float *ph = p + h * p_stride;
            const float new_max = mb[h] > m[h] ? mb[h] : m[h];
            vecf sum = vecf_splat(0.0f);
            for (int64_t base = t0; base < n; base += TILE) {
                const vecf e = vecf_exp_nonpositive(vecf_load(ph + base) - new_max);
                const vecf w = vecf_keep_first(e, n - base, 0.0f);
                vecf_store(ph + base, w);
                sum += w;
            }
            const float corr = expf(m[h] - new_max);  /* exp(-inf) = 0 at the start */
            l[h] = l[h] * corr + vecf_reduce_add(sum);
            m[h] = new_max;
            if (corr != 1.0f)
                for (int64_t i = 0; i < head_dim; ++i) acc[h * head_dim + i] *= corr;
        }
        block_values(vb, nk, tok_stride, t0, n, num_heads, h_kv, head_dim, p, p_stride, acc);
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = softmax_normalizer(m[h], l[h], sinks, h);
        for (int64_t i = 0; i < head_dim; ++i) o[h * head_dim + i] = acc[h * head_dim + i] * inv;
    }
}

/* One sequence's decode attention (see decode_sequence), the common head sizes as constants (the
 * feature loops unrolled, the accumulators in registers); window > 0: only the last `window`
 * rows of its context. Scratch: acc [num_heads * head_dim], m [3 * num_heads] (m, l, mb),
 * p [num_heads * (block_size + TILE)]. */
static inline __attribute__((always_inline)) void attend_sequence(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t ctx,
    int64_t window, float *o, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, const float *sinks, float *acc, float *m, float *p, kv8_t kv8) {
    const int64_t first = window > 0 && ctx > window ? ctx - window : 0;
#define SEQ(D)                                                                                          \
    decode_sequence(q, k_cache, v_cache, table, ctx, first, o, num_heads, num_kv_heads, D, block_size, \
                    scale, sinks, acc, m, m + num_heads, m + 2 * num_heads, p, kv8)
    switch (head_dim) {
        case 32: SEQ(32); break;
        case 64: SEQ(64); break;
        case 128: SEQ(128); break;
        default: SEQ(head_dim);
    }
#undef SEQ
}

/* Every sequence's decode attention, one sequence per work item, over float caches (narrow's
 * pointers NULL) or a narrow cache (narrow: an fp8 or bfloat16 cache; each thread gets the float
 * scratch its blocks are decoded into). Returns 0, or -1 when the per-thread scratch cannot be
 * allocated. */
static int paged_attention(const float *q, const float *k_cache, const float *v_cache, kv8_t narrow,
                           const int32_t *block_tables, const int32_t *context_lens, float *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, float scale, int num_threads, int64_t window, const float *sinks) {
    const int64_t blk = block_size * num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *acc = malloc(sizeof(float) * num_heads * head_dim);
        float *m = malloc(sizeof(float) * num_heads * 3);  /* m, l, mb */
        float *p = malloc(sizeof(float) * num_heads * (block_size + TILE));
        float *kvf = kv_is_narrow(narrow) ? malloc(sizeof(float) * 2 * blk) : NULL;
        failed = !acc || !m || !p || (kv_is_narrow(narrow) && !kvf);
        kv8_t kv = narrow;
        kv.kf = kvf, kv.vf = kvf == NULL ? NULL : kvf + blk;
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; ++s) {
            if (failed) continue;
            attend_sequence(q + s * num_heads * head_dim, k_cache, v_cache, block_tables + s * max_blocks,
                            context_lens[s], window, out + s * num_heads * head_dim, num_heads, num_kv_heads,
                            head_dim, block_size, scale, sinks, acc, m, p, kv);
        }
        free(acc);
        free(m);
        free(p);
        free(kvf);
    }
    return failed ? -1 : 0;
}

/* q [num_seqs, num_heads, head_dim] contiguous; caches [num_blocks, block_size,
 * num_kv_heads, head_dim] contiguous; block_tables [num_seqs, max_blocks] int32;
 * context_lens [num_seqs] int32; out like q; window > 0: each query sees only the last
 * `window` rows of its context (0: all of them); sinks [num_heads] or NULL. One sequence per
 * work item. The common head sizes get a copy with the size a constant (the feature loops
 * unrolled, the accumulators in registers). Returns 0, or -1 when the per-thread scratch
 * cannot be allocated. */
int inflight_paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
    const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    int num_threads, int64_t window, const float *sinks) {
    return paged_attention(q, k_cache, v_cache, (kv8_t){0}, block_tables, context_lens, out, num_seqs, num_heads,
                           num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads, window, sinks);
}

/* Rows of key/value (token stride *_stride, heads then head_dim contiguous) into their
 * cache slots; slot -1 skips the token. A step's slots are distinct, so the tokens split over
 * threads when the copy is big (a prefill chunk). */
void inflight_store_kv_cache_f32(
    const float *key, int64_t key_stride, const float *value, int64_t value_stride,
    float *k_cache, float *v_cache, const int64_t *slot_mapping, int64_t num_tokens,
    int64_t row_size, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * row_size >= (1 << 17))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_size, key + t * key_stride, sizeof(float) * row_size);
        memcpy(v_cache + slot * row_size, value + t * value_stride, sizeof(float) * row_size);
    }
}

/* out = weight * ((x + residual) * rsqrt(mean((x + residual)^2) + eps)); new_residual =
 * x + residual when residual is given. x and residual rows have their own strides; out and
 * new_residual are contiguous [num_tokens, hidden]. On one thread unless the op is big (a
 * prefill chunk): at 64-256 rows of 256-512 features two threads were 3-6 us slower per call
 * than one (2 cores, passive OpenMP waits: the fork wakes a sleeping thread). */
__attribute__((optimize("fp-contract=off")))
void inflight_rms_norm_f32(
    const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
    const float *weight, float *out, float *new_residual, int64_t num_tokens, int64_t hidden,
    float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * hidden >= (1 << 18))
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
 * [num_tokens, num_heads, head_dim]. cos_sin rows: rot_dim / 2 cosines, then the sines. The
 * tokens split over threads when the op is big (a prefill chunk). */
__attribute__((optimize("fp-contract=off")))
void inflight_rotary_embedding_f32(
    const int64_t *positions, const float *x, int64_t x_stride, int64_t num_heads,
    int64_t head_dim, const float *cos_sin, int64_t rot_dim, float *out, int64_t num_tokens, int num_threads) {
    const int64_t half = rot_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * num_heads * head_dim >= (1 << 17))
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

/* silu(g) * u lane by lane, silu(g) = g / (1 + exp(-g)) as torch computes it, exp(-g) by the
 * polynomial of cpu_vecf.h on -g clamped to [-20, 88.75]: below -20 it is under half an ulp of
 * 1 (1 + e rounds to 1 either way); 2^k is built as 2^(k-1) * 2 so that k = 128 (-g up to
 * log(FLT_MAX) ~ 88.72) stays finite, and past it the product overflows to +inf, as expf does
 * (silu(g) = -0 for g below ~-88.72, as in torch). NaN stays NaN; silu(+inf) = +inf and
 * silu(-inf) = -inf / inf = NaN, as in torch. */
static inline __attribute__((always_inline)) vecf silu_mul(vecf g, vecf u) {
    ivecf k;
    const vecf poly = vecf_exp_reduced(vecf_max(vecf_min(-g, vecf_splat(88.75f)), vecf_splat(-20.0f)), &k);
    const vecf e = poly * (vecf)((k + 126) << 23) * 2.0f;
    return g / (1.0f + e) * u;
}

/* out[t, :] = silu(x[t, :d]) * x[t, d:2d] (SwiGLU: gate, then up, in one row of stride
 * x_stride); out is contiguous [num_tokens, d]. One pass, a vector at a time; the features
 * past the last whole vector go through the same vector code on a padded copy. On one thread
 * unless the op is big (a prefill chunk): a decode lane's call (32 x 1536) takes ~18 us, where a
 * second thread would save less than its fork and join cost with passive waits. */
void inflight_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t num_tokens, int64_t d,
                               int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * d >= (1 << 18))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *g = x + t * x_stride, *u = g + d;
        float *o = out + t * d;
        int64_t i = 0;
        for (; i + VECF_W <= d; i += VECF_W) vecf_store(o + i, silu_mul(vecf_load(g + i), vecf_load(u + i)));
        if (i < d) {
            float gt[VECF_W] = {0}, ut[VECF_W] = {0}, ot[VECF_W];
            memcpy(gt, g + i, sizeof(float) * (d - i));
            memcpy(ut, u + i, sizeof(float) * (d - i));
            vecf_store(ot, silu_mul(vecf_load(gt), vecf_load(ut)));
            memcpy(o + i, ot, sizeof(float) * (d - i));
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

#include "cpu_panel_linear.h"  /* few-row products on a weight kept in column panels */
#include "cpu_decode_block.h"  /* composes the kernels above: kept in its own file */
#include "cpu_bf16_kv.h"  /* bfloat16 KV caches of a float32 engine: store, decode attention and block, prefill */
#include "cpu_prefill_attention.h"  /* prompt chunks: tiled online softmax, softmax_normalizer above */
#include "cpu_decode_stack.h"  /* a pure-decode step's whole layer stack: composes the block above */
#include "cpu_fp8_kv.h"  /* fp8 KV caches: store, decode attention over them, block decoding for prefill */
