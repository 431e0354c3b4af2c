/* A whole decoder step of a Llama-family model with GGUF-quantized projections, in C:
 * embeddings in, final-normed hidden states out, every layer in between in one call.
 *
 * In PyTorch the same step is ~15 small ops per layer, each a few microseconds of Python
 * and dispatch: at one sequence that overhead was as large as the matrix products
 * themselves. Here a layer is
 *
 *   h = rms_norm(x) * input_norm
 *   qkv = h @ Wqkv^T (+ bias);  q/k: per-head rms_norm (Qwen3), rotary (rotate half)
 *   k, v -> the paged KV pool at slots[t];  att = paged attention of q over the pool
 *   x += att @ Wo^T (+ bias)
 *   h = rms_norm(x) * post_norm;  gu = h @ Wgu^T (+ bias);  a = silu(gate) * up
 *   x += a @ Wdown^T (+ bias)
 *
 * and at the end x = rms_norm(x) * final_norm. Matrix products are quant_matmul.c's,
 * attention is paged_attention.c's with per-row context lengths (row t attends to the
 * first lens[t] tokens of its sequence: decode rows to the whole context, prefill rows
 * to their causal prefix; every row's K/V is written before any row attends).
 *
 * Layouts: x [T, hidden] fp32, rewritten in place; cos/sin [T, D/2]; the KV pool
 * [layers, 2, num_blocks, block_size, Hkv, D]; tables [B, bt_stride] int32; seqs [T]
 * (each token's row in tables), slots [T], rows [T] = 0..T-1, lens [T] int32.
 * The caller (engine/kernels/decoder.py) checks every shape and index.
 */
#include "paged_attention.c"
#include "quant_matmul.c"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const uint8_t *w; /* [n, k / 32 * block bytes] ggml blocks */
    int64_t n, k;
    int64_t qtype; /* ggml type id */
} tr_qmat;

typedef struct {
    const float *input_norm; /* [hidden] */
    tr_qmat qkv;             /* [(H + 2 Hkv) D, hidden] */
    const float *qkv_bias;   /* [(H + 2 Hkv) D] or NULL */
    const float *q_norm;     /* [D] or NULL (with k_norm) */
    const float *k_norm;
    tr_qmat o; /* [hidden, H D] */
    const float *o_bias;
    const float *post_norm;
    tr_qmat gate_up; /* [2 I, hidden]: gate rows, then up rows */
    const float *gate_up_bias;
    tr_qmat down; /* [hidden, I] */
    const float *down_bias;
} tr_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    double eps, scale;
    const tr_layer *layers;
    const float *final_norm;
    float *kv; /* [layers, 2, num_blocks, block_size, Hkv, D] */
    int64_t num_blocks, block_size;
} tr_model;

typedef struct {
    int64_t T;
    const float *cos, *sin; /* [T, D/2] */
    const int64_t *slots;   /* [T] */
    const int32_t *tables;  /* [B, bt_stride] */
    int64_t bt_stride;
    const int64_t *seqs; /* [T] */
    const int64_t *rows; /* [T] */
    const int32_t *lens; /* [T] */
    int64_t heads_per_task;
} tr_step;

/* out[t] = x[t] / rms(x[t]) * w for `rows` rows of `n` floats, rows `xs` / `os` apart. */
static void dec_rms_norm(const float *x, int64_t xs, float *out, int64_t os, int64_t rows,
                         int64_t n, const float *w, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * xs;
        float *o = out + t * os;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r * w[i];
    }
}

static void dec_add_bias(float *y, int64_t rows, int64_t n, const float *b) {
    if (b == NULL) return;
    for (int64_t t = 0; t < rows; t++)
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[t * n + i] += b[i];
}

/* Rotate `heads` heads of D floats starting at v (rotate half: pairs i, i + D/2). */
static void dec_rope(float *v, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = v + h * D, *b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

static int dec_matmul(const float *x, int64_t T, const tr_qmat *w, float *y) {
    return tr_quant_matmul(x, T, w->k, w->k, w->w, w->n, (int)w->qtype, y, w->n);
}

int tr_decoder_forward(const tr_model *m, const tr_step *s, float *x) {
    const int64_t T = s->T, E = m->hidden, H = m->num_heads, Hkv = m->num_kv_heads;
    const int64_t D = m->head_dim, I = m->inter, half = D / 2;
    const int64_t qkv_w = (H + 2 * Hkv) * D;
    const int64_t pool = m->num_blocks * m->block_size * Hkv * D; /* floats: one K pool */
    const float eps = (float)m->eps;
    /* scratch: h [T, max(E, I)], qkv [T, qkv_w], att [T, H D], gu [T, 2 I], y [T, E] */
    const int64_t hw = E > I ? E : I;
    float *buf = (float *)malloc(sizeof(float) * T * (hw + qkv_w + H * D + 2 * I + E));
    if (buf == NULL) return -2;
    float *h = buf, *qkv = h + T * hw, *att = qkv + T * qkv_w, *gu = att + T * H * D;
    float *y = gu + T * 2 * I;
    int rc = 0;
    for (int64_t l = 0; l < m->num_layers && rc == 0; l++) {
        const tr_layer *L = &m->layers[l];
        float *kc = m->kv + l * 2 * pool, *vc = kc + pool;
        dec_rms_norm(x, E, h, E, T, E, L->input_norm, eps);
        rc |= dec_matmul(h, T, &L->qkv, qkv);
        dec_add_bias(qkv, T, qkv_w, L->qkv_bias);
        for (int64_t t = 0; t < T; t++) {
            float *row = qkv + t * qkv_w; /* q [H, D] | k [Hkv, D] | v [Hkv, D] */
            if (L->q_norm != NULL) {
                dec_rms_norm(row, D, row, D, H, D, L->q_norm, eps);
                dec_rms_norm(row + H * D, D, row + H * D, D, Hkv, D, L->k_norm, eps);
            }
            dec_rope(row, H + Hkv, D, s->cos + t * half, s->sin + t * half);
            const int64_t slot = s->slots[t] * Hkv * D;
            memcpy(kc + slot, row + H * D, sizeof(float) * Hkv * D);
            memcpy(vc + slot, row + (H + Hkv) * D, sizeof(float) * Hkv * D);
        }
        rc |= tr_paged_decode_f32(qkv, qkv_w, att, kc, vc, s->tables, s->bt_stride, NULL,
                                  s->rows, s->seqs, s->lens, T, H, Hkv, D, m->block_size,
                                  s->heads_per_task, (float)m->scale);
        rc |= dec_matmul(att, T, &L->o, y);
        dec_add_bias(y, T, E, L->o_bias);
        for (int64_t i = 0; i < T * E; i++) x[i] += y[i];
        dec_rms_norm(x, E, h, E, T, E, L->post_norm, eps);
        rc |= dec_matmul(h, T, &L->gate_up, gu);
        dec_add_bias(gu, T, 2 * I, L->gate_up_bias);
        for (int64_t t = 0; t < T; t++) { /* h[t] = silu(gate) * up */
            const float *g = gu + t * 2 * I, *u = g + I;
            float *a = h + t * I;
            for (int64_t i = 0; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        rc |= dec_matmul(h, T, &L->down, y);
        dec_add_bias(y, T, E, L->down_bias);
        for (int64_t i = 0; i < T * E; i++) x[i] += y[i];
    }
    if (rc == 0) dec_rms_norm(x, E, x, E, T, E, m->final_norm, eps);
    free(buf);
    return rc;
}
