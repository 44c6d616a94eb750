/* A stand-in for libcudart.so on the fake driver: the few runtime functions the preload
 * intercepts (and cudaGetDevice, which it asks), each done with the driver API the way the
 * real runtime does it, on the current device's primary context. Its driver calls go through
 * the preloaded hooks, as a real runtime's do, so they test that a hook called from inside a
 * real runtime function passes the call through. Error codes: the driver's (the ones used here
 * have the same numbers in both APIs). */
#include <cuda.h>
#include <stddef.h>

#define CUDART_EXPORT __attribute__((visibility("default")))

static unsigned long long calls;

/* Test control: allocation and free calls that reached this runtime. */
CUDART_EXPORT unsigned long long fake_cudart_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

static void called(void) { __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED); }

static CUresult ensure_context(void) {
    static int initialised;
    CUcontext ctx = NULL;
    if (!initialised) {
        CUresult r = cuInit(0);
        if (r != CUDA_SUCCESS) return r;
        initialised = 1;
    }
    CUresult r = cuCtxGetCurrent(&ctx);
    if (r != CUDA_SUCCESS || ctx != NULL) return r;
    CUdevice dev;
    if ((r = cuDeviceGet(&dev, 0)) != CUDA_SUCCESS) return r;
    if ((r = cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) return r;
    return cuCtxSetCurrent(ctx);
}

/* The runtime's NULL stream is the legacy stream; with _ptsz, the per-thread stream. */
static CUstream legacy(CUstream s) { return s ? s : CU_STREAM_LEGACY; }
static CUstream per_thread(CUstream s) { return s ? s : CU_STREAM_PER_THREAD; }

CUDART_EXPORT int cudaGetDevice(int *device) {
    CUresult r = ensure_context();
    CUdevice dev;
    if (r == CUDA_SUCCESS) r = cuCtxGetDevice(&dev);
    if (r == CUDA_SUCCESS) *device = dev;
    return r;
}

CUDART_EXPORT int cudaMalloc(void **p, size_t size) {
    called();
    CUresult r = ensure_context();
    return r ? r : cuMemAlloc((CUdeviceptr *)p, size);
}

CUDART_EXPORT int cudaFree(void *p) {
    called();
    CUresult r = ensure_context();
    return r || !p ? r : cuMemFree((CUdeviceptr)p);
}

static int alloc_on(void **p, size_t size, CUstream s) {
    called();
    CUresult r = ensure_context();
    return r ? r : cuMemAllocAsync((CUdeviceptr *)p, size, s);
}

static int free_on(void *p, CUstream s) {
    called();
    CUresult r = ensure_context();
    return r ? r : cuMemFreeAsync((CUdeviceptr)p, s);
}

CUDART_EXPORT int cudaMallocAsync(void **p, size_t size, CUstream s) { return alloc_on(p, size, legacy(s)); }
CUDART_EXPORT int cudaFreeAsync(void *p, CUstream s) { return free_on(p, legacy(s)); }
CUDART_EXPORT int cudaMallocAsync_ptsz(void **p, size_t size, CUstream s) { return alloc_on(p, size, per_thread(s)); }
CUDART_EXPORT int cudaFreeAsync_ptsz(void *p, CUstream s) { return free_on(p, per_thread(s)); }

CUDART_EXPORT int cudaStreamCreateWithFlags(CUstream *s, unsigned flags) {
    CUresult r = ensure_context();
    return r ? r : cuStreamCreate(s, flags);
}

CUDART_EXPORT int cudaStreamDestroy(CUstream s) { return cuStreamDestroy(s); }
