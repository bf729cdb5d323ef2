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

int df_simd_width(void) {
#ifdef __AVX512F__
    return 16;
#else
    return 1;
#endif
}
