/* float16 bits -> float, in software (exact for every value, subnormals included); shared by
 * the native kernels that read fp16 scales (cpu_quant.c, cpu_intq.c). Included, not compiled
 * alone: inflight/kernels/cpu_native.py keys each compiled library by its source and the headers
 * it includes. */
#ifndef INFLIGHT_CPU_HALF_H
#define INFLIGHT_CPU_HALF_H
#include <stdint.h>

static inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                --exp;
            }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    union { uint32_t u; float f; } v = {.u = bits};
    return v.f;
}
#endif
