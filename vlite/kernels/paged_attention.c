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
 * with an online softmax that is rescaled once per cache block.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP_VALUES 8192 /* query heads per KV head x head_dim, on the stack */

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
            for (int64_t j = 0; j < n; j++) {
                const float p = expf(s[j] - new_max);
                running_sum[h] += p;
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
