// Small-M float32 GEMM placed in front of the BLAS that MLX calls (see engine/cpu/gemm.py).
//
// Why: a decode step multiplies 1 row per request by every weight matrix, and draft verification
// 1 + K rows. MKL switches from a weight-streaming GEMV path (M <= 3) to a packed GEMM path at M >= 4
// that costs far more, so verifying 5 tokens cost far more than decoding 1. This kernel streams each
// weight row once for up to GROUP_M rows of activations (prefill chunks too, where it also beats MKL);
// more rows run as several groups in turn. Figures: docs/design-notes.md.
//
// Every output element is the same sequence of float operations whatever M, the grouping, the blocking,
// the thread split and the instruction set (engine/cpu/simd.h) are: a row computed in a batch of 5 or of 600 is bitwise the row computed alone.
// So a verified draft token's logits equal those of plain one-token decoding, whatever else shares the
// step (a long prefill chunk included): any row count must stay here, never reach the BLAS.
//
// Only row-major C = alpha * A @ op(B) + beta * C with A not transposed is handled here; every other
// call goes to the BLAS's own cblas_sgemm (set by small_gemm_init).
#include "simd.h"

#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111 };
// A weight block passes over at most GROUP_M rows of activations (576 KiB at K = 576: a core's L2); a
// larger M runs in balanced groups in turn, each streaming the weights again, which costs less than
// reading every row back from L3 for each weight block.
// NN products (scores @ V) run chunks of at most KERNEL_M rows over TILE_N output columns.
// Weight-layout (NT) products run chunks of at most WIDE_M_MAX rows against WIDE_R weight rows at a
// time, sized to the registers: 4 x 6 accumulators in 32 zmm (4 + 6 loads per k step for 24 FMAs),
// 2 x 3 in 16 ymm. The block of WIDE_R weight rows comes from memory for the first chunk and from L1
// for the others, so the weights stream once whatever M.
#if SS_VREGS >= 32
enum { KERNEL_M = 8, WIDE_R = 4, WIDE_M_MAX = 6 };
#define NN_S(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)  // 16-column strips per NN block
#else
enum { KERNEL_M = 4, WIDE_R = 2, WIDE_M_MAX = 3 };
#define NN_S(M) ((M) <= 1 ? 4 : (M) <= 2 ? 2 : 1)
#endif
enum { GROUP_M = 256, TILE_N = 64 };
// An explicit prefetch 16 KiB ahead along the weights into the outer caches overlaps memory and
// arithmetic; without it they add up, and a few rows cost much more than one.
enum { PREFETCH_BYTES = 16384 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*kern_fn)(int, const float *, int, const float *, int, float *, int, float, float, int,
                        int);

static sgemm_fn fallback;
static int max_m, threads;  // threads: 0 for OpenMP's default

static inline void store(float *c, float v, float alpha, float beta) {
    v *= alpha;
    *c = beta == 0.0f ? v : v + beta * *c;
}

// B transposed (weights [N, K] row-major, the linear layers): C[i, j] = dot(A[i, :], B[j, :]) for one
// weight row j (the few rows a WIDE_R block leaves over); each dot is 16-lane partial sums over k in
// order, then vhsum: the arithmetic the wide kernel below repeats per element.
SS_INLINE void nt_block(const int M, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                        float alpha, float beta, int j) {
    const int kfull = K & ~15;
    const float *bp = B + (size_t)j * ldb;
    vf acc[M];
    for (int i = 0; i < M; i++) acc[i] = vzero();
    int k = 0;
    for (; k < kfull; k += 16) {
        // Weight rows are contiguous, so this runs a fixed distance ahead along the stream.
        vprefetch_far((const char *)(bp + k) + PREFETCH_BYTES);
        const vf b = vload(bp + k);
        for (int i = 0; i < M; i++) acc[i] = vfma(vload(A + (size_t)i * lda + k), b, acc[i]);
    }
    if (K & 15) {
        const vf b = vloadn(bp + k, K & 15);
        for (int i = 0; i < M; i++) acc[i] = vfma(vloadn(A + (size_t)i * lda + k, K & 15), b, acc[i]);
    }
    for (int i = 0; i < M; i++) store(C + (size_t)i * ldc + j, vhsum(acc[i]), alpha, beta);
}

// B not transposed ([K, N] row-major, e.g. attention's scores @ V): 16-column strips of B, S strips at
// a time; each output element is one FMA chain over k in order. `last`: columns in the last strip.
SS_INLINE void nn_block(const int M, const int S, int K, const float *A, int lda, const float *B, int ldb,
                        float *C, int ldc, float alpha, float beta, int j, int last) {
    vf acc[S][M];
    for (int s = 0; s < S; s++)
        for (int i = 0; i < M; i++) acc[s][i] = vzero();
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb + j;
        for (int s = 0; s < S; s++) {
            const vf bv = s == S - 1 && last < 16 ? vloadn(b + 16 * s, last) : vload(b + 16 * s);
            for (int i = 0; i < M; i++) acc[s][i] = vfma(vset1(A[(size_t)i * lda + k]), bv, acc[s][i]);
        }
    }
    for (int s = 0; s < S; s++) {
        const int m = s == S - 1 ? last : 16;
        for (int i = 0; i < M; i++) {
            float *c = C + (size_t)i * ldc + j + 16 * s;
            vf v = vmul(vset1(alpha), acc[s][i]);
            if (beta != 0.0f) v = vfma(vset1(beta), vloadn(c, m), v);
            vstoren(c, v, m);
        }
    }
}

#define DEFINE_NN(M)                                                                                    \
    static void nn##M(int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,       \
                      float alpha, float beta, int j0, int j1) {                                        \
        int j = j0;                                                                                     \
        for (; j + 16 * NN_S(M) <= j1; j += 16 * NN_S(M))                                               \
            nn_block(M, NN_S(M), K, A, lda, B, ldb, C, ldc, alpha, beta, j, 16);                        \
        for (; j < j1; j += 16) {                                                                       \
            const int rem = j1 - j;                                                                     \
            nn_block(M, 1, K, A, lda, B, ldb, C, ldc, alpha, beta, j, rem >= 16 ? 16 : rem);            \
        }                                                                                               \
    }
DEFINE_NN(1) DEFINE_NN(2) DEFINE_NN(3) DEFINE_NN(4) DEFINE_NN(5) DEFINE_NN(6) DEFINE_NN(7) DEFINE_NN(8)
static const kern_fn NN[9] = {0, nn1, nn2, nn3, nn4, nn5, nn6, nn7, nn8};

// M rows (M <= WIDE_M_MAX) against weight rows j0..j1-1, WIDE_R at a time (the last few through
// nt_block: the same arithmetic per output element). Named accumulators c<r>_<i>, each A and weight
// vector loaded once into a register: with an acc[4][6] array GCC kept part of it on the stack and
// stored it back on every k step, and folded loads into the FMAs using them, loading each vector up to
// 4 times; each made the kernel much slower.
#define W_FMA(r, i) if ((r) < WIDE_R) c##r##_##i = vfma(a, b##r, c##r##_##i);
#define W_ROW(i, k, LOAD)                                                                               \
    if ((i) < M) {                                                                                      \
        vf a = LOAD(A + (size_t)(i) * lda + (k));                                                       \
        VKEEP(a);                                                                                       \
        W_FMA(0, i) W_FMA(1, i) W_FMA(2, i) W_FMA(3, i)                                                 \
    }
#define W_B(r, k, LOAD) vf b##r = (r) < WIDE_R ? LOAD(b##r##p + (k)) : vzero(); VKEEP(b##r);
#define W_STEP(k, LOAD)                                                                                 \
    {                                                                                                   \
        W_B(0, k, LOAD) W_B(1, k, LOAD) W_B(2, k, LOAD) W_B(3, k, LOAD)                                 \
        W_ROW(0, k, LOAD) W_ROW(1, k, LOAD) W_ROW(2, k, LOAD) W_ROW(3, k, LOAD) W_ROW(4, k, LOAD)      \
        W_ROW(5, k, LOAD)                                                                               \
    }
#define W_STORE(r, i) if ((r) < WIDE_R) store(C + (size_t)(i) * ldc + j + (r), vhsum(c##r##_##i), alpha, beta);
#define W_OUT(i) if ((i) < M) { W_STORE(0, i) W_STORE(1, i) W_STORE(2, i) W_STORE(3, i) }
#define W_ZERO(i) vf c0_##i = vzero(), c1_##i = c0_##i, c2_##i = c0_##i, c3_##i = c0_##i;
#define W_PTR(r) const float *b##r##p = B + (size_t)(j + ((r) < WIDE_R ? (r) : 0)) * ldb;
#define W_PREFETCH(r) if ((r) < WIDE_R) vprefetch_far((const char *)(b##r##p + k) + PREFETCH_BYTES);
#define W_TAIL_LOAD(p) vloadn((p), K & 15)
#define DEFINE_WIDE(MM)                                                                                 \
    static void ntw##MM(int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,     \
                        float alpha, float beta, int j0, int j1) {                                      \
        enum { M = MM };                                                                                \
        const int kfull = K & ~15;                                                                      \
        int j = j0;                                                                                     \
        for (; j + WIDE_R <= j1; j += WIDE_R) {                                                         \
            W_PTR(0) W_PTR(1) W_PTR(2) W_PTR(3)                                                         \
            W_ZERO(0) W_ZERO(1) W_ZERO(2) W_ZERO(3) W_ZERO(4) W_ZERO(5)                                 \
            for (int k = 0; k < kfull; k += 16) {                                                       \
                W_PREFETCH(0) W_PREFETCH(1) W_PREFETCH(2) W_PREFETCH(3)                                 \
                W_STEP(k, vload)                                                                        \
            }                                                                                           \
            if (K & 15) W_STEP(kfull, W_TAIL_LOAD)                                                      \
            W_OUT(0) W_OUT(1) W_OUT(2) W_OUT(3) W_OUT(4) W_OUT(5)                                       \
        }                                                                                               \
        for (; j < j1; j++) nt_block(M, K, A, lda, B, ldb, C, ldc, alpha, beta, j);                  \
    }
DEFINE_WIDE(1) DEFINE_WIDE(2) DEFINE_WIDE(3) DEFINE_WIDE(4) DEFINE_WIDE(5) DEFINE_WIDE(6)
static const kern_fn NTW[7] = {0, ntw1, ntw2, ntw3, ntw4, ntw5, ntw6};

// Products with more than want_max_m rows go to the BLAS (the engine passes INT_MAX: none; a smaller
// bound only serves benchmarks against the BLAS). Returns the bound in force.
int small_gemm_init(void *blas_sgemm, int want_max_m) {
    fallback = (sgemm_fn)blas_sgemm;
    max_m = want_max_m < 0 ? 0 : want_max_m;
    return max_m;
}

const char *small_gemm_isa(void) { return SS_ISA_NAME; }
// Weight rows per register tile of NT products (tests check each ISA gets its own).
int small_gemm_wide_rows(void) { return WIDE_R; }

// The threads larger products are split between (engine/cpu/threads.py; 0: OpenMP's default).
void small_gemm_threads(int n) { __atomic_store_n(&threads, n, __ATOMIC_RELAXED); }

// NT: balanced chunks of <= WIDE_M_MAX rows per block of WIDE_R weight rows. NN (M > KERNEL_M): chunks
// of <= KERNEL_M rows over each tile of TILE_N output columns in turn, so the later chunks read the
// tile from the core's own cache. Per element the arithmetic is unchanged.
static void run_rows(int tb, int M, int N0, int N1, int K, const float *A, int lda, const float *B,
                     int ldb, float *C, int ldc, float alpha, float beta) {
    if (tb == NO_TRANS && M <= KERNEL_M) {
        NN[M](K, A, lda, B, ldb, C, ldc, alpha, beta, N0, N1);
        return;
    }
    const int nt = tb != NO_TRANS;
    const int most = nt ? WIDE_M_MAX : KERNEL_M, tile = nt ? WIDE_R : TILE_N;
    const kern_fn *kernels = nt ? NTW : NN;
    const int chunks = (M + most - 1) / most;
    for (int j = N0; j < N1; j += tile) {
        const int j1 = j + tile < N1 ? j + tile : N1;
        for (int c = 0, r0 = 0; c < chunks; c++) {
            const int rows = (M - r0) / (chunks - c);
            kernels[rows](K, A + (size_t)r0 * lda, lda, B, ldb, C + (size_t)r0 * ldc, ldc, alpha, beta, j, j1);
            r0 += rows;
        }
    }
}

// Balanced groups of at most GROUP_M rows, one after another: each row's arithmetic is unchanged.
static void run_groups(int tb, int M, int N0, int N1, int K, const float *A, int lda, const float *B,
                       int ldb, float *C, int ldc, float alpha, float beta) {
    const int groups = (M + GROUP_M - 1) / GROUP_M;
    for (int g = 0, r0 = 0; g < groups; g++) {
        const int rows = (M - r0) / (groups - g);
        run_rows(tb, rows, N0, N1, K, A + (size_t)r0 * lda, lda, B, ldb, C + (size_t)r0 * ldc, ldc, alpha,
                 beta);
        r0 += rows;
    }
}

void cblas_sgemm(int layout, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (layout != ROW_MAJOR || ta != NO_TRANS || M < 1 || M > max_m || N < 1 || K < 1) {
        fallback(layout, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    // Small products stay on this thread; larger ones split the output columns evenly between the
    // threads in multiples of 16 (uneven fixed-size chunks left one core idle up to a chunk's time).
    if ((double)M * N * K < 262144.0 || N < 32) {
        run_groups(tb, M, 0, N, K, A, lda, B, ldb, C, ldc, alpha, beta);
        return;
    }
    const int nth = __atomic_load_n(&threads, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(nth > 0 ? nth : omp_get_max_threads())
    {
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int per = ((N + nth - 1) / nth + 15) & ~15;
        const int j0 = tid * per, j1 = j0 + per < N ? j0 + per : N;
        if (j0 < j1) run_groups(tb, M, j0, j1, K, A, lda, B, ldb, C, ldc, alpha, beta);
    }
}
