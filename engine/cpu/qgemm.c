// Small-M GEMM over weights kept in their stored precision (see engine/cpu/qgemm.py):
//   C[M, N] = A[M, K] @ dequant(W)[N, K]^T, A and C float32 row-major.
// Formats: bfloat16 and float16 weights, and MLX's affine quantization (8 or 4 bits packed little-end
// first into uint32 words, one scale and one bias per `group` consecutive weights of a row, scales and
// biases float32, float16 or bfloat16). GGUF Q8_0 / Q4_0 / Q4_1 load into the affine layout with
// group 32, so their integers are served as stored.
//
// Why: a decode step streams every weight once; float32 weights are 2x (bf16), 4x (8-bit) or ~6x
// (4-bit) the bytes, and MLX's own quantized matmul has no fast CPU path. Each 16-weight slice is
// dequantized in registers (w = q * scale + bias, one FMA) and multiplied into every activation row.
//
// Batch invariance: every output element is one 16-lane FMA chain over k in order, then one fixed
// horizontal sum, whatever M, the row chunking and the thread split: a row computed in a batch of 5 or
// 256 is bitwise the row computed alone (so verified drafts get plain decoding's logits).
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FMT_BF16 = 1, FMT_F16 = 2, FMT_Q8 = 3, FMT_Q4 = 4, FMT_F32 = 5 };
enum { SC_F32 = 0, SC_F16 = 1, SC_BF16 = 2 };
// Up to MB activation rows, WR weight rows at a time: 4 x 6 accumulators, 4 weight vectors and one
// activation vector in the 32 vector registers.
#ifndef QGEMM_PREFETCH
#define QGEMM_PREFETCH 4096
#endif
// Past MB rows, 2 weight rows against chunks of at most MB2: 2 x 12 accumulators, so each dequantized
// slice feeds 12 FMAs per row instead of 6.
// Past MB2 rows (prefill) the activations go in chunks of MB rows against WRB weight rows at a time,
// which stay in L1 (dequantized once into a buffer) while every chunk passes over them.
enum { WR = 4, MB = 6, WR2 = 2, MB2 = 12, WRB = 8, PREFETCH_BYTES = QGEMM_PREFETCH };
// Groups per weight row the kernel takes (K = 32768 at group 32): their scales sit on the stack.
enum { MAX_GROUPS = 1024 };

typedef struct {
    int fmt, K, group, sdtype, gpr;  // gpr: groups per row
    const uint8_t *w;                // row-major
    const void *scales, *biases;     // [N, gpr]
} Weights;

// A row's `n` group scales (or biases) as float32 in `buf` (n <= MAX_GROUPS): copied, or converted 16 at a
// time; returns `buf`. (A copy even of float32 ones lets the blocks index one array from one base.)
static inline const float *group_params(const void *p, size_t at, int n, int sdtype, float *buf) {
    if (sdtype == SC_F32) {
        memcpy(buf, (const float *)p + at, sizeof(float) * (size_t)n);
        return buf;
    }
    const uint16_t *h = (const uint16_t *)p + at;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(h + i));
        _mm512_storeu_ps(buf + i, sdtype == SC_F16 ? _mm512_cvtph_ps(v)
                                                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
    }
    for (; i < n; i++) {
        union { uint32_t u; float f; } v = {(uint32_t)h[i] << 16};
        buf[i] = sdtype == SC_F16 ? _cvtsh_ss(h[i]) : v.f;
    }
    return buf;
}

// Weights k..k+15 of a row as float32 (s, b: the group's scale and bias). FMT is a constant after inlining.
static inline __attribute__((always_inline)) __m512 slice(const int FMT, const uint8_t *row, int k, __m512 s,
                                                          __m512 b) {
    if (FMT == FMT_F32) return _mm512_loadu_ps((const float *)row + k);
    if (FMT == FMT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)k))), 16));
    if (FMT == FMT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)k)));
    if (FMT == FMT_Q8)
        return _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k)))), s, b);
    // FMT_Q4: 32 weights in 16 bytes, byte i holding weights 2i (low nibble) and 2i + 1 (high nibble). The
    // activations come permuted to match (see qgemm): k % 32 < 16 takes the even weights, else the odd.
    // `s` is the group's table of the 16 dequantized values (q4_table): a lane permute reads the nibble's
    // value (only an index's low 4 bits count), no conversion or FMA per weight.
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + (size_t)(k & ~31) / 2)));
    (void)b;
    return _mm512_permutexvar_ps((k & 16) ? _mm512_srli_epi32(q, 4) : q, s);
}

// The 16 values of a 4-bit group: v * scale + bias for v = 0..15 (the same FMA as 8-bit weights get).
static inline __m512 q4_table(__m512 s, __m512 b) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_fmadd_ps(iota, s, b);
}

static inline size_t row_bytes(const int FMT, int K) {
    return FMT == FMT_Q4 ? (size_t)K / 2 : FMT == FMT_Q8 ? (size_t)K : FMT == FMT_F32 ? 4 * (size_t)K : 2 * (size_t)K;
}

// Named accumulators (an array of them was kept partly on the stack by GCC), 4 weight rows x M rows.
#define ACC_ZERO(i) __m512 a0##i = _mm512_setzero_ps(), a1##i = a0##i, a2##i = a0##i, a3##i = a0##i;
#define ACC_ROW(i)                                                                                      \
    if ((i) < M) {                                                                                      \
        __m512 x = _mm512_loadu_ps(A + (size_t)(i) * lda + k);                                          \
        __asm__("" : "+v"(x));                                                                          \
        a0##i = _mm512_fmadd_ps(w0, x, a0##i);                                                          \
        a1##i = _mm512_fmadd_ps(w1, x, a1##i);                                                          \
        a2##i = _mm512_fmadd_ps(w2, x, a2##i);                                                          \
        a3##i = _mm512_fmadd_ps(w3, x, a3##i);                                                          \
    }
#define ACC_OUT(i)                                                                                      \
    if ((i) < M) {                                                                                      \
        float *c = C + (size_t)(i) * ldc + j;                                                           \
        c[0] = _mm512_reduce_add_ps(a0##i);                                                             \
        c[1] = _mm512_reduce_add_ps(a1##i);                                                             \
        c[2] = _mm512_reduce_add_ps(a2##i);                                                             \
        c[3] = _mm512_reduce_add_ps(a3##i);                                                             \
    }

// Weight rows j..j+3 against M activation rows (M <= MB).
static inline __attribute__((always_inline)) void block4(const int FMT, const int M, const Weights *W,
        const float *A, int lda, float *C, int ldc, int j) {
    const int K = W->K, quant = FMT == FMT_Q8 || FMT == FMT_Q4;
    const int step = quant ? W->group : K;
    const size_t rb = row_bytes(FMT, K);
    const uint8_t *r0 = W->w + (size_t)j * rb, *r1 = r0 + rb, *r2 = r1 + rb, *r3 = r2 + rb;
    ACC_ZERO(0) ACC_ZERO(1) ACC_ZERO(2) ACC_ZERO(3) ACC_ZERO(4) ACC_ZERO(5)
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, b0 = s0, b1 = s0, b2 = s0, b3 = s0;
    // Row r's group scales at buf[2r], biases at buf[2r + 1]: one base, fixed offsets (no pointer per row).
    float buf[2 * WR][quant ? MAX_GROUPS : 1];
    if (quant)
        for (int r = 0; r < WR; r++) {
            group_params(W->scales, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, buf[2 * r]);
            group_params(W->biases, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, buf[2 * r + 1]);
        }
    // Group 32 (GGUF's): spelled out as a constant bound, the compiler drops the inner loop.
    const int g32 = quant && step == 32;
    for (int g = 0, k = 0; k < K; g++) {
        if (quant) {  // broadcasts straight from memory: no arithmetic port
            s0 = _mm512_set1_ps(buf[0][g]), s1 = _mm512_set1_ps(buf[2][g]);
            s2 = _mm512_set1_ps(buf[4][g]), s3 = _mm512_set1_ps(buf[6][g]);
            b0 = _mm512_set1_ps(buf[1][g]), b1 = _mm512_set1_ps(buf[3][g]);
            b2 = _mm512_set1_ps(buf[5][g]), b3 = _mm512_set1_ps(buf[7][g]);
            if (FMT == FMT_Q4)
                s0 = q4_table(s0, b0), s1 = q4_table(s1, b1), s2 = q4_table(s2, b2), s3 = q4_table(s3, b3);
        }
        if (FMT == FMT_Q4) {  // 32 weights a step: one load per row, its low then its high nibbles
            for (const int end = k + (g32 ? 32 : step); k < end; k += 32) {
                const size_t at = (size_t)k / 2;
                _mm_prefetch((const char *)r0 + at + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)r1 + at + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)r2 + at + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)r3 + at + PREFETCH_BYTES, _MM_HINT_T0);
                __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r0 + at)));
                __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r1 + at)));
                __m512i q2 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r2 + at)));
                __m512i q3 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r3 + at)));
                {
                    __m512 w0 = _mm512_permutexvar_ps(q0, s0), w1 = _mm512_permutexvar_ps(q1, s1);
                    __m512 w2 = _mm512_permutexvar_ps(q2, s2), w3 = _mm512_permutexvar_ps(q3, s3);
                    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
                }
                k += 16;
                {
                    __m512 w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), s0);
                    __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), s1);
                    __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(q2, 4), s2);
                    __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(q3, 4), s3);
                    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
                }
                k -= 16;
            }
            continue;
        }
        for (const int end = k + (g32 ? 32 : step); k < end; k += 16) {
            const size_t ahead = k * rb / K + PREFETCH_BYTES;
            _mm_prefetch((const char *)r0 + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)r1 + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)r2 + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)r3 + ahead, _MM_HINT_T0);
            __m512 w0 = slice(FMT, r0, k, s0, b0), w1 = slice(FMT, r1, k, s1, b1);
            __m512 w2 = slice(FMT, r2, k, s2, b2), w3 = slice(FMT, r3, k, s3, b3);
            __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
            ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
        }
    }
    ACC_OUT(0) ACC_OUT(1) ACC_OUT(2) ACC_OUT(3) ACC_OUT(4) ACC_OUT(5)
}

#define ACC2_ZERO(i) __m512 c0##i = _mm512_setzero_ps(), c1##i = c0##i;
#define ACC2_ROW(i)                                                                                     \
    if ((i) < M) {                                                                                      \
        __m512 x = _mm512_loadu_ps(A + (size_t)(i) * lda + k);                                          \
        __asm__("" : "+v"(x));                                                                          \
        c0##i = _mm512_fmadd_ps(w0, x, c0##i);                                                          \
        c1##i = _mm512_fmadd_ps(w1, x, c1##i);                                                          \
    }
#define ACC2_OUT(i)                                                                                     \
    if ((i) < M) {                                                                                      \
        float *c = C + (size_t)(i) * ldc + j;                                                           \
        c[0] = _mm512_reduce_add_ps(c0##i);                                                             \
        c[1] = _mm512_reduce_add_ps(c1##i);                                                             \
    }
#define ACC2_ALL(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// Weight rows j, j+1 against M activation rows (MB < M <= MB2): block4's arithmetic per element.
static inline __attribute__((always_inline)) void block2(const int FMT, const int M, const Weights *W,
        const float *A, int lda, float *C, int ldc, int j) {
    const int K = W->K, quant = FMT == FMT_Q8 || FMT == FMT_Q4;
    const int step = quant ? W->group : K;
    const size_t rb = row_bytes(FMT, K);
    const uint8_t *r0 = W->w + (size_t)j * rb, *r1 = r0 + rb;
    ACC2_ALL(ACC2_ZERO)
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, b0 = s0, b1 = s0;
    float buf[2 * WR2][quant ? MAX_GROUPS : 1];  // as in block4
    const int g32 = quant && step == 32;
    if (quant)
        for (int r = 0; r < WR2; r++) {
            group_params(W->scales, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, buf[2 * r]);
            group_params(W->biases, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, buf[2 * r + 1]);
        }
    for (int g = 0, k = 0; k < K; g++) {
        if (quant) {
            s0 = _mm512_set1_ps(buf[0][g]), s1 = _mm512_set1_ps(buf[2][g]);
            b0 = _mm512_set1_ps(buf[1][g]), b1 = _mm512_set1_ps(buf[3][g]);
            if (FMT == FMT_Q4) s0 = q4_table(s0, b0), s1 = q4_table(s1, b1);
        }
        for (const int end = k + (g32 ? 32 : step); k < end; k += 16) {
            const size_t ahead = k * rb / K + PREFETCH_BYTES;
            _mm_prefetch((const char *)r0 + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)r1 + ahead, _MM_HINT_T0);
            __m512 w0 = slice(FMT, r0, k, s0, b0), w1 = slice(FMT, r1, k, s1, b1);
            __asm__("" : "+v"(w0), "+v"(w1));
            ACC2_ALL(ACC2_ROW)
        }
    }
    ACC2_ALL(ACC2_OUT)
}

// One weight row j against M rows: the same arithmetic per element as block4 (the few rows left over).
static inline __attribute__((always_inline)) void block1(const int FMT, const int M, const Weights *W,
        const float *A, int lda, float *C, int ldc, int j) {
    const int K = W->K, quant = FMT == FMT_Q8 || FMT == FMT_Q4;
    const int step = quant ? W->group : K;
    const size_t rb = row_bytes(FMT, K);
    const uint8_t *r0 = W->w + (size_t)j * rb;
    __m512 acc[MB2];
    for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps();
    __m512 s = _mm512_setzero_ps(), b = s;
    float buf[2][quant ? MAX_GROUPS : 1];
    const float *sc = quant ? group_params(W->scales, (size_t)j * W->gpr, W->gpr, W->sdtype, buf[0]) : NULL;
    const float *bi = quant ? group_params(W->biases, (size_t)j * W->gpr, W->gpr, W->sdtype, buf[1]) : NULL;
    for (int g = 0, k = 0; k < K; g++) {
        if (quant) {
            s = _mm512_set1_ps(sc[g]);
            b = _mm512_set1_ps(bi[g]);
            if (FMT == FMT_Q4) s = q4_table(s, b);
        }
        for (const int end = k + step; k < end; k += 16) {
            const __m512 w = slice(FMT, r0, k, s, b);
            for (int i = 0; i < M; i++) acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(A + (size_t)i * lda + k), acc[i]);
        }
    }
    for (int i = 0; i < M; i++) C[(size_t)i * ldc + j] = _mm512_reduce_add_ps(acc[i]);
}

typedef void (*block_fn)(const Weights *, const float *, int, float *, int, int);

#define DEF_B(P, BLOCK, FMT, M)                                                                         \
    static void P##_##FMT##_##M(const Weights *W, const float *A, int lda, float *C, int ldc, int j) {  \
        BLOCK(FMT, M, W, A, lda, C, ldc, j);                                                            \
    }
// 1 and WR weight rows up to MB activation rows, 1 and WR2 past it.
#define DEF_BLOCK(FMT, M) DEF_B(b1, block1, FMT, M) DEF_B(b4, block4, FMT, M)
#define DEF_BLOCK2(FMT, M) DEF_B(b1, block1, FMT, M) DEF_B(b2, block2, FMT, M)
#define DEF_FMT(FMT) DEF_BLOCK(FMT, 1) DEF_BLOCK(FMT, 2) DEF_BLOCK(FMT, 3) DEF_BLOCK(FMT, 4)            \
    DEF_BLOCK(FMT, 5) DEF_BLOCK(FMT, 6) DEF_BLOCK2(FMT, 7) DEF_BLOCK2(FMT, 8) DEF_BLOCK2(FMT, 9)        \
    DEF_BLOCK2(FMT, 10) DEF_BLOCK2(FMT, 11) DEF_BLOCK2(FMT, 12)
DEF_FMT(1) DEF_FMT(2) DEF_FMT(3) DEF_FMT(4) DEF_FMT(5)
#define ROWS(FMT) {0, b1_##FMT##_1, b1_##FMT##_2, b1_##FMT##_3, b1_##FMT##_4, b1_##FMT##_5, b1_##FMT##_6,    \
                   b1_##FMT##_7, b1_##FMT##_8, b1_##FMT##_9, b1_##FMT##_10, b1_##FMT##_11, b1_##FMT##_12},   \
                  {0, b4_##FMT##_1, b4_##FMT##_2, b4_##FMT##_3, b4_##FMT##_4, b4_##FMT##_5, b4_##FMT##_6,    \
                   b2_##FMT##_7, b2_##FMT##_8, b2_##FMT##_9, b2_##FMT##_10, b2_##FMT##_11, b2_##FMT##_12}
// [format][several weight rows?][M]: M <= MB takes WR weight rows a call, M > MB takes WR2.
static const block_fn BLOCKS[6][2][MB2 + 1] = {{{0}, {0}}, {ROWS(1)}, {ROWS(2)}, {ROWS(3)}, {ROWS(4)}, {ROWS(5)}};

// Rows j..j+n-1 dequantized into buf ([n, K] float32): each weight the value slice() gives in registers.
static inline __attribute__((always_inline)) void dequant_rows(const int FMT, const Weights *W, int j, int n,
                                                               float *buf) {
    const int K = W->K, quant = FMT == FMT_Q8 || FMT == FMT_Q4, step = quant ? W->group : K;
    const size_t rb = row_bytes(FMT, K);
    float tmp[2][quant ? MAX_GROUPS : 1];
    for (int r = 0; r < n; r++) {
        const uint8_t *row = W->w + (size_t)(j + r) * rb;
        const float *sc = quant ? group_params(W->scales, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, tmp[0]) : NULL;
        const float *bi = quant ? group_params(W->biases, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, tmp[1]) : NULL;
        for (int g = 0, k = 0; k < K; g++) {
            __m512 sv = _mm512_set1_ps(quant ? sc[g] : 0.0f), bv = _mm512_set1_ps(quant ? bi[g] : 0.0f);
            if (FMT == FMT_Q4) sv = q4_table(sv, bv);
            for (const int end = k + step; k < end; k += 16)
                _mm512_storeu_ps(buf + (size_t)r * K + k, slice(FMT, row, k, sv, bv));
        }
    }
}

static void dequant_any(const Weights *W, int j, int n, float *buf) {
    switch (W->fmt) {
    case FMT_BF16: dequant_rows(FMT_BF16, W, j, n, buf); break;
    case FMT_F16: dequant_rows(FMT_F16, W, j, n, buf); break;
    case FMT_Q8: dequant_rows(FMT_Q8, W, j, n, buf); break;
    default: dequant_rows(FMT_Q4, W, j, n, buf); break;
    }
}

// Weight rows j0..j1-1 against all M rows. Up to MB2 rows dequantize in registers (WR rows a block up to
// MB, WR2 past it). More rows go in balanced chunks of <= MB against WRB weight rows at a time; a
// low-precision block of them is dequantized once into `buf` (WRB * K floats) that every chunk reads from
// L1: the same values and the same FMA chain per output element as in registers, so the same bits.
static void run(const Weights *W, int M, int j0, int j1, const float *A, int lda, float *C, int ldc, float *buf) {
    if (M <= MB2) {
        const int wr = M > MB ? WR2 : WR;
        for (int j = j0; j < j1; j += wr) {
            const int many = j + wr <= j1;
            const int rend = many ? j + wr : j1;
            for (int jj = j; jj < rend; jj += many ? wr : 1) BLOCKS[W->fmt][many][M](W, A, lda, C, ldc, jj);
        }
        return;
    }
    const int chunks = (M + MB - 1) / MB;
    if (W->fmt == FMT_F32) buf = NULL;
    const Weights F = {FMT_F32, W->K, W->K, SC_F32, 1, (const uint8_t *)buf, NULL, NULL};
    for (int j = j0; j < j1; j += WRB) {
        const int jn = j1 - j < WRB ? j1 - j : WRB;
        if (buf) dequant_any(W, j, jn, buf);
        for (int c = 0, r0 = 0; c < chunks; c++) {
            const int rows = (M - r0) / (chunks - c);
            for (int jj = 0; jj < jn;) {
                const int four = jj + WR <= jn;
                if (buf)
                    BLOCKS[FMT_F32][four][rows](&F, A + (size_t)r0 * lda, lda, C + (size_t)r0 * ldc + j, ldc, jj);
                else
                    BLOCKS[W->fmt][four][rows](W, A + (size_t)r0 * lda, lda, C + (size_t)r0 * ldc, ldc, j + jj);
                jj += four ? WR : 1;
            }
            r0 += rows;
        }
    }
}

// Thread t of n takes weight rows [*j0, *j1): even shares in multiples of WR.
static inline void share(int N, int n, int t, int *j0, int *j1) {
    const int per = ((N + n - 1) / n + WR - 1) / WR * WR;
    *j0 = t * per < N ? t * per : N;
    *j1 = *j0 + per < N ? *j0 + per : N;
}

// Row i of A ([K] floats) as qgemm's 4-bit blocks read it: each 32 as their 16 even then 16 odd elements.
static inline void q4_permute_row(const float *a, int K, float *d) {
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i od = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int k = 0; k < K; k += 32) {
        const __m512 lo = _mm512_loadu_ps(a + k), hi = _mm512_loadu_ps(a + k + 16);
        _mm512_storeu_ps(d + k, _mm512_permutex2var_ps(lo, ev, hi));
        _mm512_storeu_ps(d + k + 16, _mm512_permutex2var_ps(lo, od, hi));
    }
}

// The Weights for a product, or -1 for arguments the kernel does not handle.
static int weights_of(int fmt, int N, int K, int group, const void *w, const void *scales, const void *biases,
                      int sdtype, Weights *W) {
    if (fmt < FMT_BF16 || fmt > FMT_F32 || N < 1 || K < 16 || K % 16) return -1;
    const int quant = fmt == FMT_Q8 || fmt == FMT_Q4;
    if (quant && (group < 16 || group % 16 || K % group)) return -1;
    const Weights v = {fmt, K, quant ? group : K, sdtype, quant ? K / group : 1, (const uint8_t *)w, scales, biases};
    if (quant && (v.gpr > MAX_GROUPS || (fmt == FMT_Q4 && group % 32))) return -1;
    *W = v;
    return 0;
}

// Returns 0, or -1 for arguments it does not handle (the caller dequantizes instead).
int qgemm(int fmt, int M, int N, int K, int group, const float *A, int lda, const void *w, const void *scales,
          const void *biases, int sdtype, float *C, int ldc, int max_threads) {
    Weights W;
    if (M < 1 || weights_of(fmt, N, K, group, w, scales, biases, sdtype, &W)) return -1;
    float *perm = NULL;
    if (fmt == FMT_Q4) {
        perm = malloc(sizeof(float) * (size_t)M * K);
        if (perm == NULL) return -1;
        for (int i = 0; i < M; i++) q4_permute_row(A + (size_t)i * lda, K, perm + (size_t)i * K);
        A = perm;
        lda = K;
    }
    const size_t bytes = row_bytes(fmt, K) * (size_t)N;
    // Small products stay on this thread; larger ones split the weight rows evenly, in multiples of WR.
    int nth = omp_get_max_threads();
    if (max_threads > 0 && nth > max_threads) nth = max_threads;
    if (bytes < 65536 || N < 2 * WR || nth < 2) nth = 1;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        // Without the buffer (none needed, or malloc failed) every chunk dequantizes in registers: same bits.
        float *buf = M > MB2 && fmt != FMT_F32 ? malloc(sizeof(float) * WRB * (size_t)K) : NULL;
        int j0, j1;
        share(N, omp_get_num_threads(), omp_get_thread_num(), &j0, &j1);
        if (j0 < j1) run(&W, M, j0, j1, A, lda, C, ldc, buf);
        free(buf);
    }
    free(perm);
    return 0;
}

// Rows ids[0..T-1] of the [N, K] weight matrix as float32 (out: [T, K]): the values the product reads,
// for an embedding table kept in its stored precision. Returns 0, or -1 (layout refused, id out of range).
int qgemm_rows(int fmt, int N, int K, int group, const void *w, const void *scales, const void *biases, int sdtype,
               const int32_t *ids, int T, float *out) {
    Weights W;
    if (weights_of(fmt, N, K, group, w, scales, biases, sdtype, &W)) return -1;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    for (int t = 0; t < T; t++) {
        if (fmt == FMT_F32)
            memcpy(out + (size_t)t * K, (const float *)w + (size_t)ids[t] * K, sizeof(float) * K);
        else
            dequant_any(&W, ids[t], 1, out + (size_t)t * K);
        if (fmt == FMT_Q4) {  // dequant_rows gives each 32 as 16 even then 16 odd weights: interleave back
            const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
            for (int k = 0; k < K; k += 32) {
                float *r = out + (size_t)t * K + k;
                const __m512 ev = _mm512_loadu_ps(r), od = _mm512_loadu_ps(r + 16);
                _mm512_storeu_ps(r, _mm512_permutex2var_ps(ev, lo, od));
                _mm512_storeu_ps(r + 16, _mm512_permutex2var_ps(ev, hi, od));
            }
        }
    }
    return 0;
}
