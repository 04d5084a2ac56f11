/* Block-FP8 -> bfloat16 expansion, one fused pass: the method and the checks are described in
   fp8_native.py, which loads this file as fp8_build.py builds it. Built with -Wall -Werror in the tests. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#if defined(__AVX2__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif

#define BAND 128
#define SPAN 512
#define ROWS 8
#define MAX_THREADS 256

typedef struct {
    const uint8_t *src; int64_t n, k, src_stride;
    const float *scale; int64_t ss0, ss1;
    uint16_t *out; int64_t out_stride;
    int64_t bn, bk, sub_k, spans, nunits;
    int transposed;
    uint16_t nan_bits;
    int64_t next;
} job_t;

/* The definition for one code: bf16(RNE(float32(code) * s)); NaN results as nan_bits. */
static uint16_t expand_one(uint32_t b, float s, uint16_t nan_bits) {
    uint32_t m = b & 0x7Fu, bits, pb;
    float v, p;
    if (m == 0x7Fu) return nan_bits;
    if (m < 8u) {
        v = (float)m * 0x1p-9f; /* subnormal codes: m * 2**-9, exact */
    } else {
        bits = (m << 20) + (120u << 23); /* exponent e + (127 - 7), mantissa f */
        memcpy(&v, &bits, 4);
    }
    if (b & 0x80u) v = -v;
    p = v * s;
    memcpy(&pb, &p, 4);
    if ((pb & 0x7FFFFFFFu) > 0x7F800000u) return nan_bits;
    return (uint16_t)((pb + 0x7FFFu + ((pb >> 16) & 1u)) >> 16);
}

typedef struct {
    int fast;             /* the 16-entry table applies (see the module docstring) */
    uint8_t lo[16], hi[16];
    int have_lut;
    uint16_t lut[256];
    float s;
    uint16_t nan_bits;
} tables_t;

static void make_tables(tables_t *t, float s, uint16_t nan_bits) {
    uint32_t ab;
    float a;
    memcpy(&ab, &s, 4);
    ab &= 0x7FFFFFFFu;
    memcpy(&a, &ab, 4);
    t->s = s;
    t->nan_bits = nan_bits;
    t->have_lut = 0;
#if defined(__AVX2__) || defined(__SSE4_1__)
    t->fast = (a >= 0x1p-120f && a <= 0x1p118f); /* false for NaN */
#else
    t->fast = 0; /* without a byte shuffle the 256-entry table is faster */
#endif
    if (t->fast) {
        for (int f = 0; f < 8; f++) {
            uint16_t sub = expand_one((uint32_t)f, s, nan_bits);
            /* e = 1 result minus one exponent step, so that adding e << 7 gives code (e, f) */
            uint16_t nrm = (uint16_t)(expand_one((uint32_t)(8 + f), s, nan_bits) - 128u);
            t->lo[f] = (uint8_t)sub; t->hi[f] = (uint8_t)(sub >> 8);
            t->lo[8 + f] = (uint8_t)nrm; t->hi[8 + f] = (uint8_t)(nrm >> 8);
        }
    }
}

static void ensure_lut(tables_t *t) {
    if (!t->have_lut) {
        for (uint32_t b = 0; b < 256; b++) t->lut[b] = expand_one(b, t->s, t->nan_bits);
        t->have_lut = 1;
    }
}

static void convert_row(const uint8_t *in, uint16_t *out, int64_t cnt, tables_t *t) {
    int64_t i = 0;
    if (t->fast) {
#if defined(__AVX2__)
        const __m256i tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->lo));
        const __m256i thi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->hi));
        const __m256i zero = _mm256_setzero_si256(), c7 = _mm256_set1_epi8(7), c8 = _mm256_set1_epi8(8);
        const __m256i c78 = _mm256_set1_epi8(0x78), c7f = _mm256_set1_epi8(0x7F), c80 = _mm256_set1_epi8((char)0x80);
        const __m256i nan = _mm256_set1_epi16((short)t->nan_bits);
        for (; i + 32 <= cnt; i += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(in + i));
            __m256i e3 = _mm256_and_si256(x, c78);
            __m256i idx = _mm256_or_si256(_mm256_and_si256(x, c7), _mm256_andnot_si256(_mm256_cmpeq_epi8(e3, zero), c8));
            __m256i lo = _mm256_shuffle_epi8(tlo, idx);
            __m256i hi = _mm256_xor_si256(_mm256_shuffle_epi8(thi, idx), _mm256_and_si256(x, c80));
            __m256i isnan = _mm256_cmpeq_epi8(_mm256_and_si256(x, c7f), c7f);
            __m256i w0 = _mm256_add_epi16(_mm256_unpacklo_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpacklo_epi8(e3, zero), 4));
            __m256i w1 = _mm256_add_epi16(_mm256_unpackhi_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpackhi_epi8(e3, zero), 4));
            w0 = _mm256_blendv_epi8(w0, nan, _mm256_unpacklo_epi8(isnan, isnan));
            w1 = _mm256_blendv_epi8(w1, nan, _mm256_unpackhi_epi8(isnan, isnan));
            /* unpack works per 128-bit lane: w0 = codes 0-7 | 16-23, w1 = 8-15 | 24-31 */
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute2x128_si256(w0, w1, 0x20));
            _mm256_storeu_si256((__m256i *)(out + i + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
        }
#elif defined(__SSE4_1__)
        const __m128i tlo = _mm_loadu_si128((const __m128i *)t->lo);
        const __m128i thi = _mm_loadu_si128((const __m128i *)t->hi);
        const __m128i zero = _mm_setzero_si128(), c7 = _mm_set1_epi8(7), c8 = _mm_set1_epi8(8);
        const __m128i c78 = _mm_set1_epi8(0x78), c7f = _mm_set1_epi8(0x7F), c80 = _mm_set1_epi8((char)0x80);
        const __m128i nan = _mm_set1_epi16((short)t->nan_bits);
        for (; i + 16 <= cnt; i += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(in + i));
            __m128i e3 = _mm_and_si128(x, c78);
            __m128i idx = _mm_or_si128(_mm_and_si128(x, c7), _mm_andnot_si128(_mm_cmpeq_epi8(e3, zero), c8));
            __m128i lo = _mm_shuffle_epi8(tlo, idx);
            __m128i hi = _mm_xor_si128(_mm_shuffle_epi8(thi, idx), _mm_and_si128(x, c80));
            __m128i isnan = _mm_cmpeq_epi8(_mm_and_si128(x, c7f), c7f);
            __m128i w0 = _mm_add_epi16(_mm_unpacklo_epi8(lo, hi), _mm_slli_epi16(_mm_unpacklo_epi8(e3, zero), 4));
            __m128i w1 = _mm_add_epi16(_mm_unpackhi_epi8(lo, hi), _mm_slli_epi16(_mm_unpackhi_epi8(e3, zero), 4));
            _mm_storeu_si128((__m128i *)(out + i), _mm_blendv_epi8(w0, nan, _mm_unpacklo_epi8(isnan, isnan)));
            _mm_storeu_si128((__m128i *)(out + i + 8), _mm_blendv_epi8(w1, nan, _mm_unpackhi_epi8(isnan, isnan)));
        }
#endif
        for (; i < cnt; i++) out[i] = expand_one(in[i], t->s, t->nan_bits);
        return;
    }
    ensure_lut(t);
    for (; i < cnt; i++) out[i] = t->lut[in[i]];
}

/* 8x8 byte transpose in registers: x[i] holds row i (byte j = column j). */
static void transpose8(uint64_t x[8]) {
    uint64_t t;
    for (int i = 0; i < 8; i += 2) {
        t = ((x[i] >> 8) ^ x[i + 1]) & 0x00FF00FF00FF00FFull; x[i + 1] ^= t; x[i] ^= t << 8;
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = i; j < i + 2; j++) {
            t = ((x[j] >> 16) ^ x[j + 2]) & 0x0000FFFF0000FFFFull; x[j + 2] ^= t; x[j] ^= t << 16;
        }
    for (int j = 0; j < 4; j++) {
        t = ((x[j] >> 32) ^ x[j + 4]) & 0x00000000FFFFFFFFull; x[j + 4] ^= t; x[j] ^= t << 32;
    }
}

static inline __attribute__((always_inline)) void transpose_into(
        const job_t *j, uint8_t *tb, int64_t stride, int64_t n0, int64_t k0, int64_t tn, int64_t tk) {
    int64_t tn8 = tn & ~(int64_t)7, tk8 = tk & ~(int64_t)7;
    for (int64_t a = 0; a < tn8; a += 8) {
        const uint8_t *row = j->src + (n0 + a) * j->src_stride + k0;
        for (int64_t c = 0; c < tk8; c += 8) {
            uint64_t x[8];
            for (int i = 0; i < 8; i++) memcpy(&x[i], row + i * j->src_stride + c, 8);
            transpose8(x);
            for (int i = 0; i < 8; i++) memcpy(tb + (c + i) * stride + a, &x[i], 8);
        }
        for (int64_t c = tk8; c < tk; c++)
            for (int i = 0; i < 8; i++) tb[c * stride + a + i] = row[i * j->src_stride + c];
    }
    for (int64_t a = tn8; a < tn; a++)
        for (int64_t c = 0; c < tk; c++) tb[c * stride + a] = j->src[(n0 + a) * j->src_stride + k0 + c];
}

static inline __attribute__((always_inline)) void transposed_unit(
        const job_t *j, uint8_t *tb, tables_t *tabs, int64_t stride, int64_t n0, int64_t n1, int64_t k0,
        int64_t bc, int64_t tk) {
    transpose_into(j, tb, stride, n0, k0, n1 - n0, tk);
    int64_t nt = 0; /* one table per scale block along n (the caller sized tabs) */
    for (int64_t nb = n0; nb < n1; nb = (nb / j->bn + 1) * j->bn)
        make_tables(&tabs[nt++], j->scale[(nb / j->bn) * j->ss0 + bc * j->ss1], j->nan_bits);
    for (int64_t c = 0; c < tk; c++) {
        int64_t q = 0;
        for (int64_t nb = n0; nb < n1; q++) {
            int64_t ne = (nb / j->bn + 1) * j->bn < n1 ? (nb / j->bn + 1) * j->bn : n1;
            convert_row(tb + c * stride + (nb - n0), j->out + (k0 + c) * j->out_stride + nb, ne - nb, &tabs[q]);
            nb = ne;
        }
    }
}

/* Work unit t.  Not transposed: ROWS source rows, each end to end (long streams in and out).
   Transposed: a band of BAND source columns (= BAND output rows) by SPAN source rows; the
   codes are transposed into the worker's scratch tb in 8x8 blocks, then each output row is
   converted in segments of one scale block.  Measured on a 2-core Xeon: output rows written
   SPAN codes at a time are what makes this fast (the strided writes are the cost). */
static void do_unit(job_t *j, int64_t t, uint8_t *tb, tables_t *tabs) {
    tables_t tab;
    if (!j->transposed) {
        int64_t r0 = t * ROWS, r1 = r0 + ROWS < j->n ? r0 + ROWS : j->n;
        while (r0 < r1) { /* rows of one scale block row; one table per column block */
            int64_t br = r0 / j->bn, re = (br + 1) * j->bn < r1 ? (br + 1) * j->bn : r1;
            for (int64_t k0 = 0; k0 < j->k; k0 += j->bk) {
                int64_t k1 = k0 + j->bk < j->k ? k0 + j->bk : j->k;
                make_tables(&tab, j->scale[br * j->ss0 + (k0 / j->bk) * j->ss1], j->nan_bits);
                for (int64_t r = r0; r < re; r++)
                    convert_row(j->src + r * j->src_stride + k0, j->out + r * j->out_stride + k0, k1 - k0, &tab);
            }
            r0 = re;
        }
        return;
    }
    int64_t band = t / j->spans, span = t % j->spans;
    int64_t bc = band / j->sub_k;
    int64_t k0 = bc * j->bk + (band % j->sub_k) * BAND, k1 = k0 + BAND;
    if (k1 > (bc + 1) * j->bk) k1 = (bc + 1) * j->bk;
    if (k1 > j->k) k1 = j->k;
    int64_t n0 = span * SPAN, n1 = n0 + SPAN < j->n ? n0 + SPAN : j->n;
    if (k0 >= k1 || n0 >= n1) return;
    int64_t tk = k1 - k0, tn = n1 - n0;
    /* tb[c * stride + a] = code (n0 + a, k0 + c); a constant stride (full spans) measured ~25% faster */
    if (tn == SPAN) transposed_unit(j, tb, tabs, SPAN, n0, n1, k0, bc, tk);
    else transposed_unit(j, tb, tabs, tn, n0, n1, k0, bc, tk);
}

typedef struct { job_t *j; uint8_t *tb; tables_t *tabs; } worker_t;

static void *worker(void *arg) {
    worker_t *w = (worker_t *)arg;
    for (;;) {
        int64_t t = __atomic_fetch_add(&w->j->next, 1, __ATOMIC_RELAXED);
        if (t >= w->j->nunits) return NULL;
        do_unit(w->j, t, w->tb, w->tabs);
    }
}

int d3_fp8_simd_level(void) {
#if defined(__AVX2__)
    return 2;
#elif defined(__SSE4_1__)
    return 1;
#else
    return 0;
#endif
}

/* Expand one (n, k) block-FP8 weight.  Returns the number of threads that worked (>= 1). */
int d3_fp8_expand(const uint8_t *src, int64_t n, int64_t k, int64_t src_stride,
                  const float *scale, int64_t ss0, int64_t ss1,
                  uint16_t *out, int64_t out_stride, int64_t bn, int64_t bk,
                  int transposed, int nan_bits, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.src = src; j.n = n; j.k = k; j.src_stride = src_stride;
    j.scale = scale; j.ss0 = ss0; j.ss1 = ss1;
    j.out = out; j.out_stride = out_stride; j.bn = bn; j.bk = bk;
    j.transposed = transposed; j.nan_bits = (uint16_t)nan_bits;
    j.sub_k = (bk + BAND - 1) / BAND;
    j.spans = (n + SPAN - 1) / SPAN;
    j.nunits = transposed ? ((k + bk - 1) / bk) * j.sub_k * j.spans : (n + ROWS - 1) / ROWS;
    if (j.nunits == 0) return 1;
    /* Scratch: one transposed unit and its tables per worker; workers are capped so that all of
       it stays within n * k bytes (half the expert's bfloat16 size). */
    int64_t tb_size = transposed ? (k < BAND ? k : BAND) * (n < SPAN ? n : SPAN) : 0;
    int64_t segments = transposed ? (n < SPAN ? n : SPAN) / bn + 2 : 0; /* scale blocks a unit meets */
    int64_t scratch = tb_size + segments * (int64_t)sizeof(tables_t);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > j.nunits) threads = (int)j.nunits;
    if (scratch && threads > n * k / scratch) threads = (int)(n * k / scratch);
    if (threads < 1) threads = 1;
    pthread_t th[MAX_THREADS];
    worker_t w[MAX_THREADS];
    int ready = 0;
    for (; ready < threads; ready++) {
        w[ready].j = &j;
        void *mem = NULL;
        if (scratch && posix_memalign(&mem, 64, (size_t)(scratch + 64)) != 0) break;
        w[ready].tb = (uint8_t *)mem; /* tb first, cache-line aligned; the tables after it */
        w[ready].tabs = mem ? (tables_t *)((uint8_t *)mem + ((tb_size + 63) & ~(int64_t)63)) : NULL;
    }
    if (ready == 0) return -1;
    int started = 0;
    for (int i = 1; i < ready; i++)
        if (pthread_create(&th[started], NULL, worker, &w[i]) == 0) started++;
    worker(&w[0]);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    /* A worker whose thread did not start left its units to the others: none is lost. */
    for (int i = 0; i < ready; i++) free(w[i].tb);
    return started + 1;
}
