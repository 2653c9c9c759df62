/* The gated delta rule's one-token step (Qwen3-Next's linear attention, decode rows) in C, float32.
 *
 * Specification: inflight/kernels/gated_delta.py (_recurrent_step on one-token sequences). For
 * each row and value head, in one pass over the head's [k_dim, v_dim] state slice: q and k
 * L2-normalised (q scaled by 1/sqrt(k_dim)), S *= exp(g), kv = S^T k, delta = beta (v - kv),
 * S += k (x) delta, out = S^T q, the state read from and written back to the row's slot (zeros
 * first for a new sequence). Rows and heads in parallel (OpenMP); each (row, head) owns its slice,
 * and the rows of a step hold distinct slots.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

int inflight_gdn_decode_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            float *state, float *out, const int64_t *slots, const uint8_t *has_initial,
                            int64_t num_rows, int64_t num_k_heads, int64_t num_v_heads, int64_t dk, int64_t dv) {
    if (num_rows < 0 || num_k_heads <= 0 || num_v_heads % num_k_heads != 0 || dk <= 0 || dk > 1024 || dv <= 0 || dv > 4096)
        return 1;
    const int64_t group = num_v_heads / num_k_heads;
    const float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t h = 0; h < num_v_heads; h++) {
            const int64_t kh = h / group;
            const float *qr = q + (r * num_k_heads + kh) * dk;
            const float *kr = k + (r * num_k_heads + kh) * dk;
            const float *vr = v + (r * num_v_heads + h) * dv;
            float *o = out + (r * num_v_heads + h) * dv;
            float *s = state + (slots[r] * num_v_heads + h) * dk * dv;
            float qn[1024], kn[1024];
            float qq = 0.0f, kk = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                qq += qr[i] * qr[i];
                kk += kr[i] * kr[i];
            }
            const float qs = scale / sqrtf(qq + 1e-6f), ks = 1.0f / sqrtf(kk + 1e-6f);
            for (int64_t i = 0; i < dk; i++) {
                qn[i] = qr[i] * qs;
                kn[i] = kr[i] * ks;
            }
            if (!has_initial[r])
                memset(s, 0, (size_t)(dk * dv) * sizeof(float));
            const float decay = expf(g[r * num_v_heads + h]), b = beta[r * num_v_heads + h];
            for (int64_t j = 0; j < dv; j++)
                o[j] = 0.0f; /* kv_mem first, then the output */
            for (int64_t i = 0; i < dk; i++) {
                float *row = s + i * dv;
                const float ki = kn[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] *= decay;
                    o[j] += row[j] * ki;
                }
            }
            float delta[4096];
            for (int64_t j = 0; j < dv; j++) {
                delta[j] = (vr[j] - o[j]) * b;
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {
                float *row = s + i * dv;
                const float ki = kn[i], qi = qn[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] += ki * delta[j];
                    o[j] += row[j] * qi;
                }
            }
        }
    }
    return 0;
}
