/* The handful of CUDA driver API calls the examples make, loaded from libcuda.so.1 at run time
 * so the examples build without the CUDA toolkit. The names and prototypes are NVIDIA's: a
 * program of your own includes <cuda.h>, links -lcuda and makes the same calls.
 *
 * cuda_start() loads the driver, makes device 0's primary context current on the calling
 * thread and returns it (other threads call cuCtxSetCurrent with it).
 *
 * With TENSORALLOC_DRIVER=sim there is no driver: tensoralloc runs on its simulated device,
 * whose memory lives in the host, and the calls below act on that instead. C99 or C++. */
#ifndef TENSORALLOC_EXAMPLE_CUDA_SHIM_H
#define TENSORALLOC_EXAMPLE_CUDA_SHIM_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;

static CUresult (*cuInit)(unsigned int flags);
static CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice device);
static CUresult (*cuCtxSetCurrent)(CUcontext ctx);
static CUresult (*cuStreamCreate)(CUstream *stream, unsigned int flags);
static CUresult (*cuStreamDestroy)(CUstream stream);
static CUresult (*cuStreamSynchronize)(CUstream stream);
static CUresult (*cuMemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t n, CUstream stream);
static CUresult (*cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t n, CUstream stream);
static CUresult (*cuGetErrorName)(CUresult error, const char **name);

/* CU(call): a driver call that must succeed; prints the error's name and exits otherwise. */
#define CU(call)                                                                         \
    do {                                                                                 \
        CUresult cu_result_ = (call);                                                    \
        if (cu_result_ != 0) {                                                           \
            const char *cu_name_ = "unknown error";                                      \
            cuGetErrorName(cu_result_, &cu_name_);                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cu_name_); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* A device pointer from tensoralloc (a void *) as the driver API spells it. */
static inline CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* --- The simulated device (TENSORALLOC_DRIVER=sim): device memory is host memory, work runs
 * at once, and a stream is any distinct handle. Not CUDA code: skip this part. ------------- */
static CUresult sim_init(unsigned int f) { (void)f; return 0; }
static CUresult sim_device_get(CUdevice *d, int ordinal) { *d = ordinal; return 0; }
static CUresult sim_ctx_retain(CUcontext *c, CUdevice d) { (void)d; *c = NULL; return 0; }
static CUresult sim_ctx_set(CUcontext c) { (void)c; return 0; }
static CUresult sim_stream_create(CUstream *s, unsigned int f) { (void)f; *s = (CUstream)malloc(1); return *s ? 0 : 2; }
static CUresult sim_stream_destroy(CUstream s) { free(s); return 0; }
static CUresult sim_stream_sync(CUstream s) { (void)s; return 0; }
static CUresult sim_memset(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    (void)s; memset((void *)(uintptr_t)d, v, n); return 0;
}
static CUresult sim_dtoh(void *h, CUdeviceptr d, size_t n, CUstream s) {
    (void)s; memcpy(h, (const void *)(uintptr_t)d, n); return 0;
}
static CUresult sim_error_name(CUresult e, const char **name) { (void)e; *name = "simulated error"; return 0; }

static void sim_use(void) {
    cuInit = sim_init; cuDeviceGet = sim_device_get; cuDevicePrimaryCtxRetain = sim_ctx_retain;
    cuCtxSetCurrent = sim_ctx_set; cuStreamCreate = sim_stream_create;
    cuStreamDestroy = sim_stream_destroy; cuStreamSynchronize = sim_stream_sync;
    cuMemsetD8Async = sim_memset; cuMemcpyDtoHAsync = sim_dtoh; cuGetErrorName = sim_error_name;
}
/* --- end of the simulated device ------------------------------------------------------- */

/* Sets `fn` to the driver's function `symbol` (cuda.h maps some names to a _v2 symbol). */
#define CUDA_LOAD(fn, symbol)                                                 \
    do {                                                                      \
        void *f_ = dlsym(lib, symbol);                                        \
        if (!f_) {                                                            \
            fprintf(stderr, "libcuda.so.1 has no %s\n", symbol);              \
            exit(1);                                                          \
        }                                                                     \
        memcpy(&(fn), &f_, sizeof f_);                                        \
    } while (0)

static CUcontext cuda_start(void) {
    const char *driver = getenv("TENSORALLOC_DRIVER");
    if (driver && strcmp(driver, "sim") == 0) {
        sim_use();
    } else {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (!lib) {
            fprintf(stderr, "cannot load the NVIDIA driver (%s); TENSORALLOC_DRIVER=sim runs on "
                            "the simulated device\n", dlerror());
            exit(1);
        }
        CUDA_LOAD(cuInit, "cuInit");
        CUDA_LOAD(cuDeviceGet, "cuDeviceGet");
        CUDA_LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
        CUDA_LOAD(cuCtxSetCurrent, "cuCtxSetCurrent");
        CUDA_LOAD(cuStreamCreate, "cuStreamCreate");
        CUDA_LOAD(cuStreamDestroy, "cuStreamDestroy_v2");
        CUDA_LOAD(cuStreamSynchronize, "cuStreamSynchronize");
        CUDA_LOAD(cuMemsetD8Async, "cuMemsetD8Async");
        CUDA_LOAD(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
        CUDA_LOAD(cuGetErrorName, "cuGetErrorName");
    }
    CUdevice device;
    CUcontext ctx;
    CU(cuInit(0));
    CU(cuDeviceGet(&device, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, device));
    CU(cuCtxSetCurrent(ctx));
    return ctx;
}

#endif
