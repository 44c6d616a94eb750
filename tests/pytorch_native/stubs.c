// Runtime functions libc10_cuda.so links against but the allocator replay never needs:
// each reports "not supported" (and says so once) instead of pretending to work.
#include <stdio.h>
#define UNSUPPORTED(name)                                                  \
  int name(void) {                                                         \
    static int said;                                                       \
    if (!said++) fprintf(stderr, "stand-in cudart: %s unsupported\n", #name); \
    return 801;                                                            \
  }
UNSUPPORTED(cudaDeviceCanAccessPeer)
UNSUPPORTED(cudaDeviceEnablePeerAccess)
UNSUPPORTED(cudaDeviceGetDefaultMemPool)
UNSUPPORTED(cudaEventElapsedTime)
UNSUPPORTED(cudaFreeAsync)
UNSUPPORTED(cudaGraphNodeGetDependencies)
UNSUPPORTED(cudaIpcCloseMemHandle)
UNSUPPORTED(cudaIpcGetMemHandle)
UNSUPPORTED(cudaIpcOpenMemHandle)
UNSUPPORTED(cudaMallocAsync)
UNSUPPORTED(cudaMemPoolGetAttribute)
UNSUPPORTED(cudaMemPoolSetAccess)
UNSUPPORTED(cudaMemPoolSetAttribute)
UNSUPPORTED(cudaMemPoolTrimTo)
UNSUPPORTED(cudaMemcpy)
UNSUPPORTED(cudaMemcpyAsync)
UNSUPPORTED(cudaMemcpyPeerAsync)
UNSUPPORTED(cudaStreamCreateWithPriority)
UNSUPPORTED(cudaStreamGetCaptureInfo)
