/* 4 threads x 4 streams churning allocations of mixed sizes, each checking its own data. */
#include <pthread.h>

#include "check.h"
#include "cuda_shim.h"

#define THREADS 4
#define STREAMS 4
#define ROUNDS 20000
#define SLOTS 32

static CUcontext ctx;
static CUstream streams[THREADS][STREAMS];

/* Marks an allocation's first and last byte with `tag`, on its stream. */
static void mark(unsigned char *p, size_t len, unsigned char tag, CUstream s) {
    CU(cuMemsetD8Async(dptr(p), tag, 1, s));
    CU(cuMemsetD8Async(dptr(p + len - 1), tag, 1, s));
}

/* Whether an allocation's first and last byte still hold `tag`. */
static int marked(const unsigned char *p, size_t len, unsigned char tag, CUstream s) {
    unsigned char first, last;
    CU(cuMemcpyDtoHAsync(&first, dptr(p), 1, s));
    CU(cuMemcpyDtoHAsync(&last, dptr(p + len - 1), 1, s));
    CU(cuStreamSynchronize(s));
    return first == tag && last == tag;
}

static void *churn(void *arg) {
    uintptr_t t = (uintptr_t)arg;
    CU(cuCtxSetCurrent(ctx)); /* driver calls need a current context on each thread */
    static const size_t sizes[] = {512, 3000, 65536, 1u << 20, (2u << 20) + 512, 12u << 20};
    unsigned char *ptr[SLOTS] = {0};
    size_t len[SLOTS] = {0};
    CUstream str[SLOTS] = {0};
    unsigned seed = (unsigned)(t * 7919 + 1);
    for (int r = 0; r < ROUNDS; r++) {
        seed = seed * 1664525u + 1013904223u;
        int k = (seed >> 10) % SLOTS;
        if (ptr[k]) {
            CHECK(marked(ptr[k], len[k], (unsigned char)(k + t), str[k]), "thread %lu slot %d overwritten",
                  (unsigned long)t, k);
            tensoralloc_free(ptr[k], len[k], 0, str[k]);
            ptr[k] = NULL;
        } else {
            len[k] = sizes[(seed >> 20) % 6];
            str[k] = streams[t][(seed >> 4) % STREAMS];
            ptr[k] = tensoralloc_malloc(len[k], 0, str[k]);
            CHECK(ptr[k], "malloc");
            mark(ptr[k], len[k], (unsigned char)(k + t), str[k]);
        }
    }
    for (int k = 0; k < SLOTS; k++)
        if (ptr[k]) tensoralloc_free(ptr[k], len[k], 0, str[k]);
    return NULL;
}

int main(void) {
    ctx = cuda_start();
    for (int t = 0; t < THREADS; t++)
        for (int s = 0; s < STREAMS; s++) CU(cuStreamCreate(&streams[t][s], 0));
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
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < STREAMS; i++) CU(cuStreamDestroy(streams[t][i]));
    return 0;
}
