/*
 * Fused elementwise steps of a decoder layer on float32 CPU tensors, one call each where
 * PyTorch takes several small ops (each op costs microseconds of dispatch at decode sizes).
 * Compiled with -ffp-contract=off: every product and sum is rounded as written, in the
 * order PyTorch's reference formulas use. SwiGLU's e^-g is a polynomial with AVX2
 * (vec_exp.h: within 1e-7 relative of expf).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/*
 * residual[T, H] += x (when residual is given), then
 * out[t] = weight * (h[t] * 1 / sqrt(mean(h[t]^2) + eps)), h = the (updated) residual or x.
 */
void vl_add_rmsnorm(const float *x, float *residual, const float *weight, int64_t T,
                    int64_t H, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *h = x + t * H;
        if (residual) {
            float *r = residual + t * H;
            for (int64_t i = 0; i < H; i++) r[i] = r[i] + h[i];
            h = r;
        }
        float sum = 0.0f;
        for (int64_t i = 0; i < H; i++) sum += h[i] * h[i];
        const float scale = 1.0f / sqrtf(sum / (float)H + eps);
        float *o = out + t * H;
        for (int64_t i = 0; i < H; i++) o[i] = weight[i] * (h[i] * scale);
    }
}

/*
 * Rotary embedding ("rotate half"), in place, on the first num_heads heads of each row of
 * x (row t starts at x + t * row_stride; heads of head_dim values back to back):
 * (a, b) = (x[i], x[i + d/2]) -> (a cos - b sin, b cos + a sin), with cos/sin of row
 * positions[t] of the [max_positions, d/2] tables.
 */
void vl_rope(float *x, int64_t T, int64_t row_stride, int64_t num_heads, int64_t head_dim,
             const int64_t *positions, const float *cos_table, const float *sin_table) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *a = x + t * row_stride + h * head_dim, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float a0 = a[i], b0 = b[i];
                a[i] = a0 * c[i] - b0 * s[i];
                b[i] = b0 * c[i] + a0 * s[i];
            }
        }
    }
}

/*
 * SwiGLU's activation: out[t, i] = silu(gate) * up with gate = x[t, i] and
 * up = x[t, width + i] (x[T, 2 * width], the fused gate/up product), silu(g) = g / (1 + e^-g).
 */
#include "vec_exp.h"

void vl_silu_mul(const float *x, int64_t T, int64_t width, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *gate = x + t * 2 * width, *up = gate + width;
        float *o = out + t * width;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        /* 8 at a time with a polynomial e^-g (expf is most of this op's time otherwise). */
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= width; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, vl_exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < width; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Copy src [rows, cols] (contiguous) into columns of dst (row stride dst_stride): a fused
   projection whose pieces are multiplied separately writes each piece's output features
   in place, so a recorded forward needs no PyTorch concatenation. */
void vl_copy_columns(const float *src, int64_t rows, int64_t cols, float *dst,
                     int64_t dst_stride) {
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * dst_stride, src + r * cols, (size_t)cols * sizeof(float));
}
