/* See native_parallel.h. */
#include "native_parallel.h"

#include <pthread.h>
#include <stddef.h>

enum { MOST_THREADS = 64 };

/* The OpenMP runtime's entry points (GNU libgomp's ABI, which LLVM's and Intel's runtimes
 * also export), set once by aiocb_use_openmp before any kernel runs. */
typedef void (*gomp_parallel_fn)(void (*fn)(void*), void* data, unsigned threads, unsigned flags);
static gomp_parallel_fn team_parallel;
static int (*team_index)(void);
static int (*team_size)(void);

/* Use the OpenMP runtime whose GOMP_parallel, omp_get_thread_num and omp_get_num_threads
 * these are (any NULL: POSIX threads instead). */
void aiocb_use_openmp(void* parallel, void* thread_num, void* num_threads) {
    if (parallel && thread_num && num_threads) {
        team_index = (int (*)(void))thread_num;
        team_size = (int (*)(void))num_threads;
        team_parallel = (gomp_parallel_fn)parallel;
    } else {
        team_parallel = NULL;
    }
}

typedef struct {
    parallel_body body;
    void* arg;
    int index, count;
} part;

static void run_team_part(void* data) {
    const part* whole = (const part*)data;
    whole->body(whole->arg, team_index(), team_size());
}

static void* run_thread_part(void* data) {
    const part* one = (const part*)data;
    one->body(one->arg, one->index, one->count);
    return NULL;
}

void aiocb_parallel(parallel_body body, void* arg, int threads) {
    if (threads > MOST_THREADS) threads = MOST_THREADS;
    if (threads <= 1) {
        body(arg, 0, 1);
        return;
    }
    if (team_parallel) {
        part whole = {body, arg, 0, threads};
        team_parallel(run_team_part, &whole, (unsigned)threads, 0);
        return;
    }
    part parts[MOST_THREADS];
    pthread_t ids[MOST_THREADS];
    int started[MOST_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        parts[t] = (part){body, arg, t, threads};
        if (t) started[t] = pthread_create(&ids[t], NULL, run_thread_part, &parts[t]) == 0;
    }
    body(arg, 0, threads);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            body(arg, t, threads); /* (no thread: this one does its part) */
    }
}
