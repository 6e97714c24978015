/*
 * Paged causal attention on the CPU, float32, in one call per layer: write the step's new
 * keys and values into the paged cache, then let every new token attend to its sequence's
 * context straight from the cache blocks (no gathered copy, no padding).
 *
 * The cache holds float32 or, with cache_half, float16 values (llama.cpp's default): the
 * new keys and values are rounded to float16 as they are written (to nearest, ties to
 * even, as PyTorch's .to(torch.float16)), and read back as float32, so everything else
 * computes in float32. A decode step of many sequences reads the whole context of each from
 * memory, once per layer: float16 halves those bytes.
 *
 * Layout (vlite's default cache): k_cache and v_cache are [num_blocks * block_size,
 * num_kv_heads, head_dim]; slot = block_id * block_size + offset. Token t of sequence s
 * (rows query_start_loc[s] .. query_start_loc[s + 1]) sits at position
 * seq_lens[s] - query_len + (t - query_start_loc[s]) and sees keys 0 .. position (with a
 * sliding window > 0, keys position - window + 1 .. position: the loops start at the first
 * visible key's group and mask the keys before it).
 *
 * Work item = (token, KV head) or, in a step of few tokens, (chunk of a token's keys, KV
 * head): the query heads that share the KV head are done together, with an online softmax
 * that is rescaled once per group of keys; chunks of 256 keys at fixed positions are folded
 * in order, so a token's result does not depend on its batch or the threads. With AVX-512 and a head
 * size of 32, 64, 128 or 256 (attend16), keys go 16 at a time: their 16 scores are summed into one
 * vector by a transposing tree of shuffles, the exponentials are a degree-7 polynomial
 * (within 1e-8 relative of expf) on that vector, and the head's output accumulator stays in
 * registers. With AVX2 + FMA and a head size of 32 to 256 (attend8), the same scheme runs 8
 * keys at a time (the accumulator in L1: AVX2 has 16 registers); at 192 keys of a
 * 9-head, 3-KV-head, 64-dim layer that is 33 us per call instead of 112 us. Elsewhere
 * (attend) keys go one cache block at a time with scalar dot products.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_GROUP_VALUES 8192 /* query heads per KV head x head_dim, on the stack */

/* IEEE float16 <-> float32 in integer arithmetic, for CPUs without F16C (and compilers
 * without a float16 type): the same values as the hardware conversions, rounding to
 * nearest, ties to even. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F;
    const uint32_t mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13); /* infinity, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t a = x & 0x7FFFFFFF;
    if (a > 0x7F800000) return sign | 0x7E00;  /* NaN */
    if (a >= 0x477FF000) return sign | 0x7C00; /* 65520 and up round to infinity */
    if (a >= 0x38800000) {                     /* a normal float16: rebias, round 13 bits */
        const uint32_t r = a - 0x38000000;
        return sign | (uint16_t)((r + 0x0FFF + ((r >> 13) & 1)) >> 13);
    }
    if (a < 0x33000000) return sign; /* below 2^-25 (2^-25 itself ties to 0) */
    /* A subnormal float16: |f| * 2^24 rounded to an integer (1024 is the smallest normal). */
    const uint32_t m = (a & 0x7FFFFF) | 0x800000;
    const int shift = 126 - (int)(a >> 23);
    uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (q & 1))) q++;
    return sign | (uint16_t)q;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 cache values from `index` on, as floats. */
static inline __attribute__((always_inline)) __m512 load16(const void *cache, int64_t index,
                                                           int half) {
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + index)));
    return _mm512_loadu_ps((const float *)cache + index);
}

/* exp(x) for 16 floats, x <= 0 (scores minus their running maximum): 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2 / 2, p the degree-7 Taylor polynomial (error < 1e-8 relative);
 * x below -87 gives 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 floor_x = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor_x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

/* s[j] = exp(s[j] - shift) for j < n; returns their sum. */
static inline float exp_shifted(float *s, int64_t n, float shift) {
    __m512 total = _mm512_setzero_ps();
    const __m512 offset = _mm512_set1_ps(shift);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), offset));
        _mm512_mask_storeu_ps(s + j, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(total);
}
/* r[j] = the sum of the 16 lanes of v[j], for j < 16: a transposing tree of in-lane
 * unpacks and cross-lane shuffles, about three instructions per sum instead of a full
 * horizontal reduction for each. */
static inline __m512 lane_sums16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane L: [v2i, v2i+1, v2i, v2i+1] partial sums */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* lane L: v4i .. v4i+3, each summed over lane L */
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* Fold the four lanes of quads[i] into lane i of the result. */
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

/* One tile of n keys (from `base`, `row` floats or halves apart in keys and values) for
 * the group's query heads: scores, the running softmax and the accumulators. */
static inline __attribute__((always_inline)) void attend16_heads(
    const int DV, const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t t,
    int64_t g, int64_t group, const void *keys, const void *values, const int half,
    int64_t base, int64_t row, int64_t n, __mmask16 valid, __m512 scale16, float *acc,
    float *running_max, float *running_sum) {
    const int64_t D = 16 * DV;
    for (int64_t h = 0; h < group; h++) {
        const float *qh = q + t * q_tok_stride + (g * group + h) * q_head_stride;
        __m512 qv[DV], partial[16];
        for (int c = 0; c < DV; c++) qv[c] = _mm512_loadu_ps(qh + 16 * c);
        for (int j = 0; j < 16; j++) {
            partial[j] = _mm512_setzero_ps();
            if (j < n)
                for (int c = 0; c < DV; c++)
                    partial[j] = _mm512_fmadd_ps(qv[c], load16(keys, base + j * row + 16 * c, half),
                                                 partial[j]);
        }
        const __m512 scores = _mm512_mask_mov_ps(
            _mm512_set1_ps(-INFINITY), valid, _mm512_mul_ps(lane_sums16(partial), scale16));
        const float tile_max = _mm512_reduce_max_ps(scores);
        const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
        const float correction = expf(running_max[h] - new_max);
        running_max[h] = new_max;
        const __m512 p = _mm512_maskz_mov_ps(
            valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
        running_sum[h] = running_sum[h] * correction + _mm512_reduce_add_ps(p);
        float weight[16];
        _mm512_storeu_ps(weight, p);
        float *a = acc + h * D;
        __m512 even[DV], odd[DV];
        for (int c = 0; c < DV; c++) {
            even[c] = _mm512_mul_ps(_mm512_load_ps(a + 16 * c), _mm512_set1_ps(correction));
            odd[c] = _mm512_setzero_ps();
        }
        int64_t j = 0;
        for (; j + 2 <= n; j += 2) {
            const __m512 w0 = _mm512_set1_ps(weight[j]), w1 = _mm512_set1_ps(weight[j + 1]);
            for (int c = 0; c < DV; c++) {
                even[c] = _mm512_fmadd_ps(w0, load16(values, base + j * row + 16 * c, half), even[c]);
                odd[c] = _mm512_fmadd_ps(w1, load16(values, base + (j + 1) * row + 16 * c, half),
                                         odd[c]);
            }
        }
        if (j < n) {
            const __m512 w0 = _mm512_set1_ps(weight[j]);
            for (int c = 0; c < DV; c++)
                even[c] = _mm512_fmadd_ps(w0, load16(values, base + j * row + 16 * c, half), even[c]);
        }
        for (int c = 0; c < DV; c++) _mm512_store_ps(a + 16 * c, _mm512_add_ps(even[c], odd[c]));
    }
}

/*
 * attend() for head_dim = 16 * DV: keys are taken 16 at a time (a block size is a multiple
 * of 16), their 16 scores come out of one lane_sums16 in one vector, softmax runs on that
 * vector, and the head's accumulator stays in registers while the 16 values are added
 * (two interleaved sets, so the additions are not one long dependency chain).
 */
static inline __attribute__((always_inline)) void attend16(
    const int DV, const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t t,
    int64_t g, int64_t first_key, int64_t key_end, const int32_t *table, const void *k_cache,
    const void *v_cache, const int half, int64_t Hkv, int64_t group, int64_t block_size,
    float scale, float *acc, float *running_max, float *running_sum) {
    const int64_t D = 16 * DV, row = Hkv * D; /* values from one cache slot to the next */
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t h = 0; h < group; h++) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    const int64_t num_keys = key_end;
    for (int64_t first = first_key & ~(int64_t)15; first < num_keys; first += 16) {
        const int64_t n = num_keys - first < 16 ? num_keys - first : 16;
        __mmask16 valid = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
        if (first < first_key) valid &= (__mmask16) ~((1u << (first_key - first)) - 1);
        const int64_t slot = (int64_t)table[first / block_size] * block_size + first % block_size;
        const int64_t base = slot * row + g * D; /* the first key's and value's index */
        /* A float32 cache's next tile, asked of memory ahead: 3-9% faster at 32 x 201,
         * 1 x 4,097 and 8 x 1,001 keys in two runs (benchmarks/cpu_attention.py --baseline);
         * a float16 tile, half the bytes, was no faster or 2-3% slower with it. */
        if (!half && first + 16 < num_keys) {
            const int64_t next = first + 16;
            const int64_t next_slot =
                (int64_t)table[next / block_size] * block_size + next % block_size;
            const float *k = (const float *)k_cache + next_slot * row + g * D;
            const float *v = (const float *)v_cache + next_slot * row + g * D;
            for (int j = 0; j < 16; j++)
                for (int64_t at = 0; at < D; at += 16) {
                    _mm_prefetch((const char *)(k + j * row + at), _MM_HINT_T0);
                    _mm_prefetch((const char *)(v + j * row + at), _MM_HINT_T0);
                }
        }
        /* A float16 tile read by several query heads is converted once, here (the same
         * values, so the same bits): best of 2 runs 6-8% faster at 32 x 201 and 8 x 1,001
         * keys, medians within the noise (benchmarks/cpu_attention.py --baseline). */
        if (half && group > 1) {
            float keys[16 * 16 * DV] __attribute__((aligned(64)));
            float values[16 * 16 * DV] __attribute__((aligned(64)));
            for (int64_t j = 0; j < n; j++)
                for (int c = 0; c < DV; c++) {
                    _mm512_store_ps(keys + j * D + 16 * c, load16(k_cache, base + j * row + 16 * c, 1));
                    _mm512_store_ps(values + j * D + 16 * c, load16(v_cache, base + j * row + 16 * c, 1));
                }
            attend16_heads(DV, q, q_tok_stride, q_head_stride, t, g, group, keys, values, 0, 0, D, n,
                           valid, scale16, acc, running_max, running_sum);
        } else {
            attend16_heads(DV, q, q_tok_stride, q_head_stride, t, g, group, k_cache, v_cache, half,
                           base, row, n, valid, scale16, acc, running_max, running_sum);
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_exp.h"

/* 8 cache values from `index` on, as floats (float16 needs F16C; without it a float16
 * cache takes attend()). */
static inline __attribute__((always_inline)) __m256 load8(const void *cache, int64_t index,
                                                          int half) {
#if defined(__F16C__)
    if (half)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + index)));
#endif
    (void)half;
    return _mm256_loadu_ps((const float *)cache + index);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* r[j] = the sum of the 8 lanes of v[j], for j < 8 (a tree of horizontal adds). */
static inline __m256 lane_sums8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a: [s0 s1 s2 s3 | s0 s1 s2 s3] halves (low and high 128-bit lanes), same for b. */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/*
 * attend() for head_dim = 8 * DV (AVX2): attend16's scheme with 8 keys at a time. The
 * head's accumulator lives in `acc` (in L1) rather than in registers: AVX2 has 16 of them.
 */
static inline __attribute__((always_inline)) void attend8(
    const int DV, const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t t,
    int64_t g, int64_t first_key, int64_t key_end, const int32_t *table, const void *k_cache,
    const void *v_cache, const int half, int64_t Hkv, int64_t group, int64_t block_size,
    float scale, float *acc, float *running_max, float *running_sum) {
    const int64_t D = 8 * DV, row = Hkv * D;
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t h = 0; h < group; h++) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    const __m256 scale8 = _mm256_set1_ps(scale), minus_inf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t num_keys = key_end;
    for (int64_t first = first_key & ~(int64_t)7; first < num_keys; first += 8) {
        const int64_t n = num_keys - first < 8 ? num_keys - first : 8;
        const int64_t hidden = first < first_key ? first_key - first : 0;
        const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane),
            _mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)hidden - 1))));
        const int64_t slot = (int64_t)table[first / block_size] * block_size + first % block_size;
        const int64_t base = slot * row + g * D; /* the first key's and value's index */
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + t * q_tok_stride + (g * group + h) * q_head_stride;
            __m256 partial[8];
            for (int j = 0; j < 8; j++) {
                partial[j] = _mm256_setzero_ps();
                if (j < n)
                    for (int c = 0; c < DV; c++)
                        partial[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c),
                                                     load8(k_cache, base + j * row + 8 * c, half),
                                                     partial[j]);
            }
            const __m256 scores =
                _mm256_blendv_ps(minus_inf, _mm256_mul_ps(lane_sums8(partial), scale8), valid);
            const float tile_max = max8(scores);
            const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
            const float correction = expf(running_max[h] - new_max);
            running_max[h] = new_max;
            const __m256 p =
                _mm256_and_ps(valid, vl_exp8(_mm256_sub_ps(scores, _mm256_set1_ps(new_max))));
            running_sum[h] = running_sum[h] * correction + sum8(p);
            float weight[8];
            _mm256_storeu_ps(weight, p);
            float *a = acc + h * D;
            const __m256 fix = _mm256_set1_ps(correction);
            for (int c = 0; c < DV; c++) {
                __m256 sum = _mm256_mul_ps(_mm256_load_ps(a + 8 * c), fix);
                for (int64_t j = 0; j < n; j++)
                    sum = _mm256_fmadd_ps(_mm256_set1_ps(weight[j]),
                                          load8(v_cache, base + j * row + 8 * c, half), sum);
                _mm256_store_ps(a + 8 * c, sum);
            }
        }
    }
}

static inline float exp_shifted(float *s, int64_t n, float shift) {
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) total += (s[j] = expf(s[j] - shift));
    return total;
}
#else
static inline float exp_shifted(float *s, int64_t n, float shift) {
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) total += (s[j] = expf(s[j] - shift));
    return total;
}
#endif

/* The dot product of a[0..n) with the n cache values from `index` on. */
static inline float dot(const float *a, const void *cache, int64_t index, int64_t n, int half) {
    float sum = 0.0f;
    if (half) {
        const uint16_t *b = (const uint16_t *)cache + index;
        for (int64_t i = 0; i < n; i++) sum += a[i] * half_to_float(b[i]);
        return sum;
    }
    const float *b = (const float *)cache + index;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* a[0..n) += p times the n cache values from `index` on. */
static inline void add_scaled(float *a, float p, const void *cache, int64_t index, int64_t n,
                              int half) {
    if (half) {
        const uint16_t *v = (const uint16_t *)cache + index;
        for (int64_t d = 0; d < n; d++) a[d] += p * half_to_float(v[d]);
        return;
    }
    const float *v = (const float *)cache + index;
#pragma omp simd
    for (int64_t d = 0; d < n; d++) a[d] += p * v[d];
}

/* Writes each token's Hkv rows of D values at its slot, rounded to float16 when half. A
 * negative slot (a padding row of a replayed decode step) is not written. */
static void write_rows(const float *src, int64_t tok_stride, int64_t head_stride,
                       const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, void *cache,
                       int half) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < Hkv && slots[t] >= 0; g++) {
            const float *row = src + t * tok_stride + g * head_stride;
            const int64_t at = (slots[t] * Hkv + g) * D;
            if (!half) {
                memcpy((float *)cache + at, row, D * sizeof(float));
                continue;
            }
            uint16_t *to = (uint16_t *)cache + at;
            int64_t d = 0;
#if defined(__F16C__)
            for (; d + 8 <= D; d += 8)
                _mm_storeu_si128((__m128i *)(to + d),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(row + d),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
            for (; d < D; d++) to[d] = float_to_half(row[d]);
        }
}

static void attend(const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t t,
                   int64_t g, int64_t first_key, int64_t key_end, const int32_t *table,
                   const void *k_cache, const void *v_cache, int half, int64_t Hkv, int64_t group,
                   int64_t D, int64_t block_size, float scale, float *acc, float *running_max,
                   float *running_sum) {
    float scores[64 * 64];
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t h = 0; h < group; h++) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    const int64_t num_keys = key_end;
    for (int64_t first = first_key - first_key % block_size; first < num_keys;
         first += block_size) {
        const int64_t n = num_keys - first < block_size ? num_keys - first : block_size;
        const int64_t hidden = first < first_key ? first_key - first : 0; /* before the window */
        const int64_t base_slot = (int64_t)table[first / block_size] * block_size;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + t * q_tok_stride + (g * group + h) * q_head_stride;
            float *s = scores + h * block_size;
            float tile_max = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                s[j] = j < hidden ? -INFINITY
                                  : dot(qh, k_cache, ((base_slot + j) * Hkv + g) * D, D, half) * scale;
                if (s[j] > tile_max) tile_max = s[j];
            }
            const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
            const float correction = expf(running_max[h] - new_max);
            running_max[h] = new_max;
            running_sum[h] *= correction;
            float *a = acc + h * D;
            if (correction != 1.0f)
                for (int64_t d = 0; d < D; d++) a[d] *= correction;
            running_sum[h] += exp_shifted(s, n, new_max);
            for (int64_t j = 0; j < n; j++)
                add_scaled(a, s[j], v_cache, ((base_slot + j) * Hkv + g) * D, D, half);
        }
    }
}

/* One chunk of one token's keys for the query heads of KV head g: keys first_key ..
 * key_end - 1 (a chunk of CHUNK_KEYS, see below), unnormalized: acc [group * D] holds each
 * head's sum of softmax-weighted values relative to its running maximum, and running_sum
 * the weights' sum. attend16 or attend8 for the head sizes models use (64, 128, 256, ...),
 * attend for the rest. */
static void attend_chunk(const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t t,
                         int64_t g, int64_t first_key, int64_t key_end, const int32_t *table,
                         const void *k_cache, const void *v_cache, int half, int64_t Hkv,
                         int64_t group, int64_t D, int64_t block_size, float scale, float *acc,
                         float *running_max, float *running_sum) {
#define ARGS(HALF)                                                                           \
    q, q_tok_stride, q_head_stride, t, g, first_key, key_end, table, k_cache, v_cache, HALF,  \
        Hkv, group, block_size, scale, acc, running_max, running_sum
#if defined(__AVX512F__)
#define ATTEND16(DV) (half ? attend16(DV, ARGS(1)) : attend16(DV, ARGS(0)))
    if (block_size % 16 == 0) switch (D) {
            case 32: ATTEND16(2); return;
            case 64: ATTEND16(4); return;
            case 128: ATTEND16(8); return;
            case 256: ATTEND16(16); return; /* Gemma 3's; its accumulators spill to L1 */
        }
#undef ATTEND16
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTEND8(DV) (half ? attend8(DV, ARGS(1)) : attend8(DV, ARGS(0)))
#if defined(__F16C__)
    const int vector_loads = 1;
#else
    const int vector_loads = !half;
#endif
    if (block_size % 8 == 0 && vector_loads) switch (D) {
            case 32: ATTEND8(4); return;
            case 64: ATTEND8(8); return;
            case 128: ATTEND8(16); return;
            case 256: ATTEND8(32); return;
        }
#undef ATTEND8
#endif
#undef ARGS
    attend(q, q_tok_stride, q_head_stride, t, g, first_key, key_end, table, k_cache, v_cache,
           half, Hkv, group, D, block_size, scale, acc, running_max, running_sum);
}

/*
 * A token's keys are taken in chunks of CHUNK_KEYS at fixed positions (0 .. 255, 256 ..
 * 511, ...; the first and last cut to what the token sees), each with its own online
 * softmax, and the chunks' results are folded in order (fold_chunk). The chunks of a step
 * with few tokens run on different threads (a decode of one sequence has as many work items
 * as KV heads otherwise: three for two threads leaves one idle half the time), those of a
 * step with many tokens one after the other in the token's item; the arithmetic, and so
 * every bit of a token's result, is the same either way, whatever the batch or the threads.
 */
#define CHUNK_KEYS 256

/* Folds a later chunk (acc2, max2, sum2) into acc, running_max and running_sum. */
static void fold_chunk(float *acc, float *running_max, float *running_sum, const float *acc2,
                       const float *max2, const float *sum2, int64_t group, int64_t D) {
    for (int64_t h = 0; h < group; h++) {
        const float top = running_max[h] > max2[h] ? running_max[h] : max2[h];
        const float a = expf(running_max[h] - top), b = expf(max2[h] - top);
        running_max[h] = top;
        running_sum[h] = running_sum[h] * a + sum2[h] * b;
        for (int64_t d = 0; d < D; d++) acc[h * D + d] = acc[h * D + d] * a + acc2[h * D + d] * b;
    }
}

/* out [group * D] = each head's acc / running_sum. */
static void normalize(const float *acc, const float *running_sum, int64_t group, int64_t D,
                      float *out) {
    for (int64_t h = 0; h < group; h++) {
        const float inv = 1.0f / running_sum[h];
        for (int64_t d = 0; d < D; d++) out[h * D + d] = acc[h * D + d] * inv;
    }
}

/* The chunks of keys first_key .. key_end - 1: the first's index and how many. */
static inline int64_t first_chunk(int64_t first_key) { return first_key / CHUNK_KEYS; }
static inline int64_t num_chunks(int64_t first_key, int64_t key_end) {
    return (key_end - 1) / CHUNK_KEYS - first_key / CHUNK_KEYS + 1;
}

/* Chunk c's keys, cut to first_key .. key_end - 1. */
static inline void chunk_keys(int64_t c, int64_t first_key, int64_t key_end, int64_t *lo,
                              int64_t *hi) {
    *lo = c * CHUNK_KEYS > first_key ? c * CHUNK_KEYS : first_key;
    *hi = (c + 1) * CHUNK_KEYS < key_end ? (c + 1) * CHUNK_KEYS : key_end;
}

/* Every (token, KV head) a work item, which takes the token's chunks in turn. */
static void attend_in_turn(const float *q, int64_t q_tok_stride, int64_t q_head_stride,
                           int64_t T, const int64_t *seq_of, const int64_t *first_key,
                           const int64_t *key_end, const int32_t *block_tables,
                           int64_t table_stride, const void *k_cache, const void *v_cache,
                           int half, int64_t Hkv, int64_t group, int64_t D, int64_t block_size,
                           float scale, float *out, int num_threads) {
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < Hkv; g++) {
            float acc[MAX_GROUP_VALUES] __attribute__((aligned(64)));
            float part[MAX_GROUP_VALUES] __attribute__((aligned(64)));
            float max[64], sum[64], part_max[64], part_sum[64];
            const int64_t c0 = first_chunk(first_key[t]);
            const int64_t n = num_chunks(first_key[t], key_end[t]);
            for (int64_t c = c0; c < c0 + n; c++) {
                int64_t lo, hi;
                chunk_keys(c, first_key[t], key_end[t], &lo, &hi);
                const int first = c == c0;
                attend_chunk(q, q_tok_stride, q_head_stride, t, g, lo, hi,
                             block_tables + seq_of[t] * table_stride, k_cache, v_cache, half,
                             Hkv, group, D, block_size, scale, first ? acc : part,
                             first ? max : part_max, first ? sum : part_sum);
                if (!first) fold_chunk(acc, max, sum, part, part_max, part_sum, group, D);
            }
            normalize(acc, sum, group, D, out + (t * Hkv + g) * group * D);
        }
}

/* Every (chunk, KV head) a work item, its result kept, then each (token, KV head)'s chunks
 * folded in order: for steps with fewer (token, KV head) pairs than the threads can share.
 * Returns 0, or -2 when its memory cannot be had. */
static int attend_spread(const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t T,
                         const int64_t *seq_of, const int64_t *first_key,
                         const int64_t *key_end, int64_t num_token_chunks,
                         const int32_t *block_tables, int64_t table_stride,
                         const void *k_cache, const void *v_cache, int half, int64_t Hkv,
                         int64_t group, int64_t D, int64_t block_size, float scale, float *out,
                         int num_threads) {
    const int64_t values = (group * D + 15) & ~(int64_t)15, stride = values + 2 * 64;
    int64_t *chunk_token = malloc(sizeof(int64_t) * 2 * num_token_chunks);
    float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(num_token_chunks * Hkv * stride));
    int64_t *token_start = malloc(sizeof(int64_t) * (T + 1));
    if (chunk_token == NULL || scratch == NULL || token_start == NULL) {
        free(chunk_token);
        free(scratch);
        free(token_start);
        return -2;
    }
    int64_t *chunk_index = chunk_token + num_token_chunks;
    for (int64_t t = 0, i = 0; t < T; t++) {
        token_start[t] = i;
        const int64_t c0 = first_chunk(first_key[t]);
        for (int64_t c = c0; c < c0 + num_chunks(first_key[t], key_end[t]); c++, i++) {
            chunk_token[i] = t;
            chunk_index[i] = c;
        }
        token_start[t + 1] = i;
    }
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t item = 0; item < num_token_chunks * Hkv; item++) {
        const int64_t i = item / Hkv, g = item % Hkv, t = chunk_token[i];
        int64_t lo, hi;
        chunk_keys(chunk_index[i], first_key[t], key_end[t], &lo, &hi);
        float *result = scratch + item * stride;
        attend_chunk(q, q_tok_stride, q_head_stride, t, g, lo, hi,
                     block_tables + seq_of[t] * table_stride, k_cache, v_cache, half, Hkv,
                     group, D, block_size, scale, result, result + values, result + values + 64);
    }
#pragma omp parallel for collapse(2) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < Hkv; g++) {
            float *first = scratch + (token_start[t] * Hkv + g) * stride;
            for (int64_t i = token_start[t] + 1; i < token_start[t + 1]; i++) {
                const float *later = scratch + (i * Hkv + g) * stride;
                fold_chunk(first, first + values, first + values + 64, later, later + values,
                           later + values + 64, group, D);
            }
            normalize(first, first + values + 64, group, D, out + (t * Hkv + g) * group * D);
        }
    free(chunk_token);
    free(scratch);
    free(token_start);
    return 0;
}

/* Returns 0, -1 when a shape exceeds the kernel's stack buffers, or -2 when memory
 * cannot be had. */
int vl_paged_attention(const float *q, int64_t q_tok_stride, int64_t q_head_stride,
                       const float *k_new, int64_t k_tok_stride, int64_t k_head_stride,
                       const float *v_new, int64_t v_tok_stride, int64_t v_head_stride,
                       const int64_t *slot_mapping, int64_t T, void *k_cache, void *v_cache,
                       const int32_t *block_tables, int64_t table_stride,
                       const int32_t *seq_lens, const int32_t *query_start_loc,
                       int64_t num_seqs, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                       float scale, int64_t window, int64_t cache_half, float *out,
                       int num_threads) {
    const int half = cache_half != 0;
    const int64_t group = H / Hkv;
    if (group > 64 || block_size > 64 || group * D > MAX_GROUP_VALUES) return -1;
    write_rows(k_new, k_tok_stride, k_head_stride, slot_mapping, T, Hkv, D, k_cache, half);
    write_rows(v_new, v_tok_stride, v_head_stride, slot_mapping, T, Hkv, D, v_cache, half);
    if (T == 0) return 0;
    int64_t *seq_of = malloc(sizeof(int64_t) * 3 * T);
    if (seq_of == NULL) return -2;
    int64_t *first_key = seq_of + T, *key_end = first_key + T;
    int64_t num_token_chunks = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t start = query_start_loc[s], end = query_start_loc[s + 1];
        for (int64_t t = start; t < end; t++) {
            const int64_t position = seq_lens[s] - (end - start) + (t - start);
            seq_of[t] = s;
            key_end[t] = position + 1;
            first_key[t] = window > 0 && position + 1 > window ? position + 1 - window : 0;
            num_token_chunks += num_chunks(first_key[t], key_end[t]);
        }
    }
    int status = 0;
    if (T * Hkv < 4 * (int64_t)num_threads && num_token_chunks > T)
        status = attend_spread(q, q_tok_stride, q_head_stride, T, seq_of, first_key, key_end,
                               num_token_chunks, block_tables, table_stride, k_cache, v_cache,
                               half, Hkv, group, D, block_size, scale, out, num_threads);
    else
        attend_in_turn(q, q_tok_stride, q_head_stride, T, seq_of, first_key, key_end,
                       block_tables, table_stride, k_cache, v_cache, half, Hkv, group, D,
                       block_size, scale, out, num_threads);
    free(seq_of);
    return status;
}
