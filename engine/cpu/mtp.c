// The draft loop of a trained MTP assistant (engine/models/mtp_trained.py) for a few requests, on the CPU:
// mtp_draft runs MTPProposer.draft's passes, cut-offs and early stop; mtp_pass is one pass; mtp_step is
// one pass returning the head's logits, for drafts drawn in Python.
//
// Why C: through MLX, an assistant pass is dozens of small ops, each built in Python and dispatched
// on its own, over a few million float32 weights that the target's step has evicted from the caches.
// Here the weights are the checkpoint's float16 values (half the bytes), converted in registers, a
// pass is a handful of loops with no per-op dispatch, and no Python runs between passes. One thread
// throughout (see gemv_f16). Figures: docs/design-notes.md.
//
// Same arithmetic as the MLX module up to float rounding: pre_projection, RMSNorm, query projection,
// RoPE (split halves), attention over the target's head-major paged KV (keys at positions < the query's),
// output projection, RMSNorm, SwiGLU MLP, final RMSNorm, reduced-vocabulary head (argmax and its
// probability), post_projection. Drafts are verified by the target, so rounding never reaches outputs.
#include "head_ops.h"

#include <stdlib.h>

typedef struct {
    int backbone, hidden, heads, kv_heads, head_dim, inter, head_size;
    float eps, rope_base;
    // [out, in] row-major float16 matrices
    const uint16_t *pre, *q, *o, *gate, *up, *down, *head, *post;
    // RMSNorm weights, float32
    const float *ln_in, *ln_post, *ln_final;
} Assistant;

// One pass for n requests. x: [n, 2 * backbone] = [scaled target embedding of the newest token, hidden
// state]; pos[r]: the query position (keys 0..pos-1 exist); tables: [n, table_len] block ids.
// Out: best[r] (head row of the argmax), prob[r] (its softmax probability), next_hidden [n, backbone]
// (post_projection) and logits_out [n, head_size] when not NULL. Returns 0, or -1 when scratch memory
// cannot be had.
static int mtp_pass(const Assistant *a, int n, const float *x, const int32_t *pos, const int32_t *tables,
                    int table_len, int block_size, const float *kc, const float *vc, long slots,
                    int32_t *best, float *prob, float *next_hidden, float *logits_out) {
    const int d = a->hidden, qd = a->heads * a->head_dim;
    int max_pos = 1;
    for (int r = 0; r < n; r++) max_pos = pos[r] > max_pos ? pos[r] : max_pos;
    const size_t need = (size_t)n * (3 * d + 2 * qd + 2 * a->inter + a->head_size) + max_pos;
    float *buf = malloc(sizeof(float) * need);
    if (!buf) return -1;
    float *h = buf, *t = h + (size_t)n * d, *u = t + (size_t)n * d, *q = u + (size_t)n * d,
          *att = q + (size_t)n * qd, *g = att + (size_t)n * qd, *up = g + (size_t)n * a->inter,
          *logits = up + (size_t)n * a->inter, *scores = logits + (size_t)n * a->head_size;

    gemv_f16(a->pre, d, 2 * a->backbone, x, n, h);  // h: residual stream
    for (int r = 0; r < n; r++) rms_norm(h + (size_t)r * d, a->ln_in, d, a->eps, t + (size_t)r * d);
    gemv_f16(a->q, qd, d, t, n, q);
    for (int r = 0; r < n; r++) {
        for (int hh = 0; hh < a->heads; hh++) rope(q + (size_t)r * qd + (size_t)hh * a->head_dim,
                                                   a->head_dim, pos[r], a->rope_base);
        attend(a->heads, a->kv_heads, a->head_dim, q + (size_t)r * qd, pos[r], tables + (size_t)r * table_len,
               block_size, kc, vc, slots, att + (size_t)r * qd, scores);
    }
    gemv_f16(a->o, d, qd, att, n, u);
    for (size_t i = 0; i < (size_t)n * d; i++) h[i] += u[i];
    for (int r = 0; r < n; r++) rms_norm(h + (size_t)r * d, a->ln_post, d, a->eps, t + (size_t)r * d);
    gemv_f16(a->gate, a->inter, d, t, n, g);
    gemv_f16(a->up, a->inter, d, t, n, up);
    for (size_t i = 0; i < (size_t)n * a->inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * up[i];
    gemv_f16(a->down, d, a->inter, g, n, u);
    for (size_t i = 0; i < (size_t)n * d; i++) h[i] += u[i];
    for (int r = 0; r < n; r++) rms_norm(h + (size_t)r * d, a->ln_final, d, a->eps, t + (size_t)r * d);
    gemv_f16(a->head, a->head_size, d, t, n, logits);
    for (int r = 0; r < n; r++) {
        const float *l = logits + (size_t)r * a->head_size;
        const int arg = argmax_f32(l, a->head_size);
        double sum = 0.0;
        for (int i = 0; i < a->head_size; i++) sum += exp((double)(l[i] - l[arg]));
        best[r] = arg;
        prob[r] = (float)(1.0 / sum);
    }
    if (next_hidden) gemv_f16(a->post, a->backbone, d, t, n, next_hidden);
    if (logits_out) memcpy(logits_out, logits, sizeof(float) * (size_t)n * a->head_size);
    free(buf);
    return 0;
}

// Fill x [n, 2 * backbone] with each request's scaled token embedding and hidden row.
static void pass_input(int n, int b, const int32_t *tok, const float *hidden, const float *embed,
                       float embed_scale, float *x) {
    for (int r = 0; r < n; r++) {
        const float *e = embed + (size_t)tok[r] * b;
        float *xr = x + (size_t)r * 2 * b;
        for (int i = 0; i < b; i++) xr[i] = e[i] * embed_scale;
        memcpy(xr + b, hidden + (size_t)r * b, sizeof(float) * b);
    }
}

// One pass for drafters that choose tokens themselves (draws from the assistant's distribution): the
// head's logits [n, head_size] and, when not NULL, the next hidden rows [n, backbone] (in place of
// hidden is allowed). tokens: each request's newest token id. Returns 0, or -1 (no memory).
int mtp_step(const Assistant *a, int n, const int32_t *tokens, float *hidden, const float *embed,
             float embed_scale, const int32_t *pos, const int32_t *tables, int table_len, int block_size,
             const float *kc, const float *vc, long slots, float *logits, float *next_hidden) {
    const int b = a->backbone;
    float *x = malloc(sizeof(float) * ((size_t)n * 2 * b + n));
    int32_t *best = malloc(sizeof(int32_t) * (size_t)n);
    int rc = -1;
    if (x && best) {
        pass_input(n, b, tokens, hidden, embed, embed_scale, x);
        rc = mtp_pass(a, n, x, pos, tables, table_len, block_size, kc, vc, slots, best,
                      x + (size_t)n * 2 * b, next_hidden, logits);
    }
    free(x);
    free(best);
    return rc;
}

// MTPProposer.draft's loop (engine/spec/mtp.py) in one call, so that no Python runs between passes:
// pass j drafts for the requests still going; request r stops at its first draft whose probability is
// below cuts[min(j, ncuts - 1)], or after want[r] drafts; no pass runs once every request has stopped.
// tokens[n]: each request's newest token; hidden: [n, backbone] target hidden rows (overwritten);
// embed: the target's [vocab, backbone] float32 embedding, times embed_scale; head_ids: token id per head
// row. Out: drafts [n, max_k] (the first lengths[r] of row r are set). Returns 0, or -1 (no memory).
int mtp_draft(const Assistant *a, int n, const int64_t *tokens, float *hidden, const float *embed,
              float embed_scale, const int32_t *head_ids, const int32_t *pos, const int32_t *tables,
              int table_len, int block_size, const float *kc, const float *vc, long slots, const float *cuts,
              int ncuts, const int32_t *want, int max_k, int32_t *drafts, int32_t *lengths) {
    const int b = a->backbone;
    float *x = malloc(sizeof(float) * ((size_t)n * 2 * b + n));
    int32_t *best = malloc(sizeof(int32_t) * (size_t)n * 2);
    if (!x || !best) {
        free(x);
        free(best);
        return -1;
    }
    float *prob = x + (size_t)n * 2 * b;
    int32_t *tok = best + n;
    for (int r = 0; r < n; r++) {
        tok[r] = (int32_t)tokens[r];
        lengths[r] = 0;
    }
    int rc = 0, going = n;
    for (int j = 0; j < max_k && going > 0; j++) {
        pass_input(n, b, tok, hidden, embed, embed_scale, x);
        rc = mtp_pass(a, n, x, pos, tables, table_len, block_size, kc, vc, slots, best, prob,
                      j + 1 < max_k ? hidden : NULL, NULL);
        if (rc) break;
        const float cut = cuts[j < ncuts ? j : ncuts - 1];
        going = 0;
        for (int r = 0; r < n; r++) {
            tok[r] = head_ids[best[r]];
            if (lengths[r] == j && j < want[r] && prob[r] >= cut) {
                drafts[(size_t)r * max_k + j] = tok[r];
                lengths[r]++;
                going += lengths[r] < want[r];
            }
        }
    }
    free(x);
    free(best);
    return rc;
}
