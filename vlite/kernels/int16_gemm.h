/*
 * Many rows of int16 activations (a prefill, a large batch) by block-quantized weights, on
 * AVX-512 VNNI. Included by quantized_activations.h (it uses int8_decode, int8_row,
 * quantize_row_int16).
 *
 * The tiles of quantized_activations.h decode each weight block once per tile of x and
 * reduce every group's lanes in place: per 16 or 32 values a conversion, a scale and a
 * multiply for each pair of rows, as many instructions as the products themselves. Here W
 * is unpacked a panel of GEMM16_ROWS rows at a time into its integer values as 16 bits
 * (exactly: every type's values are small integers, Q2_K's and Q3_K's times their integer
 * sub-scales, at most 45 and 128), a float scale per group of GEMM16 values (16 for Q6_K,
 * whose sub-scales times its values could pass 16 bits, 32 for the rest) and an offset per
 * 16 or 32, and stored transposed: one 512-bit vector holds values k and k + 1 of 16 rows
 * of W. One vpdpwssd multiplies it by the same pair of one row of x, broadcast, into 16
 * int32 lanes, one per row of W: a group's sum needs no horizontal reduction, and one
 * conversion, scale and add per group serve 16 products of 32 values. The panel's
 * unpacking (a decode and a 16 x 16 transpose per 32 values and 16 rows) is repaid over
 * the rows of x, so this path is for products of at least gemm16_min_rows rows.
 *
 * The activations are quantize_row_int16's, in order: the same integers and scales the
 * tiles multiply. A row of y sums group after group in one order whatever the batch (not
 * the tiles' order, so not their bits). Integer sums are exact: |w| <= 128 (Q8_0's int8,
 * Q3_K's 4 x 32) and |v| <= 32258, so a group's 32 products sum below 2^27. Building with
 * -DVL_NO_INT16_GEMM leaves every product to the paths before it (a benchmark's baseline).
 */

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(VL_NO_INT16_GEMM)
#define GEMM16 1

/* Rows of W unpacked together (two vectors of 16 lanes) and rows of x per tile. */
#define GEMM16_ROWS 32
#define GEMM16_MR 4 /* (6 measured no better: 337 against 358 GFLOP/s on Q4_K at 512 rows) */

/* Products of fewer rows of x than this take the tiles (vl_matmul_quantized): below it the
 * panel's unpacking costs more than the tiles' decoding. Measured over a whole file's
 * products in forward order, the weights streamed from memory (benchmarks/model_products.py,
 * AVX-512 EPYC, 2 threads): the default model's Q4_1 and Q8_0, tiles faster up to 5 rows,
 * about even at 6 to 8, the GEMM 1.45x at 16 and 1.8x at 31; a 1B Llama's Q4_K and Q6_K,
 * tiles faster up to 8 rows (1.2x), the GEMM 1.3-1.5x at 12 and 1.4-1.6x at 16 (the
 * K-quants' tiles are the stronger). The 32-value types take row_lanes.h's tiles from 2
 * rows, faster than the GEMM up to 11 (1,536 x 576 Q4_1 from memory: 59 against 79 µs at 8
 * rows, 86 against 97 at 11). */
static inline int gemm16_min_rows(int qtype) {
    if (TYPES[qtype].values == 256) return 12;
#if defined(VL_NO_ROW_LANES)
    return 8;
#else
    return 12;
#endif
}

/* Values per float scale: Q6_K keeps its sub-scales as floats (per 16 values). */
static inline int gemm16_group(int qtype) { return qtype == VL_Q6_K ? 16 : 32; }

static inline int gemm16_has_offset(int qtype) {
    return int8_has_offset(qtype) || int16_bias(qtype) != 0;
}

/* Q2_K's offsets differ per 16 values; the other offset types' per 32. */
static inline int gemm16_offset_values(int qtype) { return qtype == VL_Q2_K ? 16 : 32; }

/* Transposes 16 rows of 16 int32 lanes in place: r[j] becomes lane j of every row. */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) { /* per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3) */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4 i + j], 128-bit lane L: column 4 L + j, rows 4 i.. */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* column 4 L + j: lane L of u[j], u[4 + j], u[8 + j], ... */
        const __m512i ab01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        const __m512i ab23 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i cd01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i cd23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(ab01, cd01, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(ab01, cd01, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(ab23, cd23, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(ab23, cd23, 0xDD);
    }
}

/* A weight panel: rows n0 .. n0 + GEMM16_ROWS of W unpacked. */
typedef struct {
    int32_t *pairs; /* [K / 2][GEMM16_ROWS]: values (2 p, 2 p + 1) of each row, 16 bits each */
    float *scale;   /* [K / group][GEMM16_ROWS] */
    float *offset;  /* [K / offset_values][GEMM16_ROWS], or unused */
} gemm16_panel;

/* Chunk c of a decoded block as 32 16-bit values (Q2_K's and Q3_K's times their integer
 * sub-scales), with its float scale per 16 values (lo: values 0..15, hi: 16..31). */
static inline __attribute__((always_inline)) __m512i gemm16_chunk(int qtype, const int8_block *b,
                                                                  int c, float *lo, float *hi) {
    const __m512i v = int8_signed(qtype) ? _mm512_cvtepi8_epi16(b->w[c]) : _mm512_cvtepu8_epi16(b->w[c]);
    *lo = *hi = b->a[c];
    if (int16_bias(qtype)) return _mm512_add_epi16(v, _mm512_set1_epi16((short)int16_bias(qtype)));
    if (!int8_has_subscales(qtype)) return v;
    const short sub_lo = (short)_mm256_extract_epi16(b->scale[c], 0);
    const short sub_hi = (short)_mm256_extract_epi16(b->scale[c], 8);
    if (qtype == VL_Q6_K) { /* d * sc stays a float scale per 16 */
        *lo *= (float)sub_lo;
        *hi *= (float)sub_hi;
        return v;
    }
    const __m512i sub = _mm512_inserti64x4(_mm512_set1_epi16(sub_lo), _mm256_set1_epi16(sub_hi), 1);
    return _mm512_mullo_epi16(v, sub);
}

/* Unpacks rows n0 .. n0 + rows (rows <= GEMM16_ROWS; the panel's other rows are zero),
 * and prefetches the next panel's first next_rows rows (<= 0: none), block by block as it
 * reads this panel's: with few rows of x the product streams W from memory, 32 rows at a
 * time, more streams than the hardware prefetchers follow. */
static inline __attribute__((always_inline)) void gemm16_unpack(int qtype, const uint8_t *w, int64_t row_bytes, int64_t rows,
                          int64_t next_rows, int64_t K, gemm16_panel *panel) {
    const int values = TYPES[qtype].values, bytes = TYPES[qtype].bytes, chunks = values / 32;
    const uint8_t *next = w + GEMM16_ROWS * row_bytes;
    const int group = gemm16_group(qtype), offset_values = gemm16_offset_values(qtype);
    const int has_offset = gemm16_has_offset(qtype), bias = int16_bias(qtype);
    for (int64_t blk = 0; blk < K / values; blk++) {
        for (int half = 0; half < GEMM16_ROWS / 16; half++) {
            __m512i chunk_rows[8][16];
            for (int r = 0; r < 16; r++) {
                const int64_t row = 16 * half + r;
                const int64_t k0 = blk * values;
                if (row >= rows) {
                    for (int c = 0; c < chunks; c++) {
                        chunk_rows[c][r] = _mm512_setzero_si512();
                        for (int g = 0; g < 32 / group; g++)
                            panel->scale[((k0 + 32 * c) / group + g) * GEMM16_ROWS + row] = 0.0f;
                        for (int g = 0; has_offset && g < 32 / offset_values; g++)
                            panel->offset[((k0 + 32 * c) / offset_values + g) * GEMM16_ROWS + row] = 0.0f;
                    }
                    continue;
                }
                if (row < next_rows)
                    for (int line = 0; line < bytes; line += 64)
                        _mm_prefetch((const char *)next + row * row_bytes + blk * bytes + line, _MM_HINT_T0);
                int8_block block;
                int8_decode(qtype, w + row * row_bytes + blk * bytes, &block);
                for (int c = 0; c < chunks; c++) {
                    float lo, hi;
                    chunk_rows[c][r] = gemm16_chunk(qtype, &block, c, &lo, &hi);
                    const int64_t k = k0 + 32 * c;
                    panel->scale[(k / group) * GEMM16_ROWS + row] = lo;
                    if (group == 16) panel->scale[(k / 16 + 1) * GEMM16_ROWS + row] = hi;
                    if (!has_offset) continue;
                    panel->offset[(k / offset_values) * GEMM16_ROWS + row] =
                        bias ? -(float)bias * block.a[c] : block.b[2 * c];
                    if (offset_values == 16)
                        panel->offset[(k / 16 + 1) * GEMM16_ROWS + row] = block.b[2 * c + 1];
                }
            }
            for (int c = 0; c < chunks; c++) {
                transpose16_epi32(chunk_rows[c]);
                int32_t *out = panel->pairs + (blk * values + 32 * c) / 2 * GEMM16_ROWS + 16 * half;
                for (int p = 0; p < 16; p++)
                    _mm512_store_si512((void *)(out + p * GEMM16_ROWS), chunk_rows[c][p]);
            }
        }
    }
}

/* MR rows of x by the panel: y[i * ldy + r] for r < cols. */
static inline __attribute__((always_inline)) void gemm16_tile(int qtype, const int MR,
                                                              const int8_row *x, int64_t K,
                                                              const gemm16_panel *panel,
                                                              float *y, int64_t ldy,
                                                              int64_t cols) {
    const int group = gemm16_group(qtype), offset_values = gemm16_offset_values(qtype);
    const int has_offset = gemm16_has_offset(qtype);
    __m512 acc[GEMM16_MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        __m512i sums[GEMM16_MR][2];
        for (int i = 0; i < MR; i++) sums[i][0] = sums[i][1] = _mm512_setzero_si512();
        const int32_t *pairs = panel->pairs + g * (group / 2) * GEMM16_ROWS;
        for (int p = 0; p < group / 2; p++) {
            const __m512i w0 = _mm512_load_si512((const void *)(pairs + p * GEMM16_ROWS));
            const __m512i w1 = _mm512_load_si512((const void *)(pairs + p * GEMM16_ROWS + 16));
            for (int i = 0; i < MR; i++) {
                int32_t pair;
                memcpy(&pair, x[i].v16 + g * group + 2 * p, sizeof pair);
                const __m512i xv = _mm512_set1_epi32(pair);
                sums[i][0] = _mm512_dpwssd_epi32(sums[i][0], w0, xv);
                sums[i][1] = _mm512_dpwssd_epi32(sums[i][1], w1, xv);
            }
        }
        const __m512 a0 = _mm512_load_ps(panel->scale + g * GEMM16_ROWS);
        const __m512 a1 = _mm512_load_ps(panel->scale + g * GEMM16_ROWS + 16);
        for (int i = 0; i < MR; i++) {
            const __m512 d = _mm512_set1_ps(x[i].d[g * group / 32]);
            acc[i][0] = _mm512_fmadd_ps(_mm512_mul_ps(a0, d), _mm512_cvtepi32_ps(sums[i][0]), acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(_mm512_mul_ps(a1, d), _mm512_cvtepi32_ps(sums[i][1]), acc[i][1]);
        }
        if (!has_offset) continue; /* (group is 32 for every offset type) */
        for (int h = 0; h < 32 / offset_values; h++) {
            const int64_t o = g * (32 / offset_values) + h;
            const __m512 b0 = _mm512_load_ps(panel->offset + o * GEMM16_ROWS);
            const __m512 b1 = _mm512_load_ps(panel->offset + o * GEMM16_ROWS + 16);
            for (int i = 0; i < MR; i++) {
                const __m512 s = _mm512_set1_ps(offset_values == 16 ? x[i].s[o] : x[i].s32[o]);
                acc[i][0] = _mm512_fmadd_ps(b0, s, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(b1, s, acc[i][1]);
            }
        }
    }
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int i = 0; i < MR; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
    }
}

#define GEMM16_TILE(MR) gemm16_tile(qtype, MR, x + m, K, &panel, y + m * N + n0, N, cols)

/* Rows of W in panels n0 .. n1 (of GEMM16_ROWS) against every row of x. */
static inline __attribute__((always_inline)) void gemm16_rows(int qtype, const int8_row *x,
                                                              int64_t M, int64_t K,
                                                              const uint8_t *w, int64_t N,
                                                              int64_t p0, int64_t p1,
                                                              gemm16_panel panel, float *y) {
    const int64_t row_bytes = K / TYPES[qtype].values * TYPES[qtype].bytes;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * GEMM16_ROWS, cols = N - n0 < GEMM16_ROWS ? N - n0 : GEMM16_ROWS;
        gemm16_unpack(qtype, w + n0 * row_bytes, row_bytes, cols, N - n0 - GEMM16_ROWS, K, &panel);
        int64_t m = 0;
        for (; m + GEMM16_MR <= M; m += GEMM16_MR) GEMM16_TILE(GEMM16_MR);
        switch (M - m) {
        case 3: GEMM16_TILE(3); break;
        case 2: GEMM16_TILE(2); break;
        case 1: GEMM16_TILE(1); break;
        default: break;
        }
    }
}

typedef void (*gemm16_rows_fn)(const int8_row *, int64_t, int64_t, const uint8_t *, int64_t,
                               int64_t, int64_t, gemm16_panel, float *);

#define GEMM16_ROWS_OF_TYPE(name, code)                                                    \
    static void name##_gemm16_rows(const int8_row *x, int64_t M, int64_t K, const uint8_t *w, \
                                   int64_t N, int64_t p0, int64_t p1, gemm16_panel panel,    \
                                   float *y) {                                               \
        gemm16_rows(code, x, M, K, w, N, p0, p1, panel, y);                                \
    }
GEMM16_ROWS_OF_TYPE(q4_0, VL_Q4_0)
GEMM16_ROWS_OF_TYPE(q4_1, VL_Q4_1)
GEMM16_ROWS_OF_TYPE(q8_0, VL_Q8_0)
GEMM16_ROWS_OF_TYPE(q5_0, VL_Q5_0)
GEMM16_ROWS_OF_TYPE(q5_1, VL_Q5_1)
GEMM16_ROWS_OF_TYPE(iq4_nl, VL_IQ4_NL)
GEMM16_ROWS_OF_TYPE(q2_k, VL_Q2_K)
GEMM16_ROWS_OF_TYPE(q3_k, VL_Q3_K)
GEMM16_ROWS_OF_TYPE(q4_k, VL_Q4_K)
GEMM16_ROWS_OF_TYPE(q5_k, VL_Q5_K)
GEMM16_ROWS_OF_TYPE(q6_k, VL_Q6_K)
GEMM16_ROWS_OF_TYPE(iq4_xs, VL_IQ4_XS)

static const gemm16_rows_fn GEMM16_ROWS_FN[VL_NUM_TYPES] = {
    [VL_Q4_0] = q4_0_gemm16_rows,     [VL_Q4_1] = q4_1_gemm16_rows, [VL_Q8_0] = q8_0_gemm16_rows,
    [VL_Q5_0] = q5_0_gemm16_rows,     [VL_Q5_1] = q5_1_gemm16_rows, [VL_IQ4_NL] = iq4_nl_gemm16_rows,
    [VL_Q2_K] = q2_k_gemm16_rows,     [VL_Q3_K] = q3_k_gemm16_rows, [VL_Q4_K] = q4_k_gemm16_rows,
    [VL_Q5_K] = q5_k_gemm16_rows,     [VL_Q6_K] = q6_k_gemm16_rows, [VL_IQ4_XS] = iq4_xs_gemm16_rows,
};

/* y = x @ W^T for rows of x already quantized in order (INT16_IN_ORDER); the panels of W
 * are split over the threads. Returns -1 when a thread's panel memory cannot be had. */
static int gemm16(int qtype, const int8_row *x, int64_t M, int64_t K, const uint8_t *w,
                  int64_t N, float *y, int num_threads) {
    const int64_t num_panels = (N + GEMM16_ROWS - 1) / GEMM16_ROWS;
    const size_t pair_bytes = (size_t)(K / 2) * GEMM16_ROWS * sizeof(int32_t);
    const size_t scale_bytes = (size_t)(K / gemm16_group(qtype)) * GEMM16_ROWS * sizeof(float);
    const size_t offset_bytes = (size_t)(K / 16) * GEMM16_ROWS * sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        gemm16_panel panel = {aligned_alloc(64, pair_bytes), aligned_alloc(64, scale_bytes),
                              aligned_alloc(64, offset_bytes)};
        const int ok = panel.pairs != NULL && panel.scale != NULL && panel.offset != NULL;
        failed |= !ok;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++)
            if (ok) GEMM16_ROWS_FN[qtype](x, M, K, w, N, p, p + 1, panel, y);
        free(panel.pairs);
        free(panel.scale);
        free(panel.offset);
    }
    return failed ? -1 : 0;
}
#endif

/* Rows of x from which int16 products of this type run as the GEMM above; 0: never (a CPU
 * without AVX-512 VNNI, or not a quantized type). */
int vl_int16_gemm_rows(int qtype) {
#if defined(GEMM16)
    return qtype >= 0 && qtype < VL_NUM_TYPES && GEMM16_ROWS_FN[qtype] != NULL ? gemm16_min_rows(qtype) : 0;
#else
    (void)qtype;
    return 0;
#endif
}
