// A stand-in libcudart.so.13 with just enough of the runtime for PyTorch's caching allocator
// (libc10_cuda.so) to run on a machine without a GPU: one device, device memory handed out
// as address ranges that are never touched, events that have always completed. It exists
// to time PyTorch's own allocator bookkeeping next to tensoralloc's on the simulated device.
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define TOTAL_BYTES (80ull << 30)
#define SPAN_BYTES (1ull << 40)

static char *base;
static size_t next_offset;
static size_t used_bytes;

struct live {
  void *ptr;
  size_t size;
};
static struct live *lives;
static size_t nlives, caplives;

static int reserve_span(void) {
  if (base) return 1;
  // Address space only: PROT_NONE and never touched, so it costs no memory.
  void *p = mmap(NULL, SPAN_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 0;
  base = p;
  return 1;
}

cudaError_t cudaMalloc(void **out, size_t size) {
  if (!out) return cudaErrorInvalidValue;
  if (!reserve_span()) return cudaErrorMemoryAllocation;
  size_t rounded = (size + 511) & ~(size_t)511;
  if (used_bytes + rounded > TOTAL_BYTES || next_offset + rounded > SPAN_BYTES) {
    *out = NULL;
    return cudaErrorMemoryAllocation;
  }
  if (nlives == caplives) {
    caplives = caplives ? caplives * 2 : 1024;
    lives = realloc(lives, caplives * sizeof *lives);
    if (!lives) abort();
  }
  *out = base + next_offset;
  lives[nlives++] = (struct live){*out, rounded};
  next_offset += rounded;
  used_bytes += rounded;
  return cudaSuccess;
}

cudaError_t cudaFree(void *ptr) {
  if (!ptr) return cudaSuccess;
  for (size_t i = 0; i < nlives; i++) {
    if (lives[i].ptr == ptr) {
      used_bytes -= lives[i].size;
      lives[i] = lives[--nlives];
      return cudaSuccess;
    }
  }
  return cudaErrorInvalidValue;
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
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
  (void)symbol, (void)version, (void)flags;
  *fn = NULL;
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaErrorNotSupported;
}
