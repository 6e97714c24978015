/*
 * Products of GGUF block-quantized weights with activations quantized to integers (AVX2; with
 * AVX-512 VNNI, Q4_K and Q6_K two chunks per 512-bit instruction, and int16 products of many
 * rows as int16_gemm.h's GEMM), as llama.cpp multiplies
 * on the CPU: integer dot products of 32 values in a few instructions,
 * where the float path converts and multiplies every value. Included by gguf_blocks.c
 * (it uses that file's TYPES, fp16_to_fp32, split_nibbles, fifth_bits, k_scale_min,
 * q3_k_scale).
 *
 * Activations: each row of x is cut into blocks of 32 values, and a block keeps integers
 * and one float scale d, at one of two precisions:
 *
 *   - int8 (llama.cpp's): q = round(x / d), d = max |x| / 127, multiplied by the weights'
 *     int8 values with maddubs (u8 x s8 pairs into 16 bits, at most 2 * 128 * 127; signed
 *     weights as |w| and q * sign(w)), then by their sub-scales with madd;
 *   - int16 (about 15 bits): v = round(x / d), d = max |x| / 32258 (127 * 254), multiplied
 *     by the weights' values widened to 16 bits with madd (the 256-value types' bytes split
 *     into even and odd lanes, their activations stored in that order: see k16_tile);
 *
 * plus the float sums s of x over each 16 and each 32 values for the types with an offset,
 * which multiply them unrounded.
 *
 * Weights: every type's values are integers w times a float scale a per 16 or 32 values
 * (a 16-bit integer sub-scale per 16 in the int8 kernels of Q2_K, Q3_K, Q6_K), plus an
 * offset b per 16 or 32 values: value = a * w + b. So a group contributes
 *
 *     a * d * sum(w * v) + b * s
 *
 * with the integer sum exact and converted to float once per group (exactly below 2^24;
 * larger sums are rounded there, by at most 2^-24 of the sum). Q4_0 and Q5_0 at int16
 * multiply their unsigned nibbles and take the - 8 a (- 16 a) as an offset. The weights are
 * exactly the file's values; only the activations multiplying w are rounded (int8: about
 * 0.4% of a block's largest value), which the agreement oracle judges per type (see docs).
 * Each row's result is summed in one order, block after block, whatever the batch, so a row
 * gives the same bits alone or in any batch (of the tiles: int16_gemm.h sums in its own).
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
    const int8_t *q;    /* [K]: int8 values, or NULL */
    const int16_t *v16; /* [K]: int16 values, or NULL */
    const float *d;     /* [K / 32] */
    const float *s;     /* [K / 16]: the sum of x over each 16 values */
    const float *s32;   /* [K / 32]: over each 32 */
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

/* Block blk of the row x rounded to steps of d = max |x| / levels: its 32 integers (lanes,
 * in order of x) and d, and the sums of x over each 16 (s) and the 32 (s32) values. */
static inline void round_block(const float *x, int64_t blk, float levels, __m256i lanes[4],
                               float *d, float *s, float *s32) {
    __m256 v[4];
    const float largest = block_largest(x + 32 * blk, v);
    const float inverse = largest > 0.0f ? levels / largest : 0.0f;
    for (int j = 0; j < 4; j++) lanes[j] = round_lanes(v[j], inverse);
    d[blk] = largest / levels;
    for (int h = 0; h < 2; h++) s[2 * blk + h] = int8_hsum(_mm256_add_ps(v[2 * h], v[2 * h + 1]));
    s32[blk] = s[2 * blk] + s[2 * blk + 1];
}

/* One row of x to int8 (q, d = max / 127 per block). */
static void quantize_row_int8(const float *x, int64_t K, int8_t *q, float *d, float *s,
                              float *s32) {
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m256i lanes[4];
        round_block(x, blk, 127.0f, lanes, d, s, s32);
        store_int8(lanes, q + 32 * blk);
    }
}

/* The order of a row's int16 values: as they come, each 32 values' 16 even then 16 odd
 * values (the 256-value types'), or in the wide kernel's pairs (k16_wide). */
enum { INT16_IN_ORDER = 0, INT16_EVEN_ODD = 1, INT16_PAIRS = 2 };

/* The first chunk of each pair (c, c + 2) the wide kernel multiplies at once, in order. */
static const int PAIR_FIRST[4] = {0, 1, 4, 5};

/* A 256-value block's int16 values from EVEN_ODD to PAIRS order: per pair p, the even
 * values of chunks c and c + 2 (c = PAIR_FIRST[p]), then their odd values. */
static void int16_pairs(int16_t *block) {
    int16_t even_odd[256];
    memcpy(even_odd, block, sizeof even_odd);
    for (int p = 0; p < 4; p++) {
        const int c = PAIR_FIRST[p];
        int16_t *out = block + 64 * p;
        memcpy(out, even_odd + 32 * c, 32);             /* even of c */
        memcpy(out + 16, even_odd + 32 * (c + 2), 32);  /* even of c + 2 */
        memcpy(out + 32, even_odd + 32 * c + 16, 32);   /* odd of c */
        memcpy(out + 48, even_odd + 32 * (c + 2) + 16, 32);
    }
}

/* One row of x to int16 (v16, d = max / 32258 per block), in `order` (INT16_*). */
static void quantize_row_int16(const float *x, int64_t K, int16_t *v16, int order, float *d,
                               float *s, float *s32) {
    const int even_odd = order != INT16_IN_ORDER;
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m256i lanes[4];
        round_block(x, blk, 32258.0f, lanes, d, s, s32);
        int16_t *out = v16 + 32 * blk;
        for (int h = 0; h < 2; h++) /* packs interleaves 128-bit halves: permute back */
            _mm256_storeu_si256((__m256i *)(out + 16 * h),
                                _mm256_permute4x64_epi64(
                                    _mm256_packs_epi32(lanes[2 * h], lanes[2 * h + 1]), 0xD8));
        if (even_odd) {
            int16_t values[32];
            memcpy(values, out, sizeof values);
            for (int l = 0; l < 16; l++) {
                out[l] = values[2 * l];
                out[16 + l] = values[2 * l + 1];
            }
        }
        if (order == INT16_PAIRS && blk % 8 == 7) int16_pairs(v16 + 32 * (blk - 7));
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

/* IQ4's 16 bytes of nibbles -> the table values of the low nibbles (values 0..15) and of
 * the high ones (16..31). */
static inline void iq4_halves(const uint8_t *qs, __m128i *low, __m128i *high) {
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    *low = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
    *high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
}

/* IQ4's 16 bytes of nibbles -> 32 table values (low nibbles first). */
static inline __m256i iq4_int8(const uint8_t *qs) {
    __m128i low, high;
    iq4_halves(qs, &low, &high);
    return _mm256_set_m128i(high, low);
}

/* Chunk c (values 32 c .. 32 c + 31) of a K-quant block as 32 bytes, byte l for value
 * 32 c + l: Q2_K, Q4_K and Q5_K unsigned, Q3_K and Q6_K signed (their - 4, - 32 applied). */
static inline __attribute__((always_inline)) __m256i k_chunk_bytes(int qtype, const uint8_t *b,
                                                                   int c) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i two_bits = _mm256_set1_epi8(3);
    const int h = c / 4, s = c % 4;
    switch (qtype) {
    case VL_Q2_K: /* bits 2 s of qs[32 h + l] */
        return _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h)), 2 * s),
            two_bits);
    case VL_Q3_K: { /* bits 2 s of qs[32 h + l], bit 4 h + s of hmask[l] as the third */
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * s), two_bits);
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one);
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(bit, 2)),
                               _mm256_set1_epi8(4));
    }
    case VL_Q4_K:
    case VL_Q5_K: { /* nibble c % 2 of qs[32 (c / 2) + l]; Q5_K: bit c of qh[l] as the fifth */
        const int five = qtype == VL_Q5_K;
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + (five ? 48 : 16) + 32 * (c / 2)));
        const __m256i w = _mm256_and_si256(_mm256_srli_epi16(bytes, 4 * (c % 2)), low4);
        if (!five) return w;
        const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 16));
        return _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, c), one), 4));
    }
    default: { /* Q6_K: nibble s / 2 of ql[64 h + 32 (s % 2) + l], bits 2 s of qh[32 h + l] */
        const __m256i low_bytes = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s % 2)));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(low_bytes, 4 * (s / 2)), low4);
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(high, 2 * s), two_bits);
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
    }
    }
}

static inline __attribute__((always_inline)) void int8_decode(int qtype, const uint8_t *b,
                                                              int8_block *o) {
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
    case VL_Q2_K: {
        const uint8_t *scales = b;
        const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
        for (int c = 0; c < 8; c++) {
            o->w[c] = k_chunk_bytes(qtype, b, c);
            o->scale[c] = int8_scales(scales[2 * c] & 15, scales[2 * c + 1] & 15);
            o->a[c] = d;
            o->b[2 * c] = -(dmin * (float)(scales[2 * c] >> 4));
            o->b[2 * c + 1] = -(dmin * (float)(scales[2 * c + 1] >> 4));
        }
        break;
    }
    case VL_Q3_K: {
        const float d = fp16_to_fp32(b + 108);
        for (int c = 0; c < 8; c++) {
            o->w[c] = k_chunk_bytes(qtype, b, c);
            o->scale[c] = int8_scales(q3_k_scale(b + 96, 2 * c), q3_k_scale(b + 96, 2 * c + 1));
            o->a[c] = d;
        }
        break;
    }
    case VL_Q4_K:
    case VL_Q5_K: {
        const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
        int sc[8], mn[8];
        k_scale_min(b + 4, sc, mn);
        for (int c = 0; c < 8; c++) {
            o->w[c] = k_chunk_bytes(qtype, b, c);
            o->a[c] = d * (float)sc[c];
            o->b[2 * c] = o->b[2 * c + 1] = -(dmin * (float)mn[c]);
        }
        break;
    }
    case VL_Q6_K: {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = fp16_to_fp32(b + 208);
        for (int c = 0; c < 8; c++) {
            o->w[c] = k_chunk_bytes(qtype, b, c);
            o->scale[c] = int8_scales(scales[2 * c], scales[2 * c + 1]);
            o->a[c] = d;
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

/* acc + sum(a * b) per pair of 16-bit lanes: VNNI's one instruction where the CPU has it
 * (the same int32 results: no saturation either way). */
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* Bytes of W the 256-value kernels prefetch ahead of the rows they read. */
#define K16_AHEAD 8192

/* Rows of x a tile takes at most (a decode step's: fewer than the GEMM's 32). */
#define INT8_MAX_ROWS 32

/* MR rows of x by NR rows of W over all of K; y[i * ldy + r]. Each block of the NR rows of
 * W is decoded once for all MR rows of x. With MR = 1 (a constant) the accumulators live in
 * registers; otherwise in this stack frame (L1): the same operations in the same order, so
 * the same bits. */
static inline __attribute__((always_inline)) void int8_tile(int qtype, const int MR,
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
            const float *d = x[i].d + blk * chunks, *s = x[i].s + 2 * blk * chunks;
            for (int c = 0; c < chunks; c++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                for (int r = 0; r < NR; r++) {
                    const __m256i wv = blocks[r].w[c];
                    const __m256i sub = int8_has_subscales(qtype) ? blocks[r].scale[c] : ones;
                    const __m256i sums = _mm256_madd_epi16(int8_pairs(wv, xq, is_signed), sub);
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
    int8_tile(qtype, MR, NR, x + m, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

/* Rows n0..n1 of W against every row of x: tiles of all (up to 32) rows of x by four rows
 * of W, so a block is decoded once per step, not once per row of x (a K-quant's decoding
 * costs as much as its products). */
static inline __attribute__((always_inline)) void int8_rows(int qtype, const int8_row *x,
                                                            int64_t M, int64_t K,
                                                            const uint8_t *w, int64_t N,
                                                            int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / TYPES[qtype].values * TYPES[qtype].bytes;
    TILED_ROWS(INT8_TILE)
}

/* ---- int16 activations on 32-value blocks: values widened to 16 bits --------------------- */

/* Q4_0 and Q5_0 are multiplied by their unsigned values, their - 8 d and - 16 d taken as
 * an offset on the exact activations (by the tiles, the row lanes and the GEMM alike). */
static inline int int16_bias(int qtype) {
    return qtype == VL_Q4_0 ? 8 : qtype == VL_Q5_0 ? 16 : 0;
}

/* The 32-value types with a minimum per block (value = d w + m). */
static inline int int16_has_minimum(int qtype) { return qtype == VL_Q4_1 || qtype == VL_Q5_1; }

static inline int int16_has_offset(int qtype) {
    return int16_bias(qtype) != 0 || int16_has_minimum(qtype);
}

/* Block b's 32 values as 16-bit integers w: values 0..15 in lo, 16..31 in hi. */
static inline __attribute__((always_inline)) void int16_values(int qtype, const uint8_t *b,
                                                               __m256i *lo, __m256i *hi) {
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
    default: { /* IQ4_NL: each half widened from its own 128 bits */
        __m128i low, high;
        iq4_halves(b + 2, &low, &high);
        *lo = _mm256_cvtepi8_epi16(low);
        *hi = _mm256_cvtepi8_epi16(high);
    }
    }
}

/* Lane r of the result: the sum of v[r]'s 8 lanes (integers: exact in any order). */
static inline __m128i sum_lanes4(const __m256i v[4]) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The block scales and offsets of rows 0 .. NR - 1 at b, b + row_bytes, ... (value = scale *
 * w + offset; lanes past NR repeat row 0's): the rows' first 4 bytes (d, and Q4_1's and
 * Q5_1's m) converted together, in registers. */
static inline __attribute__((always_inline)) void int16_scales4(int qtype, const int NR,
                                                                const uint8_t *b,
                                                                int64_t row_bytes,
                                                                __m128 *scale, __m128 *offset) {
    int32_t h[4];
    for (int r = 0; r < 4; r++) memcpy(&h[r], b + (r < NR ? r : 0) * row_bytes, 4);
    const __m256 halves = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3])),
        _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)); /* d of the 4 rows, then their m */
    *scale = _mm256_castps256_ps128(halves);
    if (int16_has_minimum(qtype))
        *offset = _mm256_extractf128_ps(halves, 1);
    else /* - 8 d, - 16 d (Q4_0, Q5_0); Q8_0 and IQ4_NL have no offset */
        *offset = _mm_mul_ps(_mm_set1_ps(-(float)int16_bias(qtype)), *scale);
}

/* int8_tile's shape for the 32-value types, with the int16 GEMM's arithmetic: each block of
 * the NR rows of W is widened once (in registers) for all MR rows of x; each pair of rows
 * sums the block's 32 products in integers (exact), and adds the sum, converted, times the
 * block's scale times the activations' scale, then the block's offset times the
 * activations' sum: the same operations in the same order as int16_gemm.h's (and
 * row_lanes.h's), so a row of y has the same bits from any of them, in a batch of any size. */
static inline __attribute__((always_inline)) void int16_tile(int qtype, const int MR,
                                                             const int NR, const int8_row *x,
                                                             int64_t K, const uint8_t *w,
                                                             int64_t row_bytes, float *y,
                                                             int64_t ldy) {
    const int bytes = TYPES[qtype].bytes, has_offset = int16_has_offset(qtype);
    __m128 acc[INT8_MAX_ROWS]; /* lane r: row r of the NR rows of W */
    for (int i = 0; i < MR; i++) acc[i] = _mm_setzero_ps();
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const char *ahead = (const char *)w + PREFETCH_TILES * NR * row_bytes + blk * NR * bytes;
        for (int line = 0; line < NR * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        __m256i lo[4], hi[4];
        for (int r = 0; r < NR; r++) int16_values(qtype, w + r * row_bytes + blk * bytes, &lo[r], &hi[r]);
        __m128 scale, offset;
        int16_scales4(qtype, NR, w + blk * bytes, row_bytes, &scale, &offset);
        for (int i = 0; i < MR; i++) {
            const __m256i xa = _mm256_loadu_si256((const __m256i *)(x[i].v16 + 32 * blk));
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(x[i].v16 + 32 * blk + 16));
            __m256i lanes[4];
            for (int r = 0; r < 4; r++)
                lanes[r] = r < NR ? madd_add(_mm256_madd_epi16(lo[r], xa), hi[r], xb)
                                  : _mm256_setzero_si256();
            const __m128 sums = _mm_cvtepi32_ps(sum_lanes4(lanes));
            acc[i] = _mm_fmadd_ps(_mm_mul_ps(scale, _mm_set1_ps(x[i].d[blk])), sums, acc[i]);
            if (has_offset) acc[i] = _mm_fmadd_ps(offset, _mm_set1_ps(x[i].s32[blk]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) {
        float out[4];
        _mm_storeu_ps(out, acc[i]);
        for (int r = 0; r < NR; r++) y[i * ldy + r] = out[r];
    }
}

#define INT16_TILE(MR, NR) \
    int16_tile(qtype, MR, NR, x + m, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

static inline __attribute__((always_inline)) void int16_rows(int qtype, const int8_row *x,
                                                             int64_t M, int64_t K,
                                                             const uint8_t *w, int64_t N,
                                                             int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / 32 * TYPES[qtype].bytes;
    TILED_ROWS(INT16_TILE)
}

/* ---- int16 activations on 256-value blocks: even and odd values apart -------------------
 *
 * A 256-value type's 16-bit lanes come from its bytes without a shuffle: lane k of a
 * 32-byte vector holds bytes 2 k and 2 k + 1, so (v & 255, v >> 8) are the even and odd
 * values of a chunk (sign-extended for the signed types; Q4_K's two nibbles of each byte are
 * two more shifts). So these types' activations are stored per 32 values as the 16 even
 * values, then the 16 odd ones (quantize_row_int16's even_odd), and a chunk's product is
 * madd(even) + madd(odd): 8 int32 lanes, lanes 0..3 summing its first 16 values, 4..7 its
 * last 16. Two rounds of hadd over four chunks give their sums per 16 values, groups in
 * TREE_ORDER (g = 2 chunk + half: 0 2 4 6 1 3 5 7); the types scaled per 32 values add the
 * halves into the 8 sums per chunk. Scales and offsets come in the same order, so a block
 * ends in a few float operations per row. Each integer sum is at most 32 * 127 * 32258
 * (IQ4_XS), inside int32. */

/* Types whose scales and offsets are per 32 values (the others': per 16). */
static inline int k16_per_chunk(int qtype) {
    return qtype == VL_Q4_K || qtype == VL_Q5_K || qtype == VL_IQ4_XS;
}

/* Tree order: 8 values of groups 0..7 (or 8..15) as groups 0 2 4 6 1 3 5 7. */
static inline __m256 tree_order(__m256 groups) {
    return _mm256_permutevar8x32_ps(groups, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}

/* 8 int32 (8 bytes at p, unsigned or signed) as floats. */
static inline __m256 bytes_to_floats(const void *p, int is_signed) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* Block b's scales a and offsets o (value = a * w + o for the integers w of k16_values):
 * per chunk in a[0], o[0] (k16_per_chunk), else per 16 values in tree order, groups 0..7 in
 * a[0], o[0] and 8..15 in a[1], o[1]. */
static inline __attribute__((always_inline)) void k16_scales(int qtype, const uint8_t *b,
                                                             __m256 a[2], __m256 o[2]) {
    switch (qtype) {
    case VL_Q4_K:
    case VL_Q5_K: { /* k_scale_min's 6-bit scales and minimums, 4 bytes at a time */
        const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
        uint32_t u[4];
        memcpy(u, b + 4, 12);
        const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
        u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4); /* minimums 4..7 */
        const uint32_t minimums = u[1] & six;                         /* minimums 0..3 */
        u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);          /* scales 4..7 */
        u[2] = minimums;
        u[0] &= six; /* scales 0..3 */
        a[0] = _mm256_mul_ps(_mm256_set1_ps(d), bytes_to_floats(u, 0));
        o[0] = _mm256_mul_ps(_mm256_set1_ps(-dmin), bytes_to_floats(u + 2, 0));
        break;
    }
    case VL_IQ4_XS: { /* 6-bit scales: a nibble of scales_l[c / 2], bits 2 c of scales_h */
        uint16_t scales_h;
        uint32_t scales_l;
        memcpy(&scales_h, b + 2, 2);
        memcpy(&scales_l, b + 4, 4);
        const __m256i low = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)scales_l), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
            _mm256_set1_epi32(15));
        const __m256i high = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32(scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
            _mm256_set1_epi32(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)),
                                            _mm256_set1_epi32(32));
        a[0] = _mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(b)), _mm256_cvtepi32_ps(ls));
        o[0] = _mm256_setzero_ps();
        break;
    }
    case VL_Q2_K: { /* scales[g]: low nibble the scale, high nibble the minimum */
        const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
        for (int half = 0; half < 2; half++) {
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * half)));
            const __m256 scale = _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15)));
            const __m256 minimum = _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4));
            a[half] = tree_order(_mm256_mul_ps(_mm256_set1_ps(d), scale));
            o[half] = tree_order(_mm256_mul_ps(_mm256_set1_ps(-dmin), minimum));
        }
        break;
    }
    case VL_Q3_K: { /* q3_k_scale, 8 groups at a time */
        const uint8_t *sc = b + 96;
        const __m256 d = _mm256_set1_ps(fp16_to_fp32(b + 108));
        uint32_t high_bytes;
        memcpy(&high_bytes, sc + 8, 4);
        const __m256i low_bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        const __m256i high_shifts[2] = {_mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26),
                                        _mm256_setr_epi32(4, 12, 20, 28, 6, 14, 22, 30)};
        for (int half = 0; half < 2; half++) {
            const __m256i low = _mm256_and_si256(_mm256_srli_epi32(low_bytes, 4 * half), _mm256_set1_epi32(15));
            const __m256i high = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)high_bytes), high_shifts[half]), _mm256_set1_epi32(3));
            const __m256i scale = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)),
                                                   _mm256_set1_epi32(32));
            a[half] = tree_order(_mm256_mul_ps(d, _mm256_cvtepi32_ps(scale)));
            o[half] = _mm256_setzero_ps();
        }
        break;
    }
    default: { /* Q6_K: int8 scales */
        const float d = fp16_to_fp32(b + 208);
        for (int half = 0; half < 2; half++) {
            a[half] = tree_order(_mm256_mul_ps(_mm256_set1_ps(d), bytes_to_floats(b + 192 + 8 * half, 1)));
            o[half] = _mm256_setzero_ps();
        }
        break;
    }
    }
}

/* Block b's 256 values as 16-bit lanes: w[2 c] the even values of chunk c, w[2 c + 1] its
 * odd ones. */
static inline __attribute__((always_inline)) void k16_values(int qtype, const uint8_t *b,
                                                             __m256i w[16]) {
    const __m256i byte = _mm256_set1_epi16(255), low4 = _mm256_set1_epi16(15);
    if (qtype == VL_Q4_K) { /* a byte's two nibbles are chunks 2 j and 2 j + 1 */
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
            w[4 * j] = _mm256_and_si256(v, low4);
            w[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
            w[4 * j + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            w[4 * j + 3] = _mm256_srli_epi16(v, 12);
        }
        return;
    }
    for (int c = 0; c < 8; c++) {
        const __m256i v = qtype == VL_IQ4_XS ? iq4_int8(b + 8 + 16 * c) : k_chunk_bytes(qtype, b, c);
        if (int8_signed(qtype)) {
            w[2 * c] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
            w[2 * c + 1] = _mm256_srai_epi16(v, 8);
        } else {
            w[2 * c] = _mm256_and_si256(v, byte);
            w[2 * c + 1] = _mm256_srli_epi16(v, 8);
        }
    }
}

/* The integer sums of block blk of W (values wv) with row x: per chunk (k16_per_chunk) in
 * sums[0], else per 16 values in tree order in sums[0] (groups 0..7) and sums[1]. */
static inline __attribute__((always_inline)) void k16_sums(int qtype, const __m256i wv[16],
                                                           const int16_t *xv, __m256i sums[2]) {
    __m256i t[8];
    for (int c = 0; c < 8; c++)
        t[c] = madd_add(
            _mm256_madd_epi16(wv[2 * c], _mm256_loadu_si256((const __m256i *)(xv + 32 * c))),
            wv[2 * c + 1], _mm256_loadu_si256((const __m256i *)(xv + 32 * c + 16)));
    for (int half = 0; half < 2; half++)
        sums[half] = _mm256_hadd_epi32(_mm256_hadd_epi32(t[4 * half], t[4 * half + 1]),
                                       _mm256_hadd_epi32(t[4 * half + 2], t[4 * half + 3]));
    if (k16_per_chunk(qtype)) /* [c0..3 first halves | second halves], the same for c4..7 */
        sums[0] = _mm256_add_epi32(_mm256_permute2x128_si256(sums[0], sums[1], 0x20),
                                   _mm256_permute2x128_si256(sums[0], sums[1], 0x31));
}

/* int16_tile for the 256-value types: per block and row of W, its values once (k16_values),
 * then per row of x 16 madds, the hadd rounds, and its scales and offsets. */
static inline __attribute__((always_inline)) void k16_tile(int qtype, const int MR, const int NR,
                                                           const int8_row *x, int64_t K,
                                                           const uint8_t *w, int64_t row_bytes,
                                                           float *y, int64_t ldy) {
    const int bytes = TYPES[qtype].bytes, has_offset = int8_has_offset(qtype);
    const int per_chunk = k16_per_chunk(qtype), parts = per_chunk ? 1 : 2;
    /* prefetch K16_AHEAD bytes ahead (in tiles: at least one) */
    const int64_t ahead_tiles = 1 + K16_AHEAD / (NR * row_bytes);
    __m256 acc[INT8_MAX_ROWS][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < K / 256; blk++) {
        const char *ahead = (const char *)w + ahead_tiles * NR * row_bytes + blk * NR * bytes;
        for (int line = 0; line < NR * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        __m256 dx[INT8_MAX_ROWS][2], sx[INT8_MAX_ROWS][2]; /* x's scales and sums, in order */
        for (int i = 0; i < MR; i++) {
            const __m256 d = _mm256_loadu_ps(x[i].d + 8 * blk);
            if (per_chunk) {
                dx[i][0] = d;
                sx[i][0] = _mm256_loadu_ps(x[i].s32 + 8 * blk);
            } else {
                dx[i][0] = _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3));
                dx[i][1] = _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7));
                for (int half = 0; half < 2 && has_offset; half++)
                    sx[i][half] = tree_order(_mm256_loadu_ps(x[i].s + 16 * blk + 8 * half));
            }
        }
        for (int r = 0; r < NR; r++) {
            const uint8_t *block = w + r * row_bytes + blk * bytes;
            __m256 a[2], o[2];
            __m256i wv[16];
            k16_scales(qtype, block, a, o);
            k16_values(qtype, block, wv);
            for (int i = 0; i < MR; i++) {
                __m256i sums[2];
                k16_sums(qtype, wv, x[i].v16 + blk * 256, sums);
                for (int part = 0; part < parts; part++) {
                    acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(a[part], dx[i][part]),
                                                _mm256_cvtepi32_ps(sums[part]), acc[i][r]);
                    if (has_offset) acc[i][r] = _mm256_fmadd_ps(o[part], sx[i][part], acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) y[i * ldy + r] = int8_hsum(acc[i][r]);
}

#define K16_TILE(MR, NR) \
    k16_tile(qtype, MR, NR, x + m, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

/* One row of x streams W row after row (no reuse to tile for), several rows of x in tiles
 * of four rows of W (each block widened once for all of them). */
static inline __attribute__((always_inline)) void k16_rows(int qtype, const int8_row *x,
                                                           int64_t M, int64_t K, const uint8_t *w,
                                                           int64_t N, int64_t n0, int64_t n1,
                                                           float *y) {
    const int64_t row_bytes = K / 256 * TYPES[qtype].bytes;
    if (M == 1) {
        for (int64_t n = n0; n < n1; n++) k16_tile(qtype, 1, 1, x, K, w + n * row_bytes, row_bytes, y + n, N);
        return;
    }
    TILED_ROWS(K16_TILE)
}

/* ---- int16 activations on 256-value blocks, 512-bit (AVX-512 VNNI) ----------------------
 *
 * Where the CPU has AVX-512 VNNI, Q4_K and Q6_K multiply two chunks at once: chunks c and
 * c + 2 (c in PAIR_FIRST) side by side in 32 16-bit lanes (even values, then a second
 * vector of odd ones: for Q4_K straight from 64 bytes of nibbles), one vpdpwssd each, so a
 * pair's product is 16 int32 lanes, lane k (mod 8) holding values 4 k .. 4 k + 3 of its
 * chunk. The lanes are converted to float and multiplied by their group's scale a * d (a
 * per 16 values: lanes 0..3 and 4..7 of each chunk), so no integer reduction is needed;
 * Q4_K's offsets multiply the sums of x per 32 values. About half the instructions of
 * k16_tile per block; the activations are the same int16 values (stored in INT16_PAIRS
 * order), and each row still sums in one order whatever the batch. */

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define K16_WIDE 1

static inline int k16_wide(int qtype) { return qtype == VL_Q4_K || qtype == VL_Q6_K; }

/* Block b's values: w[2 p] the even values of pair p's chunks (c, c + 2), w[2 p + 1] their
 * odd values. */
static inline __attribute__((always_inline)) void k16_wide_values(int qtype, const uint8_t *b,
                                                                  __m512i w[8]) {
    if (qtype == VL_Q4_K) { /* 64 bytes: qs of j = 2 h (chunks 4 h, 4 h + 1) and 2 h + 1 */
        const __m512i low4 = _mm512_set1_epi16(15);
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512((const void *)(b + 16 + 64 * h));
            w[4 * h] = _mm512_and_si512(v, low4);
            w[4 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 8), low4);
            w[4 * h + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            w[4 * h + 3] = _mm512_srli_epi16(v, 12);
        }
        return;
    }
    /* Q6_K (see k_chunk_bytes): chunks c and c + 2 (h = c / 4, s = c % 4 < 2) read the
     * same 32 bytes of ql (low and high nibbles) and of qh (bits 2 s and 2 s + 4): each
     * vector is loaded once into both halves and shifted by a lane's own count. */
    const __m512i low4 = _mm512_set1_epi8(15), two_bits = _mm512_set1_epi8(3);
    for (int p = 0; p < 4; p++) {
        const int c = PAIR_FIRST[p], h = c / 4, s = c % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * s));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m512i low_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        const __m512i high_shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * s)),
                                                      _mm256_set1_epi16((short)(2 * s + 4)), 1);
        const __m512i low = _mm512_and_si512(
            _mm512_srlv_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(ql), ql, 1), low_shift), low4);
        const __m512i top = _mm512_and_si512(
            _mm512_srlv_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1), high_shift),
            two_bits);
        const __m512i v = _mm512_sub_epi8(_mm512_or_si512(low, _mm512_slli_epi16(top, 4)),
                                          _mm512_set1_epi8(32));
        w[2 * p] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
        w[2 * p + 1] = _mm512_srai_epi16(v, 8);
    }
}

/* Block b's scale per 16 values (16 floats, natural order) and, for Q4_K, its offsets per
 * 32 (-dmin * m, 8 floats). */
static inline __attribute__((always_inline)) void k16_wide_scales(int qtype, const uint8_t *b,
                                                                  __m512 *a16, __m256 *o) {
    if (qtype == VL_Q6_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        *a16 = _mm512_mul_ps(_mm512_set1_ps(fp16_to_fp32(b + 208)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        return;
    }
    __m256 a[2], offsets[2];
    k16_scales(qtype, b, a, offsets); /* Q4_K: per chunk, natural order, in a[0] and o[0] */
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    *a16 = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(a[0]));
    *o = offsets[0];
}

/* MR rows of x by NR rows of W of a wide type (see above); y[i * ldy + r]. */
static inline __attribute__((always_inline)) void k16_wide_tile(int qtype, const int MR,
                                                                const int NR, const int8_row *x,
                                                                int64_t K, const uint8_t *w,
                                                                int64_t row_bytes, float *y,
                                                                int64_t ldy) {
    const int bytes = TYPES[qtype].bytes, has_offset = qtype == VL_Q4_K;
    const int64_t ahead_tiles = 1 + K16_AHEAD / (NR * row_bytes);
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    /* lanes of pair p: groups 2 c, 2 c + 1 (chunk c), 2 c + 4, 2 c + 5 (chunk c + 2), 4 each */
    __m512i lanes[4];
    for (int p = 0; p < 4; p++) {
        const int g = 2 * PAIR_FIRST[p];
        lanes[p] = _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 4, g + 4, g + 4,
                                     g + 4, g + 5, g + 5, g + 5, g + 5);
    }
    __m512 acc[INT8_MAX_ROWS][4];
    __m256 off[INT8_MAX_ROWS][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) {
            acc[i][r] = _mm512_setzero_ps();
            off[i][r] = _mm256_setzero_ps();
        }
    for (int64_t blk = 0; blk < K / 256; blk++) {
        const char *ahead = (const char *)w + ahead_tiles * NR * row_bytes + blk * NR * bytes;
        for (int line = 0; line < NR * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        for (int r = 0; r < NR; r++) {
            const uint8_t *block = w + r * row_bytes + blk * bytes;
            __m512 a16;
            __m256 o = _mm256_setzero_ps();
            __m512i wv[8];
            k16_wide_scales(qtype, block, &a16, &o);
            k16_wide_values(qtype, block, wv);
            for (int i = 0; i < MR; i++) {
                const int16_t *xv = x[i].v16 + blk * 256;
                const __m256 dx = _mm256_loadu_ps(x[i].d + 8 * blk);
                const __m512 scale = _mm512_mul_ps(
                    a16, _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(dx)));
                for (int p = 0; p < 4; p++) {
                    __m512i sums = _mm512_dpwssd_epi32(
                        _mm512_setzero_si512(), wv[2 * p], _mm512_loadu_si512((const void *)(xv + 64 * p)));
                    sums = _mm512_dpwssd_epi32(sums, wv[2 * p + 1],
                                               _mm512_loadu_si512((const void *)(xv + 64 * p + 32)));
                    acc[i][r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes[p], scale),
                                                _mm512_cvtepi32_ps(sums), acc[i][r]);
                }
                if (has_offset)
                    off[i][r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(x[i].s32 + 8 * blk), off[i][r]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++)
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[i][r]) + (has_offset ? int8_hsum(off[i][r]) : 0.0f);
}

#define K16_WIDE_TILE(MR, NR) \
    k16_wide_tile(qtype, MR, NR, x + m, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

static inline __attribute__((always_inline)) void k16_wide_rows(int qtype, const int8_row *x,
                                                                int64_t M, int64_t K,
                                                                const uint8_t *w, int64_t N,
                                                                int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / 256 * TYPES[qtype].bytes;
    if (M == 1) {
        for (int64_t n = n0; n < n1; n++)
            k16_wide_tile(qtype, 1, 1, x, K, w + n * row_bytes, row_bytes, y + n, N);
        return;
    }
    TILED_ROWS(K16_WIDE_TILE)
}
#else
static inline int k16_wide(int qtype) {
    (void)qtype;
    return 0;
}
#endif

/* The order quantize_row_int16 stores a row in for `qtype`'s int16 kernel. */
static inline int int16_order(int qtype) {
    if (TYPES[qtype].values != 256) return INT16_IN_ORDER;
    return k16_wide(qtype) ? INT16_PAIRS : INT16_EVEN_ODD;
}

/* ---- one function per type and precision ---------------------------------------------- */

typedef void (*int8_rows_fn)(const int8_row *, int64_t, int64_t, const uint8_t *, int64_t,
                             int64_t, int64_t, float *);

#define INT8_ROWS(name, code) TYPED_ROWS(name##_int8_rows, int8_rows, int8_row, code)
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

#define INT16_ROWS(name, code) TYPED_ROWS(name##_int16_rows, int16_rows, int8_row, code)
INT16_ROWS(q4_0, VL_Q4_0)
INT16_ROWS(q4_1, VL_Q4_1)
INT16_ROWS(q8_0, VL_Q8_0)
INT16_ROWS(q5_0, VL_Q5_0)
INT16_ROWS(q5_1, VL_Q5_1)
INT16_ROWS(iq4_nl, VL_IQ4_NL)

#define K16_ROWS(name, code) TYPED_ROWS(name##_int16_rows, k16_rows, int8_row, code)
K16_ROWS(iq4_xs, VL_IQ4_XS)
K16_ROWS(q2_k, VL_Q2_K)
K16_ROWS(q3_k, VL_Q3_K)
#if defined(K16_WIDE)
#define K16_WIDE_ROWS(name, code) TYPED_ROWS(name##_int16_rows, k16_wide_rows, int8_row, code)
K16_WIDE_ROWS(q4_k, VL_Q4_K)
K16_WIDE_ROWS(q6_k, VL_Q6_K)
#else
K16_ROWS(q4_k, VL_Q4_K)
K16_ROWS(q6_k, VL_Q6_K)
#endif
K16_ROWS(q5_k, VL_Q5_K)

/* int16 activations: every type's values widened to 16 bits (madd). */
static const int8_rows_fn INT16_ROWS_OF[VL_NUM_TYPES] = {
    [VL_Q4_0] = q4_0_int16_rows,   [VL_Q4_1] = q4_1_int16_rows, [VL_Q8_0] = q8_0_int16_rows,
    [VL_Q5_0] = q5_0_int16_rows,   [VL_Q5_1] = q5_1_int16_rows, [VL_IQ4_NL] = iq4_nl_int16_rows,
    [VL_IQ4_XS] = iq4_xs_int16_rows, [VL_Q2_K] = q2_k_int16_rows, [VL_Q3_K] = q3_k_int16_rows,
    [VL_Q4_K] = q4_k_int16_rows,     [VL_Q5_K] = q5_k_int16_rows, [VL_Q6_K] = q6_k_int16_rows,
};
#endif

#include "int16_gemm.h"
#include "row_lanes.h"

/* 1 when every int16 product of this type gives a row of x the int16 GEMM's bits, whatever
 * the batch: the 32-value types, whose tiles (and row_lanes.h's) compute as the GEMM does, on
 * builds with the GEMM. */
int vl_int16_matches_gemm(int qtype) {
#if defined(GEMM16)
    return qtype >= 0 && qtype < VL_NUM_TYPES && GEMM16_ROWS_FN[qtype] != NULL &&
           TYPES[qtype].values == 32;
#else
    (void)qtype;
    return 0;
#endif
}

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
    int8_rows_fn rows_fn = (bits == 16 ? INT16_ROWS_OF : INT8_ROWS_OF)[qtype];
#if defined(ROW_LANES)
    /* one row: the tiles stream W from memory better (the same bits) */
    if (bits == 16 && M > 1 && ROW_LANES_OF[qtype] != NULL) rows_fn = ROW_LANES_OF[qtype];
#endif
    int8_t *q = malloc((size_t)(bits / 8 * M * K));
    const int64_t per_row = K / 32 + K / 16 + K / 32; /* d, s, s32 */
    float *scales = malloc(sizeof(float) * (size_t)(M * per_row));
    int8_row *rows = malloc(sizeof(int8_row) * (size_t)M);
    if (q == NULL || scales == NULL || rows == NULL) {
        free(q);
        free(scales);
        free(rows);
        return -1;
    }
#if defined(GEMM16)
    const int many_rows = bits == 16 && M >= gemm16_min_rows(qtype);
    const int order = many_rows ? INT16_IN_ORDER : int16_order(qtype);
#else
    const int many_rows = 0, order = int16_order(qtype);
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        float *d = scales + m * per_row, *s = d + K / 32, *s32 = s + K / 16;
        if (bits == 16) {
            rows[m] = (int8_row){NULL, (int16_t *)q + m * K, d, s, s32};
            quantize_row_int16(x + m * K, K, (int16_t *)q + m * K, order, d, s, s32);
        } else {
            rows[m] = (int8_row){q + m * K, NULL, d, s, s32};
            quantize_row_int8(x + m * K, K, q + m * K, d, s, s32);
        }
    }
    int status = 0;
#if defined(GEMM16)
    if (many_rows) status = gemm16(qtype, rows, M, K, w, N, y, num_threads);
#endif
    if (!many_rows) {
        const int64_t chunk = 16, num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t c = 0; c < num_chunks; c++)
            rows_fn(rows, M, K, w, N, c * chunk, (c + 1) * chunk < N ? (c + 1) * chunk : N, y);
    }
    free(q);
    free(scales);
    free(rows);
    return status;
#else
    (void)qtype, (void)bits, (void)x, (void)M, (void)K, (void)w, (void)N, (void)y, (void)num_threads;
    return -1;
#endif
}
