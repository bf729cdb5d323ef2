/* Fused CPU matmuls over stored weight bytes: y[t, r] = sum_c x[t, c] * W[r, c], W decoded inside the loop.
 *
 * 4-bit formats (MXFP4, INT4 group 32) share one layout: each row is blocks of 16 bytes holding 32
 * elements, byte k carrying element 2k in its low nibble and 2k+1 in its high nibble, one scale per block.
 * The caller passes x split into even and odd columns (xe, xo [T, C/2]), so a nibble lane meets its column.
 * Scales: kind 0 E8M0 bytes (through a 256-entry table), kind 1 bf16, kind 2 float32.
 * int8: one float32 scale per row.
 * Rows are split over threads (OpenMP); each row's weights are decoded once and reused for every token, and
 * every token's sum runs in the same order whatever T is: a token's result does not depend on its batch.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h> /* MXCSR (df_ftz), in the portable build too */
#define DF_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#ifndef DF_STREAM_HINT
#define DF_STREAM_HINT _MM_HINT_T0 /* the one-token loops' prefetch ahead in a weight stream */
#endif
#else
#define DF_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define DF_NEON 1 /* arm64: NEON, with the dot-product (SDOT) and I8MM (USDOT) instructions where the target has them */
#endif

#define TT 32 /* tokens per tile: the accumulators of a tile stay in L1 */

static inline float scale_at(const void *scales, int kind, const float *e8m0, int64_t i) {
    if (kind == 0) return e8m0[((const uint8_t *)scales)[i]];           /* OCP MX E8M0 via its table */
    if (kind == 2) return ((const float *)scales)[i];
    uint32_t b = (uint32_t)((const uint16_t *)scales)[i] << 16;         /* bf16 -> float32 */
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Gated activations of an expert, float32: SwiGLU h = silu(g) u (GLU_SILU) and Kimi K3's SiTU-GLU
 * h = beta tanh(g / beta) sigmoid(g) lbeta tanh(u / lbeta) (GLU_SITU), in torch's order of operations.
 * Both come from one function, expm1: sigmoid(g) = 1 / (2 + expm1(-g)), tanh(a) = -e / (2 + e) with
 * e = expm1(-2 a), a = |y| (sign restored), which has no cancellation near 0 (1 - 2 / (exp(2a) + 1) would).
 * expm1(x): x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite, ln2 in two parts, both products exact or fused), then
 * q = r + r^2 P(r), P the Taylor series of (expm1(r) - r) / r^2 to r^6 (truncation < 2^-30 relative), and
 * 2^n q + (2^n - 1) in one fused multiply-add (from n = 25, 2^n (1 + q) - 1: the 1 is below half an ulp there,
 * and 2^n alone may overflow where the result does not). Error bound, u = 2^-24 the unit roundoff: Horner's
 * rounding on r^2 P (P ~ 1/2, |r| <= 0.35) and the final addition give expm1 <= 3u relative for n = 0; for n != 0
 * the last addition cancels at most 1.5x, <= 6u. Then sigmoid <= 6u + 2u (the sum 2 + e >= 1, the division),
 * tanh <= 6u + 2u + u (the sum, the division, the rounding of y = g / beta before it; tanh's condition number is
 * <= 1), and the products one u each: SwiGLU <= 10u, SiTU-GLU <= 2 x 9u + 8u + 4u = 30u relative (15 ulps),
 * where sigmoid(g) is a normal float32 (g > -87; below, it is < 2^-126 and comes out as 0 or a denormal, an
 * absolute error under 2^-118 (|u| + 1) of h). Measured: 3u and 7u at most. tests/test_cpu_glu.py checks these. */
#define GLU_SILU 0
#define GLU_SITU 1
#define LN2_HI 0.693145751953125f /* 15 significant bits: n LN2_HI is exact for |n| < 2^8 */
#define LN2_LO 1.428606765330187e-06f

#ifdef __AVX512F__
/* expm1(r) for x = n ln2 + r, n returned: the reduction and polynomial shared by expm1 and exp */
static inline __m512 v_expm1_reduced(__m512 x, __m512 *n_out) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 40320);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 5040));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    *n_out = n;
    return _mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r);
}

static inline __m512 v_expm1(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-100.0f), _mm512_min_ps(_mm512_set1_ps(100.0f), x)); /* NaN kept */
    __m512 n;
    const __m512 q = v_expm1_reduced(x, &n);
    const __m512 s = _mm512_scalef_ps(_mm512_set1_ps(1.0f), n), one = _mm512_set1_ps(1.0f); /* 2^n, 0 below */
    const __m512 small = _mm512_fmadd_ps(s, q, _mm512_sub_ps(s, one));
    /* from n = 25 the 1 is below half an ulp, and 2^n alone may overflow (n = 128) where 2^n (1 + q) does not */
    const __m512 big = _mm512_sub_ps(_mm512_scalef_ps(_mm512_add_ps(q, one), n), one);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(24.5f), _CMP_GT_OQ), small, big);
}

static inline __m512 v_exp_neg(__m512 x) { /* exp(x) for x <= 0, 0 below -87 (no denormals) */
    const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    __m512 n;
    const __m512 q = v_expm1_reduced(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), &n);
    return _mm512_maskz_mov_ps(~zero, _mm512_scalef_ps(_mm512_add_ps(q, _mm512_set1_ps(1.0f)), n));
}

static inline __m512 v_sigmoid(__m512 g) {
    const __m512 e = v_expm1(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(2.0f), e));
}

static inline __m512 v_tanh(__m512 y) {
    const __m512 a = _mm512_abs_ps(y);
    const __m512 e = v_expm1(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_setzero_ps(), e), _mm512_add_ps(_mm512_set1_ps(2.0f), e));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), /* the sign of y */
                                               _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN))));
}

/* 16 lanes (m: the lanes to write) of h = act(g, u) into h (which may be g). */
static inline void v_glu(int act, float beta, float lbeta, const float *g, const float *u, float *h, __mmask16 m) {
    const __m512 gv = _mm512_maskz_loadu_ps(m, g), uv = _mm512_maskz_loadu_ps(m, u), sg = v_sigmoid(gv);
    __m512 y;
    if (act == GLU_SILU) {
        y = _mm512_mul_ps(_mm512_mul_ps(gv, sg), uv);
    } else {
        const __m512 b = _mm512_set1_ps(beta), lb = _mm512_set1_ps(lbeta);
        const __m512 tg = _mm512_mul_ps(_mm512_mul_ps(b, v_tanh(_mm512_div_ps(gv, b))), sg);
        y = _mm512_mul_ps(tg, _mm512_mul_ps(lb, v_tanh(_mm512_div_ps(uv, lb))));
    }
    _mm512_mask_storeu_ps(h, m, y);
}
#elif defined(__AVX2__)
/* The same on 8 lanes. 2^n is built from its exponent bits: 0 for n <= -127 (the AVX-512 code's scalef gives a
 * subnormal there, which the sum beside it, 2^n - 1 = -1, does not see), and in two factors for the large branch, so
 * that neither overflows where the product does not; multiplying by powers of two rounds nothing. */
static inline __m256 v8_pow2(__m256 n) { /* n an integer in [-127, 127] */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

static inline __m256 v8_expm1(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-100.0f), _mm256_min_ps(_mm256_set1_ps(100.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.0f / 40320);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 5040));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    const __m256 q = _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r), one = _mm256_set1_ps(1.0f);
    const __m256 s = v8_pow2(_mm256_max_ps(n, _mm256_set1_ps(-127.0f)));
    const __m256 small = _mm256_fmadd_ps(s, q, _mm256_sub_ps(s, one));
    const __m256 n1 = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f))), n2 = _mm256_sub_ps(n, n1);
    const __m256 big = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(q, one), v8_pow2(n1)), v8_pow2(n2)), one);
    const __m256 x_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 y = _mm256_blendv_ps(small, big, _mm256_cmp_ps(n, _mm256_set1_ps(24.5f), _CMP_GT_OQ));
    return _mm256_blendv_ps(y, x, x_nan); /* NaN kept */
}

static inline __m256 v8_sigmoid(__m256 g) {
    const __m256 e = v8_expm1(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(2.0f), e));
}

static inline __m256 v8_tanh(__m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 e = v8_expm1(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.0f)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_setzero_ps(), e), _mm256_add_ps(_mm256_set1_ps(2.0f), e));
    return _mm256_or_ps(t, _mm256_and_ps(y, sign)); /* the sign of y */
}

/* 8 lanes (m: the lanes to read and write, -1 each) of h = act(g, u) into h (which may be g). */
static inline void v8_glu(int act, float beta, float lbeta, const float *g, const float *u, float *h, __m256i m) {
    const __m256 gv = _mm256_maskload_ps(g, m), uv = _mm256_maskload_ps(u, m), sg = v8_sigmoid(gv);
    __m256 y;
    if (act == GLU_SILU) {
        y = _mm256_mul_ps(_mm256_mul_ps(gv, sg), uv);
    } else {
        const __m256 b = _mm256_set1_ps(beta), lb = _mm256_set1_ps(lbeta);
        const __m256 tg = _mm256_mul_ps(_mm256_mul_ps(b, v8_tanh(_mm256_div_ps(gv, b))), sg);
        y = _mm256_mul_ps(tg, _mm256_mul_ps(lb, v8_tanh(_mm256_div_ps(uv, lb))));
    }
    _mm256_maskstore_ps(h, m, y);
}
#elif defined(DF_NEON)
/* The same on 4 NEON lanes, step for step (fused multiply-adds where the AVX2 code has them). */
static inline float32x4_t n4_pow2(float32x4_t n) { /* n an integer in [-127, 127] */
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
}

static inline float32x4_t n4_expm1(float32x4_t x) {
    x = vmaxq_f32(vdupq_n_f32(-100.0f), vminq_f32(vdupq_n_f32(100.0f), x)); /* NaN stays NaN */
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(LN2_HI));
    r = vfmsq_f32(r, n, vdupq_n_f32(LN2_LO));
    float32x4_t p = vdupq_n_f32(1.0f / 40320);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 5040), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    const float32x4_t q = vfmaq_f32(r, vmulq_f32(r, r), p), one = vdupq_n_f32(1.0f);
    const float32x4_t s = n4_pow2(vmaxq_f32(n, vdupq_n_f32(-127.0f)));
    const float32x4_t small = vfmaq_f32(vsubq_f32(s, one), s, q);
    const float32x4_t n1 = vrndmq_f32(vmulq_f32(n, vdupq_n_f32(0.5f))), n2 = vsubq_f32(n, n1);
    const float32x4_t big = vsubq_f32(vmulq_f32(vmulq_f32(vaddq_f32(q, one), n4_pow2(n1)), n4_pow2(n2)), one);
    const float32x4_t y = vbslq_f32(vcgtq_f32(n, vdupq_n_f32(24.5f)), big, small);
    return vbslq_f32(vceqq_f32(x, x), y, x); /* NaN kept */
}

static inline float32x4_t n4_sigmoid(float32x4_t g) {
    return vdivq_f32(vdupq_n_f32(1.0f), vaddq_f32(vdupq_n_f32(2.0f), n4_expm1(vnegq_f32(g))));
}

static inline float32x4_t n4_tanh(float32x4_t y) {
    const float32x4_t e = n4_expm1(vmulq_f32(vabsq_f32(y), vdupq_n_f32(-2.0f)));
    const float32x4_t t = vdivq_f32(vnegq_f32(e), vaddq_f32(vdupq_n_f32(2.0f), e));
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(t),
                                           vandq_u32(vreinterpretq_u32_f32(y), vdupq_n_u32(0x80000000u))));
}

/* 4 lanes of h = act(g, u) into h (which may be g). */
static inline void n4_glu(int act, float beta, float lbeta, const float *g, const float *u, float *h) {
    const float32x4_t gv = vld1q_f32(g), uv = vld1q_f32(u), sg = n4_sigmoid(gv);
    float32x4_t y;
    if (act == GLU_SILU) {
        y = vmulq_f32(vmulq_f32(gv, sg), uv);
    } else {
        const float32x4_t b = vdupq_n_f32(beta), lb = vdupq_n_f32(lbeta);
        const float32x4_t tg = vmulq_f32(vmulq_f32(b, n4_tanh(vdivq_f32(gv, b))), sg);
        y = vmulq_f32(tg, vmulq_f32(lb, n4_tanh(vdivq_f32(uv, lb))));
    }
    vst1q_f32(h, y);
}
#endif

/* h[i] = act(g[i], u[i]) for n values (h may be g); the portable build takes libm's expm1f in the same formulas. */
static void glu_span(int act, float beta, float lbeta, const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        v_glu(act, beta, lbeta, g + i, u + i, h + i, m);
    }
#elif defined(__AVX2__)
    for (; i < n; i += 8) {
        const int left = n - i >= 8 ? 8 : (int)(n - i);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        v8_glu(act, beta, lbeta, g + i, u + i, h + i, m);
    }
#elif defined(DF_NEON)
    for (; i + 4 <= n; i += 4) n4_glu(act, beta, lbeta, g + i, u + i, h + i); /* the last n % 4 below */
#endif
    for (; i < n; i++) {
        const float sg = 1.0f / (2.0f + expm1f(-g[i]));
        if (act == GLU_SILU) {
            h[i] = g[i] * sg * u[i];
        } else {
            const float yg = g[i] / beta, yu = u[i] / lbeta;
            const float eg = expm1f(-2.0f * fabsf(yg)), eu = expm1f(-2.0f * fabsf(yu));
            const float tg = copysignf(-eg / (2.0f + eg), yg), tu = copysignf(-eu / (2.0f + eu), yu);
            h[i] = beta * tg * sg * (lbeta * tu);
        }
    }
}

/* The gated activation alone (tests check it against torch and float64). */
void df_glu_act(int act, float beta, float lbeta, const float *g, const float *u, float *h, int64_t n) {
    glu_span(act, beta, lbeta, g, u, h, n);
}

#ifdef __AVX512F__
/* One block of 16 bytes -> its 16 even and 16 odd elements, times the block's scale. */
static inline void q4_decode_block(const uint8_t *p, __m512 tab, float scale, __m512 *we, __m512 *wo) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 s = _mm512_set1_ps(scale);
    *we = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)), tab), s);
    *wo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab), s);
}
#endif

static void q4_rows(int kind, const uint8_t *packed, const void *scales, const float *lut, const float *e8m0,
                    const float *xe, const float *xo, float *out, int64_t r0, int64_t r1, int64_t R, int64_t C,
                    int64_t T) {
    const int64_t H = C / 2, nb = C / 32;
#ifdef __AVX512F__
    const __m512 tab = _mm512_loadu_ps(lut);
    int64_t r = r0;
    if (T == 1) /* four rows at a time: eight independent FMA chains hide the FMA latency */
        for (; r + 4 <= r1; r += 4) {
            __m512 ae[4], ao[4];
            for (int i = 0; i < 4; i++) ae[i] = ao[i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m512 x0 = _mm512_loadu_ps(xe + b * 16), x1 = _mm512_loadu_ps(xo + b * 16);
                for (int i = 0; i < 4; i++) {
                    __m512 we, wo;
                    q4_decode_block(packed + (r + i) * H + b * 16, tab,
                                    scale_at(scales, kind, e8m0, (r + i) * nb + b), &we, &wo);
                    ae[i] = _mm512_fmadd_ps(we, x0, ae[i]);
                    ao[i] = _mm512_fmadd_ps(wo, x1, ao[i]);
                }
            }
            for (int i = 0; i < 4; i++) out[r + i] = _mm512_reduce_add_ps(_mm512_add_ps(ae[i], ao[i]));
        }
    __m512 acce[TT], acco[TT]; /* the same sums, token by token, for the rest */
    for (; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
            for (int64_t t = 0; t < nt; t++) acce[t] = acco[t] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m512 we, wo;
                q4_decode_block(row + b * 16, tab, scale_at(scales, kind, e8m0, r * nb + b), &we, &wo);
                for (int64_t t = 0; t < nt; t++) {
                    const float *pe = xe + (t0 + t) * H + b * 16, *po = xo + (t0 + t) * H + b * 16;
                    acce[t] = _mm512_fmadd_ps(we, _mm512_loadu_ps(pe), acce[t]);
                    acco[t] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(po), acco[t]);
                }
            }
            for (int64_t t = 0; t < nt; t++) out[(t0 + t) * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(acce[t], acco[t]));
        }
    }
#else
    float acc[TT][16];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
            memset(acc, 0, sizeof(acc));
            for (int64_t b = 0; b < nb; b++) {
                const float s = scale_at(scales, kind, e8m0, r * nb + b);
                float we[16], wo[16];
                for (int j = 0; j < 16; j++) {
                    we[j] = lut[row[b * 16 + j] & 15] * s;
                    wo[j] = lut[row[b * 16 + j] >> 4] * s;
                }
                for (int64_t t = 0; t < nt; t++) {
                    const float *pe = xe + (t0 + t) * H + b * 16, *po = xo + (t0 + t) * H + b * 16;
                    for (int j = 0; j < 16; j++) acc[t][j] += we[j] * pe[j] + wo[j] * po[j];
                }
            }
            for (int64_t t = 0; t < nt; t++) {
                float sum = 0.0f;
                for (int j = 0; j < 16; j++) sum += acc[t][j];
                out[(t0 + t) * R + r] = sum;
            }
        }
    }
#endif
}




/* Rows [r0, r1) decoded to float32 w [r1 - r0, C] in column order: the tile a BLAS matmul reuses for many tokens. */
static void q4_decode_rows(int kind, const uint8_t *packed, const void *scales, const float *lut, const float *e8m0,
                           float *w, int64_t r0, int64_t r1, int64_t rbase, int64_t C) {
    const int64_t H = C / 2, nb = C / 32;
#ifdef __AVX512F__
    const __m512 tab = _mm512_loadu_ps(lut);
    const __m512i m15 = _mm512_set1_epi32(15);
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
#endif
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        float *dst = w + (r - rbase) * C;
        for (int64_t b = 0; b < nb; b++) {
            const float s = scale_at(scales, kind, e8m0, r * nb + b);
#ifdef __AVX512F__
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * 16)));
            const __m512 vs = _mm512_set1_ps(s);
            const __m512 we = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(q, m15), tab), vs);
            const __m512 wo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab), vs);
            _mm512_storeu_ps(dst + b * 32, _mm512_permutex2var_ps(we, lo, wo));
            _mm512_storeu_ps(dst + b * 32 + 16, _mm512_permutex2var_ps(we, hi, wo));
#else
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + 2 * j] = lut[row[b * 16 + j] & 15] * s;
                dst[b * 32 + 2 * j + 1] = lut[row[b * 16 + j] >> 4] * s;
            }
#endif
        }
    }
}

static void i8_rows(const int8_t *q, const float *s, const float *x, float *out, int64_t r0, int64_t r1,
                    int64_t R, int64_t C, int64_t T) {
    const int64_t C16 = C - C % 16;
#ifdef __AVX512F__
    __m512 acc[TT];
#else
    float acc[TT][16];
#endif
    int64_t r = r0;
#ifdef __AVX512F__
    if (T == 1) /* four rows at a time: independent FMA chains hide the FMA latency; same sums as below */
        for (; r + 4 <= r1; r += 4) {
            __m512 a[4];
            for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < C16; c += 16) {
                const __m512 xv = _mm512_loadu_ps(x + c);
                for (int i = 0; i < 4; i++) {
                    const __m128i b = _mm_loadu_si128((const __m128i *)(q + (r + i) * C + c));
                    a[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), xv, a[i]);
                }
            }
            for (int i = 0; i < 4; i++) {
                float sum = _mm512_reduce_add_ps(a[i]);
                for (int64_t c = C16; c < C; c++) sum += (float)q[(r + i) * C + c] * x[c];
                out[r + i] = sum * s[r + i];
            }
        }
#endif
    for (; r < r1; r++) {
        const int8_t *row = q + r * C;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
#ifdef __AVX512F__
            for (int64_t t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t c = 0; c < C16; c += 16) {
                const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
                for (int64_t t = 0; t < nt; t++)
                    acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (t0 + t) * C + c), acc[t]);
            }
#else
            memset(acc, 0, sizeof(acc));
            for (int64_t c = 0; c < C16; c += 16) {
                float w[16];
                for (int j = 0; j < 16; j++) w[j] = (float)row[c + j];
                for (int64_t t = 0; t < nt; t++)
                    for (int j = 0; j < 16; j++) acc[t][j] += w[j] * x[(t0 + t) * C + c + j];
            }
#endif
            for (int64_t t = 0; t < nt; t++) {
#ifdef __AVX512F__
                float sum = _mm512_reduce_add_ps(acc[t]);
#else
                float sum = 0.0f;
                for (int j = 0; j < 16; j++) sum += acc[t][j];
#endif
                for (int64_t c = C16; c < C; c++) sum += (float)row[c] * x[(t0 + t) * C + c];
                out[(t0 + t) * R + r] = sum * s[r];
            }
        }
    }
}

/* Q8 path for 4-bit weights, one to a few tokens: each token's row is quantized once per call to int8 per block of
 * 32, in two terms where the build has AVX-512 VNNI (Q8_TERMS): q1 = round(x / d) with d = max|x| / 127, and the
 * rest, x - d q1 (at most d / 2), as q2 = round((x - d q1) / (d / 256)) clamped to +-127, so x = (d / 256) (256 q1 +
 * q2) within d / 256 (q1 alone, within d / 2, flipped 2 of a tiny Kimi K3's 16 greedy decode steps; the two terms
 * flip none). The block dot products run in int8 x int8 -> int32 (exact), once per term, combined as 256 s1 + s2
 * (exact: below 2^24), then float(sum) * weight scale * d / 256 accumulates in float32. The weight nibble n goes
 * through a table tab[n] = v + K, v the stored value as an integer (MXFP4: twice the E2M1 value, 0..12 with sign, K = 12;
 * INT4: n - 8, K = 8), so the weight side is unsigned as VNNI's vpdpbusd wants, and K * sum(q) is taken off
 * once per token (it does not depend on the row). The factor that maps v back (0.5 for MXFP4) is folded into d.
 * Per token, a group of 4 blocks is laid out as one 512-bit vector of even columns and one of odd columns (the
 * low and high nibbles of the group's 64 packed bytes) for q1, the same for q2 after them (Q8GB bytes a group),
 * corr holding -K * (256 sum(q1) + sum(q2)) for each int32 lane. */
#define QG 4 /* blocks per group */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_TERMS 2 /* the two int8 terms: VNNI on 512-bit vectors keeps the one-token expert at memory speed */
#else
#define Q8_TERMS 1 /* q1 alone (d = max|x| / 127, within d / 2): the second term's dot products took the AVX2
                    * one-token expert from 0.57-0.61 to 0.38-0.43 of memory bandwidth */
#endif
#define Q8GB (64 * Q8_TERMS) /* bytes of xe (and of xo) per group and token: q1's 64, then q2's */
#define XS (((q->G + 3) / 4) * 16) /* a token's xs stride: whole runs of 4 groups */

typedef struct {
    int8_t *xe, *xo; /* [T, G * Q8GB] */
    float *xs;       /* [T, XS] block scales times the value factor, 0 in padding */
    int32_t *corr;   /* [T, G * 16] */
    int64_t G;
} q8x_t;

#if Q8_TERMS == 2
/* q2 of a value v with d, q1 = round(v / d) and id = 1 / d (0 where the block has no finite scale): the rest
 * v - d q1 in units of d / 256, rounded, within +-127 */
static inline int q8_rest(float v, float d, int q1, float id) {
    const int r = (int)nearbyintf(fmaf(-d, (float)q1, v) * (id * 256.0f));
    return r > 127 ? 127 : r < -127 ? -127 : r;
}
#endif

static void q8_quantize(const float *x, int64_t T, int64_t C, int K, float mult, q8x_t *q) {
    const int64_t nb = C / 32, G = q->G;
    memset(q->xe, 0, T * G * Q8GB);
    memset(q->xo, 0, T * G * Q8GB);
    memset(q->xs, 0, T * XS * sizeof(float));
    memset(q->corr, 0, T * G * 16 * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + t * C + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                const float a = xb[j] < 0 ? -xb[j] : xb[j];
                amax = a > amax || a != a ? a : amax; /* NaN wins: it reaches the scale, hence the result */
            }
            const float d = amax / 127.0f, id = amax > 0.0f && amax <= 3.4e38f ? 127.0f / amax : 0.0f;
            const int64_t g = b / QG, lane0 = (b % QG) * 4, at = t * G * Q8GB + g * Q8GB + (b % QG) * 16;
            int8_t *pe = q->xe + at, *po = q->xo + at;
            int32_t *corr = q->corr + t * G * 16 + g * 16 + lane0;
            for (int j = 0; j < 16; j++) {
                const int qe = (int)nearbyintf(xb[2 * j] * id), qo = (int)nearbyintf(xb[2 * j + 1] * id);
                pe[j] = (int8_t)qe;
                po[j] = (int8_t)qo;
#if Q8_TERMS == 2
                const int re = q8_rest(xb[2 * j], d, qe, id), ro = q8_rest(xb[2 * j + 1], d, qo, id);
                pe[j + 64] = (int8_t)re;
                po[j + 64] = (int8_t)ro;
                corr[j / 4] -= K * (256 * (qe + qo) + re + ro);
#else
                corr[j / 4] -= K * (qe + qo);
#endif
            }
            q->xs[t * XS + b] = (Q8_TERMS == 2 ? d * (1.0f / 256) : d) * mult;
        }
}

/* Software prefetch of the next rows, a row ahead: measured 1.5x on a K3 expert read from memory (the
 * hardware prefetcher alone left the one-token loop waiting on memory). */
#ifndef PF
#define PF 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_VNNI 1
/* The weight scales of 16 blocks from block i (n < 16 in a last, partial run), as float32. E8M0 by its bits:
 * e << 23 is 2^(e - 127) for e in 1..254; 0 (2^-127, a subnormal) and 255 (NaN) are patched in. Scales past n
 * meet zero activation scales. */
static inline __m512 q8_wscale16(int kind, const void *scales, const float *e8m0, int64_t i, int n) {
    const __mmask16 m = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); /* past n: 2^-127 or 0 */
    if (kind == 0) {
        const __m128i b = _mm_maskz_loadu_epi8(m, (const uint8_t *)scales + i);
        const __m512i e = _mm512_cvtepu8_epi32(b);
        __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
        f = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), f, _mm512_set1_ps(e8m0[0]));
        return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), f, _mm512_set1_ps(e8m0[255]));
    }
    if (kind == 2) return _mm512_maskz_loadu_ps(m, (const float *)scales + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)scales + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One token's contribution of one group (4 blocks) of one row: the 16 int32 lanes of the group's exact block
 * sums, times the scale of each lane's block (sc16: the 16 block scales of the run, spread: which 4 of them), added
 * to acc. The same operations whatever the batch. */
static inline __m512 q8_group(__m512i lo, __m512i hi, __m512 sc16, __m512i spread, const int8_t *xe,
                              const int8_t *xo, const int32_t *corr, __m512 acc) {
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xe)); /* q1's sums */
    a = _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512(xo));
    __m512i b = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr), lo, _mm512_loadu_si512(xe + 64)); /* q2's */
    b = _mm512_dpbusd_epi32(b, hi, _mm512_loadu_si512(xo + 64));
    const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(a, 8), b);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(spread, sc16), acc);
}

/* The group's 64 packed bytes -> table values of the even (lo) and odd (hi) columns, block j in 128-bit lane j. */
static inline void q8_decode(const uint8_t *w, __mmask64 m, __m512i tab, __m512i *lo, __m512i *hi) {
    const __m512i v = _mm512_maskz_loadu_epi8(m, w), m15 = _mm512_set1_epi8(15);
    *lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m15));
    *hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
}

/* The Q8 path's vector code, one loop for both widths (q8_rows) over these: a unit is a group's 4 blocks (64
 * packed bytes), decoded once per row and group and multiplied into each token; a run of Q8_RUN blocks shares one
 * vector of weight scales, whose lanes a unit's block sums take by its place in the run (k->spread). */
#define Q8_VEC 1
#define Q8_RUN 16
typedef __m512 q8f_t;
typedef struct {
    __m512i lo, hi; /* a group's table values, even and odd columns, block j in 128-bit lane j */
} q8u_t;
typedef struct {
    __m512i tab, spread[4];
} q8k_t;

static inline void q8_consts(q8k_t *k, const uint8_t *tab8) {
    k->tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)tab8));
    for (int j = 0; j < 4; j++)
        k->spread[j] = _mm512_add_epi32(_mm512_set1_epi32(4 * j),
                                        _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
}
static inline q8f_t q8f_zero(void) { return _mm512_setzero_ps(); }
static inline q8f_t q8f_load(const float *p) { return _mm512_loadu_ps(p); }
static inline q8f_t q8f_mul(q8f_t a, q8f_t b) { return _mm512_mul_ps(a, b); }
static inline float q8f_sum(q8f_t a) { return _mm512_reduce_add_ps(a); }
static inline q8f_t q8_wscale_run(int kind, const void *scales, const float *e8m0, int64_t i, int n) {
    return q8_wscale16(kind, scales, e8m0, i, n);
}
/* n (1-4) blocks of a group; bytes past them are not read */
static inline void q8_unit_decode(const uint8_t *w, int n, const q8k_t *k, q8u_t *u) {
    const __mmask64 m = n == QG ? ~(__mmask64)0 : (((__mmask64)1 << (16 * n)) - 1);
    q8_decode(w, m, k->tab, &u->lo, &u->hi);
}
/* acc + one token's unit: its 16 exact int32 lane sums times their blocks' scales (sc: the run's, gi: the unit's
 * place in the run) */
static inline q8f_t q8_unit_fma(q8f_t acc, const q8u_t *u, q8f_t sc, int gi, const q8k_t *k, const int8_t *xe,
                                const int8_t *xo, const int32_t *corr) {
    return q8_group(u->lo, u->hi, sc, k->spread[gi], xe, xo, corr, acc);
}
#elif defined(__AVX2__)
/* The same on 256-bit vectors (x86 without AVX-512: most laptop and desktop CPUs): a unit is two vectors of two
 * blocks each, 8 int32 lanes of 4 byte pairs apiece, the AVX-512 code's lanes in two halves (corr lines up with
 * them), and a run is 8 blocks. With AVX-VNNI (vpdpbusd on ymm) the sums are VNNI's; without it vpmaddubsw
 * multiplies the unsigned table values by the signed activations into int16 pairs, which cannot saturate
 * (2 x 24 x 127, twice for the even and odd columns added, < 2^15), and vpmaddwd by ones widens them to the same
 * exact int32 lane sums. */
#define Q8_VEC 1
#define Q8_RUN 8
typedef __m256 q8f_t;
typedef struct {
    __m256i lo[2], hi[2]; /* blocks 2h, 2h + 1 of the group in half h */
    int n;                /* blocks in the group (1-4) */
} q8u_t;
typedef struct {
    __m256i tab, spread[4]; /* spread[k]: lanes 0-3 take scale 2k of the run, lanes 4-7 scale 2k + 1 */
} q8k_t;

static inline void q8_consts(q8k_t *k, const uint8_t *tab8) {
    k->tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab8));
    for (int j = 0; j < 4; j++) k->spread[j] = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
}
static inline q8f_t q8f_zero(void) { return _mm256_setzero_ps(); }
static inline q8f_t q8f_load(const float *p) { return _mm256_loadu_ps(p); }
static inline q8f_t q8f_mul(q8f_t a, q8f_t b) { return _mm256_mul_ps(a, b); }
static inline float q8f_sum(q8f_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The weight scales of 8 blocks from block i (n < 8 in a last, partial run: 0 past n, where the activation scales
 * are 0 too), as float32: E8M0 through its table (2^-127 and NaN included), bf16 by its bits, or float32. */
static inline q8f_t q8_wscale_run(int kind, const void *scales, const float *e8m0, int64_t i, int n) {
    if (n < 8) {
        float f[8] = {0};
        for (int j = 0; j < n; j++) f[j] = scale_at(scales, kind, e8m0, i + j);
        return _mm256_loadu_ps(f);
    }
    if (kind == 0) { /* E8M0 by its bits, as the AVX-512 code: e << 23 is 2^(e - 127) for e in 1..254; 0 and 255
                      * patched in from the table. A gather from the table took longer than a short row's math
                      * (three a row of 768 columns) */
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)scales + i)));
        __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
        f = _mm256_blendv_ps(f, _mm256_set1_ps(e8m0[0]), _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
        return _mm256_blendv_ps(f, _mm256_set1_ps(e8m0[255]),
                                _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(255))));
    }
    if (kind == 2) return _mm256_loadu_ps((const float *)scales + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)scales + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* n (1-4) blocks of a group -> their table values; bytes past them are not read (a missing block of a half reads
 * as nibble 0, whose table value meets zero activations) */
static inline void q8_unit_decode(const uint8_t *w, int n, const q8k_t *k, q8u_t *u) {
    const __m256i m15 = _mm256_set1_epi8(15);
    u->n = n;
    for (int h = 0; h < 2; h++) {
        if (2 * h >= n) { /* a group of 1-2 blocks: half 1 is not read */
            u->lo[h] = u->hi[h] = _mm256_setzero_si256();
            continue;
        }
        const __m128i b0 = _mm_loadu_si128((const __m128i *)(w + 32 * h));
        const __m128i b1 = 2 * h + 1 < n ? _mm_loadu_si128((const __m128i *)(w + 32 * h + 16)) : _mm_setzero_si128();
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
        u->lo[h] = _mm256_shuffle_epi8(k->tab, _mm256_and_si256(v, m15));
        u->hi[h] = _mm256_shuffle_epi8(k->tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), m15));
    }
}

/* acc + one token's unit (see the AVX-512 one): per half, the two blocks' int32 lane sums with K's offset taken
 * off through corr, times their scales */
static inline q8f_t q8_unit_fma(q8f_t acc, const q8u_t *u, q8f_t sc, int gi, const q8k_t *k, const int8_t *xe,
                                const int8_t *xo, const int32_t *corr) {
    for (int h = 0; h < 2 && 2 * h < u->n; h++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + 8 * h));
        const __m256i e = _mm256_loadu_si256((const __m256i *)(xe + 32 * h));
        const __m256i o = _mm256_loadu_si256((const __m256i *)(xo + 32 * h));
#ifdef __AVXVNNI__
        const __m256i sum = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(c, u->lo[h], e), u->hi[h], o);
#else
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u->lo[h], e), _mm256_maddubs_epi16(u->hi[h], o));
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), c);
#endif
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_permutevar8x32_ps(sc, k->spread[2 * gi + h]), acc);
    }
    return acc;
}
#elif defined(DF_NEON)
/* The same on 128-bit NEON vectors (arm64: Apple M-series without MLX, Graviton, Ampere, Grace): a unit is a group's
 * 4 blocks, one vector of even and one of odd columns each, and a run is the group (one vector of 4 block scales).
 * A block's 4 int32 lanes hold exact partial sums with K's offset taken off through corr; two pairwise adds give the
 * 4 block sums, one float multiply-add applies their scales. The products: USDOT with I8MM (unsigned table values x
 * signed activations, as x86's vpdpbusd), SDOT with the dot-product extension (the table values, at most 24, are
 * valid signed bytes), else widening multiplies and pairwise adds (|sum| <= 2 x 24 x 127 per int16 lane). */
#define Q8_VEC 1
#define Q8_RUN 4
typedef float32x4_t q8f_t;
typedef struct {
    uint8x16_t lo[QG], hi[QG]; /* table values of block j's even and odd columns, 0 past the group's blocks */
} q8u_t;
typedef struct {
    uint8x16_t tab;
} q8k_t;

static inline void q8_consts(q8k_t *k, const uint8_t *tab8) { k->tab = vld1q_u8(tab8); }
static inline q8f_t q8f_zero(void) { return vdupq_n_f32(0.0f); }
static inline q8f_t q8f_load(const float *p) { return vld1q_f32(p); }
static inline q8f_t q8f_mul(q8f_t a, q8f_t b) { return vmulq_f32(a, b); }
static inline float q8f_sum(q8f_t v) { return vaddvq_f32(v); }
/* the 4 block scales from block i (0 past n, where the activation scales are 0 too), as float32 */
static inline q8f_t q8_wscale_run(int kind, const void *scales, const float *e8m0, int64_t i, int n) {
    float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < n; j++) f[j] = scale_at(scales, kind, e8m0, i + j);
    return vld1q_f32(f);
}
static inline void q8_unit_decode(const uint8_t *w, int n, const q8k_t *k, q8u_t *u) {
    const uint8x16_t m15 = vdupq_n_u8(15);
    for (int j = 0; j < QG; j++) {
        if (j >= n) { /* bytes past the group's blocks are not read */
            u->lo[j] = u->hi[j] = vdupq_n_u8(0);
            continue;
        }
        const uint8x16_t v = vld1q_u8(w + 16 * j);
        u->lo[j] = vqtbl1q_u8(k->tab, vandq_u8(v, m15));
        u->hi[j] = vqtbl1q_u8(k->tab, vshrq_n_u8(v, 4));
    }
}
static inline int32x4_t q8_dot(int32x4_t c, uint8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
    return vusdotq_s32(c, w, x);
#elif defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(c, vreinterpretq_s8_u8(w), x);
#else
    const int8x16_t s = vreinterpretq_s8_u8(w);
    return vpadalq_s16(c, vmlal_high_s8(vmull_s8(vget_low_s8(s), vget_low_s8(x)), s, x));
#endif
}
static inline q8f_t q8_unit_fma(q8f_t acc, const q8u_t *u, q8f_t sc, int gi, const q8k_t *k, const int8_t *xe,
                                const int8_t *xo, const int32_t *corr) {
    (void)gi, (void)k;
    int32x4_t s[QG];
    for (int j = 0; j < QG; j++)
        s[j] = q8_dot(q8_dot(vld1q_s32(corr + 4 * j), u->lo[j], vld1q_s8(xe + 16 * j)), u->hi[j], vld1q_s8(xo + 16 * j));
    const int32x4_t b = vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3])); /* the 4 block sums */
    return vfmaq_f32(acc, vcvtq_f32_s32(b), sc);
}
#endif

#if defined(Q8_VNNI) && Q8_TERMS == 2
/* q8_rows' one-token loop where every group is whole (blocks a multiple of 4): one row at a time, start to end,
 * so a thread reads one sequential stream that the hardware prefetcher follows (no software prefetch), with the
 * same operations on the same values in the same order as q8_group (the same sums, bit for bit). Four rows
 * interleaved with a prefetch a row ahead (the generic loop) spilled its pointers and ran 8 experts of 768 x 2048
 * at 7.1-7.7 GB/s on one Zen 4 core, whether they were in L3 or in memory. This one computes at 18 GB/s from L2 and
 * 9-12 from memory. A prefetch Q8_PFD bytes ahead in the same stream: a layer's 8 experts, rotated over 256 (640 MB,
 * from memory), 2 threads of a Zen 4 VM, 978-1091 -> 908-1003 us at 1 KB (+8-9%; 512 B +0-2%, 2 KB +8%, 4 KB +4%),
 * one thread 1536 -> 1448; over 64 experts +3%; one layer's 8 again and again (20 MB, in L3) level. Returns r1. */
#ifndef Q8_PFD
#define Q8_PFD 1024 /* bytes ahead in the row stream to prefetch (0: none; -DQ8_PFD=N to measure another) */
#endif
static int64_t q8_rows1_vnni(int kind, const uint8_t *packed, const void *scales, const float *e8m0,
                             const q8k_t *k, const q8x_t *q, float *out, int64_t r0, int64_t r1, int64_t H,
                             int64_t nb, int64_t G) {
    const int64_t GR = Q8_RUN / QG;
    const __m512i tab = k->tab, m15 = _mm512_set1_epi8(15);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = packed + r * H;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g0 = 0; g0 < G; g0 += GR) {
            const int nbr = nb - g0 * QG < Q8_RUN ? (int)(nb - g0 * QG) : Q8_RUN;
            const __m512 sc = _mm512_mul_ps(q8_wscale16(kind, scales, e8m0, r * nb + g0 * QG, nbr),
                                            _mm512_loadu_ps(q->xs + g0 * QG));
            const int64_t g1 = g0 + GR < G ? g0 + GR : G;
            for (int64_t g = g0; g < g1; g++) {
                const int8_t *xe = q->xe + g * Q8GB, *xo = q->xo + g * Q8GB;
                if (Q8_PFD) _mm_prefetch((const char *)(w + g * 64 + Q8_PFD), DF_STREAM_HINT); /* never faults */
                const __m512i v = _mm512_loadu_si512(w + g * 64);
                const __m512i lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m15));
                const __m512i hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
                __m512i x = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xe));
                x = _mm512_dpbusd_epi32(x, hi, _mm512_loadu_si512(xo));
                __m512i y = _mm512_dpbusd_epi32(_mm512_loadu_si512(q->corr + g * 16), lo, _mm512_loadu_si512(xe + 64));
                y = _mm512_dpbusd_epi32(y, hi, _mm512_loadu_si512(xo + 64));
                const __m512i t = _mm512_add_epi32(_mm512_slli_epi32(x, 8), y);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(k->spread[g - g0], sc), acc);
            }
        }
        out[r] = _mm512_reduce_add_ps(acc);
    }
    return r1;
}
#endif

#if !defined(Q8_VNNI) && defined(__AVX2__) && Q8_TERMS == 1
/* The AVX2 form of that loop (x86 without AVX-512): one row at a time, start to end, a group as two 256-bit
 * halves of two blocks, the same operations in the same order as q8_unit_fma (the same sums, bit for bit). The
 * four-row loop below keeps 4 accumulators, 4 scale vectors and 4 units live in 16 ymm registers and spills
 * them. Written out rather than through q8_unit_decode / q8_unit_fma, whose unit carries its block count: the
 * same loop over them ran 6-10% slower (Zen 3, 2 threads, Qwen3-MoE and K3 experts, three interleaved runs).
 * One loop per scale kind, whole runs apart from the last: with the kind's branch and the run's block count
 * tested in every run, a layer's 8 experts from memory ran 10-17% slower (2 threads, interleaved: Qwen3-MoE
 * 18.2 -> 21.0 GB/s, K3 7168 x 2048 24.4 -> 26.7), the same bits. Two rows at a time sharing the activation
 * loads: faster from cache, slower from memory (two streams a thread); not kept. Returns r1. */
#ifndef Q8_PFD
#define Q8_PFD 1024 /* bytes ahead in the row stream to prefetch (0: none) */
#endif
/* One run (8 blocks, 2 groups) of a row: acc + its 4 halves' block sums times their scales, in q8_unit_fma's order. */
static inline __attribute__((always_inline)) __m256 q8_run_avx2(__m256 acc, const uint8_t *w, __m256 sc,
                                                                const int8_t *xe, const int8_t *xo,
                                                                const int32_t *corr, const q8k_t *k, int ng) {
    const __m256i m15 = _mm256_set1_epi8(15);
#ifndef __AVXVNNI__
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int g = 0; g < ng; g++) {
        if (Q8_PFD) _mm_prefetch((const char *)(w + g * 64 + Q8_PFD), DF_STREAM_HINT); /* never faults */
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + g * 64 + 32 * h));
            const __m256i lo = _mm256_shuffle_epi8(k->tab, _mm256_and_si256(v, m15));
            const __m256i hi = _mm256_shuffle_epi8(k->tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), m15));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + g * 16 + 8 * h));
            const __m256i e = _mm256_loadu_si256((const __m256i *)(xe + g * Q8GB + 32 * h));
            const __m256i o = _mm256_loadu_si256((const __m256i *)(xo + g * Q8GB + 32 * h));
#ifdef __AVXVNNI__
            const __m256i sum = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(c, lo, e), hi, o);
#else
            const __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
            const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(pr, ones), c);
#endif
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_permutevar8x32_ps(sc, k->spread[2 * g + h]), acc);
        }
    }
    return acc;
}

/* The loop for one scale kind (a constant where it is inlined: the kind's branch leaves the run loop). Whole runs
 * in one loop, a last partial run (fewer than 8 blocks) after it. */
static inline __attribute__((always_inline)) int64_t q8_rows1_avx2_kind(
    int kind, const uint8_t *packed, const void *scales, const float *e8m0, const q8k_t *k, const q8x_t *q,
    float *out, int64_t r0, int64_t r1, int64_t H, int64_t nb, int64_t G) {
    const int64_t GR = Q8_RUN / QG, full = nb / Q8_RUN;
    const int8_t *xe = q->xe, *xo = q->xo;
    const int32_t *corr = q->corr;
    const float *xs = q->xs;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = packed + r * H;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < full; j++) {
            const int64_t g0 = j * GR;
            const __m256 sc = _mm256_mul_ps(q8_wscale_run(kind, scales, e8m0, r * nb + g0 * QG, Q8_RUN),
                                            _mm256_loadu_ps(xs + g0 * QG));
            acc = q8_run_avx2(acc, w + g0 * 64, sc, xe + g0 * Q8GB, xo + g0 * Q8GB, corr + g0 * 16, k, (int)GR);
        }
        if (full * GR < G) { /* the last run: its blocks (a multiple of 4) past the whole runs */
            const int64_t g0 = full * GR;
            const int nbr = (int)(nb - g0 * QG);
            const __m256 sc = _mm256_mul_ps(q8_wscale_run(kind, scales, e8m0, r * nb + g0 * QG, nbr),
                                            _mm256_loadu_ps(xs + g0 * QG));
            acc = q8_run_avx2(acc, w + g0 * 64, sc, xe + g0 * Q8GB, xo + g0 * Q8GB, corr + g0 * 16, k,
                              (int)(G - g0));
        }
        out[r] = q8f_sum(acc);
    }
    return r1;
}

static int64_t q8_rows1_avx2(int kind, const uint8_t *packed, const void *scales, const float *e8m0,
                             const q8k_t *k, const q8x_t *q, float *out, int64_t r0, int64_t r1, int64_t H,
                             int64_t nb, int64_t G) {
    if (kind == 0) return q8_rows1_avx2_kind(0, packed, scales, e8m0, k, q, out, r0, r1, H, nb, G);
    if (kind == 2) return q8_rows1_avx2_kind(2, packed, scales, e8m0, k, q, out, r0, r1, H, nb, G);
    return q8_rows1_avx2_kind(1, packed, scales, e8m0, k, q, out, r0, r1, H, nb, G);
}
#define Q8_ROWS1_AVX2 1
#endif

static void q8_rows(int kind, const uint8_t *packed, const void *scales, const uint8_t *tab8, int K,
                    const float *e8m0, const q8x_t *q, float *out, int64_t r0, int64_t r1, int64_t R, int64_t C,
                    int64_t T) {
    const int64_t H = C / 2, nb = C / 32, G = q->G;
#ifdef Q8_VEC
    /* a run of Q8_RUN blocks (Q8_RUN / QG groups) shares one vector of weight scales */
    q8k_t k;
    q8_consts(&k, tab8);
    const int64_t GR = Q8_RUN / QG;
    int64_t r = r0;
#if defined(Q8_VNNI) && Q8_TERMS == 2
    if (T == 1 && nb % QG == 0)
        r = q8_rows1_vnni(kind, packed, scales, e8m0, &k, q, out, r0, r1, H, nb, G);
#elif defined(Q8_ROWS1_AVX2) && !defined(Q8_NO_ROWS1)
    if (T == 1 && nb % QG == 0)
        r = q8_rows1_avx2(kind, packed, scales, e8m0, &k, q, out, r0, r1, H, nb, G);
#endif
    if (T == 1) /* four rows at a time share the activation loads; the same sums as below */
        for (; r + 4 <= r1; r += 4) {
            q8f_t acc[4];
            for (int i = 0; i < 4; i++) acc[i] = q8f_zero();
            for (int64_t g0 = 0; g0 < G; g0 += GR) {
                const int nbr = nb - g0 * QG < Q8_RUN ? (int)(nb - g0 * QG) : Q8_RUN;
                const q8f_t xs = q8f_load(q->xs + g0 * QG);
                q8f_t sc[4];
                for (int i = 0; i < 4; i++) sc[i] = q8f_mul(q8_wscale_run(kind, scales, e8m0, (r + i) * nb + g0 * QG, nbr), xs);
                for (int64_t g = g0; g < g0 + GR && g < G; g++) {
                    const int n = nb - g * QG < QG ? (int)(nb - g * QG) : QG;
                    for (int i = 0; i < 4; i++) {
                        q8u_t u;
                        if (PF && r + 4 + i < r1) DF_PREFETCH(packed + (r + 4 + i) * H + g * 64);
                        q8_unit_decode(packed + (r + i) * H + g * 64, n, &k, &u);
                        acc[i] = q8_unit_fma(acc[i], &u, sc[i], (int)(g - g0), &k, q->xe + g * Q8GB,
                                             q->xo + g * Q8GB, q->corr + g * 16);
                    }
                }
            }
            for (int i = 0; i < 4; i++) out[r + i] = q8f_sum(acc[i]);
        }
    q8f_t acc[TT];
    for (; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
            for (int64_t t = 0; t < nt; t++) acc[t] = q8f_zero();
            for (int64_t g0 = 0; g0 < G; g0 += GR) {
                const int nbr = nb - g0 * QG < Q8_RUN ? (int)(nb - g0 * QG) : Q8_RUN;
                const q8f_t ws = q8_wscale_run(kind, scales, e8m0, r * nb + g0 * QG, nbr);
                for (int64_t g = g0; g < g0 + GR && g < G; g++) {
                    const int n = nb - g * QG < QG ? (int)(nb - g * QG) : QG;
                    q8u_t u;
                    if (PF && r + 1 < r1) DF_PREFETCH(row + H + g * 64);
                    q8_unit_decode(row + g * 64, n, &k, &u);
                    for (int64_t t = 0; t < nt; t++) {
                        const int64_t v = t0 + t;
                        const q8f_t sc = q8f_mul(ws, q8f_load(q->xs + v * XS + g0 * QG));
                        acc[t] = q8_unit_fma(acc[t], &u, sc, (int)(g - g0), &k, q->xe + (v * G + g) * Q8GB,
                                             q->xo + (v * G + g) * Q8GB, q->corr + v * G * 16 + g * 16);
                    }
                }
            }
            for (int64_t t = 0; t < nt; t++) out[(t0 + t) * R + r] = q8f_sum(acc[t]);
        }
    }
#else
    int v[16];
    for (int j = 0; j < 16; j++) v[j] = (int)tab8[j] - K;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xe = q->xe + t * G * Q8GB, *xo = q->xo + t * G * Q8GB;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t off = (b / QG) * Q8GB + (b % QG) * 16;
                int32_t s1 = 0, s2 = 0;
                for (int j = 0; j < 16; j++) {
                    const uint8_t p = row[b * 16 + j];
                    s1 += v[p & 15] * xe[off + j] + v[p >> 4] * xo[off + j];
                    if (Q8_TERMS == 2) s2 += v[p & 15] * xe[off + 64 + j] + v[p >> 4] * xo[off + 64 + j];
                }
                const int32_t s = Q8_TERMS == 2 ? 256 * s1 + s2 : s1;
                sum += (float)s * (scale_at(scales, kind, e8m0, r * nb + b) * q->xs[t * XS + b]);
            }
            out[t * R + r] = sum;
        }
    }
#endif
}

/* int8 rows, one to a few tokens, with int16 activations: each token's row is quantized once per call to int16
 * per block of 128 columns (d = max|x| / 32767, q = round(x / d)), and the weights meet it in int16 x int16 ->
 * int32 (exact) with VNNI's vpdpwssd: each weight byte is sign-extended once, with no float conversion and no
 * float multiply-add per byte (one per 128 columns), a third of the float loop's vector instructions per byte.
 * The rounding, |x - d q| <= d / 2, is 256 times finer than 8-bit activations: the greedy tokens stay the
 * float loop's (8-bit activations per block of 32 measurably changed a tiny Kimi K3's choices). */
#define A16B 128 /* columns per block */

typedef struct {
    int16_t *q; /* [T, NB * 128], 0 past C */
    float *d;   /* [T, NB] */
    int64_t NB;
} i8a16_t;

static void a16_quantize(const float *x, int64_t T, int64_t C, i8a16_t *a) {
    const int64_t NB = a->NB;
    memset(a->q, 0, T * NB * A16B * sizeof(int16_t));
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < NB; b++) {
            const float *xb = x + t * C + b * A16B;
            const int n = C - b * A16B < A16B ? (int)(C - b * A16B) : A16B;
            float amax = 0.0f;
            for (int j = 0; j < n; j++) {
                const float v = xb[j] < 0 ? -xb[j] : xb[j];
                amax = v > amax || v != v ? v : amax; /* NaN wins: it reaches the scale, hence the result */
            }
            const float id = amax > 0.0f && amax <= 3.4e38f ? 32767.0f / amax : 0.0f;
            int16_t *q = a->q + (t * NB + b) * A16B;
            for (int j = 0; j < n; j++) q[j] = (int16_t)(int)nearbyintf(xb[j] * id);
            a->d[t * NB + b] = amax / 32767.0f;
        }
}

#ifndef I8PF
#define I8PF 1 /* prefetch the next rows, a row ahead */
#endif


/* The int16-activation path's vector code, one loop for both widths (i8a16_rows) over these, on the Q8 path's
 * float vectors (q8f_t): a row's block of 128 columns is loaded once (sign-extended to int16) and multiplied into
 * each token; its int32 sum is exact, then one float multiply-add per lane applies the token's block scale. */
#if defined(Q8_VNNI) && defined(__AVX512VL__)
#define A16_VEC 1
typedef struct {
    __m512i w[4]; /* 32 columns each, 0 past the row's width */
} a16w_t;
static inline void a16_wload(a16w_t *W, const int8_t *p, int64_t n) {
    for (int j = 0; j < 4; j++) {
        const int64_t left = n - 32 * j;
        const __mmask32 m = left >= 32 ? ~(__mmask32)0 : left <= 0 ? 0 : (((__mmask32)1 << left) - 1);
        W->w[j] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, p + 32 * j));
    }
}
static inline q8f_t a16_fma(q8f_t f, const a16w_t *W, const int16_t *xq, float d) {
    __m512i acc = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) acc = _mm512_dpwssd_epi32(acc, W->w[j], _mm512_loadu_si512(xq + 32 * j));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d), f);
}
#elif defined(Q8_VEC) && !defined(Q8_VNNI) && defined(__AVX2__)
/* AVX2: 16 columns a step, vpmaddwd (or AVX-VNNI's vpdpwssd) into 8 int32 lanes; the columns of a block past its
 * last whole step (a width that is not a multiple of 16) are summed in scalar code into lane 0 */
#define A16_VEC 1
typedef struct {
    __m256i w[A16B / 16];
    const int8_t *p; /* the block's bytes, for the columns past its whole steps */
    int64_t n;       /* its columns */
} a16w_t;
static inline void a16_wload(a16w_t *W, const int8_t *p, int64_t n) {
    W->p = p;
    W->n = n;
    for (int64_t j = 0; j < n / 16; j++) W->w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * j)));
}
static inline q8f_t a16_fma(q8f_t f, const a16w_t *W, const int16_t *xq, float d) {
    __m256i acc = _mm256_setzero_si256();
    const int64_t nv = W->n / 16;
    for (int64_t j = 0; j < nv; j++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 16 * j));
#ifdef __AVXVNNI__
        acc = _mm256_dpwssd_avx_epi32(acc, W->w[j], x);
#else
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(W->w[j], x));
#endif
    }
    int32_t tail = 0;
    for (int64_t c = nv * 16; c < W->n; c++) tail += (int32_t)W->p[c] * xq[c];
    acc = _mm256_add_epi32(acc, _mm256_setr_epi32(tail, 0, 0, 0, 0, 0, 0, 0));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(d), f);
}
#elif defined(DF_NEON)
/* NEON: 8 columns a step, widening int16 multiply-adds (vmlal_s16) into 4 int32 lanes (|sum| < 128 x 128 x 32767 <
 * 2^31: exact); columns past the block's last whole step are summed in scalar code into lane 0 */
#define A16_VEC 1
typedef struct {
    int16x8_t w[A16B / 8];
    const int8_t *p;
    int64_t n;
} a16w_t;
static inline void a16_wload(a16w_t *W, const int8_t *p, int64_t n) {
    W->p = p;
    W->n = n;
    for (int64_t j = 0; j < n / 8; j++) W->w[j] = vmovl_s8(vld1_s8(p + 8 * j));
}
static inline q8f_t a16_fma(q8f_t f, const a16w_t *W, const int16_t *xq, float d) {
    int32x4_t acc = vdupq_n_s32(0);
    const int64_t nv = W->n / 8;
    for (int64_t j = 0; j < nv; j++) {
        const int16x8_t x = vld1q_s16(xq + 8 * j);
        acc = vmlal_high_s16(vmlal_s16(acc, vget_low_s16(W->w[j]), vget_low_s16(x)), W->w[j], x);
    }
    int32_t tail = 0;
    for (int64_t c = nv * 8; c < W->n; c++) tail += (int32_t)W->p[c] * xq[c];
    acc = vsetq_lane_s32(vgetq_lane_s32(acc, 0) + tail, acc, 0);
    return vfmaq_n_f32(f, vcvtq_f32_s32(acc), d);
}
#endif

#if defined(Q8_VNNI) && defined(__AVX512VL__)
/* i8a16_rows' one-token loop where the rows are whole blocks (C a multiple of 128): one row at a time, start to
 * end, so a thread reads one sequential stream, which the hardware prefetcher follows (no software prefetch). A
 * block's int32 sum is exact, so summing its four products in two chains gives the same integer, and the float
 * steps are a16_fma's in its order: the result is the generic loop's, bit for bit. Four rows interleaved with a
 * software prefetch a row ahead (the generic loop) ran 8.4-10 GB/s on one Zen 4 core and 15.6-18 on two, from
 * memory; this runs 18.5 and 27, against 20 and 31 for a plain sum of the same bytes. Returns r1. */
static int64_t i8a16_rows1(const int8_t *w, const float *s, const i8a16_t *a, float *out, int64_t r0, int64_t r1,
                           int64_t C) {
    const int64_t NB = a->NB;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *row = w + r * C;
        __m512 f = _mm512_setzero_ps();
        for (int64_t b = 0; b < NB; b++) {
            const int16_t *xq = a->q + b * A16B;
            const int8_t *p = row + b * A16B;
            __m512i u = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)),
                                            _mm512_loadu_si512(xq));
            __m512i v = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32))),
                                            _mm512_loadu_si512(xq + 32));
            u = _mm512_dpwssd_epi32(u, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 64))),
                                    _mm512_loadu_si512(xq + 64));
            v = _mm512_dpwssd_epi32(v, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 96))),
                                    _mm512_loadu_si512(xq + 96));
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(u, v)), _mm512_set1_ps(a->d[b]), f);
        }
        out[r] = _mm512_reduce_add_ps(f) * s[r];
    }
    return r1;
}
#endif

#if defined(A16_VEC) && !defined(Q8_VNNI) && defined(__AVX2__) && !defined(Q8_NO_ROWS1)
/* The AVX2 form of that loop (x86 without AVX-512): one row at a time, start to end, through the four-row loop's
 * own steps (a16_wload, a16_fma: its result bit for bit) with a prefetch a kilobyte ahead in the row stream.
 * Returns r1. */
#ifndef A16_PFD
#define A16_PFD 1024
#endif
static int64_t i8a16_rows1_avx2(const int8_t *w, const float *s, const i8a16_t *a, float *out, int64_t r0,
                                int64_t r1, int64_t C) {
    const int64_t NB = a->NB;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *row = w + r * C;
        q8f_t f = q8f_zero();
        for (int64_t b = 0; b < NB; b++) {
            const int8_t *p = row + b * A16B;
            if (A16_PFD) { /* never faults */
                _mm_prefetch((const char *)(p + A16_PFD), DF_STREAM_HINT);
                _mm_prefetch((const char *)(p + A16_PFD + 64), DF_STREAM_HINT);
            }
            a16w_t W;
            a16_wload(&W, p, A16B);
            f = a16_fma(f, &W, a->q + b * A16B, a->d[b]);
        }
        out[r] = q8f_sum(f) * s[r];
    }
    return r1;
}
#define A16_ROWS1_AVX2 1
#endif

static void i8a16_rows(const int8_t *w, const float *s, const i8a16_t *a, float *out, int64_t r0, int64_t r1,
                       int64_t R, int64_t C, int64_t T) {
    const int64_t NB = a->NB;
#ifdef A16_VEC
    int64_t r = r0;
#if defined(Q8_VNNI) && defined(__AVX512VL__)
    if (T == 1 && C % A16B == 0) r = i8a16_rows1(w, s, a, out, r0, r1, C);
#elif defined(A16_ROWS1_AVX2)
    if (T == 1 && C % A16B == 0) r = i8a16_rows1_avx2(w, s, a, out, r0, r1, C);
#endif
    if (T == 1) /* four rows at a time share the activation loads; the same sums as below */
        for (; r + 4 <= r1; r += 4) {
            q8f_t f[4];
            for (int i = 0; i < 4; i++) f[i] = q8f_zero();
            for (int64_t b = 0; b < NB; b++) {
                const int64_t c0 = b * A16B, n = C - c0 < A16B ? C - c0 : A16B;
                for (int i = 0; i < 4; i++) {
                    const int8_t *p = w + (r + i) * C + c0;
                    if (I8PF && r + 4 + i < r1) {
                        DF_PREFETCH(p + 4 * C);
                        DF_PREFETCH(p + 4 * C + 64);
                    }
                    a16w_t W;
                    a16_wload(&W, p, n);
                    f[i] = a16_fma(f[i], &W, a->q + b * A16B, a->d[b]);
                }
            }
            for (int i = 0; i < 4; i++) out[r + i] = q8f_sum(f[i]) * s[r + i];
        }
    q8f_t f[TT];
    for (; r < r1; r++) {
        const int8_t *row = w + r * C;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
            for (int64_t t = 0; t < nt; t++) f[t] = q8f_zero();
            for (int64_t b = 0; b < NB; b++) {
                const int64_t c0 = b * A16B, n = C - c0 < A16B ? C - c0 : A16B;
                if (I8PF && r + 1 < r1) {
                    DF_PREFETCH(row + C + c0);
                    DF_PREFETCH(row + C + c0 + 64);
                }
                a16w_t W;
                a16_wload(&W, row + c0, n);
                for (int64_t t = 0; t < nt; t++)
                    f[t] = a16_fma(f[t], &W, a->q + ((t0 + t) * NB + b) * A16B, a->d[(t0 + t) * NB + b]);
            }
            for (int64_t t = 0; t < nt; t++) out[(t0 + t) * R + r] = q8f_sum(f[t]) * s[r];
        }
    }
#else
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *row = w + r * C;
        for (int64_t t = 0; t < T; t++) {
            float sum = 0.0f;
            for (int64_t b = 0; b < NB; b++) {
                const int16_t *xq = a->q + (t * NB + b) * A16B;
                int32_t acc = 0;
                for (int64_t c = b * A16B; c < C && c < (b + 1) * A16B; c++) acc += (int32_t)row[c] * xq[c - b * A16B];
                sum += (float)acc * a->d[t * NB + b];
            }
            out[t * R + r] = sum * s[r];
        }
    }
#endif
}

/* Rows in chunks of even count, handed to threads as they free up: on a shared machine a thread that loses
 * its core for a while does not hold the whole call back. About 8 chunks per thread. */
#define SPLIT(nthreads, R, body)                                                          \
    {                                                                                     \
        int64_t step_ = R / ((int64_t)nthreads * 8);                                      \
        step_ = step_ < 16 ? 16 : step_ + (step_ & 1);                                    \
        const int64_t n_ = (R + step_ - 1) / step_;                                       \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")            \
        for (int64_t p = 0; p < n_; p++) {                                                \
            const int64_t r0 = p * step_, r1 = r0 + step_ < R ? r0 + step_ : R;           \
            body;                                                                         \
        }                                                                                 \
    }

void df_q4_mm(int kind, const uint8_t *packed, const void *scales, const float *lut, const float *e8m0,
              const float *xe, const float *xo, float *out, int64_t R, int64_t C, int64_t T, int nthreads) {
    SPLIT(nthreads, R, q4_rows(kind, packed, scales, lut, e8m0, xe, xo, out, r0, r1, R, C, T))
}

void df_i8_mm(const int8_t *q, const float *s, const float *x, float *out, int64_t R, int64_t C, int64_t T,
              int nthreads) {
    SPLIT(nthreads, R, i8_rows(q, s, x, out, r0, r1, R, C, T))
}

void df_q4_decode(int kind, const uint8_t *packed, const void *scales, const float *lut, const float *e8m0,
                  float *w, int64_t rbase, int64_t R, int64_t C, int nthreads) {
    SPLIT(nthreads, R, q4_decode_rows(kind, packed, scales, lut, e8m0, w, rbase + r0, rbase + r1, rbase, C))
}

/* Q8 matmul (see q8_rows): x float32 [T, C] natural order; tab8 the 16 table bytes; K its offset; mult the value
 * factor. Returns 0, or -1 when the activation buffers could not be allocated. */
int df_q4q8_mm(int kind, const uint8_t *packed, const void *scales, const uint8_t *tab8, int K, float mult,
               const float *e8m0, const float *x, float *out, int64_t R, int64_t C, int64_t T, int nthreads) {
    q8x_t q;
    q.G = (C / 32 + QG - 1) / QG;
    q.xe = malloc(T * q.G * Q8GB);
    q.xo = malloc(T * q.G * Q8GB);
    q.xs = malloc(T * (((q.G + 3) / 4) * 16) * sizeof(float));
    q.corr = malloc(T * q.G * 16 * sizeof(int32_t));
    int rc = -1;
    if (q.xe && q.xo && q.xs && q.corr) {
        q8_quantize(x, T, C, K, mult, &q);
        SPLIT(nthreads, R, q8_rows(kind, packed, scales, tab8, K, e8m0, &q, out, r0, r1, R, C, T))
        rc = 0;
    }
    free(q.xe);
    free(q.xo);
    free(q.xs);
    free(q.corr);
    return rc;
}

static int q8x_alloc(q8x_t *q, int64_t T, int64_t C) {
    q->G = (C / 32 + QG - 1) / QG;
    q->xe = malloc(T * q->G * Q8GB);
    q->xo = malloc(T * q->G * Q8GB);
    q->xs = malloc(T * (((q->G + 3) / 4) * 16) * sizeof(float));
    q->corr = malloc(T * q->G * 16 * sizeof(int32_t));
    return q->xe && q->xo && q->xs && q->corr;
}

static void q8x_free(q8x_t *q) {
    free(q->xe);
    free(q->xo);
    free(q->xs);
    free(q->corr);
}

/* One gated expert of 4-bit weights for T tokens in one call: out = down(act(gate x, up x)), act a GLU_* kind
 * (glu_span), gate and up [I, D], down [D, I], all in one format (kind, tab8, K, mult as for df_q4q8_mm). x is
 * quantized once for gate and up, whose rows run in one parallel pass; the product is quantized and the down rows
 * run in a second. The same arithmetic as three df_q4q8_mm calls with the activation between them, less the host
 * round trips. Returns 0, or -1 when the buffers could not be allocated. */
int df_q4q8_glu(int act, float beta, float lbeta, int kind, const uint8_t *gp, const void *gs, const uint8_t *up,
                const void *us, const uint8_t *dp, const void *ds, const uint8_t *tab8, int K, float mult,
                const float *e8m0, const float *x, float *out, int64_t I, int64_t D, int64_t T, int nthreads) {
    q8x_t qx = {0}, qh = {0};
    float *g = malloc(T * I * sizeof(float)), *u = malloc(T * I * sizeof(float));
    int rc = -1;
    if (g && u && q8x_alloc(&qx, T, D) && q8x_alloc(&qh, T, I)) {
        q8_quantize(x, T, D, K, mult, &qx);
        SPLIT(nthreads, I, {
            q8_rows(kind, gp, gs, tab8, K, e8m0, &qx, g, r0, r1, I, D, T);
            q8_rows(kind, up, us, tab8, K, e8m0, &qx, u, r0, r1, I, D, T);
        })
        glu_span(act, beta, lbeta, g, u, g, T * I);
        q8_quantize(g, T, I, K, mult, &qh);
        SPLIT(nthreads, D, q8_rows(kind, dp, ds, tab8, K, e8m0, &qh, out, r0, r1, D, I, T))
        rc = 0;
    }
    q8x_free(&qx);
    q8x_free(&qh);
    free(g);
    free(u);
    return rc;
}

/* n gated 4-bit experts of the same shape and format, expert e on its own tokens x[e] [T[e], D] (a decode step's
 * routed experts of one layer: the same token for all, or each sequence's tokens in a batch): out[e] [T[e], D] =
 * df_q4q8_glu's result for expert e (gp[e], gs[e], ...) on x[e], bit for bit (rows are independent, so where they
 * run does not matter). One parallel region for the layer: each distinct x quantized once; then every expert's
 * gate and up rows, in pieces shared out over the threads; each expert's activation and its quantization; then
 * every expert's down rows: three barriers a layer where a call per expert had three per expert, and small
 * experts (which a call of their own runs on one thread: waking a second costs more than its half) keep every
 * core busy together. Returns 0, or -1 when buffers could not be allocated. */
int df_q4q8_glu_many(int n, int act, float beta, float lbeta, int kind, const uint8_t *const *gp,
                     const void *const *gs, const uint8_t *const *up, const void *const *us, const uint8_t *const *dp,
                     const void *const *ds, const uint8_t *tab8, int K, float mult, const float *e8m0,
                     const float *const *x, const int64_t *T, float *const *out, int64_t I, int64_t D, int nthreads) {
    int *xi = malloc(n * sizeof(int)), *first = malloc(n * sizeof(int)); /* expert e reads the xi[e]-th distinct
                                                                             input, first met at expert first[xi] */
    int64_t *off = malloc((n + 1) * sizeof(int64_t)); /* expert e's rows of g and u start at off[e] * I */
    q8x_t *qx = calloc(n, sizeof(q8x_t)), *qh = calloc(n, sizeof(q8x_t));
    int nx = 0, rc = xi && first && off && qx && qh ? 0 : -1;
    float *g = NULL, *u = NULL;
    if (rc == 0) {
        off[0] = 0;
        for (int e = 0; e < n; e++) {
            off[e + 1] = off[e] + T[e];
            xi[e] = nx;
            for (int f = 0; f < e; f++)
                if (x[f] == x[e] && T[f] == T[e]) {
                    xi[e] = xi[f];
                    break;
                }
            if (xi[e] == nx) {
                first[nx] = e;
                if (!q8x_alloc(&qx[nx++], T[e], D)) rc = -1;
            }
            if (!q8x_alloc(&qh[e], T[e], I)) rc = -1;
        }
        g = malloc(off[n] * I * sizeof(float));
        u = malloc(off[n] * I * sizeof(float));
        if (!g || !u) rc = -1;
    }
    if (rc == 0) {
        int64_t step = I * n / ((int64_t)nthreads * 8); /* pieces of rows, as SPLIT cuts one matrix */
        step = step < 16 ? 16 : step > I ? I : step + (step & 1);
        int64_t dstep = D * n / ((int64_t)nthreads * 8);
        dstep = dstep < 16 ? 16 : dstep > D ? D : dstep + (dstep & 1);
        const int64_t pi = (I + step - 1) / step, pd = (D + dstep - 1) / dstep;
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int k = 0; k < nx; k++) q8_quantize(x[first[k]], T[first[k]], D, K, mult, &qx[k]);
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < n * pi; p++) {
                const int e = (int)(p / pi);
                const int64_t r0 = p % pi * step, r1 = r0 + step < I ? r0 + step : I;
                q8_rows(kind, gp[e], gs[e], tab8, K, e8m0, &qx[xi[e]], g + off[e] * I, r0, r1, I, D, T[e]);
                q8_rows(kind, up[e], us[e], tab8, K, e8m0, &qx[xi[e]], u + off[e] * I, r0, r1, I, D, T[e]);
            }
#pragma omp for schedule(dynamic, 1)
            for (int e = 0; e < n; e++) {
                glu_span(act, beta, lbeta, g + off[e] * I, u + off[e] * I, g + off[e] * I, T[e] * I);
                q8_quantize(g + off[e] * I, T[e], I, K, mult, &qh[e]);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < n * pd; p++) {
                const int e = (int)(p / pd);
                const int64_t r0 = p % pd * dstep, r1 = r0 + dstep < D ? r0 + dstep : D;
                q8_rows(kind, dp[e], ds[e], tab8, K, e8m0, &qh[e], out[e], r0, r1, D, I, T[e]);
            }
        }
    }
    for (int e = 0; qx && qh && e < n; e++) {
        q8x_free(&qx[e]);
        q8x_free(&qh[e]);
    }
    free(qx);
    free(qh);
    free(g);
    free(u);
    free(xi);
    free(first);
    free(off);
    return rc;
}

/* int8 rows x int16 activations (see i8a16_rows): x float32 [T, C]. Returns 0, or -1 when the activation
 * buffers could not be allocated. */
int df_i8a16_mm(const int8_t *w, const float *s, const float *x, float *out, int64_t R, int64_t C, int64_t T,
                int nthreads) {
    i8a16_t a;
    a.NB = (C + A16B - 1) / A16B;
    a.q = malloc(T * a.NB * A16B * sizeof(int16_t));
    a.d = malloc(T * a.NB * sizeof(float));
    int rc = -1;
    if (a.q && a.d) {
        a16_quantize(x, T, C, &a);
        SPLIT(nthreads, R, i8a16_rows(w, s, &a, out, r0, r1, R, C, T))
        rc = 0;
    }
    free(a.q);
    free(a.d);
    return rc;
}

/* Rows [r0, r1) of a list of matrices, cut at each matrix's end. */
static void i8a16_span(int n, const int8_t *const *w, const float *const *s, float *const *out, const int64_t *R,
                       const i8a16_t *a, int64_t r0, int64_t r1, int64_t C, int64_t T) {
    int64_t base = 0;
    for (int m = 0; m < n && base < r1; base += R[m], m++) {
        const int64_t lo = r0 > base ? r0 - base : 0;
        const int64_t hi = r1 - base < R[m] ? r1 - base : R[m];
        if (lo < hi) i8a16_rows(w[m], s[m], a, out[m], lo, hi, R[m], C, T);
    }
}

/* The rows of n int8 matrices that read the same quantized x, taken as one list, in one parallel pass. A function
 * of its own, called by df_i8a16_multi and df_gqa1: the same region written inside df_gqa1 ran its q, k and v rows
 * 20-30% slower on an AVX2 Zen 3 (GCC 12), over the same inner loop; measured, the cause not found. */
__attribute__((noinline)) static void i8a16_span_all(int n, const int8_t *const *w, const float *const *s,
                                                     float *const *out, const int64_t *R, const i8a16_t *a, int64_t C,
                                                     int64_t T, int nthreads) {
    int64_t total = 0;
    for (int m = 0; m < n; m++) total += R[m];
    SPLIT(nthreads, total, i8a16_span(n, w, s, out, R, a, r0, r1, C, T))
}

/* Several int8 matrices that read the same x (attention's q, k and v): x is quantized once and the rows of all
 * of them, taken as one list, run in one parallel pass. Each matrix's rows get the arithmetic of df_i8a16_mm,
 * so the results are those of separate calls. w, s, out, R: n entries each. */
int df_i8a16_multi(int n, const int8_t *const *w, const float *const *s, float *const *out, const int64_t *R,
                   const float *x, int64_t C, int64_t T, int nthreads) {
    i8a16_t a;
    a.NB = (C + A16B - 1) / A16B;
    a.q = malloc(T * a.NB * A16B * sizeof(int16_t));
    a.d = malloc(T * a.NB * sizeof(float));
    int rc = -1;
    if (a.q && a.d) {
        a16_quantize(x, T, C, &a);
        i8a16_span_all(n, w, s, out, R, &a, C, T, nthreads);
        rc = 0;
    }
    free(a.q);
    free(a.d);
    return rc;
}

/* 1 when the int8 x int16 path has its vector (AVX-512 VNNI) code here, 0 when it runs the plain C loop. */
/* Rows [r0, r1) of df_i8a16_heads' n * R, head by head. */
static void i8a16_heads_span(const int8_t *w, int64_t ws, const float *s, int64_t ss, const i8a16_t *a, float *out,
                             int64_t r0, int64_t r1, int64_t R, int64_t C) {
    for (int64_t h = r0 / R; h * R < r1; h++) {
        const int64_t lo = r0 > h * R ? r0 - h * R : 0;
        const int64_t hi = r1 - h * R < R ? r1 - h * R : R;
        i8a16_rows(w + h * ws, s + h * ss, &a[h], out + h * R, lo, hi, R, C, 1);
    }
}

/* n int8 matrices of the same shape [R, C], each with its own one-token x (MLA's per-head absorbed projections:
 * head h's rows at w + h * ws, their scales at s + h * ss, ss = 0 for one shared scale row), out [n, R]. Each x row
 * is quantized once, then all n * R rows run in one parallel pass with df_i8a16_mm's arithmetic per row. */
int df_i8a16_heads(int n, const int8_t *w, int64_t ws, const float *s, int64_t ss, const float *x, float *out,
                   int64_t R, int64_t C, int nthreads) {
    i8a16_t *a = calloc(n, sizeof(i8a16_t));
    int rc = a ? 0 : -1;
    for (int h = 0; rc == 0 && h < n; h++) {
        a[h].NB = (C + A16B - 1) / A16B;
        a[h].q = malloc(a[h].NB * A16B * sizeof(int16_t));
        a[h].d = malloc(a[h].NB * sizeof(float));
        if (!a[h].q || !a[h].d) rc = -1;
        else a16_quantize(x + h * C, 1, C, &a[h]);
    }
    if (rc == 0) {
        const int64_t total = (int64_t)n * R;
        SPLIT(nthreads, total, i8a16_heads_span(w, ws, s, ss, a, out, r0, r1, R, C))
    }
    for (int h = 0; a && h < n; h++) {
        free(a[h].q);
        free(a[h].d);
    }
    free(a);
    return rc;
}

int df_a16_vnni(void) {
#if defined(Q8_VNNI) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

/* 1 when the Q8 path has its vector (AVX-512 VNNI) code here, 0 when it runs the plain C loop. */
int df_q8_vnni(void) {
#ifdef Q8_VNNI
    return 1;
#else
    return 0;
#endif
}

/* Which one-token loops read one row start to end in this build (1: 4-bit Q8 rows, 2: int8 rows with int16
 * activations), for tests that hold them to the four-row loops. */
int df_one_row_loops(void) {
    int m = 0;
#if (defined(Q8_VNNI) && Q8_TERMS == 2) || (defined(Q8_ROWS1_AVX2) && !defined(Q8_NO_ROWS1))
    m |= 1;
#endif
#if (defined(Q8_VNNI) && defined(__AVX512VL__)) || defined(A16_ROWS1_AVX2)
    m |= 2;
#endif
    return m;
}

/* The vector code of the one-token paths in this build, for reports: 4 AVX-512 (VNNI where the CPU has it), 3 AVX2
 * with AVX-VNNI, 2 AVX2; on arm64 NEON 7 with I8MM (USDOT), 6 with the dot-product extension (SDOT), 5 without;
 * 0 plain C loops (auto-vectorised where the compiler can). */
int df_isa(void) {
#if defined(__AVX512F__)
    return 4;
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return 3;
#elif defined(__AVX2__)
    return 2;
#elif defined(DF_NEON) && defined(__ARM_FEATURE_MATMUL_INT8)
    return 7;
#elif defined(DF_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return 6;
#elif defined(DF_NEON)
    return 5;
#else
    return 0;
#endif
}

/* The int8 terms of the Q8 path's activations in this build: 2 (x = d / 256 (256 q1 + q2)) or 1 (x = d q1). */
int df_q8_terms(void) { return Q8_TERMS; }

int df_simd_width(void) {
#ifdef __AVX512F__
    return 16;
#else
    return 1;
#endif
}

/* ======================================================================================================== */
/* Prefill GEMM for 4-bit weights (many tokens): int16 activations x exact integer weights, AVX-512 VNNI.    */
/* ======================================================================================================== */
/* Each token's activations are quantized once per call to int16 with one scale per GW_MB blocks of 32 (d = max|x|
 * / 32767 over those values, q = round(x / d): |x - d q| <= d (1/2 + 2^-7), about 2^-16 of their largest value,
 * far finer than bf16). A weight nibble n is read as v, the stored value as an integer (MXFP4 2 x E2M1 in [-12, 12];
 * INT4 n - 8; the Q8 table less its offset K), exact in int16. vpdpwssd sums int16 x int16 pairs into int32 exactly;
 * one float conversion, scale product and multiply-add (the scale step) applies weight scale x value factor x d.
 * The scale step runs once per GW_MB blocks where the weights allow it, once per block elsewhere: int8 rows (one
 * scale a row) always; MXFP4 chunks (GW_KB blocks of a panel) where, in every row, the E8M0 exponents of each GW_MB
 * blocks are within GW_GAP of each other (and none is 0 or 255): each block's values are shifted left by its
 * exponent less the smallest of its group (exact: |v| <= 12 x 2^6 = 768 in int16) and the group takes the smallest
 * exponent's scale. |sum| <= 768 x 32767 x 64 < 2^31 stays exact; its float conversion rounds past 2^24 (2^-24 of
 * it). The scale step was an eighth to a sixth of the micro-kernel's time on a core that runs two vpdpwssd a cycle
 * (AMD Zen 5); INT4 chunks (bf16 or float scales, no exact shift) and MXFP4 chunks with far exponents keep one per
 * block. The merge's shifts cost the decode about what it saves per token group: on Zen 5 it pays from about 16
 * tokens (+2% at 85, -6% at 9 on AVX-512); it is decided by the weights alone, never by T, so that a token's
 * result does not depend on the batch.
 * Layout: a panel of GW_NV x 16 rows is decoded once per call into int32 pairs
 * (element 2p in the low half, 2p + 1 in the high half), vector-major: for block b, pair p, vector j, the 16 rows'
 * pairs, so one load feeds 16 output rows while a token's pair is broadcast. Tokens are taken in groups of at most
 * GW_MR, of near-equal sizes (a lone last token would leave the dot-product units waiting on one chain), and a
 * group's activations are stored interleaved ([block][pair][token]), so the micro-kernel reads every broadcast off
 * one pointer. The micro-kernel keeps a group's tokens x GW_NV row vectors of accumulators in registers; blocks are
 * walked in GW_KB-block chunks so the panel's chunk stays in L1 across all groups. Every token's sum runs block
 * by block in the same order whatever T is or how the tokens are grouped: results do not depend on the batch.
 * Panels are handed to threads as they free up. */
#ifndef GW_MB /* blocks per activation scale and per scale step where the weights' scales allow */
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(__AVXVNNI__)
#define GW_MB 1 /* AVX2 without VNNI: two measured 4% slower (159 against 165 GFLOP/s, K3 expert at 85 tokens, Zen 5) */
#else
#define GW_MB 2 /* AVX2 + AVX-VNNI 318 against 215 GFLOP/s on the same case; AVX-512 743 against 712 */
#endif
#endif
_Static_assert(GW_MB == 1 || GW_MB == 2, "the sums' bound and GW_GAP are worked out for one or two blocks");
#define GW_GAP 6 /* the widest exponent gap inside a group: 12 x 2^6 x 32767 x 64 < 2^31 */
#if defined(__AVX2__) /* the GEMM's builds (AVX-512 and AVX2), each with its own test of MXFP4 exponents */
#define GW_I8 8         /* the kind of int8 rows with one float scale each (df_i8gw_mm), beside q4_rows' 4-bit kinds */
static int gw_mxfp4_mergeable(const uint8_t *e, int64_t r0, int64_t r1, int64_t nb, int64_t b0, int64_t b1);

/* Blocks per scale step for a chunk of the GEMM (rows [r0, r1), blocks [b0, b1), b0 a multiple of 16): GW_MB for
 * int8 rows (one scale a row) and for MXFP4 rows whose every group's exponents are within GW_GAP of each other
 * and none 0 or 255 (2^-127 and NaN keep a step of their own); 1 for INT4 (bf16 or float scales). */
static inline int gw_chunk_mb(int kind, const void *scales, int64_t r0, int64_t r1, int64_t nb, int64_t b0,
                              int64_t b1) {
    if (GW_MB == 1 || (kind != 0 && kind != GW_I8)) return 1;
    return kind == GW_I8 || gw_mxfp4_mergeable((const uint8_t *)scales, r0, r1, nb, b0, b1) ? GW_MB : 1;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define GW_VNNI 1
/* Tile shape, by measurement on a K3 matrix (3072 x 3584) at 85 tokens, one thread, builds timed in turn: 6 tokens x
 * 2 row vectors (12 int32 and 12 float accumulators in registers, 80% of the int16 peak with the chunk in L1)
 * within noise of 7 x 2, 6 x 3 and 8 x 2 (float accumulators through L1), 5-9% ahead of 5 x 2, 4 x 3 and 8 x 3;
 * 8 x 1 and 3 x 4 far behind; GW_KB 8 and 4 slower than 16. The rest of the call is the weights' decode (about a
 * tenth at 85 tokens) and one float conversion, scale product and multiply-add per 16 dot products. With the
 * broadcasts inside vpdpwssd (GW_EMB), 6, 7 and 8 tokens x 2 measured alike over a whole expert at 85 and 170. */
/* GW_EMB: the token's pair broadcast from memory inside vpdpwssd ({1to16}: one instruction and one fused load
 * where the broadcast and the dot product were two); from the intrinsics GCC 12 emits a vpbroadcastd of its own.
 * 5-9% faster over a K3 expert at 24-300 tokens on Intel (Emerald Rapids; builds timed in turn, two threads), 5-10%
 * slower on AMD (Zen 5), where native.py builds with GW_EMB=0. */
#ifndef GW_EMB
#define GW_EMB 1
#endif
#ifndef GW_NV
#define GW_NV 2 /* row vectors (16 rows each) per panel */
#endif
#ifndef GW_MR
#define GW_MR 6 /* tokens per micro-kernel (at most 8) */
#endif
#ifndef GW_KB
#define GW_KB 16 /* blocks of 32 per chunk (<= 16): 16 x 32 x GW_NV x 16 x 2 bytes = 32 KB of panel per chunk */
#endif
_Static_assert(GW_KB >= 1 && GW_KB <= 16, "a chunk's scales are one 16 x 16 transpose");
_Static_assert(GW_KB % GW_MB == 0, "chunks hold whole groups of blocks");
#define GW_ROWS (16 * GW_NV)

/* 16 x 16 int32 transpose in registers: r[a] element e -> r[e] element a. */
static inline void gw_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

typedef struct {
    __m512i tr[4]; /* dword transpose: dword l = row l's dword d, from two vectors of 4 rows x 4 dwords each */
    __m512i tab;   /* word i: the signed value v of nibble i & 15 (vpermw reads an index's low 5 bits) */
} gw_consts_t;

static void gw_consts(const uint8_t *tab8, int K, gw_consts_t *k) {
    int16_t tab[32];
    for (int i = 0; i < 32; i++) tab[i] = (int16_t)((int)tab8[i % 16] - K);
    k->tab = _mm512_loadu_si512(tab);
    for (int d = 0; d < 4; d++) {
        int32_t idx[16];
        for (int l = 0; l < 16; l++) idx[l] = (l / 4 % 2 ? 16 : 0) + 4 * (l % 4) + d;
        k->tr[d] = _mm512_loadu_si512(idx);
    }
}

/* Row r's E8M0 exponents of blocks [b0, b0 + n) (b0 even, n <= 16), a block a lane (past n: 0), and the smallest
 * of each lane's group of two (a last block of an odd count alone). */
static inline __m512i gw_exponents(const uint8_t *e, int64_t r, int64_t nb, int64_t b0, int n, __m512i *lo,
                                   __m512i *hi) {
    const __mmask16 live = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __mmask16 solo = n % 2 ? (__mmask16)(1u << (n - 1)) : 0; /* its partner lane is past n */
    const __m512i ev = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, e + r * nb + b0));
    const __m512i sw = _mm512_mask_blend_epi32(solo, _mm512_shuffle_epi32(ev, _MM_PERM_CDAB), ev);
    *lo = _mm512_min_epi32(ev, sw);
    *hi = _mm512_max_epi32(ev, sw);
    return ev;
}

/* gw_chunk_mb's test of MXFP4 rows, a row's chunk of exponents in one vector. */
static int gw_mxfp4_mergeable(const uint8_t *e, int64_t r0, int64_t r1, int64_t nb, int64_t b0, int64_t b1) {
    const int n = (int)(b1 - b0);
    const __mmask16 live = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    for (int64_t r = r0; r < r1; r++) {
        __m512i lo, hi;
        gw_exponents(e, r, nb, b0, n, &lo, &hi);
        const __mmask16 bad = _mm512_cmpeq_epi32_mask(lo, _mm512_setzero_si512()) |
                              _mm512_cmpeq_epi32_mask(hi, _mm512_set1_epi32(255)) |
                              _mm512_cmpgt_epi32_mask(_mm512_sub_epi32(hi, lo), _mm512_set1_epi32(GW_GAP));
        if (bad & live) return 0;
    }
    return 1;
}

/* One block b of rows [r, r + 16) (rows past R read as zero) -> its 16 vectors of int32 pairs, one per pair: the
 * rows' bytes transposed a dword (4 pairs) at a time, then per pair two shifts, a bitwise select and a 16-bit table
 * lookup (vpermw) give each row's two values as int16 in place. One byte transpose and a 2-source byte permute per
 * pair (vpermt2b, two cycles each here) took 36 ns a block, hot in cache; this takes 24 ns, bit for bit the same. */
static inline void gw_decode_block(const uint8_t *packed, int64_t r, int64_t R, int64_t H, int64_t b,
                                   const gw_consts_t *k, const __m512i *shv, int32_t *dst) {
    __m512i z[4];
    if (r + 16 <= R) { /* all 16 rows (every panel but a last, partial one): no per-row test, inserts in a tree */
        const uint8_t *p = packed + r * H + b * 16;
        for (int i = 0; i < 4; i++, p += 4 * H) {
            const __m256i r01 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                        _mm_loadu_si128((const __m128i *)(p + H)), 1);
            const __m256i r23 = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 2 * H))),
                _mm_loadu_si128((const __m128i *)(p + 3 * H)), 1);
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(r01), r23, 1);
        }
    } else {
        for (int i = 0; i < 4; i++) { /* z[i]: rows 4i..4i+3, one per 128-bit lane (masked broadcasts; past R: 0) */
            z[i] = _mm512_setzero_si512();
            for (int m = 0; m < 4; m++)
                if (r + 4 * i + m < R) {
                    const __m128i row = _mm_loadu_si128((const __m128i *)(packed + (r + 4 * i + m) * H + b * 16));
                    z[i] = _mm512_mask_broadcast_i32x4(z[i], (__mmask16)(0xF << (4 * m)), row);
                }
        }
    }
    const __m512i sel = _mm512_set1_epi32((int)0xFFFF0000);
    for (int d = 0; d < 4; d++) { /* x: dword l = row l's bytes 4d..4d+3, i.e. pairs 4d..4d+3 */
        const __m512i x = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(z[0], k->tr[d], z[1]),
                                                  _mm512_permutex2var_epi32(z[2], k->tr[d], z[3]));
        /* pair 4d + m is byte m: its low nibble to bits 0-3 (s1), its high nibble to bits 16-19 (s2); one bitwise
         * select puts both in one dword, and a word lookup turns each into its value (the bits above an index's
         * low 5 are not read; bit 4 is another nibble's, and the table repeats past 16) */
        const __m512i s1[4] = {x, _mm512_srli_epi32(x, 8), _mm512_srli_epi32(x, 16), _mm512_srli_epi32(x, 24)};
        const __m512i s2[4] = {_mm512_slli_epi32(x, 12), _mm512_slli_epi32(x, 4), _mm512_srli_epi32(x, 4),
                               _mm512_srli_epi32(x, 12)};
        for (int m = 0; m < 4; m++) {
            const __m512i u = _mm512_ternarylogic_epi32(sel, s2[m], s1[m], 0xCA); /* sel ? s2 : s1, bit by bit */
            const __m512i v = _mm512_permutexvar_epi16(u, k->tab);
            /* shv: each row's values shifted left by its block's place in a merged group (both words alike) */
            _mm512_storeu_si512(dst + (4 * d + m) * GW_NV * 16, shv ? _mm512_sllv_epi16(v, *shv) : v);
        }
    }
}

/* int8 rows (GW_I8): block b of rows [r, r + 16) (rows past R read as zero) -> its 16 vectors of int32 pairs, as
 * gw_decode_block's: each row's 32 bytes sign-extended to 32 int16 (16 pairs), then a 16 x 16 dword transpose. */
static inline void gw_decode_block_i8(const int8_t *q, int64_t r, int64_t R, int64_t C, int64_t b, int32_t *dst) {
    __m512i v[16];
    for (int l = 0; l < 16; l++)
        v[l] = r + l < R ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + (r + l) * C + b * 32)))
                         : _mm512_setzero_si512();
    gw_transpose16(v);
    for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * GW_NV * 16, v[p]);
}

/* Blocks [b0, b1) (at most 16) of rows [r0, r0 + GW_ROWS) -> wp (int32 pairs, the layout above, block b at b - b0)
 * and ws (float scales x value factor, [b1 - b0][GW_NV][16], 0 past R). A chunk at a time, right before its use:
 * it is written to and read from L1 (a whole panel went through L2, a fifth of the call's time). Returns the
 * blocks per scale step (gw_chunk_mb); where it is GW_MB, an MXFP4 block's values are shifted by their place in
 * their group and each block's place in ws holds its group's scale. */
static int gw_decode_chunk(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                           const gw_consts_t *k, int32_t *wp, float *ws, int64_t r0, int64_t R, int64_t C,
                           int64_t b0, int64_t b1) {
    const int64_t H = C / 2, nb = C / 32, r1 = r0 + GW_ROWS < R ? r0 + GW_ROWS : R;
    const int n = (int)(b1 - b0), mb = gw_chunk_mb(kind, scales, r0, r1, nb, b0, b1);
    const __m512 vm = _mm512_set1_ps(mult);
    if (kind == GW_I8) {
        for (int j = 0; j < GW_NV; j++) {
            const int64_t r = r0 + 16 * j;
            for (int64_t b = b0; b < b1; b++)
                gw_decode_block_i8((const int8_t *)packed, r, R, C, b, wp + ((b - b0) * 16 * GW_NV + j) * 16);
            const __mmask16 live = r >= R ? 0 : r + 16 <= R ? (__mmask16)0xFFFF : (__mmask16)((1u << (R - r)) - 1);
            const __m512 sv = _mm512_maskz_loadu_ps(live, (const float *)scales + r); /* a row's scale, every block */
            for (int bb = 0; bb < n; bb++) _mm512_storeu_ps(ws + (bb * GW_NV + j) * 16, sv);
        }
        return mb;
    }
    for (int j = 0; j < GW_NV; j++) {
        const int64_t r = r0 + 16 * j;
        __m512i v[16], sh[16]; /* 16 rows x n blocks of scales (and of shifts where merged), transposed */
        for (int l = 0; l < 16; l++) { /* rows past R are not read */
            if (r + l >= R) {
                v[l] = sh[l] = _mm512_setzero_si512();
            } else if (mb > 1) { /* a group's scale, its smallest exponent's; each block shifted by its own less it */
                __m512i lo, hi;
                const __m512i ev = gw_exponents((const uint8_t *)scales, r + l, nb, b0, n, &lo, &hi);
                sh[l] = _mm512_sub_epi32(ev, lo);
                v[l] = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 23)), vm));
            } else {
                v[l] = _mm512_castps_si512(_mm512_mul_ps(q8_wscale16(kind, scales, e8m0, (r + l) * nb + b0, n), vm));
            }
        }
        gw_transpose16(v);
        if (mb > 1) gw_transpose16(sh);
        for (int64_t b = b0; b < b1; b++) {
            int32_t *dst = wp + ((b - b0) * 16 * GW_NV + j) * 16;
            if (mb > 1) {
                const __m512i shv = _mm512_or_si512(sh[b - b0], _mm512_slli_epi32(sh[b - b0], 16)); /* both words */
                gw_decode_block(packed, r, R, H, b, k, &shv, dst);
            } else {
                gw_decode_block(packed, r, R, H, b, k, NULL, dst);
            }
        }
        for (int bb = 0; bb < n; bb++) _mm512_storeu_si512(ws + (bb * GW_NV + j) * 16, v[bb]);
    }
    return mb;
}

/* The micro-kernel's vector steps (gw_tile, shared with the AVX2 build): 16 rows a vector. */
#define GW_LANES 16
typedef __m512 gwf_t;
typedef __m512i gwi_t;
typedef __mmask16 gw_mask_t; /* a row vector's live rows */
static inline gw_mask_t gw_mask_for(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}
static inline gwf_t gwf_maskload(const float *p, gw_mask_t m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void gwf_maskstore(float *p, gw_mask_t m, gwf_t v) { _mm512_mask_storeu_ps(p, m, v); }
static inline gwi_t gwi_load(const int32_t *p) { return _mm512_loadu_si512(p); }
#if GW_EMB
typedef const int32_t *gw_x_t; /* the token's pair, broadcast inside vpdpwssd */
static inline gw_x_t gw_bcast(const int32_t *x) { return x; }
static inline gwi_t gw_dot(gwi_t a, gwi_t w, gw_x_t x) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(a) : "v"(w), "m"(*x));
    return a;
}
#else
typedef __m512i gw_x_t;
static inline gw_x_t gw_bcast(const int32_t *x) { return _mm512_set1_epi32(*x); }
static inline gwi_t gw_dot(gwi_t a, gwi_t w, gw_x_t x) { return _mm512_dpwssd_epi32(a, w, x); }
#endif
/* f + float(a) x (weight scales s x the token's scale d) */
static inline gwf_t gw_scale_add(gwf_t f, gwi_t a, gwf_t s, float d) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(d)), f);
}
#define gwf_zero _mm512_setzero_ps
#define gwi_zero _mm512_setzero_si512
#define gwf_load _mm512_loadu_ps

/* Token row x [C] -> its int16 pairs, every stride-th int32 of xp from the first (its place in its group), and
 * one scale per GW_MB blocks (the last group of an odd count: one), in each of its blocks' places, every stride-th
 * float of xs (NaN or inf in a group reaches its scale). */
static void gw_quantize(const float *x, int32_t *xp, float *xs, int64_t stride, int64_t C) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)stride));
    const int64_t nb = C / 32;
    for (int64_t b = 0; b < nb; b += GW_MB) {
        const int64_t n = nb - b < GW_MB ? nb - b : GW_MB;
        __m512 m = _mm512_setzero_ps(), z = _mm512_setzero_ps();
        for (int64_t i = 0; i < 2 * n; i++) {
            const __m512 v = _mm512_loadu_ps(x + b * 32 + 16 * i);
            m = _mm512_max_ps(m, _mm512_abs_ps(v));
            z = _mm512_add_ps(z, _mm512_sub_ps(v, v)); /* max drops NaN: x - x is 0, or NaN for NaN and inf */
        }
        const float amax = _mm512_reduce_max_ps(m), bad = _mm512_reduce_add_ps(z);
        const float d = bad != 0.0f || bad != bad ? bad : amax / 32767.0f;
        const float id = amax > 0.0f && d == d ? 32767.0f / amax : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        for (int64_t c = b; c < b + n; c++) {
            const __m512 x0 = _mm512_loadu_ps(x + c * 32), x1 = _mm512_loadu_ps(x + c * 32 + 16);
            const __m256i q0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)));
            const __m256i q1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vid)));
            _mm512_i32scatter_epi32(xp + c * 16 * stride, idx, _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1),
                                    4);
            xs[c * stride] = d;
        }
    }
}

#elif defined(__AVX2__)
/* The same GEMM on 256-bit vectors (x86 without AVX-512): 8 rows per vector, the int16 pair products summed by
 * AVX-VNNI's vpdpwssd where the CPU has it, by vpmaddwd and vpaddd (the same exact int32 sums) otherwise; 16 vector
 * registers hold a group of GW_MR tokens x GW_NV row vectors of int32 sums (the float sums go through L1). Every
 * token's sum runs block by block in the same order whatever T is, as above. */
#define GW_AVX2 1
#ifndef GW_NV
#define GW_NV 2 /* row vectors (8 rows each) per panel */
#endif
#ifndef GW_MR
#define GW_MR 4 /* tokens per micro-kernel (at most 8) */
#endif
#ifndef GW_KB
#define GW_KB 16 /* blocks of 32 per chunk: 16 x 16 pairs x GW_NV x 8 rows x 4 bytes = 16 KB of panel per chunk */
#endif
_Static_assert(GW_KB % GW_MB == 0, "chunks hold whole groups of blocks");
#define GW_ROWS (8 * GW_NV)

typedef struct {
    __m128i tab;  /* byte i: the signed value of nibble i (the Q8 table less its offset) */
    __m128i utab; /* byte i: the Q8 table itself, v + K (unsigned), for the 8-bit-activation GEMM (GW_U8) */
    int K;        /* the table's offset */
    int u8;       /* 1 where the 8-bit-activation GEMM takes these weights (see u8_mm) */
} gw_consts_t;

#define U8_QMAX 32 /* the largest weight byte the 8-bit-activation GEMM takes (its int16 bound, see u8_tile) */
static void gw_consts(const uint8_t *tab8, int K, gw_consts_t *k) {
    int8_t tab[16];
    int most = 0;
    for (int i = 0; i < 16; i++) {
        tab[i] = (int8_t)((int)tab8[i] - K);
        most = tab8[i] > most ? tab8[i] : most;
    }
    k->tab = _mm_loadu_si128((const __m128i *)tab);
    k->utab = _mm_loadu_si128((const __m128i *)tab8);
    k->K = K;
    k->u8 = most <= U8_QMAX;
}

/* 8 x 8 int32 transpose in registers: r[a] element e -> r[e] element a. */
static inline void gw_transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + j], 128-bit half h: column 4h + j of rows 4i..4i+3 */
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* Block b of rows [r, r + 8) (rows past R read as zero) -> its 16 vectors of int32 pairs at dst (one per pair,
 * GW_NV vectors apart): each row's 32 values as int16 in order (a 4-bit row's nibbles through the table, even and
 * odd interleaved; an int8 row sign-extended), then two 8 x 8 transposes. */
static inline void gw_decode_block8(int kind, const uint8_t *packed, int64_t r, int64_t R, int64_t C, int64_t b,
                                    const gw_consts_t *k, const int32_t *sh, int32_t *dst) {
    __m256i lo[8], hi[8]; /* row l: pairs 0-7 and 8-15 */
    const __m128i m15 = _mm_set1_epi8(15);
    for (int l = 0; l < 8; l++) {
        if (r + l >= R) {
            lo[l] = hi[l] = _mm256_setzero_si256();
        } else if (kind == GW_I8) {
            const int8_t *q = (const int8_t *)packed + (r + l) * C + b * 32;
            lo[l] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
            hi[l] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
        } else {
            const __m128i v = _mm_loadu_si128((const __m128i *)(packed + (r + l) * (C / 2) + b * 16));
            const __m128i e = _mm_shuffle_epi8(k->tab, _mm_and_si128(v, m15));
            const __m128i o = _mm_shuffle_epi8(k->tab, _mm_and_si128(_mm_srli_epi16(v, 4), m15));
            lo[l] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(e, o));
            hi[l] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(e, o));
            if (sh && sh[l]) { /* the row's place in a merged group */
                lo[l] = _mm256_sll_epi16(lo[l], _mm_cvtsi32_si128(sh[l]));
                hi[l] = _mm256_sll_epi16(hi[l], _mm_cvtsi32_si128(sh[l]));
            }
        }
    }
    gw_transpose8(lo);
    gw_transpose8(hi);
    for (int p = 0; p < 8; p++) {
        _mm256_storeu_si256((__m256i *)(dst + p * GW_NV * 8), lo[p]);
        _mm256_storeu_si256((__m256i *)(dst + (8 + p) * GW_NV * 8), hi[p]);
    }
}

/* gw_chunk_mb's test of MXFP4 rows, one row and group at a time. */
static int gw_mxfp4_mergeable(const uint8_t *e, int64_t r0, int64_t r1, int64_t nb, int64_t b0, int64_t b1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *er = e + r * nb;
        for (int64_t c = b0; c < b1; c += 2) {
            const int e0 = er[c], e1 = c + 1 < b1 ? er[c + 1] : e0;
            const int lo = e0 < e1 ? e0 : e1, hi = e0 < e1 ? e1 : e0;
            if (lo == 0 || hi == 255 || hi - lo > GW_GAP) return 0;
        }
    }
    return 1;
}

/* Blocks [b0, b1) of rows [r0, r0 + GW_ROWS) -> wp ([b - b0][pair][GW_NV][8] int32 pairs) and ws ([b - b0][GW_NV][8]
 * float scales x value factor, 0 past R; an int8 row's own scale in every block's place). Returns the blocks per
 * scale step, with merged MXFP4 groups shifted and scaled as the AVX-512 decode's. */
static int gw_decode_chunk(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                           const gw_consts_t *k, int32_t *wp, float *ws, int64_t r0, int64_t R, int64_t C,
                           int64_t b0, int64_t b1) {
    const int64_t nb = C / 32, r1 = r0 + GW_ROWS < R ? r0 + GW_ROWS : R;
    const int mb = gw_chunk_mb(kind, scales, r0, r1, nb, b0, b1), shift = mb > 1 && kind == 0;
    for (int j = 0; j < GW_NV; j++) {
        const int64_t r = r0 + 8 * j;
        int32_t sh[16][8], lo[16][8]; /* [block][row] where shift: the row's block less its group's smallest */
        for (int l = 0; l < 8 && shift && r + l < R; l++) { /* rows past R: neither read */
            const uint8_t *e = (const uint8_t *)scales + (r + l) * nb;
            for (int64_t c = b0; c < b1; c += 2) {
                const int e0 = e[c], e1 = c + 1 < b1 ? e[c + 1] : e0;
                const int m = e0 < e1 ? e0 : e1;
                sh[c - b0][l] = e0 - m, lo[c - b0][l] = m;
                if (c + 1 < b1) sh[c + 1 - b0][l] = e1 - m, lo[c + 1 - b0][l] = m;
            }
        }
        for (int64_t b = b0; b < b1; b++) {
            gw_decode_block8(kind, packed, r, R, C, b, k, shift ? sh[b - b0] : NULL,
                             wp + ((b - b0) * 16 * GW_NV + j) * 8);
            float *w = ws + ((b - b0) * GW_NV + j) * 8;
            for (int l = 0; l < 8; l++)
                w[l] = r + l >= R ? 0.0f
                       : kind == GW_I8 ? ((const float *)scales)[r + l]
                       : shift ? e8m0[lo[b - b0][l]] * mult
                               : scale_at(scales, kind, e8m0, (r + l) * nb + b) * mult;
        }
    }
    return mb;
}

/* The micro-kernel's vector steps: 8 rows a vector. */
#define GW_LANES 8
typedef __m256 gwf_t;
typedef __m256i gwi_t;
typedef __m256i gw_mask_t; /* a row vector's live rows: lanes of -1 */
static inline gw_mask_t gw_mask_for(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 8 ? 8 : left < 0 ? 0 : left)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline gwf_t gwf_maskload(const float *p, gw_mask_t m) { return _mm256_maskload_ps(p, m); }
static inline void gwf_maskstore(float *p, gw_mask_t m, gwf_t v) { _mm256_maskstore_ps(p, m, v); }
static inline gwi_t gwi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
typedef __m256i gw_x_t;
static inline gw_x_t gw_bcast(const int32_t *x) { return _mm256_set1_epi32(*x); }
static inline gwi_t gw_dot(gwi_t a, gwi_t w, gw_x_t x) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(a, w, x);
#else
    /* the product added as soon as it is made, in one asm: written as intrinsics, GCC regrouped the unrolled
     * block's 16 adds per accumulator and kept the products on the stack (22-125 spills per block), which held
     * the GEMM to a third of the dot-product peak */
    gwi_t t;
    __asm__("vpmaddwd %[x], %[w], %[t]\n\tvpaddd %[t], %[a], %[a]" : [a] "+x"(a), [t] "=&x"(t) : [w] "x"(w), [x] "x"(x));
    return a;
#endif
}
static inline gwf_t gw_scale_add(gwf_t f, gwi_t a, gwf_t s, float d) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s, _mm256_set1_ps(d)), f);
}
#define gwf_zero _mm256_setzero_ps
#define gwi_zero _mm256_setzero_si256
#define gwf_load _mm256_loadu_ps

/* The largest of m's lanes (each a max |x|) and, in *bad, the sum of z's (0, or NaN where a lane met NaN or inf). */
static inline float gw_reduce8(__m256 m, __m256 z, float *bad) {
    float mm[8], zz[8], amax = 0.0f, sum = 0.0f;
    _mm256_storeu_ps(mm, m);
    _mm256_storeu_ps(zz, z);
    for (int i = 0; i < 8; i++) {
        amax = mm[i] > amax ? mm[i] : amax;
        sum += zz[i];
    }
    *bad = sum;
    return amax;
}

/* Token row x [C] -> its int16 pairs, every stride-th int32 of xp from the first, and one scale per GW_MB blocks,
 * in each of its blocks' places, every stride-th float of xs: the AVX-512 quantizer's arithmetic (d = max|x| /
 * 32767 over the group; NaN or inf in a group reaches its scale). */
static void gw_quantize(const float *x, int32_t *xp, float *xs, int64_t stride, int64_t C) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int64_t nb = C / 32;
    for (int64_t b0 = 0; b0 < nb; b0 += GW_MB) {
        const int64_t n = nb - b0 < GW_MB ? nb - b0 : GW_MB;
        __m256 m = _mm256_setzero_ps(), z = _mm256_setzero_ps();
        for (int64_t i = 0; i < 4 * n; i++) {
            const __m256 v = _mm256_loadu_ps(x + b0 * 32 + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
            z = _mm256_add_ps(z, _mm256_sub_ps(v, v)); /* 0, or NaN for NaN and inf */
        }
        float bad;
        const float amax = gw_reduce8(m, z, &bad);
        const float d = bad != 0.0f || bad != bad ? bad : amax / 32767.0f;
        const float id = amax > 0.0f && d == d ? 32767.0f / amax : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int64_t b = b0; b < b0 + n; b++) {
            int32_t q[32];
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + b * 32 + 8 * i), vid));
                _mm256_storeu_si256((__m256i *)(q + 8 * i), v);
            }
            for (int p = 0; p < 16; p++) {
                const int32_t e = q[2 * p] > 32767 ? 32767 : q[2 * p] < -32768 ? -32768 : q[2 * p];
                const int32_t o = q[2 * p + 1] > 32767 ? 32767 : q[2 * p + 1] < -32768 ? -32768 : q[2 * p + 1];
                xp[(b * 16 + p) * stride] = (int32_t)((uint32_t)(uint16_t)e | ((uint32_t)(uint16_t)o << 16));
            }
            xs[b * stride] = d;
        }
    }
}
#endif

#if defined(GW_VNNI) || defined(GW_AVX2)
#define GW_VEC 1
/* Token group g of T (ng = ceil(T / GW_MR) groups whose sizes differ by at most one) starts at token gw_start. */
static inline int64_t gw_start(int64_t g, int64_t T) {
    const int64_t ng = (T + GW_MR - 1) / GW_MR;
    return g * (T / ng) + (g < T % ng ? g : T % ng);
}

/* The MR tokens of the group at t0 (xp: its int32 pairs [nb][16][MR], xs: its scales [nb][MR]) x the panel's rows,
 * blocks [b0, b1), mb blocks per scale step (1, or GW_MB where the chunk's decode merged them; a last group of an
 * odd count is one block): accumulates into out (the first chunk starts at 0). */
static inline __attribute__((always_inline)) void gw_tile(const int32_t *wp, const float *ws, const int32_t *xp,
                                                          const float *xs, float *out, int64_t t0, const int MR,
                                                          int64_t r0, const gw_mask_t *mask, int64_t b0, int64_t b1,
                                                          int64_t R, int mb) {
    gwf_t f[8][GW_NV]; /* MR <= 8 */
    for (int t = 0; t < MR; t++)
        for (int j = 0; j < GW_NV; j++)
            f[t][j] = b0 == 0 ? gwf_zero() : gwf_maskload(out + (t0 + t) * R + r0 + GW_LANES * j, mask[j]);
    for (int64_t b = b0; b < b1; b += mb) {
        gwi_t a[8][GW_NV];
        for (int t = 0; t < MR; t++)
            for (int j = 0; j < GW_NV; j++) a[t][j] = gwi_zero();
        const int64_t n = b1 - b < mb ? b1 - b : mb;
        for (int64_t c = 0; c < n; c++) { /* the pairs of block b + c follow block b + c - 1's, in wp and xp alike */
            const int32_t *w = wp + (b + c - b0) * 16 * GW_NV * GW_LANES, *x = xp + (b + c) * 16 * MR;
#pragma GCC unroll 16
            for (int p = 0; p < 16; p++) {
                gwi_t wv[GW_NV];
                for (int j = 0; j < GW_NV; j++) wv[j] = gwi_load(w + (p * GW_NV + j) * GW_LANES);
                for (int t = 0; t < MR; t++) {
                    const gw_x_t xb = gw_bcast(x + p * MR + t);
                    for (int j = 0; j < GW_NV; j++) a[t][j] = gw_dot(a[t][j], wv[j], xb);
                }
            }
        }
        gwf_t sc[GW_NV];
        for (int j = 0; j < GW_NV; j++) sc[j] = gwf_load(ws + ((b - b0) * GW_NV + j) * GW_LANES);
        for (int t = 0; t < MR; t++)
            for (int j = 0; j < GW_NV; j++) f[t][j] = gw_scale_add(f[t][j], a[t][j], sc[j], xs[b * MR + t]);
    }
    for (int t = 0; t < MR; t++)
        for (int j = 0; j < GW_NV; j++) gwf_maskstore(out + (t0 + t) * R + r0 + GW_LANES * j, mask[j], f[t][j]);
}

/* Every token of x [T, C] into the group layout (see gw_tile): tokens of group g at xq + gw_start(g) C / 2, its
 * scales at xs + gw_start(g) C / 32. Token t is row rows[t] of x where rows is given (an expert's tokens picked out
 * of the whole batch where they lie: no gathered copy), row t otherwise. Inside an OpenMP parallel region, groups
 * shared out. */
static void gw_quantize_all(const float *x, const int64_t *rows, int32_t *xq, float *xs, int64_t C, int64_t T) {
    const int64_t ng = (T + GW_MR - 1) / GW_MR;
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < ng; g++) {
        const int64_t t0 = gw_start(g, T), w = gw_start(g + 1, T) - t0;
        for (int64_t i = 0; i < w; i++)
            gw_quantize(x + (rows ? rows[t0 + i] : t0 + i) * C, xq + t0 * (C / 2) + i, xs + t0 * (C / 32) + i, w, C);
    }
}

/* A buffer of at least n bytes kept per thread across calls: fresh pages per call (large mallocs are mmapped)
 * cost a page fault each, which measured a fifth of a K3 matrix's decode. NULL when it cannot grow. n = 0
 * releases a buffer over GW_KEEP bytes (a long prompt's activations are not kept for the rest of the run). */
#define GW_KEEP (32 << 20)
static void *gw_buffer(int which, size_t n) {
    static __thread void *buf[8];
    static __thread size_t cap[8];
    if (n == 0 && cap[which] > GW_KEEP) {
        free(buf[which]);
        buf[which] = NULL;
        cap[which] = 0;
    }
    if (cap[which] < n) {
        free(buf[which]);
        cap[which] = 0;
        buf[which] = aligned_alloc(64, (n + 63) / 64 * 64);
        if (buf[which]) cap[which] = n;
    }
    return buf[which];
}

/* GW_PF: while a chunk's token groups run, each asks for its share of the next chunk's packed bytes and scales
 * (the last chunk asks for the first chunk GW_PF_NEXT panels on: the threads take panels in turn), into L2: the
 * decode's row loads otherwise wait on memory. 4-9% over a K3 gated expert at 24 and 85 tokens, alike at 300
 * (builds timed in turn, two threads). The empty volatile asm keeps the call: a function that only prefetches is
 * side-effect free to GCC, which drops calls to it whose result is unused. */
#ifndef GW_PF
#define GW_PF 1
#endif
#ifndef GW_PF_HINT
#define GW_PF_HINT _MM_HINT_T1
#endif
#ifndef GW_PF_NEXT
#define GW_PF_NEXT 2
#endif
static inline void gw_prefetch(const uint8_t *packed, const void *scales, int kind, int64_t r0, int64_t R, int64_t C,
                               int64_t b0, int64_t part, int64_t parts, int64_t rows, int64_t kb) {
    const int i8 = kind == GW_I8;
    const int64_t H = i8 ? C : C / 2, nb = C / 32, b1 = b0 + kb < nb ? b0 + kb : nb, bb = i8 ? 32 : 16;
    const int sb = kind == 0 ? 1 : kind == 2 ? 4 : 2; /* bytes per scale */
    const int64_t ra = r0 + part * rows / parts, rb = r0 + (part + 1) * rows / parts; /* rows: the panel's */
    for (int64_t r = ra; r < rb && r < R; r++) {
        const char *p = (const char *)(packed + r * H);
        for (int64_t o = b0 * bb / 64 * 64; o < b1 * bb; o += 64) _mm_prefetch(p + o, GW_PF_HINT);
        if (!i8) _mm_prefetch((const char *)scales + (r * nb + b0) * sb, GW_PF_HINT);
        __asm__ volatile("");
    }
}

static void gw_panel(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                     const gw_consts_t *k, const int32_t *xq, const float *xs, int32_t *wp, float *ws, float *out,
                     int64_t r0, int64_t R, int64_t C, int64_t T) {
    const int64_t nb = C / 32, ng = (T + GW_MR - 1) / GW_MR;
    gw_mask_t mask[GW_NV];
    for (int j = 0; j < GW_NV; j++) mask[j] = gw_mask_for(R - r0 - GW_LANES * j);
    for (int64_t b0 = 0; b0 < nb; b0 += GW_KB) {
        const int64_t b1 = b0 + GW_KB < nb ? b0 + GW_KB : nb;
        const int mb = gw_decode_chunk(kind, packed, scales, e8m0, mult, k, wp, ws, r0, R, C, b0, b1);
        for (int64_t g = 0; g < ng; g++) {
            const int64_t t0 = gw_start(g, T);
            const int32_t *xp = xq + t0 * (C / 2);
            const float *xsp = xs + t0 * nb;
#if GW_PF
            gw_prefetch(packed, scales, kind, b1 < nb ? r0 : r0 + GW_PF_NEXT * GW_ROWS, R, C, b1 < nb ? b1 : 0, g, ng,
                        GW_ROWS, GW_KB);
#endif
            switch ((gw_start(g + 1, T) - t0) * 2 + (mb > 1)) { /* GW_MR tokens at most; mb a constant in each */
#define GW_TILE(m) \
    case 2 * (m): gw_tile(wp, ws, xp, xsp, out, t0, (m) <= GW_MR ? (m) : 1, r0, mask, b0, b1, R, 1); break; \
    case 2 * (m) + 1: gw_tile(wp, ws, xp, xsp, out, t0, (m) <= GW_MR ? (m) : 1, r0, mask, b0, b1, R, GW_MB); break;
            GW_TILE(1) GW_TILE(2) GW_TILE(3) GW_TILE(4) GW_TILE(5) GW_TILE(6) GW_TILE(7) GW_TILE(8)
#undef GW_TILE
            default: break;
            }
        }
    }
}
#endif

#ifdef GW_VEC
/* This thread's decoded-panel buffers (kept across calls, see gw_buffer); *rc = -1 when one could not grow. */
static inline void gw_thread_buffers(float **ws, int32_t **wp, int *rc) {
    *ws = gw_buffer(6, GW_KB * GW_ROWS * sizeof(float));
    *wp = gw_buffer(3, GW_KB * 16 * GW_ROWS * sizeof(int32_t));
    if (!*ws || !*wp) {
#pragma omp atomic write
        *rc = -1;
    }
}

/* The start of a GEMM region, in every thread: its panel buffers (ws, wp), then its share of x's quantization
 * (token t of x is row rows[t] where rows is given) into xq and xs. */
static void gw_region_begin(const float *x, const int64_t *rows, int32_t *xq, float *xs, int64_t C, int64_t T,
                            float **ws, int32_t **wp, int *rc) {
    gw_thread_buffers(ws, wp, rc);
    gw_quantize_all(x, rows, xq, xs, C, T);
}

/* Inside a parallel region: out [T, R] = xq @ W^T for every panel of W [R, C], panels handed to threads as they
 * free up (nothing when this thread's buffers are missing: gw_thread_buffers reported it). */
static void gw_panels(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                      const gw_consts_t *k, const int32_t *xq, const float *xs, int32_t *wp, float *ws, float *out,
                      int64_t R, int64_t C, int64_t T) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < (R + GW_ROWS - 1) / GW_ROWS; p++)
        if (wp && ws) gw_panel(kind, packed, scales, e8m0, mult, k, xq, xs, wp, ws, out, p * GW_ROWS, R, C, T);
}
#endif

/* ---- The 4-bit GEMM with 8-bit activations (AVX2 without VNNI: GW_U8) ----
 * Without VNNI the int16 GEMM's pair products cost two instructions each (vpmaddwd, vpaddd) for 16 multiply-adds;
 * vpmaddubsw (u8 x s8 -> int16 sums of two products) makes 32 in one, its int16 sums added in int16 as far as
 * they cannot overflow. Each token's row is quantized as the one-token Q8 loop quantizes it (q8_quantize with
 * Q8_TERMS 1: per block of 32, d = max|x| / 127, q = round(x 127 / max|x|) in [-127, 127], |x - d q| <= d / 2), so
 * the GEMM and the Q8 loop evaluate the same integer block sums. A weight nibble n is read through the Q8 table as
 * the unsigned byte u = v + K (MXFP4 0..24, INT4 0..15); the block's sum of u q less K sum(q) (the token's
 * correction, one int32 per block) is the exact sum of v q.
 * Bounds (all exact, no saturation): a vpmaddubsw lane is u0 q0 + u1 q1, |.| <= 2 x U8_QMAX x 127 = 8128; four of
 * them (a half block, 16 values) add in int16 to |.| <= 4 x 8128 = 32512 <= 32767 (MXFP4: 24384); vpmaddwd by
 * ones widens each row's two lanes into int32 and the block's two halves and the correction add in int32 (|.| <=
 * 32 x 32 x 127 + 32 x 32 x 127 < 2^18); that sum converts to float exactly (< 2^24). Weights with a byte above
 * U8_QMAX (none of this package's tables) and int8 rows (int8 x u8 would overflow the int16 sums) keep the int16
 * GEMM. One scale step a block: f + float(s) x (weight scale x value factor x d), one rounding of the scale
 * product and one fused multiply-add, in block order for each token whatever T, the token grouping or the thread
 * count: a token's result does not depend on its batch.
 * Layout: a panel of U8_NV x 8 rows is decoded per chunk of GW_KB blocks into [block][quad][vector][row] dwords
 * (a row's 4 consecutive weight bytes), one 8 x 8 dword transpose a block and vector; a token group's activations
 * as [block][quad][token] dwords of 4 q bytes, broadcast into vpmaddubsw's signed operand, and per [block][token]
 * the scale d and the correction -K sum(q). */
#if defined(GW_AVX2) && !defined(__AVXVNNI__)
#ifndef GW_U8
/* Off by default: 1.65-1.71x the int16 GEMM and 1.19-1.26x a 512-token prefill on Zen 3, but 8-bit activations in
 * prefill dropped the fast path's teacher-forced agreement with float32 under the 99% bar on the tiny random
 * DeepSeek-V3 (0.984) and Kimi K3 (0.83) of tests/test_fast_path.py. Built with -DGW_U8=1. */
#define GW_U8 0
#endif
#else
#undef GW_U8
#define GW_U8 0
#endif

#if GW_U8
#ifndef U8_NV
#define U8_NV 2 /* row vectors (8 rows each) per panel */
#endif
#ifndef U8_MR /* tokens per micro-kernel (at most 8): 12 int16 sums, 2 weight vectors and a broadcast in registers,
               * the int32 sums through L1. On Zen 3 (one thread, interleaved) 6 ran 2-10% ahead of 3 (every sum in
               * registers) at 32 and 85 tokens, 4 within noise of 3, 8 5-15% behind */
#define U8_MR 6
#endif
#ifndef U8_KB
#define U8_KB GW_KB /* blocks of 32 per chunk: 16 x 8 quads x U8_NV x 8 rows x 4 bytes = 8 KB of panel per chunk */
#endif
#define U8_ROWS (8 * U8_NV)
_Static_assert(4 * 2 * U8_QMAX * 127 <= 32767, "a half block's int16 sums stay exact");

/* Token group g of T (ceil(T / U8_MR) groups whose sizes differ by at most one) starts at token u8_start. */
static inline int64_t u8_start(int64_t g, int64_t T) {
    const int64_t ng = (T + U8_MR - 1) / U8_MR;
    return g * (T / ng) + (g < T % ng ? g : T % ng);
}

/* Token row x [C] -> its q bytes, a dword of 4 every stride-th int32 of xp from the first ([block][quad]), and per
 * block its d every stride-th float of xs and -K sum(q) every stride-th int32 of xc: q8_quantize's arithmetic (d =
 * max|x| / 127, q = round(x x (127 / max|x|)), nearest-even as nearbyintf). NaN or inf in a block: q and the
 * correction 0, d NaN (the token's every result NaN, as the int16 GEMM's). */
static void u8_quantize(const float *x, int32_t *xp, float *xs, int32_t *xc, int64_t stride, int64_t C, int K) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* packs' dword order back to quads 0..7 */
    const int64_t nb = C / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        __m256 v[4], m = _mm256_setzero_ps(), z = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            z = _mm256_add_ps(z, _mm256_sub_ps(v[i], v[i])); /* 0, or NaN for NaN and inf */
        }
        float bad;
        const float amax = gw_reduce8(m, z, &bad);
        int32_t q[8];
        if (bad != 0.0f || bad != bad) {
            memset(q, 0, sizeof q);
            xs[b * stride] = bad != bad ? bad : NAN;
            xc[b * stride] = 0;
        } else {
            const __m256 vid = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i qi[4];
            for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid)); /* |.| <= 127 */
            const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, order));
            int32_t s8[8], sum = 0;
            _mm256_storeu_si256((__m256i *)s8, s4);
            for (int i = 0; i < 8; i++) sum += s8[i];
            xs[b * stride] = amax / 127.0f;
            xc[b * stride] = -K * sum;
        }
        for (int p = 0; p < 8; p++) xp[(b * 8 + p) * stride] = q[p];
    }
}

/* Every token of x [T, C] into the group layout (tokens of group g at xq + u8_start(g) C / 4, their scales and
 * corrections at xs and xc + u8_start(g) C / 32); token t is row rows[t] of x where rows is given. Inside an
 * OpenMP parallel region, groups shared out. */
static void u8_quantize_all(const float *x, const int64_t *rows, int32_t *xq, float *xs, int32_t *xc, int64_t C,
                            int64_t T, int K) {
    const int64_t ng = (T + U8_MR - 1) / U8_MR;
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < ng; g++) {
        const int64_t t0 = u8_start(g, T), w = u8_start(g + 1, T) - t0;
        for (int64_t i = 0; i < w; i++)
            u8_quantize(x + (rows ? rows[t0 + i] : t0 + i) * C, xq + t0 * (C / 4) + i, xs + t0 * (C / 32) + i,
                        xc + t0 * (C / 32) + i, w, C, K);
    }
}

/* Blocks [b0, b1) of rows [r0, r0 + U8_ROWS) -> wp ([b - b0][quad][U8_NV][8] dwords of 4 weight bytes u) and ws
 * ([b - b0][U8_NV][8] weight scales x value factor, 0 past R; rows past R decode as zeros). */
static void u8_decode_chunk(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                            const gw_consts_t *k, int32_t *wp, float *ws, int64_t r0, int64_t R, int64_t C,
                            int64_t b0, int64_t b1) {
    const int64_t nb = C / 32, H = C / 2;
    const __m256i m15 = _mm256_set1_epi8(15), tab = _mm256_broadcastsi128_si256(k->utab);
    for (int j = 0; j < U8_NV; j++) {
        const int64_t r = r0 + 8 * j;
        for (int64_t b = b0; b < b1; b++) {
            __m256i v[8]; /* row l's 32 bytes u in column order, then quad p of the 8 rows */
            for (int l = 0; l < 8; l += 2) { /* rows l and l + 1 in the two 128-bit halves */
                const __m128i z = _mm_setzero_si128();
                const __m128i x0 = r + l < R ? _mm_loadu_si128((const __m128i *)(packed + (r + l) * H + b * 16)) : z;
                const __m128i x1 = r + l + 1 < R ? _mm_loadu_si128((const __m128i *)(packed + (r + l + 1) * H + b * 16)) : z;
                const __m256i x = _mm256_set_m128i(x1, x0);
                const __m256i e = _mm256_shuffle_epi8(tab, _mm256_and_si256(x, m15));
                const __m256i o = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(x, 4), m15));
                const __m256i lo = _mm256_unpacklo_epi8(e, o), hi = _mm256_unpackhi_epi8(e, o); /* columns 0-15, 16-31 */
                v[l] = _mm256_permute2x128_si256(lo, hi, 0x20);
                v[l + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
            }
            gw_transpose8(v);
            int32_t *dst = wp + (b - b0) * 8 * U8_ROWS + j * 8;
            for (int p = 0; p < 8; p++) _mm256_storeu_si256((__m256i *)(dst + p * U8_ROWS), v[p]);
            float *w = ws + ((b - b0) * U8_NV + j) * 8;
            for (int l = 0; l < 8; l++) w[l] = r + l >= R ? 0.0f : scale_at(scales, kind, e8m0, (r + l) * nb + b) * mult;
        }
    }
}

/* The vpmaddubsw product of weight dword vector w and the broadcast token dword x, added in int16 to s: in asm so
 * that GCC keeps each chain as written (see gw_dot). */
static inline __m256i u8_dot(__m256i s, __m256i w, __m256i x) {
    __m256i t;
    __asm__("vpmaddubsw %[x], %[w], %[t]\n\tvpaddw %[t], %[s], %[s]" : [s] "+x"(s), [t] "=&x"(t) : [w] "x"(w), [x] "x"(x));
    return s;
}

/* The MR tokens of the group at t0 (xp: their q dwords [nb][8][MR]; xs, xc: scales and corrections [nb][MR]) x
 * the panel's rows, blocks [b0, b1): accumulates into out (the first chunk starts at 0). */
static inline __attribute__((always_inline)) void u8_tile(const int32_t *wp, const float *ws, const int32_t *xp,
                                                          const float *xs, const int32_t *xc, float *out, int64_t t0,
                                                          const int MR, int64_t r0, const gw_mask_t *mask,
                                                          int64_t b0, int64_t b1, int64_t R) {
    const __m256i ones = _mm256_set1_epi16(1);
    gwf_t f[8][U8_NV]; /* MR <= 8 */
    for (int t = 0; t < MR; t++)
        for (int j = 0; j < U8_NV; j++)
            f[t][j] = b0 == 0 ? gwf_zero() : gwf_maskload(out + (t0 + t) * R + r0 + 8 * j, mask[j]);
    for (int64_t b = b0; b < b1; b++) {
        const int32_t *w = wp + (b - b0) * 8 * U8_ROWS, *x = xp + b * 8 * MR;
        __m256i a[8][U8_NV]; /* int32: the correction, then the two halves' sums */
        for (int t = 0; t < MR; t++) {
            const __m256i c = _mm256_set1_epi32(xc[b * MR + t]);
            for (int j = 0; j < U8_NV; j++) a[t][j] = c;
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int32_t *wh = w + 4 * h * U8_ROWS, *xh = x + 4 * h * MR;
            __m256i s[8][U8_NV], wv[U8_NV]; /* s: int16, a half block's sums, |.| <= 32512 */
            for (int j = 0; j < U8_NV; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(wh + j * 8));
            for (int t = 0; t < MR; t++) {
                const __m256i xb = _mm256_set1_epi32(xh[t]);
                for (int j = 0; j < U8_NV; j++) s[t][j] = _mm256_maddubs_epi16(wv[j], xb);
            }
#pragma GCC unroll 4
            for (int p = 1; p < 4; p++) {
                for (int j = 0; j < U8_NV; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(wh + (p * U8_NV + j) * 8));
                for (int t = 0; t < MR; t++) {
                    const __m256i xb = _mm256_set1_epi32(xh[p * MR + t]);
                    for (int j = 0; j < U8_NV; j++) s[t][j] = u8_dot(s[t][j], wv[j], xb);
                }
            }
            for (int t = 0; t < MR; t++)
                for (int j = 0; j < U8_NV; j++) a[t][j] = _mm256_add_epi32(a[t][j], _mm256_madd_epi16(s[t][j], ones));
        }
        gwf_t sc[U8_NV];
        for (int j = 0; j < U8_NV; j++) sc[j] = gwf_load(ws + ((b - b0) * U8_NV + j) * 8);
        for (int t = 0; t < MR; t++)
            for (int j = 0; j < U8_NV; j++) f[t][j] = gw_scale_add(f[t][j], a[t][j], sc[j], xs[b * MR + t]);
    }
    for (int t = 0; t < MR; t++)
        for (int j = 0; j < U8_NV; j++) gwf_maskstore(out + (t0 + t) * R + r0 + 8 * j, mask[j], f[t][j]);
}

/* out [T, R] rows [r0, r0 + U8_ROWS) for the quantized tokens (xq, xs, xc as u8_quantize_all leaves them). */
static void u8_panel(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                     const gw_consts_t *k, const int32_t *xq, const float *xs, const int32_t *xc, int32_t *wp,
                     float *ws, float *out, int64_t r0, int64_t R, int64_t C, int64_t T) {
    const int64_t nb = C / 32, ng = (T + U8_MR - 1) / U8_MR;
    gw_mask_t mask[U8_NV];
    for (int j = 0; j < U8_NV; j++) mask[j] = gw_mask_for(R - r0 - 8 * j);
    for (int64_t b0 = 0; b0 < nb; b0 += U8_KB) {
        const int64_t b1 = b0 + U8_KB < nb ? b0 + U8_KB : nb;
        u8_decode_chunk(kind, packed, scales, e8m0, mult, k, wp, ws, r0, R, C, b0, b1);
        for (int64_t g = 0; g < ng; g++) {
            const int64_t t0 = u8_start(g, T);
            const int32_t *xp = xq + t0 * (C / 4);
#if GW_PF
            gw_prefetch(packed, scales, kind, b1 < nb ? r0 : r0 + GW_PF_NEXT * U8_ROWS, R, C, b1 < nb ? b1 : 0, g, ng,
                        U8_ROWS, U8_KB);
#endif
            switch (u8_start(g + 1, T) - t0) { /* U8_MR tokens at most */
#define U8_TILE(m) \
    case (m): u8_tile(wp, ws, xp, xs + t0 * nb, xc + t0 * nb, out, t0, (m) <= U8_MR ? (m) : 1, r0, mask, b0, b1, R); break;
            U8_TILE(1) U8_TILE(2) U8_TILE(3) U8_TILE(4) U8_TILE(5) U8_TILE(6) U8_TILE(7) U8_TILE(8)
#undef U8_TILE
            default: break;
            }
        }
    }
}

/* This thread's decoded-panel buffers for u8_panel (gw_buffer's slots 3 and 6, shared with the int16 GEMM's). */
static inline void u8_thread_buffers(float **ws, int32_t **wp, int *rc) {
    *ws = gw_buffer(6, U8_KB * U8_ROWS * sizeof(float));
    *wp = gw_buffer(3, U8_KB * 8 * U8_ROWS * sizeof(int32_t));
    if (!*ws || !*wp) {
#pragma omp atomic write
        *rc = -1;
    }
}

/* Inside a parallel region: out [T, R] for every panel of W [R, C], panels handed to threads as they free up. */
static void u8_panels(int kind, const uint8_t *packed, const void *scales, const float *e8m0, float mult,
                      const gw_consts_t *k, const int32_t *xq, const float *xs, const int32_t *xc, int32_t *wp,
                      float *ws, float *out, int64_t R, int64_t C, int64_t T) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < (R + U8_ROWS - 1) / U8_ROWS; p++)
        if (wp && ws) u8_panel(kind, packed, scales, e8m0, mult, k, xq, xs, xc, wp, ws, out, p * U8_ROWS, R, C, T);
}

/* The activations' buffers of a call of T tokens of width C (gw_buffer's slots 0, 1, 2); 0, or -1. */
static int u8_act_buffers(int64_t T, int64_t C, int32_t **xq, float **xs, int32_t **xc) {
    *xq = gw_buffer(0, T * (C / 4) * sizeof(int32_t));
    *xs = gw_buffer(1, T * (C / 32) * sizeof(float));
    *xc = gw_buffer(2, T * (C / 32) * sizeof(int32_t));
    return *xq && *xs && *xc ? 0 : -1;
}

/* The start of an 8-bit-activation GEMM region, in every thread: its panel buffers, then its share of x's
 * quantization (token t of x is row rows[t] where rows is given). */
static void u8_region_begin(const float *x, const int64_t *rows, int32_t *xq, float *xs, int32_t *xc, int64_t C,
                            int64_t T, int K, float **ws, int32_t **wp, int *rc) {
    u8_thread_buffers(ws, wp, rc);
    u8_quantize_all(x, rows, xq, xs, xc, C, T, K);
}

/* gw_mm through the 8-bit-activation GEMM (k->u8 set). */
static int u8_mm(int kind, const uint8_t *packed, const void *scales, const gw_consts_t *k, float mult,
                 const float *e8m0, const float *x, float *out, int64_t R, int64_t C, int64_t T, int nthreads) {
    int32_t *xq, *xc;
    float *xs;
    int rc = u8_act_buffers(T, C, &xq, &xs, &xc);
    if (rc == 0) {
#pragma omp parallel num_threads(nthreads)
        {
            float *ws;
            int32_t *wp;
            u8_region_begin(x, NULL, xq, xs, xc, C, T, k->K, &ws, &wp, &rc);
            u8_panels(kind, packed, scales, e8m0, mult, k, xq, xs, xc, wp, ws, out, R, C, T);
        }
    }
    for (int i = 0; i < 3; i++) gw_buffer(i, 0);
    return rc;
}

/* df_q4gw_glu through the 8-bit-activation GEMM (k->u8 set): the same steps, each matrix's result bit for bit that
 * of its own u8_mm call. */
static int u8_glu(int act, float beta, float lbeta, int kind, const uint8_t *gp, const void *gs, const uint8_t *upk,
                  const void *us, const uint8_t *dp, const void *ds, const gw_consts_t *k, float mult,
                  const float *e8m0, const float *x, const int64_t *rows, float *out, int64_t I, int64_t D, int64_t T,
                  int nthreads) {
    const int64_t C = D > I ? D : I, npi = (I + U8_ROWS - 1) / U8_ROWS;
    int32_t *xq, *xc;
    float *xs;
    float *g = gw_buffer(4, T * I * sizeof(float)), *u = gw_buffer(5, T * I * sizeof(float)); /* h in g */
    int rc = u8_act_buffers(T, C, &xq, &xs, &xc) == 0 && g && u ? 0 : -1;
    if (rc == 0) {
#pragma omp parallel num_threads(nthreads)
        {
            float *ws;
            int32_t *wp;
            u8_region_begin(x, rows, xq, xs, xc, D, T, k->K, &ws, &wp, &rc);
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < npi; p++) {
                const int64_t r0 = p * U8_ROWS, n = I - r0 < U8_ROWS ? I - r0 : U8_ROWS;
                if (!wp || !ws) continue;
                u8_panel(kind, gp, gs, e8m0, mult, k, xq, xs, xc, wp, ws, g, r0, I, D, T);
                u8_panel(kind, upk, us, e8m0, mult, k, xq, xs, xc, wp, ws, u, r0, I, D, T);
                for (int64_t t = 0; t < T; t++) /* h in g's place */
                    glu_span(act, beta, lbeta, g + t * I + r0, u + t * I + r0, g + t * I + r0, n);
            }
            u8_quantize_all(g, NULL, xq, xs, xc, I, T, k->K);
            u8_panels(kind, dp, ds, e8m0, mult, k, xq, xs, xc, wp, ws, out, D, I, T);
        }
    }
    for (int i = 0; i < 6; i++)
        if (i != 3) gw_buffer(i, 0);
    return rc;
}
#endif

#ifdef GW_VEC
/* y [T, R] = x [T, C] @ W^T through the GEMM for any kind it decodes (k: the 4-bit kinds' constants): x quantized,
 * then W's panels shared out, in one parallel region. Returns 0, or -1 when buffers could not be allocated. */
static int gw_mm(int kind, const uint8_t *packed, const void *scales, const gw_consts_t *k, float mult,
                 const float *e8m0, const float *x, float *out, int64_t R, int64_t C, int64_t T, int nthreads) {
#if GW_U8
    if (k->u8 && kind != GW_I8) return u8_mm(kind, packed, scales, k, mult, e8m0, x, out, R, C, T, nthreads);
#endif
    int32_t *xq = gw_buffer(0, T * (C / 2) * sizeof(int32_t));
    float *xs = gw_buffer(1, T * (C / 32) * sizeof(float));
    int rc = xq && xs ? 0 : -1;
    if (rc == 0) {
#pragma omp parallel num_threads(nthreads)
        {
            float *ws;
            int32_t *wp;
            gw_region_begin(x, NULL, xq, xs, C, T, &ws, &wp, &rc);
            gw_panels(kind, packed, scales, e8m0, mult, k, xq, xs, wp, ws, out, R, C, T);
        }
    }
    for (int i = 0; i < 2; i++) gw_buffer(i, 0);
    return rc;
}
#endif

/* y [T, R] = x [T, C] @ W^T for a 4-bit W (kind as in q4_rows; tab8 and K the Q8 table and its offset; mult the
 * value factor, 0.5 for MXFP4). Returns 0, -1 when buffers could not be allocated, -2 when this build has no
 * vector code for it (the caller takes the tiled float path). */
int df_q4gw_mm(int kind, const uint8_t *packed, const void *scales, const uint8_t *tab8, int K, float mult,
               const float *e8m0, const float *x, float *out, int64_t R, int64_t C, int64_t T, int nthreads) {
#ifdef GW_VEC
    gw_consts_t k;
    gw_consts(tab8, K, &k);
    return gw_mm(kind, packed, scales, &k, mult, e8m0, x, out, R, C, T, nthreads);
#else
    (void)kind, (void)packed, (void)scales, (void)tab8, (void)K, (void)mult, (void)e8m0, (void)x, (void)out;
    (void)R, (void)C, (void)T, (void)nthreads;
    return -2;
#endif
}

/* y [T, R] = x [T, C] @ W^T for int8 rows W = q [R, C] x s [R] (one float scale a row): df_q4gw_mm's GEMM with
 * the rows sign-extended to int16 in its decode (GW_I8) and the row's scale in every block's place. C a multiple of
 * 32. The int32 sums of a scale step (two blocks) are exact (|sum| <= 128 x 32767 x 64 < 2^31); their float
 * conversion rounds past 2^24.
 * Returns as df_q4gw_mm (-2 also where C is not whole blocks). */
int df_i8gw_mm(const int8_t *q, const float *s, const float *x, float *out, int64_t R, int64_t C, int64_t T,
               int nthreads) {
#ifdef GW_VEC
    if (C % 32) return -2;
    gw_consts_t k; /* unused by the int8 decode */
    memset(&k, 0, sizeof k);
    return gw_mm(GW_I8, (const uint8_t *)q, s, &k, 1.0f, NULL, x, out, R, C, T, nthreads);
#else
    (void)q, (void)s, (void)x, (void)out, (void)R, (void)C, (void)T, (void)nthreads;
    return -2;
#endif
}

/* One gated 4-bit expert for T tokens in one call (the GEMM's token range): out [T, D] = down(act(gate x, up x)),
 * gate and up [I, D], down [D, I] in one format (kind, tab8, K, mult as for df_q4gw_mm; act as for glu_span).
 * One parallel region: x quantized once; then per panel of GW_ROWS rows, gate's and up's rows, each with
 * df_q4gw_mm's arithmetic, and the activation of those columns right away, while they are in cache (no [T, I]
 * trip through the caller); then h quantized, and down's panels. Each matrix's result is bit for bit that of its
 * own df_q4gw_mm call, the activation that of df_glu_act. rows (NULL: x is [T, D]): token t is row rows[t] of x,
 * the expert's tokens read where they lie in the batch. Returns as df_q4gw_mm. */
int df_q4gw_glu(int act, float beta, float lbeta, int kind, const uint8_t *gp, const void *gs, const uint8_t *upk,
                const void *us, const uint8_t *dp, const void *ds, const uint8_t *tab8, int K, float mult,
                const float *e8m0, const float *x, const int64_t *rows, float *out, int64_t I, int64_t D, int64_t T,
                int nthreads) {
#ifdef GW_VEC
    gw_consts_t k;
    gw_consts(tab8, K, &k);
#if GW_U8
    if (k.u8)
        return u8_glu(act, beta, lbeta, kind, gp, gs, upk, us, dp, ds, &k, mult, e8m0, x, rows, out, I, D, T, nthreads);
#endif
    const int64_t C = D > I ? D : I, npi = (I + GW_ROWS - 1) / GW_ROWS;
    int32_t *xq = gw_buffer(0, T * (C / 2) * sizeof(int32_t)); /* x's, then h's */
    float *xs = gw_buffer(1, T * (C / 32) * sizeof(float));
    float *g = gw_buffer(4, T * I * sizeof(float)), *u = gw_buffer(5, T * I * sizeof(float)); /* h in g */
    int rc = xq && xs && g && u ? 0 : -1;
    if (rc == 0) {
#pragma omp parallel num_threads(nthreads)
        {
            float *ws;
            int32_t *wp;
            gw_region_begin(x, rows, xq, xs, D, T, &ws, &wp, &rc);
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < npi; p++) {
                const int64_t r0 = p * GW_ROWS, n = I - r0 < GW_ROWS ? I - r0 : GW_ROWS;
                if (!wp || !ws) continue;
                gw_panel(kind, gp, gs, e8m0, mult, &k, xq, xs, wp, ws, g, r0, I, D, T);
                gw_panel(kind, upk, us, e8m0, mult, &k, xq, xs, wp, ws, u, r0, I, D, T);
                for (int64_t t = 0; t < T; t++) /* h in g's place */
                    glu_span(act, beta, lbeta, g + t * I + r0, u + t * I + r0, g + t * I + r0, n);
            }
            gw_quantize_all(g, NULL, xq, xs, I, T);
            gw_panels(kind, dp, ds, e8m0, mult, &k, xq, xs, wp, ws, out, D, I, T);
        }
    }
    for (int i = 0; i < 6; i++)
        if (i != 3) gw_buffer(i, 0); /* the per-thread panel buffers (3 and 6) are small and kept */
    return rc;
#else
    (void)act, (void)beta, (void)lbeta, (void)kind, (void)gp, (void)gs, (void)upk, (void)us, (void)dp, (void)ds;
    (void)tab8, (void)K, (void)mult, (void)e8m0, (void)x, (void)rows, (void)out, (void)I, (void)D, (void)T;
    (void)nthreads;
    return -2;
#endif
}

/* Denormals flushed to zero (FTZ) and read as zero (DAZ) in the calling thread and the OpenMP team of nthreads
 * (torch's and these kernels' one runtime, so its threads are torch's and MKL's too), on = 1, or both bits cleared,
 * on = 0; on < 0 changes nothing. Returns the calling thread's setting before: 1 when both bits were set. On arm64
 * FPCR's FZ bit (inputs and results alike); elsewhere a no-op returning -1.
 * Tiny values in a long model's prefill (Kimi K3's decays, e^-100 and below, and their products) otherwise make
 * the multiply units take their slow microcoded path. */
int df_ftz(int on, int nthreads) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned bits = 0x8040; /* FTZ (bit 15) | DAZ (bit 6) */
    const int before = (_mm_getcsr() & bits) == bits;
    if (on < 0) return before;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(on ? csr | bits : csr & ~bits);
    }
    return before;
#elif defined(__aarch64__)
    const uint64_t bit = (uint64_t)1 << 24; /* FPCR.FZ: denormal inputs and results of float arithmetic are zero */
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    const int before = (fpcr & bit) != 0;
    if (on < 0) return before;
#pragma omp parallel num_threads(nthreads)
    {
        uint64_t f;
        __asm__ volatile("mrs %0, fpcr" : "=r"(f));
        f = on ? f | bit : f & ~bit;
        __asm__ volatile("msr fpcr, %0" : : "r"(f));
    }
    return before;
#else
    (void)on, (void)nthreads;
    return -1;
#endif
}

/* The GEMM's blocks per scale step for rows [r0, r1) of a matrix of nb blocks a row, over blocks [b0, b1) (b0 a
 * multiple of GW_MB): gw_chunk_mb, for tests; 1 where this build has no GEMM. */
int df_gw_merge(int kind, const void *scales, int64_t r0, int64_t r1, int64_t nb, int64_t b0, int64_t b1) {
#ifdef GW_VEC
    return gw_chunk_mb(kind, scales, r0, r1, nb, b0, b1);
#else
    (void)kind, (void)scales, (void)r0, (void)r1, (void)nb, (void)b0, (void)b1;
    return 1;
#endif
}

/* 1 when this build has OpenMP (its kernels share out over threads), 0 when it runs them on the calling thread. */
int df_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build's 4-bit GEMM takes 8-bit activations (GW_U8: AVX2 without VNNI; the Q8 loop's quantization),
 * 0 when int16 ones. */
int df_gw_u8(void) {
#if defined(GW_VEC) && GW_U8
    return 1;
#else
    return 0;
#endif
}

/* 1 when df_q4gw_mm has its vector code in this build. */
int df_q4gw_vnni(void) {
#ifdef GW_VEC
    return 1;
#else
    return 0;
#endif
}

#include <time.h>

/* The int16 dot-product peak of this machine, GOP/s (a multiply and an add each) on nthreads threads: n rounds of
 * independent dot-product chains per thread (16 on AVX-512, 12 on AVX2), the limit the GEMM's figures are printed
 * beside. The loop is written in assembly with every chain in its own register: from intrinsics, compilers kept the
 * chains in memory or copied them each round, and the probe measured the copies (0.55 of the peak on a core that
 * runs two vpdpwssd a cycle) or, with the product of the constant operands hoisted, only the adds. 0 when this
 * build has no VNNI code. */
#define GW_CHAIN16(op) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15) \
    op(16) op(17)
#define GW_CHAIN12(op) op(2, 14) op(3, 15) op(4, 14) op(5, 15) op(6, 14) op(7, 15) op(8, 14) op(9, 15) op(10, 14) \
    op(11, 15) op(12, 14) op(13, 15) /* the chain, and a scratch register for the non-VNNI product */
#define GW_ZMM_DOT(i) "vpdpwssd %%zmm1, %%zmm0, %%zmm" #i "\n\t"
#define GW_ZMM_ZERO(i) "vpxord %%zmm" #i ", %%zmm" #i ", %%zmm" #i "\n\t"
#define GW_YMM_ZERO(i, t) "vpxor %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n\t"
#ifdef __AVXVNNI__
#define GW_YMM_DOT(i, t) "%{vex%} vpdpwssd %%ymm1, %%ymm0, %%ymm" #i "\n\t"
#else
#define GW_YMM_DOT(i, t) "vpmaddwd %%ymm1, %%ymm0, %%ymm" #t "\n\tvpaddd %%ymm" #t ", %%ymm" #i ", %%ymm" #i "\n\t"
#endif

#if defined(GW_VNNI) || defined(GW_AVX2)
static void gw_peak_rounds(int64_t n) {
    const int32_t w = 0x00030001, x = 0x00020005;
    if (n <= 0) return;
#if defined(GW_VNNI)
    __asm__ volatile("vpbroadcastd %[w], %%zmm0\n\tvpbroadcastd %[x], %%zmm1\n\t" GW_CHAIN16(GW_ZMM_ZERO)
                     "1:\n\t" GW_CHAIN16(GW_ZMM_DOT) "dec %[n]\n\tjnz 1b\n\t"
                     : [n] "+r"(n)
                     : [w] "m"(w), [x] "m"(x)
                     : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                       "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17");
#elif defined(GW_AVX2)
    __asm__ volatile("vpbroadcastd %[w], %%ymm0\n\tvpbroadcastd %[x], %%ymm1\n\t" GW_CHAIN12(GW_YMM_ZERO)
                     "1:\n\t" GW_CHAIN12(GW_YMM_DOT) "dec %[n]\n\tjnz 1b\n\t"
                     : [n] "+r"(n)
                     : [w] "m"(w), [x] "m"(x)
                     : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                       "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#endif
}
#endif

double df_gw_peak(int nthreads, int64_t n) {
#if defined(GW_VNNI) || defined(GW_AVX2)
#ifdef GW_VNNI
    const double ops = 16.0 * 64; /* a round: 16 vpdpwssd of 32 multiply-adds */
#else
    const double ops = 12.0 * 32; /* 12 of 16 */
#endif
    double best = 0.0;
    for (int rep = 0; rep < 3; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
#pragma omp parallel num_threads(nthreads)
        gw_peak_rounds(n);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        const double g = (double)nthreads * (double)n * ops / dt / 1e9;
        best = g > best ? g : best;
    }
    return best;
#else
    (void)nthreads, (void)n;
    return 0.0;
#endif
}

/* ---- One decode token's attention, and the norms and rotations around it (float32) ----
 * The torch ops of a one-token step (a dozen per attention, six per norm, eight per rotation) each cost a few
 * microseconds of dispatch, about as long as their math; these do the same work in one call each. Every sum runs
 * in one fixed order (vectorised by `omp simd`, fixed at build time), so a result never depends on the thread
 * count or the batch. */

/* ---- Causal grouped-query attention of one or many queries, float32, flash-style ----
 * q [T, H, dk] at positions pos .. pos+T-1; keys / values of kv head j at k + j kstride, v + j vstride, one row of
 * dk / dv floats per position from 0; out [T, H, dv]. Query i sees key s iff s <= i and (window <= 0 or
 * i - s < window). sinks [H] or NULL: a per-head logit that joins the softmax (gpt-oss).
 * Keys go in blocks of AT_BK aligned to absolute positions; each query row keeps its own running max, sum and
 * output, updated block by block in position order, with every product summed in channel order. So a row's
 * result depends only on its query, its position and the cache: not on T, the other rows, the thread count or
 * how a prompt is split into calls. Tasks (a kv head's heads over AT_BQ positions) run in parallel; only the
 * blocks a row sees are computed (causal skipping). Returns 0, or -1 when work memory could not be had. */
#define AT_BK 64
#define AT_BQ 16


/* kt[c][i] = k[i][c] for the block's nk keys (rows of dk floats), 0 for keys nk..AT_BK-1 */
static void at_transpose(const float *k, int64_t dk, int nk, float *kt) {
    int64_t c0 = 0;
#ifdef __AVX512F__
    for (; c0 + 16 <= dk; c0 += 16)
        for (int i0 = 0; i0 + 16 <= nk; i0 += 16) { /* a 16 x 16 tile in registers */
            __m512 r[16], t[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(k + (i0 + i) * dk + c0);
            for (int i = 0; i < 8; i++) { /* pairs of rows interleaved in each 128-bit lane */
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            for (int m = 0; m < 4; m++) { /* r[4m + c]: lane L holds column 4L + c of rows 4m..4m+3 */
                r[4 * m] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], 0x44);
                r[4 * m + 1] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], 0xEE);
                r[4 * m + 2] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0x44);
                r[4 * m + 3] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0xEE);
            }
            for (int c = 0; c < 4; c++) { /* lane L of r[c], r[4+c], r[8+c], r[12+c] -> column 4L + c */
                const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
                const __m512 w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
                const __m512 w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
                float *o = kt + (c0 + c) * AT_BK + i0;
                _mm512_storeu_ps(o, _mm512_shuffle_f32x4(v0, w0, 0x88));
                _mm512_storeu_ps(o + 4 * AT_BK, _mm512_shuffle_f32x4(v0, w0, 0xDD));
                _mm512_storeu_ps(o + 8 * AT_BK, _mm512_shuffle_f32x4(v1, w1, 0x88));
                _mm512_storeu_ps(o + 12 * AT_BK, _mm512_shuffle_f32x4(v1, w1, 0xDD));
            }
        }
    const int whole = nk / 16 * 16; /* the tiles above covered keys below this in channels below c0 */
    for (int64_t c = 0; c < c0; c++)
        for (int i = whole; i < AT_BK; i++) kt[c * AT_BK + i] = i < nk ? k[i * dk + c] : 0.0f;
#endif
    for (int64_t c = c0; c < dk; c++)
        for (int i = 0; i < AT_BK; i++) kt[c * AT_BK + i] = i < nk ? k[i * dk + c] : 0.0f;
}

#ifdef __AVX512F__
/* o0 / o1 [64] = (zero ? 0 : f0 o0 / f1 o1) + sum over j < n, in order, of x0[j] / x1[j] times rows + j stride [64]:
 * the scores' and the weighted values' shared step, two rows' 64 lanes in registers */
static inline void at_rank1x2(const float *x0, const float *x1, const float *rows, int64_t stride, int64_t n,
                              float *o0, float *o1, float f0, float f1, int zero) {
    __m512 u[4], w[4];
    for (int i = 0; i < 4; i++) {
        u[i] = zero ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_set1_ps(f0), _mm512_loadu_ps(o0 + 16 * i));
        w[i] = zero ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_set1_ps(f1), _mm512_loadu_ps(o1 + 16 * i));
    }
    for (int64_t j = 0; j < n; j++) {
        const float *r = rows + j * stride;
        const __m512 y0 = _mm512_set1_ps(x0[j]), y1 = _mm512_set1_ps(x1[j]);
        for (int i = 0; i < 4; i++) {
            const __m512 rv = _mm512_loadu_ps(r + 16 * i);
            u[i] = _mm512_fmadd_ps(y0, rv, u[i]);
            w[i] = _mm512_fmadd_ps(y1, rv, w[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        _mm512_storeu_ps(o0 + 16 * i, u[i]);
        _mm512_storeu_ps(o1 + 16 * i, w[i]);
    }
}
#endif

/* s0 / s1 [AT_BK] = q0 / q1 [dk] . kt[c][AT_BK] over c in order */
static void at_scores2(const float *q0, const float *q1, const float *kt, int64_t dk, float *s0, float *s1) {
#ifdef __AVX512F__
    at_rank1x2(q0, q1, kt, AT_BK, dk, s0, s1, 0.0f, 0.0f, 1);
#else
    float a[AT_BK], b[AT_BK];
    for (int j = 0; j < AT_BK; j++) a[j] = b[j] = 0.0f;
    for (int64_t c = 0; c < dk; c++) {
        const float *kr = kt + c * AT_BK, x = q0[c], y = q1[c];
#pragma omp simd
        for (int j = 0; j < AT_BK; j++) {
            a[j] += x * kr[j];
            b[j] += y * kr[j];
        }
    }
    memcpy(s0, a, sizeof a);
    memcpy(s1, b, sizeof b);
#endif
}

/* The softmax step of one row over a block: s [AT_BK] scores (unscaled), keys [lo, hi) of the block visible.
 * Updates *m and *l; leaves p [AT_BK] (0 where hidden) and returns the factor the row's output is scaled by. */
static float at_softmax(float *s, int lo, int hi, float scale, float *m, float *l) {
    float mx = -INFINITY;
    for (int j = lo; j < hi; j++) {
        s[j] *= scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    const float mn = mx > *m ? mx : *m, alpha = *m == -INFINITY ? 0.0f : expf(*m - mn);
    for (int j = 0; j < lo; j++) s[j] = -INFINITY;
    for (int j = hi; j < AT_BK; j++) s[j] = -INFINITY;
#ifdef __AVX512F__
    const __m512 mv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < AT_BK; j += 16) {
        const __m512 p = v_exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, p);
        sum = _mm512_add_ps(sum, p);
    }
    const float tot = _mm512_reduce_add_ps(sum);
#else
    float tot = 0.0f;
    for (int j = 0; j < AT_BK; j++) {
        s[j] = j < lo || j >= hi ? 0.0f : expf(s[j] - mn);
        tot += s[j];
    }
#endif
    *l = *l * alpha + tot;
    *m = mn;
    return alpha;
}

/* o0 / o1 [dv] = o alpha + sum over keys j < nk of p[j] v[j] (rows of dv floats), keys in order */
static void at_pv2(const float *p0, const float *p1, float a0, float a1, const float *v, int nk, int64_t dv,
                   float *o0, float *o1) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 64 <= dv; c += 64) at_rank1x2(p0, p1, v + c, dv, nk, o0 + c, o1 + c, a0, a1, 0);
    for (; c < dv; c += 16) {
        const __mmask16 mk = dv - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - c)) - 1);
        __m512 u = _mm512_mul_ps(_mm512_set1_ps(a0), _mm512_maskz_loadu_ps(mk, o0 + c));
        __m512 w = _mm512_mul_ps(_mm512_set1_ps(a1), _mm512_maskz_loadu_ps(mk, o1 + c));
        for (int j = 0; j < nk; j++) {
            const __m512 vv = _mm512_maskz_loadu_ps(mk, v + j * dv + c);
            u = _mm512_fmadd_ps(_mm512_set1_ps(p0[j]), vv, u);
            w = _mm512_fmadd_ps(_mm512_set1_ps(p1[j]), vv, w);
        }
        _mm512_mask_storeu_ps(o0 + c, mk, u);
        _mm512_mask_storeu_ps(o1 + c, mk, w);
    }
#else
    for (; c < dv; c += 32) {
        const int64_t n = dv - c < 32 ? dv - c : 32;
        float u[32], w[32];
        for (int64_t i = 0; i < n; i++) {
            u[i] = o0[c + i] * a0;
            w[i] = o1[c + i] * a1;
        }
        for (int j = 0; j < nk; j++) {
            const float *vr = v + j * dv + c, x = p0[j], y = p1[j];
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                u[i] += x * vr[i];
                w[i] += y * vr[i];
            }
        }
        for (int64_t i = 0; i < n; i++) {
            o0[c + i] = u[i];
            o1[c + i] = w[i];
        }
    }
#endif
}

int df_attend_rows(const float *q, const float *k, const float *v, const float *sinks, float *out, int64_t H,
                   int64_t Hkv, int64_t T, int64_t pos, int64_t dk, int64_t dv, int64_t kstride, int64_t vstride,
                   int64_t window, float scale, int nthreads) {
    const int64_t G = H / Hkv, nqb = (T + AT_BQ - 1) / AT_BQ, ntask = Hkv * nqb, R = AT_BQ * G;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *kt = malloc(dk * AT_BK * sizeof(float)), *acc = malloc((R + 1) * dv * sizeof(float));
        float *ms = malloc((R + 1) * sizeof(float)), *ls = malloc((R + 1) * sizeof(float));
        float *sc = malloc(2 * AT_BK * sizeof(float));
        const int ok = kt && acc && ms && ls && sc;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            if (!ok) continue; /* every thread meets the loop; the call fails as a whole */
            const int64_t qb = nqb - 1 - task / Hkv, j = task % Hkv; /* the longest rows first */
            const int64_t t0 = qb * AT_BQ, t1 = t0 + AT_BQ < T ? t0 + AT_BQ : T, nr = (t1 - t0) * G;
            const float *kh = k + j * kstride, *vh = v + j * vstride;
            for (int64_t r = 0; r < nr; r++) { /* row r: position t0 + r / G, head j G + r % G */
                ms[r] = sinks ? sinks[j * G + r % G] : -INFINITY;
                ls[r] = sinks ? 1.0f : 0.0f;
                memset(acc + r * dv, 0, dv * sizeof(float));
            }
            const int64_t first = window > 0 ? pos + t0 - window + 1 : 0;
            for (int64_t kb = (first > 0 ? first : 0) / AT_BK * AT_BK; kb < pos + t1; kb += AT_BK) {
                const int nk = (int)(pos + t1 - kb < AT_BK ? pos + t1 - kb : AT_BK);
                at_transpose(kh + kb * dk, dk, nk, kt);
                for (int64_t r = 0; r < nr; r += 2) {
                    const int64_t r1 = r + 1 < nr ? r + 1 : nr; /* the last odd row pairs with a spare */
                    int lo[2], hi[2];
                    for (int e = 0; e < 2; e++) {
                        const int64_t ip = pos + t0 + (e ? r1 : r) / G; /* the row's position */
                        const int64_t a = window > 0 ? ip - window + 1 - kb : -kb, b = ip + 1 - kb;
                        lo[e] = (int)(a < 0 ? 0 : a > AT_BK ? AT_BK : a);
                        hi[e] = (int)(b < 0 ? 0 : b > nk ? nk : b);
                    }
                    if (lo[0] >= hi[0] && (r1 == nr || lo[1] >= hi[1])) continue;
                    const int64_t h0 = j * G + r % G, h1 = j * G + r1 % G;
                    const float *q0 = q + ((t0 + r / G) * H + h0) * dk;
                    const float *q1 = r1 < nr ? q + ((t0 + r1 / G) * H + h1) * dk : q0;
                    float *s0 = sc, *s1 = sc + AT_BK, al[2] = {1.0f, 1.0f};
                    at_scores2(q0, q1, kt, dk, s0, s1);
                    for (int e = 0; e < 2; e++) {
                        float *s = e ? s1 : s0;
                        const int64_t row = e ? r1 : r;
                        if (lo[e] < hi[e] && row < nr)
                            al[e] = at_softmax(s, lo[e], hi[e], scale, ms + row, ls + row);
                        else
                            memset(s, 0, AT_BK * sizeof(float)); /* nothing seen here: the row is left as is */
                    }
                    const int nkb = hi[0] > hi[1] ? hi[0] : hi[1];
                    at_pv2(s0, s1, al[0], al[1], vh + kb * dv, nkb, dv, acc + r * dv, acc + r1 * dv);
                }
            }
            for (int64_t r = 0; r < nr; r++) {
                const float inv = 1.0f / ls[r], *a = acc + r * dv;
                float *o = out + ((t0 + r / G) * H + j * G + r % G) * dv;
                for (int64_t c = 0; c < dv; c++) o[c] = a[c] * inv;
            }
        }
        free(kt);
        free(acc);
        free(ms);
        free(ls);
        free(sc);
    }
    return failed ? -1 : 0;
}

/* rows [n, d] -> out (may be x): w * x / sqrt(mean(x^2) + eps) */
void df_rms_rows(const float *x, const float *w, float *out, int64_t n, int64_t d, float eps) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * d;
        float *yr = out + r * d, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < d; c++) ss += xr[c] * xr[c];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int64_t c = 0; c < d; c++) yr[c] = w[c] * (xr[c] * inv);
    }
}

/* In place: heads [n, d] of one token, the first r channels rotated in halves (i, i + r/2) by cos / sin [r/2]
 * (GPT-NeoX's form), the rest left */
void df_rope1(float *x, const float *cs, const float *sn, int64_t n, int64_t d, int64_t r) {
    const int64_t h = r / 2;
    for (int64_t i = 0; i < n; i++) {
        float *a = x + i * d, *b = a + h;
#pragma omp simd
        for (int64_t c = 0; c < h; c++) {
            const float x1 = a[c], x2 = b[c];
            a[c] = x1 * cs[c] - x2 * sn[c];
            b[c] = x2 * cs[c] + x1 * sn[c];
        }
    }
}

/* ---- One decode token's whole GQA attention block in one call (float32) ----
 * out = x + o_proj(attend(rope(norm(q)), rope(norm(k)), v)) for q, k, v = int8 rows of rms(x, ln1) (+ biases): the
 * steps, kernels and order of the separate calls (df_rms_rows, df_i8a16_multi, df_rope1, df_attend_rows, df_i8a16_mm
 * and the adds between them), so the result is theirs bit for bit; what goes is a dozen host round trips a layer.
 * L: the layer's table (DF_GQA_* below, pointers and sizes as int64, 0 for an absent bias or norm). k and v of the
 * token are written at position pos of the head-major caches kc / vc (heads kstride / vstride floats apart); the
 * token attends over positions k0 .. pos. cs / sn: the token's rotation [r / 2]. nt: threads for q/k/v, the
 * attention and o. Returns 0, or -1 when the work buffers could not be allocated. */
enum { DF_GQA_D, DF_GQA_H, DF_GQA_HKV, DF_GQA_HD, DF_GQA_R, DF_GQA_LN, DF_GQA_WQ, DF_GQA_SQ, DF_GQA_WK, DF_GQA_SK,
       DF_GQA_WV, DF_GQA_SV, DF_GQA_BQ, DF_GQA_BK, DF_GQA_BV, DF_GQA_QN, DF_GQA_KN, DF_GQA_WO, DF_GQA_SO, DF_GQA_BO,
       DF_GQA_N };

int df_gqa1(const int64_t *L, const float *x, float *out, float eps, float scale, int64_t pos, const float *cs,
            const float *sn, float *kc, float *vc, int64_t kstride, int64_t vstride, int64_t k0, int nt_qkv,
            int nt_attn, int nt_o) {
#define P_(i, type) ((type)(intptr_t)L[i])
    const int64_t D = L[DF_GQA_D], H = L[DF_GQA_H], Hkv = L[DF_GQA_HKV], d = L[DF_GQA_HD], r = L[DF_GQA_R];
    const int64_t nq = H * d, nkv = Hkv * d;
    float *h = malloc(D * sizeof(float)), *qkv = malloc((nq + 2 * nkv) * sizeof(float));
    float *att = malloc(nq * sizeof(float));
    i8a16_t a = {0}, b = {0};
    a.NB = (D + A16B - 1) / A16B;
    b.NB = (nq + A16B - 1) / A16B;
    a.q = malloc(a.NB * A16B * sizeof(int16_t));
    a.d = malloc(a.NB * sizeof(float));
    b.q = malloc(b.NB * A16B * sizeof(int16_t));
    b.d = malloc(b.NB * sizeof(float));
    int rc = -1;
    if (h && qkv && att && a.q && a.d && b.q && b.d) {
        df_rms_rows(x, P_(DF_GQA_LN, const float *), h, 1, D, eps);
        a16_quantize(h, 1, D, &a);
        const int8_t *w[3] = {P_(DF_GQA_WQ, const int8_t *), P_(DF_GQA_WK, const int8_t *), P_(DF_GQA_WV, const int8_t *)};
        const float *sc[3] = {P_(DF_GQA_SQ, const float *), P_(DF_GQA_SK, const float *), P_(DF_GQA_SV, const float *)};
        float *o3[3] = {qkv, qkv + nq, qkv + nq + nkv};
        const int64_t R3[3] = {nq, nkv, nkv};
        i8a16_span_all(3, w, sc, o3, R3, &a, D, 1, nt_qkv);
        for (int m = 0; m < 3; m++) {
            const float *bias = P_(DF_GQA_BQ + m, const float *);
            if (bias)
                for (int64_t i = 0; i < R3[m]; i++) o3[m][i] = o3[m][i] + bias[i];
        }
        float *q = o3[0], *k = o3[1], *v = o3[2];
        if (L[DF_GQA_QN]) df_rms_rows(q, P_(DF_GQA_QN, const float *), q, H, d, eps);
        if (L[DF_GQA_KN]) df_rms_rows(k, P_(DF_GQA_KN, const float *), k, Hkv, d, eps);
        if (r > 0) {
            df_rope1(q, cs, sn, H, d, r);
            df_rope1(k, cs, sn, Hkv, d, r);
        }
        for (int64_t j = 0; j < Hkv; j++) {
            memcpy(kc + j * kstride + pos * d, k + j * d, d * sizeof(float));
            memcpy(vc + j * vstride + pos * d, v + j * d, d * sizeof(float));
        }
        /* keys k0 .. pos: a window of pos + 1 - k0 where k0 > 0 (the keys' blocks stay aligned to positions) */
        if (df_attend_rows(q, kc, vc, NULL, att, H, Hkv, 1, pos, d, d, kstride, vstride, k0 > 0 ? pos + 1 - k0 : 0,
                           scale, nt_attn))
            goto done;
        a16_quantize(att, 1, nq, &b);
        float *o = h; /* h is spent: o [D] takes its place */
        const float *so = P_(DF_GQA_SO, const float *), *bo = P_(DF_GQA_BO, const float *);
        const int8_t *wo = P_(DF_GQA_WO, const int8_t *);
        {
            const int nthreads = nt_o;
            SPLIT(nthreads, D, i8a16_rows(wo, so, &b, o, r0, r1, D, nq, 1))
        }
        for (int64_t i = 0; i < D; i++) out[i] = x[i] + (bo ? o[i] + bo[i] : o[i]);
        rc = 0;
    }
done:
#undef P_
    free(h);
    free(qkv);
    free(att);
    free(a.q);
    free(a.d);
    free(b.q);
    free(b.d);
    return rc;
}

int df_gqa_table_size(void) { return DF_GQA_N; }

/* ---- One decode token's MoE routing and the sum of its experts (float32) ----
 * df_route1: h = rms(x, ln) [D]; logits = W h for a float32 router W [E, D] (rows over nthreads, each row's sum in
 * one fixed order); softmax over the E logits (the largest taken off, expf, summed in expert order); the k largest
 * probabilities, descending, a tie to the lower expert; renorm: divided by their sum. ids [k] int64, w [k].
 * df_moe_sum1: out = x + sum over slots s (in slot order) of w[s] * y[s], y [k, D]: every product lands in its slot
 * whatever order the experts were computed in, so the result does not depend on it. */
int df_route1(const float *x, const float *ln, float eps, const float *W, int64_t E, int64_t D, int64_t k, int renorm,
              float *h, int64_t *ids, float *w, int nthreads) {
    float *p = malloc(E * sizeof(float));
    if (!p || k > E) {
        free(p);
        return -1;
    }
    df_rms_rows(x, ln, h, 1, D, eps);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t e = 0; e < E; e++) {
        const float *row = W + e * D;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < D; c++) acc += row[c] * h[c];
        p[e] = acc;
    }
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; e++) p[e] *= inv;
    float total = 0.0f;
    for (int64_t s = 0; s < k; s++) { /* k passes: k is a handful */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
        if (best < 0) { /* NaN logits: the caller's torch form says what they give */
            free(p);
            return -1;
        }
        ids[s] = best;
        w[s] = p[best];
        total += p[best];
        p[best] = -1.0f; /* taken */
    }
    if (renorm)
        for (int64_t s = 0; s < k; s++) w[s] = w[s] / total;
    free(p);
    return 0;
}

void df_moe_sum1(const float *x, const float *y, const float *w, int64_t k, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c++) out[c] = 0.0f;
    for (int64_t s = 0; s < k; s++) {
        const float ws = w[s], *ys = y + s * D;
#pragma omp simd
        for (int64_t c = 0; c < D; c++) out[c] += ws * ys[c];
    }
#pragma omp simd
    for (int64_t c = 0; c < D; c++) out[c] = x[c] + out[c];
}
