/*
 * 16 float lanes ("V16") and the few integer operations the quantized kernels need, for the
 * ISA this translation unit is compiled for (build.py passes one of):
 *   PDSERVE_ISA_AVX512  one __m512 per V16 (AVX-512 F/BW/VL/DQ; BF16 and VNNI when
 *                       __AVX512BF16__ / __AVX512VNNI__ are defined by the compiler flags)
 *   PDSERVE_ISA_AVX2    two __m256 per V16 (AVX2 + FMA + F16C)
 *   (neither)           portable C: GCC/Clang vector extensions, which the compiler lowers to
 *                       whatever the target has (SSE2 on x86-64, NEON on ARM).
 * The logical width is 16 on every ISA, so packed weight layouts do not depend on the ISA.
 */
#ifndef PDSERVE_SIMD_H
#define PDSERVE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- float lanes ------------------------------------------------------------------------ */
#if defined(PDSERVE_ISA_AVX512)
#include <immintrin.h>
typedef __m512 V16;
typedef __m512i VI16; /* 16 int32 lanes */
ALWAYS_INLINE V16 v_zero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE V16 v_set1(float x) { return _mm512_set1_ps(x); }
ALWAYS_INLINE V16 v_load(const float* p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void v_store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE V16 v_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE V16 v_sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE V16 v_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE V16 v_div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
ALWAYS_INLINE V16 v_fma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE V16 v_max(V16 a, V16 b) { return _mm512_max_ps(a, b); }
ALWAYS_INLINE V16 v_min(V16 a, V16 b) { return _mm512_min_ps(a, b); }
ALWAYS_INLINE float v_sum(V16 v) { return _mm512_reduce_add_ps(v); }
ALWAYS_INLINE float v_hmax(V16 v) { return _mm512_reduce_max_ps(v); }
/* Whether any lane of v exceeds x. */
ALWAYS_INLINE int v_any_gt(V16 v, float x) {
    return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
}
/* Horizontal sums of 16 vectors with the shuffles and adds shared: v_psum4 of vectors 0-3
 * (4-7, ...), v_psum8 of two such, v_psum16 of two of those gives lane i = vector i's sum
 * (the steps between hold partial sums in an ISA-specific layout). Here: folds of lane pairs
 * and of pairs of pairs within 128 bits (v_psum4), then of 128-bit quarters. */
ALWAYS_INLINE __m512 fold_pairs512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
ALWAYS_INLINE V16 v_psum4(const V16* d) {
    return fold_pairs512(fold_pairs512(d[0], d[1]), fold_pairs512(d[2], d[3]));
}
ALWAYS_INLINE V16 v_psum8(V16 a, V16 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
ALWAYS_INLINE V16 v_psum16(V16 a, V16 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
ALWAYS_INLINE V16 v_abs(V16 v) { return _mm512_abs_ps(v); }
ALWAYS_INLINE V16 v_round(V16 v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integral n in [-126, 127]. */
ALWAYS_INLINE V16 v_pow2i(V16 n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
ALWAYS_INLINE V16 v_from_bits(VI16 bits) { return _mm512_castsi512_ps(bits); }
ALWAYS_INLINE VI16 v_bits(V16 v) { return _mm512_castps_si512(v); }
ALWAYS_INLINE V16 v_load_bf16(const uint16_t* p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
/* float32 -> bfloat16 bits, round to nearest even (values are finite). With AVX-512 BF16 one
 * conversion instead of six integer steps (which float denormals, below 1.2e-38, alone tell
 * apart: it flushes them to zero); every bf16 store and rounding goes through it. */
ALWAYS_INLINE __m256i v_bf16_bits(V16 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
#endif
}
ALWAYS_INLINE void v_store_bf16(uint16_t* p, V16 v) {
    _mm256_storeu_si256((__m256i*)p, v_bf16_bits(v));
}
/* What a value reads back as once stored as bfloat16. */
ALWAYS_INLINE V16 v_round_bf16(V16 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v_bf16_bits(v)), 16));
}
/* 32 bfloat16 laid out [16 lanes][2]: the first and second element of every pair. */
ALWAYS_INLINE void v_load_bf16_pairs(const uint16_t* p, V16* first, V16* second) {
    const __m512i raw = _mm512_loadu_si512(p);
    *first = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    *second = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000)));
}
ALWAYS_INLINE V16 v_load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
ALWAYS_INLINE V16 v_cvt_i32(VI16 v) { return _mm512_cvtepi32_ps(v); }
ALWAYS_INLINE V16 v_load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
/* v's lanes (integers in [-128, 127]) as 16 int8 at p. */
ALWAYS_INLINE void v_store_i8(int8_t* p, V16 v) {
    _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
ALWAYS_INLINE VI16 vi_zero(void) { return _mm512_setzero_si512(); }

#elif defined(PDSERVE_ISA_AVX2)
#include <immintrin.h>
typedef struct {
    __m256 lo, hi;
} V16;
typedef struct {
    __m256i lo, hi;
} VI16;
#define V16_MAP2(a, b, op) ((V16){op((a).lo, (b).lo), op((a).hi, (b).hi)})
ALWAYS_INLINE V16 v_zero(void) { return (V16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ALWAYS_INLINE V16 v_set1(float x) { return (V16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
ALWAYS_INLINE V16 v_load(const float* p) {
    return (V16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
ALWAYS_INLINE void v_store(float* p, V16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
ALWAYS_INLINE V16 v_add(V16 a, V16 b) { return V16_MAP2(a, b, _mm256_add_ps); }
ALWAYS_INLINE V16 v_sub(V16 a, V16 b) { return V16_MAP2(a, b, _mm256_sub_ps); }
ALWAYS_INLINE V16 v_mul(V16 a, V16 b) { return V16_MAP2(a, b, _mm256_mul_ps); }
ALWAYS_INLINE V16 v_div(V16 a, V16 b) { return V16_MAP2(a, b, _mm256_div_ps); }
ALWAYS_INLINE V16 v_max(V16 a, V16 b) { return V16_MAP2(a, b, _mm256_max_ps); }
ALWAYS_INLINE V16 v_min(V16 a, V16 b) { return V16_MAP2(a, b, _mm256_min_ps); }
ALWAYS_INLINE V16 v_fma(V16 a, V16 b, V16 c) {
    return (V16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
ALWAYS_INLINE float v_sum(V16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
ALWAYS_INLINE int v_any_gt(V16 v, float x) {
    const __m256 t = _mm256_set1_ps(x);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v.lo, t, _CMP_GT_OQ),
                                           _mm256_cmp_ps(v.hi, t, _CMP_GT_OQ))) != 0;
}
/* The horizontal sums of 16 vectors (steps as in the AVX-512 section): each vector's halves
 * added, hadd trees over 4 (v_psum4), the 128-bit halves of two of those added (v_psum8: 8
 * sums in .lo), two of those side by side (v_psum16). */
ALWAYS_INLINE V16 v_psum4(const V16* d) {
    __m256 e[4];
    for (int i = 0; i < 4; i++) e[i] = _mm256_add_ps(d[i].lo, d[i].hi);
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(e[0], e[1]), _mm256_hadd_ps(e[2], e[3]));
    return (V16){s, _mm256_setzero_ps()};
}
ALWAYS_INLINE V16 v_psum8(V16 a, V16 b) {
    const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(a.lo, b.lo, 0x20),
                                   _mm256_permute2f128_ps(a.lo, b.lo, 0x31));
    return (V16){s, _mm256_setzero_ps()};
}
ALWAYS_INLINE V16 v_psum16(V16 a, V16 b) { return (V16){a.lo, b.lo}; }
ALWAYS_INLINE float v_hmax(V16 v) {
    const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
ALWAYS_INLINE V16 v_abs(V16 v) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return (V16){_mm256_and_ps(v.lo, mask), _mm256_and_ps(v.hi, mask)};
}
ALWAYS_INLINE V16 v_round(V16 v) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return (V16){_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode)};
}
ALWAYS_INLINE __m256 pow2i8(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
ALWAYS_INLINE V16 v_pow2i(V16 n) { return (V16){pow2i8(n.lo), pow2i8(n.hi)}; }
ALWAYS_INLINE V16 v_from_bits(VI16 b) {
    return (V16){_mm256_castsi256_ps(b.lo), _mm256_castsi256_ps(b.hi)};
}
ALWAYS_INLINE VI16 v_bits(V16 v) {
    return (VI16){_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)};
}
ALWAYS_INLINE __m256 bf16x8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
ALWAYS_INLINE V16 v_load_bf16(const uint16_t* p) { return (V16){bf16x8(p), bf16x8(p + 8)}; }
ALWAYS_INLINE __m256i bf16_bits8(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_srli_epi32(bits, 16);
}
ALWAYS_INLINE void v_store_bf16(uint16_t* p, V16 v) {
    /* packus works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] -> reorder the quarters. */
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi));
    _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));
}
ALWAYS_INLINE void v_load_bf16_pairs(const uint16_t* p, V16* first, V16* second) {
    const __m256i a = _mm256_loadu_si256((const __m256i*)p);
    const __m256i b = _mm256_loadu_si256((const __m256i*)(p + 16));
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    *first = (V16){_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                   _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    *second = (V16){_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                    _mm256_castsi256_ps(_mm256_and_si256(b, high))};
}
ALWAYS_INLINE V16 v_load_f16(const uint16_t* p) {
    return (V16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
ALWAYS_INLINE V16 v_cvt_i32(VI16 v) {
    return (V16){_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)};
}
ALWAYS_INLINE V16 v_load_i8(const int8_t* p) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)p);
    return (V16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw)))};
}
ALWAYS_INLINE void v_store_i8(int8_t* p, V16 v) {
    /* Packing works per 128-bit lane: the bytes come out as dwords lo 0-3, hi 0-3, lo 4-7,
     * hi 4-7 of the halves, put back in order by the last shuffle. */
    const __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words),
                                          _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i*)p, _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0)));
}
ALWAYS_INLINE VI16 vi_zero(void) { return (VI16){_mm256_setzero_si256(), _mm256_setzero_si256()}; }

#else /* portable */
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t VI16 __attribute__((vector_size(64)));
typedef uint32_t VU16 __attribute__((vector_size(64)));
typedef uint16_t VH16 __attribute__((vector_size(32)));
ALWAYS_INLINE V16 v_zero(void) { return (V16){0}; }
ALWAYS_INLINE V16 v_set1(float x) { /* not (V16){0} + x: 0 + -0 is +0 */
    V16 v;
    for (int i = 0; i < 16; i++) v[i] = x;
    return v;
}
ALWAYS_INLINE V16 v_load(const float* p) {
    V16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
ALWAYS_INLINE void v_store(float* p, V16 v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE V16 v_add(V16 a, V16 b) { return a + b; }
ALWAYS_INLINE V16 v_sub(V16 a, V16 b) { return a - b; }
ALWAYS_INLINE V16 v_mul(V16 a, V16 b) { return a * b; }
ALWAYS_INLINE V16 v_div(V16 a, V16 b) { return a / b; }
ALWAYS_INLINE V16 v_fma(V16 a, V16 b, V16 c) { return a * b + c; } /* fused by -ffp-contract */
ALWAYS_INLINE V16 v_select(VI16 mask, V16 a, V16 b) {
    return (V16)((mask & (VI16)a) | (~mask & (VI16)b));
}
ALWAYS_INLINE V16 v_max(V16 a, V16 b) { return v_select(a > b, a, b); }
ALWAYS_INLINE V16 v_min(V16 a, V16 b) { return v_select(a < b, a, b); }
ALWAYS_INLINE float v_sum(V16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
ALWAYS_INLINE float v_hmax(V16 v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}
ALWAYS_INLINE int v_any_gt(V16 v, float x) {
    int any = 0;
    for (int i = 0; i < 16; i++) any |= v[i] > x;
    return any;
}
/* The horizontal sums of 16 vectors (steps as in the AVX-512 section): v_psum4 puts 4 sums
 * in lanes 0-3, v_psum8 and v_psum16 concatenate the sums of two such. */
ALWAYS_INLINE V16 v_psum4(const V16* d) {
    V16 s = v_zero();
    for (int i = 0; i < 4; i++) s[i] = v_sum(d[i]);
    return s;
}
ALWAYS_INLINE V16 v_psum8(V16 a, V16 b) {
    for (int i = 0; i < 4; i++) a[4 + i] = b[i];
    return a;
}
ALWAYS_INLINE V16 v_psum16(V16 a, V16 b) {
    for (int i = 0; i < 8; i++) a[8 + i] = b[i];
    return a;
}
ALWAYS_INLINE V16 v_abs(V16 v) { return (V16)((VI16)v & 0x7fffffff); }
/* Round to nearest even for |v| < 2^22 (all callers' inputs). */
ALWAYS_INLINE V16 v_round(V16 v) {
    const V16 magic = v_set1(12582912.0f); /* 1.5 * 2^23 */
    const VI16 negative = v < 0.0f;
    const V16 a = v_abs(v);
    const V16 r = (a + magic) - magic;
    return (V16)((VI16)r | (negative & (VI16)v_set1(-0.0f)));
}
ALWAYS_INLINE V16 v_pow2i(V16 n) {
    return (V16)((__builtin_convertvector(n, VI16) + 127) << 23);
}
ALWAYS_INLINE V16 v_from_bits(VI16 bits) { return (V16)bits; }
ALWAYS_INLINE VI16 v_bits(V16 v) { return (VI16)v; }
ALWAYS_INLINE V16 v_load_bf16(const uint16_t* p) {
    VH16 h;
    memcpy(&h, p, sizeof h);
    return (V16)(__builtin_convertvector(h, VU16) << 16);
}
ALWAYS_INLINE void v_store_bf16(uint16_t* p, V16 v) {
    VU16 bits = (VU16)v;
    bits += ((bits >> 16) & 1) + 0x7fff;
    const VH16 h = __builtin_convertvector(bits >> 16, VH16);
    memcpy(p, &h, sizeof h);
}
ALWAYS_INLINE void v_load_bf16_pairs(const uint16_t* p, V16* first, V16* second) {
    VU16 raw;
    memcpy(&raw, p, sizeof raw);
    *first = (V16)(raw << 16);
    *second = (V16)(raw & 0xffff0000u);
}
/* IEEE half -> float for finite values (subnormal halves included). */
ALWAYS_INLINE float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f;
    const uint32_t mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) {
        value = ldexpf((float)mantissa, -24);
    } else {
        const uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
        memcpy(&value, &bits, sizeof value);
    }
    return sign ? -value : value;
}
ALWAYS_INLINE V16 v_load_f16(const uint16_t* p) {
    V16 v;
    for (int i = 0; i < 16; i++) v[i] = f16_to_f32(p[i]);
    return v;
}
ALWAYS_INLINE V16 v_cvt_i32(VI16 v) { return __builtin_convertvector(v, V16); }
typedef int8_t VB16 __attribute__((vector_size(16)));
ALWAYS_INLINE V16 v_load_i8(const int8_t* p) {
    VB16 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, V16);
}
ALWAYS_INLINE void v_store_i8(int8_t* p, V16 v) {
    const VB16 b = __builtin_convertvector(v, VB16);
    memcpy(p, &b, sizeof b);
}
ALWAYS_INLINE VI16 vi_zero(void) { return (VI16){0}; }
#endif

/* ---- shared helpers on top of the lanes ------------------------------------------------- */

ALWAYS_INLINE int64_t round_up_64(int64_t n) { return (n + 63) / 64 * 64; }

/* The first n (< 16) lanes from memory, the rest zero; and their store. */
ALWAYS_INLINE V16 v_load_n(const float* p, int64_t n) {
    float buffer[16] = {0};
    memcpy(buffer, p, (size_t)n * sizeof(float));
    return v_load(buffer);
}
ALWAYS_INLINE void v_store_n(float* p, int64_t n, V16 v) {
    float buffer[16];
    v_store(buffer, v);
    memcpy(p, buffer, (size_t)n * sizeof(float));
}
ALWAYS_INLINE V16 v_load_bf16_n(const uint16_t* p, int64_t n) {
    uint16_t buffer[16] = {0};
    memcpy(buffer, p, (size_t)n * sizeof(uint16_t));
    return v_load_bf16(buffer);
}
ALWAYS_INLINE void v_store_bf16_n(uint16_t* p, int64_t n, V16 v) {
    uint16_t buffer[16];
    v_store_bf16(buffer, v);
    memcpy(p, buffer, (size_t)n * sizeof(uint16_t));
}

#if !defined(PDSERVE_ISA_AVX512)
/* What a value reads back as once stored as bfloat16. */
ALWAYS_INLINE V16 v_round_bf16(V16 v) {
    uint16_t buffer[16];
    v_store_bf16(buffer, v);
    return v_load_bf16(buffer);
}
#endif

/* e^x: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, degree-6 Taylor series of 2^f
 * (relative error ~1e-7). Inputs below -87 give ~0, above 88 are clamped. */
ALWAYS_INLINE V16 v_exp(V16 x) {
    x = v_max(v_min(x, v_set1(88.0f)), v_set1(-87.0f));
    const V16 t = v_mul(x, v_set1(1.44269504f));
    const V16 n = v_round(t);
    const V16 f = v_sub(t, n);
    V16 p = v_set1(1.54035304e-4f);
    p = v_fma(p, f, v_set1(1.33335581e-3f));
    p = v_fma(p, f, v_set1(9.61812911e-3f));
    p = v_fma(p, f, v_set1(5.55041087e-2f));
    p = v_fma(p, f, v_set1(2.40226507e-1f));
    p = v_fma(p, f, v_set1(6.93147181e-1f));
    p = v_fma(p, f, v_set1(1.0f));
    return v_mul(p, v_pow2i(n));
}

/* Element types of activation and KV tensors. */
enum { DT_F32 = 0, DT_BF16 = 1 };

/* 16 lanes of element i of a tensor of type dt (dt is a compile-time constant at every
 * call site, so the branch folds away). */
ALWAYS_INLINE V16 load_dt(const void* base, int64_t i, int dt) {
    return dt == DT_BF16 ? v_load_bf16((const uint16_t*)base + i) : v_load((const float*)base + i);
}
ALWAYS_INLINE void store_dt(void* base, int64_t i, V16 v, int dt) {
    if (dt == DT_BF16)
        v_store_bf16((uint16_t*)base + i, v);
    else
        v_store((float*)base + i, v);
}
/* n lanes (n <= 16) of elements [i, i + n). */
ALWAYS_INLINE V16 load_dt_n(const void* base, int64_t i, int64_t n, int dt) {
    if (n >= 16) return load_dt(base, i, dt);
    return dt == DT_BF16 ? v_load_bf16_n((const uint16_t*)base + i, n)
                         : v_load_n((const float*)base + i, n);
}
ALWAYS_INLINE void store_dt_n(void* base, int64_t i, int64_t n, V16 v, int dt) {
    if (n >= 16)
        store_dt(base, i, v, dt);
    else if (dt == DT_BF16)
        v_store_bf16_n((uint16_t*)base + i, n, v);
    else
        v_store_n((float*)base + i, n, v);
}
ALWAYS_INLINE V16 round_dt(V16 v, int dt) { return dt == DT_BF16 ? v_round_bf16(v) : v; }

#endif /* PDSERVE_SIMD_H */
