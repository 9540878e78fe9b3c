/* A helper thread that lends a second core to one thread's work: on a two-core machine a
 * step too small to share out over two model lanes runs on one, and this thread takes part
 * of its matmuls and of its decode attention (tokentape/kernels/cpu_native.py starts it).
 *
 * A job is `count` items. The caller posts it and works through the items itself; the helper,
 * if it is awake, claims items too. Items are claimed one at a time from one atomic word, so
 * a helper that comes late (asleep, or its core busy with another thread) leaves the caller
 * its share and costs nothing but the wait for an item it already holds. Which worker runs
 * an item changes no bit of its result: every item computes the same thing either way.
 *
 * Between jobs the helper spins for up to `spin_us` (the gaps between a forward pass's
 * matmuls are tens of microseconds, a futex wake-up costs about as much), then sleeps on a
 * condition variable until the next job (between steps it takes no CPU).
 *
 * The word: bits 63..32 the job's generation, 31..16 its item count, 15..0 the next item to
 * claim. A claim is a compare-and-swap on the whole word, so it can only take an item of the
 * job whose generation it read, and only while that job has items left.
 */
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "helper.h"
#include "kernels.h"

#define TT_MAX_ITEMS 0xffff

struct tt_helper {
    _Atomic uint64_t word;
    _Atomic int64_t helper_done; /* items of the current job the helper has finished */
    _Atomic int64_t items_helped; /* items the helper has run, all jobs together */
    /* The current job: written before its generation is published, read after. */
    _Atomic(tt_item_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int sleeping;
    _Atomic int stop;
    int64_t spin_ns;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
};

static inline uint32_t gen_of(uint64_t w) { return (uint32_t)(w >> 32); }
static inline int64_t count_of(uint64_t w) { return (int64_t)((w >> 16) & 0xffff); }
static inline int64_t next_of(uint64_t w) { return (int64_t)(w & 0xffff); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim the next item of generation `gen`: its index, or -1 when that job has none left (or
 * is no longer the current one). */
static int64_t claim(tt_helper *h, uint32_t gen) {
    uint64_t w = atomic_load_explicit(&h->word, memory_order_acquire);
    while (gen_of(w) == gen && next_of(w) < count_of(w)) {
        if (atomic_compare_exchange_weak_explicit(&h->word, &w, w + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return next_of(w);
    }
    return -1;
}

/* Wait until the word shows a generation other than `seen`: spin, then sleep. Returns 0 when
 * told to stop. */
static int wait_for_job(tt_helper *h, uint32_t seen) {
    int64_t start = now_ns();
    for (unsigned spins = 1;; spins++) {
        if (gen_of(atomic_load_explicit(&h->word, memory_order_acquire)) != seen) return 1;
        if (atomic_load_explicit(&h->stop, memory_order_relaxed)) return 0;
        _mm_pause();
        if (spins % 256 == 0 && now_ns() - start > h->spin_ns) {
            pthread_mutex_lock(&h->lock);
            atomic_store(&h->sleeping, 1);
            /* Dekker with tt_helper_run: it publishes the word, then reads `sleeping`; this
             * sets `sleeping`, then reads the word (both sequentially consistent), so one of
             * the two sees the other's write and no wake-up is missed. */
            while (gen_of(atomic_load(&h->word)) == seen && !atomic_load(&h->stop))
                pthread_cond_wait(&h->wake, &h->lock);
            atomic_store(&h->sleeping, 0);
            pthread_mutex_unlock(&h->lock);
            start = now_ns();
        }
    }
}

static void *helper_main(void *arg) {
    tt_helper *h = arg;
    omp_set_num_threads(1); /* what it runs is its share of one thread's work */
    uint32_t seen = gen_of(atomic_load(&h->word));
    while (wait_for_job(h, seen)) {
        const uint32_t gen = gen_of(atomic_load_explicit(&h->word, memory_order_acquire));
        /* Read before claiming: a successful claim proves they were this generation's (the
         * caller writes the next job's only after every item of this one is claimed). */
        const tt_item_fn fn = atomic_load_explicit(&h->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&h->ctx, memory_order_relaxed);
        for (int64_t item; (item = claim(h, gen)) >= 0;) {
            fn(ctx, item, 1);
            atomic_fetch_add_explicit(&h->helper_done, 1, memory_order_release);
            atomic_fetch_add_explicit(&h->items_helped, 1, memory_order_relaxed);
        }
        seen = gen;
    }
    return NULL;
}

/* Start a helper; NULL where the thread cannot be started. */
tt_helper *tt_helper_start(int64_t spin_us) {
    tt_helper *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->spin_ns = spin_us * 1000;
    pthread_mutex_init(&h->lock, NULL);
    pthread_cond_init(&h->wake, NULL);
    if (pthread_create(&h->thread, NULL, helper_main, h) != 0) {
        pthread_cond_destroy(&h->wake);
        pthread_mutex_destroy(&h->lock);
        free(h);
        return NULL;
    }
    return h;
}

/* How many items the helper has run since it started. */
int64_t tt_helper_items(tt_helper *h) {
    return atomic_load_explicit(&h->items_helped, memory_order_relaxed);
}

/* Stop the helper and free it; no job may be running. */
void tt_helper_stop(tt_helper *h) {
    if (!h) return;
    pthread_mutex_lock(&h->lock);
    atomic_store(&h->stop, 1);
    pthread_cond_signal(&h->wake);
    pthread_mutex_unlock(&h->lock);
    pthread_join(h->thread, NULL);
    pthread_cond_destroy(&h->wake);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

void tt_helper_run(tt_helper *h, tt_item_fn fn, void *ctx, int64_t count) {
    if (!h || count <= 1 || count > TT_MAX_ITEMS) {
        for (int64_t i = 0; i < count; i++) fn(ctx, i, 0);
        return;
    }
    atomic_store_explicit(&h->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&h->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&h->helper_done, 0, memory_order_relaxed);
    const uint32_t gen = gen_of(atomic_load_explicit(&h->word, memory_order_relaxed)) + 1;
    atomic_store(&h->word, (uint64_t)gen << 32 | (uint64_t)count << 16);
    if (atomic_load(&h->sleeping)) {
        pthread_mutex_lock(&h->lock);
        pthread_cond_signal(&h->wake);
        pthread_mutex_unlock(&h->lock);
    }
    int64_t mine = 0;
    for (int64_t item; (item = claim(h, gen)) >= 0; mine++) fn(ctx, item, 0);
    while (atomic_load_explicit(&h->helper_done, memory_order_acquire) != count - mine)
        _mm_pause();
}

typedef struct {
    tt_sgemm_compute compute;
    const float *x;
    float *out;
    const void *const *parts;
    const int64_t *first_column; /* num_parts + 1 */
    int64_t rows, k, n;
} SplitGemm;

static void gemm_part(void *ctx, int64_t part, int worker) {
    (void)worker;
    const SplitGemm *g = ctx;
    const int64_t col = g->first_column[part];
    enum { ROW_MAJOR = 101, NO_TRANS = 111, PACKED = 151 };
    g->compute(ROW_MAJOR, NO_TRANS, PACKED, (int)g->rows, (int)(g->first_column[part + 1] - col),
               (int)g->k, g->x, (int)g->k, g->parts[part], (int)g->k, 0.0f, g->out + col,
               (int)g->n);
}

/* out [rows, n] = x [rows, k] @ W.T, W's output columns in `num_parts` parts, part i packed
 * by MKL on its own (columns first_column[i]..first_column[i + 1] - 1): each part one item. A
 * column's result is the same whichever part holds it, so the split changes no bit. */
void tt_helper_sgemm_f32(tt_helper *h, tt_sgemm_compute compute, const float *x, int64_t rows,
                         int64_t k, const void *const *parts, const int64_t *first_column,
                         int64_t num_parts, float *out) {
    const SplitGemm g = {compute, x, out, parts, first_column, rows, k, first_column[num_parts]};
    tt_helper_run(h, gemm_part, (void *)&g, num_parts);
}
