// Small-M float32 GEMM placed in front of the BLAS that MLX calls (see engine/cpu/gemm.py).
//
// Why: a decode step multiplies 1 row per request by every weight matrix, and draft verification
// 1 + K rows. MKL switches from a weight-streaming GEMV path (M <= 3) to a packed GEMM path at M >= 4
// that costs far more, so verifying 5 tokens cost far more than decoding 1. This kernel streams each
// weight row once for up to GROUP_M rows of activations (prefill chunks too, where it also beats MKL);
// more rows run as several groups in turn. Figures: docs/design-notes.md.
//
// Every output element is the same sequence of float operations whatever M, the grouping, the blocking
// and the thread split are: a row computed in a batch of 5 or of 600 is bitwise the row computed alone.
// So a verified draft token's logits equal those of plain one-token decoding, whatever else shares the
// step (a long prefill chunk included): any row count must stay here, never reach the BLAS.
//
// Only row-major C = alpha * A @ op(B) + beta * C with A not transposed is handled here; every other
// call goes to the BLAS's own cblas_sgemm (set by small_gemm_init).
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111 };
// A weight block passes over at most GROUP_M rows of activations (576 KiB at K = 576: a core's L2); a
// larger M runs in balanced groups in turn, each streaming the weights again, which costs less than
// reading every row back from L3 for each weight block.
enum { KERNEL_M = 8, GROUP_M = 256, TILE_N = 64 };
// Weight-layout (NT) products run chunks of at most WIDE_M_MAX rows against WIDE_R weight rows at a
// time: up to 24 accumulators in registers, 4 + 6 loads per k step for 24 FMAs. The block of WIDE_R
// weight rows (9 KiB at K = 576) comes from memory for the first chunk and from L1 for the others, so
// the weights stream once whatever M (8-row chunks of one weight row each were much slower).
enum { WIDE_R = 4, WIDE_M_MAX = 6 };
// An explicit prefetch 16 KiB ahead along the weights into the outer caches overlaps memory and
// arithmetic; without it they add up, and a few rows cost much more than one.
enum { PREFETCH_BYTES = 16384 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*kern_fn)(int, const float *, int, const float *, int, float *, int, float, float, int,
                        int);

static sgemm_fn fallback;
static int max_m;

static inline void store(float *c, float v, float alpha, float beta) {
    v *= alpha;
    *c = beta == 0.0f ? v : v + beta * *c;
}

// B transposed (weights [N, K] row-major, the linear layers): C[i, j] = dot(A[i, :], B[j, :]) for one
// weight row j (the few rows a WIDE_R block leaves over); each dot is 16-lane partial sums over k in
// order, then one fixed horizontal reduction: the arithmetic the wide kernel below repeats per element.
static inline __attribute__((always_inline)) void nt_block(const int M, int K, const float *A, int lda,
        const float *B, int ldb, float *C, int ldc, float alpha, float beta, int j) {
    const int kfull = K & ~15;
    const __mmask16 tail = (__mmask16)((1u << (K & 15)) - 1);
    const float *bp = B + (size_t)j * ldb;
    __m512 acc[M];
    for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps();
    int k = 0;
    for (; k < kfull; k += 16) {
        // Weight rows are contiguous, so this runs a fixed distance ahead along the stream.
        _mm_prefetch((const char *)(bp + k) + PREFETCH_BYTES, _MM_HINT_T2);
        const __m512 b = _mm512_loadu_ps(bp + k);
        for (int i = 0; i < M; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(A + (size_t)i * lda + k), b, acc[i]);
    }
    if (tail) {
        const __m512 b = _mm512_maskz_loadu_ps(tail, bp + k);
        for (int i = 0; i < M; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, A + (size_t)i * lda + k), b, acc[i]);
    }
    for (int i = 0; i < M; i++) store(C + (size_t)i * ldc + j, _mm512_reduce_add_ps(acc[i]), alpha, beta);
}

// B not transposed ([K, N] row-major, e.g. attention's scores @ V): 16-column strips of B, S strips at
// a time; each output element is one FMA chain over k in order.
static inline __attribute__((always_inline)) void nn_block(const int M, const int S, int K, const float *A,
        int lda, const float *B, int ldb, float *C, int ldc, float alpha, float beta, int j,
        __mmask16 last) {
    __m512 acc[S][M];
    for (int s = 0; s < S; s++)
        for (int i = 0; i < M; i++) acc[s][i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb + j;
        for (int s = 0; s < S; s++) {
            const __m512 bv = s == S - 1 ? _mm512_maskz_loadu_ps(last, b + 16 * s) : _mm512_loadu_ps(b + 16 * s);
            for (int i = 0; i < M; i++)
                acc[s][i] = _mm512_fmadd_ps(_mm512_set1_ps(A[(size_t)i * lda + k]), bv, acc[s][i]);
        }
    }
    for (int s = 0; s < S; s++) {
        const __mmask16 m = s == S - 1 ? last : (__mmask16)0xFFFF;
        for (int i = 0; i < M; i++) {
            float *c = C + (size_t)i * ldc + j + 16 * s;
            __m512 v = _mm512_mul_ps(_mm512_set1_ps(alpha), acc[s][i]);
            if (beta != 0.0f) v = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, c), v);
            _mm512_mask_storeu_ps(c, m, v);
        }
    }
}

// Register blocking per M (32 zmm registers): more strips for small M.
#define NN_S(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)

#define DEFINE_NN(M)                                                                                    \
    static void nn##M(int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,       \
                      float alpha, float beta, int j0, int j1) {                                        \
        int j = j0;                                                                                     \
        for (; j + 16 * NN_S(M) <= j1; j += 16 * NN_S(M))                                               \
            nn_block(M, NN_S(M), K, A, lda, B, ldb, C, ldc, alpha, beta, j, (__mmask16)0xFFFF);         \
        for (; j < j1; j += 16) {                                                                       \
            const int rem = j1 - j;                                                                     \
            nn_block(M, 1, K, A, lda, B, ldb, C, ldc, alpha, beta, j,                                   \
                     rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1));                     \
        }                                                                                               \
    }
DEFINE_NN(1) DEFINE_NN(2) DEFINE_NN(3) DEFINE_NN(4) DEFINE_NN(5) DEFINE_NN(6) DEFINE_NN(7) DEFINE_NN(8)
static const kern_fn NN[KERNEL_M + 1] = {0, nn1, nn2, nn3, nn4, nn5, nn6, nn7, nn8};

// M rows (M <= WIDE_M_MAX) against weight rows j0..j1-1, WIDE_R at a time (the last few through
// nt_block: the same arithmetic per output element). Named accumulators, and every A and weight vector
// loaded once into a register: with an acc[4][6] array GCC kept part of it on the stack and stored it
// back on every k step, and it folded loads into the FMAs using them, loading each vector up to 4
// times (28 loads for 24 FMAs); each made the kernel much slower.
#define W_ROW(i, k, LOAD)                                                                               \
    if ((i) < M) {                                                                                      \
        __m512 a = LOAD(A + (size_t)(i) * lda + (k));                                                  \
        __asm__("" : "+v"(a)); /* one load into a register, not one folded into each of the 4 FMAs */ \
        c0##i = _mm512_fmadd_ps(a, b0, c0##i);                                                          \
        c1##i = _mm512_fmadd_ps(a, b1, c1##i);                                                          \
        c2##i = _mm512_fmadd_ps(a, b2, c2##i);                                                          \
        c3##i = _mm512_fmadd_ps(a, b3, c3##i);                                                          \
    }
#define W_STEP(k, LOAD)                                                                                 \
    {                                                                                                   \
        __m512 b0 = LOAD(b0p + (k)), b1 = LOAD(b1p + (k)), b2 = LOAD(b2p + (k)), b3 = LOAD(b3p + (k));   \
        __asm__("" : "+v"(b0), "+v"(b1), "+v"(b2), "+v"(b3)); /* loaded once, like each row of A */     \
        W_ROW(0, k, LOAD) W_ROW(1, k, LOAD) W_ROW(2, k, LOAD) W_ROW(3, k, LOAD) W_ROW(4, k, LOAD)      \
        W_ROW(5, k, LOAD)                                                                               \
    }
#define W_OUT(i)                                                                                        \
    if ((i) < M) {                                                                                      \
        float *c = C + (size_t)(i) * ldc + j;                                                           \
        store(c, _mm512_reduce_add_ps(c0##i), alpha, beta);                                             \
        store(c + 1, _mm512_reduce_add_ps(c1##i), alpha, beta);                                         \
        store(c + 2, _mm512_reduce_add_ps(c2##i), alpha, beta);                                         \
        store(c + 3, _mm512_reduce_add_ps(c3##i), alpha, beta);                                         \
    }
#define W_ZERO(i) __m512 c0##i = _mm512_setzero_ps(), c1##i = c0##i, c2##i = c0##i, c3##i = c0##i;
#define W_TAIL_LOAD(p) _mm512_maskz_loadu_ps(tail, (p))
#define DEFINE_WIDE(MM)                                                                                 \
    static void ntw##MM(int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc,     \
                        float alpha, float beta, int j0, int j1) {                                      \
        enum { M = MM };                                                                                \
        const int kfull = K & ~15;                                                                      \
        const __mmask16 tail = (__mmask16)((1u << (K & 15)) - 1);                                       \
        int j = j0;                                                                                     \
        for (; j + WIDE_R <= j1; j += WIDE_R) {                                                         \
            const float *b0p = B + (size_t)j * ldb, *b1p = b0p + ldb, *b2p = b1p + ldb, *b3p = b2p + ldb; \
            W_ZERO(0) W_ZERO(1) W_ZERO(2) W_ZERO(3) W_ZERO(4) W_ZERO(5)                                 \
            for (int k = 0; k < kfull; k += 16) {                                                       \
                _mm_prefetch((const char *)(b0p + k) + PREFETCH_BYTES, _MM_HINT_T2);                    \
                _mm_prefetch((const char *)(b1p + k) + PREFETCH_BYTES, _MM_HINT_T2);                    \
                _mm_prefetch((const char *)(b2p + k) + PREFETCH_BYTES, _MM_HINT_T2);                    \
                _mm_prefetch((const char *)(b3p + k) + PREFETCH_BYTES, _MM_HINT_T2);                    \
                W_STEP(k, _mm512_loadu_ps)                                                              \
            }                                                                                           \
            if (tail) W_STEP(kfull, W_TAIL_LOAD)                                                        \
            W_OUT(0) W_OUT(1) W_OUT(2) W_OUT(3) W_OUT(4) W_OUT(5)                                       \
        }                                                                                               \
        for (; j < j1; j++) nt_block(M, K, A, lda, B, ldb, C, ldc, alpha, beta, j);                  \
    }
DEFINE_WIDE(1) DEFINE_WIDE(2) DEFINE_WIDE(3) DEFINE_WIDE(4) DEFINE_WIDE(5) DEFINE_WIDE(6)
static const kern_fn NTW[WIDE_M_MAX + 1] = {0, ntw1, ntw2, ntw3, ntw4, ntw5, ntw6};

// Products with more than want_max_m rows go to the BLAS (the engine passes INT_MAX: none; a smaller
// bound only serves benchmarks against the BLAS). Returns the bound in force (0: the CPU lacks
// AVX-512F, every call is forwarded).
int small_gemm_init(void *blas_sgemm, int want_max_m) {
    fallback = (sgemm_fn)blas_sgemm;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f")) want_max_m = 0;
    max_m = want_max_m < 0 ? 0 : want_max_m;
    return max_m;
}

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
#pragma omp parallel
    {
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int per = ((N + nth - 1) / nth + 15) & ~15;
        const int j0 = tid * per, j1 = j0 + per < N ? j0 + per : N;
        if (j0 < j1) run_groups(tb, M, j0, j1, K, A, lda, B, ldb, C, ldc, alpha, beta);
    }
}
