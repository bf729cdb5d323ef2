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
#ifdef __AVX512F__
#include <immintrin.h>
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

/* Q8 path for 4-bit weights, one to a few tokens: each token's row is quantized once per call to int8 with one
 * float scale per block of 32 (d = max|x| / 127, q = round(x / d)), and the block dot products run in int8 x int8
 * -> int32 (exact), then float(sum) * weight scale * d accumulates in float32. The weight nibble n goes through a
 * table tab[n] = v + K, v the stored value as an integer (MXFP4: twice the E2M1 value, 0..12 with sign, K = 12;
 * INT4: n - 8, K = 8), so the weight side is unsigned as VNNI's vpdpbusd wants, and K * sum(q) is taken off
 * once per token (it does not depend on the row). The factor that maps v back (0.5 for MXFP4) is folded into d.
 * Per token, a group of 4 blocks is laid out as one 512-bit vector of even columns and one of odd columns (the
 * low and high nibbles of the group's 64 packed bytes), corr holding -K * sum(q) for each int32 lane. */
#define QG 4 /* blocks per group */
#define XS (((q->G + 3) / 4) * 16) /* a token's xs stride: whole runs of 4 groups */

typedef struct {
    int8_t *xe, *xo; /* [T, G * 64] */
    float *xs;       /* [T, XS] block scales times the value factor, 0 in padding */
    int32_t *corr;   /* [T, G * 16] */
    int64_t G;
} q8x_t;

static void q8_quantize(const float *x, int64_t T, int64_t C, int K, float mult, q8x_t *q) {
    const int64_t nb = C / 32, G = q->G;
    memset(q->xe, 0, T * G * 64);
    memset(q->xo, 0, T * G * 64);
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
            const int64_t g = b / QG, lane0 = (b % QG) * 4;
            int8_t *pe = q->xe + t * G * 64 + g * 64 + (b % QG) * 16, *po = q->xo + t * G * 64 + g * 64 + (b % QG) * 16;
            int32_t *corr = q->corr + t * G * 16 + g * 16 + lane0;
            for (int j = 0; j < 16; j++) {
                const int qe = (int)nearbyintf(xb[2 * j] * id), qo = (int)nearbyintf(xb[2 * j + 1] * id);
                pe[j] = (int8_t)qe;
                po[j] = (int8_t)qo;
                corr[j / 4] -= K * (qe + qo);
            }
            q->xs[t * XS + b] = d * mult;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_VNNI 1
/* Software prefetch of the next rows, a row ahead: measured 1.5x on a K3 expert read from memory (the
 * hardware prefetcher alone left the one-token loop waiting on memory). */
#ifndef PF
#define PF 1
#endif
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
    __m512i s = _mm512_loadu_si512(corr);
    s = _mm512_dpbusd_epi32(s, lo, _mm512_loadu_si512(xe));
    s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(xo));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(spread, sc16), acc);
}

/* The group's 64 packed bytes -> table values of the even (lo) and odd (hi) columns, block j in 128-bit lane j. */
static inline void q8_decode(const uint8_t *w, __mmask64 m, __m512i tab, __m512i *lo, __m512i *hi) {
    const __m512i v = _mm512_maskz_loadu_epi8(m, w), m15 = _mm512_set1_epi8(15);
    *lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m15));
    *hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
}
#endif

static void q8_rows(int kind, const uint8_t *packed, const void *scales, const uint8_t *tab8, int K,
                    const float *e8m0, const q8x_t *q, float *out, int64_t r0, int64_t r1, int64_t R, int64_t C,
                    int64_t T) {
    const int64_t H = C / 2, nb = C / 32, G = q->G;
#ifdef Q8_VNNI
    const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)tab8));
    __m512i spread[4];
    for (int j = 0; j < 4; j++) spread[j] = _mm512_add_epi32(_mm512_set1_epi32(4 * j),
                                                   _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
    int64_t r = r0;
    if (T == 1) /* four rows at a time share the activation loads */
        for (; r + 4 <= r1; r += 4) {
            __m512 acc[4];
            for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                const int nb16 = nb - g0 * QG < 16 ? (int)(nb - g0 * QG) : 16;
                const __m512 xs = _mm512_loadu_ps(q->xs + g0 * 4);
                __m512 sc[4];
                for (int i = 0; i < 4; i++)
                    sc[i] = _mm512_mul_ps(q8_wscale16(kind, scales, e8m0, (r + i) * nb + g0 * QG, nb16), xs);
                for (int64_t g = g0; g < g0 + 4 && g < G; g++) {
                    const int n = nb - g * QG < QG ? (int)(nb - g * QG) : QG;
                    const __mmask64 m = n == QG ? ~(__mmask64)0 : (((__mmask64)1 << (16 * n)) - 1);
                    for (int i = 0; i < 4; i++) {
                        __m512i lo, hi;
                        if (PF && r + 4 + i < r1) _mm_prefetch((const char *)(packed + (r + 4 + i) * H + g * 64), _MM_HINT_T0);
                        q8_decode(packed + (r + i) * H + g * 64, m, tab, &lo, &hi);
                        acc[i] = q8_group(lo, hi, sc[i], spread[g - g0], q->xe + g * 64, q->xo + g * 64,
                                          q->corr + g * 16, acc[i]);
                    }
                }
            }
            for (int i = 0; i < 4; i++) out[r + i] = _mm512_reduce_add_ps(acc[i]);
        }
    __m512 acc[TT];
    for (; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
            for (int64_t t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                const int nb16 = nb - g0 * QG < 16 ? (int)(nb - g0 * QG) : 16;
                const __m512 ws = q8_wscale16(kind, scales, e8m0, r * nb + g0 * QG, nb16);
                for (int64_t g = g0; g < g0 + 4 && g < G; g++) {
                    const int n = nb - g * QG < QG ? (int)(nb - g * QG) : QG;
                    const __mmask64 m = n == QG ? ~(__mmask64)0 : (((__mmask64)1 << (16 * n)) - 1);
                    __m512i lo, hi;
                    if (PF && r + 1 < r1) _mm_prefetch((const char *)(row + H + g * 64), _MM_HINT_T0);
                    q8_decode(row + g * 64, m, tab, &lo, &hi);
                    for (int64_t t = 0; t < nt; t++) {
                        const int64_t u = t0 + t;
                        const __m512 sc = _mm512_mul_ps(ws, _mm512_loadu_ps(q->xs + u * XS + g0 * 4));
                        acc[t] = q8_group(lo, hi, sc, spread[g - g0], q->xe + u * G * 64 + g * 64,
                                          q->xo + u * G * 64 + g * 64, q->corr + u * G * 16 + g * 16, acc[t]);
                    }
                }
            }
            for (int64_t t = 0; t < nt; t++) out[(t0 + t) * R + r] = _mm512_reduce_add_ps(acc[t]);
        }
    }
#else
    int v[16];
    for (int j = 0; j < 16; j++) v[j] = (int)tab8[j] - K;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = packed + r * H;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xe = q->xe + t * G * 64, *xo = q->xo + t * G * 64;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t off = (b / QG) * 64 + (b % QG) * 16;
                int32_t s = 0;
                for (int j = 0; j < 16; j++) {
                    const uint8_t p = row[b * 16 + j];
                    s += v[p & 15] * xe[off + j] + v[p >> 4] * xo[off + j];
                }
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

static void i8a16_rows(const int8_t *w, const float *s, const i8a16_t *a, float *out, int64_t r0, int64_t r1,
                       int64_t R, int64_t C, int64_t T) {
    const int64_t NB = a->NB;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* the 4 masks of a block's 32-column steps: full, or the columns left in the last block */
    __mmask32 last[4];
    for (int j = 0; j < 4; j++) {
        const int64_t n = C - (NB - 1) * A16B - j * 32;
        last[j] = n >= 32 ? ~(__mmask32)0 : n <= 0 ? 0 : (((__mmask32)1 << n) - 1);
    }
    const __mmask32 full[4] = {~(__mmask32)0, ~(__mmask32)0, ~(__mmask32)0, ~(__mmask32)0};
    int64_t r = r0;
    if (T == 1) /* four rows at a time share the activation loads; the same sums as below */
        for (; r + 4 <= r1; r += 4) {
            __m512 f[4];
            for (int i = 0; i < 4; i++) f[i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < NB; b++) {
                const __mmask32 *m = b + 1 < NB ? full : last;
                const int16_t *xq = a->q + b * A16B;
                const __m512 dv = _mm512_set1_ps(a->d[b]);
                for (int i = 0; i < 4; i++) {
                    const int8_t *p = w + (r + i) * C + b * A16B;
                    if (I8PF && r + 4 + i < r1) {
                        _mm_prefetch((const char *)(p + 4 * C), _MM_HINT_T0);
                        _mm_prefetch((const char *)(p + 4 * C + 64), _MM_HINT_T0);
                    }
                    __m512i acc = _mm512_setzero_si512();
                    for (int j = 0; j < 4; j++)
                        acc = _mm512_dpwssd_epi32(acc, _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m[j], p + 32 * j)),
                                                  _mm512_loadu_si512(xq + 32 * j));
                    f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dv, f[i]);
                }
            }
            for (int i = 0; i < 4; i++) out[r + i] = _mm512_reduce_add_ps(f[i]) * s[r + i];
        }
    __m512 f[TT];
    for (; r < r1; r++) {
        const int8_t *row = w + r * C;
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t nt = T - t0 < TT ? T - t0 : TT;
            for (int64_t t = 0; t < nt; t++) f[t] = _mm512_setzero_ps();
            for (int64_t b = 0; b < NB; b++) {
                const __mmask32 *m = b + 1 < NB ? full : last;
                if (I8PF && r + 1 < r1) {
                    _mm_prefetch((const char *)(row + C + b * A16B), _MM_HINT_T0);
                    _mm_prefetch((const char *)(row + C + b * A16B + 64), _MM_HINT_T0);
                }
                __m512i wv[4];
                for (int j = 0; j < 4; j++)
                    wv[j] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m[j], row + b * A16B + 32 * j));
                for (int64_t t = 0; t < nt; t++) {
                    const int16_t *xq = a->q + ((t0 + t) * NB + b) * A16B;
                    __m512i acc = _mm512_setzero_si512();
                    for (int j = 0; j < 4; j++) acc = _mm512_dpwssd_epi32(acc, wv[j], _mm512_loadu_si512(xq + 32 * j));
                    f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(a->d[(t0 + t) * NB + b]), f[t]);
                }
            }
            for (int64_t t = 0; t < nt; t++) out[(t0 + t) * R + r] = _mm512_reduce_add_ps(f[t]) * s[r];
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
    q.xe = malloc(T * q.G * 64);
    q.xo = malloc(T * q.G * 64);
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
    q->xe = malloc(T * q->G * 64);
    q->xo = malloc(T * q->G * 64);
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

/* One SwiGLU expert of 4-bit weights for T tokens in one call: out = down(silu(gate x) * up x), gate and up
 * [I, D], down [D, I], all in one format (kind, tab8, K, mult as for df_q4q8_mm). x is quantized once for gate
 * and up, whose rows run in one parallel pass; the product is quantized and the down rows run in a second.
 * The same arithmetic as three df_q4q8_mm calls with silu(g) * u between them, less the host round trips
 * (SiLU here is g / (1 + expf(-g)), which may differ from torch's in the last bit). Returns 0, or -1 when the
 * buffers could not be allocated. */
int df_q4q8_swiglu(int kind, const uint8_t *gp, const void *gs, const uint8_t *up, const void *us,
                   const uint8_t *dp, const void *ds, const uint8_t *tab8, int K, float mult, const float *e8m0,
                   const float *x, float *out, int64_t I, int64_t D, int64_t T, int nthreads) {
    q8x_t qx = {0}, qh = {0};
    float *g = malloc(T * I * sizeof(float)), *u = malloc(T * I * sizeof(float));
    int rc = -1;
    if (g && u && q8x_alloc(&qx, T, D) && q8x_alloc(&qh, T, I)) {
        q8_quantize(x, T, D, K, mult, &qx);
        SPLIT(nthreads, I, {
            q8_rows(kind, gp, gs, tab8, K, e8m0, &qx, g, r0, r1, I, D, T);
            q8_rows(kind, up, us, tab8, K, e8m0, &qx, u, r0, r1, I, D, T);
        })
        for (int64_t i = 0; i < T * I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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

/* Several int8 matrices that read the same x (attention's q, k and v): x is quantized once and the rows of all
 * of them, taken as one list, run in one parallel pass. Each matrix's rows get the arithmetic of df_i8a16_mm,
 * so the results are those of separate calls. w, s, out, R: n entries each. */
int df_i8a16_multi(int n, const int8_t *const *w, const float *const *s, float *const *out, const int64_t *R,
                   const float *x, int64_t C, int64_t T, int nthreads) {
    i8a16_t a;
    int64_t total = 0;
    for (int m = 0; m < n; m++) total += R[m];
    a.NB = (C + A16B - 1) / A16B;
    a.q = malloc(T * a.NB * A16B * sizeof(int16_t));
    a.d = malloc(T * a.NB * sizeof(float));
    int rc = -1;
    if (a.q && a.d) {
        a16_quantize(x, T, C, &a);
        SPLIT(nthreads, total, i8a16_span(n, w, s, out, R, &a, r0, r1, C, T))
        rc = 0;
    }
    free(a.q);
    free(a.d);
    return rc;
}

/* 1 when the int8 x int16 path has its vector (AVX-512 VNNI) code here, 0 when it runs the plain C loop. */
int df_a16_vnni(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
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

int df_simd_width(void) {
#ifdef __AVX512F__
    return 16;
#else
    return 1;
#endif
}
