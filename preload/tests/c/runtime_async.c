/* A CUDA runtime API program (linked against libcudart.so: on the fake driver, the stand-in
 * fake_cudart.c), built twice: as is, and with CUDA_API_PER_THREAD_DEFAULT_STREAM (what nvcc's
 * --default-stream per-thread defines), where cudaMallocAsync/cudaFreeAsync are the runtime's
 * cudaMallocAsync_ptsz/cudaFreeAsync_ptsz and the NULL stream is the thread's own.
 *
 * Modes (argv[1]):
 *   pairs    10,000 cudaMalloc/cudaFree pairs, 10,000 stream-ordered pairs on the NULL stream
 *            and 10,000 on a non-blocking stream
 *   threads  four threads allocating and freeing on the NULL stream, checking their data
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static void *control(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    if (!f) {
        fprintf(stderr, "%s not found: run on the fake libcuda.so.1 and fake_cudart.c\n", name);
        exit(1);
    }
    return f;
}

static unsigned long long counter(const char *name) {
    return ((unsigned long long (*)(const char *))control("fakecuda_counter"))(name);
}

/* Allocation and free calls that reached the runtime (not served by a preload). */
static unsigned long long runtime_calls(void) {
    return ((unsigned long long (*)(void))control("fake_cudart_calls"))();
}

static void async_pairs(const char *what, cudaStream_t s) {
    unsigned long long before = counter("mem_alloc"), calls = runtime_calls();
    for (int i = 0; i < 10000; i++) {
        void *p;
        CHECK(cudaMallocAsync(&p, 4096, s));
        ((volatile char *)p)[4095] = 1;
        CHECK(cudaFreeAsync(p, s));
    }
    printf("count: %s mem_alloc %llu\n", what, counter("mem_alloc") - before);
    printf("count: %s runtime_calls %llu\n", what, runtime_calls() - calls);
}

static int pairs(void) {
    unsigned long long before = counter("mem_alloc"), calls = runtime_calls();
    for (int i = 0; i < 10000; i++) {
        void *p;
        CHECK(cudaMalloc(&p, 1 << 20));
        CHECK(cudaFree(p));
    }
    printf("count: sync pairs mem_alloc %llu\n", counter("mem_alloc") - before);
    printf("count: sync pairs runtime_calls %llu\n", runtime_calls() - calls);
    async_pairs("null stream pairs", 0);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    async_pairs("stream pairs", s);
    CHECK(cudaStreamDestroy(s));
    void *p;
    CHECK(cudaMallocAsync(&p, 4096, 0));
    CHECK(cudaFreeAsync(p, 0));
    printf("result: second cudaFreeAsync = %d\n", (int)cudaFreeAsync(p, 0));
    printf("result: cudaFreeAsync(foreign) = %d\n", (int)cudaFreeAsync((void *)0x1000, 0));
    return 0;
}

static void *thread_main(void *arg) {
    int id = (int)(intptr_t)arg;
    void *live[16];
    int ok = 1;
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < 16; i++) CHECK(cudaMallocAsync(&live[i], 512 * (1 + (i + id) % 5), 0));
        for (int i = 0; i < 16; i++) memset(live[i], id * 16 + i, 512);
        for (int i = 0; i < 16; i++)
            if (((unsigned char *)live[i])[511] != (unsigned char)(id * 16 + i)) ok = 0;
        for (int i = 0; i < 16; i++) CHECK(cudaFreeAsync(live[i], 0));
    }
    return (void *)(intptr_t)ok;
}

static int threads(void) {
    int dev;
    CHECK(cudaGetDevice(&dev));
    run_threads(thread_main);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "pairs";
#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
    printf("result: per-thread default stream\n");
#endif
    if (!strcmp(mode, "pairs")) return pairs();
    if (!strcmp(mode, "threads")) return threads();
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
