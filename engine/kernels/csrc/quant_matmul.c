/* Matrix products against GGUF-quantized weights, fp32 activations, without ever
 * dequantizing a whole weight matrix into memory.
 *
 *   y[M, N] = x[M, K] @ W^T      x, y fp32 (rows `xs` / `ys` floats apart, elements
 *                                contiguous); W [N, K] in ggml blocks of 32 weights
 *   out[i, :] = W[ids[i], :]     row gather (the embedding lookup), dequantized
 *
 * Block layouts (ggml, little endian), `qtype` the ggml type id:
 *   Q4_0 (2)  18 bytes: fp16 d, 16 bytes q;  w[j] = ((q[j] & 15) - 8) d,
 *                                            w[j + 16] = ((q[j] >> 4) - 8) d   (j < 16)
 *   Q4_1 (3)  20 bytes: fp16 d, fp16 m, 16 bytes q;  w[j] = (q[j] & 15) d + m, ...
 *   Q8_0 (8)  34 bytes: fp16 d, 32 int8 q;  w[j] = q[j] d
 *   Q5_0 (6)  22 bytes: fp16 d, uint32 qh, 16 bytes q;  Q4_0's nibbles with bit j of qh as
 *                                            weight j's fifth bit; w = (q5 - 16) d
 *   Q5_1 (7)  24 bytes: fp16 d, fp16 m, uint32 qh, 16 bytes q;  w = q5 d + m
 *             (quant_q5.c, included, dequantizes these two)
 * W's row n is K / 32 blocks, `row_bytes` = K / 32 * block bytes.
 *
 * Every weight is dequantized exactly (w = q d + offset, one fma) and multiplied against
 * the fp32 activations with fp32 accumulation, so the product differs from the one against
 * the dequantized matrix only by float rounding order. (Quantizing x to int8 as llama.cpp
 * does would cut the dequantization work but add ~0.3% error per product.) Two paths:
 *
 * - Few rows of x (decode): a grid of tiles, R rows of x times C rows of W, R x C
 *   accumulators along K summed at the end. Each W block is dequantized in registers once
 *   per tile and used for all R rows of x: R is 8 with AVX-512 (16 lanes, 32 registers:
 *   C = 2), 4 with AVX2 (8 lanes, C = 2); with one or two rows each pair keeps two
 *   accumulators, two independent fma chains that hide the fma latency. Rows of x go in
 *   chunks of X_CHUNK (kept in L2); within a chunk the tiles of W rows are split statically
 *   over the OpenMP threads, so each thread reads its own rows of W.
 * - From GEMM_M rows of x (prefill, batches; 10, or 16 for Q8_0 whose transposes cost
 *   more; 16 with AVX2): each thread dequantizes a panel of PANEL rows of W (48 with
 *   AVX-512, 16 with AVX2) into its own scratch, transposed (panel[k][c], in L2), then an
 *   outer-product micro-kernel runs over it for GEMM_R rows of x at a time (8 with AVX-512,
 *   6 with AVX2): per k, one load of the panel row's PV vectors, one broadcast of x per
 *   row, GEMM_R x PV accumulators kept in registers. AVX-512 transposes 16 rows' quants as
 *   bytes (vpermt2b, AVX512-VBMI) before converting them (Q5: then adds each row's qh bits
 *   from a gather); AVX2 converts, then transposes 8 x 8 floats. Work units are (panel,
 *   chunk of at most X_ROWS rows of x), split statically so each thread dequantizes each
 *   of its panels once (and prefetches the next); the last panel is zero-padded when N is
 *   not a multiple of PANEL.
 *
 * The OpenMP runtime is the one PyTorch loaded (same soname), so torch.set_num_threads
 * applies here too. Without AVX2 + FMA + F16C a portable path computes the same (the tile
 * path for every M).
 *
 * Each path is also a per-thread part (qm_part) that the fused decoder step
 * (decoder.c) calls inside its own parallel region. tr_quant_matmul returns -1 for a
 * qtype it does not know, -2 when there is no memory for the panel scratch. The caller
 * (engine/kernels/quant.py) checks every shape and index: nothing is checked here except
 * the qtype.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TR_AVX2 1
#if defined(__AVX512F__)
#define TR_AVX512 1
#endif
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };
#define X_CHUNK 64

static inline int block_bytes(int qt) {
    return qt == Q4_0 ? 18 : qt == Q4_1 ? 20 : qt == Q5_0 ? 22 : qt == Q5_1 ? 24 : 34;
}

#ifndef TR_SPLIT_DEFINED
#define TR_SPLIT_DEFINED
/* [lo, hi): thread tid's contiguous share of n items over nth threads. */
static inline void tr_split(int64_t n, int tid, int nth, int64_t *lo, int64_t *hi) {
    const int64_t q = n / nth, r = n % nth;
    *lo = tid * q + (tid < r ? tid : r);
    *hi = *lo + q + (tid < r);
}
#ifdef _OPENMP
static inline int tr_thread(void) { return omp_get_thread_num(); }
static inline int tr_threads(void) { return omp_get_num_threads(); }
static inline int tr_max_threads(void) { return omp_get_max_threads(); }
#else
static inline int tr_thread(void) { return 0; }
static inline int tr_threads(void) { return 1; }
static inline int tr_max_threads(void) { return 1; }
#endif
#endif

#include "kquant.c"

/* Every ggml type this file multiplies. */
static inline int qm_known(int64_t qt) {
    return qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == Q8_0 ||
           is_kquant((int)qt) || (qt == KQ_Q4_KX && kq_takes(KQ_Q4_KX, QK));
}

static inline float half_to_float(const uint8_t *p) { return kq_half(p); }

#include "quant_q5.c"

/* The 32 weights of one block into `out` (portable; the gather and the fallback). */
static inline void dequant_block(const uint8_t *b, int qt, float *out) {
    if (is_q5(qt)) {
        q5_block(b, qt, out);
        return;
    }
    const float d = half_to_float(b);
    if (qt == Q8_0) {
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    const float m = qt == Q4_1 ? half_to_float(b + 2) : -8.0f * d;
    const uint8_t *q = b + (qt == Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; j++) {
        out[j] = (float)(q[j] & 15) * d + m;
        out[j + 16] = (float)(q[j] >> 4) * d + m;
    }
}

#ifdef TR_AVX2
/* One block as four vectors of 8 weights (0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void dequant_avx(const uint8_t *b, const int qt,
                                                              __m256 w[4]) {
    if (is_q5(qt)) {
        q5_avx(b, qt, w);
        return;
    }
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    if (qt == Q8_0) {
        const __m128i lo = _mm_loadu_si128((const __m128i *)(b + 2));
        const __m128i hi = _mm_loadu_si128((const __m128i *)(b + 18));
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
        return;
    }
    const __m256 m = qt == Q4_1 ? _mm256_set1_ps(half_to_float(b + 2))
                                : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (qt == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i v0 = lo, v1 = _mm_srli_si128(lo, 8), v2 = hi, v3 = _mm_srli_si128(hi, 8);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v0)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v1)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v2)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v3)), d, m);
}

#endif /* TR_AVX2 */

#if defined(TR_AVX512)
/* One block as two vectors of 16 weights (0-15: the low nibbles, 16-31: the high). */
static inline __attribute__((always_inline)) void dequant_512(const uint8_t *b, const int qt,
                                                              __m512 w[2]) {
    if (is_q5(qt)) {
        q5_512(b, qt, w);
        return;
    }
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    if (qt == Q8_0) {
        const __m128i lo = _mm_loadu_si128((const __m128i *)(b + 2));
        const __m128i hi = _mm_loadu_si128((const __m128i *)(b + 18));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d);
        return;
    }
    const __m512 m = qt == Q4_1 ? _mm512_set1_ps(half_to_float(b + 2))
                                : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (qt == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
}

/* y[r, c] for R rows of x from x0 and C rows of W from w0; S accumulators per pair.
 * Each block of W is dequantized once for the R rows of x (x read from L1). */
static inline __attribute__((always_inline)) void tile(const float *x0, int64_t xs,
                                                       const uint8_t *w0, int64_t rb,
                                                       int64_t nb, const int qt, float *y0,
                                                       int64_t ys, const int R, const int C,
                                                       const int S) {
    const int bb = block_bytes(qt);
    __m512 acc[8][2][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int s = 0; s < S; s++) acc[r][c][s] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        for (int c = 0; c < C; c++) {
            __m512 w[2];
            dequant_512(w0 + c * rb + kb * bb, qt, w);
            for (int r = 0; r < R; r++) {
                const float *xp = x0 + r * xs + kb * 32;
                acc[r][c][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xp), acc[r][c][0]);
                acc[r][c][S - 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xp + 16), acc[r][c][S - 1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            __m512 v = acc[r][c][0];
            if (S == 2) v = _mm512_add_ps(v, acc[r][c][1]);
            y0[r * ys + c] = _mm512_reduce_add_ps(v);
        }
}
#define TILE_R 8
#define TILE_C 2
#elif defined(TR_AVX2)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r, c] for R rows of x from x0 and C rows of W from w0; S accumulators per pair
 * (two for fewer than three rows of x: independent fma chains hide the fma latency). */
static inline __attribute__((always_inline)) void tile(const float *x0, int64_t xs,
                                                       const uint8_t *w0, int64_t rb,
                                                       int64_t nb, const int qt, float *y0,
                                                       int64_t ys, const int R, const int C,
                                                       const int S) {
    const int bb = block_bytes(qt);
    __m256 acc[4][2][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int s = 0; s < S; s++) acc[r][c][s] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        for (int c = 0; c < C; c++) {
            __m256 w[4];
            dequant_avx(w0 + c * rb + kb * bb, qt, w);
            for (int r = 0; r < R; r++) {
                const float *xp = x0 + r * xs + kb * 32;
                for (int j = 0; j < 4; j++) {
                    const int s = S == 1 ? 0 : j & 1;
                    acc[r][c][s] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xp + 8 * j), acc[r][c][s]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            __m256 v = acc[r][c][0];
            if (S == 2) v = _mm256_add_ps(v, acc[r][c][1]);
            y0[r * ys + c] = hsum(v);
        }
}
#define TILE_R 4
#define TILE_C 2
#endif

#if defined(TR_AVX2)
/* R rows of x (1..TILE_R) by C rows of W (TILE_C or 1): constants inside each tile. */
#define TILE_COLS(QT, R)                                                                     \
    if (C == TILE_C) tile(x0, xs, w0, rb, nb, QT, y0, ys, R, TILE_C, R < 3 ? 2 : 1);         \
    else tile(x0, xs, w0, rb, nb, QT, y0, ys, R, 1, 2);
#if TILE_R == 8
#define TILE_ROWS(QT)                                                                        \
    switch (R) {                                                                             \
        case 8: TILE_COLS(QT, 8) break;                                                      \
        case 7: TILE_COLS(QT, 7) break;                                                      \
        case 6: TILE_COLS(QT, 6) break;                                                      \
        case 5: TILE_COLS(QT, 5) break;                                                      \
        case 4: TILE_COLS(QT, 4) break;                                                      \
        case 3: TILE_COLS(QT, 3) break;                                                      \
        case 2: TILE_COLS(QT, 2) break;                                                      \
        default: TILE_COLS(QT, 1) break;                                                     \
    }
#else
#define TILE_ROWS(QT)                                                                        \
    switch (R) {                                                                             \
        case 4: TILE_COLS(QT, 4) break;                                                      \
        case 3: TILE_COLS(QT, 3) break;                                                      \
        case 2: TILE_COLS(QT, 2) break;                                                      \
        default: TILE_COLS(QT, 1) break;                                                     \
    }
#endif
#define TILE_CASES(QT)                                                                       \
    case QT:                                                                                 \
        TILE_ROWS(QT)                                                                        \
        break;

/* One tile of R (1..TILE_R) rows of x by C (TILE_C or 1) rows of W. */
static void run_tile(const float *x0, int64_t xs, const uint8_t *w0, int64_t rb, int64_t nb,
                     int qt, float *y0, int64_t ys, int R, int C) {
    switch (qt) {
        TILE_CASES(Q4_0)
        TILE_CASES(Q4_1)
        TILE_CASES(Q5_0)
        TILE_CASES(Q5_1)
        TILE_CASES(Q8_0)
    }
}
#else
#define TILE_R 4
#define TILE_C 4
/* Portable: each block of C rows of W into a buffer once, then dotted with R rows of x. */
static void run_tile(const float *x0, int64_t xs, const uint8_t *w0, int64_t rb, int64_t nb,
                     int qt, float *y0, int64_t ys, int R, int C) {
    const int bb = block_bytes(qt);
    float acc[4][TILE_C] = {{0}};
    float w[32];
    for (int64_t kb = 0; kb < nb; kb++)
        for (int c = 0; c < C; c++) {
            dequant_block(w0 + c * rb + kb * bb, qt, w);
            for (int r = 0; r < R; r++) {
                const float *xp = x0 + r * xs + kb * 32;
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += w[j] * xp[j];
                acc[r][c] += s;
            }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y0[r * ys + c] = acc[r][c];
}
#endif

/* ---- Many rows of x: dequantized panels and an outer-product micro-kernel ---- */
#if defined(TR_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                  \
    defined(__AVX512DQ__) && defined(__AVX512VBMI__)
#define PV 3            /* vectors of 16 per panel row */
#define PANEL (16 * PV) /* rows of W per panel */
#define GEMM_R 8        /* rows of x per micro-tile: 8 x 3 accumulators */
/* Rows of x from which tr_quant_matmul takes the panel path: Q8_0's permutes cost more. */
#define GEMM_M(qt) ((qt) == Q8_0 ? 16 : 10)

/* The byte permutes that transpose 16 rows of W's quants (vpermt2b: 128 bytes in, 64 out). */
typedef struct {
    __m512i t[2], s[2], o[8];
} perms;

static void perms_init(perms *p) {
    uint8_t b[64];
    for (int h = 0; h < 2; h++) {
        /* Q8_0: [4 rows] x quants 16h..16h+15 from [row 0 | row 1], [row 2 | row 3] (32 each) */
        for (int i = 0; i < 64; i++)
            b[i] = (uint8_t)(i / 32 * 64 + i / 16 % 2 * 32 + 16 * h + i % 16);
        p->t[h] = _mm512_loadu_si512(b);
        /* [8 rows] x 8 quants 8h..8h+7 from two [4 rows] x 16 quants */
        for (int i = 0; i < 64; i++)
            b[i] = (uint8_t)(i / 32 * 64 + i / 8 % 4 * 16 + 8 * h + i % 8);
        p->s[h] = _mm512_loadu_si512(b);
    }
    /* every byte of dword lane c: row c's quant j from two [8 rows] x 8 quants */
    for (int j = 0; j < 8; j++) {
        for (int i = 0; i < 64; i++) b[i] = (uint8_t)(i / 32 * 64 + i / 4 % 8 * 8 + j);
        p->o[j] = _mm512_loadu_si512(b);
    }
}

/* d (and m) of one block of each of 16 rows of W (at b + c * rb), one lane per row. Q8_0:
 * d * 2^-24, its quants arriving as q * 2^24 (exact both ways); Q4_0: m = -8 d; Q5_0:
 * m = -16 d. */
static inline __attribute__((always_inline)) void scales16(const uint8_t *b, int64_t rb,
                                                           const int qt, __m512 *d, __m512 *m) {
    __m128i part[4]; /* per row 4 bytes: fp16 d, then fp16 m (Q4_1, Q5_1) or (ignored) quants */
    for (int i = 0; i < 4; i++) {
        int32_t v[4];
        for (int j = 0; j < 4; j++) memcpy(&v[j], b + (4 * i + j) * rb, 4);
        part[i] = _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(v[0]),
                                                                     v[1], 1), v[2], 2), v[3], 3);
    }
    const __m256i dm0 = _mm256_inserti128_si256(_mm256_castsi128_si256(part[0]), part[1], 1);
    const __m256i dm1 = _mm256_inserti128_si256(_mm256_castsi128_si256(part[2]), part[3], 1);
    const __m512 lo = _mm512_cvtph_ps(dm0), hi = _mm512_cvtph_ps(dm1); /* d0 m0 .. d7 m7, .. */
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *d = _mm512_permutex2var_ps(lo, even, hi);
    if (qt == Q4_1 || qt == Q5_1) {
        *m = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
    } else if (qt == Q4_0 || qt == Q5_0) {
        *m = _mm512_mul_ps(*d, _mm512_set1_ps(qt == Q4_0 ? -8.0f : -16.0f));
    } else {
        *d = _mm512_mul_ps(*d, _mm512_set1_ps(0x1p-24f));
    }
}

/* One block of each of 16 rows of W (row c's at b0 + c * rb) into out[k * PANEL + c], k < 32:
 * the quants transposed as bytes, then converted and scaled 16 rows at a time. */
static inline __attribute__((always_inline)) void dequant16(const uint8_t *b0, int64_t rb,
                                                            const int qt, const perms *p,
                                                            float *out) {
    const uint8_t *b[16];
    for (int c = 0; c < 16; c++) b[c] = b0 + c * rb;
    __m512 d, m;
    scales16(b0, rb, qt, &d, &m);
    __m512i s[2][4]; /* [8 rows] x [8 quants] per vector */
    if (qt == Q8_0) {
        __m512i z[8], t[8];
        for (int i = 0; i < 8; i++)
            z[i] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b[2 * i] + 2))),
                _mm256_loadu_si256((const __m256i *)(b[2 * i + 1] + 2)), 1);
        for (int i = 0; i < 4; i++)
            for (int h = 0; h < 2; h++)
                t[2 * i + h] = _mm512_permutex2var_epi8(z[2 * i], p->t[h], z[2 * i + 1]);
        for (int o = 0; o < 2; o++)
            for (int q = 0; q < 4; q++)
                s[o][q] = _mm512_permutex2var_epi8(t[4 * o + q / 2], p->s[q % 2],
                                                   t[4 * o + 2 + q / 2]);
#pragma GCC unroll 32
        for (int k = 0; k < 32; k++) { /* the quant into the top byte: q * 2^24 */
            const __m512i v = _mm512_maskz_permutex2var_epi8(0x8888888888888888ull, s[0][k / 8],
                                                             p->o[k % 8], s[1][k / 8]);
            _mm512_storeu_ps(out + k * PANEL, _mm512_mul_ps(_mm512_cvtepi32_ps(v), d));
        }
    } else {
        const int qo = qt == Q4_0 ? 2 : qt == Q4_1 ? 4 : q5_qh_at(qt) + 4; /* the nibbles */
        /* Q5: each row's qh, and qh << 4 (bit j at 4 + j) */
        const __m512i qh = is_q5(qt) ? q5_high16(b0, rb, qt) : _mm512_setzero_si512();
        const __m512i qh4 = _mm512_slli_epi32(qh, 4), sixteen = _mm512_set1_epi32(16);
        __m512i z[4];
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b[4 * i] + qo)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b[4 * i + 1] + qo)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b[4 * i + 2] + qo)), 2);
            z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b[4 * i + 3] + qo)), 3);
        }
        for (int o = 0; o < 2; o++)
            for (int h = 0; h < 2; h++)
                s[o][h] = _mm512_permutex2var_epi8(z[2 * o], p->s[h], z[2 * o + 1]);
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) { /* byte j: weight j (low nibble), j + 16 (high) */
            const __m512i v = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, s[0][j / 8],
                                                             p->o[j % 8], s[1][j / 8]);
            __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
            if (is_q5(qt)) { /* qh bits j and j + 16, moved to 16 */
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_srli_epi32(qh4, j), sixteen));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi32(qh, j + 12), sixteen));
            }
            const __m512 wl = _mm512_cvtepi32_ps(lo), wh = _mm512_cvtepi32_ps(hi);
            _mm512_storeu_ps(out + j * PANEL, _mm512_fmadd_ps(wl, d, m));
            _mm512_storeu_ps(out + (j + 16) * PANEL, _mm512_fmadd_ps(wh, d, m));
        }
    }
}

/* PANEL rows of W (from w0, rb bytes apart) into panel[k * PANEL + c]. */
static inline __attribute__((always_inline)) void dequant_panel(const uint8_t *w0, int64_t rb,
                                                                int64_t nb, const int qt,
                                                                const perms *p, float *panel) {
    const int bb = block_bytes(qt);
    for (int64_t kb = 0; kb < nb; kb++)
        for (int g = 0; g < PANEL / 16; g++)
            dequant16(w0 + 16 * g * rb + kb * bb, rb, qt, p, panel + kb * 32 * PANEL + 16 * g);
}

/* y[r, c] for R rows of x from x0 and the panel's columns c < cols: R x PV accumulators, each
 * panel row loaded once per k for the R rows (x broadcast). */
static inline __attribute__((always_inline)) void gemm_tile(const float *x0, int64_t xs,
                                                            const float *panel, int64_t K,
                                                            float *y0, int64_t ys, const int R,
                                                            int cols) {
    __m512 a[GEMM_R][PV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PV; v++) a[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 pv[PV];
        for (int v = 0; v < PV; v++) pv[v] = _mm512_load_ps(panel + k * PANEL + 16 * v);
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x0[r * xs + k]);
            for (int v = 0; v < PV; v++) a[r][v] = _mm512_fmadd_ps(xb, pv[v], a[r][v]);
        }
    }
    for (int v = 0; v < PV; v++) {
        const int c = cols - 16 * v;
        const __mmask16 keep = c >= 16 ? 0xffff : c <= 0 ? 0 : (__mmask16)((1u << c) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y0 + r * ys + 16 * v, keep, a[r][v]);
    }
}
#elif defined(TR_AVX2)
#define PV 2           /* vectors of 8 per panel row */
#define PANEL (8 * PV) /* rows of W per panel */
#define GEMM_R 6       /* rows of x per micro-tile: 6 x 2 accumulators */
#define GEMM_M(qt) 16  /* rows of x from which tr_quant_matmul takes the panel path */

typedef struct {
    char unused;
} perms; /* (no byte permutes here) */
static void perms_init(perms *p) { (void)p; }

/* 8 x 8 floats from src (rows ss apart) transposed into dst (rows ds apart). */
static inline __attribute__((always_inline)) void transpose8(const float *src, int64_t ss,
                                                             float *dst, int64_t ds) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ss);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* r[i + j]: column j (lane 0) and j + 4 (lane 1) */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(dst + j * ds, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
        _mm256_storeu_ps(dst + (j + 4) * ds, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
    }
}

/* PANEL rows of W (from w0, rb bytes apart) into panel[k * PANEL + c]: each block
 * dequantized into a PANEL x 32 buffer, then transposed 8 x 8 at a time. */
static inline __attribute__((always_inline)) void dequant_panel(const uint8_t *w0, int64_t rb,
                                                                int64_t nb, const int qt,
                                                                const perms *p, float *panel) {
    (void)p;
    const int bb = block_bytes(qt);
    float tmp[PANEL * 32] __attribute__((aligned(32)));
    for (int64_t kb = 0; kb < nb; kb++) {
        for (int c = 0; c < PANEL; c++) {
            __m256 v[4];
            dequant_avx(w0 + c * rb + kb * bb, qt, v);
            for (int j = 0; j < 4; j++) _mm256_store_ps(tmp + c * 32 + 8 * j, v[j]);
        }
        for (int g = 0; g < PANEL / 8; g++)
            for (int j = 0; j < 4; j++)
                transpose8(tmp + 8 * g * 32 + 8 * j, 32, panel + (kb * 32 + 8 * j) * PANEL + 8 * g,
                           PANEL);
    }
}

/* y[r, c] for R rows of x from x0 and the panel's columns c < cols: R x 2 accumulators, each
 * panel row loaded once per k for the R rows (x broadcast). */
static inline __attribute__((always_inline)) void gemm_tile(const float *x0, int64_t xs,
                                                            const float *panel, int64_t K,
                                                            float *y0, int64_t ys, const int R,
                                                            int cols) {
    __m256 a[GEMM_R][PV];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 p0 = _mm256_load_ps(panel + k * PANEL);
        const __m256 p1 = _mm256_load_ps(panel + k * PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x0 + r * xs + k);
            a[r][0] = _mm256_fmadd_ps(xb, p0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, p1, a[r][1]);
        }
    }
    if (cols == PANEL) {
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(y0 + r * ys, a[r][0]);
            _mm256_storeu_ps(y0 + r * ys + 8, a[r][1]);
        }
    } else {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
        const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
        for (int r = 0; r < R; r++) {
            _mm256_maskstore_ps(y0 + r * ys, m0, a[r][0]);
            _mm256_maskstore_ps(y0 + r * ys + 8, m1, a[r][1]);
        }
    }
}
#endif

#ifdef PANEL
#define X_ROWS 128 /* rows of x per work unit at most */

#define GEMM_CASE(n)                                                                         \
    case n: gemm_tile(x0, xs, panel, K, y0, ys, n, cols); break;
/* Rows m0..m1 - 1 of y's panel columns from the dequantized panel. */
static void gemm_rows(const float *x, int64_t m0, int64_t m1, int64_t xs, const float *panel,
                      int64_t K, int cols, float *y, int64_t ys) {
    for (int64_t r0 = m0; r0 < m1; r0 += GEMM_R) {
        const float *x0 = x + r0 * xs;
        float *y0 = y + r0 * ys;
        switch (m1 - r0 < GEMM_R ? m1 - r0 : GEMM_R) {
#if GEMM_R == 8
            GEMM_CASE(8) GEMM_CASE(7)
#endif
            GEMM_CASE(6) GEMM_CASE(5) GEMM_CASE(4) GEMM_CASE(3) GEMM_CASE(2)
            default: gemm_tile(x0, xs, panel, K, y0, ys, 1, cols); break;
        }
    }
}

/* The work units of the panel path: (panel of W's rows, chunk of at most mc rows of x). */
typedef struct {
    int64_t panels, chunks, mc;
} gemm_plan;

static gemm_plan plan_gemm(int64_t M, int64_t N, int nth) {
    gemm_plan g = {(N + PANEL - 1) / PANEL, (M + X_ROWS - 1) / X_ROWS, 0};
    if (g.panels * g.chunks < 2 * nth) { /* few panels: split the rows too */
        const int64_t most = (M + GEMM_R - 1) / GEMM_R;
        g.chunks = (2 * nth + g.panels - 1) / g.panels;
        if (g.chunks > most) g.chunks = most;
    }
    g.mc = ((M + g.chunks - 1) / g.chunks + GEMM_R - 1) / GEMM_R * GEMM_R;
    g.chunks = (M + g.mc - 1) / g.mc;
    return g;
}

/* Floats of one thread's panel scratch for rows of K weights: the panel (PANEL * K), then
 * room for a zero-padded copy of the last rows of W when N is not a multiple of PANEL. */
static int64_t panel_floats(int64_t K, int qt) {
    return PANEL * K + (PANEL * (K / 32) * block_bytes(qt) + 63) / 64 * 16;
}

/* Thread tid's share (of nth) of the panel path: units split statically, so that each
 * thread dequantizes each of its panels once; `panel` is its scratch (panel_floats). */
static void gemm_part(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                      int64_t N, int qt, float *y, int64_t ys, float *panel, int tid,
                      int nth) {
    const int64_t nb = K / 32, rb = nb * block_bytes(qt);
    const gemm_plan g = plan_gemm(M, N, nth);
    int64_t u0, u1;
    tr_split(g.panels * g.chunks, tid, nth, &u0, &u1);
    perms p;
    perms_init(&p);
    int64_t have = -1;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t pi = u / g.chunks, m0 = u % g.chunks * g.mc, n0 = pi * PANEL;
        const int64_t m1 = m0 + g.mc < M ? m0 + g.mc : M;
        const int cols = (int)(N - n0 < PANEL ? N - n0 : PANEL);
        if (pi != have) {
            const uint8_t *w0 = w + n0 * rb;
            if (pi + 1 < g.panels) { /* the next panel's rows (contiguous) towards L2 */
                const uint8_t *next = w0 + PANEL * rb;
                const int64_t bytes = (pi + 2 < g.panels ? PANEL : N - n0 - PANEL) * rb;
                for (int64_t i = 0; i < bytes; i += 64)
                    _mm_prefetch((const char *)next + i, _MM_HINT_T1);
            }
            if (cols < PANEL) { /* zero blocks dequantize to zeros */
                uint8_t *pad = (uint8_t *)(panel + PANEL * K);
                memcpy(pad, w0, (size_t)(cols * rb));
                memset(pad + cols * rb, 0, (size_t)((PANEL - cols) * rb));
                w0 = pad;
            }
            switch (qt) {
                case Q4_0: dequant_panel(w0, rb, nb, Q4_0, &p, panel); break;
                case Q4_1: dequant_panel(w0, rb, nb, Q4_1, &p, panel); break;
                case Q5_0: dequant_panel(w0, rb, nb, Q5_0, &p, panel); break;
                case Q5_1: dequant_panel(w0, rb, nb, Q5_1, &p, panel); break;
                default: dequant_panel(w0, rb, nb, Q8_0, &p, panel); break;
            }
            have = pi;
        }
        gemm_rows(x, m0, m1, xs, panel, K, cols, y + n0, ys);
    }
}
#endif

/* Thread tid's share (of nth) of the tile path: within each chunk of x's rows, the tiles
 * of W's rows split statically, so that each thread reads its own rows of W. */
static void tiles_part(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                       int64_t N, int qt, float *y, int64_t ys, int tid, int nth) {
    const int64_t nb = K / 32, rb = nb * block_bytes(qt);
    int64_t t0, t1;
    tr_split((N + TILE_C - 1) / TILE_C, tid, nth, &t0, &t1);
    for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK) {
        const int64_t m1 = m0 + X_CHUNK < M ? m0 + X_CHUNK : M;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n0 = t * TILE_C;
            const int64_t cols = N - n0 < TILE_C ? N - n0 : TILE_C;
            for (int64_t r0 = m0; r0 < m1; r0 += TILE_R) {
                const int R = (int)(m1 - r0 < TILE_R ? m1 - r0 : TILE_R);
                const float *xr = x + r0 * xs;
                float *yr = y + r0 * ys + n0;
                if (cols == TILE_C) {
                    run_tile(xr, xs, w + n0 * rb, rb, nb, qt, yr, ys, R, TILE_C);
                } else { /* the last rows of W, one at a time */
                    for (int64_t c = 0; c < cols; c++)
                        run_tile(xr, xs, w + (n0 + c) * rb, rb, nb, qt, yr + c, ys, R, 1);
                }
            }
        }
    }
}

/* Floats of panel scratch qm_part needs per thread for M rows of x (0: the tile path). */
static int64_t qm_scratch_floats(int64_t M, int64_t K, int qt) {
    if (kq_takes(qt, K)) return kq_scratch_bytes(M, K) / (int64_t)sizeof(float);
#ifdef PANEL
    if (M >= GEMM_M(qt)) return panel_floats(K, qt);
#endif
    (void)M, (void)K, (void)qt;
    return 0;
}

/* Thread tid's share (of nth) of y = x @ W^T, called by every thread of a parallel region
 * with the same arguments; `panel`: this thread's qm_scratch_floats of scratch (may be NULL
 * when that is 0); `next`: a zeroed counter the threads share to split the K-quant path's
 * work as they go (NULL: statically). No barrier at the end: y is complete once every
 * thread has returned. */
static void qm_part(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                    int64_t N, int qt, float *y, int64_t ys, float *panel, int tid, int nth,
                    int64_t *next) {
    if (kq_takes(qt, K)) {
        kq_part(x, M, K, xs, w, N, qt, y, ys, (xq_block *)panel, tid, nth, next);
        return;
    }
#ifdef PANEL
    if (M >= GEMM_M(qt)) {
        gemm_part(x, M, K, xs, w, N, qt, y, ys, panel, tid, nth);
        return;
    }
#endif
    (void)panel;
    tiles_part(x, M, K, xs, w, N, qt, y, ys, tid, nth);
}

int tr_quant_matmul(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                    int64_t N, int qt, float *y, int64_t ys) {
    if (!qm_known(qt)) return -1;
    const int64_t per = qm_scratch_floats(M, K, qt);
    float *scratch = NULL;
    if (per > 0) {
        scratch = aligned_alloc(64, (size_t)(per * tr_max_threads()) * sizeof(float));
        if (scratch == NULL) return -2;
    }
#pragma omp parallel
    {
        const int tid = tr_thread(), nth = tr_threads();
        qm_part(x, M, K, xs, w, N, qt, y, ys, scratch ? scratch + per * tid : NULL, tid, nth,
                NULL);
    }
    free(scratch);
    return 0;
}

int tr_quant_rows(const uint8_t *w, int64_t K, int qt, const int64_t *ids, int64_t n,
                  float *out) {
    if (!qm_known(qt)) return -1;
    if (is_kquant(qt)) {
        kq_rows(w, K, qt, ids, n, out);
        return 0;
    }
    const int64_t nb = K / 32, bb = block_bytes(qt), rb = nb * bb;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + ids[i] * rb;
        float *o = out + i * K;
        for (int64_t kb = 0; kb < nb; kb++) {
#ifdef TR_AVX2
            __m256 v[4];
            switch (qt) {
                case Q4_0: dequant_avx(row + kb * bb, Q4_0, v); break;
                case Q4_1: dequant_avx(row + kb * bb, Q4_1, v); break;
                case Q5_0: dequant_avx(row + kb * bb, Q5_0, v); break;
                case Q5_1: dequant_avx(row + kb * bb, Q5_1, v); break;
                default: dequant_avx(row + kb * bb, Q8_0, v); break;
            }
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + kb * 32 + 8 * j, v[j]);
#else
            dequant_block(row + kb * bb, qt, o + kb * 32);
#endif
        }
    }
    return 0;
}

/* x [M, K] (rows xs floats apart) as the K-quant products see it: each value replaced by
 * its int8 quantization times its block's scale (for tests: the exact reference input). */
int tr_kq_quantized_x(const float *x, int64_t M, int64_t K, int64_t xs, float *out) {
    const int64_t nb = K / QK;
    xq_block *xq = aligned_alloc(64, (size_t)(nb > 0 ? nb : 1) * sizeof(xq_block));
    if (xq == NULL) return -2;
    for (int64_t r = 0; r < M; r++) {
        kq_quantize_rows(x + r * xs, 1, K, xs, xq, 0);
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < QK; i++)
                out[r * K + b * QK + i] = xq[b].d * (float)xq[b].q[kq_pair_pos(i)];
    }
    free(xq);
    return 0;
}

/* W [n, k] Q4_K -> out (n / 16 * k / 256 * 2368 bytes) repacked as Q4_KX (kquant_x16.c);
 * -1 where this build has no Q4_KX (no AVX512-VNNI) or n, k are not multiples of 16, 256. */
int tr_kq_interleave(const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
#ifdef TR_KQ_VNNI
    if (n > 0 && k > 0 && n % 16 == 0 && k % QK == 0) {
        kqx_repack(w, n, k, out);
        return 0;
    }
#endif
    (void)w, (void)n, (void)k, (void)out;
    return -1;
}

/* 1 when products with a qt matrix of K columns quantize x to int8 (kquant.c), else 0. */
int tr_quant_int8_activations(int qt, int64_t K) { return kq_takes(qt, K); }
