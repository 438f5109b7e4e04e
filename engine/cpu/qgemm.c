// Small-M GEMM over weights kept in their stored precision (see engine/cpu/qgemm.py):
//   C[M, N] = A[M, K] @ dequant(W)[N, K]^T, A and C float32 row-major.
// Formats: bfloat16 and float16 weights, and MLX's affine quantization (8 or 4 bits packed little-end
// first into uint32 words, one scale and one bias per `group` consecutive weights of a row, scales and
// biases float32, float16 or bfloat16). GGUF Q8_0 / Q4_0 / Q4_1 load into the affine layout with
// group 32, so their integers are served as stored; GGML's Q5_0 / Q5_1 / K-quant blocks: blocks.h.
//
// Why: a decode step streams every weight once; float32 weights are 2x (bf16), 4x (8-bit) or ~6x
// (4-bit) the bytes, and MLX's own quantized matmul has no fast CPU path. Each 16-weight slice is
// dequantized in registers (w = q * scale + bias, one FMA) and multiplied into every activation row.
// Written once against engine/cpu/simd.h: the same bits on AVX-512, AVX2 and NEON.
//
// Batch invariance: every output element is one 16-lane FMA chain over k in order, then one fixed
// horizontal sum (vhsum), whatever M, the row chunking, the thread split and the instruction set: a row computed in a batch of 5 or
// 256 is bitwise the row computed alone (so verified drafts get plain decoding's logits).
#include "simd.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FMT_BF16 = 1, FMT_F16 = 2, FMT_Q8 = 3, FMT_Q4 = 4, FMT_F32 = 5 };
enum { SC_F32 = 0, SC_F16 = 1, SC_BF16 = 2 };
#ifndef QGEMM_PREFETCH
#define QGEMM_PREFETCH 4096
#endif
// Up to MB2 activation rows dequantize in registers, TILE_R(format, M) weight rows at a time, sized to the
// vector registers: 4 x 6 and 2 x 12 accumulators in 32 zmm; in 16 ymm (a logical vector is two) at most
// 2 x 3. Past MB2 rows (prefill) the activations go in chunks of at most CHUNK rows against WRB weight
// rows at a time, dequantized once into a float32 buffer that stays in L1.
#ifndef TILE_R
#if SS_VREGS >= 32
#define TILE_R(FMT, M) ((M) <= 6 ? 4 : 2)
enum { MB2 = 12, CHUNK = 6 };
#else
#define TILE_R(FMT, M) ((FMT) == FMT_F32 ? ((M) <= 3 ? 2 : 1) : (FMT) == FMT_Q4 ? 1 : ((M) <= 2 ? 2 : 1))
enum { MB2 = 6, CHUNK = 3 };
#endif
#endif
// WRB: weight rows dequantized into the buffer at a time; SHARE: threads split weight rows in multiples.
enum { WRB = 8, SHARE = 4, PREFETCH_BYTES = QGEMM_PREFETCH };
// Groups per weight row the kernel takes (K = 32768 at group 32): their scales sit on the stack.
enum { MAX_GROUPS = 1024 };

typedef struct {
    int fmt, K, group, sdtype, gpr;  // gpr: groups per row
    const uint8_t *w;                // row-major
    const void *scales, *biases;     // [N, gpr]
} Weights;

// A row's `n` group scales (or biases) as float32 in `buf` (n <= MAX_GROUPS): copied or converted (exact);
// returns `buf`. (A copy even of float32 ones lets the blocks index one array from one base.)
static inline const float *group_params(const void *p, size_t at, int n, int sdtype, float *buf) {
    if (sdtype == SC_F32) {
        memcpy(buf, (const float *)p + at, sizeof(float) * (size_t)n);
        return buf;
    }
    const uint16_t *h = (const uint16_t *)p + at;
    int i = 0;
    for (; i + 16 <= n; i += 16) vstore(buf + i, sdtype == SC_F16 ? vload_f16(h + i) : vload_bf16(h + i));
    for (; i < n; i++) buf[i] = sdtype == SC_F16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
    return buf;
}

// Weights k..k+15 of a row as float32 (s, b: the group's scale and bias). FMT is a constant after inlining.
// 4-bit rows: 32 weights in 16 bytes, byte i holding weights 2i (low nibble) and 2i + 1 (high nibble); the
// activations come permuted to match (q4_permute_row): k % 32 < 16 takes the even weights, else the odd.
SS_INLINE vf slice(const int FMT, const uint8_t *row, int k, vf s, vf b, vtab t) {
    if (FMT == FMT_F32) return vload((const float *)row + k);
    if (FMT == FMT_BF16) return vload_bf16((const uint16_t *)row + k);
    if (FMT == FMT_F16) return vload_f16((const uint16_t *)row + k);
    if (FMT == FMT_Q8) return vfma(vload_u8(row + k), s, b);
    const vq q = vq_load(row + (size_t)(k & ~31) / 2);
    return (k & 16) ? vq_hi(q, t) : vq_lo(q, t);
}

static inline size_t row_bytes(const int FMT, int K) {
    return FMT == FMT_Q4 ? (size_t)K / 2 : FMT == FMT_Q8 ? (size_t)K : FMT == FMT_F32 ? 4 * (size_t)K : 2 * (size_t)K;
}

// Named accumulators a<r>_<i> (weight row r < 4, activation row i < 12; an array of them was kept partly
// on the stack by GCC), each used only where r < R and i < M (constants after inlining).
#define EACH_I(X, r) X(r, 0) X(r, 1) X(r, 2) X(r, 3) X(r, 4) X(r, 5) X(r, 6) X(r, 7) X(r, 8) X(r, 9) X(r, 10) X(r, 11)
#define EACH_RI(X) EACH_I(X, 0) EACH_I(X, 1) EACH_I(X, 2) EACH_I(X, 3)
#define EACH_R(X) X(0) X(1) X(2) X(3)
#define ACC_ZERO(r, i) vf a##r##_##i = vzero();
#define ACC_FMA(r, i) if ((r) < R) a##r##_##i = vfma(w##r, x, a##r##_##i);
#define ACC_ROW(i)                                                                                      \
    if ((i) < M) {                                                                                      \
        vf x = vload(A + (size_t)(i) * lda + k);                                                        \
        VKEEP(x);                                                                                       \
        ACC_FMA(0, i) ACC_FMA(1, i) ACC_FMA(2, i) ACC_FMA(3, i)                                         \
    }
#define ACC_ROWS ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5) ACC_ROW(6) ACC_ROW(7)  \
    ACC_ROW(8) ACC_ROW(9) ACC_ROW(10) ACC_ROW(11)
#define ACC_OUT(r, i) if ((r) < R && (i) < M) C[(size_t)(i) * ldc + j + (r)] = vhsum(a##r##_##i);
// Row r's pointer, group parameters and table.
#define ROW_PTR(r) const uint8_t *p##r = W->w + (size_t)(j + ((r) < R ? (r) : 0)) * rb;
#define ROW_PARAMS(r)                                                                                   \
    if ((r) < R) {                                                                                      \
        group_params(W->scales, (size_t)(j + (r)) * W->gpr, W->gpr, W->sdtype, buf[2 * (r)]);          \
        group_params(W->biases, (size_t)(j + (r)) * W->gpr, W->gpr, W->sdtype, buf[2 * (r) + 1]);      \
    }
#define ROW_GROUP(r)                                                                                    \
    if ((r) < R) {  /* broadcasts straight from memory: no arithmetic port */                           \
        s##r = vset1(buf[2 * (r)][g]), b##r = vset1(buf[2 * (r) + 1][g]);                               \
        if (FMT == FMT_Q4) t##r = vtab_make(s##r, b##r);                                                \
    }
#define ROW_PREFETCH(r, at) if ((r) < R) vprefetch((const char *)p##r + (at));
#define ROW_Q(r) const vq q##r = vq_load(p##r + at);
#define ROW_LO(r) vf w##r = vq_lo(q##r, t##r); VKEEP(w##r);
#define ROW_HI(r) vf w##r = vq_hi(q##r, t##r); VKEEP(w##r);
#define ROW_SLICE(r) vf w##r = slice(FMT, p##r, k, s##r, b##r, t##r); VKEEP(w##r);

// Weight rows j..j+R-1 (R <= 4) against M activation rows (M <= 12): each output element one 16-lane
// FMA chain over k in order, then vhsum.
SS_INLINE void block(const int FMT, const int R, const int M, const Weights *W, const float *A, int lda,
                     float *C, int ldc, int j) {
    const int K = W->K, quant = FMT == FMT_Q8 || FMT == FMT_Q4;
    const int step = quant ? W->group : K;
    const size_t rb = row_bytes(FMT, K);
    EACH_R(ROW_PTR)
    EACH_RI(ACC_ZERO)
    vf s0 = vzero(), s1 = s0, s2 = s0, s3 = s0, b0 = s0, b1 = s0, b2 = s0, b3 = s0;
    vtab t0 = vtab_make(s0, s0), t1 = t0, t2 = t0, t3 = t0;
    // Row r's group scales at buf[2r], biases at buf[2r + 1]: one base, fixed offsets (no pointer per row).
    float buf[2 * 4][quant ? MAX_GROUPS : 1];
    if (quant) { EACH_R(ROW_PARAMS) }
    // Group 32 (GGUF's): spelled out as a constant bound, the compiler drops the inner loop.
    const int g32 = quant && step == 32;
    for (int g = 0, k = 0; k < K; g++) {
        if (quant) { EACH_R(ROW_GROUP) }
        if (FMT == FMT_Q4) {  // 32 weights a step: one load per row, its low then its high nibbles
            for (const int end = k + (g32 ? 32 : step); k < end; k += 32) {
                const size_t at = (size_t)k / 2;
                ROW_PREFETCH(0, at + PREFETCH_BYTES) ROW_PREFETCH(1, at + PREFETCH_BYTES)
                ROW_PREFETCH(2, at + PREFETCH_BYTES) ROW_PREFETCH(3, at + PREFETCH_BYTES)
                EACH_R(ROW_Q)
                {
                    EACH_R(ROW_LO)
                    ACC_ROWS
                }
                k += 16;
                {
                    EACH_R(ROW_HI)
                    ACC_ROWS
                }
                k -= 16;
            }
            continue;
        }
        for (const int end = k + (g32 ? 32 : step); k < end; k += 16) {
            const size_t ahead = k * rb / K + PREFETCH_BYTES;
            ROW_PREFETCH(0, ahead) ROW_PREFETCH(1, ahead) ROW_PREFETCH(2, ahead) ROW_PREFETCH(3, ahead)
            EACH_R(ROW_SLICE)
            ACC_ROWS
        }
    }
    EACH_RI(ACC_OUT)
}

typedef void (*block_fn)(const Weights *, const float *, int, float *, int, int);

#define DEF_B(FMT, M)                                                                                   \
    static void b1_##FMT##_##M(const Weights *W, const float *A, int lda, float *C, int ldc, int j) {   \
        block(FMT, 1, M, W, A, lda, C, ldc, j);                                                         \
    }                                                                                                   \
    static void bw_##FMT##_##M(const Weights *W, const float *A, int lda, float *C, int ldc, int j) {   \
        block(FMT, TILE_R(FMT, M), M, W, A, lda, C, ldc, j);                                             \
    }
// One weight row, and TILE_R weight rows.
#define DEF_FMT(FMT) DEF_B(FMT, 1) DEF_B(FMT, 2) DEF_B(FMT, 3) DEF_B(FMT, 4) DEF_B(FMT, 5) DEF_B(FMT, 6)     \
    DEF_B(FMT, 7) DEF_B(FMT, 8) DEF_B(FMT, 9) DEF_B(FMT, 10) DEF_B(FMT, 11) DEF_B(FMT, 12)
DEF_FMT(1) DEF_FMT(2) DEF_FMT(3) DEF_FMT(4) DEF_FMT(5)
#define ROWS(FMT) {0, b1_##FMT##_1, b1_##FMT##_2, b1_##FMT##_3, b1_##FMT##_4, b1_##FMT##_5, b1_##FMT##_6,    \
                   b1_##FMT##_7, b1_##FMT##_8, b1_##FMT##_9, b1_##FMT##_10, b1_##FMT##_11, b1_##FMT##_12},   \
                  {0, bw_##FMT##_1, bw_##FMT##_2, bw_##FMT##_3, bw_##FMT##_4, bw_##FMT##_5, bw_##FMT##_6,    \
                   bw_##FMT##_7, bw_##FMT##_8, bw_##FMT##_9, bw_##FMT##_10, bw_##FMT##_11, bw_##FMT##_12}
// [format][several weight rows?][M]: one weight row a call, or TILE_R(format, M).
typedef char mb2_fits[MB2 <= 12 ? 1 : -1];
static const block_fn BLOCKS[6][2][13] = {{{0}, {0}}, {ROWS(1)}, {ROWS(2)}, {ROWS(3)}, {ROWS(4)}, {ROWS(5)}};

// Rows j..j+n-1 dequantized into buf ([n, K] float32): each weight the value slice() gives in registers.
SS_INLINE void dequant_rows(const int FMT, const Weights *W, int j, int n, float *buf) {
    const int K = W->K, quant = FMT == FMT_Q8 || FMT == FMT_Q4, step = quant ? W->group : K;
    const size_t rb = row_bytes(FMT, K);
    float tmp[2][quant ? MAX_GROUPS : 1];
    for (int r = 0; r < n; r++) {
        const uint8_t *row = W->w + (size_t)(j + r) * rb;
        const float *sc = quant ? group_params(W->scales, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, tmp[0]) : NULL;
        const float *bi = quant ? group_params(W->biases, (size_t)(j + r) * W->gpr, W->gpr, W->sdtype, tmp[1]) : NULL;
        for (int g = 0, k = 0; k < K; g++) {
            const vf sv = vset1(quant ? sc[g] : 0.0f), bv = vset1(quant ? bi[g] : 0.0f);
            const vtab tv = vtab_make(sv, bv);
            for (const int end = k + step; k < end; k += 16) vstore(buf + (size_t)r * K + k, slice(FMT, row, k, sv, bv, tv));
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

// Weight rows j0..j1-1 against all M rows. Up to MB2 rows dequantize in registers, TILE_R rows a block.
// More rows go in balanced chunks of <= CHUNK against WRB weight rows at a time; a low-precision block
// of them is dequantized once into `buf` (WRB * K floats) that every chunk reads from L1: the same values
// and the same FMA chain per output element as in registers, so the same bits.
static void run(const Weights *W, int M, int j0, int j1, const float *A, int lda, float *C, int ldc, float *buf) {
    if (M <= MB2) {
        const int wr = TILE_R(W->fmt, M);
        for (int j = j0; j < j1; j += wr) {
            const int many = j + wr <= j1;
            const int rend = many ? j + wr : j1;
            for (int jj = j; jj < rend; jj += many ? wr : 1) BLOCKS[W->fmt][many][M](W, A, lda, C, ldc, jj);
        }
        return;
    }
    const int chunks = (M + CHUNK - 1) / CHUNK;
    if (W->fmt == FMT_F32) buf = NULL;
    const Weights F = {FMT_F32, W->K, W->K, SC_F32, 1, (const uint8_t *)buf, NULL, NULL};
    for (int j = j0; j < j1; j += WRB) {
        const int jn = j1 - j < WRB ? j1 - j : WRB;
        if (buf) dequant_any(W, j, jn, buf);
        for (int c = 0, r0 = 0; c < chunks; c++) {
            const int rows = (M - r0) / (chunks - c);
            const int fmt = buf ? FMT_F32 : W->fmt, wr = TILE_R(fmt, rows);
            for (int jj = 0; jj < jn;) {
                const int many = jj + wr <= jn;
                if (buf)
                    BLOCKS[FMT_F32][many][rows](&F, A + (size_t)r0 * lda, lda, C + (size_t)r0 * ldc + j, ldc, jj);
                else
                    BLOCKS[W->fmt][many][rows](W, A + (size_t)r0 * lda, lda, C + (size_t)r0 * ldc, ldc, j + jj);
                jj += many ? wr : 1;
            }
            r0 += rows;
        }
    }
}

// Thread t of n takes weight rows [*j0, *j1): even shares in multiples of SHARE.
static inline void share(int N, int n, int t, int *j0, int *j1) {
    const int per = ((N + n - 1) / n + SHARE - 1) / SHARE * SHARE;
    *j0 = t * per < N ? t * per : N;
    *j1 = *j0 + per < N ? *j0 + per : N;
}

// Row i of A ([K] floats) as qgemm's 4-bit blocks read it: each 32 as their 16 even then 16 odd elements.
static inline void q4_permute_row(const float *a, int K, float *d) {
    for (int k = 0; k < K; k += 32) {
        vf even, odd;
        vdeint(a + k, &even, &odd);
        vstore(d + k, even), vstore(d + k + 16, odd);
    }
}

// Activations quantized per row for the int8 products (qgemm_i8 below, and the C layers).
typedef struct {
    const int8_t *q;     // [M, K], each 32 as 16 even then 16 odd elements
    const float *d, *s;  // [M, nbp]: block scale, scale * sum of the block's q (zero past K / 32)
    int K, nbp;
} QAct;

static inline int i8_padded_blocks(int K) { return (K / 32 + 7) / 8 * 8; }

// One block of 32 values given as two 16-lane vectors: q = round(x / d) stored (the first vector's 16, then
// the second's), d returned; sums[0..2]: d * sum(q) over the block, over the first 16, over the second 16.
SS_INLINE float q8_block(vf a, vf b, int8_t *q, float *sums) {
    const float amax = vhmax(vmax(vabs(a), vabs(b)));
    const float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    // Rounded to nearest, ties to even (lrintf's rounding); integers below 2^24 sum exactly in floats.
    const vf qa = vround(vmul(a, vset1(id))), qb = vround(vmul(b, vset1(id)));
    vstore_i8(q, qa), vstore_i8(q + 16, qb);
    sums[0] = dd * vhsum(vadd(qa, qb)), sums[1] = dd * vhsum(qa), sums[2] = dd * vhsum(qb);
    return dd;
}

static void q8_quantize_row(const float *a, int K, int8_t *q, float *d, float *s) {
    const int nb = K / 32;
    for (int b = 0; b < nb; b++) {
        vf even, odd;
        float sums[3];
        vdeint(a + (size_t)b * 32, &even, &odd);
        d[b] = q8_block(even, odd, q + (size_t)b * 32, sums);
        s[b] = sums[0];
    }
    for (int b = nb; b < i8_padded_blocks(K); b++) d[b] = s[b] = 0.0f;
}

// A product's input as the 4-bit kernels read it: permuted floats (xp, float activations) or rows
// quantized to int8 (q, with ds: [T, nbp] block scales, then [T, nbp] scaled sums).
typedef struct {
    float *xp;
    int8_t *q;
    float *ds;
    int K, nbp, T;
} Q4In;

static int q4in_alloc(Q4In *a, int int8, int T, int K) {
    a->K = K, a->T = T, a->nbp = i8_padded_blocks(K), a->xp = NULL, a->q = NULL, a->ds = NULL;
    if (!int8) return (a->xp = malloc(sizeof(float) * (size_t)T * K)) != NULL;
    a->q = malloc((size_t)T * K);
    a->ds = malloc(sizeof(float) * 2 * (size_t)T * a->nbp);
    return a->q && a->ds;
}

static void q4in_free(Q4In *a) { free(a->xp), free(a->q), free(a->ds); }

// Row t of x into a's row t.
static void q4in_row(const Q4In *a, const float *x, int t) {
    if (a->xp) {
        q4_permute_row(x, a->K, a->xp + (size_t)t * a->K);
        return;
    }
    q8_quantize_row(x, a->K, a->q + (size_t)t * a->K, a->ds + (size_t)t * a->nbp,
                    a->ds + (size_t)(a->T + t) * a->nbp);
}

static inline QAct q4in_act(const Q4In *a) {
    const QAct X = {a->q, a->ds, a->ds + (size_t)a->T * a->nbp, a->K, a->nbp};
    return X;
}

// Threads for a product of N weight rows (`bytes` of weights): small ones stay on this thread, larger
// ones split the weight rows evenly, in multiples of SHARE.
static int product_threads(size_t bytes, int N, int max_threads) {
    int nth = omp_get_max_threads();
    if (max_threads > 0 && nth > max_threads) nth = max_threads;
    return bytes < 65536 || N < 2 * SHARE || nth < 2 ? 1 : nth;
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

// Weight rows a register tile takes at M activation rows (0 past MB2): tests check each ISA gets its own.
int qgemm_tile_rows(int fmt, int M) { return M >= 1 && M <= MB2 ? TILE_R(fmt, M) : 0; }

// Returns 0, or -1 for arguments it does not handle (the caller dequantizes instead).
int qgemm(int fmt, int M, int N, int K, int group, const float *A, int lda, const void *w, const void *scales,
          const void *biases, int sdtype, float *C, int ldc, int max_threads) {
    Weights W;
    if (M < 1 || weights_of(fmt, N, K, group, w, scales, biases, sdtype, &W)) return -1;
    Q4In perm = {0};
    if (fmt == FMT_Q4) {
        if (!q4in_alloc(&perm, 0, M, K)) return -1;
        for (int i = 0; i < M; i++) q4in_row(&perm, A + (size_t)i * lda, i);
        A = perm.xp;
        lda = K;
    }
    const int nth = product_threads(row_bytes(fmt, K) * (size_t)N, N, max_threads);
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        // Without the buffer (none needed, or malloc failed) every chunk dequantizes in registers: same bits.
        float *buf = M > MB2 && fmt != FMT_F32 ? malloc(sizeof(float) * WRB * (size_t)K) : NULL;
        int j0, j1;
        share(N, omp_get_num_threads(), omp_get_thread_num(), &j0, &j1);
        if (j0 < j1) run(&W, M, j0, j1, A, lda, C, ldc, buf);
        free(buf);
    }
    q4in_free(&perm);
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
            for (int k = 0; k < K; k += 32) {
                float *r = out + (size_t)t * K + k, tmp[32];
                memcpy(tmp, r, sizeof(tmp));
                for (int i = 0; i < 16; i++) r[2 * i] = tmp[i], r[2 * i + 1] = tmp[16 + i];
            }
        }
    }
    return 0;
}

// ---- 8-bit activations (activation precision int8) against 4-bit weights ----
// Each activation row is quantized on its own, per 32 values: d = max|x| / 127, q = round(x / d) (ties to
// even), kept permuted as q4_permute_row orders floats, with d and d * sum(q) per block. Per weight group
// (scale s, bias b) and activation block: sum(w x) ~ s d sum(q_w q_x) + b d sum(q_x). The integer dots go
// into 8 lanes, one FMA per lane with s * d, even blocks into one accumulator and odd ones into another
// (two chains in flight); the bias terms are 8-lane FMAs over blocks 8 at a time; each ends in one fixed
// horizontal sum. Every element is that sequence whatever M, the chunking and the threads.
enum { MAX_BLOCKS = MAX_GROUPS + 8 };  // blocks per row, padded to a multiple of 8

// Activation rows per int8 block: 2 accumulators a row (even and odd blocks) beside 2 weight vectors.
#if SS_VREGS >= 32
enum { I8_MB = 8 };
#else
enum { I8_MB = 4 };
#endif
#define I8_EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

// Weight row j against activation rows 0..M-1 of X (M <= I8_MB).
// Weight row j's scale and bias per 32-weight block (group 32: as stored; wider groups repeated), zero
// past the row's blocks up to nbp.
static inline void block_params(const Weights *W, int j, int nbp, float *sc, float *bi) {
    const int nb = W->K / 32, gs = __builtin_ctz((unsigned)(W->group / 32));
    group_params(W->scales, (size_t)j * W->gpr, W->gpr, W->sdtype, sc);
    group_params(W->biases, (size_t)j * W->gpr, W->gpr, W->sdtype, bi);
    if (gs > 0)
        for (int b = nb - 1; b >= 0; b--) sc[b] = sc[b >> gs], bi[b] = bi[b >> gs];  // in place, from the end
    for (int b = nb; b < nbp; b++) sc[b] = bi[b] = 0.0f;
}

// The bias terms of M activation rows (row i's sums at xs + i * stride): 8-lane FMAs over the np
// parameters in order, one horizontal sum each.
static inline void bias_terms(const float *wb, const float *xs, size_t stride, int np, int M, float *bias) {
    for (int i = 0; i < M; i++) {
        iacc v = iacc_zero();
        const float *x = xs + (size_t)i * stride;
        for (int p = 0; p < np; p += 8) v = iacc_fma(iacc_load(wb + p), iacc_load(x + p), v);
        bias[i] = ihsum(v);
    }
}

SS_INLINE void block_i8(const int M, const Weights *W, const QAct *X, float *C, int ldc, int j) {
    const int K = W->K, nb = K / 32, nbp = X->nbp;
    float sc[MAX_BLOCKS], bi[MAX_BLOCKS], bias[8];  // 8: the most rows a block takes
    block_params(W, j, nbp, sc, bi);
    bias_terms(bi, X->s, (size_t)nbp, nbp, M, bias);
    // Blocks in pairs: each lane's FMA with s * d (one rounding), even blocks in lanes 0-7, odd in 8-15.
#define I8_INIT(i) iacc2 a##i = iacc2_zero(); const int8_t *x##i = X->q + (size_t)((i) < M ? (i) : 0) * K; \
    const float *d##i = X->d + (size_t)((i) < M ? (i) : 0) * nbp;
    I8_EACH(I8_INIT)
#undef I8_INIT
    const uint8_t *row = W->w + (size_t)j * (K / 2);
#define I8_PAIR(i) if ((i) < M) a##i = ifma_pair(w, x##i + (size_t)b * 32, sc + b, d##i + b, a##i);
#define I8_LAST(i) if ((i) < M) a##i = ifma_first(w0, x##i + (size_t)b * 32, sc[b] * d##i[b], sc[b] * d##i[b], a##i);
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        if (!(b & 3)) vprefetch((const char *)row + (size_t)b * 16 + PREFETCH_BYTES);
        iw w0, w1;
        iw_q4x2(row + (size_t)b * 16, &w0, &w1);
        const iw2 w = iw2_pair(w0, w1);
        I8_EACH(I8_PAIR)
    }
    if (b < nb) {
        const iw w0 = iw_q4(row + (size_t)b * 16);
        I8_EACH(I8_LAST)
    }
#undef I8_PAIR
#undef I8_LAST
#define I8_OUT(i) if ((i) < M) C[(size_t)(i) * ldc + j] = ihsum2(a##i) + bias[i];
    I8_EACH(I8_OUT)
#undef I8_OUT
}

typedef void (*block_i8_fn)(const Weights *, const QAct *, float *, int, int);
#define DEF_I8(M) static void bi8_##M(const Weights *W, const QAct *X, float *C, int ldc, int j) { \
        block_i8(M, W, X, C, ldc, j); }
DEF_I8(1) DEF_I8(2) DEF_I8(3) DEF_I8(4) DEF_I8(5) DEF_I8(6) DEF_I8(7) DEF_I8(8)
#undef DEF_I8
static const block_i8_fn BLOCKS_I8[9] = {0, bi8_1, bi8_2, bi8_3, bi8_4, bi8_5, bi8_6, bi8_7, bi8_8};

// Weight rows j0..j1-1 against all M quantized rows, in balanced chunks of at most I8_MB rows.
static void run_i8(const Weights *W, int M, int j0, int j1, const QAct *X, float *C, int ldc) {
    const int chunks = (M + I8_MB - 1) / I8_MB;
    for (int c = 0, i0 = 0; c < chunks; c++) {
        const int m = (M - i0) / (chunks - c);
        const size_t at = (size_t)i0 * X->nbp;
        const QAct Xi = {X->q + (size_t)i0 * X->K, X->d + at, X->s + at, X->K, X->nbp};
        for (int j = j0; j < j1; j++) BLOCKS_I8[m](W, &Xi, C + (size_t)i0 * ldc, ldc, j);
        i0 += m;
    }
}

#include "blocks.h"  // natural-order activation rows: GGML's blocks, and 8-bit weights (run_q8i8)

// Whether the int8 path serves these weights: 4- or 8-bit, groups of 32 times a power of two.
static inline int i8_serves(const Weights *W) {
    const int gb = W->group / 32;
    return (W->fmt == FMT_Q4 || W->fmt == FMT_Q8) && W->group % 32 == 0 && (gb & (gb - 1)) == 0;  // shifts
}

// C = A @ W^T with A's rows quantized to int8 first (4- and 8-bit weights). Returns 0, or -1 for arguments
// it does not handle.
int qgemm_i8(int fmt, int M, int N, int K, int group, const float *A, int lda, const void *w, const void *scales,
             const void *biases, int sdtype, float *C, int ldc, int max_threads) {
    Weights W;
    if (M < 1 || weights_of(fmt, N, K, group, w, scales, biases, sdtype, &W) || !i8_serves(&W)) return -1;
    if (fmt == FMT_Q8) return q8_i8(&W, M, N, A, lda, C, ldc, max_threads);
    Q4In a;
    if (!q4in_alloc(&a, 1, M, K)) {
        q4in_free(&a);
        return -1;
    }
    for (int i = 0; i < M; i++) q4in_row(&a, A + (size_t)i * lda, i);
    const QAct X = q4in_act(&a);
    const int nth = product_threads(row_bytes(fmt, K) * (size_t)N, N, max_threads);
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        int j0, j1;
        share(N, omp_get_num_threads(), omp_get_thread_num(), &j0, &j1);
        if (j0 < j1) run_i8(&W, M, j0, j1, &X, C, ldc);
    }
    q4in_free(&a);
    return 0;
}

