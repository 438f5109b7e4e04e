// Paged attention for the CPU over the head-major float32 KV cache (see engine/attention/cpu.py).
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
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// 2^x for x <= 0 (inputs below -126 give 0): x = n + f with n = round(x), f in [-0.5, 0.5], 2^f by its
// degree-6 Taylor polynomial (relative error < 2e-7), scaled by 2^n with vscalefps.
static inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512 r = _mm512_scalef_ps(p, n);
    // Below -126 the result would be denormal: 0, as for a key far below the maximum.
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ), r);
}

// 16 vectors -> one vector: lane i holds the sum of the lanes of a[P(i)], P = {0, 4, 8, 12, 1, 5, ...}
// (a 4 x 4 transpose, its own inverse). A fixed tree: 15 adds and 30 shuffles where 16 separate
// horizontal sums took ~8 instructions each.
static inline __m512 reduce16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}
static const int REDUCE16_SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

static inline const float *slot_row(const float *cache, const int32_t *table, int bs, int D, int p) {
    return cache + ((size_t)table[p / bs] * bs + p % bs) * D;
}

// Softmax of one head's n scores in place (already scaled by log2 e); returns 1 / sum.
static inline float softmax2(float *sg, int n) {
    float m = sg[0];
    for (int j = 1; j < n; j++) m = sg[j] > m ? sg[j] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mv));
        _mm512_storeu_ps(sg + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
        const __mmask16 t = (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(t, exp2_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, sg + j), mv)));
        _mm512_mask_storeu_ps(sg + j, t, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

// One (token, KV head): its G query heads against keys lo..hi-1 (positions), read through the table.
// q: [G, D] rows of this KV head's query heads; out: [G, D]; s: scratch for G * (hi - lo) scores.
// Per head: scores 16 keys at a time (reduce16), softmax, then the values weighted in key order.
// NV = D / 16 vectors per row. Inlined with a constant NV the query row and the head's output stay in
// registers; the arithmetic per output element is the same for every NV and call site.
static inline __attribute__((always_inline)) void attend(const int NV, int G, const float *q, const float *kc,
        const float *vc, const int32_t *table, int bs, int lo, int hi, float scale_log2e, float *s, float *out) {
    const int D = 16 * NV, n = hi - lo;
    for (int g = 0; g < G; g++) {
        __m512 qv[NV], acc[16], o[NV];
        for (int v = 0; v < NV; v++) qv[v] = _mm512_loadu_ps(q + (size_t)g * D + 16 * v);
        float *sg = s + (size_t)g * n;
        for (int j0 = 0; j0 < n; j0 += 16) {
            const int cnt = n - j0 < 16 ? n - j0 : 16;
            for (int jj = 0; jj < 16; jj++) {
                __m512 a = _mm512_setzero_ps();
                if (jj < cnt) {
                    const float *k = slot_row(kc, table, bs, D, lo + j0 + jj);
                    a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                    for (int v = 1; v < NV; v++) a = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + 16 * v), a);
                }
                acc[REDUCE16_SLOT[jj]] = a;
            }
            _mm512_mask_storeu_ps(sg + j0, (__mmask16)((1u << cnt) - 1),
                                  _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale_log2e)));
        }
        const float inv = softmax2(sg, n);
        for (int v = 0; v < NV; v++) o[v] = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const float *vr = slot_row(vc, table, bs, D, lo + j);
            const __m512 w = _mm512_set1_ps(sg[j]);
            for (int v = 0; v < NV; v++) o[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * v), o[v]);
        }
        const __m512 iv = _mm512_set1_ps(inv);
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + (size_t)g * D + 16 * v, _mm512_mul_ps(o[v], iv));
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
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
    const int n = CPU_COUNT(&set);
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
