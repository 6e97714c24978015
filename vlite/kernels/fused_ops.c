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

/*
 * RMSNorm of each head, in place (Gemma 3's and Qwen 3's q/k norms): the first num_heads
 * heads (head_dim values each) of row t of x (rows row_stride apart) become
 * weight * (v * 1 / sqrt(mean(v^2) + eps)).
 */
void vl_rmsnorm_heads(float *x, int64_t T, int64_t row_stride, int64_t num_heads,
                      int64_t head_dim, const float *weight, float eps) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < num_heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
            float sum = 0.0f;
            for (int64_t i = 0; i < head_dim; i++) sum += v[i] * v[i];
            const float scale = 1.0f / sqrtf(sum / (float)head_dim + eps);
            for (int64_t i = 0; i < head_dim; i++) v[i] = weight[i] * (v[i] * scale);
        }
}

/* x[0..n) *= factor, in place (Gemma's embedding scale). */
void vl_scale(float *x, int64_t n, float factor) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * factor;
}

/*
 * GeGLU's activation: out[t, i] = gelu_tanh(gate) * up, gate = x[t, i], up = x[t, width + i]
 * (x[T, 2 * width]), gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3),
 * computed as g / (1 + e^(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + e^(-2u))), which
 * keeps its relative precision where 1 + tanh(u) cancels (large negative g).
 */
void vl_gelu_tanh_mul(const float *x, int64_t T, int64_t width, float *out) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    for (int64_t t = 0; t < T; t++) {
        const float *gate = x + t * 2 * width, *up = gate + width;
        float *o = out + t * width;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), minus_two_beta = _mm256_set1_ps(-2.0f * beta);
        const __m256 vkappa = _mm256_set1_ps(kappa);
        for (; i + 8 <= width; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            const __m256 minus_2u =
                _mm256_mul_ps(minus_two_beta, _mm256_add_ps(g, _mm256_mul_ps(vkappa, cube)));
            const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, vl_exp8(minus_2u)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < width; i++) {
            const float g = gate[i], minus_2u = -2.0f * beta * (g + kappa * (g * g * g));
            o[i] = g / (1.0f + expf(minus_2u)) * up[i];
        }
    }
}
