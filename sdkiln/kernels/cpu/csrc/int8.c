/* sdkiln's exact int8 linears for x86 CPUs, for sdkiln.kernels.cpu.native: built once with -mavx2,
 * and, where the CPU has AVX-512 VNNI, a second time with -mavx512f -mavx512bw -mavx512vnni.
 *
 * One call does what the reference does in several torch ops: quantize the fp32 activations
 * (per token, or per tensor with a calibrated scale and offset), multiply by the int8 weight exactly
 * in int32, and dequantize, with the reference's fp32 operations in the reference's order. Built with
 * -ffp-contract=off and without -ffast-math, so every fp32 operation is one IEEE operation rounded to
 * nearest even, as in torch: the output is the reference's bit for bit.
 *
 * The products are exact for every int8 value, -128 included, with no saturation:
 * - AVX2: int8 widened to int16 (the weight a block of rows at a time, reused by every row of
 *   activations), vpmaddwd (pairs of int16 products summed in int32);
 * - AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so the activations are offset by
 *   128 (a + 128 in [0, 255]) and 128 * sum_k w[n][k] is subtracted afterwards; the int32 sums wrap,
 *   but the true result fits int32 (K <= 131071, which the Python side checks), so it comes out exact.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SK_VNNI 1
typedef int8_t a_t; /* the activations as the product reads them */
#define A_PAD 64
#define MR 4
#else
typedef int16_t a_t;
#define A_PAD 16
#define MR 2
#endif
/* The output tile: MR rows (activations) by NR columns (weight rows, int8), NR <= 4. */
#define NR 4
#ifdef SK_VNNI
#define W_BLOCK_BYTES (128 * 1024) /* of int8 weight rows per block of columns */
#else
#define W_BLOCK_BYTES (64 * 1024) /* widened to int16: 128 KiB */
#endif

/* The reference's rounding: torch.round (half to even) of an fp32 value, clamped to [lo, hi];
 * NaN becomes 0. */
static inline int8_t round_clamp(float v, float lo, float hi) {
    v = rintf(v);
    if (!(v >= lo)) v = (v != v) ? 0.0f : lo;
    if (v > hi) v = hi;
    return (int8_t)(int)v;
}

static float row_absmax(const float *x, int64_t k) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
    }
    float buf[8];
    _mm256_storeu_ps(buf, m);
    float r = 0.0f;
    for (int j = 0; j < 8; j++) r = buf[j] > r ? buf[j] : r;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < k; i++) {
        float a = fabsf(x[i]);
        if (a != a) any_nan = 1;
        r = a > r ? a : r;
    }
    return any_nan ? NAN : r;
}

/* 8 rounded, clamped values (NaN -> 0) as int16. */
static inline __m128i round_clamp8(__m256 v, __m256 lo, __m256 hi) {
    __m256 ord = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(v, lo), hi), ord);
    __m256i iv = _mm256_cvtps_epi32(v);
    return _mm_packs_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
}

/* One row: q = clamp(round(x / s + o), lo, hi) (o = 0 per token), as int16 (q16, padded with zeros
 * to kp) or int8 (q8). */
static void quant_row(const float *x, int64_t k, float s, float o, float lo, float hi, int16_t *q16, int64_t kp,
                      int8_t *q8) {
    __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vs);
        if (o != 0.0f) v = _mm256_add_ps(v, vo);
        __m128i p = round_clamp8(v, vlo, vhi);
        if (q16)
            _mm_storeu_si128((__m128i *)(q16 + i), p);
        else
            _mm_storel_epi64((__m128i *)(q8 + i), _mm_packs_epi16(p, p));
    }
    for (; i < k; i++) {
        int8_t v = round_clamp(o != 0.0f ? x[i] / s + o : x[i] / s, lo, hi);
        if (q16)
            q16[i] = v;
        else
            q8[i] = v;
    }
    for (; i < kp; i++) {
        if (q16)
            q16[i] = 0;
        else
            q8[i] = 0;
    }
}

/* Per token: scale = absmax / 127 (1 where that is not > 0), q = clamp(round(x / scale), -127, 127). */
static void quant_per_token(const float *x, int64_t m, int64_t k, int16_t *q16, int64_t kp, int8_t *q8,
                            float *scale) {
    for (int64_t r = 0; r < m; r++) {
        float s = row_absmax(x + r * k, k) / 127.0f;
        if (!(s > 0.0f)) s = 1.0f;
        scale[r] = s;
        quant_row(x + r * k, k, s, 0.0f, -127.0f, 127.0f, q16 ? q16 + r * kp : NULL, kp, q8 ? q8 + r * kp : NULL);
    }
}

/* Per tensor: q = clamp(round(x / scale + offset), -128, 127). */
static void quant_per_tensor(const float *x, int64_t m, int64_t k, float scale, float offset, int16_t *q16,
                             int64_t kp, int8_t *q8) {
    for (int64_t r = 0; r < m; r++)
        quant_row(x + r * k, k, scale, offset, -128.0f, 127.0f, q16 ? q16 + r * kp : NULL, kp,
                  q8 ? q8 + r * kp : NULL);
}

/* The four sums of c[0..3], one per lane, and the products' epilogue for them. */
static inline __m128i reduce4(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(c0, c1), _mm256_hadd_epi32(c2, c3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The dequantizing epilogues, in the references' fp32 order:
 * per token: y = (float(acc) * x_scale[m]) * w_scale[n] (+ bias[n]);
 * per tensor: y = float(acc + quant_bias[n]) * deq_scale[n]. */
typedef struct {
    int kind; /* 0: per token, 1: per tensor (static), 2: the int32 sums themselves */
    const float *x_scale, *w_scale, *bias, *deq_scale;
    const int32_t *quant_bias;
    float *out;
    int32_t *acc;
    int64_t n;
} epilogue_t;

/* Row m, columns n0 .. n0 + nr - 1 (nr <= 4) of the output from their exact sums. */
static inline void store_row(const epilogue_t *e, int64_t m, int64_t n0, int nr, __m128i acc) {
    static const int32_t ones[8] = {-1, -1, -1, -1, 0, 0, 0, 0};
    __m128i mask = _mm_loadu_si128((const __m128i *)(ones + 4 - nr));
    __m128 y;
    if (e->kind == 2) {
        _mm_maskstore_epi32(e->acc + m * e->n + n0, mask, acc);
        return;
    }
    if (e->kind == 0) {
        y = _mm_mul_ps(_mm_cvtepi32_ps(acc), _mm_set1_ps(e->x_scale[m]));
        y = _mm_mul_ps(y, _mm_maskload_ps(e->w_scale + n0, mask));
        if (e->bias) y = _mm_add_ps(y, _mm_maskload_ps(e->bias + n0, mask));
    } else {
        __m128i q = _mm_add_epi32(acc, _mm_maskload_epi32(e->quant_bias + n0, mask));
        y = _mm_mul_ps(_mm_cvtepi32_ps(q), _mm_maskload_ps(e->deq_scale + n0, mask));
    }
    _mm_maskstore_ps(e->out + m * e->n + n0, mask, y);
}

/* An mr x nr tile of the output (mr <= MR, nr <= NR): rows m0.. of a (rows of kp, zero padded) times
 * columns n0.. (rows of the int8 weight, of k), exactly, then the epilogue. */
#ifdef SK_VNNI
static inline __attribute__((always_inline)) void tile(const a_t *a, int64_t kp, const int8_t *w, int64_t k,
                                                       const int32_t *comp, int64_t m0, int64_t n0, const int mr,
                                                       const int nr, const epilogue_t *e) {
    const __m512i b80 = _mm512_set1_epi8((char)0x80);
    __m512i c[MR][4]; /* the columns past nr stay zero */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) c[i][j] = _mm512_setzero_si512();
    for (int64_t t = 0; t < k; t += 64) {
        __mmask64 mk = k - t >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - t)) - 1);
        __m512i wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_maskz_loadu_epi8(mk, w + (n0 + j) * k + t);
        for (int i = 0; i < mr; i++) {
            __m512i av = _mm512_xor_si512(_mm512_loadu_si512(a + (m0 + i) * kp + t), b80); /* a + 128 */
            for (int j = 0; j < nr; j++) c[i][j] = _mm512_dpbusd_epi32(c[i][j], av, wv[j]);
        }
    }
    static const int32_t ones[8] = {-1, -1, -1, -1, 0, 0, 0, 0};
    __m128i mask = _mm_loadu_si128((const __m128i *)(ones + 4 - nr));
    __m128i cj = _mm_maskload_epi32(comp + n0, mask);
    for (int i = 0; i < mr; i++) {
        __m256i h[4];
        for (int j = 0; j < 4; j++)
            h[j] = _mm256_add_epi32(_mm512_castsi512_si256(c[i][j]), _mm512_extracti64x4_epi64(c[i][j], 1));
        store_row(e, m0 + i, n0, nr, _mm_sub_epi32(reduce4(h[0], h[1], h[2], h[3]), cj));
    }
}

/* comp[n] = 128 * sum_k w[n][k], what the offset activations add to each sum. */
static void offset_sums(const int8_t *w, int64_t n, int64_t k, int32_t *comp) {
    const __m512i b80 = _mm512_set1_epi8((char)0x80);
    for (int64_t j = 0; j < n; j++) {
        __m512i c = _mm512_setzero_si512();
        for (int64_t t = 0; t < k; t += 64) {
            __mmask64 mk = k - t >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - t)) - 1);
            c = _mm512_dpbusd_epi32(c, b80, _mm512_maskz_loadu_epi8(mk, w + j * k + t));
        }
        comp[j] = _mm512_reduce_add_epi32(c);
    }
}
#else
/* w here is a block of the weight widened to int16, rows of kp zero padded (``widen``), and n0 its
 * row in that block, so the product has no tail. */
static inline __attribute__((always_inline)) void tile(const a_t *a, int64_t kp, const int16_t *w, int64_t n0b,
                                                       int64_t m0, int64_t n0, const int mr, const int nr,
                                                       const epilogue_t *e) {
    __m256i c[MR][4]; /* the columns past nr stay zero */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) c[i][j] = _mm256_setzero_si256();
    for (int64_t t = 0; t < kp; t += 16) {
        __m256i wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(w + (n0b + j) * kp + t));
        for (int i = 0; i < mr; i++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(a + (m0 + i) * kp + t));
            for (int j = 0; j < nr; j++) c[i][j] = _mm256_add_epi32(c[i][j], _mm256_madd_epi16(av, wv[j]));
        }
    }
    for (int i = 0; i < mr; i++) store_row(e, m0 + i, n0, nr, reduce4(c[i][0], c[i][1], c[i][2], c[i][3]));
}

/* Rows n0 .. n1 - 1 of the int8 weight [n, k] widened to int16 rows of kp, zero padded. */
static void widen(const int8_t *w, int64_t k, int64_t kp, int64_t n0, int64_t n1, int16_t *out) {
    for (int64_t j = n0; j < n1; j++) {
        const int8_t *src = w + j * k;
        int16_t *dst = out + (j - n0) * kp;
        int64_t t = 0;
        for (; t + 16 <= k; t += 16)
            _mm256_storeu_si256((__m256i *)(dst + t), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + t))));
        for (; t < k; t++) dst[t] = src[t];
        for (; t < kp; t++) dst[t] = 0;
    }
}
#endif

#ifdef SK_VNNI
#define TILE_ARGS w, k, comp
#else
#define TILE_ARGS wb, n0 - nb0
#endif
#define TILE_CASE(MRV, NRV)                                  \
    case MRV * 8 + NRV:                                      \
        tile(a, kp, TILE_ARGS, m0, n0, MRV, NRV, e);         \
        break;

/* out = epilogue(a @ w.T) for a [m, kp] (the activations, zero padded) and w [n, k]; 0, or -1
 * without memory. */
static int gemm(const a_t *a, int64_t kp, const int8_t *w, int64_t m, int64_t n, int64_t k, const epilogue_t *e) {
    int64_t nb = (W_BLOCK_BYTES / (k > 0 ? k : 1)) / NR * NR;
    if (nb < NR) nb = NR;
#ifdef SK_VNNI
    int32_t *comp = (int32_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!comp) return -1;
    offset_sums(w, n, k, comp);
#else
    int16_t *wb = (int16_t *)malloc((size_t)(nb * kp + 16) * sizeof(int16_t));
    if (!wb) return -1;
#endif
    for (int64_t nb0 = 0; nb0 < n; nb0 += nb) {
        int64_t nb1 = nb0 + nb < n ? nb0 + nb : n;
#ifndef SK_VNNI
        widen(w, k, kp, nb0, nb1, wb);
#endif
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
            int mr = m - m0 < MR ? (int)(m - m0) : MR;
            for (int64_t n0 = nb0; n0 < nb1; n0 += NR) {
                int nr = nb1 - n0 < NR ? (int)(nb1 - n0) : NR;
                if (mr == MR && nr == NR) {
                    tile(a, kp, TILE_ARGS, m0, n0, MR, NR, e);
                    continue;
                }
                switch (mr * 8 + nr) {
#ifdef SK_VNNI
                    TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
                    TILE_CASE(3, 4) TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
                    TILE_CASE(2, 4)
#endif
                    TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
                    TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
                }
            }
        }
    }
#ifdef SK_VNNI
    free(comp);
#else
    free(wb);
#endif
    return 0;
}

static a_t *scratch(int64_t m, int64_t kp) {
    return (a_t *)malloc((size_t)(m * kp + A_PAD) * sizeof(a_t));
}

static int16_t *as16(a_t *a) {
#ifdef SK_VNNI
    (void)a;
    return NULL;
#else
    return a;
#endif
}

static int8_t *as8(a_t *a) {
#ifdef SK_VNNI
    return a;
#else
    (void)a;
    return NULL;
#endif
}

#define PADDED(k) (((k) + A_PAD - 1) & ~(int64_t)(A_PAD - 1))

/* quantize_per_token_int8 -> w8a8_linear in one pass: x [m, k] fp32, w [n, k] int8, w_scale [n], bias
 * [n] or NULL -> out [m, n] fp32; x_scale [m] receives the per-token scales unless NULL. 0, or -1
 * without memory. */
int sdkiln_w8a8_dynamic(const float *x, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *w_scale,
                        const float *bias, float *x_scale, float *out) {
    int64_t kp = PADDED(k);
    a_t *a = scratch(m, kp);
    float *own = x_scale ? NULL : (float *)malloc((size_t)(m > 0 ? m : 1) * sizeof(float));
    int rc = -1;
    if (a && (x_scale || own)) {
        if (own) x_scale = own;
        quant_per_token(x, m, k, as16(a), kp, as8(a), x_scale);
        epilogue_t e = {0, x_scale, w_scale, bias, NULL, NULL, out, NULL, n};
        rc = gemm(a, kp, w, m, n, k, &e);
    }
    free(a);
    free(own);
    return rc;
}

/* quantize_per_tensor_int8 -> w8a8_static_linear in one pass: out = float(q @ w.T + quant_bias) * deq_scale. */
int sdkiln_w8a8_static(const float *x, int64_t m, int64_t k, const float *scale, const float *offset, const int8_t *w,
                       int64_t n, const int32_t *quant_bias, const float *deq_scale, float *out) {
    int64_t kp = PADDED(k);
    a_t *a = scratch(m, kp);
    if (!a) return -1;
    quant_per_tensor(x, m, k, *scale, *offset, as16(a), kp, as8(a));
    epilogue_t e = {1, NULL, NULL, NULL, deq_scale, quant_bias, out, NULL, n};
    int rc = gemm(a, kp, w, m, n, k, &e);
    free(a);
    return rc;
}

/* The exact product alone: acc [m, n] int32 = a [m, k] int8 @ w [n, k].T. */
int sdkiln_int8_product(const int8_t *a8, int64_t m, int64_t k, const int8_t *w, int64_t n, int32_t *acc) {
    int64_t kp = PADDED(k);
    a_t *a = scratch(m, kp);
    if (!a) return -1;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i++) a[r * kp + i] = a8[r * k + i];
        for (int64_t i = k; i < kp; i++) a[r * kp + i] = 0;
    }
    epilogue_t e = {2, NULL, NULL, NULL, NULL, NULL, NULL, acc, n};
    int rc = gemm(a, kp, w, m, n, k, &e);
    free(a);
    return rc;
}

/* The quantizers alone, to int8 (for torch._int_mm), and the epilogues alone, from int32 sums. */
void sdkiln_quant_per_token(const float *x, int64_t m, int64_t k, int8_t *q, float *scale) {
    quant_per_token(x, m, k, NULL, k, q, scale);
}

void sdkiln_quant_per_tensor(const float *x, int64_t m, int64_t k, float scale, float offset, int8_t *q) {
    quant_per_tensor(x, m, k, scale, offset, NULL, k, q);
}

static void dequant(const int32_t *acc, int64_t m, int64_t n, const epilogue_t *e) {
    for (int64_t r = 0; r < m; r++) {
        int64_t c = 0;
        for (; c + 4 <= n; c += 4) store_row(e, r, c, 4, _mm_loadu_si128((const __m128i *)(acc + r * n + c)));
        if (c < n) {
            int32_t tail[4] = {0, 0, 0, 0};
            memcpy(tail, acc + r * n + c, (size_t)(n - c) * sizeof(int32_t));
            store_row(e, r, c, (int)(n - c), _mm_loadu_si128((const __m128i *)tail));
        }
    }
}

void sdkiln_dequant_per_token(const int32_t *acc, int64_t m, int64_t n, const float *x_scale, const float *w_scale,
                              const float *bias, float *out) {
    epilogue_t e = {0, x_scale, w_scale, bias, NULL, NULL, out, NULL, n};
    dequant(acc, m, n, &e);
}

void sdkiln_dequant_per_tensor(const int32_t *acc, int64_t m, int64_t n, const int32_t *quant_bias,
                               const float *deq_scale, float *out) {
    epilogue_t e = {1, NULL, NULL, NULL, deq_scale, quant_bias, out, NULL, n};
    dequant(acc, m, n, &e);
}
