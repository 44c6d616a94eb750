// A CUDA program for libtensoralloc_preload.so on a real GPU. Built twice by run.sh (static
// and shared CUDA runtime) and run with the preload. Exits 0 when every check passes; prints
// one line per check.
//
// 1. Data: many buffers from cudaMalloc / cudaMallocAsync / cudaMallocHost, filled and checked
//    by kernels (a mismatch counter on the device must stay 0) while buffers are freed and
//    allocated again, on several streams.
// 2. cudaFree reuse: a kernel on another stream (non-blocking, blocking, and the legacy default
//    stream) spins for a while and then writes its whole buffer; the host frees that buffer at
//    once and allocates the same size again and again. No block handed out while the kernel
//    still runs may overlap its buffer, and the data written into the new blocks must survive
//    the kernel's late writes.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                        \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,             \
                         cudaGetErrorString(e_));                                          \
            std::exit(1);                                                                  \
        }                                                                                  \
    } while (0)

static int failures = 0;

static void report(const char *what, bool ok) {
    std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failures++;
}

__device__ __forceinline__ uint32_t pattern(uint32_t tag, size_t i) {
    return tag * 2654435761u ^ (uint32_t)i;
}

__global__ void fill(uint32_t *p, size_t n, uint32_t tag) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = pattern(tag, i);
}

__global__ void verify(const uint32_t *p, size_t n, uint32_t tag, unsigned long long *bad) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        if (p[i] != pattern(tag, i)) atomicAdd(bad, 1ull);
}

// Spins for about `cycles` clock cycles, then writes the whole buffer.
__global__ void late_writer(uint32_t *p, size_t n, long long cycles, uint32_t value) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = value;
}

static unsigned long long *bad_counter;

static unsigned long long read_bad() {
    unsigned long long bad = 0;
    CHECK(cudaMemcpy(&bad, bad_counter, sizeof bad, cudaMemcpyDeviceToHost));
    CHECK(cudaMemset(bad_counter, 0, sizeof bad));
    return bad;
}

static void data_checks() {
    cudaStream_t streams[3];
    CHECK(cudaStreamCreateWithFlags(&streams[0], cudaStreamNonBlocking));
    CHECK(cudaStreamCreate(&streams[1]));
    streams[2] = 0;
    const int n = 48;
    std::vector<uint32_t *> bufs(n, nullptr);
    std::vector<size_t> lens(n, 0);
    std::vector<uint32_t> tags(n, 0);
    uint32_t tag = 1;
    for (int round = 0; round < 40; round++) {
        for (int i = 0; i < n; i++) {
            if (bufs[i] && (i + round) % 3 == 0) {
                CHECK(cudaFree(bufs[i]));
                bufs[i] = nullptr;
            }
            if (!bufs[i]) {
                lens[i] = (size_t)(1 + (i * 7919 + round * 104729) % 3000) * 1024 / 4;
                tags[i] = tag++;
                CHECK(cudaMalloc((void **)&bufs[i], lens[i] * 4));
                fill<<<64, 256, 0, streams[i % 3]>>>(bufs[i], lens[i], tags[i]);
            }
        }
        for (int i = 0; i < n; i++)
            verify<<<64, 256, 0, streams[(i + 1) % 3]>>>(bufs[i], lens[i], tags[i], bad_counter);
        CHECK(cudaDeviceSynchronize());
    }
    report("cudaMalloc blocks keep their data across frees and reuse", read_bad() == 0);
    for (int i = 0; i < n; i++) CHECK(cudaFree(bufs[i]));

    // Stream-ordered: allocate, fill, check and free on a stream, many times.
    for (int round = 0; round < 200; round++) {
        cudaStream_t s = streams[round % 2];
        uint32_t *a, *b;
        size_t len = (size_t)(1 + round % 17) * 65536;
        CHECK(cudaMallocAsync((void **)&a, len * 4, s));
        CHECK(cudaMallocAsync((void **)&b, len * 4, s));
        fill<<<64, 256, 0, s>>>(a, len, 1000 + round);
        fill<<<64, 256, 0, s>>>(b, len, 5000 + round);
        verify<<<64, 256, 0, s>>>(a, len, 1000 + round, bad_counter);
        CHECK(cudaFreeAsync(a, s));
        verify<<<64, 256, 0, s>>>(b, len, 5000 + round, bad_counter);
        CHECK(cudaFreeAsync(b, s));
    }
    CHECK(cudaDeviceSynchronize());
    report("cudaMallocAsync/cudaFreeAsync keep stream order", read_bad() == 0);

    // Pinned host memory: a round trip through the device.
    for (int round = 0; round < 50; round++) {
        size_t len = (size_t)(1 + round % 9) * 4096;
        uint32_t *h, *d;
        CHECK(cudaMallocHost((void **)&h, len * 4));
        CHECK(cudaMalloc((void **)&d, len * 4));
        fill<<<32, 256, 0, streams[0]>>>(d, len, 9000 + round);
        CHECK(cudaMemcpyAsync(h, d, len * 4, cudaMemcpyDeviceToHost, streams[0]));
        CHECK(cudaStreamSynchronize(streams[0]));
        bool same = true;
        for (size_t i = 0; i < len; i++)
            if (h[i] != ((9000u + round) * 2654435761u ^ (uint32_t)i)) same = false;
        if (!same) failures++;
        CHECK(cudaFreeHost(h));
        CHECK(cudaFree(d));
    }
    report("cudaMallocHost buffers round-trip through the device", failures == 0);

    size_t free_mem = 0, total = 0;
    CHECK(cudaMemGetInfo(&free_mem, &total));
    report("cudaMemGetInfo: free <= total", free_mem <= total && free_mem > 0);
    CHECK(cudaStreamDestroy(streams[0]));
    CHECK(cudaStreamDestroy(streams[1]));
}

// The kernel on `s` writes `buf` late; meanwhile the host frees it and allocates again.
static void reuse_under_running_kernel(cudaStream_t s, const char *what, long long cycles) {
    const size_t len = (8u << 20) / 4;  // 8 MiB
    uint32_t *buf;
    CHECK(cudaMalloc((void **)&buf, len * 4));
    CHECK(cudaDeviceSynchronize());
    late_writer<<<132, 256, 0, s>>>(buf, len, cycles, 0xdeadbeefu);
    CHECK(cudaFree(buf));  // synchronous for the caller: buf may not be reused until the kernel ends

    cudaStream_t other;
    CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    std::vector<uint32_t *> taken;
    bool overlapped_while_running = false;
    int allocated_while_running = 0;
    for (int i = 0; i < 400; i++) {
        uint32_t *q;
        CHECK(cudaMalloc((void **)&q, len * 4));
        bool running = cudaStreamQuery(s) == cudaErrorNotReady;
        bool overlaps = (uintptr_t)q < (uintptr_t)(buf + len) && (uintptr_t)buf < (uintptr_t)(q + len);
        if (running) {
            allocated_while_running++;
            if (overlaps) overlapped_while_running = true;
        }
        fill<<<64, 256, 0, other>>>(q, len, 77 + i);
        taken.push_back(q);
        if (i % 2 == 1) {
            // Free every other block at once so the allocator has blocks to reuse.
            CHECK(cudaFree(taken[i - 1]));
            taken[i - 1] = nullptr;
        }
    }
    CHECK(cudaStreamSynchronize(other));
    CHECK(cudaDeviceSynchronize());  // the late writer has finished now
    for (size_t i = 0; i < taken.size(); i++)
        if (taken[i]) verify<<<64, 256>>>(taken[i], len, 77 + (uint32_t)i, bad_counter);
    CHECK(cudaDeviceSynchronize());
    unsigned long long bad = read_bad();
    std::printf("      %s: %d allocations while the kernel ran\n", what, allocated_while_running);
    char line[200];
    std::snprintf(line, sizeof line, "%s: no block handed out under the running kernel", what);
    report(line, !overlapped_while_running);
    std::snprintf(line, sizeof line, "%s: blocks allocated after the free keep their data", what);
    report(line, bad == 0);
    for (uint32_t *q : taken)
        if (q) CHECK(cudaFree(q));
    CHECK(cudaStreamDestroy(other));
}

int main() {
    int dev = 0;
    CHECK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));
    CHECK(cudaMalloc((void **)&bad_counter, sizeof(unsigned long long)));
    CHECK(cudaMemset(bad_counter, 0, sizeof(unsigned long long)));
    std::printf("device: %s\n", prop.name);

    data_checks();

    // About half a second of spinning at the GPU's clock rate (clockRate is in kHz).
    int clock_khz = 0;
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
    long long cycles = (long long)clock_khz * 500;

    cudaStream_t nonblocking, blocking;
    CHECK(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
    CHECK(cudaStreamCreate(&blocking));
    reuse_under_running_kernel(nonblocking, "non-blocking stream", cycles);
    reuse_under_running_kernel(blocking, "blocking stream", cycles);
    reuse_under_running_kernel(0, "legacy default stream", cycles);
    CHECK(cudaStreamDestroy(nonblocking));
    CHECK(cudaStreamDestroy(blocking));

    CHECK(cudaFree(bad_counter));
    std::printf("%s\n", failures ? "FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
