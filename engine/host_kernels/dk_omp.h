/* The OpenMP runtime as the library uses it (gemv.c, mhc.c, gemv_avx2.h): the runtime calls it makes, and
 * DK_PARALLEL, a parallel region only where more than one thread runs it. */
#ifndef DK_OMP_H
#define DK_OMP_H

/* The OpenMP runtime calls the library makes, declared here, not by <omp.h>: the library uses torch's libgomp (gcc's
 * -fopenmp; clang's -fopenmp=libgomp, build.py), and clang has no omp.h of its own without libomp installed. */
int omp_get_thread_num(void);
int omp_get_num_threads(void);
int omp_get_max_threads(void);
int omp_in_parallel(void);

/* `call` (a function whose loops are orphaned `omp for`s) in a parallel region of `nt` threads where `par` and nt > 1,
 * else on the calling thread outside any region: libgomp makes a team even for a region its `if` clause keeps to one
 * thread (a malloc, and a barrier that ends in a futex wake), and that costs more than some of a decode step's one-row
 * calls, which make dozens of regions a step. Called inside another region, an orphaned `omp for` would share its
 * loop with that region's team: there it gets a team of its own, of one thread, as before. */
#define DK_PARALLEL(par, nt, call)                                                                                     \
    do {                                                                                                               \
        const int dk_team_ = (par) && (nt) > 1 ? (nt) : 1;                                                             \
        if (dk_team_ > 1 || omp_in_parallel()) {                                                                       \
            _Pragma("omp parallel num_threads(dk_team_)") call;                                                        \
        } else {                                                                                                       \
            call;                                                                                                      \
        }                                                                                                              \
    } while (0)

#endif
