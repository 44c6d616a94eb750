/* 4 threads x 4 streams churning allocations of mixed sizes, each checking its own data. */
#include <pthread.h>
#include <string.h>

#include "check.h"

#define THREADS 4
#define STREAMS 4
#define ROUNDS 20000
#define SLOTS 32

static void *churn(void *arg) {
    uintptr_t t = (uintptr_t)arg;
    static const size_t sizes[] = {512, 3000, 65536, 1u << 20, (2u << 20) + 512, 12u << 20};
    unsigned char *ptr[SLOTS] = {0};
    size_t len[SLOTS] = {0};
    struct CUstream_st *str[SLOTS] = {0};
    unsigned seed = (unsigned)(t * 7919 + 1);
    for (int r = 0; r < ROUNDS; r++) {
        seed = seed * 1664525u + 1013904223u;
        int k = (seed >> 10) % SLOTS;
        if (ptr[k]) {
            CHECK(ptr[k][0] == (unsigned char)(k + t) && ptr[k][len[k] - 1] == (unsigned char)(k + t),
                  "thread %lu slot %d overwritten", (unsigned long)t, k);
            tensoralloc_free(ptr[k], len[k], 0, str[k]);
            ptr[k] = NULL;
        } else {
            len[k] = sizes[(seed >> 20) % 6];
            str[k] = stream_n(1 + t * STREAMS + (seed >> 4) % STREAMS);
            ptr[k] = tensoralloc_malloc(len[k], 0, str[k]);
            CHECK(ptr[k], "malloc");
            ptr[k][0] = ptr[k][len[k] - 1] = (unsigned char)(k + t);
        }
    }
    for (int k = 0; k < SLOTS; k++)
        if (ptr[k]) tensoralloc_free(ptr[k], len[k], 0, str[k]);
    return NULL;
}

int main(void) {
    pthread_t threads[THREADS];
    for (uintptr_t t = 0; t < THREADS; t++)
        CHECK(pthread_create(&threads[t], NULL, churn, (void *)t) == 0, "thread");
    for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
    tensoralloc_device_stats s;
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.allocation[0].current == 0 && s.active_bytes[0].current == 0, "all freed");
    printf("%d threads x %d streams: %lld allocations, all freed, %lld segments cached\n", THREADS, STREAMS,
           (long long)s.allocation[0].allocated, (long long)s.segment[0].current);
    tensoralloc_empty_cache();
    CHECK(tensoralloc_get_device_stats(0, &s) == 0, "stats");
    CHECK(s.reserved_bytes[0].current == 0, "cache emptied");
    return 0;
}
