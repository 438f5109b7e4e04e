// Runs every C kernel on inputs it generates itself (a fixed xorshift stream, so every build sees the same
// bits) and writes each output as a named record: tests/kernels/test_isa_identity.py builds it for every
// ISA this machine runs (and for NEON under qemu-user) and compares the records bitwise.
// Records: u32 name length, name, u64 byte count, bytes. Batch invariance is checked here too: a product
// of M rows must give each row bitwise the bits of the same row in the 256-row product.
#include "layers.c"

#include <stdio.h>

int mtp_step(const void *a, int n, const int32_t *tokens, float *hidden, const float *embed, float embed_scale,
             const int32_t *pos, const int32_t *tables, int table_len, int block_size, const float *kc,
             const float *vc, long slots, float *logits, float *next_hidden);
int eagle3_gemv(const void *m, int out, int in, const float *x, int n, float *y, int threads);
int eagle3_draft(const void *a, const void *kv, int n, const int32_t *counts, const int32_t *tokens,
                 const float *feats, const float *embed, const int32_t *ids, const int32_t *first,
                 const int32_t *want, int max_k, int32_t *drafts, int threads);
void cblas_sgemm(int layout, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc);
int small_gemm_init(void *blas_sgemm, int want_max_m);

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) {
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1Dull;
}
static float uniform(void) { return (float)(next_u64() >> 40) / 16777216.0f * 2.0f - 1.0f; }  // exact
static float *floats(size_t n, float scale) {
    float *p = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) p[i] = uniform() * scale;
    return p;
}
static uint8_t *bytes(size_t n) {
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(next_u64() >> 56);
    return p;
}
// Normal half / bfloat16 values around 2^-4..2^3 (sign random), straight as bits.
static uint16_t *halves(size_t n, int bf16) {
    uint16_t *p = malloc(2 * n);
    for (size_t i = 0; i < n; i++) {
        const uint64_t r = next_u64();
        const uint16_t sign = (uint16_t)((r >> 63) << 15);
        p[i] = bf16 ? (uint16_t)(sign | ((123 + (r >> 8) % 7) << 7) | (r & 0x7F))
                    : (uint16_t)(sign | ((11 + (r >> 16) % 7) << 10) | (r & 0x3FF));
    }
    return p;
}
static uint16_t *scale_halves(size_t n, int bf16) {  // positive, small: 2^-7..2^-5
    uint16_t *p = halves(n, bf16);
    for (size_t i = 0; i < n; i++)
        p[i] = bf16 ? (uint16_t)(((120 + i % 3) << 7) | (p[i] & 0x7F)) : (uint16_t)(((8 + i % 3) << 10) | (p[i] & 0x3FF));
    return p;
}

static FILE *out;
static void record(const char *name, const void *data, size_t n) {
    const uint32_t len = (uint32_t)strlen(name);
    const uint64_t nb = n;
    if (getenv("HARNESS_TRACE")) fprintf(stderr, "%s\n", name);
    fwrite(&len, 4, 1, out), fwrite(name, 1, len, out), fwrite(&nb, 8, 1, out), fwrite(data, 1, n, out);
}
static int invariance_failures;
// Row counts checked against the 256-row product: all of 1..255, or under emulation (`quick`) every
// register-tile path and chunk split (the tile logic is the same code on every ISA; the full sweep runs
// natively) at a thirtieth of the work.
static int quick;
static int next_m(int m) {
    static const int picks[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129,
                                200, 255, 256};
    if (!quick) return m + 1;
    for (int i = 0;; i++)
        if (picks[i] > m) return picks[i];
}
static void check_rows(const char *what, const float *full, const float *part, int m, int n) {
    if (memcmp(full, part, sizeof(float) * (size_t)m * n) != 0) {
        fprintf(stderr, "%s: rows of the %d-row product differ from the same rows among 256\n", what, m);
        invariance_failures++;
    }
}

static void fallback_sgemm(int l, int ta, int tb, int M, int N, int K, float al, const float *A, int lda,
                           const float *B, int ldb, float be, float *C, int ldc) {
    (void)l, (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)al, (void)A, (void)lda, (void)B, (void)ldb;
    (void)be, (void)C, (void)ldc;
    fprintf(stderr, "small GEMM forwarded a call it should handle\n");
    invariance_failures++;
}

static void small_gemm_cases(void) {
    small_gemm_init((void *)fallback_sgemm, 1 << 30);
    const int N = 40, K = 37;  // a K tail, an NN strip tail
    float *A = floats(256 * (size_t)K, 1.0f), *W = floats((size_t)N * K, 1.0f), *B = floats((size_t)K * N, 1.0f);
    float *full_nt = malloc(sizeof(float) * 256 * N), *full_nn = malloc(sizeof(float) * 256 * N);
    float *c = malloc(sizeof(float) * 256 * N);
    cblas_sgemm(101, 111, 112, 256, N, K, 1.0f, A, K, W, K, 0.0f, full_nt, N);
    cblas_sgemm(101, 111, 111, 256, N, K, 1.0f, A, K, B, N, 0.0f, full_nn, N);
    record("gemm/nt", full_nt, sizeof(float) * 256 * N);
    record("gemm/nn", full_nn, sizeof(float) * 256 * N);
    for (int m = 1; m < 256; m = next_m(m)) {
        cblas_sgemm(101, 111, 112, m, N, K, 1.0f, A, K, W, K, 0.0f, c, N);
        check_rows("gemm nt", full_nt, c, m, N);
        cblas_sgemm(101, 111, 111, m, N, K, 1.0f, A, K, B, N, 0.0f, c, N);
        check_rows("gemm nn", full_nn, c, m, N);
    }
    for (int i = 0; i < 5 * N; i++) c[i] = (float)i;  // alpha, beta
    cblas_sgemm(101, 111, 112, 5, N, K, 0.5f, A, K, W, K, 2.0f, c, N);
    record("gemm/alpha_beta", c, sizeof(float) * 5 * N);
    free(A), free(W), free(B), free(full_nt), free(full_nn), free(c);
}

typedef int (*product_fn)(int, int, int, int, int, const float *, int, const void *, const void *, const void *,
                          int, float *, int, int);

// One product's 256-row output recorded under `name`, and every row count's rows checked against it.
static void sweep_product(product_fn fn, const char *name, int fmt, int N, int K, int group, const float *A,
                          const void *w, const void *s, const void *b, int sd, float *full, float *c) {
    if (fn(fmt, 256, N, K, group, A, K, w, s, b, sd, full, N, 0)) {
        fprintf(stderr, "%s refused\n", name);
        invariance_failures++;
    }
    record(name, full, sizeof(float) * 256 * N);
    for (int m = 1; m < 256; m = next_m(m)) {
        fn(fmt, m, N, K, group, A, K, w, s, b, sd, c, N, 1);
        check_rows(name, full, c, m, N);
    }
}

static void qgemm_cases(void) {
    const int N = 21, K = 256;  // five 4-row blocks and a row left over
    float *A = floats(256 * (size_t)K, 1.0f), *full = malloc(sizeof(float) * 256 * N), *c = malloc(sizeof(float) * 256 * N);
    const int fmts[] = {FMT_F32, FMT_BF16, FMT_F16, FMT_Q8, FMT_Q4};
    for (int f = 0; f < 5; f++) {
        const int fmt = fmts[f], quant = fmt == FMT_Q8 || fmt == FMT_Q4;
        for (int group = 32; group <= (quant ? 128 : 32); group *= 2)
            for (int sd = 0; sd < (quant ? 3 : 1); sd++) {
                const size_t nw = (size_t)N * K, ng = quant ? nw / group : 1;
                void *w = fmt == FMT_F32 ? (void *)floats(nw, 1.0f)
                        : fmt == FMT_BF16 || fmt == FMT_F16 ? (void *)halves(nw, fmt == FMT_BF16)
                        : (void *)bytes(fmt == FMT_Q4 ? nw / 2 : nw);
                void *s = sd == SC_F32 ? (void *)floats(ng, 0.02f) : (void *)scale_halves(ng, sd == SC_BF16);
                void *b = sd == SC_F32 ? (void *)floats(ng, 0.5f) : (void *)halves(ng, sd == SC_BF16);
                char name[64], i8[80];
                snprintf(name, sizeof(name), "qgemm/fmt%d/g%d/s%d", fmt, quant ? group : 0, sd);
                sweep_product(qgemm, name, fmt, N, K, group, A, w, s, b, sd, full, c);
                if (fmt == FMT_Q4 || fmt == FMT_Q8) {  // 8-bit activations: integer sums, float parts in one order
                    snprintf(i8, sizeof(i8), "%s/int8", name);
                    sweep_product(qgemm_i8, i8, fmt, N, K, group, A, w, s, b, sd, full, c);
                }
                const int32_t ids[4] = {0, 20, 7, 7};
                qgemm_rows(fmt, N, K, group, w, s, b, sd, ids, 4, c);
                strncat(name, "/rows", sizeof(name) - strlen(name) - 1);
                record(name, c, sizeof(float) * 4 * K);
                free(w), free(s), free(b);
            }
    }
    free(A), free(full), free(c);
}

static void attention_cases(void) {
    const int heads[] = {32, 64, 80, 128, 256};
    const int bs = 16, T = 6, H = 4, Hkv = 2, nblocks = 24;
    const int32_t pos[6] = {0, 5, 16, 17, 40, 300};  // a first token, block edges, a long context
    for (int hd = 0; hd < 5; hd++)
        for (int window = 0; window <= 24; window += 24) {
            const int D = heads[hd];
            const long S = (long)nblocks * bs;
            float *q = floats((size_t)T * H * D, 1.0f), *kc = floats((size_t)Hkv * S * D, 1.0f);
            float *vc = floats((size_t)Hkv * S * D, 1.0f), *o = malloc(sizeof(float) * T * H * D);
            int32_t tables[24], tok_table[6] = {0, 0, 0, 0, 0, 0};
            for (int i = 0; i < nblocks; i++) tables[i] = (i * 7) % nblocks;  // a shuffled block table
            cpu_paged_attention(T, H, Hkv, D, q, kc, vc, S, pos, tok_table, tables, bs, window, 0.125f, 301, 1, o);
            char name[64];
            snprintf(name, sizeof(name), "attention/d%d/w%d", D, window);
            record(name, o, sizeof(float) * T * H * D);
            free(q), free(kc), free(vc), free(o);
        }
}

static Mat mat(int fmt, int n, int k) {
    const size_t nw = (size_t)n * k, ng = nw / 32;
    Mat m = {fmt, 32, SC_F16, n, k, NULL, NULL, NULL, NULL};
    if (fmt == GG_Q5_0) {  // GGML blocks: random bits, each block's float16 scale a small one
        uint8_t *w = bytes(ng * 22);
        uint16_t *d = scale_halves(ng, 0);
        for (size_t i = 0; i < ng; i++) memcpy(w + i * 22, d + i, 2);
        free(d);
        m.w = w;
        return m;
    }
    m.w = fmt == FMT_F32 ? (void *)floats(nw, 0.1f) : fmt == FMT_BF16 ? (void *)halves(nw, 1)
        : (void *)bytes(fmt == FMT_Q4 ? nw / 2 : nw);
    for (size_t i = 0; fmt == FMT_BF16 && i < nw; i++) ((uint16_t *)m.w)[i] -= 4 << 7;  // 2^-8..2^-1
    m.scales = scale_halves(ng, 0);
    m.biases = halves(ng, 0);
    for (size_t i = 0; i < ng; i++) ((uint16_t *)m.biases)[i] = (uint16_t)((((uint16_t *)m.biases)[i] & 0x83FF) | (5 << 10));
    return m;
}

static void layer_cases(void) {
    const int L = 2, D = 64, H = 4, Hkv = 2, Dh = 32, I = 128, bs = 16, T = 5, nblocks = 8;
    const long slots = (long)nblocks * bs;
    // Q4 twice (the second with 8-bit activations); GGML Q5_0 blocks; last, gemma3's layer shape (post-norms,
    // GELU, a second RoPE on layer 1).
    // and 8-bit weights with 8-bit activations.
    const int fmts[] = {FMT_Q4, FMT_Q8, FMT_BF16, FMT_F32, FMT_Q4, GG_Q5_0, FMT_Q8, FMT_Q8};
    for (int f = 0; f < 8; f++) {
        const int gemma = f == 6;
        Layer layers[2];
        memset(layers, 0, sizeof(layers));
        for (int l = 0; l < L; l++) {
            Layer *y = &layers[l];
            y->q = mat(fmts[f], H * Dh, D), y->k = mat(fmts[f], Hkv * Dh, D), y->v = mat(fmts[f], Hkv * Dh, D);
            y->o = mat(fmts[f], D, H * Dh), y->gate = mat(fmts[f], I, D), y->up = mat(fmts[f], I, D);
            y->down = mat(fmts[f], D, I);
            y->q.bias = floats(H * Dh, 0.1f);  // qwen2's projection biases
            y->ln_in = floats(D, 1.0f), y->ln_post = floats(D, 1.0f);
            y->q_norm = l ? floats(Dh, 1.0f) : NULL, y->k_norm = l ? floats(Dh, 1.0f) : NULL;  // qwen3's
            y->kc = floats((size_t)Hkv * slots * Dh, 1.0f), y->vc = floats((size_t)Hkv * slots * Dh, 1.0f);
            y->window = l ? 0 : 6;
            if (gemma) y->ln_attn_out = floats(D, 1.0f), y->ln_mlp_out = floats(D, 1.0f), y->rope2 = l;
        }
        float inv_freq[16];
        for (int i = 0; i < 16; i++) inv_freq[i] = 1.0f / (float)(1 << (i % 12));
        Stack st = {L, D, H, Hkv, Dh, I, 0, 1e-5f, 0.1767767f, 1.0f, slots, inv_freq, layers, NULL};
        st.final_norm = floats(D, 1.0f);
        st.act_int8 = f == 4 ? 1 : f == 7 ? 2 : 0;
        float inv_freq2[16];
        for (int i = 0; i < 16; i++) inv_freq2[i] = 1.0f / (float)(3 << (i % 10));
        if (gemma) st.inv_freq2 = inv_freq2, st.rope_scale2 = 0.5f, st.gelu = 1;
        float *h = floats((size_t)T * D, 1.0f);
        const int32_t pos[5] = {3, 4, 5, 6, 40}, slot[5] = {3, 4, 5, 6, 40}, tok_table[5] = {0, 0, 0, 0, 0};
        int32_t tables[8];
        for (int i = 0; i < nblocks; i++) tables[i] = i;
        if (layers_forward(&st, T, h, pos, slot, tok_table, tables, bs, 41, 0) != 0) invariance_failures++;
        char name[64];
        const char *tag = st.act_int8 || fmts[f] == GG_Q5_0 ? "/int8" : gemma ? "/gemma3" : "";
        snprintf(name, sizeof(name), "layers/fmt%d%s", fmts[f], tag);
        record(name, h, sizeof(float) * T * D);
        for (int l = 0; l < L; l++) {
            snprintf(name, sizeof(name), "layers/fmt%d%s/kcache%d", fmts[f], tag, l);
            record(name, layers[l].kc, sizeof(float) * Hkv * slots * Dh);
        }
    }
}

// engine/cpu/mtp.c's Assistant, field for field.
typedef struct {
    int backbone, hidden, heads, kv_heads, head_dim, inter, head_size;
    float eps, rope_base;
    const uint16_t *pre, *q, *o, *gate, *up, *down, *head, *post;
    const float *ln_in, *ln_post, *ln_final;
} HAssistant;

static void mtp_cases(void) {
    const int B = 64, d = 48, heads = 3, kvh = 1, hd = 16, inter = 96, hs = 100, bs = 16, n = 2, vocab = 120;
    HAssistant a = {B, d, heads, kvh, hd, inter, hs, 1e-6f, 10000.0f, halves((size_t)d * 2 * B, 0),
                    halves((size_t)heads * hd * d, 0), halves((size_t)d * heads * hd, 0), halves((size_t)inter * d, 0),
                    halves((size_t)inter * d, 0), halves((size_t)d * inter, 0), halves((size_t)hs * d, 0),
                    halves((size_t)B * d, 0), floats(d, 1.0f), floats(d, 1.0f), floats(d, 1.0f)};
    uint16_t *mats[] = {(uint16_t *)a.pre, (uint16_t *)a.q, (uint16_t *)a.o, (uint16_t *)a.gate, (uint16_t *)a.up,
                        (uint16_t *)a.down, (uint16_t *)a.head, (uint16_t *)a.post};
    const size_t sizes[] = {(size_t)d * 2 * B, (size_t)heads * hd * d, (size_t)d * heads * hd, (size_t)inter * d,
                            (size_t)inter * d, (size_t)d * inter, (size_t)hs * d, (size_t)B * d};
    for (int m = 0; m < 8; m++)  // weights of magnitude 2^-6..2^-3
        for (size_t i = 0; i < sizes[m]; i++) mats[m][i] = (uint16_t)((mats[m][i] & 0x83FF) | ((9 + i % 3) << 10));
    const long slots = 4 * bs;
    float *kc = floats((size_t)kvh * slots * hd, 1.0f), *vc = floats((size_t)kvh * slots * hd, 1.0f);
    float *embed = floats((size_t)vocab * B, 1.0f), *hidden = floats((size_t)n * B, 1.0f);
    float *logits = malloc(sizeof(float) * n * hs), *next = malloc(sizeof(float) * n * B);
    const int32_t tokens[2] = {5, 77}, pos[2] = {9, 30}, tables[8] = {2, 0, 3, 1, 1, 2, 0, 3};
    mtp_step(&a, n, tokens, hidden, embed, 0.5f, pos, tables, 4, bs, kc, vc, slots, logits, next);
    record("mtp/logits", logits, sizeof(float) * n * hs);
    record("mtp/hidden", next, sizeof(float) * n * B);
}

// engine/cpu/eagle3.c's Eagle3 and HeadKV, field for field.
typedef struct {
    const void *w;
    const float *scale;
} HMat;
typedef struct {
    int hidden, target_hidden, heads, kv_heads, head_dim, inter, vocab, norm_before_residual;
    float eps, rope_base;
    HMat fc, q, k, v, o, gate, up, down, head;
    const float *ln_in, *ln_hidden, *ln_post, *ln_final;
} HEagle3;
typedef struct {
    float *kc, *vc;
    long slots;
    const int32_t *tables;
    int table_len, block_size;
} HHeadKV;

// Two requests (three catch-up rows and one) wanting 2 and 3 drafts: the drafts and the whole KV cache the
// passes wrote (every pass's hidden flows into the next pass's keys).
static void eagle3_cases(void) {
    const int d = 48, heads = 3, kvh = 1, hd = 16, inter = 96, vd = 100, bs = 16, vocab = 120;
    const size_t sizes[] = {(size_t)d * 3 * d, (size_t)heads * hd * 2 * d, (size_t)kvh * hd * 2 * d,
                            (size_t)kvh * hd * 2 * d, (size_t)d * heads * hd, (size_t)inter * d, (size_t)inter * d,
                            (size_t)d * inter, (size_t)vd * d};
    HMat mats[9];
    for (int m = 0; m < 9; m++) {
        if (m % 2) {  // float16 weights of magnitude 2^-6..2^-3
            uint16_t *w = halves(sizes[m], 0);
            for (size_t i = 0; i < sizes[m]; i++) w[i] = (uint16_t)((w[i] & 0x83FF) | ((9 + i % 3) << 10));
            mats[m] = (HMat){w, NULL};
        } else {  // int8 rows, scales up to 2^-9 (weights up to 2^-2)
            float *scale = floats(sizes[m] / d, 1.0f / 512);
            for (size_t i = 0; i < sizes[m] / d; i++) scale[i] = fabsf(scale[i]) + 1.0f / 4096;
            mats[m] = (HMat){bytes(sizes[m]), scale};
        }
    }
    HEagle3 a = {d, d, heads, kvh, hd, inter, vd, 1, 1e-6f, 10000.0f, mats[0], mats[1], mats[2], mats[3], mats[4],
                 mats[5], mats[6], mats[7], mats[8], floats(d, 1.0f), floats(d, 1.0f), floats(d, 1.0f),
                 floats(d, 1.0f)};
    const long slots = 4 * bs;
    float *kc = calloc((size_t)kvh * slots * hd, sizeof(float)), *vc = calloc((size_t)kvh * slots * hd, sizeof(float));
    const int32_t tables[4] = {2, 0, 3, 1};
    HHeadKV kv = {kc, vc, slots, tables, 2, bs};
    float *embed = floats((size_t)vocab * d, 1.0f), *feats = floats((size_t)4 * 3 * d, 1.0f);
    int32_t ids[100];
    for (int i = 0; i < vd; i++) ids[i] = (i * 7) % vocab;
    const int32_t counts[2] = {3, 1}, tokens[4] = {5, 77, 3, 90}, first[2] = {14, 20}, want[2] = {2, 3};
    int32_t drafts[6] = {0};
    eagle3_draft(&a, &kv, 2, counts, tokens, feats, embed, ids, first, want, 3, drafts, 2);
    record("eagle3/drafts", drafts, sizeof(drafts));
    float written[2][7 * 16];  // the slots the passes wrote: positions 14..17 and 20..22 (one KV head)
    for (int i = 0; i < 7; i++) {
        const int r = i >= 4, p = r ? 20 + i - 4 : 14 + i;
        const size_t slot = (size_t)tables[r * 2 + p / bs] * bs + p % bs;
        memcpy(written[0] + i * hd, kc + slot * hd, sizeof(float) * hd);
        memcpy(written[1] + i * hd, vc + slot * hd, sizeof(float) * hd);
    }
    record("eagle3/kcache", written[0], sizeof(written[0]));
    record("eagle3/vcache", written[1], sizeof(written[1]));
}

// The draft heads' weight products, float16 and int8 rows: 70 rows in thread blocks, each row's bits those
// of the same row in a product of fewer rows (one thread, or other blocks).
static void head_gemv_cases(void) {
    const int out = 7, in = 100, n = 70;  // a K tail (100 = 96 + 4); 70 rows: several blocks, a row tail
    uint16_t *wh = halves((size_t)out * in, 0);
    for (size_t i = 0; i < (size_t)out * in; i++) wh[i] = (uint16_t)((wh[i] & 0x83FF) | ((9 + i % 3) << 10));
    const int8_t *wq = (const int8_t *)bytes((size_t)out * in);
    const float *x = floats((size_t)n * in, 1.0f), *scale = floats(out, 0.01f);
    float *full = malloc(sizeof(float) * n * out), *part = malloc(sizeof(float) * n * out);
    for (int i8 = 0; i8 < 2; i8++) {
        const HMat m = {i8 ? (const void *)wq : (const void *)wh, i8 ? scale : NULL};
        eagle3_gemv(&m, out, in, x, n, full, 2);
        record(i8 ? "head_gemv/i8" : "head_gemv/f16", full, sizeof(float) * n * out);
        for (int rows = 1; rows < n; rows = rows < 20 ? rows + 1 : rows + 7) {
            eagle3_gemv(&m, out, in, x, rows, part, rows % 2 ? 1 : 2);  // one thread or two
            check_rows(i8 ? "head gemv i8" : "head gemv f16", full, part, rows, out);
        }
    }
    free(full), free(part);
}

// GGML block formats (blocks.h): random bytes with finite float16 scales, every row count, and row lookups.
static void block_cases(void) {
    const int N = 21, K = 512, fmts[] = {GG_Q5_0, GG_Q5_1, GG_Q4_K, GG_Q5_K, GG_Q6_K};
    float *A = floats(256 * (size_t)K, 1.0f), *full = malloc(sizeof(float) * 256 * N), *c = malloc(sizeof(float) * 256 * N);
    for (int f = 0; f < 5; f++) {
        const int fmt = fmts[f], size = gg_block_bytes(fmt), per = gg_block_weights(fmt), nblk = N * K / per;
        uint8_t *w = bytes((size_t)nblk * size);
        uint16_t *h = halves((size_t)2 * nblk, 0);
        for (int i = 0; i < nblk; i++) {  // the float16 fields: d (and m / dmin) where the format has them
            uint8_t *blk = w + (size_t)i * size;
            memcpy(blk + (fmt == GG_Q6_K ? 208 : 0), h + 2 * i, 2);
            if (fmt != GG_Q5_0 && fmt != GG_Q6_K) memcpy(blk + 2, h + 2 * i + 1, 2);
        }
        char name[64];
        snprintf(name, sizeof(name), "blocks/type%d/int8", fmt);
        if (qgemm_blocks(fmt, 256, N, K, A, K, w, full, N, 0)) {
            fprintf(stderr, "%s refused\n", name);
            invariance_failures++;
        }
        record(name, full, sizeof(float) * 256 * N);
        for (int m = 1; m < 256; m = next_m(m)) {
            qgemm_blocks(fmt, m, N, K, A, K, w, c, N, 1);
            check_rows(name, full, c, m, N);
        }
        const int32_t ids[4] = {0, 20, 7, 7};
        qgemm_blocks_rows(fmt, N, K, w, ids, 4, c);
        snprintf(name, sizeof(name), "blocks/type%d/rows", fmt);
        record(name, c, sizeof(float) * 4 * K);
        free(w), free(h);
    }
    free(A), free(full), free(c);
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s OUT [quick]\n", argv[0]);
        return 2;
    }
    quick = argc == 3 && strcmp(argv[2], "quick") == 0;
    out = fopen(argv[1], "wb");
    if (!out) return 2;
    record("isa", SS_ISA_NAME, strlen(SS_ISA_NAME));
    small_gemm_cases();
    qgemm_cases();
    attention_cases();
    layer_cases();
    mtp_cases();
    eagle3_cases();
    head_gemv_cases();
    block_cases();
    fclose(out);
    return invariance_failures ? 1 : 0;
}
