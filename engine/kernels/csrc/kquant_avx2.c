/* kquant.c's tiles for CPUs with AVX2 (+FMA, F16C) but not AVX512-VNNI: most laptops. Each
 * 32-byte vector of weights is one sub-block of 32 (Q4_K, Q5_K; two groups of 16 for Q6_K):
 * vpmaddubsw sums u8 weights x s8 activations in pairs, then the sub-block's scale is
 * applied into int32 (vpdpwssd where the CPU has AVX-VNNI, vpmaddwd + vpaddd where not).
 * The same integer sums as the other paths. Included by kquant.c inside
 * #elif TR_KQ_AVX2; its entry point is kq_rows_by_tile. */

#ifdef __AVXVNNI__
#define KQ2_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define KQ2_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

/* Vector v (0..7) of a super-block covers pair-order bytes 32v..32v+31: quarter v / 2, half
 * v % 2. Its sub-block (Q4_K, Q5_K) is 4h + odd + 2 half (h = v / 4, odd = v / 2 % 2). */
typedef struct {
    __m256i pick[8];  /* shuffle: every s16 lane <- the sub-block's scale (Q4_K, Q5_K) */
    __m256i pick6[8]; /* shuffle: low 128 <- group g, high <- g + 1 (Q6_K, from its half) */
    __m128i mdup;     /* bytes 8 + i / 2: each min twice */
} kq_consts;

static void kq_consts_init(kq_consts *k) {
    uint8_t b[32];
    for (int v = 0; v < 8; v++) {
        const int h = v / 4, odd = v / 2 % 2, half = v % 2;
        const int sub = 4 * h + odd + 2 * half;
        for (int i = 0; i < 32; i++) b[i] = (uint8_t)(2 * sub + i % 2);
        k->pick[v] = _mm256_loadu_si256((const __m256i *)b);
        const int g = (8 * h + 2 * odd + 4 * half) % 8; /* within its half's 8 groups */
        for (int i = 0; i < 32; i++) b[i] = (uint8_t)(2 * (g + i / 16) + i % 2);
        k->pick6[v] = _mm256_loadu_si256((const __m256i *)b);
    }
    for (int i = 0; i < 16; i++) b[i] = (uint8_t)(8 + i / 2);
    k->mdup = _mm_loadu_si128((const __m128i *)b);
}

typedef struct {
    __m256i w[8], s[8];
    __m256i m; /* what the 16-sums are multiplied by: mins twice each, or Q6_K's scales */
    float d, dmin;
} kq2_wblock;

static inline __attribute__((always_inline)) void kq2_load(const uint8_t *b, const int qt,
                                                           const kq_consts *k, kq2_wblock *o) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (qt == Q6_K) {
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        for (int h = 0; h < 2; h++) {
            const __m256i scale8 = _mm256_permute4x64_epi64(sc, h ? 0xee : 0x44); /* 8 groups */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int odd = 0; odd < 2; odd++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * odd));
                for (int half = 0; half < 2; half++) {
                    const int v = 4 * h + 2 * odd + half, shift = 4 * half + 2 * odd;
                    const __m256i lo = half ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4)
                                            : _mm256_and_si256(ql, low4);
                    const __m256i hi = _mm256_and_si256(
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(3));
                    o->w[v] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                    o->s[v] = _mm256_shuffle_epi8(scale8, k->pick6[v]);
                }
            }
        }
        o->m = sc;
        o->d = kq_half(b + 208);
        o->dmin = 0.0f;
        return;
    }
    const __m128i sm = kq_scales_mins_simd(b); /* scales 0-7, mins 0-7 */
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    const uint8_t *qs = b + (qt == Q5_K ? 48 : 16);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 2; half++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 64 * h + 32 * half));
            o->w[4 * h + half] = _mm256_and_si256(raw, low4);
            o->w[4 * h + 2 + half] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
    for (int v8 = 0; v8 < 8; v8++) {
        if (qt == Q5_K) {
            const int sub = 4 * (v8 / 4) + v8 / 2 % 2 + 2 * (v8 % 2);
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sub)),
                                                 _mm256_set1_epi8(1));
            o->w[v8] = _mm256_or_si256(o->w[v8], _mm256_slli_epi16(bit, 4));
        }
        o->s[v8] = _mm256_shuffle_epi8(scales, k->pick[v8]);
    }
    o->m = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, k->mdup));
    o->d = kq_half(b);
    o->dmin = kq_half(b + 2);
}

static inline float kq2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r] for R (1..4) rows of x and one row of W (the 16 ymm registers hold no more). */
static inline __attribute__((always_inline)) void kq2_tile(const xq_block *xq, int64_t nb,
                                                           const uint8_t *w0, const int qt,
                                                           const kq_consts *k, float *y0,
                                                           int64_t ys, const int R) {
    const int bb = kq_block_bytes(qt);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        kq2_wblock wb;
        kq2_load(w0 + b * bb, qt, k, &wb);
        for (int r = 0; r < R; r++) {
            const xq_block *xb = xq + r * nb + b;
            __m256i dot = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) {
                const __m256i xv = _mm256_load_si256((const __m256i *)(xb->q + 32 * v));
                dot = KQ2_DPWSSD(dot, _mm256_maddubs_epi16(wb.w[v], xv), wb.s[v]);
            }
            const __m256i bs = _mm256_load_si256((const __m256i *)xb->bs);
            const __m256i side = _mm256_madd_epi16(bs, wb.m);
            if (qt == Q6_K) dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(side, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(wb.d * xb->d), acc[r]);
            if (qt != Q6_K)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(side), _mm256_set1_ps(-wb.dmin * xb->d),
                                         acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y0[r * ys] = kq2_hsum(acc[r]);
}

#define KQ_R 4 /* rows of x per tile */
#define KQ_C 4 /* rows of W per thread's unit of work, one at a time */

#define KQ2_ROWS(QT)                                                                         \
    switch (R) {                                                                             \
        case 4: kq2_tile(xq, nb, w0, QT, k, y0, ys, 4); break;                               \
        case 3: kq2_tile(xq, nb, w0, QT, k, y0, ys, 3); break;                               \
        case 2: kq2_tile(xq, nb, w0, QT, k, y0, ys, 2); break;                               \
        default: kq2_tile(xq, nb, w0, QT, k, y0, ys, 1); break;                              \
    }

/* R rows of x (1..KQ_R) by the cols (<= KQ_C) rows of W from w0. Q8_0 never comes here
 * (kq_takes keeps it on quant_matmul.c's path without AVX512-VNNI). */
static void kq_rows_by_tile(const xq_block *xq, int64_t nb, const uint8_t *w, int64_t rb,
                            int qt, const kq_consts *k, float *y, int64_t ys, int R,
                            int cols) {
    for (int64_t c = 0; c < cols; c++) {
        const uint8_t *w0 = w + c * rb;
        float *y0 = y + c;
        switch (qt) {
            case Q4_K: KQ2_ROWS(Q4_K) break;
            case Q5_K: KQ2_ROWS(Q5_K) break;
            default: KQ2_ROWS(Q6_K) break;
        }
    }
}
