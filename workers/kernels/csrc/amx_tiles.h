/* The AMX tile configuration our tile kernels load (amx.c, attention_amx.c, gguf_amx.c), once per
 * work item: palette 1, tile t holding rows[t] rows of colsb[t] bytes, tiles past count unused. */
#ifndef RAYLLM_AMX_TILES_H
#define RAYLLM_AMX_TILES_H
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline void load_tile_config(int count, const uint8_t *rows, const uint16_t *colsb) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < count; t++) config.rows[t] = rows[t], config.colsb[t] = colsb[t];
    /* The stores above must reach memory before LDTILECFG reads it. GCC 12 does not see that the
     * intrinsic reads its operand: inlined into a small function (amx.c's peak_item) it kept only
     * the palette byte and part of the memset, and LDTILECFG faulted on the garbage left. */
    __asm__ __volatile__("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* All eight tiles 16 rows of 64 bytes: bf16 operands (16 x 32) and fp32 sums (16 x 16). */
static inline void load_full_tiles(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    load_tile_config(8, rows, colsb);
}
#endif
#endif
