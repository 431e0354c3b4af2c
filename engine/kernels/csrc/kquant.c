/* Matrix products against ggml's K-quant weights (Q4_K, Q5_K, Q6_K) with int8 activations.
 *
 *   y[M, N] = x[M, K] @ W^T     x, y fp32; W [N, K] in super-blocks of 256 weights
 *
 * Block layouts (ggml, little endian; d, dmin fp16):
 *   Q4_K (12) 144 bytes: d, dmin, scales[12], qs[128]
 *   Q5_K (13) 176 bytes: d, dmin, scales[12], qh[32], qs[128]
 *   Q6_K (14) 210 bytes: ql[128], qh[64], int8 scales[16], d
 * Q4_K / Q5_K: 8 sub-blocks of 32 weights, w = d sc q - dmin m, sc and m 6-bit (packed in
 * the 12 bytes), q 4-bit (Q5_K: plus a fifth bit from qh). Chunk c (64 weights) of qs is 32
 * bytes: low nibbles weights 64c..64c+31, high nibbles 64c+32..64c+63; Q5_K's qh[l] bit 2c
 * lifts weight 64c + l, bit 2c + 1 weight 64c + 32 + l. Q6_K: 16 groups of 16 weights,
 * w = d sc (q - 32), q 6-bit: half h (128 weights) takes ql[64h..], qh[32h..]; weight
 * 128h + l + 32i (l < 32) has low bits from ql[64h + l + 32 (i & 1)] (low nibble for i < 2,
 * high for i >= 2) and high bits (qh[32h + l] >> 2i) & 3.
 *
 * As the format was designed for, each row of x is quantized first, per 256 values
 * (xq_block: d = max|x| / 127, q = round(x / d), the sums of each 16 q's), and the dot
 * products run in integers: per pair of sub-blocks, u8 weights x s8 activations summed in
 * fours into int32 (vpdpbusd, AVX512-VNNI), two quarters' sums packed into int16s and
 * multiplied by their sub-blocks' scales into int32 (vpdpwssd);
 * the mins (Q4_K, Q5_K) and Q6_K's -32 come from the 16-sums. Each super-block's integer
 * sum is exact; it is scaled into fp32 accumulators in super-block order. Row r of y
 * therefore depends only on row r of x, never on what else is in the batch or how the
 * rows are tiled (a sequence's logits do not change with its neighbours).
 *
 * x's int8 values are stored in "pair order": within each 128, [0..31, 64..95, 32..63,
 * 96..127], so that one 64-byte load matches one load of Q4_K/Q5_K nibbles (and, with a
 * broadcast and shifts, of Q6_K's). Without AVX512-VNNI/BW/VL a portable C path computes
 * the same integer sums.
 *
 * Included by quant_matmul.c (kq_part is its K-quant branch).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

enum { Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define QK 256

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                \
    defined(__AVX512VNNI__)
#define TR_KQ_VNNI 1
#include <immintrin.h>
#endif


/* One row's 256 values of x, quantized. 320 bytes: rows of blocks stay 64-byte aligned. */
typedef struct {
    int8_t q[QK];  /* pair order (see above) */
    int16_t bs[16]; /* sum of q over natural positions 16i..16i+15 */
    float d;
    uint8_t pad[28];
} xq_block;

static inline int is_kquant(int qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }

#define KQ_Q8_0 8 /* ggml's Q8_0: fp16 d, 32 int8 q; 8 blocks per 256 values of x */

/* Whether kq_part multiplies qt at this K: the K-quants always; Q8_0 where the int8 dot
 * products are there and K is whole 256-blocks of x (else quant_matmul.c's fp32 path). */
static inline int kq_takes(int qt, int64_t K) {
#ifdef TR_KQ_VNNI
    if (qt == KQ_Q8_0) return K % QK == 0;
#endif
    (void)K;
    return is_kquant(qt);
}

/* Bytes of W per 256 weights of a row. */
static inline int kq_block_bytes(int qt) {
    return qt == Q4_K ? 144 : qt == Q5_K ? 176 : qt == Q6_K ? 210 : 8 * 34;
}

/* Natural position i of a 256-block <-> its place in pair order (the map is its own inverse). */
static inline int kq_pair_pos(int i) {
    const int j = i & 127, base = i & ~127;
    return base + (j < 32 || j >= 96 ? j : j < 64 ? j + 32 : j - 32);
}

static inline float kq_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
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
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> out[0..7] scales, out[8..15] mins.
 * Sub-blocks 0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
 * 4-7 put their low 4 bits in bytes 8-11 (scale: low nibble, min: high nibble) and
 * their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void kq_scales_mins(const uint8_t *s, uint8_t out[16]) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t six = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t w[4] = {
        a & six,                                 /* scales 0-3 */
        (c & low4) | (((a >> 6) & two) << 4),    /* scales 4-7 */
        b & six,                                 /* mins 0-3 */
        ((c >> 4) & low4) | (((b >> 6) & two) << 4), /* mins 4-7 */
    };
    memcpy(out, w, 16);
}

/* Quantize rows [0, M) of x (K values each, rows xs floats apart) into xq (K / 256 blocks a
 * row). Round to nearest even, as the AVX-512 conversion does. */
static void kq_quantize_rows(const float *x, int64_t M, int64_t K, int64_t xs, xq_block *xq) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * xs + b * QK;
            xq_block *o = xq + r * nb + b;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            o->d = d;
            for (int g = 0; g < 16; g++) {
                int sum = 0;
                for (int i = 16 * g; i < 16 * g + 16; i++) {
                    int q = (int)nearbyintf(v[i] * id);
                    q = q > 127 ? 127 : q < -127 ? -127 : q;
                    o->q[kq_pair_pos(i)] = (int8_t)q;
                    sum += q;
                }
                o->bs[g] = (int16_t)sum;
            }
        }
    }
}

/* For Q8_0: rows of x quantized per 256 values as for the K-quants, stored in natural order
 * as unsigned bytes q + 128 (vpdpbusd's unsigned side; the 128 comes off per block of W). */
static void kq_quantize_rows_u8(const float *x, int64_t M, int64_t K, int64_t xs,
                                xq_block *xq) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * xs + b * QK;
            xq_block *o = xq + r * nb + b;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            o->d = amax / 127.0f;
            for (int i = 0; i < QK; i++) {
                int q = (int)nearbyintf(v[i] * id);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                ((uint8_t *)o->q)[i] = (uint8_t)(q + 128);
            }
        }
}

/* One super-block of W as integers: q[256] (natural order; Q6_K minus 32), per group of 16
 * its scale and min (Q6_K: min 0), and d, dmin. */
static void kq_unpack(const uint8_t *b, int qt, int16_t q[QK], int sc[16], int mn[16],
                      float *d, float *dmin) {
    if (qt == Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *s = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t lo = ql[64 * h + l + 32 * (i & 1)];
                    const int v = (i < 2 ? lo & 15 : lo >> 4) | (((qh[32 * h + l] >> (2 * i)) & 3) << 4);
                    q[128 * h + l + 32 * i] = (int16_t)(v - 32);
                }
        for (int g = 0; g < 16; g++) sc[g] = s[g], mn[g] = 0;
        *d = kq_half(b + 208);
        *dmin = 0.0f;
        return;
    }
    uint8_t sm[16];
    kq_scales_mins(b + 4, sm);
    const uint8_t *qs = b + (qt == Q5_K ? 48 : 16), *qh = b + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
            if (qt == Q5_K) {
                lo += ((qh[l] >> (2 * c)) & 1) << 4;
                hi += ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            q[64 * c + l] = (int16_t)lo;
            q[64 * c + 32 + l] = (int16_t)hi;
        }
    for (int g = 0; g < 16; g++) sc[g] = sm[g / 2], mn[g] = sm[8 + g / 2];
    *d = kq_half(b);
    *dmin = kq_half(b + 2);
}

/* Rows ids of W dequantized (the embedding lookup): out[i] = W[ids[i]] fp32. */
static void kq_rows(const uint8_t *w, int64_t K, int qt, const int64_t *ids, int64_t n,
                    float *out) {
    const int64_t nb = K / QK, rb = nb * kq_block_bytes(qt);
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) {
        int16_t q[QK];
        int sc[16], mn[16];
        float d, dmin;
        for (int64_t b = 0; b < nb; b++) {
            kq_unpack(w + ids[i] * rb + b * kq_block_bytes(qt), qt, q, sc, mn, &d, &dmin);
            float *o = out + i * K + b * QK;
            for (int j = 0; j < QK; j++)
                o[j] = d * (float)sc[j / 16] * (float)q[j] - dmin * (float)mn[j / 16];
        }
    }
}

/* Portable: y[r, c] for rows of x [r0, r1) and W's rows [c0, c1). */
static __attribute__((unused)) void kq_block_portable(const xq_block *xq, int64_t nb, const uint8_t *w, int64_t rb,
                              int qt, float *y, int64_t ys, int64_t r0, int64_t r1, int64_t c0,
                              int64_t c1) {
    const int bb = kq_block_bytes(qt);
    for (int64_t c = c0; c < c1; c++)
        for (int64_t r = r0; r < r1; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int16_t q[QK];
                int sc[16], mn[16];
                float d, dmin;
                kq_unpack(w + c * rb + b * bb, qt, q, sc, mn, &d, &dmin);
                const xq_block *xb = xq + r * nb + b;
                int32_t dot = 0, mins = 0;
                for (int g = 0; g < 16; g++) {
                    int32_t s = 0;
                    for (int i = 16 * g; i < 16 * g + 16; i++) s += q[i] * xb->q[kq_pair_pos(i)];
                    dot += sc[g] * s;
                    mins += mn[g] * xb->bs[g];
                }
                acc += (float)dot * (d * xb->d);
                acc -= (float)mins * (dmin * xb->d);
            }
            y[r * ys + c] = acc;
        }
}

#ifdef TR_KQ_VNNI
/* Per super-block of one row of W: its 4 quarter vectors of u8 weights (pair order), the
 * s16 scale vectors of its two pairs of quarters (in the order vpackssdw leaves their sums),
 * the s16 vector its 16-sums are multiplied by (mins duplicated per 16, or Q6_K's scales)
 * and d, dmin. */
typedef struct {
    __m512i w[4], s[2];
    __m256i m;
    float d, dmin;
} kq_wblock;

typedef struct {
    __m512i sel[2];     /* packed lane -> sub-block, per pair of quarters (Q4_K/Q5_K) */
    __m512i sel6[2];    /* packed lane -> group of 16, per pair of quarters (Q6_K) */
    __m256i mdup;       /* lane i -> min i / 2 (at 8 + i / 2 of the scales-mins vector) */
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
    int16_t m[16];
    for (int i = 0; i < 16; i++) m[i] = (int16_t)(8 + i / 2);
    k->mdup = _mm256_loadu_si256((const __m256i *)m);
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
        o->d = kq_half(b + 208);
        o->dmin = 0.0f;
        return;
    }
    /* kq_scales_mins in SIMD (no store-to-load round trip): u32 lanes [a, b, c, -] of the 12
     * bytes -> [a & six, (c & low4) | ((a >> 6) & two) << 4, b & six, ...] */
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4)); /* 16 bytes: inside the block */
    const __m128i acbc = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i aabb = _mm_shuffle_epi32(v, 0x50);
    const __m128i low = _mm_and_si128(acbc, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f,
                                                           0x0f0f0f0f));
    const __m128i top = _mm_and_si128(_mm_srli_epi32(aabb, 2),
                                      _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m256i sm16 = _mm256_cvtepu8_epi16(_mm_or_si128(low, top));
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
    o->m = _mm256_permutexvar_epi16(k->mdup, sm16);
    o->d = kq_half(b);
    o->dmin = kq_half(b + 2);
}

/* y[r, c] for R rows of x (xq, nb blocks a row) and C rows of W from w0 (rb bytes apart). */
static inline __attribute__((always_inline)) void kq_tile(const xq_block *xq, int64_t nb,
                                                          const uint8_t *w0, int64_t rb,
                                                          const int qt, const kq_consts *k,
                                                          float *y0, int64_t ys, const int R,
                                                          const int C) {
    const int bb = kq_block_bytes(qt);
    __m512 acc[8][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < C; c++) {
            kq_wblock wb;
            kq_load(w0 + c * rb + b * bb, qt, k, &wb);
            for (int r = 0; r < R; r++) {
                const xq_block *xb = xq + r * nb + b;
                /* per quarter, sums of 4 products (|sum| <= 4 * 63 * 127: an int16), two
                 * quarters packed into int16s, times their sub-blocks' scales */
                __m512i dot = _mm512_setzero_si512();
                for (int pq = 0; pq < 2; pq++) {
                    const __m512i p0 = _mm512_dpbusd_epi32(
                        _mm512_setzero_si512(), wb.w[2 * pq], _mm512_load_si512(xb->q + 128 * pq));
                    const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb.w[2 * pq + 1],
                                                           _mm512_load_si512(xb->q + 128 * pq + 64));
                    dot = _mm512_dpwssd_epi32(dot, _mm512_packs_epi32(p0, p1), wb.s[pq]);
                }
                /* the 16-sums times the mins (Q4_K, Q5_K) or Q6_K's scales (its -32) */
                const __m256i bs = _mm256_load_si256((const __m256i *)xb->bs);
                const __m256i side = _mm256_madd_epi16(bs, wb.m);
                if (qt == Q6_K)
                    dot = _mm512_sub_epi32(dot, _mm512_zextsi256_si512(_mm256_slli_epi32(side, 5)));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(wb.d * xb->d),
                                            acc[r][c]);
                if (qt != Q6_K)
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(side)),
                                                _mm512_set1_ps(-wb.dmin * xb->d), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y0[r * ys + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* Q8_0 against x quantized per 256 (kq_quantize_rows_u8): per quarter of 256 values, two
 * blocks of W (64 int8) dotted with x + 128 in fours (vpdpbusd, from -128 times the weights'
 * own sums in fours, which takes the 128 back off), scaled per block in fp32. */
static inline __attribute__((always_inline)) void kq8_tile(const xq_block *xq, int64_t nb,
                                                           const uint8_t *w0, int64_t rb,
                                                           float *y0, int64_t ys, const int R,
                                                           const int C) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w0 + c * rb + b * 272;
            __m512i w[4], corr[4];
            __m512 dw[4];
            for (int q = 0; q < 4; q++) {
                const uint8_t *b0 = blk + 68 * q, *b1 = b0 + 34;
                w[q] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                    _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
                corr[q] = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[q]), 7));
                dw[q] = _mm512_insertf32x8(_mm512_set1_ps(kq_half(b0)),
                                           _mm256_set1_ps(kq_half(b1)), 1);
            }
            for (int r = 0; r < R; r++) {
                const xq_block *xb = xq + r * nb + b;
                __m512 t = _mm512_setzero_ps();
                for (int q = 0; q < 4; q++) {
                    const __m512i p =
                        _mm512_dpbusd_epi32(corr[q], _mm512_load_si512(xb->q + 64 * q), w[q]);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dw[q], t);
                }
                acc[r][c] = _mm512_fmadd_ps(t, _mm512_set1_ps(xb->d), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y0[r * ys + c] = _mm512_reduce_add_ps(acc[r][c]);
}

#define KQ_R 8 /* rows of x per tile (from 3 rows of x on: two W rows at a time) */
#define KQ_C 4 /* rows of W per tile: each thread's share of W comes in these */

#define KQ_CASE(QT, R, C)                                                                    \
    case R: kq_tile(xq, nb, w0, rb, QT, k, y0, ys, R, C); break;
#define KQ_TILES(QT)                                                                         \
    if (C == 4) {                                                                            \
        switch (R) { KQ_CASE(QT, 2, 4) default: kq_tile(xq, nb, w0, rb, QT, k, y0, ys, 1, 4); } \
    } else if (C == 2) {                                                                     \
        switch (R) {                                                                         \
            KQ_CASE(QT, 8, 2) KQ_CASE(QT, 7, 2) KQ_CASE(QT, 6, 2) KQ_CASE(QT, 5, 2)           \
            KQ_CASE(QT, 4, 2) KQ_CASE(QT, 3, 2) KQ_CASE(QT, 2, 2)                            \
            default: kq_tile(xq, nb, w0, rb, QT, k, y0, ys, 1, 2);                           \
        }                                                                                    \
    } else {                                                                                 \
        switch (R) {                                                                         \
            KQ_CASE(QT, 8, 1) KQ_CASE(QT, 7, 1) KQ_CASE(QT, 6, 1) KQ_CASE(QT, 5, 1)           \
            KQ_CASE(QT, 4, 1) KQ_CASE(QT, 3, 1) KQ_CASE(QT, 2, 1)                            \
            default: kq_tile(xq, nb, w0, rb, QT, k, y0, ys, 1, 1);                           \
        }                                                                                    \
    }

/* R rows of x (1..8) by C rows of W (4 with R <= 2; else 2 or 1). */
static void kq_run_tile(const xq_block *xq, int64_t nb, const uint8_t *w0, int64_t rb, int qt,
                        const kq_consts *k, float *y0, int64_t ys, int R, int C) {
    switch (qt) {
        case Q4_K: KQ_TILES(Q4_K) break;
        case Q5_K: KQ_TILES(Q5_K) break;
        case Q6_K: KQ_TILES(Q6_K) break;
        default: /* Q8_0: two rows of W at most (its unpacked blocks take 12 registers) */
            for (int c = 0; c < C; c += 2) {
                const int cc = C - c >= 2 ? 2 : 1;
                switch (R * 2 + cc) {
#define KQ8_CASE(RR, CC)                                                                     \
    case RR * 2 + CC: kq8_tile(xq, nb, w0 + c * rb, rb, y0 + c, ys, RR, CC); break;
                    KQ8_CASE(8, 2) KQ8_CASE(7, 2) KQ8_CASE(6, 2) KQ8_CASE(5, 2) KQ8_CASE(4, 2)
                    KQ8_CASE(3, 2) KQ8_CASE(2, 2) KQ8_CASE(1, 2) KQ8_CASE(8, 1) KQ8_CASE(7, 1)
                    KQ8_CASE(6, 1) KQ8_CASE(5, 1) KQ8_CASE(4, 1) KQ8_CASE(3, 1) KQ8_CASE(2, 1)
                    default: kq8_tile(xq, nb, w0 + c * rb, rb, y0 + c, ys, 1, 1);
#undef KQ8_CASE
                }
            }
    }
}

/* R rows of x from r0 (relative to xq) by the cols (<= KQ_C) rows of W from w0. */
static void kq_rows_by_tile(const xq_block *xq, int64_t nb, const uint8_t *w0, int64_t rb,
                            int qt, const kq_consts *k, float *y0, int64_t ys, int R,
                            int64_t cols) {
    if (R <= 2 && cols == KQ_C) {
        kq_run_tile(xq, nb, w0, rb, qt, k, y0, ys, R, KQ_C);
        return;
    }
    for (int64_t c = 0; c < cols; c += 2) {
        const int C = cols - c >= 2 ? 2 : 1;
        kq_run_tile(xq, nb, w0 + c * rb, rb, qt, k, y0 + c, ys, R, C);
    }
}
#else
#define KQ_R 8
#define KQ_C 4
#endif

#define KQ_CHUNK 64 /* rows of x quantized at a time (the thread's scratch) */

/* Bytes of per-thread scratch kq_part needs for M rows of K values. */
static int64_t kq_scratch_bytes(int64_t M, int64_t K) {
    const int64_t rows = M < KQ_CHUNK ? M : KQ_CHUNK;
    return rows * (K / QK) * (int64_t)sizeof(xq_block);
}

/* Thread tid's share (of nth) of y = x @ W^T for a K-quant W: every thread quantizes each
 * chunk of x's rows into its own scratch (xq, kq_scratch_bytes, 64-byte aligned), then runs
 * its own tiles of W's rows (split statically, so each thread reads its rows of W once per
 * chunk). No barrier. */
static void kq_part(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                    int64_t N, int qt, float *y, int64_t ys, xq_block *xq, int tid, int nth) {
    const int64_t nb = K / QK, rb = nb * kq_block_bytes(qt);
    int64_t t0, t1;
    tr_split((N + KQ_C - 1) / KQ_C, tid, nth, &t0, &t1);
    if (t0 >= t1) return;
#ifdef TR_KQ_VNNI
    kq_consts k;
    kq_consts_init(&k);
#endif
    for (int64_t m0 = 0; m0 < M; m0 += KQ_CHUNK) {
        const int64_t m1 = m0 + KQ_CHUNK < M ? m0 + KQ_CHUNK : M;
        if (qt == KQ_Q8_0)
            kq_quantize_rows_u8(x + m0 * xs, m1 - m0, K, xs, xq);
        else
            kq_quantize_rows(x + m0 * xs, m1 - m0, K, xs, xq);
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n0 = t * KQ_C;
            const int64_t cols = N - n0 < KQ_C ? N - n0 : KQ_C;
#ifdef TR_KQ_VNNI
            for (int64_t r0 = m0; r0 < m1; r0 += KQ_R) {
                const int R = (int)(m1 - r0 < KQ_R ? m1 - r0 : KQ_R);
                kq_rows_by_tile(xq + (r0 - m0) * nb, nb, w + n0 * rb, rb, qt, &k,
                                y + r0 * ys + n0, ys, R, cols);
            }
#else
            kq_block_portable(xq, nb, w, rb, qt, y + m0 * ys, ys, 0, m1 - m0, n0, n0 + cols);
#endif
        }
    }
}
