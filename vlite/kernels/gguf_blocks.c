/*
 * Weight-only matrix products over GGUF block-quantized weights, on the CPU.
 *
 * A weight matrix W [N, K] is stored as llama.cpp stores it: each of the N rows is a run of
 * self-describing blocks (32 values, or a 256-value "super-block" for the K-quants and
 * IQ4_XS). The kernels read the file's bytes as they are and decode blocks right before they
 * are used, so the weights a product sees are exactly the values the GGUF format defines
 * (gguf-py's `dequantize`, value for value). Every type decodes as, per group of 16 or 32
 * values, value = a * q + b: a float scale a (d, or d times a small integer sub-scale), an
 * integer or table value q, and an offset b (0, a minimum m, or minus dmin times a
 * sub-minimum). a * q is exact in float32 for every type (at most 11 + 6 + 7 significant
 * bits), so value is rounded once, in any order of evaluation:
 *
 *   Q4_0   (18 bytes / 32): d; qs[16]                    d * (nibble - 8)
 *   Q4_1   (20 / 32):  d; m; qs[16]                      d * nibble + m
 *   Q5_0   (22 / 32):  d; qh[4]; qs[16]                  d * (nibble | bit << 4) - 16 d
 *   Q5_1   (24 / 32):  d; m; qh[4]; qs[16]               d * (nibble | bit << 4) + m
 *   Q8_0   (34 / 32):  d; qs[32] int8                    d * q
 *   IQ4_NL (18 / 32):  d; qs[16]                         d * IQ4_VALUES[nibble]
 *   F16, BF16 (64 / 32): 32 half-precision values       (a "block" is 32 values here)
 *   Q2_K   (84 / 256): scales[16]; qs[64]; d; dmin       d * (sc & 15) * q2 - dmin * (sc >> 4)
 *   Q3_K   (110 / 256): hmask[32]; qs[64]; scales[12]; d  d * (sc6 - 32) * (q2 - 4 * !hbit)
 *   Q4_K   (144 / 256): d; dmin; scales[12]; qs[128]     d * sc6 * nibble - dmin * m6
 *   Q5_K   (176 / 256): d; dmin; scales[12]; qh[32]; qs[128]   as Q4_K with a fifth bit
 *   Q6_K   (210 / 256): ql[128]; qh[64]; scales[16] int8; d    d * sc * (q6 - 32)
 *   IQ4_XS (136 / 256): d; scales_h (u16); scales_l[4]; qs[128]  d * (ls6 - 32) * IQ4_VALUES[nibble]
 *
 * (d, dmin, m: fp16; the bit layouts are spelled out in each decoder below.) Activations and
 * accumulators are float32.
 *
 * Products with few rows of x (a decode step) decode NR rows of W at a time into a small
 * float32 buffer and run MR x NR tiles of dot products over it, with the widest vectors the
 * compiler was told of (AVX-512, AVX2 + FMA, or 4-wide portable vectors). With AVX-512 the
 * three oldest types (Q4_0, Q4_1, Q8_0) and F16/BF16 keep their own register-resident
 * decoder, and the three a blocked GEMM for many rows (vl_has_gemm says which; F16/BF16
 * many rows are PyTorch's, on panels); with AVX2 alone the types whose
 * values widen straight from memory are decoded in registers too (register_product). The
 * caller handles many rows of the other types by decoding W in panels (vl_dequantize) for a
 * dense product.
 *
 * Threads: OpenMP, in the OpenMP runtime PyTorch already loaded (this library names the
 * same libgomp.so.1), so the kernels and PyTorch's own ops share one thread team. The
 * caller passes the thread count (PyTorch's intra-op setting).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    VL_Q4_0 = 0, VL_Q4_1 = 1, VL_Q8_0 = 2, VL_Q5_0 = 3, VL_Q5_1 = 4, VL_IQ4_NL = 5,
    VL_F16 = 6, VL_BF16 = 7, VL_Q2_K = 8, VL_Q3_K = 9, VL_Q4_K = 10, VL_Q5_K = 11,
    VL_Q6_K = 12, VL_IQ4_XS = 13, VL_NUM_TYPES = 14
};
#define QK 32
#define QK_K 256
#define PREFETCH_TILES 4

/* IQ4_NL's and IQ4_XS's 16 non-linear values. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static inline float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) {
                mantissa <<= 1;
                exponent--;
            }
            mantissa &= 0x3ff;
            bits = sign | (exponent << 23) | (mantissa << 13);
        }
    } else if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(__AVX2__)
/* Vector decoding: int8 values q -> a * q + b (a * q is exact, so the fused multiply-add
 * rounds once, exactly like the two steps of the portable decoders). */
static inline void put8(__m128i q, __m256 a, __m256 b, float *out) {
    _mm256_storeu_ps(out, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), b));
}

static inline void put16(__m128i q, float a, float b, float *out) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    put8(q, va, vb, out);
    put8(_mm_unpackhi_epi64(q, q), va, vb, out + 8);
}

static inline void put32(__m256i q, float a, float b, float *out) {
    put16(_mm256_castsi256_si128(q), a, b, out);
    put16(_mm256_extracti128_si256(q, 1), a, b, out + 16);
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high nibbles. */
static inline __m256i split_nibbles(const uint8_t *qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                            _mm_and_si128(bytes, low4));
}

/* Q5_0/Q5_1's 32 fifth bits (a little-endian uint32) -> 32 bytes of 0 or 16. */
static inline __m256i fifth_bits(const uint8_t *qh_bytes) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
#endif

/* ---- decoders: one block -> its values as float32 ----------------------------------- */

static inline void decode_q4_0(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b);
    const uint8_t *qs = b + 2;
#if defined(__AVX2__)
    put32(_mm256_sub_epi8(split_nibbles(qs), _mm256_set1_epi8(8)), d, 0.0f, out);
#else
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((int)(qs[j] & 15) - 8);
        out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
#endif
}

static inline void decode_q4_1(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b), m = fp16_to_fp32(b + 2);
    const uint8_t *qs = b + 4;
#if defined(__AVX2__)
    put32(split_nibbles(qs), d, m, out);
#else
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(qs[j] & 15) + m;
        out[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
#endif
}

static inline void decode_q8_0(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b);
    const int8_t *qs = (const int8_t *)(b + 2);
#if defined(__AVX2__)
    /* Sign-extended straight from memory: no shuffles of a loaded vector (1.7x faster than
     * the compiler's loop for the Q8_0 LM head of Gemma 3, 262,144 x 640). */
    const __m256 scale = _mm256_set1_ps(d);
    for (int j = 0; j < 32; j += 8) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + j)));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale));
    }
#else
    for (int j = 0; j < 32; j++) out[j] = (float)qs[j] * d;
#endif
}

/* Q5_0/Q5_1: bit j of the little-endian uint32 qh is the fifth bit of value j. */
static inline void five_bit_values(const uint8_t *qh_bytes, const uint8_t *qs, int *q) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    for (int j = 0; j < 16; j++) {
        q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
}

static inline void decode_q5_0(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b);
#if defined(__AVX2__)
    const __m256i q = _mm256_or_si256(split_nibbles(b + 6), fifth_bits(b + 2));
    put32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, 0.0f, out);
#else
    int q[32];
    five_bit_values(b + 2, b + 6, q);
    for (int j = 0; j < 32; j++) out[j] = d * (float)(q[j] - 16);
#endif
}

static inline void decode_q5_1(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b), m = fp16_to_fp32(b + 2);
#if defined(__AVX2__)
    put32(_mm256_or_si256(split_nibbles(b + 8), fifth_bits(b + 4)), d, m, out);
#else
    int q[32];
    five_bit_values(b + 4, b + 8, q);
    for (int j = 0; j < 32; j++) out[j] = d * (float)q[j] + m;
#endif
}

/* 16 bytes of IQ4 nibbles -> 32 values: low nibbles to out[0..16), high to out[16..32). */
static inline void iq4_values(const uint8_t *qs, float a, float *out) {
#if defined(__AVX2__)
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const __m256 scale = _mm256_set1_ps(a);
    const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
    for (int p = 0; p < 4; p++)
        _mm256_storeu_ps(out + 8 * p,
                         _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p]))));
#else
    for (int j = 0; j < 16; j++) {
        out[j] = a * (float)IQ4_VALUES[qs[j] & 15];
        out[j + 16] = a * (float)IQ4_VALUES[qs[j] >> 4];
    }
#endif
}

static inline void decode_iq4_nl(const uint8_t *b, float *out) {
    iq4_values(b + 2, fp16_to_fp32(b), out);
}

static inline void decode_f16(const uint8_t *b, float *out) {
#if defined(__F16C__)
    for (int j = 0; j < 32; j += 8)
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * j))));
#else
    for (int j = 0; j < 32; j++) out[j] = fp16_to_fp32(b + 2 * j);
#endif
}

static inline void decode_bf16(const uint8_t *b, float *out) {
    for (int j = 0; j < 32; j++) {
        uint16_t h;
        memcpy(&h, b + 2 * j, 2);
        const uint32_t bits = (uint32_t)h << 16;
        memcpy(out + j, &bits, 4);
    }
}

/* Q2_K: value i = 128 h + 32 s + l (h < 2, s < 4, l < 32) is bits 2s..2s+1 of qs[32 h + l];
 * its group of 16 is i / 16, with scale nibble sc & 15 and minimum nibble sc >> 4. */
static inline void decode_q2_k(const uint8_t *b, float *out) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
#if defined(__AVX2__)
    const __m256i two_bits = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        for (int s = 0; s < 4; s++) {
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * s), two_bits);
            for (int half = 0; half < 2; half++) {
                const int g = 8 * h + 2 * s + half;
                const __m128i part = half ? _mm256_extracti128_si256(q, 1)
                                          : _mm256_castsi256_si128(q);
                put16(part, d * (float)(scales[g] & 15), -(dmin * (float)(scales[g] >> 4)),
                      out + 16 * g);
            }
        }
    }
#else
    for (int g = 0; g < 16; g++) {
        const float a = d * (float)(scales[g] & 15), m = dmin * (float)(scales[g] >> 4);
        const uint8_t *q = qs + 32 * (g / 8) + 16 * (g % 2);
        const int shift = 2 * ((g / 2) % 4);
        float *o = out + 16 * g;
        for (int l = 0; l < 16; l++) o[l] = a * (float)((q[l] >> shift) & 3) - m;
    }
#endif
}

/* Q3_K: the low two bits as Q2_K's; the third bit of value i = 32 s + l is bit s of
 * hmask[l], and a clear bit subtracts 4. The 16 six-bit scales: low nibbles from
 * scales[0..8) (scale j: byte j % 8, nibble j / 8), high two bits from scales[8..12)
 * (scale j: byte 8 + j % 4, bits 2 (j / 4)); each minus 32. */
static inline int q3_k_scale(const uint8_t *sc, int g) {
    const int low = (sc[g % 8] >> (4 * (g / 8))) & 15;
    const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
    return (low | (high << 4)) - 32;
}

static inline void decode_q3_k(const uint8_t *b, float *out) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = fp16_to_fp32(b + 108);
#if defined(__AVX2__)
    const __m256i two_bits = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)hmask);
    for (int h = 0; h < 2; h++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        for (int s = 0; s < 4; s++) {
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * s), two_bits);
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one);
            const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(bit, 2)),
                                              _mm256_set1_epi8(4));
            const int g = 8 * h + 2 * s;
            put16(_mm256_castsi256_si128(q), d * (float)q3_k_scale(sc, g), 0.0f, out + 16 * g);
            put16(_mm256_extracti128_si256(q, 1), d * (float)q3_k_scale(sc, g + 1), 0.0f,
                  out + 16 * (g + 1));
        }
    }
#else
    for (int g = 0; g < 16; g++) {
        const float a = d * (float)q3_k_scale(sc, g);
        const int l0 = 16 * (g % 2), shift = 2 * ((g / 2) % 4), bit = g / 2;
        const uint8_t *q = qs + 32 * (g / 8) + l0, *h = hmask + l0;
        float *o = out + 16 * g;
        for (int l = 0; l < 16; l++)
            o[l] = a * (float)(((q[l] >> shift) & 3) - 4 + 4 * ((h[l] >> bit) & 1));
    }
#endif
}

/* The eight 6-bit scales and minimums of Q4_K/Q5_K, packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int *sc, int *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* Q4_K: value i = 64 c + 32 h + l is nibble h of qs[32 c + l]; its group of 32 is i / 32. */
static inline void decode_q4_k(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
    const uint8_t *qs = b + 16;
    int sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    for (int g = 0; g < 8; g += 2) {
        const uint8_t *q = qs + 32 * (g / 2);
#if defined(__AVX2__)
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)q), low4 = _mm256_set1_epi8(15);
        put32(_mm256_and_si256(bytes, low4), d * (float)sc[g], -(dmin * (float)mn[g]),
              out + 32 * g);
        put32(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4), d * (float)sc[g + 1],
              -(dmin * (float)mn[g + 1]), out + 32 * (g + 1));
#else
        for (int h = 0; h < 2; h++) {
            const float a = d * (float)sc[g + h], m = dmin * (float)mn[g + h];
            for (int l = 0; l < 32; l++) out[32 * (g + h) + l] = a * (float)((q[l] >> 4 * h) & 15) - m;
        }
#endif
    }
}

/* Q5_K: Q4_K's nibbles, plus bit g of qh[l] as the fifth bit of value 32 g + l. */
static inline void decode_q5_k(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    int sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
#if defined(__AVX2__)
    const __m256i high = _mm256_loadu_si256((const __m256i *)qh), low4 = _mm256_set1_epi8(15);
    const __m256i one = _mm256_set1_epi8(1);
    for (int g = 0; g < 8; g++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * (g / 2)));
        const __m256i nibbles = _mm256_and_si256(_mm256_srli_epi16(bytes, 4 * (g % 2)), low4);
        const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(high, g), one);
        put32(_mm256_or_si256(nibbles, _mm256_slli_epi16(fifth, 4)), d * (float)sc[g],
              -(dmin * (float)mn[g]), out + 32 * g);
    }
#else
    for (int g = 0; g < 8; g++) {
        const float a = d * (float)sc[g], m = dmin * (float)mn[g];
        const uint8_t *q = qs + 32 * (g / 2);
        const int shift = 4 * (g % 2);
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 15) | (((qh[l] >> g) & 1) << 4);
            out[32 * g + l] = a * (float)v - m;
        }
    }
#endif
}

/* Q6_K: value i = 128 h + 32 s + l: low nibble (s / 2 picks the nibble) of
 * ql[64 h + 32 (s % 2) + l], high two bits (bits 2s) of qh[32 h + l]; minus 32; group i / 16
 * with an int8 scale. */
static inline void decode_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = fp16_to_fp32(b + 208);
#if defined(__AVX2__)
    const __m256i low4 = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        for (int s = 0; s < 4; s++) {
            const __m256i low_bytes = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (s % 2)));
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(low_bytes, 4 * (s / 2)), low4);
            const __m256i top = _mm256_and_si256(_mm256_srli_epi16(high, 2 * s), two_bits);
            const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)),
                                              _mm256_set1_epi8(32));
            const int g = 8 * h + 2 * s;
            put16(_mm256_castsi256_si128(q), d * (float)scales[g], 0.0f, out + 16 * g);
            put16(_mm256_extracti128_si256(q, 1), d * (float)scales[g + 1], 0.0f, out + 16 * (g + 1));
        }
    }
#else
    for (int g = 0; g < 16; g++) {
        const int h = g / 8, s = (g / 2) % 4, l0 = 16 * (g % 2);
        const float a = d * (float)scales[g];
        const uint8_t *low = ql + 64 * h + 32 * (s % 2) + l0, *high = qh + 32 * h + l0;
        const int low_shift = 4 * (s / 2), high_shift = 2 * s;
        float *o = out + 16 * g;
        for (int l = 0; l < 16; l++)
            o[l] = a * (float)((((low[l] >> low_shift) & 15) |
                                (((high[l] >> high_shift) & 3) << 4)) - 32);
    }
#endif
}

static inline void decode_iq4_xs(const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b);
    uint16_t scales_h;
    memcpy(&scales_h, b + 2, 2);
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int g = 0; g < 8; g++) {
        const int low = (scales_l[g / 2] >> (4 * (g % 2))) & 15;
        const int high = (scales_h >> (2 * g)) & 3;
        iq4_values(qs + 16 * g, d * (float)((low | (high << 4)) - 32), out + 32 * g);
    }
}

/* Per type: its row decoder (nb blocks, the block decoder inlined into the loop). */
#define ROW_DECODER(name, bytes, values)                                                  \
    static void name##_row(const uint8_t *row, int64_t nb, float *out) {                  \
        for (int64_t b = 0; b < nb; b++) decode_##name(row + b * (bytes), out + b * (values)); \
    }
ROW_DECODER(q4_0, 18, QK)
ROW_DECODER(q4_1, 20, QK)
ROW_DECODER(q8_0, 34, QK)
ROW_DECODER(q5_0, 22, QK)
ROW_DECODER(q5_1, 24, QK)
ROW_DECODER(iq4_nl, 18, QK)
ROW_DECODER(f16, 64, QK)
ROW_DECODER(bf16, 64, QK)
ROW_DECODER(q2_k, 84, QK_K)
ROW_DECODER(q3_k, 110, QK_K)
ROW_DECODER(q4_k, 144, QK_K)
ROW_DECODER(q5_k, 176, QK_K)
ROW_DECODER(q6_k, 210, QK_K)
ROW_DECODER(iq4_xs, 136, QK_K)

typedef void (*row_decoder)(const uint8_t *row, int64_t num_blocks, float *out);

static const struct block_type {
    int values, bytes;
    row_decoder decode_row;
} TYPES[VL_NUM_TYPES] = {
    [VL_Q4_0] = {QK, 18, q4_0_row},       [VL_Q4_1] = {QK, 20, q4_1_row},
    [VL_Q8_0] = {QK, 34, q8_0_row},       [VL_Q5_0] = {QK, 22, q5_0_row},
    [VL_Q5_1] = {QK, 24, q5_1_row},       [VL_IQ4_NL] = {QK, 18, iq4_nl_row},
    [VL_F16] = {QK, 64, f16_row},         [VL_BF16] = {QK, 64, bf16_row},
    [VL_Q2_K] = {QK_K, 84, q2_k_row},     [VL_Q3_K] = {QK_K, 110, q3_k_row},
    [VL_Q4_K] = {QK_K, 144, q4_k_row},    [VL_Q5_K] = {QK_K, 176, q5_k_row},
    [VL_Q6_K] = {QK_K, 210, q6_k_row},    [VL_IQ4_XS] = {QK_K, 136, iq4_xs_row},
};

int vl_block_bytes(int qtype) { return qtype >= 0 && qtype < VL_NUM_TYPES ? TYPES[qtype].bytes : -1; }

int vl_block_values(int qtype) {
    return qtype >= 0 && qtype < VL_NUM_TYPES ? TYPES[qtype].values : -1;
}

/* K values of one row (K a multiple of the type's block values) as float32. */
static inline void decode_row(const struct block_type *t, const uint8_t *row, int64_t K,
                              float *out) {
    t->decode_row(row, K / t->values, out);
}

/* out[n, :] = the N x K matrix's row n, as float32. */
void vl_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out,
                   int num_threads) {
    const struct block_type *t = &TYPES[qtype];
    const int64_t row_bytes = K / t->values * t->bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) decode_row(t, w + n * row_bytes, K, out + n * K);
}

/* out[t, :] = row ids[t] of the N x K matrix (an embedding lookup); returns -1, having
 * written nothing, when an id is outside 0..N-1. */
int vl_gather_rows(int qtype, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids,
                   int64_t T, float *out) {
    const struct block_type *t = &TYPES[qtype];
    const int64_t row_bytes = K / t->values * t->bytes;
    for (int64_t i = 0; i < T; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (int64_t i = 0; i < T; i++) decode_row(t, w + ids[i] * row_bytes, K, out + i * K);
    return 0;
}

/* ---- the generic product: decoded rows of W times rows of x ------------------------- */

#if defined(__AVX512F__)
typedef __m512 vec;
#define VW 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define VW 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
typedef float vec __attribute__((vector_size(16)));
#define VW 4
#define vzero() ((vec){0, 0, 0, 0})
static inline vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
#define vfma(a, b, c) ((c) + (a) * (b))
#define vsum(v) (((v)[0] + (v)[1]) + ((v)[2] + (v)[3]))
#endif

#define NROWS 4 /* rows of W decoded together */

/* y[i * N + r] = x[i] . wbuf[r] for i < MR, r < NRR: an MR x NRR tile over all K. */
static inline __attribute__((always_inline)) void decoded_tile(const int MR, const int NRR,
                                                                 const float *x, int64_t K,
                                                                 const float *wbuf, float *y,
                                                                 int64_t N) {
    vec acc[4][NROWS];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NRR; r++) acc[i][r] = vzero();
    for (int64_t k = 0; k < K; k += VW) {
        vec wv[NROWS];
        for (int r = 0; r < NRR; r++) wv[r] = vload(wbuf + r * K + k);
        for (int i = 0; i < MR; i++) {
            const vec xv = vload(x + i * K + k);
            for (int r = 0; r < NRR; r++) acc[i][r] = vfma(wv[r], xv, acc[i][r]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NRR; r++) y[i * N + r] = vsum(acc[i][r]);
}

/* Every row of x against NRR decoded rows of W (wbuf, row stride K). */
static void decoded_rows(int NRR, const float *x, int64_t M, int64_t K, const float *wbuf,
                         float *y, int64_t N) {
    int64_t m = 0;
    if (NRR == NROWS) {
        for (; m + 4 <= M; m += 4) decoded_tile(4, NROWS, x + m * K, K, wbuf, y + m * N, N);
        for (; m + 2 <= M; m += 2) decoded_tile(2, NROWS, x + m * K, K, wbuf, y + m * N, N);
        for (; m < M; m++) decoded_tile(1, NROWS, x + m * K, K, wbuf, y + m * N, N);
        return;
    }
    for (int r = 0; r < NRR; r++)
        for (m = 0; m < M; m++) decoded_tile(1, 1, x + m * K, K, wbuf + r * K, y + m * N + r, N);
}

/* y[M, N] = x @ W^T for any type: rows of W are split over the threads in chunks of 16, and
 * each thread decodes NROWS rows at a time into its buffer, then runs the tiles over it. */
static void generic_product(int qtype, const float *x, int64_t M, int64_t K,
                            const uint8_t *w, int64_t N, float *y, int num_threads) {
    const struct block_type *t = &TYPES[qtype];
    const int64_t row_bytes = K / t->values * t->bytes, chunk = 16;
    const int64_t num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = aligned_alloc(64, (size_t)(NROWS * K * sizeof(float)) + 64);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < num_chunks; c++) {
            const int64_t n1 = (c + 1) * chunk < N ? (c + 1) * chunk : N;
            for (int64_t n = c * chunk; n < n1; n += NROWS) {
                const int rows = n1 - n < NROWS ? (int)(n1 - n) : NROWS;
                for (int r = 0; r < rows; r++) decode_row(t, w + (n + r) * row_bytes, K, wbuf + r * K);
                decoded_rows(rows, x, M, K, wbuf, y + n, N);
            }
        }
        free(wbuf);
    }
}

/* A function `name` running the rows function `body` (rows n0..n1 of W against every row of
 * x, of type X) with the type code a constant: one function per type and kernel, so each
 * tile is compiled for its type alone. */
#define TYPED_ROWS(name, body, X, code)                                                    \
    static void name(const X *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,        \
                     int64_t n0, int64_t n1, float *y) {                                   \
        body(code, x, M, K, w, N, n0, n1, y);                                              \
    }

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/*
 * Products with few rows of x (a decode step), in registers (AVX2), for the types whose
 * values can be had without shuffling a loaded vector: 8 bytes of the block are widened to
 * eight 32-bit lanes straight from memory (one instruction), and masks and shifts of those
 * lanes give the values (a 4-bit type's low nibbles are 8 values, its high nibbles 8 more),
 * exactly the decoders' a * q + b, each multiplied into the accumulators at once, in
 * ascending k as the generic product sums (so the same bits). Decoding
 * blocks into a buffer and reading them back costs more than redoing this per tile
 * (measured per type against that generic product: REGISTER_TILES). A tile is MR rows of x
 * by NR rows of W, and each vector of x is shared by the NR rows.
 */

/* 8 bytes at p as eight 32-bit lanes. */
static inline __m256i widen8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* acc[i] += v * x[i * K + k .. + 8) for the MR rows of x. */
#define FMA_X(v, k)                                                                      \
    for (int i = 0; i < MR; i++)                                                         \
        acc[i][r] = _mm256_fmadd_ps((v), _mm256_loadu_ps(x + i * K + (k)), acc[i][r])

/* value = a * q + b for 8 integer lanes q (a * q exact: one rounding). */
#define AQB(q, a, b) _mm256_fmadd_ps((a), _mm256_cvtepi32_ps(q), (b))

static inline __attribute__((always_inline)) void register_tile(int qtype, const int MR,
                                                                 const int NR, const float *x,
                                                                 int64_t K, const uint8_t *w,
                                                                 int64_t row_bytes, float *y,
                                                                 int64_t ldy) {
    const int values = TYPES[qtype].values, bytes = TYPES[qtype].bytes;
    const __m256i low4 = _mm256_set1_epi32(15), bit = _mm256_set1_epi32(1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[2][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < K / values; blk++) {
        /* Tiles of NR rows follow each other: prefetch PREFETCH_TILES tiles ahead. */
        const char *ahead = (const char *)w + PREFETCH_TILES * NR * row_bytes + blk * NR * bytes;
        for (int line = 0; line < NR * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        const int64_t k0 = blk * values;
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = w + r * row_bytes + blk * bytes;
            switch (qtype) {
            case VL_Q8_0: {
                const __m256 d = _mm256_set1_ps(fp16_to_fp32(b));
                for (int j = 0; j < 32; j += 8) {
                    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + j)));
                    FMA_X(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), k0 + j);
                }
                break;
            }
            case VL_Q4_0:
            case VL_Q4_1: { /* Q4_0: d * (n - 8) = d * n - 8 d, exactly (15 bits) */
                const float d = fp16_to_fp32(b);
                const float m = qtype == VL_Q4_1 ? fp16_to_fp32(b + 2) : -8.0f * d;
                const __m256 a = _mm256_set1_ps(d), c = _mm256_set1_ps(m);
                const uint8_t *qs = b + (qtype == VL_Q4_1 ? 4 : 2);
                const __m256i u0 = widen8(qs), u1 = widen8(qs + 8);
                FMA_X(AQB(_mm256_and_si256(u0, low4), a, c), k0);
                FMA_X(AQB(_mm256_and_si256(u1, low4), a, c), k0 + 8);
                FMA_X(AQB(_mm256_srli_epi32(u0, 4), a, c), k0 + 16);
                FMA_X(AQB(_mm256_srli_epi32(u1, 4), a, c), k0 + 24);
                break;
            }
            case VL_Q5_0:
            case VL_Q5_1: { /* Q5_0: d * (n - 16) = d * n - 16 d, exactly */
                const float d = fp16_to_fp32(b);
                const float m = qtype == VL_Q5_1 ? fp16_to_fp32(b + 2) : -16.0f * d;
                const __m256 a = _mm256_set1_ps(d), c = _mm256_set1_ps(m);
                const uint8_t *qh_bytes = b + (qtype == VL_Q5_1 ? 4 : 2), *qs = qh_bytes + 4;
                uint32_t qh;
                memcpy(&qh, qh_bytes, 4);
                const __m256i high = _mm256_set1_epi32((int)qh);
                for (int j = 0; j < 32; j += 8) { /* values j..j+7: nibble j / 16 of qs[j % 16] */
                    const __m256i u = widen8(qs + j % 16);
                    const __m256i nibble = j < 16 ? _mm256_and_si256(u, low4) : _mm256_srli_epi32(u, 4);
                    const __m256i fifth = _mm256_and_si256(
                        _mm256_srlv_epi32(high, _mm256_add_epi32(lanes, _mm256_set1_epi32(j))), bit);
                    FMA_X(AQB(_mm256_or_si256(nibble, _mm256_slli_epi32(fifth, 4)), a, c), k0 + j);
                }
                break;
            }
            case VL_IQ4_NL:
            case VL_IQ4_XS: { /* group g: 16 bytes, low nibbles then high; a = d (times ls) */
                /* The table's values plus 128 looked up per lane's low byte (the other three
                 * bytes index with their top bit set: zeros), then a t - 128 a in one fused
                 * multiply-add: a (t - 128) is the decoder's a * value, exactly. */
                const __m256i table = _mm256_broadcastsi128_si256(
                    _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153,
                                  (char)166, (char)181, (char)197, (char)217, (char)241));
                const __m256i high_bytes = _mm256_set1_epi32((int)0x80808000);
                const float d = fp16_to_fp32(b);
                for (int g = 0; g < values / 32; g++) {
                    float scale = d;
                    const uint8_t *qs = b + 2;
                    if (qtype == VL_IQ4_XS) {
                        uint16_t scales_h;
                        memcpy(&scales_h, b + 2, 2);
                        const int low = (b[4 + g / 2] >> (4 * (g % 2))) & 15;
                        const int high = (scales_h >> (2 * g)) & 3;
                        scale = d * (float)((low | (high << 4)) - 32);
                        qs = b + 8 + 16 * g;
                    }
                    const __m256 a = _mm256_set1_ps(scale), c = _mm256_set1_ps(-128.0f * scale);
                    const __m256i u[2] = {widen8(qs), widen8(qs + 8)};
                    for (int p = 0; p < 4; p++) { /* values 8p..8p+7 of the group */
                        const __m256i nibble = p < 2 ? _mm256_and_si256(u[p], low4)
                                                     : _mm256_srli_epi32(u[p - 2], 4);
                        const __m256i t = _mm256_shuffle_epi8(table, _mm256_or_si256(nibble, high_bytes));
                        FMA_X(AQB(t, a, c), k0 + 32 * g + 8 * p);
                    }
                }
                break;
            }
#if defined(__F16C__)
            case VL_F16:
                for (int j = 0; j < 32; j += 8)
                    FMA_X(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * j))), k0 + j);
                break;
#endif
            case VL_BF16:
                for (int j = 0; j < 32; j += 8) {
                    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 2 * j)));
                    FMA_X(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), k0 + j);
                }
                break;
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) y[i * ldy + r] = vsum(acc[i][r]);
}

#define REGISTER_TILE(MR, NR) \
    register_tile(qtype, MR, NR, x + m * K, K, w + n * row_bytes, row_bytes, y + m * N + n, N)

/* Rows n0..n1 of W against every row of x, in tiles of two rows of x by four of W. */
static inline __attribute__((always_inline)) void register_rows(int qtype, const float *x,
                                                                 int64_t M, int64_t K,
                                                                 const uint8_t *w, int64_t N,
                                                                 int64_t n0, int64_t n1, float *y) {
    const int64_t row_bytes = K / TYPES[qtype].values * TYPES[qtype].bytes;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) REGISTER_TILE(2, 4);
        for (; n < n1; n++) REGISTER_TILE(2, 1);
    }
    for (; m < M; m++) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) REGISTER_TILE(1, 4);
        for (; n < n1; n++) REGISTER_TILE(1, 1);
    }
}

#define REGISTER_ROWS(name, code) TYPED_ROWS(name##_register_rows, register_rows, float, code)
REGISTER_ROWS(q4_0, VL_Q4_0)
REGISTER_ROWS(q4_1, VL_Q4_1)
REGISTER_ROWS(q8_0, VL_Q8_0)
REGISTER_ROWS(q5_0, VL_Q5_0)
REGISTER_ROWS(q5_1, VL_Q5_1)
REGISTER_ROWS(iq4_nl, VL_IQ4_NL)
REGISTER_ROWS(iq4_xs, VL_IQ4_XS)
#if defined(__F16C__)
REGISTER_ROWS(f16, VL_F16)
#endif
REGISTER_ROWS(bf16, VL_BF16)

typedef void (*register_rows_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t,
                                 int64_t, int64_t, float *);
/* The types with register tiles, and the most rows of x they take: a tile decodes its
 * weights once per two rows of x, so only the cheapest decoders pay for many rows. Every
 * tile sums in the generic product's order (ascending k, eight lanes), so a row's result is
 * the same bits whichever path a batch takes. Measured on an AVX2 EPYC (Zen 3) against the
 * generic product, one row of x: F16/BF16 2.0-2.5x, Q8_0 1.8-2.4x, Q4_0/Q4_1 1.9-2.2x,
 * Q5_0/Q5_1 1.4-1.5x, IQ4_NL 1.3-1.5x, IQ4_XS 1.2x; 31 rows: F16/BF16 1.4x, Q8_0/Q4_1 1.2x;
 * at 4 rows Q5_0/Q5_1 1.2x, IQ4_NL 1.3x, IQ4_XS 1.0x; at 8 about 1.0x or less. The K-quants,
 * decoded in this order, were slower than the buffer (0.4x to 1.1x): they keep it. */
static const struct {
    register_rows_fn rows;
    int64_t max_rows;
} REGISTER_TILES[VL_NUM_TYPES] = {
    [VL_Q4_0] = {q4_0_register_rows, 31}, [VL_Q4_1] = {q4_1_register_rows, 31},
    [VL_Q8_0] = {q8_0_register_rows, 31}, [VL_Q5_0] = {q5_0_register_rows, 4},
    [VL_Q5_1] = {q5_1_register_rows, 4},  [VL_BF16] = {bf16_register_rows, 31},
    [VL_IQ4_NL] = {iq4_nl_register_rows, 4}, [VL_IQ4_XS] = {iq4_xs_register_rows, 2},
#if defined(__F16C__)
    [VL_F16] = {f16_register_rows, 31},
#endif
};

/* y[M, N] = x @ W^T in register tiles, rows of W split over the threads in chunks of 16. */
static void register_product(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t N, float *y, int num_threads) {
    const register_rows_fn rows = REGISTER_TILES[qtype].rows;
    const int64_t chunk = 16, num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < num_chunks; c++)
        rows(x, M, K, w, N, c * chunk, (c + 1) * chunk < N ? (c + 1) * chunk : N, y);
}
#endif

#if defined(__AVX512F__)

/* Block b of a row as two vectors: values 0..15 in *lo, 16..31 in *hi (exactly as above). */
static inline float fp16_to_fp32_hw(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __attribute__((always_inline)) void load_block(int qtype, const uint8_t *b,
                                                               __m512 *lo, __m512 *hi) {
    if (qtype == VL_F16) { /* 32 half-precision values, widened exactly */
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        return;
    }
    if (qtype == VL_BF16) { /* bfloat16 is float32's high half */
        const __m512i h0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b));
        const __m512i h1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32)));
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(h0, 16));
        *hi = _mm512_castsi512_ps(_mm512_slli_epi32(h1, 16));
        return;
    }
    const __m512 d = _mm512_set1_ps(fp16_to_fp32_hw(b));
    if (qtype == VL_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    /* A 16-entry table of the block's values, value(q) = d * q + m (m = -8 d for Q4_0), looked
     * up by each nibble: d * q is exact in float32, so the fused multiply-add rounds once,
     * exactly like d * q + m. */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    const uint8_t *qs;
    if (qtype == VL_Q4_1) {
        table = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(fp16_to_fp32_hw(b + 2)));
        qs = b + 4;
    } else {
        table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
        qs = b + 2;
    }
    /* permutexvar reads only the low 4 bits of each index: no mask for the low nibbles. */
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *lo = _mm512_permutexvar_ps(bytes, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

/* y[i, n..n+NR) for the MR rows x[0..MR) (row stride K): an MR x NR tile of dot products. */
static inline __attribute__((always_inline)) void tile(int qtype, const int MR, const int NR,
                                                         const float *x, int64_t K,
                                                         const uint8_t *w, int64_t row_bytes,
                                                         int64_t bb, float *y, int64_t ldy) {
    __m512 acc[8][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; b++) {
        __m512 wlo[4], whi[4];
        /* A tile's NR rows are contiguous, and so are consecutive tiles: prefetch
         * PREFETCH_TILES tiles ahead, two cache lines per block step (measured on the
         * default model: 10.0 -> 5.5 ms per decode step's products on one thread). */
        const char *ahead = (const char *)w + PREFETCH_TILES * NR * row_bytes + b * NR * bb;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        if (bb == 64) /* F16/BF16: NR cache lines per block step */
            for (int line = 2; line < NR; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
        for (int r = 0; r < NR; r++) load_block(qtype, w + r * row_bytes + b * bb, &wlo[r], &whi[r]);
        for (int i = 0; i < MR; i++) {
            const __m512 xlo = _mm512_loadu_ps(x + i * K + b * QK);
            const __m512 xhi = _mm512_loadu_ps(x + i * K + b * QK + 16);
            for (int r = 0; r < NR; r++) {
                acc[i][r] = _mm512_fmadd_ps(wlo[r], xlo, acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(whi[r], xhi, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i][r]);
}

#define TILE(MR, NR) tile(qtype, MR, NR, x + m * K, K, w + n * row_bytes, row_bytes, bb, \
                          y + m * N + n, N)

/* Any number of rows of x: tiles of four, two and one rows (each pass over W decodes its
 * blocks again; the blocks are in the cache by then). */
static void rows_in_tiles(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                          int64_t N, int64_t n0, int64_t n1, float *y) {
    const int64_t bb = vl_block_bytes(qtype), row_bytes = (K / QK) * bb;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) TILE(4, 4);
        for (; n + 2 <= n1; n += 2) TILE(4, 2);
        for (; n < n1; n++) TILE(4, 1);
    }
    for (; m + 2 <= M; m += 2) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) TILE(2, 4);
        for (; n < n1; n++) TILE(2, 1);
    }
    for (; m < M; m++) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) TILE(1, 4);
        for (; n < n1; n++) TILE(1, 1);
    }
}

/* Rows n0..n1 of W times all M (<= 8) rows of x in one pass: every weight block is decoded
 * once for all of them. NR rows of W per tile keep MR * NR accumulators, NR decoded blocks
 * and the x vectors within the 32 vector registers. */
#define ONE_PASS(MR, NR)                                   \
    do {                                                   \
        int64_t n = n0;                                    \
        for (; n + NR <= n1; n += NR) TILE(MR, NR);        \
        for (; n < n1; n++) TILE(MR, 1);                   \
    } while (0)

static void rows_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                       int64_t N, int64_t n0, int64_t n1, float *y) {
    const int64_t bb = vl_block_bytes(qtype), row_bytes = (K / QK) * bb;
    const int64_t m = 0;
    switch (M) {
    case 1: ONE_PASS(1, 4); return;
    case 2: ONE_PASS(2, 4); return;
    case 3: ONE_PASS(3, 4); return;
    case 4: ONE_PASS(4, 4); return;
    case 5: ONE_PASS(5, 3); return;
    case 6: ONE_PASS(6, 3); return;
    case 7: ONE_PASS(7, 2); return;
    case 8: ONE_PASS(8, 2); return;
    default: break;
    }
    rows_in_tiles(qtype, x, M, K, w, N, n0, n1, y);
}

#endif

#if defined(__AVX512F__)

/*
 * Many rows of x (a prefill, a large batch): an outer-product GEMM on whole strips of 32
 * rows of x. Each strip is packed once, transposed, into a contiguous [K, 32] panel of xs
 * (so the inner loop walks memory in order: no page-sized strides, no TLB misses on long
 * prefills); each thread dequantizes PANEL rows of W into a float32 buffer, then for each
 * strip accumulates a PANEL x 32 tile of y^T in registers, one broadcast weight times two
 * vectors of x per FMA pair. Strips are taken STRIPS_PER_PASS at a time so the packed x of
 * a pass stays in the core's L2 while every panel of W goes over it.
 */
#define PANEL 6
#define STRIP 32
#define STRIPS_PER_PASS 4

static void gemm_panel(const float *wbuf, int64_t K, const float *xs, int64_t s0, int64_t s1,
                       int64_t n0, int64_t rows, int64_t N, float *y) {
    for (int64_t strip = s0; strip < s1; strip++) {
        __m512 acc[PANEL][2];
        for (int r = 0; r < PANEL; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const float *col = xs + strip * K * STRIP;
        for (int64_t k = 0; k < K; k++) {
            const __m512 b0 = _mm512_load_ps(col + k * STRIP);
            const __m512 b1 = _mm512_load_ps(col + k * STRIP + 16);
            for (int r = 0; r < PANEL; r++) {
                const __m512 a = _mm512_set1_ps(wbuf[r * K + k]);
                acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            }
        }
        float tile[PANEL][STRIP];
        for (int r = 0; r < PANEL; r++) {
            _mm512_storeu_ps(tile[r], acc[r][0]);
            _mm512_storeu_ps(tile[r] + 16, acc[r][1]);
        }
        float *out = y + strip * STRIP * N + n0;
        for (int64_t i = 0; i < STRIP; i++)
            for (int64_t r = 0; r < rows; r++) out[i * N + r] = tile[r][i];
    }
}

/* M is a multiple of STRIP. */
static void gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                 float *y, int num_threads) {
    const int64_t bb = vl_block_bytes(qtype), row_bytes = (K / QK) * bb, nb = K / QK;
    const int64_t num_strips = M / STRIP;
    float *xs = aligned_alloc(64, (size_t)(K * M * sizeof(float)));
    /* Pack: xs[strip][k][i] = x[strip * 32 + i][k], in 32 x 32 tiles so reads and writes
     * both stay in cache. */
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t strip = 0; strip < num_strips; strip++)
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            float *dst = xs + strip * K * STRIP;
            const float *src = x + strip * STRIP * K;
            for (int64_t k = k0; k < k0 + 32; k++)
                for (int64_t i = 0; i < STRIP; i++) dst[k * STRIP + i] = src[i * K + k];
        }
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = aligned_alloc(64, (size_t)(PANEL * K * sizeof(float)));
        for (int64_t s0 = 0; s0 < num_strips; s0 += STRIPS_PER_PASS) {
            const int64_t s1 = s0 + STRIPS_PER_PASS < num_strips ? s0 + STRIPS_PER_PASS
                                                                 : num_strips;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t n0 = p * PANEL, rows = N - n0 < PANEL ? N - n0 : PANEL;
                for (int64_t r = 0; r < PANEL; r++) {
                    float *dst = wbuf + r * K;
                    if (r >= rows) {
                        memset(dst, 0, (size_t)K * sizeof(float));
                        continue;
                    }
                    for (int64_t b = 0; b < nb; b++) {
                        __m512 lo, hi;
                        load_block(qtype, w + (n0 + r) * row_bytes + b * bb, &lo, &hi);
                        _mm512_storeu_ps(dst + b * QK, lo);
                        _mm512_storeu_ps(dst + b * QK + 16, hi);
                    }
                }
                gemm_panel(wbuf, K, xs, s0, s1, n0, rows, N, y);
            }
        }
        free(wbuf);
    }
    free(xs);
}

#endif

static inline int has_register_decoder(int qtype) {
    return qtype <= VL_Q8_0 || qtype == VL_F16 || qtype == VL_BF16;
}

/* 1 when vl_matmul runs many rows of x (M >= 32) as a blocked GEMM for this type; 0 when the
 * caller had better decode W in panels (vl_dequantize) and use a dense product instead
 * (F16/BF16 too: PyTorch's GEMM beats this one's on their panels). */
int vl_has_gemm(int qtype) {
#if defined(__AVX512F__)
    return qtype <= VL_Q8_0;
#else
    (void)qtype;
    return 0;
#endif
}

/*
 * y[M, N] = x[M, K] @ W[N, K]^T with W block-quantized (qtype), K a multiple of the type's
 * block values. With AVX-512, for Q4_0/Q4_1/Q8_0: whole 32-row strips of x go to the blocked
 * GEMM above; the rows left over (all of them for a decode of fewer than 32 sequences) go to
 * register tiles, with no padding: rows of W are split over the threads in chunks of `chunk`
 * rows, and every thread walks those rows of x for its chunk, so each weight block is read
 * from memory once. Every other type and machine: generic_product.
 */
void vl_matmul(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
               float *y, int num_threads) {
#if defined(__AVX512F__)
    if (has_register_decoder(qtype)) {
        const int64_t gemm_rows = vl_has_gemm(qtype) ? M / STRIP * STRIP : 0;
        if (gemm_rows > 0) {
            gemm(qtype, x, gemm_rows, K, w, N, y, num_threads);
            x += gemm_rows * K;
            y += gemm_rows * N;
            M -= gemm_rows;
            if (M == 0) return;
        }
        const int64_t chunk = 16;
        const int64_t num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t c = 0; c < num_chunks; c++) {
            const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            rows_range(qtype, x, M, K, w, N, n0, n1, y);
        }
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (REGISTER_TILES[qtype].rows != NULL && M <= REGISTER_TILES[qtype].max_rows) {
        register_product(qtype, x, M, K, w, N, y, num_threads);
        return;
    }
#endif
    generic_product(qtype, x, M, K, w, N, y, num_threads);
}

#include "quantized_activations.h"
