/* The few-row linear on a weight kept in column panels, included by cpu_kernels.c; not a header
 * to include anywhere else.
 *
 * Layout (inflight/kernels/cpu_weight_layout.py: to_panels): a [n, k] weight becomes ceil(n / 16)
 * panels of [k][16] floats, panel p holding output columns 16p..16p+15 (zeros past n), so a
 * panel is one contiguous stream of k rows of 16 weights. The product is an outer-product
 * register tile: up to PANEL_ROWS input rows x 16 columns of accumulators (below), one
 * broadcast of x[r][i] a row and one panel row loaded per step i, no horizontal reduction.
 * Threads split the panels; a panel is read from memory once and, for more rows than a tile
 * holds, again from cache for each further tile.
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

/* A panel row is PANEL_VECS vectors of PANEL_VEC floats: one 16-float register where the
 * compiler may use AVX-512 (32 of them: tiles of up to 12 rows), two 8-float ones elsewhere (16
 * AVX registers: up to 6 rows). On the 2-core Xeon (AVX-512), bench-medium's 72 products on two
 * threads, ms, 8-wide / 16-wide: 1 row 15.6 / 15.3, 4 rows 15.7 / 15.4, 8 rows 25.0 / 17.3, 16
 * rows 33.7 / 30.3, 32 rows 59.0 / 44.1, 64 rows 111 / 84. Either way each output is the same
 * chain of fused multiply-adds, so both builds give the same bits (the tests check it). */
#if defined(__AVX512F__)
#define PANEL_ROWS 12 /* a macro: the tiles past 6 rows are compiled only where it is 12 */
enum { PANEL_VEC = 16, PANEL_VECS = 1 };
#define PANEL_SPLAT(s) {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}
#else
#define PANEL_ROWS 6
enum { PANEL_VEC = 8, PANEL_VECS = 2 };
#define PANEL_SPLAT(s) {s, s, s, s, s, s, s, s}
#endif
typedef float inflight_panel_vec __attribute__((vector_size(PANEL_VEC * 4)));
typedef float inflight_panel_vec_unaligned __attribute__((vector_size(PANEL_VEC * 4), aligned(4)));

enum { PANEL_COLS = 16, PANEL_PREFETCH_AHEAD = 24 };

/* One tile: rows [0, R) of x (row stride ldx) times one panel, plus bias, into cols columns of
 * out (row stride ldo); step i also prefetches the cache line at pf + 16 i (see above). R is a
 * constant in every expansion, so the accumulators stay in registers. */
#define INFLIGHT_PANEL_TILE(R)                                                                        \
    static void panel_tile_##R(const float *x, int64_t ldx, const float *panel, int64_t k,           \
                               const float *bias, float *out, int64_t ldo, int64_t cols,             \
                               const float *pf) {                                                    \
        inflight_panel_vec acc[R][PANEL_VECS];                                                        \
        for (int r = 0; r < R; ++r)                                                                   \
            for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] = (inflight_panel_vec){0};                 \
        for (int64_t i = 0; i < k; ++i) {                                                             \
            __builtin_prefetch(pf + i * PANEL_COLS, 0, 3);                                           \
            inflight_panel_vec b[PANEL_VECS];                                                         \
            for (int v = 0; v < PANEL_VECS; ++v)                                                      \
                b[v] = *(const inflight_panel_vec_unaligned *)(panel + i * PANEL_COLS + v * PANEL_VEC); \
            for (int r = 0; r < R; ++r) {                                                             \
                const float s = x[r * ldx + i]; /* a broadcast; 0 + s would cost an add */          \
                const inflight_panel_vec a = PANEL_SPLAT(s);                                          \
                for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] += a * b[v];                           \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < R; ++r) {                                                                 \
            float row[PANEL_COLS];                                                                    \
            for (int v = 0; v < PANEL_VECS; ++v)                                                      \
                *(inflight_panel_vec_unaligned *)(row + v * PANEL_VEC) = acc[r][v];                   \
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
#if PANEL_ROWS > 6
INFLIGHT_PANEL_TILE(7)
INFLIGHT_PANEL_TILE(8)
INFLIGHT_PANEL_TILE(9)
INFLIGHT_PANEL_TILE(10)
INFLIGHT_PANEL_TILE(11)
INFLIGHT_PANEL_TILE(12)
#endif
#undef INFLIGHT_PANEL_TILE

/* All m rows of x times the panel of output columns c0 onwards, tile by tile. The first tile
 * prefetches down its own panel, the further ones the next panel (see above). */
static void panel_rows(const float *x, const float *panel, const float *bias, float *out, int64_t m, int64_t n,
                       int64_t k, int64_t c0) {
    const int64_t cols = n - c0 < PANEL_COLS ? n - c0 : PANEL_COLS;
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
#if PANEL_ROWS > 6
            case 6: panel_tile_6(xr, k, panel, k, b, o, n, cols, pf); break;
            case 7: panel_tile_7(xr, k, panel, k, b, o, n, cols, pf); break;
            case 8: panel_tile_8(xr, k, panel, k, b, o, n, cols, pf); break;
            case 9: panel_tile_9(xr, k, panel, k, b, o, n, cols, pf); break;
            case 10: panel_tile_10(xr, k, panel, k, b, o, n, cols, pf); break;
            case 11: panel_tile_11(xr, k, panel, k, b, o, n, cols, pf); break;
            default: panel_tile_12(xr, k, panel, k, b, o, n, cols, pf); break;
#else
            default: panel_tile_6(xr, k, panel, k, b, o, n, cols, pf); break;
#endif
        }
    }
}

/* out[m, n] = x[m, k] . W^T (+ bias), W in panels (above); x and out contiguous, bias may be
 * NULL. Threads split the panels. */
void inflight_panel_linear_f32(const float *x, const float *panels, const float *bias, float *out, int64_t m,
                               int64_t n, int64_t k, int num_threads) {
    const int64_t num_panels = (n + PANEL_COLS - 1) / PANEL_COLS;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= (1 << 16))
    for (int64_t p = 0; p < num_panels; ++p)
        panel_rows(x, panels + p * k * PANEL_COLS, bias, out, m, n, k, p * PANEL_COLS);
}
