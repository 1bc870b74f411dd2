/*
 * Paged prefill attention, flash-style: the new tokens of one sequence (a prefill chunk)
 * attend to its whole context, read in place through the block table, causally within the
 * chunk and offset by the tokens cached before it. Included once, by cpu_ops.c.
 *
 * Layout of the work: for each KV head, the query rows it serves (token-major: row
 * t * group + g is token t's query head kv_head * group + g) are cut into tiles of 16, one
 * row per vector lane, and PF_TILES tiles form a block that walks the context once, one
 * unit of up to UNIT positions (inside one cache block) at a time, with an online softmax.
 * Rows in lanes keep every per-row quantity (running max, denominator, causal limit) a
 * vector, so the softmax needs no horizontal operations:
 *   scores  s[t][lane] = sum_d qt[d][lane] * K[t][d]   (qt: the tile's queries transposed)
 *   values  o[lane][:] = o[lane][:] * alpha[lane] + sum_t p[t][lane] * V[t][:]
 * Arithmetic is float32 (bfloat16 K/V are widened once per unit and block), except where
 * q and K/V are all bfloat16 on a core with vdpbf16ps (BF below): q and K meet as pairs of
 * dims, the weights (rounded to bfloat16, as the AMX path's) and V as pairs of positions,
 * with half the multiply instructions and nothing widened; sums stay float32.
 *
 * With AMX (the amx variant) a bfloat16 model with a bfloat16 cache runs pf_amx_tile instead:
 * the same walk in units of 32 positions, scores and values multiplied in tiles, the softmax
 * in AVX-512, the next unit's scores issued to the tiles before it (see there).
 *
 * Blocks are independent; a call runs blocks [0, prefill_num_blocks(...)) on a team of
 * num_threads members (run_team) that take blocks from a shared counter.
 */

#define PF_TILE 16 /* query rows per tile: one per lane */
#define PF_TILES 4 /* tiles per block: a unit's widened K/V serves them all */
#define PF_MASKED (-1.0e30f)

#if defined(PDSERVE_ISA_AVX512)
#define PF_SCORE_T 16 /* positions scored per pass over d: accumulators in registers */
#define PF_PV_VECS 4  /* output vectors of a row per pass over a unit */
#else
#define PF_SCORE_T 4
#define PF_PV_VECS 1
#endif
#define PF_PV_ROWS 4 /* rows per pass over a unit */

typedef struct {
    int qdt, kvdt;
    const void* q; /* [num_new, q_stride], query head h at h * head_dim */
    int64_t q_stride;
    const void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int64_t* block_table;
    int64_t num_new, num_computed;
    void* out; /* [num_new, num_heads * head_dim] */
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int use_amx;
    uint16_t* packed; /* AMX: per KV head, K [packed_len][D] then V^T [D][packed_len] */
    int64_t packed_len;
} PrefillArgs;

ALWAYS_INLINE int64_t pf_rows(const PrefillArgs* a) {
    return a->num_new * (a->num_heads / a->num_kv_heads);
}

/* Blocks of PF_TILES * PF_TILE query rows per KV head. */
int64_t prefill_num_blocks(int64_t num_new, int64_t num_heads, int64_t num_kv_heads) {
    const int64_t rows = num_new * (num_heads / num_kv_heads);
    return num_kv_heads * ((rows + PF_TILE * PF_TILES - 1) / (PF_TILE * PF_TILES));
}

/* Floats of one thread's scratch: queries and outputs of a block, its per-row state, one
 * unit's widened K and V, and one tile's scores. */
ALWAYS_INLINE int64_t pf_scratch_floats(int64_t head_dim) {
    return 2 * PF_TILES * PF_TILE * head_dim + 3 * PF_TILES * PF_TILE + 2 * UNIT * head_dim +
           UNIT * PF_TILE + PF_TILE;
}

ALWAYS_INLINE int64_t pf_thread_bytes(int64_t head_dim) {
    return round_up_64(pf_scratch_floats(head_dim) * (int64_t)sizeof(float));
}

/* Positions of the context packed for the AMX path: seq_len rounded up to a whole unit. */
ALWAYS_INLINE int64_t pf_packed_len(int64_t seq_len) { return (seq_len + 31) / 32 * 32; }

/* Bytes of scratch a call on num_threads threads needs: each thread's, then (AMX) every KV
 * head's context packed once. */
int64_t prefill_scratch_bytes(int64_t head_dim, int64_t num_threads, int64_t num_kv_heads,
                              int64_t seq_len) {
    return num_threads * pf_thread_bytes(head_dim) +
           num_kv_heads * 2 * pf_packed_len(seq_len) * head_dim * 2;
}

/* s[t] += qt . K[t] for positions t < PF_SCORE_T of rows[] (row pointers, float). */
ALWAYS_INLINE void pf_scores(const int64_t D, const float* qt, const float* const* k, V16* s) {
    V16 acc[PF_SCORE_T];
    for (int64_t t = 0; t < PF_SCORE_T; t++) acc[t] = v_zero();
    for (int64_t d = 0; d < D; d++) {
        const V16 qd = v_load(qt + 16 * d);
        for (int64_t t = 0; t < PF_SCORE_T; t++) acc[t] = v_fma(qd, v_set1(k[t][d]), acc[t]);
    }
    for (int64_t t = 0; t < PF_SCORE_T; t++) s[t] = acc[t];
}

#if HAS_DPBF16
/* s[t] = scale * qt . K[t] for positions t < PF_SCORE_T: qt [D / 2][16] pairs of dims (one
 * row per lane), K rows bf16 in the cache (k[t]), a pair of dims broadcast per instruction. */
ALWAYS_INLINE void pf_scores_bf16(const int64_t D, const uint32_t* qt,
                                  const uint16_t* const* k, float scale, V16* s) {
    V16 acc[PF_SCORE_T];
    for (int64_t t = 0; t < PF_SCORE_T; t++) acc[t] = v_zero();
    for (int64_t i = 0; i < D / 2; i++) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(qt + 16 * i);
        for (int64_t t = 0; t < PF_SCORE_T; t++)
            acc[t] = _mm512_dpbf16_ps(acc[t], qd,
                                      (__m512bh)_mm512_set1_epi32(((const int32_t*)k[t])[i]));
    }
    for (int64_t t = 0; t < PF_SCORE_T; t++) s[t] = v_mul(acc[t], v_set1(scale));
}

/* A unit's n V rows (bf16, v_stride apart) as pairs of positions: vp [(n + 1) / 2][D]
 * (uint32: V[2i][d], V[2i + 1][d]), a missing odd row zero. */
ALWAYS_INLINE void pf_pack_values(const int64_t NV, const uint16_t* v, int64_t v_stride,
                                  int64_t n, uint32_t* vp) {
    const __m512i pairs = BF16_PAIRS;
    for (int64_t t = 0; t < n; t += 2)
        for (int64_t j = 0; j < NV; j++) {
            const __m256i even = _mm256_loadu_si256((const __m256i*)(v + t * v_stride + 16 * j));
            const __m256i odd = t + 1 < n
                                    ? _mm256_loadu_si256(
                                          (const __m256i*)(v + (t + 1) * v_stride + 16 * j))
                                    : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
            _mm512_storeu_si512(vp + t / 2 * 16 * NV + 16 * j,
                                _mm512_permutexvar_epi16(pairs, both));
        }
}

#endif

/* o[r][:] = o[r][:] * alpha[r] + sum_{t < n} p[t][r] * V[t][:] for the tile's 16 rows.
 * Float (BF 0): v [n][v_stride] float. BF 1: p (float [UNIT][16], zero past n) rounded to
 * bf16 pairs of positions in pt [UNIT / 2][16], v as pf_pack_values left it (pairs
 * [(n + 1) / 2][D]). */
ALWAYS_INLINE void pf_values(const int64_t NV, const int BF, float* o, const float* alpha,
                             const float* p, const void* v, int64_t v_stride, int64_t n,
                             uint32_t* pt) {
    const int64_t D = 16 * NV, steps = BF ? (n + 1) / 2 : n;
#if HAS_DPBF16
    for (int64_t i = 0; BF && i < steps; i++) {
        const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(v_load(p + 16 * (2 * i + 1)),
                                                        v_load(p + 16 * (2 * i)));
        _mm512_storeu_si512(pt + 16 * i, _mm512_permutexvar_epi16(BF16_PAIRS, bf));
    }
#endif
    for (int64_t r0 = 0; r0 < PF_TILE; r0 += PF_PV_ROWS)
        for (int64_t j0 = 0; j0 < NV; j0 += PF_PV_VECS) {
            const int64_t jn = NV - j0 < PF_PV_VECS ? NV - j0 : PF_PV_VECS;
            V16 acc[PF_PV_ROWS][PF_PV_VECS];
            for (int64_t r = 0; r < PF_PV_ROWS; r++) {
                const V16 scale = v_set1(alpha[r0 + r]);
                for (int64_t j = 0; j < jn; j++)
                    acc[r][j] = v_mul(v_load(o + (r0 + r) * D + 16 * (j0 + j)), scale);
            }
            for (int64_t t = 0; t < steps; t++) {
#if HAS_DPBF16
                if (BF) {
                    __m512bh vv[PF_PV_VECS];
                    for (int64_t j = 0; j < jn; j++)
                        vv[j] = (__m512bh)_mm512_loadu_si512((const uint32_t*)v + t * D +
                                                             16 * (j0 + j));
                    for (int64_t r = 0; r < PF_PV_ROWS; r++) {
                        const __m512bh pr =
                            (__m512bh)_mm512_set1_epi32((int32_t)pt[16 * t + r0 + r]);
                        for (int64_t j = 0; j < jn; j++)
                            acc[r][j] = _mm512_dpbf16_ps(acc[r][j], vv[j], pr);
                    }
                    continue;
                }
#endif
                V16 vv[PF_PV_VECS];
                for (int64_t j = 0; j < jn; j++)
                    vv[j] = v_load((const float*)v + t * v_stride + 16 * (j0 + j));
                for (int64_t r = 0; r < PF_PV_ROWS; r++) {
                    const V16 pr = v_set1(p[16 * t + r0 + r]);
                    for (int64_t j = 0; j < jn; j++) acc[r][j] = v_fma(pr, vv[j], acc[r][j]);
                }
            }
            for (int64_t r = 0; r < PF_PV_ROWS; r++)
                for (int64_t j = 0; j < jn; j++)
                    v_store(o + (r0 + r) * D + 16 * (j0 + j), acc[r][j]);
        }
}

/* One block: rows [row0, row0 + PF_TILES * PF_TILE) of KV head kv_head; BF (a compile-time
 * constant, bf16 q and K/V on a vdpbf16ps core) keeps the block's queries as bf16 pairs of
 * dims in qt, V as pairs of positions in vbuf and the weights' pairs in kbuf. */
ALWAYS_INLINE void pf_block(int qdt, int kvdt, const int64_t NV, const int BF,
                            const PrefillArgs* a, int64_t kv_head, int64_t row0,
                            float* scratch) {
    const int64_t D = 16 * NV, group = a->num_heads / a->num_kv_heads, rows = pf_rows(a);
    const int64_t token_stride = a->num_kv_heads * D, bs = a->block_size;
    const int64_t num_rows = rows - row0 < PF_TILES * PF_TILE ? rows - row0 : PF_TILES * PF_TILE;
    const int64_t num_tiles = (num_rows + PF_TILE - 1) / PF_TILE;
    float* qt = scratch;                          /* [tiles][D][16] */
    float* o = qt + PF_TILES * PF_TILE * D;       /* [tiles][16][D] */
    float* peak = o + PF_TILES * PF_TILE * D;     /* [tiles][16] running max */
    float* total = peak + PF_TILES * PF_TILE;     /* [tiles][16] softmax denominator */
    float* qpos = total + PF_TILES * PF_TILE;     /* [tiles][16] each row's position */
    float* kbuf = qpos + PF_TILES * PF_TILE;      /* [UNIT][D] widened K of a unit */
    float* vbuf = kbuf + UNIT * D;                /* [UNIT][D] */
    float* p = vbuf + UNIT * D;                   /* [UNIT][16] one tile's scores/weights */
    float* alpha = p + UNIT * PF_TILE;            /* [16] */
    for (int64_t lane = 0; lane < PF_TILES * PF_TILE; lane++) {
        /* Lanes past the last row repeat it: computed, never written out. */
        const int64_t r = row0 + (lane < num_rows ? lane : num_rows - 1);
        const int64_t token = r / group, head = kv_head * group + r % group;
        if (BF) { /* [tiles][D / 2][16] pairs of dims, unscaled */
            uint32_t* pairs = (uint32_t*)qt + (lane / PF_TILE) * PF_TILE * D / 2 + lane % PF_TILE;
            const uint32_t* q_pairs =
                (const uint32_t*)((const uint16_t*)a->q + token * a->q_stride + head * D);
            for (int64_t i = 0; i < D / 2; i++) pairs[16 * i] = q_pairs[i];
        }
        float* q_lanes = qt + (lane / PF_TILE) * PF_TILE * D + lane % PF_TILE;
        for (int64_t j = 0; !BF && j < NV; j++) {
            float values[16];
            v_store(values, load_dt(a->q, token * a->q_stride + head * D + 16 * j, qdt));
            for (int64_t k = 0; k < 16; k++) q_lanes[16 * (16 * j + k)] = values[k] * a->scale;
        }
        qpos[lane] = (float)(a->num_computed + token);
        peak[lane] = PF_MASKED;
        total[lane] = 0.0f;
    }
    memset(o, 0, sizeof(float) * PF_TILES * PF_TILE * D);
    const int64_t context = a->num_computed + (row0 + num_rows - 1) / group + 1;
    for (int64_t start = 0; start < context;) {
        const int64_t blk = start / bs, in_block = start % bs;
        int64_t n = bs - in_block < UNIT ? bs - in_block : UNIT;
        n = context - start < n ? context - start : n;
        const int64_t offset = (a->block_table[blk] * bs + in_block) * token_stride + kv_head * D;
        const float *k, *v;
        int64_t kv_stride;
        if (BF) {
#if HAS_DPBF16
            pf_pack_values(NV, (const uint16_t*)a->v_cache + offset, token_stride, n,
                           (uint32_t*)vbuf);
#endif
            k = v = NULL;
            kv_stride = token_stride;
        } else if (kvdt == DT_F32) {
            k = (const float*)a->k_cache + offset;
            v = (const float*)a->v_cache + offset;
            kv_stride = token_stride;
        } else {
            for (int64_t t = 0; t < n; t++)
                for (int64_t j = 0; j < NV; j++) {
                    const int64_t i = offset + t * token_stride + 16 * j;
                    v_store(kbuf + t * D + 16 * j, load_dt(a->k_cache, i, DT_BF16));
                    v_store(vbuf + t * D + 16 * j, load_dt(a->v_cache, i, DT_BF16));
                }
            k = kbuf;
            v = vbuf;
            kv_stride = D;
        }
        for (int64_t tile = 0; tile < num_tiles; tile++) {
            const float* tile_pos = qpos + tile * PF_TILE;
            if ((float)start > tile_pos[PF_TILE - 1]) continue; /* all masked: a past tile */
            V16 s[UNIT];
            for (int64_t t0 = 0; t0 < n; t0 += PF_SCORE_T) {
                if (BF) {
#if HAS_DPBF16
                    const uint16_t* rows_k[PF_SCORE_T];
                    for (int64_t t = 0; t < PF_SCORE_T; t++)
                        rows_k[t] = (const uint16_t*)a->k_cache + offset +
                                    (t0 + t < n ? t0 + t : n - 1) * kv_stride;
                    pf_scores_bf16(D, (const uint32_t*)qt + tile * PF_TILE * D / 2, rows_k,
                                   a->scale, s + t0);
#endif
                    continue;
                }
                const float* rows_k[PF_SCORE_T];
                for (int64_t t = 0; t < PF_SCORE_T; t++)
                    rows_k[t] = k + (t0 + t < n ? t0 + t : n - 1) * kv_stride;
                pf_scores(D, qt + tile * PF_TILE * D, rows_k, s + t0);
            }
            const V16 pos = v_load(tile_pos);
            const int is_diagonal = (float)(start + n - 1) > tile_pos[0];
            float* tile_peak = peak + tile * PF_TILE;
            V16 new_peak = v_load(tile_peak);
            for (int64_t t = 0; t < n; t++) {
                if (is_diagonal) /* + 0 where visible, <= -1e30 where the row is earlier */
                    s[t] = v_fma(v_min(v_sub(pos, v_set1((float)(start + t))), v_zero()),
                                 v_set1(-PF_MASKED), s[t]);
                new_peak = v_max(new_peak, s[t]);
            }
            const V16 scale = v_exp(v_sub(v_load(tile_peak), new_peak));
            V16 sum = v_zero();
            for (int64_t t = 0; t < n; t++) {
                const V16 weight = v_exp(v_sub(s[t], new_peak));
                sum = v_add(sum, weight);
                v_store(p + 16 * t, weight);
            }
            float* tile_total = total + tile * PF_TILE;
            v_store(tile_total, v_fma(v_load(tile_total), scale, sum));
            v_store(tile_peak, new_peak);
            v_store(alpha, scale);
            if (BF && n % 2) v_store(p + 16 * n, v_zero()); /* pairs V's zero row */
            pf_values(NV, BF, o + tile * PF_TILE * D, alpha, p, BF ? (const void*)vbuf : v,
                      kv_stride, n, (uint32_t*)kbuf);
        }
        start += n;
    }
    for (int64_t lane = 0; lane < num_rows; lane++) {
        const int64_t r = row0 + lane, token = r / group, head = kv_head * group + r % group;
        const V16 inverse = v_set1(1.0f / total[lane]);
        const float* row = o + (lane / PF_TILE) * PF_TILE * D + (lane % PF_TILE) * D;
        for (int64_t j = 0; j < NV; j++)
            store_dt(a->out, token * a->num_heads * D + head * D + 16 * j,
                     v_mul(v_load(row + 16 * j), inverse), qdt);
    }
}

ALWAYS_INLINE void pf_block_types(int qdt, int kvdt, const int BF, const PrefillArgs* a,
                                  int64_t kv_head, int64_t row0, float* scratch) {
    if (a->head_dim == 64)
        pf_block(qdt, kvdt, 4, BF, a, kv_head, row0, scratch);
    else if (a->head_dim == 128)
        pf_block(qdt, kvdt, 8, BF, a, kv_head, row0, scratch);
    else
        pf_block(qdt, kvdt, a->head_dim / 16, BF, a, kv_head, row0, scratch);
}

#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PF_AMX_UNIT 32 /* positions per step: P^T of 16 rows is one tile of bf16 pairs */
#define PF_AMX_MAX_HEAD_DIM 64 /* O^T stays in tiles 4..7, one per 16 dims */
/* The running max a row's weights are taken against moves only when the row's true max
 * exceeds it by 2^8 (weights then stay <= 256: exact in fp32 sums, fine in bf16), so the
 * accumulators in tiles are rescaled rarely instead of every unit. Exact: numerator and
 * denominator use the same max. */
#define PF_RESCALE_LOG2 8.0f

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* ldtilecfg of `config`. GCC's _tile_loadconfig tells the compiler it reads 8 bytes, so without
 * the barrier the stores of the rest of the struct may be dropped as dead (seen: a #GP on a
 * config whose rows and columns were never written). */
ALWAYS_INLINE void amx_load_config(const TileConfig* config) {
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(config);
}

/* Linux hands out AMX state only to processes that ask for it (once per process). */
static int pf_amx_permitted(void) {
    static int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    int granted = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (granted == 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, granted, __ATOMIC_RELEASE);
    }
    return granted == 1;
}

/* Tiles 0-7 all 16 rows of 64 bytes: scores/P^T (0), scores (1), K or V^T (2), Q^T (3),
 * O^T (4-7). */
static void pf_amx_configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.rows[i] = 16;
        config.colsb[i] = 64;
    }
    amx_load_config(&config);
}

ALWAYS_INLINE int pf_amx_applies(const PrefillArgs* a) {
    return a->qdt == DT_BF16 && a->kvdt == DT_BF16 &&
           (a->head_dim == 32 || a->head_dim == PF_AMX_MAX_HEAD_DIM) && pf_amx_permitted();
}

/* 2^x for finite x (the masked -1e29 gives 0, x > 128 inf): degree-3 polynomial of the
 * fraction (relative error < 6e-4, below bf16's rounding of the weights, 2e-3). x's nearest
 * integer comes from adding and subtracting 1.5 * 2^23 (exact for |x| < 2^22; beyond, x is
 * already an integer and stays), not vrndscaleps, two uops on the port the softmax's other
 * shuffles and scalings need (Sapphire Rapids, the kernel alone: 3,000 tokens -5%, 512 -4%). */
ALWAYS_INLINE __m512 pf_exp2(__m512 x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(5.5504109e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Scores of position u + t for the tile's rows (lanes), PF_MASKED where a row precedes it. */
ALWAYS_INLINE __m512 pf_masked_scores(const float* scores, __m512i pos, int64_t u, int64_t t,
                                      int is_diagonal) {
    const __m512 s = _mm512_loadu_ps(scores + 16 * t);
    if (!is_diagonal) return s;
    const __mmask16 later =
        _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int)(u + t)), _MM_CMPINT_LT);
    return _mm512_mask_mov_ps(s, later, _mm512_set1_ps(PF_MASKED));
}

/* m[c] <- column c of the 16 x 16 matrix of 32-bit elements whose rows are m[0..15]: 32-, then
 * 64-bit interleaves of row pairs, then two rounds of 128-bit lane shuffles (64 shuffles,
 * where element by element it took 256 loads and stores). */
ALWAYS_INLINE void pf_transpose16(__m512i m[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* m[i + c]: column 4L + c of rows i..i + 3, lane L */
        m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int c = 0; c < 4; c++) {
            t[i + c] = _mm512_shuffle_i32x4(m[i + c], m[i + 4 + c], 0x88);
            t[i + 4 + c] = _mm512_shuffle_i32x4(m[i + c], m[i + 4 + c], 0xdd);
        }
    for (int c = 0; c < 4; c++) {
        m[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        m[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
        m[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
        m[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
    }
}

/* vt[d * lpad + t] <- rows[t][d], t < PF_AMX_UNIT, d < D: each two positions' values of a dim
 * paired as one 32-bit element, then 16 x 16 transposes of those (scalar copies of the
 * 2,048 values took ~a tenth of a 512-token prompt's attention). */
ALWAYS_INLINE void pf_transpose_values(int64_t D, uint16_t rows[PF_AMX_UNIT][PF_AMX_MAX_HEAD_DIM],
                                       uint16_t* vt, int64_t lpad) {
    /* dims 16h.. of rows a and b as (a, b) pairs: element 2k is a[16h + k], 2k + 1 b[16h + k]. */
    static const uint16_t index[2][32] = {
        {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
        {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
    for (int64_t b = 0; b < D / 16; b++) {
        const __m512i pairs = _mm512_loadu_si512(index[b % 2]);
        __m512i m[16];
        for (int p = 0; p < 16; p++)
            m[p] = _mm512_permutex2var_epi16(_mm512_loadu_si512(rows[2 * p] + 32 * (b / 2)), pairs,
                                             _mm512_loadu_si512(rows[2 * p + 1] + 32 * (b / 2)));
        pf_transpose16(m);
        for (int d = 0; d < 16; d++) _mm512_storeu_si512(vt + (16 * b + d) * lpad, m[d]);
    }
}

/* KV head kv_head's context, packed once per call for tile loads: K [lpad][D] and V
 * transposed [D][lpad], bfloat16, zero past seq_len. */
static void pf_amx_pack(const PrefillArgs* a, int64_t kv_head, int64_t seq_len, int64_t lpad,
                        uint16_t* k_packed, uint16_t* v_transposed) {
    const int64_t D = a->head_dim, bs = a->block_size, token_stride = a->num_kv_heads * D;
    for (int64_t c = 0; c < lpad; c += PF_AMX_UNIT) {
        uint16_t v_rows[PF_AMX_UNIT][PF_AMX_MAX_HEAD_DIM];
        for (int64_t t = 0; t < PF_AMX_UNIT; t++) {
            const int64_t pos = c + t;
            if (pos < seq_len) {
                const int64_t offset =
                    (a->block_table[pos / bs] * bs + pos % bs) * token_stride + kv_head * D;
                memcpy(k_packed + pos * D, (const uint16_t*)a->k_cache + offset, D * 2);
                memcpy(v_rows[t], (const uint16_t*)a->v_cache + offset, D * 2);
            } else {
                memset(k_packed + pos * D, 0, D * 2);
                memset(v_rows[t], 0, D * 2);
            }
        }
        pf_transpose_values(D, v_rows, v_transposed + c, lpad);
    }
}

/* scores [32 positions][16 rows] of positions u.. against the tile's queries (qt: Q^T as
 * bf16 pairs of dims), through tiles 0 and 1. */
ALWAYS_INLINE void pf_amx_scores(int64_t D, const uint32_t* qt, const uint16_t* k_packed,
                                 int64_t u, float* scores) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t h = 0; h < D / 32; h++) {
        _tile_loadd(3, qt + h * 16 * 16, 64);
        _tile_loadd(2, k_packed + u * D + 32 * h, D * 2);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(2, k_packed + (u + 16) * D + 32 * h, D * 2);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, scores, 64);
    _tile_stored(1, scores + 16 * 16, 64);
}

/* (j, tile) of O^T's tiles; tile numbers must be literals in the instructions. */
#define PF_AMX_O_TILES(X) X(0, 4) X(1, 5) X(2, 6) X(3, 7)

/*
 * One tile of 16 query rows (lanes) over the packed context, per unit of 32 positions:
 *   S^T [32 pos][16 rows] = K [32 pos][D] . Q^T           (tiles 0, 1; Q^T as bf16 pairs)
 *   P^T = 2^(S^T * scale * log2 e - max), rows in lanes   (AVX-512; bf16 pairs of positions)
 *   O^T [D][16 rows] += V^T [D][32 pos] . P^T             (tiles 4.., stay in tiles)
 */
static void pf_amx_tile(const PrefillArgs* a, int64_t kv_head, int64_t row0, int64_t num_rows,
                        const uint16_t* k_packed, const uint16_t* v_transposed, int64_t lpad,
                        float* scratch) {
    const int64_t D = a->head_dim, group = a->num_heads / a->num_kv_heads;
    uint32_t* qt = (uint32_t*)scratch;                /* [D / 2][16] pairs of dims */
    float* score_units = (float*)(qt + D / 2 * 16);    /* 2 x [32][16]: this unit's, the next's */
    uint32_t* pt = (uint32_t*)(score_units + 2 * PF_AMX_UNIT * 16); /* [16][16] position pairs */
    float* o = (float*)(pt + 16 * 16);                 /* [D][16] */
    int32_t qpos[16];
    /* The lanes' queries, 16 pairs of dims at a time. */
    __m512i q_rows[PF_AMX_MAX_HEAD_DIM / 32][16];
    for (int64_t lane = 0; lane < 16; lane++) {
        const int64_t r = row0 + (lane < num_rows ? lane : num_rows - 1);
        const int64_t token = r / group, head = kv_head * group + r % group;
        const uint16_t* q = (const uint16_t*)a->q + token * a->q_stride + head * D;
        for (int64_t b = 0; b < D / 32; b++) q_rows[b][lane] = _mm512_loadu_si512(q + 32 * b);
        qpos[lane] = (int32_t)(a->num_computed + token);
    }
    for (int64_t b = 0; b < D / 32; b++) {
        pf_transpose16(q_rows[b]);
        for (int64_t i = 0; i < 16; i++) _mm512_storeu_si512(qt + (16 * b + i) * 16, q_rows[b][i]);
    }
    const __m512i pos = _mm512_loadu_si512(qpos);
    const __m512 log2_scale = _mm512_set1_ps(a->scale * 1.44269504f);
    /* Interleaves [p_even x16 | p_odd x16] into (even, odd) pairs per row. */
    const __m512i pairs = BF16_PAIRS;
    __m512 peak = _mm512_setzero_ps(), total = _mm512_setzero_ps();
#define PF_ZERO_O(j, tile) if (D > 16 * (j)) _tile_zero(tile);
    PF_AMX_O_TILES(PF_ZERO_O)
    pf_amx_scores(D, qt, k_packed, 0, score_units);
    for (int64_t u = 0; u <= qpos[15]; u += PF_AMX_UNIT) {
        const float* scores = score_units + (u / PF_AMX_UNIT % 2) * PF_AMX_UNIT * 16;
        /* The next unit's scores go to the tiles before this unit's softmax (they wait on
         * no result of this unit's). One thread, 9/3 heads of 64: the kernel alone on 3,000
         * tokens 16.1-17.2 -> 14.4-14.7 ms, on 512 0.76-0.79 -> 0.71-0.72 ms. The tiles and
         * the softmax still barely overlap: with either switched off the kernel takes 7.6
         * (no tiles) and 8.8 ms (no softmax), and issuing the previous unit's values here
         * too changed nothing (Sapphire Rapids). */
        if (u + PF_AMX_UNIT <= qpos[15])
            pf_amx_scores(D, qt, k_packed, u + PF_AMX_UNIT,
                          score_units + ((u / PF_AMX_UNIT + 1) % 2) * PF_AMX_UNIT * 16);
        const int is_diagonal = u + PF_AMX_UNIT - 1 > qpos[0];
        if (u == 0) { /* the first peak: position 0 is visible to every row */
            __m512 unit_peak = _mm512_set1_ps(PF_MASKED);
            for (int64_t t = 0; t < PF_AMX_UNIT; t++)
                unit_peak = _mm512_max_ps(unit_peak, pf_masked_scores(scores, pos, u, t, is_diagonal));
            peak = _mm512_mul_ps(unit_peak, log2_scale);
        }
        for (;;) { /* the weights against the current peak, unless some row outgrows it */
            __m512 excess = _mm512_set1_ps(PF_MASKED), sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < PF_AMX_UNIT; t += 2) {
                const __m512 even = _mm512_fmsub_ps(
                    pf_masked_scores(scores, pos, u, t, is_diagonal), log2_scale, peak);
                const __m512 odd = _mm512_fmsub_ps(
                    pf_masked_scores(scores, pos, u, t + 1, is_diagonal), log2_scale, peak);
                excess = _mm512_max_ps(excess, _mm512_max_ps(even, odd));
                const __m512 p_even = pf_exp2(even), p_odd = pf_exp2(odd);
                sum = _mm512_add_ps(sum, _mm512_add_ps(p_even, p_odd));
                const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(p_odd, p_even);
                _mm512_storeu_si512(pt + 8 * t, _mm512_permutexvar_epi16(pairs, bf));
            }
            if (!_mm512_cmp_ps_mask(excess, _mm512_set1_ps(PF_RESCALE_LOG2), _CMP_GT_OQ)) {
                total = _mm512_add_ps(total, sum);
                break;
            }
            /* Rare: move the peak up, rescale what was accumulated, weigh the unit again. */
            const __m512 rise = _mm512_max_ps(excess, _mm512_setzero_ps());
            const __m512 alpha = pf_exp2(_mm512_sub_ps(_mm512_setzero_ps(), rise));
            total = _mm512_mul_ps(total, alpha);
#define PF_STORE_O(j, tile) if (D > 16 * (j)) _tile_stored(tile, o + 16 * 16 * (j), 64);
#define PF_LOAD_O(j, tile) if (D > 16 * (j)) _tile_loadd(tile, o + 16 * 16 * (j), 64);
            PF_AMX_O_TILES(PF_STORE_O)
            for (int64_t d = 0; d < D; d++)
                _mm512_storeu_ps(o + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * d), alpha));
            PF_AMX_O_TILES(PF_LOAD_O)
            peak = _mm512_add_ps(peak, rise);
        }
        _tile_loadd(0, pt, 64);
#define PF_VALUES(j, tile)                                                                    \
    if (D > 16 * (j)) {                                                                       \
        _tile_loadd(2, v_transposed + 16 * (j) * lpad + u, lpad * 2);                         \
        _tile_dpbf16ps(tile, 2, 0);                                                           \
    }
        PF_AMX_O_TILES(PF_VALUES)
    }
    PF_AMX_O_TILES(PF_STORE_O)
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), total);
    for (int64_t j = 0; j < D; j += 16) { /* O^T's dims j.. -> each row's */
        __m512i m[16];
        for (int64_t d = 0; d < 16; d++)
            m[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(o + 16 * (j + d)), inverse));
        pf_transpose16(m);
        for (int64_t lane = 0; lane < num_rows; lane++) {
            const int64_t r = row0 + lane, token = r / group, head = kv_head * group + r % group;
            store_dt(a->out, token * a->num_heads * D + head * D + j, _mm512_castsi512_ps(m[lane]),
                     DT_BF16);
        }
    }
#undef PF_ZERO_O
#undef PF_STORE_O
#undef PF_LOAD_O
#undef PF_VALUES
}
#endif

static void pf_run_block(const PrefillArgs* a, int64_t index, float* scratch) {
    /* KV-head major: consecutive blocks read the same head's context, which stays in L2. */
    const int64_t per_head = (pf_rows(a) + PF_TILE * PF_TILES - 1) / (PF_TILE * PF_TILES);
    const int64_t kv_head = index / per_head, row0 = index % per_head * PF_TILE * PF_TILES;
#if defined(__AMX_BF16__)
    if (a->use_amx) {
        const int64_t rows = pf_rows(a), head_size = a->packed_len * a->head_dim;
        const uint16_t* k_packed = a->packed + kv_head * 2 * head_size;
        for (int64_t r = row0; r < row0 + PF_TILE * PF_TILES && r < rows; r += PF_TILE)
            pf_amx_tile(a, kv_head, r, rows - r < PF_TILE ? rows - r : PF_TILE, k_packed,
                        k_packed + head_size, a->packed_len, scratch);
        return;
    }
#endif
    if (a->qdt == DT_F32 && a->kvdt == DT_F32)
        pf_block_types(DT_F32, DT_F32, 0, a, kv_head, row0, scratch);
    else if (a->qdt == DT_F32)
        pf_block_types(DT_F32, DT_BF16, 0, a, kv_head, row0, scratch);
    else if (a->kvdt == DT_BF16)
        pf_block_types(DT_BF16, DT_BF16, HAS_DPBF16, a, kv_head, row0, scratch);
    else
        pf_block_types(DT_BF16, DT_F32, 0, a, kv_head, row0, scratch);
}

typedef struct {
    const PrefillArgs* args;
    int64_t num_blocks;
    int64_t next; /* the next block to take (atomic) */
    uint8_t* scratch;
    int64_t scratch_stride;
} PrefillWork;

static void pf_member(void* arg, const Team* team) {
    PrefillWork* work = (PrefillWork*)arg;
    float* scratch = (float*)(work->scratch + team->index * work->scratch_stride);
#if defined(__AMX_BF16__)
    if (work->args->use_amx) pf_amx_configure(); /* tile state is per thread */
#endif
    /* Blocks in decreasing order of cost (later query rows see more context) balance the
     * members' shares. */
    for (;;) {
        const int64_t taken = __atomic_fetch_add(&work->next, 1, __ATOMIC_RELAXED);
        if (taken >= work->num_blocks) break;
        pf_run_block(work->args, work->num_blocks - 1 - taken, scratch);
    }
#if defined(__AMX_BF16__)
    if (work->args->use_amx) _tile_release();
#endif
}

/* A member must score this many (query head, position) pairs to repay joining the team (~50
 * us where its worker sleeps, on a 2-vCPU VM, Sapphire Rapids, where a pair costs ~0.5 ns): a
 * burst of short prompts runs each one's attention on the calling thread alone (2^13 was no
 * faster for bursts of 7 prompts of ~66 tokens, with workers that spin between calls). */
#define PREFILL_MIN_SCORES_PER_MEMBER (1 << 18)

/* Members for a chunk of num_new tokens after num_computed cached ones, on up to num_threads:
 * never more than its blocks, nor than its scores (causal: num_new / 2 new positions each on
 * average) afford. */
int64_t prefill_threads(int64_t num_new, int64_t num_computed, int64_t num_heads,
                        int64_t num_kv_heads, int64_t num_threads) {
    const int64_t scores = num_new * num_heads * (num_computed + (num_new + 1) / 2);
    const int64_t blocks = prefill_num_blocks(num_new, num_heads, num_kv_heads);
    int64_t most = scores / PREFILL_MIN_SCORES_PER_MEMBER;
    most = most < blocks ? most : blocks;
    num_threads = num_threads < most ? num_threads : most;
    return num_threads < 1 ? 1 : num_threads > MAX_TEAM ? MAX_TEAM : num_threads;
}

/*
 * q [num_new, q_stride] (query head h of token t at t * q_stride + h * head_dim), K/V of all
 * num_computed + num_new positions already in the cache; out [num_new, num_heads * head_dim]
 * (qdt), on prefill_threads(...) members. head_dim % 16 == 0; scratch holds
 * prefill_scratch_bytes(head_dim, num_threads, num_kv_heads, num_computed + num_new).
 */
void paged_prefill(int qdt, int kvdt, const void* q, int64_t q_stride, const void* k_cache,
                   const void* v_cache, const int64_t* block_table, int64_t num_new,
                   int64_t num_computed, void* out, uint8_t* scratch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                   int64_t num_threads) {
    num_threads = prefill_threads(num_new, num_computed, num_heads, num_kv_heads, num_threads);
    const int64_t seq_len = num_computed + num_new;
    PrefillArgs args = {qdt,       kvdt,         q,        q_stride,   k_cache,
                        v_cache,   block_table,  num_new,  num_computed, out,
                        num_heads, num_kv_heads, head_dim, block_size, scale,
                        0,         (uint16_t*)(scratch + num_threads * pf_thread_bytes(head_dim)),
                        pf_packed_len(seq_len)};
#if defined(__AMX_BF16__)
    args.use_amx = pf_amx_applies(&args);
    for (int64_t h = 0; args.use_amx && h < num_kv_heads; h++) {
        uint16_t* k_packed = args.packed + h * 2 * args.packed_len * head_dim;
        pf_amx_pack(&args, h, seq_len, args.packed_len, k_packed,
                    k_packed + args.packed_len * head_dim);
    }
#endif
    const int64_t num_blocks = prefill_num_blocks(num_new, num_heads, num_kv_heads);
    PrefillWork work = {&args, num_blocks, 0, scratch, pf_thread_bytes(head_dim)};
    run_team(num_threads, pf_member, &work);
}
