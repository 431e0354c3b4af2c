/* Q4_K repacked 16 rows at a time (Q4_KX, AVX512-VNNI): a 64-byte vector holds 4
 * consecutive weights of each of 16 rows of W, so one vpdpbusd against 4 bytes of a row
 * of x, broadcast, is 64 products for 16 outputs at once. The sub-blocks' scales then
 * apply once per 16 rows and 32 weights (one conversion, two fused multiply-adds), not per
 * row of W as in kquant_avx512.c's tiles; unpacking the nibbles is shared by up to 8 rows
 * of x. Included by kquant.c inside #ifdef TR_KQ_VNNI.
 *
 * Layout, per group of 16 rows (g) and super-block (b), kqx_block (2368 bytes; the same
 * bytes as the 16 rows' Q4_K blocks, 16 x 144 + 64 for the d / dmin kept as fp16 vectors):
 *   nib[c][l]: chunk c (32 weights) of x's stored (pair) order, which is natural sub-block
 *              kq_chunk_sub(c); byte 4i + k of 64: weight 4l + k of that sub-block of row i in
 *              the low nibble, weight 16 + 4l + k in the high one;
 *   sc[c][i], mn[c][i]: that sub-block's 6-bit scale and min of row i; d[i], dm[i]: fp16.
 * Row i of the group is output row 16g + i. The sums are the same integers as Q4_K's; the
 * fp32 scaling differs in order from the other tiles but, per row of x, never with the
 * batch: a row's result does not depend on its neighbours.
 */
#define KQX_ROWS 16
#define KQX_BLOCK 2368 /* bytes per group and super-block */
#define KQX_AHEAD 2      /* blocks ahead to prefetch */

typedef struct {
    uint8_t nib[8][4][64];
    uint8_t sc[8][16], mn[8][16];
    uint16_t d[16], dm[16];
} kqx_block;

/* W [n, k] Q4_K (n a multiple of 16, k of 256) -> out in Q4_KX. */
static void kqx_repack(const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    const int64_t nb = k / QK, rb = nb * 144;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / KQX_ROWS; g++)
        for (int64_t b = 0; b < nb; b++) {
            kqx_block *o = (kqx_block *)(out + (g * nb + b) * KQX_BLOCK);
            for (int i = 0; i < KQX_ROWS; i++) {
                const uint8_t *blk = w + (g * KQX_ROWS + i) * rb + b * 144;
                uint8_t sm[16];
                kq_scales_mins(blk + 4, sm);
                memcpy(&o->d[i], blk, 2);
                memcpy(&o->dm[i], blk + 2, 2);
                for (int c = 0; c < 8; c++) {
                    const int j = kq_chunk_sub(c), shift = 4 * (j & 1);
                    o->sc[c][i] = sm[j];
                    o->mn[c][i] = sm[8 + j];
                    /* sub-block j: the low (even j) or high nibbles of qs[32 (j / 2) ..+32] */
                    const uint8_t *qs = blk + 16 + 32 * (j / 2);
                    uint8_t v[16];
                    for (int t = 0; t < 16; t++)
                        v[t] = (uint8_t)((qs[t] >> shift & 15) | (qs[16 + t] >> shift & 15) << 4);
                    for (int l = 0; l < 4; l++) memcpy(&o->nib[c][l][4 * i], v + 4 * l, 4);
                }
            }
        }
}

/* y[r, 0..15] (rows ys apart) for R (1..8) rows of x and one group of W (nb blocks). */
static inline __attribute__((always_inline)) void kqx_tile(const xq_block *xq, int64_t nb,
                                                           const kqx_block *g, float *y,
                                                           int64_t ys, const int R) {
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const kqx_block *gb = g + b;
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb->d));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb->dm));
        __m512 blk[8]; /* this super-block's sum per row of x, in x's int8 units */
        for (int r = 0; r < R; r++) blk[r] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++) {
            /* the block after next, 5 of its 37 lines a chunk: the stream ahead of the core */
            const char *ahead = (const char *)(gb + KQX_AHEAD) + 320 * c;
            for (int l = 0; l < 5; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
            __m512i w[8];
            for (int l = 0; l < 4; l++) {
                const __m512i raw = _mm512_loadu_si512(gb->nib[c][l]);
                w[l] = _mm512_and_si512(raw, low4);
                w[l + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
            const __m512 sc = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)gb->sc[c]))),
                dv);
            const __m512 mn = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)gb->mn[c]))),
                mv);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const xq_block *xb = xq + r * nb + b;
                const int32_t *x4 = (const int32_t *)(const void *)(xb->q + 32 * c);
                __m512i s = kq_zero();
                for (int q = 0; q < 8; q++) s = _mm512_dpbusd_epi32(s, w[q], _mm512_set1_epi32(x4[q]));
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, blk[r]);
                blk[r] = _mm512_fnmadd_ps(_mm512_set1_ps(xb->qs32[c]), mn, blk[r]);
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(blk[r], _mm512_set1_ps(xq[r * nb + b].d), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ys, acc[r]);
}

/* Rows m0..m1 of y for the groups t0..t1 (xq: those rows of x, quantized). */
static void kqx_tiles(const xq_block *xq, int64_t m0, int64_t m1, int64_t nb, const uint8_t *w,
                      float *y, int64_t ys, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const kqx_block *g = (const kqx_block *)(w + t * nb * KQX_BLOCK);
        for (int64_t r0 = m0; r0 < m1; r0 += 8) {
            const xq_block *x = xq + (r0 - m0) * nb;
            float *y0 = y + r0 * ys + t * KQX_ROWS;
            switch (m1 - r0 < 8 ? m1 - r0 : 8) {
                case 8: kqx_tile(x, nb, g, y0, ys, 8); break;
                case 7: kqx_tile(x, nb, g, y0, ys, 7); break;
                case 6: kqx_tile(x, nb, g, y0, ys, 6); break;
                case 5: kqx_tile(x, nb, g, y0, ys, 5); break;
                case 4: kqx_tile(x, nb, g, y0, ys, 4); break;
                case 3: kqx_tile(x, nb, g, y0, ys, 3); break;
                case 2: kqx_tile(x, nb, g, y0, ys, 2); break;
                default: kqx_tile(x, nb, g, y0, ys, 1);
            }
        }
    }
}
