// The draft loop of an EAGLE-3 head (engine/models/eagle3.py) for a few requests, on the CPU, with the
// head's own head-major float32 paged KV: eagle3_draft runs Eagle3Proposer.propose's passes in one call.
//
// Why C: through MLX a head pass is dozens of small ops dispatched one by one from Python, over float32
// weights the target's step has evicted from the caches; here the weights are int8 rows (a quarter of the
// bytes), a pass is a handful of loops and no Python runs between passes (the MTP assistant's reasons,
// mtp.c).
//
// Same arithmetic as Eagle3Head.__call__ up to float rounding: fc over the target's fused features, RMSNorm
// of the embedding and of the hidden, their concatenation through q/k/v, RoPE (split halves), K and V into
// the paged cache, attention over positions 0..p, output projection onto the normed (or raw) hidden,
// RMSNorm, SwiGLU MLP, final RMSNorm and the draft-vocabulary head (argmax). Drafts are verified by the
// target, so rounding never reaches outputs.
#include "head_ops.h"

#include <stdlib.h>

typedef struct {
    int hidden, target_hidden, heads, kv_heads, head_dim, inter, vocab, norm_before_residual;
    float eps, rope_base;
    HeadMat fc, q, k, v, o, gate, up, down, head;  // [out, in]
    // RMSNorm weights, float32
    const float *ln_in, *ln_hidden, *ln_post, *ln_final;
} Eagle3;

// The caller's buffers: the paged cache and each request's block table.
typedef struct {
    float *kc, *vc;  // [kv_heads, slots, head_dim]
    long slots;
    const int32_t *tables;  // [requests, table_len]
    int table_len, block_size;
} HeadKV;

// One pass over n rows: row i is token tok[i] at position pos[i] of request req[i], with hid[i] its input
// hidden (fused features, or the previous pass's output), replaced by the layer's output. Every row's K
// and V are written before any row attends, so a request's rows see each other causally. Rows with
// last[i] set also get their draft-vocabulary argmax in best[i]. Returns 0, or -1 (no memory).
static int e3_pass(const Eagle3 *a, const HeadKV *kv, int n, const int32_t *tok, float *hid, const float *embed,
                   const int32_t *pos, const int32_t *req, const uint8_t *last, int32_t *best, int threads) {
    const int d = a->hidden, hd = a->head_dim, qd = a->heads * hd, kvd = a->kv_heads * hd;
    int max_pos = 1, picked = 0;
    for (int r = 0; r < n; r++) {
        max_pos = pos[r] + 1 > max_pos ? pos[r] + 1 : max_pos;
        picked += last[r] != 0;
    }
    const size_t need = (size_t)n * (2 * d + 2 * d + qd + 2 * kvd + qd + 2 * a->inter) +
                        (size_t)picked * (d + a->vocab) + max_pos;
    float *buf = malloc(sizeof(float) * need);
    if (!buf) return -1;
    float *x = buf, *t = x + (size_t)n * 2 * d, *u = t + (size_t)n * d, *q = u + (size_t)n * d,
          *k = q + (size_t)n * qd, *v = k + (size_t)n * kvd, *att = v + (size_t)n * kvd,
          *g = att + (size_t)n * qd, *up = g + (size_t)n * a->inter, *sel = up + (size_t)n * a->inter,
          *logits = sel + (size_t)picked * d, *scores = logits + (size_t)picked * a->vocab;

    for (int r = 0; r < n; r++) {  // x = [norm(embedding); norm(hidden)]
        float *xr = x + (size_t)r * 2 * d;
        rms_norm(embed + (size_t)tok[r] * d, a->ln_in, d, a->eps, xr);
        rms_norm(hid + (size_t)r * d, a->ln_hidden, d, a->eps, xr + d);
    }
    gemv(a->q, qd, 2 * d, x, n, q, threads);
    gemv(a->k, kvd, 2 * d, x, n, k, threads);
    gemv(a->v, kvd, 2 * d, x, n, v, threads);
    for (int r = 0; r < n; r++) {
        for (int h = 0; h < a->heads; h++) rope(q + (size_t)r * qd + (size_t)h * hd, hd, pos[r], a->rope_base);
        const size_t s = kv_slot(kv->tables + (size_t)req[r] * kv->table_len, kv->block_size, pos[r]);
        for (int h = 0; h < a->kv_heads; h++) {
            float *kr = k + (size_t)r * kvd + (size_t)h * hd;
            rope(kr, hd, pos[r], a->rope_base);
            memcpy(kv->kc + ((size_t)h * kv->slots + s) * hd, kr, sizeof(float) * hd);
            memcpy(kv->vc + ((size_t)h * kv->slots + s) * hd, v + (size_t)r * kvd + (size_t)h * hd,
                   sizeof(float) * hd);
        }
    }
    for (int r = 0; r < n; r++)
        attend(a->heads, a->kv_heads, hd, q + (size_t)r * qd, pos[r] + 1,
               kv->tables + (size_t)req[r] * kv->table_len, kv->block_size, kv->kc, kv->vc, kv->slots,
               att + (size_t)r * qd, scores);
    gemv(a->o, d, qd, att, n, u, threads);
    for (int r = 0; r < n; r++) {  // hid = (normed or raw hidden) + attention
        float *hr = hid + (size_t)r * d;
        const float *base = a->norm_before_residual ? x + (size_t)r * 2 * d + d : hr;
        for (int i = 0; i < d; i++) hr[i] = base[i] + u[(size_t)r * d + i];
        rms_norm(hr, a->ln_post, d, a->eps, t + (size_t)r * d);
    }
    gemv(a->gate, a->inter, d, t, n, g, threads);
    gemv(a->up, a->inter, d, t, n, up, threads);
    for (size_t i = 0; i < (size_t)n * a->inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * up[i];
    gemv(a->down, d, a->inter, g, n, u, threads);
    for (size_t i = 0; i < (size_t)n * d; i++) hid[i] += u[i];
    if (picked) {
        int m = 0;
        for (int r = 0; r < n; r++)
            if (last[r]) rms_norm(hid + (size_t)r * d, a->ln_final, d, a->eps, sel + (size_t)(m++) * d);
        gemv(a->head, a->vocab, d, sel, picked, logits, threads);
        m = 0;
        for (int r = 0; r < n; r++)
            if (last[r]) best[r] = argmax_f32(logits + (size_t)(m++) * a->vocab, a->vocab);
    }
    free(buf);
    return 0;
}

// One weight product as the passes run it (tests/kernels/isa_harness.c checks its rows across ISAs and
// thread blocks).
int eagle3_gemv(const HeadMat *m, int out, int in, const float *x, int n, float *y, int threads) {
    gemv(*m, out, in, x, n, y, threads);
    return 0;
}

// Eagle3Proposer.propose for n requests in one call. Request r has counts[r] >= 1 catch-up rows: tokens
// tokens[...] at positions first[r]..first[r] + counts[r] - 1 with the target's features feats[...]
// ([rows, 3 * target_hidden], in request order); its first draft comes from its last catch-up row, draft
// j > 0 from draft j - 1 at the next position, until want[r] drafts (0: the catch-up rows only). embed:
// the [vocab, hidden] float32 token embedding; ids: the target id of each draft-vocabulary row. Out:
// drafts [n, max_k] (the first want[r] of row r). The tables must hold every slot a draft writes; threads:
// the most a product of many rows may use. Returns 0, or -1 (no memory).
int eagle3_draft(const Eagle3 *a, const HeadKV *kv, int n, const int32_t *counts, const int32_t *tokens,
                 const float *feats, const float *embed, const int32_t *ids, const int32_t *first,
                 const int32_t *want, int max_k, int32_t *drafts, int threads) {
    const int d = a->hidden;
    int rows = 0;
    for (int r = 0; r < n; r++) rows += counts[r];
    const size_t cap = (size_t)(rows > n ? rows : n);
    float *hid = malloc(sizeof(float) * cap * d);
    int32_t *ints = malloc(sizeof(int32_t) * cap * 4 + cap);
    if (!hid || !ints) {
        free(hid);
        free(ints);
        return -1;
    }
    int32_t *pos = ints, *req = pos + cap, *best = req + cap, *tok = best + cap;
    uint8_t *last = (uint8_t *)(tok + cap);
    gemv(a->fc, d, 3 * a->target_hidden, feats, rows, hid, threads);
    for (int r = 0, i = 0; r < n; r++)
        for (int c = 0; c < counts[r]; c++, i++) {
            pos[i] = first[r] + c;
            req[i] = r;
            last[i] = c + 1 == counts[r] && want[r] > 0;
            tok[i] = tokens[i];
        }
    int rc = e3_pass(a, kv, rows, tok, hid, embed, pos, req, last, best, threads);
    // Keep each request's last row (its hidden) at index r; rows then stay in request order.
    for (int r = 0, i = 0; r < n && !rc; r++) {
        i += counts[r];
        memmove(hid + (size_t)r * d, hid + (size_t)(i - 1) * d, sizeof(float) * d);
        req[r] = r;
        if (want[r] > 0) drafts[(size_t)r * max_k] = ids[best[i - 1]];
    }
    for (int j = 1, cur = n; j < max_k && !rc; j++) {
        int live = 0;  // the rows of requests still drafting, packed to the front
        for (int i = 0; i < cur; i++) {
            const int r = req[i];
            if (want[r] <= j) continue;
            if (live != i) memmove(hid + (size_t)live * d, hid + (size_t)i * d, sizeof(float) * d);
            tok[live] = drafts[(size_t)r * max_k + j - 1];
            pos[live] = first[r] + counts[r] - 1 + j;
            req[live] = r;
            last[live] = 1;
            live++;
        }
        if (!live) break;
        cur = live;
        rc = e3_pass(a, kv, live, tok, hid, embed, pos, req, last, best, threads);
        for (int i = 0; i < live && !rc; i++) drafts[(size_t)req[i] * max_k + j] = ids[best[i]];
    }
    free(hid);
    free(ints);
    return rc;
}
