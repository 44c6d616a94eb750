/* Reaches the driver the way a CUDA runtime does: dlopen("libcuda.so.1"), dlsym of
 * cuGetProcAddress on that handle, and every other function through cuGetProcAddress. Not
 * linked against libcuda. Lines starting with "result:" must be the same with and without the
 * preload; "count:" lines report the fake driver's call counters. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*gpa_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa_v1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*device_get_fn)(CUdevice *, int);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*set_current_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*host_alloc_fn)(void **, size_t, unsigned int);
typedef CUresult (*free_host_fn)(void *);
typedef unsigned long long (*counter_fn)(const char *);

#define CHECK(call)                                                                    \
    do {                                                                               \
        CUresult r_ = (call);                                                          \
        if (r_ != CUDA_SUCCESS) {                                                      \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, r_); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

static gpa_v2_fn gpa;

static void *get(const char *name) {
    void *f = NULL;
    CUdriverProcAddressQueryResult status;
    CHECK(gpa(name, &f, 12060, CU_GET_PROC_ADDRESS_DEFAULT, &status));
    if (!f || status != CU_GET_PROC_ADDRESS_SUCCESS) {
        fprintf(stderr, "cuGetProcAddress(%s) gave nothing\n", name);
        exit(1);
    }
    return f;
}

int main(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    gpa = (gpa_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    gpa_v1_fn gpa1 = (gpa_v1_fn)dlsym(lib, "cuGetProcAddress");
    counter_fn counter = (counter_fn)dlsym(lib, "fakecuda_counter");
    if (!gpa || !gpa1 || !counter) {
        fprintf(stderr, "the fake libcuda.so.1 lacks cuGetProcAddress or fakecuda_counter\n");
        return 1;
    }
    init_fn init = (init_fn)get("cuInit");
    device_get_fn device_get = (device_get_fn)get("cuDeviceGet");
    retain_fn retain = (retain_fn)get("cuDevicePrimaryCtxRetain");
    set_current_fn set_current = (set_current_fn)get("cuCtxSetCurrent");
    alloc_fn alloc = (alloc_fn)get("cuMemAlloc");
    free_fn mem_free = (free_fn)get("cuMemFree");
    alloc_async_fn alloc_async = (alloc_async_fn)get("cuMemAllocAsync");
    free_async_fn free_async = (free_async_fn)get("cuMemFreeAsync");
    info_fn info = (info_fn)get("cuMemGetInfo");
    host_alloc_fn host_alloc = (host_alloc_fn)get("cuMemHostAlloc");
    free_host_fn free_host = (free_host_fn)get("cuMemFreeHost");

    /* The CUDA 11 entry point finds the same kind of functions. */
    void *alloc1 = NULL;
    CHECK(gpa1("cuMemAlloc", &alloc1, 11000, 0));
    printf("result: legacy cuGetProcAddress finds cuMemAlloc: %s\n", alloc1 ? "yes" : "no");
    void *missing = (void *)1;
    CUdriverProcAddressQueryResult status;
    CUresult r = gpa("cuNoSuchFunction", &missing, 12060, 0, &status);
    printf("result: unknown name: %d, status %d, null %s\n", (int)r, (int)status, missing ? "no" : "yes");

    CUdevice dev;
    CUcontext ctx;
    CHECK(init(0));
    CHECK(device_get(&dev, 0));
    CHECK(retain(&ctx, dev));
    CHECK(set_current(ctx));

    unsigned long long before = counter("mem_alloc");
    for (int i = 0; i < 10000; i++) {
        CUdeviceptr p;
        CHECK(alloc(&p, 1 << 20));
        ((volatile char *)(uintptr_t)p)[0] = 1;
        CHECK(mem_free(p));
    }
    printf("count: sync pairs mem_alloc %llu\n", counter("mem_alloc") - before);

    before = counter("mem_alloc");
    for (int i = 0; i < 10000; i++) {
        CUdeviceptr p;
        CHECK(alloc_async(&p, 4096, (CUstream)0));
        CHECK(free_async(p, (CUstream)0));
    }
    printf("count: async pairs mem_alloc %llu\n", counter("mem_alloc") - before);

    before = counter("host_alloc");
    for (int i = 0; i < 1000; i++) {
        void *h;
        CHECK(host_alloc(&h, 4096, 0));
        CHECK(free_host(h));
    }
    printf("count: host pairs host_alloc %llu\n", counter("host_alloc") - before);

    size_t f, t;
    CHECK(info(&f, &t));
    printf("result: free <= total: %s\n", f <= t ? "yes" : "no");
    printf("result: cuMemFree(foreign) = %d\n", (int)mem_free((CUdeviceptr)0x1000));

    CUdeviceptr a, b;
    CHECK(alloc(&a, 5000));
    CHECK(alloc(&b, 5000));
    memset((void *)(uintptr_t)a, 0xaa, 5000);
    memset((void *)(uintptr_t)b, 0xbb, 5000);
    printf("result: two live blocks keep their data: %s\n",
           ((unsigned char *)(uintptr_t)a)[4999] == 0xaa && ((unsigned char *)(uintptr_t)b)[0] == 0xbb ? "yes" : "no");
    CHECK(mem_free(a));
    CHECK(mem_free(b));
    return 0;
}
