/*
 * Products of GGUF block-quantized weights with activations quantized to int8 (AVX2), as
 * llama.cpp multiplies on the CPU: integer dot products of 32 values in a few instructions,
 * where the float path converts and multiplies every value. Included by gguf_blocks.c
 * (it uses that file's TYPES, fp16_to_fp32, split_nibbles, fifth_bits, k_scale_min,
 * q3_k_scale).
 *
 * Activations: each row of x is cut into blocks of 32 values; a block keeps q = round(x / d)
 * as int8 with d = max |x| / 127 (so |q| <= 127), and the float sums s of its two halves'
 * x (one per 16 values) for the types with an offset, which multiply them unrounded.
 *
 * Weights: every type's values are, per 32-value chunk, integers w times a float a, with
 * 16-bit integer sub-scales per 16 values for the types that have them, plus an offset b
 * per 16 values: value = a * scale * w + b. So a chunk contributes
 *
 *     a * d * sum_halves(scale * sum(w * q)) + b_lo * s_lo + b_hi * s_hi
 *
 * with the integer part exact (maddubs: u8 x s8 pairs into 16 bits, at most 2 * 128 * 127;
 * madd by the sub-scales into 32 bits, exact in float32: below 2^24). Signed weights go
 * through maddubs as |w| and q * sign(w). The weights are exactly the file's values; only
 * the activations multiplying w are rounded (about 0.4% of a block's largest value), which the agreement
 * oracle judges per type (see docs). Each row's result is summed in one order, chunk after
 * chunk, whatever the batch, so a row gives the same bits alone or in any batch.
 */

#if defined(__AVX2__) && defined(__FMA__)

static inline float int8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 32 int32 lanes (each within int8) -> 32 bytes at out, in order. */
static inline void store_int8(const __m256i lanes[4], int8_t *out) {
    /* packs interleave the 128-bit halves; the permute puts values back in order */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]),
                           _mm256_packs_epi32(lanes[2], lanes[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, bytes);
}

/* One row of x, quantized. */
typedef struct {
    const int8_t *q;   /* [K] */
    const int8_t *low; /* [K]: the second digit (two-digit activations), or NULL */
    const float *d;  /* [K / 32] */
    const float *s;  /* [K / 16]: the sum of x over each 16 values */
} int8_row;

/* One weight block as int8 chunks (a 32-value type uses chunk 0 and b[0..1]). */
typedef struct {
    __m256i w[8];     /* 32 values per chunk */
    __m256i scale[8]; /* 16-bit sub-scales: lanes 0..7 for values 0..15, 8..15 for 16..31 */
    float a[8];
    float b[16];
} int8_block;

static void quantize_row_int8(const float *x, int64_t K, int8_t *q, int8_t *low, float *d,
                              float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const float *p = x + 32 * blk;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(p + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float largest = _mm_cvtss_f32(m4);
        const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        __m256i lanes[4], rest[4];
        for (int j = 0; j < 4; j++) {
            const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            lanes[j] = _mm256_cvtps_epi32(rounded);
            /* the second digit: what is left, in units of d / 254 (at most 127 of them) */
            const __m256 left = _mm256_sub_ps(v[j], _mm256_mul_ps(rounded, _mm256_set1_ps(scale)));
            rest[j] = _mm256_cvtps_epi32(_mm256_mul_ps(left, _mm256_set1_ps(254.0f * inverse)));
        }
        store_int8(lanes, q + 32 * blk);
        if (low != NULL) store_int8(rest, low + 32 * blk);
        d[blk] = scale;
        for (int h = 0; h < 2; h++) s[2 * blk + h] = int8_hsum(_mm256_add_ps(v[2 * h], v[2 * h + 1]));
    }
}

/* ---- weight blocks as int8 chunks ------------------------------------------------------ */

static inline int int8_signed(int qtype) {
    return qtype == VL_Q4_0 || qtype == VL_Q5_0 || qtype == VL_Q8_0 || qtype == VL_IQ4_NL ||
           qtype == VL_Q3_K || qtype == VL_Q6_K || qtype == VL_IQ4_XS;
}

static inline int int8_has_offset(int qtype) {
    return qtype == VL_Q4_1 || qtype == VL_Q5_1 || qtype == VL_Q2_K || qtype == VL_Q4_K ||
           qtype == VL_Q5_K;
}

static inline int int8_has_subscales(int qtype) {
    return qtype == VL_Q2_K || qtype == VL_Q3_K || qtype == VL_Q6_K;
}

static inline __m256i int8_scales(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

/* IQ4's 16 bytes of nibbles -> 32 table values (low nibbles first). */
static inline __m256i iq4_int8(const uint8_t *qs) {
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4)),
                            _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4)));
}

static inline __attribute__((always_inline)) void int8_decode(int qtype, const uint8_t *b,
                                                              int8_block *o) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    switch (qtype) {
    case VL_Q4_0:
        o->w[0] = _mm256_sub_epi8(split_nibbles(b + 2), _mm256_set1_epi8(8));
        o->a[0] = fp16_to_fp32(b);
        break;
    case VL_Q4_1:
        o->w[0] = split_nibbles(b + 4);
        o->a[0] = fp16_to_fp32(b);
        o->b[0] = o->b[1] = fp16_to_fp32(b + 2);
        break;
    case VL_Q5_0:
        o->w[0] = _mm256_sub_epi8(_mm256_or_si256(split_nibbles(b + 6), fifth_bits(b + 2)),
                                  _mm256_set1_epi8(16));
        o->a[0] = fp16_to_fp32(b);
        break;
    case VL_Q5_1:
        o->w[0] = _mm256_or_si256(split_nibbles(b + 8), fifth_bits(b + 4));
        o->a[0] = fp16_to_fp32(b);
        o->b[0] = o->b[1] = fp16_to_fp32(b + 2);
        break;
    case VL_Q8_0:
        o->w[0] = _mm256_loadu_si256((const __m256i *)(b + 2));
        o->a[0] = fp16_to_fp32(b);
        break;
    case VL_IQ4_NL:
        o->w[0] = iq4_int8(b + 2);
        o->a[0] = fp16_to_fp32(b);
        break;
    case VL_Q2_K: { /* chunk c = 4 h + s: bits 2s of qs[32 h + l]; groups 2c, 2c + 1 */
        const uint8_t *scales = b, *qs = b + 16;
        const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
        for (int h = 0; h < 2; h++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int c = 4 * h + s;
                o->w[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * s), _mm256_set1_epi8(3));
                o->scale[c] = int8_scales(scales[2 * c] & 15, scales[2 * c + 1] & 15);
                o->a[c] = d;
                o->b[2 * c] = -(dmin * (float)(scales[2 * c] >> 4));
                o->b[2 * c + 1] = -(dmin * (float)(scales[2 * c + 1] >> 4));
            }
        }
        break;
    }
    case VL_Q3_K: {
        const uint8_t *qs = b + 32, *sc = b + 96;
        const float d = fp16_to_fp32(b + 108);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int h = 0; h < 2; h++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int c = 4 * h + s;
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * s), _mm256_set1_epi8(3));
                const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one);
                o->w[c] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(bit, 2)),
                                          _mm256_set1_epi8(4));
                o->scale[c] = int8_scales(q3_k_scale(sc, 2 * c), q3_k_scale(sc, 2 * c + 1));
                o->a[c] = d;
            }
        }
        break;
    }
    case VL_Q4_K:
    case VL_Q5_K: {
        const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
        const int five = qtype == VL_Q5_K;
        const uint8_t *qs = b + (five ? 48 : 16);
        int sc[8], mn[8];
        k_scale_min(b + 4, sc, mn);
        const __m256i high = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : low4;
        for (int c = 0; c < 8; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c / 2)));
            __m256i w = _mm256_and_si256(_mm256_srli_epi16(bytes, 4 * (c % 2)), low4);
            if (five) {
                const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(high, c), one);
                w = _mm256_or_si256(w, _mm256_slli_epi16(fifth, 4));
            }
            o->w[c] = w;
            o->a[c] = d * (float)sc[c];
            o->b[2 * c] = o->b[2 * c + 1] = -(dmin * (float)mn[c]);
        }
        break;
    }
    case VL_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = fp16_to_fp32(b + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int c = 4 * h + s;
                const __m256i low_bytes = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (s % 2)));
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(low_bytes, 4 * (s / 2)), low4);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(high, 2 * s), _mm256_set1_epi8(3));
                o->w[c] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)),
                                          _mm256_set1_epi8(32));
                o->scale[c] = int8_scales(scales[2 * c], scales[2 * c + 1]);
                o->a[c] = d;
            }
        }
        break;
    }
    case VL_IQ4_XS: {
        const float d = fp16_to_fp32(b);
        uint16_t scales_h;
        memcpy(&scales_h, b + 2, 2);
        for (int c = 0; c < 8; c++) {
            const int low = (b[4 + c / 2] >> (4 * (c % 2))) & 15;
            const int high = (scales_h >> (2 * c)) & 3;
            o->w[c] = iq4_int8(b + 8 + 16 * c);
            o->a[c] = d * (float)((low | (high << 4)) - 32);
        }
        break;
    }
    }
}

/* ---- tiles ----------------------------------------------------------------------------- */

/* sum(w * x) per 8 lanes of 4 values, times the 16-bit sub-scales, as float (exact). */
static inline __m256 int8_dot(__m256i w, __m256i x, __m256i sub, int is_signed) {
    const __m256i pairs = is_signed
        ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
        : _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, sub));
}

/* Rows of x a tile takes at most (a decode step's: fewer than the GEMM's 32). */
#define INT8_MAX_ROWS 32

/* MR rows of x by NR rows of W over all of K; y[i * ldy + r]. Each block of the NR rows of
 * W is decoded once for all MR rows of x. With MR = 1 (a constant) the accumulators live in
 * registers; otherwise in this stack frame (L1): the same operations in the same order, so
 * the same bits. */
static inline __attribute__((always_inline)) void int8_tile(int qtype, const int TWO,
                                                            const int MR,
                                                            const int NR, const int8_row *x,
                                                            int64_t K, const uint8_t *w,
                                                            int64_t row_bytes, float *y,
                                                            int64_t ldy) {
    const int values = TYPES[qtype].values, bytes = TYPES[qtype].bytes, chunks = values / 32;
    const int is_signed = int8_signed(qtype), has_offset = int8_has_offset(qtype);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[INT8_MAX_ROWS][4];
    float offset[INT8_MAX_ROWS][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) {
            acc[i][r] = _mm256_setzero_ps();
            offset[i][r] = 0.0f;
        }
    int8_block blocks[4];
    for (int64_t blk = 0; blk < K / values; blk++) {
        const char *ahead = (const char *)w + PREFETCH_TILES * NR * row_bytes + blk * NR * bytes;
        for (int line = 0; line < NR * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        for (int r = 0; r < NR; r++) int8_decode(qtype, w + r * row_bytes + blk * bytes, &blocks[r]);
        for (int i = 0; i < MR; i++) {
            const int8_t *q = x[i].q + blk * values;
            const int8_t *low = TWO ? x[i].low + blk * values : NULL;
            const float *d = x[i].d + blk * chunks, *s = x[i].s + 2 * blk * chunks;
            for (int c = 0; c < chunks; c++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                const __m256i xl = TWO ? _mm256_loadu_si256((const __m256i *)(low + 32 * c)) : xq;
                for (int r = 0; r < NR; r++) {
                    const __m256i wv = blocks[r].w[c];
                    const __m256i sub = int8_has_subscales(qtype) ? blocks[r].scale[c] : ones;
                    const float ad = blocks[r].a[c] * d[c];
                    acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(ad), int8_dot(wv, xq, sub, is_signed),
                                                acc[i][r]);
                    if (TWO)
                        acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(ad * (1.0f / 254.0f)),
                                                    int8_dot(wv, xl, sub, is_signed), acc[i][r]);
                    if (has_offset)
                        offset[i][r] += blocks[r].b[2 * c] * s[2 * c] +
                                        blocks[r].b[2 * c + 1] * s[2 * c + 1];
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) y[i * ldy + r] = int8_hsum(acc[i][r]) + offset[i][r];
}

#define INT8_TILE(MR, NR) \
    int8_tile(qtype, TWO, MR, NR, x + m, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

/* Rows n0..n1 of W against every row of x: tiles of all (up to 32) rows of x by four rows
 * of W, so a block is decoded once per step, not once per row of x (a K-quant's decoding
 * costs as much as its products). */
static inline __attribute__((always_inline)) void int8_rows(int qtype, const int TWO,
                                                            const int8_row *x,
                                                            int64_t M, int64_t K,
                                                            const uint8_t *w, int64_t N,
                                                            int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / TYPES[qtype].values * TYPES[qtype].bytes;
    for (int64_t m = 0; m < M; m += INT8_MAX_ROWS) {
        const int rows = M - m < INT8_MAX_ROWS ? (int)(M - m) : INT8_MAX_ROWS;
        int64_t n = n0;
        if (rows == 1) {
            for (; n + 4 <= n1; n += 4) INT8_TILE(1, 4);
            for (; n < n1; n++) INT8_TILE(1, 1);
        } else {
            for (; n + 4 <= n1; n += 4) INT8_TILE(rows, 4);
            for (; n < n1; n++) INT8_TILE(rows, 1);
        }
    }
}

#define INT8_ROWS(name, code)                                                              \
    static void name##_int8_rows(const int8_row *x, int64_t M, int64_t K, const uint8_t *w, \
                                 int64_t N, int64_t n0, int64_t n1, float *y) {             \
        if (x[0].low != NULL)                                                               \
            int8_rows(code, 1, x, M, K, w, N, n0, n1, y);                                   \
        else                                                                                \
            int8_rows(code, 0, x, M, K, w, N, n0, n1, y);                                   \
    }
INT8_ROWS(q4_0, VL_Q4_0)
INT8_ROWS(q4_1, VL_Q4_1)
INT8_ROWS(q8_0, VL_Q8_0)
INT8_ROWS(q5_0, VL_Q5_0)
INT8_ROWS(q5_1, VL_Q5_1)
INT8_ROWS(iq4_nl, VL_IQ4_NL)
INT8_ROWS(q2_k, VL_Q2_K)
INT8_ROWS(q3_k, VL_Q3_K)
INT8_ROWS(q4_k, VL_Q4_K)
INT8_ROWS(q5_k, VL_Q5_K)
INT8_ROWS(q6_k, VL_Q6_K)
INT8_ROWS(iq4_xs, VL_IQ4_XS)

typedef void (*int8_rows_fn)(const int8_row *, int64_t, int64_t, const uint8_t *, int64_t,
                             int64_t, int64_t, float *);
static const int8_rows_fn INT8_ROWS_OF[VL_NUM_TYPES] = {
    [VL_Q4_0] = q4_0_int8_rows,   [VL_Q4_1] = q4_1_int8_rows, [VL_Q8_0] = q8_0_int8_rows,
    [VL_Q5_0] = q5_0_int8_rows,   [VL_Q5_1] = q5_1_int8_rows, [VL_IQ4_NL] = iq4_nl_int8_rows,
    [VL_Q2_K] = q2_k_int8_rows,   [VL_Q3_K] = q3_k_int8_rows, [VL_Q4_K] = q4_k_int8_rows,
    [VL_Q5_K] = q5_k_int8_rows,   [VL_Q6_K] = q6_k_int8_rows, [VL_IQ4_XS] = iq4_xs_int8_rows,
};
#endif

/* 1 when vl_matmul_int8 multiplies this type (AVX2 builds; every quantized type). */
int vl_has_int8(int qtype) {
#if defined(__AVX2__) && defined(__FMA__)
    return qtype >= 0 && qtype < VL_NUM_TYPES && INT8_ROWS_OF[qtype] != NULL;
#else
    (void)qtype;
    return 0;
#endif
}

/*
 * y[M, N] = x[M, K] @ W[N, K]^T with x quantized to int8 per 32 values first (see the top of
 * this file). Returns -1, having written nothing, for a type vl_has_int8 refuses or when the
 * scratch memory cannot be had.
 */
int vl_matmul_int8(int qtype, int digits, const float *x, int64_t M, int64_t K, const uint8_t *w,
                   int64_t N, float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (!vl_has_int8(qtype) || (digits != 1 && digits != 2)) return -1;
    const int8_rows_fn rows_fn = INT8_ROWS_OF[qtype];
    int8_t *q = malloc((size_t)(digits * M * K));
    float *scales = malloc(sizeof(float) * (size_t)(M * (K / 32 + K / 16)));
    int8_row *rows = malloc(sizeof(int8_row) * (size_t)M);
    if (q == NULL || scales == NULL || rows == NULL) {
        free(q);
        free(scales);
        free(rows);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        float *d = scales + m * (K / 32 + K / 16), *s = d + K / 32;
        int8_t *low = digits == 2 ? q + (M + m) * K : NULL;
        quantize_row_int8(x + m * K, K, q + m * K, low, d, s);
        rows[m] = (int8_row){q + m * K, low, d, s};
    }
    const int64_t chunk = 16, num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < num_chunks; c++)
        rows_fn(rows, M, K, w, N, c * chunk, (c + 1) * chunk < N ? (c + 1) * chunk : N, y);
    free(q);
    free(scales);
    free(rows);
    return 0;
#else
    (void)qtype, (void)digits, (void)x, (void)M, (void)K, (void)w, (void)N, (void)y, (void)num_threads;
    return -1;
#endif
}
