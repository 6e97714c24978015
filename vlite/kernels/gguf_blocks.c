/*
 * Weight-only matrix products over GGUF block-quantized weights, on the CPU.
 *
 * A weight matrix W [N, K] is stored as llama.cpp stores it: each of the N rows is K / 32
 * blocks of 32 values, every block self-describing (an fp16 scale, for Q4_1 an fp16 minimum,
 * then the quantized values). The kernels read the file's bytes as they are and dequantize a
 * block into registers right before it is used, so the weights the product sees are exactly
 * the values the GGUF format defines:
 *
 *   Q4_0 (18 bytes): d; qs[16]          value[j] = d * (nibble[j] - 8)
 *   Q4_1 (20 bytes): d; m; qs[16]       value[j] = d * nibble[j] + m
 *   Q8_0 (34 bytes): d; qs[32] (int8)   value[j] = d * qs[j]
 *
 * where nibble[j] = qs[j] & 15 and nibble[j + 16] = qs[j] >> 4 for j < 16. Activations and
 * accumulators are float32.
 *
 * Threads: OpenMP, in the OpenMP runtime PyTorch already loaded (this library names the
 * same libgomp.so.1), so the kernels and PyTorch's own ops share one thread team. The
 * caller passes the thread count (PyTorch's intra-op setting).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { VL_Q4_0 = 0, VL_Q4_1 = 1, VL_Q8_0 = 2 };
#define QK 32
#define PREFETCH_TILES 4

int vl_block_bytes(int qtype) {
    switch (qtype) {
        case VL_Q4_0: return 18;
        case VL_Q4_1: return 20;
        case VL_Q8_0: return 34;
        default: return -1;
    }
}

static inline float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
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

/* One block as 32 floats (portable; also the reference the vector path must equal). */
static inline void dequantize_block(int qtype, const uint8_t *b, float *out) {
    const float d = fp16_to_fp32(b);
    if (qtype == VL_Q4_0) {
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((int)(qs[j] & 15) - 8);
            out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
    } else if (qtype == VL_Q4_1) {
        const float m = fp16_to_fp32(b + 2);
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            float lo = d * (float)(qs[j] & 15), hi = d * (float)(qs[j] >> 4);
            out[j] = lo + m;
            out[j + 16] = hi + m;
        }
    } else {
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)qs[j];
    }
}

/* out[n, :] = the N x K matrix's row n, as float32. */
void vl_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out,
                   int num_threads) {
    const int64_t nb = K / QK, row_bytes = nb * vl_block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++)
            dequantize_block(qtype, w + n * row_bytes + b * vl_block_bytes(qtype),
                             out + n * K + b * QK);
}

/* out[t, :] = row ids[t] of the matrix (an embedding lookup). */
void vl_gather_rows(int qtype, const uint8_t *w, int64_t K, const int64_t *ids, int64_t T,
                    float *out) {
    const int64_t nb = K / QK, row_bytes = nb * vl_block_bytes(qtype);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++)
            dequantize_block(qtype, w + ids[t] * row_bytes + b * vl_block_bytes(qtype),
                             out + t * K + b * QK);
}

#if defined(__AVX512F__)

/* Block b of a row as two vectors: values 0..15 in *lo, 16..31 in *hi (exactly as above). */
static inline float fp16_to_fp32_hw(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __attribute__((always_inline)) void load_block(int qtype, const uint8_t *b,
                                                               __m512 *lo, __m512 *hi) {
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

static void rows_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
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

#else /* portable path */

static void rows_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                       int64_t N, int64_t n0, int64_t n1, float *y) {
    const int64_t bb = vl_block_bytes(qtype), row_bytes = (K / QK) * bb, nb = K / QK;
    float values[QK];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) y[m * N + n] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            dequantize_block(qtype, w + n * row_bytes + b * bb, values);
            for (int64_t m = 0; m < M; m++) {
                const float *xb = x + m * K + b * QK;
                float sum = 0.0f;
                for (int j = 0; j < QK; j++) sum += values[j] * xb[j];
                y[m * N + n] += sum;
            }
        }
    }
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

/*
 * y[M, N] = x[M, K] @ W[N, K]^T with W block-quantized (qtype), K a multiple of 32.
 * Whole 32-row strips of x go to the blocked GEMM above; the rows left over (all of them
 * for a decode of fewer than 32 sequences) go to the tiles, with no padding: rows of W are
 * split over the threads in chunks of `chunk` rows, and every thread walks those rows of x
 * for its chunk, so each weight block is read from memory once.
 */
void vl_matmul(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
               float *y, int num_threads) {
#if defined(__AVX512F__)
    const int64_t gemm_rows = M / STRIP * STRIP;
    if (gemm_rows > 0) {
        gemm(qtype, x, gemm_rows, K, w, N, y, num_threads);
        x += gemm_rows * K;
        y += gemm_rows * N;
        M -= gemm_rows;
        if (M == 0) return;
    }
#endif
    const int64_t chunk = 16;
    const int64_t num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        rows_range(qtype, x, M, K, w, N, n0, n1, y);
    }
}
