/* The multi-LoRA delta in one call for the CPU (float32): built and bound by lora_cpu.py.
 *
 * out[t, :] += (x[t, :] @ a[s].T) @ b[s].T for every row t whose slot s = slots[t] is not -1.
 * Every slot is checked first (nothing is written when one lies outside [-1, num_slots)).
 * Each slot's B [out_features, rank] present in the batch is transposed once into a scratch
 * [rank, out_features], so the expand is a run of axpys over contiguous out_features; the
 * shrink is rank dot products over in_features. No -ffast-math: the dot keeps 16 independent
 * partial sums (vectorized without reassociation) and adds them at the end.
 * Layouts: x rows with unit column stride (any row stride), a [num_slots, rank, in] and
 * b [num_slots, out, rank] contiguous, out rows with unit column stride (any row stride).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float dot16(const float *restrict p, const float *restrict q, int64_t n) {
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16)
        for (int j = 0; j < 16; j++) acc[j] += p[k + j] * q[k + j];
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += acc[j];
    for (; k < n; k++) sum += p[k] * q[k];
    return sum;
}

/* Returns 0, -1 for a slot out of range (nothing written), -2 when scratch cannot be allocated. */
int inflight_lora_delta_f32(const float *x, int64_t x_stride, const float *a, const float *b,
                            const int32_t *slots, float *out, int64_t out_stride, int64_t num_tokens,
                            int64_t in_features, int64_t out_features, int64_t rank, int64_t num_slots,
                            int num_threads) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
    /* where[s]: slot s's index among the slots present (-1: absent); bt[where[s]] = b[s].T. */
    int64_t *where = malloc((size_t)(num_slots > 0 ? num_slots : 1) * sizeof(int64_t));
    if (where == NULL) return -2;
    for (int64_t s = 0; s < num_slots; s++) where[s] = -1;
    int64_t num_present = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= 0 && where[slots[t]] < 0) where[slots[t]] = num_present++;
    if (num_present == 0) {
        free(where);
        return 0;
    }
    float *bt = malloc((size_t)(num_present * rank * out_features) * sizeof(float));
    if (bt == NULL) {
        free(where);
        return -2;
    }
    for (int64_t s = 0; s < num_slots; s++) {
        if (where[s] < 0) continue;
        const float *bs = b + s * out_features * rank;
        float *dst = bt + where[s] * rank * out_features;
        for (int64_t n = 0; n < out_features; n++)
            for (int64_t r = 0; r < rank; r++) dst[r * out_features + n] = bs[n * rank + r];
    }
    int threads = num_threads > 1 && num_tokens >= 8 ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        const float *xt = x + t * x_stride;
        const float *as = a + s * rank * in_features;
        const float *bts = bt + where[s] * rank * out_features;
        float *ot = out + t * out_stride;
        for (int64_t r = 0; r < rank; r++) {
            float h = dot16(xt, as + r * in_features, in_features);
            const float *row = bts + r * out_features;
            for (int64_t n = 0; n < out_features; n++) ot[n] += h * row[n];
        }
    }
    free(bt);
    free(where);
    return 0;
}
