/* A parallel for whose caller never waits for a thread that took no work.
 *
 *     rayllm_parallel_for(num_items, num_threads, fn, ctx);   // fn(ctx, i) for every i, then returns
 *
 * Served, a worker shares its cores with the ingress, the scheduler and Serve's proxy, which
 * wake at every step. An OpenMP parallel region ends at a barrier every thread of the team
 * must reach, so when the OS hands one thread's core to them for a few ms, the other thread
 * finishes the region's work and then waits for it, and the step loses the whole time. Here
 * items are claimed one at a time from a shared counter by the caller and the helpers alike,
 * and the caller waits only for items that someone has claimed: a helper that is not running
 * claims nothing, and the caller does its share. A helper that lost its core in the middle of an
 * item is waited for asleep, not spinning (WAIT_SPINS), so that it can have the caller's core.
 *
 * The helpers (num_threads - 1, started on first use, grown when more are asked for) spin
 * for a short while after each job and then sleep on a futex until the next one. One job at
 * a time: a second caller arriving while a job runs (another Python thread, a nested call)
 * runs its items itself. A forked child starts with no helpers.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "entry_points.h"

static void run_inline(int64_t num_items, ParallelBody fn, void *ctx) {
    for (int64_t i = 0; i < num_items; i++) fn(ctx, i);
}

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_HELPERS 255
#define NO_ITEMS 0xffffffffu /* the low half of a state being published: more than any job has */
/* Pause loops before a helper with no job sleeps: 2000, about 20 us on a Sapphire Rapids-class
 * Xeon (11 ns a pause), 50 us on a Zen 3 EPYC. Within a step the kernels come back to back and
 * the caller's serial work between them (norms, RoPE, the KV write) is shorter than that; past it
 * (the step's Python, the wait for the next step) a spinning helper only holds a core that the
 * ingress, the proxy and the scheduler want at that moment. On a 2-core AMX Xeon, served, rounds
 * alternating with 20000 (0.2 ms; `perf record` of the served worker at c16 had the helper's spin
 * at 9.6% of its samples): GGUF c16 453 / 466 / 463 tok/s against 438 / 453 / 435 (ITL p50 26.8-27.4
 * against 27.8-28.9 ms), bf16 c16 488 / 472 against 447 / 481, GGUF c1 149 / 159 / 163 / 158 against
 * 143 / 134 / 158 / 160; in-process decode steps of 16 level (18.2 / 18.8 against 18.4 / 19.0 ms).
 * A build may set it (-DSPIN_ROUNDS=...) to compare. */
#ifndef SPIN_ROUNDS
#define SPIN_ROUNDS 2000
#endif
/* Pause loops before the caller, its own items done, sleeps until the items the helpers claimed
 * are done: 20000 (0.2 ms there), longer than the end of any job takes. A longer wait means a
 * helper lost its core mid-item to another process (served: the ingress, the proxy, the
 * scheduler), and spinning on would keep the caller's core from it; asleep, the caller leaves its
 * core idle and the kernel moves the helper there. On a 2-core AMX Xeon, served c16, rounds
 * alternating with the spinning wait: GGUF 440 / 477 / 459 against 419 / 461 / 488 tok/s, within
 * the machine's drift, with the worker's CPU at 141-143% against 145-151%; c1 and the in-process
 * steps level. A shorter wait (2000) also sleeps at the ends of ordinary jobs; its c1 looked 3%
 * slower, about the bias of the rounds' order, and beside the helpers' 2000 above it gave GGUF c16
 * 410 / 419 / 409 tok/s against 431 / 416 / 408, so the ends of jobs keep spinning. */
#ifndef WAIT_SPINS
#define WAIT_SPINS 20000
#endif

static struct {
    pthread_mutex_t lock; /* one job at a time (trylock: a busy pool means run inline) */
    _Atomic uint64_t state; /* job generation << 32 | next unclaimed item */
    _Atomic uint32_t num_done; /* items of the current job finished (a futex word: the caller may sleep on it) */
    _Atomic int caller_waiting; /* the caller sleeps until num_done reaches num_items */
    _Atomic uint32_t wake;    /* futex word: bumped for every job */
    _Atomic int num_sleeping;
    ParallelBody fn;
    void *ctx;
    int64_t num_items;
    int num_helpers;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Atomic int32_t caller_sleeps; /* waits that outlasted WAIT_SPINS (rayllm_pool_caller_sleeps) */

int32_t rayllm_pool_caller_sleeps(void) { return atomic_load(&caller_sleeps); }

static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

/* Claims and runs items of job `generation` until none are left (or a newer job started). */
static void work(uint32_t generation) {
    for (;;) {
        uint64_t state = atomic_load(&pool.state);
        if ((uint32_t)(state >> 32) != generation || (int64_t)(state & 0xffffffffu) >= pool.num_items) return;
        if (!atomic_compare_exchange_weak(&pool.state, &state, state + 1)) continue;
        /* the item is ours; the job cannot change until it is counted done */
        const int64_t num_items = pool.num_items;
        pool.fn(pool.ctx, (int64_t)(state & 0xffffffffu));
        if ((int64_t)atomic_fetch_add(&pool.num_done, 1) + 1 == num_items && atomic_load(&pool.caller_waiting))
            futex_wake_all(&pool.num_done); /* the last item, and the caller asleep on it */
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    uint32_t seen = atomic_load(&pool.wake);
    for (;;) {
        uint32_t now;
        for (int round = 0; (now = atomic_load(&pool.wake)) == seen; round++) {
            if (round < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            atomic_fetch_add(&pool.num_sleeping, 1);
            if (atomic_load(&pool.wake) == seen) futex_wait(&pool.wake, seen);
            atomic_fetch_sub(&pool.num_sleeping, 1);
            round = 0;
        }
        seen = now;
        work((uint32_t)(atomic_load(&pool.state) >> 32));
    }
    return NULL;
}

static void forget_helpers_in_child(void) {
    pool.num_helpers = 0; /* a forked child has only the thread that forked */
    pthread_mutex_init(&pool.lock, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_helpers_in_child); }

static void grow(int num_helpers) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    while (pool.num_helpers < num_helpers && pool.num_helpers < MAX_HELPERS) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, NULL) != 0) return; /* fewer helpers: still correct */
        pthread_detach(thread);
        pool.num_helpers++;
    }
}

void rayllm_parallel_for(int64_t num_items, int num_threads, ParallelBody fn, void *ctx) {
    if (num_items <= 1 || num_items >= NO_ITEMS || num_threads <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        run_inline(num_items, fn, ctx);
        return;
    }
    grow(num_threads - 1);
    /* Publish in two stores. First a new generation with no item to claim, so a helper still
     * looking at the last job (it read the old state and is about to compare its item with
     * num_items) can no longer claim anything: its compare-and-swap expects the old state. Only
     * then the job's fields, and the generation's items. Writing num_items while the old state
     * stood let a late helper claim a phantom item of the old job and run it with the new one's
     * fields, and count it done (a full-suite run caught the wrong tokens). */
    const uint32_t generation = (uint32_t)(atomic_load(&pool.state) >> 32) + 1;
    atomic_store(&pool.state, (uint64_t)generation << 32 | NO_ITEMS);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.num_items = num_items;
    atomic_store(&pool.num_done, 0);
    atomic_store(&pool.state, (uint64_t)generation << 32); /* the job's items, from 0 */
    atomic_fetch_add(&pool.wake, 1);
    if (atomic_load(&pool.num_sleeping) > 0) futex_wake_all(&pool.wake);
    work(generation);
    /* Only items someone claimed are left. Past WAIT_SPINS, sleep on num_done: the flag is set
     * before num_done is read again, and a helper counts its item before it reads the flag, so
     * either this read sees the last item done or that helper sees the flag and wakes us (and a
     * wake between the read and the wait makes the wait return: num_done has changed). */
    for (int spins = 0;; spins++) {
        const uint32_t done = atomic_load(&pool.num_done);
        if ((int64_t)done >= num_items) break;
        if (spins < WAIT_SPINS) {
            cpu_relax();
            continue;
        }
        if (spins == WAIT_SPINS) atomic_fetch_add(&caller_sleeps, 1);
        atomic_store(&pool.caller_waiting, 1);
        if ((int64_t)atomic_load(&pool.num_done) < num_items) futex_wait(&pool.num_done, done);
        atomic_store(&pool.caller_waiting, 0);
    }
    pthread_mutex_unlock(&pool.lock);
}
#else /* no futex: the caller runs every item */
int32_t rayllm_pool_caller_sleeps(void) { return 0; }

void rayllm_parallel_for(int64_t num_items, int num_threads, ParallelBody fn, void *ctx) {
    (void)num_threads;
    run_inline(num_items, fn, ctx);
}
#endif
