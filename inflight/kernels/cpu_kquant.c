/* Native CPU kernels for GGUF K-quant weights (Q4_K, Q5_K, Q6_K), float32 activations, with
 * the semantics of inflight/kernels/quant_reference.py. The companion of cpu_quant.c (the
 * 32-weight types), built on first use by inflight/kernels/cpu_kquant.py with cpu_native's
 * compiler, flags and cache.
 *
 * A super-block holds 256 weights in eight 32-weight sub-blocks. unpack_group turns one
 * sub-block into 32 floats (d * sc) * q and its offset dmin * m (zero for Q6_K), so a weight
 * is w[i] - dm; those products are rounded exactly as gguf's numpy code rounds them (no
 * contraction into FMA). Few rows (decode): each thread takes output features; each
 * sub-block is unpacked once into registers and dotted with up to four activation rows; the
 * offsets enter as dm * sum(x sub-block), the sub-block sums computed once per call. Many
 * rows (prefill): inflight_kquant_dequantize_f32 writes rows bit-identical to the reference
 * for a library GEMM on the Python side.
 *
 * Codes (quant_reference.QTYPE_IDS): 3 = Q4_K (144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit
 * scales and mins, 128 nibble bytes), 4 = Q5_K (176 bytes: as Q4_K with 32 bytes of fifth bits
 * before the nibbles), 5 = Q6_K (210 bytes: 128 low-nibble bytes, 64 bytes of 2-bit highs, 16
 * int8 scales, fp16 d). fp16 fields are read through _Float16 (GCC 12+, Clang 15+ on x86-64
 * and AArch64); a compiler without it fails the build and Python falls back to the reference.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define QK 256
#define SUB 32

static inline float half_to_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static inline int64_t block_bytes(int qtype) { return qtype == 3 ? 144 : qtype == 4 ? 176 : 210; }

/* Sub-block j's 6-bit scale and min from Q4_K/Q5_K's 12 scale bytes s: j < 4 in the low 6
 * bits of s[j] and s[j + 4]; j >= 4 in the low/high nibble of s[j + 4], with the top 2 bits
 * of s[j - 4] (scale) and s[j] (min) on top. */
static inline void scale_min(const uint8_t *s, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 0x3F);
        *mn = (float)(s[j + 4] & 0x3F);
    } else {
        *sc = (float)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Q6_K group of 32: low nibble at LSHIFT of lo[i], 2 high bits at HSHIFT of hi[i]; scale d0
 * for the first 16, d1 for the rest. */
#define Q6_GROUP(LSHIFT, HSHIFT)                                                                  \
    _Pragma("omp simd") for (int i = 0; i < SUB; ++i) {                                           \
        const int q = (((lo[i] >> (LSHIFT)) & 0x0F) | (((hi[i] >> (HSHIFT)) & 3) << 4)) - 32;      \
        w[i] = (i < 16 ? d0 : d1) * (float)q;                                                     \
    }

/* Q4_K/Q5_K sub-block of 32: NIBBLE of q[i], plus 16 where Q5_K's fifth bit is set, times ds. */
#define Q45_GROUP(NIBBLE)                                                                         \
    _Pragma("omp simd") for (int i = 0; i < SUB; ++i)                                             \
        w[i] = ds * (float)((NIBBLE) | (fifth && (qh[i] & bit) ? 16 : 0))

/* Sub-block g (32 weights) of a super-block into w[32] = scale * q, returning its offset
 * dmin * m (0 for Q6_K). d and dmin are the super-block's fp16 scales, read once by the caller.
 * Q6_K: group g (half h = g / 4, quarter t = g % 4) takes low nibble t / 2 of bytes
 * 64 h + 32 (t % 2) + i, bits 2t..2t+1 of bytes 128 + 32 h + i, and scales 2g, 2g + 1.
 * Inlined into dequant_row, whose fp-contract=off then keeps w - dm from fusing into an FMA
 * (rounded as the reference rounds), and into row_dots, where contraction only moves the
 * sum's rounding. */
static inline __attribute__((always_inline)) float unpack_group(
    const uint8_t *blk, int qtype, int g, float d, float dmin, float *w) {
    if (qtype == 5) {
        const int h = g >> 2, t = g & 3;
        const uint8_t *lo = blk + 64 * h + 32 * (t & 1), *hi = blk + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d0 = d * (float)scales[2 * g], d1 = d * (float)scales[2 * g + 1];
        switch (t) {  /* constant shifts vectorize; x86 has no per-byte variable shift */
            case 0: Q6_GROUP(0, 0); break;
            case 1: Q6_GROUP(0, 2); break;
            case 2: Q6_GROUP(4, 4); break;
            default: Q6_GROUP(4, 6);
        }
        return 0.0f;
    }
    float sc, mn;
    scale_min(blk + 4, g, &sc, &mn);
    const float ds = d * sc;
    const uint8_t *q = blk + (qtype == 4 ? 48 : 16) + SUB * (g >> 1), *qh = blk + 16;
    const uint8_t bit = (uint8_t)(1u << g);
    const int fifth = qtype == 4;
    if (g & 1)  /* odd sub-blocks: high nibbles (constant shifts vectorize, as for Q6_K) */
        Q45_GROUP(q[i] >> 4);
    else
        Q45_GROUP(q[i] & 0x0F);
    return dmin * mn;
}

/* The fp16 d (and dmin, 0 for Q6_K) of a super-block. */
static inline void superblock_scales(const uint8_t *blk, int qtype, float *d, float *dmin) {
    *d = half_to_float(qtype == 5 ? blk + 208 : blk);
    *dmin = qtype == 5 ? 0.0f : half_to_float(blk + 2);
}

#if defined(SIMD_BYTES)
/* Q4_K/Q5_K super-block into o[256], 16 weights a vector (cpu_simd.h): sub-blocks 2p and 2p + 1
 * are the low and high nibbles of bytes 32p..32p + 31, plus 16 where Q5_K's bit 2p / 2p + 1
 * of qh[i] is set; each weight (d * sc) * q - dmin * m, as in unpack_group. */
static inline __attribute__((always_inline)) void simd_q45(const uint8_t *blk, int qtype, float d,
                                                          float dmin, float *o) {
    const uint8_t *qs = blk + (qtype == 4 ? 48 : 16), *qh = blk + 16;
    for (int p = 0; p < 4; ++p) {
        float sc0, mn0, sc1, mn1;
        scale_min(blk + 4, 2 * p, &sc0, &mn0);
        scale_min(blk + 4, 2 * p + 1, &sc1, &mn1);
        const float ds0 = d * sc0, dm0 = dmin * mn0, ds1 = d * sc1, dm1 = dmin * mn1;
        for (int j = 0; j < 2; ++j) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * p + 16 * j));
            __m128i lo = simd_lo4(q), hi = simd_hi4(q);
            if (qtype == 4) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * j)), sixteen = _mm_set1_epi8(16);
                const __m128i b0 = _mm_set1_epi8((char)(1 << (2 * p))), b1 = _mm_set1_epi8((char)(2 << (2 * p)));
                lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, b0), b0), sixteen));
                hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, b1), b1), sixteen));
            }
            simd_put16(o + 64 * p + 16 * j, lo, 0, ds0, -1, dm0);
            simd_put16(o + 64 * p + 32 + 16 * j, hi, 0, ds1, -1, dm1);
        }
    }
}

/* Q6_K super-block into o[256]: group g = 4h + t as in unpack_group, 16 weights a vector. */
static inline __attribute__((always_inline)) void simd_q6(const uint8_t *blk, float d, float *o) {
    const int8_t *scales = (const int8_t *)(blk + 192);
    const __m128i low4 = _mm_set1_epi8(0x0F), three = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 2; ++j) {  /* bytes 16j..16j + 15 of each group of this half */
            const __m128i l0 = _mm_loadu_si128((const __m128i *)(blk + 64 * h + 16 * j));
            const __m128i l1 = _mm_loadu_si128((const __m128i *)(blk + 64 * h + 32 + 16 * j));
            const __m128i hi = _mm_loadu_si128((const __m128i *)(blk + 128 + 32 * h + 16 * j));
            const __m128i lows[4] = {_mm_and_si128(l0, low4), _mm_and_si128(l1, low4),
                                     _mm_and_si128(_mm_srli_epi16(l0, 4), low4),
                                     _mm_and_si128(_mm_srli_epi16(l1, 4), low4)};
            const __m128i highs[4] = {_mm_and_si128(hi, three), _mm_and_si128(_mm_srli_epi16(hi, 2), three),
                                      _mm_and_si128(_mm_srli_epi16(hi, 4), three),
                                      _mm_and_si128(_mm_srli_epi16(hi, 6), three)};
            for (int t = 0; t < 4; ++t) {
                const int g = 4 * h + t;
                const __m128i q = _mm_sub_epi8(_mm_or_si128(lows[t], _mm_slli_epi16(highs[t], 4)), bias);
                simd_put16(o + SUB * g + 16 * j, q, 1, d * (float)scales[2 * g + j], 0, 0.0f);
            }
        }
}
#endif

/* One row of k weights (k / 256 super-blocks) into out[k], bit-identical to the reference;
 * through cpu_simd.h where the CPU has AVX2, else unpack_group's scalar loops. */
__attribute__((optimize("fp-contract=off")))
static void dequant_row(const uint8_t *row, int qtype, int64_t k, float *out) {
    const int64_t nb = k / QK, bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + b * bb;
        float d, dmin;
        superblock_scales(blk, qtype, &d, &dmin);
#if defined(SIMD_BYTES)
        if (qtype == 5)
            simd_q6(blk, d, out + b * QK);
        else
            simd_q45(blk, qtype, d, dmin, out + b * QK);
#else
        for (int g = 0; g < 8; ++g) {
            float *o = out + b * QK + SUB * g;
            const float dm = unpack_group(blk, qtype, g, d, dmin, o);
            if (qtype != 5)
                for (int i = 0; i < SUB; ++i) o[i] = o[i] - dm;
        }
#endif
    }
}

/* out[r, :] = dequant(w[r]) for n rows; out is [n, k] contiguous. */
void inflight_kquant_dequantize_f32(const uint8_t *w, int qtype, float *out, int64_t n, int64_t k,
                                    int num_threads) {
    const int64_t row_bytes = k / QK * block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) dequant_row(w + j * row_bytes, qtype, k, out + j * k);
}

/* Dot products of one packed weight row with R (1-4, a constant after inlining) activation
 * rows; xsum is [R, k / 32] sub-block sums of x (NULL for Q6_K). Lanes stay in registers;
 * each sub-block is unpacked once for all R rows. */
static inline __attribute__((always_inline)) void row_dots(
    const uint8_t *wr, int qtype, const float *x, const float *xsum, int64_t k, int R, float *dots) {
    float lanes[4][SUB] = {{0.0f}}, mins[4] = {0.0f};
    const int64_t nb = k / QK, bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wr + b * bb;
        float d, dmin;
        superblock_scales(blk, qtype, &d, &dmin);
        for (int g = 0; g < 8; ++g) {
            float wg[SUB];
            const float dm = unpack_group(blk, qtype, g, d, dmin, wg);
            for (int r = 0; r < R; ++r) {
                const float *xg = x + r * k + b * QK + SUB * g;
#pragma omp simd
                for (int i = 0; i < SUB; ++i) lanes[r][i] += xg[i] * wg[i];
                if (xsum != NULL) mins[r] += dm * xsum[r * (k / SUB) + b * 8 + g];
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float acc = 0.0f;
        for (int i = 0; i < SUB; ++i) acc += lanes[r][i];
        dots[r] = acc - mins[r];
    }
}

/* [m, k / 32] sums of each row's 32-element sub-blocks, or NULL when malloc fails. */
static float *subblock_sums(const float *x, int64_t m, int64_t k) {
    const int64_t ns = k / SUB;
    float *xsum = malloc(sizeof(float) * (m * ns > 0 ? m * ns : 1));
    if (xsum == NULL) return NULL;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t s = 0; s < ns; ++s) {
            float acc = 0.0f;
            for (int i = 0; i < SUB; ++i) acc += x[r * k + s * SUB + i];
            xsum[r * ns + s] = acc;
        }
    return xsum;
}

/* out[m, n] = x[m, k] . dequant(w)[n, k]^T (+ bias[n]); x and out contiguous, bias may be
 * NULL. Split across threads by output feature; activation rows four at a time. Returns 0, or
 * -1 when the sub-block sums cannot be allocated. */
int inflight_kquant_linear_f32(const float *x, const uint8_t *w, int qtype, const float *bias,
                               float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t row_bytes = k / QK * block_bytes(qtype), ns = k / SUB;
    float *xsum = NULL;
    if (qtype != 5 && (xsum = subblock_sums(x, m, k)) == NULL) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t *wr = w + j * row_bytes;
        const float bj = bias != NULL ? bias[j] : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            const float *xr = x + r0 * k, *xs = xsum != NULL ? xsum + r0 * ns : NULL;
            float dots[4];
            switch (rows) {
                case 4: row_dots(wr, qtype, xr, xs, k, 4, dots); break;
                case 3: row_dots(wr, qtype, xr, xs, k, 3, dots); break;
                case 2: row_dots(wr, qtype, xr, xs, k, 2, dots); break;
                default: row_dots(wr, qtype, xr, xs, k, 1, dots);
            }
            for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n + j] = dots[r] + bj;
        }
    }
    free(xsum);
    return 0;
}
