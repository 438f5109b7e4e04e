// The decoder layers of a llama-family model (llama, mistral, qwen2, qwen3) in one call per step, on the
// CPU (see engine/cpu/layers.py).
//
// Why: once the weights are 4- or 8-bit, a step's matmuls cost a few milliseconds, and the MLX ops
// between them (norms, RoPE, cache writes, SwiGLU, residual adds: ~15 dispatched ops and 5 graph
// evaluations per layer) cost several times more. Here a layer is a handful of loops with no dispatch.
//
// Per layer: RMSNorm, q/k/v projections (+ bias), per-head q/k RMSNorm (qwen3), RoPE, the new keys and
// values written into their cache slots, paged attention (attention.c), output projection, residual,
// RMSNorm, gate/up projections, SwiGLU, down projection, residual. Every operation is row-local or,
// for attention, per (token, head) in a fixed order, and the matmuls are qgemm's batch-invariant
// kernels: a token's hidden state is bitwise the same whatever else shares the step.
#define _GNU_SOURCE
#include "attention.c"
#include "qgemm.c"

#include <math.h>
#include <stdlib.h>

typedef struct {
    int fmt, group, sdtype, n, k;
    const void *w, *scales, *biases;
    const float *bias;  // [n] or NULL
} Mat;

typedef struct {
    Mat q, k, v, o, gate, up, down;
    const float *ln_in, *ln_post;   // [hidden]
    const float *q_norm, *k_norm;   // [head_dim] or NULL
    float *kc, *vc;                 // head-major caches [kv_heads, slots, head_dim]
    int window;                     // sliding window (0: none)
} Layer;

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, inter, rope_traditional;
    float eps, scale, rope_scale;
    long slots;
    const float *inv_freq;          // [head_dim / 2]
    const Layer *layers;
} Stack;

static int matmul(const Mat *m, int T, const float *x, float *y) {
    const int rc = qgemm(m->fmt, T, m->n, m->k, m->group, x, m->k, m->w, m->scales, m->biases, m->sdtype, y,
                         m->n, 0);
    if (rc == 0 && m->bias)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < m->n; j++) y[(size_t)t * m->n + j] += m->bias[j];
    return rc;
}

// y = x / sqrt(mean(x^2) + eps) * g over n values: 16-lane partial sums in order, one fixed reduction.
static void rms_norm(const float *x, const float *g, int n, float eps, float *y) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = x[i] * inv * g[i];
}

// RoPE of one head at position p: split halves (mlx.nn.RoPE, traditional=False) or adjacent pairs.
static void rope(float *v, int d, float p, const float *inv_freq, int traditional) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float th = p * inv_freq[i], c = cosf(th), s = sinf(th);
        float *a = traditional ? v + 2 * i : v + i, *b = traditional ? v + 2 * i + 1 : v + i + half;
        const float x1 = *a, x2 = *b;
        *a = x1 * c - x2 * s;
        *b = x1 * s + x2 * c;
    }
}

static float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// h: [T, hidden] in/out (the embeddings in, the last layer's residual stream out). pos, slot: [T];
// tok_table, tables, bs, max_ctx: as cpu_paged_attention takes them. Returns 0, -1 (out of memory) or
// -2 (a matmul refused its shapes).
int layers_forward(const Stack *m, int T, float *h, const int32_t *pos, const int32_t *slot,
                   const int32_t *tok_table, const int32_t *tables, int bs, int max_ctx, int max_threads) {
    const int D = m->hidden, H = m->heads, Hkv = m->kv_heads, Dh = m->head_dim;
    const size_t qn = (size_t)H * Dh, kn = (size_t)Hkv * Dh, wide = qn > (size_t)D ? qn : (size_t)D;
    float *x = malloc(sizeof(float) * T * wide), *q = malloc(sizeof(float) * T * qn);
    float *k = malloc(sizeof(float) * T * kn), *v = malloc(sizeof(float) * T * kn);
    float *att = malloc(sizeof(float) * T * qn), *o = malloc(sizeof(float) * T * D);
    float *g = malloc(sizeof(float) * T * m->inter), *u = malloc(sizeof(float) * T * m->inter);
    int rc = x && q && k && v && att && o && g && u ? 0 : -1;
    for (int l = 0; l < m->num_layers && rc == 0; l++) {
        const Layer *L = &m->layers[l];
        for (int t = 0; t < T; t++) rms_norm(h + (size_t)t * D, L->ln_in, D, m->eps, x + (size_t)t * D);
        if (matmul(&L->q, T, x, q) || matmul(&L->k, T, x, k) || matmul(&L->v, T, x, v)) {
            rc = -2;
            break;
        }
        for (int t = 0; t < T; t++) {
            const float p = (float)pos[t] * m->rope_scale;
            for (int i = 0; i < H; i++) {
                float *qh = q + (size_t)t * qn + (size_t)i * Dh;
                if (L->q_norm) rms_norm(qh, L->q_norm, Dh, m->eps, qh);
                rope(qh, Dh, p, m->inv_freq, m->rope_traditional);
            }
            for (int i = 0; i < Hkv; i++) {
                float *kh = k + (size_t)t * kn + (size_t)i * Dh;
                if (L->k_norm) rms_norm(kh, L->k_norm, Dh, m->eps, kh);
                rope(kh, Dh, p, m->inv_freq, m->rope_traditional);
                const size_t at = ((size_t)i * m->slots + (size_t)slot[t]) * Dh;
                memcpy(L->kc + at, kh, sizeof(float) * Dh);
                memcpy(L->vc + at, v + (size_t)t * kn + (size_t)i * Dh, sizeof(float) * Dh);
            }
        }
        if (cpu_paged_attention(T, H, Hkv, Dh, q, L->kc, L->vc, m->slots, pos, tok_table, tables, bs, L->window,
                                m->scale, max_ctx, max_threads, att)) {
            rc = -1;
            break;
        }
        if (matmul(&L->o, T, att, o)) {
            rc = -2;
            break;
        }
        for (size_t i = 0; i < (size_t)T * D; i++) h[i] += o[i];
        for (int t = 0; t < T; t++) rms_norm(h + (size_t)t * D, L->ln_post, D, m->eps, x + (size_t)t * D);
        if (matmul(&L->gate, T, x, g) || matmul(&L->up, T, x, u)) {
            rc = -2;
            break;
        }
        for (size_t i = 0; i < (size_t)T * m->inter; i++) g[i] = silu_mul(g[i], u[i]);
        if (matmul(&L->down, T, g, o)) {
            rc = -2;
            break;
        }
        for (size_t i = 0; i < (size_t)T * D; i++) h[i] += o[i];
    }
    free(x), free(q), free(k), free(v), free(att), free(o), free(g), free(u);
    return rc;
}
