// A stand-in libcudart.so.13 with just enough of the runtime for PyTorch's caching allocator
// (libc10_cuda.so) to run on a machine without a GPU: one device, device memory handed out
// as address ranges that are never touched, events that have always completed, and the
// driver's virtual-memory functions that PyTorch's expandable segments fetch through
// cudaGetDriverEntryPointByVersion. It exists to run PyTorch's own allocator bookkeeping
// next to tensoralloc's on the simulated device.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOTAL_BYTES (80ull << 30)

// Device addresses are numbers that nothing ever touches. cudaMalloc takes the lowest free
// range that fits (sizes rounded to 512 bytes) in a span of twice the capacity, as
// tensoralloc's simulated device does: the two allocators then see segments in the same
// address order, so ties in best fit (which PyTorch breaks by address) fall alike.
#define SPAN_BASE (1ull << 44)
#define SPAN_BYTES (2 * TOTAL_BYTES)
static size_t used_bytes;

struct range {
  uint64_t start, len;
};
// Free ranges in address order, and live allocations.
static struct range *holes, *lives;
static size_t nholes, capholes, nlives, caplives;

static void push(struct range **v, size_t *n, size_t *cap, size_t at, struct range r) {
  if (*n == *cap) {
    *cap = *cap ? *cap * 2 : 256;
    *v = realloc(*v, *cap * sizeof **v);
    if (!*v) abort();
  }
  memmove(*v + at + 1, *v + at, (*n - at) * sizeof **v);
  (*v)[at] = r;
  (*n)++;
}

static void drop(struct range *v, size_t *n, size_t at) {
  memmove(v + at, v + at + 1, (*n - at - 1) * sizeof *v);
  (*n)--;
}

cudaError_t cudaMalloc(void **out, size_t size) {
  if (!out) return cudaErrorInvalidValue;
  *out = NULL;
  if (!holes && !nholes) push(&holes, &nholes, &capholes, 0, (struct range){SPAN_BASE, SPAN_BYTES});
  uint64_t rounded = ((uint64_t)(size ? size : 1) + 511) & ~(uint64_t)511;
  if (used_bytes + rounded > TOTAL_BYTES) return cudaErrorMemoryAllocation;
  for (size_t i = 0; i < nholes; i++) {
    if (holes[i].len < rounded) continue;
    uint64_t start = holes[i].start;
    holes[i].start += rounded;
    holes[i].len -= rounded;
    if (!holes[i].len) drop(holes, &nholes, i);
    push(&lives, &nlives, &caplives, nlives, (struct range){start, rounded});
    used_bytes += rounded;
    *out = (void *)(uintptr_t)start;
    return cudaSuccess;
  }
  return cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void *ptr) {
  if (!ptr) return cudaSuccess;
  uint64_t start = (uint64_t)(uintptr_t)ptr;
  size_t k = 0;
  while (k < nlives && lives[k].start != start) k++;
  if (k == nlives) return cudaErrorInvalidValue;
  uint64_t len = lives[k].len;
  drop(lives, &nlives, k);
  used_bytes -= len;
  size_t at = 0;
  while (at < nholes && holes[at].start < start) at++;
  // Coalesce with the neighbouring free ranges.
  if (at < nholes && start + len == holes[at].start) {
    len += holes[at].len;
    drop(holes, &nholes, at);
  }
  if (at > 0 && holes[at - 1].start + holes[at - 1].len == start) {
    holes[at - 1].len += len;
  } else {
    push(&holes, &nholes, &capholes, at, (struct range){start, len});
  }
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  if (free_bytes) *free_bytes = TOTAL_BYTES - used_bytes;
  if (total) *total = TOTAL_BYTES;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  memset(prop, 0, sizeof *prop);
  strcpy(prop->name, "tensoralloc stand-in device");
  prop->totalGlobalMem = TOTAL_BYTES;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->textureAlignment = 512;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "stand-in runtime error"; }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorStandIn"; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  (void)s;
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  (void)s;
  return cudaSuccess;
}

static uintptr_t next_event = 0x1000;
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  (void)flags;
  *event = (cudaEvent_t)(next_event += 16);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  (void)e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  (void)e, (void)s;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  (void)e;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  (void)e;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  (void)s, (void)e, (void)flags;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
  (void)s;
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  (void)mode;
  return cudaSuccess;
}
// The driver's virtual-memory functions. Reserved ranges are numbers above the cudaMalloc
// span (never touched either); physical handles count against the device's capacity.
#define VM_GRANULARITY (2ull << 20)
static CUdeviceptr next_reservation;

static CUresult drv_get_error_string(CUresult e, const char **s) {
  *s = e == CUDA_SUCCESS ? "no error" : "stand-in driver error";
  return CUDA_SUCCESS;
}
static CUresult drv_device_get(CUdevice *d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
static CUresult drv_device_get_attribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  *v = a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
  return CUDA_SUCCESS;
}
static CUresult drv_address_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
  (void)align, (void)addr, (void)flags;
  if (!next_reservation) next_reservation = SPAN_BASE + SPAN_BYTES;
  *p = next_reservation;
  next_reservation += (size + VM_GRANULARITY - 1) & ~(VM_GRANULARITY - 1);
  return CUDA_SUCCESS;
}
static CUresult drv_address_free(CUdeviceptr p, size_t size) {
  (void)p, (void)size;
  return CUDA_SUCCESS;
}
static CUresult drv_create(CUmemGenericAllocationHandle *h, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags) {
  (void)prop, (void)flags;
  if (size % VM_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  if (used_bytes + size > TOTAL_BYTES) return CUDA_ERROR_OUT_OF_MEMORY;
  size_t *handle = malloc(sizeof *handle);
  if (!handle) return CUDA_ERROR_OUT_OF_MEMORY;
  *handle = size;
  used_bytes += size;
  *h = (CUmemGenericAllocationHandle)(uintptr_t)handle;
  return CUDA_SUCCESS;
}
static CUresult drv_release(CUmemGenericAllocationHandle h) {
  size_t *handle = (size_t *)(uintptr_t)h;
  used_bytes -= *handle;
  free(handle);
  return CUDA_SUCCESS;
}
static CUresult drv_map(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                        unsigned long long flags) {
  (void)p, (void)size, (void)offset, (void)h, (void)flags;
  return CUDA_SUCCESS;
}
static CUresult drv_unmap(CUdeviceptr p, size_t size) {
  (void)p, (void)size;
  return CUDA_SUCCESS;
}
static CUresult drv_set_access(CUdeviceptr p, size_t size, const CUmemAccessDesc *d, size_t n) {
  (void)p, (void)size, (void)d, (void)n;
  return CUDA_SUCCESS;
}
static CUresult drv_granularity(size_t *g, const CUmemAllocationProp *prop,
                                CUmemAllocationGranularity_flags option) {
  (void)prop, (void)option;
  *g = VM_GRANULARITY;
  return CUDA_SUCCESS;
}
static CUresult drv_unsupported(void) { return CUDA_ERROR_NOT_SUPPORTED; }

static const struct {
  const char *name;
  void *fn;
} driver_functions[] = {
    {"cuGetErrorString", (void *)drv_get_error_string},
    {"cuDeviceGet", (void *)drv_device_get},
    {"cuDeviceGetAttribute", (void *)drv_device_get_attribute},
    {"cuMemAddressReserve", (void *)drv_address_reserve},
    {"cuMemAddressFree", (void *)drv_address_free},
    {"cuMemCreate", (void *)drv_create},
    {"cuMemRelease", (void *)drv_release},
    {"cuMemMap", (void *)drv_map},
    {"cuMemUnmap", (void *)drv_unmap},
    {"cuMemSetAccess", (void *)drv_set_access},
    {"cuMemGetAllocationGranularity", (void *)drv_granularity},
    // Fetched by PyTorch but not used when replaying allocations: they say so if called.
    {"cuMemExportToShareableHandle", (void *)drv_unsupported},
    {"cuMemImportFromShareableHandle", (void *)drv_unsupported},
    {"cuMemRetainAllocationHandle", (void *)drv_unsupported},
    {"cuMemGetAllocationPropertiesFromHandle", (void *)drv_unsupported},
    {"cuMemsetD32Async", (void *)drv_unsupported},
    {"cuStreamWriteValue32", (void *)drv_unsupported},
};

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
  (void)version, (void)flags;
  for (size_t i = 0; i < sizeof driver_functions / sizeof driver_functions[0]; i++) {
    if (strcmp(symbol, driver_functions[i].name) == 0) {
      *fn = driver_functions[i].fn;
      if (status) *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  }
  *fn = NULL;
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
