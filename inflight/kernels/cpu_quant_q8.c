/* Integer dot products for GGUF Q4_0/Q4_1/Q8_0 weights at decode (few activation rows), float32
 * in and out, with the semantics of quant_q8_reference in inflight/kernels/cpu_quant_q8.py.
 *
 * Built on first use by cpu_quant_q8.py with cpu_native's compiler and flags (-march=native, so
 * the SIMD paths below are chosen at compile time from the build machine's CPU). Each call first
 * quantizes every activation row once to 8-bit blocks: per 32 values a float scale
 * d = amax / 127 and q = round-half-even(x / d) (q = 0 where d = 0), with isum = sum(q) and
 * s = d * isum. Then each thread takes output features; for each weight block the 32 weights are
 * loaded as bytes once and dotted in integers with up to eight activation rows, and one float
 * multiply-add per block and row adds d_w * d_x * idot. Q4_1's min enters as m * s.
 *
 * Paths (argument `path`; all that were compiled can be forced, for the tests):
 *   0 scalar: portable C, signed weights (nibble - 8, nibble, q8) times q_x.
 *   1 avx2: _mm256_maddubs_epi16 (unsigned weight bytes x signed activation bytes, pairs into
 *     int16 without saturation: 15 * 127 * 2 and 128 * 127 * 2 both fit) + _mm256_madd_epi16.
 *     Q4_0 uses raw nibbles and adds -isum to each of the 8 int32 lanes (-8 * isum in all);
 *     Q8_0 moves the weight's sign onto the activation (abs(w), sign(x, w)).
 *   2 vnni: dpbusd (AVX512-VNNI with VL, or AVX-VNNI) on 256-bit vectors. Q4_0 as avx2; Q8_0
 *     as unsigned w + 128 with -16 * isum in each lane (-128 * isum in all).
 * Every integer sum is exact, so the paths differ only in float rounding of per-block terms.
 * Loops over rows are unrolled (GCC unroll) so the accumulators stay in registers.
 *
 * Codes: 0 = Q4_0 (18 bytes: fp16 d, 16 nibble bytes), 1 = Q4_1 (20 bytes: fp16 d, fp16 m,
 * 16 nibble bytes), 2 = Q8_0 (34 bytes: fp16 d, 32 int8). Nibble byte i holds weight i (low)
 * and weight i + 16 (high).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define HAVE_VNNI 0
#define DPBUSD(acc, u, s) (acc)
#endif
#else
#define HAVE_AVX2 0
#define HAVE_VNNI 0
#endif

enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_VNNI = 2, MAX_ROWS = 8 };

static inline float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7FFFu;
    union { uint32_t u; float f; } v;
    if (em >= 0x7C00u) {
        v.u = sign | 0x7F800000u | ((em & 0x3FFu) << 13);  /* inf, nan */
    } else if (em >= 0x0400u) {
        v.u = sign | ((em + ((127u - 15u) << 10)) << 13);  /* normal */
    } else {
        v.f = (float)em * 5.9604644775390625e-8f;  /* subnormal: em * 2^-24, exact */
        v.u |= sign;
    }
    return v.f;
}

static inline int64_t block_bytes(int qtype) { return qtype == 0 ? 18 : qtype == 1 ? 20 : 34; }

/* The activation rows in 8-bit blocks: q [m, k]; d, s [m, nb]; off [m, nb] (lane offsets). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *off;
    int64_t k, nb;
} QRows;

static void quantize_block_scalar(const float *x, int8_t *q, float *d, int32_t *isum) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
        q[i] = (int8_t)nearbyintf(x[i] * id);  /* default rounding mode: half to even */
        s += q[i];
    }
    *d = dd;
    *isum = s;
}

#if HAVE_AVX2
static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The same numbers as quantize_block_scalar: cvtps rounds half to even like nearbyintf. */
static void quantize_block_avx2(const float *x, int8_t *q, float *d, int32_t *isum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dd = _mm_cvtss_f32(m) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv));
    /* packs work per 128-bit lane: 0 1 4 5 2 3 6 7 (groups of 4) -> permute back into order */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q,
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d = dd;
    *isum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
}
#endif

/* Quantize x [m, k] into xr; off = -isum * off_scale (the lane offsets of the SIMD paths). */
static void quantize_rows(const float *x, int64_t m, const QRows *xr, int path, int off_scale) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < xr->nb; ++b) {
            const int64_t i = r * xr->nb + b, at = r * xr->k + b * 32;
            int32_t isum;
#if HAVE_AVX2
            if (path != PATH_SCALAR)
                quantize_block_avx2(x + at, xr->q + at, xr->d + i, &isum);
            else
#endif
                quantize_block_scalar(x + at, xr->q + at, xr->d + i, &isum);
            xr->s[i] = xr->d[i] * (float)isum;
            xr->off[i] = -isum * off_scale;
        }
}

/* Dot products of one packed weight row with R activation rows, portable C. */
static void dots_scalar(const uint8_t *wr, int qtype, const QRows *xr, int64_t r0, int R, float *dots) {
    float acc[MAX_ROWS] = {0.0f}, corr[MAX_ROWS] = {0.0f};
    const int64_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < xr->nb; ++b) {
        const uint8_t *blk = wr + b * bb;
        const float dw = half_to_float(blk), mw = qtype == 1 ? half_to_float(blk + 2) : 0.0f;
        int32_t wq[32];
        if (qtype == 2) {
            for (int i = 0; i < 32; ++i) wq[i] = ((const int8_t *)(blk + 2))[i];
        } else {
            const uint8_t *nib = blk + (qtype == 1 ? 4 : 2);
            const int32_t offset = qtype == 1 ? 0 : 8;
            for (int i = 0; i < 16; ++i) {
                wq[i] = (int32_t)(nib[i] & 0x0F) - offset;
                wq[i + 16] = (int32_t)(nib[i] >> 4) - offset;
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t i = (r0 + r) * xr->nb + b;
            const int8_t *xq = xr->q + (r0 + r) * xr->k + b * 32;
            int32_t idot = 0;
            for (int t = 0; t < 32; ++t) idot += wq[t] * xq[t];
            acc[r] += dw * xr->d[i] * (float)idot;
            corr[r] += mw * xr->s[i];
        }
    }
    for (int r = 0; r < R; ++r) dots[r] = acc[r] + corr[r];
}

#if HAVE_AVX2
/* One weight block b dotted with R activation rows into acc/corr; qtype, vnni and R are
 * constants after inlining. The 32 weight bytes are loaded once for all R rows. */
static inline __attribute__((always_inline)) void block_step(
    const uint8_t *blk, const int qtype, const int vnni, const QRows *xr, int64_t r0, int64_t b,
    const int R, __m256 *acc, float *corr) {
    const int64_t nb = xr->nb, k = xr->k;
    const __m256 dw = _mm256_set1_ps(half_f16c(blk));
    __m256i w, wsign = _mm256_setzero_si256();
    if (qtype == 2) {
        w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        if (vnni) {
            w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));  /* w + 128 as unsigned */
        } else {
            wsign = w;
            w = _mm256_sign_epi8(w, w);  /* abs */
        }
    } else {
        const __m128i nib = _mm_loadu_si128((const __m128i *)(blk + (qtype == 1 ? 4 : 2)));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(0x0F));
    }
    const float mw = qtype == 1 ? half_f16c(blk + 2) : 0.0f;
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr->q + (r0 + r) * k + b * 32)), p;
        if (vnni) {
            const __m256i init = qtype == 1 ? _mm256_setzero_si256() : _mm256_set1_epi32(xr->off[i]);
            p = DPBUSD(init, w, xv);
        } else {
            if (qtype == 2) xv = _mm256_sign_epi8(xv, wsign);
            p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
            if (qtype == 0) p = _mm256_add_epi32(p, _mm256_set1_epi32(xr->off[i]));
        }
        const __m256 dd = _mm256_mul_ps(dw, _mm256_broadcast_ss(xr->d + i));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc[r]);
        if (qtype == 1) corr[r] += mw * xr->s[i];
    }
}

/* Dot products of one packed weight row with R activation rows: even and odd blocks go to two
 * sets of accumulators, so one row is not held up by the latency of one chain of FMAs. */
static inline __attribute__((always_inline)) void dots_simd(
    const uint8_t *wr, const int qtype, const int vnni, const QRows *xr, int64_t r0, const int R,
    float *dots) {
    __m256 acc0[MAX_ROWS], acc1[MAX_ROWS];
    float corr0[MAX_ROWS], corr1[MAX_ROWS];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
        corr0[r] = corr1[r] = 0.0f;
    }
    const int64_t bb = block_bytes(qtype), nb = xr->nb;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        block_step(wr + b * bb, qtype, vnni, xr, r0, b, R, acc0, corr0);
        block_step(wr + (b + 1) * bb, qtype, vnni, xr, r0, b + 1, R, acc1, corr1);
    }
    if (b < nb) block_step(wr + b * bb, qtype, vnni, xr, r0, b, R, acc0, corr0);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        dots[r] = hsum_ps(_mm256_add_ps(acc0[r], acc1[r])) + (corr0[r] + corr1[r]);
    }
}

#define ROWS_CASES(QT, VN)                                                     \
    switch (R) {                                                               \
        case 8: dots_simd(wr, QT, VN, xr, r0, 8, dots); break;                 \
        case 7: dots_simd(wr, QT, VN, xr, r0, 7, dots); break;                 \
        case 6: dots_simd(wr, QT, VN, xr, r0, 6, dots); break;                 \
        case 5: dots_simd(wr, QT, VN, xr, r0, 5, dots); break;                 \
        case 4: dots_simd(wr, QT, VN, xr, r0, 4, dots); break;                 \
        case 3: dots_simd(wr, QT, VN, xr, r0, 3, dots); break;                 \
        case 2: dots_simd(wr, QT, VN, xr, r0, 2, dots); break;                 \
        default: dots_simd(wr, QT, VN, xr, r0, 1, dots);                       \
    }

static void dots_avx2(const uint8_t *wr, int qtype, const QRows *xr, int64_t r0, int R, float *dots) {
    if (qtype == 0) { ROWS_CASES(0, 0) } else if (qtype == 1) { ROWS_CASES(1, 0) } else { ROWS_CASES(2, 0) }
}

#if HAVE_VNNI
static void dots_vnni(const uint8_t *wr, int qtype, const QRows *xr, int64_t r0, int R, float *dots) {
    if (qtype == 0) { ROWS_CASES(0, 1) } else if (qtype == 1) { ROWS_CASES(1, 1) } else { ROWS_CASES(2, 1) }
}
#endif
#endif

/* Bit i set: path i was compiled into this build. */
int inflight_q8_paths(void) {
    return (1 << PATH_SCALAR) | (HAVE_AVX2 << PATH_AVX2) | (HAVE_VNNI << PATH_VNNI);
}

/* x [m, k] into q [m, k] int8, d [m, nb] and s [m, nb] = d * sum(q), as the kernel does it
 * (for the tests). Returns 0, or -2 when `path` was not compiled in. */
int inflight_q8_quantize_f32(const float *x, int64_t m, int64_t k, int path, int8_t *q, float *d, float *s) {
    if (path < 0 || path > PATH_VNNI || !((inflight_q8_paths() >> path) & 1)) return -2;
    int32_t *off = malloc(sizeof(int32_t) * (m * (k / 32) + 1));
    if (off == NULL) return -1;
    const QRows xr = {q, d, s, off, k, k / 32};
    quantize_rows(x, m, &xr, path, 0);
    free(off);
    return 0;
}

/* out[m, n] = q8(x)[m, k] . dequant(w)[n, k]^T (+ bias[n]); x and out contiguous, bias may be
 * NULL. Activation rows quantized once, then split across threads by output feature, rows
 * eight at a time. Returns 0, -1 when the scratch cannot be allocated, -2 for a path that was
 * not compiled in. */
int inflight_q8_linear_f32(const float *x, const uint8_t *w, int qtype, const float *bias, float *out,
                           int64_t m, int64_t n, int64_t k, int num_threads, int path) {
    if (path < 0 || path > PATH_VNNI || !((inflight_q8_paths() >> path) & 1)) return -2;
    const int64_t nb = k / 32, row_bytes = nb * block_bytes(qtype);
    /* one allocation: d, s, off (4 bytes each) then q */
    uint8_t *scratch = malloc((size_t)(m * nb * 12 + m * k + 32));
    if (scratch == NULL) return -1;
    const QRows xr = {(int8_t *)(scratch + m * nb * 12), (float *)scratch, (float *)(scratch + m * nb * 4),
                      (int32_t *)(scratch + m * nb * 8), k, nb};
    const int off_scale = path == PATH_SCALAR ? 0
                          : qtype == 0 ? 1
                          : (qtype == 2 && path == PATH_VNNI) ? 16 : 0;
    quantize_rows(x, m, &xr, path, off_scale);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t *wr = w + j * row_bytes;
        const float bj = bias != NULL ? bias[j] : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
            const int R = (int)(m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS);
            float dots[MAX_ROWS];
#if HAVE_VNNI
            if (path == PATH_VNNI) dots_vnni(wr, qtype, &xr, r0, R, dots);
            else
#endif
#if HAVE_AVX2
            if (path == PATH_AVX2) dots_avx2(wr, qtype, &xr, r0, R, dots);
            else
#endif
                dots_scalar(wr, qtype, &xr, r0, R, dots);
            for (int r = 0; r < R; ++r) out[(r0 + r) * n + j] = dots[r] + bj;
        }
    }
    free(scratch);
    return 0;
}
