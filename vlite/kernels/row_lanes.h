/*
 * A few rows of int16 activations (a verification of drafts, a small batch, a short prefill)
 * by the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) on AVX-512 VNNI: one row of W
 * per 32-bit lane, transposed in registers. Included by quantized_activations.h after
 * int16_gemm.h (it uses int8_row, TYPES, IQ4_VALUES and int16_bias).
 *
 * The tiles of quantized_activations.h keep a block's 32 values across the lanes of a
 * vector: every pair of a row of x and a row of W needs its own products and reduction per
 * block, so MR rows of x cost nearly MR times one. The int16 GEMM (int16_gemm.h) puts one
 * row of W in each lane instead, but unpacks W through a stored panel, which only pays from
 * a dozen rows of x. Here the same layout comes straight from the blocks' bytes, in
 * registers: the 16-byte chunks of 16 rows of W are transposed 16 bits at a time (word u of
 * every row side by side: two values of Q8_0, four nibbles of the others), then widened to
 * 16 bits (IQ4_NL's nibbles through its table, Q5's fifth bits or'ed in), so that lane j of
 * vector t holds values 2 t and 2 t + 1 of row j. One vpdpwssd multiplies it by the
 * matching pair of a row of x, broadcast; 16 of them give each of the 16 rows' integer sum
 * over the block in its own lane, converted, scaled by the 16 rows' block scales and added
 * in one fused multiply-add. The unpacking is shared by every row of x: five rows of Q4_1
 * cost about twice one (the tiles: 2.7 times). One row alone stays on the tiles, which
 * stream W from memory better (vl_matmul_quantized).
 *
 * A row of y is computed with the GEMM's arithmetic exactly (the same integer sums, the
 * same float operations in the same order: a block's scale times its sum, then its offset
 * times the activations' sum), as the int16 tiles of these types compute it too, so a row of
 * x gets the same bits alone, in any batch, and from the GEMM. Building with
 * -DVL_NO_ROW_LANES leaves these types to the tiles (a benchmark's baseline).
 */

#if defined(GEMM16) && !defined(VL_NO_ROW_LANES)
#define ROW_LANES 1

/* Rows of x multiplied together against one unpacked block (more: in turn). */
#define ROW_LANES_MR 8

/* The 16 bytes at p[j] for 16 rows j, transposed by 16-bit words: word u (u = 0..7) of
 * every row, in row order, is the low 256 bits of out[u / 2] for even u, the high for odd. */
static inline __attribute__((always_inline)) void transpose_words(const uint8_t *const p[16],
                                                                  __m512i out[4]) {
    __m512i z[4]; /* z[a], 128-bit lane L: row 4 L + a */
    for (int a = 0; a < 4; a++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p[a]));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p[a + 4]), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p[a + 8]), 2);
        z[a] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p[a + 12]), 3);
    }
    /* per lane L: (word k of rows 4 L, 4 L + 1) as dwords; then of rows 4 L .. 4 L + 3 as
     * qwords, two words per vector; then the qwords of one word gathered in row order */
    const __m512i lo01 = _mm512_unpacklo_epi16(z[0], z[1]), hi01 = _mm512_unpackhi_epi16(z[0], z[1]);
    const __m512i lo23 = _mm512_unpacklo_epi16(z[2], z[3]), hi23 = _mm512_unpackhi_epi16(z[2], z[3]);
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    out[0] = _mm512_permutexvar_epi64(order, _mm512_unpacklo_epi32(lo01, lo23)); /* words 0, 1 */
    out[1] = _mm512_permutexvar_epi64(order, _mm512_unpackhi_epi32(lo01, lo23)); /* 2, 3 */
    out[2] = _mm512_permutexvar_epi64(order, _mm512_unpacklo_epi32(hi01, hi23)); /* 4, 5 */
    out[3] = _mm512_permutexvar_epi64(order, _mm512_unpackhi_epi32(hi01, hi23)); /* 6, 7 */
}

static inline __m256i word_of(const __m512i out[4], int u) {
    return u % 2 ? _mm512_extracti64x4_epi64(out[u / 2], 1) : _mm512_castsi512_si256(out[u / 2]);
}

/* The 4 bytes at b + row_offset[j] of the 16 rows, as the dwords of one vector (loaded one
 * by one: a gather is no faster here, and slow on CPUs whose microcode guards it). */
static inline __attribute__((always_inline)) __m512i row_dwords(const uint8_t *b,
                                                                const int64_t row_offset[16]) {
    __m128i quarter[4];
    for (int q = 0; q < 4; q++) {
        int32_t h[4];
        for (int r = 0; r < 4; r++) memcpy(&h[r], b + row_offset[4 * q + r], 4);
        quarter[q] = _mm_setr_epi32(h[0], h[1], h[2], h[3]);
    }
    __m512i v = _mm512_castsi128_si512(quarter[0]);
    for (int q = 1; q < 4; q++) v = _mm512_inserti32x4(v, quarter[q], q);
    return v;
}

/* Where a 32-value block keeps its nibbles (byte k: value k low, value k + 16 high) and its
 * fifth bits (Q5_0, Q5_1: bit k of a dword, value k's 16). */
static inline int nibbles_at(int qtype) {
    return qtype == VL_Q4_1 ? 4 : qtype == VL_Q5_0 ? 6 : qtype == VL_Q5_1 ? 8 : 2;
}
static inline int fifth_bits_at(int qtype) { return qtype == VL_Q5_0 ? 2 : 4; }

/* Q5's fifth bits added to pairs[]: value 2 u's to bit 4 of lane j's low word of pairs[u],
 * value 2 u + 1's to bit 4 of its high word (values 16.. in pairs[u + 8]). The row's 32 bits
 * are first regrouped so that values 2 u and 2 u + 1 sit 16 bits apart (bits 2 u and
 * 2 u + 16: one shift and one masked or per vector then). */
static inline __attribute__((always_inline)) void add_fifth_bits(__m512i qh, __m512i pairs[16]) {
    const __m512i even = _mm512_and_si512(qh, _mm512_set1_epi32(0x55555555));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(qh, 1), _mm512_set1_epi32(0x55555555));
    const __m512i low_half = _mm512_set1_epi32(0xFFFF), bits = _mm512_set1_epi32(0x00100010);
    /* (a & c) | b, and a | (b & ~c): 0xEC and 0xF4 (a = 0xF0, b = 0xCC, c = 0xAA) */
    const __m512i first = _mm512_ternarylogic_epi32(even, _mm512_slli_epi32(odd, 16), low_half, 0xEC);
    const __m512i second = _mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 16), odd, low_half, 0xF4);
    for (int u = 0; u < 8; u++)
        for (int h = 0; h < 2; h++) {
            const __m512i spread = h ? second : first;
            const __m512i at4 = 2 * u >= 4 ? _mm512_srli_epi32(spread, 2 * u - 4)
                                           : _mm512_slli_epi32(spread, 4 - 2 * u);
            /* pairs | (at4 & bits) */
            pairs[u + 8 * h] = _mm512_ternarylogic_epi32(pairs[u + 8 * h], at4, bits, 0xF8);
        }
}

/* Block blk of 16 rows (at w + row_offset[j]) as 16 vectors of pairs: lane j of pairs[t]
 * holds values 2 t and 2 t + 1 of row j as 16-bit integers (Q4_0 and Q5_0: unsigned, their
 * - 8 d and - 16 d taken as offsets). */
static inline __attribute__((always_inline)) void row_lanes_values(int qtype, const uint8_t *w,
                                                                   const int64_t row_offset[16],
                                                                   int64_t blk,
                                                                   __m512i pairs[16]) {
    const int bytes = TYPES[qtype].bytes;
    const uint8_t *p[16];
    __m512i words[4];
    if (qtype == VL_Q8_0) {
        for (int c = 0; c < 2; c++) { /* values 16 c .. 16 c + 15: words 8 c .. */
            for (int j = 0; j < 16; j++) p[j] = w + row_offset[j] + blk * bytes + 2 + 16 * c;
            transpose_words(p, words);
            for (int u = 0; u < 8; u++) pairs[8 * c + u] = _mm512_cvtepi8_epi16(word_of(words, u));
        }
        return;
    }
    for (int j = 0; j < 16; j++) p[j] = w + row_offset[j] + blk * bytes + nibbles_at(qtype);
    transpose_words(p, words);
    if (qtype == VL_IQ4_NL) { /* each nibble through the 16 values, then widened */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
        const __m256i low4 = _mm256_set1_epi8(15);
        for (int u = 0; u < 8; u++) {
            const __m256i v = word_of(words, u);
            pairs[u] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(v, low4)));
            pairs[u + 8] = _mm512_cvtepi8_epi16(
                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)));
        }
        return;
    }
    const __m512i low4 = _mm512_set1_epi16(15);
    for (int u = 0; u < 8; u++) {
        const __m512i v = _mm512_cvtepu8_epi16(word_of(words, u));
        pairs[u] = _mm512_and_si512(v, low4);
        pairs[u + 8] = _mm512_srli_epi16(v, 4);
    }
    if (qtype == VL_Q5_0 || qtype == VL_Q5_1)
        add_fifth_bits(row_dwords(w + blk * bytes + fifth_bits_at(qtype), row_offset), pairs);
}

/* The 16 rows' block scales and offsets (value = scale * w + offset), as the GEMM's: each
 * row's first 4 bytes (d, and Q4_1's and Q5_1's m). */
static inline __attribute__((always_inline)) void row_lanes_scales(int qtype, const uint8_t *w,
                                                                   const int64_t row_offset[16],
                                                                   int64_t blk, __m512 *scale,
                                                                   __m512 *offset) {
    const __m512i header = row_dwords(w + blk * TYPES[qtype].bytes, row_offset);
    *scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
    if (int16_has_minimum(qtype))
        *offset = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16)));
    else
        *offset = _mm512_mul_ps(_mm512_set1_ps(-(float)int16_bias(qtype)), *scale);
}

/* Row i of x by the block's pairs: each lane's integer sum over the block (four chains). */
static inline __attribute__((always_inline)) __m512i row_lanes_sums(const __m512i pairs[16],
                                                                    const int16_t *v16) {
    __m512i s[4];
    for (int c = 0; c < 4; c++) s[c] = _mm512_setzero_si512();
    for (int t = 0; t < 16; t++) {
        int32_t pair;
        memcpy(&pair, v16 + 2 * t, sizeof pair);
        s[t % 4] = _mm512_dpwssd_epi32(s[t % 4], pairs[t], _mm512_set1_epi32(pair));
    }
    return _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
}

/* MR rows of x (MR <= ROW_LANES_MR) by the `rows` rows of W at w (rows <= 16): y[i * ldy + j].
 * The next ahead_bytes after them (the next tile's rows) are prefetched a slice per block:
 * the 16 rows are read across, 16 streams, more than the hardware prefetchers follow, but
 * the tile is one contiguous span of memory and so is the next. */
static inline __attribute__((always_inline)) void row_lanes_tile(int qtype, const int MR,
                                                                 const int8_row *x, int64_t K,
                                                                 const uint8_t *w,
                                                                 int64_t row_bytes, int rows,
                                                                 int64_t ahead_bytes, float *y,
                                                                 int64_t ldy) {
    const int has_offset = qtype != VL_Q8_0 && qtype != VL_IQ4_NL;
    int64_t row_offset[16];
    for (int j = 0; j < 16; j++) /* lanes past the last row repeat it; not stored */
        row_offset[j] = (j < rows ? j : rows - 1) * row_bytes;
    __m512 acc[ROW_LANES_MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    const char *ahead = (const char *)w + rows * row_bytes;
    const int64_t slice = (16 * row_bytes + K / 32 - 1) / (K / 32);
    for (int64_t blk = 0; blk < K / 32; blk++) {
        for (int64_t at = blk * slice; at < (blk + 1) * slice && at < ahead_bytes; at += 64)
            _mm_prefetch(ahead + at, _MM_HINT_T0);
        __m512i pairs[16];
        __m512 scale, offset;
        row_lanes_values(qtype, w, row_offset, blk, pairs);
        row_lanes_scales(qtype, w, row_offset, blk, &scale, &offset);
        for (int i = 0; i < MR; i++) {
            const __m512i sums = row_lanes_sums(pairs, x[i].v16 + 32 * blk);
            const __m512 d = _mm512_set1_ps(x[i].d[blk]);
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(scale, d), _mm512_cvtepi32_ps(sums), acc[i]);
            if (has_offset) acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[i].s32[blk]), acc[i]);
        }
    }
    const __mmask16 stored = rows >= 16 ? 0xFFFF : (__mmask16)((1u << rows) - 1);
    for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(y + i * ldy, stored, acc[i]);
}

#define ROW_LANES_TILE(MR)                                                                  \
    row_lanes_tile(qtype, MR, x + m, K, w + n * row_bytes, row_bytes, rows, ahead_rows * row_bytes, \
                   y + m * N + n, N)

/* Rows n0 .. n1 of W, 16 at a time, against every row of x: one row of x with its
 * accumulator in registers, more ROW_LANES_MR at a time. */
static inline __attribute__((always_inline)) void row_lanes_rows(int qtype, const int8_row *x,
                                                                 int64_t M, int64_t K,
                                                                 const uint8_t *w, int64_t N,
                                                                 int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / 32 * TYPES[qtype].bytes;
    for (int64_t n = n0; n < n1; n += 16) {
        const int rows = n1 - n < 16 ? (int)(n1 - n) : 16;

        const int64_t after = N - n - rows, ahead_rows = after < 16 ? after : 16;
        for (int64_t m = 0; m < M; m += ROW_LANES_MR) {
            const int left = M - m < ROW_LANES_MR ? (int)(M - m) : ROW_LANES_MR;
            if (left == 1)
                ROW_LANES_TILE(1);
            else
                ROW_LANES_TILE(left);
        }
    }
}

#define ROW_LANES_ROWS(name, code) TYPED_ROWS(name##_row_lanes_rows, row_lanes_rows, int8_row, code)
ROW_LANES_ROWS(q4_0, VL_Q4_0)
ROW_LANES_ROWS(q4_1, VL_Q4_1)
ROW_LANES_ROWS(q8_0, VL_Q8_0)
ROW_LANES_ROWS(q5_0, VL_Q5_0)
ROW_LANES_ROWS(q5_1, VL_Q5_1)
ROW_LANES_ROWS(iq4_nl, VL_IQ4_NL)

static const int8_rows_fn ROW_LANES_OF[VL_NUM_TYPES] = {
    [VL_Q4_0] = q4_0_row_lanes_rows, [VL_Q4_1] = q4_1_row_lanes_rows,
    [VL_Q8_0] = q8_0_row_lanes_rows, [VL_Q5_0] = q5_0_row_lanes_rows,
    [VL_Q5_1] = q5_1_row_lanes_rows, [VL_IQ4_NL] = iq4_nl_row_lanes_rows,
};
#endif
