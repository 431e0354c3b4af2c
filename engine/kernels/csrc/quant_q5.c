/* Q5_0 and Q5_1 blocks for quant_matmul.c (which includes this file after defining Q5_0,
 * Q5_1, half_to_float and the TR_AVX2 / TR_AVX512 switches).
 *
 *   Q5_0 (6)  22 bytes: fp16 d, uint32 qh, 16 bytes q;             w = (q5 - 16) d
 *   Q5_1 (7)  24 bytes: fp16 d, fp16 m, uint32 qh, 16 bytes q;     w = q5 d + m
 *
 * q5[j] (0..31) is Q4_0's nibble (q[j] & 15 for j < 16, q[j - 16] >> 4 above) with bit j
 * of qh (little endian) as its fifth bit, 16. Like the 4-bit types, each weight is one fma,
 * q5 d + m with m = -16 d for Q5_0 (exact: q5 d and 16 d are), so the weights are ggml's.
 */

static inline int is_q5(int qt) { return qt == Q5_0 || qt == Q5_1; }

/* Byte offset of qh in a Q5 block (the nibbles follow it). */
static inline int q5_qh_at(int qt) { return qt == Q5_1 ? 4 : 2; }

static inline uint32_t q5_high(const uint8_t *b, int qt) {
    uint32_t h;
    memcpy(&h, b + q5_qh_at(qt), 4);
    return h;
}

/* The 32 weights of one block into out (portable). */
static inline void q5_block(const uint8_t *b, int qt, float *out) {
    const float d = half_to_float(b);
    const float m = qt == Q5_1 ? half_to_float(b + 2) : -16.0f * d;
    const uint32_t h = q5_high(b, qt);
    const uint8_t *q = b + q5_qh_at(qt) + 4;
    for (int j = 0; j < 16; j++) {
        out[j] = (float)((q[j] & 15) | (h >> j & 1) << 4) * d + m;
        out[j + 16] = (float)((q[j] >> 4) | (h >> (j + 16) & 1) << 4) * d + m;
    }
}

#ifdef TR_AVX2
/* One block as four vectors of 8 weights (0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void q5_avx(const uint8_t *b, const int qt,
                                                         __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    const __m256 m = qt == Q5_1 ? _mm256_set1_ps(half_to_float(b + 2))
                                : _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
    /* byte i of top: 16 where bit i of qh is set (byte i / 8 of qh, tested against bit i % 8) */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)q5_high(b, qt)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    const __m256i top = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                         _mm256_set1_epi8(16));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + q5_qh_at(qt) + 4));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_or_si128(_mm_and_si128(raw, mask), _mm256_castsi256_si128(top));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(raw, 4), mask),
                                    _mm256_extracti128_si256(top, 1));
    const __m128i v[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int g = 0; g < 4; g++)
        w[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v[g])), d, m);
}
#endif /* TR_AVX2 */

#ifdef TR_AVX512
/* One block as two vectors of 16 weights: qh's low and high halves are the masks that
 * add 16 to the nibbles. */
static inline __attribute__((always_inline)) void q5_512(const uint8_t *b, const int qt,
                                                         __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    const __m512 m = qt == Q5_1 ? _mm512_set1_ps(half_to_float(b + 2))
                                : _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
    const uint32_t h = q5_high(b, qt);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + q5_qh_at(qt) + 4));
    const __m128i mask = _mm_set1_epi8(15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    lo = _mm512_mask_or_epi32(lo, (__mmask16)(h & 0xffff), lo, sixteen);
    hi = _mm512_mask_or_epi32(hi, (__mmask16)(h >> 16), hi, sixteen);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m);
}

/* qh of one block of each of 16 rows of W (row c's block at b + c * rb), one lane per row
 * (the byte-transposing panel path adds bit j to lane c's weight j). */
static inline __attribute__((always_inline)) __m512i q5_high16(const uint8_t *b, int64_t rb,
                                                               const int qt) {
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)rb));
    return _mm512_i32gather_epi32(at, (const void *)(b + q5_qh_at(qt)), 1);
}
#endif /* TR_AVX512 */
