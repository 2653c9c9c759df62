/* Native CPU kernels for GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), float32 activations,
 * with the semantics of inflight/kernels/quant_reference.py.
 *
 * Built on first use by inflight/kernels/cpu_quant.py (same compiler, flags and cache as
 * cpu_kernels.c). Few rows (decode, a speculative verify): each thread takes output features.
 * With AVX-512 (linear_avx512) a tile of 4 weight rows (2 above 4 activation rows) is unpacked
 * block by block into registers (Q4_1's min folded in by one FMA) and FMA'd into up to eight
 * activation rows' accumulators, so an extra row costs its FMAs, not another unpack or pass.
 * Without it each block is unpacked once into 32 floats d * q and dotted with up to four rows;
 * Q4_1's min enters as m * sum(x block), the block sums computed once per call. Either way the
 * weight is read in its packed form (4.5-8.5 bits a weight instead of 32). Many
 * rows (prefill): inflight_quant_dequantize_f32 dequantizes tiles of rows with exactly gguf's
 * float32 arithmetic (no contraction into FMA: bit-identical to the reference) for a library
 * GEMM on the Python side. Both unpack 16 weights a vector through cpu_simd.h where the CPU has
 * AVX2 (AVX-512: one instruction per step), the scalar loops otherwise.
 *
 * Codes: 0 = Q4_0 (18 bytes: fp16 d, 16 nibble bytes), 1 = Q4_1 (20 bytes: fp16 d, fp16 m,
 * 16 nibble bytes), 2 = Q8_0 (34 bytes: fp16 d, 32 int8). Nibble byte i holds weight i (low)
 * and weight i + 16 (high).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_simd.h"

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(const uint8_t *p) {  /* one instruction where the CPU has F16C */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#else
static inline float half_to_float(const uint8_t *p) {
    return half_bits_to_float((uint16_t)p[0] | ((uint16_t)p[1] << 8));
}
#endif

static inline int64_t block_bytes(int qtype) { return qtype == 0 ? 18 : qtype == 1 ? 20 : 34; }

/* One row of k weights (k / 32 blocks) into out[k]: 16 weights a vector where the CPU has
 * AVX2 (cpu_simd.h), else the scalar loops; the same float operations either way. */
__attribute__((optimize("fp-contract=off")))
static void dequant_row(const uint8_t *row, int qtype, int64_t k, float *out) {
    const int64_t nb = k / 32, bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + b * bb;
        float *o = out + b * 32;
        const float d = half_to_float(blk);
#if defined(SIMD_BYTES)
        if (qtype == 2) {
            simd_put16(o, _mm_loadu_si128((const __m128i *)(blk + 2)), 1, d, 0, 0.0f);
            simd_put16(o + 16, _mm_loadu_si128((const __m128i *)(blk + 18)), 1, d, 0, 0.0f);
        } else if (qtype == 1) {
            const float m = half_to_float(blk + 2);
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
            simd_put16(o, simd_lo4(q), 0, d, 1, m);
            simd_put16(o + 16, simd_hi4(q), 0, d, 1, m);
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2)), eight = _mm_set1_epi8(8);
            simd_put16(o, _mm_sub_epi8(simd_lo4(q), eight), 1, d, 0, 0.0f);
            simd_put16(o + 16, _mm_sub_epi8(simd_hi4(q), eight), 1, d, 0, 0.0f);
        }
#else
        if (qtype == 2) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int i = 0; i < 32; ++i) o[i] = (float)q[i] * d;
        } else if (qtype == 1) {
            const float m = half_to_float(blk + 2);
            const uint8_t *q = blk + 4;
            for (int i = 0; i < 16; ++i) {
                o[i] = d * (float)(q[i] & 0x0F) + m;
                o[i + 16] = d * (float)(q[i] >> 4) + m;
            }
        } else {
            const uint8_t *q = blk + 2;
            for (int i = 0; i < 16; ++i) {
                o[i] = d * (float)((int)(q[i] & 0x0F) - 8);
                o[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
            }
        }
#endif
    }
}

/* out[r, :] = dequant(w[r]) for n rows of row_bytes each; out is [n, k] contiguous. */
void inflight_quant_dequantize_f32(const uint8_t *w, int qtype, float *out, int64_t n, int64_t k,
                                   int num_threads) {
    const int64_t row_bytes = k / 32 * block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) dequant_row(w + j * row_bytes, qtype, k, out + j * k);
}

/* The 32 weights of one block as d * q (without Q4_1's min, which is added through the
 * activation's block sums), for the fused dot products below. */
static inline float block_scaled(const uint8_t *blk, int qtype, float *w, float *min) {
    const float d = half_to_float(blk);
#if defined(SIMD_BYTES)
    if (qtype == 2) {
        simd_put16(w, _mm_loadu_si128((const __m128i *)(blk + 2)), 1, d, 0, 0.0f);
        simd_put16(w + 16, _mm_loadu_si128((const __m128i *)(blk + 18)), 1, d, 0, 0.0f);
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (qtype == 1 ? 4 : 2)));
        const __m128i offset = _mm_set1_epi8(qtype == 1 ? 0 : 8);
        simd_put16(w, _mm_sub_epi8(simd_lo4(q), offset), 1, d, 0, 0.0f);
        simd_put16(w + 16, _mm_sub_epi8(simd_hi4(q), offset), 1, d, 0, 0.0f);
    }
    *min = qtype == 1 ? half_to_float(blk + 2) : 0.0f;
    return d;
#endif
    if (qtype == 2) {
        const int8_t *q = (const int8_t *)(blk + 2);
#pragma omp simd
        for (int i = 0; i < 32; ++i) w[i] = d * (float)q[i];
        *min = 0.0f;
        return d;
    }
    const uint8_t *q = blk + (qtype == 1 ? 4 : 2);
    const int offset = qtype == 1 ? 0 : 8;
#pragma omp simd
    for (int i = 0; i < 16; ++i) {
        w[i] = d * (float)((int)(q[i] & 0x0F) - offset);
        w[i + 16] = d * (float)((int)(q[i] >> 4) - offset);
    }
    *min = qtype == 1 ? half_to_float(blk + 2) : 0.0f;
    return d;
}

/* Dot products of one packed weight row with R (1-4, a constant after inlining) activation
 * rows: lanes stay in registers, each block is unpacked once for all R rows. */
static inline __attribute__((always_inline)) void row_dots(
    const uint8_t *wr, int qtype, const float *x, const float *xsum, int64_t k, int64_t nb,
    int R, float *dots) {
    float lanes[4][32] = {{0.0f}}, mins[4] = {0.0f};
    const int64_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        float wb[32], mn;
        block_scaled(wr + b * bb, qtype, wb, &mn);
        for (int r = 0; r < R; ++r) {
            const float *xb = x + r * k + b * 32;
#pragma omp simd
            for (int i = 0; i < 32; ++i) lanes[r][i] += xb[i] * wb[i];
            if (xsum != NULL) mins[r] += mn * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < R; ++r) {
        float acc = 0.0f;
        for (int i = 0; i < 32; ++i) acc += lanes[r][i];
        dots[r] = acc + mins[r];
    }
}

#if defined(__AVX512F__)
#define PREFETCH_BYTES 256  /* how far ahead of the block being unpacked each weight row is prefetched */

/* The 32 weights of one block as two vectors (weights 0-15, 16-31) of the dequantized values:
 * d * q (Q8_0), d * (q - 8) (Q4_0: the integer subtraction is exact) or one FMA d * q + m
 * (Q4_1: the min folded in, rounded once, so no activation block sums are needed). */
static inline __attribute__((always_inline)) void block_vectors(const uint8_t *blk, int qtype, __m512 *lo,
                                                               __m512 *hi) {
    const __m512 d = _mm512_set1_ps(half_to_float(blk));
    if (qtype == 2) {
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (qtype == 1 ? 4 : 2)));
    if (qtype == 1) {
        const __m512 m = _mm512_set1_ps(half_to_float(blk + 2));
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(simd_lo4(q))), d, m);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(simd_hi4(q))), d, m);
        return;
    }
    const __m128i eight = _mm_set1_epi8(8);
    *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(simd_lo4(q), eight))));
    *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(simd_hi4(q), eight))));
}

/* out[r, j0 + f] (f < F, r < R; F and R constants after inlining) for F consecutive weight rows
 * and R activation rows: each block of each weight row is unpacked once into two registers and
 * FMA'd into R accumulators, each 16-float slice of an activation row is loaded once for all F
 * weight rows; F * R accumulators stay in registers (F * R <= 16 of the 32). */
static inline __attribute__((always_inline)) void tile_dots(
    const uint8_t *w, int64_t row_bytes, int qtype, const float *x, int64_t k, int64_t nb, int F, int R,
    const float *bias, float *out, int64_t n, int64_t j0) {
    __m512 acc[4][8];
    for (int f = 0; f < F; ++f)
        for (int r = 0; r < R; ++r) acc[f][r] = _mm512_setzero_ps();
    const int64_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        __m512 lo[4], hi[4];
        for (int f = 0; f < F; ++f)  /* the vocab head (30 MB) streams from memory: 1.3-2x faster so */
            _mm_prefetch((const char *)(w + (j0 + f) * row_bytes + b * bb + PREFETCH_BYTES), _MM_HINT_T0);
        for (int f = 0; f < F; ++f) block_vectors(w + (j0 + f) * row_bytes + b * bb, qtype, &lo[f], &hi[f]);
        for (int r = 0; r < R; ++r) {
            const __m512 x0 = _mm512_loadu_ps(x + r * k + b * 32), x1 = _mm512_loadu_ps(x + r * k + b * 32 + 16);
            for (int f = 0; f < F; ++f) acc[f][r] = _mm512_fmadd_ps(hi[f], x1, _mm512_fmadd_ps(lo[f], x0, acc[f][r]));
        }
    }
    for (int f = 0; f < F; ++f) {
        const float bj = bias != NULL ? bias[j0 + f] : 0.0f;
        for (int r = 0; r < R; ++r) out[r * n + j0 + f] = _mm512_reduce_add_ps(acc[f][r]) + bj;
    }
}

/* Up to 8 activation rows (R) against weight rows in tiles of F = 4 (R <= 4) or 2 (R > 4),
 * the last n % F weight rows one at a time. */
#define TILE_CASE(R, F)                                                                                  \
    case R:                                                                                              \
        if (j + F <= n) {                                                                                \
            tile_dots(w, row_bytes, qtype, xr, k, nb, F, R, bias, o, n, j);                              \
            j += F;                                                                                      \
        } else {                                                                                         \
            tile_dots(w, row_bytes, qtype, xr, k, nb, 1, R, bias, o, n, j);                              \
            j += 1;                                                                                      \
        }                                                                                                \
        break;

static void linear_avx512(const float *x, const uint8_t *w, int qtype, const float *bias, float *out,
                          int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t nb = k / 32, row_bytes = nb * block_bytes(qtype);
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        const int rows = m - r0 < 8 ? (int)(m - r0) : 8, tile = rows <= 4 ? 4 : 2;
        const float *xr = x + r0 * k;
        float *o = out + r0 * n;
        const int64_t num_tiles = (n + tile - 1) / tile;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
        for (int64_t t = 0; t < num_tiles; ++t) {
            int64_t j = t * tile;
            const int64_t end = j + tile < n ? j + tile : n;
            while (j < end) {
                switch (rows) {
                    TILE_CASE(1, 4) TILE_CASE(2, 4) TILE_CASE(3, 4) TILE_CASE(4, 4)
                    TILE_CASE(5, 2) TILE_CASE(6, 2) TILE_CASE(7, 2) default: TILE_CASE(8, 2)
                }
            }
        }
    }
}
#undef TILE_CASE
#endif

/* How many activation rows one pass of inflight_quant_linear_f32 takes: 8 on the AVX-512 path,
 * 4 on the portable one (above it the Python side's dequantized tiles and GEMM win). */
int inflight_quant_few_rows(void) {
#if defined(__AVX512F__)
    return 8;
#else
    return 4;
#endif
}

/* out[m, n] = x[m, k] . dequant(w)[n, k]^T (+ bias[n]); x and out contiguous, bias may be
 * NULL. With AVX-512, linear_avx512 above. Otherwise: split across threads by output
 * feature; activation rows four at a time. Each block
 * is unpacked into 32 scaled floats (d * q) and dotted with the block's slice of each row;
 * Q4_1's min contributes min * sum(x slice), the slice sums computed once per call. Returns
 * 0, or -1 when the slice sums cannot be allocated. */
int inflight_quant_linear_f32(const float *x, const uint8_t *w, int qtype, const float *bias,
                              float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
#if defined(__AVX512F__)
    linear_avx512(x, w, qtype, bias, out, m, n, k, num_threads);
    return 0;
#else
    const int64_t nb = k / 32, row_bytes = nb * block_bytes(qtype);
    float *xsum = NULL;
    if (qtype == 1) {
        xsum = malloc(sizeof(float) * m * nb);  /* [m, nb] */
        if (xsum == NULL) return -1;
        for (int64_t r = 0; r < m; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                float s = 0.0f;
                for (int i = 0; i < 32; ++i) s += x[r * k + b * 32 + i];
                xsum[r * nb + b] = s;
            }
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t *wr = w + j * row_bytes;
        const float bj = bias != NULL ? bias[j] : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t rows = m - r0 < 4 ? m - r0 : 4;
            const float *xr = x + r0 * k, *xs = xsum != NULL ? xsum + r0 * nb : NULL;
            float dots[4];
            switch (rows) {
                case 4: row_dots(wr, qtype, xr, xs, k, nb, 4, dots); break;
                case 3: row_dots(wr, qtype, xr, xs, k, nb, 3, dots); break;
                case 2: row_dots(wr, qtype, xr, xs, k, nb, 2, dots); break;
                default: row_dots(wr, qtype, xr, xs, k, nb, 1, dots);
            }
            for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n + j] = dots[r] + bj;
        }
    }
    free(xsum);
    return 0;
#endif
}
