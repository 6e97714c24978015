/*
 * e^x on 8 floats (AVX2 + FMA), shared by the kernels that need many exponentials:
 * 2^n p(r) with x = n ln2 + r, |r| <= ln2 / 2, p the degree-7 Taylor polynomial (within
 * 1e-7 relative of expf). Below -87 it is 0 and above expf's largest finite result it is
 * infinity, as in float32 (a softmax's masked -inf scores give 0; SwiGLU's e^-g overflows
 * where expf's does).
 *
 * Included by the .c files next to it; the kernel cache key covers the headers too.
 */
#ifndef VLITE_VEC_EXP_H
#define VLITE_VEC_EXP_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>

static inline __m256 vl_exp8(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f), ceiling = _mm256_set1_ps(88.7228f);
    const __m256 tiny = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
    const __m256 overflow = _mm256_cmp_ps(x, ceiling, _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, floor_x), ceiling);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n (n in -126..128) as two factors 2^(n/2) 2^(n - n/2), each a valid exponent. */
    const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
    const __m256 value = _mm256_andnot_ps(tiny, _mm256_mul_ps(_mm256_mul_ps(p, a), b));
    return _mm256_blendv_ps(value, _mm256_set1_ps(INFINITY), overflow);
}

#endif
#endif
