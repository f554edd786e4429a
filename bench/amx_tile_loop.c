/* How fast one core's AMX tiles run the 2 x 2 block loop of workers/kernels/csrc/amx.c (four tile
 * loads and four TDPBF16PS a k step, the sums in TMM0-3) over operands that stay in the caches:
 * a 32-row block of x and a 32-column group of weights, K wide, the same block again and again.
 * The ceiling of the products' loop at a given K, before any memory traffic; docs/cpu.md.
 *
 *     gcc -O2 -march=native -o /tmp/amx_tile_loop bench/amx_tile_loop.c && /tmp/amx_tile_loop
 *
 * Prints TFLOP/s and the share of 3.4 TFLOP/s (a loop of TDPBF16PS on registers on a 2-core
 * Sapphire Rapids-class VM) for K = 128, 256 and 576 (SmolLM2's hidden size), with x read in
 * place (rows K apart, as amx.c reads it), x packed tile by tile (each tile 1 KB, contiguous),
 * and no loads at all. Linux 5.16 or later on a CPU with AMX-BF16 only.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../workers/kernels/csrc/amx_tiles.h" /* TileConfig, load_full_tiles: the kernels' own */

#define MAX_K 576
#define PEAK_TFLOPS 3.4

static uint16_t x[32 * MAX_K] __attribute__((aligned(64)));
static uint16_t w[32 * MAX_K] __attribute__((aligned(64)));
static float sums[32 * 32] __attribute__((aligned(64)));

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* mode 0: x in place (stride K); 1: x packed (stride 64 bytes); 2: products only. */
static double run(int K, int mode, long reps) {
    const int k_tiles = K / 32;
    const uint16_t *x1 = x + (mode == 1 ? 16 * 32 * k_tiles : 16 * K), *b1 = w + 16 * K;
    const long stride = mode == 1 ? 64 : K * 2, step = mode == 1 ? 512 : 32;
    const double start = seconds();
    for (long r = 0; r < reps; r++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int t = 0; t < k_tiles; t++) {
            if (mode != 2) {
                _tile_loadd(4, x + t * step, stride);
                _tile_loadd(6, w + t * 512, 64);
            }
            _tile_dpbf16ps(0, 4, 6);
            if (mode != 2) _tile_loadd(7, b1 + t * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (mode != 2) _tile_loadd(5, x1 + t * step, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, sums, 128);
        _tile_stored(1, sums + 16, 128);
        _tile_stored(2, sums + 512, 128);
        _tile_stored(3, sums + 528, 128);
    }
    return 2.0 * 32 * 32 * K * reps / (seconds() - start) / 1e12;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
        fprintf(stderr, "the OS refused tile data (Linux 5.16 or later, a CPU with AMX)\n");
        return 1;
    }
    load_full_tiles();
    for (int i = 0; i < 32 * MAX_K; i++) x[i] = w[i] = 0x3f80; /* bf16 1.0 */
    static const char *modes[3] = {"x in place", "x packed", "no loads"};
    const int ks[3] = {128, 256, 576};
    for (int k = 0; k < 3; k++)
        for (int mode = 0; mode < 3; mode++) {
            const double tflops = run(ks[k], mode, 200000);
            printf("K %3d, %-10s: %.2f TFLOP/s, %3.0f%% of %.1f\n", ks[k], modes[mode], tflops,
                   100 * tflops / PEAK_TFLOPS, PEAK_TFLOPS);
        }
    _tile_release();
    return 0;
}
