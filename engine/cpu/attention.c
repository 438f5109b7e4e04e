// Paged attention for the CPU over the head-major float32 KV cache (see engine/cpu/attention.py).
//
// Why: on MLX's CPU backend the reference path (gather blocks, scores, mask, softmax, weighted sum as
// separate ops) cost about as much as all the weight matmuls of a SmolLM2 step, and every verified draft
// row added its own masks and exponentials. Here one call per layer, with the step's new keys/values
// already in their slots (MLX's scatter) attends every (token, KV head) straight from the block table.
//
// Each (token, query head) output is the same sequence of float operations whatever else is in the
// step: keys in position order, fixed-order dot products and sums, one max, the same exponential.
// So a token verified as a draft gets bitwise the attention output it would get decoded alone.
#define _GNU_SOURCE
#include "simd.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static inline const float *slot_row(const float *cache, const int32_t *table, int bs, int D, int p) {
    return cache + ((size_t)table[p / bs] * bs + p % bs) * D;
}

// Softmax of one head's n scores in place (already scaled by log2 e); returns 1 / sum.
static inline float softmax2(float *sg, int n) {
    float m = sg[0];
    for (int j = 1; j < n; j++) m = sg[j] > m ? sg[j] : m;
    const vf mv = vset1(m);
    vf sum = vzero();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const vf e = vexp2_neg(vsub(vload(sg + j), mv));
        vstore(sg + j, e);
        sum = vadd(sum, e);
    }
    if (j < n) {  // the lanes past n are reloaded as 0 before they are summed
        vf e = vexp2_neg(vsub(vloadn(sg + j, n - j), mv));
        vstoren(sg + j, e, n - j);
        e = vloadn(sg + j, n - j);
        sum = vadd(sum, e);
    }
    return 1.0f / vhsum(sum);
}

// One (token, KV head): its G query heads against keys lo..hi-1 (positions), read through the table.
// q: [G, D] rows of this KV head's query heads; out: [G, D]; s: scratch for G * (hi - lo) scores.
// Per head: scores 16 keys at a time (reduce16), softmax, then the values weighted in key order.
// NV = D / 16 vectors per row. Inlined with a constant NV the query row and the head's output stay in
// registers; the arithmetic per output element is the same for every NV and call site.
SS_INLINE void attend(const int NV, int G, const float *q, const float *kc,
        const float *vc, const int32_t *table, int bs, int lo, int hi, float scale_log2e, float *s, float *out) {
    const int D = 16 * NV, n = hi - lo;
    for (int g = 0; g < G; g++) {
        vf qv[NV], acc[16], o[NV];
        for (int v = 0; v < NV; v++) qv[v] = vload(q + (size_t)g * D + 16 * v);
        float *sg = s + (size_t)g * n;
        for (int j0 = 0; j0 < n; j0 += 16) {
            const int cnt = n - j0 < 16 ? n - j0 : 16;
            for (int jj = 0; jj < 16; jj++) {
                vf a = vzero();
                if (jj < cnt) {
                    const float *k = slot_row(kc, table, bs, D, lo + j0 + jj);
                    a = vmul(qv[0], vload(k));
                    for (int v = 1; v < NV; v++) a = vfma(qv[v], vload(k + 16 * v), a);
                }
                acc[jj] = a;
            }
            vstoren(sg + j0, vmul(vhsum16(acc), vset1(scale_log2e)), cnt);
        }
        const float inv = softmax2(sg, n);
        for (int v = 0; v < NV; v++) o[v] = vzero();
        for (int j = 0; j < n; j++) {
            const float *vr = slot_row(vc, table, bs, D, lo + j);
            const vf w = vset1(sg[j]);
            for (int v = 0; v < NV; v++) o[v] = vfma(w, vload(vr + 16 * v), o[v]);
        }
        const vf iv = vset1(inv);
        for (int v = 0; v < NV; v++) vstore(out + (size_t)g * D + 16 * v, vmul(o[v], iv));
    }
}

static void attend_one(int G, int D, const float *q, const float *kc, const float *vc, const int32_t *table,
                       int bs, int lo, int hi, float scale_log2e, float *s, float *out) {
    switch (D) {  // the common head sizes with a constant NV; any other multiple of 16 without
    case 32: attend(2, G, q, kc, vc, table, bs, lo, hi, scale_log2e, s, out); break;
    case 64: attend(4, G, q, kc, vc, table, bs, lo, hi, scale_log2e, s, out); break;
    case 128: attend(8, G, q, kc, vc, table, bs, lo, hi, scale_log2e, s, out); break;
    default: attend(D / 16, G, q, kc, vc, table, bs, lo, hi, scale_log2e, s, out);
    }
}

typedef struct {
    int T, H, Hkv, D, bs, window, max_ctx;
    const float *q, *kc, *vc;
    long S;
    const int32_t *pos, *tok_table, *tables;
    float sl2e;
    float *out;
    long next;  // the next (token, KV head) item to take, shared by the threads
    int failed;
} Job;

static void *run_items(void *arg) {
    Job *jb = arg;
    const int G = jb->H / jb->Hkv;
    float *s = malloc(sizeof(float) * (size_t)G * (size_t)jb->max_ctx);
    if (s == NULL) {
        __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    const long items = (long)jb->T * jb->Hkv;
    for (long it; (it = __atomic_fetch_add(&jb->next, 1, __ATOMIC_RELAXED)) < items;) {
        const int t = (int)(it / jb->Hkv), h = (int)(it % jb->Hkv);
        const int hi = jb->pos[t] + 1;
        const int lo = jb->window > 0 && hi > jb->window ? hi - jb->window : 0;
        const size_t head = (size_t)h * jb->S * jb->D, qo = ((size_t)t * jb->H + (size_t)h * G) * jb->D;
        attend_one(G, jb->D, jb->q + qo, jb->kc + head, jb->vc + head, jb->tables + jb->tok_table[t], jb->bs, lo,
                   hi, jb->sl2e, s, jb->out + qo);
    }
    free(s);
    return NULL;
}

static int usable_cpus(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
    const int n = CPU_COUNT(&set);
#else  // macOS: no affinity masks
    const int n = (int)sysconf(_SC_NPROCESSORS_ONLN);
#endif
    return n < 1 ? 1 : n;
}

// q: [T, H, D]; kc, vc: head-major caches [Hkv, S, D] holding this step's new keys/values already;
// pos, tok_table: [T] (each token's position, the offset of its request's block table in `tables`);
// window: sliding window (0: none); max_ctx: the longest context (scratch size); out: [T, H, D].
// Returns 0, or -1 when scratch memory could not be allocated (out is then undefined).
//
// Threads: the caller's alone unless the step has much attention work (long prefill chunks); then
// short-lived pthreads take items from a shared counter. Not OpenMP: this runs on the Python thread
// while MLX calls the small-M GEMM's OpenMP regions from its own, and a second OpenMP pool would keep
// spinning workers on the cores the GEMM needs, slowing the short verification steps.
int cpu_paged_attention(int T, int H, int Hkv, int D, const float *q, const float *kc, const float *vc, long S,
                        const int32_t *pos, const int32_t *tok_table, const int32_t *tables, int bs, int window,
                        float scale, int max_ctx, int max_threads, float *out) {
    Job jb = {T, H, Hkv, D, bs, window, max_ctx, q, kc, vc, S, pos, tok_table, tables,
              scale * 1.4426950408889634f, out, 0, 0};
    double work = 0;
    for (int t = 0; t < T; t++) work += pos[t] + 1;
    work *= (double)H * D;
    enum { MAX_THREADS = 64 };
    int nth = work > 1e7 ? usable_cpus() : 1;
    if (nth > max_threads) nth = max_threads < 1 ? 1 : max_threads;
    if (nth > MAX_THREADS) nth = MAX_THREADS;
    if (nth > (long)T * Hkv) nth = (int)((long)T * Hkv);
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int i = 1; i < nth; i++, started++)
        if (pthread_create(&tids[started], NULL, run_items, &jb) != 0) break;
    run_items(&jb);
    for (int i = 0; i < started; i++) pthread_join(tids[i], NULL);
    return jb.failed ? -1 : 0;
}
