/* kquant.c's tiles for CPUs with AVX512-VNNI (F, BW, VL): 64-byte vectors of weights,
 * vpdpbusd sums in fours, vpdpwssd applies the sub-blocks' scales. Included by kquant.c
 * inside #ifdef TR_KQ_VNNI; its entry point is kq_rows_by_tile. */
/* Per super-block of one row of W: its 4 quarter vectors of u8 weights (pair order), the
 * s16 scale vectors of its two pairs of quarters (in the order vpackssdw leaves their sums),
 * d, and the fp32 factors of x's 16-sums (xq_block.xs): -dmin times the min of each 16
 * (Q4_K, Q5_K), -32 d times the scale of each 16 (Q6_K, whose q are stored + 32). */
typedef struct {
    __m512i w[4], s[2];
    __m512 side; /* Q4_K, Q5_K */
    __m256i m;   /* Q6_K: its s16 scales, which x's 16-sums (bs) multiply in integers */
    __m512 d;
} kq_wblock;

typedef struct {
    __m512i sel[2];     /* packed lane -> sub-block, per pair of quarters (Q4_K/Q5_K) */
    __m512i sel6[2];    /* packed lane -> group of 16, per pair of quarters (Q6_K) */
    __m128i mdup;       /* byte i -> min i / 2 (byte 8 + i / 2 of the scales-mins vector) */
    __m512i bits5[4];   /* Q5_K: the qh bit of each byte, per quarter */
    __m512i shift4;     /* 0 in the low 256 bits, 4 in the high ones (16-bit lanes) */
    __m512i shift6[2];  /* Q6_K qh shifts per odd: [2 odd | 4 + 2 odd] */
} kq_consts;

static void kq_consts_init(kq_consts *k) {
    int16_t a[32];
    uint8_t b[64];
    for (int pq = 0; pq < 2; pq++) {
        /* vpackssdw of quarters 2pq, 2pq+1's int32 sums: s16 lane L holds, per 128 bits, 4
         * lanes of the first then 4 of the second; int32 lane l sums pair-order bytes 4l.. */
        int16_t a6[32];
        for (int L = 0; L < 32; L++) {
            const int q = 2 * pq + (L % 8 >= 4), l = 4 * (L / 8) + L % 4;
            const int natural = kq_pair_pos(64 * q + 4 * l);
            a[L] = (int16_t)(natural / 32);
            a6[L] = (int16_t)(natural / 16);
        }
        k->sel[pq] = _mm512_loadu_si512(a);
        k->sel6[pq] = _mm512_loadu_si512(a6);
    }
    for (int qi = 0; qi < 4; qi++) {
        const int h = qi / 2, odd = qi % 2;
        for (int i = 0; i < 64; i++) b[i] = (uint8_t)(1u << (4 * h + odd + (i < 32 ? 0 : 2)));
        k->bits5[qi] = _mm512_loadu_si512(b);
    }
    for (int i = 0; i < 16; i++) b[i] = (uint8_t)(8 + i / 2);
    k->mdup = _mm_loadu_si128((const __m128i *)b);
    for (int i = 0; i < 32; i++) a[i] = (int16_t)(i < 16 ? 0 : 4);
    k->shift4 = _mm512_loadu_si512(a);
    for (int odd = 0; odd < 2; odd++) {
        for (int i = 0; i < 32; i++) a[i] = (int16_t)(i < 16 ? 2 * odd : 4 + 2 * odd);
        k->shift6[odd] = _mm512_loadu_si512(a);
    }
}

static inline __attribute__((always_inline)) void kq_load(const uint8_t *b, const int qt,
                                                          const kq_consts *k, kq_wblock *o) {
    const __m512i low4 = _mm512_set1_epi8(15);
    if (qt == Q6_K) {
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        const __m512i sc5 = _mm512_castsi256_si512(sc);
        for (int qi = 0; qi < 4; qi++) {
            const int h = qi / 2, odd = qi % 2;
            const __m512i ql = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * odd)));
            const __m512i qh = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            const __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(ql, k->shift4), low4);
            const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, k->shift6[odd]),
                                                _mm512_set1_epi8(3));
            o->w[qi] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
        }
        o->s[0] = _mm512_permutexvar_epi16(k->sel6[0], sc5);
        o->s[1] = _mm512_permutexvar_epi16(k->sel6[1], sc5);
        o->m = sc;
        o->d = _mm512_set1_ps(kq_half(b + 208));
        return;
    }
    const __m128i sm = kq_scales_mins_simd(b);
    const __m256i sm16 = _mm256_cvtepu8_epi16(sm);
    const __m512i sm5 = _mm512_castsi256_si512(sm16);
    const uint8_t *qs = b + (qt == Q5_K ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if (qt == Q5_K) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
    for (int h = 0; h < 2; h++) {
        const __m512i raw = _mm512_loadu_si512(qs + 64 * h);
        o->w[2 * h] = _mm512_and_si512(raw, low4);
        o->w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if (qt == Q5_K)
        for (int qi = 0; qi < 4; qi++) {
            const __mmask64 set = _mm512_test_epi8_mask(qh, k->bits5[qi]);
            o->w[qi] = _mm512_mask_add_epi8(o->w[qi], set, o->w[qi], _mm512_set1_epi8(16));
        }
    o->s[0] = _mm512_permutexvar_epi16(k->sel[0], sm5);
    o->s[1] = _mm512_permutexvar_epi16(k->sel[1], sm5);
    o->d = _mm512_set1_ps(kq_half(b));
    /* opaque to the compiler, which would otherwise multiply d by x's scale as scalars and
     * broadcast the product, two instructions per row where one vmulps with a broadcast
     * operand does */
    __asm__("" : "+v"(o->d));
    o->side = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(sm, k->mdup))),
                            _mm512_set1_ps(-kq_half(b + 2)));
}

/* A zeroed register by the zero idiom (no execution port), where the compiler would copy
 * one shared zero register into each accumulator (a move that takes a port). */
static inline __attribute__((always_inline)) __m512i kq_zero(void) {
    __m512i z;
    __asm__ volatile("vpxord %0, %0, %0" : "=v"(z));
    return z;
}

#define KQ_TILE_MOST 8 /* rows of x a kq_tile takes at most (more spill registers) */

/* acc + row xb of x times one super-block of W (wb), scaled: the step every tile takes per
 * row of x, row of W and super-block, in the same order whatever the tile's shape. */
static inline __attribute__((always_inline)) __m512 kq_step(const kq_wblock *wb,
                                                            const xq_block *xb, const int qt,
                                                            __m512 acc) {
    /* per quarter, sums of 4 products (|sum| <= 4 * 63 * 127: an int16), two quarters packed
     * into int16s, times their sub-blocks' scales */
    __m512i dot = kq_zero();
    for (int pq = 0; pq < 2; pq++) {
        const __m512i p0 = _mm512_dpbusd_epi32(kq_zero(), wb->w[2 * pq],
                                               _mm512_load_si512(xb->q + 128 * pq));
        const __m512i p1 = _mm512_dpbusd_epi32(kq_zero(), wb->w[2 * pq + 1],
                                               _mm512_load_si512(xb->q + 128 * pq + 64));
        dot = _mm512_dpwssd_epi32(dot, _mm512_packs_epi32(p0, p1), wb->s[pq]);
    }
    if (qt == Q6_K) { /* its -32: the 16-sums times the scales, in integers */
        const __m256i side =
            _mm256_madd_epi16(_mm256_load_si256((const __m256i *)xb->bs), wb->m);
        dot = _mm512_sub_epi32(dot, _mm512_zextsi256_si512(_mm256_slli_epi32(side, 5)));
    }
    /* the exact sum scaled by d times x's scale; Q4_K, Q5_K: then x's 16-sums (in x's
     * units) times the mins */
    const __m512 scale = _mm512_mul_ps(wb->d, _mm512_set1_ps(xb->d));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    if (qt != Q6_K) acc = _mm512_fmadd_ps(_mm512_load_ps(xb->xs), wb->side, acc);
    return acc;
}

/* y[r, c] for R (3..8) rows of x (xq, nb blocks a row) and C rows of W from w0 (rb bytes
 * apart), one row of W at a time over all of K: its R accumulators stay in registers. */
static inline __attribute__((always_inline)) void kq_tile(const xq_block *xq, int64_t nb,
                                                          const uint8_t *w0, int64_t rb,
                                                          const int qt, const kq_consts *k,
                                                          float *y0, int64_t ys, const int R,
                                                          const int C) {
    const int bb = kq_block_bytes(qt);
    for (int c = 0; c < C; c++) {
        __m512 acc[KQ_TILE_MOST];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            kq_wblock wb;
            kq_load(w0 + c * rb + b * bb, qt, k, &wb);
#pragma GCC unroll 8 /* acc[] in registers (GCC stops short of it for Q6_K's longer step) */
            for (int r = 0; r < R; r++) acc[r] = kq_step(&wb, xq + r * nb + b, qt, acc[r]);
        }
        for (int r = 0; r < R; r++) y0[r * ys + c] = _mm512_reduce_add_ps(acc[r]);
    }
}

/* The same for 1 or 2 rows of x (decode) and 4 rows of W interleaved super-block by
 * super-block: four independent streams of W in flight (the loop over them unrolled, so
 * their accumulators are registers). */
static inline __attribute__((always_inline)) void kq_tile4(const xq_block *xq, int64_t nb,
                                                           const uint8_t *w0, int64_t rb,
                                                           const int qt, const kq_consts *k,
                                                           float *y0, int64_t ys, const int R) {
    const int bb = kq_block_bytes(qt);
    __m512 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            kq_wblock wb;
            kq_load(w0 + c * rb + b * bb, qt, k, &wb);
            for (int r = 0; r < R; r++) acc[r][c] = kq_step(&wb, xq + r * nb + b, qt, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) y0[r * ys + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* Q8_0 against x quantized per 256 (kq_quantize_rows, u8): per quarter of 256 values, two
 * blocks of W (64 int8) dotted with x + 128 in fours (vpdpbusd, from -128 times the weights'
 * own sums in fours, which takes the 128 back off); the four quarters' sums folded to two
 * lanes per block (vpermt2d, exact in int32), converted once and scaled per block. */
static inline __attribute__((always_inline)) void kq8_tile(const xq_block *xq, int64_t nb,
                                                           const uint8_t *w0, int64_t rb,
                                                           float *y0, int64_t ys, const int R,
                                                           const int C) {
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (int c = 0; c < C; c++) { /* one row of W at a time: its accumulators in registers */
        __m512 acc[KQ_TILE_MOST];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w0 + c * rb + b * 272;
            __m512i w[4], corr[4];
            for (int q = 0; q < 4; q++) {
                const uint8_t *b0 = blk + 68 * q, *b1 = b0 + 34;
                w[q] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                    _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
                corr[q] = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[q]), 7));
            }
            const __m256 d8 = _mm256_setr_ps(kq_half(blk), kq_half(blk + 34), kq_half(blk + 68),
                                             kq_half(blk + 102), kq_half(blk + 136),
                                             kq_half(blk + 170), kq_half(blk + 204),
                                             kq_half(blk + 238));
            const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(d8));
            for (int r = 0; r < R; r++) {
                const xq_block *xb = xq + r * nb + b;
                __m512i p[4];
                for (int q = 0; q < 4; q++)
                    p[q] = _mm512_dpbusd_epi32(corr[q], _mm512_load_si512(xb->q + 64 * q), w[q]);
                /* [8 lanes block 2q | 8 lanes block 2q+1] x 4 -> 4 lanes a block -> 2 */
                const __m512i t01 = _mm512_add_epi32(_mm512_permutex2var_epi32(p[0], even, p[1]),
                                                     _mm512_permutex2var_epi32(p[0], odd, p[1]));
                const __m512i t23 = _mm512_add_epi32(_mm512_permutex2var_epi32(p[2], even, p[3]),
                                                     _mm512_permutex2var_epi32(p[2], odd, p[3]));
                const __m512i u = _mm512_add_epi32(_mm512_permutex2var_epi32(t01, even, t23),
                                                   _mm512_permutex2var_epi32(t01, odd, t23));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u),
                                         _mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) y0[r * ys + c] = _mm512_reduce_add_ps(acc[r]);
    }
}

#define KQ_R KQ_TILE_MOST /* rows of x per tile */
#define KQ_C 4  /* rows of W per tile: each thread's share of W comes in these */

#define KQ_CASE(QT, RR)                                                                      \
    case RR: kq_tile(xq, nb, w0, rb, QT, k, y0, ys, RR, C); break;
#define KQ_TILES(QT)                                                                         \
    if (R <= 2 && C == 4) {                                                                  \
        if (R == 2) kq_tile4(xq, nb, w0, rb, QT, k, y0, ys, 2);                               \
        else kq_tile4(xq, nb, w0, rb, QT, k, y0, ys, 1);                                     \
    } else {                                                                                 \
        switch (R) {                                                                         \
            KQ_CASE(QT, 8) KQ_CASE(QT, 7) KQ_CASE(QT, 6) KQ_CASE(QT, 5) KQ_CASE(QT, 4)         \
            KQ_CASE(QT, 3) KQ_CASE(QT, 2)                                                    \
            default: kq_tile(xq, nb, w0, rb, QT, k, y0, ys, 1, C);                           \
        }                                                                                    \
    }

/* R rows of x (1..KQ_R) by the C (<= KQ_C) rows of W from w0: kquant.c's entry point. */
static void kq_rows_by_tile(const xq_block *xq, int64_t nb, const uint8_t *w0, int64_t rb,
                            int qt, const kq_consts *k, float *y0, int64_t ys, int R, int C) {
    switch (qt) {
        case Q4_K: KQ_TILES(Q4_K) break;
        case Q5_K: KQ_TILES(Q5_K) break;
        case Q6_K: KQ_TILES(Q6_K) break;
        default: /* Q8_0 */
            switch (R) {
#define KQ8_CASE(RR)                                                                         \
    case RR: kq8_tile(xq, nb, w0, rb, y0, ys, RR, C); break;
                KQ8_CASE(8) KQ8_CASE(7) KQ8_CASE(6) KQ8_CASE(5) KQ8_CASE(4) KQ8_CASE(3)
                KQ8_CASE(2)
                default: kq8_tile(xq, nb, w0, rb, y0, ys, 1, C);
#undef KQ8_CASE
            }
    }
}
