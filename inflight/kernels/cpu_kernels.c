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
 * replace 5-10 small torch ops each with one call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

/* q [num_seqs, num_heads, head_dim] contiguous; caches [num_blocks, block_size,
 * num_kv_heads, head_dim] contiguous; block_tables [num_seqs, max_blocks] int32;
 * context_lens [num_seqs] int32; out like q. Returns 0, or -1 for unsupported sizes. */
int inflight_paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
    const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1;
    const int64_t tok_stride = num_kv_heads * head_dim;
    const int64_t blk_stride = block_size * tok_stride;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            float m[MAX_GROUP], l[MAX_GROUP];
            float acc[MAX_GROUP * MAX_HEAD_DIM];
            float scores[MAX_GROUP * MAX_BLOCK_SIZE];
            const float *qs = q + (s * num_heads + h * group) * head_dim;
            const int64_t ctx = context_lens[s];
            for (int64_t g = 0; g < group; ++g) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * group * head_dim);
            for (int64_t b = 0; b * block_size < ctx; ++b) {
                const int64_t block = block_tables[s * max_blocks + b];
                const int64_t n = ctx - b * block_size < block_size ? ctx - b * block_size : block_size;
                const float *kb = k_cache + block * blk_stride + h * head_dim;
                const float *vb = v_cache + block * blk_stride + h * head_dim;
                for (int64_t t = 0; t < n; ++t) {
                    const float *kr = kb + t * tok_stride;
                    for (int64_t g = 0; g < group; ++g) {
                        const float *qg = qs + g * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * kr[i];
                        scores[g * block_size + t] = dot * scale;
                    }
                }
                for (int64_t g = 0; g < group; ++g) {
                    float *sg = scores + g * block_size;
                    float block_max = sg[0];
                    for (int64_t t = 1; t < n; ++t) block_max = sg[t] > block_max ? sg[t] : block_max;
                    const float new_max = block_max > m[g] ? block_max : m[g];
                    const float correction = expf(m[g] - new_max);  /* exp(-inf) = 0 at the start */
                    float *ag = acc + g * head_dim;
                    l[g] *= correction;
                    for (int64_t i = 0; i < head_dim; ++i) ag[i] *= correction;
                    for (int64_t t = 0; t < n; ++t) {
                        const float p = expf(sg[t] - new_max);
                        const float *vr = vb + t * tok_stride;
                        l[g] += p;
#pragma omp simd
                        for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * vr[i];
                    }
                    m[g] = new_max;
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                float *o = out + (s * num_heads + h * group + g) * head_dim;
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int64_t i = 0; i < head_dim; ++i) o[i] = acc[g * head_dim + i] * inv;
            }
        }
    }
    return 0;
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
