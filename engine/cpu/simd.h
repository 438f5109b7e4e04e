// The one SIMD layer every C kernel is written against: a logical 16-lane float vector `vf` that is one
// zmm register (AVX-512), two ymm (AVX2 + FMA + F16C) or four NEON q registers (aarch64), chosen at build
// time by -DSS_ISA_AVX512 / -DSS_ISA_AVX2 / -DSS_ISA_NEON (engine/cpu/build.py).
//
// Every operation gives the same bits on every ISA: lane-wise IEEE operations, one fused multiply-add,
// conversions that are exact, and one fixed horizontal-sum tree (lanes i + i+8, then i + i+4, i + i+2,
// i + i+1). Kernels must be built with -ffp-contract=off so no compiler fuses their scalar code its own way.
#ifndef SPECSERVE_SIMD_H
#define SPECSERVE_SIMD_H
#include <stdint.h>
#include <string.h>

#define SS_INLINE static inline __attribute__((always_inline))

#ifdef _OPENMP
#include <omp.h>
#else  // built without OpenMP (Apple's clang): one thread, the pragmas ignored
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#if defined(SS_ISA_AVX512)
#include <immintrin.h>
#define SS_ISA_NAME "avx512"
#define SS_VREGS 32  // architectural vector registers, in logical vectors (a macro: kernels test it in #if)
typedef __m512 vf;
typedef __m512i vq;  // 16 packed bytes of 4-bit weights, one byte per 32-bit lane
typedef __m512 vtab;  // a 4-bit group's 16 dequantized values
#define VKEEP(x) __asm__("" : "+v"(x))  // one load into a register, not one folded into each use

SS_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
SS_INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
SS_INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
SS_INLINE void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
SS_INLINE vf vloadn(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
SS_INLINE void vstoren(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
SS_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
SS_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
SS_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
SS_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
SS_INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
SS_INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
SS_INLINE float vhsum(vf v) {
    const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}
// Lane i: vhsum(a[i]), the same tree for all 16 at once (a 4 x 4 transpose of 128-bit blocks, then of
// lanes): 15 adds and 30 shuffles where 16 separate sums took ~8 instructions each.
SS_INLINE vf vhsum16(const vf *in) {
    static const int slot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    __m512 a[16], b[8], c[4], d[2];
    for (int i = 0; i < 16; i++) a[slot[i]] = in[i];
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
SS_INLINE vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
SS_INLINE vf vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
SS_INLINE vf vload_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
SS_INLINE vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
SS_INLINE vq vq_load(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
SS_INLINE vtab vtab_make(vf s, vf b) {
    return _mm512_fmadd_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), s, b);
}
// A lane permute reads the nibble's value from the table (only an index's low 4 bits count).
SS_INLINE vf vq_lo(vq q, vtab t) { return _mm512_permutexvar_ps(q, t); }
SS_INLINE vf vq_hi(vq q, vtab t) { return _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t); }
SS_INLINE vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 32 floats at p as their 16 even-indexed and 16 odd-indexed elements (data movement only).
SS_INLINE void vdeint(const float *p, vf *even, vf *odd) {
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
    *even = _mm512_permutex2var_ps(lo, ev, hi);
    *odd = _mm512_permutex2var_ps(lo, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), hi);
}
SS_INLINE vf vabs(vf x) { return _mm512_abs_ps(x); }
SS_INLINE float vhmax(vf v) { return _mm512_reduce_max_ps(v); }  // max is exact in any order
// 16 integral lanes in [-128, 127] as int8.
SS_INLINE void vstore_i8(int8_t *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
// p * 2^n for integer-valued n in [-126, 127] (exact while the result is normal).
SS_INLINE vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
// v where x >= t, else 0.
SS_INLINE vf vkeep_ge(vf x, vf t, vf v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, t, _CMP_GE_OQ), v); }
// a where x >= t, else b.
SS_INLINE vf vsel_ge(vf x, vf t, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, t, _CMP_GE_OQ), b, a); }

#elif defined(SS_ISA_AVX2)
#include <immintrin.h>
#define SS_ISA_NAME "avx2"
#define SS_VREGS 8
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vq;  // the bytes of 16 packed 4-bit pairs, one per 32-bit lane
typedef struct { __m256 s, b; } vtab;
#define VKEEP(x) ((void)0)  // 16 ymm registers: the compiler's own allocation spills less

SS_INLINE vf vf2(__m256 lo, __m256 hi) { vf v = {lo, hi}; return v; }
SS_INLINE vf vzero(void) { return vf2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
SS_INLINE vf vset1(float x) { return vf2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
SS_INLINE vf vload(const float *p) { return vf2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
SS_INLINE void vstore(float *p, vf v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
SS_INLINE __m256i ss_mask8(int n) {  // lanes < n all ones (n may be outside 0..8)
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
SS_INLINE vf vloadn(const float *p, int n) {
    return vf2(_mm256_maskload_ps(p, ss_mask8(n)), _mm256_maskload_ps(p + 8, ss_mask8(n - 8)));
}
SS_INLINE void vstoren(float *p, vf v, int n) {
    _mm256_maskstore_ps(p, ss_mask8(n), v.lo), _mm256_maskstore_ps(p + 8, ss_mask8(n - 8), v.hi);
}
SS_INLINE vf vadd(vf a, vf b) { return vf2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
SS_INLINE vf vsub(vf a, vf b) { return vf2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
SS_INLINE vf vmul(vf a, vf b) { return vf2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
SS_INLINE vf vmax(vf a, vf b) { return vf2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
SS_INLINE vf vfma(vf a, vf b, vf c) { return vf2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
SS_INLINE vf vdiv(vf a, vf b) { return vf2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
SS_INLINE float vhsum(vf v) {
    const __m256 s = _mm256_add_ps(v.lo, v.hi);
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}
// Eight sums: lane order [0, 2, 4, 6, 1, 3, 5, 7] of the tree, put back in order by one permute.
SS_INLINE __m256 ss_hsum8(const vf *a) {
    __m256 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++) s[i] = _mm256_add_ps(a[i].lo, a[i].hi);
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
SS_INLINE vf vhsum16(const vf *a) { return vf2(ss_hsum8(a), ss_hsum8(a + 8)); }
SS_INLINE vf vload_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return vf2(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16)),
               _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16)));
}
SS_INLINE vf vload_f16(const uint16_t *p) {
    return vf2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
SS_INLINE vf vload_u8(const uint8_t *p) {
    return vf2(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
}
SS_INLINE vf vload_i8(const int8_t *p) {
    return vf2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
}
// Widened straight from memory (two vpmovzxbd): no byte shuffles left for the nibbles.
SS_INLINE vq vq_load(const uint8_t *p) {
    vq q = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
    return q;
}
// The 4-bit value v dequantized as v * s + b: the AVX-512 table's entry, computed by the same FMA.
SS_INLINE vtab vtab_make(vf s, vf b) { vtab t = {s.lo, b.lo}; return t; }
SS_INLINE vf ss_nibbles(__m256i lo, __m256i hi, vtab t) {
    return vf2(_mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), t.s, t.b), _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), t.s, t.b));
}
SS_INLINE vf vq_lo(vq q, vtab t) {
    const __m256i m = _mm256_set1_epi32(15);
    return ss_nibbles(_mm256_and_si256(q.lo, m), _mm256_and_si256(q.hi, m), t);
}
SS_INLINE vf vq_hi(vq q, vtab t) { return ss_nibbles(_mm256_srli_epi32(q.lo, 4), _mm256_srli_epi32(q.hi, 4), t); }
SS_INLINE vf vround(vf x) {
    return vf2(_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
               _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
SS_INLINE __m256 ss_even8(__m256 a, __m256 b, int odd) {  // elements 2i (+ odd) of a then of b
    const __m256 t = odd ? _mm256_shuffle_ps(a, b, 0xDD) : _mm256_shuffle_ps(a, b, 0x88);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), 0xD8));
}
SS_INLINE void vdeint(const float *p, vf *even, vf *odd) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8), c = _mm256_loadu_ps(p + 16),
                 d = _mm256_loadu_ps(p + 24);
    *even = vf2(ss_even8(a, b, 0), ss_even8(c, d, 0));
    *odd = vf2(ss_even8(a, b, 1), ss_even8(c, d, 1));
}
SS_INLINE vf vabs(vf x) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return vf2(_mm256_and_ps(x.lo, m), _mm256_and_ps(x.hi, m));
}
SS_INLINE float vhmax(vf v) {
    __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
SS_INLINE void vstore_i8(int8_t *p, vf v) {
    const __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));  // per 128 lanes
    const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i *)p, _mm_shuffle_epi32(b, 0xD8));  // lanes 0-3, 8-11, 4-7, 12-15 -> in order
}
SS_INLINE __m256 ss_pow2(__m256 n) {  // 2^n from the exponent bits (n in [-126, 127])
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
SS_INLINE vf vscale2(vf p, vf n) { return vf2(_mm256_mul_ps(p.lo, ss_pow2(n.lo)), _mm256_mul_ps(p.hi, ss_pow2(n.hi))); }
SS_INLINE vf vkeep_ge(vf x, vf t, vf v) {
    return vf2(_mm256_and_ps(_mm256_cmp_ps(x.lo, t.lo, _CMP_GE_OQ), v.lo), _mm256_and_ps(_mm256_cmp_ps(x.hi, t.hi, _CMP_GE_OQ), v.hi));
}
SS_INLINE vf vsel_ge(vf x, vf t, vf a, vf b) {
    return vf2(_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, t.lo, _CMP_GE_OQ)),
               _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, t.hi, _CMP_GE_OQ)));
}

#elif defined(SS_ISA_NEON)
#include <arm_neon.h>
#define SS_ISA_NAME "neon"
#define SS_VREGS 8
typedef float32x4x4_t vf;
typedef uint8x16_t vq;
typedef struct { float32x4_t s, b; } vtab;
#define VKEEP(x) ((void)0)
#define SS_EACH(OP, ...) { vf r_; for (int i_ = 0; i_ < 4; i_++) r_.val[i_] = OP(__VA_ARGS__); return r_; }

SS_INLINE vf vzero(void) { SS_EACH(vdupq_n_f32, 0.0f) }
SS_INLINE vf vset1(float x) { SS_EACH(vdupq_n_f32, x) }
SS_INLINE vf vload(const float *p) { return vld1q_f32_x4(p); }
SS_INLINE void vstore(float *p, vf v) { vst1q_f32_x4(p, v); }
SS_INLINE vf vloadn(const float *p, int n) {
    float t[16] = {0};
    if (n > 0) memcpy(t, p, sizeof(float) * (size_t)(n < 16 ? n : 16));
    return vld1q_f32_x4(t);
}
SS_INLINE void vstoren(float *p, vf v, int n) {
    float t[16];
    vst1q_f32_x4(t, v);
    if (n > 0) memcpy(p, t, sizeof(float) * (size_t)(n < 16 ? n : 16));
}
SS_INLINE vf vadd(vf a, vf b) { SS_EACH(vaddq_f32, a.val[i_], b.val[i_]) }
SS_INLINE vf vsub(vf a, vf b) { SS_EACH(vsubq_f32, a.val[i_], b.val[i_]) }
SS_INLINE vf vmul(vf a, vf b) { SS_EACH(vmulq_f32, a.val[i_], b.val[i_]) }
SS_INLINE vf vmax(vf a, vf b) { SS_EACH(vmaxq_f32, a.val[i_], b.val[i_]) }
SS_INLINE vf vfma(vf a, vf b, vf c) { SS_EACH(vfmaq_f32, c.val[i_], a.val[i_], b.val[i_]) }
SS_INLINE vf vdiv(vf a, vf b) { SS_EACH(vdivq_f32, a.val[i_], b.val[i_]) }
SS_INLINE float vhsum(vf v) {
    const float32x4_t t = vaddq_f32(vaddq_f32(v.val[0], v.val[2]), vaddq_f32(v.val[1], v.val[3]));
    const float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
    return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}
SS_INLINE vf vhsum16(const vf *a) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = vhsum(a[i]);
    return vld1q_f32_x4(t);
}
SS_INLINE vf vload_bf16(const uint16_t *p) {
    const uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8);
    vf r = {{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16)), vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(a), 16)),
             vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16)), vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(b), 16))}};
    return r;
}
SS_INLINE vf vload_f16(const uint16_t *p) {
    const float16x8_t a = vreinterpretq_f16_u16(vld1q_u16(p)), b = vreinterpretq_f16_u16(vld1q_u16(p + 8));
    vf r = {{vcvt_f32_f16(vget_low_f16(a)), vcvt_high_f32_f16(a), vcvt_f32_f16(vget_low_f16(b)), vcvt_high_f32_f16(b)}};
    return r;
}
SS_INLINE vf ss_u8_to_f(uint8x16_t q) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(q)), hi = vmovl_u8(vget_high_u8(q));
    vf r = {{vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))),
             vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)))}};
    return r;
}
SS_INLINE vf vload_u8(const uint8_t *p) { return ss_u8_to_f(vld1q_u8(p)); }
SS_INLINE vf vload_i8(const int8_t *p) {
    const int8x16_t q = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_s8(vget_high_s8(q));
    vf r = {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
             vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
    return r;
}
SS_INLINE vq vq_load(const uint8_t *p) { return vld1q_u8(p); }
SS_INLINE vtab vtab_make(vf s, vf b) { vtab t = {s.val[0], b.val[0]}; return t; }
SS_INLINE vf ss_nibbles(uint8x16_t q, vtab t) {
    const vf x = ss_u8_to_f(q);
    SS_EACH(vfmaq_f32, t.b, x.val[i_], t.s)
}
SS_INLINE vf vq_lo(vq q, vtab t) { return ss_nibbles(vandq_u8(q, vdupq_n_u8(15)), t); }
SS_INLINE vf vq_hi(vq q, vtab t) { return ss_nibbles(vshrq_n_u8(q, 4), t); }
SS_INLINE vf vround(vf x) { SS_EACH(vrndnq_f32, x.val[i_]) }
SS_INLINE void vdeint(const float *p, vf *even, vf *odd) {
    for (int i = 0; i < 4; i++) {
        const float32x4x2_t t = vld2q_f32(p + 8 * i);
        even->val[i] = t.val[0], odd->val[i] = t.val[1];
    }
}
SS_INLINE vf vabs(vf x) { SS_EACH(vabsq_f32, x.val[i_]) }
SS_INLINE float vhmax(vf v) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(v.val[0], v.val[1]), vmaxq_f32(v.val[2], v.val[3]))); }
SS_INLINE void vstore_i8(int8_t *p, vf v) {
    const int16x8_t a = vcombine_s16(vmovn_s32(vcvtnq_s32_f32(v.val[0])), vmovn_s32(vcvtnq_s32_f32(v.val[1])));
    const int16x8_t b = vcombine_s16(vmovn_s32(vcvtnq_s32_f32(v.val[2])), vmovn_s32(vcvtnq_s32_f32(v.val[3])));
    vst1q_s8(p, vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
}
SS_INLINE float32x4_t ss_pow2(float32x4_t n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
}
SS_INLINE vf vscale2(vf p, vf n) { SS_EACH(vmulq_f32, p.val[i_], ss_pow2(n.val[i_])) }
SS_INLINE vf vkeep_ge(vf x, vf t, vf v) {
    SS_EACH(vreinterpretq_f32_u32, vandq_u32(vcgeq_f32(x.val[i_], t.val[i_]), vreinterpretq_u32_f32(v.val[i_])))
}
SS_INLINE vf vsel_ge(vf x, vf t, vf a, vf b) { SS_EACH(vbslq_f32, vcgeq_f32(x.val[i_], t.val[i_]), a.val[i_], b.val[i_]) }
SS_INLINE void vprefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
SS_INLINE void vprefetch_far(const void *p) { __builtin_prefetch(p, 0, 1); }
SS_INLINE float f16_to_f32(uint16_t h) { __fp16 v; memcpy(&v, &h, 2); return (float)v; }
#else
#error "build with -DSS_ISA_AVX512, -DSS_ISA_AVX2 or -DSS_ISA_NEON (engine/cpu/build.py)"
#endif

#if defined(SS_ISA_AVX512) || defined(SS_ISA_AVX2)
SS_INLINE void vprefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
SS_INLINE void vprefetch_far(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T2); }
SS_INLINE float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#endif

SS_INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// 2^x for x <= 0 (inputs below -126 give 0): x = n + f with n = round(x), f in [-0.5, 0.5], 2^f by its
// degree-6 Taylor polynomial (relative error < 2e-7), scaled by 2^n.
SS_INLINE vf vexp2_neg(vf x) {
    x = vmax(x, vset1(-127.0f));
    const vf n = vround(x), f = vsub(x, n);
    vf p = vset1(1.5403530e-4f);
    p = vfma(p, f, vset1(1.3333558e-3f));
    p = vfma(p, f, vset1(9.6181291e-3f));
    p = vfma(p, f, vset1(5.5504109e-2f));
    p = vfma(p, f, vset1(2.4022651e-1f));
    p = vfma(p, f, vset1(6.9314718e-1f));
    p = vfma(p, f, vset1(1.0f));
    // Below -126 the result would be denormal: 0, as for a key far below the maximum.
    return vkeep_ge(x, vset1(-126.0f), vscale2(p, n));
}

// sin and cos of a float angle, the same bits everywhere (libm's differ between builds and machines):
// reduced by multiples of pi/2 (Cody-Waite, three parts of pi/2) and Taylor series in double, rounded.
static inline void ss_sincos(float angle, float *s, float *c) {
    const double x = angle;
    const double k = __builtin_nearbyint(x * 0.63661977236758134308);
    const double r = ((x - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) - k * 2.02226624871116645580e-21;
    const double r2 = r * r;
    double sp = -7.6471637318198164759e-13, cp = 4.7794773323873852974e-14;
    sp = sp * r2 + 1.6059043836821614599e-10, cp = cp * r2 - 1.1470745597729724714e-11;
    sp = sp * r2 - 2.5052108385441718775e-08, cp = cp * r2 + 2.0876756987868098979e-09;
    sp = sp * r2 + 2.7557319223985890653e-06, cp = cp * r2 - 2.7557319223985890653e-07;
    sp = sp * r2 - 1.9841269841269841270e-04, cp = cp * r2 + 2.4801587301587301587e-05;
    sp = sp * r2 + 8.3333333333333333333e-03, cp = cp * r2 - 1.3888888888888888889e-03;
    sp = sp * r2 - 1.6666666666666666667e-01, cp = cp * r2 + 4.1666666666666666667e-02;
    const double sv = r + r * r2 * sp, cv = 1.0 - 0.5 * r2 + r2 * r2 * cp;
    const long q = (long)k & 3;
    const double so = q == 0 ? sv : q == 1 ? cv : q == 2 ? -sv : -cv;
    const double co = q == 0 ? cv : q == 1 ? -sv : q == 2 ? -cv : sv;
    *s = (float)so;
    *c = (float)co;
}

// x * sigmoid(z) * u per lane: x / (1 + e^-z) for z >= 0, x e^z / (1 + e^z) below, with the exponential of
// -|z| (vexp2_neg never overflows).
SS_INLINE vf ss_sigmoid_mul(vf x, vf z, vf u) {
    const vf zero = vzero(), one = vset1(1.0f);
    const vf e = vexp2_neg(vmul(vsub(zero, vmax(z, vsub(zero, z))), vset1(1.4426950408889634f)));
    return vmul(vdiv(vmul(x, vsel_ge(z, zero, one, e)), vadd(one, e)), u);
}
// silu(x) * u.
SS_INLINE vf vsilu_mul(vf x, vf u) { return ss_sigmoid_mul(x, x, u); }
// GELU's tanh form times u: 0.5 x (1 + tanh(y)) = x * sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3).
SS_INLINE vf vgelu_tanh_mul(vf x, vf u) {
    const vf z = vmul(vset1(1.5957691216057308f), vfma(vmul(vset1(0.044715f), vmul(x, x)), x, x));
    return ss_sigmoid_mul(x, z, u);
}
// Integer dot products of 4- to 6-bit weights with 8-bit activations, 32 at a time: `iw` holds a block's 32
// weights as bytes below 64 (so vpmaddubsw's pair sums never saturate; for 4-bit ones its 16 low nibbles
// then its 16 high ones), the activations come as int8 in the same
// order, `idot` gives 8 int32 lanes (lane l: the products of bytes 4l..4l+3; exact, so any instruction
// that sums the same bytes gives the same lanes), `ifma` adds lane * scale into 8 float lanes with one
// FMA each, and `ihsum` ends with one fixed tree. x86 builds use 256-bit AVX2 (AVX-512 CPUs have it), and
// vpdpbusd where the CPU has VNNI; other ISAs the same lanes in plain C.
#if defined(SS_ISA_AVX512) || defined(SS_ISA_AVX2)
typedef __m256i iw;
typedef __m256 iacc;
SS_INLINE iw iw_q4(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
SS_INLINE __m256i idot(iw w, const int8_t *x) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)x);
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));  // 15 * 127 * 2: no saturation
#endif
}
// Two consecutive blocks (32 bytes of weights) at once: one load, shift and mask for both.
SS_INLINE void iw_q4x2(const uint8_t *p, iw *w0, iw *w1) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    *w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
    *w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
}
// Bytes of GGML's block formats (engine/cpu/blocks.h): 32 loaded; each byte's bits shift.. under `mask`;
// a | b << 4 per byte (b's bytes below 16); byte j = bit j of h.
SS_INLINE iw iw_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
SS_INLINE void iw_store(uint8_t *p, iw w) { _mm256_storeu_si256((__m256i *)p, w); }
SS_INLINE iw iw_field(iw a, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(a, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
SS_INLINE iw iw_or_hi(iw a, iw b) { return _mm256_or_si256(a, _mm256_slli_epi16(b, 4)); }
SS_INLINE iw iw_bits32(uint32_t h) {
    const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), which), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(1));
}
// a with 16 added to byte j where bit j of h is set (a's bytes below 16: a | bit << 4).
SS_INLINE iw iw_add_bits32(iw a, uint32_t h) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(a, (__mmask32)h, a, _mm256_set1_epi8(16));
#else
    return iw_or_hi(a, iw_bits32(h));
#endif
}
// Signed weights (8-bit: v = u - 128): |v| times x carrying v's sign, as the unsigned-by-signed products
// above (128 * 127 * 2 fits vpmaddubsw's pair sums); exact.
SS_INLINE iw iw_s8(iw u) { return _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); }
SS_INLINE __m256i idot_s8(iw v, const int8_t *x) {
    const __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), v), w = _mm256_abs_epi8(v);
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}
SS_INLINE iacc iacc_zero(void) { return _mm256_setzero_ps(); }
SS_INLINE iacc iacc_load(const float *p) { return _mm256_loadu_ps(p); }
SS_INLINE void iacc_store(float *p, iacc a) { _mm256_storeu_ps(p, a); }
SS_INLINE iacc iacc_add(iacc a, iacc b) { return _mm256_add_ps(a, b); }
SS_INLINE iacc iacc_mul(iacc a, iacc b) { return _mm256_mul_ps(a, b); }
SS_INLINE iacc iacc_fma(iacc a, iacc b, iacc c) { return _mm256_fmadd_ps(a, b, c); }
SS_INLINE iacc ifma(__m256i d, float scale, iacc acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale), acc);
}
// Lanes 0-3 scaled by s0, lanes 4-7 by s1 (a block of two 16-weight halves with their own scales).
SS_INLINE iacc ifma2(__m256i d, float s0, float s1, iacc acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)), acc);
}
SS_INLINE float ihsum(iacc a) {  // ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}
#else
typedef struct { uint8_t b[32]; } iw;
typedef struct { float v[8]; } iacc;
typedef struct { int32_t v[8]; } idots;
SS_INLINE iw iw_q4(const uint8_t *p) {
    iw w;
    for (int i = 0; i < 16; i++) w.b[i] = p[i] & 15, w.b[16 + i] = p[i] >> 4;
    return w;
}
SS_INLINE idots idot(iw w, const int8_t *x) {
    idots d;
    for (int l = 0; l < 8; l++) {
        int32_t t = 0;
        for (int i = 4 * l; i < 4 * l + 4; i++) t += (int32_t)w.b[i] * x[i];
        d.v[l] = t;
    }
    return d;
}
SS_INLINE void iw_q4x2(const uint8_t *p, iw *w0, iw *w1) {
    *w0 = iw_q4(p);
    *w1 = iw_q4(p + 16);
}
SS_INLINE iw iw_load(const uint8_t *p) {
    iw w;
    memcpy(w.b, p, 32);
    return w;
}
SS_INLINE void iw_store(uint8_t *p, iw w) { memcpy(p, w.b, 32); }
SS_INLINE iw iw_field(iw a, int shift, int mask) {
    for (int i = 0; i < 32; i++) a.b[i] = (uint8_t)((a.b[i] >> shift) & mask);
    return a;
}
SS_INLINE iw iw_or_hi(iw a, iw b) {
    for (int i = 0; i < 32; i++) a.b[i] = (uint8_t)(a.b[i] | b.b[i] << 4);
    return a;
}
SS_INLINE iw iw_bits32(uint32_t h) {
    iw w;
    for (int j = 0; j < 32; j++) w.b[j] = (uint8_t)((h >> j) & 1);
    return w;
}
SS_INLINE iw iw_add_bits32(iw a, uint32_t h) { return iw_or_hi(a, iw_bits32(h)); }
SS_INLINE iw iw_s8(iw u) {
    for (int i = 0; i < 32; i++) u.b[i] ^= 0x80;
    return u;
}
SS_INLINE idots idot_s8(iw v, const int8_t *x) {
    idots d;
    for (int l = 0; l < 8; l++) {
        int32_t t = 0;
        for (int i = 4 * l; i < 4 * l + 4; i++) t += (int32_t)(int8_t)v.b[i] * x[i];
        d.v[l] = t;
    }
    return d;
}
SS_INLINE iacc iacc_zero(void) { return (iacc){{0}}; }
SS_INLINE iacc iacc_load(const float *p) {
    iacc a;
    memcpy(a.v, p, sizeof(a.v));
    return a;
}
SS_INLINE void iacc_store(float *p, iacc a) { memcpy(p, a.v, sizeof(a.v)); }
SS_INLINE iacc iacc_add(iacc a, iacc b) {
    for (int l = 0; l < 8; l++) a.v[l] = a.v[l] + b.v[l];
    return a;
}
SS_INLINE iacc iacc_mul(iacc a, iacc b) {
    for (int l = 0; l < 8; l++) a.v[l] = a.v[l] * b.v[l];
    return a;
}
SS_INLINE iacc iacc_fma(iacc a, iacc b, iacc c) {
    for (int l = 0; l < 8; l++) c.v[l] = __builtin_fmaf(a.v[l], b.v[l], c.v[l]);
    return c;
}
SS_INLINE iacc ifma(idots d, float scale, iacc acc) {
    for (int l = 0; l < 8; l++) acc.v[l] = __builtin_fmaf((float)d.v[l], scale, acc.v[l]);
    return acc;
}
SS_INLINE iacc ifma2(idots d, float s0, float s1, iacc acc) {
    for (int l = 0; l < 8; l++) acc.v[l] = __builtin_fmaf((float)d.v[l], l < 4 ? s0 : s1, acc.v[l]);
    return acc;
}
SS_INLINE float ihsum(iacc a) {
    const float v0 = a.v[0] + a.v[4], v1 = a.v[1] + a.v[5], v2 = a.v[2] + a.v[6], v3 = a.v[3] + a.v[7];
    return (v0 + v2) + (v1 + v3);
}
#endif

// Two consecutive blocks at once: `iw2` their 64 bytes, `iacc2` 16 float lanes, lanes 0-7 the first block's
// 8 (the even blocks' accumulator), 8-15 the second's (the odd ones'), each lane updated by exactly the
// idot / ifma / ifma2 sequence above, so the bits are those of two iacc chains; one 512-bit dot, convert
// and FMA where the build has AVX-512.
#if defined(SS_ISA_AVX512)
typedef __m512i iw2;
typedef __m512 iacc2;
SS_INLINE iw2 iw2_pair(iw a, iw b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
SS_INLINE iacc2 iacc2_zero(void) { return _mm512_setzero_ps(); }
SS_INLINE __m512 ss_dot2(iw2 w, const int8_t *x) {
    const __m512i a = _mm512_loadu_si512((const void *)x);
#if defined(__AVX512VNNI__)
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a));
#else
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
#endif
}
// Lanes 0-7 += dot(first block) * (ws[0] * d[0]), lanes 8-15 += dot(second) * (ws[1] * d[1]).
SS_INLINE iacc2 ifma_pair(iw2 w, const int8_t *x, const float *ws, const float *d, iacc2 acc) {
    const __m128 s = _mm_mul_ps(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)ws)),
                                _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)d)));
    const __m512i at = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_fmadd_ps(ss_dot2(w, x), _mm512_permutexvar_ps(at, _mm512_castps128_ps512(s)), acc);
}
// The same with a scale per 16 weights: lanes 4k..4k+3 times ws[k] * d[k / 2].
SS_INLINE iacc2 ifma_pair_halves(iw2 w, const int8_t *x, const float *ws, const float *d, iacc2 acc) {
    const __m128 dd = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)d));
    const __m128 s = _mm_mul_ps(_mm_loadu_ps(ws), _mm_unpacklo_ps(dd, dd));
    const __m512i at = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_fmadd_ps(ss_dot2(w, x), _mm512_permutexvar_ps(at, _mm512_castps128_ps512(s)), acc);
}
// A last, unpaired block into lanes 0-7 (lanes 8-15 kept): as ifma / ifma2.
SS_INLINE iacc2 ifma_first(iw w, const int8_t *x, float s0, float s1, iacc2 acc) {
    const __m512 lo = _mm512_castps256_ps512(ifma2(idot(w, x), s0, s1, _mm512_castps512_ps256(acc)));
    return _mm512_mask_blend_ps(0x00FF, acc, lo);
}
SS_INLINE float ihsum2(iacc2 a) {
    return ihsum(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
}
#else
typedef struct { iw a, b; } iw2;
typedef struct { iacc lo, hi; } iacc2;
SS_INLINE iw2 iw2_pair(iw a, iw b) { iw2 w = {a, b}; return w; }
SS_INLINE iacc2 iacc2_zero(void) { iacc2 z = {iacc_zero(), iacc_zero()}; return z; }
SS_INLINE iacc2 ifma_pair(iw2 w, const int8_t *x, const float *ws, const float *d, iacc2 acc) {
    acc.lo = ifma(idot(w.a, x), ws[0] * d[0], acc.lo);
    acc.hi = ifma(idot(w.b, x + 32), ws[1] * d[1], acc.hi);
    return acc;
}
SS_INLINE iacc2 ifma_pair_halves(iw2 w, const int8_t *x, const float *ws, const float *d, iacc2 acc) {
    acc.lo = ifma2(idot(w.a, x), ws[0] * d[0], ws[1] * d[0], acc.lo);
    acc.hi = ifma2(idot(w.b, x + 32), ws[2] * d[1], ws[3] * d[1], acc.hi);
    return acc;
}
SS_INLINE iacc2 ifma_first(iw w, const int8_t *x, float s0, float s1, iacc2 acc) {
    acc.lo = ifma2(idot(w, x), s0, s1, acc.lo);
    return acc;
}
SS_INLINE float ihsum2(iacc2 a) { return ihsum(iacc_add(a.lo, a.hi)); }
#endif
#endif
