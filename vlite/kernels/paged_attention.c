/*
 * Paged causal attention on the CPU, float32, in one call per layer: write the step's new
 * keys and values into the paged cache, then let every new token attend to its sequence's
 * context straight from the cache blocks (no gathered copy, no padding).
 *
 * Layout (vlite's default cache): k_cache and v_cache are [num_blocks * block_size,
 * num_kv_heads, head_dim]; slot = block_id * block_size + offset. Token t of sequence s
 * (rows query_start_loc[s] .. query_start_loc[s + 1]) sits at position
 * seq_lens[s] - query_len + (t - query_start_loc[s]) and sees keys 0 .. position.
 *
 * Work item = (token, KV head): the query heads that share the KV head are done together,
 * with an online softmax that is rescaled once per cache block; the block's exponentials are
 * computed 16 at a time where AVX-512 is available (a degree-7 polynomial, within 1e-8
 * relative of expf), one by one with expf elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP_VALUES 8192 /* query heads per KV head x head_dim, on the stack */

#if defined(__AVX512F__)
#include <immintrin.h>

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
#else
static inline float exp_shifted(float *s, int64_t n, float shift) {
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) total += (s[j] = expf(s[j] - shift));
    return total;
}
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void write_rows(const float *src, int64_t tok_stride, int64_t head_stride,
                       const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, float *cache) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < Hkv; g++)
            memcpy(cache + (slots[t] * Hkv + g) * D, src + t * tok_stride + g * head_stride,
                   D * sizeof(float));
}

static void attend(const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t t,
                   int64_t g, int64_t position, const int32_t *table, const float *k_cache,
                   const float *v_cache, int64_t Hkv, int64_t group, int64_t D,
                   int64_t block_size, float scale, float *out) {
    float acc[MAX_GROUP_VALUES];
    float running_max[64], running_sum[64], scores[64 * 64];
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t h = 0; h < group; h++) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    const int64_t num_keys = position + 1;
    for (int64_t first = 0; first < num_keys; first += block_size) {
        const int64_t n = num_keys - first < block_size ? num_keys - first : block_size;
        const int64_t base_slot = (int64_t)table[first / block_size] * block_size;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + t * q_tok_stride + (g * group + h) * q_head_stride;
            float *s = scores + h * block_size;
            float tile_max = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                s[j] = dot(qh, k_cache + ((base_slot + j) * Hkv + g) * D, D) * scale;
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
            for (int64_t j = 0; j < n; j++) {
                const float p = s[j];
                const float *v = v_cache + ((base_slot + j) * Hkv + g) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *o = out + (t * Hkv * group + g * group + h) * D;
        const float inv = 1.0f / running_sum[h];
        for (int64_t d = 0; d < D; d++) o[d] = acc[h * D + d] * inv;
    }
}

/* Returns 0, or -1 when a shape exceeds the kernel's stack buffers. */
int vl_paged_attention(const float *q, int64_t q_tok_stride, int64_t q_head_stride,
                       const float *k_new, int64_t k_tok_stride, int64_t k_head_stride,
                       const float *v_new, int64_t v_tok_stride, int64_t v_head_stride,
                       const int64_t *slot_mapping, int64_t T, float *k_cache, float *v_cache,
                       const int32_t *block_tables, int64_t table_stride,
                       const int32_t *seq_lens, const int32_t *query_start_loc,
                       int64_t num_seqs, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                       float scale, float *out, int num_threads) {
    const int64_t group = H / Hkv;
    if (group > 64 || block_size > 64 || group * D > MAX_GROUP_VALUES) return -1;
    write_rows(k_new, k_tok_stride, k_head_stride, slot_mapping, T, Hkv, D, k_cache);
    write_rows(v_new, v_tok_stride, v_head_stride, slot_mapping, T, Hkv, D, v_cache);
    int64_t *seq_of = malloc(sizeof(int64_t) * 2 * (T > 0 ? T : 1));
    int64_t *position = seq_of + T;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t start = query_start_loc[s], end = query_start_loc[s + 1];
        for (int64_t t = start; t < end; t++) {
            seq_of[t] = s;
            position[t] = seq_lens[s] - (end - start) + (t - start);
        }
    }
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < Hkv; g++)
            attend(q, q_tok_stride, q_head_stride, t, g, position[t],
                   block_tables + seq_of[t] * table_stride, k_cache, v_cache, Hkv, group, D,
                   block_size, scale, out);
    free(seq_of);
    return 0;
}
