/*
 * Decode attention over the paged KV cache for CPUs with AVX-512: every sequence of the batch
 * has one query token, which attends to its seq_lens[b] positions. K and V are read in place
 * through the block table (no gathered copy), so each cached byte is read once. Arithmetic is
 * float32; T is float or bfloat16 (stored as uint16_t).
 *
 * Layouts (all contiguous):
 *   q, out          [num_seqs, num_heads, head_dim]
 *   k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
 *   block_tables    [num_seqs, max_blocks] int64;  seq_lens [num_seqs] int64 (>= 1)
 * Query head h reads KV head h / (num_heads / num_kv_heads); head_dim % 16 == 0, <= 256.
 *
 * (A flash-style prefill kernel with float32 FMAs was tried and lost to torch's SDPA on long
 * prompts: prefill attention is compute-bound, so it stays with SDPA.)
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_HEAD_DIM 256

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline void store16_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

static inline __m512 load16_bf16(const uint16_t* p) {
    __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline void store16_bf16(uint16_t* p, __m512 v) {
    /* Round to nearest even (values are finite). */
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

/* e^x for 16 lanes: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, degree-6 Taylor series
 * of 2^f (relative error ~1e-7). Inputs below -87 give ~0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.54035304e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* scores[h * stride + l] <- softmax over l < len, in place. */
static void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t stride) {
    for (int64_t h = 0; h < rows; h++) {
        float* row = scores + h * stride;
        float peak = row[0];
        for (int64_t l = 1; l < len; l++) peak = row[l] > peak ? row[l] : peak;
        const __m512 vpeak = _mm512_set1_ps(peak);
        __m512 vtotal = _mm512_setzero_ps();
        int64_t l = 0;
        for (; l + 16 <= len; l += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + l), vpeak));
            _mm512_storeu_ps(row + l, e);
            vtotal = _mm512_add_ps(vtotal, e);
        }
        if (l < len) {
            const __mmask16 tail = (__mmask16)((1u << (len - l)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + l), vpeak));
            _mm512_mask_storeu_ps(row + l, tail, e);
            vtotal = _mm512_add_ps(vtotal, _mm512_maskz_mov_ps(tail, e));
        }
        const float inverse = 1.0f / _mm512_reduce_add_ps(vtotal);
        for (l = 0; l < len; l++) row[l] *= inverse;
    }
}

#define DEFINE_PAGED_DECODE(NAME, T, LOAD16, STORE16)                                          \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,         \
          const int64_t* seq_lens, T* out, float* scratch, int64_t num_seqs, int64_t num_heads,\
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,      \
          int64_t max_len, float scale) {                                                    \
    /* scratch: float [2 * num_heads * head_dim + num_heads * max_len] */                   \
    const int64_t group = num_heads / num_kv_heads, num_vectors = head_dim / 16;             \
    const int64_t token_stride = num_kv_heads * head_dim, seq_stride = num_heads * head_dim; \
    float* qf = scratch;               /* scaled queries [num_heads, head_dim] */            \
    float* acc = qf + seq_stride;      /* weighted V sums [num_heads, head_dim] */           \
    float* scores = acc + seq_stride;  /* [num_heads, max_len] */                            \
    const __m512 vscale = _mm512_set1_ps(scale);                                             \
    for (int64_t b = 0; b < num_seqs; b++) {                                                 \
        const int64_t len = seq_lens[b];                                                     \
        const int64_t* table = block_tables + b * max_blocks;                                \
        for (int64_t i = 0; i < seq_stride; i += 16) {                                       \
            store16_f32(qf + i, _mm512_mul_ps(LOAD16(q + b * seq_stride + i), vscale));      \
            store16_f32(acc + i, _mm512_setzero_ps());                                       \
        }                                                                                    \
        for (int64_t start = 0, blk = 0; start < len; start += block_size, blk++) {          \
            const int64_t n = len - start < block_size ? len - start : block_size;           \
            const T* k = k_cache + table[blk] * block_size * token_stride;                   \
            for (int64_t t = 0; t < n; t++, k += token_stride) {                             \
                for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {        \
                    __m512 kv[MAX_HEAD_DIM / 16];                                            \
                    for (int64_t j = 0; j < num_vectors; j++)                                \
                        kv[j] = LOAD16(k + kv_head * head_dim + 16 * j);                     \
                    for (int64_t g = 0; g < group; g++, h++) {                               \
                        const float* qh = qf + h * head_dim;                                 \
                        __m512 dot = _mm512_mul_ps(kv[0], _mm512_loadu_ps(qh));              \
                        for (int64_t j = 1; j < num_vectors; j++)                            \
                            dot = _mm512_fmadd_ps(kv[j], _mm512_loadu_ps(qh + 16 * j), dot); \
                        scores[h * max_len + start + t] = _mm512_reduce_add_ps(dot);         \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        softmax_rows(scores, num_heads, len, max_len);                                       \
        for (int64_t start = 0, blk = 0; start < len; start += block_size, blk++) {          \
            const int64_t n = len - start < block_size ? len - start : block_size;           \
            const T* v = v_cache + table[blk] * block_size * token_stride;                   \
            for (int64_t t = 0; t < n; t++, v += token_stride) {                             \
                for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {        \
                    __m512 vv[MAX_HEAD_DIM / 16];                                            \
                    for (int64_t j = 0; j < num_vectors; j++)                                \
                        vv[j] = LOAD16(v + kv_head * head_dim + 16 * j);                     \
                    for (int64_t g = 0; g < group; g++, h++) {                               \
                        float* ah = acc + h * head_dim;                                      \
                        const __m512 p = _mm512_set1_ps(scores[h * max_len + start + t]);    \
                        for (int64_t j = 0; j < num_vectors; j++)                            \
                            _mm512_storeu_ps(ah + 16 * j, _mm512_fmadd_ps(                   \
                                p, vv[j], _mm512_loadu_ps(ah + 16 * j)));                    \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int64_t i = 0; i < seq_stride; i += 16)                                         \
            STORE16(out + b * seq_stride + i, _mm512_loadu_ps(acc + i));                     \
    }                                                                                        \
}

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, load16_bf16, store16_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, load16_f32, store16_f32)
