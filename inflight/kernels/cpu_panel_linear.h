/* The few-row linear on a weight kept in column panels, included by cpu_kernels.c; not a header
 * to include anywhere else.
 *
 * Layout (inflight/kernels/cpu_packed.py: to_panels): a [n, k] weight becomes ceil(n / 16)
 * panels of [k][16] floats, panel p holding output columns 16p..16p+15 (zeros past n), so a
 * panel is one contiguous stream of k rows of 16 weights. The product is an outer-product
 * register tile: up to PANEL_ROWS input rows x 16 columns of accumulators (12 AVX registers at
 * 6 rows), one broadcast of x[r][i] and two vector loads of the panel per step i, no horizontal
 * reduction. Threads split the panels; a panel is read from memory once and, for more rows than
 * a tile holds, again from cache for each further tile.
 *
 * Prefetching keeps memory busy while the tiles compute: each step of a panel's first tile asks
 * for the cache line PANEL_PREFETCH_AHEAD lines further down the stream (past the panel's end,
 * into the next panel), and each step of its further tiles, which read the panel from cache and
 * would otherwise leave memory idle, for a line of the next panel. With more rows than a tile
 * holds this is 5-30% faster at 4-32 rows on a 2-core AMD EPYC (bench/README.md). A prefetch
 * past the weight's end reads nothing into a result and never faults (x86 PREFETCH, ARM PRFM).
 *
 * Each output element is one chain of fused multiply-adds over i in order, whatever the tile
 * height, the row count or the thread: a row's result does not depend on what other rows share
 * its call (batch invariance). */

typedef float inflight_v8f __attribute__((vector_size(32)));
typedef float inflight_v8f_unaligned __attribute__((vector_size(32), aligned(4)));

enum { PANEL_COLS = 16, PANEL_ROWS = 6, PANEL_PREFETCH_AHEAD = 24 };

/* One tile: rows [0, R) of x (row stride ldx) times one panel, plus bias, into cols columns of
 * out (row stride ldo); step i also prefetches the cache line at pf + 16 i (see above). R is a
 * constant in every expansion, so the accumulators stay in registers. */
#define INFLIGHT_PANEL_TILE(R)                                                                        \
    static void panel_tile_##R(const float *x, int64_t ldx, const float *panel, int64_t k,           \
                               const float *bias, float *out, int64_t ldo, int64_t cols,             \
                               const float *pf) {                                                    \
        inflight_v8f lo[R], hi[R];                                                                    \
        for (int r = 0; r < R; ++r) lo[r] = hi[r] = (inflight_v8f){0};                               \
        for (int64_t i = 0; i < k; ++i) {                                                             \
            __builtin_prefetch(pf + i * PANEL_COLS, 0, 3);                                           \
            const inflight_v8f b0 = *(const inflight_v8f_unaligned *)(panel + i * PANEL_COLS);       \
            const inflight_v8f b1 = *(const inflight_v8f_unaligned *)(panel + i * PANEL_COLS + 8);   \
            for (int r = 0; r < R; ++r) {                                                             \
                const float s = x[r * ldx + i]; /* a broadcast; 0 + s would cost an add */        \
                const inflight_v8f a = {s, s, s, s, s, s, s, s};                                      \
                lo[r] += a * b0;                                                                      \
                hi[r] += a * b1;                                                                      \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < R; ++r) {                                                                 \
            float row[PANEL_COLS];                                                                    \
            *(inflight_v8f_unaligned *)row = lo[r];                                                   \
            *(inflight_v8f_unaligned *)(row + 8) = hi[r];                                             \
            float *o = out + r * ldo;                                                                 \
            for (int64_t c = 0; c < cols; ++c) o[c] = row[c] + (bias != NULL ? bias[c] : 0.0f);      \
        }                                                                                             \
    }
INFLIGHT_PANEL_TILE(1)
INFLIGHT_PANEL_TILE(2)
INFLIGHT_PANEL_TILE(3)
INFLIGHT_PANEL_TILE(4)
INFLIGHT_PANEL_TILE(5)
INFLIGHT_PANEL_TILE(6)
#undef INFLIGHT_PANEL_TILE

/* out[m, n] = x[m, k] . W^T (+ bias), W in panels (above); x and out contiguous, bias may be
 * NULL. */
void inflight_panel_linear_f32(const float *x, const float *panels, const float *bias, float *out, int64_t m,
                               int64_t n, int64_t k, int num_threads) {
    const int64_t num_panels = (n + PANEL_COLS - 1) / PANEL_COLS;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t p = 0; p < num_panels; ++p) {
        const float *panel = panels + p * k * PANEL_COLS;
        const int64_t c0 = p * PANEL_COLS, cols = n - c0 < PANEL_COLS ? n - c0 : PANEL_COLS;
        const float *b = bias != NULL ? bias + c0 : NULL;
        for (int64_t r = 0; r < m; r += PANEL_ROWS) {
            const float *xr = x + r * k;
            float *o = out + r * n + c0;
            const float *pf = panel + (r == 0 ? PANEL_PREFETCH_AHEAD : k) * PANEL_COLS;
            switch (m - r < PANEL_ROWS ? m - r : PANEL_ROWS) {
                case 1: panel_tile_1(xr, k, panel, k, b, o, n, cols, pf); break;
                case 2: panel_tile_2(xr, k, panel, k, b, o, n, cols, pf); break;
                case 3: panel_tile_3(xr, k, panel, k, b, o, n, cols, pf); break;
                case 4: panel_tile_4(xr, k, panel, k, b, o, n, cols, pf); break;
                case 5: panel_tile_5(xr, k, panel, k, b, o, n, cols, pf); break;
                default: panel_tile_6(xr, k, panel, k, b, o, n, cols, pf); break;
            }
        }
    }
}
