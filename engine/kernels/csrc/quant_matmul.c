/* Matrix products against GGUF-quantized weights, fp32 activations, without ever
 * dequantizing a weight matrix into memory.
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
 * W's row n is K / 32 blocks, `row_bytes` = K / 32 * block bytes.
 *
 * Every weight is dequantized exactly (w = q d + offset, one fma, in registers) and
 * multiplied against the fp32 activations, so the product differs from the one against
 * the dequantized matrix only by float rounding order. (Quantizing x to int8 as
 * llama.cpp does would cut the dequantization work but add ~0.3% error per product.)
 * Work is a grid of tiles: R rows of x times C rows of W, R x C accumulators. Each W
 * block is dequantized once per tile and used for all R rows of x: R is 8 with AVX-512
 * (16 lanes, 32 registers: C = 2), 4 with AVX2 (8 lanes, C = 2), so prefill pays the
 * dequantization once per 8 (4) rows of x; with one or two rows (decode) each pair
 * keeps two accumulators, two independent fma chains that hide the fma latency.
 * Rows of x go in chunks of X_CHUNK (kept in L2); within a chunk the tiles of W rows are
 * split statically over the OpenMP threads, so each thread reads its own rows of W.
 * The OpenMP runtime is the one PyTorch loaded (same soname), so torch.set_num_threads
 * applies here too. Without AVX2 + FMA + F16C a portable path computes the same.
 *
 * The caller (engine/kernels/quant.py) checks every shape and index: nothing is
 * checked here except the qtype.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TR_AVX2 1
#if defined(__AVX512F__)
#define TR_AVX512 1
#endif
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
#define X_CHUNK 64

static inline int block_bytes(int qt) { return qt == Q4_0 ? 18 : qt == Q4_1 ? 20 : 34; }

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef TR_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf / nan */
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The 32 weights of one block into `out` (portable; the gather and the fallback). */
static inline void dequant_block(const uint8_t *b, int qt, float *out) {
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

int tr_quant_matmul(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                    int64_t N, int qt, float *y, int64_t ys) {
    if (qt != Q4_0 && qt != Q4_1 && qt != Q8_0) return -1;
    const int64_t nb = K / 32, rb = nb * block_bytes(qt);
    const int64_t tiles = (N + TILE_C - 1) / TILE_C;
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK) {
        const int64_t m1 = m0 + X_CHUNK < M ? m0 + X_CHUNK : M;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
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
    return 0;
}

int tr_quant_rows(const uint8_t *w, int64_t K, int qt, const int64_t *ids, int64_t n,
                  float *out) {
    if (qt != Q4_0 && qt != Q4_1 && qt != Q8_0) return -1;
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
