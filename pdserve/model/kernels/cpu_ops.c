/*
 * Fused CPU kernels for the decoder's memory-bound steps, where a chain of torch ops would
 * cost more in dispatch than in arithmetic. Written once against the 16-lane layer of
 * simd.h and compiled per ISA (AVX-512, AVX2, portable C). Arithmetic is float32; tensors
 * are float32 or bfloat16 (DT_F32 / DT_BF16 arguments), rounded once on store.
 *
 * Every exported function takes its element types as int arguments and dispatches to an
 * always-inlined body specialised for them, so the inner loops carry no type branches.
 *
 * Layouts (all contiguous unless a stride is passed):
 *   paged_decode: q, out [num_seqs, num_heads, head_dim];
 *     k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim] (one layer);
 *     block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64 (>= 1);
 *     scratch float [num_heads * (2 * head_dim + UNIT + 17)].
 *     Query head h reads KV head h / (num_heads / num_kv_heads); head_dim % 16 == 0, <= 256.
 *   linear: weights pre-packed in groups of 16 output rows (see the W_* formats below).
 */
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np */
#include "simd.h"

#if defined(PDSERVE_ISA_AVX512) && defined(__AVX512BF16__)
#define HAS_DPBF16 1
#else
#define HAS_DPBF16 0
#endif

#if HAS_DPBF16
/* Interleaves [a x16 | b x16] (bf16) into 16 (a, b) pairs: vdpbf16ps's operand layout. */
#define BF16_PAIRS                                                                            \
    _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, \
                     6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
#endif

#define MAX_HEAD_DIM 256
#define UNIT 16 /* positions scored together: one vector of scores per head */
#define CHUNK_BYTES (256 * 1024) /* weights one pass of row tiles keeps in L2 */
/* bfloat16 weights AMX passes of rows keep in L2 (2 MiB a core on Sapphire Rapids): every
 * chunk reads all of x again, from L3 once a prompt's rows outgrow L2, so a chunk larger than
 * CHUNK_BYTES pays (Q4_1 linears of one layer at 3,012 rows, one thread: 256 KiB 27.3 ms,
 * 512 KiB 24.4, 1 MiB 23.7, 1.5 MiB 24.4). */
#define AMX_CHUNK_BYTES (1024 * 1024)

#if defined(PDSERVE_ISA_AVX512)
#define MAX_ROW_TILE 8 /* rows of x per pass over a weight group: 32 vector registers */
#else
#define MAX_ROW_TILE 4 /* 16 vector registers (AVX2: two per V16) */
#endif

/* ---- teams: one call's work split over threads ---------------------------------------- */
/*
 * A call on num_threads threads runs its work function on the caller's thread (member 0) and
 * on num_threads - 1 workers of a pool that lives as long as the process; members meet at
 * team_sync between phases. Every output element is computed by one member with the same
 * arithmetic as on one thread, so results do not depend on the thread count.
 */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_TEAM 64
/* Spins at a barrier before yielding the core (to a server's event loop, say). */
#define SPINS_BEFORE_YIELD 4000

typedef struct {
    int64_t arrived, generation;
} Barrier;

typedef struct {
    int64_t index, size;
    Barrier* barrier;
} Team;

typedef void (*TeamWork)(void* arg, const Team* team);

ALWAYS_INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Every member waits until all have arrived; writes before it are seen by all after it. */
static void team_sync(const Team* team) {
    if (team->size == 1) return;
    Barrier* b = team->barrier;
    const int64_t generation = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == team->size) {
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->generation, generation + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int64_t spins = 0; __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) == generation;
         spins++) {
        if (spins < SPINS_BEFORE_YIELD)
            cpu_relax();
        else
            sched_yield();
    }
}

/* This member's share [*begin, *end) of n equal items. */
ALWAYS_INLINE void team_share(const Team* team, int64_t n, int64_t* begin, int64_t* end) {
    *begin = n * team->index / team->size;
    *end = n * (team->index + 1) / team->size;
}

/*
 * The pool's workers: member i of every team is worker i. Starting a thread per call cost
 * ~75 us a call on a 2-vCPU VM (~150 us for an AMX kernel, whose new thread also faults in its
 * tile state), against kernels of tens of us in a short prompt's step (Sapphire Rapids). After
 * a job a worker spins for POOL_SPIN_NS, yielding its core to any other runnable thread (the
 * OpenMP threads of torch's next op, say), then sleeps on a futex until the next job.
 * One caller at a time (pool.lock): a call that finds the pool taken (another thread's, or a
 * team member's own call) runs on its caller alone.
 */
#define POOL_SPIN_NS 200000

typedef struct {
    pthread_mutex_t lock; /* held by the call whose team runs on the pool */
    int64_t num_workers;  /* started: members 1..num_workers */
    pthread_t threads[MAX_TEAM];
    int cpus[MAX_TEAM]; /* the CPU each worker is pinned to, -1 unpinned */
    /* The job, published by bumping generation (the futex word). */
    TeamWork work;
    void* arg;
    int64_t size;
    Barrier barrier;
    uint32_t generation;
    int64_t acknowledged; /* workers that finished (or, past size, skipped) this job */
    int64_t sleeping;     /* workers in futex_wait */
} Pool;

static Pool pool = {PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Waits until pool.generation differs from seen; returns it. */
static uint32_t pool_wait(uint32_t seen) {
    const int64_t deadline = now_ns() + POOL_SPIN_NS;
    uint32_t generation;
    while ((generation = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen) {
        if (now_ns() < deadline) {
            for (int i = 0; i < 16; i++) cpu_relax();
            sched_yield();
            continue;
        }
        /* The caller bumps generation, then reads sleeping: one of the two sees the other. */
        __atomic_add_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        __atomic_sub_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
    }
    return generation;
}

/* p: the worker's index in the high 32 bits, the generation it was started at in the low
 * ones (its first job is the next). */
static void* pool_worker(void* p) {
    const int64_t index = (int64_t)((uintptr_t)p >> 32);
    uint32_t seen = (uint32_t)(uintptr_t)p;
    for (;;) {
        seen = pool_wait(seen);
        if (index < pool.size) {
            const Team team = {index, pool.size, &pool.barrier};
            pool.work(pool.arg, &team);
        }
        __atomic_add_fetch(&pool.acknowledged, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* The i-th CPU (i >= 1) of the caller's mask other than `here`, -1 where there is none.
 * Left to the scheduler, a member could share the caller's core for seconds while the other
 * idled: a gguf server started after a bf16 one decoded at 20-24 ms a token for its first
 * 10 s, against 4.2-5.5 ms pinned (Zen 4, 2 vCPUs; perf: 45% idle, 36% in team_sync). */
static int member_cpu(int64_t i, int here) {
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
    int64_t k = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &allowed) && cpu != here && ++k == i) return cpu;
    return -1;
}

static void pin_worker(int64_t i, int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    if (cpu >= 0) CPU_SET(cpu, &one);
    else
        sched_getaffinity(0, sizeof one, &one);
    pthread_setaffinity_np(pool.threads[i], sizeof one, &one);
    pool.cpus[i] = cpu;
}

/* A forked child has none of the parent's workers. */
static void pool_forget(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.num_workers = 0;
    pool.sleeping = 0;
}

static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_forget); }

/* Workers 1..num_threads - 1 started (as many as could be) and none on the caller's CPU;
 * returns the team's size. Holds pool.lock. */
static int64_t pool_ready(int64_t num_threads) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pool_register_fork);
    const int here = sched_getcpu();
    for (int64_t i = 1; i <= pool.num_workers && i < num_threads; i++)
        if (pool.cpus[i] == here && here >= 0) pin_worker(i, member_cpu(i, here));
    while (pool.num_workers + 1 < num_threads) {
        const int64_t i = pool.num_workers + 1;
        if (pthread_create(&pool.threads[i], NULL, pool_worker,
                           (void*)(((uintptr_t)i << 32) | pool.generation)))
            break;
        pthread_detach(pool.threads[i]);
        pin_worker(i, member_cpu(i, here));
        pool.num_workers = i;
    }
    return pool.num_workers + 1 < num_threads ? pool.num_workers + 1 : num_threads;
}

/* work(arg, team) on up to num_threads members (fewer if workers cannot be started). */
static void run_team(int64_t num_threads, TeamWork work, void* arg) {
    num_threads = num_threads < 1 ? 1 : num_threads > MAX_TEAM ? MAX_TEAM : num_threads;
    if (num_threads == 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        const Team alone = {0, 1, NULL};
        work(arg, &alone);
        return;
    }
    const int64_t size = pool_ready(num_threads);
    pool.work = work;
    pool.arg = arg;
    pool.size = size;
    pool.barrier = (Barrier){0, 0};
    pool.acknowledged = 0;
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleeping, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    const Team team = {0, size, &pool.barrier};
    work(arg, &team);
    /* Every worker, in the team or not, is done reading this job before the next is set. */
    for (int64_t spins = 0;
         __atomic_load_n(&pool.acknowledged, __ATOMIC_ACQUIRE) < pool.num_workers; spins++) {
        if (spins < SPINS_BEFORE_YIELD)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}

/* Which build this is, for the Python side to check and report. */
const char* pdserve_isa(void) {
#if defined(PDSERVE_ISA_AVX512) && defined(__AMX_BF16__)
    return "amx";
#elif defined(PDSERVE_ISA_AVX512) && defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(PDSERVE_ISA_AVX512)
    return "avx512";
#elif defined(PDSERVE_ISA_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* Bytes of one element of type dt. */
ALWAYS_INLINE int64_t dt_size(int64_t dt) { return dt == DT_BF16 ? 2 : 4; }

/* ---- add + RMSNorm, rotary, SiLU x mul ------------------------------------------------ */

/* residual <- residual + x (rounded to dt) unless add_residual is 0, then
 * out <- residual / rms(residual) * weight, row by row. x: [rows, hidden]. */
ALWAYS_INLINE void add_rms_norm_impl(int dt, const void* x, void* residual, const void* weight,
                                     void* out, int64_t rows, int64_t hidden, float eps,
                                     int64_t add_residual) {
    const void* source = add_residual ? residual : x;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r * hidden;
        V16 squares = v_zero();
        for (int64_t j = 0; j < hidden; j += 16) {
            const int64_t n = hidden - j;
            V16 h = load_dt_n(x, row + j, n, dt);
            if (add_residual) {
                h = round_dt(v_add(h, load_dt_n(residual, row + j, n, dt)), dt);
                store_dt_n(residual, row + j, n, h, dt);
            }
            squares = v_fma(h, h, squares);
        }
        const V16 inverse_rms = v_set1(1.0f / sqrtf(v_sum(squares) / (float)hidden + eps));
        for (int64_t j = 0; j < hidden; j += 16) {
            const int64_t n = hidden - j;
            const V16 h = v_mul(load_dt_n(source, row + j, n, dt), inverse_rms);
            store_dt_n(out, row + j, n, v_mul(h, load_dt_n(weight, j, n, dt)), dt);
        }
    }
}

/* Members a call over `rows` rows runs on, on up to num_threads threads: one per min_rows. */
int64_t row_threads(int64_t rows, int64_t min_rows, int64_t num_threads) {
    const int64_t most = rows / min_rows;
    return num_threads < most ? num_threads : most < 1 ? 1 : most;
}

/* A team shares add_rms_norm's and rotary's rows from ROW_OP_MIN_ROWS rows a member: a row
 * costs ~0.2 us (576 wide; L2-bound) and a member joining ~2 us where its worker spins. On 2
 * threads, Sapphire Rapids: a 512-token prompt 118 -> 107 ms, a step of 26 prompts of ~66
 * tokens 370-380 -> 335-350 ms. */
#define ROW_OP_MIN_ROWS 64

typedef struct {
    int dt;
    const uint8_t* x;
    uint8_t* residual;
    const void* weight;
    uint8_t* out;
    int64_t rows, hidden;
    float eps;
    int64_t add_residual;
} NormCall;

static void add_rms_norm_member(void* arg, const Team* team) {
    const NormCall* c = (const NormCall*)arg;
    int64_t r0, r1;
    team_share(team, c->rows, &r0, &r1);
    const int64_t offset = r0 * c->hidden * dt_size(c->dt);
    if (c->dt == DT_BF16)
        add_rms_norm_impl(DT_BF16, c->x + offset, c->residual + offset, c->weight,
                          c->out + offset, r1 - r0, c->hidden, c->eps, c->add_residual);
    else
        add_rms_norm_impl(DT_F32, c->x + offset, c->residual + offset, c->weight,
                          c->out + offset, r1 - r0, c->hidden, c->eps, c->add_residual);
}

void add_rms_norm(int dt, const void* x, void* residual, const void* weight, void* out,
                  int64_t rows, int64_t hidden, float eps, int64_t add_residual,
                  int64_t num_threads) {
    NormCall call = {dt, x, residual, weight, out, rows, hidden, eps, add_residual};
    run_team(row_threads(rows, ROW_OP_MIN_ROWS, num_threads), add_rms_norm_member, &call);
}

/* Rotate heads [0, num_heads) of each row in place ("rotate half" pairs i and i + head_dim/2).
 * Rows are row_stride elements apart; cos/sin: float [rows, head_dim / 2]. */
ALWAYS_INLINE void rotary_impl(int dt, void* x, int64_t rows, int64_t row_stride,
                               int64_t num_heads, int64_t head_dim, const float* cos,
                               const float* sin) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t head = r * row_stride + h * head_dim;
            for (int64_t j = 0; j < half; j += 16) {
                const int64_t n = half - j;
                const V16 c = load_dt_n(cos, r * half + j, n, DT_F32);
                const V16 s = load_dt_n(sin, r * half + j, n, DT_F32);
                const V16 x1 = load_dt_n(x, head + j, n, dt);
                const V16 x2 = load_dt_n(x, head + half + j, n, dt);
                store_dt_n(x, head + j, n, v_sub(v_mul(x1, c), v_mul(x2, s)), dt);
                store_dt_n(x, head + half + j, n, v_fma(x2, c, v_mul(x1, s)), dt);
            }
        }
    }
}

typedef struct {
    int dt;
    uint8_t* x;
    int64_t rows, row_stride, num_heads, head_dim;
    const float *cos, *sin;
} RotaryCall;

static void rotary_member(void* arg, const Team* team) {
    const RotaryCall* c = (const RotaryCall*)arg;
    int64_t r0, r1;
    team_share(team, c->rows, &r0, &r1);
    uint8_t* x = c->x + r0 * c->row_stride * dt_size(c->dt);
    const int64_t angles = r0 * c->head_dim / 2;
    if (c->dt == DT_BF16)
        rotary_impl(DT_BF16, x, r1 - r0, c->row_stride, c->num_heads, c->head_dim,
                    c->cos + angles, c->sin + angles);
    else
        rotary_impl(DT_F32, x, r1 - r0, c->row_stride, c->num_heads, c->head_dim,
                    c->cos + angles, c->sin + angles);
}

void rotary(int dt, void* x, int64_t rows, int64_t row_stride, int64_t num_heads,
            int64_t head_dim, const float* cos, const float* sin, int64_t num_threads) {
    RotaryCall call = {dt, x, rows, row_stride, num_heads, head_dim, cos, sin};
    run_team(row_threads(rows, ROW_OP_MIN_ROWS, num_threads), rotary_member, &call);
}

/* silu(g) = g * sigmoid(g) = g / (1 + e^-g): one division, as torch computes it. */
ALWAYS_INLINE V16 v_silu(V16 g) {
    return v_div(g, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), g))));
}

/* out [rows, width] <- silu(gate) * up, gate_up [rows, 2 * width] = [gate | up]. */
ALWAYS_INLINE void silu_mul_impl(int dt, const void* gate_up, void* out, int64_t rows,
                                 int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gate = r * 2 * width;
        for (int64_t j = 0; j < width; j += 16) {
            const int64_t n = width - j;
            const V16 g = load_dt_n(gate_up, gate + j, n, dt);
            const V16 up = load_dt_n(gate_up, gate + width + j, n, dt);
            store_dt_n(out, r * width + j, n, v_mul(v_silu(g), up), dt);
        }
    }
}

/* A team shares silu_mul's rows from SILU_MUL_MIN_ROWS rows a member. Measured when a member
 * was a thread started per call (~70 us on a 2-vCPU VM, Sapphire Rapids), where a row of the
 * default model's MLP (1,536 wide) costs ~0.66 us: bf16 768 rows 522 -> 403 us on 2 threads,
 * 512 rows no faster. */
#define SILU_MUL_MIN_ROWS 384

typedef struct {
    int dt;
    const uint8_t* gate_up;
    uint8_t* out;
    int64_t rows, width;
} SiluMulCall;

static void silu_mul_member(void* arg, const Team* team) {
    const SiluMulCall* c = (const SiluMulCall*)arg;
    const int64_t es = dt_size(c->dt);
    int64_t r0, r1;
    team_share(team, c->rows, &r0, &r1);
    const uint8_t* gate_up = c->gate_up + r0 * 2 * c->width * es;
    uint8_t* out = c->out + r0 * c->width * es;
    if (c->dt == DT_BF16)
        silu_mul_impl(DT_BF16, gate_up, out, r1 - r0, c->width);
    else
        silu_mul_impl(DT_F32, gate_up, out, r1 - r0, c->width);
}

/* Members silu_mul runs on for `rows` rows on up to num_threads threads. */
int64_t silu_mul_threads(int64_t rows, int64_t num_threads) {
    return row_threads(rows, SILU_MUL_MIN_ROWS, num_threads);
}

/* silu_mul_impl's rows, shared by silu_mul_threads(rows, num_threads) members. */
void silu_mul(int dt, const void* gate_up, void* out, int64_t rows, int64_t width,
              int64_t num_threads) {
    SiluMulCall call = {dt, gate_up, out, rows, width};
    run_team(silu_mul_threads(rows, num_threads), silu_mul_member, &call);
}

/* ---- paged decode attention ----------------------------------------------------------- */

/* The NV vectors of one head's K or V row, from element i of the cache. */
ALWAYS_INLINE void load_kv_row(int kvdt, const int64_t NV, const void* cache, int64_t i,
                               V16* row) {
    for (int64_t j = 0; j < NV; j++) row[j] = load_dt(cache, i + 16 * j, kvdt);
}

/* K and V blocks are prefetched DECODE_PREFETCH_BLOCKS blocks ahead of the one being read
 * (across sequences), a few lines with each row read rather than a block at once: a burst of a
 * whole block per block left the kernel with its KV in DRAM about twice as slow as spreading
 * the same requests (Zen 4, 4 KiB pages, scattered blocks). Into L2 or into L1 as the process
 * sets it from a measurement (CpuOps.tune_kv_prefetch): on Zen 4 requests into L1 streamed at
 * about half the rate of requests into L2; on Zen 5 (30 layers' bf16 KV of 8 and 32 sequences
 * of 530 positions, from DRAM) L1 took 8-11% less time. 6 blocks ahead or 2 were slower there. */
#define DECODE_PREFETCH_BLOCKS 3
static int is_kv_prefetch_into_l1 = 0;

void set_kv_prefetch_into_l1(int64_t is_l1) { is_kv_prefetch_into_l1 = (int)is_l1; }

typedef struct {
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    int64_t num_seqs, max_blocks, block_size, token_bytes;
    int64_t seq, blk;  /* the next block to prefetch */
    const char *k, *v; /* the block being prefetched */
    int64_t done, end; /* bytes of it requested so far, of all to request */
} Prefetcher;

/* Up to `lines` more cache lines of the K and V of the block being prefetched. */
ALWAYS_INLINE void prefetch_lines(Prefetcher* p, int64_t lines) {
    const int64_t end = p->end - p->done < 64 * lines ? p->end : p->done + 64 * lines;
    if (is_kv_prefetch_into_l1)
        for (int64_t o = p->done; o < end; o += 64) {
            __builtin_prefetch(p->k + o, 0, 3);
            __builtin_prefetch(p->v + o, 0, 3);
        }
    else
        for (int64_t o = p->done; o < end; o += 64) {
            __builtin_prefetch(p->k + o, 0, 1);
            __builtin_prefetch(p->v + o, 0, 1);
        }
    p->done = end;
}

/* The rest of the block being prefetched, then move on to the next (none after the last). */
ALWAYS_INLINE void prefetch_next_block(Prefetcher* p) {
    prefetch_lines(p, (p->end - p->done) / 64 + 1);
    p->done = p->end = 0;
    if (p->seq >= p->num_seqs) return;
    const int64_t len = p->seq_lens[p->seq], first = p->blk * p->block_size;
    const int64_t rows = len - first < p->block_size ? len - first : p->block_size;
    const int64_t at =
        p->block_tables[p->seq * p->max_blocks + p->blk] * p->block_size * p->token_bytes;
    p->k = (const char*)p->k_cache + at;
    p->v = (const char*)p->v_cache + at;
    p->end = rows * p->token_bytes;
    if (first + p->block_size < len) {
        p->blk++;
    } else {
        p->seq++;
        p->blk = 0;
    }
}

/* The query heads that share a KV head go through a unit in tiles of up to DECODE_MAX_TILE
 * heads, as even as can be (6 heads: 3 + 3): a K or V row is read once per tile, and a
 * tile's V sums stay in registers across the unit's rows. Measured on Zen 4 (AVX-512 and
 * AVX2 builds, head_dim 64 and 128), tiles this large beat ones sized to keep every vector
 * in registers, even where their vectors spill. */
#define DECODE_MAX_TILE 4

/* The unit's scores for G query heads q [G, head_dim] of one KV head: lane t of w [G, UNIT]
 * is scale * q_g . K row t (rows token_stride apart from element k) for t < n, -1e30 from n
 * on. Each position's dot-product vectors are summed across lanes 4 positions at a time, the
 * shuffles shared (v_psum4, then v_psum8 and v_psum16). `lines` to prefetch per row.
 * QK (bfloat16 q and K, head_dim % 32 == 0, a bf16 build): q stays bf16 and each K row's
 * pairs of dims meet it in vdpbf16ps, a third of the instructions of widening K to floats
 * for FMAs; its products are exact in float32 as theirs are. Otherwise q is float. */
ALWAYS_INLINE void score_tile(int kvdt, const int64_t NV, const int64_t G, const int QK,
                              const void* q, const void* k_cache, int64_t k, int64_t token_stride,
                              const int64_t n, int64_t head_dim, float scale, float* w,
                              Prefetcher* ahead, int64_t lines) {
    V16 halves[DECODE_MAX_TILE][2];
    for (int64_t half = 0; half < 2; half++) {
        V16 quads[DECODE_MAX_TILE][2];
        for (int64_t quad = 0; quad < 2; quad++) {
            V16 dots[DECODE_MAX_TILE][4];
            /* Unrolled, the quad's dot vectors stay in registers (as a loop, GCC kept them on
             * the stack: bf16 in cache x0.86 unrolled); unrolling the outer loops as well
             * spilled and was slower. */
#pragma GCC unroll 4
            for (int64_t i = 0; i < 4; i++) {
                const int64_t t = 8 * half + 4 * quad + i;
                if (t >= n) {
                    for (int64_t g = 0; g < G; g++) dots[g][i] = v_zero();
                    continue;
                }
#if HAS_DPBF16
                if (QK) {
                    const uint16_t* row = (const uint16_t*)k_cache + k + t * token_stride;
                    prefetch_lines(ahead, lines);
                    for (int64_t g = 0; g < G; g++) {
                        const uint16_t* qg = (const uint16_t*)q + g * head_dim;
                        V16 dot = v_zero();
                        for (int64_t j = 0; j < NV / 2; j++)
                            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(row + 32 * j),
                                                   (__m512bh)_mm512_loadu_si512(qg + 32 * j));
                        dots[g][i] = dot;
                    }
                    continue;
                }
#endif
                V16 row[MAX_HEAD_DIM / 16];
                load_kv_row(kvdt, NV, k_cache, k + t * token_stride, row);
                prefetch_lines(ahead, lines);
                for (int64_t g = 0; g < G; g++) {
                    const float* qg = (const float*)q + g * head_dim;
                    V16 dot = v_mul(row[0], v_load(qg));
                    for (int64_t j = 1; j < NV; j++)
                        dot = v_fma(row[j], v_load(qg + 16 * j), dot);
                    dots[g][i] = dot;
                }
            }
            for (int64_t g = 0; g < G; g++) quads[g][quad] = v_psum4(dots[g]);
        }
        for (int64_t g = 0; g < G; g++) halves[g][half] = v_psum8(quads[g][0], quads[g][1]);
    }
    for (int64_t g = 0; g < G; g++) {
        const V16 scores = v_psum16(halves[g][0], halves[g][1]);
        v_store(w + g * UNIT, QK ? v_mul(scores, v_set1(scale)) : scores);
        for (int64_t t = n; t < UNIT; t++) w[g * UNIT + t] = -1.0e30f;
    }
}

/* Online softmax step for one head: the unit's scores w [UNIT] (-1e30 past the unit) become
 * weights relative to the running max, added lane-wise to the denominator total [16]. Only
 * when a score exceeds the max (rare once a sequence is under way) does the max move and
 * what was accumulated get rescaled; otherwise that factor would be exactly 1. A lane-wise
 * compare decides that branch, so no horizontal reduction lies on the common path. */
ALWAYS_INLINE void softmax_step(float* w, int64_t n, float* peak, float* total, float* acc,
                                int64_t NV) {
    const V16 scores = v_load(w);
    if (v_any_gt(scores, *peak)) {
        const float unit_peak = v_hmax(scores);
        const V16 alpha = v_set1(expf(*peak - unit_peak));
        *peak = unit_peak;
        v_store(total, v_mul(v_load(total), alpha));
        for (int64_t j = 0; j < NV; j++)
            v_store(acc + 16 * j, v_mul(v_load(acc + 16 * j), alpha));
    }
    V16 weights = v_exp(v_sub(scores, v_set1(*peak)));
    v_store(w, weights);
    if (n < UNIT) {
        for (int64_t t = n; t < UNIT; t++) w[t] = 0.0f;
        weights = v_load(w);
    }
    v_store(total, v_add(v_load(total), weights));
}

/* acc [G, head_dim] += the unit's V rows (from element v, token_stride apart) weighted by
 * w [G, UNIT], for G query heads that share a KV head; the sums stay in registers across
 * the unit's positions. `lines` to prefetch per row. */
ALWAYS_INLINE void add_values(int kvdt, const int64_t NV, const int64_t G, const float* w,
                              float* acc, const void* v_cache, int64_t v, int64_t token_stride,
                              int64_t n, int64_t head_dim, Prefetcher* ahead, int64_t lines) {
    V16 sums[DECODE_MAX_TILE][MAX_HEAD_DIM / 16];
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < NV; j++) sums[g][j] = v_load(acc + g * head_dim + 16 * j);
    for (int64_t t = 0; t < n; t++) {
        V16 row[MAX_HEAD_DIM / 16];
        load_kv_row(kvdt, NV, v_cache, v + t * token_stride, row);
        prefetch_lines(ahead, lines);
        for (int64_t g = 0; g < G; g++) {
            const V16 p = v_set1(w[g * UNIT + t]);
            for (int64_t j = 0; j < NV; j++) sums[g][j] = v_fma(p, row[j], sums[g][j]);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < NV; j++) v_store(acc + g * head_dim + 16 * j, sums[g][j]);
}

/* Whole units get their own copy of the scoring, without position checks (~20% faster on
 * AVX-512). Not in portable C, whose build it would make ~2.5x slower to compile. */
#if defined(PDSERVE_ISA_AVX512) || defined(PDSERVE_ISA_AVX2)
#define DECODE_WHOLE_UNITS 1
#else
#define DECODE_WHOLE_UNITS 0
#endif

/* One unit for a tile of G query heads (h.. of KV head whose rows start at element kv):
 * scoring (step 0) or adding V rows (step 1); G a compile-time constant below. */
ALWAYS_INLINE void decode_tile(int kvdt, const int64_t NV, const int64_t G, const int QK,
                               int step, const void* qs, float scale, float* acc, float* w,
                               int64_t h, const void* k_cache, const void* v_cache, int64_t kv,
                               int64_t token_stride, int64_t n, int64_t head_dim,
                               Prefetcher* ahead, int64_t lines) {
    const void* q = QK ? (const void*)((const uint16_t*)qs + h * head_dim)
                       : (const void*)((const float*)qs + h * head_dim);
    if (step == 1)
        add_values(kvdt, NV, G, w + h * UNIT, acc + h * head_dim, v_cache, kv, token_stride, n,
                   head_dim, ahead, lines);
    else if (DECODE_WHOLE_UNITS && n == UNIT)
        score_tile(kvdt, NV, G, QK, q, k_cache, kv, token_stride, UNIT, head_dim, scale,
                   w + h * UNIT, ahead, lines);
    else
        score_tile(kvdt, NV, G, QK, q, k_cache, kv, token_stride, n, head_dim, scale,
                   w + h * UNIT, ahead, lines);
}

/* Step 0 or 1 of one unit for every head, tile by tile. */
ALWAYS_INLINE void decode_tiles(int kvdt, const int64_t NV, const int QK, int step,
                                const void* qs, float scale, float* acc, float* w,
                                const void* k_cache, const void* v_cache,
                                int64_t offset, int64_t num_kv_heads, int64_t group, int64_t n,
                                int64_t head_dim, Prefetcher* ahead, int64_t lines) {
    const int64_t token_stride = num_kv_heads * head_dim;
    for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {
        const int64_t kv = offset + kv_head * head_dim;
        for (int64_t left = group, G; left > 0; left -= G, h += G) {
            const int64_t tiles_left = (left + DECODE_MAX_TILE - 1) / DECODE_MAX_TILE;
            G = (left + tiles_left - 1) / tiles_left;
            if (G >= 4)
                decode_tile(kvdt, NV, 4, QK, step, qs, scale, acc, w, h, k_cache, v_cache, kv,
                            token_stride, n, head_dim, ahead, lines);
            else if (G == 3)
                decode_tile(kvdt, NV, 3, QK, step, qs, scale, acc, w, h, k_cache, v_cache, kv,
                            token_stride, n, head_dim, ahead, lines);
            else if (G == 2)
                decode_tile(kvdt, NV, 2, QK, step, qs, scale, acc, w, h, k_cache, v_cache, kv,
                            token_stride, n, head_dim, ahead, lines);
            else
                decode_tile(kvdt, NV, 1, QK, step, qs, scale, acc, w, h, k_cache, v_cache, kv,
                            token_stride, n, head_dim, ahead, lines);
        }
    }
}

/* Every sequence has one query token, which attends to its seq_lens[b] positions. K and V are
 * read in place through the block table (no gathered copy), one pass with an online softmax,
 * blocks prefetched ahead. A unit is scored for every head (a K row read once per tile of
 * heads), then the softmax steps, then its V rows are added (once per tile). NV =
 * head_dim / 16 is a compile-time constant in the specialised copies, so a tile's vectors
 * live in registers.
 * Bound by its instructions more than by memory: Zen 5, bfloat16 q and KV (SmolLM2's 9 heads
 * on 3 KV heads of 64), 4 sequences of 512 positions in cache, 410 ns a unit of 16 positions
 * (28 GB/s; 8 sequences from DRAM, blocks in order, 527 ns). A unit took, with one part left
 * out: the scoring 220 ns (its horizontal sums: 45 shuffles and adds for each head's 16 rows
 * against 32 vdpbf16ps), the V rows 283, the softmax 350, the prefetch requests 335. A probe
 * with K laid out with positions in lanes (each block's K transposed per KV head, q's pairs
 * broadcast: no sums) took 374-379 ns against 406-415 in cache and -5% to +3% from DRAM, so the
 * sums alone are not the bound; V's pairs of rows in vdpbf16ps (half the instructions, weights
 * rounded to bf16) and q held in registers did not help either (417, 404 ns). */
ALWAYS_INLINE void paged_decode_impl(int qdt, int kvdt, const int64_t NV, const int QK,
                                     const void* q,
                                     const void* k_cache, const void* v_cache,
                                     const int64_t* block_tables, const int64_t* seq_lens,
                                     void* out, float* scratch, int64_t num_seqs,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim, seq_stride = num_heads * head_dim;
    const int64_t token_bytes = token_stride * (kvdt == DT_BF16 ? 2 : 4);
    float* qf = scratch; /* float queries [num_heads, head_dim], pre-scaled (unless QK) */
    float* acc = qf + seq_stride;       /* weighted V sums [num_heads, head_dim] */
    float* w = acc + seq_stride;        /* one unit's scores, then weights [num_heads, UNIT] */
    float* total = w + num_heads * UNIT; /* running softmax denominator per head, by lane */
    float* peak = total + num_heads * 16; /* running max per head */
    Prefetcher ahead = {.k_cache = k_cache,
                        .v_cache = v_cache,
                        .block_tables = block_tables,
                        .seq_lens = seq_lens,
                        .num_seqs = num_seqs,
                        .max_blocks = max_blocks,
                        .block_size = block_size,
                        .token_bytes = token_bytes};
    for (int64_t i = 0; i < DECODE_PREFETCH_BLOCKS; i++) prefetch_next_block(&ahead);
    /* Lines to prefetch per row read: a block's worth over a unit's K and V rows, each read
     * once per tile (decode_tiles). */
    const int64_t tiles = num_kv_heads * ((group + DECODE_MAX_TILE - 1) / DECODE_MAX_TILE);
    const int64_t rows = 2 * tiles * (block_size < UNIT ? block_size : UNIT);
    const int64_t lines = ((block_size * token_bytes + 63) / 64 + rows - 1) / rows;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = seq_lens[b];
        const int64_t* table = block_tables + b * max_blocks;
        for (int64_t i = 0; i < seq_stride; i += 16) {
            if (!QK) v_store(qf + i, v_mul(load_dt(q, b * seq_stride + i, qdt), v_set1(scale)));
            v_store(acc + i, v_zero());
        }
        const void* qs = QK ? (const void*)((const uint16_t*)q + b * seq_stride) : qf;
        for (int64_t h = 0; h < num_heads; h++) {
            peak[h] = -1.0e30f;
            v_store(total + 16 * h, v_zero());
        }
        for (int64_t start = 0; start < len;) {
            /* A unit: up to UNIT consecutive positions inside one block. */
            const int64_t blk = start / block_size, in_block = start % block_size;
            int64_t n = block_size - in_block < UNIT ? block_size - in_block : UNIT;
            n = len - start < n ? len - start : n;
            const int64_t offset = (table[blk] * block_size + in_block) * token_stride;
            if (in_block == 0) prefetch_next_block(&ahead);
            decode_tiles(kvdt, NV, QK, 0, qs, scale, acc, w, k_cache, v_cache, offset,
                         num_kv_heads, group, n, head_dim, &ahead, lines);
            for (int64_t h = 0; h < num_heads; h++)
                softmax_step(w + h * UNIT, n, peak + h, total + 16 * h, acc + h * head_dim, NV);
            decode_tiles(kvdt, NV, QK, 1, qs, scale, acc, w, k_cache, v_cache, offset,
                         num_kv_heads, group, n, head_dim, &ahead, lines);
            start += n;
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const V16 inverse = v_set1(1.0f / v_sum(v_load(total + 16 * h)));
            for (int64_t j = 0; j < NV; j++)
                store_dt(out, b * seq_stride + h * head_dim + 16 * j,
                         v_mul(v_load(acc + h * head_dim + 16 * j), inverse), qdt);
        }
    }
}

#define PAGED_DECODE_ARGS                                                                     \
    q, k_cache, v_cache, block_tables, seq_lens, out, scratch, num_seqs, num_heads,          \
        num_kv_heads, head_dim, block_size, max_blocks, scale

/* head_dim 64 and 128 get copies with the vector count fixed; others use a loop bound. The
 * query's type only matters outside the loop over positions (unless QK): it stays a run-time
 * value. */
ALWAYS_INLINE void paged_decode_types(int qdt, int kvdt, const int QK, const void* q,
                                      const void* k_cache,
                                      const void* v_cache, const int64_t* block_tables,
                                      const int64_t* seq_lens, void* out, float* scratch,
                                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                      float scale) {
    if (head_dim == 64)
        paged_decode_impl(qdt, kvdt, 4, QK, PAGED_DECODE_ARGS);
    else if (head_dim == 128)
        paged_decode_impl(qdt, kvdt, 8, QK, PAGED_DECODE_ARGS);
    else if (!QK)
        paged_decode_impl(qdt, kvdt, head_dim / 16, 0, PAGED_DECODE_ARGS);
}

void paged_decode(int qdt, int kvdt, const void* q, const void* k_cache, const void* v_cache,
                  const int64_t* block_tables, const int64_t* seq_lens, void* out,
                  float* scratch, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
    if (HAS_DPBF16 && kvdt == DT_BF16 && qdt == DT_BF16 && (head_dim == 64 || head_dim == 128))
        paged_decode_types(DT_BF16, DT_BF16, 1, PAGED_DECODE_ARGS);
    else if (kvdt == DT_BF16)
        paged_decode_types(qdt, DT_BF16, 0, PAGED_DECODE_ARGS);
    else
        paged_decode_types(qdt, DT_F32, 0, PAGED_DECODE_ARGS);
}

#include "prefill_attention.h"

/* ---- streaming linear: y [rows, out] = x [rows, in] W^T (+ bias) ---------------------- */
/*
 * W is packed in groups of 16 output rows (the last group zero-padded), each group one
 * sequential stream that the hardware prefetcher keeps at memory speed; a tile of up to
 * MAX_ROW_TILE rows of x is multiplied per pass over a group, so a batch reads the weights
 * from memory once (later tiles reread the group from cache). Formats:
 *   W_F32   float  [group][in][16]
 *   W_BF16  bf16   [group][in / 2][16][2]   (in even; AVX-512 BF16: one vdpbf16ps per pair)
 *   quantized, in % 32 == 0, per group and block of 32 inputs ("quads" of 4 inputs):
 *   W_Q8_0  [f16 scale x16][8 quads][16 rows][4 bytes]          GGUF Q8_0 (34 B/32)
 *   W_Q4_0  [f16 scale x16][8 quads][32 bytes]                  GGUF Q4_0 (18 B/32)
 *   W_Q4_1  [f16 scale x16][f16 min x16][8 quads][32 bytes]     GGUF Q4_1 (20 B/32)
 *   Q8_0 weights are stored + 128 (unsigned); a 4-bit quad's byte j holds row j / 4 in its
 *   low nibble and row 8 + j / 4 in its high one, input j % 4 of the quad.
 *   These multiply integers: each row of x is quantized per block of 32 to int8 (scale
 *   amax / 127, as llama.cpp's Q8 activations) and dotted with the weights' integers; block
 *   results are scaled in float.
 *   W_INT8  [f16 scale x16][32 inputs][16 rows] int8, weight-only: x stays in floats (each
 *           value converted in registers), so its error is the weights' alone.
 * The scratch holds x as the format's inner loop reads it (see linear_scratch).
 */
enum { W_F32 = 0, W_BF16 = 1, W_Q8_0 = 2, W_Q4_0 = 3, W_Q4_1 = 4, W_INT8 = 5 };

/* Formats multiplied by integer dot products (x quantized first). */
ALWAYS_INLINE int is_quantized(int wfmt) { return wfmt >= W_Q8_0 && wfmt <= W_Q4_1; }


/* Rows up to which bfloat16 weights meet bfloat16 x in vdpbf16ps; beyond, the weights are
 * widened to float32 for FMAs. Which wins at 3-8 rows depends on the core (vdpbf16ps' share
 * of the FMA ports: Zen 4 gains 25% at 8 rows, Sapphire Rapids loses), so the process sets
 * it from a measurement (CpuOps.tune_bf16_dot). */
static int64_t dpbf16_max_rows = 2;

/* Whether this build has vdpbf16ps; sets the rows it serves (when it has). */
int set_linear_dpbf16_max_rows(int64_t rows) {
    dpbf16_max_rows = rows;
    return HAS_DPBF16;
}

/* Bytes one group's block of 32 inputs occupies, and the group header. */
ALWAYS_INLINE int64_t block_bytes(int wfmt) {
    switch (wfmt) {
        case W_Q8_0: return 32 + 512;
        case W_Q4_0: return 32 + 256;
        case W_Q4_1: return 64 + 256;
        default: return 32 + 512; /* W_INT8 */
    }
}

/* Groups of bfloat16 weights (32 * in bytes each, dequantized or W_BF16) an AMX chunk holds:
 * it stays in L2 while passes of rows cross it. At least 4: amx_silu_mul pairs them, and
 * in one pass dequantizes a gate and an up group while it multiplies two others. */
ALWAYS_INLINE int64_t amx_chunk_groups(int64_t in) {
    const int64_t groups = AMX_CHUNK_BYTES / (32 * in);
    return groups < 4 ? 4 : groups;
}

/* Where a thread's scratch holds dequantized groups: after x, whose float copy fits before. */
ALWAYS_INLINE uint16_t* dequantized_area(uint8_t* scratch, int64_t rows, int64_t in) {
    return (uint16_t*)(scratch + round_up_64(rows * in * (int64_t)sizeof(float)));
}

/* Bytes of scratch one thread of `linear` needs for `rows` rows of `in` inputs (a multiple
 * of 64, so that the threads' slices stay aligned). */
int64_t linear_scratch(int wfmt, int64_t rows, int64_t in) {
    const int64_t floats = round_up_64(rows * in * (int64_t)sizeof(float));
#if HAS_DPBF16
    /* The bf16 paths' x, then groups dequantized to bf16 (int8_dpbf16_linear,
     * amx_dequantized_linear); float x fits in x's place. */
    const int64_t dequantized = floats + amx_chunk_groups(in) * in * 32;
#else
    const int64_t dequantized = floats;
#endif
    if (is_quantized(wfmt)) {
        const int64_t integers = round_up_64(rows * (in + 2 * (in / 32) * (int64_t)sizeof(float)));
        return integers > dequantized ? integers : dequantized;
    }
    return wfmt == W_INT8 ? dequantized : floats;
}

/* A quantized row: in int8 values, then per block its scale and the term the weights' format
 * adds for it (quantize_rows): the zero point times the sum of its integers (Q8_0, Q4_0), or
 * the scale times that sum (Q4_1, whose mins multiply it). Precomputed, each is one
 * broadcast operand per row and block. */
typedef struct {
    const int8_t* q;
    const float* scale;
    const float* offset;
} QuantRow;

ALWAYS_INLINE QuantRow quant_row(const uint8_t* scratch, int64_t r, int64_t in) {
    const int64_t nb = in / 32;
    const uint8_t* base = scratch + r * (in + 2 * nb * (int64_t)sizeof(float));
    const float* scales = (const float*)(base + in);
    return (QuantRow){(const int8_t*)base, scales, scales + nb};
}

/* The dot products of one block (8 quads) for R rows: isum[r] (16 int32 lanes, one per output
 * row of the group) += the weights' integers . row r's int8 values. 8-bit weights are the
 * stored (+128) bytes; Q8_BIAS is what the result carries beyond the true signed dot, in
 * units of the block's sum of x integers. */
#if defined(PDSERVE_ISA_AVX512)
#if defined(__AVX512VNNI__)
#define Q8_BIAS 128
/* acc + per lane the sum of 4 products u8 (w) x s8 (x). */
ALWAYS_INLINE __m512i dot4_512(__m512i acc, __m512i w_unsigned, __m512i x_signed) {
    return _mm512_dpbusd_epi32(acc, w_unsigned, x_signed);
}
#else
#define Q8_BIAS 0
/* u8 x s8 pairs summed to int16 (no overflow: |w| <= 127 or w <= 15), then pairs to int32. */
ALWAYS_INLINE __m512i dot4_512(__m512i acc, __m512i w_unsigned, __m512i x_signed) {
    const __m512i pairs = _mm512_maddubs_epi16(w_unsigned, x_signed);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#endif
ALWAYS_INLINE __m512i quad_of(const int8_t* x, int64_t k) {
    int32_t quad;
    memcpy(&quad, x + 4 * k, 4);
    return _mm512_set1_epi32(quad);
}
/* Two quads' nibbles a pass: their low nibbles (outputs 0-7) and high ones (8-15) in two
 * 512-bit ands, each quad's halves joined by one lane shuffle. Zen 5, one thread, against
 * one quad a pass in 256-bit halves: Q4_1 linears of one row in L2 -12%, 32 rows -4%; engine
 * decode of 1 and 32 sequences -2 to -5%, prefill of 512 tokens +7% tokens/s. */
ALWAYS_INLINE void dot_block_4bit(const int64_t R, const uint8_t* qs, const int8_t* const* x,
                                  VI16* isum) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t k = 0; k < 8; k += 2) {
        const __m512i packed = _mm512_loadu_si512(qs + 32 * k);
        const __m512i lo = _mm512_and_si512(packed, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        const __m512i first = _mm512_shuffle_i64x2(lo, hi, 0x44);   /* quad k */
        const __m512i second = _mm512_shuffle_i64x2(lo, hi, 0xee);  /* quad k + 1 */
        for (int64_t r = 0; r < R; r++) isum[r] = dot4_512(isum[r], first, quad_of(x[r], k));
        for (int64_t r = 0; r < R; r++)
            isum[r] = dot4_512(isum[r], second, quad_of(x[r], k + 1));
    }
}
ALWAYS_INLINE void dot_block_8bit(const int64_t R, const uint8_t* qs, const int8_t* const* x,
                                  VI16* isum) {
    for (int64_t k = 0; k < 8; k++) {
        const __m512i stored = _mm512_loadu_si512(qs + 64 * k);
#if defined(__AVX512VNNI__)
        for (int64_t r = 0; r < R; r++) isum[r] = dot4_512(isum[r], stored, quad_of(x[r], k));
#else
        /* Signed weights; |w| times x with w's sign keeps maddubs's int16 sums in range. */
        const __m512i w = _mm512_xor_si512(stored, _mm512_set1_epi8((char)0x80));
        const __m512i magnitude = _mm512_abs_epi8(w);
        const __mmask64 negative = _mm512_movepi8_mask(w);
        for (int64_t r = 0; r < R; r++) {
            const __m512i xq = quad_of(x[r], k);
            const __m512i signed_x = _mm512_mask_sub_epi8(xq, negative, _mm512_setzero_si512(), xq);
            isum[r] = dot4_512(isum[r], magnitude, signed_x);
        }
#endif
    }
}
#elif defined(PDSERVE_ISA_AVX2)
#define Q8_BIAS 0
ALWAYS_INLINE __m256i dot4_256(__m256i w_unsigned, __m256i x_signed) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w_unsigned, x_signed), _mm256_set1_epi16(1));
}
ALWAYS_INLINE void dot_block_4bit(const int64_t R, const uint8_t* qs, const int8_t* const* x,
                                  VI16* isum) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t k = 0; k < 8; k++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(qs + 32 * k));
        const __m256i w_lo = _mm256_and_si256(packed, low);
        const __m256i w_hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        for (int64_t r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, x[r] + 4 * k, 4);
            const __m256i xq = _mm256_set1_epi32(quad);
            isum[r].lo = _mm256_add_epi32(isum[r].lo, dot4_256(w_lo, xq));
            isum[r].hi = _mm256_add_epi32(isum[r].hi, dot4_256(w_hi, xq));
        }
    }
}
ALWAYS_INLINE void dot_block_8bit(const int64_t R, const uint8_t* qs, const int8_t* const* x,
                                  VI16* isum) {
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int64_t k = 0; k < 8; k++) {
        const __m256i* quad = (const __m256i*)(qs + 64 * k);
        const __m256i w_lo = _mm256_xor_si256(_mm256_loadu_si256(quad), bias);
        const __m256i w_hi = _mm256_xor_si256(_mm256_loadu_si256(quad + 1), bias);
        const __m256i m_lo = _mm256_abs_epi8(w_lo), m_hi = _mm256_abs_epi8(w_hi);
        for (int64_t r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, x[r] + 4 * k, 4);
            const __m256i xq = _mm256_set1_epi32(quad);
            isum[r].lo = _mm256_add_epi32(isum[r].lo, dot4_256(m_lo, _mm256_sign_epi8(xq, w_lo)));
            isum[r].hi = _mm256_add_epi32(isum[r].hi, dot4_256(m_hi, _mm256_sign_epi8(xq, w_hi)));
        }
    }
}
#else
#define Q8_BIAS 0
ALWAYS_INLINE void dot_block_4bit(const int64_t R, const uint8_t* qs, const int8_t* const* x,
                                  VI16* isum) {
    for (int64_t r = 0; r < R; r++) {
        int32_t lanes[16] = {0};
        for (int64_t k = 0; k < 8; k++)
            for (int64_t j = 0; j < 32; j++) {
                const int32_t byte = qs[32 * k + j], xi = x[r][4 * k + j % 4];
                lanes[j / 4] += (byte & 15) * xi;
                lanes[8 + j / 4] += (byte >> 4) * xi;
            }
        VI16 v;
        memcpy(&v, lanes, sizeof v);
        isum[r] += v;
    }
}
ALWAYS_INLINE void dot_block_8bit(const int64_t R, const uint8_t* qs, const int8_t* const* x,
                                  VI16* isum) {
    for (int64_t r = 0; r < R; r++) {
        int32_t lanes[16] = {0};
        for (int64_t k = 0; k < 8; k++)
            for (int64_t j = 0; j < 64; j++)
                lanes[j / 4] += ((int32_t)qs[64 * k + j] - 128) * x[r][4 * k + j % 4];
        VI16 v;
        memcpy(&v, lanes, sizeof v);
        isum[r] += v;
    }
}
#endif

/* A full tile of rows spends as long on a weight line's dot products as memory takes to bring
 * it, and the hardware prefetcher alone did not overlap the two: each pass asks for the line
 * WEIGHT_PREFETCH_BYTES ahead into L1 (past a group's end it is the next group's, which comes
 * next), and dense and Q8_0 weights also for the line 4x further ahead into L2. Measured at 8
 * rows on Zen 4 (AVX2: 4 rows), weights streamed from memory: bf16 -22% with L1 alone, -32%
 * more with L2 too (now within 10% of the same weights in cache); float32 -14%, then -26%;
 * int8 -8%, and the L2 request made int8 (+10%) and Q4_1 slower (their loops are bound by
 * instructions); the Q8_0 LM head -35% with L2 (gguf, 49k x 576: 2.2 -> 1.4 ms, and 1.9 ->
 * 1.4 ms in L3). Fewer rows ask for the L1 line on Sapphire Rapids (the amx build), where one
 * core's demand misses alone leave memory idle: 30 layers' weights at one row, Q4_1 -14%,
 * int8 -14 to -33%, bf16 -6%; Q4_1 at 2-4 rows -28%. On Zen 4 they gain nothing, and int8
 * at one row lost 13%. There dense weights at fewer rows also ask for the line 8x further
 * ahead into L2: 30 layers and the LM head at one row, bf16 -8%, float32 -8%. */
#define WEIGHT_PREFETCH_BYTES 2048
#if defined(__AMX_BF16__)
#define PREFETCH_MIN_ROWS 1
#else
#define PREFETCH_MIN_ROWS MAX_ROW_TILE
#endif
/* Blocks of int8 and GGUF weights (prefetch_weights) on AVX-512 cores without AMX ask for the
 * line 8 KiB ahead into L1 at every row count. Zen 5, 30 layers' linears and the LM head from
 * memory, one thread, against the above: Q4_1 1 row -12%, 8 rows -8%, 16 rows -5% (4 KiB:
 * -7%, -4%, -3%; 12 KiB as 8); int8 8 rows -18%, 12 rows -14%. Engine decode steps (one
 * thread, 512-token contexts, alternating in one process): int8 8 sequences -11%, 32 -5%;
 * gguf 1 sequence -4%, 8 -1%; prefill of 512 tokens within 2% either way. */
#if defined(PDSERVE_ISA_AVX512) && !defined(__AMX_BF16__)
#define BLOCK_PREFETCH_BYTES 8192
#define BLOCK_PREFETCH_MIN_ROWS 1
#else
#define BLOCK_PREFETCH_BYTES WEIGHT_PREFETCH_BYTES
#define BLOCK_PREFETCH_MIN_ROWS PREFETCH_MIN_ROWS
#endif
ALWAYS_INLINE void prefetch_weights(const int64_t R, int wfmt, const void* p, int64_t bytes) {
    if (R < BLOCK_PREFETCH_MIN_ROWS) return;
    for (int64_t offset = 0; offset < bytes; offset += 64) {
        __builtin_prefetch((const char*)p + BLOCK_PREFETCH_BYTES + offset, 0, 3);
        if (wfmt == W_Q8_0 && R >= MAX_ROW_TILE && BLOCK_PREFETCH_BYTES < 4 * WEIGHT_PREFETCH_BYTES)
            __builtin_prefetch((const char*)p + 4 * WEIGHT_PREFETCH_BYTES + offset, 0, 2);
    }
}
/* `next_chunk`: 0, or the bytes from this chunk to the next, whose line at p's place is asked
 * into L2 instead (linear_impl), by tiles of any row count: Zen 5, 30 layers' linears and the
 * LM head from memory, a second tile of 1-4 rows asking it against none, bfloat16 at 9, 10 and
 * 12 rows -8 to -11%, float32 at 12 rows -10%. */
/* `is_one_pass`: this pass is the call's only one over the weights (one tile of rows). On the
 * AVX-512 build (Zen 4 and 5, no AMX) such a pass of 2 rows or more asks for the line 3x
 * ahead with the non-temporal hint (a full tile also for the line ahead into L1), not 4x
 * ahead into L2, which only later passes need: Zen 5, one thread, 30 layers' linears and the
 * LM head at 8 bfloat16 rows from memory -10 to -11% (2x ahead -8 to -13%, 1.5x -6%, 4x -5%,
 * 8x -6%; t0 at 2x -10%; t1 at 8x +7%), at 6 rows -9%, float32 at 8 rows -2 to 0%; engine
 * decode steps of 8 bfloat16 sequences -5 to -10%, 6 -8%, 2 -6%, 3 -3%, 4 0% (builds
 * alternating in one process). One row, no faster (float32 +3.5%, bfloat16 -2.5%), keeps
 * the hardware's prefetch alone. Tiles of a longer call asking the same took 3 to 13% longer
 * (12 to 32 rows). With no request at all, an 8-row call takes a third longer: the hardware
 * prefetcher alone leaves memory idle at that many dot products a line. */
#if defined(PDSERVE_ISA_AVX512) && !defined(__AMX_BF16__)
#define IS_ONE_PASS_NTA 1
#else
#define IS_ONE_PASS_NTA 0
#endif
ALWAYS_INLINE void prefetch_dense_line(const int64_t R, const void* p, int64_t next_chunk,
                                       int is_one_pass) {
    if (next_chunk) __builtin_prefetch((const char*)p + next_chunk, 0, 2);
    if (IS_ONE_PASS_NTA && is_one_pass && R > 1) {
        if (R >= MAX_ROW_TILE) __builtin_prefetch((const char*)p + WEIGHT_PREFETCH_BYTES, 0, 3);
        __builtin_prefetch((const char*)p + 3 * WEIGHT_PREFETCH_BYTES, 0, 0);
        return;
    }
    if (R < PREFETCH_MIN_ROWS) return;
    __builtin_prefetch((const char*)p + WEIGHT_PREFETCH_BYTES, 0, 3);
    const int64_t l2_ahead = (R >= MAX_ROW_TILE ? 4 : 8) * WEIGHT_PREFETCH_BYTES;
    if (!next_chunk) __builtin_prefetch((const char*)p + l2_ahead, 0, 2);
}

#if HAS_DPBF16
/* Chains a row and group of bf16 dot products take (dpbf16_groups) for R rows, their groups
 * paired from 3 rows (is_paired_call): 4 for one row, 2 for up to 4 rows, 1 for 5-8 rows (16
 * chains over the two groups). */
ALWAYS_INLINE int64_t dpbf16_chains(const int64_t R) { return R == 1 ? 4 : R <= 4 ? 2 : 1; }

/* G groups of W_BF16 weights (wg[h], 1 or 2) for R rows of bfloat16 x in P chains a row and
 * group (interleaved pairs of inputs): acc[h R + r] = group h's slice of x_r W^T, the same
 * sums whatever G for one P. Each vdpbf16ps waits on the last one of its chain; a core with
 * two 512-bit vdpbf16ps a cycle (Zen 5) keeps about 12 in flight, and one chain a row left it
 * waiting where the weights come from cache: Zen 5, 30 layers' linears and the LM head,
 * against one chain a row from 3 rows: 32 rows (3 of 4 passes over each chunk from L2) -9%,
 * 4 rows -6%; one and 8 rows (memory-bound) unchanged. Two groups at once load each row's
 * broadcast pair of x once for both (is_paired_call). */
ALWAYS_INLINE void dpbf16_groups(const int64_t R, const int64_t G, const int64_t P,
                                 const uint16_t* const* wg, const void* const* x, int64_t in,
                                 int64_t next_chunk, int is_one_pass, V16* acc) {
    V16 part[2][MAX_ROW_TILE][4];
    for (int64_t h = 0; h < G; h++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t p = 0; p < P; p++) part[h][r][p] = v_zero();
    const int64_t pairs = in / 2;
    int64_t i = 0;
    for (; i + P <= pairs; i += P)
        for (int64_t p = 0; p < P; p++) {
            __m512bh wv[2];
            for (int64_t h = 0; h < G; h++) {
                prefetch_dense_line(R, wg[h] + 32 * (i + p), next_chunk, is_one_pass);
                wv[h] = (__m512bh)_mm512_loadu_si512(wg[h] + 32 * (i + p));
            }
            for (int64_t r = 0; r < R; r++) {
                const __m512bh xv =
                    (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)x[r])[i + p]);
                for (int64_t h = 0; h < G; h++)
                    part[h][r][p] = _mm512_dpbf16_ps(part[h][r][p], wv[h], xv);
            }
        }
    for (; i < pairs; i++)
        for (int64_t h = 0; h < G; h++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wg[h] + 32 * i);
            for (int64_t r = 0; r < R; r++)
                part[h][r][0] = _mm512_dpbf16_ps(
                    part[h][r][0], wv,
                    (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)x[r])[i]));
        }
    for (int64_t h = 0; h < G; h++)
        for (int64_t r = 0; r < R; r++) {
            acc[h * R + r] = part[h][r][0];
            for (int64_t p = 1; p < P; p++) acc[h * R + r] = v_add(acc[h * R + r], part[h][r][p]);
        }
}
#endif

/* G groups (wg[h], 1 or 2; 2 from 4 rows of an AVX-512 tile) for R rows of float x:
 * acc[h R + r] = group h's slice of x_r W^T, the same sums whatever G. Two groups at once
 * load each of x's broadcasts once for both. */
ALWAYS_INLINE void group_float(const int64_t R, const int64_t G, int wfmt,
                               const void* const* wg, const void* const* x, int64_t in,
                               int64_t next_chunk, int is_one_pass, V16* acc) {
    /* R == 1 runs 4 independent chains (interleaved inputs) to hide FMA latency. */
    const int64_t P = R == 1 ? 4 : R == 2 ? 2 : 1;
    V16 part[2][MAX_ROW_TILE][4];
    for (int64_t h = 0; h < G; h++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t p = 0; p < P; p++) part[h][r][p] = v_zero();
    if (wfmt == W_F32) {
        int64_t i = 0;
        for (; i + P <= in; i += P)
            for (int64_t p = 0; p < P; p++) {
                V16 wv[2];
                for (int64_t h = 0; h < G; h++) {
                    const float* line = (const float*)wg[h] + 16 * (i + p);
                    prefetch_dense_line(R, line, next_chunk, is_one_pass);
                    wv[h] = v_load(line);
                }
                for (int64_t r = 0; r < R; r++) {
                    const V16 xv = v_set1(((const float*)x[r])[i + p]);
                    for (int64_t h = 0; h < G; h++) part[h][r][p] = v_fma(wv[h], xv, part[h][r][p]);
                }
            }
        for (; i < in; i++)
            for (int64_t h = 0; h < G; h++) {
                const V16 wv = v_load((const float*)wg[h] + 16 * i);
                for (int64_t r = 0; r < R; r++)
                    part[h][r][0] = v_fma(wv, v_set1(((const float*)x[r])[i]), part[h][r][0]);
            }
    } else {
        const int64_t pairs = in / 2;
        int64_t i = 0;
        for (; i + P <= pairs; i += P)
            for (int64_t p = 0; p < P; p++) {
                V16 first[2], second[2];
                for (int64_t h = 0; h < G; h++) {
                    const uint16_t* line = (const uint16_t*)wg[h] + 32 * (i + p);
                    prefetch_dense_line(R, line, next_chunk, is_one_pass);
                    v_load_bf16_pairs(line, &first[h], &second[h]);
                }
                for (int64_t r = 0; r < R; r++) {
                    const float* xr = (const float*)x[r] + 2 * (i + p);
                    const V16 x0 = v_set1(xr[0]), x1 = v_set1(xr[1]);
                    for (int64_t h = 0; h < G; h++)
                        part[h][r][p] = v_fma(second[h], x1, v_fma(first[h], x0, part[h][r][p]));
                }
            }
        for (; i < pairs; i++)
            for (int64_t h = 0; h < G; h++) {
                V16 first, second;
                v_load_bf16_pairs((const uint16_t*)wg[h] + 32 * i, &first, &second);
                for (int64_t r = 0; r < R; r++) {
                    const float* xr = (const float*)x[r] + 2 * i;
                    part[h][r][0] =
                        v_fma(second, v_set1(xr[1]), v_fma(first, v_set1(xr[0]), part[h][r][0]));
                }
            }
    }
    for (int64_t h = 0; h < G; h++)
        for (int64_t r = 0; r < R; r++) {
            acc[h * R + r] = part[h][r][0];
            for (int64_t p = 1; p < P; p++) acc[h * R + r] = v_add(acc[h * R + r], part[h][r][p]);
        }
}

/* Stored integers minus zero point = the true ones: Q8_0's carry Q8_BIAS, Q4_0's 8. */
ALWAYS_INLINE float zero_point_of(int wfmt) {
    return wfmt == W_Q8_0 ? (float)Q8_BIAS : wfmt == W_Q4_0 ? 8.0f : 0.0f;
}

/* Quantize rows of x per block of 32 for weights in wfmt: q = round(x * 127 / amax), scale =
 * amax / 127, and the block's offset (QuantRow). */
ALWAYS_INLINE void quantize_rows(int wfmt, int xdt, const void* x, uint8_t* scratch,
                                 int64_t rows, int64_t in) {
    const int64_t nb = in / 32;
    for (int64_t r = 0; r < rows; r++) {
        QuantRow row = quant_row(scratch, r, in);
        for (int64_t b = 0; b < nb; b++) {
            const V16 lo = load_dt(x, r * in + 32 * b, xdt);
            const V16 hi = load_dt(x, r * in + 32 * b + 16, xdt);
            const float amax = v_hmax(v_max(v_abs(lo), v_abs(hi)));
            const V16 inverse = v_set1(amax > 0.0f ? 127.0f / amax : 0.0f);
            /* Rounded to nearest even, as quant.py's quantize_activations: |q| <= 127. */
            const V16 q_lo = v_round(v_mul(lo, inverse)), q_hi = v_round(v_mul(hi, inverse));
            v_store_i8((int8_t*)row.q + 32 * b, q_lo);
            v_store_i8((int8_t*)row.q + 32 * b + 16, q_hi);
            const float sum = v_sum(v_add(q_lo, q_hi)); /* exact: integers below 2^12 */
            const float scale = amax / 127.0f;
            ((float*)row.scale)[b] = scale;
            ((float*)row.offset)[b] = (wfmt == W_Q4_1 ? scale : zero_point_of(wfmt)) * sum;
        }
    }
}

ALWAYS_INLINE void group_quantized(const int64_t R, int wfmt, const uint8_t* w,
                                   const QuantRow* x, int64_t in, V16* acc) {
    const int64_t nb = in / 32;
    const uint8_t* block = w;
    for (int64_t r = 0; r < R; r++) acc[r] = v_zero();
    for (int64_t b = 0; b < nb; b++, block += block_bytes(wfmt)) {
        prefetch_weights(R, wfmt, block, block_bytes(wfmt));
        const int8_t* xq[MAX_ROW_TILE];
        VI16 isum[MAX_ROW_TILE];
        for (int64_t r = 0; r < R; r++) {
            xq[r] = x[r].q + 32 * b;
            isum[r] = vi_zero();
        }
        if (wfmt == W_Q8_0)
            dot_block_8bit(R, block + 32, xq, isum);
        else
            dot_block_4bit(R, block + (wfmt == W_Q4_1 ? 64 : 32), xq, isum);
        const V16 d = v_load_f16((const uint16_t*)block);
        for (int64_t r = 0; r < R; r++) {
            V16 dot = v_cvt_i32(isum[r]);
            if (zero_point_of(wfmt) != 0.0f) dot = v_sub(dot, v_set1(x[r].offset[b]));
            acc[r] = v_fma(dot, v_mul(d, v_set1(x[r].scale[b])), acc[r]);
        }
        if (wfmt == W_Q4_1) {
            const V16 m = v_load_f16((const uint16_t*)block + 16);
            for (int64_t r = 0; r < R; r++) acc[r] = v_fma(m, v_set1(x[r].offset[b]), acc[r]);
        }
    }
}

/* Rows from which W_INT8 meets bfloat16 x in bf16 dot products (group_int8's BF, a bf16
 * build). Measured on Zen 4 (30 layers' MLP and QKV weights, one thread, against float x):
 * x1.16 at 2 rows, x0.87 at 4, x0.64 at 8, x0.73 at 12; 3 rows run the 4-row tile. */
#define INT8_BF16X_MIN_ROWS 3

#if HAS_DPBF16
/* A pair of inputs' int8 weights (rows of 16 outputs, q and q + 16) as the 16 outputs'
 * bfloat16 pairs (exact: |w| <= 127), outputs 0-7 then 8-15. */
ALWAYS_INLINE __m512bh int8_pair_as_bf16(const int8_t* q) {
    const __m128i even = _mm_loadu_si128((const __m128i*)q);
    const __m128i odd = _mm_loadu_si128((const __m128i*)(q + 16));
    const V16 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(even, odd)));
    const V16 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(even, odd)));
    return _mm512_cvtne2ps_pbh(high, low);
}
#endif

/* W_INT8, weight-only: each block's int8 weights are converted in registers and multiplied
 * with x, the block sums scaled once. x float (BF 0): a weight vector per input, an FMA per
 * row. x bfloat16 pairs (BF 1, a bf16 model's rows as they are, a bf16 build): the int8 of
 * a pair of inputs, exact in bfloat16, meets x's pair in vdpbf16ps; products exact and sums
 * float as with FMAs, in fewer instructions. R == 1 runs 4 chains. G groups (w[h], 1 or 2):
 * acc[h R + r], the same sums whatever G, each broadcast of x serving both. */
ALWAYS_INLINE void group_int8(const int64_t R, const int64_t G, const int BF,
                              const uint8_t* const* w, const void* const* x, int64_t in,
                              V16* acc) {
    const int64_t P = R == 1 ? 4 : R == 2 ? 2 : 1;
    const int64_t steps = BF ? 16 : 32; /* pairs of inputs or inputs per block */
    for (int64_t i = 0; i < G * R; i++) acc[i] = v_zero();
    for (int64_t b = 0; b < in / 32; b++) {
        const uint8_t* block[2];
        const int8_t* q[2]; /* [32 inputs][16 outputs] */
        for (int64_t h = 0; h < G; h++) {
            block[h] = w[h] + b * block_bytes(W_INT8);
            prefetch_weights(R, W_INT8, block[h], block_bytes(W_INT8));
            q[h] = (const int8_t*)(block[h] + 32);
        }
        V16 part[2][MAX_ROW_TILE][4];
        for (int64_t h = 0; h < G; h++)
            for (int64_t r = 0; r < R; r++)
                for (int64_t p = 0; p < P; p++) part[h][r][p] = v_zero();
        for (int64_t i = 0; i < steps; i += P)
            for (int64_t p = 0; p < P; p++) {
                const int64_t k = steps * b + i + p; /* x's input (or pair) */
#if HAS_DPBF16
                if (BF) {
                    __m512bh wv[2];
                    for (int64_t h = 0; h < G; h++) wv[h] = int8_pair_as_bf16(q[h] + 32 * (i + p));
                    for (int64_t r = 0; r < R; r++) {
                        const __m512bh xv =
                            (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)x[r])[k]);
                        for (int64_t h = 0; h < G; h++)
                            part[h][r][p] = _mm512_dpbf16_ps(part[h][r][p], wv[h], xv);
                    }
                    continue;
                }
#endif
                V16 wv[2];
                for (int64_t h = 0; h < G; h++) wv[h] = v_load_i8(q[h] + 16 * (i + p));
                for (int64_t r = 0; r < R; r++) {
                    const V16 xv = v_set1(((const float*)x[r])[k]);
                    for (int64_t h = 0; h < G; h++) part[h][r][p] = v_fma(wv[h], xv, part[h][r][p]);
                }
            }
        for (int64_t h = 0; h < G; h++) {
            const V16 d = v_load_f16((const uint16_t*)block[h]);
            for (int64_t r = 0; r < R; r++) {
                V16 sum = part[h][r][0];
                for (int64_t p = 1; p < P; p++) sum = v_add(sum, part[h][r][p]);
                acc[h * R + r] = v_fma(sum, d, acc[h * R + r]);
            }
        }
    }
}

ALWAYS_INLINE int64_t group_bytes(int wfmt, int64_t in) {
    switch (wfmt) {
        case W_F32: return 64 * in;
        case W_BF16: return 32 * in;
        default: return (in / 32) * block_bytes(wfmt);
    }
}

/* Whether linear_tile takes a call's dense groups two at a time in its tiles of 4 or more
 * rows (dpbf16_groups, group_float): each broadcast of x then serves both. Zen 5, one
 * thread, against one group at a time: engine decode steps, float32 4 sequences -11%, 32
 * sequences -7%; bfloat16 dot products 4 sequences -2 to -10%, 32 sequences -5%, int8
 * prefill (int8_dpbf16_linear) +13-20% tokens/s; 30 layers' bfloat16 linears converted to
 * float (the avx512 variant), 32 rows -13%. One tile of 5-8 rows in bfloat16 dot products
 * too, where an unpaired tile's broadcast per vdpbf16ps held it to half the roof with its
 * weights in cache (3072 x 576 at 8 rows, 108 -> 75 us): 30 layers' linears and the LM head
 * from memory at 8 rows -12 to -17%, engine decode steps of 5, 6 and 8 sequences -7%
 * (builds alternating in one process; the measure when pairing came in had +4% at 6 and 8,
 * on kernels changed since). Not
 * float32 at 5-8 rows (+9% at 8), bfloat16 converted to float at 4 rows (+6 to +9%), nor
 * AVX2 (its 16 registers hold one group's 4 rows). W_INT8 in bf16 dot products (group_int8,
 * its pairs converted in registers) likewise: 30 layers' linears and the LM head from memory,
 * 5 and 8 rows -10%, 12 rows -7%; engine decode steps of 8 int8 sequences -6 to -8%, of 6
 * -5 to -6%. */
ALWAYS_INLINE int is_paired_call(int wfmt, int dpbf16, int64_t rows) {
    const int is_dot = HAS_DPBF16 && dpbf16;
    if (MAX_ROW_TILE == 4) return 0;
    if (wfmt == W_INT8) return is_dot;
    if (!(wfmt == W_F32 || wfmt == W_BF16)) return 0;
    if (rows > MAX_ROW_TILE) return 1;
    return is_dot || (rows <= 4 && wfmt == W_F32);
}

/* Group g's outputs (16, fewer in the last group) of rows [first, first + n) from acc[r]
 * (+ bias), stored in y's type. */
ALWAYS_INLINE void store_group_rows(const V16* acc, const void* bias, void* y, int ydt,
                                    int64_t first, int64_t n, int64_t out, int64_t g) {
    const int64_t width = out - 16 * g < 16 ? out - 16 * g : 16;
    const V16 b = bias ? load_dt_n(bias, 16 * g, width, ydt) : v_zero();
    for (int64_t r = 0; r < n; r++)
        store_dt_n(y, (first + r) * out + 16 * g, width, v_add(acc[r], b), ydt);
}

/* Rows [first, first + n) of the output, n <= R (rows past n repeat the last one);
 * `next_chunk` and `is_one_pass` as prefetch_dense_line's. */
ALWAYS_INLINE void linear_tile(const int64_t R, int wfmt, int dpbf16, int is_paired, int ydt,
                               const uint8_t* w, const uint8_t* xs, int64_t x_row_bytes,
                               const void* bias, void* y, int64_t first, int64_t n, int64_t out,
                               int64_t in, int64_t group_start, int64_t group_end,
                               int64_t next_chunk, int is_one_pass) {
    const void* xf[MAX_ROW_TILE];
    QuantRow xq[MAX_ROW_TILE];
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = first + (r < n ? r : n - 1);
        if (is_quantized(wfmt))
            xq[r] = quant_row(xs, row, in);
        else
            xf[r] = xs + row * x_row_bytes;
    }
    /* Paired groups (is_paired_call) are g and g + half: each of the two streams of weights
     * runs on through the range. */
    const int is_bf16_dot = HAS_DPBF16 && wfmt == W_BF16 && dpbf16;
    const int64_t half = is_paired && R >= 4 ? (group_end - group_start) / 2 : 0;
    for (int64_t g = group_start; g < group_start + half; g++) {
        const void* wg[2] = {w + g * group_bytes(wfmt, in), w + (g + half) * group_bytes(wfmt, in)};
        V16 acc[2 * MAX_ROW_TILE];
        if (is_bf16_dot) {
#if HAS_DPBF16
            const uint16_t* groups[2] = {wg[0], wg[1]};
            dpbf16_groups(R, 2, dpbf16_chains(R), groups, xf, in, next_chunk, is_one_pass, acc);
#endif
        } else if (wfmt == W_INT8) {
            const uint8_t* groups[2] = {wg[0], wg[1]};
            group_int8(R, 2, dpbf16 ? HAS_DPBF16 : 0, groups, xf, in, acc);
        } else {
            group_float(R, 2, wfmt, wg, xf, in, next_chunk, is_one_pass, acc);
        }
        store_group_rows(acc, bias, y, ydt, first, n, out, g);
        store_group_rows(acc + R, bias, y, ydt, first, n, out, g + half);
    }
    for (int64_t g = group_start + 2 * half; g < group_end; g++) {
        const uint8_t* wg = w + g * group_bytes(wfmt, in);
        V16 acc[MAX_ROW_TILE];
        if (is_bf16_dot) {
#if HAS_DPBF16
            const uint16_t* group = (const uint16_t*)wg;
            dpbf16_groups(R, 1, dpbf16_chains(R), &group, xf, in, next_chunk, is_one_pass, acc);
#endif
        } else if (is_quantized(wfmt)) {
            group_quantized(R, wfmt, wg, xq, in, acc);
        } else if (wfmt == W_INT8) {
            group_int8(R, 1, dpbf16 ? HAS_DPBF16 : 0, &wg, xf, in, acc);
        } else {
            const void* group = wg;
            group_float(R, 1, wfmt, &group, xf, in, next_chunk, is_one_pass, acc);
        }
        store_group_rows(acc, bias, y, ydt, first, n, out, g);
    }
}

#if HAS_DPBF16
/* W_INT8 multiplies in vdpbf16ps from this many rows: each group dequantized to bfloat16 once
 * (group_to_bf16) serves every row, in half the instructions of float FMAs; x is rounded
 * to bfloat16, as in AMX tiles. Below, float FMAs on exact x (decode batches). */
#define INT8_DPBF16_MIN_ROWS 16

/* Lanes 2o and 2o + 1 of a pair row take output o's value: outputs 0-7 (low half), 8-15. */
#define PAIR_LOW_OUTPUTS _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0)

/* One W_INT8 block of 32 inputs into W_BF16's layout: the int8 weights times their scales
 * (exact in float32), rounded to bfloat16 (to nearest even), input pairs interleaved per
 * output. pairs: [16 pair rows][16 outputs][2] bf16. */
ALWAYS_INLINE void int8_block_to_bf16(const uint8_t* block, uint16_t* pairs) {
    const V16 scale = v_load_f16((const uint16_t*)block);
    const V16 scale_low = _mm512_permutexvar_ps(PAIR_LOW_OUTPUTS, scale);
    const V16 scale_high =
        _mm512_permutexvar_ps(_mm512_add_epi32(PAIR_LOW_OUTPUTS, _mm512_set1_epi32(8)), scale);
    const __m128i* q = (const __m128i*)(block + 32); /* [32 inputs][16 outputs] int8 */
    for (int64_t p = 0; p < 16; p++) {
        const __m128i even = _mm_loadu_si128(q + 2 * p), odd = _mm_loadu_si128(q + 2 * p + 1);
        const V16 low = v_mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                  _mm_unpacklo_epi8(even, odd))), scale_low);
        const V16 high = v_mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_unpackhi_epi8(even, odd))), scale_high);
        _mm512_storeu_si512(pairs + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}

/* A GGUF block (Q8_0, Q4_0, Q4_1) of 32 inputs into W_BF16's layout: (q - zero point) x scale,
 * or Q4_1's q x scale + min, in float (exact but for Q4_1's sum), rounded to bfloat16. A quad
 * holds output o's 4 inputs in 32-bit lane o (a 4-bit quad once its nibbles are split). */
ALWAYS_INLINE void gguf_block_to_bf16(int wfmt, const uint8_t* block, uint16_t* pairs) {
    const V16 d = v_load_f16((const uint16_t*)block);
    /* Stored Q8_0 integers carry + 128 in every build (zero_point_of is the dot products'). */
    const V16 base = wfmt == W_Q4_1 ? v_load_f16((const uint16_t*)block + 16)
                                    : v_mul(d, v_set1(wfmt == W_Q8_0 ? -128.0f : -8.0f));
    const uint8_t* quads = block + (wfmt == W_Q4_1 ? 64 : 32);
    /* Element 2o of a pair row takes input 0's output o (element o), 2o + 1 input 1's (16 + o). */
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i byte = _mm512_set1_epi32(0xff);
    for (int64_t k = 0; k < 8; k++) {
        __m512i quad;
        if (wfmt == W_Q8_0) {
            quad = _mm512_loadu_si512(quads + 64 * k);
        } else {
            const __m256i packed = _mm256_loadu_si256((const __m256i*)(quads + 32 * k));
            const __m256i low = _mm256_set1_epi8(0x0f);
            quad = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low)),
                                      _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), 1);
        }
        V16 value[4];
        for (int i = 0; i < 4; i++)
            value[i] = v_fma(_mm512_cvtepi32_ps(_mm512_and_si512(
                                 _mm512_srli_epi32(quad, 8 * i), byte)), d, base);
        for (int i = 0; i < 2; i++)
            _mm512_storeu_si512(pairs + 32 * (2 * k + i),
                                _mm512_permutexvar_epi16(interleave,
                                    (__m512i)_mm512_cvtne2ps_pbh(value[2 * i + 1], value[2 * i])));
    }
}

/* Block b (inputs 32 b..) of one group wg (W_INT8 or GGUF) dequantized into W_BF16's layout:
 * group [in / 2][16][2] bf16. */
ALWAYS_INLINE void block_to_bf16(int wfmt, const uint8_t* wg, int64_t b, uint16_t* group) {
    /* Asked ahead as the dot products do: int8 -14% at 8 and 32 rows, from memory. */
    prefetch_weights(MAX_ROW_TILE, wfmt, wg + b * block_bytes(wfmt), block_bytes(wfmt));
    if (wfmt == W_INT8)
        int8_block_to_bf16(wg + b * block_bytes(wfmt), group + 512 * b);
    else
        gguf_block_to_bf16(wfmt, wg + b * block_bytes(wfmt), group + 512 * b);
}

/* One group dequantized, block by block (block_to_bf16). */
ALWAYS_INLINE void group_to_bf16(int wfmt, const uint8_t* wg, int64_t in, uint16_t* group) {
    for (int64_t b = 0; b < in / 32; b++) block_to_bf16(wfmt, wg, b, group);
}

/* G (1 or 2) dequantized groups g.. (W_BF16's layout, `groups` holding one after the
 * other) for rows [first, first + n), n <= R: as linear_tile. */
ALWAYS_INLINE void bf16_groups_rows(const int64_t R, const int64_t G, const uint16_t* groups,
                                    const uint16_t* x, const void* bias, void* y, int ydt,
                                    int64_t first, int64_t n, int64_t out, int64_t in, int64_t g) {
    const void* rows_x[MAX_ROW_TILE];
    for (int64_t r = 0; r < R; r++) rows_x[r] = x + (first + (r < n ? r : n - 1)) * in;
    const uint16_t* wg[2] = {groups, groups + 16 * in};
    V16 acc[2 * MAX_ROW_TILE];
    dpbf16_groups(R, G, dpbf16_chains(R), wg, rows_x, in, 0, 0, acc);
    for (int64_t h = 0; h < G; h++)
        store_group_rows(acc + h * R, bias, y, ydt, first, n, out, g + h);
}

/* W_INT8 against bf16 x in bf16 dot products, groups [group_begin, group_end), two at a time
 * (dpbf16_groups); `groups` holds two dequantized groups (in * 32 bf16). */
static void int8_dpbf16_linear(const uint8_t* w, const uint16_t* x, const void* bias, void* y,
                               int ydt, int64_t rows, int64_t out, int64_t in, uint16_t* groups,
                               int64_t group_begin, int64_t group_end) {
    for (int64_t g = group_begin; g < group_end; g += 2) {
        const int64_t G = g + 1 < group_end ? 2 : 1;
        for (int64_t h = 0; h < G; h++)
            group_to_bf16(W_INT8, w + (g + h) * group_bytes(W_INT8, in), in, groups + h * 16 * in);
        for (int64_t first = 0; first < rows; first += MAX_ROW_TILE) {
            const int64_t n = rows - first < MAX_ROW_TILE ? rows - first : MAX_ROW_TILE;
#define ROWS(R, G) bf16_groups_rows(R, G, groups, x, bias, y, ydt, first, n, out, in, g)
            if (n <= 4 && G == 2)
                ROWS(4, 2);
            else if (n <= 4)
                ROWS(4, 1);
            else if (G == 2)
                ROWS(MAX_ROW_TILE, 2);
            else
                ROWS(MAX_ROW_TILE, 1);
#undef ROWS
        }
    }
}
#endif

/* W_INT8 weights against x quantized to 16 bits per block (SPLIT_X_LEVELS) and split into two
 * bytes, multiplied exactly in integers: in vpdpbusd (vnni_int8_linear) on any AVX-512 VNNI
 * core, in AMX integer tiles (amx_int8_linear) where it has them. */
#if defined(PDSERVE_ISA_AVX512) && defined(__AVX512VNNI__) && HAS_DPBF16
#define HAS_SPLIT_X 1
#else
#define HAS_SPLIT_X 0
#endif

#if HAS_SPLIT_X
/* Rows up to which W_INT8 is multiplied in vpdpbusd (vnni_int8_linear). With AMX tiles
 * beyond, which spend less in dot products than vpdpbusd does from 4 rows on (Sapphire
 * Rapids, one thread, 30 layers' linears and the LM head from memory, alternating in one
 * process: 1 row 15.1 -> 13.2-14.0 ms, 2 rows 15.3 -> 14.3, 4 rows 16.2 both, 8 rows 17.3 ->
 * 22.1); without, against int8 weights converted to bfloat16 pairs in registers (group_int8,
 * Zen 5, the same measure): 3 rows -10 to -11%, 4 rows -7%, 8 rows +51%. */
#if defined(__AMX_BF16__)
#define INT8_VNNI_MAX_ROWS 2
#else
#define INT8_VNNI_MAX_ROWS 4
#endif
/* x of vnni_int8_linear and amx_int8_linear: per row and block of 32 inputs, q = round(x *
 * 32767 / amax) held as its high byte (signed) and low byte (unsigned), q = 256 high + low,
 * and scale = amax / 32767. Its error, under amax / 65534, is below bfloat16's rounding for
 * all but values 100x smaller than their block's largest: int8 weights stay weight-only in
 * effect. */
#define SPLIT_X_LEVELS 32767.0f /* quant.py's SPLIT_X_LEVELS, the tests' reference */
typedef struct {
    int8_t* high;    /* [rows][in] */
    uint8_t* low;    /* [rows][in] */
    float* scale;    /* [rows][in / 32] */
} SplitRows;

/* In the first linear_scratch(W_INT8, rows, in) bytes, before dequantized_area. */
ALWAYS_INLINE SplitRows split_rows_area(uint8_t* scratch, int64_t rows, int64_t in) {
    const int64_t plane = rows * in;
    return (SplitRows){(int8_t*)scratch, scratch + plane,
                       (float*)(scratch + round_up_64(2 * plane))};
}

ALWAYS_INLINE void split_rows(int xdt, const void* x, SplitRows s, int64_t rows, int64_t in) {
    const int64_t nb = in / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = r * in + 32 * b;
            const V16 lo = load_dt(x, at, xdt), hi = load_dt(x, at + 16, xdt);
            const float amax = v_hmax(v_max(v_abs(lo), v_abs(hi)));
            const V16 inverse = v_set1(amax > 0.0f ? SPLIT_X_LEVELS / amax : 0.0f);
            const __m512i q[2] = {_mm512_cvtps_epi32(v_mul(lo, inverse)), /* nearest even */
                                  _mm512_cvtps_epi32(v_mul(hi, inverse))};
            for (int h = 0; h < 2; h++) {
                _mm_storeu_si128((__m128i*)(s.low + at + 16 * h), _mm512_cvtepi32_epi8(q[h]));
                _mm_storeu_si128((__m128i*)(s.high + at + 16 * h),
                                 _mm512_cvtepi32_epi8(_mm512_srai_epi32(q[h], 8)));
            }
            s.scale[r * nb + b] = amax / SPLIT_X_LEVELS;
        }
}

/* Quad k of a W_INT8 block's [32 inputs][16 outputs] bytes q: its 4 input rows as [16
 * outputs][4 inputs], what AMX's B operand and vpdpbusd take: one byte permutation with
 * AVX512-VBMI, else a 4 x 4 transpose of dwords (lane j: outputs 4j.. of the 4 inputs) and
 * a byte shuffle within each lane. */
ALWAYS_INLINE __m512i int8_quad(const uint8_t* q, int64_t k) {
    const __m512i stored = _mm512_loadu_si512(q + 64 * k);
#if defined(__AVX512VBMI__)
    const __m512i order = _mm512_set_epi8(
        63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,
        59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,
        55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
        51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    return _mm512_permutexvar_epi8(order, stored);
#else
    const __m512i transpose =
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i within = _mm512_broadcast_i32x4(
        _mm_set_epi8(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0));
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(transpose, stored), within);
#endif
}

/* acc + a block's integer products of x's high and low bytes (high * 256 + low, exact),
 * scaled by the weights' scales d and x's block scale. */
ALWAYS_INLINE V16 add_split_block(V16 acc, __m512i high, __m512i low, V16 d, float scale) {
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
    return v_fma(_mm512_cvtepi32_ps(sum), v_mul(d, v_set1(scale)), acc);
}

/* A block's lines 1 KiB ahead into L1 and 4 KiB ahead into L2 on Sapphire Rapids (the amx
 * build): 1 row -5 to -8% against 2 KiB into L1 alone, groups one at a time. Not on Zen 5,
 * where they cost (30 layers' linears and the LM head at one row, one group at a time,
 * against none: these +10%, 4-32 KiB into L2 alone -2 to +2%); there the 4-row pass (3-4
 * rows) asks BLOCK_PREFETCH_BYTES ahead into L1 (the same measure against none: 3 rows
 * -14%, 4 rows -12 to -15%), and one or two rows, two streams, none (8 KiB: 0%, +4%). */
ALWAYS_INLINE void prefetch_split_block(const int64_t R, const uint8_t* block) {
#if defined(__AMX_BF16__)
    (void)R;
    for (int64_t o = 0; o < block_bytes(W_INT8); o += 64) {
        __builtin_prefetch(block + 1024 + o, 0, 3);
        __builtin_prefetch(block + 4096 + o, 0, 2);
    }
#else
    if (R >= 4) prefetch_weights(R, W_INT8, block, block_bytes(W_INT8));
#endif
}

/* Rows [0, n) (n <= R) of G groups' outputs (G 1 or 2: weights wg[h], index g[h]), the
 * integers of amx_int8_group_rows in AVX-512 VNNI instead of tiles: per block, x's low bytes
 * (unsigned) . the weights (signed) and its high bytes (signed) . the weights + 128 (w ^
 * 0x80, unsigned) in vpdpbusd, less 128 times the block's sum of high bytes (high_sums
 * [rows][in / 32]); then the same float epilogue, so the same result bit for bit. Each quad
 * is permuted in registers and used at once: no copy of the weights, no tile stored and read
 * back. Two groups make two streams of weights (vnni_int8_linear). */
ALWAYS_INLINE void vnni_int8_groups_rows(const int64_t R, const int64_t G,
                                         const uint8_t* const* wg, const int64_t* g, SplitRows s,
                                         const int32_t* high_sums, const void* bias, void* y,
                                         int ydt, int64_t n, int64_t out, int64_t in) {
    const int64_t nb = in / 32;
    V16 acc[2][4]; /* G <= 2, R <= 4 */
    for (int64_t h = 0; h < G; h++)
        for (int64_t r = 0; r < R; r++) acc[h][r] = v_zero();
    for (int64_t b = 0; b < nb; b++) {
        __m512i high[2][4], low[2][4];
        for (int64_t h = 0; h < G; h++) {
            prefetch_split_block(R, wg[h] + b * block_bytes(W_INT8));
            for (int64_t r = 0; r < R; r++) high[h][r] = low[h][r] = _mm512_setzero_si512();
        }
        for (int64_t k = 0; k < 8; k++)
            for (int64_t h = 0; h < G; h++) {
                const __m512i w = int8_quad(wg[h] + b * block_bytes(W_INT8) + 32, k);
                const __m512i w_plus_128 = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
                for (int64_t r = 0; r < R && r < n; r++) {
                    const int64_t quad = (r * in + 32 * b + 4 * k) / 4;
                    const __m512i x_low = quad_of((const int8_t*)s.low, quad);
                    low[h][r] = _mm512_dpbusd_epi32(low[h][r], x_low, w);
                    high[h][r] = _mm512_dpbusd_epi32(high[h][r], w_plus_128, quad_of(s.high, quad));
                }
            }
        for (int64_t h = 0; h < G; h++) {
            const V16 d = v_load_f16((const uint16_t*)(wg[h] + b * block_bytes(W_INT8)));
            for (int64_t r = 0; r < R && r < n; r++) {
                const __m512i exact_high =
                    _mm512_sub_epi32(high[h][r], _mm512_set1_epi32(128 * high_sums[r * nb + b]));
                acc[h][r] =
                    add_split_block(acc[h][r], exact_high, low[h][r], d, s.scale[r * nb + b]);
            }
        }
    }
    for (int64_t h = 0; h < G; h++)
        store_group_rows(acc[h], bias, y, ydt, 0, n < R ? n : R, out, g[h]);
}

/* W_INT8, groups [group_begin, group_end), rows <= INT8_VNNI_MAX_ROWS: x split into two bytes
 * (split_rows), multiplied in vpdpbusd (vnni_int8_groups_rows); one or two rows take group g
 * with g + half of the range: two streams of weights, which one core's memory requests keep
 * busier than one (Zen 5, one thread, 30 layers' linears and the LM head from memory,
 * against one group at a time: 1 row -11 to -17%, 2 rows -8 to -13%; 4 rows +4 to +5%). */
static void vnni_int8_linear(const uint8_t* w, int xdt, const void* x, const void* bias, void* y,
                             int64_t rows, int64_t out, int64_t in, uint8_t* scratch,
                             int64_t group_begin, int64_t group_end) {
    const SplitRows s = split_rows_area(scratch, rows, in);
    split_rows(xdt, x, s, rows, in);
    int32_t* high_sums = (int32_t*)dequantized_area(scratch, rows, in); /* rows x in / 32 */
    for (int64_t i = 0; i < rows * in / 32; i++) {
        int32_t sum = 0;
        for (int64_t j = 0; j < 32; j++) sum += s.high[32 * i + j];
        high_sums[i] = sum;
    }
    const int64_t half = rows <= 2 ? (group_end - group_begin) / 2 : 0;
#define GROUPS(G, first, second)                                                                \
    do {                                                                                        \
        const int64_t index[2] = {first, second};                                               \
        const uint8_t* wg[2] = {w + index[0] * group_bytes(W_INT8, in),                         \
                                w + index[1] * group_bytes(W_INT8, in)};                        \
        if (rows == 1)                                                                          \
            vnni_int8_groups_rows(1, G, wg, index, s, high_sums, bias, y, xdt, 1, out, in);     \
        else if (rows == 2)                                                                     \
            vnni_int8_groups_rows(2, G, wg, index, s, high_sums, bias, y, xdt, 2, out, in);     \
        else                                                                                    \
            vnni_int8_groups_rows(4, 1, wg, index, s, high_sums, bias, y, xdt, rows, out, in);  \
    } while (0)
    for (int64_t g = group_begin; g < group_begin + half; g++) GROUPS(2, g, g + half);
    for (int64_t g = group_begin + 2 * half; g < group_end; g++) GROUPS(1, g, g);
#undef GROUPS
}
#endif

#if defined(__AMX_BF16__)
#define AMX_LINEAR_ROWS 32 /* rows of x per pass over a weight group: two 16-row tiles */
/* W_INT8 runs in AMX integer tiles up to this many rows (amx_int8_linear, one tile pass; x
 * split into two bytes); beyond, dequantized to bfloat16 (amx_dequantized_linear), which more
 * rows repay. Sapphire Rapids, one thread, 30 layers' linears and the LM head from memory:
 * 1 row 14.0 -> 12.2 ms (against float FMAs), 8 rows 22.3 -> 13.3, 16 rows 23.5 -> 16.1; 2
 * passes of 16 rows lost to the dequantized tiles (31 rows: 29.2 against 27.1). */
#define AMX_INT8_TILES_MAX_ROWS 16
/* GGUF weights run in AMX tiles from this many rows (dequantized to bfloat16, x rounded to
 * bfloat16 instead of quantized to int8); below, in int8 dot products. Dequantizing costs
 * about 100 ns a block (16 outputs x 32 inputs), which more rows repay: 30 layers' Q4_1
 * linears on Sapphire Rapids, one thread, against int8 dot products, x1.47 at 16 rows, x1.06
 * at 24, x0.85 at 32, x0.57 at 64, x0.37 at 256 (the Q8_0 LM head: x1.23, -, x0.88, x0.66,
 * x0.44). */
#define AMX_GGUF_MIN_ROWS 32
/* Rows from which amx_dequantized_linear takes weights of format wfmt; 0: never. */
ALWAYS_INLINE int64_t amx_dequantized_min_rows(int wfmt) {
    return wfmt == W_INT8 ? AMX_INT8_TILES_MAX_ROWS + 1
                          : is_quantized(wfmt) ? AMX_GGUF_MIN_ROWS : 0;
}
/* Tiles 0-3: y (float) of rows [0, m0) and [m0, m0 + m1) for a group, then for the next;
 * 4, 5: those rows' x (32 bf16 inputs); 6, 7: the two groups' 32 inputs, which W_BF16 stores
 * as AMX wants B (pairs of inputs per row). */
static void amx_linear_configure(int64_t m0, int64_t m1) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int64_t tile_rows[8] = {m0, m1, m0, m1, m0, m1, 16, 16};
    for (int i = 0; i < 8; i++) {
        config.rows[i] = (uint8_t)tile_rows[i];
        config.colsb[i] = tile_rows[i] ? 64 : 0;
    }
    amx_load_config(&config);
}

/* A pass's products, stored from the tiles, waiting for their epilogue (amx_products_finish).
 * SiLU's, ~30 vector operations a row, run a few rows at a time between the next pass's tile
 * products (amx_pass): the vector work and the tiles then overlap, where one after the other
 * each waited for the other, the epilogue being longer than the core's reorder window
 * (Sapphire Rapids, one thread, 512 rows of gate/up 3,072 x 576: 1.45 -> 1.14 ms). */
typedef struct {
    float (*c)[AMX_LINEAR_ROWS][16]; /* c[i][r]: group g + i, row first + r; NULL: none */
    void* y;                         /* [rows][out] of type ydt */
    const void* bias;                /* [out] or NULL (linear only) */
    int ydt, num_groups, is_silu;    /* is_silu: c[0] gate, c[1] up of y's group g */
    int64_t first, n, out, g, done;  /* rows [first, first + done) are stored */
} AmxProducts;

/* Rows [p->done, upto) of p's epilogue: y = c + bias (group by group), or y = silu(gate) * up
 * with gate and up rounded to ydt as `linear` stores them, so the result is what linear then
 * silu_mul give, bit for bit (the one-call decode step computes the latter). */
ALWAYS_INLINE void amx_products_finish(AmxProducts* p, int64_t upto) {
    const int ydt = p->ydt;
    for (int64_t r = p->done; r < upto; r++) {
        const int64_t row = (p->first + r) * p->out;
        if (p->is_silu) {
            store_dt(p->y, row + 16 * p->g,
                     v_mul(v_silu(round_dt(v_load(p->c[0][r]), ydt)),
                           round_dt(v_load(p->c[1][r]), ydt)),
                     ydt);
            continue;
        }
        for (int64_t i = 0; i < p->num_groups; i++) {
            const int64_t col = 16 * (p->g + i), width = p->out - col < 16 ? p->out - col : 16;
            const V16 b = p->bias ? load_dt_n(p->bias, col, width, ydt) : v_zero();
            store_dt_n(p->y, row + col, width, v_add(v_load(p->c[i][r]), b), ydt);
        }
    }
    p->done = upto;
}

/* The groups the next pass multiplies, dequantized a block after each k-step of the current
 * pass's tiles (one pass takes every row): the vector work and the tiles overlap, where one
 * after the other each waited for the other (Sapphire Rapids, one thread, 30 layers' linears
 * and the LM head at 32 rows: int8 27.2-28.1 -> 20.8 ms, Q4_1 with its Q8_0 head 24.0-25.9 ->
 * 21.0 ms; a pair of groups in 2 x 2 tiles while the next pair dequantized was no faster). */
typedef struct {
    int wfmt, num_groups; /* num_groups: 1 or 2 */
    const uint8_t* w[2];  /* group i's quantized weights */
    uint16_t* group[2];   /* where group i goes, in W_BF16's layout */
} AmxDequantizing;

/* A tile multiplies as soon as its weights arrive, and a tile load waits for every line it
 * brings, so weights streamed from memory (a chunk's first pass) ask for the lines
 * AMX_WEIGHT_AHEAD bytes ahead of each weight tile into L2 (Sapphire Rapids, one thread, 30
 * layers' bf16 linears and the LM head at 32 rows, three alternating pairs: 25.3-26.5 ->
 * 23.0-24.2 ms; 8 rows -1 to -3%; 4 and 8 KiB ahead no better). */
#define AMX_WEIGHT_AHEAD 2048
ALWAYS_INLINE void amx_weights_ahead(int num_groups, const uint16_t* w0, const uint16_t* w1) {
    for (int64_t line = 0; line < 16; line++) {
        __builtin_prefetch((const char*)w0 + AMX_WEIGHT_AHEAD + 64 * line, 0, 2);
        if (num_groups == 2)
            __builtin_prefetch((const char*)w1 + AMX_WEIGHT_AHEAD + 64 * line, 0, 2);
    }
}

/* Tiles 0-3 <- rows [first, first + n) (n <= AMX_LINEAR_ROWS, as configured) of bf16 x
 * [rows][in] times group i's weights w[i] (16 * in bf16, in W_BF16's layout: AMX's B operand),
 * i < num_groups (1 or 2), fp32 sums of exact bf16 products, in % 32 == 0: tile 2i + (r >= 16)
 * holds group i's rows. Two groups make 2 x 2 tiles: each x and weight tile loaded feeds two
 * products, where one group's pass loads three tiles for two. is_from_memory: the weights
 * come from memory (amx_weights_ahead). `pending` (or NULL): the previous pass's products,
 * finished in step with these; `dequantizing` (or NULL): groups dequantized in step with
 * them. Weights load with the non-temporal hint: a pass reads each weight line once (the next
 * pass again from L2), and without it they pushed the pass's x (32 rows, 36 KiB at 576
 * inputs) out of L1, so every tile came from L2 at its bandwidth (Sapphire Rapids, one
 * thread, gate/up 3,072 x 576 with SiLU at 512 rows: one weight 1.31 -> 1.07 ms, 30 weights
 * from memory 1.70 -> 1.36 ms). */
ALWAYS_INLINE void amx_tiles_multiply(int num_groups, const uint16_t* w0, const uint16_t* w1,
                                      const uint16_t* x, int64_t first, int64_t n, int64_t in,
                                      int is_from_memory, AmxProducts* pending,
                                      const AmxDequantizing* dequantizing) {
    const int64_t m1 = n > 16 ? n - 16 : 0, stride = in * 2;
    const uint16_t* x0 = x + first * in;
    const uint16_t* x1 = x0 + 16 * in;
    _tile_zero(0);
    if (m1) _tile_zero(1);
    if (num_groups == 2) {
        _tile_zero(2);
        if (m1) _tile_zero(3);
    }
    for (int64_t k = 0; k < in; k += 32) {
        if (is_from_memory) amx_weights_ahead(num_groups, w0 + 16 * k, w1 + 16 * k);
        _tile_stream_loadd(6, w0 + 16 * k, 64);
        _tile_loadd(4, x0 + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (num_groups == 2) {
            _tile_stream_loadd(7, w1 + 16 * k, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (m1) {
            _tile_loadd(5, x1 + k, stride);
            _tile_dpbf16ps(1, 5, 6);
            if (num_groups == 2) _tile_dpbf16ps(3, 5, 7);
        }
        if (pending) amx_products_finish(pending, pending->n * (k + 32) / in);
        for (int i = 0; dequantizing && i < dequantizing->num_groups; i++)
            block_to_bf16(dequantizing->wfmt, dequantizing->w[i], k / 32, dequantizing->group[i]);
    }
    if (pending) amx_products_finish(pending, pending->n);
}

/* c[i][r] <- amx_tiles_multiply's products: group i, row r. */
ALWAYS_INLINE void amx_tiles_store(int num_groups, int64_t n, float c[2][AMX_LINEAR_ROWS][16]) {
    _tile_stored(0, c[0][0], 64);
    if (n > 16) _tile_stored(1, c[0][16], 64);
    if (num_groups == 2) {
        _tile_stored(2, c[1][0], 64);
        if (n > 16) _tile_stored(3, c[1][16], 64);
    }
}

/* Multiply one pass (amx_tiles_multiply) while finishing *pending (if any), then make the
 * pass pending: its products go to `buffers`' half the previous pass did not use.
 * is_from_memory, dequantizing: as amx_tiles_multiply's. */
ALWAYS_INLINE void amx_pass(AmxProducts* pending, float buffers[2][2][AMX_LINEAR_ROWS][16],
                            AmxProducts next, const uint16_t* w0, const uint16_t* w1,
                            const uint16_t* x, int64_t in, int is_from_memory,
                            const AmxDequantizing* dequantizing) {
    amx_tiles_multiply(next.num_groups, w0, w1, x, next.first, next.n, in, is_from_memory,
                       pending->c ? pending : NULL, dequantizing);
    next.c = buffers[pending->c == buffers[0]];
    amx_tiles_store(next.num_groups, next.n, next.c);
    *pending = next;
}

/* Rows [first, first + n) of y = x W^T (+ bias) for groups [g0, g1), two at a time; wg: group
 * g0's weights; is_from_memory as amx_tiles_multiply's. Each pass is finished as soon as
 * stored: its few vector operations a row overlap the next pass's tiles in the core's reorder
 * window already, and finishing them in step with the next pass (amx_pass) was slower in the
 * model (Sapphire Rapids, a 512-token prompt's down projections: 18.5 -> 21.3 ms). */
ALWAYS_INLINE void amx_groups_passes(const uint16_t* wg, const uint16_t* x, const void* bias,
                                     void* y, int ydt, int64_t first, int64_t n, int64_t out,
                                     int64_t in, int64_t g0, int64_t g1, int is_from_memory) {
    float c[2][AMX_LINEAR_ROWS][16];
    for (int64_t g = g0; g < g1; g += 2) {
        const int num_groups = g + 2 <= g1 ? 2 : 1;
        const uint16_t* w = wg + (g - g0) * 16 * in;
        AmxProducts products = {c, y, bias, ydt, num_groups, 0, first, n, out, g, 0};
        amx_tiles_multiply(num_groups, w, w + 16 * in, x, first, n, in, is_from_memory, NULL,
                           NULL);
        amx_tiles_store(num_groups, n, c);
        amx_products_finish(&products, n);
    }
}

/* Configure the tiles for passes of n rows, unless they are (*configured: the current n). */
ALWAYS_INLINE void amx_configure_rows(int64_t n, int64_t* configured) {
    if (n == *configured) return;
    amx_linear_configure(n < 16 ? n : 16, n > 16 ? n - 16 : 0);
    *configured = n;
}

/* amx_dequantized_linear where one pass takes every row: group g multiplies from one of two
 * buffers in `groups` while group g + 1 is dequantized into the other (AmxDequantizing). */
static void amx_dequantized_pass(int wfmt, const uint8_t* w, const uint16_t* x,
                                 const void* bias, void* y, int ydt, int64_t rows, int64_t out,
                                 int64_t in, uint16_t* groups, int64_t group_begin,
                                 int64_t group_end) {
    const int64_t bytes = group_bytes(wfmt, in);
    float c[2][AMX_LINEAR_ROWS][16];
    int64_t configured = 0;
    if (group_begin >= group_end) return; /* an empty share: no first group to dequantize */
    amx_configure_rows(rows, &configured);
    group_to_bf16(wfmt, w + group_begin * bytes, in, groups);
    for (int64_t g = group_begin; g < group_end; g++) {
        const int64_t half = (g - group_begin) % 2;
        const AmxDequantizing dequantizing = {
            wfmt, 1, {w + (g + 1) * bytes, NULL}, {groups + 16 * in * (1 - half), NULL}};
        amx_tiles_multiply(1, groups + 16 * in * half, NULL, x, 0, rows, in, 0, NULL,
                           g + 1 < group_end ? &dequantizing : NULL);
        AmxProducts products = {c, y, bias, ydt, 1, 0, 0, rows, out, g, 0};
        amx_tiles_store(1, rows, c);
        amx_products_finish(&products, rows);
    }
    _tile_release();
}

/* W_INT8 or GGUF weights against bf16 x in AMX tiles: a chunk of groups dequantized to
 * bfloat16 (into `groups`, amx_chunk_groups(in) x in x 16 bf16), then every pass of rows
 * multiplied against it; amx_dequantized_pass where one pass takes every row. */
static void amx_dequantized_linear(int wfmt, const uint8_t* w, const uint16_t* x,
                                   const void* bias, void* y, int ydt, int64_t rows, int64_t out,
                                   int64_t in, uint16_t* groups, int64_t group_begin,
                                   int64_t group_end) {
    if (rows <= AMX_LINEAR_ROWS) {
        amx_dequantized_pass(wfmt, w, x, bias, y, ydt, rows, out, in, groups, group_begin,
                             group_end);
        return;
    }
    const int64_t chunk = amx_chunk_groups(in);
    int64_t configured = 0;
    for (int64_t g0 = group_begin; g0 < group_end; g0 += chunk) {
        const int64_t g1 = g0 + chunk < group_end ? g0 + chunk : group_end;
        for (int64_t g = g0; g < g1; g++)
            group_to_bf16(wfmt, w + g * group_bytes(wfmt, in), in, groups + (g - g0) * 16 * in);
        for (int64_t first = 0; first < rows; first += AMX_LINEAR_ROWS) {
            const int64_t n = rows - first < AMX_LINEAR_ROWS ? rows - first : AMX_LINEAR_ROWS;
            amx_configure_rows(n, &configured);
            amx_groups_passes(groups, x, bias, y, ydt, first, n, out, in, g0, g1, 0);
        }
    }
    _tile_release();
}

/* Tiles 0, 1: x's high and low bytes of m <= 16 rows x 32 inputs; 2 and 7: a block's weights
 * as AMX's B (8 quads of 4 inputs x 16 outputs); 3, 4 and 5, 6: the products of the high and
 * low bytes, alternate blocks taking (2, 3, 4) and (7, 5, 6). */
static void amx_int8_configure(int64_t m) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int64_t rows[8] = {m, m, 8, m, m, m, m, 8};
    for (int i = 0; i < 8; i++) {
        config.rows[i] = (uint8_t)rows[i];
        config.colsb[i] = i < 2 ? 32 : 64;
    }
    amx_load_config(&config);
}

/* One W_INT8 block as AMX's B operand: [8 quads][16 outputs][4 inputs]. */
ALWAYS_INLINE void int8_block_as_quads(const uint8_t* q, uint8_t* quads) {
    for (int64_t k = 0; k < 8; k++) _mm512_store_si512(quads + 64 * k, int8_quad(q, k));
}

/* Block b's integer products of x's two bytes by its weights (`quads`) into high and low
 * [16][16]; meanwhile the rest of the next group's block b (its first line was asked for as
 * this group was permuted, see amx_int8_linear) is asked for into L2, so that memory streams
 * while the tiles work (a group's weights are read up front, and asked for there they come
 * in one burst: 8 rows +25%). */
#define AMX_INT8_BLOCK(B, H, L)                                                                 \
    do {                                                                                        \
        for (int64_t o = 64; o < block_bytes(W_INT8); o += 64)                                  \
            __builtin_prefetch(block + group_bytes(W_INT8, in) + o, 0, 2);                      \
        _tile_loadd(B, quads, 64);                                                              \
        _tile_loadd(0, s.high + 32 * b, in);                                                    \
        _tile_loadd(1, s.low + 32 * b, in);                                                     \
        _tile_zero(H);                                                                          \
        _tile_zero(L);                                                                          \
        _tile_dpbssd(H, 0, B);                                                                  \
        _tile_dpbusd(L, 1, B);                                                                  \
        _tile_stored(H, high, 64);                                                              \
        _tile_stored(L, low, 64);                                                               \
    } while (0)
ALWAYS_INLINE void amx_int8_block(const uint8_t* block, const uint8_t* quads, SplitRows s,
                                  int64_t in, int64_t b, int32_t (*high)[16], int32_t (*low)[16]) {
    if (b & 1)
        AMX_INT8_BLOCK(7, 5, 6);
    else
        AMX_INT8_BLOCK(2, 3, 4);
}
#undef AMX_INT8_BLOCK

/* Rows [0, n) (n <= R <= 16) of group g's outputs from its blocks in quads
 * (int8_block_as_quads): per block the exact integer products (amx_int8_block), scaled by the
 * weights' and x's scales in float, once the next block's tile work is issued (each block
 * scaled as soon as stored, on one set of tiles: 8 rows +10-15%). */
ALWAYS_INLINE void amx_int8_group_rows(const int64_t R, const uint8_t* wg, const uint8_t* quads,
                                       SplitRows s, const void* bias, void* y, int ydt,
                                       int64_t n, int64_t out, int64_t in, int64_t g) {
    const int64_t nb = in / 32;
    _Alignas(64) int32_t high[2][16][16], low[2][16][16];
    V16 acc[16];
    for (int64_t r = 0; r < R; r++) acc[r] = v_zero();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb)
            amx_int8_block(wg + b * block_bytes(W_INT8), quads + 512 * b, s, in, b, high[b & 1],
                           low[b & 1]);
        if (b == 0) continue;
        const int64_t done = b - 1, i = done & 1;
        const V16 d = v_load_f16((const uint16_t*)(wg + done * block_bytes(W_INT8)));
        for (int64_t r = 0; r < R && r < n; r++)
            acc[r] = add_split_block(acc[r], _mm512_load_si512(high[i][r]),
                                     _mm512_load_si512(low[i][r]), d, s.scale[r * nb + done]);
    }
    store_group_rows(acc, bias, y, ydt, 0, n < R ? n : R, out, g);
}

/* W_INT8, groups [group_begin, group_end), INT8_VNNI_MAX_ROWS < rows <=
 * AMX_INT8_TILES_MAX_ROWS: x split into two bytes (split_rows), each group's weights permuted
 * into AMX's layout once (a tile load right after the stores that made it waits on them: +60%
 * a block), then multiplied as they are in integer tiles. */
static void amx_int8_linear(const uint8_t* w, int xdt, const void* x, const void* bias, void* y,
                            int64_t rows, int64_t out, int64_t in, uint8_t* scratch,
                            int64_t group_begin, int64_t group_end) {
    const SplitRows s = split_rows_area(scratch, rows, in);
    split_rows(xdt, x, s, rows, in);
    uint8_t* quads = (uint8_t*)dequantized_area(scratch, rows, in); /* 16 x in bytes */
    amx_int8_configure(rows);
    for (int64_t g = group_begin; g < group_end; g++) {
        const uint8_t* wg = w + g * group_bytes(W_INT8, in);
        for (int64_t b = 0; b < in / 32; b++) {
            /* One line of the next group's block while permuting keeps memory busy between
             * groups (Sapphire Rapids, one thread, 30 layers' linears + LM head alternating
             * in one process: 1 row -6 to -9%, 4 rows -3%, 8 and 16 unchanged); all of it
             * here: +12%. */
            const uint8_t* block = wg + b * block_bytes(W_INT8);
            __builtin_prefetch(block + group_bytes(W_INT8, in), 0, 2);
            int8_block_as_quads(block + 32, quads + 512 * b);
        }
        if (rows <= 4)
            amx_int8_group_rows(4, wg, quads, s, bias, y, xdt, rows, out, in, g);
        else if (rows <= 8)
            amx_int8_group_rows(8, wg, quads, s, bias, y, xdt, rows, out, in, g);
        else
            amx_int8_group_rows(16, wg, quads, s, bias, y, xdt, rows, out, in, g);
    }
    _tile_release();
}

/* silu_mul_impl of x [gate; up]^T for gate groups [group_begin, group_end) of W_BF16, W_INT8
 * or GGUF weights [2 * width, in] (width % 16 == 0: gate group g pairs with up group
 * g + width / 16), a chunk at a time as amx_dequantized_linear takes them (quantized ones
 * dequantized into `groups`, half gate, half up): the [rows, 2 * width] product never reaches
 * memory. */
static void amx_silu_mul(int wfmt, const uint8_t* w, const uint16_t* x, void* y, int ydt,
                         int64_t rows, int64_t width, int64_t in, uint16_t* groups,
                         int64_t group_begin, int64_t group_end) {
    const int64_t half = amx_chunk_groups(in) / 2;
    const int64_t up_groups = width / 16, bytes = group_bytes(wfmt, in);
    int64_t configured = 0;
    float buffers[2][2][AMX_LINEAR_ROWS][16];
    AmxProducts pending = {NULL};
    if (wfmt != W_BF16 && rows <= AMX_LINEAR_ROWS) {
        /* One pass takes every row: group g's gate and up multiply from one half of `groups`
         * while g + 1's are dequantized into the other (AmxDequantizing). */
        if (group_begin >= group_end) return; /* an empty share */
        amx_configure_rows(rows, &configured);
        group_to_bf16(wfmt, w + group_begin * bytes, in, groups);
        group_to_bf16(wfmt, w + (group_begin + up_groups) * bytes, in, groups + 16 * in);
        for (int64_t g = group_begin; g < group_end; g++) {
            const uint16_t* current = groups + 32 * in * ((g - group_begin) % 2);
            uint16_t* other = groups + 32 * in * ((g - group_begin + 1) % 2);
            const AmxDequantizing dequantizing = {
                wfmt, 2, {w + (g + 1) * bytes, w + (g + 1 + up_groups) * bytes},
                {other, other + 16 * in}};
            const AmxProducts next = {NULL, y, NULL, ydt, 2, 1, 0, rows, width, g, 0};
            amx_pass(&pending, buffers, next, current, current + 16 * in, x, in, 0,
                     g + 1 < group_end ? &dequantizing : NULL);
        }
        amx_products_finish(&pending, pending.n);
        _tile_release();
        return;
    }
    for (int64_t g0 = group_begin; g0 < group_end; g0 += half) {
        const int64_t g1 = g0 + half < group_end ? g0 + half : group_end;
        const uint16_t *gate = (const uint16_t*)(w + g0 * bytes),
                       *up = (const uint16_t*)(w + (g0 + up_groups) * bytes);
        if (wfmt != W_BF16) {
            for (int64_t g = g0; g < g1; g++) {
                group_to_bf16(wfmt, w + g * bytes, in, groups + (g - g0) * 16 * in);
                group_to_bf16(wfmt, w + (g + up_groups) * bytes, in,
                              groups + (half + g - g0) * 16 * in);
            }
            gate = groups;
            up = groups + half * 16 * in;
        }
        for (int64_t first = 0; first < rows; first += AMX_LINEAR_ROWS) {
            const int64_t n = rows - first < AMX_LINEAR_ROWS ? rows - first : AMX_LINEAR_ROWS;
            amx_configure_rows(n, &configured);
            for (int64_t g = g0; g < g1; g++) {
                const AmxProducts next = {NULL, y, NULL, ydt, 2, 1, first, n, width, g, 0};
                amx_pass(&pending, buffers, next, gate + (g - g0) * 16 * in,
                         up + (g - g0) * 16 * in, x, in, wfmt == W_BF16 && first == 0, NULL);
            }
        }
    }
    amx_products_finish(&pending, pending.n);
    _tile_release();
}
#endif

/* Whether `linear` multiplies bfloat16 weights by bfloat16 rows in AMX tiles here (from 3
 * rows): the amx build, a kernel that grants the tiles. */
int linear_has_amx(void) {
#if defined(__AMX_BF16__)
    return pf_amx_permitted();
#else
    return 0;
#endif
}

/* Rows up to which `linear` multiplies W_INT8 weights by x split into two bytes per block of
 * 32 (split_rows; vnni_int8_linear, amx_int8_linear), or 0: never. */
int64_t linear_split_x_max_rows(int wfmt) {
    if (wfmt != W_INT8) return 0;
#if defined(__AMX_BF16__)
    if (pf_amx_permitted()) return AMX_INT8_TILES_MAX_ROWS;
#endif
#if HAS_SPLIT_X
    return INT8_VNNI_MAX_ROWS;
#else
    return 0;
#endif
}

/* Rows from which `linear` multiplies weights of format wfmt (W_INT8 or GGUF) in bfloat16
 * here, in AMX tiles or bf16 dot products (x rounded to bfloat16, each weight dequantized
 * and rounded to bfloat16), or 0: never. */
int64_t linear_bf16_min_rows(int wfmt) {
#if defined(__AMX_BF16__)
    if (pf_amx_permitted()) return amx_dequantized_min_rows(wfmt);
#endif
#if HAS_DPBF16
    return wfmt == W_INT8 ? INT8_DPBF16_MIN_ROWS : 0;
#else
    return 0;
#endif
}

/* x's n values as type dt: x itself when it is (xdt == dt), else converted into scratch
 * (rounded to nearest even). */
ALWAYS_INLINE const void* x_as(int xdt, int dt, const void* x, int64_t n, uint8_t* scratch) {
    if (xdt == dt) return x;
    for (int64_t i = 0; i < n; i += 16)
        store_dt_n(scratch, i, n - i, load_dt_n(x, i, n - i, xdt), dt);
    return scratch;
}

/* Groups [group_begin, group_end) of y = x W^T (+ bias): outputs 16 * group_begin onwards. */
ALWAYS_INLINE void linear_impl(int wfmt, int xdt, const void* w, const void* x, const void* bias,
                               void* y, int64_t rows, int64_t out, int64_t in, uint8_t* scratch,
                               int64_t group_begin, int64_t group_end) {
#if HAS_SPLIT_X
    if (wfmt == W_INT8 && rows > 0 && rows <= INT8_VNNI_MAX_ROWS) {
        vnni_int8_linear((const uint8_t*)w, xdt, x, bias, y, rows, out, in, scratch, group_begin,
                         group_end);
        return;
    }
#endif
#if defined(__AMX_BF16__)
    if (wfmt == W_BF16 && xdt == DT_BF16 && rows >= 3 && in % 32 == 0 && pf_amx_permitted()) {
        /* As below, a chunk of groups stays in L2 while every pass of rows crosses it. */
        const int64_t chunk = amx_chunk_groups(in);
        int64_t configured = 0;
        for (int64_t g0 = group_begin; g0 < group_end; g0 += chunk) {
            const int64_t g1 = g0 + chunk < group_end ? g0 + chunk : group_end;
            for (int64_t first = 0; first < rows; first += AMX_LINEAR_ROWS) {
                const int64_t n = rows - first < AMX_LINEAR_ROWS ? rows - first : AMX_LINEAR_ROWS;
                amx_configure_rows(n, &configured);
                amx_groups_passes((const uint16_t*)w + g0 * 16 * in, (const uint16_t*)x, bias,
                                  y, xdt, first, n, out, in, g0, g1, first == 0);
            }
        }
        _tile_release();
        return;
    }
    if (wfmt == W_INT8 && rows > 0 && rows <= AMX_INT8_TILES_MAX_ROWS && pf_amx_permitted()) {
        amx_int8_linear((const uint8_t*)w, xdt, x, bias, y, rows, out, in, scratch, group_begin,
                        group_end);
        return;
    }
    if (amx_dequantized_min_rows(wfmt) && rows >= amx_dequantized_min_rows(wfmt) &&
        pf_amx_permitted()) {
        amx_dequantized_linear(wfmt, (const uint8_t*)w, x_as(xdt, DT_BF16, x, rows * in, scratch),
                               bias, y, xdt, rows, out, in, dequantized_area(scratch, rows, in),
                               group_begin, group_end);
        return;
    }
#endif
#if HAS_DPBF16
    if (wfmt == W_INT8 && rows >= INT8_DPBF16_MIN_ROWS) {
        int8_dpbf16_linear((const uint8_t*)w, x_as(xdt, DT_BF16, x, rows * in, scratch), bias,
                           y, xdt, rows, out, in, dequantized_area(scratch, rows, in), group_begin,
                           group_end);
        return;
    }
#endif
    const int dpbf16 =
        HAS_DPBF16 && ((wfmt == W_BF16 && rows <= dpbf16_max_rows) ||
                       (wfmt == W_INT8 && xdt == DT_BF16 && rows >= INT8_BF16X_MIN_ROWS));
    /* x as the format's kernel reads it: bfloat16 pairs (vdpbf16ps), int8 blocks or float. */
    const uint8_t* xs;
    int64_t x_row_bytes = in * (int64_t)sizeof(float);
    if (is_quantized(wfmt)) {
        quantize_rows(wfmt, xdt, x, scratch, rows, in);
        xs = scratch;
    } else if (dpbf16) {
        x_row_bytes = in * 2;
        xs = x_as(xdt, DT_BF16, x, rows * in, scratch);
    } else {
        xs = x_as(xdt, DT_F32, x, rows * in, scratch);
    }
    const int is_paired = is_paired_call(wfmt, dpbf16, rows);
    /* A chunk of groups stays in L2 while every tile of rows passes over it: the weights
     * come from memory once per call, however many rows. The second tile's pass over a chunk
     * of dense weights asks for the next chunk into L2 (at each line, the line a chunk on), so
     * that the next chunk's first pass finds its weights there: memory then streams while the
     * passes compute. Zen 5, one thread, 30 layers' linears and the LM head from memory,
     * against the first pass reading from memory (its prefetch 8 KiB ahead): bfloat16 (dot
     * products) 16 rows -15%, 24 rows -12%, 32 rows -8%; float32 32 rows -6%; every pass
     * after the first asking for it (the same lines again) no better; engine decode steps of
     * 12 bfloat16 sequences (a second tile of 4 rows asking too) -7 to -9%. Not quantized
     * blocks, whose loops are bound by instructions: Q4_1 at 32 rows and int8 at 12 rows +5%.
     * One tile of rows makes one pass, kept in L2 for none: paired groups then run the whole
     * range as two streams (Zen 5, engine decode steps, builds alternating: bfloat16 6 and 8
     * sequences -1 to -5%, float32 4 sequences -3%; linears at 6 and 8 rows -5%). */
    int64_t chunk = rows <= MAX_ROW_TILE ? group_end - group_begin
                                         : CHUNK_BYTES / group_bytes(wfmt, in);
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t g0 = group_begin; g0 < group_end; g0 += chunk) {
        const int64_t g1 = g0 + chunk < group_end ? g0 + chunk : group_end;
        for (int64_t first = 0; first < rows; first += MAX_ROW_TILE) {
            const int64_t n = rows - first < MAX_ROW_TILE ? rows - first : MAX_ROW_TILE;
            const int64_t next_chunk =
                first == MAX_ROW_TILE && g1 < group_end ? (g1 - g0) * group_bytes(wfmt, in) : 0;
#define TILE(R)                                                                                 \
    linear_tile(R, wfmt, dpbf16, is_paired, xdt, w, xs, x_row_bytes, bias, y, first, n, out, in, \
                g0, g1, next_chunk, rows <= MAX_ROW_TILE)
            if (n == 1)
                TILE(1);
            else if (n == 2)
                TILE(2);
            else if (n <= 4)
                TILE(4);
#if MAX_ROW_TILE > 4
            else
                TILE(MAX_ROW_TILE);
#endif
#undef TILE
        }
    }
}

/* linear_impl for a format known at run time. */
static void linear_groups(int wfmt, int xdt, const void* w, const void* x, const void* bias,
                          void* y, int64_t rows, int64_t out, int64_t in, uint8_t* scratch,
                          int64_t group_begin, int64_t group_end) {
#define LINEAR_CASE(F)                                                                          \
    case F:                                                                                     \
        if (xdt == DT_BF16)                                                                     \
            linear_impl(F, DT_BF16, w, x, bias, y, rows, out, in, scratch, group_begin,         \
                        group_end);                                                             \
        else                                                                                    \
            linear_impl(F, DT_F32, w, x, bias, y, rows, out, in, scratch, group_begin,          \
                        group_end);                                                             \
        break;
    switch (wfmt) {
        LINEAR_CASE(W_F32)
        LINEAR_CASE(W_BF16)
        LINEAR_CASE(W_Q8_0)
        LINEAR_CASE(W_Q4_0)
        LINEAR_CASE(W_Q4_1)
        LINEAR_CASE(W_INT8)
    }
#undef LINEAR_CASE
}

/* One member's share of a linear: its groups, its slice of the scratch. */
ALWAYS_INLINE void linear_share(const Team* team, int wfmt, int xdt, const void* w, const void* x,
                                const void* bias, void* y, int64_t rows, int64_t out, int64_t in,
                                uint8_t* scratch) {
    int64_t begin, end;
    team_share(team, (out + 15) / 16, &begin, &end);
    uint8_t* own = scratch + team->index * linear_scratch(wfmt, rows, in);
    linear_groups(wfmt, xdt, w, x, bias, y, rows, out, in, own, begin, end);
}

typedef struct {
    int wfmt, xdt;
    const void *w, *x, *bias;
    void* y;
    int64_t rows, out, in;
    uint8_t* scratch;
} LinearCall;

static void linear_member(void* arg, const Team* team) {
    const LinearCall* c = (const LinearCall*)arg;
    linear_share(team, c->wfmt, c->xdt, c->w, c->x, c->bias, c->y, c->rows, c->out, c->in,
                 c->scratch);
}

/* Work per thread below which another thread costs more to start than it saves, in weight
 * bytes times passes of row tiles (the work of a 1 MiB weight streamed for one tile). */
#define LINEAR_WORK_PER_THREAD (1 << 20)

/* Threads a standalone linear of these weights and rows runs on, at most num_threads. */
int64_t linear_threads(int wfmt, int64_t rows, int64_t out, int64_t in, int64_t num_threads) {
    const int64_t tiles = (rows + MAX_ROW_TILE - 1) / MAX_ROW_TILE;
    const int64_t useful =
        ((out + 15) / 16) * group_bytes(wfmt, in) * tiles / LINEAR_WORK_PER_THREAD;
    const int64_t n = num_threads < useful ? num_threads : useful;
    return n < 1 ? 1 : n > MAX_TEAM ? MAX_TEAM : n;
}

/* y [rows, out] (type xdt, like x and bias) = x [rows, in] W^T (+ bias) on
 * linear_threads(wfmt, rows, out, in, num_threads) threads, each a share of the output groups;
 * scratch holds that many times linear_scratch(wfmt, rows, in) bytes. */
void linear(int wfmt, int xdt, const void* w, const void* x, const void* bias, void* y,
            int64_t rows, int64_t out, int64_t in, uint8_t* scratch, int64_t num_threads) {
    LinearCall call = {wfmt, xdt, w, x, bias, y, rows, out, in, scratch};
    run_team(linear_threads(wfmt, rows, out, in, num_threads), linear_member, &call);
}

/* Rows from which linear_silu_mul runs weights of format wfmt here, or 0: never (it needs
 * their AMX path, which W_BF16 takes from 3 rows of bfloat16 x). */
int64_t linear_silu_mul_min_rows(int wfmt) {
#if defined(__AMX_BF16__)
    if (pf_amx_permitted()) return wfmt == W_BF16 ? 3 : amx_dequantized_min_rows(wfmt);
#endif
    (void)wfmt;
    return 0;
}

typedef struct {
    int wfmt, xdt;
    const void *w, *x;
    void* y;
    int64_t rows, width, in;
    uint8_t* scratch;
} SiluMulLinearCall;

static void linear_silu_mul_member(void* arg, const Team* team) {
#if defined(__AMX_BF16__)
    const SiluMulLinearCall* c = (const SiluMulLinearCall*)arg;
    int64_t begin, end;
    team_share(team, c->width / 16, &begin, &end);
    uint8_t* own = c->scratch + team->index * linear_scratch(c->wfmt, c->rows, c->in);
    amx_silu_mul(c->wfmt, (const uint8_t*)c->w, x_as(c->xdt, DT_BF16, c->x, c->rows * c->in, own),
                 c->y, c->xdt, c->rows, c->width, c->in, dequantized_area(own, c->rows, c->in),
                 begin, end);
#else
    (void)arg, (void)team;
#endif
}

/* y [rows, width] (type xdt, like x) = silu(x G^T) * (x U^T) for W = [G; U] [2 * width, in]
 * of format wfmt: linear and silu_mul in one pass, on the threads and scratch linear takes for
 * W. Returns 0, or 1 having computed nothing unless rows >= linear_silu_mul_min_rows(wfmt)
 * > 0, width % 16 == 0 and in % 32 == 0 (other weights would be read as if in AMX's layout). */
int linear_silu_mul(int wfmt, int xdt, const void* w, const void* x, void* y, int64_t rows,
                    int64_t width, int64_t in, uint8_t* scratch, int64_t num_threads) {
    const int64_t min_rows = linear_silu_mul_min_rows(wfmt);
    if (min_rows == 0 || rows < min_rows || width % 16 || in % 32) return 1;
    SiluMulLinearCall call = {wfmt, xdt, w, x, y, rows, width, in, scratch};
    run_team(linear_threads(wfmt, rows, 2 * width, in, num_threads), linear_silu_mul_member,
             &call);
    return 0;
}

/* ---- memory bandwidth probe ------------------------------------------------------------- */

/* Streams of p, one per member, summed into that member's partial (the bandwidth probe). */
typedef struct {
    const float* p;
    int64_t n;
    float partial[MAX_TEAM];
} StreamCall;

static void stream_member(void* arg, const Team* team) {
    StreamCall* c = (StreamCall*)arg;
    int64_t begin, end;
    team_share(team, c->n / 64, &begin, &end);
    V16 a = v_zero(), b = v_zero(), d = v_zero(), e = v_zero();
    for (int64_t i = 64 * begin; i < 64 * end; i += 64) {
        a = v_add(a, v_load(c->p + i));
        b = v_add(b, v_load(c->p + i + 16));
        d = v_add(d, v_load(c->p + i + 32));
        e = v_add(e, v_load(c->p + i + 48));
    }
    c->partial[team->index] = v_sum(v_add(v_add(a, b), v_add(d, e)));
}

/* The sum of n floats (n % 64 == 0), read as one stream per thread on num_threads threads:
 * what the weight reads of a GEMV split over those threads cost. */
float stream_sum(const float* p, int64_t n, int64_t num_threads) {
    StreamCall call = {p, n, {0}};
    run_team(num_threads, stream_member, &call);
    float sum = 0.0f;
    for (int64_t i = 0; i < MAX_TEAM; i++) sum += call.partial[i];
    return sum;
}

/* ---- a whole decode step: every layer in one call --------------------------------------- */
/*
 * For a batch where every sequence has exactly one new token (rows = sequences), the decoder
 * stack runs here end to end with the kernels above, in the same order and arithmetic as the
 * per-op path (llama.py), so the two agree exactly; Python only embeds the tokens, computes
 * the rotary angles and applies the LM head. All integer fields are int64 and all pointers
 * void* so the ctypes mirror (cpu_ops.py) needs no padding rules.
 */
typedef struct {
    int64_t format, out, in;
    const void* data;
    const void* bias; /* or NULL */
} PackedLinear;

typedef struct {
    const void* input_norm;
    const void* post_norm;
    PackedLinear qkv, o, gate_up, down;
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t dt, kv_dt; /* activation and KV cache element types */
    double eps, scale;
    const DecoderLayer* layers;
    const void* final_norm;
} DecoderModel;

/* decode_forward's scratch: activations, then each member's attention scratch and each
 * member's linear scratch. */
typedef struct {
    int64_t activations, attention, linears;
} DecodeScratch;

ALWAYS_INLINE DecodeScratch decode_scratch(const DecoderModel* m, int64_t rows) {
    const int64_t q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int64_t values = rows * (2 * m->hidden + 2 * q_size + 2 * kv_size + 3 * m->intermediate);
    int64_t linears = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const PackedLinear* layer_linears[4] = {&m->layers[l].qkv, &m->layers[l].o,
                                                &m->layers[l].gate_up, &m->layers[l].down};
        for (int i = 0; i < 4; i++) {
            const PackedLinear* w = layer_linears[i];
            const int64_t n = linear_scratch((int)w->format, rows, w->in);
            linears = n > linears ? n : linears;
        }
    }
    return (DecodeScratch){round_up_64(values * dt_size(m->dt)),
                           round_up_64(m->num_heads * (2 * m->head_dim + UNIT + 17) * 4), linears};
}

/* Threads decode_forward runs on, at most num_threads. */
int64_t decode_threads(int64_t num_threads) {
    return num_threads < 1 ? 1 : num_threads > MAX_TEAM ? MAX_TEAM : num_threads;
}

/* Scratch bytes decode_forward needs for `rows` rows on num_threads threads. */
int64_t decode_scratch_bytes(const DecoderModel* m, int64_t rows, int64_t num_threads) {
    const DecodeScratch s = decode_scratch(m, rows);
    return s.activations + decode_threads(num_threads) * (s.attention + s.linears);
}

/* K or V of each row (dt) -> its cache slot (kv_dt), rounded once. */
ALWAYS_INLINE void write_kv(int dt, int kv_dt, const void* src, int64_t src_stride, void* cache,
                            const int64_t* slots, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < width; j += 16) {
            const int64_t n = width - j;
            store_dt_n(cache, slots[r] * width + j, n, load_dt_n(src, r * src_stride + j, n, dt),
                       kv_dt);
        }
}

/* A step's K and V rows [rows, width] (dt, rows src_stride elements apart: views of the qkv
 * product) -> their cache slots (kv_dt): what torch's index_copy_ of the strided views does
 * (Sapphire Rapids, one thread, 512 bf16 rows of 3 x 64: 82 us a layer there, 28 here with
 * the call: 1.6 ms of a 512-token prompt's prefill). */
void write_kv_rows(int dt, int kv_dt, const void* k, const void* v, int64_t src_stride,
                   void* k_cache, void* v_cache, const int64_t* slots, int64_t rows,
                   int64_t width) {
    write_kv(dt, kv_dt, k, src_stride, k_cache, slots, rows, width);
    write_kv(dt, kv_dt, v, src_stride, v_cache, slots, rows, width);
}

/* Positions a sequence's attention costs beyond its length (per-sequence setup). */
#define ATTENTION_ROW_COST 64

/* This member's share [*begin, *end) of the sequences, split by attention cost. */
ALWAYS_INLINE void attention_share(const Team* team, const int64_t* seq_lens, int64_t rows,
                                   int64_t* begin, int64_t* end) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++) total += seq_lens[r] + ATTENTION_ROW_COST;
    /* Row r goes to the member whose share of `total` holds the midpoint of r's cost. */
    *begin = rows, *end = rows;
    int64_t before = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t cost = seq_lens[r] + ATTENTION_ROW_COST;
        const int64_t owner = (2 * before + cost) * team->size / (2 * total);
        if (owner >= team->index && *begin == rows) *begin = r;
        if (owner > team->index) {
            *end = r;
            break;
        }
        before += cost;
    }
}

/* The arguments of decode_forward, shared by the members. */
typedef struct {
    const DecoderModel* m;
    int64_t rows;
    void* hidden;
    const float *cos, *sin;
    void* kv_cache;
    int64_t num_blocks, block_size;
    const int64_t *slot_mapping, *block_tables, *seq_lens;
    int64_t max_blocks;
    uint8_t* scratch;
} DecodeCall;

/*
 * One member's part of the step: linears split by output groups, attention by sequences,
 * the rest by rows, with a team_sync wherever a phase reads what others wrote.
 * hidden [rows, hidden] (dt): the token embeddings in, the final-normed states out.
 * cos/sin float [rows, head_dim / 2]; kv_cache [num_layers, 2, num_blocks, block_size,
 * num_kv_heads, head_dim] (kv_dt); slot_mapping [rows]; block_tables [rows, max_blocks],
 * seq_lens [rows] int64 (including the new token).
 */
ALWAYS_INLINE void decode_forward_impl(int dt, int kv_dt, const DecodeCall* c, const Team* team) {
    const DecoderModel* m = c->m;
    const int64_t rows = c->rows, H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, es = dt_size(dt);
    uint8_t* p = c->scratch;
    uint8_t* residual = p;
    uint8_t* x = p += rows * H * es;            /* normed input of a projection */
    uint8_t* qkv = p += rows * H * es;          /* [rows, q | k | v], then attention's output */
    uint8_t* queries = p += rows * qkv_size * es; /* [rows, q_size] */
    uint8_t* gate_up = p += rows * q_size * es; /* [rows, 2I] */
    uint8_t* act = p += rows * 2 * I * es;      /* [rows, I] */
    uint8_t* hidden = (uint8_t*)c->hidden;
    const DecodeScratch sizes = decode_scratch(m, rows);
    float* attention_scratch =
        (float*)(c->scratch + sizes.activations + team->index * sizes.attention);
    uint8_t* linear_scratch_area =
        c->scratch + sizes.activations + team->size * sizes.attention;
    const int64_t layer_stride = 2 * c->num_blocks * c->block_size * kv_size * dt_size(kv_dt);
    int64_t r0, r1, s0, s1; /* this member's rows, and its sequences for attention */
    team_share(team, rows, &r0, &r1);
    attention_share(team, c->seq_lens, rows, &s0, &s1);
    const int64_t n = r1 - r0;
#define LINEAR(w, in_rows, out_rows)                                                            \
    linear_share(team, (int)(w)->format, dt, (w)->data, in_rows, (w)->bias, out_rows, rows,    \
                 (w)->out, (w)->in, linear_scratch_area)
    memcpy(residual + r0 * H * es, hidden + r0 * H * es, n * H * es);
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecoderLayer* layer = &m->layers[l];
        /* Layer 0's stream starts at the embeddings; later ones add the MLP output. */
        add_rms_norm_impl(dt, hidden + r0 * H * es, residual + r0 * H * es, layer->input_norm,
                          x + r0 * H * es, n, H, (float)m->eps, l > 0);
        team_sync(team);
        LINEAR(&layer->qkv, x, qkv);
        team_sync(team);
        uint8_t* own_qkv = qkv + r0 * qkv_size * es;
        rotary_impl(dt, own_qkv, n, qkv_size, m->num_heads + m->num_kv_heads, D,
                    c->cos + r0 * D / 2, c->sin + r0 * D / 2);
        uint8_t* k_cache = (uint8_t*)c->kv_cache + l * layer_stride;
        uint8_t* v_cache = k_cache + layer_stride / 2;
        write_kv(dt, kv_dt, own_qkv + q_size * es, qkv_size, k_cache, c->slot_mapping + r0, n,
                 kv_size);
        write_kv(dt, kv_dt, own_qkv + (q_size + kv_size) * es, qkv_size, v_cache,
                 c->slot_mapping + r0, n, kv_size);
        /* The queries are rows of qkv: copy them out contiguous for the attention kernel. */
        for (int64_t r = r0; r < r1; r++)
            memcpy(queries + r * q_size * es, qkv + r * qkv_size * es, q_size * es);
        team_sync(team); /* every K/V written, every query copied: qkv is free */
        if (s1 > s0)
            paged_decode(dt, kv_dt, queries + s0 * q_size * es, k_cache, v_cache,
                         c->block_tables + s0 * c->max_blocks, c->seq_lens + s0,
                         qkv + s0 * q_size * es, attention_scratch, s1 - s0, m->num_heads,
                         m->num_kv_heads, D, c->block_size, c->max_blocks, (float)m->scale);
        team_sync(team);
        LINEAR(&layer->o, qkv, hidden);
        team_sync(team);
        add_rms_norm_impl(dt, hidden + r0 * H * es, residual + r0 * H * es, layer->post_norm,
                          x + r0 * H * es, n, H, (float)m->eps, 1);
        team_sync(team);
        LINEAR(&layer->gate_up, x, gate_up);
        team_sync(team);
        silu_mul_impl(dt, gate_up + r0 * 2 * I * es, act + r0 * I * es, n, I);
        team_sync(team);
        LINEAR(&layer->down, act, hidden);
        team_sync(team);
    }
#undef LINEAR
    add_rms_norm_impl(dt, hidden + r0 * H * es, residual + r0 * H * es, m->final_norm,
                      x + r0 * H * es, n, H, (float)m->eps, 1);
    memcpy(hidden + r0 * H * es, x + r0 * H * es, n * H * es);
}

static void decode_member(void* arg, const Team* team) {
    const DecodeCall* c = (const DecodeCall*)arg;
    if (c->m->dt == DT_F32 && c->m->kv_dt == DT_F32)
        decode_forward_impl(DT_F32, DT_F32, c, team);
    else if (c->m->dt == DT_F32)
        decode_forward_impl(DT_F32, DT_BF16, c, team);
    else if (c->m->kv_dt == DT_BF16)
        decode_forward_impl(DT_BF16, DT_BF16, c, team);
    else
        decode_forward_impl(DT_BF16, DT_F32, c, team);
}

/* One decode step of every layer for `rows` single-token sequences (see decode_forward_impl)
 * on decode_threads(num_threads) threads; scratch holds decode_scratch_bytes(m, rows,
 * num_threads) bytes. */
void decode_forward(const DecoderModel* m, int64_t rows, void* hidden, const float* cos,
                    const float* sin, void* kv_cache, int64_t num_blocks, int64_t block_size,
                    const int64_t* slot_mapping, const int64_t* block_tables,
                    const int64_t* seq_lens, int64_t max_blocks, uint8_t* scratch,
                    int64_t num_threads) {
    DecodeCall call = {m,         rows,       hidden,       cos,          sin,
                       kv_cache,  num_blocks, block_size,   slot_mapping, block_tables,
                       seq_lens,  max_blocks, scratch};
    run_team(decode_threads(num_threads), decode_member, &call);
}

/* sizeof each struct the ctypes mirror (cpu_ops.py, `_STRUCTS`) passes, in that order: it
 * checks them at load, so a field changed on one side only fails loudly, not as a misread. */
void pdserve_struct_sizes(int64_t* sizes) {
    sizes[0] = sizeof(PackedLinear);
    sizes[1] = sizeof(DecoderLayer);
    sizes[2] = sizeof(DecoderModel);
}
