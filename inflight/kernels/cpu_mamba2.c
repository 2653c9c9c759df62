/* Mamba-2's one-step (decode) state update in C, float32.
 *
 * Specification: inflight/kernels/mamba2_reference.py (state_update). For each row (one token of
 * a sequence) and head h, over the head's [head_dim, d_state] state slice in one pass:
 * S = S * exp(dt A[h]) + (dt B[g]) x^T, y = S C[g] + D[h] x, with g = h / (num_heads / num_groups),
 * the state read from and written back to the row's slot (zeros first for a new sequence). Rows
 * and heads in parallel (OpenMP); each (row, head) owns its slice, and a step's rows hold
 * distinct slots.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

int inflight_mamba2_decode_f32(const float *x, const float *dt, const float *A, const float *B, const float *C,
                               const float *D, float *state, float *out, const int64_t *slots,
                               const uint8_t *has_initial, int64_t num_rows, int64_t num_heads, int64_t head_dim,
                               int64_t num_groups, int64_t d_state) {
    if (num_rows < 0 || num_heads <= 0 || num_groups <= 0 || num_heads % num_groups != 0 || head_dim <= 0 ||
        d_state <= 0 || d_state > 4096)
        return 1;
    const int64_t per_group = num_heads / num_groups;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t g = h / per_group;
            const float *xr = x + (r * num_heads + h) * head_dim;
            const float *br = B + (r * num_groups + g) * d_state;
            const float *cr = C + (r * num_groups + g) * d_state;
            float *o = out + (r * num_heads + h) * head_dim;
            float *s = state + (slots[r] * num_heads + h) * head_dim * d_state;
            const float step = dt[r * num_heads + h];
            const float decay = expf(step * A[h]);
            float db[4096];
            for (int64_t n = 0; n < d_state; n++)
                db[n] = step * br[n];
            if (!has_initial[r])
                memset(s, 0, (size_t)(head_dim * d_state) * sizeof(float));
            for (int64_t p = 0; p < head_dim; p++) {
                float *row = s + p * d_state;
                const float xp = xr[p];
                float acc = 0.0f;
                for (int64_t n = 0; n < d_state; n++) {
                    row[n] = row[n] * decay + db[n] * xp;
                    acc += row[n] * cr[n];
                }
                o[p] = acc + D[h] * xp;
            }
        }
    }
    return 0;
}
