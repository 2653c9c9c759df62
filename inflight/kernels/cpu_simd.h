/* 16 quantized integers (bytes in an __m128i) -> 16 floats, for the tile dequantizers of
 * cpu_quant.c and cpu_kquant.c. AVX-512 converts all 16 at once, AVX2 eight at a time; without
 * AVX2 SIMD_BYTES is undefined and the callers keep their scalar loops. Each float is rounded
 * exactly as the reference rounds it: (float)q is exact, then one multiply and, where there is
 * an offset, a separate add or subtract. The callers carry fp-contract=off so GCC does not fuse
 * the pair into an FMA (its intrinsics are plain vector arithmetic it may contract). Included,
 * not compiled alone: cpu_native.py keys each library by its source and included headers. */
#ifndef INFLIGHT_CPU_SIMD_H
#define INFLIGHT_CPU_SIMD_H
#if defined(__AVX2__)
#include <immintrin.h>
#define SIMD_BYTES 1

/* o[i] = d * (float)q[i] for the 16 bytes q, read as int8 (sign != 0) or uint8; then plus off
 * (offset > 0: Q4_1's min) or minus off (offset < 0: a K-quant's dmin * m). sign and offset
 * are constants at every call, so the branches fold away. */
static inline __attribute__((always_inline)) void simd_put16(float *o, __m128i q, int sign, float d,
                                                            int offset, float off) {
#if defined(__AVX512F__)
    const __m512i wide = sign ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(wide));
    if (offset > 0) v = _mm512_add_ps(v, _mm512_set1_ps(off));
    if (offset < 0) v = _mm512_sub_ps(v, _mm512_set1_ps(off));
    _mm512_storeu_ps(o, v);
#else
    const __m128i hi = _mm_unpackhi_epi64(q, q);
    const __m256i w0 = sign ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
    const __m256i w1 = sign ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
    __m256 v0 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(w0));
    __m256 v1 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(w1));
    if (offset > 0) {
        v0 = _mm256_add_ps(v0, _mm256_set1_ps(off));
        v1 = _mm256_add_ps(v1, _mm256_set1_ps(off));
    }
    if (offset < 0) {
        v0 = _mm256_sub_ps(v0, _mm256_set1_ps(off));
        v1 = _mm256_sub_ps(v1, _mm256_set1_ps(off));
    }
    _mm256_storeu_ps(o, v0);
    _mm256_storeu_ps(o + 8, v1);
#endif
}

/* Low and high nibbles of 16 bytes, each as 16 bytes. */
static inline __attribute__((always_inline)) __m128i simd_lo4(__m128i q) {
    return _mm_and_si128(q, _mm_set1_epi8(0x0F));
}
static inline __attribute__((always_inline)) __m128i simd_hi4(__m128i q) {
    return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
}
#endif
#endif
