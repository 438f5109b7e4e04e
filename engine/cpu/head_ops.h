// Small-model building blocks shared by the draft heads' C loops (mtp.c, eagle3.c): float16 weight
// products, RMSNorm, split-halves RoPE and attention of one query row over a head-major paged KV cache.
// Each row's float operations are the same whatever the number of rows, so a draft never depends on
// which other requests share its pass.
#ifndef SPECSERVE_HEAD_OPS_H
#define SPECSERVE_HEAD_OPS_H
#include "simd.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

// A weight matrix [out, in], row-major: float16, or int8 rows with one float32 scale each (W[j] = scale[j] *
// Q[j]: half float16's bytes; the draft loops' products read the weights from memory every pass).
typedef struct {
    const void *w;
    const float *scale;  // NULL: float16
} HeadMat;

SS_INLINE vf mat_load(const void *row, int k, int i8) {
    return i8 ? vload_i8((const int8_t *)row + k) : vload_f16((const uint16_t *)row + k);
}

SS_INLINE float mat_at(const void *row, int k, int i8) {
    return i8 ? (float)((const int8_t *)row)[k] : f16_to_f32(((const uint16_t *)row)[k]);
}

// y[r, j] = dot(W[j, :], x[r, :]) for r < n, j < out (int8: the sum, then times scale[j]). Rows go four at
// a time so each weight vector is converted once per four rows, and in blocks that stay in L2 while the
// weights stream past once per block (a prompt's catch-up carries hundreds of rows: streaming the rows once
// per weight row instead read them from memory out times). Sixteen rows or more split into blocks across
// `threads` (the engine's thread policy); fewer take one thread (splitting a few rows' outputs between two
// cores was slower).
SS_INLINE void gemv_body(const void *w, const float *scale, int i8, int out, int in, const float *x, int n,
                         float *y, int threads) {
    const int full = in & ~15;
    const size_t esize = i8 ? 1 : 2;
    const int nth = n >= 16 && threads > 1 ? threads : 1, even = ((n + nth - 1) / nth + 3) & ~3;
    int block = (int)((192u << 10) / (sizeof(float) * (size_t)in)) & ~3;
    block = even < block ? even : block;
    block = block < 4 ? 4 : block;
    const int blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nth) if (nth > 1)
    for (int b = 0; b < blocks; b++) {
        const int r0 = b * block, r1 = r0 + block < n ? r0 + block : n, r4 = r0 + ((r1 - r0) & ~3);
        for (int j0 = 0; j0 < out; j0 += 4) {
            const int j1 = j0 + 4 < out ? j0 + 4 : out;
            for (int j = j0; j < j1; j++) {
                const void *row = (const char *)w + (size_t)j * in * esize;
                const float sc = i8 ? scale[j] : 1.0f;
                for (int r = r0; r < r4; r += 4) {
                    const float *x0 = x + (size_t)r * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
                    vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
                    for (int k = 0; k < full; k += 16) {
                        const vf wk = mat_load(row, k, i8);
                        a0 = vfma(wk, vload(x0 + k), a0);
                        a1 = vfma(wk, vload(x1 + k), a1);
                        a2 = vfma(wk, vload(x2 + k), a2);
                        a3 = vfma(wk, vload(x3 + k), a3);
                    }
                    float s[4] = {vhsum(a0), vhsum(a1), vhsum(a2), vhsum(a3)};
                    for (int i = 0; i < 4; i++) {
                        const float *xr = x0 + (size_t)i * in;
                        for (int k = full; k < in; k++) s[i] += mat_at(row, k, i8) * xr[k];
                        y[(size_t)(r + i) * out + j] = i8 ? s[i] * sc : s[i];
                    }
                }
            }
            // Rows left over (a draft's single row) take four weight rows at once: four independent FMA
            // chains where one chain's latency bounded the pass; each output's operations are unchanged.
            for (int r = r4; r < r1; r++) {
                const float *xr = x + (size_t)r * in;
                if (j1 - j0 == 4) {
                    const char *rows[4];
                    for (int i = 0; i < 4; i++) rows[i] = (const char *)w + (size_t)(j0 + i) * in * esize;
                    vf c0 = vzero(), c1 = vzero(), c2 = vzero(), c3 = vzero();
                    for (int k = 0; k < full; k += 16) {
                        const vf xk = vload(xr + k);
                        c0 = vfma(mat_load(rows[0], k, i8), xk, c0);
                        c1 = vfma(mat_load(rows[1], k, i8), xk, c1);
                        c2 = vfma(mat_load(rows[2], k, i8), xk, c2);
                        c3 = vfma(mat_load(rows[3], k, i8), xk, c3);
                    }
                    float s[4] = {vhsum(c0), vhsum(c1), vhsum(c2), vhsum(c3)};
                    for (int i = 0; i < 4; i++) {
                        for (int k = full; k < in; k++) s[i] += mat_at(rows[i], k, i8) * xr[k];
                        y[(size_t)r * out + j0 + i] = i8 ? s[i] * scale[j0 + i] : s[i];
                    }
                    continue;
                }
                for (int j = j0; j < j1; j++) {
                    const void *row = (const char *)w + (size_t)j * in * esize;
                    vf acc = vzero();
                    for (int k = 0; k < full; k += 16) acc = vfma(mat_load(row, k, i8), vload(xr + k), acc);
                    float s = vhsum(acc);
                    for (int k = full; k < in; k++) s += mat_at(row, k, i8) * xr[k];
                    y[(size_t)r * out + j] = i8 ? s * scale[j] : s;
                }
            }
        }
    }
}

// One thread (mtp.c: its passes carry one row per drafting request).
static void gemv_f16(const uint16_t *w, int out, int in, const float *x, int n, float *y) {
    gemv_body(w, NULL, 0, out, in, x, n, y, 1);
}

static void gemv(HeadMat m, int out, int in, const float *x, int n, float *y, int threads) {
    if (m.scale) gemv_body(m.w, m.scale, 1, out, in, x, n, y, threads);
    else gemv_body(m.w, NULL, 0, out, in, x, n, y, threads);
}

static void rms_norm(const float *x, const float *g, int d, float eps, float *y) {
    double ss = 0.0;
    for (int i = 0; i < d; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / d) + eps);
    for (int i = 0; i < d; i++) y[i] = x[i] * inv * g[i];
}

// Split-halves RoPE (mlx.nn.RoPE, traditional=False) of one head at position p.
static void rope(float *v, int d, int p, float base) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float theta = (float)p * powf(base, -(float)(2 * i) / (float)d);
        const float c = cosf(theta), s = sinf(theta);
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = a * s + b * c;
    }
}

// The cache slot of position t: table[t / block_size] * block_size + t % block_size.
static inline size_t kv_slot(const int32_t *table, int block_size, int t) {
    return (size_t)table[t / block_size] * block_size + t % block_size;
}

// Attention of one row's `heads` query heads over its keys at positions 0..count-1 in the head-major
// cache ([kv_heads, slots, head_dim]); scores: scratch of count floats.
static void attend(int heads, int kv_heads, int d, const float *q, int count, const int32_t *table,
                   int block_size, const float *kc, const float *vc, long slots, float *out, float *scores) {
    const int group = heads / kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    for (int h = 0; h < heads; h++) {
        const int kvh = h / group;
        const float *qh = q + (size_t)h * d;
        const float *kbase = kc + (size_t)kvh * slots * d, *vbase = vc + (size_t)kvh * slots * d;
        float mx = -INFINITY;
        for (int t = 0; t < count; t++) {
            const float *k = kbase + kv_slot(table, block_size, t) * d;
            float s = 0.0f;
            for (int i = 0; i < d; i++) s += qh[i] * k[i];
            scores[t] = s * scale;
            if (scores[t] > mx) mx = scores[t];
        }
        float sum = 0.0f;
        for (int t = 0; t < count; t++) {
            scores[t] = expf(scores[t] - mx);
            sum += scores[t];
        }
        float *oh = out + (size_t)h * d;
        memset(oh, 0, sizeof(float) * d);
        for (int t = 0; t < count; t++) {
            const float *v = vbase + kv_slot(table, block_size, t) * d;
            const float w = scores[t] / sum;
            for (int i = 0; i < d; i++) oh[i] += w * v[i];
        }
    }
}

// Index of the largest of l[0..n-1] (the first on ties).
static int argmax_f32(const float *l, int n) {
    int arg = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[arg]) arg = i;
    return arg;
}
#endif
