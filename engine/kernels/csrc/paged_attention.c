/* Paged decode attention for CPUs, fp32 math: one query token per sequence, K and V read
 * straight out of the block pool (no gather), each KV head's rows read once from memory
 * for all the query heads that share it (GQA).
 *
 * Layouts (row-major):
 *   q               [T, H, D] with rows `q_row_stride` floats apart (a view of the fused
 *                   q/k/v projection); only the rows listed in `rows` are read
 *   out             [T, H, D] contiguous; only the rows listed in `rows` are written
 *   k_cache/v_cache [num_blocks, block_size, Hkv, D], fp32 or IEEE fp16 (kv_f16); fp16
 *                   elements are converted to fp32 as they are read, and all arithmetic
 *                   is fp32 either way
 *   block_tables    [B, bt_stride] int32 block ids of each sequence, in order
 *   rows[i]         the q/out row of decode sequence i; seqs[i] its row in block_tables
 *   ctx_lens[s]     tokens of sequence s in the cache, this step's included
 *   row_lens[i]     if not NULL: the tokens row i attends to instead (its position + 1),
 *                   so every token of a prefill chunk is a row that sees its causal prefix
 *   window          if > 0: a row sees only the last `window` of its tokens (a sliding-window
 *                   layer); the blocks before them are not read
 *   softcap         if > 0: each score s (scale applied) becomes softcap * tanh(s / softcap)
 *                   before the softmax (Gemma 2); the prefill tiles compute tanh from the
 *                   same exp as their softmax (tanh |s| = (1 - e) / (1 + e), e = exp(-2|s|))
 *
 * Work is split over (sequence, run of `heads_per_task` KV heads), the tasks taken by the
 * OpenMP threads one at a time (pa_part, which the fused decoder step also calls). A task
 * covering all KV heads reads each block as one contiguous run of memory; splitting heads
 * only pays when there are fewer sequences than threads. The OpenMP runtime is the one
 * PyTorch already loaded (same soname), so torch.set_num_threads applies here too.
 *
 * Per block (block_size tokens, a few KB, in L1 once touched): scores for every query
 * row, then after an exact softmax (max-subtracted) the weighted sum of V. With AVX2 the
 * inner loops are written with intrinsics (scores for D a multiple of 8, values for D a
 * multiple of 64); other shapes take the portable loops. Both give the same result up to
 * float rounding order.
 *
 * fp16 K/V: the decode path reads them in its loops (F16C's vcvtph2ps beside each load),
 * one copy of those loops per element type (PA_INLINE with a constant f16 argument); the
 * prefill tiles convert each key/value sub-tile once into their scratch, then run their
 * fp32 loops on it. Without F16C or AVX-512 a portable scalar conversion does it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TR_AVX2 1
#endif

/* Inlined into each caller: a caller that passes a constant f16 gets a copy of the loops
 * for that element type, with no branch on the type inside them. */
#define PA_INLINE static inline __attribute__((always_inline))

/* IEEE binary16 -> float, exactly. */
static inline float tr_h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    uint32_t bits;
    if (em >= 0x7c00u) { /* inf, nan */
        bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) { /* normal: rebias the exponent (127 - 15) */
        bits = sign | ((em << 13) + 0x38000000u);
    } else { /* zero or subnormal: em * 2^-24, exact in a float */
        const float f = (float)em * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float -> IEEE binary16, rounded to nearest even (overflow to inf, nan stays nan). */
static inline uint16_t tr_f2h(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    uint16_t o;
    if (x >= 0x47800000u) { /* 2^16 and up: inf; nan stays a (quiet) nan */
        o = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x < 0x38800000u) { /* below 2^-14: a subnormal half or zero */
        /* adding 0.5 puts the 10 bits that remain at the bottom of the mantissa, rounded
         * to nearest even by the addition itself */
        float g;
        memcpy(&g, &x, sizeof g);
        g += 0.5f;
        uint32_t y;
        memcpy(&y, &g, sizeof y);
        o = (uint16_t)(y - 0x3f000000u);
    } else { /* normal: rebias, round half to even on the 13 bits dropped */
        const uint32_t odd = (x >> 13) & 1u;
        x += 0xc8000fffu + odd; /* (15 - 127) << 23, mod 2^32, + 0xfff */
        o = (uint16_t)(x >> 13);
    }
    return sign | o;
#endif
}

/* dst[i] = fp16(src[i]), rounded to nearest even. */
static inline void tr_f32_to_f16(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = tr_f2h(src[i]);
}

/* dst[i] = src[i] as floats. */
static inline void tr_f16_to_f32(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = tr_h2f(src[i]);
}

/* Element i of a K/V pool of fp16 (f16) or fp32 elements, as a float. */
PA_INLINE float kv_load1(const void *p, int64_t i, int f16) {
    return f16 ? tr_h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The address of element i of a pool of fp16 (f16) or fp32 elements. */
PA_INLINE const void *kv_at(const void *p, int64_t i, int f16) {
    return (const char *)p + i * (f16 ? 2 : 4);
}

#ifdef TR_AVX2
/* Elements i..i+7 as floats. */
PA_INLINE __m256 kv_load8(const void *p, int64_t i, int f16) {
    if (!f16) return _mm256_loadu_ps((const float *)p + i);
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    const uint16_t *h = (const uint16_t *)p + i;
    return _mm256_setr_ps(tr_h2f(h[0]), tr_h2f(h[1]), tr_h2f(h[2]), tr_h2f(h[3]),
                          tr_h2f(h[4]), tr_h2f(h[5]), tr_h2f(h[6]), tr_h2f(h[7]));
#endif
}
#endif

/* Ask for one token's rows of the next block while this block is read: a sequence's
 * blocks are scattered over the pool, so the hardware prefetchers cannot guess them. */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

#ifdef TR_AVX2
/* e^x for x <= 0, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor
 * polynomial (Cephes' coefficients), 2^n through the exponent bits. Within 2 ulp of
 * expf; lanes below -87.3 (underflow) give 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

/* s[t] = e^(s[t] - max s) in place; returns the sum. */
static float exp_shifted(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    int64_t t = 0;
#ifdef TR_AVX2
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) sum += lanes[k];
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}

typedef struct {
    int64_t D, G, hp, h0, tok_stride, L;
    float scale;
} task_shape;

/* scores[r, t0 + o] = scale * q_r . k_o for the `end` tokens of one block (kb: its first
 * element, fp16 or fp32 as f16 says). */
PA_INLINE void block_scores(const task_shape *s, const float *qh, const void *kb, int64_t end,
                            int64_t t0, float *scores, int f16) {
    const int64_t D = s->D, G = s->G;
    for (int64_t h = 0; h < s->hp; h++) {
        const void *kh = kv_at(kb, (s->h0 + h) * D, f16);
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = h * G + g;
            const float *qr = qh + r * D;
            float *out = scores + r * s->L + t0;
            int64_t o = 0;
#ifdef TR_AVX2
            if (D % 8 == 0) {
                for (; o + 8 <= end; o += 8) { /* 8 tokens at once, one sum per lane */
                    __m256 a[8];
                    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < D; c += 8) {
                        const __m256 qc = _mm256_loadu_ps(qr + c);
                        for (int j = 0; j < 8; j++)
                            a[j] = _mm256_fmadd_ps(
                                qc, kv_load8(kh, (o + j) * s->tok_stride + c, f16), a[j]);
                    }
                    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                                     _mm256_hadd_ps(a[2], a[3]));
                    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]),
                                                     _mm256_hadd_ps(a[6], a[7]));
                    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                     _mm256_permute2f128_ps(u0, u1, 0x31));
                    _mm256_storeu_ps(out + o, _mm256_mul_ps(sum, _mm256_set1_ps(s->scale)));
                }
            }
#endif
            for (; o < end; o++) {
                const void *kt = kv_at(kh, o * s->tok_stride, f16);
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qr[d] * kv_load1(kt, d, f16);
                out[o] = acc * s->scale;
            }
        }
    }
}

/* acc[r] += sum_o p[r, t0 + o] * v_o for the `end` tokens of one block (vb as kb above). */
PA_INLINE void block_values(const task_shape *s, const void *vb, int64_t end, int64_t t0,
                            const float *probs, float *acc, int f16) {
    const int64_t D = s->D, G = s->G;
    for (int64_t h = 0; h < s->hp; h++) {
        const void *vh = kv_at(vb, (s->h0 + h) * D, f16);
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = h * G + g;
            const float *p = probs + r * s->L + t0;
            float *ar = acc + r * D;
#ifdef TR_AVX2
            if (D % 64 == 0) {
                for (int64_t c = 0; c < D; c += 64) { /* 64 floats of acc held in registers */
                    __m256 a[8];
                    for (int k = 0; k < 8; k++) a[k] = _mm256_loadu_ps(ar + c + 8 * k);
                    for (int64_t o = 0; o < end; o++) {
                        const __m256 po = _mm256_broadcast_ss(p + o);
                        const int64_t vt = o * s->tok_stride + c;
                        for (int k = 0; k < 8; k++)
                            a[k] = _mm256_fmadd_ps(po, kv_load8(vh, vt + 8 * k, f16), a[k]);
                    }
                    for (int k = 0; k < 8; k++) _mm256_storeu_ps(ar + c + 8 * k, a[k]);
                }
                continue;
            }
#endif
            for (int64_t o = 0; o < end; o++) {
                const void *vt = kv_at(vh, o * s->tok_stride, f16);
                const float po = p[o];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ar[d] += po * kv_load1(vt, d, f16);
            }
        }
    }
}

/* One call's arguments (see the layouts at the top). */
typedef struct {
    const float *q;
    int64_t q_row_stride;
    float *out;
    const void *k_cache, *v_cache; /* fp32, or fp16 where kv_f16 */
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *ctx_lens;
    const int64_t *rows, *seqs;
    const int32_t *row_lens;
    int64_t n, num_heads, num_kv_heads, head_dim, block_size, heads_per_task;
    float scale;
    /* runs of rows attended as one tile (pa_make_groups): group g is rows [starts[g],
     * starts[g + 1]); NULL: every row alone */
    const int64_t *group_starts;
    int64_t groups;
    int64_t kv_f16; /* 1: the caches hold IEEE fp16 elements; 0: fp32 */
    int64_t window; /* > 0: the last `window` tokens only (the fused decoder leaves 0) */
    float softcap;  /* > 0: soft-capped scores */
} pa_args;

/* One thread's scratch: scores [R, cap] (grown on demand), acc [R, D] then inv_sum [R]. */
typedef struct {
    float *scores;
    int64_t cap;
    float *acc;
    float *tile; /* the tiled path's: acc [QT G, D], m, l [QT G], kt [D, TT], s [QT G, TT] */
    float *stage; /* the tiled path's fp16 sub-tiles as floats: K [TT, D], then V [TT, D] */
} pa_scratch;

static int64_t pa_tasks(const pa_args *a) {
    const int64_t units = a->group_starts != NULL ? a->groups : a->n;
    return units * (a->num_kv_heads / a->heads_per_task);
}

#define PA_QT 16 /* query tokens (rows of one sequence) per tile */
#define PA_TT 16 /* key tokens per score sub-tile */

/* Split rows 0..n-1 into runs attended together: consecutive rows of one sequence at
 * consecutive positions (a prefill chunk), at most PA_QT each. starts gets n + 1 entries at
 * most; returns the number of groups. */
static int64_t pa_make_groups(const pa_args *a, int64_t *starts) {
    int64_t g = 0;
    for (int64_t i = 0; i < a->n; i++) {
        const int joins = i > 0 && a->row_lens != NULL && a->seqs[i] == a->seqs[i - 1] &&
                          a->row_lens[i] == a->row_lens[i - 1] + 1 && i - starts[g - 1] < PA_QT;
        if (!joins) starts[g++] = i;
    }
    starts[g] = a->n;
    return g;
}

/* R = heads_per_task * G query rows per task. Returns 0, or -1 without memory. */
static int pa_scratch_init(pa_scratch *s, const pa_args *a) {
    const int64_t R = a->heads_per_task * (a->num_heads / a->num_kv_heads);
    const int64_t RG = PA_QT * (a->num_heads / a->num_kv_heads), D = a->head_dim;
    s->scores = NULL;
    s->cap = 0;
    s->acc = (float *)malloc(sizeof(float) * R * (a->head_dim + 1));
    s->tile = NULL;
    s->stage = NULL;
    if (a->group_starts != NULL) {
        const int64_t RGp = (RG + 15) / 16 * 16; /* the AVX-512 path's rows, lane-padded */
        const size_t floats = (size_t)(2 * RGp * D + 5 * RGp + 2 * PA_TT * RGp + D * PA_TT);
        s->tile = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (s->tile == NULL) return -1;
        if (a->kv_f16) {
            s->stage = (float *)aligned_alloc(64, (2 * PA_TT * D * sizeof(float) + 63) / 64 * 64);
            if (s->stage == NULL) return -1;
        }
    }
    return s->acc == NULL ? -1 : 0;
}

static void pa_scratch_free(pa_scratch *s) {
    free(s->scores);
    free(s->acc);
    free(s->tile);
    free(s->stage);
}

/* One task: decode row i's run of heads_per_task KV heads, the caches' elements fp16 (f16)
 * or fp32. Returns -1 without memory. */
PA_INLINE int pa_task_kv(const pa_args *a, pa_scratch *sc, int64_t task, int f16) {
    const int64_t G = a->num_heads / a->num_kv_heads; /* query heads per KV head */
    const int64_t D = a->head_dim, hp = a->heads_per_task, bs = a->block_size;
    const int64_t row_stride = a->num_heads * D;    /* out */
    const int64_t tok_stride = a->num_kv_heads * D; /* one token's K (or V) in the pool */
    const int64_t block_stride = bs * tok_stride;
    const int64_t parts = a->num_kv_heads / hp;
    const int64_t R = hp * G; /* query rows per task */
    const int64_t es = f16 ? 2 : 4; /* bytes per element of the caches */
    const int64_t i = task / parts, h0 = (task % parts) * hp;
    const int64_t seq = a->seqs[i];
    const int64_t L = a->row_lens != NULL ? a->row_lens[i] : a->ctx_lens[seq];
    const int32_t *bt = a->block_tables + seq * a->bt_stride;
    const int64_t nb = (L + bs - 1) / bs;
    const float *qh = a->q + a->rows[i] * a->q_row_stride + h0 * G * D; /* [R, D] */
    const char *kc = a->k_cache, *vc = a->v_cache;
    const task_shape s = {D, G, hp, h0, tok_stride, L, a->scale};
    float *o = a->out + a->rows[i] * row_stride + h0 * G * D;
    if (L <= 0) { /* nothing to attend to (the caller never asks): zeros, not NaN */
        memset(o, 0, sizeof(float) * R * D);
        return 0;
    }
    if (L > sc->cap) {
        float *grown = (float *)realloc(sc->scores, sizeof(float) * R * L);
        if (grown == NULL) return -1;
        sc->scores = grown;
        sc->cap = L;
    }
    float *scores = sc->scores, *acc = sc->acc, *inv_sum = sc->acc + R * D;
    /* a window: tokens [lo, L) only, from the block holding lo (b0) on */
    const int64_t lo = a->window > 0 && L > a->window ? L - a->window : 0, b0 = lo / bs;
    for (int64_t b = b0; b < nb; b++) {
        const int64_t t0 = b * bs;
        const int64_t end = L - t0 < bs ? L - t0 : bs;
        const char *next = b + 1 < nb ? kc + (int64_t)bt[b + 1] * block_stride * es
                                      : vc + (int64_t)bt[b0] * block_stride * es;
        for (int64_t t = 0; t < bs; t++)
            prefetch_bytes(next + (t * tok_stride + h0 * D) * es, hp * D * es);
        block_scores(&s, qh, kc + (int64_t)bt[b] * block_stride * es, end, t0, scores, f16);
    }
    for (int64_t r = 0; r < R; r++) { /* softmax over t, per query row */
        float *sr = scores + r * L;
        for (int64_t t = b0 * bs; t < lo; t++) sr[t] = -INFINITY; /* before the window */
        if (a->softcap > 0.0f)
            for (int64_t t = lo; t < L; t++) sr[t] = a->softcap * tanhf(sr[t] / a->softcap);
        inv_sum[r] = 1.0f / exp_shifted(sr + b0 * bs, L - b0 * bs);
    }
    memset(acc, 0, sizeof(float) * R * D);
    for (int64_t b = b0; b < nb; b++) {
        const int64_t t0 = b * bs;
        const int64_t end = L - t0 < bs ? L - t0 : bs;
        if (b + 1 < nb)
            for (int64_t t = 0; t < bs; t++)
                prefetch_bytes(
                    vc + ((int64_t)bt[b + 1] * block_stride + t * tok_stride + h0 * D) * es,
                    hp * D * es);
        block_values(&s, vc + (int64_t)bt[b] * block_stride * es, end, t0, scores, acc, f16);
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) o[r * D + d] = acc[r * D + d] * inv_sum[r];
    return 0;
}

/* pa_task_kv for the caches' element type: a copy of its loops for each. */
static int pa_task(const pa_args *a, pa_scratch *sc, int64_t task) {
    return a->kv_f16 ? pa_task_kv(a, sc, task, 1) : pa_task_kv(a, sc, task, 0);
}

/* The key and value sub-tile of tt tokens (at most PA_TT) that starts at element `at` of the
 * caches, head h0's D elements of each token, as floats: fp32 caches are read in place
 * (*stride = tok_stride), fp16 ones converted into sc->stage first (*stride = D). */
static void pa_subtile(const pa_args *a, pa_scratch *sc, int64_t at, int64_t tt,
                       int64_t tok_stride, const float **kb, const float **vb, int64_t *stride) {
    const int64_t D = a->head_dim;
    if (!a->kv_f16) {
        *kb = (const float *)a->k_cache + at;
        *vb = (const float *)a->v_cache + at;
        *stride = tok_stride;
        return;
    }
    const uint16_t *k = (const uint16_t *)a->k_cache + at, *v = (const uint16_t *)a->v_cache + at;
    float *ks = sc->stage, *vs = sc->stage + PA_TT * D;
    for (int64_t j = 0; j < tt; j++) {
        tr_f16_to_f32(ks + j * D, k + j * tok_stride, D);
        tr_f16_to_f32(vs + j * D, v + j * tok_stride, D);
    }
    *kb = ks;
    *vb = vs;
    *stride = D;
}

#if defined(__AVX512F__)
/* e^x for x <= 0, 16 lanes (exp_nonpositive's polynomial); -inf gives 0. */
static inline __m512 exp512_nonpositive(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(y, _mm512_castsi512_ps(bits)));
}
#endif

/* s[rg, 0..tt) = scale * q_rg . k_j for query vectors q[rg] (rows of D) against the key
 * sub-tile kt [D, PA_TT] (token j in lane j); lanes >= tt are left to the caller's mask. */
static void pa_tile_scores(const float *const *q, int64_t RG, int64_t D, const float *kt,
                           float scale, float *s) {
#if defined(__AVX512F__)
    if (PA_TT == 16) {
        int64_t rg = 0;
        for (; rg + 4 <= RG; rg += 4) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d++) {
                const __m512 k = _mm512_load_ps(kt + d * PA_TT);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[rg][d]), k, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[rg + 1][d]), k, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(q[rg + 2][d]), k, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(q[rg + 3][d]), k, a3);
            }
            const __m512 sc = _mm512_set1_ps(scale);
            _mm512_store_ps(s + rg * PA_TT, _mm512_mul_ps(a0, sc));
            _mm512_store_ps(s + (rg + 1) * PA_TT, _mm512_mul_ps(a1, sc));
            _mm512_store_ps(s + (rg + 2) * PA_TT, _mm512_mul_ps(a2, sc));
            _mm512_store_ps(s + (rg + 3) * PA_TT, _mm512_mul_ps(a3, sc));
        }
        for (; rg < RG; rg++) {
            __m512 a0 = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++)
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[rg][d]), _mm512_load_ps(kt + d * PA_TT), a0);
            _mm512_store_ps(s + rg * PA_TT, _mm512_mul_ps(a0, _mm512_set1_ps(scale)));
        }
        return;
    }
#endif
    for (int64_t rg = 0; rg < RG; rg++) {
        float acc[PA_TT] = {0};
        for (int64_t d = 0; d < D; d++) {
            const float qd = q[rg][d];
#pragma omp simd
            for (int64_t j = 0; j < PA_TT; j++) acc[j] += qd * kt[d * PA_TT + j];
        }
        for (int64_t j = 0; j < PA_TT; j++) s[rg * PA_TT + j] = acc[j] * scale;
    }
}

/* acc[D] += sum_j p[j] v_j for the tt tokens of a sub-tile (v_j `stride` floats apart). */
static inline void pa_tile_values(float *acc, const float *p, const float *v, int64_t tt,
                                  int64_t stride, int64_t D) {
#if defined(__AVX512F__)
    if (D == 64) {
        __m512 a0 = _mm512_loadu_ps(acc), a1 = _mm512_loadu_ps(acc + 16);
        __m512 a2 = _mm512_loadu_ps(acc + 32), a3 = _mm512_loadu_ps(acc + 48);
        for (int64_t j = 0; j < tt; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            const float *vj = v + j * stride;
            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 48), a3);
        }
        _mm512_storeu_ps(acc, a0);
        _mm512_storeu_ps(acc + 16, a1);
        _mm512_storeu_ps(acc + 32, a2);
        _mm512_storeu_ps(acc + 48, a3);
        return;
    }
#endif
    for (int64_t j = 0; j < tt; j++) {
        const float pj = p[j];
        const float *vj = v + j * stride;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[d] += pj * vj[d];
    }
}

/* The rows [i0, i0 + n) of one sequence at consecutive positions (a prefill chunk), KV heads
 * [h0, h0 + hp): each key/value sub-tile is read once for all n * G query vectors of a head,
 * with an online softmax (running max and sum, the partial output rescaled as the max
 * grows). A row's result depends only on its own query and length, not on its tile. */
static void pa_tile_task(const pa_args *a, pa_scratch *sc, int64_t i0, int64_t n, int64_t h0,
                         int64_t hp) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim, bs = a->block_size;
    const int64_t tok_stride = a->num_kv_heads * D, block_stride = bs * tok_stride;
    const int64_t RG = n * G, seq = a->seqs[i0];
    const int32_t *bt = a->block_tables + seq * a->bt_stride;
    float *acc = sc->tile, *m = acc + PA_QT * G * D, *l = m + PA_QT * G;
    float *kt = l + PA_QT * G, *s = kt + D * PA_TT; /* kt, s: 64-byte aligned (D * 4 bytes) */
    const float *q[PA_QT * 16];
    int64_t len[PA_QT * 16], lo[PA_QT * 16]; /* each row attends to tokens [lo, len) */
    const float cap = a->softcap;
    for (int64_t h = h0; h < h0 + hp; h++) {
        int64_t most = 0, least = INT64_MAX;
        for (int64_t rg = 0; rg < RG; rg++) {
            const int64_t i = i0 + rg / G;
            q[rg] = a->q + a->rows[i] * a->q_row_stride + (h * G + rg % G) * D;
            len[rg] = a->row_lens[i];
            lo[rg] = a->window > 0 && len[rg] > a->window ? len[rg] - a->window : 0;
            most = len[rg] > most ? len[rg] : most;
            least = lo[rg] < least ? lo[rg] : least;
            m[rg] = -INFINITY;
            l[rg] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * RG * D);
        for (int64_t t0 = least; t0 < most;) {
            const int64_t off = t0 % bs, left = most - t0;
            int64_t tt = bs - off < PA_TT ? bs - off : PA_TT;
            tt = left < tt ? left : tt;
            const float *kb, *vb;
            int64_t ts; /* floats from one token's row to the next in kb, vb */
            pa_subtile(a, sc, (int64_t)bt[t0 / bs] * block_stride + off * tok_stride + h * D, tt,
                       tok_stride, &kb, &vb, &ts);
            for (int64_t d = 0; d < D; d++) /* K^T of the sub-tile, zero-padded */
                for (int64_t j = 0; j < PA_TT; j++)
                    kt[d * PA_TT + j] = j < tt ? kb[j * ts + d] : 0.0f;
            pa_tile_scores(q, RG, D, kt, a->scale, s);
            for (int64_t rg = 0; rg < RG; rg++) {
                const int64_t valid = len[rg] - t0 < tt ? len[rg] - t0 : tt;
                const int64_t first = lo[rg] > t0 ? lo[rg] - t0 : 0; /* the window's start */
                if (valid <= first) continue; /* this row sees none of the sub-tile */
                float *sr = s + rg * PA_TT, mx = m[rg];
                for (int64_t j = 0; j < first; j++) sr[j] = -INFINITY;
                if (cap > 0.0f)
                    for (int64_t j = first; j < valid; j++) sr[j] = cap * tanhf(sr[j] / cap);
                for (int64_t j = first; j < valid; j++) mx = sr[j] > mx ? sr[j] : mx;
                const float c = expf(m[rg] - mx); /* 0 at the first sub-tile (m = -inf) */
                float sum = 0.0f;
#if defined(__AVX512F__)
                if (PA_TT == 16) {
                    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
                    const __m512 e = exp512_nonpositive(
                        _mm512_sub_ps(_mm512_load_ps(sr), _mm512_set1_ps(mx)));
                    const __m512 p = _mm512_maskz_mov_ps(keep, e);
                    _mm512_store_ps(sr, p);
                    sum = _mm512_reduce_add_ps(p);
                } else
#endif
                {
                    for (int64_t j = 0; j < valid; j++) {
                        sr[j] = expf(sr[j] - mx);
                        sum += sr[j];
                    }
                }
                float *ar = acc + rg * D;
                if (c != 1.0f)
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ar[d] *= c;
                l[rg] = l[rg] * c + sum;
                m[rg] = mx;
                pa_tile_values(ar, sr, vb, valid, ts, D);
            }
            t0 += tt;
        }
        for (int64_t rg = 0; rg < RG; rg++) {
            const int64_t i = i0 + rg / G;
            float *o = a->out + a->rows[i] * a->num_heads * D + (h * G + rg % G) * D;
            const float inv = 1.0f / l[rg];
            for (int64_t d = 0; d < D; d++) o[d] = acc[rg * D + d] * inv;
        }
    }
}

#if defined(__AVX512F__)
/* cap * tanh(s / cap), 16 lanes: tanh |x| = (1 - e) / (1 + e) with e = exp(-2 |x|) <= 1 (no
 * overflow), the sign of x put back. */
static inline __m512 softcap512(__m512 s, float cap) {
    const __m512 x = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / cap));
    const __m512 e = exp512_nonpositive(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(_mm512_mask_sub_ps(t, neg, _mm512_setzero_ps(), t),
                         _mm512_set1_ps(cap));
}

/* pa_tile_task with the query rows across the vector lanes (D a multiple of 16): Q^T [D, RGp]
 * once per head, scores S[t][rows] = sum_d Q^T[d] * k_t[d] straight from the pool's rows (no
 * transpose of K), the online softmax 16 rows at a time, then acc[row] += p * v_t. Each row
 * sees the same operations in the same order as in any other tile. */
static void pa_tile_task512(const pa_args *a, pa_scratch *sc, int64_t i0, int64_t n, int64_t h0,
                            int64_t hp) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim, bs = a->block_size;
    const int64_t tok_stride = a->num_kv_heads * D, block_stride = bs * tok_stride;
    const int64_t RG = n * G, RGp = (RG + 15) / 16 * 16, nv = RGp / 16, seq = a->seqs[i0];
    const int32_t *bt = a->block_tables + seq * a->bt_stride;
    float *acc = sc->tile, *qt = acc + RGp * D, *m = qt + RGp * D, *l = m + RGp;
    float *c = l + RGp, *sp = c + 3 * RGp; /* sp: scores, then probabilities [TT][RGp] */
    int32_t *len = (int32_t *)(c + RGp), *lo = (int32_t *)(c + 2 * RGp); /* [lo, len) */
    const __m512 scale = _mm512_set1_ps(a->scale), ninf = _mm512_set1_ps(-INFINITY);
    const float cap = a->softcap;
    for (int64_t h = h0; h < h0 + hp; h++) {
        int32_t most = 0, least = INT32_MAX;
        for (int64_t rg = 0; rg < RGp; rg++) {
            const int64_t i = i0 + rg / G;
            len[rg] = rg < RG ? a->row_lens[i] : 0; /* padding rows: never valid */
            lo[rg] = a->window > 0 && len[rg] > a->window ? len[rg] - (int32_t)a->window : 0;
            most = len[rg] > most ? len[rg] : most;
            least = rg < RG && lo[rg] < least ? lo[rg] : least;
            const float *q = rg < RG ? a->q + a->rows[i] * a->q_row_stride + (h * G + rg % G) * D
                                     : NULL;
            for (int64_t d = 0; d < D; d++) qt[d * RGp + rg] = q != NULL ? q[d] : 0.0f;
            m[rg] = -INFINITY;
            l[rg] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * RGp * D);
        for (int64_t t0 = least; t0 < most;) {
            const int64_t off = t0 % bs, left = most - t0;
            int64_t tt = bs - off < PA_TT ? bs - off : PA_TT;
            tt = left < tt ? left : tt;
            const float *kb, *vb;
            int64_t ts; /* floats from one token's row to the next in kb, vb */
            pa_subtile(a, sc, (int64_t)bt[t0 / bs] * block_stride + off * tok_stride + h * D, tt,
                       tok_stride, &kb, &vb, &ts);
            /* scores, soft-capped and masked: 8 tokens x 2 vectors of rows at a time */
            for (int64_t v = 0; v < nv; v += 2) {
                const int two = v + 1 < nv;
                for (int64_t j0 = 0; j0 < tt; j0 += 8) {
                    const int64_t jn = tt - j0 < 8 ? tt - j0 : 8;
                    __m512 s0[8], s1[8];
                    for (int j = 0; j < 8; j++) s0[j] = s1[j] = _mm512_setzero_ps();
                    for (int64_t d = 0; d < D; d++) {
                        const __m512 q0 = _mm512_load_ps(qt + d * RGp + 16 * v);
                        const __m512 q1 = two ? _mm512_load_ps(qt + d * RGp + 16 * v + 16) : q0;
                        for (int j = 0; j < 8; j++) {
                            if (j >= jn) break;
                            const __m512 k = _mm512_set1_ps(kb[(j0 + j) * ts + d]);
                            s0[j] = _mm512_fmadd_ps(q0, k, s0[j]);
                            s1[j] = _mm512_fmadd_ps(q1, k, s1[j]);
                        }
                    }
                    for (int64_t j = 0; j < jn; j++) {
                        const __m512i pos = _mm512_set1_epi32((int32_t)(t0 + j0 + j));
                        for (int u = 0; u <= two; u++) {
                            const __mmask16 ok =
                                _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(len + 16 * (v + u)),
                                                        pos) &
                                _mm512_cmple_epi32_mask(_mm512_loadu_si512(lo + 16 * (v + u)),
                                                        pos);
                            __m512 sv = _mm512_mul_ps(u ? s1[j] : s0[j], scale);
                            if (cap > 0.0f) sv = softcap512(sv, cap);
                            _mm512_store_ps(sp + (j0 + j) * RGp + 16 * (v + u),
                                            _mm512_mask_blend_ps(ok, ninf, sv));
                        }
                    }
                }
            }
            /* online softmax, 16 rows at a time */
            for (int64_t v = 0; v < nv; v++) {
                __m512 mx = _mm512_load_ps(m + 16 * v);
                for (int64_t j = 0; j < tt; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(sp + j * RGp + 16 * v));
                const __m512 old = _mm512_load_ps(m + 16 * v);
                /* rows with nothing valid yet keep -inf: 0 weights, c = 1 (NaN masked off) */
                const __mmask16 live = _mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ);
                const __m512 cv = _mm512_mask_blend_ps(
                    live, _mm512_set1_ps(1.0f), exp512_nonpositive(_mm512_sub_ps(old, mx)));
                __m512 sum = _mm512_setzero_ps();
                for (int64_t j = 0; j < tt; j++) {
                    float *pj = sp + j * RGp + 16 * v;
                    const __m512 e = _mm512_maskz_mov_ps(
                        live, exp512_nonpositive(_mm512_sub_ps(_mm512_load_ps(pj), mx)));
                    _mm512_store_ps(pj, e);
                    sum = _mm512_add_ps(sum, e);
                }
                _mm512_store_ps(l + 16 * v,
                                _mm512_fmadd_ps(_mm512_load_ps(l + 16 * v), cv, sum));
                _mm512_store_ps(m + 16 * v, mx);
                _mm512_store_ps(c + 16 * v, cv);
            }
            /* values: acc[row] = acc[row] c + sum_j p[j][row] v_j, two rows at a time */
            for (int64_t rg = 0; rg < RG; rg += 2) {
                const int two = rg + 1 < RG;
                for (int64_t d0 = 0; d0 < D; d0 += 16) {
                    float *a0 = acc + rg * D + d0, *a1 = a0 + D;
                    __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(a0), _mm512_set1_ps(c[rg]));
                    __m512 x1 = two ? _mm512_mul_ps(_mm512_loadu_ps(a1), _mm512_set1_ps(c[rg + 1]))
                                    : x0;
                    for (int64_t j = 0; j < tt; j++) {
                        const __m512 vj = _mm512_loadu_ps(vb + j * ts + d0);
                        x0 = _mm512_fmadd_ps(_mm512_set1_ps(sp[j * RGp + rg]), vj, x0);
                        if (two) x1 = _mm512_fmadd_ps(_mm512_set1_ps(sp[j * RGp + rg + 1]), vj, x1);
                    }
                    _mm512_storeu_ps(a0, x0);
                    if (two) _mm512_storeu_ps(a1, x1);
                }
            }
            t0 += tt;
        }
        for (int64_t rg = 0; rg < RG; rg++) {
            const int64_t i = i0 + rg / G;
            float *o = a->out + a->rows[i] * a->num_heads * D + (h * G + rg % G) * D;
            const float inv = 1.0f / l[rg];
            for (int64_t d = 0; d < D; d++) o[d] = acc[rg * D + d] * inv;
        }
    }
}
#endif

/* A thread's part of a call, inside a parallel region: tasks taken one at a time from the
 * shared counter *next (zero before the first thread starts) until none are left or
 * *failed is set; sets *failed when out of memory. No barrier at the end. */
static void pa_part(const pa_args *a, pa_scratch *sc, int64_t *next, int *failed) {
    const int64_t tasks = pa_tasks(a);
    for (;;) {
        if (__atomic_load_n(failed, __ATOMIC_RELAXED)) return;
        const int64_t task = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (task >= tasks) return;
        if (a->group_starts != NULL) {
            const int64_t parts = a->num_kv_heads / a->heads_per_task;
            const int64_t g = task / parts, h0 = task % parts * a->heads_per_task;
            const int64_t i0 = a->group_starts[g], n = a->group_starts[g + 1] - i0;
            if (n > 1) {
#if defined(__AVX512F__)
                if (a->head_dim % 16 == 0) {
                    pa_tile_task512(a, sc, i0, n, h0, a->heads_per_task);
                    continue;
                }
#endif
                pa_tile_task(a, sc, i0, n, h0, a->heads_per_task);
                continue;
            }
            if (pa_task(a, sc, i0 * parts + task % parts) != 0)
                __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
            continue;
        }
        if (pa_task(a, sc, task) != 0) __atomic_store_n(failed, 1, __ATOMIC_RELAXED);
    }
}

/* q and out fp32; the caches fp32, or IEEE fp16 where kv_f16 is 1. */
int tr_paged_decode(const float *q, int64_t q_row_stride, float *out, const void *k_cache,
                    const void *v_cache, const int32_t *block_tables, int64_t bt_stride,
                    const int32_t *ctx_lens, const int64_t *rows, const int64_t *seqs,
                    const int32_t *row_lens, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, int64_t heads_per_task, float scale,
                    int64_t kv_f16, int64_t window, float softcap) {
    pa_args a = {q,      q_row_stride, out,       k_cache,      v_cache,
                 block_tables, bt_stride, ctx_lens, rows,       seqs,
                 row_lens, n,         num_heads, num_kv_heads, head_dim,
                 block_size, heads_per_task, scale, NULL, 0, kv_f16, window, softcap};
    int64_t *starts = NULL;
    if (row_lens != NULL && num_heads / num_kv_heads <= 16) {
        starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
        if (starts == NULL) return -1;
        a.groups = pa_make_groups(&a, starts);
        a.group_starts = starts;
    }
    int failed = 0;
    int64_t next = 0;
#pragma omp parallel
    {
        pa_scratch sc;
        if (pa_scratch_init(&sc, &a) != 0)
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        else
            pa_part(&a, &sc, &next, &failed);
        pa_scratch_free(&sc);
    }
    free(starts);
    return failed ? -1 : 0;
}
