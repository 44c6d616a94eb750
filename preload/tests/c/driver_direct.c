/* A CUDA driver API program linked against libcuda, run with and without the preload.
 * Lines starting with "result:" must be the same in both runs; "count:" lines report the
 * fake driver's call counters.
 *
 * Modes (argv[1]):
 *   pairs        10,000 same-size cuMemAlloc/cuMemFree pairs, stream-ordered pairs, pinned
 *                host pairs, checks that live blocks never overlap, error codes for bad frees
 *   double-free  frees one block twice, twice over
 *   marker       a block freed while the legacy stream is held is not reused until released
 *   fork         allocates, forks a child that allocates and frees, then allocates again
 *   threads      four threads with their own pairs and live blocks
 *   host-batch   frees 64 pinned blocks, then allocates 64 again: markers and driver calls
 *   host-marker  a pinned block freed while the legacy stream is held is not reused until
 *                released
 *   stream-reuse a block freed on its stream is reused there at once, not on another stream
 *   short        (device memory 16 MiB) blocks freed on one stream, then a large allocation on
 *                another that needs their memory
 *   short-sync   (device memory 16 MiB) the same with cuMemAlloc/cuMemFree, the frees' batch
 *                completed and their blocks kept for the next allocations of their size
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include <sys/wait.h>
#include <unistd.h>

typedef unsigned long long (*counter_fn)(const char *);
typedef void (*stream_fn)(CUstream);

static unsigned long long counter(const char *name) {
    counter_fn f = (counter_fn)dlsym(RTLD_DEFAULT, "fakecuda_counter");
    if (!f) {
        fprintf(stderr, "fakecuda_counter not found: run on the fake libcuda.so.1\n");
        exit(1);
    }
    return f(name);
}

static void control(const char *name, CUstream s) {
    stream_fn f = (stream_fn)dlsym(RTLD_DEFAULT, name);
    if (!f) {
        fprintf(stderr, "%s not found\n", name);
        exit(1);
    }
    f(s);
}

static CUcontext ctx;

static void setup(void) {
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
}

/* Fills live blocks with their index and checks them all: overlapping blocks would clobber. */
static int blocks_are_disjoint(CUdeviceptr *p, int n, size_t size) {
    for (int i = 0; i < n; i++) memset((void *)(uintptr_t)p[i], i & 0xff, size);
    for (int i = 0; i < n; i++) {
        const unsigned char *b = (const unsigned char *)(uintptr_t)p[i];
        for (size_t k = 0; k < size; k += 61)
            if (b[k] != (unsigned char)(i & 0xff)) return 0;
    }
    return 1;
}

static int pairs(void) {
    const size_t size = 1 << 20;
    unsigned long long before = counter("mem_alloc");
    for (int i = 0; i < 10000; i++) {
        CUdeviceptr p;
        CHECK(cuMemAlloc(&p, size));
        ((volatile char *)(uintptr_t)p)[size - 1] = 1;
        CHECK(cuMemFree(p));
    }
    printf("count: sync pairs mem_alloc %llu\n", counter("mem_alloc") - before);

    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    before = counter("mem_alloc");
    for (int i = 0; i < 10000; i++) {
        CUdeviceptr p;
        CHECK(cuMemAllocAsync(&p, 4096, s));
        CHECK(cuMemFreeAsync(p, s));
    }
    printf("count: async pairs mem_alloc %llu\n", counter("mem_alloc") - before);

    before = counter("host_alloc");
    for (int i = 0; i < 1000; i++) {
        void *h;
        CHECK(cuMemHostAlloc(&h, 8192, CU_MEMHOSTALLOC_PORTABLE));
        ((volatile char *)h)[8191] = 2;
        CHECK(cuMemFreeHost(h));
        CHECK(cuMemAllocHost(&h, 100));
        CHECK(cuMemFreeHost(h));
    }
    printf("count: host pairs host_alloc %llu\n", counter("host_alloc") - before);

    CUdeviceptr live[64];
    for (int i = 0; i < 64; i++) CHECK(cuMemAlloc(&live[i], 3000 + 1000 * (i % 7)));
    printf("result: 64 live blocks disjoint: %s\n", blocks_are_disjoint(live, 64, 3000) ? "yes" : "no");
    for (int i = 0; i < 64; i++) CHECK(cuMemFree(live[i]));

    size_t free_mem, total;
    CHECK(cuMemGetInfo(&free_mem, &total));
    /* Everything is freed: cached memory counts as free. */
    printf("result: free == total: %s\n", free_mem == total ? "yes" : "no");
    printf("count: free memory %zu of %zu\n", free_mem, total);

    CUdeviceptr z = 0;
    printf("result: cuMemAlloc(0 bytes) = %d\n", (int)cuMemAlloc(&z, 0));
    printf("result: cuMemFree(0) = %d\n", (int)cuMemFree(0));
    printf("result: cuMemFree(foreign) = %d\n", (int)cuMemFree((CUdeviceptr)0x1000));
    printf("result: cuMemFreeHost(foreign) = %d\n", (int)cuMemFreeHost((void *)0x2000));
    CHECK(cuStreamDestroy(s));
    return 0;
}

static int double_free(void) {
    CUdeviceptr p, q;
    CHECK(cuMemAlloc(&p, 1 << 16));
    CHECK(cuMemFree(p));
    printf("result: second cuMemFree = %d\n", (int)cuMemFree(p));
    CHECK(cuMemAlloc(&q, 1 << 16));
    CHECK(cuMemFree(q));
    printf("result: another second cuMemFree = %d\n", (int)cuMemFree(q));
    return 0;
}

static int marker(void) {
    const size_t size = 1 << 16;
    CUdeviceptr p, q[100];
    control("fakecuda_hold_stream", (CUstream)0);
    CHECK(cuMemAlloc(&p, size));
    CHECK(cuMemFree(p));
    int reused = 0;
    for (int i = 0; i < 100; i++) {
        CHECK(cuMemAlloc(&q[i], size));
        if (q[i] == p) reused = 1;
        CHECK(cuMemFree(q[i]));
    }
    printf("result: reused while the legacy stream is busy: %s\n", reused ? "yes" : "no");
    control("fakecuda_release_stream", (CUstream)0);
    /* The blocks stay live, so every block freed above is handed out before new memory. */
    CUdeviceptr r[200];
    int reused_after = 0, n = 0;
    while (n < 200 && !reused_after) {
        CHECK(cuMemAlloc(&r[n], size));
        if (r[n++] == p) reused_after = 1;
    }
    printf("result: reused once it completed: %s\n", reused_after ? "yes" : "no");
    for (int i = 0; i < n; i++) CHECK(cuMemFree(r[i]));
    return 0;
}

static int fork_mode(void) {
    CUdeviceptr p;
    CHECK(cuMemAlloc(&p, 1 << 20));
    CHECK(cuMemFree(p));
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        CUdeviceptr c;
        CHECK(cuCtxSetCurrent(ctx));
        unsigned long long before = counter("mem_alloc");
        CHECK(cuMemAlloc(&c, 1 << 20));
        unsigned long long calls = counter("mem_alloc") - before;
        CHECK(cuMemFree(c));
        printf("result: child allocation reached the driver: %s\n", calls == 1 ? "yes" : "no");
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("result: child exit %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    for (int i = 0; i < 1000; i++) {
        CHECK(cuMemAlloc(&p, 1 << 20));
        CHECK(cuMemFree(p));
    }
    printf("result: parent still allocates\n");
    return 0;
}

static int host_batch(void) {
    void *h[64];
    for (int i = 0; i < 64; i++) CHECK(cuMemHostAlloc(&h[i], 4096, 0));
    unsigned long long records = counter("event_records");
    unsigned long long created = counter("events_created");
    for (int i = 0; i < 64; i++) CHECK(cuMemFreeHost(h[i]));
    unsigned long long allocs = counter("host_alloc");
    for (int i = 0; i < 64; i++) CHECK(cuMemHostAlloc(&h[i], 4096, 0));
    printf("count: host batch event_records %llu\n", counter("event_records") - records);
    printf("count: host batch events_created %llu\n", counter("events_created") - created);
    printf("count: host batch host_alloc %llu\n", counter("host_alloc") - allocs);
    for (int i = 0; i < 64; i++) CHECK(cuMemFreeHost(h[i]));
    printf("result: host batch done\n");
    return 0;
}

/* The blocks allocated meanwhile stay live, so the freed block is the only one the cache could
 * hand out. */
static int host_marker(void) {
    void *p, *q[100], *r[100];
    control("fakecuda_hold_stream", (CUstream)0);
    CHECK(cuMemHostAlloc(&p, 4096, 0));
    CHECK(cuMemFreeHost(p));
    int reused = 0;
    for (int i = 0; i < 100; i++) {
        CHECK(cuMemHostAlloc(&q[i], 4096, 0));
        if (q[i] == p) reused = 1;
    }
    printf("result: pinned block reused while the legacy stream is busy: %s\n", reused ? "yes" : "no");
    control("fakecuda_release_stream", (CUstream)0);
    int reused_after = 0, n = 0;
    while (n < 100 && !reused_after) {
        CHECK(cuMemHostAlloc(&r[n], 4096, 0));
        if (r[n++] == p) reused_after = 1;
    }
    printf("result: pinned block reused once it completed: %s\n", reused_after ? "yes" : "no");
    for (int i = 0; i < 100; i++) CHECK(cuMemFreeHost(q[i]));
    for (int i = 0; i < n; i++) CHECK(cuMemFreeHost(r[i]));
    return 0;
}

static int stream_reuse(void) {
    CUstream s1, s2;
    CUdeviceptr p, q, r;
    CHECK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAllocAsync(&p, 4096, s1));
    CHECK(cuMemFreeAsync(p, s1));
    CHECK(cuMemAllocAsync(&q, 4096, s2));
    CHECK(cuMemAllocAsync(&r, 4096, s1));
    printf("result: reused on another stream: %s\n", q == p ? "yes" : "no");
    printf("result: reused on its stream: %s\n", r == p ? "yes" : "no");
    CHECK(cuMemFreeAsync(q, s2));
    CHECK(cuMemFreeAsync(r, s1));
    CHECK(cuStreamDestroy(s1));
    CHECK(cuStreamDestroy(s2));
    return 0;
}

static int short_memory(void) {
    CUstream s1, s2;
    CUdeviceptr p[4], big;
    CHECK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < 4; i++) CHECK(cuMemAllocAsync(&p[i], 1 << 20, s1));
    for (int i = 0; i < 4; i++) CHECK(cuMemFreeAsync(p[i], s1));
    printf("result: 14 MiB on another stream = %d\n", (int)cuMemAllocAsync(&big, 14 << 20, s2));
    CHECK(cuMemFreeAsync(big, s2));
    CHECK(cuStreamDestroy(s1));
    CHECK(cuStreamDestroy(s2));
    return 0;
}

static int short_memory_sync(void) {
    CUdeviceptr p[4], q, big;
    for (int i = 0; i < 4; i++) CHECK(cuMemAlloc(&p[i], 1 << 20));
    for (int i = 0; i < 4; i++) CHECK(cuMemFree(p[i]));
    /* Closes the batch of the four frees and, its marker done, takes the blocks back. */
    CHECK(cuMemAlloc(&q, 512 << 10));
    CHECK(cuMemFree(q));
    printf("result: 14 MiB = %d\n", (int)cuMemAlloc(&big, 14 << 20));
    CHECK(cuMemFree(big));
    return 0;
}

static void *thread_main(void *arg) {
    int id = (int)(intptr_t)arg;
    CHECK(cuCtxSetCurrent(ctx));
    CUdeviceptr live[16];
    int ok = 1;
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < 16; i++) CHECK(cuMemAlloc(&live[i], 512 * (1 + (i + id) % 5)));
        for (int i = 0; i < 16; i++) memset((void *)(uintptr_t)live[i], id * 16 + i, 512);
        for (int i = 0; i < 16; i++)
            if (((unsigned char *)(uintptr_t)live[i])[511] != (unsigned char)(id * 16 + i)) ok = 0;
        for (int i = 0; i < 16; i++) CHECK(cuMemFree(live[i]));
    }
    return (void *)(intptr_t)ok;
}

static int threads(void) {
    run_threads(thread_main);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "pairs";
    setup();
    if (!strcmp(mode, "pairs")) return pairs();
    if (!strcmp(mode, "double-free")) return double_free();
    if (!strcmp(mode, "marker")) return marker();
    if (!strcmp(mode, "fork")) return fork_mode();
    if (!strcmp(mode, "threads")) return threads();
    if (!strcmp(mode, "host-batch")) return host_batch();
    if (!strcmp(mode, "host-marker")) return host_marker();
    if (!strcmp(mode, "stream-reuse")) return stream_reuse();
    if (!strcmp(mode, "short")) return short_memory();
    if (!strcmp(mode, "short-sync")) return short_memory_sync();
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
