// C++17: device buffers owned by std::unique_ptr, each freed to the stream it was allocated
// on. Built against an installed tensoralloc, with CMake (CMakeLists.txt) or pkg-config
// (Makefile); see "Installing" in the README.
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include <tensoralloc.h>

#include "cuda_shim.h"

// Frees a tensoralloc block to the device and stream it came from.
struct FreeOnStream {
    size_t size;
    int device;
    CUstream stream;
    void operator()(void *p) const { tensoralloc_free(p, size, device, stream); }
};

using DeviceBuffer = std::unique_ptr<void, FreeOnStream>;

DeviceBuffer device_alloc(size_t size, int device, CUstream stream) {
    void *p = tensoralloc_malloc(size, device, stream);
    if (!p) {
        std::fprintf(stderr, "tensoralloc_malloc: %s\n", tensoralloc_last_error());
        throw std::bad_alloc();
    }
    return DeviceBuffer(p, FreeOnStream{size, device, stream});
}

static long long allocations_now() {
    tensoralloc_device_stats s;
    if (tensoralloc_get_device_stats(0, &s) != TENSORALLOC_OK) return -1;
    return (long long)s.allocation[TENSORALLOC_STAT_AGGREGATE].current;
}

int main() {
    std::printf("tensoralloc %s\n", tensoralloc_version());
    cuda_start();
    CUstream streams[2];
    for (CUstream &s : streams) CU(cuStreamCreate(&s, 0));
    {
        std::vector<DeviceBuffer> buffers;
        for (int i = 0; i < 8; i++) {
            CUstream s = streams[i % 2];
            buffers.push_back(device_alloc(size_t(1) << (10 + i), 0, s));
            CU(cuMemsetD8Async(dptr(buffers.back().get()), (unsigned char)i, size_t(1) << (10 + i), s));
        }
        unsigned char last = 0;
        FreeOnStream &d = buffers.back().get_deleter();
        CU(cuMemcpyDtoHAsync(&last, dptr(buffers.back().get()), 1, d.stream));
        CU(cuStreamSynchronize(d.stream));
        std::printf("8 buffers on 2 streams, %lld live allocations, last buffer holds %d\n", allocations_now(),
                    last);
        if (allocations_now() != 8 || last != 7) {
            std::fprintf(stderr, "expected 8 live allocations and a last buffer holding 7\n");
            return 1;
        }
    } // every buffer is freed here, to its own stream
    std::printf("after scope: %lld live allocations\n", allocations_now());
    if (allocations_now() != 0) {
        std::fprintf(stderr, "the buffers were not freed\n");
        return 1;
    }
    tensoralloc_empty_cache();
    for (CUstream s : streams) CU(cuStreamDestroy(s));
    return 0;
}
