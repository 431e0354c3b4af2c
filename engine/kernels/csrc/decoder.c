/* A whole decoder step of a model with GGUF-quantized projections, in C: embeddings in,
 * final-normed hidden states out, every layer in between in one call.
 *
 * In PyTorch the same step is ~15 small ops per layer, each a few microseconds of Python
 * and dispatch: at one sequence that overhead was as large as the matrix products
 * themselves. Here a layer is
 *
 *   h = rms_norm(x) * input_norm                 (h = x where a layer has none: OLMo 2)
 *   qkv = h @ Wqkv^T (+ bias);  q/k: rms_norm per head (Qwen3, Gemma 3) or over the whole
 *         projection (OLMo 2), rotary (rotate half) over the first rot_dim values of a head
 *         with the step's global or local table (Gemma 3's local layers)
 *   k, v -> the paged KV pool at slots[t];  att = paged attention of q over the pool,
 *         within the layer's window and soft-capped where set (Gemma, Phi-3, Mistral)
 *   x += r * out_norm(att @ Wo^T (+ bias))       (out_norm where set: Gemma, OLMo 2;
 *   h = rms_norm(x) * post_norm                   r: Granite's residual multiplier)
 *   gu = h @ Wgu^T (+ bias);  a = act(gate) * up  (act: SiLU, or tanh-GELU for Gemma)
 *   x += r * out_norm(a @ Wdown^T (+ bias))
 *
 * and at the end x = rms_norm(x) * final_norm, and if asked the logits of every row,
 * x @ head^T (one wake-up of the threads for the whole step). Matrix products are
 * quant_matmul.c's, attention is paged_attention.c's with per-row context lengths (row t
 * attends to the first lens[t] tokens of its sequence: decode rows to the whole context,
 * prefill rows to their causal prefix; every row's K/V is written before any row attends).
 *
 * Layouts: x [T, hidden] fp32, rewritten in place; cos/sin [T, rot_dim/2]; the KV pool
 * [layers, 2, num_blocks, block_size, Hkv, D], fp32 or IEEE fp16 (kv_f16: K and V rounded
 * to nearest even as they are written, read back as fp32 by the attention); tables
 * [B, bt_stride] int32; seqs [T]
 * (each token's row in tables), slots [T], rows [T] = 0..T-1, lens [T] int32.
 * Threads: the whole step is one OpenMP parallel region. Each phase (a matrix product, the
 * rows' norms, rotary and KV writes, attention, the gated MLP) is split over the threads and ends
 * at a barrier of our own that spins briefly: waking OpenMP's sleeping threads for ~5
 * regions per layer cost more than some of the products themselves.
 *
 * The caller (engine/kernels/decoder.py) checks every shape and index; the qtypes are
 * checked here (-1), and -2 means no memory for the scratch.
 */
#include "paged_attention.c"
#include "quant_matmul.c"

#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define dec_pause() _mm_pause()
#else
#define dec_pause() ((void)0)
#endif

#define TR_PARTS 3
typedef struct {
    const uint8_t *w; /* [n, k / block weights * block bytes] ggml blocks */
    int64_t n;
    int64_t qtype; /* ggml type id */
} tr_qpart;

/* A matrix [n, k] stacked by rows from 1..TR_PARTS parts, each in its own ggml type (a
 * fused q/k/v whose v is Q6_K while q and k are Q4_K), each read where the file maps it. */
typedef struct {
    tr_qpart part[TR_PARTS];
    int64_t parts, n, k;
} tr_qmat;

typedef struct {
    const float *input_norm; /* [hidden] or NULL: attention reads x itself */
    tr_qmat qkv;             /* [(H + 2 Hkv) D, hidden] */
    const float *qkv_bias;   /* [(H + 2 Hkv) D] or NULL */
    const float *q_norm;     /* [D], or [H D] where qk_norm_whole; NULL: none (nor k_norm) */
    const float *k_norm;     /* [D], or [Hkv D] where qk_norm_whole */
    tr_qmat o; /* [hidden, H D] */
    const float *o_bias;
    const float *attn_out_norm; /* [hidden] or NULL: the attention output's norm */
    const float *post_norm;     /* [hidden] or NULL: the norm before the MLP */
    tr_qmat gate_up; /* [2 I, hidden]: gate rows, then up rows */
    const float *gate_up_bias;
    tr_qmat down; /* [hidden, I] */
    const float *down_bias;
    const float *mlp_out_norm; /* [hidden] or NULL: the MLP output's norm */
    int64_t window;            /* > 0: each row attends to its last `window` tokens only */
    int64_t local_rope;        /* 1: rotary from the step's local table */
} tr_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    double eps, scale;
    const tr_layer *layers;
    const float *final_norm;
    void *kv; /* [layers, 2, num_blocks, block_size, Hkv, D] */
    int64_t num_blocks, block_size;
    tr_qmat head; /* the LM head [vocab, hidden]; parts 0: none */
    int64_t kv_f16; /* 1: the pool holds IEEE fp16 elements; 0: fp32 */
    int64_t rot_dim;       /* values of each head rotated (even, <= D) */
    int64_t qk_norm_whole; /* 1: q/k norms over the whole projection, not per head */
    int64_t act;           /* TR_ACT_SILU or TR_ACT_GELU_TANH */
    double residual_scale; /* each sublayer's output times this before its residual add */
    double softcap;        /* > 0: attention scores soft-capped */
} tr_model;

#define TR_ACT_SILU 0
#define TR_ACT_GELU_TANH 1

typedef struct {
    int64_t T;
    const float *cos, *sin; /* [T, rot_dim/2] */
    const float *cos_local, *sin_local; /* [T, rot_dim/2] for local_rope layers, or NULL */
    const int64_t *slots;   /* [T] */
    const int32_t *tables;  /* [B, bt_stride] */
    int64_t bt_stride;
    const int64_t *seqs; /* [T] */
    const int64_t *rows; /* [T] */
    const int32_t *lens; /* [T] */
    int64_t heads_per_task;
    float *logits; /* [T, vocab]: every row's logits through the head; NULL: none */
} tr_step;

/* All threads of the step's parallel region wait here until every one has arrived. They
 * spin up to ~0.2 ms (phases last microseconds to tens of them), then sleep on a futex.
 * Sleeping matters: on a laptop the gateway, Redis and the client share the cores, and a
 * thread of the step they preempt gets a core back sooner when its partner gives one up
 * than when the partner spins on or yields. */
typedef struct {
    int arrived, generation, sleepers;
} dec_barrier;

#define DEC_SPINS 10000 /* ~0.2 ms here (22 ns a pause) */

static void dec_sleep(int *addr, int value) {
#ifdef __linux__
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)addr, (void)value;
    sched_yield();
#endif
}

static void dec_wake(int *addr) {
#ifdef __linux__
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

static void dec_wait(dec_barrier *b, int nth) {
    if (nth == 1) return;
    const int gen = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == nth) {
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->generation, gen + 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&b->sleepers, __ATOMIC_SEQ_CST) > 0) dec_wake(&b->generation);
        return;
    }
    for (int spins = 0; spins < DEC_SPINS; spins++) {
        if (__atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) != gen) return;
        dec_pause();
    }
    __atomic_add_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
    /* the futex returns at once if generation has moved on since it was read */
    while (__atomic_load_n(&b->generation, __ATOMIC_SEQ_CST) == gen) dec_sleep(&b->generation, gen);
    __atomic_sub_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
}

/* o[i] = x[i] / rms(x) * w[i] for one row of n floats (o may be x). */
static void dec_norm_row(const float *x, float *o, int64_t n, const float *w, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = x[i] * r * w[i];
}

/* A sublayer's output y[t] (+ b), normed by out_norm where set and times r, joins the
 * residual x[t]; then h[t] = rms_norm(x[t]) * w (a copy of x[t] where w is NULL), for rows
 * t0..t1 - 1. y NULL: the norm only. h may be x; y's rows are rewritten. */
static void dec_residual_norm(float *x, float *y, const float *b, const float *out_norm,
                              float r, float *h, int64_t t0, int64_t t1, int64_t n,
                              const float *w, float eps) {
    for (int64_t t = t0; t < t1; t++) {
        float *xr = x + t * n;
        if (y != NULL) {
            float *yr = y + t * n;
            if (b != NULL)
#pragma omp simd
                for (int64_t i = 0; i < n; i++) yr[i] += b[i];
            if (out_norm != NULL) dec_norm_row(yr, yr, n, out_norm, eps);
            if (r != 1.0f) {
#pragma omp simd
                for (int64_t i = 0; i < n; i++) xr[i] += yr[i] * r;
            } else {
#pragma omp simd
                for (int64_t i = 0; i < n; i++) xr[i] += yr[i];
            }
        }
        if (w != NULL)
            dec_norm_row(xr, h + t * n, n, w, eps);
        else if (h != x)
            memcpy(h + t * n, xr, sizeof(float) * (size_t)n);
    }
}

/* Rotate `heads` heads of D floats starting at v: the first R values of each (rotate half:
 * pairs i, i + R/2); c and s hold R/2 values. */
static void dec_rope(float *v, int64_t heads, int64_t D, int64_t R, const float *c,
                     const float *s) {
    const int64_t half = R / 2;
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

/* Rows t0..t1 - 1 of qkv: bias, q/k norms, rotary, then k and v into the pool's slots
 * (kc, vc: this layer's K and V pools, of the pool's element type). */
static void dec_qkv_rows(const tr_model *m, const tr_layer *L, const tr_step *s, float *qkv,
                         void *kc, void *vc, int64_t t0, int64_t t1) {
    const int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    const int64_t width = (H + 2 * Hkv) * D, half = m->rot_dim / 2;
    const float eps = (float)m->eps;
    const float *cos = L->local_rope ? s->cos_local : s->cos;
    const float *sin = L->local_rope ? s->sin_local : s->sin;
    for (int64_t t = t0; t < t1; t++) {
        float *row = qkv + t * width; /* q [H, D] | k [Hkv, D] | v [Hkv, D] */
        if (L->qkv_bias != NULL)
#pragma omp simd
            for (int64_t i = 0; i < width; i++) row[i] += L->qkv_bias[i];
        if (L->q_norm != NULL && m->qk_norm_whole) {
            dec_norm_row(row, row, H * D, L->q_norm, eps);
            dec_norm_row(row + H * D, row + H * D, Hkv * D, L->k_norm, eps);
        } else if (L->q_norm != NULL) {
            for (int64_t h = 0; h < H; h++) dec_norm_row(row + h * D, row + h * D, D, L->q_norm, eps);
            for (int64_t h = H; h < H + Hkv; h++)
                dec_norm_row(row + h * D, row + h * D, D, L->k_norm, eps);
        }
        dec_rope(row, H + Hkv, D, m->rot_dim, cos + t * half, sin + t * half);
        const int64_t slot = s->slots[t] * Hkv * D;
        if (m->kv_f16) {
            tr_f32_to_f16((uint16_t *)kc + slot, row + H * D, Hkv * D);
            tr_f32_to_f16((uint16_t *)vc + slot, row + (H + Hkv) * D, Hkv * D);
        } else {
            memcpy((float *)kc + slot, row + H * D, sizeof(float) * Hkv * D);
            memcpy((float *)vc + slot, row + (H + Hkv) * D, sizeof(float) * Hkv * D);
        }
    }
}

/* Columns c0..c1 - 1 of every row: h[t] = act(gate + bg) * (up + bu), act SiLU or (gelu)
 * tanh-GELU. Both are g s(v), s the logistic function: v = g for SiLU, and for the GELU
 * 0.5 g (1 + tanh(u)) = g s(2 u), u = sqrt(2 / pi) (g + 0.044715 g^3), as PyTorch's
 * gelu(approximate="tanh"). s(v) from e = exp(-|v|) <= 1 (no overflow): 1 / (1 + e) for
 * v >= 0, e / (1 + e) below; 16 lanes at a time with AVX-512 (paged_attention.c's exp). */
static void dec_gated(const float *gu, const float *bias, float *h, int64_t T, int64_t I,
                      int64_t c0, int64_t c1, int gelu) {
    const float k2 = 2.0f * 0.7978845608028654f, c3 = 0.044715f;
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *a = h + t * I;
        int64_t i = c0;
#if defined(__AVX512F__)
        if (bias == NULL) {
            const __m512 one = _mm512_set1_ps(1.0f), c3v = _mm512_set1_ps(c3);
            const __m512 k2v = _mm512_set1_ps(k2);
            for (; i + 16 <= c1; i += 16) {
                const __m512 gi = _mm512_loadu_ps(g + i);
                const __m512 v =
                    gelu ? _mm512_mul_ps(
                               k2v, _mm512_fmadd_ps(c3v, _mm512_mul_ps(_mm512_mul_ps(gi, gi), gi),
                                                    gi))
                         : gi;
                const __m512 e = exp512_nonpositive(
                    _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
                const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
                const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
                const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);
                _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_mul_ps(gi, sig),
                                                      _mm512_loadu_ps(u + i)));
            }
        }
#endif
        for (; i < c1; i++) {
            const float gi = bias != NULL ? g[i] + bias[i] : g[i];
            const float ui = bias != NULL ? u[i] + bias[I + i] : u[i];
            const float v = gelu ? k2 * (gi + c3 * gi * gi * gi) : gi;
            a[i] = gi / (1.0f + expf(-v)) * ui;
        }
    }
}

/* What the threads of one step share. */
typedef struct {
    const tr_model *m;
    const tr_step *s;
    float *x, *h, *qkv, *att, *gu, *y; /* activations, see tr_decoder_forward */
    int64_t panel_floats;             /* per-thread matmul scratch (0: none needed) */
    int64_t *next; /* zeroed task counters: DEC_COUNTERS per layer (attention, then each
                    * matmul's parts), then the head's parts */
    const int64_t *group_starts;      /* rows attended as one tile (pa_make_groups) */
    int64_t groups;
    dec_barrier bar;
    int failed;
} dec_shared;

#define DEC_COUNTERS (1 + 4 * TR_PARTS) /* per layer: attention, q/k/v, o, gate/up, down */

/* y = x @ w^T by all threads; `next`: the matmul's TR_PARTS counters (see dec_shared). */
static void dec_matmul(dec_shared *d, const float *x, const tr_qmat *w, float *y, float *panel,
                       int tid, int nth, int64_t *next) {
    int64_t row = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        const tr_qpart *q = &w->part[p];
        qm_part(x, d->s->T, w->k, w->k, q->w, q->n, (int)q->qtype, y + row, w->n, panel, tid,
                nth, next + p);
        row += q->n;
    }
}

/* 0 when every part of w is a type qm_part multiplies and the parts add up to w's rows. */
static int dec_check(const tr_qmat *w) {
    if (w->parts < 1 || w->parts > TR_PARTS) return -1;
    int64_t rows = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        if (w->part[p].w == NULL || !qm_known(w->part[p].qtype)) return -1;
        rows += w->part[p].n;
    }
    return rows == w->n ? 0 : -1;
}

/* The most scratch floats any part of w needs for T rows. */
static int64_t dec_scratch(const tr_qmat *w, int64_t T, int64_t most) {
    for (int64_t p = 0; p < w->parts; p++) {
        const int64_t f = qm_scratch_floats(T, w->k, (int)w->part[p].qtype);
        most = f > most ? f : most;
    }
    return most;
}

/* One thread's part of the step: every phase split over the threads, a barrier after each
 * (every thread passes every barrier, also after a failure, or the others would wait). */
static void dec_thread(dec_shared *d, int tid, int nth) {
    const tr_model *m = d->m;
    const tr_step *s = d->s;
    const int64_t T = s->T, E = m->hidden, H = m->num_heads, Hkv = m->num_kv_heads;
    const int64_t D = m->head_dim, I = m->inter;
    const int64_t pool = m->num_blocks * m->block_size * Hkv * D; /* elements: one K pool */
    const int64_t es = m->kv_f16 ? 2 : 4;                         /* bytes per element */
    const float eps = (float)m->eps, r = (float)m->residual_scale;
    float *panel = NULL;
    pa_scratch sc = {NULL, 0, NULL, NULL, NULL};
    int ok = 1;
    if (d->panel_floats > 0) {
        panel = aligned_alloc(64, (size_t)d->panel_floats * sizeof(float));
        ok = panel != NULL;
    }
    pa_args att = {NULL, (H + 2 * Hkv) * D, d->att, NULL, NULL, s->tables, s->bt_stride, NULL,
                   s->rows, s->seqs, s->lens, T, H, Hkv, D, m->block_size, s->heads_per_task,
                   (float)m->scale, d->group_starts, d->groups, m->kv_f16, 0,
                   (float)m->softcap};
    ok = ok && pa_scratch_init(&sc, &att) == 0;
    if (!ok) __atomic_store_n(&d->failed, 1, __ATOMIC_RELAXED);
    dec_wait(&d->bar, nth);
    if (__atomic_load_n(&d->failed, __ATOMIC_RELAXED)) { /* all threads leave together */
        free(panel);
        pa_scratch_free(&sc);
        return;
    }
    int64_t r0, r1, c0, c1; /* this thread's rows of T, columns of I */
    tr_split(T, tid, nth, &r0, &r1);
    /* columns in runs of 16: which of them take the vector path (and its rounding) is the
     * same at any thread count */
    tr_split((I + 15) / 16, tid, nth, &c0, &c1);
    c0 = c0 * 16 < I ? c0 * 16 : I;
    c1 = c1 * 16 < I ? c1 * 16 : I;
    float *x = d->x;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tr_layer *L = &m->layers[l];
        const tr_layer *prev = l > 0 ? &m->layers[l - 1] : NULL;
        char *kc = (char *)m->kv + l * 2 * pool * es, *vc = kc + pool * es;
        /* the previous layer's down projection joins the residual; the input norm */
        dec_residual_norm(x, prev ? d->y : NULL, prev ? prev->down_bias : NULL,
                          prev ? prev->mlp_out_norm : NULL, r, d->h, r0, r1, E, L->input_norm,
                          eps);
        dec_wait(&d->bar, nth);
        int64_t *ctr = d->next + l * DEC_COUNTERS;
        dec_matmul(d, d->h, &L->qkv, d->qkv, panel, tid, nth, ctr + 1);
        dec_wait(&d->bar, nth);
        dec_qkv_rows(m, L, s, d->qkv, kc, vc, r0, r1);
        dec_wait(&d->bar, nth); /* every row's K/V is in the pool before any row attends */
        att.q = d->qkv;
        att.k_cache = kc;
        att.v_cache = vc;
        att.window = L->window;
        pa_part(&att, &sc, ctr, &d->failed);
        dec_wait(&d->bar, nth);
        dec_matmul(d, d->att, &L->o, d->y, panel, tid, nth, ctr + 1 + TR_PARTS);
        dec_wait(&d->bar, nth);
        dec_residual_norm(x, d->y, L->o_bias, L->attn_out_norm, r, d->h, r0, r1, E,
                          L->post_norm, eps);
        dec_wait(&d->bar, nth);
        dec_matmul(d, d->h, &L->gate_up, d->gu, panel, tid, nth, ctr + 1 + 2 * TR_PARTS);
        dec_wait(&d->bar, nth);
        dec_gated(d->gu, L->gate_up_bias, d->h, T, I, c0, c1, m->act == TR_ACT_GELU_TANH);
        dec_wait(&d->bar, nth);
        dec_matmul(d, d->h, &L->down, d->y, panel, tid, nth, ctr + 1 + 3 * TR_PARTS);
        dec_wait(&d->bar, nth);
    }
    const tr_layer *last = &m->layers[m->num_layers - 1];
    dec_residual_norm(x, d->y, last->down_bias, last->mlp_out_norm, r, x, r0, r1, E,
                      m->final_norm, eps);
    if (s->logits != NULL) { /* the LM head in the same region: no second wake-up */
        dec_wait(&d->bar, nth);
        dec_matmul(d, x, &m->head, s->logits, panel, tid, nth,
                   d->next + m->num_layers * DEC_COUNTERS);
    }
    free(panel);
    pa_scratch_free(&sc);
}

int tr_decoder_forward(const tr_model *m, const tr_step *s, float *x) {
    const int64_t T = s->T, E = m->hidden, H = m->num_heads, Hkv = m->num_kv_heads;
    const int64_t D = m->head_dim, I = m->inter;
    const int64_t qkv_w = (H + 2 * Hkv) * D;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tr_layer *L = &m->layers[l];
        if (dec_check(&L->qkv) || dec_check(&L->o) || dec_check(&L->gate_up) ||
            dec_check(&L->down))
            return -1;
    }
    if (s->logits != NULL && dec_check(&m->head)) return -1;
    if (m->rot_dim < 2 || m->rot_dim > D || m->rot_dim % 2 || m->act < 0 || m->act > 1) return -1;
    for (int64_t l = 0; l < m->num_layers; l++)
        if (m->layers[l].local_rope && (s->cos_local == NULL || s->sin_local == NULL)) return -1;
    if (m->num_layers < 1) return 0;
    /* scratch: h [T, max(E, I)], qkv [T, qkv_w], att [T, H D], gu [T, 2 I], y [T, E] */
    const int64_t hw = E > I ? E : I;
    float *buf = (float *)malloc(sizeof(float) * T * (hw + qkv_w + H * D + 2 * I + E));
    const size_t counters = (size_t)(m->num_layers * DEC_COUNTERS + TR_PARTS);
    int64_t *next = (int64_t *)calloc(counters, sizeof(int64_t));
    if (buf == NULL || next == NULL) {
        free(buf);
        free(next);
        return -2;
    }
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1));
    if (starts == NULL) {
        free(buf);
        free(next);
        return -2;
    }
    dec_shared d = {m, s, x, buf, NULL, NULL, NULL, NULL, 0, next, NULL, 0, {0, 0, 0}, 0};
    if (H / Hkv <= 16) { /* prefill chunks' rows in tiles (the tile keeps 16 G query rows) */
        pa_args rows = {NULL, 0, NULL, NULL, NULL, s->tables, s->bt_stride, NULL, s->rows,
                        s->seqs, s->lens, T, H, Hkv, D, m->block_size, 1, 0.0f, NULL, 0, 0,
                        0, 0.0f};
        d.groups = pa_make_groups(&rows, starts);
        d.group_starts = starts;
    }
    d.qkv = d.h + T * hw;
    d.att = d.qkv + T * qkv_w;
    d.gu = d.att + T * H * D;
    d.y = d.gu + T * 2 * I;
    int64_t most = 0; /* the panel scratch for the widest K among the layers' matrices */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tr_layer *L = &m->layers[l];
        most = dec_scratch(&L->qkv, T, most);
        most = dec_scratch(&L->o, T, most);
        most = dec_scratch(&L->gate_up, T, most);
        most = dec_scratch(&L->down, T, most);
    }
    if (s->logits != NULL) most = dec_scratch(&m->head, T, most);
    d.panel_floats = most;
#pragma omp parallel
    dec_thread(&d, tr_thread(), tr_threads());
    free(buf);
    free(next);
    free(starts);
    return d.failed ? -2 : 0;
}
