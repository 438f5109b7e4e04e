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
    // gemma3: norms of the attention and MLP outputs before their residual adds (NULL: none), and the
    // stack's second RoPE (local layers' base) in place of the first.
    const float *ln_attn_out, *ln_mlp_out;
    int rope2;
} Layer;

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, inter, rope_traditional;
    float eps, scale, rope_scale;
    long slots;
    const float *inv_freq;          // [head_dim / 2]
    const Layer *layers;
    const float *final_norm;        // [hidden] or NULL: the model's last RMSNorm, applied to h at the end
    int act_int8;                   // products taking 8-bit activations (qgemm_i8's): 1 the 4-bit, 2 the 8-bit
    const float *inv_freq2;         // [head_dim / 2] or NULL: the RoPE of layers with rope2
    float rope_scale2;
    int gelu;                       // MLP: gelu_tanh(gate) * up (gemma) rather than silu(gate) * up
} Stack;

static int mat_weights(const Mat *m, Weights *W) {
    return weights_of(m->fmt, m->n, m->k, m->group, m->w, m->scales, m->biases, m->sdtype, W);
}

// A Mat in one of GGML's block formats (blocks.h), its type id in fmt.
static inline int mat_blocks(const Mat *m) { return gg_block_bytes(m->fmt) != 0; }
// A product that reads its input as natural-order int8 rows (GIn): block formats, 8-bit weights at int8.
static inline int mat_natural(const Mat *m, int act_int8) {
    return mat_blocks(m) || ((act_int8 & 2) && m->fmt == FMT_Q8);
}

// Whether a product reads these weights (-2 from layers_forward where not).
static int mat_ok(const Mat *m, int act_int8) {
    Weights W;
    GWeights G;
    if (mat_blocks(m)) return !gweights_of(m->fmt, m->n, m->k, m->w, &G);
    if (mat_weights(m, &W)) return 0;
    const int int8 = ((act_int8 & 1) && W.fmt == FMT_Q4) || ((act_int8 & 2) && W.fmt == FMT_Q8);
    return !(int8 && !i8_serves(&W));
}

// This thread's share of y[T, n] = x @ W^T (+ bias): weight rows split as qgemm splits them, so every
// element is computed as qgemm (qgemm_i8, qgemm_blocks) alone computes it. xp, xg: x as the 4-bit and the
// natural-order int8 kernels read it; a8: the stack's act_int8.
static void matmul_share(const Mat *m, int T, const float *x, const Q4In *xp, const GIn *xg, float *y, float *buf,
                         int nth, int tid, int *j0, int *j1, int a8) {
    share(m->n, nth, tid, j0, j1);
    if (*j0 >= *j1) return;
    if (mat_blocks(m)) {
        GWeights G;
        gweights_of(m->fmt, m->n, m->k, m->w, &G);  // checked before the parallel region
        const GAct X = gin_act(xg);
        run_blocks(&G, T, *j0, *j1, &X, y, m->n);
    } else {
        Weights W;
        mat_weights(m, &W);  // checked before the parallel region
        if (m->fmt == FMT_Q4 && xp->q) {
            const QAct X = q4in_act(xp);
            run_i8(&W, T, *j0, *j1, &X, y, m->n);
        } else if (m->fmt == FMT_Q8 && (a8 & 2)) {
            const GAct X = gin_act(xg);
            run_q8i8(&W, T, *j0, *j1, &X, y, m->n);
        } else {
            run(&W, T, *j0, *j1, m->fmt == FMT_Q4 ? xp->xp : x, m->k, y, m->n, buf);
        }
    }
    if (m->bias)
        for (int t = 0; t < T; t++)
            for (int j = *j0; j < *j1; j++) y[(size_t)t * m->n + j] += m->bias[j];
}

// y = x / sqrt(mean(x^2) + eps) * g over n values: 16-lane partial sums in order, one fixed reduction.
static void rms_norm(const float *x, const float *g, int n, float eps, float *y) {
    vf acc = vzero();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const vf v = vload(x + i);
        acc = vfma(v, v, acc);
    }
    float ss = vhsum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = x[i] * inv * g[i];
}

// RoPE of one head given its position's cos/sin per frequency: split halves (mlx.nn.RoPE,
// traditional=False) or adjacent pairs.
static void rope(float *v, int d, const float *cs, const float *sn, int traditional) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float c = cs[i], s = sn[i];
        float *a = traditional ? v + 2 * i : v + i, *b = traditional ? v + 2 * i + 1 : v + i + half;
        const float x1 = *a, x2 = *b;
        *a = x1 * c - x2 * s;
        *b = x1 * s + x2 * c;
    }
}

// g[j] = act(g[j]) * u[j] for j in [j0, j1), 16 lanes at a time, act silu or (gelu) GELU's tanh form
// (vsilu_mul, vgelu_tanh_mul: the same bits everywhere).
static void act_mul_range(float *g, const float *u, int j0, int j1, int gelu) {
    int j = j0;
    for (; j + 16 <= j1; j += 16)
        vstore(g + j, gelu ? vgelu_tanh_mul(vload(g + j), vload(u + j)) : vsilu_mul(vload(g + j), vload(u + j)));
    if (j < j1) {
        const vf a = vloadn(g + j, j1 - j), b = vloadn(u + j, j1 - j);
        vstoren(g + j, gelu ? vgelu_tanh_mul(a, b) : vsilu_mul(a, b), j1 - j);
    }
}

// h[t] += o[t], o[t] normed first by `ln` where the layer has one (gemma3's post-norms).
static void residual_add(float *h, float *o, const float *ln, int D, float eps) {
    if (ln) rms_norm(o, ln, D, eps, o);
    for (int i = 0; i < D; i++) h[i] += o[i];
}

// h: [T, hidden] in/out (the embeddings in, the last layer's residual stream out, normed by final_norm). pos, slot: [T];
// tok_table, tables, bs, max_ctx: as cpu_paged_attention takes them. aux: [T, n_aux, hidden] or NULL; aux_slot:
// [num_layers + 1], where aux_slot[l] >= 0 copies the residual stream entering layer l (l = num_layers: the
// last layer's output, before final_norm) into that slot, bit for bit (EAGLE-3's features). Returns 0, -1
// (out of memory) or -2 (a matmul refused its shapes, or an aux slot is out of range).
//
// One OpenMP region for the whole call: the threads split each product's weight rows, each token's
// norms, each (token, head)'s RoPE and each (token, KV head)'s attention, meeting at a barrier between
// dependent stages (a region per product cost a fork and a join each, ~210 a step).
int layers_forward_aux(const Stack *m, int T, float *h, const int32_t *pos, const int32_t *slot,
                       const int32_t *tok_table, const int32_t *tables, int bs, int max_ctx, int max_threads,
                       float *aux, const int32_t *aux_slot, int n_aux) {
    const int D = m->hidden, H = m->heads, Hkv = m->kv_heads, Dh = m->head_dim, I = m->inter, half = Dh / 2;
    const int G = H / Hkv;
    const size_t qn = (size_t)H * Dh, kn = (size_t)Hkv * Dh;
    int pq = 0, po = 0, pg = 0, pd = 0, bq = 0, bo = 0, bd = 0;
    for (int l = 0; l < m->num_layers; l++) {
        const Layer *L = &m->layers[l];
        const Mat *mats[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++)
            if (!mat_ok(mats[i], m->act_int8)) return -2;
        const int a8 = m->act_int8;
        bq |= mat_natural(&L->q, a8) || mat_natural(&L->k, a8) || mat_natural(&L->v, a8) ||
              mat_natural(&L->gate, a8) || mat_natural(&L->up, a8);
        bo |= mat_natural(&L->o, a8);
        bd |= mat_natural(&L->down, a8);
        pq |= L->q.fmt == FMT_Q4 || L->k.fmt == FMT_Q4 || L->v.fmt == FMT_Q4;
        po |= L->o.fmt == FMT_Q4;
        pg |= L->gate.fmt == FMT_Q4 || L->up.fmt == FMT_Q4;
        pd |= L->down.fmt == FMT_Q4;
        if (L->q.n != (int)qn || L->k.n != (int)kn || L->v.n != (int)kn || L->o.n != D || L->o.k != (int)qn ||
            L->gate.n != I || L->up.n != I || L->down.n != D || L->down.k != I || L->q.k != D || L->k.k != D ||
            L->v.k != D || L->gate.k != D || L->up.k != D)
            return -2;
    }
    if (aux && (!aux_slot || n_aux < 1)) return -2;
    for (int l = 0; aux && l <= m->num_layers; l++)
        if (aux_slot[l] < -1 || aux_slot[l] >= n_aux) return -2;
    const size_t an = (size_t)n_aux * D;
    int nth = omp_get_max_threads();
    if (max_threads > 0 && nth > max_threads) nth = max_threads;
    if (nth < 1) nth = 1;
    size_t Kmax = (size_t)D > qn ? (size_t)D : qn;  // the widest product input
    if ((size_t)I > Kmax) Kmax = (size_t)I;
    // Each input some layer's product reads at 4 bits is also kept as the 4-bit kernels read it.
    Q4In xp = {0}, attp = {0}, gp = {0};
    const int a8 = m->act_int8, a4 = a8 & 1, px = pq || pg;
    int ok = (!px || q4in_alloc(&xp, a4, T, D)) & (!po || q4in_alloc(&attp, a4, T, (int)qn)) &
             (!pd || q4in_alloc(&gp, a4, T, I));
    GIn xg = {0}, attg = {0}, gg = {0};  // and as the block kernels read it
    ok &= (!bq || gin_alloc(&xg, T, D)) & (!bo || gin_alloc(&attg, T, (int)qn)) & (!bd || gin_alloc(&gg, T, I));
    float *x = malloc(sizeof(float) * T * D);
    float *q = malloc(sizeof(float) * T * qn), *k = malloc(sizeof(float) * T * kn), *v = malloc(sizeof(float) * T * kn);
    float *att = malloc(sizeof(float) * T * qn);
    float *o = malloc(sizeof(float) * T * D), *g = malloc(sizeof(float) * T * I), *u = malloc(sizeof(float) * T * I);
    float *cs = malloc(sizeof(float) * 2 * T * half), *sn = malloc(sizeof(float) * 2 * T * half);  // two RoPEs
    float *scores = malloc(sizeof(float) * (size_t)nth * G * (max_ctx > 0 ? max_ctx : 1));
    float *bufs = T > MB2 ? malloc(sizeof(float) * (size_t)nth * WRB * Kmax) : NULL;
    int rc = ok && x && q && k && v && att && o && g && u && cs && sn && scores ? 0 : -1;
    if (rc == 0) {
        for (int r = 0; r < (m->inv_freq2 ? 2 : 1); r++)  // [rope][T][half]
            for (int t = 0; t < T; t++)
                for (int i = 0; i < half; i++) {
                    const float th = (float)pos[t] * (r ? m->rope_scale2 * m->inv_freq2[i] : m->rope_scale * m->inv_freq[i]);
                    const size_t at = ((size_t)r * T + t) * half + i;
                    ss_sincos(th, sn + at, cs + at);
                }
        const float sl2e = m->scale * 1.4426950408889634f;
#pragma omp parallel num_threads(nth)
        {
            const int n = omp_get_num_threads(), tid = omp_get_thread_num();
            float *buf = bufs ? bufs + (size_t)tid * WRB * Kmax : NULL;
            float *sc = scores + (size_t)tid * G * (max_ctx > 0 ? max_ctx : 1);
            int j0, j1;
            for (int l = 0; l < m->num_layers; l++) {
                const Layer *L = &m->layers[l];
#pragma omp for schedule(static)
                for (int t = 0; t < T; t++) {
                    if (l > 0) residual_add(h + (size_t)t * D, o + (size_t)t * D, m->layers[l - 1].ln_mlp_out, D, m->eps);
                    if (aux && aux_slot[l] >= 0)
                        memcpy(aux + t * an + (size_t)aux_slot[l] * D, h + (size_t)t * D, sizeof(float) * D);
                    rms_norm(h + (size_t)t * D, L->ln_in, D, m->eps, x + (size_t)t * D);
                    if (px) q4in_row(&xp, x + (size_t)t * D, t);
                    if (bq) gin_row(&xg, x + (size_t)t * D, t);
                }
                matmul_share(&L->q, T, x, &xp, &xg, q, buf, n, tid, &j0, &j1, a8);
                matmul_share(&L->k, T, x, &xp, &xg, k, buf, n, tid, &j0, &j1, a8);
                matmul_share(&L->v, T, x, &xp, &xg, v, buf, n, tid, &j0, &j1, a8);
#pragma omp barrier
#pragma omp for schedule(static)
                for (int it = 0; it < T * (H + Hkv); it++) {
                    const int t = it / (H + Hkv), i = it % (H + Hkv);
                    const size_t at = ((size_t)(L->rope2 && m->inv_freq2) * T + t) * half;
                    const float *c = cs + at, *s = sn + at;
                    if (i < H) {
                        float *qh = q + (size_t)t * qn + (size_t)i * Dh;
                        if (L->q_norm) rms_norm(qh, L->q_norm, Dh, m->eps, qh);
                        rope(qh, Dh, c, s, m->rope_traditional);
                    } else {
                        const int j = i - H;
                        float *kh = k + (size_t)t * kn + (size_t)j * Dh;
                        if (L->k_norm) rms_norm(kh, L->k_norm, Dh, m->eps, kh);
                        rope(kh, Dh, c, s, m->rope_traditional);
                        const size_t at = ((size_t)j * m->slots + (size_t)slot[t]) * Dh;
                        memcpy(L->kc + at, kh, sizeof(float) * Dh);
                        memcpy(L->vc + at, v + (size_t)t * kn + (size_t)j * Dh, sizeof(float) * Dh);
                    }
                }
#pragma omp for schedule(dynamic, 1)
                for (int it = 0; it < T * Hkv; it++) {
                    const int t = it / Hkv, j = it % Hkv;
                    const int hi = pos[t] + 1, lo = L->window > 0 && hi > L->window ? hi - L->window : 0;
                    const size_t head = (size_t)j * m->slots * Dh, qo = ((size_t)t * H + (size_t)j * G) * Dh;
                    attend_one(G, Dh, q + qo, L->kc + head, L->vc + head, tables + tok_table[t], bs, lo, hi, sl2e,
                               sc, att + qo);
                }
                if (po || bo) {
#pragma omp for schedule(static)
                    for (int t = 0; t < T; t++) {
                        if (po) q4in_row(&attp, att + (size_t)t * qn, t);
                        if (bo) gin_row(&attg, att + (size_t)t * qn, t);
                    }
                }
                matmul_share(&L->o, T, att, &attp, &attg, o, buf, n, tid, &j0, &j1, a8);
#pragma omp barrier
#pragma omp for schedule(static)
                for (int t = 0; t < T; t++) {
                    residual_add(h + (size_t)t * D, o + (size_t)t * D, L->ln_attn_out, D, m->eps);
                    rms_norm(h + (size_t)t * D, L->ln_post, D, m->eps, x + (size_t)t * D);
                    if (px) q4in_row(&xp, x + (size_t)t * D, t);
                    if (bq) gin_row(&xg, x + (size_t)t * D, t);
                }
                matmul_share(&L->gate, T, x, &xp, &xg, g, buf, n, tid, &j0, &j1, a8);
                matmul_share(&L->up, T, x, &xp, &xg, u, buf, n, tid, &j0, &j1, a8);
                for (int t = 0; t < T; t++)  // this thread's columns of gate and up: no barrier before
                    act_mul_range(g + (size_t)t * I, u + (size_t)t * I, j0, j1, m->gelu);
#pragma omp barrier
                if (pd || bd) {
#pragma omp for schedule(static)
                    for (int t = 0; t < T; t++) {
                        if (pd) q4in_row(&gp, g + (size_t)t * I, t);
                        if (bd) gin_row(&gg, g + (size_t)t * I, t);
                    }
                }
                matmul_share(&L->down, T, g, &gp, &gg, o, buf, n, tid, &j0, &j1, a8);
#pragma omp barrier
            }
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                residual_add(h + (size_t)t * D, o + (size_t)t * D, m->layers[m->num_layers - 1].ln_mlp_out, D, m->eps);
                const int a = aux ? aux_slot[m->num_layers] : -1;
                if (a >= 0) memcpy(aux + t * an + (size_t)a * D, h + (size_t)t * D, sizeof(float) * D);
                if (m->final_norm) rms_norm(h + (size_t)t * D, m->final_norm, D, m->eps, h + (size_t)t * D);
            }
        }
    }
    free(x), free(q), free(k), free(v), free(att), free(o), free(g), free(u);
    q4in_free(&xp), q4in_free(&attp), q4in_free(&gp);
    gin_free(&xg), gin_free(&attg), gin_free(&gg);
    free(cs), free(sn), free(scores), free(bufs);
    return rc;
}

// layers_forward_aux with no aux states captured.
int layers_forward(const Stack *m, int T, float *h, const int32_t *pos, const int32_t *slot,
                   const int32_t *tok_table, const int32_t *tables, int bs, int max_ctx, int max_threads) {
    return layers_forward_aux(m, T, h, pos, slot, tok_table, tables, bs, max_ctx, max_threads, NULL, NULL, 0);
}
