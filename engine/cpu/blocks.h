// GGML's block formats as a GGUF file stores them, multiplied with 8-bit activations (included by qgemm.c;
// engine/cpu/qgemm.py's BlockWeights): Q5_0 and Q5_1 (32 weights a block), Q4_K and Q5_K (256 a
// super-block, 8 sub-blocks of 32 with 6-bit scales and mins) and Q6_K (256, 16 sub-blocks of 16 with
// 8-bit scales). A weight is w = s * u + b, u its unsigned integer (below 64), s and b its (sub-)block's:
//   Q5_0: d, -16 d;  Q5_1: d, m;  Q4_K / Q5_K: d * sc, -(dmin * m);  Q6_K: d * sc, -32 d * sc (per 16).
// Activation rows are quantized on their own per 32 values in their natural order (q8_block: the values
// qgemm_i8 gets, unpermuted). Per block and activation row: the 32 bytes u dotted with q in 8 integer lanes
// (idot: exact), one FMA a lane with s * d (Q6_K: lanes 0-3 and 4-7 have their halves' scales), even and
// odd blocks into two accumulators; the bias terms b * d * sum(q) (per block, Q6_K per half) as 8-lane FMAs
// in order; one fixed horizontal sum each. Every output element is that sequence whatever M, the chunking,
// the thread split and the ISA, so a row in a batch is bitwise the row alone.
enum { GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14 };  // GGML's type ids

// Bytes per block and weights per block of a format (0: not one of these).
static inline int gg_block_bytes(int fmt) {
    return fmt == GG_Q5_0 ? 22 : fmt == GG_Q5_1 ? 24 : fmt == GG_Q4_K ? 144 : fmt == GG_Q5_K ? 176
         : fmt == GG_Q6_K ? 210 : 0;
}
static inline int gg_block_weights(int fmt) { return fmt == GG_Q5_0 || fmt == GG_Q5_1 ? 32 : 256; }

typedef struct {
    int fmt, K;
    size_t rb;         // bytes per weight row
    const uint8_t *w;  // [N, rb]
} GWeights;

// Activation rows as the block products read them.
typedef struct {
    const int8_t *q;        // [M, K], natural order
    const float *d, *s;     // [M, nbp]: block scale, d * sum(q) (zero past K / 32)
    const float *h;         // [M, nhp]: d * sum(q) per 16 values (zero past K / 16)
    int K, nbp, nhp;
} GAct;

// Sub-block scales (or mins) j = 0..7 of a K-quant super-block: 6 bits each, packed in 12 bytes.
static inline void gg_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline float gg_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// Block b of a weight row: its 32 integers u, in order.
SS_INLINE iw gg_unpack(const int FMT, const uint8_t *row, int b) {
    if (FMT == GG_Q5_0 || FMT == GG_Q5_1) {
        const uint8_t *qh = row + (size_t)b * gg_block_bytes(FMT) + (FMT == GG_Q5_0 ? 2 : 4);
        uint32_t h;
        memcpy(&h, qh, 4);
        return iw_add_bits32(iw_q4(qh + 4), h);  // byte j: low nibble element j, high one j + 16
    }
    const int t = b & 7;
    const uint8_t *sb = row + (size_t)(b >> 3) * gg_block_bytes(FMT);
    if (FMT == GG_Q6_K) {  // per 128: ql[64], qh[32]; block r of the four takes ql's half r & 1, nibble r >> 1
        const int n = t >> 2, r = t & 3;
        const iw lo = iw_field(iw_load(sb + 64 * n + 32 * (r & 1)), 4 * (r >> 1), 15);
        return iw_or_hi(lo, iw_field(iw_load(sb + 128 + 32 * n), 2 * r, 3));
    }
    // Q4_K / Q5_K: 32 bytes per pair of sub-blocks, the first's in the low nibbles; Q5_K's fifth bits of
    // sub-block t are bit t of its 32 qh bytes.
    const iw lo = iw_field(iw_load(sb + (FMT == GG_Q4_K ? 16 : 48) + 32 * (t >> 1)), 4 * (t & 1), 15);
    return FMT == GG_Q4_K ? lo : iw_or_hi(lo, iw_field(iw_load(sb + 16), t, 1));
}

// A weight row's scales and biases: per block (Q6_K: per 16 weights), zero-padded to np.
static void gg_params(const int FMT, const uint8_t *row, int K, float *ws, float *wb, int np) {
    int n = 0;
    if (FMT == GG_Q5_0 || FMT == GG_Q5_1) {
        for (int b = 0; b < K / 32; b++, n++) {
            const uint8_t *blk = row + (size_t)b * gg_block_bytes(FMT);
            ws[n] = gg_f16(blk);
            wb[n] = FMT == GG_Q5_0 ? -16.0f * ws[n] : gg_f16(blk + 2);
        }
    } else {
        for (int s = 0; s < K / 256; s++) {
            const uint8_t *sb = row + (size_t)s * gg_block_bytes(FMT);
            if (FMT == GG_Q6_K) {
                const float d = gg_f16(sb + 208);
                for (int h = 0; h < 16; h++, n++) ws[n] = d * (float)(int8_t)sb[192 + h], wb[n] = -32.0f * ws[n];
                continue;
            }
            const float d = gg_f16(sb), dmin = gg_f16(sb + 2);
            for (int j = 0; j < 8; j++, n++) {
                int sc, m;
                gg_scale_min(sb + 4, j, &sc, &m);
                ws[n] = d * (float)sc, wb[n] = -(dmin * (float)m);
            }
        }
    }
    for (; n < np; n++) ws[n] = wb[n] = 0.0f;
}

// Weight row j against activation rows 0..M-1 of X (M <= I8_MB).
SS_INLINE void gblock(const int FMT, const int M, const GWeights *W, const GAct *X, float *C, int ldc, int j) {
    const int K = W->K, nb = K / 32, halves = FMT == GG_Q6_K;
    const int np = halves ? X->nhp : X->nbp;
    float ws[2 * MAX_BLOCKS], wb[2 * MAX_BLOCKS], bias[8];  // 8: the most rows a block takes
    const uint8_t *row = W->w + (size_t)j * W->rb;
    gg_params(FMT, row, K, ws, wb, np);
    bias_terms(wb, halves ? X->h : X->s, (size_t)np, np, M, bias);
    // Row i's block scale d_i[b] times the weights' (s * d, one rounding), then one FMA a lane; blocks in
    // pairs, the even ones into lanes 0-7 of the accumulator, the odd ones into lanes 8-15.
#define G_INIT(i) iacc2 a##i = iacc2_zero(); const int8_t *x##i = X->q + (size_t)((i) < M ? (i) : 0) * K; \
    const float *d##i = X->d + (size_t)((i) < M ? (i) : 0) * X->nbp;
    I8_EACH(G_INIT)
#undef G_INIT
#define G_PAIR(i)                                                                                       \
    if ((i) < M) {                                                                                      \
        if (halves) a##i = ifma_pair_halves(u, x##i + (size_t)b * 32, ws + 2 * b, d##i + b, a##i);       \
        else a##i = ifma_pair(u, x##i + (size_t)b * 32, ws + b, d##i + b, a##i);                          \
    }
#define G_LAST(i)                                                                                       \
    if ((i) < M) {                                                                                      \
        const float s0 = ws[halves ? 2 * b : b] * d##i[b], s1 = halves ? ws[2 * b + 1] * d##i[b] : s0;  \
        a##i = ifma_first(u, x##i + (size_t)b * 32, s0, s1, a##i);                                      \
    }
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        if (!(b & 3)) vprefetch((const char *)row + (size_t)b * W->rb / nb + PREFETCH_BYTES);
        const iw2 u = iw2_pair(gg_unpack(FMT, row, b), gg_unpack(FMT, row, b + 1));
        I8_EACH(G_PAIR)
    }
    if (b < nb) {
        const iw u = gg_unpack(FMT, row, b);
        I8_EACH(G_LAST)
    }
#undef G_PAIR
#undef G_LAST
#define G_OUT(i) if ((i) < M) C[(size_t)(i) * ldc + j] = ihsum2(a##i) + bias[i];
    I8_EACH(G_OUT)
#undef G_OUT
}

typedef void (*gblock_fn)(const GWeights *, const GAct *, float *, int, int);
#define DEF_G(F, M) static void gb_##F##_##M(const GWeights *W, const GAct *X, float *C, int ldc, int j) { \
        gblock(F, M, W, X, C, ldc, j); }
#define DEF_GF(F) DEF_G(F, 1) DEF_G(F, 2) DEF_G(F, 3) DEF_G(F, 4) DEF_G(F, 5) DEF_G(F, 6) DEF_G(F, 7) DEF_G(F, 8)
DEF_GF(6) DEF_GF(7) DEF_GF(12) DEF_GF(13) DEF_GF(14)
#define GROWS(F) {0, gb_##F##_1, gb_##F##_2, gb_##F##_3, gb_##F##_4, gb_##F##_5, gb_##F##_6, gb_##F##_7, gb_##F##_8}
static const gblock_fn GBLOCKS[5][9] = {GROWS(6), GROWS(7), GROWS(12), GROWS(13), GROWS(14)};
#undef GROWS
#undef DEF_GF
#undef DEF_G

static inline int gg_index(int fmt) {
    return fmt == GG_Q5_0 ? 0 : fmt == GG_Q5_1 ? 1 : fmt == GG_Q4_K ? 2 : fmt == GG_Q5_K ? 3 : 4;
}

// X's rows from i0 on.
static inline GAct gact_from(const GAct *X, int i0) {
    const GAct Xi = {X->q + (size_t)i0 * X->K, X->d + (size_t)i0 * X->nbp, X->s + (size_t)i0 * X->nbp,
                     X->h + (size_t)i0 * X->nhp, X->K, X->nbp, X->nhp};
    return Xi;
}

// Weight rows j0..j1-1 against all M rows, in balanced chunks of at most I8_MB rows.
static void run_blocks(const GWeights *W, int M, int j0, int j1, const GAct *X, float *C, int ldc) {
    const gblock_fn *fns = GBLOCKS[gg_index(W->fmt)];
    const int chunks = (M + I8_MB - 1) / I8_MB;
    for (int c = 0, i0 = 0; c < chunks; c++) {
        const int m = (M - i0) / (chunks - c);
        const GAct Xi = gact_from(X, i0);
        for (int j = j0; j < j1; j++) fns[m](W, &Xi, C + (size_t)i0 * ldc, ldc, j);
        i0 += m;
    }
}

// The GWeights of a product, or -1 for arguments the kernel does not handle.
static int gweights_of(int fmt, int N, int K, const void *w, GWeights *W) {
    if (!gg_block_bytes(fmt) || N < 1 || K < 32 || K % gg_block_weights(fmt) || K / 32 > MAX_GROUPS) return -1;
    const GWeights v = {fmt, K, (size_t)(K / gg_block_weights(fmt)) * gg_block_bytes(fmt), (const uint8_t *)w};
    *W = v;
    return 0;
}

// Activation rows quantized for the block products (owned buffers).
typedef struct {
    int8_t *q;
    float *p;  // d [T, nbp], s [T, nbp], h [T, nhp]
    int K, T, nbp, nhp;
} GIn;

static int gin_alloc(GIn *a, int T, int K) {
    a->K = K, a->T = T, a->nbp = i8_padded_blocks(K), a->nhp = (K / 16 + 7) / 8 * 8;
    a->q = malloc((size_t)T * K);
    a->p = calloc((size_t)T * (2 * a->nbp + a->nhp), sizeof(float));
    return a->q && a->p;
}

static void gin_free(GIn *a) { free(a->q), free(a->p); }

static void gin_row(const GIn *a, const float *x, int t) {
    float *d = a->p + (size_t)t * a->nbp, *s = a->p + (size_t)(a->T + t) * a->nbp;
    float *h = a->p + (size_t)2 * a->T * a->nbp + (size_t)t * a->nhp;
    for (int b = 0; b < a->K / 32; b++) {
        float sums[3];
        d[b] = q8_block(vload(x + (size_t)b * 32), vload(x + (size_t)b * 32 + 16), a->q + (size_t)t * a->K + b * 32, sums);
        s[b] = sums[0], h[2 * b] = sums[1], h[2 * b + 1] = sums[2];
    }
}

static inline GAct gin_act(const GIn *a) {
    const GAct X = {a->q, a->p, a->p + (size_t)a->T * a->nbp, a->p + (size_t)2 * a->T * a->nbp, a->K, a->nbp, a->nhp};
    return X;
}

// A product over natural-order int8 rows: A's M rows quantized, then `run` over each thread's share of
// the N weight rows (`bytes` of them). Returns 0, or -1 where memory ran out.
typedef void (*grun_fn)(const void *W, int M, int j0, int j1, const GAct *X, float *C, int ldc);
static int gin_product(grun_fn run, const void *W, size_t bytes, int M, int N, int K, const float *A, int lda,
                       float *C, int ldc, int max_threads) {
    GIn a;
    if (!gin_alloc(&a, M, K)) {
        gin_free(&a);
        return -1;
    }
    for (int i = 0; i < M; i++) gin_row(&a, A + (size_t)i * lda, i);
    const GAct X = gin_act(&a);
    const int nth = product_threads(bytes, N, max_threads);
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        int j0, j1;
        share(N, omp_get_num_threads(), omp_get_thread_num(), &j0, &j1);
        if (j0 < j1) run(W, M, j0, j1, &X, C, ldc);
    }
    gin_free(&a);
    return 0;
}

static void run_blocks_any(const void *W, int M, int j0, int j1, const GAct *X, float *C, int ldc) {
    run_blocks(W, M, j0, j1, X, C, ldc);
}

// C = A @ W^T, W in GGML block format `fmt` (GGML's type id), A's rows quantized to int8 first. Returns 0,
// or -1 for arguments it does not handle.
int qgemm_blocks(int fmt, int M, int N, int K, const float *A, int lda, const void *w, float *C, int ldc,
                 int max_threads) {
    GWeights W;
    if (M < 1 || gweights_of(fmt, N, K, w, &W)) return -1;
    return gin_product(run_blocks_any, &W, W.rb * (size_t)N, M, N, K, A, lda, C, ldc, max_threads);
}

// ---- 8-bit affine weights (MLX's layout: a byte u per weight, w = s * u + b per group) with 8-bit
// activations, the rows in natural order: v = u - 128 dotted with q as signed bytes, one FMA a lane with
// s * d, even and odd blocks in two accumulators; the bias terms (b + 128 s) * d * sum(q) (for GGUF's Q8_0,
// b = -128 s: zero) as 8-lane FMAs; one fixed horizontal sum each.
SS_INLINE void block_q8i8(const int M, const Weights *W, const GAct *X, float *C, int ldc, int j) {
    const int K = W->K, nb = K / 32, nbp = X->nbp;
    float sc[MAX_BLOCKS], bb[MAX_BLOCKS], bias[8];
    block_params(W, j, nbp, sc, bb);
    for (int b = 0; b < nb; b++) bb[b] = bb[b] + 128.0f * sc[b];
    bias_terms(bb, X->s, (size_t)nbp, nbp, M, bias);
#define Q_INIT(i) iacc e##i = iacc_zero(), o##i = e##i; const int8_t *x##i = X->q + (size_t)((i) < M ? (i) : 0) * K; \
    const float *d##i = X->d + (size_t)((i) < M ? (i) : 0) * nbp;
    I8_EACH(Q_INIT)
#undef Q_INIT
    const uint8_t *row = W->w + (size_t)j * K;
#define Q_EVEN(i) if ((i) < M) e##i = ifma(idot_s8(v0, x##i + (size_t)b * 32), sc[b] * d##i[b], e##i);
#define Q_ODD(i) if ((i) < M) o##i = ifma(idot_s8(v1, x##i + (size_t)b * 32 + 32), sc[b + 1] * d##i[b + 1], o##i);
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        if (!(b & 1)) vprefetch((const char *)row + (size_t)b * 32 + PREFETCH_BYTES);
        const iw v0 = iw_s8(iw_load(row + (size_t)b * 32)), v1 = iw_s8(iw_load(row + (size_t)b * 32 + 32));
        I8_EACH(Q_EVEN)
        I8_EACH(Q_ODD)
    }
    if (b < nb) {
        const iw v0 = iw_s8(iw_load(row + (size_t)b * 32));
        I8_EACH(Q_EVEN)
    }
#undef Q_EVEN
#undef Q_ODD
#define Q_OUT(i) if ((i) < M) C[(size_t)(i) * ldc + j] = ihsum(iacc_add(e##i, o##i)) + bias[i];
    I8_EACH(Q_OUT)
#undef Q_OUT
}

#define DEF_Q(M) static void q8b_##M(const Weights *W, const GAct *X, float *C, int ldc, int j) { \
        block_q8i8(M, W, X, C, ldc, j); }
DEF_Q(1) DEF_Q(2) DEF_Q(3) DEF_Q(4) DEF_Q(5) DEF_Q(6) DEF_Q(7) DEF_Q(8)
#undef DEF_Q
typedef void (*block_q8_fn)(const Weights *, const GAct *, float *, int, int);
static const block_q8_fn BLOCKS_Q8[9] = {0, q8b_1, q8b_2, q8b_3, q8b_4, q8b_5, q8b_6, q8b_7, q8b_8};

// Weight rows j0..j1-1 of 8-bit weights against all M rows, in balanced chunks of at most I8_MB rows.
static void run_q8i8(const Weights *W, int M, int j0, int j1, const GAct *X, float *C, int ldc) {
    const int chunks = (M + I8_MB - 1) / I8_MB;
    for (int c = 0, i0 = 0; c < chunks; c++) {
        const int m = (M - i0) / (chunks - c);
        const GAct Xi = gact_from(X, i0);
        for (int j = j0; j < j1; j++) BLOCKS_Q8[m](W, &Xi, C + (size_t)i0 * ldc, ldc, j);
        i0 += m;
    }
}

static void run_q8i8_any(const void *W, int M, int j0, int j1, const GAct *X, float *C, int ldc) {
    run_q8i8(W, M, j0, j1, X, C, ldc);
}

// qgemm_i8 for 8-bit weights (checked by the caller).
static int q8_i8(const Weights *W, int M, int N, const float *A, int lda, float *C, int ldc, int max_threads) {
    return gin_product(run_q8i8_any, W, (size_t)W->K * N, M, N, W->K, A, lda, C, ldc, max_threads);
}

// Rows ids[0..T-1] as float32 (out: [T, K]), each value as GGML (and the gguf package) dequantizes it:
// s * (u - 16) for Q5_0, s * (u - 32) for Q6_K, s * u + b otherwise. Returns 0, or -1.
int qgemm_blocks_rows(int fmt, int N, int K, const void *w, const int32_t *ids, int T, float *out) {
    GWeights W;
    if (gweights_of(fmt, N, K, w, &W)) return -1;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    const int halves = fmt == GG_Q6_K, off = fmt == GG_Q5_0 ? 16 : halves ? 32 : 0;
    float ws[2 * MAX_BLOCKS], wb[2 * MAX_BLOCKS];
    for (int t = 0; t < T; t++) {
        const uint8_t *row = W.w + (size_t)ids[t] * W.rb;
        float *o = out + (size_t)t * K;
        gg_params(fmt, row, K, ws, wb, 0);
        for (int b = 0; b < K / 32; b++) {
            uint8_t u[32];
            iw_store(u, gg_unpack(fmt, row, b));
            for (int i = 0; i < 32; i++) {
                const int p = halves ? 2 * b + i / 16 : b;
                o[b * 32 + i] = off ? ws[p] * (float)(u[i] - off) : ws[p] * (float)u[i] + wb[p];
            }
        }
    }
    return 0;
}
