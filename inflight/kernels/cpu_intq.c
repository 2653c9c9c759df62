/* Native CPU kernels for compressed-tensors pack-quantized int4/int8 weights, float32
 * activations, with the semantics of inflight/kernels/intq_reference.py.
 *
 * Built on first use by inflight/kernels/cpu_intq.py (same compiler, flags and cache as
 * cpu_kernels.c). Layout: row j of the weight is words packed[j, :] (int32), input feature i
 * in word i * bits / 32 at bit i * bits % 32, unsigned (q + 2^(bits-1)); scales[j, g] for the
 * group g = i / group_size (float32, bfloat16 or float16: scale code 0, 1, 2); zero points
 * zp[j, g] int8 or NULL (symmetric).
 *
 * A weight is (q - zp) * s rounded to the scale's dtype, as compressed-tensors computes it in
 * that dtype: the product of a small integer and a 16-bit scale is exact in float32, so one
 * rounding of it to bfloat16/float16 is bit-identical to torch's half-precision multiply.
 *
 * Few rows (decode): each thread takes output features; every 8 weights of a row are unpacked
 * once from the packed words (registers) and dotted with up to four activation rows, so the
 * weight is read at 4 or 8 bits a value. Many rows (prefill): inflight_intq_dequantize_f32
 * dequantizes tiles of rows, bit-identical to the reference, for a library GEMM in Python.
 * The Python side sends only weights whose group_size is a multiple of 8 or that have one
 * group per row (channel-wise), so 8 consecutive weights from a multiple of 8 share a scale.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* float -> float16 bits, round to nearest even (what torch's conversion does). */
static inline uint16_t float_to_half_sw(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    const uint32_t sign = (v.u >> 16) & 0x8000, abs = v.u & 0x7FFFFFFF;
    if (abs >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0));
    if (abs >= 0x477FF000) return (uint16_t)(sign | 0x7C00);  /* rounds past 65504: inf */
    if (abs < 0x38800000) {  /* float16 subnormal (or zero): add as a float, the FPU rounds */
        union { uint32_t u; float f; } magic = {.u = 126u << 23}, x = {.u = abs};
        x.f += magic.f;
        return (uint16_t)(sign | (x.u - magic.u));
    }
    const uint32_t odd = (abs >> 13) & 1;
    return (uint16_t)(sign | ((abs + 0xC8000FFFu + odd) >> 13));
}

static inline float scale_at(const void *scales, int code, int64_t g) {
    if (code == 0) return ((const float *)scales)[g];
    const uint16_t h = ((const uint16_t *)scales)[g];
    if (code == 1) return bf16_to_float(h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_bits_to_float(h);
#endif
}

/* v[0..n) rounded to the scale's dtype (code 1: bfloat16, 2: float16; 0: float32 as is). */
static inline __attribute__((always_inline)) void round_to_scale_dtype(float *v, int n, int code) {
    if (code == 1) {
#pragma omp simd
        for (int i = 0; i < n; ++i) {
            union { float f; uint32_t u; } b = {.f = v[i]};
            const uint32_t rounded = (b.u + 0x7FFFu + ((b.u >> 16) & 1u)) & 0xFFFF0000u;
            b.u = (b.u & 0x7FFFFFFFu) > 0x7F800000u ? (b.u | 0x00400000u) : rounded;  /* NaN stays NaN */
            v[i] = b.f;
        }
    } else if (code == 2) {
#if defined(__F16C__)
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(v + i);
            _mm256_storeu_ps(v + i, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)));
        }
        for (; i < n; ++i) v[i] = _cvtsh_ss(_cvtss_sh(v[i], _MM_FROUND_TO_NEAREST_INT));
#else
        for (int i = 0; i < n; ++i) v[i] = half_bits_to_float(float_to_half_sw(v[i]));
#endif
    }
}

/* W (8 or 32, a constant after inlining) weights from input feature c of a row (c a multiple
 * of 8, all in one group), given the group's scale s and zq = 2^(bits-1) + zero point:
 * (u - zq) * s rounded to the scale's dtype, u the stored unsigned value. */
static inline __attribute__((always_inline)) void unpack_span(
    const int32_t *words, int64_t c, int W, int bits, int code, float s, float zq, float *w) {
    const int32_t *base = words + c * bits / 32;
    const uint32_t mask = (1u << bits) - 1;
#pragma omp simd
    for (int i = 0; i < W; ++i) {
        const uint32_t word = (uint32_t)base[i * bits / 32];
        w[i] = ((float)((word >> ((i * bits) & 31)) & mask) - zq) * s;
    }
    round_to_scale_dtype(w, W, code);
}

/* The last n < 8 weights of a row (in_features not a multiple of 8): value by value. */
static inline void unpack_tail(const int32_t *words, int64_t c, int n, int bits, int code, float s, float zq,
                               float *w) {
    for (int i = 0; i < n; ++i) {
        const int64_t bit = (c + i) * bits;
        const uint32_t word = (uint32_t)words[bit >> 5];
        w[i] = ((float)((word >> (bit & 31)) & ((1u << bits) - 1)) - zq) * s;
    }
    round_to_scale_dtype(w, n, code);
}

typedef struct {
    const int32_t *packed;  /* [n, words_per_row] */
    const void *scales;     /* [n, num_groups] of the scale dtype */
    const int8_t *zp;       /* [n, num_groups] or NULL */
    int bits, code;
    int64_t k, group_size;
} Weight;

/* Group g of row j: its scale and zq, and its span of input features [c0, c1). */
static inline void group_of(const Weight *wt, int64_t j, int64_t g, float *s, float *zq, int64_t *c0,
                            int64_t *c1) {
    const int64_t num_groups = wt->k / wt->group_size, at = j * num_groups + g;
    *s = scale_at(wt->scales, wt->code, at);
    *zq = (float)((1 << (wt->bits - 1)) + (wt->zp != NULL ? wt->zp[at] : 0));
    *c0 = g * wt->group_size;
    *c1 = *c0 + wt->group_size;
}

static inline __attribute__((always_inline)) void dequant_row(const Weight *wt, int64_t j, int bits, int code,
                                                               float *out) {
    const int32_t *words = wt->packed + j * ((wt->k * bits + 31) / 32);
    for (int64_t g = 0; g < wt->k / wt->group_size; ++g) {
        float s, zq;
        int64_t c, c1;
        group_of(wt, j, g, &s, &zq, &c, &c1);
        for (; c + 32 <= c1; c += 32) unpack_span(words, c, 32, bits, code, s, zq, out + c);
        for (; c + 8 <= c1; c += 8) unpack_span(words, c, 8, bits, code, s, zq, out + c);
        if (c < c1) unpack_tail(words, c, (int)(c1 - c), bits, code, s, zq, out + c);
    }
}

/* call(bits, code) with both as constants, for the six (bits, scale code) pairs. */
#define DISPATCH_BITS_CODE(bits, code, call)                            \
    switch ((bits) * 4 + (code)) {                                      \
        case 16: call(4, 0); break;                                     \
        case 17: call(4, 1); break;                                     \
        case 18: call(4, 2); break;                                     \
        case 32: call(8, 0); break;                                     \
        case 33: call(8, 1); break;                                     \
        default: call(8, 2);                                            \
    }

/* out[j, :] = dequantize(weight)[j, :] for n rows; out is [n, k] contiguous; bit-identical
 * to the reference (no sum, nothing to contract into a fused multiply-add). */
void inflight_intq_dequantize_f32(const int32_t *packed, const void *scales, int scale_code,
                                  const int8_t *zp, int bits, float *out, int64_t n, int64_t k,
                                  int64_t group_size, int num_threads) {
    const Weight wt = {packed, scales, zp, bits, scale_code, k, group_size};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
#define DEQUANT(B, C) dequant_row(&wt, j, B, C, out + j * k)
        DISPATCH_BITS_CODE(bits, scale_code, DEQUANT)
#undef DEQUANT
    }
}

/* Accumulate W weights w against the same W inputs of R activation rows into lanes. */
static inline __attribute__((always_inline)) void accumulate(
    float lanes[4][32], const float *x, int64_t k, int64_t c, const float *w, int W, int R) {
    for (int q = 0; q < R; ++q) {
        const float *xb = x + q * k + c;
#pragma omp simd
        for (int i = 0; i < W; ++i) lanes[q][i] += xb[i] * w[i];
    }
}

/* Dot products of packed row j with R (1-4) activation rows; bits, code and R are constants
 * after inlining. 32 lanes a row stay in registers; each weight is unpacked once for all R. */
static inline __attribute__((always_inline)) void row_dots(const Weight *wt, int64_t j, const float *x, int R,
                                                            int bits, int code, float *dots) {
    float lanes[4][32] = {{0.0f}};
    const int64_t k = wt->k;
    const int32_t *words = wt->packed + j * ((k * bits + 31) / 32);
    for (int64_t g = 0; g < k / wt->group_size; ++g) {
        float s, zq, w[32];
        int64_t c, c1;
        group_of(wt, j, g, &s, &zq, &c, &c1);
        for (; c + 32 <= c1; c += 32) {
            unpack_span(words, c, 32, bits, code, s, zq, w);
            accumulate(lanes, x, k, c, w, 32, R);
        }
        for (; c + 8 <= c1; c += 8) {
            unpack_span(words, c, 8, bits, code, s, zq, w);
            accumulate(lanes, x, k, c, w, 8, R);
        }
        if (c < c1) {
            const int n = (int)(c1 - c);
            unpack_tail(words, c, n, bits, code, s, zq, w);
            for (int q = 0; q < R; ++q)
                for (int i = 0; i < n; ++i) lanes[q][i] += x[q * k + c + i] * w[i];
        }
    }
    for (int q = 0; q < R; ++q) {
        float acc = 0.0f;
        for (int i = 0; i < 32; ++i) acc += lanes[q][i];
        dots[q] = acc;
    }
}

static void row_dots_any(const Weight *wt, int64_t j, const float *x, int R, float *dots) {
#define DOTS(B, C)                                                      \
    switch (R) {                                                        \
        case 4: row_dots(wt, j, x, 4, B, C, dots); break;               \
        case 3: row_dots(wt, j, x, 3, B, C, dots); break;               \
        case 2: row_dots(wt, j, x, 2, B, C, dots); break;               \
        default: row_dots(wt, j, x, 1, B, C, dots);                     \
    }
    DISPATCH_BITS_CODE(wt->bits, wt->code, DOTS)
#undef DOTS
}

/* out[m, n] = x[m, k] . dequantize(weight)[n, k]^T (+ bias[n]); x and out contiguous, bias
 * may be NULL. Split across threads by output feature; activation rows four at a time. */
void inflight_intq_linear_f32(const float *x, const int32_t *packed, const void *scales, int scale_code,
                              const int8_t *zp, int bits, const float *bias, float *out, int64_t m,
                              int64_t n, int64_t k, int64_t group_size, int num_threads) {
    const Weight wt = {packed, scales, zp, bits, scale_code, k, group_size};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
        const float bj = bias != NULL ? bias[j] : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            float dots[4];
            row_dots_any(&wt, j, x + r0 * k, (int)rows, dots);
            for (int64_t q = 0; q < rows; ++q) out[(r0 + q) * n + j] = dots[q] + bj;
        }
    }
}
