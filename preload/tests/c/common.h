/* What the preload's C test programs share. */
#ifndef PRELOAD_TEST_COMMON_H
#define PRELOAD_TEST_COMMON_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Exits when a CUDA call (driver or runtime: 0 is success in both) fails. */
#define CHECK(call)                                                                    \
    do {                                                                               \
        int r_ = (int)(call);                                                          \
        if (r_ != 0) {                                                                 \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, r_); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* Runs `body(id)` on four threads; prints whether each returned non-zero (its data was its
 * own). */
static inline void run_threads(void *(*body)(void *)) {
    pthread_t t[4];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, body, (void *)(intptr_t)i);
    int ok = 1;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        ok &= (int)(intptr_t)r;
    }
    printf("result: threads saw only their own data: %s\n", ok ? "yes" : "no");
}

#endif
