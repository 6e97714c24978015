/*
 * Products of GGUF block-quantized weights with activations quantized to integers (AVX2), as
 * llama.cpp multiplies on the CPU: integer dot products of 32 values in a few instructions,
 * where the float path converts and multiplies every value. Included by gguf_blocks.c
 * (it uses that file's TYPES, fp16_to_fp32, split_nibbles, fifth_bits, k_scale_min,
 * q3_k_scale).
 *
 * Activations: each row of x is cut into blocks of 32 values, and a block keeps integers
 * and one float scale d, at one of two precisions:
 *
 *   - int8 (llama.cpp's): q = round(x / d), d = max |x| / 127;
 *   - int16 (about 15 bits): v = round(x / d), d = max |x| / 32258 (= 127 * 254). The
 *     32-value types multiply v by their values widened to 16 bits (madd); the 256-value
 *     types, whose int8 decoding is cheaper than widening, multiply its two int8 digits
 *     v = 254 q + l (|l| <= 127) and join the two integer sums as 254 * sum(w q) + sum(w l).
 *
 * plus the float sums s of each block's two halves of x (one per 16 values) for the types
 * with an offset, which multiply them unrounded.
 *
 * Weights: every type's values are, per 32-value chunk, integers w times a float a, with
 * 16-bit integer sub-scales per 16 values for the types that have them, plus an offset b
 * per 16 values: value = a * scale * w + b. So a chunk contributes
 *
 *     a * d * sum_halves(scale * sum(w * q)) + b_lo * s_lo + b_hi * s_hi
 *
 * with the integer part exact (maddubs: u8 x s8 pairs into 16 bits, at most 2 * 128 * 127;
 * madd by the sub-scales or v into 32 bits) and converted to float once per chunk (exactly
 * below 2^24; the int16 sums of Q6_K's largest sub-scales are rounded there, by at most
 * 2^-24 of the sum). Signed weights go through maddubs as |w| and q * sign(w); Q4_0 and
 * Q5_0 at int16 multiply their unsigned nibbles and take the - 8 a (- 16 a) as an offset.
 * The weights are exactly the file's values; only the activations multiplying w are rounded
 * (int8: about 0.4% of a block's largest value), which the agreement oracle judges per type
 * (see docs). Each row's result is summed in one order, chunk after chunk, whatever the
 * batch, so a row gives the same bits alone or in any batch.
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
    const int8_t *q;    /* [K]: int8, or int16's first digit */
    const int8_t *low;  /* [K]: int16's second digit, or NULL */
    const int16_t *v16; /* [K]: int16 values, or NULL */
    const float *d;     /* [K / 32] */
    const float *s;     /* [K / 16]: the sum of x over each 16 values */
} int8_row;

/* One weight block as int8 chunks (a 32-value type uses chunk 0 and b[0..1]). */
typedef struct {
    __m256i w[8];     /* 32 values per chunk */
    __m256i scale[8]; /* 16-bit sub-scales: lanes 0..7 for values 0..15, 8..15 for 16..31 */
    float a[8];
    float b[16];
} int8_block;

/* The largest |x| of the 32 values at p, and the four vectors of them. */
static inline float block_largest(const float *p, __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(p + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

static inline __m256i round_lanes(__m256 v, float inverse) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(inverse)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* One row of x to int8 (q, d = max / 127 per block), and the sums s of each 16 values. */
static void quantize_row_int8(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m256 v[4];
        const float largest = block_largest(x + 32 * blk, v);
        const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        __m256i lanes[4];
        for (int j = 0; j < 4; j++) lanes[j] = round_lanes(v[j], inverse);
        store_int8(lanes, q + 32 * blk);
        d[blk] = largest / 127.0f;
        for (int h = 0; h < 2; h++) s[2 * blk + h] = int8_hsum(_mm256_add_ps(v[2 * h], v[2 * h + 1]));
    }
}

/* One row of x to int16 (v, d = max / 32258 per block), as v itself (v16) or as its two
 * int8 digits v = 254 q + l (q, low): whichever is not NULL; and the sums s. */
static void quantize_row_int16(const float *x, int64_t K, int16_t *v16, int8_t *q, int8_t *low,
                               float *d, float *s) {
    const __m256 per_digit = _mm256_set1_ps(1.0f / 254.0f);
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m256 v[4];
        const float largest = block_largest(x + 32 * blk, v);
        const float inverse = largest > 0.0f ? 32258.0f / largest : 0.0f;
        __m256i lanes[4];
        for (int j = 0; j < 4; j++) lanes[j] = round_lanes(v[j], inverse);
        if (v16 != NULL)
            for (int h = 0; h < 2; h++) /* packs interleaves 128-bit halves: permute back */
                _mm256_storeu_si256((__m256i *)(v16 + 32 * blk + 16 * h),
                                    _mm256_permute4x64_epi64(
                                        _mm256_packs_epi32(lanes[2 * h], lanes[2 * h + 1]), 0xD8));
        if (q != NULL) {
            __m256i high[4], rest[4];
            for (int j = 0; j < 4; j++) {
                high[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(lanes[j]), per_digit));
                rest[j] = _mm256_sub_epi32(lanes[j], _mm256_mullo_epi32(high[j], _mm256_set1_epi32(254)));
            }
            store_int8(high, q + 32 * blk);
            store_int8(rest, low + 32 * blk);
        }
        d[blk] = largest / 32258.0f;
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

/* sum(w * x) per 16 lanes of 2 values (16 bits: at most 2 * 128 * 127). */
static inline __m256i int8_pairs(__m256i w, __m256i x, int is_signed) {
    return is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                     : _mm256_maddubs_epi16(w, x);
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
    const __m256i ones = _mm256_set1_epi16(1), digit = _mm256_set1_epi16(254);
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
                    __m256i sums = _mm256_madd_epi16(int8_pairs(wv, xq, is_signed),
                                                     TWO ? _mm256_mullo_epi16(sub, digit) : sub);
                    if (TWO) /* 254 sum(w q) + sum(w l): at most 2^30 (Q6_K) */
                        sums = _mm256_add_epi32(
                            sums, _mm256_madd_epi16(int8_pairs(wv, xl, is_signed), sub));
                    acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(blocks[r].a[c] * d[c]),
                                                _mm256_cvtepi32_ps(sums), acc[i][r]);
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

/* The body of a rows function: rows n0..n1 of W against every row of x, in tiles of up to
 * INT8_MAX_ROWS rows of x by four rows of W (TILE(MR, NR) multiplies one); a single row of
 * x with MR = 1 as a constant, so its accumulators live in registers. */
#define TILED_ROWS(TILE)                                                          \
    for (int64_t m = 0; m < M; m += INT8_MAX_ROWS) {                              \
        const int rows = M - m < INT8_MAX_ROWS ? (int)(M - m) : INT8_MAX_ROWS;    \
        int64_t n = n0;                                                           \
        if (rows == 1) {                                                          \
            for (; n + 4 <= n1; n += 4) TILE(1, 4);                               \
            for (; n < n1; n++) TILE(1, 1);                                       \
        } else {                                                                  \
            for (; n + 4 <= n1; n += 4) TILE(rows, 4);                            \
            for (; n < n1; n++) TILE(rows, 1);                                    \
        }                                                                         \
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
    TILED_ROWS(INT8_TILE)
}

/* ---- int16 activations: values widened to 16 bits ---------------------------------------- */

static inline int int16_has_offset(int qtype) {
    return qtype == VL_Q4_0 || qtype == VL_Q4_1 || qtype == VL_Q5_0 || qtype == VL_Q5_1 ||
           qtype == VL_Q4_K;
}

/* Per chunk of 32 values of block b: value = a[c] * w + offset[c] (Q4_0 and Q5_0: their
 * unsigned values and - 8 d, - 16 d; Q4_K: minus its minimum). */
static inline __attribute__((always_inline)) void int16_scales(int qtype, const uint8_t *b,
                                                               float *a, float *offset) {
    switch (qtype) {
    case VL_Q4_0:
    case VL_Q5_0:
        a[0] = fp16_to_fp32(b);
        offset[0] = (qtype == VL_Q4_0 ? -8.0f : -16.0f) * a[0];
        break;
    case VL_Q4_1:
    case VL_Q5_1:
        a[0] = fp16_to_fp32(b);
        offset[0] = fp16_to_fp32(b + 2);
        break;
    case VL_Q8_0:
    case VL_IQ4_NL:
        a[0] = fp16_to_fp32(b);
        offset[0] = 0.0f;
        break;
    case VL_IQ4_XS: {
        const float d = fp16_to_fp32(b);
        uint16_t scales_h;
        memcpy(&scales_h, b + 2, 2);
        for (int c = 0; c < 8; c++) {
            const int low = (b[4 + c / 2] >> (4 * (c % 2))) & 15, high = (scales_h >> (2 * c)) & 3;
            a[c] = d * (float)((low | (high << 4)) - 32);
            offset[c] = 0.0f;
        }
        break;
    }
    case VL_Q4_K: {
        const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
        int sc[8], mn[8];
        k_scale_min(b + 4, sc, mn);
        for (int c = 0; c < 8; c++) {
            a[c] = d * (float)sc[c];
            offset[c] = -(dmin * (float)mn[c]);
        }
        break;
    }
    }
}

/* IQ4's 16 bytes of nibbles -> its 32 table values as 16-bit lanes (low nibbles first). */
static inline void iq4_int16(const uint8_t *qs, __m256i *lo, __m256i *hi) {
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), l4 = _mm_set1_epi8(15);
    *lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(bytes, l4)));
    *hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), l4)));
}

/* Chunk c of block b as 16-bit integers w: values 0..15 in lo, 16..31 in hi. */
static inline __attribute__((always_inline)) void int16_values(int qtype, const uint8_t *b,
                                                               int c, __m256i *lo,
                                                               __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi16(15);
    switch (qtype) {
    case VL_Q4_0:
    case VL_Q4_1: {
        const __m256i v = _mm256_cvtepu8_epi16(
            _mm_loadu_si128((const __m128i *)(b + (qtype == VL_Q4_1 ? 4 : 2))));
        *lo = _mm256_and_si256(v, low4);
        *hi = _mm256_srli_epi16(v, 4);
        break;
    }
    case VL_Q5_0:
    case VL_Q5_1: { /* fifth bit j of qh: value j's 16 */
        const int with_min = qtype == VL_Q5_1;
        uint32_t qh;
        memcpy(&qh, b + (with_min ? 4 : 2), 4);
        const __m256i v =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + (with_min ? 8 : 6))));
        const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                              4096, 8192, 16384, (short)-32768);
        const __m256i sixteen = _mm256_set1_epi16(16);
        const __m256i h0 = _mm256_and_si256(_mm256_set1_epi16((short)(qh & 0xFFFF)), bit);
        const __m256i h1 = _mm256_and_si256(_mm256_set1_epi16((short)(qh >> 16)), bit);
        *lo = _mm256_or_si256(_mm256_and_si256(v, low4),
                              _mm256_and_si256(_mm256_cmpeq_epi16(h0, bit), sixteen));
        *hi = _mm256_or_si256(_mm256_srli_epi16(v, 4),
                              _mm256_and_si256(_mm256_cmpeq_epi16(h1, bit), sixteen));
        break;
    }
    case VL_Q8_0: {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 2));
        *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
        break;
    }
    case VL_IQ4_NL:
        iq4_int16(b + 2, lo, hi);
        break;
    case VL_IQ4_XS:
        iq4_int16(b + 8 + 16 * c, lo, hi);
        break;
    case VL_Q4_K: { /* chunk c: nibble c % 2 of qs[32 (c / 2) + l] */
        const uint8_t *qs = b + 16 + 32 * (c / 2);
        const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
        const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
        *lo = c % 2 ? _mm256_srli_epi16(v0, 4) : _mm256_and_si256(v0, low4);
        *hi = c % 2 ? _mm256_srli_epi16(v1, 4) : _mm256_and_si256(v1, low4);
        break;
    }
    }
}

/* The 8 sums of x over each 32 values of a 256-value block, from its 16 sums s over 16. */
static inline __m256 chunk_sums(const float *s) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
    /* hadd keeps 128-bit lanes: chunks 0 1 4 5 | 2 3 6 7 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(pairs), 0xD8));
}

/* int8_tile's shape for the widened types: each chunk of the NR rows of W is widened once
 * (in registers) for all MR rows of x; sum(w v) per 32 values is below 2^24 (|w| <= 128,
 * |v| <= 32258), so its float is exact. A 256-value block's 8 scales a * d and offsets
 * b * s are taken 8 at a time (vectors), a 32-value block's one by one. */
static inline __attribute__((always_inline)) void int16_tile(int qtype, const int MR,
                                                             const int NR, const int8_row *x,
                                                             int64_t K, const uint8_t *w,
                                                             int64_t row_bytes, float *y,
                                                             int64_t ldy) {
    const int values = TYPES[qtype].values, bytes = TYPES[qtype].bytes, chunks = values / 32;
    const int has_offset = int16_has_offset(qtype);
    __m256 acc[INT8_MAX_ROWS][4], offsets[INT8_MAX_ROWS][4];
    float offset[INT8_MAX_ROWS][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) {
            acc[i][r] = offsets[i][r] = _mm256_setzero_ps();
            offset[i][r] = 0.0f;
        }
    float ad[INT8_MAX_ROWS][4][8]; /* a 256-value block's a * d per chunk */
    for (int64_t blk = 0; blk < K / values; blk++) {
        const char *ahead = (const char *)w + PREFETCH_TILES * NR * row_bytes + blk * NR * bytes;
        for (int line = 0; line < NR * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        float a[4][8], b[4][8];
        for (int r = 0; r < NR; r++) int16_scales(qtype, w + r * row_bytes + blk * bytes, a[r], b[r]);
        if (chunks == 8)
            for (int i = 0; i < MR; i++) {
                const __m256 d = _mm256_loadu_ps(x[i].d + 8 * blk);
                const __m256 sums = has_offset ? chunk_sums(x[i].s + 16 * blk) : d;
                for (int r = 0; r < NR; r++) {
                    _mm256_storeu_ps(ad[i][r], _mm256_mul_ps(_mm256_loadu_ps(a[r]), d));
                    if (has_offset)
                        offsets[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(b[r]), sums, offsets[i][r]);
                }
            }
        for (int c = 0; c < chunks; c++) {
            __m256i lo[4], hi[4];
            for (int r = 0; r < NR; r++)
                int16_values(qtype, w + r * row_bytes + blk * bytes, c, &lo[r], &hi[r]);
            for (int i = 0; i < MR; i++) {
                const int64_t k = blk * values + 32 * c, g = k / 32;
                const __m256i xa = _mm256_loadu_si256((const __m256i *)(x[i].v16 + k));
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(x[i].v16 + k + 16));
                for (int r = 0; r < NR; r++) {
                    const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(lo[r], xa),
                                                          _mm256_madd_epi16(hi[r], xb));
                    const __m256 scale = chunks == 8 ? _mm256_broadcast_ss(&ad[i][r][c])
                                                     : _mm256_set1_ps(a[r][0] * x[i].d[g]);
                    acc[i][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[i][r]);
                    if (has_offset && chunks == 1)
                        offset[i][r] += b[r][0] * (x[i].s[2 * g] + x[i].s[2 * g + 1]);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++)
            y[i * ldy + r] = int8_hsum(acc[i][r]) + (chunks == 8 ? int8_hsum(offsets[i][r])
                                                                  : offset[i][r]);
}

#define INT16_TILE(MR, NR) \
    int16_tile(qtype, MR, NR, x + m, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

static inline __attribute__((always_inline)) void int16_rows(int qtype, const int8_row *x,
                                                             int64_t M, int64_t K,
                                                             const uint8_t *w, int64_t N,
                                                             int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / TYPES[qtype].values * TYPES[qtype].bytes;
    TILED_ROWS(INT16_TILE)
}

/* ---- one function per type and precision ---------------------------------------------- */

typedef void (*int8_rows_fn)(const int8_row *, int64_t, int64_t, const uint8_t *, int64_t,
                             int64_t, int64_t, float *);

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

static const int8_rows_fn INT8_ROWS_OF[VL_NUM_TYPES] = {
    [VL_Q4_0] = q4_0_int8_rows,   [VL_Q4_1] = q4_1_int8_rows, [VL_Q8_0] = q8_0_int8_rows,
    [VL_Q5_0] = q5_0_int8_rows,   [VL_Q5_1] = q5_1_int8_rows, [VL_IQ4_NL] = iq4_nl_int8_rows,
    [VL_Q2_K] = q2_k_int8_rows,   [VL_Q3_K] = q3_k_int8_rows, [VL_Q4_K] = q4_k_int8_rows,
    [VL_Q5_K] = q5_k_int8_rows,   [VL_Q6_K] = q6_k_int8_rows, [VL_IQ4_XS] = iq4_xs_int8_rows,
};

#define INT16_ROWS(name, code)                                                               \
    static void name##_int16_rows(const int8_row *x, int64_t M, int64_t K, const uint8_t *w, \
                                  int64_t N, int64_t n0, int64_t n1, float *y) {             \
        int16_rows(code, x, M, K, w, N, n0, n1, y);                                          \
    }
INT16_ROWS(q4_0, VL_Q4_0)
INT16_ROWS(q4_1, VL_Q4_1)
INT16_ROWS(q8_0, VL_Q8_0)
INT16_ROWS(q5_0, VL_Q5_0)
INT16_ROWS(q5_1, VL_Q5_1)
INT16_ROWS(iq4_nl, VL_IQ4_NL)
INT16_ROWS(iq4_xs, VL_IQ4_XS)
INT16_ROWS(q4_k, VL_Q4_K)

/* The types int16 activations multiply by values widened to 16 bits (madd), 32 at a time:
 * those whose widening costs no more than decoding to bytes. The others multiply the int16
 * values' two int8 digits (INT8_ROWS_OF with the second digit). */
static const int8_rows_fn WIDENED_ROWS_OF[VL_NUM_TYPES] = {
    [VL_Q4_0] = q4_0_int16_rows,   [VL_Q4_1] = q4_1_int16_rows, [VL_Q8_0] = q8_0_int16_rows,
    [VL_Q5_0] = q5_0_int16_rows,   [VL_Q5_1] = q5_1_int16_rows, [VL_IQ4_NL] = iq4_nl_int16_rows,
    [VL_IQ4_XS] = iq4_xs_int16_rows, [VL_Q4_K] = q4_k_int16_rows,
};
#endif

/* 1 when vl_matmul_quantized multiplies this type (AVX2 builds; every quantized type). */
int vl_has_quantized_activations(int qtype) {
#if defined(__AVX2__) && defined(__FMA__)
    return qtype >= 0 && qtype < VL_NUM_TYPES && INT8_ROWS_OF[qtype] != NULL;
#else
    (void)qtype;
    return 0;
#endif
}

/*
 * y[M, N] = x[M, K] @ W[N, K]^T with x quantized per 32 values first to `bits` 8 or 16 (see
 * the top of this file). Returns -1, having written nothing, for a type
 * vl_has_quantized_activations refuses, other bits, or when the scratch memory cannot be
 * had.
 */
int vl_matmul_quantized(int qtype, int bits, const float *x, int64_t M, int64_t K,
                        const uint8_t *w, int64_t N, float *y, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (!vl_has_quantized_activations(qtype) || (bits != 8 && bits != 16)) return -1;
    const int widened = bits == 16 && WIDENED_ROWS_OF[qtype] != NULL;
    const int8_rows_fn rows_fn = (widened ? WIDENED_ROWS_OF : INT8_ROWS_OF)[qtype];
    int8_t *q = malloc((size_t)(bits / 8 * M * K));
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
        int8_row row = {q + m * K, NULL, NULL, d, s};
        if (widened) {
            row = (int8_row){NULL, NULL, (int16_t *)q + m * K, d, s};
            quantize_row_int16(x + m * K, K, (int16_t *)q + m * K, NULL, NULL, d, s);
        } else if (bits == 16) {
            row.low = q + (M + m) * K;
            quantize_row_int16(x + m * K, K, NULL, q + m * K, q + (M + m) * K, d, s);
        } else {
            quantize_row_int8(x + m * K, K, q + m * K, d, s);
        }
        rows[m] = row;
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
    (void)qtype, (void)bits, (void)x, (void)M, (void)K, (void)w, (void)N, (void)y, (void)num_threads;
    return -1;
#endif
}
