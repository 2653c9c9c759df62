/* fp8 KV caches in inflight's CPU kernels (inflight/kernels/fp8_kv.py is the definition), included at
 * the end of cpu_kernels.c (it runs that file's decode attention on the kv8_t path and needs its
 * static helpers); not a header to include anywhere else. */

/* inflight_paged_decode_attention_f32 over fp8 caches (bytes, same layout): k_lut/v_lut [256]
 * hold each byte's value times the layer's K/V scale (exact: the reference dequantizes the same
 * way). Each thread decodes a block's rows into its scratch and runs the float code on them. */
int inflight_paged_decode_attention_fp8(
    const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const float *k_lut, const float *v_lut,
    const int32_t *block_tables, const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    int num_threads, int64_t window, const float *sinks) {
    const kv8_t fp8 = {k_cache, v_cache, k_lut, v_lut, NULL, NULL, NULL, NULL};
    return paged_attention(q, NULL, NULL, fp8, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
                           head_dim, block_size, max_blocks, scale, num_threads, window, sinks);
}

/* float -> fp8 byte: x already multiplied by 1 / scale; saturated to +-max_value, rounded to
 * nearest-even (mantissa_bits 3, bias 7: e4m3fn; 2 and 15: e5m2), as torch's cast of the
 * clamped value. A normal result rounds the float's bits in place (a carry into the exponent is
 * the next binade); below the format's smallest normal it is a multiple of the subnormal step,
 * rounded with rintf (nearest-even). NaN stays NaN (0x7f, sign kept). */
static inline uint8_t fp8_encode(float x, int mantissa_bits, int bias, float max_value) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(x);
    if (a != a) return (uint8_t)(sign | 0x7f);
    if (a > max_value) a = max_value;
    const float min_normal = ldexpf(1.0f, 1 - bias);
    if (a < min_normal) return (uint8_t)(sign | (uint8_t)rintf(ldexpf(a, bias - 1 + mantissa_bits)));
    memcpy(&bits, &a, sizeof(bits));
    const int shift = 23 - mantissa_bits;
    bits += ((1u << (shift - 1)) - 1u) + ((bits >> shift) & 1u);
    return (uint8_t)(sign | (uint8_t)((bits >> shift) - ((uint32_t)(127 - bias) << mantissa_bits)));
}

/* inflight_store_kv_cache_f32 into fp8 caches: each value times k_inv/v_inv (1 / the layer's
 * scale), encoded by fp8_encode. */
void inflight_store_kv_cache_fp8(
    const float *key, int64_t key_stride, const float *value, int64_t value_stride,
    uint8_t *k_cache, uint8_t *v_cache, const int64_t *slot_mapping, int64_t num_tokens,
    int64_t row_size, float k_inv, float v_inv, int mantissa_bits, int bias, float max_value, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * row_size >= (1 << 16))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *kr = key + t * key_stride, *vr = value + t * value_stride;
        uint8_t *kd = k_cache + slot * row_size, *vd = v_cache + slot * row_size;
        for (int64_t i = 0; i < row_size; ++i) {
            kd[i] = fp8_encode(kr[i] * k_inv, mantissa_bits, bias, max_value);
            vd[i] = fp8_encode(vr[i] * v_inv, mantissa_bits, bias, max_value);
        }
    }
}

/* dst[i] = the block src_blocks[i] of an fp8 cache (block_elems bytes) decoded through lut [256]
 * (byte value * scale): the blocks a prefill step reads, as a float cache for its kernel. */
void inflight_dequantize_fp8_blocks(const uint8_t *src, const int64_t *src_blocks, int64_t num_blocks,
                                    int64_t block_elems, const float *lut, float *dst, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_blocks * block_elems >= (1 << 16))
    for (int64_t i = 0; i < num_blocks; ++i)
        kv8_decode_rows(src + src_blocks[i] * block_elems, lut, dst + i * block_elems, 0, block_elems);
}
