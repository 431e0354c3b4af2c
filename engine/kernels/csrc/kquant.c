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
 * sum is exact; it is scaled into fp32 accumulators in super-block order (the AVX-512
 * tiles add Q4_K / Q5_K's mins there too, as fp32 products of the 16-sums in x's units
 * and -dmin times each min: one fused multiply-add a row instead of integer ops). Row r of y
 * therefore depends only on row r of x, never on what else is in the batch or how the
 * rows are tiled (a sequence's logits do not change with its neighbours).
 *
 * With AVX512-VNNI, Q4_K matrices whose rows come in 16s may also be repacked once
 * (kquant_x16.c, type KQ_Q4_KX): 16 rows per vector, the same sums, fewer instructions.
 *
 * x's int8 values are stored in "pair order": within each 128, [0..31, 64..95, 32..63,
 * 96..127], so that one 64-byte load matches one load of Q4_K/Q5_K nibbles (and, with a
 * broadcast and shifts, of Q6_K's). The tiles: kquant_avx512.c with AVX512-VNNI/BW/VL,
 * kquant_avx2.c with AVX2 (AVX-VNNI where there), else portable C; all compute the same
 * integer sums.
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TR_KQ_AVX2 1
#include <immintrin.h>
#endif


/* One row's 256 values of x, quantized. 448 bytes: rows of blocks stay 64-byte aligned. */
typedef struct {
    int8_t q[QK];  /* pair order (see above) */
    float xs[16];   /* d * bs[i]: the 16-sums in x's units (the AVX-512 tiles' side term) */
    float qs32[8];  /* sum of q over stored positions 32c..32c+31 (kquant_x16.c) */
    int16_t bs[16]; /* sum of q over natural positions 16i..16i+15 */
    float d;
    uint8_t pad[60];
} xq_block;

static inline int is_kquant(int qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }

#define KQ_Q8_0 8 /* ggml's Q8_0: fp16 d, 32 int8 q; 8 blocks per 256 values of x */
#define KQ_Q4_KX 112 /* Q4_K repacked 16 rows at a time (kquant_x16.c, AVX512-VNNI only) */

/* Whether kq_part multiplies qt at this K: the K-quants always; Q8_0 where the int8 dot
 * products are there and K is whole 256-blocks of x (else quant_matmul.c's fp32 path). */
static inline int kq_takes(int qt, int64_t K) {
#ifdef TR_KQ_VNNI
    if (qt == KQ_Q8_0) return K % QK == 0;
    if (qt == KQ_Q4_KX) return 1;
#endif
    (void)K;
    return is_kquant(qt);
}

/* Bytes of W per 256 weights of a row. */
static inline int kq_block_bytes(int qt) {
    return qt == Q4_K || qt == KQ_Q4_KX ? 144 : qt == Q5_K ? 176 : qt == Q6_K ? 210 : 8 * 34;
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

#if defined(TR_KQ_VNNI) || defined(TR_KQ_AVX2)
/* kq_scales_mins of the Q4_K / Q5_K super-block at b, in SIMD (no store-to-load round trip
 * per super-block): u32 lanes [a, b, c, -] of the 12 bytes -> [a & six, (c & low4) |
 * ((a >> 6) & two) << 4, b & six, ((c >> 4) & low4) | ((b >> 6) & two) << 4]. */
static inline __m128i kq_scales_mins_simd(const uint8_t *b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4)); /* 16 bytes: inside the block */
    const __m128i acbc = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i low = _mm_and_si128(acbc, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f,
                                                           0x0f0f0f0f));
    const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2),
                                      _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, top);
}
#endif

/* The natural sub-block (32 values) of a block's stored chunk c: pair order swaps the
 * middle two of each 4. */
static inline int kq_chunk_sub(int c) { return (c & 4) | (c & 1) << 1 | (c & 2) >> 1; }

/* qs32 of a quantized block from its 16-sums (sub-block j is 16-groups 2j and 2j + 1). */
static inline void kq_chunk_sums(xq_block *o) {
    for (int c = 0; c < 8; c++) {
        const int j = kq_chunk_sub(c);
        o->qs32[c] = (float)(o->bs[2 * j] + o->bs[2 * j + 1]);
    }
}

/* 256 values v as int8: q[i] = round(v[i] / d) (to nearest even, as the AVX-512 conversion
 * does), d = max|v| / 127 (returned; 0 for a block of zeros). */
static inline float kq_quantize_block(const float *v, int q[QK]) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < QK; i++) {
        const int n = (int)nearbyintf(v[i] * id);
        q[i] = n > 127 ? 127 : n < -127 ? -127 : n;
    }
    return amax / 127.0f;
}

/* Quantize rows [0, M) of x (K values each, rows xs floats apart) into xq (K / 256 blocks a
 * row). For the K-quants: pair order and the sums of each 16. For Q8_0 (u8): natural order
 * as unsigned bytes q + 128 (vpdpbusd's unsigned side; the 128 comes off per block of W). */
#ifdef TR_KQ_VNNI
/* kq_quantize_block and the K-quant layout of one block, 16 values at a time: the same
 * bytes (max is exact, the product rounds the same, cvtps2dq rounds to nearest even as
 * nearbyintf does in the default rounding mode). */
static inline void kq_quantize_block512(const float *v, xq_block *o, int u8) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < QK; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 id = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    o->d = m / 127.0f;
    for (int g = 0; g < 16; g++) {
        __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * g), id));
        n = _mm512_max_epi32(_mm512_min_epi32(n, hi), lo);
        if (u8) {
            _mm_storeu_si128((__m128i *)((uint8_t *)o->q + 16 * g),
                             _mm512_cvtepi32_epi8(_mm512_add_epi32(n, _mm512_set1_epi32(128))));
            continue;
        }
        _mm_storeu_si128((__m128i *)(o->q + kq_pair_pos(16 * g)), _mm512_cvtsepi32_epi8(n));
        o->bs[g] = (int16_t)_mm512_reduce_add_epi32(n);
        o->xs[g] = o->d * (float)o->bs[g];
    }
    if (!u8) kq_chunk_sums(o);
}
#endif

static void kq_quantize_rows(const float *x, int64_t M, int64_t K, int64_t xs, xq_block *xq,
                             int u8) {
    const int64_t nb = K / QK;
    int q[QK];
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            xq_block *o = xq + r * nb + b;
#ifdef TR_KQ_VNNI
            kq_quantize_block512(x + r * xs + b * QK, o, u8);
            continue;
#endif
            o->d = kq_quantize_block(x + r * xs + b * QK, q);
            if (u8) {
                for (int i = 0; i < QK; i++) ((uint8_t *)o->q)[i] = (uint8_t)(q[i] + 128);
                continue;
            }
            for (int g = 0; g < 16; g++) {
                int sum = 0;
                for (int i = 16 * g; i < 16 * g + 16; i++) {
                    o->q[kq_pair_pos(i)] = (int8_t)q[i];
                    sum += q[i];
                }
                o->bs[g] = (int16_t)sum;
                o->xs[g] = o->d * (float)sum;
            }
            kq_chunk_sums(o);
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
static __attribute__((unused)) void kq_block_portable(const xq_block *xq, int64_t nb,
                                                      const uint8_t *w, int64_t rb, int qt,
                                                      float *y, int64_t ys, int64_t r0,
                                                      int64_t r1, int64_t c0, int64_t c1) {
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

#if defined(TR_KQ_VNNI)
#include "kquant_avx512.c"
#include "kquant_x16.c"
#elif defined(TR_KQ_AVX2)
#include "kquant_avx2.c"
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

/* Tiles t0..t1 (KQ_C rows of W each) of y's rows m0..m1, x's rows quantized in xq. */
static inline void kq_tiles(const xq_block *xq, int64_t m0, int64_t m1, int64_t nb, int64_t rb,
                            const uint8_t *w, int64_t N, int qt, float *y, int64_t ys,
                            int64_t t0, int64_t t1, const void *consts) {
#ifdef TR_KQ_VNNI
    if (qt == KQ_Q4_KX) {
        kqx_tiles(xq, m0, m1, nb, w, y, ys, t0, t1);
        return;
    }
#endif
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n0 = t * KQ_C;
        const int64_t cols = N - n0 < KQ_C ? N - n0 : KQ_C;
#if defined(TR_KQ_VNNI) || defined(TR_KQ_AVX2)
        for (int64_t r0 = m0; r0 < m1; r0 += KQ_R) {
            const int R = (int)(m1 - r0 < KQ_R ? m1 - r0 : KQ_R);
            kq_rows_by_tile(xq + (r0 - m0) * nb, nb, w + n0 * rb, rb, qt,
                            (const kq_consts *)consts, y + r0 * ys + n0, ys, R, (int)cols);
        }
#else
        (void)consts;
        kq_block_portable(xq, nb, w, rb, qt, y + m0 * ys, ys, 0, m1 - m0, n0, n0 + cols);
#endif
    }
}

#define KQ_GRAIN 32 /* tiles a thread claims at a time from a shared counter */

/* Thread tid's share (of nth) of y = x @ W^T for a K-quant W. Each chunk of x's rows is
 * quantized into the thread's own scratch (xq, kq_scratch_bytes, 64-byte aligned), then
 * multiplied by tiles of W's rows. Without a counter (next NULL) the tiles are split
 * statically; with one (zero before the first thread starts), threads claim KQ_GRAIN tiles
 * at a time in (chunk, tile) order, so a thread the OS stalls holds up no other (a thread
 * quantizes a chunk when it first claims tiles in it). Either way each element of y comes
 * from one tile computed the same way: the result does not depend on who ran it. No
 * barrier. */
static void kq_part(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w,
                    int64_t N, int qt, float *y, int64_t ys, xq_block *xq, int tid, int nth,
                    int64_t *next) {
    const int64_t nb = K / QK, rb = nb * kq_block_bytes(qt);
    const int64_t tiles = qt == KQ_Q4_KX ? N / 16 : (N + KQ_C - 1) / KQ_C;
#if defined(TR_KQ_VNNI) || defined(TR_KQ_AVX2)
    kq_consts k;
    kq_consts_init(&k);
    const void *consts = &k;
#else
    const void *consts = NULL;
#endif
    if (next == NULL) {
        int64_t t0, t1;
        tr_split(tiles, tid, nth, &t0, &t1);
        if (t0 >= t1) return;
        for (int64_t m0 = 0; m0 < M; m0 += KQ_CHUNK) {
            const int64_t m1 = m0 + KQ_CHUNK < M ? m0 + KQ_CHUNK : M;
            kq_quantize_rows(x + m0 * xs, m1 - m0, K, xs, xq, qt == KQ_Q8_0);
            kq_tiles(xq, m0, m1, nb, rb, w, N, qt, y, ys, t0, t1, consts);
        }
        return;
    }
    const int64_t grains = (tiles + KQ_GRAIN - 1) / KQ_GRAIN;
    const int64_t units = (M + KQ_CHUNK - 1) / KQ_CHUNK * grains;
    int64_t have = -1; /* the chunk quantized in xq */
    for (int64_t u; (u = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < units;) {
        const int64_t chunk = u / grains, t0 = u % grains * KQ_GRAIN;
        const int64_t m0 = chunk * KQ_CHUNK, m1 = m0 + KQ_CHUNK < M ? m0 + KQ_CHUNK : M;
        if (chunk != have) {
            kq_quantize_rows(x + m0 * xs, m1 - m0, K, xs, xq, qt == KQ_Q8_0);
            have = chunk;
        }
        const int64_t t1 = t0 + KQ_GRAIN < tiles ? t0 + KQ_GRAIN : tiles;
        kq_tiles(xq, m0, m1, nb, rb, w, N, qt, y, ys, t0, t1, consts);
    }
    (void)tid, (void)nth;
}
