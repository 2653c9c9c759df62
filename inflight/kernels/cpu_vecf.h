/* A vector of VECF_W floats as one value (GCC/Clang vector extensions), for the decode attention
 * of cpu_kernels.c: 16 lanes where the CPU has AVX-512 (one register), else 8 (one AVX register,
 * two SSE or NEON ones). No intrinsics: the compiler lowers each operation to what the CPU has,
 * and every width computes the same sums in the same tree order. Loads and stores are
 * unaligned. vecf_hsum is the piece that lets a kernel vectorize over tokens: VECF_W dot-product
 * partial vectors (one per token) become one vector of VECF_W dot products, folding pairs of
 * vectors with shuffles and adds (VECF_W - 1 folds), instead of one horizontal reduction per
 * token. Included, not compiled alone: cpu_native.py keys each library by its source and the
 * headers it includes. */
#ifndef INFLIGHT_CPU_VECF_H
#define INFLIGHT_CPU_VECF_H
#include <stdint.h>

/* Without AVX-512, GCC notes that 64-byte vectors would be passed differently: every function
 * here is always inlined, so none is ever passed. */
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__AVX512F__)
#define VECF_W 16
#else
#define VECF_W 8
#endif
typedef float vecf __attribute__((vector_size(4 * VECF_W)));
typedef float vecf_unaligned __attribute__((vector_size(4 * VECF_W), aligned(4)));
typedef int32_t ivecf __attribute__((vector_size(4 * VECF_W)));

/* Lanes of a and b (0 to W-1: a's, W to 2W-1: b's) picked by constant indices. GCC before 12
 * has no __builtin_shufflevector; its __builtin_shuffle takes the indices as a vector. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define VECF_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef VECF_SHUFFLE
#define VECF_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivecf){__VA_ARGS__})
#endif
#define VECF_INLINE static inline __attribute__((always_inline))

VECF_INLINE vecf vecf_load(const float *p) { return *(const vecf_unaligned *)p; }
VECF_INLINE void vecf_store(float *p, vecf v) { *(vecf_unaligned *)p = v; }
VECF_INLINE vecf vecf_splat(float x) { return (vecf){0} + x; }
VECF_INLINE vecf vecf_max(vecf a, vecf b) {
    const ivecf take_a = a > b;  /* lanes of -1 (true) or 0 */
    return (vecf)(((ivecf)a & take_a) | ((ivecf)b & ~take_a));
}
VECF_INLINE vecf vecf_min(vecf a, vecf b) {
    const ivecf take_a = a < b;  /* a NaN lane takes b */
    return (vecf)(((ivecf)a & take_a) | ((ivecf)b & ~take_a));
}
/* Lanes [0, n) of v, the rest `fill`. */
VECF_INLINE vecf vecf_keep_first(vecf v, int64_t n, float fill) {
    ivecf lane;
    for (int i = 0; i < VECF_W; ++i) lane[i] = i;
    const ivecf keep = lane < (int32_t)(n < VECF_W ? n : VECF_W);
    return (vecf)(((ivecf)v & keep) | ((ivecf)vecf_splat(fill) & ~keep));
}

#if VECF_W == 16
/* The largest lane and the sum of the lanes: a tree of four swaps (halves, quarters, ...). */
#define VECF_SWAPS(op, v)                                                                     \
    v = op(v, VECF_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));   \
    v = op(v, VECF_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));   \
    v = op(v, VECF_SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));   \
    v = op(v, VECF_SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
/* Tokens i and i + 1 (sixteen partials each) -> eight partials each: lanes 0-7 and 8-15. */
VECF_INLINE vecf vecf_fold8(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + VECF_SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
/* Two tokens of eight partials, twice -> four tokens of four partials. */
VECF_INLINE vecf vecf_fold4(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + VECF_SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
/* Four tokens of four partials, twice -> eight tokens of two partials. */
VECF_INLINE vecf vecf_fold2(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
         + VECF_SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
/* Eight tokens of two partials, twice -> sixteen tokens of one sum. */
VECF_INLINE vecf vecf_fold1(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + VECF_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
/* out[j] = the sum of the lanes of part[j], for j = 0..15, in order. */
VECF_INLINE vecf vecf_hsum(const vecf part[16]) {
    vecf f8[8], f4[4], f2[2];
    for (int i = 0; i < 8; ++i) f8[i] = vecf_fold8(part[2 * i], part[2 * i + 1]);
    for (int i = 0; i < 4; ++i) f4[i] = vecf_fold4(f8[2 * i], f8[2 * i + 1]);
    for (int i = 0; i < 2; ++i) f2[i] = vecf_fold2(f4[2 * i], f4[2 * i + 1]);
    return vecf_fold1(f2[0], f2[1]);
}
#else
#define VECF_SWAPS(op, v)                                                \
    v = op(v, VECF_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3));               \
    v = op(v, VECF_SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5));               \
    v = op(v, VECF_SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6))
/* Tokens i and i + 1 (eight partials each) -> four partials each: lanes 0-3 and 4-7. */
VECF_INLINE vecf vecf_fold4(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + VECF_SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
/* Two tokens of four partials, twice -> four tokens of two partials. */
VECF_INLINE vecf vecf_fold2(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + VECF_SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
/* Four tokens of two partials, twice -> eight tokens of one sum. */
VECF_INLINE vecf vecf_fold1(vecf a, vecf b) {
    return VECF_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + VECF_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
/* out[j] = the sum of the lanes of part[j], for j = 0..7, in order. */
VECF_INLINE vecf vecf_hsum(const vecf part[8]) {
    vecf f4[4], f2[2];
    for (int i = 0; i < 4; ++i) f4[i] = vecf_fold4(part[2 * i], part[2 * i + 1]);
    for (int i = 0; i < 2; ++i) f2[i] = vecf_fold2(f4[2 * i], f4[2 * i + 1]);
    return vecf_fold1(f2[0], f2[1]);
}
#endif

VECF_INLINE vecf vecf_add_(vecf a, vecf b) { return a + b; }
VECF_INLINE float vecf_reduce_max(vecf v) {
    VECF_SWAPS(vecf_max, v);
    return v[0];
}
VECF_INLINE float vecf_reduce_add(vecf v) {
    VECF_SWAPS(vecf_add_, v);
    return v[0];
}

/* exp(x) lane by lane, within ~2 ulp of expf: x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in
 * two for the reduction), a degree-6 polynomial in r (returned), times 2^k (k in *k), which
 * the caller builds in the exponent bits. k = round(x / ln2) by the 1.5 * 2^23 trick: adding
 * it leaves the rounded integer in the low mantissa bits. For |x| up to ~88.7 (|k| <= 128);
 * the caller clamps x. */
VECF_INLINE vecf vecf_exp_reduced(vecf x, ivecf *k) {
    const vecf shifted = x * 1.44269504f + 12582912.0f;
    *k = (ivecf)shifted - 0x4B400000;  /* the bits of 12582912.0f */
    const vecf kf = shifted - 12582912.0f;
    const vecf r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
    vecf poly = vecf_splat(1.0f / 720.0f);
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    return poly * r + 1.0f;
}

/* exp(x) for x <= 0 (scores minus their running max); below -87 it is exp(-87) ~ 1.6e-38:
 * no denormals. */
VECF_INLINE vecf vecf_exp_nonpositive(vecf x) {
    ivecf k;
    const vecf poly = vecf_exp_reduced(vecf_max(x, vecf_splat(-87.0f)), &k);
    return poly * (vecf)((k + 127) << 23);  /* 2^k, k >= -126 */
}
#endif
