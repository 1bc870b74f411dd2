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
 * Arithmetic is float32 (bfloat16 K/V are widened once per unit and block).
 *
 * Blocks are independent; a call runs blocks [0, prefill_num_blocks(...)) on num_threads
 * threads (the caller's and num_threads - 1 pthreads) that take blocks from a shared counter.
 */
#include <pthread.h>

#define PF_TILE 16 /* query rows per tile: one per lane */
#define PF_TILES 4 /* tiles per block: a unit's widened K/V serves them all */
#define PF_MAX_THREADS 64
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

/* Bytes of scratch a call on num_threads threads needs. */
int64_t prefill_scratch_bytes(int64_t head_dim, int64_t num_threads) {
    return num_threads * round_up_64(pf_scratch_floats(head_dim) * (int64_t)sizeof(float));
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

/* o[r][:] = o[r][:] * alpha[r] + sum_{t < n} p[t][r] * V[t][:] for the tile's 16 rows. */
ALWAYS_INLINE void pf_values(const int64_t NV, float* o, const float* alpha, const float* p,
                             const float* v, int64_t v_stride, int64_t n) {
    const int64_t D = 16 * NV;
    for (int64_t r0 = 0; r0 < PF_TILE; r0 += PF_PV_ROWS)
        for (int64_t j0 = 0; j0 < NV; j0 += PF_PV_VECS) {
            const int64_t jn = NV - j0 < PF_PV_VECS ? NV - j0 : PF_PV_VECS;
            V16 acc[PF_PV_ROWS][PF_PV_VECS];
            for (int64_t r = 0; r < PF_PV_ROWS; r++) {
                const V16 scale = v_set1(alpha[r0 + r]);
                for (int64_t j = 0; j < jn; j++)
                    acc[r][j] = v_mul(v_load(o + (r0 + r) * D + 16 * (j0 + j)), scale);
            }
            for (int64_t t = 0; t < n; t++) {
                V16 vv[PF_PV_VECS];
                for (int64_t j = 0; j < jn; j++) vv[j] = v_load(v + t * v_stride + 16 * (j0 + j));
                for (int64_t r = 0; r < PF_PV_ROWS; r++) {
                    const V16 pr = v_set1(p[16 * t + r0 + r]);
                    for (int64_t j = 0; j < jn; j++) acc[r][j] = v_fma(pr, vv[j], acc[r][j]);
                }
            }
            for (int64_t r = 0; r < PF_PV_ROWS; r++)
                for (int64_t j = 0; j < jn; j++) v_store(o + (r0 + r) * D + 16 * (j0 + j), acc[r][j]);
        }
}

/* One block: rows [row0, row0 + PF_TILES * PF_TILE) of KV head kv_head. */
ALWAYS_INLINE void pf_block(int qdt, int kvdt, const int64_t NV, const PrefillArgs* a,
                            int64_t kv_head, int64_t row0, float* scratch) {
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
        float* q_lanes = qt + (lane / PF_TILE) * PF_TILE * D + lane % PF_TILE;
        for (int64_t j = 0; j < NV; j++) {
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
        if (kvdt == DT_F32) {
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
            pf_values(NV, o + tile * PF_TILE * D, alpha, p, v, kv_stride, n);
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

ALWAYS_INLINE void pf_block_types(int qdt, int kvdt, const PrefillArgs* a, int64_t kv_head,
                                  int64_t row0, float* scratch) {
    if (a->head_dim == 64)
        pf_block(qdt, kvdt, 4, a, kv_head, row0, scratch);
    else if (a->head_dim == 128)
        pf_block(qdt, kvdt, 8, a, kv_head, row0, scratch);
    else
        pf_block(qdt, kvdt, a->head_dim / 16, a, kv_head, row0, scratch);
}

static void pf_run_block(const PrefillArgs* a, int64_t index, float* scratch) {
    /* Query-range major: threads taking consecutive blocks read the same context. */
    const int64_t kv_head = index % a->num_kv_heads;
    const int64_t row0 = index / a->num_kv_heads * PF_TILE * PF_TILES;
    if (a->qdt == DT_F32 && a->kvdt == DT_F32)
        pf_block_types(DT_F32, DT_F32, a, kv_head, row0, scratch);
    else if (a->qdt == DT_F32)
        pf_block_types(DT_F32, DT_BF16, a, kv_head, row0, scratch);
    else if (a->kvdt == DT_BF16)
        pf_block_types(DT_BF16, DT_BF16, a, kv_head, row0, scratch);
    else
        pf_block_types(DT_BF16, DT_F32, a, kv_head, row0, scratch);
}

typedef struct {
    const PrefillArgs* args;
    int64_t num_blocks;
    int64_t next; /* the next block to take (atomic) */
    uint8_t* scratch;
    int64_t scratch_stride;
} PrefillWork;

typedef struct {
    PrefillWork* work;
    int64_t thread;
} PrefillWorker;

static void* pf_worker(void* arg) {
    const PrefillWorker* self = (const PrefillWorker*)arg;
    PrefillWork* work = self->work;
    float* scratch = (float*)(work->scratch + self->thread * work->scratch_stride);
    /* Blocks in decreasing order of cost (later query rows see more context) balance the
     * threads' shares. */
    for (;;) {
        const int64_t taken = __atomic_fetch_add(&work->next, 1, __ATOMIC_RELAXED);
        if (taken >= work->num_blocks) break;
        pf_run_block(work->args, work->num_blocks - 1 - taken, scratch);
    }
    return NULL;
}

/*
 * q [num_new, q_stride] (query head h of token t at t * q_stride + h * head_dim), K/V of all
 * num_computed + num_new positions already in the cache; out [num_new, num_heads * head_dim]
 * (qdt). head_dim % 16 == 0; scratch holds prefill_scratch_bytes(head_dim, num_threads).
 */
void paged_prefill(int qdt, int kvdt, const void* q, int64_t q_stride, const void* k_cache,
                   const void* v_cache, const int64_t* block_table, int64_t num_new,
                   int64_t num_computed, void* out, uint8_t* scratch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                   int64_t num_threads) {
    const PrefillArgs args = {qdt,     kvdt,         q,         q_stride,  k_cache,
                              v_cache, block_table,  num_new,   num_computed, out,
                              num_heads, num_kv_heads, head_dim, block_size, scale};
    const int64_t num_blocks = prefill_num_blocks(num_new, num_heads, num_kv_heads);
    num_threads = num_threads < 1 ? 1 : num_threads > PF_MAX_THREADS ? PF_MAX_THREADS : num_threads;
    num_threads = num_threads > num_blocks ? num_blocks : num_threads;
    PrefillWork work = {&args, num_blocks, 0, scratch,
                        round_up_64(pf_scratch_floats(head_dim) * (int64_t)sizeof(float))};
    PrefillWorker workers[PF_MAX_THREADS];
    pthread_t threads[PF_MAX_THREADS];
    int64_t started = 0; /* threads 1..started run (a failed create leaves fewer) */
    for (int64_t i = 1; i < num_threads; i++, started++) {
        workers[i] = (PrefillWorker){&work, i};
        if (pthread_create(&threads[i], NULL, pf_worker, &workers[i]) != 0) break;
    }
    workers[0] = (PrefillWorker){&work, 0};
    pf_worker(&workers[0]);
    for (int64_t i = 1; i <= started; i++) pthread_join(threads[i], NULL);
}
