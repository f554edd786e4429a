/* How fast this machine reads a decode step's KV pool: 8400 blocks of 12 KB (30 layers x 16
 * sequences x 17 blocks of SmolLM2's bf16 K and V, as bench/bench_attention.py lays them out),
 * read whole with plain 64-byte loads, in order and in a random order, with no arithmetic.
 * The floor for bench.bench_attention's "from memory" time.
 *
 *     gcc -O2 -mavx512f -fopenmp -o /tmp/kv_read bench/kv_read_bandwidth.c && /tmp/kv_read 2
 *
 * Argument: threads (default 2). AVX-512 CPUs only.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BLOCK_BYTES 12288
#define NUM_BLOCKS 8400
#define FLUSH_BYTES (256u << 20)

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const size_t bytes = (size_t)NUM_BLOCKS * BLOCK_BYTES;
    char *pool = aligned_alloc(4096, bytes), *flush = malloc(FLUSH_BYTES);
    int *order = malloc(NUM_BLOCKS * sizeof *order);
    if (!pool || !flush || !order) return 1;
    memset(pool, 1, bytes);
    for (int i = 0; i < NUM_BLOCKS; i++) order[i] = i;
    srand(1);
    for (int i = NUM_BLOCKS - 1; i > 0; i--) {
        const int j = rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int shuffled = 0; shuffled < 2; shuffled++)
        for (int repeat = 0; repeat < 3; repeat++) {
            memset(flush, repeat, FLUSH_BYTES); /* the pool leaves the caches */
            int sink = 0;
            const double start = seconds();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : sink)
            for (int b = 0; b < NUM_BLOCKS; b++) {
                const char *block = pool + (size_t)(shuffled ? order[b] : b) * BLOCK_BYTES;
                __m512i x = _mm512_setzero_si512();
                for (int offset = 0; offset < BLOCK_BYTES; offset += 64)
                    x = _mm512_or_si512(x, _mm512_load_si512(block + offset));
                sink |= _mm512_reduce_or_epi32(x);
            }
            const double elapsed = seconds() - start;
            volatile int keep = sink; /* the loads' result is used, so they are not optimized away */
            (void)keep;
            printf("%s order, %d thread(s): %.0f MB in %.2f ms, %.1f GB/s\n", shuffled ? "random" : "in", threads,
                   bytes / 1e6, elapsed * 1e3, bytes / elapsed / 1e9);
        }
    return 0;
}
