/* Running a kernel's work on several threads: torch's OpenMP team when aiocb.runner.native
 * hands its entry points over (the threads torch's own operations use, so the two never
 * compete for a core), POSIX threads started for the call otherwise. */
#ifndef AIOCB_NATIVE_PARALLEL_H
#define AIOCB_NATIVE_PARALLEL_H

/* body(arg, index, count) does part `index` of `count`; count may be lower than asked for
 * (an OpenMP team can be smaller), so each body splits its work by the count it gets. */
typedef void (*parallel_body)(void* arg, int index, int count);

/* Run body on up to `threads` threads (this one among them) and return when all are done. */
void aiocb_parallel(parallel_body body, void* arg, int threads);

#endif
