/*
 * Fused CPU kernels (AVX-512) for the decoder's small, memory-bound steps, where a chain of
 * torch ops would cost more in dispatch than in arithmetic. Arithmetic is float32; tensors are
 * float or bfloat16 (as uint16_t), rounded once on store. Every function comes in _f32 and
 * _bf16 versions.
 *
 * linear_bf16 (CPUs with AVX-512 BF16): x W^T for a few rows, W in a streaming layout.
 *
 * paged_decode: every sequence of the batch has one query token, which attends to its
 * seq_lens[b] positions. K and V are read in place through the block table (no gathered copy),
 * in one pass with an online softmax, while the next block is prefetched.
 *
 * Layouts (all contiguous):
 *   q, out          [num_seqs, num_heads, head_dim]
 *   k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
 *   block_tables    [num_seqs, max_blocks] int64;  seq_lens [num_seqs] int64 (>= 1)
 *   scratch         float [2 * num_heads * head_dim + num_heads * (UNIT + 2)]
 * Query head h reads KV head h / (num_heads / num_kv_heads); head_dim % 16 == 0, <= 256.
 *
 * (A flash-style prefill kernel with float32 FMAs was tried and lost to torch's SDPA on long
 * prompts: prefill attention is compute-bound, so it stays with SDPA.)
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define MAX_HEAD_DIM 256
#define UNIT 16 /* positions scored together: one vector of scores per head */

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline void store16_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 loadm_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void storem_f32(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }

static inline __m512 load16_bf16(const uint16_t* p) {
    __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* float32 -> bfloat16 bits, round to nearest even (values are finite). */
static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

static inline void store16_bf16(uint16_t* p, __m512 v) {
    _mm256_storeu_si256((__m256i*)p, to_bf16(v));
}

static inline __m512 loadm_bf16(const uint16_t* p, __mmask16 m) {
    __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline void storem_bf16(uint16_t* p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

/* What a value reads back as once stored as T (bfloat16 rounds; float is exact). */
static inline __m512 round_f32(__m512 v) { return v; }
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1);
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

static inline void prefetch_bytes(const void* start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64)
        _mm_prefetch((const char*)start + offset, _MM_HINT_T0);
}

/* Online softmax step for one head and a unit of n <= UNIT scores: turn the scores into
 * weights relative to the new running max, and rescale what was accumulated so far. */
static inline void rescale_head(float* scores, int64_t n, float* peak, float* total,
                                float* acc, int64_t num_vectors) {
    const __mmask16 valid = (__mmask16)((1u << n) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(valid, scores);
    const float unit_peak = _mm512_mask_reduce_max_ps(valid, s);
    const float new_peak = unit_peak > *peak ? unit_peak : *peak;
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_peak))));
    const __m512 alpha = exp16(_mm512_set1_ps(*peak - new_peak));
    _mm512_mask_storeu_ps(scores, valid, p);
    *total = *total * _mm512_cvtss_f32(alpha) + _mm512_reduce_add_ps(p);
    *peak = new_peak;
    for (int64_t j = 0; j < num_vectors; j++)
        _mm512_storeu_ps(acc + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), alpha));
}

/* The body, with NV = head_dim / 16 a compile-time constant in the specialised copies below
 * (so the per-head vectors live in registers). */
#define DEFINE_PAGED_DECODE_IMPL(NAME, T, LOAD16, STORE16)                                          \
static inline __attribute__((always_inline)) void NAME(                                        \
          const int64_t NV, const T* q, const T* k_cache, const T* v_cache,                  \
          const int64_t* block_tables,                                                       \
          const int64_t* seq_lens, T* out, float* scratch, int64_t num_seqs, int64_t num_heads,\
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,      \
          float scale) {                                                                     \
    const int64_t group = num_heads / num_kv_heads, num_vectors = NV;                        \
    const int64_t token_stride = num_kv_heads * head_dim, seq_stride = num_heads * head_dim; \
    const int64_t block_bytes = block_size * token_stride * (int64_t)sizeof(T);              \
    float* qf = scratch;               /* queries [num_heads, head_dim] */                   \
    float* acc = qf + seq_stride;      /* weighted V sums [num_heads, head_dim] */           \
    float* scores = acc + seq_stride;  /* one unit's [num_heads, UNIT] */                    \
    float* peak = scores + num_heads * UNIT;  /* running max per head */                     \
    float* total = peak + num_heads;          /* running softmax denominator per head */     \
    for (int64_t b = 0; b < num_seqs; b++) {                                                 \
        const int64_t len = seq_lens[b];                                                     \
        const int64_t* table = block_tables + b * max_blocks;                                \
        for (int64_t i = 0; i < seq_stride; i += 16) {                                       \
            store16_f32(qf + i, LOAD16(q + b * seq_stride + i));                             \
            store16_f32(acc + i, _mm512_setzero_ps());                                       \
        }                                                                                    \
        for (int64_t h = 0; h < num_heads; h++) {                                            \
            peak[h] = -1.0e30f;                                                              \
            total[h] = 0.0f;                                                                 \
        }                                                                                    \
        for (int64_t start = 0; start < len;) {                                              \
            /* A unit: up to UNIT consecutive positions inside one block. */                  \
            const int64_t blk = start / block_size, in_block = start % block_size;          \
            int64_t n = block_size - in_block < UNIT ? block_size - in_block : UNIT;         \
            n = len - start < n ? len - start : n;                                           \
            const int64_t offset = (table[blk] * block_size + in_block) * token_stride;      \
            if (in_block == 0 && (blk + 1) * block_size < len) {                             \
                const int64_t next = table[blk + 1] * block_size * token_stride;             \
                prefetch_bytes(k_cache + next, block_bytes);                                 \
                prefetch_bytes(v_cache + next, block_bytes);                                 \
            }                                                                                \
            const T* k = k_cache + offset;                                                   \
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
                        scores[h * UNIT + t] = _mm512_reduce_add_ps(dot) * scale;            \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            for (int64_t h = 0; h < num_heads; h++)                                          \
                rescale_head(scores + h * UNIT, n, peak + h, total + h, acc + h * head_dim,  \
                             num_vectors);                                                   \
            const T* v = v_cache + offset;                                                   \
            for (int64_t t = 0; t < n; t++, v += token_stride) {                             \
                for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {        \
                    __m512 vv[MAX_HEAD_DIM / 16];                                            \
                    for (int64_t j = 0; j < num_vectors; j++)                                \
                        vv[j] = LOAD16(v + kv_head * head_dim + 16 * j);                     \
                    for (int64_t g = 0; g < group; g++, h++) {                               \
                        float* ah = acc + h * head_dim;                                      \
                        const __m512 p = _mm512_set1_ps(scores[h * UNIT + t]);               \
                        for (int64_t j = 0; j < num_vectors; j++)                            \
                            _mm512_storeu_ps(ah + 16 * j, _mm512_fmadd_ps(                   \
                                p, vv[j], _mm512_loadu_ps(ah + 16 * j)));                    \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            start += n;                                                                      \
        }                                                                                    \
        for (int64_t h = 0; h < num_heads; h++) {                                            \
            const __m512 inverse = _mm512_set1_ps(1.0f / total[h]);                          \
            for (int64_t j = 0; j < num_vectors; j++)                                        \
                STORE16(out + b * seq_stride + h * head_dim + 16 * j,                        \
                        _mm512_mul_ps(_mm512_loadu_ps(acc + h * head_dim + 16 * j), inverse));\
        }                                                                                    \
    }                                                                                        \
}


#define DEFINE_PAGED_DECODE(NAME, IMPL, T)                                                     \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,         \
          const int64_t* seq_lens, T* out, float* scratch, int64_t num_seqs, int64_t num_heads,\
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,      \
          float scale) {                                                                     \
    if (head_dim == 64)                                                                      \
        IMPL(4, q, k_cache, v_cache, block_tables, seq_lens, out, scratch, num_seqs,         \
             num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);              \
    else if (head_dim == 128)                                                                \
        IMPL(8, q, k_cache, v_cache, block_tables, seq_lens, out, scratch, num_seqs,         \
             num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);              \
    else                                                                                     \
        IMPL(head_dim / 16, q, k_cache, v_cache, block_tables, seq_lens, out, scratch,       \
             num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);    \
}

/* add_rms_norm: residual <- residual + x (rounded to T) unless add_residual is 0, then
 * out <- residual / rms(residual) * weight, row by row. x: [rows, hidden]. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOADM, STOREM, ROUND)                                     \
void NAME(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden,     \
          float eps, int64_t add_residual) {                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T* xr = x + r * hidden;                                                         \
        T* rr = residual + r * hidden;                                                        \
        __m512 squares = _mm512_setzero_ps();                                                 \
        for (int64_t j = 0; j < hidden; j += 16) {                                            \
            const __mmask16 m = tail_mask(hidden - j);                                        \
            __m512 h = LOADM(xr + j, m);                                                      \
            if (add_residual) {                                                               \
                h = ROUND(_mm512_add_ps(h, LOADM(rr + j, m)));                                \
                STOREM(rr + j, m, h);                                                         \
            }                                                                                 \
            squares = _mm512_fmadd_ps(h, h, squares);                                         \
        }                                                                                     \
        const __m512 inverse_rms = _mm512_set1_ps(                                            \
            1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));               \
        const T* source = add_residual ? rr : xr;                                             \
        for (int64_t j = 0; j < hidden; j += 16) {                                            \
            const __mmask16 m = tail_mask(hidden - j);                                        \
            STOREM(out + r * hidden + j, m, _mm512_mul_ps(                                    \
                _mm512_mul_ps(LOADM(source + j, m), inverse_rms), LOADM(weight + j, m)));     \
        }                                                                                     \
    }                                                                                         \
}

/* rotary: rotate heads [0, num_heads) of each row in place ("rotate half" pairs i and
 * i + head_dim/2). Rows are row_stride apart; cos/sin: float [rows, head_dim / 2]. */
#define DEFINE_ROTARY(NAME, T, LOADM, STOREM)                                                  \
void NAME(T* x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,        \
          const float* cos, const float* sin) {                                               \
    const int64_t half = head_dim / 2;                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        for (int64_t h = 0; h < num_heads; h++) {                                             \
            T* head = x + r * row_stride + h * head_dim;                                      \
            for (int64_t j = 0; j < half; j += 16) {                                          \
                const __mmask16 m = tail_mask(half - j);                                      \
                const __m512 c = _mm512_maskz_loadu_ps(m, cos + r * half + j);                \
                const __m512 s = _mm512_maskz_loadu_ps(m, sin + r * half + j);                \
                const __m512 x1 = LOADM(head + j, m), x2 = LOADM(head + half + j, m);         \
                STOREM(head + j, m, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));            \
                STOREM(head + half + j, m, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));     \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

/* silu_mul: out [rows, width] <- silu(gate) * up, gate_up [rows, 2 * width] = [gate | up]. */
#define DEFINE_SILU_MUL(NAME, T, LOADM, STOREM)                                                \
void NAME(const T* gate_up, T* out, int64_t rows, int64_t width) {                            \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T* gate = gate_up + r * 2 * width;                                              \
        for (int64_t j = 0; j < width; j += 16) {                                             \
            const __mmask16 m = tail_mask(width - j);                                         \
            const __m512 g = LOADM(gate + j, m);                                              \
            const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(             \
                _mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));         \
            STOREM(out + r * width + j, m,                                                    \
                   _mm512_mul_ps(_mm512_mul_ps(g, sig), LOADM(gate + width + j, m)));         \
        }                                                                                     \
    }                                                                                         \
}

#ifdef __AVX512BF16__
/* linear_bf16: y [rows, out] = x [rows, in] W^T (+ bias), for few rows (decode batches).
 * W is pre-packed as [out / 16][in / 2][16][2]: one 64-byte load holds 2 inputs of 16
 * outputs and feeds one vdpbf16ps per row of x, and the whole matrix is one sequential
 * stream, which the hardware prefetcher keeps at memory speed. NR rows of x and NP
 * interleaved input phases give NR * NP independent accumulator chains. */
static inline __attribute__((always_inline)) void linear_group_bf16(
        const int64_t NR, const int64_t NP, const uint16_t* w, const uint32_t* const* x,
        int64_t pairs, __m512* sums) {
    __m512 acc[8][4];
    for (int64_t r = 0; r < NR; r++)
        for (int64_t p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();
    int64_t pair = 0;
    for (; pair + NP <= pairs; pair += NP) {
        for (int64_t p = 0; p < NP; p++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (pair + p) * 32);
            for (int64_t r = 0; r < NR; r++)
                acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv,
                                             (__m512bh)_mm512_set1_epi32((int)x[r][pair + p]));
        }
    }
    for (; pair < pairs; pair++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + pair * 32);
        for (int64_t r = 0; r < NR; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv,
                                         (__m512bh)_mm512_set1_epi32((int)x[r][pair]));
    }
    for (int64_t r = 0; r < NR; r++) {
        sums[r] = acc[r][0];
        for (int64_t p = 1; p < NP; p++) sums[r] = _mm512_add_ps(sums[r], acc[r][p]);
    }
}

void linear_bf16(const uint16_t* w, const uint16_t* x, const uint16_t* bias, uint16_t* y,
                 int64_t rows, int64_t out, int64_t in) {
    const int64_t pairs = in / 2;
    for (int64_t group = 0; group < out / 16; group++) {
        /* The group's weights come from memory once; later row blocks reread them from cache. */
        const uint16_t* wg = w + group * pairs * 32;
        const __m512 b = bias ? load16_bf16(bias + group * 16) : _mm512_setzero_ps();
        for (int64_t first = 0; first < rows; first += 8) {
            const int64_t n = rows - first < 8 ? rows - first : 8;
            const uint32_t* xr[8];
            for (int64_t r = 0; r < 8; r++)  /* rows past n repeat the last one */
                xr[r] = (const uint32_t*)(x + (first + (r < n ? r : n - 1)) * in);
            __m512 sums[8];
            if (n == 1) linear_group_bf16(1, 4, wg, xr, pairs, sums);
            else if (n == 2) linear_group_bf16(2, 2, wg, xr, pairs, sums);
            else if (n <= 4) linear_group_bf16(4, 1, wg, xr, pairs, sums);
            else linear_group_bf16(8, 1, wg, xr, pairs, sums);
            for (int64_t r = 0; r < n; r++)
                store16_bf16(y + (first + r) * out + group * 16, _mm512_add_ps(sums[r], b));
        }
    }
}
#endif

DEFINE_PAGED_DECODE_IMPL(paged_decode_bf16_impl, uint16_t, load16_bf16, store16_bf16)
DEFINE_PAGED_DECODE_IMPL(paged_decode_f32_impl, float, load16_f32, store16_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, paged_decode_bf16_impl, uint16_t)
DEFINE_PAGED_DECODE(paged_decode_f32, paged_decode_f32_impl, float)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, loadm_bf16, storem_bf16, round_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, loadm_f32, storem_f32, round_f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, loadm_bf16, storem_bf16)
DEFINE_ROTARY(rotary_f32, float, loadm_f32, storem_f32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, loadm_bf16, storem_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, loadm_f32, storem_f32)
